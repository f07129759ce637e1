"""Pieces the benchmarks share: argument types, the check for what a bench needs installed, the
worker/thread setup and the pipelined timing loop."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def at_least(low: int):
    """An argparse ``type``: an int >= ``low`` (a bad one is a usage error naming the flag, not a
    traceback, a silent default or a table of inf/nan from an empty timing loop)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"an integer >= {low}, not {text!r}")
        return value
    parse.__name__ = f"int >= {low}"  # what argparse names in its message
    return parse


def require(ap: argparse.ArgumentParser, *modules: str, what: str = "") -> None:
    """Stop with a usage error naming the packages of ``modules`` that are not installed (the
    benches compare against torch and friends, which tilegraph itself does not need)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"{what or 'this benchmark'} needs {', '.join(missing)}, not installed here: "
                 f"pip install {' '.join(PIP_NAMES.get(m, m) for m in missing)}")


#: what ``require`` tells the user to install (the README's pinned CPU build of torch: an unpinned
#: one pulls in several GB of CUDA packages)
PIP_NAMES = {"torch": "torch==2.13.0", "cupy": "cupy-cuda12x", "dask_mpi": "dask-mpi"}


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
