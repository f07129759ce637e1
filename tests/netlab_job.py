"""What the multi-node tests run inside a lab (tests/netlab.py): ``unshare --net python
netlab_job.py SCENARIO FOLDER [options]``. Prints one JSON object, its last line, for the test
to check.

- ``train``: GPT-2 debug trained for a few steps under each strategy on workers of two nodes,
  beside the same steps in one process; what tilegraph saw of the cluster (hosts, shared
  memory, the link speed it measured) and the bytes each step moved over the cables.
- ``partition``: a data-parallel fit whose second node's cable is unplugged after a few steps:
  how it ends, and how long after the cut.
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "partition"])
    parser.add_argument("folder")
    parser.add_argument("--rate", default=None, help="each cable's rate both ways (tc's units: 1gbit)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", default="tiles,data,sharded,zero3")
    parser.add_argument("--cut-after", type=int, default=3)
    parser.add_argument("--step-timeout", default="auto")
    parser.add_argument("--restart", action="store_true", help="restart_on_failure, from checkpoints every 2 steps")
    args = parser.parse_args()
    if args.step_timeout != "auto":
        args.step_timeout = float(args.step_timeout)
    result = {"train": train, "partition": partition}[args.scenario](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
