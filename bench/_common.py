"""Pieces the benchmarks share: the worker/thread setup and the pipelined timing loop."""

from __future__ import annotations

import os
import sys
import time


def setup_threads(args) -> None:
    """Fill ``args.workers``/``args.threads`` (the local runtime: one process, a thread per core).

    With ``--runtime local`` the process restarts itself with ``OMP_NUM_THREADS=1``, as in Dask
    workers: one BLAS thread per kernel, parallelism comes from the tiles (BLAS reads the variable
    when it loads, so it must be set before).
    """
    if args.runtime == "local" and os.environ.get("OMP_NUM_THREADS") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OMP_NUM_THREADS": "1"})
    ncpu = os.cpu_count() or 1
    args.threads = args.threads or max(1, ncpu // args.workers)
    if args.runtime == "local":
        args.workers, args.threads = 1, ncpu


def timed_steps(step, batches, group: int = 1) -> tuple[float, float]:
    """Run a TrainStep over ``batches`` as tg.Trainer does (``group`` steps per graph; group i+1
    submitted before waiting for group i); returns (wall seconds, last loss)."""
    t0 = time.perf_counter()
    pending = None
    for i in range(0, len(batches), group):
        nxt = step.submit_steps(batches[i:i + group])
        if pending is not None:
            pending[-1].result()
        pending = nxt
    last = pending[-1].result()
    return time.perf_counter() - t0, last
