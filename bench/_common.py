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


def timed_steps(step, batches) -> tuple[float, float]:
    """Run a TrainStep over ``batches`` as tg.Trainer does (step i+1 submitted before waiting for
    step i); returns (wall seconds, last loss)."""
    t0 = time.perf_counter()
    pending = None
    for batch in batches:
        nxt = step.submit(*batch)
        if pending is not None:
            pending.result()
        pending = nxt
    last = pending.result()
    return time.perf_counter() - t0, last
