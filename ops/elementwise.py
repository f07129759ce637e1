"""Elementwise ops: broadcasting add/sub/mul/div, scalar affine maps and activations."""

from __future__ import annotations

import math
import numbers

import numba
import numpy as np
from llvmlite import ir as llvm_ir
from numba.core import types as nb_types
from numba.extending import intrinsic

from tilegraph._autograd import Op
from tilegraph._config import as_dtype  # noqa: F401 - the one parser of dtype arguments (ops.reduce imports it here)
from tilegraph._errors import TileError
from tilegraph._graph import emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import (acc_dtype, elementwise_cost, new_tensor, require_float, require_same_dtype, require_tensor,
                      xp_of)
from ._gpu import fused

__all__ = ["add", "sub", "mul", "div", "floor_divide", "remainder", "pow", "affine", "gelu", "relu", "silu", "exp",
           "log", "tanh", "sigmoid", "absolute", "clamp", "cast", "ones_like", "zeros_like", "unbroadcast",
           "broadcast_tiling"]


# ------------------------------------------------------------------------------ broadcasting ----
def broadcast_tiling(where: str, a: TileTensor, b: TileTensor) -> tuple[Tiling, list, list]:
    """Tiling of ``a op b`` under NumPy broadcasting, plus per output dim how each input indexes.

    A dim of size 1 broadcasts; dims that are not broadcast must have identical tiles.
    Returns (tiling, a_map, b_map) where ``x_map[d]`` is the output dim an input dim follows,
    or ``None`` when that input dim is broadcast (always tile 0).
    """
    nd = max(a.ndim, b.ndim)
    chunks = []
    a_map: list = [None] * a.ndim
    b_map: list = [None] * b.ndim
    for d in range(nd):
        da, db = d - (nd - a.ndim), d - (nd - b.ndim)
        na = a.shape[da] if da >= 0 else 1
        nb = b.shape[db] if db >= 0 else 1
        if na == nb:
            if da >= 0 and db >= 0 and a.chunks[da] != b.chunks[db]:
                fix = tuple(a.chunks[e - nd + a.ndim] if e - nd + a.ndim >= 0 and a.shape[e - nd + a.ndim] == n
                            else None for e, n in zip(range(nd - b.ndim, nd), b.shape))
                raise TileError(where, f"dim {d} must have the same tiles in both operands (cut b as a: "
                                f"b.rechunk({fix}), or build them with the same tiles)",
                                f"{a.chunks[da]} vs {b.chunks[db]} (shapes {a.shape} and {b.shape})")
            chunks.append(a.chunks[da] if da >= 0 else b.chunks[db])
        elif na == 1:
            chunks.append(b.chunks[db])
        elif nb == 1:
            chunks.append(a.chunks[da])
        else:
            raise TileError(where, "shapes do not broadcast", f"{a.shape} and {b.shape}")
        if da >= 0 and na != 1:
            a_map[da] = d
        if db >= 0 and nb != 1:
            b_map[db] = d
    return Tiling(chunks), a_map, b_map


def _pick(t: TileTensor, dmap: list, idx: tuple):
    return t.grid[tuple(idx[m] if m is not None else 0 for m in dmap)]


def unbroadcast(g: TileTensor, target: TileTensor) -> TileTensor:
    """Sum ``g`` over the dims that broadcasting added to ``target`` (gradient of a broadcast)."""
    from .reduce import sum_dims

    if g.shape == target.shape:
        return g
    lead = g.ndim - target.ndim
    dims = list(range(lead))
    for d in range(target.ndim):
        if target.shape[d] == 1 and g.shape[lead + d] != 1:
            dims.append(lead + d)
    keep = tuple(d >= lead for d in dims)
    out = sum_dims(g, tuple(dims), keep)
    if out.chunks != target.chunks:  # pragma: no cover - guarded by broadcast_tiling
        raise AssertionError(f"unbroadcast produced {out.chunks}, expected {target.chunks}")
    return out


# --------------------------------------------------------------------------------- binary ----
@kernel("add", cost=elementwise_cost(1))
def _add(a, b):
    return a + b


@kernel("sub", cost=elementwise_cost(1))
def _sub(a, b):
    return a - b


@kernel("mul", cost=elementwise_cost(1))
def _mul(a, b):
    return a * b


@kernel("div", cost=elementwise_cost(1))
def _div(a, b):
    return a / b


class Binary(Op):
    def __init__(self, name, kern):
        self.name, self.kern = name, kern

    def forward(self, a, b):
        where = f"tilegraph.{self.name}"
        dtype = require_same_dtype(where, a=a, b=b)
        if dtype.kind == "b" and self.name == "sub":
            raise TileError(where, "numbers to subtract (NumPy refuses booleans: use logical ops, or cast)",
                            "two bool tensors")
        if self.name == "div" and dtype.kind not in "fc":
            dtype = np.dtype(np.float64)  # true division, as NumPy and torch: integers give floats
        tiling, amap, bmap = broadcast_tiling(where, a, b)

        def fill(idx):
            shape = tiling.tile_shape(idx)
            return emit1(self.kern, [_pick(a, amap, idx), _pick(b, bmap, idx)], shape, dtype, op=self.name)

        return new_tensor(tiling, dtype, fill), (a, b)

    def backward(self, ctx, g):
        a, b = ctx
        if self.name == "add":
            return unbroadcast(g, a), unbroadcast(g, b)
        if self.name == "sub":
            return unbroadcast(g, a), unbroadcast(affine(g, -1.0), b)
        if self.name == "mul":
            return unbroadcast(mul(g, b), a), unbroadcast(mul(g, a), b)
        # div: d(a/b) = g/b, -g*a/b^2
        gb = div(g, b)
        return unbroadcast(gb, a), unbroadcast(affine(mul(gb, div(a, b)), -1.0), b)


_add_op, _sub_op, _mul_op, _div_op = (Binary("add", _add), Binary("sub", _sub), Binary("mul", _mul),
                                      Binary("div", _div))


def _scalar(x) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool)


def _number(x) -> int | float:
    """A Python int or float (an integer stays one: an integer tensor plus 1 stays integer)."""
    return int(x) if isinstance(x, (int, np.integer)) else float(x)


def _operands(where: str, a, b) -> None:
    """Each of ``a``, ``b`` a TileTensor or a number (one at least a tensor)."""
    for name, x in (("a", a), ("b", b)):
        if not (isinstance(x, TileTensor) or _scalar(x)):
            hint = ""
            if isinstance(x, np.ndarray):
                hint = " (wrap a NumPy array with tg.from_numpy)"
            elif type(x).__module__.startswith("torch"):  # x + torch.tensor(1.0), ported as it was
                hint = " (wrap a torch tensor with tg.from_numpy; a number as a float: t.item())"
            raise TileError(where, f"{name} must be a TileTensor or a real number (not a bool){hint}",
                            f"{type(x).__name__} {x!r:.60}")


def _promote_int(a, b):
    """torch's promotion of an integer or bool tensor beside a float one: it takes the float
    tensor's dtype (``x * mask`` with a tokenizer's int64 attention mask was refused, "inputs must
    share one dtype"). Two float dtypes stay refused (cast one), as do two integer ones."""
    if isinstance(a, TileTensor) and isinstance(b, TileTensor):
        ka, kb = a.dtype.kind, b.dtype.kind
        if ka == "f" and kb in "biu":
            b = cast(b, a.dtype)
        elif kb == "f" and ka in "biu":
            a = cast(a, b.dtype)
    return a, b


def add(a, b) -> TileTensor:
    """``a + b`` with NumPy broadcasting; either may be a Python number. An integer or bool tensor
    beside a float one is taken in the float one's dtype, as torch promotes it."""
    _operands("tilegraph.add", a, b)
    if _scalar(b):
        return affine(a, 1, _number(b))
    if _scalar(a):
        return affine(b, 1, _number(a))
    return _add_op(*_promote_int(a, b))


def sub(a, b) -> TileTensor:
    _operands("tilegraph.sub", a, b)
    if _scalar(b):
        return affine(a, 1, -_number(b))
    if _scalar(a):
        return affine(b, -1, _number(a))
    return _sub_op(*_promote_int(a, b))


def mul(a, b) -> TileTensor:
    _operands("tilegraph.mul", a, b)
    if _scalar(b):
        return affine(a, _number(b))
    if _scalar(a):
        return affine(b, _number(a))
    return _mul_op(*_promote_int(a, b))


def div(a, b) -> TileTensor:
    _operands("tilegraph.div", a, b)
    if _scalar(b):
        with np.errstate(divide="ignore"):  # by zero: inf, as NumPy and torch divide (0 / 0: NaN)
            return affine(a, float(np.float64(1.0) / np.float64(b)))
    if _scalar(a):  # a number over a tensor (``1 / x``): a * b ** -1; integers divide as floats
        if b.dtype.kind not in "fc":
            b = cast(b, np.float64)
        return mul(pow(b, -1.0), _number(a))
    return _div_op(*_promote_int(a, b))


# ------------------------------------------------------------- floor division and remainder ----
# ``a // b`` rounds toward -inf and ``a % b`` takes the sign of ``b`` (Python's rule), for integers
# and floats alike: torch's floor_divide and remainder, NumPy's floor_divide and remainder (the
# kernels). An integer divided by zero is an error, as torch's (NumPy would give 0 silently).
_DIVMOD = {"floor_divide": "//", "remainder": "%"}


@kernel("divmod", cost=elementwise_cost(4))
def _divmod_k(a, b=None, *, how, value=None, reverse=False, dtype):
    xp = xp_of(a)
    x, y = (a, b) if b is not None else ((value, a) if reverse else (a, value))
    if np.dtype(dtype).kind in "iu" and bool((xp.asarray(y) == 0).any()):
        raise ZeroDivisionError(f"integer {_DIVMOD[how]} by zero (torch refuses it too; cast to a float dtype "
                                "for inf and NaN)")
    with np.errstate(divide="ignore", invalid="ignore"):  # a float by zero: inf or NaN, as torch's
        out = getattr(xp, how)(x, y)
    return out.astype(dtype, copy=False)


class DivMod(Op):
    """``a // b`` or ``a % b`` (``how``), of two tensors (broadcast) or of a tensor and a number
    ``value`` (``reverse``: the number on the left). Floor division has no gradient (its derivative
    is 0 wherever it is defined; torch's has none); the remainder's is ``g`` for ``a`` and
    ``-g * (a // b)`` for ``b``, as torch's."""

    name = "divmod"

    def forward(self, a, b=None, *, how, value=None, reverse=False):
        where = f"tilegraph.{how}"
        tensors = [a] if b is None else [a, b]
        if b is None:
            dtype = _divmod_dtype(where, a.dtype, value)
            tiling, maps = a.tiling, [list(range(a.ndim))]
            params = {"value": value, "reverse": reverse}
        else:
            dtype = require_same_dtype(where, a=a, b=b)
            tiling, amap, bmap = broadcast_tiling(where, a, b)
            maps, params = [amap, bmap], {}

        def fill(idx):
            return emit1(_divmod_k, [_pick(t, m, idx) for t, m in zip(tensors, maps)], tiling.tile_shape(idx),
                         dtype, op=how, how=how, dtype=dtype.str, **params)

        return new_tensor(tiling, dtype, fill), (a, b, how, value, reverse)

    def backward(self, ctx, g):
        a, b, how, value, reverse = ctx
        if how == "floor_divide" or a.dtype.kind not in "fc":  # (an integer a: b has its dtype, or is a number)
            return (None,) if b is None else (None, None)
        if b is None:  # a % value: g; value % a = value - a * (value // a): -g * (value // a)
            return (affine(mul(g, floor_divide(value, a)), -1.0) if reverse else g,)
        return unbroadcast(g, a), unbroadcast(affine(mul(g, floor_divide(a, b)), -1.0), b)


_divmod_op = DivMod()


def _divmod_dtype(where: str, dtype: np.dtype, value) -> np.dtype:
    """The dtype of a ``dtype`` tensor ``//`` or ``%`` a number, as NumPy gives it: a float tensor
    keeps its dtype, an integer one stays integer beside an int and becomes float64 beside a
    float (torch would give float32)."""
    try:
        return (np.zeros(1, dtype) + value).dtype
    except OverflowError:
        raise TileError(where, f"a number that a {dtype} tensor holds (cast it to a wider or signed dtype "
                        "first)", repr(value)) from None


def _divmod(a, b, how: str) -> TileTensor:
    where = f"tilegraph.{how}"
    _operands(where, a, b)
    for x in (a, b):
        if isinstance(x, TileTensor) and x.dtype.kind not in "fiu":
            raise TileError(where, f"number tensors ({_DIVMOD[how]} of bool tensors is not supported, as in "
                            "torch; cast them first)", f"a {x.dtype} tensor of shape {x.shape}")
    if _scalar(a) and _scalar(b):  # pragma: no cover - one is a tensor (_operands)
        raise AssertionError("two numbers")
    if isinstance(a, TileTensor) and isinstance(b, TileTensor):
        return _divmod_op(a, b, how=how)
    tensor, number, reverse = (a, b, False) if isinstance(a, TileTensor) else (b, a, True)
    number = _number(number)
    dtype = _divmod_dtype(where, tensor.dtype, number)
    if dtype.kind in "iu" and number == 0 and not reverse:
        raise TileError(where, f"integer {_DIVMOD[how]} by zero (as torch refuses it; cast to a float dtype for "
                        "inf and NaN)", f"{tensor.dtype} tensor {_DIVMOD[how]} 0")
    return _divmod_op(tensor, how=how, value=number, reverse=reverse)


def floor_divide(a, b) -> TileTensor:
    """``a // b`` element by element, rounded toward -inf (torch's ``floor_divide`` and
    ``div(rounding_mode="floor")``, NumPy's ``floor_divide``): ``-7 // 2 == -4``; either may be a
    number. An integer tensor stays integer beside an int (dividing by zero is an error, as in
    torch) and becomes float64 beside a float; a float divided by zero gives inf or NaN. No
    gradient flows through it (its derivative is 0 wherever it is defined).

    >>> import numpy as np, tilegraph as tg
    >>> (tg.from_numpy(np.array([-7, 7])) // 2).numpy(), (tg.from_numpy(np.array([-3.5, 3.5])) // 2).numpy()
    (array([-4,  3]), array([-2.,  1.]))
    """
    return _divmod(a, b, "floor_divide")


def remainder(a, b) -> TileTensor:
    """``a % b`` element by element with the sign of ``b`` (torch's ``remainder``, NumPy's, and
    Python's ``%``): ``-7 % 3 == 2``, ``7 % -3 == -2``; ``a - b * (a // b)``. Its gradient is
    ``g`` for ``a`` and ``-g * (a // b)`` for ``b``, as torch's.

    >>> import numpy as np, tilegraph as tg
    >>> (tg.from_numpy(np.array([-7, 7])) % 3).numpy(), (tg.from_numpy(np.array([-3.5, 3.5])) % 2).numpy()
    (array([2, 1]), array([0.5, 1.5]))
    """
    return _divmod(a, b, "remainder")


# ------------------------------------------------------------------------------------ power ----
@kernel("pow", cost=elementwise_cost(4))
def _pow(x, exponent, dtype=None):
    if dtype is not None:  # an integer tensor to a fractional power: NumPy's float64
        x = x.astype(dtype)
    return x ** x.dtype.type(exponent)


@kernel("pow_bwd", cost=elementwise_cost(6))
def _pow_bwd(x, g, exponent):
    if exponent == 0:  # as torch: d(x ** 0) = 0, also at x = 0 (not 0 * x ** -1)
        return xp_of(g).zeros_like(g)
    e = x.dtype.type(exponent)
    return g * (e * x ** (e - 1)) if exponent != 2 else g * (x + x)


class Pow(Op):
    """``x ** exponent`` for a Python-number exponent; ``d = g * exponent * x ** (exponent - 1)``."""

    name = "pow"

    def forward(self, x, exponent):
        convert = {}
        dtype = _pow_dtype(x.dtype, exponent)
        if dtype != x.dtype:
            convert = {"dtype": dtype.str}

        def fill(idx):
            r = x.grid[idx]
            return emit1(_pow, [r], r.shape, dtype, op="pow", exponent=exponent, **convert)

        return new_tensor(x.tiling, dtype, fill), (x, exponent)

    def backward(self, ctx, g):
        x, exponent = ctx

        def fill(idx):
            r = x.grid[idx]
            return emit1(_pow_bwd, [r, g.grid[idx]], r.shape, x.dtype, op="pow_bwd", exponent=exponent)

        return (new_tensor(x.tiling, x.dtype, fill),)


_pow_op = Pow()


def _pow_dtype(dtype: np.dtype, exponent) -> np.dtype:
    """The dtype of ``x ** exponent`` as NumPy gives it: a float tensor keeps its dtype; an integer
    one stays integer under an int exponent and becomes float64 under a float one (``ids ** 2.0``
    was int64, and wrapped around past 2**63; ``ids ** -1.0`` failed in the kernel)."""
    return dtype if dtype.kind in "fc" or isinstance(exponent, int) else np.dtype(np.float64)


def pow(x: TileTensor, exponent) -> TileTensor:  # noqa: A001 - torch name
    """``x ** exponent`` element by element (``torch.pow``) for a real-number ``exponent``; its
    gradient is ``exponent * x ** (exponent - 1)`` (0 for ``exponent == 0``, as torch). A float
    tensor keeps its dtype; an integer one stays integer under an int exponent >= 0, and becomes
    float64 under a float one, ``2.0`` too (NumPy's promotion).

    >>> import numpy as np, tilegraph as tg
    >>> (tg.from_numpy(np.arange(4.0), tiles=3) ** 2).numpy()
    array([0., 1., 4., 9.])
    """
    where = "tilegraph.pow"
    if not isinstance(x, TileTensor):
        raise TileError(where, "the base must be a TileTensor (a number to a tensor's power is not supported)",
                        f"{type(x).__name__} {x!r:.60}")
    if not _scalar(exponent):
        raise TileError(where, "the exponent must be a real number (not a bool; a tensor exponent is not supported)",
                        f"{type(exponent).__name__} {exponent!r:.60}")
    if x.dtype.kind == "b":
        raise TileError(where, "the base must be a number tensor (cast a bool tensor first)",
                        f"a {x.dtype} tensor of shape {x.shape}")
    exponent = _number(exponent)
    if x.dtype.kind in "iu" and isinstance(exponent, int) and exponent < 0:
        raise TileError(where, "an integer tensor to a negative integer power is not supported (as in NumPy and "
                        "torch; cast to a float dtype first, or give a float exponent)",
                        f"a {x.dtype} tensor ** {exponent}")
    if exponent == 1 and _pow_dtype(x.dtype, exponent) == x.dtype:
        return x
    return _pow_op(x, exponent=exponent)


# ------------------------------------------------------------------------------- unary maps ----
@kernel("affine", cost=elementwise_cost(2))
def _affine(x, scale, shift, dtype=None):
    if dtype is not None:  # an integer tensor times a fraction, say: NumPy's promotion
        y = x.astype(dtype) * scale if scale != 1 else x.astype(dtype)
        return y + shift if shift else y
    y = x * x.dtype.type(scale) if scale != 1.0 else x.copy()
    if shift:
        y += x.dtype.type(shift)
    return y


def affine_dtype(dtype, scale, shift) -> np.dtype:
    """The dtype of ``scale * x + shift`` for ``x`` of ``dtype``, as NumPy gives it: a float
    tensor keeps its dtype; an integer one stays integer with integer ``scale`` and ``shift``, and
    becomes float otherwise (a factor or term of 1 or 0 changes nothing)."""
    probe = np.zeros(1, dtype)
    try:
        if scale != 1:
            probe = probe * scale
        if shift != 0:
            probe = probe + shift
    except OverflowError:  # NumPy 2 refuses a Python int the dtype cannot hold (-1 for uint8)
        raise TileError("tilegraph.affine", f"numbers that a {np.dtype(dtype)} tensor holds (cast it to a wider or "
                        "signed dtype first, as NumPy asks)",
                        f"{np.dtype(dtype)} tensor with factor {scale!r} and term {shift!r}") from None
    return probe.dtype


class Affine(Op):
    """``scale * x + shift`` with Python-number scale and shift."""

    name = "affine"

    def forward(self, x, scale=1.0, shift=0.0):
        dtype = x.dtype if x.dtype.kind in "fc" else affine_dtype(x.dtype, scale, shift)
        if dtype == x.dtype:
            params = {"scale": float(scale), "shift": float(shift)}
        else:
            params = {"scale": scale, "shift": shift, "dtype": dtype.str}

        def fill(idx):
            r = x.grid[idx]
            return emit1(_affine, [r], r.shape, dtype, op="affine", **params)

        return new_tensor(x.tiling, dtype, fill), scale

    def backward(self, scale, g):
        return (affine(g, scale),)


_affine_op = Affine()


def affine(x: TileTensor, scale: float = 1.0, shift: float = 0.0) -> TileTensor:
    if not isinstance(x, TileTensor):
        raise TileError("tilegraph.affine", "expected a TileTensor", type(x).__name__)
    for name, value in (("scale", scale), ("shift", shift)):
        # float() would take "0.1" and refuse None or a list with a bare TypeError
        if not isinstance(value, (numbers.Real, np.integer, np.floating)):
            raise TileError("tilegraph.affine", f"{name} must be a real number", f"{name}={value!r:.60}")
    return _affine_op(x, scale=scale, shift=shift)


# GELU/SiLU kernels in Numba: NumPy expressions are ~4x slower than torch here. Numba has no SVML
# on these machines, so math.exp/math.erf in a loop are scalar libm calls that keep LLVM from
# vectorising it (4-15 ns/element). float32 tiles therefore take the kernels in the next section,
# built from arithmetic alone; float64 (and other) tiles keep the libm kernels below (accurate to
# the last bit, which the float64 tests against torch need).
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# Constants arrive as arguments typed like the data (``_consts``), so float32 tiles are computed
# in float32 (float64 literals would promote every operation). The fastmath flags leave out "nnan"
# and "ninf", and error_model="numpy" drops Python's division check, as the float32 kernels' do:
# with fastmath=True a NaN input (a diverged step) raised ZeroDivisionError in tanh-GELU and SiLU
# instead of giving NaN, as torch does.
_FAST64 = {"nsz", "arcp", "contract"}


@numba.njit(cache=True, nogil=True, fastmath=_FAST64, error_model="numpy")
def _nb_gelu(x, out, k):
    half, one, inv_sqrt2 = k[0], k[1], k[3]
    for i in range(x.size):
        v = x[i]
        out[i] = half * v * (one + math.erf(v * inv_sqrt2))


@numba.njit(cache=True, nogil=True, fastmath=_FAST64, error_model="numpy")
def _nb_gelu_bwd(x, g, out, k):
    half, one, inv_sqrt2, inv_sqrt_2pi = k[0], k[1], k[3], k[4]
    for i in range(x.size):
        v = x[i]
        cdf = half * (one + math.erf(v * inv_sqrt2))
        pdf = inv_sqrt_2pi * math.exp(-half * v * v)
        out[i] = g[i] * (cdf + v * pdf)


@numba.njit(cache=True, nogil=True, fastmath=_FAST64, error_model="numpy")
def _nb_gelu_tanh(x, out, k):
    half, one, two, s2pi, c = k[0], k[1], k[2], k[5], k[6]
    for i in range(x.size):
        v = x[i]
        u = s2pi * (v + c * v * v * v)
        t = one - two / (math.exp(two * u) + one)
        out[i] = half * v * (one + t)


@numba.njit(cache=True, nogil=True, fastmath=_FAST64, error_model="numpy")
def _nb_gelu_tanh_bwd(x, g, out, k):
    half, one, two, s2pi, c, c3 = k[0], k[1], k[2], k[5], k[6], k[7]
    for i in range(x.size):
        v = x[i]
        u = s2pi * (v + c * v * v * v)
        t = one - two / (math.exp(two * u) + one)
        du = s2pi * (one + c3 * v * v)
        out[i] = g[i] * (half * (one + t) + half * v * (one - t * t) * du)


@numba.njit(cache=True, nogil=True, fastmath=_FAST64, error_model="numpy")
def _nb_silu(x, out, k):
    one = k[1]
    for i in range(x.size):
        v = x[i]
        out[i] = v / (one + math.exp(-v))


@numba.njit(cache=True, nogil=True, fastmath=_FAST64, error_model="numpy")
def _nb_silu_bwd(x, g, out, k):
    one = k[1]
    for i in range(x.size):
        v = x[i]
        s = one / (one + math.exp(-v))
        out[i] = g[i] * s * (one + v * (one - s))


_CONSTS = (0.5, 1.0, 2.0, _INV_SQRT2, _INV_SQRT_2PI, _SQRT_2_OVER_PI, 0.044715, 3 * 0.044715)


def _consts(dtype) -> np.ndarray:
    return np.array(_CONSTS, dtype=dtype)


# ------------------------------------------------------------------ float32 GELU/SiLU kernels ----
# Only arithmetic that LLVM vectorises (0.4-0.8 ns/element on one core instead of 3-16 with libm;
# bench/bench_kernels.py times them against torch):
#
# * exp(z), z in [-88, 88]: z = n ln2 + r with n = rint(z / ln2) and |r| <= ln2/2 (ln2 split in
#   two, Cody-Waite, so r is exact); exp(r) = 1 + r (1 + r (c2 + ... + c6 r^4)); 2^n is written
#   straight into the exponent bits (``_exp2i``; n = -127 gives exactly 0, the underflow).
# * sigmoid(z) = 1 / (1 + exp(-z)) for z >= 0 and exp(-|z|) / (1 + exp(-|z|)) below, so it never
#   overflows and stays relatively accurate in the left tail; sigmoid' = e / (1 + e)^2 with
#   e = exp(-|z|), without the cancellation of 1 - tanh^2. tanh-GELU is x sigmoid(2u).
# * Phi(-a) = exp(-a^2/2) R(a) for a = |x|, with R(a) = Phi(-a) exp(a^2/2) a (4, 5) rational fit
#   (Phi is the standard normal CDF; exact GELU is x Phi(x), Phi(x) = 1 - Phi(-x) for x >= 0).
#
# The polynomial and rational coefficients are minimax fits of our own, reproduced (with their
# errors) by ``python bench/fit_kernel_coeffs.py``: relative error 1.7e-8 for exp(r) and 5.7e-8
# for R, below float32's half ulp (6e-8). Over a dense grid on [-20, 20] the kernels stay within
# 2 ulp of max(|result|, 1) of exact float64 values (torch's float32 kernels: 1.3 to 8.7 ulp);
# tests/test_kernels_fast.py checks 3 ulp, and torch float32 at the shared tolerance.
#
# Constants are float32 globals, which Numba freezes as float32 literals (a Python float would
# promote the arithmetic to float64). The flags leave out "reassoc" (it could undo the ln2 split)
# and "nnan"/"ninf" (NaN inputs give NaN, as in torch); error_model="numpy" drops the
# ZeroDivisionError branch that keeps a loop with a division from vectorising.
_FAST32 = {"nsz", "arcp", "contract", "afn"}
_F32 = np.float32
_ZERO_F, _ONE_F = _F32(0.0), _F32(1.0)
_LOG2E_F = _F32(1.0 / math.log(2.0))
_LN2_HI_F, _LN2_LO_F = _F32(0.693115234375), _F32(3.194618329871446e-05)  # ln2_hi: 12 bits
_EXP_MIN_F = _F32(-88.0)  # rint(-88 / ln2) = -127: exp underflows to exactly 0 from about -87.7
_EXP_C2, _EXP_C3, _EXP_C4, _EXP_C5, _EXP_C6 = (_F32(0.4999999403953552), _F32(0.16666431725025177),
                                               _F32(0.04166800156235695), _F32(0.00837415549904108),
                                               _F32(0.0013843643246218562))
_R_P0, _R_P1, _R_P2, _R_P3, _R_P4 = (_F32(0.5), _F32(0.43723002076148987), _F32(0.18244577944278717),
                                     _F32(0.04036697372794151), _F32(0.004076734185218811))
_R_Q1, _R_Q2, _R_Q3, _R_Q4, _R_Q5 = (_F32(1.6723450422286987), _F32(1.1992253065109253),
                                     _F32(0.4673865735530853), _F32(0.10119181126356125),
                                     _F32(0.01021872740238905))
_R_AMAX = _F32(14.0)  # the fit's range; exp(-a^2/2) is 0 in float32 beyond it
_HALF_F = _F32(0.5)
_INV_SQRT_2PI_F = _F32(_INV_SQRT_2PI)
_TWO_S2PI_F = _F32(2.0 * _SQRT_2_OVER_PI)  # tanh-GELU: sigmoid(2u), 2u = 2 sqrt(2/pi) (x + c x^3)
_GELU_C_F, _GELU_C3_F = _F32(0.044715), _F32(3 * 0.044715)
_GELU_XMAX_F = _F32(12.0)  # |2u(12)| = 142 > 88: clamping x here changes neither sigmoid nor e


@intrinsic
def _exp2i(typingctx, n):
    """``2**n`` for a float32 ``n`` holding an integer in [-127, 127], from the exponent bits
    (n = -127 gives +0.0)."""
    if n != nb_types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = llvm_ir.IntType(32)
        k = builder.add(builder.fptosi(args[0], i32), llvm_ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(k, llvm_ir.Constant(i32, 23)), llvm_ir.FloatType())

    return nb_types.float32(nb_types.float32), codegen


@numba.njit(cache=True, inline="always", fastmath=_FAST32, error_model="numpy")
def _exp_f32(z):
    """exp(z) for a float32 z in [-88, 88]."""
    n = np.rint(z * _LOG2E_F)
    r = (z - n * _LN2_HI_F) - n * _LN2_LO_F
    p = _EXP_C2 + r * (_EXP_C3 + r * (_EXP_C4 + r * (_EXP_C5 + r * _EXP_C6)))
    return (_ONE_F + r * (_ONE_F + r * p)) * _exp2i(n)


@numba.njit(cache=True, inline="always", fastmath=_FAST32, error_model="numpy")
def _mills_f32(a):
    """R(a) = Phi(-a) exp(a^2/2) for a float32 a in [0, 14]."""
    p = _R_P0 + a * (_R_P1 + a * (_R_P2 + a * (_R_P3 + a * _R_P4)))
    q = _ONE_F + a * (_R_Q1 + a * (_R_Q2 + a * (_R_Q3 + a * (_R_Q4 + a * _R_Q5))))
    return p / q


# Helpers return one scalar each: a tuple return keeps the loop from vectorising.
@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def _nb_gelu_tanh_f32(x, out):
    for i in range(x.size):
        v = x[i]
        vc = min(max(v, -_GELU_XMAX_F), _GELU_XMAX_F)
        z = _TWO_S2PI_F * (vc + _GELU_C_F * vc * vc * vc)
        e = _exp_f32(max(-abs(z), _EXP_MIN_F))
        out[i] = (v if z >= _ZERO_F else v * e) / (_ONE_F + e)  # one rounding less than v * s


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def _nb_gelu_tanh_bwd_f32(x, g, out):
    # d/dx [x sigmoid(z)] = sigmoid(z) + x z' sigmoid'(z), z = 2u, sigmoid'(z) = e d^2
    for i in range(x.size):
        v = x[i]
        vc = min(max(v, -_GELU_XMAX_F), _GELU_XMAX_F)
        z = _TWO_S2PI_F * (vc + _GELU_C_F * vc * vc * vc)
        e = _exp_f32(max(-abs(z), _EXP_MIN_F))
        d = _ONE_F / (_ONE_F + e)
        s = d if z >= _ZERO_F else e * d
        dz = _TWO_S2PI_F * (_ONE_F + _GELU_C3_F * vc * vc)
        out[i] = g[i] * (s + v * (dz * (e * d * d)))


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def _nb_gelu_f32(x, out):
    for i in range(x.size):
        v = x[i]
        a = min(abs(v), _R_AMAX)
        t = _exp_f32(max(-_HALF_F * a * a, _EXP_MIN_F)) * _mills_f32(a)  # Phi(-|x|)
        out[i] = v * (_ONE_F - t if v >= _ZERO_F else t)


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def _nb_gelu_bwd_f32(x, g, out):
    for i in range(x.size):
        v = x[i]
        a = min(abs(v), _R_AMAX)
        e = _exp_f32(max(-_HALF_F * a * a, _EXP_MIN_F))
        t = e * _mills_f32(a)
        cdf = _ONE_F - t if v >= _ZERO_F else t
        out[i] = g[i] * (cdf + v * (_INV_SQRT_2PI_F * e))


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def _nb_silu_f32(x, out):
    for i in range(x.size):
        v = x[i]
        e = _exp_f32(max(-abs(v), _EXP_MIN_F))
        out[i] = (v if v >= _ZERO_F else v * e) / (_ONE_F + e)


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def _nb_silu_bwd_f32(x, g, out):
    for i in range(x.size):
        v = x[i]
        e = _exp_f32(max(-abs(v), _EXP_MIN_F))
        d = _ONE_F / (_ONE_F + e)
        s = d if v >= _ZERO_F else e * d
        out[i] = g[i] * (s + v * (e * d * d))


_F32_DT = np.dtype(np.float32)


#: the dtypes the Numba kernels take; others (float16) go through float32 and back, as torch
#: computes half-precision activations in float
_NUMBA_DTS = (_F32_DT, np.dtype(np.float64))


def _numba_unary(fn, fn32=None):
    def run(x, **params):
        if x.dtype not in _NUMBA_DTS:
            return run(x.astype(np.float32), **params).astype(x.dtype)
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        if fn32 is not None and x.dtype == _F32_DT:
            fn32(x.reshape(-1), out.reshape(-1))
        else:
            fn(x.reshape(-1), out.reshape(-1), _consts(x.dtype))
        return out

    return run


def _numba_binary(fn, fn32=None):
    def run(x, g, **params):
        if x.dtype not in _NUMBA_DTS or g.dtype not in _NUMBA_DTS:
            return run(x.astype(np.float32), g.astype(np.float32), **params).astype(x.dtype)
        x, g = np.ascontiguousarray(x), np.ascontiguousarray(g)
        out = np.empty_like(x)
        if fn32 is not None and x.dtype == _F32_DT and g.dtype == _F32_DT:
            fn32(x.reshape(-1), g.reshape(-1), out.reshape(-1))
        else:
            fn(x.reshape(-1), g.reshape(-1), out.reshape(-1), _consts(x.dtype))
        return out

    return run


def _erf(xp, x):
    if xp is np:
        return np.vectorize(math.erf, otypes=[x.dtype])(x)
    import cupyx.scipy.special

    return cupyx.scipy.special.erf(x)


def _gelu_xp(x, approximate="none"):
    xp = xp_of(x)
    if approximate == "tanh":
        return 0.5 * x * (1 + xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + _erf(xp, x * _INV_SQRT2))


def _gelu_bwd_xp(x, g, approximate="none"):
    xp = xp_of(x)
    if approximate == "tanh":
        t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        du = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du)
    cdf = 0.5 * (1 + _erf(xp, x * _INV_SQRT2))
    return g * (cdf + x * _INV_SQRT_2PI * xp.exp(-0.5 * x * x))


_gelu_cpu_tanh, _gelu_cpu_erf = _numba_unary(_nb_gelu_tanh, _nb_gelu_tanh_f32), _numba_unary(_nb_gelu, _nb_gelu_f32)
_gelu_bwd_cpu_tanh = _numba_binary(_nb_gelu_tanh_bwd, _nb_gelu_tanh_bwd_f32)
_gelu_bwd_cpu_erf = _numba_binary(_nb_gelu_bwd, _nb_gelu_bwd_f32)


def _gelu_cpu(x, approximate="none"):
    return (_gelu_cpu_tanh if approximate == "tanh" else _gelu_cpu_erf)(x)


def _gelu_bwd_cpu(x, g, approximate="none"):
    return (_gelu_bwd_cpu_tanh if approximate == "tanh" else _gelu_bwd_cpu_erf)(x, g)


def _silu_xp(x):
    xp = xp_of(x)
    return x / (1 + xp.exp(-x))


def _silu_bwd_xp(x, g):
    xp = xp_of(x)
    s = 1 / (1 + xp.exp(-x))
    return g * s * (1 + x * (1 - s))


def _relu_xp(x):
    return xp_of(x).maximum(x, 0)


def _relu_bwd_xp(x, g):
    return g * (x > 0)


def _leaky_relu_xp(x, negative_slope=0.01):
    # torch's: x where x > 0, else x * negative_slope computed in at least float32 (a float16 x is
    # scaled in float32, then rounded once)
    acc = acc_dtype(x.dtype)
    scaled = (x.astype(acc, copy=False) * acc.type(negative_slope)).astype(x.dtype, copy=False)
    return xp_of(x).where(x > 0, x, scaled)


def _leaky_relu_bwd_xp(x, g, negative_slope=0.01):
    # torch's: g where x > 0, else g * negative_slope (the slope side at exactly 0, and at NaN)
    acc = acc_dtype(g.dtype)
    scaled = (g.astype(acc, copy=False) * acc.type(negative_slope)).astype(g.dtype, copy=False)
    return xp_of(x).where(x > 0, g, scaled)


# GPU: one fused kernel each (ops._gpu), the formulas of _gelu_xp/_gelu_bwd_xp in double
_GELU_TANH_ARG = "0.7978845608028654 * (v + 0.044715 * v * v * v)"  # sqrt(2 / pi) (x + 0.044715 x^3)
_gelu_gpu_tanh = fused("gelu_tanh", "T x", "T y", f"double v = x; y = (T)(0.5 * v * (1.0 + tanh({_GELU_TANH_ARG})));",
                       lambda x: _gelu_xp(x, "tanh"))
_gelu_gpu_erf = fused("gelu_erf", "T x", "T y", "double v = x; y = (T)(0.5 * v * (1.0 + erf(v * 0.7071067811865475)));",
                      lambda x: _gelu_xp(x, "none"))
_gelu_bwd_gpu_tanh = fused(
    "gelu_bwd_tanh", "T x, T g", "T dx",
    f"double v = x; double t = tanh({_GELU_TANH_ARG}); double du = 0.7978845608028654 * (1.0 + 0.134145 * v * v);"
    "dx = (T)((double)g * (0.5 * (1.0 + t) + 0.5 * v * (1.0 - t * t) * du));",
    lambda x, g: _gelu_bwd_xp(x, g, "tanh"))
_gelu_bwd_gpu_erf = fused(
    "gelu_bwd_erf", "T x, T g", "T dx",
    "double v = x; dx = (T)((double)g * (0.5 * (1.0 + erf(v * 0.7071067811865475))"
    " + v * 0.3989422804014327 * exp(-0.5 * v * v)));",  # 1 / sqrt(2 pi)
    lambda x, g: _gelu_bwd_xp(x, g, "none"))


def _gelu_gpu(x, approximate="none"):
    return (_gelu_gpu_tanh if approximate == "tanh" else _gelu_gpu_erf)(x)


def _gelu_bwd_gpu(x, g, approximate="none"):
    return (_gelu_bwd_gpu_tanh if approximate == "tanh" else _gelu_bwd_gpu_erf)(x, g)


_gelu_k = kernel("gelu", cost=elementwise_cost(20), cpu=_gelu_cpu, gpu=_gelu_gpu)(_gelu_xp)
_gelu_bwd_k = kernel("gelu_bwd", cost=elementwise_cost(30), cpu=_gelu_bwd_cpu, gpu=_gelu_bwd_gpu)(_gelu_bwd_xp)
_silu_k = kernel("silu", cost=elementwise_cost(8), cpu=_numba_unary(_nb_silu, _nb_silu_f32))(_silu_xp)
_silu_bwd_k = kernel("silu_bwd", cost=elementwise_cost(12),
                     cpu=_numba_binary(_nb_silu_bwd, _nb_silu_bwd_f32))(_silu_bwd_xp)
_relu_k = kernel("relu", cost=elementwise_cost(1))(_relu_xp)
_relu_bwd_k = kernel("relu_bwd", cost=elementwise_cost(2))(_relu_bwd_xp)
_leaky_relu_k = kernel("leaky_relu", cost=elementwise_cost(2))(_leaky_relu_xp)
_leaky_relu_bwd_k = kernel("leaky_relu_bwd", cost=elementwise_cost(2))(_leaky_relu_bwd_xp)


class Activation(Op):
    """``y = f(x)`` tile by tile; the backward kernel recomputes from x (nothing else saved).
    ``ints``: integer tensors are taken too (abs, clamp: torch's), their dtype kept and no
    gradient flowing."""

    def __init__(self, name, fwd, bwd, ints: bool = False):
        self.name, self.fwd, self.bwd, self.ints = name, fwd, bwd, ints

    def forward(self, x, **params):
        if not (self.ints and x.dtype.kind in "iu"):
            require_float(x, f"tilegraph.{self.name}")

        def fill(idx):
            r = x.grid[idx]
            return emit1(self.fwd, [r], r.shape, x.dtype, op=self.name, **params)

        return new_tensor(x.tiling, x.dtype, fill), (x, params)

    def backward(self, ctx, g):
        x, params = ctx
        if x.dtype.kind not in "fc":  # an integer abs or clamp: no gradient, as torch gives none
            return (None,)

        def fill(idx):
            r = x.grid[idx]
            return emit1(self.bwd, [r, g.grid[idx]], r.shape, x.dtype, op=f"{self.name}_bwd", **params)

        return (new_tensor(x.tiling, x.dtype, fill),)


# exp, log, tanh, sigmoid: one NumPy/CuPy expression each; each backward recomputes from x (as
# Activation's do), so nothing but x is kept for it
def _exp_xp(x):
    return xp_of(x).exp(x)


def _exp_bwd_xp(x, g):
    return g * xp_of(x).exp(x)


def _log_xp(x):
    return xp_of(x).log(x)  # log(0) = -inf, log(-1) = NaN, as torch (the runtime silences NumPy's warnings)


def _log_bwd_xp(x, g):
    return g / x


def _tanh_xp(x):
    return xp_of(x).tanh(x)


def _tanh_bwd_xp(x, g):
    t = xp_of(x).tanh(x)
    return g * (1 - t * t)


def _sigmoid_xp(x):
    # 1 / (1 + e^-x) for x >= 0, e^x / (1 + e^x) below: exp never overflows (e = e^-|x| <= 1)
    xp = xp_of(x)
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1, e) / (1 + e)


def _sigmoid_bwd_xp(x, g):
    s = _sigmoid_xp(x)
    return g * (s * (1 - s))


def _abs_xp(x):
    return xp_of(x).abs(x)


def _abs_bwd_xp(x, g):
    return g * xp_of(x).sign(x)  # 0 at 0, as torch


def _clamp_xp(x, lo=None, hi=None):
    return xp_of(x).clip(x, lo, hi)


def _clamp_bwd_xp(x, g, lo=None, hi=None):
    keep = True
    if lo is not None:
        keep = x >= lo
    if hi is not None:
        keep = keep & (x <= hi)
    return g * keep  # the gradient passes where x lies within [lo, hi], bounds included (torch's)


_abs_k = kernel("abs", cost=elementwise_cost(1))(_abs_xp)
_abs_bwd_k = kernel("abs_bwd", cost=elementwise_cost(2))(_abs_bwd_xp)
_clamp_k = kernel("clamp", cost=elementwise_cost(2))(_clamp_xp)
_clamp_bwd_k = kernel("clamp_bwd", cost=elementwise_cost(3))(_clamp_bwd_xp)
_exp_k = kernel("exp", cost=elementwise_cost(8))(_exp_xp)
_exp_bwd_k = kernel("exp_bwd", cost=elementwise_cost(9))(_exp_bwd_xp)
_log_k = kernel("log", cost=elementwise_cost(8))(_log_xp)
_log_bwd_k = kernel("log_bwd", cost=elementwise_cost(1))(_log_bwd_xp)
_tanh_k = kernel("tanh", cost=elementwise_cost(10))(_tanh_xp)
_tanh_bwd_k = kernel("tanh_bwd", cost=elementwise_cost(13))(_tanh_bwd_xp)
_sigmoid_k = kernel("sigmoid", cost=elementwise_cost(12))(_sigmoid_xp)
_sigmoid_bwd_k = kernel("sigmoid_bwd", cost=elementwise_cost(15))(_sigmoid_bwd_xp)

_gelu_op = Activation("gelu", _gelu_k, _gelu_bwd_k)
_silu_op = Activation("silu", _silu_k, _silu_bwd_k)
_relu_op = Activation("relu", _relu_k, _relu_bwd_k)
_leaky_relu_op = Activation("leaky_relu", _leaky_relu_k, _leaky_relu_bwd_k)
_abs_op = Activation("abs", _abs_k, _abs_bwd_k, ints=True)
_clamp_op = Activation("clamp", _clamp_k, _clamp_bwd_k, ints=True)
_exp_op = Activation("exp", _exp_k, _exp_bwd_k)
_log_op = Activation("log", _log_k, _log_bwd_k)
_tanh_op = Activation("tanh", _tanh_k, _tanh_bwd_k)
_sigmoid_op = Activation("sigmoid", _sigmoid_k, _sigmoid_bwd_k)


def gelu(x: TileTensor, approximate: str = "none") -> TileTensor:
    """GELU, exact (``approximate="none"``) or the tanh approximation (``"tanh"``), as in torch."""
    if approximate not in ("none", "tanh"):
        raise TileError("tilegraph.gelu", "approximate must be 'none' or 'tanh'", repr(approximate))
    return _gelu_op(require_tensor(x, "tilegraph.gelu", "x"), approximate=approximate)


def silu(x: TileTensor) -> TileTensor:
    return _silu_op(require_tensor(x, "tilegraph.silu", "x"))


def relu(x: TileTensor) -> TileTensor:
    return _relu_op(require_tensor(x, "tilegraph.relu", "x"))


def check_negative_slope(negative_slope, where: str) -> float:
    """``negative_slope`` of a leaky ReLU as a float: a finite real number (not a bool)."""
    if (isinstance(negative_slope, (bool, np.bool_)) or not isinstance(negative_slope, numbers.Real)
            or not math.isfinite(negative_slope)):
        raise TileError(where, "negative_slope must be a real number (finite; torch's default is 0.01)",
                        f"{negative_slope!r:.60}")
    return float(negative_slope)


def leaky_relu(x: TileTensor, negative_slope: float = 0.01) -> TileTensor:
    """torch's ``F.leaky_relu``: ``x`` where ``x > 0``, ``negative_slope * x`` elsewhere; its
    gradient is 1 where ``x > 0`` and ``negative_slope`` elsewhere, at exactly 0 too (torch's).
    One kernel per tile each way (a float16 ``x`` is scaled in float32, as torch's). Floating
    tensors only, as torch's.

    >>> import numpy as np, tilegraph as tg
    >>> tg.leaky_relu(tg.from_numpy(np.array([-2.0, 0.0, 3.0])), 0.1).numpy()
    array([-0.2,  0. ,  3. ])
    """
    where = "tilegraph.leaky_relu"
    require_tensor(x, where, "x")
    return _leaky_relu_op(x, negative_slope=check_negative_slope(negative_slope, where))


def absolute(x: TileTensor) -> TileTensor:
    """``|x|`` element by element (``torch.abs`` / ``torch.absolute``; ``tg.abs`` and ``x.abs()``:
    the module keeps Python's ``abs`` for its Numba kernels); its gradient is ``sign(x)``, 0 at 0.
    An integer tensor keeps its dtype (no gradient), as torch's; a bool tensor is refused, as
    torch refuses it."""
    _require_number(require_tensor(x, "tilegraph.abs", "x"), "tilegraph.abs")
    return _abs_op(x)


def _require_number(x: TileTensor, where: str) -> None:
    """``x`` of a float or integer dtype (bool refused, as torch's abs and clamp refuse it)."""
    if x.dtype.kind not in "fciu":
        raise TileError(where, "x must have a float or integer dtype (cast a bool tensor first, e.g. "
                        "x.to(np.int64))", f"a {x.dtype} tensor of shape {x.shape}")


def clamp(x: TileTensor, min=None, max=None) -> TileTensor:  # noqa: A002 - torch names
    """``torch.clamp``: ``x`` limited to ``[min, max]`` (either bound may be None, not both); the
    gradient passes where ``min <= x <= max``. An integer tensor between integer bounds stays
    integer (no gradient), as torch's; with a fractional bound it is clamped as float64 (NumPy's
    ``np.clip`` promotion, as other numbers beside an integer tensor).

    >>> import numpy as np, tilegraph as tg
    >>> tg.clamp(tg.from_numpy(np.array([-2.0, 0.5, 3.0])), -1, 1).numpy()
    array([-1. ,  0.5,  1. ])
    """
    where = "tilegraph.clamp"
    _require_number(require_tensor(x, where, "x"), where)
    for name, v in (("min", min), ("max", max)):
        if v is not None and not _scalar(v):
            raise TileError(where, f"{name} must be a real number or None (a tensor bound: tg.where)",
                            f"{type(v).__name__} {v!r:.60}")
    if min is None and max is None:
        raise TileError(where, "at least one of min and max", "min=None, max=None")
    bounds = [v for v in (min, max) if v is not None]
    if x.dtype.kind in "iu" and all(isinstance(v, (int, np.integer)) for v in bounds):
        # an integer tensor between integer bounds stays integer (torch's); a bound past the
        # dtype's range bounds nothing (uint8 from -1)
        info = np.iinfo(x.dtype)
        if (min is not None and min > info.max) or (max is not None and max < info.min):
            raise TileError(where, f"bounds that a {x.dtype} tensor holds (cast it to a wider or signed dtype "
                            "first)", f"min={min!r}, max={max!r}")
        lo = None if min is None or min <= info.min else int(min)
        hi = None if max is None or max >= info.max else int(max)
        return x if lo is None and hi is None else _clamp_op(x, lo=lo, hi=hi)
    if x.dtype.kind in "iu":  # a fractional bound: float64, NumPy's promotion (np.clip(ids, 0.5, None))
        x = cast(x, np.float64)
    return _clamp_op(x, lo=None if min is None else float(min), hi=None if max is None else float(max))


def exp(x: TileTensor) -> TileTensor:
    """``e ** x`` element by element (``torch.exp``; a float tensor, its dtype kept)."""
    return _exp_op(require_tensor(x, "tilegraph.exp", "x"))


def log(x: TileTensor) -> TileTensor:
    """The natural logarithm element by element (``torch.log``): ``-inf`` at 0 and NaN below, as
    torch gives them."""
    return _log_op(require_tensor(x, "tilegraph.log", "x"))


def tanh(x: TileTensor) -> TileTensor:
    """``torch.tanh``; its gradient is ``1 - tanh(x) ** 2``."""
    return _tanh_op(require_tensor(x, "tilegraph.tanh", "x"))


def sigmoid(x: TileTensor) -> TileTensor:
    """``1 / (1 + exp(-x))`` (``torch.sigmoid``), computed without overflow for large ``|x|``.

    >>> import numpy as np, tilegraph as tg
    >>> tg.sigmoid(tg.from_numpy(np.array([0.0, 800.0, -800.0]))).numpy()
    array([0.5, 1. , 0. ])
    """
    return _sigmoid_op(require_tensor(x, "tilegraph.sigmoid", "x"))


# ------------------------------------------------------------------------------------- casts ----
@kernel("cast", cost=elementwise_cost(1))
def _cast(x, dtype):
    return x.astype(dtype)


class Cast(Op):
    """``x`` as another dtype; the gradient is cast back to ``x``'s (none to an integer or bool
    ``x``, as torch gives none)."""

    name = "cast"

    def forward(self, x, dtype):
        def fill(idx):
            r = x.grid[idx]
            return emit1(_cast, [r], r.shape, dtype, op="cast", dtype=dtype.str)

        return new_tensor(x.tiling, dtype, fill), x.dtype

    def backward(self, dtype, g):
        return (_cast_op(g, dtype=dtype) if dtype.kind in "fc" else None,)


_cast_op = Cast()


def cast(x: TileTensor, dtype) -> TileTensor:
    """``x`` converted to ``dtype`` (torch's ``x.to(dtype)``; ``x`` itself when it has that dtype);
    the gradient flows back in ``x``'s dtype.

    >>> import numpy as np, tilegraph as tg
    >>> tg.cast(tg.from_numpy(np.arange(3)), np.float32).numpy()
    array([0., 1., 2.], dtype=float32)
    """
    return _cast_checked(x, dtype, "tilegraph.cast")


def _cast_checked(x: TileTensor, dtype, where: str) -> TileTensor:
    """:func:`cast`, its errors labelled ``where`` (the public name the user called)."""
    require_tensor(x, where, "x")
    dtype = as_dtype(dtype, where)
    if dtype == x.dtype:
        return x
    return _cast_op(x, dtype=dtype)


# -------------------------------------------------------------------------------- constants ----
def full_like(x: TileTensor, value: float) -> TileTensor:
    def fill(idx):
        shape = x.tiling.tile_shape(idx)
        return emit1(_full_from_ref, [x.grid[idx]], shape, x.dtype, op="full", value=float(value))

    return new_tensor(x.tiling, x.dtype, fill)


@kernel("full_like", cost=elementwise_cost(0))
def _full_from_ref(like, value):
    return xp_of(like).full(like.shape, value, dtype=like.dtype)


def ones_like(x: TileTensor) -> TileTensor:
    """Ones with the tiling of ``x``; computed without reading ``x`` when ``x`` is a scalar."""
    if x.ntiles == 1:
        from tilegraph._tensor import from_numpy

        return from_numpy(np.ones(x.shape, dtype=x.dtype))
    return full_like(x, 1.0)


def zeros_like(x: TileTensor) -> TileTensor:
    return full_like(x, 0.0)

