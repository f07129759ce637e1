"""Task results spilled to disk by a Dask worker come back aligned.

A worker over its memory target writes values to disk and reads them back when a task needs them
(Dask's ``SpillBuffer``). Dask's spill format packs a value's frames one after the other, so an
array read back starts at whatever byte its frame landed on, and tilegraph's runner copies every
such array before a kernel reads it (:func:`tilegraph.exec.program.realigned`: NumPy takes slow
paths on unaligned data). In a run whose training state is several times the workers' memory
(``bench/bench_capacity.py``) that copy was about a tenth of the compute threads' time, on top of
the read itself.

:func:`install` gives a worker's spill store another format for what tilegraph's tasks return
(:class:`tilegraph.exec.program.Results` of NumPy arrays): a small header, then each array's
bytes at an offset that is a multiple of 64. Read back, each array is a view of the one buffer
read from the file, aligned, writable, and no copy is made. Every other value keeps Dask's
format; a file tells which format it holds by its first 8 bytes (Dask's start with a small frame
count, :data:`MAGIC` does not read as one).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time

import numpy as np

__all__ = ["MAGIC", "ALIGN", "dump", "load", "install"]

#: the first 8 bytes of a spilled value in this format (Dask's: its frame count, little-endian)
MAGIC = b"tgspill1"
#: where each array's bytes start in the file (and so in the buffer it is read into)
ALIGN = 64
#: values whose arrays are smaller than this in all keep Dask's format (a header's worth of gain)
MIN_BYTES = 1 << 16


def _up(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def _plain(a) -> bool:
    return type(a) is np.ndarray and a.dtype.kind in "biufc" and a.flags.c_contiguous


def dump(value, fallback):
    """``value`` as the frames of a spill file: this module's format for a ``Results`` (or tuple)
    of plain C-contiguous NumPy arrays of ``MIN_BYTES`` or more in all, ``fallback(value)``
    (Dask's) for anything else."""
    from tilegraph.exec.program import Results

    if not (type(value) in (Results, tuple) and value and all(_plain(a) for a in value)
            and sum(a.nbytes for a in value) >= MIN_BYTES):
        return fallback(value)
    arrays, offset = [], 0
    for a in value:
        arrays.append({"dtype": a.dtype.str, "shape": list(a.shape), "offset": offset})
        offset += _up(a.nbytes)
    head = json.dumps({"results": type(value) is Results, "arrays": arrays}).encode()
    start = _up(16 + len(head))  # where the first array's bytes begin
    frames = [MAGIC + len(head).to_bytes(8, "little") + head + bytes(start - 16 - len(head))]
    for a in value:
        frames.append(memoryview(a.reshape(-1)).cast("B"))
        pad = -a.nbytes % ALIGN
        if pad:
            frames.append(bytes(pad))
    return frames


def load(buf, fallback):
    """The value of a spill file read into ``buf`` (a bytearray): arrays as aligned, writable
    views of ``buf`` for this module's format, ``fallback(buf)`` (Dask's) otherwise."""
    if bytes(buf[:8]) != MAGIC:
        return fallback(buf)
    from tilegraph.exec.program import Results

    n = int.from_bytes(buf[8:16], "little")
    head = json.loads(bytes(buf[16:16 + n]))
    start = _up(16 + n)
    out = []
    for spec in head["arrays"]:
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(buf, dtype=dtype, count=count, offset=start + spec["offset"]).reshape(shape))
    return Results(out) if head["results"] else tuple(out)


def install(worker) -> bool:
    """Give ``worker``'s spill store (a Dask ``SpillBuffer``) this module's format, and have its
    files deleted aside (:func:`delete_aside`); returns whether it has one (a worker without a
    memory limit, or with its own ``data`` mapping, has none and keeps what it has)."""
    slow = getattr(getattr(worker, "data", None), "_slow_uncached", None)
    if slow is None or not callable(getattr(slow, "dump", None)) or not callable(getattr(slow, "load", None)):
        return False
    if getattr(slow, "_tilegraph_spill", False):
        return True
    dask_dump, dask_load = slow.dump, slow.load
    slow.dump = lambda value: dump(value, dask_dump)
    slow.load = lambda buf: load(buf, dask_load)
    delete_aside(getattr(slow, "d", None))
    slow._tilegraph_spill = True
    return True


#: the files waiting for the deleting thread (:func:`delete_aside`), and that thread
_DOOMED: "queue.Queue[str] | None" = None
_DELETE_LOCK = threading.Lock()


#: the longest a closing worker waits for the files still to delete
FINISH_SECONDS = 120.0


def _delete_in_turn(doomed: "queue.Queue[str]") -> None:
    while True:
        path = doomed.get()
        try:
            with contextlib.suppress(OSError):  # (gone with the worker's folder already)
                os.remove(path)
        finally:
            doomed.task_done()


def finish_deleting(worker=None) -> None:
    """As the worker closes (before Dask deletes its spill folder, whose listing the deleting
    thread would change under it: an ERROR line per file), delete the files still waiting, and
    from then on in place."""
    files = getattr(getattr(getattr(worker, "data", None), "_slow_uncached", None), "d", None)
    if files is not None:  # (this worker's store only: workers of a test can share a process)
        files._tilegraph_closing = True
    doomed = _DOOMED
    deadline = time.monotonic() + FINISH_SECONDS
    while doomed is not None and doomed.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.02)


def _delitem_aside(self, key) -> None:
    """``zict.File.__delitem__``, the file deleted by the deleting thread: the key is forgotten
    here and now, the file's name is never used again (zict adds a counter to each)."""
    global _DOOMED
    name = self.filenames.pop(key)
    if getattr(self, "_tilegraph_closing", False):
        with contextlib.suppress(OSError):
            os.remove(os.path.join(self.directory, name))
        return
    with _DELETE_LOCK:
        if _DOOMED is None:
            _DOOMED = queue.Queue()
            threading.Thread(target=_delete_in_turn, args=(_DOOMED,), name="tilegraph-spill-delete",
                             daemon=True).start()
    _DOOMED.put(os.path.join(self.directory, name))


_ASIDE_CLASSES: dict[type, type] = {}


def delete_aside(files) -> bool:
    """Have the files of a spill store's file mapping (``zict.File``) deleted by a thread of
    their own, not by the worker's event loop, which deletes a spilled value's file when the
    value is read back or forgotten: on a disk that discards freed blocks a file of tens of MB
    took 0.1-0.15 s to delete, and a worker of the 4.1x capacity bench deleted 1,300-1,700 of
    them in three steps, 14-17 s with its event loop (transfers, the scheduler's messages) held.
    Returns whether it applies (a mapping without zict.File's ``filenames``: left as it is)."""
    cls = type(files)
    if getattr(cls, "_tilegraph_aside", False):
        return True
    if not isinstance(getattr(files, "filenames", None), dict) or not isinstance(getattr(files, "directory", None), str):
        return False
    aside = _ASIDE_CLASSES.get(cls)
    if aside is None:
        aside = _ASIDE_CLASSES[cls] = type(cls.__name__, (cls,), {"__delitem__": _delitem_aside,
                                                                   "_tilegraph_aside": True})
    files.__class__ = aside
    return True


def spill_plugin():
    """A worker plugin applying :func:`install` on every worker, also those joining later, and
    :func:`finish_deleting` as each closes."""
    from tilegraph.exec import setup_plugin

    return setup_plugin("tilegraph-spill", install, finish_deleting)
