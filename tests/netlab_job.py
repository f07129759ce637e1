"""What the multi-node tests run inside a lab (tests/netlab.py): ``unshare --net python
netlab_job.py SCENARIO FOLDER [options]``. Prints one JSON object, its last line, for the test
to check.

- ``train``: GPT-2 debug trained for a few steps under each strategy on workers of two nodes,
  beside the same steps in one process; what tilegraph saw of the cluster (hosts, shared
  memory, the link speed it measured) and the bytes each step moved over the cables.
- ``partition``: a data-parallel fit whose second node's cable is unplugged after a few steps:
  how it ends, and how long after the cut.
- ``cli``: ``tilegraph train`` (the README's main job) on a cluster of two nodes over TLS (the
  PEM files in ``--tls-dir``), named by its scheduler file, then ``--resume``d there from its
  middle checkpoint; beside it the same job on one embedded worker, in this namespace.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from netlab import Lab  # noqa: E402

import tilegraph as tg  # noqa: E402
from tilegraph import models  # noqa: E402

SEQ = 16
BATCH = 4


def _batches(steps: int, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, vocab, (BATCH, SEQ + 1))
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


def _step(runtime, strategy: str | None):
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=1.0)
    kw = {} if strategy is None else {"parallel": strategy}
    return model, tg.TrainStep(model, opt, _loss, runtime=runtime, batch_tiles=[(2, None), (2, None)], **kw)


def _connect(lab: Lab, workers: int):
    lab.start_scheduler()
    for k in range(1, workers + 1):
        lab.start_worker(k)
    rt = tg.connect(scheduler_file=str(lab.scheduler_file), timeout=30, make_current=False)
    rt.client.wait_for_workers(workers, timeout=90)
    return rt


def train(args) -> dict:
    vocab = models.config("gpt2-debug").vocab_size
    batches = _batches(args.steps, vocab)
    _, local = _step(None, None)
    want = [float(local(*b)) for b in batches]
    out = {"reference": want, "strategies": {}}
    with Lab(2, rate=args.rate, folder=args.folder) as lab:
        rt = _connect(lab, 2)
        domains = rt.shm_domains(rt.workers())
        out["workers"] = sorted(rt.workers())
        out["spans_hosts"] = rt.spans_hosts()
        out["shm_domains"] = len(set(domains.values()))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out["link_bytes_per_second"] = rt.link_bytes_per_second()
        out["warnings"] = [str(w.message) for w in caught]
        for strategy in args.strategies.split(","):
            _, step = _step(rt, strategy)
            exe = step.plan(*batches[0])
            before = lab.bytes_moved()
            t0 = time.perf_counter()
            got = [float(step(*b)) for b in batches]
            seconds = time.perf_counter() - t0
            out["strategies"][strategy] = {
                "losses": got, "strategy": exe.strategy, "replicas": exe.n_replicas,
                "bytes_per_step": (lab.bytes_moved() - before) / len(batches), "seconds": seconds}
        rt.close()
    return out


def partition(args) -> dict:
    vocab = models.config("gpt2-debug").vocab_size

    def data(step):  # the same batch for a step run again after a restart
        ids = np.random.default_rng(step).integers(0, vocab, (BATCH, SEQ + 1))
        return ids[:, :-1], ids[:, 1:]

    out = {}
    if args.restart:  # the uninterrupted run, in this process
        model = models.build("gpt2-debug", seed=0)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
        out["reference"] = tg.Trainer(model, opt, data, loss_fn=_loss, progress=False,
                                      steps_per_graph=1).fit(args.steps).losses
        restart = {"restart_on_failure": True, "checkpoint_dir": str(Path(args.folder) / "ck"),
                   "checkpoint_every": 2}
    else:
        restart = {}
    with Lab(2, rate=args.rate, folder=args.folder) as lab:
        rt = _connect(lab, 2)
        model = models.build("gpt2-debug", seed=0)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
        cut, seen = {}, []

        def hook(trainer, stats):  # (a graph of several steps has run all of them when the first is logged)
            seen.append(stats)
            if len(seen) == args.cut_after and not cut:
                cut["at"] = time.perf_counter()
                lab.cut(2)

        trainer = tg.Trainer(model, opt, data, runtime=rt, loss_fn=_loss, parallel="data",
                             on_step=[hook], progress=False, step_timeout=args.step_timeout,
                             steps_per_graph=1, **restart)
        try:
            result = trainer.fit(args.steps)
            out["ended"] = "finished"
            out["losses"], out["restarts"] = result.losses, result.restarts
        except BaseException as e:  # what the user sees is what the test checks
            out["ended"] = type(e).__name__
            out["message"] = str(e)
        out["seconds_after_cut"] = time.perf_counter() - cut["at"] if cut else None
        out["step_count"] = opt.step_count
        try:
            rt.close()
        except Exception as e:  # pragma: no cover - reported, not hidden
            out["close"] = f"{type(e).__name__}: {e}"
    return out


def _train_cli(folder: Path, *flags: str) -> list[dict]:
    """``tilegraph train`` run from ``folder`` with ``flags``; its metrics records."""
    cmd = [sys.executable, "-m", "tilegraph.cli", "train", "--no-progress", "--out", "run", *flags]
    proc = subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]


def cli(args) -> dict:
    folder = Path(args.folder)
    tls = {k: str(Path(args.tls_dir) / f) for k, f in (("tls_ca_file", "ca.pem"), ("tls_cert", "cert.pem"),
                                                      ("tls_key", "key.pem"))}
    steps = ["--steps", str(args.steps), "--set", f"output.checkpoint_every={args.steps // 2}"]
    out = {}
    with Lab(2, rate=args.rate, folder=folder, tls=tls) as lab:
        one = folder / "one"  # (the embedded cluster needs the namespace's loopback, which the lab brings up)
        one.mkdir()
        out["one"] = [r["loss"] for r in _train_cli(one, *steps, "--set", "runtime.workers=1") if "loss" in r]
        lab.start_scheduler()
        for k in (1, 2):
            lab.start_worker(k)
        out["address"] = json.loads(lab.scheduler_file.read_text())["address"]
        two = folder / "two"
        two.mkdir()
        on_lab = ["--set", f"runtime.scheduler_file={lab.scheduler_file}", "--set", "runtime.connect_timeout=60",
                  "--tls-ca-file", tls["tls_ca_file"], "--tls-cert", tls["tls_cert"], "--tls-key", tls["tls_key"]]
        before = lab.bytes_moved()
        first = [r for r in _train_cli(two, *steps, *on_lab) if "loss" in r]
        middle = two / "run" / "checkpoints" / f"step-{args.steps // 2:06d}"
        out["checkpoints"] = sorted(p.name for p in (two / "run" / "checkpoints").iterdir())
        resumed = [r for r in _train_cli(two, "--resume", str(middle), *on_lab) if "loss" in r][len(first):]
        out["bytes"] = lab.bytes_moved() - before
    out["two"] = [r["loss"] for r in first]
    out["resumed"] = {r["step"]: r["loss"] for r in resumed}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "partition", "cli"])
    parser.add_argument("folder")
    parser.add_argument("--rate", default=None, help="each cable's rate both ways (tc's units: 1gbit)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", default="tiles,data,sharded,zero3")
    parser.add_argument("--cut-after", type=int, default=3)
    parser.add_argument("--step-timeout", default="auto")
    parser.add_argument("--restart", action="store_true", help="restart_on_failure, from checkpoints every 2 steps")
    parser.add_argument("--tls-dir", default=None, help="cli: the folder of ca.pem, cert.pem and key.pem")
    args = parser.parse_args()
    if args.step_timeout != "auto":
        args.step_timeout = float(args.step_timeout)
    result = {"train": train, "partition": partition, "cli": cli}[args.scenario](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
