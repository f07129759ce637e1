"""Scaling over worker processes: tokens/s of tilegraph's parallel strategies beside PyTorch's.

For the block stack of ``bench_train.py`` and for GPT-2 (``bench_gpt2.py``'s models), trains with
tilegraph on the embedded Dask cluster in the configurations 1 x T, 2 x T/2, 4 x T/4 ... (worker
processes x threads each, T = ``--threads-total``, default: the cores), each with every strategy of
``--strategies`` (``TrainStep(parallel=...)``; one row for a single worker), and prints per row:

- ``strategy``: the one asked for; ``used``: the plan's (``step.plan(*batch).strategy``);
  ``exch``: how its worker processes exchange values (``tg.config.exchange``, ``--exchange``):
  ``gang`` (one task per process per step, values through shared-memory channels), ``gang-comm``
  (the same, values over the workers' comms, as between hosts or with ``--no-shm``) or ``tasks``
  (Dask tasks; through shared memory where they can, unless ``--no-shm``);
  ``auto``: what ``parallel="auto"`` picks in that configuration (its plan is built, not run);
- ``tok/s``: tokens of the timed steps / their wall time, from an idle cluster until it is idle
  again (steps submitted as ``tg.Trainer`` does them: step i+1 before waiting for step i);
- ``outside`` = 1 - (kernel seconds summed over workers) / (wall seconds x worker processes x threads):
  idle threads, Dask scheduling, transfers and the Python runner all count as outside;
- ``dask_CPU``: CPU seconds of the workers' own Dask threads (the event loop, which sends and
  receives every transfer, and the deserialisation thread) / (wall seconds x worker processes x
  threads): the part of ``outside`` that is not idle, measured per thread (``/proc``, psutil);
  each worker's tile-kernel threads do not count;
- ``MB/step``: bytes moved between worker processes per step, estimated from the plan: for every
  task (cluster), the bytes of its external inputs made by a task on another worker process, each
  value counted once per process that reads it (Dask fetches it once per worker), and the new
  parameters of a sharded plan, which their owner sends to every other process (zero3: which the
  next step's tasks fetch, twice with reshard_after_forward); other leaf inputs (optimizer state,
  the batch) count as not moved (``Executable.step_bytes``);
- ``peak_MiB``: the most resident memory one worker process held during the row (warmup and
  timed steps; Linux ``VmHWM``, reset before the row); it includes the freed memory a worker
  keeps for reuse (up to 1 GiB, README "Worker memory allocation");
- ``held_MiB``: the most memory Dask held at once on one worker during the timed steps (the task
  results in its memory, by Dask's own count, sampled every 5 ms): what a step's tasks keep
  alive, without the allocator's reserve or the values inside a running task;
- ``ratio`` = tok/s / (tok/s of PyTorch eager in one process with the same total threads,
  ``torch.set_num_threads``), measured in the same run; the eager row itself is printed too
  (strategy ``torch``);
- for the block stack also PyTorch DDP (strategy ``torch-DDP``): P processes x T/P threads each
  (torch.multiprocessing, gloo over 127.0.0.1), each training its share of the same global batch
  with ``DistributedDataParallel``; tok/s of the global batch over a few steps after warmup. Its
  ``MB/step`` is that of a ring all-reduce of the gradients, 2 (P - 1) x gradient bytes in all.
  Compare tilegraph's ``2x1`` rows with DDP's ``2x1``.

Every configuration runs in an embedded cluster of its own, closed after it; every strategy on a
model built afresh (same seed). With ``--mpi`` every configuration of several workers also runs on
a cluster launched by MPI (``mpiexec -n W+2``: the scheduler, the timing script and W worker ranks,
as ``tilegraph train --mpi`` launches it; launch ``mpi``), and a line compares it with the embedded
cluster of the same shape. With ``--lab RATE`` every configuration of several workers also runs with
each worker on a node of its own (launch ``lab``): a network namespace with its own address and
``/dev/shm``, its cable limited to RATE both ways (``1gbit``, ``10gbit``; ``none``: as fast as the
kernel copies), as tests/netlab.py makes them (needs root, ``unshare``, ``ip`` and ``tc``); a line
compares it with the embedded cluster of the same shape, where the workers share memory.

    python bench/bench_scale.py                                  # blocks and GPT-2 6x768, tiles/data/sharded
    python bench/bench_scale.py --models gpt2 --gpt2-flavor debug --steps 5
    python bench/bench_scale.py --configs 1x2,2x1 --strategies tiles,data --width 256 --layers 2
    python bench/bench_scale.py --configs 2x1 --strategies data --mpi --no-ddp   # MPI vs embedded
    python bench/bench_scale.py --configs 2x1 --strategies data,sharded --lab 1gbit --no-ddp   # two nodes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

from _common import at_least, require, timed_steps
from bench_gpt2 import DEFAULT_SEQ, batches, flavor_config, pick_tiling
from bench_gpt2 import time_torch as time_torch_gpt2
from bench_train import build_tilegraph, build_torch
from bench_train import time_torch as time_torch_blocks

MODELS = ("blocks", "gpt2")
GPT2_FLAVORS = ("debug", "6x768", "gpt2")


# -- tilegraph ----------------------------------------------------------------------------------
class Workload:
    """One model of the benchmark: how to build it fresh, its loss, batches and tiles."""

    def __init__(self, name, tokens, build, loss_fn, make_batches, batch_tiles, opt_kwargs):
        self.name, self.tokens, self.build, self.loss_fn = name, tokens, build, loss_fn
        self.make_batches, self.batch_tiles, self.opt_kwargs = make_batches, batch_tiles, opt_kwargs


def blocks_workload(args, tg, workers, threads) -> Workload:
    ns = block_args(args)
    rng = np.random.default_rng(0)  # the data of bench_train.py
    x = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    y = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    tiles = (max(1, args.batch // (workers * threads)), None, None)

    def loss_fn(m, x, y):
        diff = m(x) - y
        return (diff * diff).mean()

    return Workload("blocks", args.batch * args.seq, lambda: build_tilegraph("blocks", ns, tg), loss_fn,
                    lambda n: [(x, y)] * n, [tiles, tiles], {"lr": 1e-4, "weight_decay": 0.0})


def gpt2_workload(args, tg, workers, threads) -> Workload:
    from tilegraph import models

    ns = gpt2_args(args, workers, threads)
    cfg = flavor_config(args.gpt2_flavor)
    seq = gpt2_seq(args, cfg)
    tiling = pick_tiling(cfg, ns, args.batch, seq)
    if workers > 1 and (tiling.batch or args.batch) * workers > args.batch:
        # a share of the batch per worker process (the data and sharded plans need one), however
        # small the tiles: the small models' rows are about those strategies' overhead
        tiling = dataclasses.replace(tiling, batch=max(1, args.batch // workers))

    def loss_fn(m, ids, targets):
        return tg.cross_entropy(m(ids), targets)

    tiles = (tiling.batch, tiling.seq)
    return Workload(f"gpt2-{args.gpt2_flavor}", args.batch * seq, lambda: models.build(cfg, tiling, seed=ns.seed),
                    loss_fn, lambda n: batches(cfg, ns, args.batch, seq, n), [tiles, tiles],
                    {"lr": ns.lr, "weight_decay": ns.weight_decay})


def dask_thread_cpu() -> float:
    """CPU seconds (user + system) of this worker's threads that run no tile kernel: the event
    loop, the offload thread and the rest of Dask's own (run on a worker)."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    compute = ("Dask-Default-Threads", "tilegraph-kernel")
    return sum(t.user_time + t.system_time for t in psutil.Process().threads()
               if not any(c in names.get(t.id, "") for c in compute))


def start_held_sampler(dask_worker=None) -> bool:
    """Sample, every 5 ms until :func:`stop_held_sampler`, how many bytes of task results this
    worker holds (Dask's count, ``dask_worker.state.nbytes``), keeping the most (run on each worker)."""
    import threading

    stop, most = threading.Event(), [0]

    def sample():
        while not stop.wait(0.005):
            most[0] = max(most[0], dask_worker.state.nbytes)

    dask_worker._bench_held = (stop, most, threading.Thread(target=sample, daemon=True))
    dask_worker._bench_held[2].start()
    return True


def stop_held_sampler(dask_worker=None) -> int:
    """The most bytes :func:`start_held_sampler` saw held; stops it."""
    stop, most, thread = dask_worker._bench_held
    stop.set()
    thread.join()
    return most[0]


def wait_idle(rt, poll: float = 0.01) -> None:
    """Wait until the cluster runs no task: a step's loss comes back before its backward pass and
    update have finished."""
    while any(rt.client.processing().values()):
        time.sleep(poll)


def time_config(work_of, workers, threads, strategies, args, tg, runtime=None, launch="embedded") -> list[dict]:
    """Train with each strategy on one embedded cluster of ``workers`` x ``threads`` (or on
    ``runtime``, a cluster of that shape started otherwise: ``launch`` "mpi" or "lab")."""
    from tilegraph.runtime.worker_setup import peak_resident_bytes, reset_peak_resident

    rows = []
    with runtime or tg.connect(n_workers=workers, threads_per_worker=threads, dashboard=False, quiet=True) as rt:
        auto = None
        for strategy in strategies:
            w = work_of(workers, threads)
            reset = all(rt.client.run(reset_peak_resident).values())  # this row's peak, not the rows' before
            model = w.build()
            opt = tg.optim.AdamW(model.parameters(), **w.opt_kwargs)
            step = tg.TrainStep(model, opt, w.loss_fn, batch_tiles=w.batch_tiles, runtime=rt, parallel=strategy)
            data = w.make_batches(args.warmup + args.steps)
            t0 = time.perf_counter()
            step(*data[0])
            first_s = time.perf_counter() - t0
            for b in data[1:args.warmup]:
                step(*b)
            wait_idle(rt)
            rt.kernel_stats(reset=True)
            cpu0 = rt.client.run(dask_thread_cpu)
            rt.client.run(start_held_sampler)
            t0 = time.perf_counter()
            timed_steps(step, data[args.warmup:])
            wait_idle(rt)  # the last step's backward and update too, not only its loss
            wall = time.perf_counter() - t0
            held = max(rt.client.run(stop_held_sampler).values())
            dask_cpu = sum(rt.client.run(dask_thread_cpu).values()) - sum(cpu0.values())
            peaks = list(rt.client.run(peak_resident_bytes).values())
            peak = max(peaks) if reset and None not in peaks else None
            ks = rt.kernel_stats()
            exe = step.plan(*data[0])
            if auto is None:  # the plan "auto" makes here (recorded and planned, not run)
                auto = tg.TrainStep(model, opt, w.loss_fn, batch_tiles=w.batch_tiles, runtime=rt,
                                    parallel="auto").plan(*data[0]).strategy
            exchange = "tasks" if exe.n_replicas > 1 else "-"
            if exe.gang is not None:  # channels through shared memory, or over the workers' comms
                exchange = "gang" if all(all(spec.shared) for spec in exe.gang.specs) else "gang-comm"
            rows.append({"model": w.name, "config": f"{workers}x{threads}", "launch": launch, "strategy": strategy,
                         "used": exe.strategy, "exch": exchange, "auto": auto, "tok_s": w.tokens * args.steps / wall,
                         "outside": 1.0 - ks["kernel_seconds"] / (wall * workers * threads),
                         "dask_cpu": dask_cpu / (wall * workers * threads),
                         "moved": exe.step_bytes(), "step_s": wall / args.steps, "first_s": first_s,
                         "peak": peak, "held": held})
            del step, opt, model, exe
    return rows


# -- PyTorch DDP --------------------------------------------------------------------------------
def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n in ("lo", "lo0")), next((n for n in names if n.startswith("lo")), "lo"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_process(rank, procs, port, threads, args, results):
    """One DDP process: its share of the global batch of bench_train.py's block stack."""
    os.environ["GLOO_SOCKET_IFNAME"] = _loopback_interface()  # gloo's pairs on loopback too
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import tilegraph as tg

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs)
    model = opt = None
    try:
        ns = block_args(args)
        state = build_tilegraph("blocks", ns, tg).state_dict()  # the weights of the tilegraph runs
        # build_torch makes its tensors with ``torch.tensor``: here nn.Parameters, for DDP to find
        as_params = types.SimpleNamespace(
            nn=torch.nn, tensor=lambda v, requires_grad: torch.nn.Parameter(torch.tensor(v), requires_grad=requires_grad))
        forward, params = build_torch("blocks", state, ns, as_params)

        class Stack(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.params = torch.nn.ParameterList(params)

            def forward(self, x):
                return forward(x)

        model = DistributedDataParallel(Stack())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        rng = np.random.default_rng(0)  # the global batch of bench_train.py; this process's rows
        x = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
        y = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
        share = args.batch // procs
        xt = torch.from_numpy(x[rank * share:(rank + 1) * share])
        yt = torch.from_numpy(y[rank * share:(rank + 1) * share])

        def step():
            opt.zero_grad(set_to_none=True)
            loss = ((model(xt) - yt) ** 2).mean()
            loss.backward()  # DDP all-reduces (averages) the gradients in buckets during it
            opt.step()

        for _ in range(args.warmup):
            step()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        dist.barrier()
        wall = time.perf_counter() - t0
        if rank == 0:
            results.put(wall)
    finally:
        # DDP's reducer goes before its process group: destroyed after it, at interpreter exit,
        # it aborted the process now and then ("terminate called without an active exception")
        model = opt = None
        gc.collect()
        dist.destroy_process_group()


def time_ddp(procs, threads, args) -> float:
    """Wall seconds of ``args.steps`` DDP steps on ``procs`` processes x ``threads`` threads."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_ddp_process, args=(procs, _free_port(), threads, args, results), nprocs=procs, join=True)
    return results.get()


# -- MPI ----------------------------------------------------------------------------------------
def _mpiexec() -> str | None:
    here = Path(sys.executable).parent / "mpiexec"  # the mpi extra's (mpich) next to this Python
    return str(here) if here.exists() else shutil.which("mpiexec")


MPI_ROW = "bench_scale-mpi-row "


def time_mpi(kind, workers, threads, argv) -> list[dict]:
    """The rows of ``workers`` x ``threads`` on a cluster launched by MPI: ``mpiexec -n W+2`` runs
    this script again (rank 0 the scheduler, rank 1 the timing, the rest one worker each; dask-mpi
    gives each worker rank its share of the node's cores); its rows come back on stdout."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        raise RuntimeError("--mpi needs mpiexec: pip install -e '.[mpi]'")
    return child_rows([mpiexec, "-n", str(workers + 2), sys.executable, str(Path(__file__).resolve()), *argv,
                       "--models", kind, "--mpi-child", f"{workers}x{threads}"])


def child_rows(cmd: list[str]) -> list[dict]:
    """The rows this script printed when run again by ``cmd`` (under mpiexec, in a lab)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    rows = [json.loads(line[len(MPI_ROW):]) for line in proc.stdout.splitlines() if line.startswith(MPI_ROW)]
    if proc.returncode != 0 or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return rows


def mpi_child(args, kind, strategies, tg) -> None:
    """Under mpiexec: time the configuration on the MPI-launched cluster (rank 1 only returns
    from ``connect``) and print its rows for the launching process."""
    workers, threads = parse_configs(args.mpi_child, os.cpu_count() or 1)[0]
    rt = tg.connect(mpi=True, interface=_loopback_interface())
    got = {(k, v) for k, v in rt.processors().items() if v}
    if got != {("cpu", workers * threads)} or len(rt.workers()) != workers:
        raise SystemExit(f"bench_scale --mpi: asked {workers}x{threads}, the MPI cluster has "
                         f"{len(rt.workers())} workers and processors {rt.processors()}")
    make = blocks_workload if kind == "blocks" else gpt2_workload
    for r in time_config(lambda W, T: make(args, tg, W, T), workers, threads, strategies, args, tg, runtime=rt,
                         launch="mpi"):
        print(MPI_ROW + json.dumps(r), flush=True)


# -- nodes of a lab (tests/netlab.py) -------------------------------------------------------------
def _netlab():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import netlab

    return netlab


def time_lab(kind, workers, threads, argv, rate: str) -> list[dict]:
    """The rows of ``workers`` x ``threads`` with each worker on a node of its own: this script
    again, in a network namespace of its own (``unshare --net``); its rows come back on stdout."""
    return child_rows(["unshare", "--net", sys.executable, str(Path(__file__).resolve()), *argv, "--models", kind,
                       "--lab", rate, "--lab-child", f"{workers}x{threads}"])


def lab_child(args, kind, strategies, tg) -> None:
    """In the lab's namespace: a scheduler at the lab's address, one worker of ``threads``
    threads on each of ``workers`` nodes; time the configuration there and print its rows."""
    import psutil

    workers, threads = parse_configs(args.lab_child, os.cpu_count() or 1)[0]
    make = blocks_workload if kind == "blocks" else gpt2_workload
    memory = f"{psutil.virtual_memory().total // workers // 2**20}MiB"
    with tempfile.TemporaryDirectory(prefix="bench_scale_lab_") as folder, \
            _netlab().Lab(workers, rate=None if args.lab == "none" else args.lab, folder=folder) as lab:
        lab.start_scheduler()
        for k in range(1, workers + 1):
            lab.start_worker(k, nthreads=threads, memory_limit=memory)
        rt = tg.connect(scheduler_file=str(lab.scheduler_file), timeout=30, make_current=False, quiet=True)
        rt.client.wait_for_workers(workers, timeout=120)
        for r in time_config(lambda W, T: make(args, tg, W, T), workers, threads, strategies, args, tg,
                             runtime=rt, launch="lab"):
            print(MPI_ROW + json.dumps(r), flush=True)


# -- the command line ---------------------------------------------------------------------------
def block_args(args) -> argparse.Namespace:
    """What bench_train.py's model functions read."""
    return argparse.Namespace(width=args.width, heads=args.heads, layers=args.layers, tile=None,
                              warmup=args.warmup, steps=args.steps)


def gpt2_args(args, workers, threads) -> argparse.Namespace:
    """What bench_gpt2.py's functions read (its defaults: seed 0, AdamW lr 1e-4, weight decay 0.01)."""
    return argparse.Namespace(workers=workers, threads=threads, feature_tile=None, vocab_tile=None, batch_tile=None,
                              seq_tile=None, seed=0, lr=1e-4, weight_decay=0.01, device="cpu")


def gpt2_seq(args, cfg) -> int:
    return min(args.seq or DEFAULT_SEQ, cfg.max_seq_len)


def parse_configs(text: str | None, total: int) -> list[tuple[int, int]]:
    if text is None:  # 1 x T, 2 x T/2, 4 x T/4 ...
        return [(w, total // w) for w in (2 ** i for i in range(total.bit_length())) if total % w == 0]
    out = []
    for part in text.split(","):
        w, _, t = part.strip().lower().partition("x")
        if not (w.isdigit() and t.isdigit() and int(w) >= 1 and int(t) >= 1):
            raise ValueError(f"a configuration is WORKERSxTHREADS (e.g. 2x1), not {part!r}")
        out.append((int(w), int(t)))
    return out


def fmt_row(r: dict) -> str:
    def opt(key, f, scale=1.0):
        v = r.get(key)
        return "-" if v is None else format(v * scale, f)

    return (f"{r['model']:12} {r['config']:>6} {r.get('launch', '-'):>8} {r['strategy']:>9} {r.get('used') or '-':>7} "
            f"{r.get('exch') or '-':>5} {r.get('auto') or '-':>7} "
            f"{r['tok_s']:9.0f} {opt('outside', '8.1%'):>8} {opt('dask_cpu', '9.1%'):>9} {opt('moved', '8.1f', 1e-6):>8} "
            f"{opt('ratio', '6.2f'):>6} {r['step_s']:7.3f} {opt('first_s', '7.1f'):>7} {opt('peak', '8.0f', 2**-20):>8} "
            f"{opt('held', '8.1f', 2**-20):>8}")


HEADER = (f"{'model':12} {'WxT':>6} {'launch':>8} {'strategy':>9} {'used':>7} {'exch':>5} {'auto':>7} {'tok/s':>9} {'outside':>8} {'dask_CPU':>9} "
          f"{'MB/step':>8} {'ratio':>6} {'step_s':>7} {'first_s':>7} {'peak_MiB':>8} {'held_MiB':>8}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="blocks,gpt2", help="comma separated: blocks, gpt2")
    ap.add_argument("--gpt2-flavor", choices=GPT2_FLAVORS, default="6x768",
                    help="GPT-2 model of bench_gpt2.py (debug: the tiny test model, for a quick run)")
    ap.add_argument("--strategies", default="tiles,data,sharded",
                    help="comma separated TrainStep(parallel=...) strategies to run with several workers")
    ap.add_argument("--threads-total", type=at_least(1), default=None, help="T: threads in all (default: the cores)")
    ap.add_argument("--configs", default=None,
                    help="WORKERSxTHREADS,... (default: 1xT, 2xT/2, 4xT/4 ... as T divides)")
    ap.add_argument("--batch", type=at_least(1), default=None,
                    help="sequences per step (default: 4, or the most workers of a configuration if more)")
    ap.add_argument("--seq", type=at_least(1), default=None,
                    help=f"tokens per sequence (default {DEFAULT_SEQ}; GPT-2: at most its max_seq_len)")
    ap.add_argument("--width", type=at_least(1), default=768, help="block stack width")
    ap.add_argument("--heads", type=at_least(1), default=None, help="block stack attention heads (default: width / 64)")
    ap.add_argument("--layers", type=at_least(1), default=6, help="block stack blocks")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one records the graph)")
    ap.add_argument("--no-ddp", action="store_true", help="skip the PyTorch DDP rows")
    ap.add_argument("--mpi", action="store_true",
                    help="also run every configuration of several workers on a cluster launched by MPI "
                         "(mpiexec -n W+2, dask-mpi; needs the mpi extra and T = the cores)")
    ap.add_argument("--exchange", choices=("auto", "gang", "tasks"), default="auto",
                    help="tg.config.exchange: how the worker processes of a data-parallel plan exchange values "
                         "(one gang task per process, or Dask tasks)")
    ap.add_argument("--no-shm", action="store_true",
                    help="tg.config.shm_transfers = False: values between worker processes go over the workers' comms "
                         "(TCP), as between hosts, not through /dev/shm")
    ap.add_argument("--bucket-bytes", default="auto",
                    help='tg.config.bucket_bytes: "auto" (gradients in buckets of 25 MB during the backward where '
                         'the workers span hosts, one exchange after it on one host), or the bytes of a bucket '
                         '(inf: one exchange), e.g. 25e6 with --no-shm to try buckets as between hosts')
    ap.add_argument("--lab", default=None, metavar="RATE",
                    help="also run every configuration of several workers with each worker on a node of its own "
                         "(a network namespace; tests/netlab.py), its cable at RATE both ways: 1gbit, 10gbit, "
                         "or none (unlimited); needs root, unshare, ip and tc")
    ap.add_argument("--mpi-child", default=None, help=argparse.SUPPRESS)  # set by --mpi, under mpiexec
    ap.add_argument("--lab-child", default=None, help=argparse.SUPPRESS)  # set by --lab, in the lab's namespace
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    total = args.threads_total or os.cpu_count() or 1
    try:
        configs = parse_configs(args.configs, total)
    except ValueError as e:
        ap.error(str(e))
    kinds = [m.strip() for m in args.models.split(",") if m.strip()]
    if not kinds or any(m not in MODELS for m in kinds):
        ap.error(f"--models: a comma separated list of {', '.join(MODELS)}, not {args.models!r}")
    if "gpt2" in kinds and args.seq == 1:  # every target would be the ignored last position: a NaN loss
        ap.error("--seq: GPT-2 predicts the next token, so at least 2")
    require(ap, "torch", *(["transformers"] if "gpt2" in kinds else []),
            what="bench_scale.py (its ratios are against PyTorch)")
    if args.mpi and not args.mpi_child:  # found now, not after the embedded runs of the first configuration
        require(ap, "dask_mpi", "mpi4py", what="--mpi")
        if _mpiexec() is None:
            ap.error("--mpi needs mpiexec: pip install -e '.[mpi]'")
    if args.lab and not args.lab_child:
        missing = _netlab().lab_missing()
        if missing is not None:
            ap.error(f"--lab: {missing}")

    import dask
    import distributed
    import torch

    import tilegraph as tg
    from tilegraph._config import PARALLEL_STRATEGIES

    tg.config.exchange = args.exchange
    tg.config.shm_transfers = not args.no_shm
    try:
        tg.config.bucket_bytes = args.bucket_bytes if args.bucket_bytes == "auto" else float(args.bucket_bytes)
    except (ValueError, tg.TileError):
        ap.error(f'--bucket-bytes: "auto" or a number of bytes > 0, not {args.bucket_bytes!r}')
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if not strategies or any(s not in PARALLEL_STRATEGIES for s in strategies):
        ap.error(f"--strategies: a comma separated list of {', '.join(PARALLEL_STRATEGIES)}, not {args.strategies!r}")
    args.batch = args.batch or max(4, max(w for w, _ in configs))
    args.seq = args.seq or DEFAULT_SEQ
    args.heads = args.heads or max(1, args.width // 64)
    if args.width % args.heads:
        ap.error(f"--heads {args.heads} must divide --width {args.width}")
    if args.mpi_child:
        return mpi_child(args, kinds[0], strategies, tg)
    if args.lab_child:
        return lab_child(args, kinds[0], strategies, tg)
    if args.mpi and total != (os.cpu_count() or 1):
        ap.error(f"--mpi: MPI worker ranks share the machine's {os.cpu_count()} cores, so --threads-total must be "
                 f"that (received {total})")
    # what a --mpi run passes on to the script under mpiexec: the shape of the work, not what to run
    child_argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                  if k in ("gpt2_flavor", "batch", "seq", "width", "heads", "layers", "steps", "warmup", "strategies",
                           "exchange", "bucket_bytes")]
    child_argv += ["--no-shm"] if args.no_shm else []

    shapes = []
    if "blocks" in kinds:
        shapes.append(f"blocks: batch {args.batch} x seq {args.seq}, width {args.width}, {args.layers} layers, "
                      f"{args.heads} heads, row tile batch / (W x T)")
    if "gpt2" in kinds:
        cfg = flavor_config(args.gpt2_flavor)
        shapes.append(f"gpt2-{args.gpt2_flavor}: batch {args.batch} x seq {gpt2_seq(args, cfg)}, width {cfg.dim}, "
                      f"{cfg.n_layers} layers, vocab {cfg.vocab_size}, tiles of bench_gpt2.py")
    print(f"# {os.cpu_count()} cores, T = {total} threads in all; configurations (W workers x T threads) "
          f"{', '.join(f'{w}x{t}' for w, t in configs)}; tilegraph {tg.__version__}, dask {dask.__version__}, "
          f"distributed {distributed.__version__}, torch {torch.__version__} (eager; DDP over gloo), "
          f"Python {platform.python_version()}; fp32, AdamW; {args.warmup} warmup + {args.steps} timed steps; "
          f"gradient buckets {args.bucket_bytes}", flush=True)
    print("# " + "; ".join(shapes), flush=True)
    print("# strategy: tilegraph's TrainStep(parallel=...), or torch (PyTorch eager, one process) or torch-DDP (P "
          "processes, gloo); used: the plan's; exch: how its processes exchange values (gang: one task per process, "
          "shared-memory channels; gang-comm: over the workers' comms; tasks: Dask tasks); auto: what parallel='auto' picks there; outside = 1 - kernel s / "
          "(wall x W x T); dask_CPU: CPU s of the workers' Dask threads (transfers) / (wall x W x T); MB/step: between worker processes, from the plan (DDP: ring all-reduce, 2 (P-1) x "
          "gradient bytes); ratio = tok/s / torch eager tok/s with W x T threads; peak_MiB: most resident memory of one worker "
          "process in the row; held_MiB: most memory Dask held at once on one worker in the timed steps", flush=True)
    print(HEADER, flush=True)

    for kind in kinds:
        make = blocks_workload if kind == "blocks" else gpt2_workload
        eager: dict[int, float] = {}  # total threads -> torch eager tok/s
        grad_bytes = 0
        for n in sorted({w * t for w, t in configs}):
            torch.set_num_threads(n)
            w = make(args, tg, 1, n)
            model = w.build()
            data = w.make_batches(args.warmup + args.steps)
            if kind == "blocks":
                state = model.state_dict()
                grad_bytes = sum(a.nbytes for a in state.values())
                t = time_torch_blocks("blocks", block_args(args), *data[0], state, torch)
            else:
                with tempfile.TemporaryDirectory(prefix="bench_scale_") as tmp:
                    model.to_hf(Path(tmp) / "hf")
                    t = time_torch_gpt2(Path(tmp) / "hf", data, args.warmup, gpt2_args(args, 1, n), torch)
            del model
            eager[n] = w.tokens / t["step_s"]
            print(fmt_row({"model": w.name, "config": f"1x{n}", "strategy": "torch", "tok_s": eager[n],
                           "ratio": 1.0, "step_s": t["step_s"]}), flush=True)
        for workers, threads in configs:
            asked = strategies if workers > 1 else strategies[:1]
            rows = time_config(lambda W, T: make(args, tg, W, T), workers, threads, asked, args, tg)
            if args.mpi and workers > 1:
                rows += time_mpi(kind, workers, threads, child_argv)
            if args.lab and workers > 1:
                rows += time_lab(kind, workers, threads, child_argv, args.lab)
            for r in rows:
                r["ratio"] = r["tok_s"] / eager[workers * threads]
                print(fmt_row(r), flush=True)
            for r in rows:  # the MPI launch and the lab's nodes against the embedded cluster, strategy by strategy
                same = next((e for e in rows if e["launch"] == "embedded" and e["strategy"] == r["strategy"]), None)
                if r["launch"] != "embedded" and same:
                    name = "MPI" if r["launch"] == "mpi" else f"{workers} nodes at {args.lab}"
                    print(f"# {r['model']} {r['config']} {r['strategy']}: {name} / embedded = "
                          f"{r['tok_s'] / same['tok_s']:.2f}", flush=True)
            if kind == "blocks" and workers > 1 and not args.no_ddp:
                if args.batch % workers:
                    print(f"# torch-DDP {workers}x{threads} skipped: batch {args.batch} does not split into "
                          f"{workers} equal shares", flush=True)
                    continue
                wall = time_ddp(workers, threads, args)
                tok_s = args.batch * args.seq * args.steps / wall
                print(fmt_row({"model": "blocks", "config": f"{workers}x{threads}", "strategy": "torch-DDP",
                               "tok_s": tok_s, "moved": 2 * (workers - 1) * grad_bytes,
                               "ratio": tok_s / eager[workers * threads], "step_s": wall / args.steps}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
