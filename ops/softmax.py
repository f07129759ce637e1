"""Softmax and log-softmax along any dim, split over any number of tiles.

When the softmax dim is one tile, each tile is one fused kernel. Otherwise every tile computes
local statistics (row max ``m`` and ``s = sum(exp(x - m))``), the statistics of the tiles of one
row group are merged in one kernel (a tree of them above :data:`FAN_IN` tiles) with
``m = max(m1, m2), s = s1 exp(m1 - m) + s2 exp(m2 - m)``, and one kernel per tile writes the
result. The backward pass has the same shape with ``sum(g * y)`` as the merged statistic.

Rows that are entirely ``-inf`` within one tile (a causal mask) contribute ``s = 0`` to the merge;
rows that are ``-inf`` everywhere give NaN, as in torch.

>>> import numpy as np, tilegraph as tg
>>> from tilegraph.ops.softmax import softmax
>>> x = tg.from_numpy(np.log(np.arange(1.0, 7.0)).reshape(2, 3), tiles=(1, 2))
>>> softmax(x, dim=-1).numpy()[0] * 6
array([1., 2., 3.])
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit, emit1, kernel
from tilegraph._tensor import TileTensor

from ._common import acc_dtype, new_tensor, norm_dim, numel, require_float, require_tensor, xp_of
from ._tree import merge_tree

__all__ = ["softmax", "log_softmax", "row_groups"]


# ---------------------------------------------------------------------------- shared helpers ----
def row_groups(grid: Sequence[int], dim: int):
    """For every tile-grid index with ``dim`` dropped: the grid indices of its tiles along ``dim``.

    Yields ``(key, [idx_0, idx_1, ...])``; ``key`` has a 0 in place of ``dim``.
    """
    outer = tuple(1 if d == dim else n for d, n in enumerate(grid))
    for key in np.ndindex(*outer):
        yield key, [key[:dim] + (k,) + key[dim + 1:] for k in range(grid[dim])]


def rowwise_cost(flops_per_elem: float) -> Callable:
    """Cost of a kernel that reads a tile (its first input) and does ``flops_per_elem`` per element."""

    def cost(in_shapes, out_shapes, itemsize, params) -> Cost:
        n_in = sum(numel(s) for s in in_shapes)
        n_out = sum(numel(s) for s in out_shapes)
        return Cost(flops=flops_per_elem * numel(in_shapes[0]), bytes=float((n_in + n_out) * itemsize))

    return cost


def _finite_or_zero(xp, m):
    """The row max with ``-inf`` (a fully masked row) replaced by 0, so ``x - m`` stays ``-inf``."""
    return xp.where(xp.isneginf(m), xp.zeros_like(m), m)


# ------------------------------------------------------------------------------------ kernels ----
@kernel("softmax", cost=rowwise_cost(4))
def _softmax(x, axis, log):
    """Whole softmax dim in one tile: the fused forward."""
    xp = xp_of(x)
    if x.shape[axis] == 0:  # a dim of no elements (no keys, say): nothing to normalise, as torch's
        return x.copy()
    xa = x.astype(acc_dtype(x.dtype), copy=False)
    z = xa - _finite_or_zero(xp, xa.max(axis=axis, keepdims=True))  # a new array: updated in place
    if log:
        z -= xp.log(xp.exp(z).sum(axis=axis, keepdims=True))
        return z.astype(x.dtype, copy=False)
    xp.exp(z, out=z)
    z /= z.sum(axis=axis, keepdims=True)
    return z.astype(x.dtype, copy=False)


@kernel("softmax_stats", cost=rowwise_cost(3))
def _softmax_stats(x, axis):
    """Local statistics of one tile: row max ``m`` (``-inf`` kept) and ``sum(exp(x - m))``."""
    xp = xp_of(x)
    xa = x.astype(acc_dtype(x.dtype), copy=False)
    m = xa.max(axis=axis, keepdims=True)
    s = xp.exp(xa - _finite_or_zero(xp, m)).sum(axis=axis, keepdims=True)
    return m, s


@kernel("softmax_merge", cost=rowwise_cost(6))
def _softmax_merge(*ms):
    """Merge ``(m1, s1, m2, s2, ...)`` into one ``(m, s)``."""
    xp = xp_of(ms[0])
    m = ms[0]
    for mi in ms[2::2]:
        m = xp.maximum(m, mi)
    m0 = _finite_or_zero(xp, m)
    s = None
    for mi, si in zip(ms[0::2], ms[1::2]):
        t = si * xp.exp(mi - m0)
        s = t if s is None else s + t
    return m, s


@kernel("softmax_apply", cost=rowwise_cost(3))
def _softmax_apply(x, m, s, log):
    xp = xp_of(x)
    z = x.astype(m.dtype, copy=False) - _finite_or_zero(xp, m)  # a new array: updated in place
    if log:
        z -= xp.log(s)
    else:
        xp.exp(z, out=z)
        z /= s
    return z.astype(x.dtype, copy=False)


@kernel("softmax_bwd", cost=rowwise_cost(4))
def _softmax_bwd(y, g, axis, log):
    """Fused backward: ``y (g - sum(g y))``, or ``g - exp(y) sum(g)`` for log-softmax."""
    xp = xp_of(y)
    ya, ga = y.astype(acc_dtype(y.dtype), copy=False), g.astype(acc_dtype(y.dtype), copy=False)
    if log:
        dx = ga - xp.exp(ya) * ga.sum(axis=axis, keepdims=True)
    else:
        dx = ya * (ga - (ga * ya).sum(axis=axis, keepdims=True))
    return dx.astype(y.dtype, copy=False)


@kernel("softmax_bwd_dot", cost=rowwise_cost(2))
def _softmax_bwd_dot(y, g, axis, log):
    ga = g.astype(acc_dtype(g.dtype), copy=False)
    if log:
        return ga.sum(axis=axis, keepdims=True)
    return (ga * y.astype(ga.dtype, copy=False)).sum(axis=axis, keepdims=True)


@kernel("softmax_sum_parts", cost=rowwise_cost(1))
def _sum_parts(*parts):
    acc = parts[0].copy()
    for p in parts[1:]:
        acc += p
    return acc


@kernel("softmax_bwd_apply", cost=rowwise_cost(3))
def _softmax_bwd_apply(y, g, d, log):
    xp = xp_of(y)
    ya, ga = y.astype(d.dtype, copy=False), g.astype(d.dtype, copy=False)
    dx = ga - xp.exp(ya) * d if log else ya * (ga - d)
    return dx.astype(y.dtype, copy=False)


# ----------------------------------------------------------------------------------------- op ----
class Softmax(Op):
    """``softmax(x, dim)`` (``log=True``: log-softmax); the backward reads only the output."""

    def __init__(self, log: bool):
        self.log = log
        self.name = "log_softmax" if log else "softmax"

    def forward(self, x, dim):
        grid = x.tiling.grid
        out = np.empty(grid, dtype=object)
        acc = acc_dtype(x.dtype)
        for _, tiles in row_groups(grid, dim):
            if len(tiles) == 1:
                (idx,) = tiles
                out[idx] = emit1(_softmax, [x.grid[idx]], x.grid[idx].shape, x.dtype, op=self.name,
                                 axis=dim, log=self.log)
                continue
            parts = []
            for idx in tiles:
                stat_shape = _keep1(x.grid[idx].shape, dim)
                parts.append(tuple(emit(_softmax_stats, [x.grid[idx]], [(stat_shape, acc)] * 2,
                                        op=self.name, axis=dim)))
            m, s = merge_tree(parts, lambda group, final: self._merge(group, acc))
            for idx in tiles:
                out[idx] = emit1(_softmax_apply, [x.grid[idx], m, s], x.grid[idx].shape, x.dtype,
                                 op=self.name, log=self.log)
        y = new_tensor(x.tiling, x.dtype, lambda idx: out[idx])
        return y, (out, x.tiling, x.dtype, dim)

    def _merge(self, group, acc):
        ins = [r for ms in group for r in ms]
        shape = group[0][0].shape
        return tuple(emit(_softmax_merge, ins, [(shape, acc)] * 2, op=self.name))

    def backward(self, ctx, g):
        ygrid, tiling, dtype, dim = ctx
        dx = np.empty(tiling.grid, dtype=object)
        acc = acc_dtype(dtype)
        op = f"{self.name}_bwd"
        for _, tiles in row_groups(tiling.grid, dim):
            if len(tiles) == 1:
                (idx,) = tiles
                dx[idx] = emit1(_softmax_bwd, [ygrid[idx], g.grid[idx]], ygrid[idx].shape, dtype, op=op,
                                axis=dim, log=self.log)
                continue
            parts = [emit1(_softmax_bwd_dot, [ygrid[idx], g.grid[idx]], _keep1(ygrid[idx].shape, dim), acc,
                           op=op, axis=dim, log=self.log) for idx in tiles]
            d = merge_tree(parts, lambda group, final: emit1(_sum_parts, group, group[0].shape, acc, op=op))
            for idx in tiles:
                dx[idx] = emit1(_softmax_bwd_apply, [ygrid[idx], g.grid[idx], d], ygrid[idx].shape, dtype,
                                op=op, log=self.log)
        return (new_tensor(tiling, dtype, lambda idx: dx[idx]),)


def _keep1(shape, dim):
    return tuple(1 if d == dim else n for d, n in enumerate(shape))


_softmax_op = Softmax(log=False)
_log_softmax_op = Softmax(log=True)


def _check(x, dim, where, dtype=None) -> tuple[TileTensor, int]:
    """``x`` (cast to ``dtype`` first, as torch's ``dtype=`` does) and ``dim`` as a dim of it."""
    require_tensor(x, where, "x")
    if dtype is not None:
        from .elementwise import _cast_checked, as_dtype

        if as_dtype(dtype, where).kind != "f":
            raise TileError(where, "dtype must be a floating dtype", repr(dtype))
        x = _cast_checked(x, dtype, where)
    require_float(x, where, "x")
    if x.ndim == 0:
        raise TileError(where, "needs at least one dim", "a 0-d tensor")
    return x, norm_dim(dim, x.ndim, where)


def softmax(x: TileTensor, dim: int = -1, *, dtype=None, where: str = "tilegraph.softmax") -> TileTensor:
    """``exp(x) / sum(exp(x), dim)`` along ``dim``, which may be split into several tiles.
    ``dtype``: torch's, ``x`` cast to it first (``dtype=np.float32`` for a float16 ``x``; the
    gradient comes back in ``x``'s dtype)."""
    x, dim = _check(x, dim, where, dtype)
    return _softmax_op(x, dim=dim)


def log_softmax(x: TileTensor, dim: int = -1, *, dtype=None, where: str = "tilegraph.log_softmax") -> TileTensor:
    """``x - log(sum(exp(x), dim))`` along ``dim``, which may be split into several tiles;
    ``dtype`` as :func:`softmax`'s."""
    x, dim = _check(x, dim, where, dtype)
    return _log_softmax_op(x, dim=dim)
