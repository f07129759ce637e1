"""Reductions over any dims, as trees over tiles: partial sums per group of tiles, then combines."""

from __future__ import annotations

import itertools
import math

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import emit1, kernel
from tilegraph._tensor import ALL_DIMS, NO_KEEPDIM, TileTensor, Tiling

from ._common import elementwise_cost, new_tensor, norm_dim, require_tensor, resolve_alias, xp_of
from ._tree import FAN_IN, merge_tree  # noqa: F401 - FAN_IN: the ops and tests read it here too

__all__ = ["sum", "mean", "sum_dims", "expand"]

@kernel("reduce_sum", cost=elementwise_cost(1))
def _reduce_sum(*tiles, axes, shape, scale, dtype=None):
    """The sum of ``tiles`` over ``axes``, times ``scale``; in ``dtype`` where it differs from the
    tiles' (NumPy's: a sum of booleans or small integers is int64, a mean of integers float64)."""
    acc = None
    for t in tiles:
        if dtype is not None:
            t = t.astype(dtype, copy=False)
        s = t.sum(axis=axes, keepdims=True) if axes else t
        acc = s.copy() if acc is None else acc + s
    acc = acc.reshape(shape)
    if scale != 1.0:
        acc *= acc.dtype.type(scale)
    return acc


@kernel("expand", cost=elementwise_cost(1))
def _expand(g, keep_shape, shape, scale):
    xp = xp_of(g)
    out = xp.broadcast_to(g.reshape(keep_shape), shape)
    return out * out.dtype.type(scale) if scale != 1.0 else out.copy()


def _tree(parts: list, shape, dtype, axes, scale, op):
    """Sum ``parts`` (tile refs of one output tile) in a :func:`merge_tree`: the kernels that
    read the tiles themselves sum over ``axes`` (in ``dtype``, where the tiles have another), the
    last one scales and gives ``shape``."""
    kshape = tuple(1 if a in axes else n for a, n in enumerate(parts[0].shape))
    tiles = {id(p): p for p in parts}  # holding the refs keeps their ids from being reused
    dtype = np.dtype(dtype)

    def merge(group: list, final: bool):
        out = shape if final else kshape
        convert = {"dtype": dtype.str} if group[0].dtype != dtype else {}
        return emit1(_reduce_sum, group, out, dtype, op=op, axes=axes if id(group[0]) in tiles else (), shape=out,
                     scale=scale if final else 1.0, **convert)

    return merge_tree(parts, merge)


class Sum(Op):
    name = "sum"

    def forward(self, x, dims: tuple, keep: tuple, scale: float = 1.0, dtype=None):
        # NumPy's result dtype (``dtype``: a mean's): booleans and small integers sum to int64
        dtype = np.dtype(dtype) if dtype is not None else np.sum(np.zeros(1, x.dtype)).dtype
        out_chunks, out_pos = [], []
        for d in range(x.ndim):
            if d in dims:
                if keep[dims.index(d)]:
                    out_chunks.append((1,))
                    out_pos.append(d)
            else:
                out_chunks.append(x.chunks[d])
                out_pos.append(d)
        tiling = Tiling(out_chunks)
        red_grid = [range(x.tiling.grid[d]) for d in dims]

        def fill(oidx):
            full = {}
            for od, d in zip(oidx, out_pos):
                if d not in dims:
                    full[d] = od
            parts = []
            for ridx in itertools.product(*red_grid):
                full.update(zip(dims, ridx))
                parts.append(x.grid[tuple(full[d] for d in range(x.ndim))])
            shape = tiling.tile_shape(oidx)
            return _tree(parts, shape, dtype, tuple(dims), scale, self.name)

        return new_tensor(tiling, dtype, fill), (x, dims, keep, scale)

    def backward(self, ctx, g):
        x, dims, keep, scale = ctx
        return (expand(g, x, dims, keep, scale),)


_sum_op = Sum()


def expand(g: TileTensor, like: TileTensor, dims: tuple, keep: tuple, scale: float = 1.0) -> TileTensor:
    """Broadcast ``g`` (``like`` reduced over ``dims``) back to the tiling of ``like``."""
    return _expand_op(g, like, dims=dims, keep=keep, scale=scale)


class Expand(Op):
    name = "expand"

    def forward(self, g, like, dims, keep, scale):
        out_pos = [d for d in range(like.ndim) if d not in dims or keep[dims.index(d)]]

        def fill(idx):
            gi = tuple(0 if d in dims else idx[d] for d in out_pos)
            shape = like.tiling.tile_shape(idx)
            keep_shape = tuple(1 if d in dims else n for d, n in enumerate(shape))
            return emit1(_expand, [g.grid[gi]], shape, like.dtype, op="expand", keep_shape=keep_shape,
                         shape=shape, scale=scale)

        return new_tensor(like.tiling, like.dtype, fill), (dims, keep, scale)

    def backward(self, ctx, dy):
        dims, keep, scale = ctx
        return (sum_dims(dy, dims, keep, scale), None)


_expand_op = Expand()


def sum_dims(x: TileTensor, dims: tuple, keep: tuple, scale: float = 1.0) -> TileTensor:
    """Sum over ``dims``; ``keep[i]`` keeps dim ``dims[i]`` with size 1. Result times ``scale``."""
    return _sum_op(x, dims=tuple(dims), keep=tuple(keep), scale=scale)


def _dims(x: TileTensor, dim, where: str) -> tuple:
    if dim is None or (isinstance(dim, (tuple, list)) and not dim):  # torch: () or [] reduces all dims
        return tuple(range(x.ndim))
    if isinstance(dim, (int, np.integer)):
        dim = (dim,)
    if not isinstance(dim, (tuple, list)) or not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                                                      for d in dim):
        raise TileError(where, "dim must be None, an int or a tuple of ints", repr(dim))
    dims = tuple(sorted({norm_dim(int(d), x.ndim, where) for d in dim}))
    if len(dims) != len(tuple(dim)):
        raise TileError(where, "dims must be distinct", repr(dim))
    return dims


def sum(x: TileTensor, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM, *,  # noqa: A001 - torch name
        keepdims: bool | None = None, axis=None) -> TileTensor:
    """Sum over ``dim`` (an int, a tuple, or None for all), as a tree over tiles.

    ``keepdim=True`` keeps each reduced dim with size 1 (as torch; ``keepdims`` and ``axis`` are
    NumPy's spellings of ``keepdim`` and ``dim``, accepted as in torch; passing both spellings of
    one parameter is an error).

    >>> import numpy as np, tilegraph as tg
    >>> tg.sum(tg.from_numpy(np.ones((4, 3)), tiles=(2, 3)), 0, keepdim=True).numpy()
    array([[4., 4., 4.]])
    """
    where = "tilegraph.sum"
    require_tensor(x, where, "x")
    keep = bool(resolve_alias(where, "keepdim", keepdim, "keepdims", keepdims))
    dims = _dims(x, resolve_alias(where, "dim", dim, "axis", axis), where)
    return sum_dims(x, dims, (keep,) * len(dims))


def mean(x: TileTensor, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM, *, keepdims: bool | None = None,
         axis=None) -> TileTensor:
    """Mean over ``dim`` (an int, a tuple, or None for all); ``keepdim``, ``keepdims`` and ``axis``
    as in :func:`sum`."""
    where = "tilegraph.mean"
    require_tensor(x, where, "x")
    keep = bool(resolve_alias(where, "keepdim", keepdim, "keepdims", keepdims))
    dims = _dims(x, resolve_alias(where, "dim", dim, "axis", axis), where)
    count = math.prod(x.shape[d] for d in dims)
    # as NumPy and torch: the mean of integers is a float, that of nothing NaN
    return _sum_op(x, dims=dims, keep=(keep,) * len(dims), scale=1.0 / count if count else float("nan"),
                   dtype=np.mean(np.zeros(1, x.dtype)).dtype)
