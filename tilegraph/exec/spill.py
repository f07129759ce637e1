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

import json

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
    """Give ``worker``'s spill store (a Dask ``SpillBuffer``) this module's format; returns
    whether it has one (a worker without a memory limit, or with its own ``data`` mapping, has
    none and keeps what it has)."""
    slow = getattr(getattr(worker, "data", None), "_slow_uncached", None)
    if slow is None or not callable(getattr(slow, "dump", None)) or not callable(getattr(slow, "load", None)):
        return False
    if getattr(slow, "_tilegraph_spill", False):
        return True
    dask_dump, dask_load = slow.dump, slow.load
    slow.dump = lambda value: dump(value, dask_dump)
    slow.load = lambda buf: load(buf, dask_load)
    slow._tilegraph_spill = True
    return True


def spill_plugin():
    """A worker plugin applying :func:`install` on every worker, also those joining later."""
    from tilegraph.exec import setup_plugin

    return setup_plugin("tilegraph-spill", install)
