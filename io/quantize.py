"""Array quantizers for checkpoints: casts, block-absmax integers, scalar k-means and Kashin.

:func:`quantize` turns a float array into a :class:`QuantizedArray`, whose
:meth:`~QuantizedArray.dequantize` gives float32 back. Methods (``bits`` each accepts):

- ``"fp16"`` (16), ``"bf16"`` (16): casts; bf16 is stored as uint16, rounded to nearest even.
- ``"int8"`` (8), ``"int4"`` (4): symmetric absmax with one scale per ``block`` rows of a column
  (blocks run along dim 0, the input dim of a ``(in, out)`` weight); int4 packs two codes a byte.
  Scales are float16 relative to one float32 maximum: 4.25 bits an entry at block 64.
- ``"kmeans"`` (1-8): one scalar codebook of ``2**bits`` float32 values per array (1-D Lloyd).
- ``"kashin"`` (2-6): the Kashin representation ``X = U + Q1 V_hat Q2^T`` (arXiv:2404.09737)
  with each pair ``(U_ij, V_hat_ij)`` coded jointly by a 2-D k-means codebook of ``2**bits``
  points, per array or per ``tile``.
- ``"auto"``: tries every method of the bit budget (16: fp16, bf16; 8: int8, kmeans; 4: int4,
  kashin, kmeans; 2, 3, 5, 6: kashin, kmeans; 7: kmeans) and keeps the lowest relative
  Frobenius error; the errors measured are kept in ``attrs["auto"]``.

A :class:`QuantizedArray` is plain parts, never pickled: :meth:`~QuantizedArray.to_parts` gives
numeric NumPy arrays and JSON-able attributes, :meth:`~QuantizedArray.from_parts` reads them back
(checking every part against the attributes). :func:`default_method` says which parameters stay
exact (norms, biases, anything not 2-D).

>>> import numpy as np
>>> from tilegraph.io.quantize import quantize
>>> w = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
>>> q = quantize(w, "int4")
>>> q.method, q.bits, q.shape, q.dequantize().dtype
('int4', 4, (256, 128), dtype('float32'))
>>> round(q.nbytes / w.nbytes, 3)  # 4.25 bits an entry plus a few bytes of attributes
0.134
>>> bool(np.linalg.norm(q.dequantize() - w) / np.linalg.norm(w) < 0.12)
True
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np

from tilegraph._config import require_int
from tilegraph._errors import TileError

__all__ = ["METHODS", "QuantizedArray", "quantize", "dequantize", "relative_error", "default_method",
           "kashin_decompose", "kashin_reconstruct", "KashinNotConverged"]

FORMAT = 1  # version of the parts layout, stored in the attributes


class _Spec(NamedTuple):
    bits: tuple[int, ...]  # the bit widths the method accepts
    default: int | None  # bits when none are given (None: bits are required)
    ndims: tuple[int, ...] | None  # array ranks accepted (None: any)


_SPECS: dict[str, _Spec] = {
    "fp16": _Spec((16,), 16, None),
    "bf16": _Spec((16,), 16, None),
    "int8": _Spec((8,), 8, (1, 2)),
    "int4": _Spec((4,), 4, (1, 2)),
    "kmeans": _Spec(tuple(range(1, 9)), 4, None),
    "kashin": _Spec(tuple(range(2, 7)), 4, (1, 2)),
    "auto": _Spec((2, 3, 4, 5, 6, 7, 8, 16), None, (1, 2)),
}
#: the method names :func:`quantize` accepts
METHODS: tuple[str, ...] = tuple(_SPECS)
TRANSFORMS = ("dct", "qr")
_MAX_ITER_CAP = 6000  # a cap on the iterations, raised up to 6000 for slow convergers


class KashinNotConverged(RuntimeWarning):
    """The Kashin decomposition reached ``max_iter`` before its residual fell under ``tol``."""


# ======================================================================= the quantized array ====
@dataclass(frozen=True, eq=False)
class QuantizedArray:
    """A quantized array: which method made it, the original shape and dtype, and its parts.

    ``parts`` are numeric NumPy arrays; ``meta`` holds the method's JSON-able attributes
    (block, scale maximum, transform, tiles, ...). Build one with :func:`quantize` or
    :meth:`from_parts`.
    """

    method: str
    bits: int
    shape: tuple[int, ...]
    dtype: str  # the dtype of the array that was quantized; dequantize() gives float32
    parts: Mapping[str, np.ndarray] = field(repr=False)
    meta: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def dequantize(self) -> np.ndarray:
        """The array as float32, in its original shape."""
        out = _DECODERS[self.method](self.parts, self.meta, self.shape, self.bits)
        return out.astype(np.float32, copy=False).reshape(self.shape)

    def to_parts(self) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """``(arrays, attrs)``: numeric arrays by part name and JSON-serializable attributes."""
        attrs = {"format": FORMAT, "method": self.method, "bits": self.bits, "shape": list(self.shape),
                 "dtype": self.dtype, **_jsonable(dict(self.meta))}
        return {k: np.asarray(v) for k, v in self.parts.items()}, attrs

    @classmethod
    def from_parts(cls, arrays: Mapping[str, Any], attrs: Mapping[str, Any]) -> QuantizedArray:
        """Rebuild from :meth:`to_parts` output; every mismatch between parts and attributes is
        reported at once."""
        where = "tilegraph.io.QuantizedArray.from_parts"
        attrs = dict(attrs)
        problems = []
        for key in ("method", "bits", "shape", "dtype"):
            if key not in attrs:
                problems.append(f"attribute {key!r} is missing")
        if problems:
            raise TileError(where, "the attributes are incomplete: " + "; ".join(problems), repr(sorted(attrs)))
        method, bits = attrs.pop("method"), attrs.pop("bits")
        shape, dtype = attrs.pop("shape"), attrs.pop("dtype")
        fmt = attrs.pop("format", FORMAT)
        if fmt != FORMAT:
            problems.append(f"format {fmt!r} is not the one this version reads ({FORMAT})")
        if method not in _SPECS or method == "auto":
            raise TileError(where, f"unknown method; expected one of {list(_DECODERS)}", repr(method))
        if isinstance(bits, bool) or not (isinstance(bits, int) and bits in _SPECS[method].bits):
            problems.append(f"bits {bits!r} is not one of {list(_SPECS[method].bits)} for {method!r}")
        if not (isinstance(shape, (list, tuple)) and all(isinstance(s, int) and s >= 0 for s in shape)):
            problems.append(f"shape {shape!r} is not a list of non-negative integers")
        if not isinstance(dtype, str):
            problems.append(f"dtype {dtype!r} is not a dtype name")
        arrays = {k: np.asarray(v) for k, v in arrays.items()}
        for name, a in arrays.items():
            if a.dtype.kind not in "uif":
                problems.append(f"part {name!r} has the non-numeric dtype {a.dtype}")
        if problems:
            raise TileError(where, "the parts do not describe a quantized array: " + "; ".join(problems))
        shape = tuple(shape)
        problems = _CHECKERS[method](arrays, attrs, shape, bits)
        if problems:
            raise TileError(where, f"the parts do not match the {method!r} attributes: " + "; ".join(problems),
                            f"parts {{{', '.join(f'{k}: {a.dtype}{list(a.shape)}' for k, a in arrays.items())}}}")
        return cls(method, bits, shape, str(dtype), arrays, attrs)

    @property
    def nbytes(self) -> int:
        """Storage bytes: every part plus the attributes as compact JSON."""
        arrays, attrs = self.to_parts()
        meta = len(json.dumps(attrs, separators=(",", ":"), sort_keys=True).encode())
        return sum(a.nbytes for a in arrays.values()) + meta

    @property
    def unquantized_tiles(self) -> list[int]:
        """Kashin only: the tiles kept exact (float32) because the decomposition did not converge."""
        return list(self.meta.get("unconverged", []))

    def __repr__(self) -> str:
        return f"QuantizedArray({self.method}, bits={self.bits}, shape={self.shape}, dtype={self.dtype})"


def dequantize(q: QuantizedArray) -> np.ndarray:
    """``q.dequantize()``: the array as float32."""
    if not isinstance(q, QuantizedArray):
        raise TileError("tilegraph.io.dequantize", "expected a QuantizedArray", type(q).__name__)
    return q.dequantize()


def relative_error(array, q) -> float:
    """``||array - q||_F / ||array||_F`` (0 when both are zero), q a QuantizedArray or an array."""
    x = np.asarray(array, dtype=np.float64)
    y = q.dequantize() if isinstance(q, QuantizedArray) else np.asarray(q)
    num = float(np.linalg.norm((x - y.astype(np.float64)).ravel()))
    den = float(np.linalg.norm(x.ravel()))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


# ====================================================================================== quantize ====
def method_bits(method, bits, where: str, error: type[TileError] = TileError) -> int:
    """The bit budget of ``method`` (its default where ``bits`` is None), or ``error`` naming an
    unknown method or a budget it does not take."""
    if not isinstance(method, str) or method not in _SPECS:
        raise error(where, f"unknown method; expected one of {list(METHODS)}", repr(method))
    spec = _SPECS[method]
    if bits is None:
        if spec.default is None:
            raise error(where, f"method {method!r} needs a bit budget, one of {list(spec.bits)}: "
                        f"quantize(x, {method!r}, 4), or '{method}:4' as a checkpoint's quantize (save_checkpoint, "
                        "tilegraph convert --quantize)",
                        "None")
        return spec.default
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise error(where, "bits must be an integer", repr(bits))
    if int(bits) not in spec.bits:
        raise error(where, f"bits out of range for method {method!r}; expected one of {list(spec.bits)}", str(bits))
    return int(bits)


def quantize(array, method: str, bits: int | None = None, *, block: int = 64, seed: int = 0,
             transform: str = "dct", tile: int | tuple[int, int] | None = None, tol: float = 1e-6,
             max_iter: int = 200) -> QuantizedArray:
    """Quantize a float array with ``method`` at ``bits`` bits (see the module docstring).

    - ``block``: rows per scale for int8/int4 (blocks run along dim 0; 1-D arrays are a column).
    - ``seed``: k-means sampling and restarts, and the "qr" transform's Gaussian matrices.
    - ``transform``, ``tile``, ``tol``, ``max_iter``: Kashin only. ``transform`` is "dct" (the
      default) or "qr"; ``tile`` an int or (rows, cols) gives each tile its own decomposition and
      codebook (None: one for the whole array). A tile whose decomposition does not converge in
      ``max_iter`` iterations is stored exact as float32, listed in ``unquantized_tiles``, and a
      :class:`KashinNotConverged` warning says so.

    >>> import numpy as np
    >>> x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    >>> q = quantize(x, "int8", block=2)
    >>> q.parts["q"].dtype, q.parts["scales"].shape
    (dtype('int8'), (2, 3))
    >>> bool(np.abs(q.dequantize() - x).max() < 1 / 127)
    True
    """
    where = "tilegraph.io.quantize"
    bits = method_bits(method, bits, where)
    spec = _SPECS[method]
    x = _check_array(array, where, method, spec)
    require_int(where, "block", block, 1)
    require_int(where, "seed", seed, 0)
    if transform not in TRANSFORMS:
        raise TileError(where, f"unknown Kashin transform; expected one of {list(TRANSFORMS)}", repr(transform))
    tile = _check_tile(tile, where)
    _check_tol(tol, max_iter, where)
    opts = dict(block=int(block), seed=int(seed), transform=transform, tile=tile, tol=float(tol),
                max_iter=int(max_iter))
    if method == "auto":
        return _auto(x, bits, opts)
    parts, meta = _ENCODERS[method](x, bits, opts)
    return QuantizedArray(method, bits, tuple(x.shape), str(x.dtype), parts, meta)


def _check_array(array, where: str, method: str, spec: _Spec) -> np.ndarray:
    x = np.asarray(array)
    if x.dtype.kind != "f" or x.dtype.itemsize > 8:
        raise TileError(where, "the array must have a float dtype (float16, float32 or float64)",
                        f"dtype {x.dtype}")
    if spec.ndims is not None and x.ndim not in spec.ndims:
        raise TileError(where, f"method {method!r} takes a {' or '.join(f'{d}-D' for d in spec.ndims)} array",
                        f"shape {x.shape} ({x.ndim}-D)")
    if method not in ("fp16", "bf16") and x.size == 0:
        raise TileError(where, f"method {method!r} cannot quantize an empty array (store it exact)",
                        f"shape {x.shape}")
    if not np.isfinite(x).all():
        bad = int(np.size(x) - np.count_nonzero(np.isfinite(x)))
        raise TileError(where, "the array has non-finite values (NaN or inf)", f"{bad} of {x.size} entries")
    if x.dtype == np.float64 and x.size and float(np.abs(x).max()) > float(np.finfo(np.float32).max):
        raise TileError(where, "the array has values beyond float32's range (dequantize gives float32)",
                        f"max |value| {float(np.abs(x).max()):g}")
    return x


def _check_tile(tile, where: str) -> tuple[int, int] | None:
    if tile is None:
        return None
    pair = (tile, tile) if isinstance(tile, (int, np.integer)) and not isinstance(tile, bool) else tile
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 1 for t in pair)):
        raise TileError(where, "tile must be None, a positive int or a (rows, cols) pair of them", repr(tile))
    return int(pair[0]), int(pair[1])


def _check_tol(tol, max_iter, where: str) -> None:
    if not (isinstance(tol, (int, float, np.floating)) and not isinstance(tol, bool) and 0 < tol < 1):
        raise TileError(where, "tol must be a number in (0, 1)", repr(tol))
    require_int(where, "max_iter", max_iter, 1, _MAX_ITER_CAP)


def _jsonable(value):
    """Attributes as plain Python (NumPy scalars -> int/float, tuples -> lists)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def _as_matrix(x: np.ndarray) -> np.ndarray:
    """A 1-D array as a column (n, 1); 2-D as is."""
    return x.reshape(-1, 1) if x.ndim == 1 else x


# ============================================================================== auto selection ====
def _auto_candidates(bits: int) -> tuple[str, ...]:
    if bits == 16:
        return ("fp16", "bf16")
    return tuple(m for m in ("int8", "int4", "kashin", "kmeans") if bits in _SPECS[m].bits)


def _auto(x: np.ndarray, bits: int, opts: dict) -> QuantizedArray:
    errors: dict[str, float] = {}
    skipped: dict[str, str] = {}
    best: QuantizedArray | None = None
    for method in _auto_candidates(bits):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", KashinNotConverged)
                parts, meta = _ENCODERS[method](x, bits, opts)
        except TileError as e:  # e.g. fp16 overflow: that candidate is out, the others stay
            skipped[method] = str(e)
            continue
        if meta.get("unconverged"):  # tiles kept exact would win on error while breaking the budget
            skipped[method] = f"Kashin did not converge in max_iter={opts['max_iter']} for tiles {meta['unconverged']}"
            continue
        q = QuantizedArray(method, bits, tuple(x.shape), str(x.dtype), parts, meta)
        errors[method] = relative_error(x, q)
        if best is None or errors[method] < errors[best.method]:
            best = q
    if best is None:
        raise TileError("tilegraph.io.quantize", f"no 'auto' candidate at {bits} bits could quantize the array",
                        "; ".join(skipped.values()))
    meta = dict(best.meta, auto={"bits": bits, "errors": errors, "skipped": skipped})
    return QuantizedArray(best.method, best.bits, best.shape, best.dtype, best.parts, meta)


# ===================================================================================== casts ====
_FP16_MAX = float(np.finfo(np.float16).max)
_F32_MAX = float(np.finfo(np.float32).max)


def _encode_fp16(x, bits, opts):
    with np.errstate(over="ignore"):  # overflow is checked just below
        data = x.astype(np.float16)
    if not np.isfinite(data).all():  # past 65504 a value would become inf: refuse rather than store it
        raise TileError("tilegraph.io.quantize", f"method 'fp16': values exceed float16's range (+-{_FP16_MAX:g}); "
                        "use 'bf16'", f"max |value| {float(np.abs(x).max()):g}")
    return {"data": data}, {}


def _decode_fp16(parts, meta, shape, bits):
    return parts["data"].astype(np.float32)


def _bf16_bits(x32: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest, ties to even."""
    u = np.ascontiguousarray(x32, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = u + 0x7FFF + ((u >> 16) & 1)  # uint64: the carry out of a huge value cannot wrap
    return (u >> 16).astype(np.uint16)


def _encode_bf16(x, bits, opts):
    # float64 input goes through float32 first (dequantize gives float32 anyway); finite input only
    data = _bf16_bits(x.astype(np.float32))
    if np.any((data & 0x7FFF) == 0x7F80):
        raise TileError("tilegraph.io.quantize", "method 'bf16': values round past bfloat16's range",
                        f"max |value| {float(np.abs(x).max()):g}")
    return {"data": data}, {}


def _decode_bf16(parts, meta, shape, bits):
    return (parts["data"].astype(np.uint32) << 16).view(np.float32)


def _check_cast(arrays, attrs, shape, bits, dtype):
    return _expect(arrays, {"data": (dtype, shape)}) + _no_extra(attrs, ())


# ===================================================================== block absmax int8/int4 ====
def _block_scales(x2: np.ndarray, qmax: int, block: int) -> tuple[np.ndarray, float, np.ndarray]:
    """Per (block of rows, column) scales: float16 relative values, the float32 maximum, and the
    float32 scales actually used (their product), each >= absmax / qmax so nothing clips."""
    n, m = x2.shape
    nb = -(-n // block)
    padded = np.zeros((nb * block, m), np.float64)
    padded[:n] = x2
    amax = np.abs(padded.reshape(nb, block, m)).max(axis=1)  # (nb, m)
    need = amax / qmax
    top = float(need.max())
    smax = np.float32(top) if top > 0 else np.float32(1.0)
    if float(smax) < top:  # float(): NumPy 2 compares np.float32 with a Python float in float32
        smax = np.nextafter(smax, np.float32(np.inf))
    rel = need / float(smax)  # in [0, 1]
    rel16 = rel.astype(np.float16)
    low = rel16.astype(np.float64) < rel  # float16 rounded down: step up one ulp so the scale covers
    rel16[low] = np.nextafter(rel16[low], np.float16(np.inf))
    return rel16, float(smax), _effective_scales(rel16, float(smax))


def _effective_scales(rel16: np.ndarray, smax: float) -> np.ndarray:
    return np.float32(smax) * rel16.astype(np.float32)  # (nb, m) float32, same on encode and decode


def _rows(scales: np.ndarray, block: int, n: int) -> np.ndarray:
    return np.repeat(scales, block, axis=0)[:n]  # (n, m): each row's scale


def _encode_absmax(x, bits, opts):
    qmax = 2 ** (bits - 1) - 1  # symmetric: int8 [-127, 127], int4 [-7, 7]
    x2 = _as_matrix(x).astype(np.float64)
    rel16, smax, eff = _block_scales(x2, qmax, opts["block"])
    s = _rows(eff, opts["block"], x2.shape[0]).astype(np.float64)
    safe = np.where(s > 0, s, 1.0)
    q = np.clip(np.rint(x2 / safe), -qmax, qmax).astype(np.int8)
    if bits == 8:
        stored = q.reshape(x.shape)
    else:
        stored = _pack_bits((q.ravel() + 8).astype(np.uint8), 4)  # offset binary nibbles, low first
    return {"q": stored, "scales": rel16}, {"block": opts["block"], "scale_max": smax}


def _decode_absmax(parts, meta, shape, bits):
    n, m = _matrix_shape(shape)
    if bits == 8:
        q = parts["q"].reshape(n, m).astype(np.float32)
    else:
        q = _unpack_bits(parts["q"], 4, n * m).astype(np.float32).reshape(n, m) - 8
    eff = _effective_scales(parts["scales"], meta["scale_max"])
    with np.errstate(over="ignore"):  # a code times its scale can round past float32's largest value
        out = q * _rows(eff, meta["block"], n)
    if not np.isfinite(out).all():  # ... where the array held values near it: those, not inf
        np.clip(out, -_F32_MAX, _F32_MAX, out=out)
    return out


def _check_absmax(arrays, attrs, shape, bits):
    problems = _no_extra(attrs, ("block", "scale_max"))
    block, smax = attrs.get("block"), attrs.get("scale_max")
    if not (isinstance(block, int) and block >= 1):
        return problems + [f"attribute 'block' must be a positive int, not {block!r}"]
    if not (isinstance(smax, (int, float)) and math.isfinite(smax) and smax > 0):
        problems.append(f"attribute 'scale_max' must be a positive number, not {smax!r}")
    if len(shape) not in (1, 2):
        return problems + [f"shape {list(shape)} is not 1-D or 2-D"]
    n, m = _matrix_shape(shape)
    want = {"scales": (np.float16, (-(-n // block), m))}
    want["q"] = (np.int8, shape) if bits == 8 else (np.uint8, ((n * m + 1) // 2,))
    return problems + _expect(arrays, want)


def _matrix_shape(shape) -> tuple[int, int]:
    return (shape[0], 1) if len(shape) == 1 else (shape[0], shape[1])


# ============================================================================ scalar k-means ====
def _lloyd_1d(sorted_x: np.ndarray, centers: np.ndarray, max_iter: int = 300) -> tuple[np.ndarray, float]:
    """Exact 1-D Lloyd on sorted data via prefix sums: O(K log N) an iteration."""
    n = sorted_x.size
    csum = np.concatenate([[0.0], np.cumsum(sorted_x)])
    csq = np.concatenate([[0.0], np.cumsum(sorted_x * sorted_x)])
    scale = float(np.abs(sorted_x).max()) or 1.0
    c = np.sort(centers)
    for _ in range(max_iter):
        cuts = np.concatenate([[0], np.searchsorted(sorted_x, (c[:-1] + c[1:]) / 2), [n]])
        cnt = np.diff(cuts)
        sums = csum[cuts[1:]] - csum[cuts[:-1]]
        new = np.where(cnt > 0, sums / np.maximum(cnt, 1), c)  # an empty cell keeps its center
        new = np.sort(new)
        moved = float(np.abs(new - c).max())
        c = new
        if moved <= 1e-12 * scale:
            break
    cuts = np.concatenate([[0], np.searchsorted(sorted_x, (c[:-1] + c[1:]) / 2), [n]])
    lo, hi = cuts[:-1], cuts[1:]
    sse = (csq[hi] - csq[lo]) - 2 * c * (csum[hi] - csum[lo]) + (hi - lo) * c * c
    return c, float(sse.sum())


def _encode_kmeans(x, bits, opts):
    k = 2 ** bits
    v = x.astype(np.float64).ravel()
    xs = np.sort(v)
    inits = [np.quantile(xs, (np.arange(k) + 0.5) / k),  # equal-mass cells: good for heavy tails
             np.linspace(xs[0], xs[-1], k + 2)[1:-1]]  # equal-width cells: good for light tails
    best = min((_lloyd_1d(xs, c) for c in inits), key=lambda t: t[1])[0]
    book = best.astype(np.float32)
    codes = _nearest_1d(v, book)
    return {"codebook": book, "codes": _pack_bits(codes, bits)}, {}


def _nearest_1d(v: np.ndarray, book: np.ndarray) -> np.ndarray:
    order = np.argsort(book, kind="stable")
    b = book[order].astype(np.float64)
    idx = np.searchsorted((b[:-1] + b[1:]) / 2, v)
    return order[idx].astype(np.uint8)


def _decode_kmeans(parts, meta, shape, bits):
    n = math.prod(shape)
    return parts["codebook"][_unpack_bits(parts["codes"], bits, n)]


def _check_kmeans(arrays, attrs, shape, bits):
    n = math.prod(shape)
    return _no_extra(attrs, ()) + _expect(arrays, {"codebook": (np.float32, (2 ** bits,)),
                                                   "codes": (np.uint8, (-(-n * bits // 8),))})


# ============================================================================= bit packing ====
def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Codes < 2**bits, ``bits`` bits each, little-endian within and across bytes."""
    codes = np.ascontiguousarray(codes, dtype=np.uint8).ravel()
    if bits == 8:
        return codes.copy()
    planes = (codes[:, None] >> np.arange(bits, dtype=np.uint8)) & 1  # (N, bits)
    return np.packbits(planes.ravel(), bitorder="little")


def _unpack_bits(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    packed = np.asarray(packed, dtype=np.uint8).ravel()
    if bits == 8:
        return packed[:count].copy()
    planes = np.unpackbits(packed, count=count * bits, bitorder="little").reshape(count, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)


# ===================================================================== orthogonal transforms ====
@lru_cache(maxsize=32)
def _twiddle(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos and sin of pi k / 2n for k < n, and the orthonormal DCT-II scale of each k."""
    theta = np.pi * np.arange(n) / (2 * n)
    scale = np.full(n, math.sqrt(2.0 / n))
    scale[0] = math.sqrt(1.0 / n)
    out = (np.cos(theta), np.sin(theta), scale)
    for a in out:
        a.setflags(write=False)
    return out


def _last(x: np.ndarray, axis: int) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1))


def _dct(x: np.ndarray, axis: int) -> np.ndarray:
    """Orthonormal DCT-II along ``axis`` through one real FFT of length n (Makhoul's reordering:
    X_k = Re(e^{-i pi k / 2n} V_k), V the FFT of the evens followed by the odds reversed, and
    V_k = conj(V_{n-k}) above n/2)."""
    x = _last(x, axis)
    n = x.shape[-1]
    h, half = n // 2 + 1, (n + 1) // 2
    v = np.empty_like(x)
    v[..., :half] = x[..., ::2]
    v[..., half:] = x[..., 1::2][..., ::-1]
    spec = np.fft.rfft(v, axis=-1)  # V_0 .. V_{h-1}
    cos, sin, scale = _twiddle(n)
    re, im = cos * scale, -sin * scale  # scale * e^{-i theta}
    out = np.empty_like(x)
    out[..., :h] = spec.real * re[:h] - spec.imag * im[:h]
    rev = spec[..., n - h:0:-1]  # V_{n-k} = conj(V_k) for k = h .. n-1
    out[..., h:] = rev.real * re[h:] + rev.imag * im[h:]
    return np.moveaxis(out, -1, axis)


def _idct(y: np.ndarray, axis: int) -> np.ndarray:
    """Inverse of :func:`_dct` (orthonormal DCT-III) along ``axis``: with C = Y / scale,
    V_k = e^{i pi k / 2n} (C_k - i C_{n-k}) is Hermitian, so its first half and one inverse real
    FFT give the reordered v back."""
    y = _last(y, axis)
    n = y.shape[-1]
    h, half = n // 2 + 1, (n + 1) // 2
    cos, sin, scale = _twiddle(n)
    ck = y[..., :h] / scale[:h]  # C_k, the unscaled DCT-II
    cflip = np.zeros(y.shape[:-1] + (h,))
    cflip[..., 1:] = y[..., :n - h:-1] * math.sqrt(n / 2.0)  # C_{n-k}, k = 1 .. h-1 (C_n = 0)
    spec = np.empty(y.shape[:-1] + (h,), np.complex128)  # (cos + i sin)(C_k - i C_{n-k})
    spec.real = cos[:h] * ck + sin[:h] * cflip
    spec.imag = sin[:h] * ck - cos[:h] * cflip
    v = np.fft.irfft(spec, n=n, axis=-1)
    out = np.empty_like(v)
    out[..., ::2] = v[..., :half]
    out[..., 1::2] = v[..., half:][..., ::-1]
    return np.moveaxis(out, -1, axis)


@lru_cache(maxsize=8)
def _qr_matrix(n: int, seed: int, axis: int) -> np.ndarray:
    """Q of the QR of a seeded n x n Gaussian, columns signed so diag(R) > 0 (the seed then fixes Q)."""
    if n == 1:
        return np.ones((1, 1))
    g = np.random.default_rng([seed, axis, n]).standard_normal((n, n))
    q, r = np.linalg.qr(g)
    q *= np.where(np.diag(r) < 0, -1.0, 1.0)
    q.setflags(write=False)
    return q


def _along(mat: np.ndarray, x: np.ndarray, axis: int) -> np.ndarray:
    """``mat`` applied to every vector of ``x`` (1-D or 2-D) along ``axis``."""
    return mat @ x if axis == 0 else x @ mat.T


def _transforms(transform: str, seed: int) -> tuple[Callable, Callable]:
    """(forward, inverse) over all axes: forward is Q^T (Y = Q1^T X Q2), inverse is Q."""
    if transform == "dct":
        def fwd(x):
            for a in range(x.ndim):
                x = _dct(x, a)
            return x

        def inv(y):
            for a in range(y.ndim):
                y = _idct(y, a)
            return y
    else:
        def fwd(x):
            for a in range(x.ndim):
                x = _along(_qr_matrix(x.shape[a], seed, a).T, x, a)
            return x

        def inv(y):
            for a in range(y.ndim):
                y = _along(_qr_matrix(y.shape[a], seed, a), y, a)
            return y
    return fwd, inv


# ===================================================================== Kashin decomposition ====
class _Kashin(NamedTuple):
    u: np.ndarray
    v_hat: np.ndarray
    iterations: int
    converged: bool


def _kashin(x: np.ndarray, fwd: Callable, inv: Callable, tol: float, max_iter: int) -> _Kashin:
    """Greedy matching pursuit over {+-1}^N U Q{+-1}^N (Kashin quantization, arXiv:2404.09737).

    V_hat is accumulated directly: each v-step adds c*Q sign(y) to V, i.e. c*sign(y) to Q^T V.
    """
    u = np.zeros_like(x)
    v_hat = np.zeros_like(x)
    r = x.copy()
    target = tol * float(np.linalg.norm(x.ravel()))
    it = 0
    while True:
        rn = float(np.linalg.norm(r.ravel()))
        if rn == 0.0 or rn < target:
            return _Kashin(u, v_hat, it, True)
        if it == max_iter:
            return _Kashin(u, v_hat, it, False)
        y = fwd(r)
        in_u = np.abs(r).sum() > np.abs(y).sum()
        s = np.sign(r) if in_u else np.sign(y)  # sign(0) = 0
        w = s if in_u else inv(s)
        ww = float(np.vdot(w, w))
        if ww == 0.0:  # only when r == 0, caught above; kept as a guard against dividing by 0
            return _Kashin(u, v_hat, it, True)
        c = float(np.vdot(r, w)) / ww  # c first, then the update that uses it
        if in_u:
            u += c * s
        else:
            v_hat += c * s
        r -= c * w
        it += 1


#: a vector whose largest magnitude passes this is scaled before it is decomposed (its squares,
#: summed, stay far from float64's overflow at 1.8e308)
_SAFE_PEAK = 1e100


def kashin_decompose(x, transform: str = "dct", *, tol: float = 1e-6, max_iter: int = 200,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """The Kashin representation of a vector or a matrix: ``(u, v_hat, iterations)``, float64.

    1-D ``x`` (vector form): ``x = u + Q v_hat`` with Q orthogonal N x N. 2-D ``x`` (matrix form):
    ``X = U + Q1 V_hat Q2^T``; X is normalised by its Frobenius norm while decomposing and U, V_hat
    are scaled back, so the identity holds for ``x`` itself. ``transform`` "dct" takes Q^T as the
    orthonormal DCT-II along each dim; "qr" takes Q from the QR of a Gaussian matrix seeded by
    ``(seed, dim, size)`` (measured: as fast as "dct" on Gaussian matrices, ~30 iterations, but
    410-630 iterations on a 96 x 96 Student-t(3) matrix where "dct" needs 49). Stops when
    ``||r|| < tol ||x||``; reaching ``max_iter`` (at most 6000) first raises a
    :class:`KashinNotConverged` warning. :func:`kashin_reconstruct` gives x back.

    >>> import numpy as np
    >>> x = np.random.default_rng(0).standard_normal(1024)
    >>> u, v_hat, it = kashin_decompose(x)
    >>> it < 40, bool(np.linalg.norm(kashin_reconstruct(u, v_hat) - x) < 1e-6 * np.linalg.norm(x))
    (True, True)
    >>> bool(32 * max(np.abs(u).max(), np.abs(v_hat).max()) < 2 * np.linalg.norm(x))
    True
    """
    where = "tilegraph.io.kashin_decompose"
    x = np.asarray(x)
    if x.dtype.kind not in "fiu" or x.dtype == np.bool_:
        raise TileError(where, "x must be a real numeric array", f"dtype {x.dtype}")
    if x.ndim not in (1, 2) or x.size == 0:
        raise TileError(where, "x must be a non-empty 1-D vector or 2-D matrix", f"shape {x.shape}")
    x = x.astype(np.float64)
    if not np.isfinite(x).all():
        raise TileError(where, "x has non-finite values (NaN or inf)",
                        f"{int(x.size - np.count_nonzero(np.isfinite(x)))} of {x.size} entries")
    if transform not in TRANSFORMS:
        raise TileError(where, f"unknown transform; expected one of {list(TRANSFORMS)}", repr(transform))
    _check_tol(tol, max_iter, where)
    require_int(where, "seed", seed, 0)
    fwd, inv = _transforms(transform, int(seed))
    # (the norm computed on x / max|x|: squares of values near 1e308 overflow, and a vector of
    # them decomposed into NaN; a vector is scaled only where its squares would overflow)
    peak = float(np.abs(x).max()) or 1.0
    if x.ndim == 2:
        norm = peak * float(np.linalg.norm(x / peak)) or 1.0
    else:
        norm = peak if peak > _SAFE_PEAK else 1.0
    res = _kashin(x / norm, fwd, inv, float(tol), int(max_iter))
    if not res.converged:
        warnings.warn(f"[{where}] no convergence in max_iter={max_iter} iterations (tol={tol}); "
                      "raise max_iter (up to 6000)", KashinNotConverged, stacklevel=2)
    return res.u * norm, res.v_hat * norm, res.iterations


def kashin_reconstruct(u, v_hat, transform: str = "dct", *, seed: int = 0) -> np.ndarray:
    """``u + Q v_hat`` (1-D) or ``U + Q1 V_hat Q2^T`` (2-D), float64: the inverse of
    :func:`kashin_decompose` for the same ``transform`` and ``seed``."""
    u, v_hat = np.asarray(u, dtype=np.float64), np.asarray(v_hat, dtype=np.float64)
    if u.shape != v_hat.shape or u.ndim not in (1, 2):
        raise TileError("tilegraph.io.kashin_reconstruct", "u and v_hat must be 1-D or 2-D of one shape",
                        f"{u.shape} and {v_hat.shape}")
    if transform not in TRANSFORMS:
        raise TileError("tilegraph.io.kashin_reconstruct", f"unknown transform; expected one of {list(TRANSFORMS)}",
                        repr(transform))
    inv = _transforms(transform, int(seed))[1]
    peak = float(max(np.abs(u).max(initial=0.0), np.abs(v_hat).max(initial=0.0)))
    if peak > _SAFE_PEAK:  # the transform's sums of values near 1e308 would overflow
        return peak * (u / peak + inv(v_hat / peak))
    return u + inv(v_hat)


# =========================================================================== 2-D k-means ====
# k-means: starts are compared on 2**14 points, the best refined on 2**16, polished on all. Three
# starts left 512 x 512 Student-t(3) at 2 bits anywhere in 0.357-0.446 depending on the seed; 16
# starts give 0.357 for every seed, and on the small sample they cost less than 3 on 2**16.
_FIT_POINTS = 1 << 16
_START_POINTS = 1 << 14
_MIN_STARTS, _START_WORK = 4, 128  # max(4, 128 // K) starts: 32 at 2 bits ... 4 at 5 and 6 bits


def _assign_2d(p32: np.ndarray, c: np.ndarray, chunk: int = 1 << 15) -> np.ndarray:
    """Index of the nearest center for each point (float32 points (N, 2)), in chunks so N x K is
    never whole. float32 differences: measured 6x faster than the ||c||^2 - 2 p.c matmul in float64."""
    c32 = c.astype(np.float32)
    idx = np.empty(len(p32), np.intp)
    for lo in range(0, len(p32), chunk):
        blk = p32[lo:lo + chunk]
        d = (blk[:, 0:1] - c32[:, 0]) ** 2  # (chunk, K)
        d += (blk[:, 1:2] - c32[:, 1]) ** 2
        idx[lo:lo + chunk] = d.argmin(axis=1)
    return idx


def _sq_dist(p: np.ndarray, c: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return ((p - c[idx]) ** 2).sum(axis=1)


def _lloyd_2d(p: np.ndarray, c: np.ndarray, max_iter: int) -> tuple[np.ndarray, float]:
    """Lloyd iterations until under 1 point in 10^4 changes center; (centers, distortion)."""
    k = len(c)
    c = c.copy()
    p32 = p.astype(np.float32)
    idx = _assign_2d(p32, c)
    for _ in range(max_iter):
        cnt = np.bincount(idx, minlength=k)
        empty = np.flatnonzero(cnt == 0)
        if empty.size:  # reseed empty centers at the points worst served (if any is not exact)
            dist = _sq_dist(p, c, idx)
            far = np.argsort(dist)[::-1][:empty.size]
            far = far[dist[far] > 0]
            if far.size:
                c[empty[:far.size]] = p[far]
                idx = _assign_2d(p32, c)
                cnt = np.bincount(idx, minlength=k)
        for d in range(2):
            sums = np.bincount(idx, weights=p[:, d], minlength=k)
            c[:, d] = np.where(cnt > 0, sums / np.maximum(cnt, 1), c[:, d])
        new = _assign_2d(p32, c)
        changed = np.count_nonzero(new != idx)
        idx = new
        if changed * 10_000 <= len(p):
            break
    return c, float(_sq_dist(p, c, idx).sum())


def _kmeans_pp(p: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    c = np.empty((k, 2))
    c[0] = p[rng.integers(len(p))]
    d = ((p - c[0]) ** 2).sum(axis=1)
    for i in range(1, k):
        total = d.sum()
        j = rng.choice(len(p), p=d / total) if total > 0 else rng.integers(len(p))
        c[i] = p[j]
        d = np.minimum(d, ((p - c[i]) ** 2).sum(axis=1))
    return c


def _grid_init(p: np.ndarray, bits: int) -> np.ndarray:
    side = 2 ** (bits // 2)  # even bits only: a side x side grid has exactly 2**bits points
    lo, hi = p.min(axis=0), p.max(axis=0)
    t = (np.arange(side) + 0.5) / side
    gx, gy = np.meshgrid(lo[0] + t * (hi[0] - lo[0]), lo[1] + t * (hi[1] - lo[1]), indexing="ij")
    return np.stack([gx.ravel(), gy.ravel()], axis=1)


def _kmeans_2d(p: np.ndarray, bits: int, seed: int) -> np.ndarray:
    """A 2**bits-point codebook for the rows of ``p`` (N, 2). Several starts (a grid over the
    bounding box for even bits, k-means++) run Lloyd on a small sample; the lowest distortion is
    refined on a larger sample, then polished on all points."""
    k = 2 ** bits
    if len(p) <= k:  # a tiny tile: every point is its own center
        return np.concatenate([p, np.repeat(p[:1], k - len(p), axis=0)])
    rng = np.random.default_rng(seed)
    fit = p if len(p) <= _FIT_POINTS else p[rng.choice(len(p), _FIT_POINTS, replace=False)]
    small = fit if len(fit) <= _START_POINTS else fit[rng.choice(len(fit), _START_POINTS, replace=False)]
    # odd bits: a square grid cannot have 2**bits points, so k-means++ only
    starts = [_grid_init(small, bits)] if bits % 2 == 0 else []
    while len(starts) < max(_MIN_STARTS, _START_WORK // k):
        starts.append(_kmeans_pp(small, k, rng))
    best = min((_lloyd_2d(small, c, 50) for c in starts), key=lambda t: t[1])[0]
    if small is not fit:
        best = _lloyd_2d(fit, best, 100)[0]
    if fit is not p:
        best = _lloyd_2d(p, best, 5)[0]
    return best


# ============================================================================ Kashin quantizer ====
def _tile_slices(shape: tuple[int, int], tile: tuple[int, int] | None) -> list[tuple[slice, slice]]:
    """Row-major tiles (the last row and column of tiles may be short)."""
    tr, tc = tile if tile is not None else shape
    return [(slice(r, min(r + tr, shape[0])), slice(c, min(c + tc, shape[1])))
            for r in range(0, shape[0], tr) for c in range(0, shape[1], tc)]


def _encode_kashin(x, bits, opts):
    x2 = _as_matrix(x).astype(np.float64)
    fwd, inv = _transforms(opts["transform"], opts["seed"])
    tiles = _tile_slices(x2.shape, opts["tile"])
    k = 2 ** bits
    books = np.zeros((len(tiles), k, 2), np.float32)
    norms = np.zeros(len(tiles), np.float32)
    codes, raw, unconverged, iterations = [], [], [], []
    for t, (rs, cs) in enumerate(tiles):
        block = x2[rs, cs]
        fro = float(np.linalg.norm(block))
        if fro > _F32_MAX:  # the norm is stored as float32: inf there would decode the tile as NaN
            raise TileError("tilegraph.io.quantize", f"method 'kashin': the Frobenius norm of tile {t} (rows "
                            f"{rs.start}:{rs.stop}, columns {cs.start}:{cs.stop}) exceeds float32's range, in "
                            "which it is stored; use another method (int8, bf16, kmeans), or quantize(..., "
                            "tile=...) with smaller tiles", f"norm {fro:g}")
        norm = np.float32(fro)
        norms[t] = norm
        res = _kashin(block / float(norm) if norm > 0 else block, fwd, inv, opts["tol"], opts["max_iter"])
        iterations.append(res.iterations)
        if not res.converged:
            unconverged.append(t)
            raw.append(block.astype(np.float32).ravel())
            continue
        pts = np.stack([res.u.ravel(), res.v_hat.ravel()], axis=1)  # (entries, 2): one point per entry
        books[t] = _kmeans_2d(pts, bits, opts["seed"] + t)
        codes.append(_assign_2d(pts.astype(np.float32), books[t]).astype(np.uint8))
    if unconverged:
        warnings.warn(f"[tilegraph.io.quantize] Kashin: {len(unconverged)} of {len(tiles)} tile(s) did not "
                      f"converge in max_iter={opts['max_iter']} iterations and are stored exact (float32): "
                      f"tiles {unconverged}", KashinNotConverged, stacklevel=3)
    parts = {"codebook": books, "fro_norm": norms,
             "codes": _pack_bits(np.concatenate(codes) if codes else np.zeros(0, np.uint8), bits)}
    if raw:
        parts["raw"] = np.concatenate(raw)
    meta = {"transform": opts["transform"], "seed": opts["seed"],
            "tile": list(opts["tile"]) if opts["tile"] is not None else None,
            "unconverged": unconverged, "iterations": iterations}
    return parts, meta


def _decode_kashin(parts, meta, shape, bits):
    n, m = _matrix_shape(shape)
    tile = tuple(meta["tile"]) if meta.get("tile") is not None else None
    tiles = _tile_slices((n, m), tile)
    _, inv = _transforms(meta["transform"], meta["seed"])
    skip = set(meta.get("unconverged", []))
    count = sum((rs.stop - rs.start) * (cs.stop - cs.start) for t, (rs, cs) in enumerate(tiles) if t not in skip)
    codes = _unpack_bits(parts["codes"], bits, count)
    raw = parts.get("raw", np.zeros(0, np.float32))
    out = np.empty((n, m), np.float32)
    at_code = at_raw = 0
    for t, (rs, cs) in enumerate(tiles):
        tshape = (rs.stop - rs.start, cs.stop - cs.start)
        size = tshape[0] * tshape[1]
        if t in skip:
            out[rs, cs] = raw[at_raw:at_raw + size].reshape(tshape)
            at_raw += size
            continue
        pts = parts["codebook"][t].astype(np.float64)[codes[at_code:at_code + size]]  # (size, 2)
        at_code += size
        u, v_hat = pts[:, 0].reshape(tshape), pts[:, 1].reshape(tshape)
        # clipped: near float32's largest value the codebook's error could round a value to inf
        out[rs, cs] = np.clip((u + inv(v_hat)) * float(parts["fro_norm"][t]), -_F32_MAX, _F32_MAX)
    return out


def _check_kashin(arrays, attrs, shape, bits):
    problems = _no_extra(attrs, ("transform", "seed", "tile", "unconverged", "iterations"))
    if attrs.get("transform") not in TRANSFORMS:
        problems.append(f"attribute 'transform' must be one of {list(TRANSFORMS)}, not {attrs.get('transform')!r}")
    seed = attrs.get("seed")
    if not (isinstance(seed, int) and seed >= 0):
        problems.append(f"attribute 'seed' must be a non-negative int, not {seed!r}")
    tile = attrs.get("tile")
    if not (tile is None or (isinstance(tile, (list, tuple)) and len(tile) == 2
                             and all(isinstance(t, int) and t >= 1 for t in tile))):
        return problems + [f"attribute 'tile' must be null or [rows, cols], not {tile!r}"]
    if len(shape) not in (1, 2) or 0 in shape:
        return problems + [f"shape {list(shape)} is not a non-empty 1-D or 2-D shape"]
    tiles = _tile_slices(_matrix_shape(shape), tuple(tile) if tile is not None else None)
    bad = attrs.get("unconverged", [])
    if not (isinstance(bad, list) and all(isinstance(t, int) and 0 <= t < len(tiles) for t in bad)
            and len(set(bad)) == len(bad)):
        return problems + [f"attribute 'unconverged' must list distinct tile indices < {len(tiles)}, not {bad!r}"]
    sizes = [(rs.stop - rs.start) * (cs.stop - cs.start) for rs, cs in tiles]
    n_raw = sum(sizes[t] for t in bad)
    n_codes = sum(sizes) - n_raw
    want = {"codebook": (np.float32, (len(tiles), 2 ** bits, 2)), "fro_norm": (np.float32, (len(tiles),)),
            "codes": (np.uint8, (-(-n_codes * bits // 8),))}
    if n_raw:
        want["raw"] = (np.float32, (n_raw,))
    return problems + _expect(arrays, want)


# ==================================================================================== checks ====
def _expect(arrays: Mapping[str, np.ndarray], want: Mapping[str, tuple]) -> list[str]:
    """Every missing, extra, mistyped or misshapen part, as messages."""
    problems = [f"part {k!r} is missing" for k in want if k not in arrays]
    problems += [f"part {k!r} is not expected" for k in arrays if k not in want]
    for k, (dtype, shape) in want.items():
        if k in arrays:
            a = arrays[k]
            if a.dtype != np.dtype(dtype):
                problems.append(f"part {k!r} is {a.dtype}, expected {np.dtype(dtype)}")
            if tuple(a.shape) != tuple(shape):
                problems.append(f"part {k!r} has shape {list(a.shape)}, expected {list(shape)}")
    return problems


def _no_extra(attrs: Mapping[str, Any], known: tuple[str, ...]) -> list[str]:
    known = known + ("auto",)  # what 'auto' measured rides along with the method it chose
    return [f"attribute {k!r} is not expected" for k in attrs if k not in known]


_ENCODERS = {"fp16": _encode_fp16, "bf16": _encode_bf16, "int8": _encode_absmax, "int4": _encode_absmax,
             "kmeans": _encode_kmeans, "kashin": _encode_kashin}
_DECODERS = {"fp16": _decode_fp16, "bf16": _decode_bf16, "int8": _decode_absmax, "int4": _decode_absmax,
             "kmeans": _decode_kmeans, "kashin": _decode_kashin}
_CHECKERS = {"fp16": lambda a, at, s, b: _check_cast(a, at, s, b, np.float16),
             "bf16": lambda a, at, s, b: _check_cast(a, at, s, b, np.uint16),
             "int8": _check_absmax, "int4": _check_absmax, "kmeans": _check_kmeans, "kashin": _check_kashin}


# ============================================================================= default rule ====
_EXACT_NAME = re.compile(r"(^|[._])(ln|norm|bias|b)([._0-9]|$)|norm", re.IGNORECASE)
#: adapters (tilegraph.peft's LoRA U and V, LoTR's factors and cores): the few trained values of a
#: fine-tuned model, a fraction of a percent of its bytes, which int4 would cut to 16 levels
_ADAPTER_NAME = re.compile(r"(^|\.)(lora_u|lora_v|lotr_left|lotr_core|lotr_right)$")


def default_method(name: str, shape, method: str = "int8") -> str | None:
    """Which method a parameter gets by default: None (stay exact) for norms, biases, adapters
    (:mod:`tilegraph.peft`'s ``lora_u``, ``lora_v``, ``lotr_*``) and anything that is not a
    non-empty 2-D matrix; ``method`` for weight matrices and embeddings.

    >>> default_method("blocks.0.ln_1.weight", (768,)), default_method("blocks.0.attn.bias", (768,))
    (None, None)
    >>> default_method("blocks.0.attn.q.lora_u", (768, 8), "int4") is None
    True
    >>> default_method("blocks.0.mlp.fc1.weight", (768, 3072), "int4")
    'int4'
    """
    if method not in _SPECS:
        raise TileError("tilegraph.io.default_method", f"unknown method; expected one of {list(METHODS)}",
                        repr(method))
    try:
        shape = tuple(shape)
    except TypeError:
        raise TileError("tilegraph.io.default_method", "shape must be a tuple of ints", repr(shape)) from None
    if len(shape) != 2 or 0 in shape or _EXACT_NAME.search(str(name)) or _ADAPTER_NAME.search(str(name)):
        return None
    return method
