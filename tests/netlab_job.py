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
- ``tls``: a cluster started by hand over TLS (the PEM files in ``--tls-dir``: ``dask scheduler``
  and a ``dask worker`` per node with ``--tls-*``), a ``tg.Trainer`` fit under each strategy
  beside the same fit in one process, and what crossed the cable between the two nodes (a
  packet capture on node 1's cable, from before the nodes' workers first met: :class:`Sniffer`).
- ``tls-errors``: what a cluster user gets wrong against a TLS scheduler on the lab (the PEM files
  of ``--tls-dir``'s folders ``good``, ``stranger`` (another CA's), ``expired`` (signed by good's
  CA) and ``foreign`` (good's CA file, a certificate of stranger's CA)): how each attempt to
  connect ends and how long it took; and a ``dask worker`` started without TLS flags.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import subprocess
import sys
import threading
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


def _pem(folder: Path) -> dict[str, str]:
    """connect's TLS arguments: the PEM files ca.pem, cert.pem and key.pem in ``folder``."""
    names = (("tls_ca_file", "ca.pem"), ("tls_cert", "cert.pem"), ("tls_key", "key.pem"))
    return {k: str(folder / f) for k, f in names}


def cli(args) -> dict:
    folder = Path(args.folder)
    tls = _pem(Path(args.tls_dir))
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


class Sniffer:
    """What crosses one network device between two addresses, captured with a packet socket
    (``AF_PACKET``; root, as the lab is): the TCP payload bytes between ``a`` and ``b`` either
    way, the first payload bytes of each connection, and whether ``marker`` appeared in a
    payload. Over TLS every connection opens with a handshake record (``16 03``) and no plain
    Dask message (whose operation names, ``marker``, travel as text) shows on the wire."""

    def __init__(self, device: str, a: str, b: str, marker: bytes):
        self.hosts, self.marker = {socket.inet_aton(a), socket.inet_aton(b)}, marker
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))  # ETH_P_ALL
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self.sock.bind((device, 0))
        self.sock.settimeout(0.2)
        self.bytes, self.first, self.marker_seen = 0, {}, False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Sniffer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame = self.sock.recv(1 << 17)  # (offloads hand over segments of up to 64 KiB)
            except (TimeoutError, socket.timeout):
                continue
            self._take(frame)

    def _take(self, frame: bytes) -> None:
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4, TCP
            return
        src, dst = frame[26:30], frame[30:34]
        if {src, dst} != self.hosts:
            return
        ip_header = (frame[14] & 0x0F) * 4
        total = struct.unpack("!H", frame[16:18])[0]
        tcp = 14 + ip_header
        payload = frame[tcp + (frame[tcp + 12] >> 4) * 4:14 + total]
        if not payload:
            return
        self.bytes += len(payload)
        flow = (src, frame[tcp:tcp + 2], dst, frame[tcp + 2:tcp + 4])
        self.first.setdefault(flow, payload[:2].hex())
        self.marker_seen = self.marker_seen or self.marker in payload

    def report(self) -> dict:
        return {"bytes": self.bytes, "flows": len(self.first), "first_bytes": sorted(set(self.first.values())),
                "marker_seen": self.marker_seen}


def tls(args) -> dict:
    """A cluster of two nodes started by hand over TLS (without ``--tls-dir``: over tcp://, the
    capture's control), trained on under each strategy with ``tg.Trainer``: its losses beside
    one process's, and what crossed between the nodes."""
    folder = Path(args.folder)
    files = _pem(Path(args.tls_dir)) if args.tls_dir else {}
    vocab = models.config("gpt2-debug").vocab_size

    def data(step):
        ids = np.random.default_rng(step).integers(0, vocab, (BATCH, SEQ + 1))
        return ids[:, :-1], ids[:, 1:]

    def fit(runtime, **kw):
        model = models.build("gpt2-debug", seed=0)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=1.0)
        return tg.Trainer(model, opt, data, runtime=runtime, loss_fn=_loss, progress=False, steps_per_graph=1,
                          **kw).fit(args.steps).losses

    out = {"reference": fit(None), "strategies": {}}
    with Lab(2, rate=args.rate, folder=folder, tls=files or None) as lab:
        lab.start_scheduler()
        for k in (1, 2):
            lab.start_worker(k)
        rt = tg.connect(scheduler_file=str(lab.scheduler_file), timeout=30, make_current=False, **files)
        rt.client.wait_for_workers(2, timeout=90)
        out["scheduler"] = rt.client.scheduler.address
        out["workers"] = sorted(rt.workers())
        # captured from before the workers first meet (the link's measure, which the first plan
        # across hosts makes otherwise: 3 x 32 MB), so every connection between them opens in it
        with Sniffer(lab.cable(1), lab.address(1), lab.address(2), b"tilegraph_channel") as sniffer:
            out["link_bytes_per_second"] = rt.link_bytes_per_second()
            for strategy in args.strategies.split(","):
                before = sniffer.bytes
                losses = fit(rt, parallel=strategy)
                out["strategies"][strategy] = {"losses": losses, "bytes": sniffer.bytes - before}
        out["capture"] = sniffer.report()
        rt.close()
    return out


def _attempt(**kw) -> dict:
    """How ``tg.connect(**kw)`` ends: its error's type and message, and the seconds it took."""
    t0 = time.monotonic()
    try:
        tg.connect(make_current=False, **kw).close()
        ended, message = "connected", ""
    except Exception as e:  # what the user sees is what the test checks
        ended, message = type(e).__name__, str(e)
    return {"ended": ended, "message": message, "seconds": time.monotonic() - t0}


def tls_errors(args) -> dict:
    certs = {name: _pem(Path(args.tls_dir) / name) for name in ("good", "stranger", "expired", "foreign")}
    good = certs["good"]
    out = {}
    with Lab(2, folder=args.folder, tls=good) as lab:
        lab.start_scheduler()
        lab.start_worker(1)
        address = json.loads(lab.scheduler_file.read_text())["address"]
        out["address"] = address
        by_file = {"scheduler_file": str(lab.scheduler_file), "timeout": args.connect_timeout}
        out["attempts"] = {
            "no certificates, scheduler file": _attempt(**by_file),
            "no certificates, tcp:// address": _attempt(address=address.replace("tls://", "tcp://"),
                                                        timeout=args.connect_timeout),
            "no certificates, HOST:PORT": _attempt(address=address.removeprefix("tls://"),
                                                   timeout=args.connect_timeout),
            "another CA": _attempt(**by_file, **certs["stranger"]),
            "a client certificate of another CA": _attempt(**by_file, **certs["foreign"]),
            "a key of another certificate": _attempt(**by_file, **{**good, "tls_key": certs["stranger"]["tls_key"]}),
            "an expired certificate": _attempt(**by_file, **certs["expired"]),
            "the right certificates": _attempt(**by_file, **good),
        }
        out["workers"] = {}
        for label, dial in (("tls://", address), ("tcp://", address.replace("tls://", "tcp://"))):
            t0 = time.monotonic()  # a worker on node 2 started without the --tls-* flags
            proc = subprocess.run(["ip", "netns", "exec", lab.names[1], sys.executable, "-m",
                                   "distributed.cli.dask_worker", dial, "--host", lab.address(2), "--nthreads", "1",
                                   "--no-dashboard"],
                                  capture_output=True, text=True, timeout=args.connect_timeout + 90)
            out["workers"][label] = {"rc": proc.returncode, "seconds": time.monotonic() - t0,
                                     "output": (proc.stdout + proc.stderr)[-6000:]}
        rt = tg.connect(**by_file, **good)
        out["joined"] = sorted(rt.workers())
        rt.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["train", "partition", "cli", "tls", "tls-errors"])
    parser.add_argument("folder")
    parser.add_argument("--rate", default=None, help="each cable's rate both ways (tc's units: 1gbit)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--strategies", default="tiles,data,sharded,zero3")
    parser.add_argument("--cut-after", type=int, default=3)
    parser.add_argument("--step-timeout", default="auto")
    parser.add_argument("--restart", action="store_true", help="restart_on_failure, from checkpoints every 2 steps")
    parser.add_argument("--tls-dir", default=None, help="cli, tls: the folder of ca.pem, cert.pem and key.pem "
                        "(tls-errors: of such folders)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="tls-errors: connect's timeout")
    args = parser.parse_args()
    if args.step_timeout != "auto":
        args.step_timeout = float(args.step_timeout)
    scenarios = {"train": train, "partition": partition, "cli": cli, "tls": tls, "tls-errors": tls_errors}
    result = scenarios[args.scenario](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
