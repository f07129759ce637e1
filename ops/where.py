"""Comparisons and selection by a mask, as torch's: ``x > 0``, ``x.eq(y)`` (bool tensors, which
carry no gradient), ``tg.where(cond, a, b)`` and ``x.masked_fill(mask, value)`` (the gradient goes
to whichever input each element came from). Operands broadcast as NumPy's do; a Python number may
stand for either value.

>>> import numpy as np, tilegraph as tg
>>> x = tg.from_numpy(np.array([-1.0, 2.0, -3.0, 4.0]), tiles=3)
>>> tg.where(x > 0, x, 0.0).numpy()
array([0., 2., 0., 4.])
>>> x.masked_fill(x < 0, -9.0).numpy()
array([-9.,  2., -9.,  4.])
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import emit1, kernel
from tilegraph._tensor import TileTensor

from ._common import elementwise_cost, new_tensor, xp_of
from .elementwise import _number, _pick, _scalar, broadcast_tiling, unbroadcast

__all__ = ["where", "masked_fill", "compare", "COMPARISONS", "logical", "LOGICAL", "logical_and", "logical_or",
           "logical_xor", "logical_not"]

#: torch's names of the comparisons and the NumPy ufunc of each
COMPARISONS = {"gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal", "eq": "equal",
               "ne": "not_equal"}
_SYMBOL = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "eq": "==", "ne": "!="}


@kernel("compare", cost=elementwise_cost(1))
def _compare(a, b=None, *, how, value=None):
    return getattr(xp_of(a), COMPARISONS[how])(a, b if value is None else value)  # a number: NumPy's (and torch's) promotion


@kernel("where", cost=elementwise_cost(1))
def _where(cond, *tiles, a_value=None, b_value=None, dtype):
    """``cond ? a : b`` over the tiles given (``cond``, then ``a`` and ``b`` unless a number
    stands for them), in ``dtype``."""
    xp = xp_of(cond)
    it = iter(tiles)
    a = next(it) if a_value is None else xp.asarray(a_value, dtype=dtype)
    b = next(it) if b_value is None else xp.asarray(b_value, dtype=dtype)
    out = xp.where(cond, a, b)
    return out if out.dtype == dtype else out.astype(dtype)


def _broadcast(where: str, tensors: list) -> tuple:
    """The tiling of ``tensors`` broadcast together, and for each the map of its dims to the
    result's (:func:`broadcast_tiling`, folded over several operands)."""
    tiling, maps = None, []
    for t in tensors:
        if tiling is None:
            tiling, maps = t.tiling, [list(range(t.ndim))]
            continue
        shape = SimpleNamespace(ndim=len(tiling.shape), shape=tiling.shape, chunks=tiling.chunks)
        tiling, old, new = broadcast_tiling(where, shape, t)
        maps = [[old[m] if m is not None else None for m in mp] for mp in maps] + [new]
    return tiling, maps


class Compare(Op):
    """``a <op> b`` element by element: a bool tensor, no gradient."""

    name = "compare"

    def forward(self, a, b, op):
        where = f"tilegraph.{op}"
        if isinstance(b, TileTensor):
            if a.dtype.kind == "b" and b.dtype.kind == "b" and op not in ("eq", "ne"):
                raise TileError(where, "numbers to order (bool tensors compare with eq/ne only)", "two bool tensors")
            tiling, (amap, bmap) = _broadcast(where, [a, b])

            def fill(idx):
                return emit1(_compare, [_pick(a, amap, idx), _pick(b, bmap, idx)], tiling.tile_shape(idx),
                             np.bool_, op="compare", how=op)
        else:
            tiling = a.tiling

            def fill(idx):
                r = a.grid[idx]
                return emit1(_compare, [r], r.shape, np.bool_, op="compare", how=op, value=_number(b))

        return new_tensor(tiling, np.bool_, fill), None

    def backward(self, ctx, g):
        return None, None


_compare_op = Compare()


def compare(a, b, op: str, where: str | None = None) -> TileTensor:
    """``a <op> b`` for ``op`` among :data:`COMPARISONS` (torch's ``gt``, ``ge``, ``lt``, ``le``,
    ``eq``, ``ne``): a bool tensor of the broadcast shape; ``b`` a TileTensor or a real number."""
    where = where or f"tilegraph.{op}"
    if not isinstance(a, TileTensor):
        raise TileError(where, "a TileTensor on the left", f"{type(a).__name__} {a!r:.60}")
    if not (isinstance(b, TileTensor) or _scalar(b)):
        hint = " (wrap a NumPy array with tg.from_numpy)" if isinstance(b, np.ndarray) else ""
        raise TileError(where, f"a TileTensor or a real number to compare with{hint}", f"{type(b).__name__} {b!r:.60}")
    if isinstance(b, TileTensor) and a.dtype != b.dtype:
        raise TileError(where, "tensors of one dtype (cast one first)", f"{a.dtype} {_SYMBOL[op]} {b.dtype}")
    return _compare_op(a, b, op=op)


#: the logical ops on bool tensors (torch's ``&``, ``|``, ``^``; ``~`` is "not") and the NumPy ufunc of each
LOGICAL = {"and": "logical_and", "or": "logical_or", "xor": "logical_xor", "not": "logical_not"}
_LOGICAL_SYMBOL = {"and": "&", "or": "|", "xor": "^", "not": "~"}


@kernel("logical", cost=elementwise_cost(1))
def _logical(a, b=None, *, how, value=None):
    ufunc = getattr(xp_of(a), LOGICAL[how])
    if how == "not":
        return ufunc(a)
    return ufunc(a, b if value is None else value)


class Logical(Op):
    """``a & b``, ``a | b``, ``a ^ b`` or ``~a`` of bool tensors (``b`` a bool tensor, or a bool
    in ``value``): a bool tensor of the broadcast shape, no gradient."""

    name = "logical"

    def forward(self, a, b, how, value=None, where="tilegraph.logical"):
        tensors = [a] if b is None else [a, b]
        tiling, maps = _broadcast(where, tensors)
        params = {} if value is None else {"value": bool(value)}

        def fill(idx):
            return emit1(_logical, [_pick(t, m, idx) for t, m in zip(tensors, maps)], tiling.tile_shape(idx),
                         np.bool_, op="logical", how=how, **params)

        return new_tensor(tiling, np.bool_, fill), None

    def backward(self, ctx, g):
        return None, None


_logical_op = Logical()


def logical(a, b, how: str, where: str | None = None) -> TileTensor:
    """torch's ``logical_and`` / ``logical_or`` / ``logical_xor`` (``&``, ``|``, ``^`` of bool
    tensors) and ``logical_not`` (``~``, ``b`` None) for ``how`` "and", "or", "xor", "not": masks
    combined element by element, shapes broadcast as NumPy's; ``b`` a bool TileTensor or a bool.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.array([-1.0, 0.5, 2.0]))
    >>> ((x > 0) & (x < 1)).numpy(), (~(x > 0)).numpy()
    (array([False,  True, False]), array([ True, False, False]))
    """
    where = where or f"tilegraph.logical_{how}"
    symbol = _LOGICAL_SYMBOL[how]
    for name, v in (("a", a), ("b", b)):
        if name == "b" and (how == "not" or isinstance(v, (bool, np.bool_))):
            continue
        if not isinstance(v, TileTensor) or v.dtype.kind != "b":
            got = f"a {v.dtype} tensor" if isinstance(v, TileTensor) else f"{type(v).__name__} {v!r:.60}"
            hint = " (wrap a NumPy mask with tg.from_numpy)" if isinstance(v, np.ndarray) else ""
            raise TileError(where, f"{symbol} takes bool tensors (masks, from comparisons such as x > 0) or a bool; "
                            f"bitwise ops on integers are not supported{hint}", f"{name}: {got}")
    if isinstance(b, TileTensor):
        return _logical_op(a, b, how=how, where=where)
    return _logical_op(a, None, how=how, value=None if how == "not" else bool(b), where=where)


def logical_and(input: TileTensor, other) -> TileTensor:  # noqa: A002 - torch names
    """torch's ``logical_and``: ``input & other`` of bool tensors (:func:`logical`)."""
    return logical(input, other, "and")


def logical_or(input: TileTensor, other) -> TileTensor:  # noqa: A002 - torch names
    """torch's ``logical_or``: ``input | other`` of bool tensors."""
    return logical(input, other, "or")


def logical_xor(input: TileTensor, other) -> TileTensor:  # noqa: A002 - torch names
    """torch's ``logical_xor``: ``input ^ other`` of bool tensors."""
    return logical(input, other, "xor")


def logical_not(input: TileTensor) -> TileTensor:  # noqa: A002 - torch names
    """torch's ``logical_not``: ``~input`` of a bool tensor."""
    return logical(input, None, "not")


class Where(Op):
    """``cond ? a : b``; the gradient of ``a`` is ``g`` where ``cond`` holds (0 elsewhere), that
    of ``b`` the rest, each summed over the dims it was broadcast along."""

    name = "where"

    def forward(self, cond, a, b, dtype):
        where = "tilegraph.where"
        tensors = [t for t in (cond, a, b) if isinstance(t, TileTensor)]
        tiling, maps = _broadcast(where, tensors)
        values = {} if isinstance(a, TileTensor) else {"a_value": _number(a)}
        if not isinstance(b, TileTensor):
            values["b_value"] = _number(b)

        def fill(idx):
            refs = [_pick(t, m, idx) for t, m in zip(tensors, maps)]
            return emit1(_where, refs, tiling.tile_shape(idx), dtype, op="where", dtype=dtype.str, **values)

        return new_tensor(tiling, dtype, fill), (cond, a, b)

    def backward(self, ctx, g):
        cond, a, b = ctx
        ga = unbroadcast(_where_op(cond, g, 0.0, dtype=g.dtype), a) if _floats(a) else None
        gb = unbroadcast(_where_op(cond, 0.0, g, dtype=g.dtype), b) if _floats(b) else None
        return None, ga, gb


def _floats(x) -> bool:
    """Whether ``x`` is a tensor that takes a gradient (an integer one, which a number made float,
    takes none)."""
    return isinstance(x, TileTensor) and x.dtype.kind == "f"


_where_op = Where()


def where(condition: TileTensor, input, other) -> TileTensor:
    """torch's ``where(condition, input, other)``: ``input`` where ``condition`` (a bool tensor)
    holds, ``other`` elsewhere; either value may be a real number (the result has the other's
    dtype, but for an integer or bool tensor with a float, which is float64: NumPy's rule).
    Shapes broadcast as NumPy's; dims that are not broadcast must have the same tiles."""
    where_ = "tilegraph.where"
    if not isinstance(condition, TileTensor) or condition.dtype.kind != "b":
        got = f"a {condition.dtype} tensor" if isinstance(condition, TileTensor) else type(condition).__name__
        raise TileError(where_, "condition must be a bool TileTensor (x > 0, or a NumPy mask via tg.from_numpy)",
                        got)
    for name, v in (("input", input), ("other", other)):
        if not (isinstance(v, TileTensor) or _scalar(v)):
            hint = " (wrap a NumPy array with tg.from_numpy)" if isinstance(v, np.ndarray) else ""
            raise TileError(where_, f"{name} must be a TileTensor or a real number{hint}", f"{type(v).__name__} "
                            f"{v!r:.60}")
    tensors = [v for v in (input, other) if isinstance(v, TileTensor)]
    if not tensors:
        raise TileError(where_, "input or other must be a TileTensor (for a 0/1 mask: condition.float())",
                        f"two numbers, {input!r} and {other!r}")
    if len(tensors) == 2 and input.dtype != other.dtype:
        raise TileError(where_, "input and other of one dtype (cast one first)", f"{input.dtype} and {other.dtype}")
    dtype = tensors[0].dtype
    if len(tensors) == 1:
        dtype = _with_number(dtype, other if tensors[0] is input else input, where_)
    return _where_op(condition, input, other, dtype=dtype)


def _with_number(dtype: np.dtype, value, where: str) -> np.dtype:
    """The dtype of ``where(cond, tensor, value)`` for a tensor of ``dtype`` and a number, as
    NumPy's ``np.where`` (and torch's, up to its float32) give it: a float tensor keeps its dtype;
    an integer or bool tensor with a fraction, or any float, is float64 (0.5 was cut to 0);
    a bool tensor with an integer is int64; an integer tensor keeps its dtype with an integer it
    holds (one it cannot hold is a TileError here, not an OverflowError of the kernel)."""
    if dtype.kind == "f":
        return dtype
    if isinstance(value, (float, np.floating)):
        return np.dtype(np.float64)
    if dtype.kind == "b":
        return np.dtype(np.int64)
    _fits(dtype, value, where)
    return dtype


def _fits(dtype: np.dtype, value, where: str) -> None:
    """A TileError unless an integer tensor of ``dtype`` holds ``value`` (a float: its whole part, as cut)."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if isinstance(value, (int, np.integer)):
            holds = info.min <= int(value) <= info.max
        else:
            holds = math.isfinite(value) and info.min - 1 < value < info.max + 1
        if not holds:
            raise TileError(where, f"a number that the {dtype} tensor holds ([{info.min}, {info.max}]; cast the "
                            "tensor to a wider dtype first)", f"{value!r}")


def masked_fill(x: TileTensor, mask: TileTensor, value, where: str = "tilegraph.masked_fill") -> TileTensor:
    """torch's ``masked_fill``: ``x`` with ``value`` (a real number) where ``mask`` (a bool
    tensor broadcasting to ``x``'s shape) holds; the gradient of ``x`` is 0 there."""
    if not isinstance(x, TileTensor):
        raise TileError(where, "x must be a TileTensor", type(x).__name__)
    if not _scalar(value):
        raise TileError(where, "value must be a real number (a tensor of values: tg.where(mask, values, x))",
                        f"{type(value).__name__} {value!r:.60}")
    if not isinstance(mask, TileTensor) or mask.dtype.kind != "b":
        got = f"a {mask.dtype} tensor" if isinstance(mask, TileTensor) else type(mask).__name__
        raise TileError(where, "mask must be a bool TileTensor (x > 0, or a NumPy mask via tg.from_numpy)", got)
    try:
        fits = np.broadcast_shapes(mask.shape, x.shape) == x.shape
    except ValueError:
        fits = False
    if not fits:
        raise TileError(where, f"a mask that broadcasts to x's shape {x.shape}", f"mask of shape {mask.shape}")
    _fits(x.dtype, value, where)  # x's dtype kept, as torch's (a fraction into an integer x is cut, as there)
    return _where_op(mask, value, x, dtype=x.dtype)
