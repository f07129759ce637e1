"""The safetensors format with NumPy alone: read (memory-mapped), write, and sharded folders.

A file is an 8-byte little-endian header length N, N bytes of JSON, then the raw tensor bytes::

    {"__metadata__": {"format": "pt"},
     "wte.weight": {"dtype": "F32", "shape": [50257, 768], "data_offsets": [0, 154389504]}, ...}

where ``data_offsets`` are [begin, end) byte offsets into the data that follows the header.
Tensors are little-endian and C-ordered. Reading maps the file and returns views into it (no copy)
except for BF16, which NumPy lacks and which is widened to float32. Nothing is ever unpickled.

A sharded checkpoint is a folder with ``model.safetensors.index.json``, whose ``weight_map`` says
which shard file holds each tensor.

>>> import numpy as np, tempfile, os
>>> from tilegraph.io.safetensors import load_file, save_file
>>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
>>> save_file({"w": np.eye(2, dtype=np.float32)}, path)
>>> load_file(path)["w"].tolist()
[[1.0, 0.0], [0.0, 1.0]]
"""

from __future__ import annotations

import json
import math
import os
import reprlib
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Iterator

import numpy as np

from tilegraph._errors import TileError

from ._store import user_path

__all__ = ["DTYPES", "TensorInfo", "SafetensorsFile", "Checkpoint", "load_file", "save_file", "open_checkpoint",
           "save_checkpoint", "INDEX_NAME", "SINGLE_NAME"]

#: safetensors dtype name -> NumPy dtype of the stored bytes (BF16 is read as raw 16-bit words)
DTYPES = {
    "BOOL": np.dtype("?"), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"), "I64": np.dtype("<i8"), "F64": np.dtype("<f8"),
}
_NAMES = {np.dtype(v).newbyteorder("=").str: k for k, v in DTYPES.items() if k != "BF16"}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit; a larger length means a corrupt file
_MAX_NDIM = 32  # NumPy's historical limit; a longer shape is crafted, and its product would be slow to take

class _Brief(reprlib.Repr):
    def repr_int(self, x, level):  # Python refuses to print ints of over 4300 digits
        return f"<an int of {x.bit_length()} bits>" if x.bit_length() > 1024 else super().repr_int(x, level)


_BRIEF = _Brief()
_BRIEF.maxstring = _BRIEF.maxother = 80
_BRIEF.maxlevel = 3


def _brief(value) -> str:
    """``repr(value)`` cut short for an error message: long strings and lists are elided and nesting
    stops at three levels, so a crafted value nested a thousand deep neither floods the message nor
    exhausts the recursion limit."""
    return _BRIEF.repr(value)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class TensorInfo:
    """Where one tensor lies in a file: dtype name, shape, [begin, end) in the data section."""

    __slots__ = ("dtype", "shape", "begin", "end")

    def __init__(self, dtype: str, shape: tuple[int, ...], begin: int, end: int):
        self.dtype, self.shape, self.begin, self.end = dtype, shape, begin, end

    @property
    def numpy_dtype(self) -> np.dtype:
        """The dtype a read returns (float32 for BF16)."""
        return np.dtype(np.float32) if self.dtype == "BF16" else DTYPES[self.dtype]

    def __repr__(self) -> str:
        return f"TensorInfo({self.dtype}, {self.shape}, [{self.begin}, {self.end}))"


def _parse_header(raw: bytes, data_len: int, where: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # ValueError: bad JSON, or an int of over 4300 digits
        raise TileError(where, "the header is not valid UTF-8 JSON", str(e)) from None
    except RecursionError:  # arrays or objects nested about a thousand deep
        raise TileError(where, "the header is not valid safetensors JSON: it nests too deeply",
                        f"a {len(raw)}-byte header") from None
    if not isinstance(header, dict):
        raise TileError(where, "the header must be a JSON object", type(header).__name__)
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise TileError(where, "__metadata__ must map strings to strings", _brief(metadata))
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise TileError(where, f"tensor {name!r} needs exactly dtype, shape and data_offsets", _brief(entry))
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:  # a list or object is not even hashable
            raise TileError(where, f"tensor {name!r} has an unsupported dtype; supported: {', '.join(DTYPES)}",
                            _brief(dtype))
        if (not isinstance(shape, list) or len(shape) > _MAX_NDIM
                or not all(type(s) is int and s >= 0 for s in shape)):
            raise TileError(where, f"the shape of tensor {name!r} must be a list of at most {_MAX_NDIM} "
                            "non-negative ints", _brief(shape))
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_len):
            raise TileError(where, f"data_offsets of tensor {name!r} must be [begin, end] with "
                            f"0 <= begin <= end <= {data_len} (the data size)", _brief(offsets))
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise TileError(where, f"tensor {name!r} of {dtype} {tuple(shape)} needs {nbytes} bytes",
                            f"data_offsets {offsets} ({offsets[1] - offsets[0]} bytes)")
        infos[name] = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
    spans = sorted((i.begin, i.end, n) for n, i in infos.items() if i.end > i.begin)
    for (a_begin, a_end, a), (b_begin, b_end, b) in zip(spans, spans[1:]):
        if b_begin < a_end:
            raise TileError(where, "tensors must not overlap",
                            f"{a!r} at [{a_begin}, {a_end}) and {b!r} at [{b_begin}, {b_end})")
    return infos, metadata


class SafetensorsFile(Mapping):
    """One .safetensors file as a read-only mapping name -> array, read lazily through a memory map.

    ``infos`` holds every tensor's dtype and shape from the header alone, so checks need no data.
    """

    def __init__(self, path):
        self.path = user_path(path, "tilegraph.io.safetensors")
        where = f"tilegraph.io.safetensors({self.path})"
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise TileError(where, "a safetensors file starts with an 8-byte header length",
                                    f"a file of {size} bytes")
                n = int.from_bytes(head, "little")
                if n > min(_MAX_HEADER, size - 8):
                    raise TileError(where, f"the header length must fit the file ({size - 8} bytes after it) "
                                    f"and the format's {_MAX_HEADER}-byte limit", f"{n}")
                raw = f.read(n)
        except OSError as e:
            raise TileError(where, "cannot read the file", str(e)) from None
        self._data_start = 8 + n
        self._data_len = size - 8 - n
        self.infos, self.metadata = _parse_header(raw, self._data_len, where)
        self._map = None

    def _data(self):
        if self._map is None:
            if self._data_len == 0:
                self._map = np.zeros(0, np.uint8)
            else:
                self._map = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start,
                                      shape=(self._data_len,))
        return self._map

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.infos[name]
        raw = self._data()[info.begin:info.end]
        array = np.frombuffer(raw, dtype=DTYPES[info.dtype]).reshape(info.shape)
        if info.dtype == "BF16":  # bfloat16 is the top half of a float32
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self)} tensors)"


def load_file(path) -> dict[str, np.ndarray]:
    """Every tensor of a .safetensors file (views of a read-only memory map; BF16 as float32)."""
    f = SafetensorsFile(path)
    return {name: f[name] for name in f}


def _encode(tensors: Mapping[str, np.ndarray], where: str) -> tuple[list[tuple[str, np.ndarray]], int]:
    out, bad = [], []
    for name in sorted(tensors, key=str):
        if not isinstance(name, str) or name == "__metadata__":
            bad.append(f"{name!r} (not a tensor name)")
            continue
        a = np.asarray(tensors[name])
        if a.dtype.newbyteorder("=").str not in _NAMES:
            bad.append(f"{name} ({a.dtype})")
            continue
        # astype, not ascontiguousarray: that one turns a 0-d array into shape (1,)
        out.append((name, a.astype(a.dtype.newbyteorder("<"), order="C", copy=False)))
    if bad:
        raise TileError(where, f"tensors must be named by strings and have one of the dtypes "
                        f"{', '.join(k for k in DTYPES if k != 'BF16')}", ", ".join(bad))
    return out, sum(a.nbytes for _, a in out)


def _write(arrays: list[tuple[str, np.ndarray]], path: Path, metadata: dict | None) -> None:
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, a in arrays:
        header[name] = {"dtype": _NAMES[a.dtype.newbyteorder("=").str], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)  # pad so that the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data if a.size else b"")


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")


def save_file(tensors: Mapping[str, np.ndarray], path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> array) to ``path``; written under a temporary name, then renamed."""
    path = user_path(path, "tilegraph.io.safetensors.save_file")
    where = f"tilegraph.io.safetensors.save_file({path})"
    if path.name in ("", "..") or path.is_dir():  # os.replace onto a folder fails with a bare OSError
        raise TileError(where, "the path of a file to write, not a folder", str(path))
    arrays, _ = _encode(tensors, where)
    tmp = _tmp_name(path)
    try:
        _write(arrays, tmp, metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# -------------------------------------------------------------------------- sharded folders ----
class Checkpoint(Mapping):
    """The tensors of a folder: sharded through ``model.safetensors.index.json``, or one
    ``model.safetensors``, or a single .safetensors file given directly."""

    def __init__(self, path):
        path = user_path(path, "tilegraph.io.safetensors.open_checkpoint")
        where = f"tilegraph.io.safetensors.open_checkpoint({path})"
        self.path = path
        self._where: dict[str, str] = {}
        self.files: dict[str, SafetensorsFile] = {}
        if path.is_file():
            self._add_file(path, None, where)
        elif (path / INDEX_NAME).is_file():
            self._from_index(path, where)
        elif (path / SINGLE_NAME).is_file():
            self._add_file(path / SINGLE_NAME, None, where)
        else:
            raise TileError(where, f"expected a .safetensors file or a folder with {INDEX_NAME} or {SINGLE_NAME}",
                            "none found" if path.exists() else "the path does not exist")

    def _from_index(self, folder: Path, where: str) -> None:
        try:
            index = json.loads((folder / INDEX_NAME).read_text())
            weight_map = index["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise TileError(where, f"{INDEX_NAME} must be JSON with a weight_map object",
                            f"{folder / INDEX_NAME}: {type(e).__name__}: {str(e)[:200]}") from None
        if not isinstance(weight_map, dict):  # not an assert: python -O drops those
            raise TileError(where, f"{INDEX_NAME} must be JSON with a weight_map object",
                            f"{folder / INDEX_NAME}: weight_map is {_brief(weight_map)}")
        bad = {name: file for name, file in weight_map.items() if not isinstance(file, str)}
        if bad:
            raise TileError(where, f"the weight_map of {INDEX_NAME} must map tensor names to shard file names",
                            ", ".join(f"{name!r}: {_brief(file)}" for name, file in list(bad.items())[:5]))
        by_file: dict[str, set] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, set()).add(name)
        problems = []
        for file, names in sorted(by_file.items()):
            if Path(file).name != file or not (folder / file).is_file():
                problems.append(f"shard {file!r} is missing or not a plain file name")
                continue
            f = self._add_file(folder / file, names, where)
            missing = sorted(names - set(f.infos))
            if missing:
                problems.append(f"{file} lacks {', '.join(missing)}")
        if problems:
            raise TileError(where, f"{INDEX_NAME} does not match its shards", "; ".join(problems))

    def _add_file(self, file: Path, names, where: str) -> SafetensorsFile:
        f = SafetensorsFile(file)
        self.files[file.name] = f
        for name in (f.infos if names is None else names):
            if name in f.infos:
                if name in self._where:
                    raise TileError(where, f"tensor {name!r} appears in two files", f"{self._where[name]}, {file.name}")
                self._where[name] = file.name
        return f

    def info(self, name: str) -> TensorInfo:
        return self.files[self._where[name]].infos[name]

    def file_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.files[self._where[name]].path

    def __getitem__(self, name: str) -> np.ndarray:
        return self.files[self._where[name]][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __repr__(self) -> str:
        n = len(self.files)
        return f"Checkpoint({str(self.path)!r}, {len(self)} tensors in {n} file{'' if n == 1 else 's'})"


def open_checkpoint(path) -> Checkpoint:
    """The tensors of a safetensors file or of a (possibly sharded) model folder, read lazily."""
    return Checkpoint(path)


def _check_shard_bytes(where: str, max_shard_bytes) -> None:
    # "1MB" or 1.5 met a raw TypeError in the comparison, or sharded by a float
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(
            max_shard_bytes, (int, np.integer)) or max_shard_bytes <= 0):
        raise TileError(where, "max_shard_bytes must be a positive int (bytes) or None", _brief(max_shard_bytes))


def save_checkpoint(tensors: Mapping[str, np.ndarray], folder, *, max_shard_bytes: int | None = None,
                    metadata: dict[str, str] | None = None) -> list[str]:
    """Write ``tensors`` into an existing ``folder``: one ``model.safetensors``, or, when they exceed
    ``max_shard_bytes``, shards ``model-00001-of-0000N.safetensors`` and an index. Returns the files."""
    folder = Path(folder)
    where = f"tilegraph.io.safetensors.save_checkpoint({folder})"
    arrays, total = _encode(tensors, where)
    _check_shard_bytes(where, max_shard_bytes)
    shards: list[list] = [[]]
    size = 0
    for name, a in arrays:  # greedy in name order; a tensor larger than the limit gets a shard alone
        if max_shard_bytes is not None and shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, a))
        size += a.nbytes
    # transformers 4.x refuses shards whose metadata carries no known "format" tag
    meta = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        save_file(dict(arrays), folder / SINGLE_NAME, meta)
        return [SINGLE_NAME]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        save_file(dict(shard), folder / file, meta)
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, s in zip(files, shards) for n, _ in s}}
    tmp = _tmp_name(folder / INDEX_NAME)
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
    os.replace(tmp, folder / INDEX_NAME)
    return files + [INDEX_NAME]
