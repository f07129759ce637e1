"""Where a process's Python time goes in tilegraph's code: a sampler of the other threads' stacks.

A thread of its own reads every thread's Python stack (``sys._current_frames``) every few
milliseconds and counts, for each thread that is inside tilegraph (a task's runner, a kernel),
its innermost frame in tilegraph's files, by line and by function. Time inside a C call (a BLAS
product, a CuPy launch, a Numba kernel) counts on the line that made the call, so the table
reads as the share of the sampled time each line of tilegraph takes, its C calls included. For
a process that only queues work on a GPU (a CuPy worker), that is where its launch time goes.

Run in a Dask worker with ``client.run(start_sampling)`` / ``client.run(stop_sampling)`` (each
worker keeps its own sampler), or in this process with ``dask_worker=None``.
"""

from __future__ import annotations

import collections
import sys
import threading



def _roots() -> tuple[str, ...]:
    """The folders of tilegraph's code: its package and its subpackages ``ops``, ``models`` and
    ``io`` (inside the package once installed, beside it in a source tree)."""
    import os

    import tilegraph
    import tilegraph.io
    import tilegraph.models
    import tilegraph.ops

    return tuple({os.path.dirname(m.__file__) + os.sep for m in (tilegraph, tilegraph.ops, tilegraph.models, tilegraph.io)})


class StackSampler:
    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.samples = 0          # (thread, instant) pairs inside tilegraph
        self.ticks = 0
        self.lines: collections.Counter = collections.Counter()
        self.functions: collections.Counter = collections.Counter()   # each function on the stack, once per sample
        self.roots = _roots()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tilegraph-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"samples": self.samples, "ticks": self.ticks, "lines": dict(self.lines),
                "functions": dict(self.functions)}

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            self.ticks += 1
            for tid, frame in sys._current_frames().items():
                if tid != me:
                    self._count(frame)

    def _count(self, frame) -> None:
        inner, seen = None, set()
        while frame is not None:
            code = frame.f_code
            root = next((r for r in self.roots if code.co_filename.startswith(r)), None)
            if root is not None:
                where = f"{code.co_filename[len(root.rstrip('/').rsplit('/', 1)[0]) + 1:]}:{code.co_name}"
                if inner is None:
                    inner = f"{where}:{frame.f_lineno}"
                seen.add(where)
            frame = frame.f_back
        if inner is not None:
            self.samples += 1
            self.lines[inner] += 1
            self.functions.update(seen)


class _Here:
    pass


_HERE = _Here()


def holder(dask_worker=None):
    """Where a process keeps a profiling aid between the call that starts it and the one that
    stops it: the Dask worker (``client.run`` passes it), or this module's object in this process."""
    return dask_worker if dask_worker is not None else _HERE


def start_sampling(dask_worker=None, interval: float = 0.002) -> None:
    sampler = holder(dask_worker)._tilegraph_sampler = StackSampler(interval)
    sampler.start()


def stop_sampling(dask_worker=None) -> dict:
    keeper = holder(dask_worker)
    sampler = keeper._tilegraph_sampler
    del keeper._tilegraph_sampler
    return sampler.stop()


def print_samples(result: dict, top: int = 30, title: str = "") -> None:
    """The ``top`` lines and functions of a :meth:`StackSampler.stop` result, as shares of its samples."""
    n = max(1, result["samples"])
    print(f"{title}{result['samples']} samples inside tilegraph over {result['ticks']} ticks")
    print("  innermost tilegraph line (its C calls included):")
    for where, c in sorted(result["lines"].items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {c / n:6.1%}  {where}")
    print("  functions on the stack (inclusive):")
    for where, c in sorted(result["functions"].items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {c / n:6.1%}  {where}")
