"""Basic indexing, as torch's: ``x[1]``, ``x[:, -1]``, ``x[..., ::2]``, ``x[None]``; and the
selections built on it: :func:`narrow`, :func:`select`, :func:`split`, :func:`chunk`,
:func:`unbind` (also TileTensor methods).

A selection never moves data between tiles: each tile of the result is the part of one tile of
the input that the index keeps (input tiles it does not touch are dropped, a tile kept whole is
reused as it is, without a kernel). So ``x[:, :64]`` on tiles of 64 columns is free, and the pieces
of :func:`split` along tile boundaries are the input's own tiles. The gradient puts each tile of
the cotangent back at its place in a tile of zeros shaped as the input tile it came from.

Indices are ints, slices with a positive step (torch refuses negative steps too), ``None`` (a new
dim of size 1) and one ``...``. Tensors, arrays, lists and booleans as indices (advanced indexing)
raise a TileError: gather rows of a table with :func:`tilegraph.embedding`.
"""

from __future__ import annotations

import numpy as np

from tilegraph._autograd import Op
from tilegraph._config import is_int
from tilegraph._errors import TileError, TileIndexError  # (defined there: TileTensor.tile raises it too)
from tilegraph._graph import emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import new_tensor, norm_dim, require_tensor, xp_of
from .shape import _copy_cost, checked_reshape

__all__ = ["narrow", "select", "split", "chunk", "unbind", "getitem", "TileIndexError"]


@kernel("slice", cost=_copy_cost)
def _slice(x, index):
    """The part ``index`` (a (start, stop, step) per dim) of a tile, as a tile of its own."""
    return xp_of(x).ascontiguousarray(x[tuple(slice(*s) for s in index)])


@kernel("unslice", cost=_copy_cost)
def _unslice(g, shape, index):
    """A tile of zeros of ``shape`` holding ``g`` at ``index`` (the backward of :func:`_slice`)."""
    out = xp_of(g).zeros(shape, dtype=g.dtype)
    out[tuple(slice(*s) for s in index)] = g
    return out


@kernel("zeros_tile", cost=_copy_cost)
def _zeros_tile(like, shape):
    """Zeros of ``shape`` and the dtype of ``like`` (read for its dtype and array namespace only)."""
    return xp_of(like).zeros(shape, dtype=like.dtype)


def _pieces(offsets, sizes, start: int, stop: int, step: int) -> list[tuple[int, int, int, int]]:
    """The tiles of one dim that ``range(start, stop, step)`` touches, as (tile, local start, local
    stop, count); one empty piece of tile 0 when it touches none (an empty selection)."""
    out = []
    for k, (o, c) in enumerate(zip(offsets, sizes)):
        first = start if start >= o else start + -(-(o - start) // step) * step
        end = min(stop, o + c)
        if first < end:
            count = (end - 1 - first) // step + 1
            out.append((k, first - o, first - o + (count - 1) * step + 1, count))
    return out or [(0, 0, 0, 0)]


class Slice(Op):
    """``x`` restricted to ``index``, a (start, stop, step) per dim (normalised, step > 0); every
    dim stays (ints become length-1 ranges, dropped after by a reshape)."""

    name = "slice"

    def forward(self, x, index):
        per_dim = [_pieces(x.tiling.offsets(d), x.chunks[d], *index[d]) for d in range(x.ndim)]
        tiling = Tiling([tuple(p[3] for p in pieces) for pieces in per_dim])
        steps = [s[2] for s in index]

        def fill(idx):
            parts = [per_dim[d][i] for d, i in enumerate(idx)]
            src = tuple(p[0] for p in parts)
            ref = x.grid[src]
            if all(p[1] == 0 and p[3] == n for p, n in zip(parts, ref.shape)):
                return ref  # the whole tile: reused, no kernel
            local = tuple((p[1], p[2], s) for p, s in zip(parts, steps))
            return emit1(_slice, [ref], tiling.tile_shape(idx), x.dtype, op="slice", index=local)

        return new_tensor(tiling, x.dtype, fill), (x.tiling, per_dim, steps)

    def backward(self, ctx, g):
        tiling, per_dim, steps = ctx
        # where each input tile went: its index among the result's tiles along each dim
        where = [{p[0]: (i, p) for i, p in enumerate(pieces) if p[3]} for pieces in per_dim]
        zero_from = g.grid.flat[0]

        def fill(idx):
            shape = tiling.tile_shape(idx)
            got = [where[d].get(k) for d, k in enumerate(idx)]
            if any(w is None for w in got):
                return emit1(_zeros_tile, [zero_from], shape, g.dtype, op="slice", shape=shape)
            ref = g.grid[tuple(w[0] for w in got)]
            if ref.shape == shape:
                return ref
            local = tuple((w[1][1], w[1][2], s) for w, s in zip(got, steps))
            return emit1(_unslice, [ref], shape, g.dtype, op="slice", shape=shape, index=local)

        return (new_tensor(tiling, g.dtype, fill),)


_slice_op = Slice()


def _select(x: TileTensor, index: list, where: str) -> TileTensor:
    """``x`` restricted to ``index`` (a (start, stop, step) per dim); ``x`` itself when that is all of it."""
    if all(s == (0, n, 1) for s, n in zip(index, x.shape)):
        return x
    return _slice_op(x, index=tuple(index))


def _full(x: TileTensor) -> list:
    return [(0, n, 1) for n in x.shape]


def _index_name(v) -> str:
    return f"{type(v).__name__} {v!r:.60}"


def getitem(x: TileTensor, key, where: str = "tilegraph.TileTensor.__getitem__") -> TileTensor:
    """``x[key]``, torch's basic indexing (see the module's docstring).

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(12.0).reshape(3, 4), tiles=(2, 3))
    >>> x[1:, ::2].numpy()
    array([[ 4.,  6.],
           [ 8., 10.]])
    >>> x[-1].shape, x[:, None, 0].shape
    ((4,), (3, 1))
    """
    require_tensor(x, where, "x")
    items = key if isinstance(key, tuple) else (key,)
    for v in items:
        if v is None or v is Ellipsis or isinstance(v, slice) or is_int(v):
            continue
        if isinstance(v, (bool, np.bool_)):
            raise TileError(where, "a boolean index (a mask) is not supported; index with ints and slices",
                            _index_name(v))
        raise TileError(where, "only ints, slices (positive steps), None and ... index a TileTensor; tensors, "
                        "arrays and lists as indices (advanced indexing) are not supported (rows of a table: "
                        "tg.embedding)", _index_name(v))
    if sum(v is Ellipsis for v in items) > 1:
        raise TileIndexError(where, "an index can only have a single ellipsis ('...')", repr(key))
    used = sum(1 for v in items if v is not None and v is not Ellipsis)
    if used > x.ndim:
        raise TileIndexError(where, f"too many indices for a tensor of {x.ndim} dims (shape {x.shape})", repr(key))
    if Ellipsis in items:
        at = next(i for i, v in enumerate(items) if v is Ellipsis)
        items = items[:at] + (slice(None),) * (x.ndim - used) + items[at + 1:]
    else:
        items = items + (slice(None),) * (x.ndim - used)
    index, shape, d = [], [], 0
    for v in items:
        if v is None:
            shape.append(1)
            continue
        n = x.shape[d]
        if isinstance(v, slice):
            for part in ("start", "stop", "step"):
                p = getattr(v, part)
                if p is not None and not is_int(p):
                    raise TileError(where, f"slice {part}s must be ints or None (dim {d})", _index_name(p))
            if v.step is not None and v.step <= 0:
                raise TileError(where, f"slice steps must be positive, as in torch (dim {d}; reverse with a "
                                "permutation of tiles instead)", repr(v))
            start, stop, step = v.indices(n)
            stop = max(stop, start)
            index.append((start, stop, step))
            shape.append(len(range(start, stop, step)))
        else:
            i = int(v)
            if not -n <= i < n:
                raise TileIndexError(where, f"index {i} is out of range for dim {d} of size {n} (shape {x.shape})",
                                     repr(key))
            i %= n
            index.append((i, i + 1, 1))
        d += 1
    y = _select(x, index, where)
    return checked_reshape(y, tuple(shape), where)


def narrow(x: TileTensor, dim: int, start: int, length: int, where: str = "tilegraph.narrow") -> TileTensor:
    """torch's ``narrow``: ``length`` elements of dim ``dim`` from ``start`` (negative: from the end).

    >>> import numpy as np, tilegraph as tg
    >>> tg.narrow(tg.from_numpy(np.arange(6.0), tiles=4), 0, 2, 3).numpy()
    array([2., 3., 4.])
    """
    require_tensor(x, where, "x")
    if x.ndim == 0:
        raise TileError(where, "a 0-d tensor has no dim to narrow", repr(x))
    d = norm_dim(dim, x.ndim, where)
    n = x.shape[d]
    for name, v in (("start", start), ("length", length)):
        if not is_int(v):
            raise TileError(where, f"{name} must be an int", _index_name(v))
    if not -n <= start <= n:
        raise TileIndexError(where, f"start out of range for dim {d} of size {n}", str(start))
    start = int(start) + n if start < 0 else int(start)
    if length < 0 or start + length > n:
        raise TileError(where, f"start + length must lie within dim {d} of size {n} (length >= 0)",
                        f"start {start}, length {length}")
    index = _full(x)
    index[d] = (start, start + int(length), 1)
    return _select(x, index, where)


def select(x: TileTensor, dim: int, index: int, where: str = "tilegraph.select") -> TileTensor:
    """torch's ``select``: the slice at ``index`` of dim ``dim``, that dim removed (``x[:, i]``
    for dim 1)."""
    require_tensor(x, where, "x")
    if x.ndim == 0:
        raise TileIndexError(where, "a 0-d tensor has no dim to select from", repr(x))
    d = norm_dim(dim, x.ndim, where)
    if not is_int(index):
        raise TileError(where, "index must be an int", _index_name(index))
    return getitem(x, (slice(None),) * d + (int(index),), where)


def _split_at(x: TileTensor, d: int, sizes, where: str) -> tuple:
    out, start = [], 0
    for s in sizes:
        index = _full(x)
        index[d] = (start, start + s, 1)
        out.append(_select(x, index, where))
        start += s
    return tuple(out)


def split(x: TileTensor, split_size_or_sections, dim: int = 0, where: str = "tilegraph.split") -> tuple:
    """torch's ``split``: pieces of ``split_size`` along ``dim`` (the last may be smaller), or of
    the sizes in a list. Pieces on tile boundaries are the input's tiles themselves.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.zeros((6, 2)), tiles=(2, 2))
    >>> [p.shape for p in tg.split(x, [2, 4])], [p.chunks for p in x.split(4)]
    ([(2, 2), (4, 2)], [((2, 2), (2,)), ((2,), (2,))])
    """
    require_tensor(x, where, "x")
    if x.ndim == 0:
        raise TileError(where, "a 0-d tensor cannot be split", repr(x))
    d = norm_dim(dim, x.ndim, where)
    n = x.shape[d]
    if is_int(split_size_or_sections):
        size = int(split_size_or_sections)
        if size <= 0 and not (size == 0 and n == 0):
            raise TileError(where, "split_size must be a positive int", str(size))
        sizes = [min(size, n - s) for s in range(0, n, size)] if n else [0]
    elif isinstance(split_size_or_sections, (list, tuple)):
        sizes = list(split_size_or_sections)
        if not all(is_int(s) and s >= 0 for s in sizes) or sum(sizes) != n:
            raise TileError(where, f"split sections must be non-negative ints that add up to dim {d}'s size {n}",
                            repr(split_size_or_sections))
    else:
        raise TileError(where, "split_size_or_sections must be an int or a list of ints",
                        _index_name(split_size_or_sections))
    return _split_at(x, d, [int(s) for s in sizes], where)


def chunk(x: TileTensor, chunks: int, dim: int = 0, where: str = "tilegraph.chunk") -> tuple:
    """torch's ``chunk``: at most ``chunks`` pieces of ``ceil(size / chunks)`` along ``dim`` (fewer
    when the size does not allow that many, as in torch)."""
    require_tensor(x, where, "x")
    if x.ndim == 0:
        raise TileError(where, "a 0-d tensor cannot be chunked", repr(x))
    if not is_int(chunks) or chunks <= 0:
        raise TileError(where, "chunks must be a positive int", _index_name(chunks))
    d = norm_dim(dim, x.ndim, where)
    n = x.shape[d]
    return split(x, max(-(-n // int(chunks)), 1), d, where)


def unbind(x: TileTensor, dim: int = 0, where: str = "tilegraph.unbind") -> tuple:
    """torch's ``unbind``: the slices along ``dim``, that dim removed."""
    require_tensor(x, where, "x")
    if x.ndim == 0:
        raise TileError(where, "a 0-d tensor cannot be unbound", repr(x))
    d = norm_dim(dim, x.ndim, where)
    return tuple(select(x, d, i, where) for i in range(x.shape[d]))
