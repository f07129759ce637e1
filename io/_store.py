"""The part of Zarr v3 that tilegraph's checkpoints use, read and written file by file.

An array's metadata is the ``zarr.json`` zarr-python itself makes (a regular chunk grid, the
``bytes`` codec, little-endian, then ``crc32c``); a chunk file ``c.i.j`` (Zarr's default chunk
key encoding with the "." separator, :data:`CHUNK_SEPARATOR`; checkpoints of format 1 used
``c/i/j``) holds the chunk's bytes in C order (edge chunks padded to the full shape) followed by
their CRC32C. Arrays of small tiles use Zarr's sharding codec: one file holds several whole
tiles, each with its checksum, then the index of (offset, length) per inner chunk and the index's
checksum. A quantized tile is one byte array of its parts, their layout in its attributes.
zarr-python opens all of it (tests check); going through its generic machinery per tile cost
~5 ms a call, which held saves to a tenth of ``numpy.save``.

Everything here runs where the tiles are: on the workers, or in the client for tiles it holds.
"""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from tilegraph._errors import TileError
from tilegraph._graph import to_host


class CheckpointError(TileError):
    """A checkpoint that cannot be written or read: names the path or array and what was wrong."""


def write_failure(where: str, e: OSError, path, what: str = "the checkpoint",
                  kept: str = "earlier checkpoints are untouched") -> CheckpointError:
    """The error of a write that failed with ``e`` at ``path``: why in words (a full disk, a
    read-only file system, ...), and what was there before (``kept``)."""
    why = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
           errno.EROFS: "the file system is read-only", errno.EDQUOT: "the disk quota is exceeded"}.get(
        e.errno, e.strerror or str(e) or type(e).__name__)
    return CheckpointError(where, f"could not write {what} ({why}); {kept}", str(path))


# ------------------------------------------------------------------------------------ helpers ----
def user_path(path, where: str, error: type[TileError] = TileError) -> Path:
    """``path`` (a str or os.PathLike) as a Path, a leading ``~`` expanded as a shell does:
    ``Path("~/ck")`` alone is a folder named "~" in the working directory, which a save would
    create there and a load would look for there."""
    if not isinstance(path, (str, os.PathLike)) or (isinstance(path, str) and not path):
        raise error(where, "a path (a str or pathlib.Path, not empty)", repr(path)[:100])
    try:
        return Path(path).expanduser()
    except RuntimeError as e:  # "~nobody/x": no such user, or no home folder known
        raise error(where, "a path whose leading ~ names a home folder", f"{path}: {e}") from None


def file_in_the_way(path) -> Path | None:
    """What keeps a folder ``path`` from being made: a file (or a dangling link) at ``path`` or at
    one of its parents; None when there is none."""
    path = Path(path)
    first = next((p for p in (path, *path.parents) if os.path.lexists(p)), None)
    return first if first is not None and not first.is_dir() else None


def unwritable_folder(folder) -> str | None:
    """Why this process cannot make ``folder`` or write in it (a read-only file system, no
    permission), as "creating X failed: reason (ERRNO)"; None when it can. The folder is made when
    missing (as a writer would), and a uniquely named empty file is created in it and removed: no
    existing file is touched. Folders made here are removed again when the check fails."""
    import contextlib
    import tempfile

    folder = Path(folder)
    missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]  # deepest first
    doing = "creating"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        doing = "writing a file in"
        fd, probe = tempfile.mkstemp(prefix=".tilegraph-write-check-", dir=folder)
    except OSError as e:
        for p in missing:  # only those made here (a parent made by someone else stays)
            with contextlib.suppress(OSError):
                p.rmdir()
        code = errno.errorcode.get(e.errno, "")
        reason = f"{e.strerror or type(e).__name__}" + (f" ({code})" if code else "")
        at = f" {e.filename}" if doing == "creating" and e.filename else " it"
        return f"{doing}{at} failed: {reason}"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def chunks_of(tiling_chunks: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """A regular Zarr chunk shape whose chunks never straddle a tile: the first tile size when
    every tile but the last is that size (the usual tiling), else the gcd of the tile sizes. A
    tile then covers whole chunks only, so no two writers ever touch the same chunk."""
    out = []
    for dim in tiling_chunks:
        dim = [int(c) for c in dim]
        if len(dim) == 1 or (all(c == dim[0] for c in dim[:-1]) and dim[-1] <= dim[0]):
            out.append(max(1, dim[0]))
        else:
            out.append(max(1, math.gcd(*dim)))
    return tuple(out)


def slices(chunks: Sequence[Sequence[int]], idx: Sequence[int]) -> tuple[tuple[int, int], ...]:
    return tuple((sum(c[:i]), sum(c[:i]) + c[i]) for c, i in zip(chunks, idx))


# ------------------------------------------------------------------------------ chunk files ----
#: the chunk key separator of the arrays tilegraph writes: chunk files ``c.0.1`` sit in their
#: array's folder. Zarr's default "/" makes ``c/0/1``, a folder for the ``c`` and for every index
#: but the last: 1,614 folders beside 1,393 files for the GPT-2 124M training state, against 786
#: with ".". Creating a file or folder is the costly part of a checkpoint of many small arrays
#: on a file system whose metadata operations are slow (a parallel file system's metadata
#: server; measured on the development machine after heavy writes: 0.3-1 ms each)
CHUNK_SEPARATOR = "."

_TEMPLATES: dict[str, dict] = {}


def array_meta(shape, dtype, chunks, attributes: dict | None = None, shards=None) -> dict:
    """The zarr.json document of an array (from one zarr-python makes, so the format is its);
    with ``shards``, chunks of ``chunks`` inside shard files of shape ``shards``."""
    dt = np.dtype(dtype)
    key = (dt.str, shards is not None)
    template = _TEMPLATES.get(key)
    if template is None:
        import zarr
        from zarr.codecs import Crc32cCodec
        from zarr.core.buffer import default_buffer_prototype

        arr = zarr.create_array(store=zarr.storage.MemoryStore(), shape=(2,), chunks=(1,), dtype=dt,
                                shards=(2,) if shards is not None else None, compressors=[Crc32cCodec()],
                                fill_value=0)
        doc = arr.metadata.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()
        template = _TEMPLATES[key] = json.loads(doc)
    meta = json.loads(json.dumps(template))
    meta["shape"] = [int(n) for n in shape]
    meta["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": CHUNK_SEPARATOR}}
    if shards is not None:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [int(c) for c in shards]
        meta["codecs"][0]["configuration"]["chunk_shape"] = [int(c) for c in chunks]
    else:
        meta["chunk_grid"]["configuration"]["chunk_shape"] = [int(c) for c in chunks]
    meta["attributes"] = attributes or {}
    return meta


#: tiles smaller than this go into shard files of several tiles (one file per tile would cost
#: more in file system calls than in bytes); a shard holds up to SHARD_BYTES
SHARD_TILE_BYTES = 1 << 20
SHARD_BYTES = 32 << 20
_EMPTY = np.uint64(2 ** 64 - 1)


def shards_of(shape, dtype, tiling_chunks) -> tuple[int, ...] | None:
    """The shard shape of an array of small tiles (whole tiles per shard; the tiling must be
    regular: every tile but the last of a dimension of one size), or None."""
    chunk = chunks_of(tiling_chunks)
    grid = [len(c) for c in tiling_chunks]
    regular = all(c[0] == k for c, k in zip(tiling_chunks, chunk))
    nbytes = int(np.prod(chunk)) * np.dtype(dtype).itemsize if chunk else 0
    if not regular or int(np.prod(grid)) < 2 or not 0 < nbytes < SHARD_TILE_BYTES:
        return None
    m, size = [1] * len(grid), nbytes
    for d in reversed(range(len(grid))):  # whole trailing dims first: shards of contiguous rows
        m[d] = max(1, min(grid[d], SHARD_BYTES // size))
        size *= m[d]
    return tuple(c * k for c, k in zip(chunk, m))


try:  # hardware instructions, and the GIL let go of on large buffers: a worker's save threads
    # checksum in parallel and its other threads are not held up
    from crc32c import crc32c as _crc32c
except ImportError:  # Zarr's own dependency; it holds the GIL (two save threads take turns)
    from google_crc32c import value as _crc32c


def crc32c(data) -> int:
    """The CRC32C of a bytes object or a uint8 array (what Zarr's ``crc32c`` codec stores)."""
    return _crc32c(data)


def crc_bytes(data) -> bytes:
    """The CRC32C of ``data`` as the 4 little-endian bytes that follow it in a file."""
    return crc32c(data).to_bytes(4, "little")


_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_OVERWRITE_FLAGS = os.O_WRONLY | getattr(os, "O_CLOEXEC", 0)


def _advance(views: list, i: int, n: int) -> int:
    """After a readv/writev moved ``n`` bytes of ``views[i:]``: the index of the first view not
    done, that view cut to what is left of it."""
    while i < len(views) and n >= views[i].nbytes:
        n -= views[i].nbytes
        i += 1
    if n:
        views[i] = views[i][n:]
    return i


#: bytes per write call: a file goes out in blocks of this size, small parts gathered into one.
#: In a sandboxed kernel (gVisor-like, the 2-core CI machine) one call per 9 MB tile, or a writev,
#: ran 3-6x slower than blocks of 64-512 KiB; elsewhere blocks cost a few thousand more calls per GB
WRITE_BLOCK = 1 << 18


def _write_all(fd: int, view: memoryview, path: str) -> None:
    for start in range(0, view.nbytes, WRITE_BLOCK):
        block = view[start:start + WRITE_BLOCK]
        while block.nbytes:  # a short write goes on with the rest
            n = os.write(fd, block)
            if n == 0:  # never for a file, but never a loop without end
                raise OSError(errno.EIO, "write wrote nothing", path)
            block = block[n:]


def write_file(path: str, parts: Sequence, *, overwrite: bool = False) -> int:
    """Create ``path`` holding ``parts`` (bytes or C-contiguous arrays) one after the other,
    large parts straight from their memory in :data:`WRITE_BLOCK` blocks, small ones gathered
    first (no Python file object). With ``overwrite``, ``path`` exists and is written over from
    its start, its blocks kept (then cut to the new length). An OSError (a full disk, ...)
    propagates. Returns the bytes written."""
    total = 0
    fd = os.open(path, _OVERWRITE_FLAGS if overwrite else _WRITE_FLAGS, 0o666)
    try:
        small = bytearray()
        for part in parts:
            view = memoryview(part).cast("B")
            total += view.nbytes
            if len(small) + view.nbytes <= WRITE_BLOCK:
                small += view
                continue
            if small:
                _write_all(fd, memoryview(bytes(small)), path)
                small.clear()
            _write_all(fd, view, path)
        if small:
            _write_all(fd, memoryview(bytes(small)), path)
        if overwrite:
            os.ftruncate(fd, total)
    finally:
        os.close(fd)
    return total


def read_file_into(path: str, buffers: Sequence) -> int:
    """Fill ``buffers`` (writable, C-contiguous; a few) from the start of ``path`` with ``readv``
    until they are full or the file ends; returns the bytes read (fewer: the file is shorter)."""
    views = [memoryview(b).cast("B") for b in buffers]
    fd = os.open(path, _READ_FLAGS)
    try:
        got, i = 0, 0
        while i < len(views):
            n = os.readv(fd, views[i:])
            if n == 0:
                break
            got += n
            i = _advance(views, i, n)
    finally:
        os.close(fd)
    return got


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (ours to signal or not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: the mark between a checkpoint's name and its writer in a save's temporary folder name
TMP_MARK = ".tmp-"
#: how long a temporary folder of a save on another host (several nodes checkpointing into one
#: folder of a shared file system) stays untouched before a manager here removes it. Its
#: writer's process cannot be looked up from here: a pid check here would delete a live save of
#: another node whose pid is free here, or keep a dead one whose pid is taken here. Never
#: removing them would let the folders of killed saves pile up (each as large as a checkpoint)
#: in a folder that only other nodes clean; a day is far longer than any save takes and than
#: any clock skew between the nodes, so a live save is never taken for a dead one
STALE_OTHER_HOST_SECONDS = 24 * 3600


def host_label() -> str:
    """This machine's host name as it goes into temporary folder names: the characters other
    than letters, digits, ``.``, ``_`` and ``-`` replaced by ``_`` (never empty)."""
    import re
    import socket

    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname() or "") or "unknown-host"


def temp_name(name: str, pid: int | None = None) -> str:
    """The hidden temporary folder name of a save of the checkpoint ``name`` by this process:
    ``.NAME.tmp-PID-HEX-HOST`` (the pid first, as in the earlier ``.NAME.tmp-PID-HEX``, so
    that a reader of that form still finds it)."""
    import uuid

    return f".{name}{TMP_MARK}{os.getpid() if pid is None else int(pid)}-{uuid.uuid4().hex[:8]}-{host_label()}"


def temp_writer(name: str) -> tuple[int, str | None] | None:
    """The writer of a save's temporary folder ``name``: (pid, host), host None for the earlier
    form without one (``.NAME.tmp-PID-HEX``, which cleanup reads as this host's, as it did
    before); None when ``name`` is not a temporary folder name."""
    if not name.startswith(".") or TMP_MARK not in name:
        return None
    fields = name.split(TMP_MARK, 1)[1].split("-", 2)  # PID, HEX, HOST (which may hold "-")
    if not fields[0].isascii() or not fields[0].isdigit():
        return None
    return int(fields[0]), (fields[2] or None) if len(fields) == 3 else None


def untouched_for(path) -> float:
    """Seconds since the folder ``path`` or its ``zarr.json`` last changed (the newer of the
    two; inf when neither can be read)."""
    import time

    times = []
    for p in (Path(path), Path(path) / "zarr.json"):
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            pass
    return time.time() - max(times) if times else math.inf


def write_file_in(path: str, parts: Sequence, root: str, made: set | None = None) -> int:
    """:func:`write_file` of a file under a save's temporary folder ``root``, its folder made
    (:func:`make_dir`) only when the file cannot be created for want of it: a save makes its
    arrays' folders before its write tasks start, so a chunk costs one file creation and no
    ``mkdir`` (a file system's metadata calls are what a checkpoint of many small arrays spends
    its time on). Returns the bytes written."""
    try:
        return write_file(path, parts)
    except FileNotFoundError:
        make_dir(os.path.dirname(path), made, root)  # (SaveAbandoned when root itself is gone)
    return write_file(path, parts)


def make_dir(folder: str, made: set | None, root: str) -> None:
    """Make ``folder`` and the folders missing between it and ``root`` (a save's temporary
    folder), at most once per ``made`` (a set of the folders made so far; None: no record),
    trying one ``mkdir`` first: the parent is there but for a tile's first chunk. ``root`` itself
    is never made here: a save that was abandoned and its folder removed (an interrupt) stops at
    its next folder, with :class:`SaveAbandoned`, instead of writing a new tree there."""
    if made is not None and folder in made:
        return
    if os.path.normpath(folder) == os.path.normpath(root):
        if not os.path.isdir(root):
            raise SaveAbandoned(root)
        return
    try:
        os.mkdir(folder)
    except FileExistsError:
        pass
    except FileNotFoundError:
        at = root
        for part in os.path.relpath(folder, root).split(os.sep):
            at = os.path.join(at, part)
            try:
                os.mkdir(at)
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise SaveAbandoned(root) from None
    if made is not None:
        made.add(folder)


class SaveAbandoned(CheckpointError):
    """A write task of a save found its temporary folder gone: the save was abandoned (an
    interrupt or an error elsewhere) and its folder removed; the task stops."""

    def __init__(self, root: str):
        super().__init__(f"tilegraph.io.save_checkpoint({root})", "the save's temporary folder, to write in",
                         "removed: the save was abandoned")


def encode_chunk(part: np.ndarray, chunk_shape) -> tuple[np.ndarray, bytes]:
    """A chunk's bytes (an edge chunk padded to the full shape, with the fill value 0) and its
    CRC32C."""
    if part.shape != tuple(chunk_shape):
        full = np.zeros(chunk_shape, part.dtype)
        full[tuple(slice(0, n) for n in part.shape)] = part
        part = full
    data = np.ascontiguousarray(part).reshape(-1).view(np.uint8)  # no copy of a whole-chunk tile
    return data, crc_bytes(data)


def decode_chunk(raw: bytes, chunk_shape, dtype: np.dtype) -> np.ndarray | None:
    """The chunk stored in ``raw`` (its bytes, then their CRC32C), or None when the length or
    the checksum is wrong (corrupted or truncated)."""
    want = int(np.prod(chunk_shape)) * dtype.itemsize
    if len(raw) != want + 4 or np.frombuffer(raw, "<u4", 1, want)[0] != crc32c(raw[:want]):
        return None
    return np.frombuffer(raw, dtype.newbyteorder("<"), int(np.prod(chunk_shape))).reshape(chunk_shape)


def write_shard(root: str, name: str, tiles: Sequence[np.ndarray], regions, shape, chunk_shape,
                 shard_shape, shard_idx) -> int:
    """One shard file: the tiles (each one inner chunk) it covers, then the index of (offset,
    length) per inner chunk, C order, with its CRC32C. Written by one task, all at once."""
    per = [s // c for s, c in zip(shard_shape, chunk_shape)]
    at = {tuple(lo // c for (lo, _), c in zip(r, chunk_shape)): t for t, r in zip(tiles, regions)}
    index = np.full((int(np.prod(per)), 2), _EMPTY, np.uint64)
    path = chunk_path(root, name, shard_idx, CHUNK_SEPARATOR)
    offset, parts = 0, []
    for k, rel in enumerate(np.ndindex(*per)):
        idx = tuple(si * p + r for si, p, r in zip(shard_idx, per, rel))
        if any(i * c >= n for i, c, n in zip(idx, chunk_shape, shape)):
            continue  # past the array's end: no chunk
        tile = at.get(idx)
        if tile is None:
            raise CheckpointError(f"tilegraph.io.save_checkpoint({root})", f"array {name!r}: every tile of "
                                  "a shard to write it", f"shard {shard_idx} lacks chunk {idx}")
        data, crc = encode_chunk(tile_bytes(tile), chunk_shape)
        parts += [data, crc]
        index[k] = (offset, data.nbytes + 4)
        offset += data.nbytes + 4
    raw = index.astype("<u8").tobytes()
    write_file_in(path, [*parts, raw, crc_bytes(raw)], root)
    return offset


def write_shard_task(values: Sequence, indices: Sequence, spec: tuple) -> dict:
    """A save task of one shard: its tiles (task results, with their tuple positions) in."""
    tiles = [to_host(v if i is None else v[i]) for v, i in zip(values, indices)]
    root, name, *rest = opened(spec)
    written = write_shard(root, name, tiles, *rest)
    return {"worker": worker_address(), "bytes": written}


def read_sharded_chunk(root: str, name: str, idx, chunk_shape, shard_shape, dtype, cache: dict,
                       sep: str = CHUNK_SEPARATOR) -> np.ndarray:
    """One inner chunk of a sharded array, its shard's index and its own checksum verified."""
    per = [s // c for s, c in zip(shard_shape, chunk_shape)]
    shard = tuple(i // p for i, p in zip(idx, per))
    key = chunk_key(shard, sep)
    where = f"tilegraph.io.load_checkpoint({root})"
    path = chunk_path(root, name, shard, sep)
    index = cache.get(shard)
    n = int(np.prod(per))
    if index is None:
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 16 * n - 4))
                raw = f.read()
        except FileNotFoundError:
            raise missing_chunk(where, root, name, "a shard is missing", f"{key} (no file {path})") from None
        if len(raw) != 16 * n + 4 or np.frombuffer(raw, "<u4", 1, 16 * n)[0] != crc32c(raw[:16 * n]):
            raise CheckpointError(where, f"array {name!r}: a shard's index failed its checksum (corrupted or "
                                  "truncated)", f"{key}: {size} bytes")
        index = cache[shard] = np.frombuffer(raw, "<u8", 2 * n).reshape(n, 2)
    k = int(np.ravel_multi_index(tuple(i % p for i, p in zip(idx, per)), per))
    offset, length = (int(x) for x in index[k])
    want = int(np.prod(chunk_shape)) * dtype.itemsize
    if index[k][0] == _EMPTY or length != want + 4:
        raise CheckpointError(where, f"array {name!r}: a chunk is missing from its shard",
                              f"{key}, chunk {idx}" + MISSING_CHUNK_WHY)
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    chunk = decode_chunk(raw, chunk_shape, dtype)
    if chunk is None:
        raise chunk_failed(where, name, f"{key}, chunk {idx}", memoryview(raw)[:want], raw[want:want + 4], len(raw),
                           want + 4)
    return chunk


def _codec_names(codecs) -> str:
    """A zarr.json's list of codecs by their names ("bytes, zstd"), or what stands there instead."""
    if not isinstance(codecs, list) or not all(isinstance(c, dict) for c in codecs):
        return repr(codecs)[:100]
    return ", ".join(str(c.get("name")) for c in codecs) or "none"


def _codec_problem(codecs, what: str) -> str | None:
    """How a list of Zarr codecs differs from the ``bytes`` (little-endian) + ``crc32c`` that
    tilegraph's chunks are stored with, in words, or None."""
    names = _codec_names(codecs)
    if names != "bytes, crc32c":
        return f"{what} {names}, not bytes (little-endian) then crc32c"
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    if endian != "little":
        return f"{what} bytes ({endian}-endian) then crc32c, not little-endian"
    return None


def layout_problems(meta: dict, info: dict) -> list[str]:
    """How the zarr.json ``meta`` of a plain (not quantized) checkpoint array differs from the
    layout tilegraph reads it in (the one it writes): ``info``, its entry in the checkpoint's
    attributes, with the ``separator`` of format 1 where :class:`~tilegraph.io.Checkpoint` added
    it. An array made anew by another tool (zarr-python's ``create_array`` compresses with zstd
    and names chunks ``c/0/1``) failed as a missing chunk or a failed checksum, the file named
    being there or whole."""
    if meta.get("node_type") != "array":
        return [f"a Zarr {meta.get('node_type')!r} node, not an array"]
    problems = []
    if meta.get("shape") != [int(n) for n in info["shape"]]:
        problems.append(f"shape {meta.get('shape')}, the checkpoint's {list(info['shape'])}")
    try:
        same = np.dtype(meta.get("data_type")) == np.dtype(info["dtype"])
    except TypeError:
        same = False
    if not same:
        problems.append(f"data type {meta.get('data_type')!r}, the checkpoint's {info['dtype']!r}")
    chunks = [int(c) for c in (info.get("chunks") or chunks_of(info["tiles"]))]
    shards = info.get("shards")
    grid = meta.get("chunk_grid") or {}
    want = [int(c) for c in shards] if shards else chunks
    got = (grid.get("configuration") or {}).get("chunk_shape")
    if grid.get("name") != "regular" or got != want:
        problems.append(f"chunks {got}, the checkpoint's {want}" if grid.get("name") == "regular"
                        else f"chunk grid {grid.get('name')!r}, not 'regular'")
    encoding = meta.get("chunk_key_encoding") or {}
    sep = (encoding.get("configuration") or {}).get("separator", "/" if encoding.get("name") == "default" else ".")
    want_sep = info.get("separator", CHUNK_SEPARATOR)
    if encoding.get("name") != "default" or sep != want_sep:
        problems.append(f"chunk key encoding {encoding.get('name')!r} with separator {sep!r}, not 'default' with "
                        f"{want_sep!r}")
    codecs = meta.get("codecs")
    if shards:
        outer = codecs[0] if isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict) else {}
        conf = outer.get("configuration") or {}
        if outer.get("name") != "sharding_indexed":
            problems.append(f"codecs {_codec_names(codecs)}, not sharding_indexed (of bytes then crc32c)")
        else:
            if conf.get("chunk_shape") != chunks:
                problems.append(f"inner chunks {conf.get('chunk_shape')}, the checkpoint's {chunks}")
            problems += [p for p in (_codec_problem(conf.get("codecs"), "inner codecs"),
                                     _codec_problem(conf.get("index_codecs"), "index codecs")) if p]
            if conf.get("index_location", "end") != "end":
                problems.append(f"shard index at the {conf.get('index_location')}, not the end")
    else:
        problem = _codec_problem(codecs, "codecs")
        if problem:
            problems.append(problem)
    return problems


def group_meta(attributes: dict | None = None) -> dict:
    return {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}


def write_meta(root: str, path: str, meta: dict, made: set | None = None) -> None:
    folder = os.path.join(root, path) if path else root
    make_dir(folder, made, root)
    write_file(os.path.join(folder, "zarr.json"), (json.dumps(meta).encode(),))


def chunk_key(idx: Sequence[int], sep: str = CHUNK_SEPARATOR) -> str:
    """The Zarr key of chunk ``idx`` in its array (the default chunk key encoding): ``c.0.1``, or
    ``c/0/1`` with ``sep="/"``."""
    return "c" + "".join(f"{sep}{int(i)}" for i in idx)


def chunk_path(root: str, name: str, idx: Sequence[int], sep: str = CHUNK_SEPARATOR) -> str:
    return os.path.join(root, name, *chunk_key(idx, sep).split("/"))


def tile_bytes(tile) -> np.ndarray:
    """``tile`` as a C-ordered little-endian array (no copy when it is one already)."""
    tile = np.ascontiguousarray(tile)
    if tile.dtype.byteorder == ">":
        tile = tile.astype(tile.dtype.newbyteorder("<"))
    return tile


def write_chunks(root: str, name: str, tile: np.ndarray, region, chunk_shape, made: set | None = None) -> int:
    """Write ``tile``, the slices ``region`` of array ``name`` (whole chunks: the chunk grid is
    chosen so that no tile straddles a chunk), one chunk file each (the chunk's bytes straight
    from the tile when it is one whole chunk, then its CRC32C, in one ``writev``); returns the
    bytes written. ``made``: the folders already made (shared by the calls of one task)."""
    tile = tile_bytes(tile)
    written = 0
    first = [lo // c for (lo, _), c in zip(region, chunk_shape)]
    counts = [-(-(hi - lo) // c) for (lo, hi), c in zip(region, chunk_shape)]
    made = set() if made is None else made
    for rel in np.ndindex(*counts):
        src = tuple(slice(i * c, min((i + 1) * c, hi - lo)) for i, c, (lo, hi) in zip(rel, chunk_shape, region))
        data, crc = encode_chunk(tile[src], chunk_shape)
        path = chunk_path(root, name, [f + r for f, r in zip(first, rel)], CHUNK_SEPARATOR)
        write_file_in(path, (data, crc), root, made)
        written += data.nbytes
    return written


#: why a chunk file can be missing, after the error's chunk key: tilegraph writes every chunk (a save
#: checks that each is there), and a Zarr writer may leave out one that is all the fill value (the
#: spec reads a missing chunk so; zarr-python does unless told not to), which tilegraph refuses to
#: guess at: a file lost in a copy would load as zeros
MISSING_CHUNK_WHY = ("; tilegraph writes every chunk, so the folder was copied incompletely, or the array was "
                     "written by another tool: zarr-python leaves out a chunk whose values all equal the fill value "
                     "0 unless zarr.config.set({'array.write_empty_chunks': True}) is in force when it writes")


def missing_chunk(where: str, root: str, name: str, what: str, received: str) -> CheckpointError:
    """The error of a chunk or shard file of array ``name`` that is not there: the checkpoint
    itself gone since it was opened (removed, or pruned by a :class:`CheckpointManager`'s
    ``keep`` in another process, while this one read it), or a file missing from it."""
    if not os.path.isfile(os.path.join(root, "zarr.json")):
        return CheckpointError(where, "the checkpoint was removed while it was being read (pruned by a "
                               "CheckpointManager's keep, or deleted, in another process?)", f"{root} is gone")
    return CheckpointError(where, f"array {name!r}: {what}", received + MISSING_CHUNK_WHY)


def read_chunk(root: str, name: str, idx, chunk_shape, dtype, sep: str = CHUNK_SEPARATOR) -> np.ndarray:
    """One chunk, its checksum verified."""
    path = chunk_path(root, name, idx, sep)
    key = chunk_key(idx, sep)
    where = f"tilegraph.io.load_checkpoint({root})"
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise missing_chunk(where, root, name, "a chunk is missing", f"{key} (no file {path})") from None
    chunk = decode_chunk(raw, chunk_shape, dtype)
    if chunk is None:
        want = int(np.prod(chunk_shape)) * dtype.itemsize
        raise chunk_failed(where, name, key, memoryview(raw)[:want], raw[want:want + 4], len(raw), want + 4)
    return chunk


def read_whole_chunk(root: str, name: str, idx, out: np.ndarray, sep: str = CHUNK_SEPARATOR) -> None:
    """Read the chunk ``idx`` straight into ``out`` (its exact shape), checksum verified."""
    path = chunk_path(root, name, idx, sep)
    key = chunk_key(idx, sep)
    where = f"tilegraph.io.load_checkpoint({root})"
    flat = out.reshape(-1).view(np.uint8)
    tail = bytearray(5)  # the checksum, and a byte more: a longer file fails too
    try:
        got = read_file_into(path, (flat, tail))
    except FileNotFoundError:
        raise missing_chunk(where, root, name, "a chunk is missing", f"{key} (no file {path})") from None
    if got != flat.nbytes + 4 or int.from_bytes(tail[:4], "little") != crc32c(flat):
        raise chunk_failed(where, name, key, flat, tail[:4], got, flat.nbytes + 4)


def chunk_failed(where: str, name: str, key: str, data, stored: bytes, got: int, want: int) -> CheckpointError:
    """The error of chunk ``key`` of array ``name`` that failed its check: a file of the wrong
    length (``got`` bytes, ``want`` expected: truncated or extended), or of the right one whose
    bytes ``data`` do not give the CRC32C ``stored`` after them (corrupted)."""
    if got != want:
        return CheckpointError(where, f"array {name!r}: a chunk failed its checksum (truncated or extended: not "
                               "the size its shape makes)", f"{key}: {got} bytes, expected {want}")
    return CheckpointError(where, f"array {name!r}: a chunk failed its checksum (corrupted: its bytes do not give "
                           "the CRC32C stored after them)",
                           f"{key}: CRC32C {crc32c(data):08x} of its bytes, {int.from_bytes(stored, 'little'):08x} stored")


def read_array_region(root: str, name: str, region, info: dict) -> np.ndarray:
    """The slices ``region`` of a plain (not quantized) array; ``info``: its entry in the
    checkpoint's attributes, and the ``separator`` of its chunk keys (format 1: "/", which
    :class:`~tilegraph.io.Checkpoint` adds to it; default: :data:`CHUNK_SEPARATOR`)."""
    chunk_shape = info.get("chunks") or chunks_of(info["tiles"])
    sep = info.get("separator", CHUNK_SEPARATOR)
    dtype = np.dtype(info["dtype"])
    out = np.empty(tuple(hi - lo for lo, hi in region), dtype)
    shards = info.get("shards")
    if not shards and dtype.byteorder != ">" and all(lo % c == 0 and hi - lo == c
                                                      for (lo, hi), c in zip(region, chunk_shape)):
        read_whole_chunk(root, name, [lo // c for (lo, _), c in zip(region, chunk_shape)], out, sep)  # no copy
        return out
    ranges = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(region, chunk_shape)]
    cache: dict = {}  # shard index -> its chunk index
    for idx in itertools.product(*ranges):
        chunk = (read_sharded_chunk(root, name, idx, chunk_shape, shards, dtype, cache, sep) if shards
                 else read_chunk(root, name, idx, chunk_shape, dtype, sep))
        span = [(i * c, i * c + c) for i, c in zip(idx, chunk_shape)]
        inter = [(max(lo, clo), min(hi, chi)) for (lo, hi), (clo, chi) in zip(region, span)]
        out[tuple(slice(lo - rlo, hi - rlo) for (lo, hi), (rlo, _) in zip(inter, region))] = \
            chunk[tuple(slice(lo - clo, hi - clo) for (lo, hi), (clo, _) in zip(inter, span))]
    return out


# --------------------------------------------------------------------------- worker-side writes ----
class Opaque:
    """An argument Dask passes to a task as it is, its items never searched for futures (a
    save's job lists hold thousands of small tuples, and that search, on every submit, took
    20-90 ms of a 0.6 s save). The task reads ``.value``."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def opened(arg):
    """The value an :class:`Opaque` wraps (anything else as it is: a task called here)."""
    return arg.value if isinstance(arg, Opaque) else arg


def write_tiles(value, jobs: Sequence[tuple]) -> dict:
    """Write tiles of ``value`` (a task's result tuple, or one array) into the checkpoint.

    Each job is ``(index or None, root, array path, ((lo, hi), ...), chunk shape, quantization
    or None, tile label)``. Runs on the worker holding ``value``; returns the worker's address and
    the bytes written."""
    written, made = 0, set()
    for job in jobs:
        written += write_job(value, job, made)
    return {"worker": worker_address(), "bytes": written}


def write_values(values: Sequence, jobs: Sequence[Sequence[tuple]]) -> dict:
    """:func:`write_tiles` for several values (task results) at once."""
    written = sum(write_tiles(v, j)["bytes"] for v, j in zip(values, opened(jobs)))
    return {"worker": worker_address(), "bytes": written}


def job_bytes(jobs: Sequence[tuple]) -> int:
    return sum(math.prod(hi - lo for lo, hi in job[3]) for job in jobs)


def write_job(value, job: tuple, made: set | None = None) -> int:
    index, root, name, region, chunk_shape, quant, label = job
    tile = to_host(value if index is None else value[index])
    if quant is not None:
        return write_quantized(root, f"{name}/{label}", tile, quant)
    return write_chunks(root, name, tile, region, chunk_shape, made)


def write_quantized(root: str, path: str, tile: np.ndarray, quant: dict) -> int:
    """Quantize one tile and store its parts as one byte array ``path`` (one file: the parts of
    a tile are small), their layout in its attributes; returns the bytes stored."""
    from tilegraph.io.quantize import quantize

    try:
        q = quantize(np.ascontiguousarray(tile, dtype=np.float32), quant["method"], quant.get("bits"))
    except TileError as e:  # say which parameter and tile (the quantizer sees only an array)
        array, _, label = path.rpartition("/")
        spec = quant["method"] + (f":{quant['bits']}" if quant.get("bits") is not None else "")
        raise CheckpointError(f"tilegraph.io.save_checkpoint({saved_path(root)})",
                              f"array {array!r}, tile {label}: could not quantize it with {spec!r}: {e.what}",
                              e.received) from None
    return write_parts(root, path, *q.to_parts())


def saved_path(root: str) -> str:
    """The checkpoint folder a save's temporary folder ``root`` (``.NAME.tmp-PID-HEX-HOST``, or
    the earlier ``.NAME.tmp-PID-HEX``) becomes."""
    p = Path(root)
    name, sep, _ = p.name.partition(TMP_MARK)
    return str(p.parent / name[1:]) if sep and name.startswith(".") else root


def write_parts(root: str, path: str, arrays, attrs: dict) -> int:
    """Store the parts of one quantized tile (name -> array, in the order given) as one byte
    array ``path``, their layout and the attributes ``attrs`` in its zarr.json; returns the
    bytes stored. :func:`write_quantized` after quantizing, and the copy of a quantized weight
    a model holds (:class:`tilegraph.peft.QuantizedTensor`) as it is."""
    layout, blobs, offset = [], [], 0
    for part, a in arrays.items():
        a = np.ascontiguousarray(a)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        layout.append([part, a.dtype.str, list(a.shape), offset, a.nbytes])
        blobs.append(a.view(np.uint8).reshape(-1))
        offset += a.nbytes
    data = np.concatenate(blobs) if blobs else np.zeros(0, np.uint8)
    shape = (max(1, data.size),)
    write_meta(root, path, array_meta(data.shape, np.uint8, shape, {"quantized": attrs, "parts": layout}))
    if data.size:
        write_chunks(root, path, data, [(0, data.size)], shape)
    return data.nbytes


def write_parts_task(values: Sequence, indices: Sequence, jobs: Sequence[tuple]) -> dict:
    """A save task writing quantized tiles' parts as they are (no quantization): ``jobs`` of
    ``(root, path, part names, first position in values, attrs)``, each tile's parts the next
    ``len(names)`` of ``values`` (task results, with their tuple positions, or arrays)."""
    written = 0
    for root, path, names, start, attrs in opened(jobs):
        parts = {n: to_host(v if i is None else v[i])
                 for n, v, i in zip(names, values[start:start + len(names)], indices[start:start + len(names)])}
        written += write_parts(root, path, parts, attrs)
    return {"worker": worker_address(), "bytes": written}


def quantized_layout(root: str, path: str) -> tuple[dict, dict]:
    """The parts (name -> (dtype, shape)) and attributes of one stored quantized tile, from its
    zarr.json alone (no data read)."""
    where = f"tilegraph.io.load_checkpoint({root})"
    try:
        attrs = json.loads(Path(root, path, "zarr.json").read_text()).get("attributes") or {}
        parts = {part: (np.dtype(dtype), tuple(shape)) for part, dtype, shape, _, _ in attrs["parts"]}
        return parts, dict(attrs["quantized"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(where, f"array {path!r}: a readable zarr.json of a quantized tile",
                              f"{type(e).__name__}: {e}") from None


def read_parts_task(root: str, jobs: Sequence[tuple]) -> tuple:
    """The parts of several quantized tiles, as stored (not dequantized): ``jobs`` of ``(path,
    part names)``; one flat tuple, each tile's parts in the order of its names."""
    out = []
    for path, names in jobs:
        parts, _ = quantized_parts(root, path)
        out += [parts[n] for n in names]
    return tuple(out)


def quantized_parts(root: str, path: str):
    """The parts and attributes of one quantized tile (its checksum verified)."""
    where = f"tilegraph.io.load_checkpoint({root})"
    try:
        meta = json.loads(Path(root, path, "zarr.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(where, f"array {path!r}: a readable zarr.json", f"{type(e).__name__}: {e}") from None
    attrs = meta.get("attributes") or {}
    size = int(meta["shape"][0])
    sep = ((meta.get("chunk_key_encoding") or {}).get("configuration") or {}).get("separator", "/")
    data = read_chunk(root, path, (0,), (max(1, size),), np.dtype(np.uint8), sep)[:size] if size else np.zeros(0, np.uint8)
    parts = {}
    for part, dtype, shape, offset, nbytes in attrs["parts"]:
        parts[part] = data[offset:offset + nbytes].view(np.dtype(dtype)).reshape(shape)
    return parts, dict(attrs["quantized"])


def worker_address() -> str | None:
    import sys

    if "distributed" not in sys.modules:  # not on a Dask worker
        return None
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:
        return None


# ---------------------------------------------------------------------------- worker-side reads ----
def read_region(root: str, name: str, region, info: dict) -> np.ndarray:
    """The slices ``region`` of checkpoint array ``name`` (dequantized, when it is stored
    quantized), as a C-ordered array of the stored dtype; every chunk's checksum is verified."""
    if info.get("quantized") is None:
        return read_array_region(root, name, region, info)
    try:
        return read_quantized(root, name, region, info)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"tilegraph.io.load_checkpoint({root})", f"array {name!r}: could not decode a "
                              "quantized tile", f"{type(e).__name__}: {e}") from None


def read_quantized(root: str, name: str, region, info: dict) -> np.ndarray:
    from tilegraph.io.quantize import QuantizedArray

    chunks = info["tiles"]
    out = np.empty(tuple(hi - lo for lo, hi in region), dtype=np.dtype(info["dtype"]))
    for idx in np.ndindex(*[len(c) for c in chunks]):
        tile = slices(chunks, idx)
        inter = [(max(lo, tlo), min(hi, thi)) for (lo, hi), (tlo, thi) in zip(region, tile)]
        if any(lo >= hi for lo, hi in inter):
            continue
        values = QuantizedArray.from_parts(*quantized_parts(root, f"{name}/{tile_label(idx)}")).dequantize()
        src = tuple(slice(lo - tlo, hi - tlo) for (lo, hi), (tlo, _) in zip(inter, tile))
        dst = tuple(slice(lo - rlo, hi - rlo) for (lo, hi), (rlo, _) in zip(inter, region))
        out[dst] = values[src]
    return out


def read_regions(root: str, jobs: Sequence[tuple]) -> tuple:
    """Several regions at once (one task per group of tiles): ``jobs`` of ``(name, region, info,
    dtype)``, each region as ``dtype`` (a model of another dtype than the stored one: the worker
    casts what it reads; no copy where the dtypes agree)."""
    return tuple(np.asarray(read_region(root, name, region, info), dtype=np.dtype(dtype))
                 for name, region, info, dtype in jobs)


def tile_label(idx: Sequence[int]) -> str:
    return "t" + ".".join(str(int(i)) for i in idx) if len(idx) else "t"
