"""Prefix sums across tiles: ``tg.cumsum(x, dim)`` / ``x.cumsum(dim)``, as torch's.

A tile's cumulative sum along ``dim`` is its own (local) cumulative sum plus the carry: the sum
of the tiles before it along ``dim``. Per row of tiles along ``dim`` (K tiles) that is

- K - 1 ``scan_total`` kernels: each tile's sum along ``dim`` (a slab of size 1 there), in
  parallel;
- one ``scan_carries`` kernel that turns those totals into the K - 1 carries (a running sum of
  slabs; none for K <= 2, where the one carry is the first total itself);
- K ``cumsum`` kernels: the local cumulative sum of a tile plus its carry.

So the tiles are read twice and the graph is three kernels deep, whatever K is. The gradient is
the reversed cumulative sum of the cotangent (the same scan from the other end). As the sums of
``tilegraph.ops.reduce``, a float16 scan accumulates in float32 and rounds once, at the end;
booleans and integers accumulate in int64, unsigned ones in uint64 (NumPy's result dtype, as
``tg.sum``'s; torch's is int64 for both).
"""

from __future__ import annotations

import numpy as np

from tilegraph._autograd import Op
from tilegraph._config import is_int
from tilegraph._errors import TileError
from tilegraph._graph import emit, emit1, kernel
from tilegraph._tensor import TileTensor

from ._common import elementwise_cost, new_tensor, norm_dim, require_tensor, xp_of
from ._gpu import sum_keepdims
from .shape import checked_reshape

__all__ = ["cumsum"]


def _acc(x, acc: str | None):
    return x if acc is None else x.astype(acc, copy=False)


@kernel("scan_total", cost=elementwise_cost(1))
def _scan_total(x, *, dim, acc=None):
    """The sum of a tile along ``dim`` (kept with size 1), in ``acc`` where given."""
    return sum_keepdims(_acc(x, acc), (dim,))


@kernel("scan_carries", cost=elementwise_cost(1))
def _scan_carries(*totals):
    """The running sums of ``totals`` (slabs of one shape): ``t0, t0 + t1, ...``, one per total."""
    out = [totals[0].copy()]
    for t in totals[1:]:
        out.append(out[-1] + t)
    return tuple(out)


@kernel("cumsum", cost=elementwise_cost(2))
def _cumsum(x, carry=None, *, dim, reverse, acc=None, out=None):
    """The cumulative sum of a tile along ``dim`` (from its end when ``reverse``) plus ``carry``
    (the sum of the tiles before it), accumulated in ``acc`` where given, cast to ``out``."""
    xp = xp_of(x)
    x = _acc(x, acc)
    if reverse:
        y = xp.flip(xp.cumsum(xp.flip(x, dim), axis=dim, dtype=x.dtype), dim)
    else:
        y = xp.cumsum(x, axis=dim, dtype=x.dtype)
    if carry is not None:
        y = y + carry  # (a new array: y may be a view of x, or flipped)
    return xp.ascontiguousarray(y if out is None else y.astype(out))


class Scan(Op):
    """Cumulative sum along ``dim`` (``reverse``: from the end); the vjp is the other scan."""

    name = "cumsum"

    def forward(self, x, *, dim: int, reverse: bool = False):
        out_dtype = np.cumsum(np.zeros(1, x.dtype)).dtype  # NumPy's (and torch's): small ints and bools to int64
        acc = np.dtype(np.float32) if out_dtype == np.float16 else out_dtype
        to_acc = {"acc": acc.str} if x.dtype != acc else {}
        cast_out = {"out": out_dtype.str} if acc != out_dtype else {}
        k = x.tiling.grid[dim]
        order = list(range(k))[::-1] if reverse else list(range(k))  # tiles in the order the scan meets them
        carries = {}  # (row of tiles, tile index along dim) -> ref of the carry into that tile
        rows = np.ndindex(*(n for d, n in enumerate(x.tiling.grid) if d != dim))
        for row in rows:
            def at(j, row=row):
                return row[:dim] + (j,) + row[dim:]

            totals = [emit1(_scan_total, [x.grid[at(j)]], _slab(x, at(j), dim), acc, op="cumsum", dim=dim,
                            **to_acc) for j in order[:-1]]
            if len(totals) > 1:
                totals = emit(_scan_carries, totals, [(t.shape, acc) for t in totals], op="cumsum")
            for j, ref in zip(order[1:], totals):
                carries[at(j)] = ref

        def fill(idx):
            carry = carries.get(idx)
            return emit1(_cumsum, [x.grid[idx]] + ([carry] if carry is not None else []), x.tiling.tile_shape(idx),
                         out_dtype, op="cumsum", dim=dim, reverse=reverse, **to_acc, **cast_out)

        return new_tensor(x.tiling, out_dtype, fill), (dim, reverse)

    def backward(self, ctx, g):
        dim, reverse = ctx
        return (_scan_op(g, dim=dim, reverse=not reverse),)


def _slab(x: TileTensor, idx: tuple, dim: int) -> tuple:
    return tuple(1 if d == dim else n for d, n in enumerate(x.tiling.tile_shape(idx)))


_scan_op = Scan()


def cumsum(x: TileTensor, dim: int, *, dtype=None, where: str = "tilegraph.cumsum") -> TileTensor:
    """torch's ``cumsum``: the cumulative sum of ``x`` along ``dim``, across its tiles (each tile's
    own cumulative sum plus the sum of the tiles before it). ``dtype``: ``x`` is cast to it
    first (torch's); otherwise booleans and integers give int64 (unsigned ones uint64, as
    ``tg.sum``), and float16 accumulates in float32. The gradient is the reversed cumulative sum
    of the cotangent (in the result's dtype, cast back to ``x``'s last).

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(1.0, 8.0), tiles=3)
    >>> tg.cumsum(x, 0).numpy()
    array([ 1.,  3.,  6., 10., 15., 21., 28.])
    >>> x.cumsum(-1).chunks
    ((3, 3, 1),)
    """
    require_tensor(x, where, "x")
    if x.dtype.kind not in "biuf":
        raise TileError(where, "x must be a bool, integer or float tensor", str(x.dtype))
    n = max(x.ndim, 1)  # a 0-d tensor takes dim 0 or -1, as torch's
    if is_int(dim) and not -n <= dim < n:
        raise TileError(where, f"dim out of range: expected {-n} <= dim <= {n - 1} for a tensor of shape {x.shape}",
                        str(dim))
    d = norm_dim(dim, n, where)
    if dtype is not None:
        from .elementwise import _cast_checked

        x = _cast_checked(x, dtype, where)
    if x.ndim == 0:  # torch: a 0-d tensor is its own cumulative sum (dim 0 or -1)
        return checked_reshape(_scan_op(checked_reshape(x, (1,), where), dim=0), (), where)
    return _scan_op(x, dim=d)
