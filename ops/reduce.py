"""Reductions over any dims, as trees over tiles: partial sums per group of tiles, then combines."""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import emit, emit1, kernel
from tilegraph._tensor import ALL_DIMS, NO_KEEPDIM, TileTensor, Tiling

from ._common import elementwise_cost, new_tensor, norm_dim, require_tensor, resolve_alias, xp_of
from ._gpu import sum_keepdims
from ._tree import FAN_IN, merge_tree  # noqa: F401 - FAN_IN: the ops and tests read it here too

__all__ = ["sum", "mean", "sum_dims", "broadcast_dims", "max", "min", "var", "std", "norm", "MinMax"]

@kernel("reduce_sum", cost=elementwise_cost(1))
def _reduce_sum(*tiles, axes, shape, scale, dtype=None, out=None):
    """The sum of ``tiles`` over ``axes``, times ``scale``; in ``dtype`` where it differs from the
    tiles' (NumPy's: a sum of booleans or small integers is int64, a mean of integers float64; a
    float16 sum accumulates in float32), then cast to ``out`` where given (float16 again)."""
    acc = None
    for t in tiles:
        if dtype is not None:
            t = t.astype(dtype, copy=False)
        # in the tiles' dtype (NumPy sums small integers to int64; sum(dtype=np.int8) asks for int8,
        # which wraps around as NumPy's own int8 sum does)
        s = sum_keepdims(t, tuple(axes)).astype(t.dtype, copy=False) if axes else t
        acc = s.copy() if acc is None else acc + s
    acc = acc.reshape(shape)
    if scale != 1.0:
        acc *= acc.dtype.type(scale)
    return acc if out is None else acc.astype(out)


@kernel("expand", cost=elementwise_cost(1))
def _expand(g, keep_shape, shape, scale):
    xp = xp_of(g)
    out = xp.broadcast_to(g.reshape(keep_shape), shape)
    return out * out.dtype.type(scale) if scale != 1.0 else out.copy()


def _tree(parts: list, shape, dtype, axes, scale, op):
    """Sum ``parts`` (tile refs of one output tile) in a :func:`merge_tree`: the kernels that
    read the tiles themselves sum over ``axes`` (in ``dtype``, where the tiles have another), the
    last one scales and gives ``shape``. A float16 result is summed and scaled in float32 (as
    torch does: 4096 halves of 30 have the mean 30, not the inf of a float16 sum) and cast last."""
    kshape = tuple(1 if a in axes else n for a, n in enumerate(parts[0].shape))
    tiles = {id(p): p for p in parts}  # holding the refs keeps their ids from being reused
    dtype = np.dtype(dtype)
    acc = np.dtype(np.float32) if dtype == np.float16 else dtype

    def merge(group: list, final: bool):
        out = shape if final else kshape
        convert = {"dtype": acc.str} if group[0].dtype != acc else {}
        if final and acc != dtype:
            convert["out"] = dtype.str
        return emit1(_reduce_sum, group, out, dtype if final else acc, op=op,
                     axes=axes if id(group[0]) in tiles else (), shape=out, scale=scale if final else 1.0, **convert)

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
        return (broadcast_dims(g, x.tiling, dims, keep, scale),)


_sum_op = Sum()


def broadcast_dims(g: TileTensor, tiling: Tiling, dims: tuple, keep: tuple, scale: float = 1.0) -> TileTensor:
    """``g`` broadcast over ``dims`` to ``tiling``, times ``scale``: the reverse of
    :func:`sum_dims` ``(x, dims, keep)`` for an ``x`` of that tiling (``keep[i]``: dim ``dims[i]``
    is in ``g`` with size 1; otherwise it is not in ``g`` at all). The gradient of a sum, and
    ``x.expand`` (new leading dims not kept, grown size-1 dims kept); its own gradient is that sum."""
    return _expand_op(g, tiling=tiling, dims=tuple(dims), keep=tuple(keep), scale=scale)


class Expand(Op):
    name = "expand"

    def forward(self, g, *, tiling, dims, keep, scale):
        out_pos = [d for d in range(len(tiling.chunks)) if d not in dims or keep[dims.index(d)]]

        def fill(idx):
            gi = tuple(0 if d in dims else idx[d] for d in out_pos)
            shape = tiling.tile_shape(idx)
            keep_shape = tuple(1 if d in dims else n for d, n in enumerate(shape))
            return emit1(_expand, [g.grid[gi]], shape, g.dtype, op="expand", keep_shape=keep_shape,
                         shape=shape, scale=scale)

        return new_tensor(tiling, g.dtype, fill), (dims, keep, scale)

    def backward(self, ctx, dy):
        dims, keep, scale = ctx
        return (sum_dims(dy, dims, keep, scale),)


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
    if x.ndim == 0:  # torch: a 0-d tensor reduces over dim 0 or -1, leaving it as it is
        for d in dim:
            if d not in (0, -1):
                raise TileError(where, "dim out of range for a 0-d tensor (0 or -1)", str(d))
        return ()
    dims = tuple(sorted({norm_dim(int(d), x.ndim, where) for d in dim}))
    if len(dims) != len(tuple(dim)):
        raise TileError(where, "dims must be distinct", repr(dim))
    return dims


def _no_out(where: str, out) -> None:
    """NumPy's ``out=`` (``np.sum(x)`` and ``np.mean(x)`` pass ``out=None``): only None."""
    if out is not None:
        raise TileError(where, "out= is not supported: a TileTensor is never written in place; use the returned "
                        "tensor (out=None, as np.sum and np.mean pass it, is accepted)",
                        f"out={type(out).__name__} {out!r:.60}")


def _cast_first(x: TileTensor, dtype, where: str, floats_only: bool = False) -> tuple[TileTensor, np.dtype | None]:
    """``x`` cast to ``dtype`` (None: ``x`` itself) before a reduction, as torch's ``dtype=``
    does: the result has that dtype, and the gradient is cast back to ``x``'s."""
    if dtype is None:
        return x, None
    from .elementwise import _cast_checked, as_dtype

    dtype = as_dtype(dtype, where)
    if floats_only and dtype.kind != "f":
        raise TileError(where, "dtype must be a floating dtype (as torch requires of a mean or a norm)", str(dtype))
    return _cast_checked(x, dtype, where), dtype


def sum(x: TileTensor, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM, *,  # noqa: A001 - torch name
        dtype=None, keepdims: bool | None = None, axis=None, out=None) -> TileTensor:
    """Sum over ``dim`` (an int, a tuple, or None for all), as a tree over tiles.

    ``keepdim=True`` keeps each reduced dim with size 1 (as torch; ``keepdims`` and ``axis`` are
    NumPy's spellings of ``keepdim`` and ``dim``, accepted as in torch; passing both spellings of
    one parameter is an error). ``dtype``: the result's, ``x`` cast to it first (torch's; NumPy's
    result is the same); without it NumPy's rule (booleans and small integers sum to int64).
    ``out`` is NumPy's, so that ``np.sum(x)`` works; only None.

    >>> import numpy as np, tilegraph as tg
    >>> tg.sum(tg.from_numpy(np.ones((4, 3)), tiles=(2, 3)), 0, keepdim=True).numpy()
    array([[4., 4., 4.]])
    >>> np.sum(tg.from_numpy(np.arange(4, dtype=np.int8), tiles=3), dtype=np.float32).numpy()
    array(6., dtype=float32)
    """
    where = "tilegraph.sum"
    require_tensor(x, where, "x")
    _no_out(where, out)
    keep = bool(resolve_alias(where, "keepdim", keepdim, "keepdims", keepdims))
    dims = _dims(x, resolve_alias(where, "dim", dim, "axis", axis), where)
    x, dtype = _cast_first(x, dtype, where)
    return _sum_op(x, dims=dims, keep=(keep,) * len(dims), dtype=dtype)


def mean(x: TileTensor, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM, *, dtype=None, keepdims: bool | None = None,
         axis=None, out=None) -> TileTensor:
    """Mean over ``dim`` (an int, a tuple, or None for all); ``keepdim``, ``keepdims``, ``axis``,
    ``out`` as in :func:`sum`; ``dtype`` a float dtype (torch's rule) that ``x`` is cast to first.
    A float16 mean accumulates in float32, as NumPy's and torch's do.

    >>> import numpy as np, tilegraph as tg
    >>> np.mean(tg.from_numpy(np.arange(6.0).reshape(2, 3), tiles=(1, 2)), axis=1).numpy()
    array([1., 4.])
    """
    where = "tilegraph.mean"
    require_tensor(x, where, "x")
    _no_out(where, out)
    keep = bool(resolve_alias(where, "keepdim", keepdim, "keepdims", keepdims))
    dims = _dims(x, resolve_alias(where, "dim", dim, "axis", axis), where)
    x, _ = _cast_first(x, dtype, where, floats_only=True)
    count = math.prod(x.shape[d] for d in dims)
    # as NumPy and torch: the mean of integers is a float, that of nothing NaN
    return _sum_op(x, dims=dims, keep=(keep,) * len(dims), scale=1.0 / count if count else float("nan"),
                   dtype=np.mean(np.zeros(1, x.dtype)).dtype)


# ------------------------------------------------------------------------------- max / min ----
class MinMax(NamedTuple):
    """What ``x.max(dim)`` / ``x.min(dim)`` return, as torch's ``torch.return_types.max``:
    ``values`` and the int64 ``indices`` (along ``dim``) where they were found."""

    values: TileTensor
    indices: TileTensor


def _pick_ext(v, i, dim, largest):
    """Of the candidates along ``dim`` (values ``v``, their indices ``i``) the largest (smallest):
    the first such one, NaN before any number, as torch."""
    xp = xp_of(v)
    at = xp.expand_dims((xp.argmax if largest else xp.argmin)(v, axis=dim), dim)
    return xp.take_along_axis(v, at, dim), xp.take_along_axis(i, at, dim)


@kernel("minmax", cost=elementwise_cost(2))
def _minmax_tiles(*tiles, dim, start, largest, shape):
    """The extremum along ``dim`` of consecutive tiles (the first at index ``start``) and its index."""
    xp = xp_of(tiles[0])
    v = tiles[0] if len(tiles) == 1 else xp.concatenate(tiles, axis=dim)
    at = xp.expand_dims((xp.argmax if largest else xp.argmin)(v, axis=dim), dim)
    return xp.take_along_axis(v, at, dim).reshape(shape), (at + start).astype(np.int64).reshape(shape)


@kernel("minmax_merge", cost=elementwise_cost(2))
def _minmax_merge(*parts, dim, largest, shape):
    """Merge (values, indices) partials of consecutive runs of the dim (``parts``: v0, i0, v1, ...)."""
    xp = xp_of(parts[0])
    v, i = _pick_ext(xp.concatenate(parts[0::2], axis=dim), xp.concatenate(parts[1::2], axis=dim), dim, largest)
    return v.reshape(shape), i.reshape(shape)


@kernel("minmax_bwd", cost=elementwise_cost(2))
def _minmax_bwd(g, idx, *, dim, start, keep_shape, shape):
    """The cotangent ``g`` of the extrema put at their indices in a tile at ``start`` along ``dim``."""
    xp = xp_of(g)
    pos = xp.arange(start, start + shape[dim], dtype=np.int64).reshape([-1 if d == dim else 1
                                                                        for d in range(len(shape))])
    hit = pos == idx.reshape(keep_shape)
    return xp.where(hit, g.reshape(keep_shape), xp.zeros((), g.dtype))


def _minmax_tiles_of(x: TileTensor, dim: int, keep: bool, largest: bool):
    """Values and indices (plain tensors, no autograd record) of the extrema of ``x`` along ``dim``."""
    chunks = [c if d != dim else (1,) for d, c in enumerate(x.chunks)]
    keep_tiling = Tiling(chunks)
    out_tiling = keep_tiling if keep else Tiling(chunks[:dim] + chunks[dim + 1:])
    offs = x.tiling.offsets(dim)
    values = np.empty(out_tiling.grid, dtype=object)
    indices = np.empty(out_tiling.grid, dtype=object)
    op = "max" if largest else "min"
    for kidx in np.ndindex(*keep_tiling.grid):
        kshape = keep_tiling.tile_shape(kidx)
        oidx = kidx if keep else kidx[:dim] + kidx[dim + 1:]
        oshape = out_tiling.tile_shape(oidx)
        parts = [(j, x.grid[kidx[:dim] + (j,) + kidx[dim + 1:]]) for j in range(x.tiling.grid[dim])]

        def merge(group: list, final: bool):
            shape = oshape if final else kshape
            meta = [(shape, x.dtype), (shape, np.int64)]
            if isinstance(group[0][1], tuple):  # partials: (values, indices) pairs
                refs = emit(_minmax_merge, [r for _, pair in group for r in pair], meta, op=op, dim=dim,
                            largest=largest, shape=shape)
            else:
                refs = emit(_minmax_tiles, [r for _, r in group], meta, op=op, dim=dim, start=int(offs[group[0][0]]),
                            largest=largest, shape=shape)
            return tuple(refs) if final else (group[0][0], tuple(refs))

        values[oidx], indices[oidx] = merge_tree(parts, merge)
    return TileTensor(out_tiling, x.dtype, values), TileTensor(out_tiling, np.int64, indices)


class Extremum(Op):
    """The values of ``x.max(dim)`` / ``x.min(dim)`` (computed beside their indices); the gradient
    goes to the element each value came from."""

    name = "max"

    def forward(self, x, *, values, indices, dim, keep):
        return values, (x, indices, dim, keep)

    def backward(self, ctx, g):
        x, indices, dim, keep = ctx
        offs = x.tiling.offsets(dim)

        def fill(idx):
            gi = idx[:dim] + ((0,) if keep else ()) + idx[dim + 1:]
            shape = x.tiling.tile_shape(idx)
            keep_shape = tuple(1 if d == dim else n for d, n in enumerate(shape))
            return emit1(_minmax_bwd, [g.grid[gi], indices.grid[gi]], shape, g.dtype, op=f"{self.name}_bwd", dim=dim,
                         start=int(offs[idx[dim]]), keep_shape=keep_shape, shape=shape)

        return (new_tensor(x.tiling, g.dtype, fill),)


_EXT = Extremum()


def _ties(xp, x, m):
    """Where ``x`` equals the extremum ``m`` (a 0-d array); NaN equals a NaN extremum."""
    hit = x == m
    if m.dtype.kind == "f":
        hit |= xp.isnan(x) & xp.isnan(m)
    return hit


@kernel("ties_count", cost=elementwise_cost(1))
def _ties_count(x, m):
    """How many elements of a tile equal the extremum (as x's float dtype, shape (1,) * ndim)."""
    xp = xp_of(x)
    return _ties(xp, x, m).sum(dtype=x.dtype).reshape((1,) * x.ndim)


@kernel("ties_grad", cost=elementwise_cost(2))
def _ties_grad(x, m, g, count):
    """The cotangent ``g`` of the extremum shared evenly by the elements equal to it."""
    xp = xp_of(x)
    share = (g / count.reshape(())).astype(x.dtype)
    return xp.where(_ties(xp, x, m), share, xp.zeros((), x.dtype))


class WholeExtremum(Op):
    """The value of ``x.max()`` / ``x.min()`` (over every dim, computed before); as torch's, the
    gradient is shared evenly by the elements equal to it."""

    name = "max"

    def forward(self, x, *, value):
        return value, (x, value)

    def backward(self, ctx, g):
        x, value = ctx
        m = value.grid[()]
        counts = [emit1(_ties_count, [x.grid[idx], m], (1,) * x.ndim, x.dtype, op=f"{self.name}_bwd")
                  for idx in np.ndindex(*x.tiling.grid)]
        count = _tree(counts, (), x.dtype, (), 1.0, f"{self.name}_bwd")
        return (new_tensor(x.tiling, x.dtype, lambda idx: emit1(
            _ties_grad, [x.grid[idx], m, g.grid[()], count], x.tiling.tile_shape(idx), x.dtype,
            op=f"{self.name}_bwd")),)


_WHOLE = {True: WholeExtremum(), False: WholeExtremum()}
_WHOLE[False].name = "min"


def _extremum(x, dim, keepdim, largest: bool, where: str):
    require_tensor(x, where, "x")
    if isinstance(dim, TileTensor):
        raise TileError(where, "the element-wise maximum or minimum of two tensors is not supported; pass a dim "
                        "(an int) for the values and indices along it", "a TileTensor as dim")
    if x.dtype.kind not in "biuf":
        raise TileError(where, "x must be a bool, integer or float tensor", str(x.dtype))
    if x.size == 0:
        raise TileError(where, "the maximum or minimum of no elements is not defined (as torch refuses it)",
                        f"a tensor of shape {x.shape}")
    if dim is None:
        # over every dim: one dim after another, with no record; the gradient (as torch's, which
        # shares it evenly by the elements equal to the extremum) comes from WholeExtremum
        if isinstance(keepdim, bool) and keepdim:
            raise TileError(where, "keepdim needs a dim (x.max() reduces every dim to a scalar)", "keepdim=True")
        out = x
        while out.ndim:
            out = _minmax_tiles_of(out, out.ndim - 1, False, largest)[0]
        return _WHOLE[largest](x, value=out) if x.dtype.kind == "f" and x.ndim else out
    d = norm_dim(dim, x.ndim, where)
    if not isinstance(keepdim, (bool, np.bool_)):
        raise TileError(where, "keepdim must be a bool", f"{keepdim!r:.60}")
    if x.ndim == 0:  # torch: the element itself, at index 0
        from tilegraph._tensor import from_numpy

        return MinMax(x, from_numpy(np.zeros((), np.int64)))
    values, indices = _minmax_tiles_of(x, d, bool(keepdim), largest)
    if x.dtype.kind == "f":
        values = (_EXT if largest else _EXT_MIN)(x, values=values, indices=indices, dim=d, keep=bool(keepdim))
    return MinMax(values, indices)


_EXT_MIN = Extremum()
_EXT_MIN.name = "min"


def max(x: TileTensor, dim=None, keepdim: bool = False):  # noqa: A001 - torch name
    """torch's ``max``: with ``dim``, ``(values, indices)`` of the largest elements along it (a
    :class:`MinMax` named tuple: ``x.max(1).values``; ties: the first; NaN counts as largest); without,
    the largest element as a scalar tensor. The gradient goes to the element each value came from
    (without ``dim``, as torch: shared evenly by the elements equal to the largest).

    >>> import numpy as np, tilegraph as tg
    >>> v, i = tg.max(tg.from_numpy(np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 7.0]]), tiles=(1, 2)), 1)
    >>> v.numpy(), i.numpy()
    (array([5., 7.]), array([1, 0]))
    """
    return _extremum(x, dim, keepdim, True, "tilegraph.max")


def min(x: TileTensor, dim=None, keepdim: bool = False):  # noqa: A001 - torch name
    """torch's ``min``: as :func:`max`, for the smallest elements."""
    return _extremum(x, dim, keepdim, False, "tilegraph.min")


# ------------------------------------------------------------------------------- var / std ----
def var(x: TileTensor, dim=ALL_DIMS, unbiased: bool | None = None, keepdim: bool = NO_KEEPDIM, *,
        correction=None, keepdims: bool | None = None, axis=None, where: str = "tilegraph.var") -> TileTensor:
    """torch's ``var``: the mean of squared deviations from the mean over ``dim``, divided by
    ``N - correction`` instead of N (``correction=1`` by default, Bessel's; ``unbiased=False`` is
    ``correction=0``). Where ``N - correction <= 0`` the result is NaN. Built from mean, sub and
    mul, so its gradient is theirs. A float16 variance is computed in float32 and rounded once, as
    torch's: the float16 mean of values in the hundreds is off by up to a quarter, and each
    deviation with it.

    >>> import numpy as np, tilegraph as tg
    >>> tg.var(tg.from_numpy(np.array([1.0, 2.0, 3.0, 4.0]), tiles=3)).numpy()
    array(1.66666667)
    """
    require_tensor(x, where, "x")
    if x.dtype.kind not in "fc":
        raise TileError(where, "x must have a floating dtype (cast it first: x.float())", str(x.dtype))
    if unbiased is not None and correction is not None:
        raise TileError(where, "pass unbiased= or correction=, not both", f"unbiased={unbiased!r}, "
                        f"correction={correction!r}")
    if unbiased is not None and not isinstance(unbiased, (bool, np.bool_)):
        raise TileError(where, "unbiased must be a bool (torch's; correction= takes a number)", f"{unbiased!r:.60}")
    if correction is None:
        correction = 0 if unbiased is False else 1
    if isinstance(correction, bool) or not isinstance(correction, (int, float, np.integer, np.floating)) or \
            not math.isfinite(correction) or correction < 0:
        raise TileError(where, "correction must be a number >= 0", f"{correction!r:.60}")
    keep = bool(resolve_alias(where, "keepdim", keepdim, "keepdims", keepdims))
    dims = _dims(x, resolve_alias(where, "dim", dim, "axis", axis), where)
    n = math.prod(x.shape[d] for d in dims)
    from .elementwise import _cast_checked, mul, sub

    if x.dtype == np.float16:  # (values near 300 with a spread of 1 gave a variance 0.5% too large)
        return _cast_checked(var(_cast_checked(x, np.float32, where), dims, keepdim=keep, correction=correction,
                                 where=where), np.float16, where)

    d = sub(x, _sum_op(x, dims=dims, keep=(True,) * len(dims), scale=1.0 / n if n else float("nan")))
    scale = 1.0 / (n - correction) if n - correction > 0 else float("nan")
    return _sum_op(mul(d, d), dims=dims, keep=(keep,) * len(dims), scale=scale)


def std(x: TileTensor, dim=ALL_DIMS, unbiased: bool | None = None, keepdim: bool = NO_KEEPDIM, *,
        correction=None, keepdims: bool | None = None, axis=None, where: str = "tilegraph.std") -> TileTensor:
    """torch's ``std``: the square root of :func:`var` (same arguments). Its gradient is torch's,
    0 where the variance is 0 (a constant row), not the NaN of ``0 * inf``.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.array([[1.0, 1.0, 1.0], [1.0, 2.0, 3.0]]), tiles=(1, 2))
    >>> s = tg.std(x, 1)
    >>> s.numpy(), tg.grad(s.sum(), [x])[0].numpy()[0]
    (array([0., 1.]), array([0., 0., 0.]))
    """
    from .elementwise import pow
    from .where import where as where_

    v = var(x, dim, unbiased, keepdim, correction=correction, keepdims=keepdims, axis=axis, where=where)
    # the square root where the variance is positive; elsewhere the variance itself (0, or NaN where
    # N - correction <= 0), whose gradient 1 meets deviations that are all 0: the root's gradient
    # at 0 (inf) times them was NaN, and NaN reached every gradient before it
    pos = v > 0
    return where_(pos, pow(where_(pos, v, 1.0), 0.5), v)


# ------------------------------------------------------------------------------------ norm ----
def _norm_order(p, where: str):
    """``p`` as 1, 2 or inf (``'fro'`` is 2), or a TileError naming the supported orders."""
    if isinstance(p, str):
        if p == "fro":
            return 2
    elif not isinstance(p, (bool, np.bool_)) and isinstance(p, (int, float, np.integer, np.floating)):
        if p in (1, 2):
            return int(p)
        if p == math.inf:
            return math.inf
    raise TileError(where, "p must be 2 (or 'fro'), 1 or inf (float('inf')); other orders (0, -inf, 3, 'nuc', "
                    "...) are not supported", f"p={p!r:.60}")


def norm(x: TileTensor, p=2, dim=None, keepdim: bool = False, *, dtype=None, out=None,
         where: str = "tilegraph.norm") -> TileTensor:
    """torch's ``norm`` (a vector norm over ``dim``: an int, a tuple, or None for every element):
    ``p=2`` (or ``'fro'``) the square root of the sum of squares, ``p=1`` the sum of absolute
    values, ``p=inf`` the largest absolute value. Built from ``mul``/``abs``, :func:`sum`,
    ``pow``, ``where`` and :func:`max`, so its gradient is theirs, and torch's: 0 for the 2-norm
    of zeros (not NaN); for the inf-norm, shared evenly by the elements equal to the largest.
    ``dtype``: ``x`` is cast to it first; a float16 norm is computed in float32 and rounded once.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.array([[3.0, -4.0], [0.0, 0.0]]), tiles=(1, 1))
    >>> tg.norm(x, dim=1).numpy(), x.norm(1).numpy(), x.norm(float("inf"), dim=0).numpy()
    (array([5., 0.]), array(7.), array([3., 4.]))
    """
    from .elementwise import _cast_checked, absolute, add, cast, div, mul, sub
    from .shape import checked_reshape
    from .where import compare, where as where_

    require_tensor(x, where, "x")
    _no_out(where, out)
    order = _norm_order(p, where)
    if not isinstance(keepdim, (bool, np.bool_)):
        raise TileError(where, "keepdim must be a bool", f"{keepdim!r:.60}")
    x, _ = _cast_first(x, dtype, where, floats_only=True)
    if x.dtype.kind != "f":
        raise TileError(where, "x must have a floating dtype (cast it first: x.float(), or pass dtype=)", str(x.dtype))
    dims = _dims(x, dim, where)
    keep = (bool(keepdim),) * len(dims)
    if x.dtype == np.float16:  # squares of halves overflow from 256 on: the norm in float32, rounded once
        return _cast_checked(norm(_cast_checked(x, np.float32, where), p, dim, keepdim, where=where), np.float16,
                             where)
    if order == 1:
        return sum_dims(absolute(x), dims, keep)
    if order == 2:
        s = sum_dims(mul(x, x), dims, keep)
        # sqrt where the sum is positive, 0 elsewhere, with the square root never taken of 0: its
        # gradient there (inf) times the zeros of where's other branch would be NaN (torch's is 0)
        pos = s > 0
        return where_(pos, where_(pos, s, 1.0) ** 0.5, 0.0)
    # the largest absolute value m (detached), and the gradient shared by the elements equal to it,
    # as torch's: m + sum(where(|x| == m, |x| - m, 0)) / count is m exactly, its gradient 1/count there
    a = absolute(x)
    m = a.detach()
    for d in reversed(dims):
        m = _extremum(m, d, True, True, where).values  # (B, 1, ...): kept, to broadcast against a
    hit = compare(a, m, "eq", where)
    kept = (True,) * len(dims)
    result = add(m, div(sum_dims(where_(hit, sub(a, m), 0.0), dims, kept), sum_dims(cast(hit, x.dtype), dims, kept)))
    if keepdim:
        return result
    return checked_reshape(result, tuple(n for d, n in enumerate(result.shape) if d not in dims), where)
