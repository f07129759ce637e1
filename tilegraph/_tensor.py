"""Tiled tensors: metadata plus a grid of tile references. No data lives here."""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Sequence

import numpy as np

from tilegraph._config import as_dtype, check_array_dtype
from tilegraph._errors import TileError, TileIndexError
from tilegraph._graph import Cell, Cost, TileRef, emit1, kernel, leaf, xp_of

__all__ = ["Tiling", "TileTensor", "from_numpy", "from_dask_array", "zeros", "ones", "full", "zeros_like", "ones_like",
           "full_like", "arange"]


# -- parameter aliases ---------------------------------------------------------------------------
# Where tilegraph takes torch's name for a parameter and keeps an older or NumPy spelling, passing
# both must be an error. They live here, the lowest module that both the TileTensor methods (whose
# defaults need them) and the ops import.
class Default:
    """A parameter's default that can be told from the same value passed explicitly, so that a call
    passing both a parameter and its alias is an error; it shows (``repr``) and tests (``bool``) as
    ``value``, so ``help()`` reads ``keepdim: bool = False``."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)


def resolve_alias(where: str, name: str, value, alias: str, alias_value):
    """The value of parameter ``name``, passed as itself (``value``, a :class:`Default` when not
    passed) or as ``alias`` (``alias_value``, None when not passed); passing both is an error."""
    if alias_value is None:
        return value.value if isinstance(value, Default) else value
    if not isinstance(value, Default):
        raise TileError(where, f"pass {name}= or {alias}= (the same parameter), not both",
                        f"{name}={value!r}, {alias}={alias_value!r}")
    return alias_value


#: ``keepdim``'s default, told apart from an explicit ``keepdim=False`` next to ``keepdims=``
NO_KEEPDIM = Default(False)
#: ``dim``'s default of the reductions, told apart from an explicit ``dim=None`` next to ``axis=``
ALL_DIMS = Default(None)


_MAX_TILES_PER_DIM = 2**31  # 16 GiB for one dim's tuple of sizes: far beyond any graph Dask runs


class Tiling:
    """Tile sizes per dimension, as dask-style chunks: ``((4, 4, 2), (8,))``.

    Build it from a shape and one tile size per dimension with :meth:`from_sizes`; the last tile
    of a dimension may be smaller (ragged).

    >>> Tiling.from_sizes((10, 8), (4, 8)).chunks
    ((4, 4, 2), (8,))
    """

    __slots__ = ("chunks",)

    def __init__(self, chunks: Sequence[Sequence[int]]):
        try:
            self.chunks = tuple(tuple(int(c) for c in dim) for dim in chunks)
        except (TypeError, ValueError, OverflowError):  # Tiling(4), Tiling(("a",)), a dask chunk of unknown size
            raise TileError("tilegraph.Tiling", "chunks must be the tile sizes of each dim, as ints: ((4, 4, 2), (8,))",
                            f"{chunks!r:.80}") from None
        if any(c < 0 for dim in self.chunks for c in dim):
            raise TileError("tilegraph.Tiling", "tile sizes must be >= 0", f"{self.chunks!r:.80}")

    @classmethod
    def from_sizes(cls, shape: Sequence[int], sizes, where: str = "tilegraph.Tiling") -> "Tiling":
        shape = tuple(int(s) for s in shape)
        if sizes is None:
            return cls(tuple((s,) for s in shape))
        if isinstance(sizes, Tiling):
            sizes = sizes.chunks
        if not isinstance(sizes, (tuple, list)):  # one size for every dim (checked below)
            sizes = (sizes,) * len(shape)
        sizes = tuple(sizes)
        if len(sizes) != len(shape):
            raise TileError(where, f"expected one tile size per dimension ({len(shape)} for shape {shape})",
                            f"tiles={sizes!r}")
        chunks = []
        for d, (n, t) in enumerate(zip(shape, sizes)):
            if isinstance(t, (tuple, list)):
                t = tuple(int(c) for c in t)
                if sum(t) != n or (any(c <= 0 for c in t) and t != (0,)):  # (0,): the one tile of an empty dim
                    raise TileError(where, f"tiles of dim {d} must be positive and sum to {n}", f"{t}")
                chunks.append(t)
                continue
            if isinstance(t, bool) or not (t is None or isinstance(t, numbers.Integral)):
                raise TileError(where, f"tile size of dim {d} must be a positive integer, or None (or -1) for "
                                "the whole dim", f"{t!r} ({type(t).__name__})")
            if t is None or t == -1:
                t = max(n, 1)  # the whole dim: one tile, of no elements where the dim has none
            t = int(t)
            if t <= 0:
                raise TileError(where, f"tile size of dim {d} must be positive", f"{t}")
            if t > n and n > 0:
                raise TileError(where, f"tile size of dim {d} is larger than the dimension ({n}); "
                                "use None for a single tile", f"tile size {t} for shape {shape}")
            if n == 0:
                chunks.append((0,))
                continue
            full, rest = divmod(n, t)
            if full > _MAX_TILES_PER_DIM:  # the tuple alone would not fit in memory (or overflow)
                raise TileError(where, f"tile size of dim {d} makes more tiles than a graph can hold "
                                f"({full} > {_MAX_TILES_PER_DIM}): use larger tiles", f"tile size {t} for shape {shape}")
            chunks.append((t,) * full + ((rest,) if rest else ()))
        return cls(chunks)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(c) for c in self.chunks)

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(len(c) for c in self.chunks)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Nominal (first) tile size per dimension."""
        return tuple(c[0] for c in self.chunks)

    def offsets(self, dim: int) -> tuple[int, ...]:
        return tuple(itertools.accumulate((0,) + self.chunks[dim][:-1]))

    def tile_shape(self, index: Sequence[int]) -> tuple[int, ...]:
        return tuple(self.chunks[d][i] for d, i in enumerate(index))

    def slices(self, index: Sequence[int]) -> tuple[slice, ...]:
        out = []
        for d, i in enumerate(index):
            o = sum(self.chunks[d][:i])
            out.append(slice(o, o + self.chunks[d][i]))
        return tuple(out)

    def __eq__(self, other) -> bool:
        return isinstance(other, Tiling) and self.chunks == other.chunks

    def __hash__(self) -> int:
        return hash(self.chunks)

    def __repr__(self) -> str:
        return f"Tiling({self.chunks})"


class _Size(int):
    """:attr:`TileTensor.size`: NumPy's ``x.size`` (an int, the number of elements) that torch's
    ``x.size()`` / ``x.size(dim)`` calls for the shape, or one dim's size (a negative dim counts
    from the end)."""

    def __new__(cls, shape: tuple):
        self = super().__new__(cls, int(np.prod(shape)))
        self._shape = tuple(shape)
        return self

    def __call__(self, dim=None):
        if dim is None:
            return self._shape
        n = len(self._shape)
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or not -n <= dim < n:
            raise TileError("tilegraph.TileTensor.size", f"dim must be an int in [{-n}, {n}) for the shape "
                            f"{self._shape} (or none: the shape)", f"{dim!r:.60}")
        return self._shape[dim]

    def __reduce__(self):
        return int, (int(self),)  # pickled as the plain int it is


class TileTensor:
    """A tensor split into tiles: shape, dtype, tiling and a grid of :class:`TileRef`.

    TileTensors are symbolic: arithmetic records tile kernels and returns new TileTensors. Data
    only moves at the explicit boundary, :func:`tilegraph.compute` (or ``t.numpy()``).

    >>> import numpy as np, tilegraph as tg
    >>> a = tg.from_numpy(np.ones((4, 6), np.float32), tiles=(2, 4))
    >>> float((a @ a.T).numpy()[0, 0])
    6.0
    """

    __slots__ = ("shape", "dtype", "tiling", "grid", "_record", "name", "__weakref__")
    __array_priority__ = 1000  # make ``ndarray + TileTensor`` defer to TileTensor

    def __init__(self, tiling: Tiling, dtype, grid: np.ndarray, record=None, name: str | None = None):
        self.tiling = tiling
        self.shape = tiling.shape
        self.dtype = np.dtype(dtype)
        if grid.shape != tiling.grid:
            raise AssertionError(f"grid {grid.shape} does not match tiling {tiling}")
        self.grid = grid
        self._record = record
        self.name = name

    # -- metadata ------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> "_Size":
        """The number of elements, an int (NumPy's ``size``); called, torch's ``x.size()`` (the
        shape) or ``x.size(dim)`` (one dim's size)."""
        return _Size(self.shape)

    def dim(self) -> int:
        """The number of dims (torch's ``Tensor.dim``; :attr:`ndim`)."""
        return self.ndim

    def numel(self) -> int:
        """The number of elements (torch's ``Tensor.numel``; :attr:`size` is NumPy's, an int)."""
        return int(self.size)

    def detach(self) -> "TileTensor":
        """The same tiles without autograd history: no gradient flows back through the result
        (torch's ``Tensor.detach``; nothing is copied)."""
        return TileTensor(self.tiling, self.dtype, self.grid, name=self.name)

    @property
    def chunks(self) -> tuple[tuple[int, ...], ...]:
        return self.tiling.chunks

    @property
    def tiles(self) -> tuple[int, ...]:
        """Nominal tile size per dimension."""
        return self.tiling.sizes

    @property
    def ntiles(self) -> int:
        return int(self.grid.size)

    def tile(self, *index) -> TileRef:
        """The tile at grid position ``index`` (one int per dim; ``self.grid.shape`` tiles)."""
        if (len(index) != self.ndim or any(isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in index)
                or any(not -n <= i < n for i, n in zip(index, self.grid.shape))):
            raise TileIndexError("tilegraph.TileTensor.tile", f"a tile index is one int per dim within the grid of "
                                 f"tiles {self.grid.shape} (tiles {self.chunks})", f"index {index!r:.60}")
        return self.grid[tuple(index)]

    def __repr__(self) -> str:
        return f"TileTensor(shape={self.shape}, dtype={self.dtype}, tiles={self.chunks})"

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d TileTensor")
        return self.shape[0]

    def __bool__(self):
        raise TileError("tilegraph.TileTensor.__bool__", "a TileTensor is symbolic and has no truth value until "
                        "it is computed: test its value (x.item() for one element, x.numpy() otherwise), or "
                        "'x is None' for a missing tensor", repr(self))

    # -- data boundary ---------------------------------------------------------------------------
    def numpy(self) -> np.ndarray:
        from tilegraph._lower import compute

        return compute(self)[0]

    def item(self):
        """The value of a one-element tensor as a Python number (torch's ``Tensor.item``): computes
        it, as :meth:`numpy` does."""
        if self.size != 1:
            raise TileError("tilegraph.TileTensor.item", "only a tensor of one element has an item (reduce it "
                            "first, or use .numpy())", f"a tensor of shape {self.shape}")
        return self.numpy().reshape(()).item()

    def __float__(self) -> float:
        """``float(loss)``: the value of a one-element tensor, computed as :meth:`item` does."""
        return float(self._number("__float__"))

    def __int__(self) -> int:
        """``int(x)``: the value of a one-element tensor, computed as :meth:`item` does."""
        return int(self._number("__int__"))

    def __format__(self, spec: str) -> str:
        """``f"{loss:.3f}"`` formats the value of a one-element tensor (computed as :meth:`item`
        does); ``f"{x}"`` is the repr, which computes nothing."""
        return format(self._number("__format__"), spec) if spec else repr(self)

    def _number(self, where: str):
        if self.size != 1:
            raise TileError(f"tilegraph.TileTensor.{where}", "only a tensor of one element converts to a number "
                            "(reduce it first, or use .numpy())", f"a tensor of shape {self.shape}")
        return self.item()

    def backward(self) -> None:
        """torch's ``loss.backward()``: adds the gradient of this scalar to the ``grad`` of every
        trainable Parameter it depends on (:func:`tilegraph._autograd.backward`)."""
        from tilegraph._autograd import backward

        backward(self)

    def to_dask_array(self):
        from tilegraph._lower import to_dask_array

        return to_dask_array(self)

    # -- operators ---------------------------------------------------------------------------------
    def __matmul__(self, other):
        from tilegraph import ops

        return ops.matmul(self, other)

    def __rmatmul__(self, other):
        from tilegraph import ops

        return ops.matmul(other, self)

    def __add__(self, other):
        from tilegraph import ops

        return ops.add(self, other)

    def __radd__(self, other):
        from tilegraph import ops

        return ops.add(other, self)  # the left operand named as ``a`` in errors

    def __sub__(self, other):
        from tilegraph import ops

        return ops.sub(self, other)

    def __rsub__(self, other):
        from tilegraph import ops

        return ops.sub(other, self)

    def __mul__(self, other):
        from tilegraph import ops

        return ops.mul(self, other)

    def __rmul__(self, other):
        from tilegraph import ops

        return ops.mul(other, self)  # the left operand named as ``a`` in errors

    def __truediv__(self, other):
        from tilegraph import ops

        return ops.div(self, other)

    def __rtruediv__(self, other):
        from tilegraph import ops

        return ops.div(other, self)

    def __floordiv__(self, other):
        from tilegraph.ops.elementwise import floor_divide

        return floor_divide(self, other)

    def __rfloordiv__(self, other):
        from tilegraph.ops.elementwise import floor_divide

        return floor_divide(other, self)

    def __mod__(self, other):
        from tilegraph.ops.elementwise import remainder

        return remainder(self, other)

    def __rmod__(self, other):
        from tilegraph.ops.elementwise import remainder

        return remainder(other, self)

    def __pow__(self, exponent):
        from tilegraph import ops

        return ops.pow(self, exponent)

    # -- augmented assignment: ``x += y`` rebinds ``x`` to ``x + y`` (a new tensor; a TileTensor is
    # never changed in place, so another name for the old ``x`` keeps its value, where torch's
    # in-place add changes it). On a Parameter that is an error: Python would rebind the name (a
    # module's attribute: ``model.fc.weight *= 0.5``) to a tensor that is no Parameter, and the
    # module silently lost it (not trained, not in its state_dict).
    def __iadd__(self, other):
        return self._augmented("+=", "__iadd__", other)

    def __isub__(self, other):
        return self._augmented("-=", "__isub__", other)

    def __imul__(self, other):
        return self._augmented("*=", "__imul__", other)

    def __itruediv__(self, other):
        return self._augmented("/=", "__itruediv__", other)

    def __ipow__(self, other):
        return self._augmented("**=", "__ipow__", other)

    def __imatmul__(self, other):
        return self._augmented("@=", "__imatmul__", other)

    def __ifloordiv__(self, other):
        return self._augmented("//=", "__ifloordiv__", other)

    def __imod__(self, other):
        return self._augmented("%=", "__imod__", other)

    def _augmented(self, symbol: str, name: str, other):
        from tilegraph import ops

        if getattr(self, "cells", None) is not None:  # a Parameter (tilegraph.nn, which imports this module)
            raise TileError(f"tilegraph.nn.Parameter.{name}", f"p {symbol} ... would replace the Parameter by a new "
                            "tensor that is no Parameter (a module holding it would lose it: not trained, not "
                            "saved); a TileTensor is never changed in place: set new values with p.assign(array) "
                            f"(e.g. p.assign(p.numpy() * 0.5)), or compute into another name (y = p {symbol[:-1]} ...)",
                            repr(self))
        from tilegraph.ops.elementwise import floor_divide, remainder

        binary = {"+=": ops.add, "-=": ops.sub, "*=": ops.mul, "/=": ops.div, "@=": ops.matmul, "//=": floor_divide,
                  "%=": remainder}
        return ops.pow(self, other) if symbol == "**=" else binary[symbol](self, other)

    def __setitem__(self, key, value):
        raise TileError("tilegraph.TileTensor.__setitem__", "x[...] = value is not supported: a TileTensor is never "
                        "changed in place; make the new tensor: tg.where(mask, value, x) or x.masked_fill(mask, "
                        "value) (mask, say, from comparisons), or tg.cat of the pieces", f"x[{key!r:.60}] = "
                        f"{type(value).__name__}")

    def __rpow__(self, base):
        """``2.0 ** x`` for a positive number: ``exp(x * log(base))`` (integers as float64)."""
        from tilegraph import ops

        where = "tilegraph.TileTensor.__rpow__"
        if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 0:
            raise TileError(where, "a number to a tensor's power needs a positive real base (exp(x * log(base)))",
                            f"{type(base).__name__} {base!r:.60} ** tensor")
        x = self if self.dtype.kind == "f" else ops.cast(self, np.float64)
        return ops.exp(x * float(np.log(np.float64(base))))

    def pow(self, exponent):
        """``x.pow(2)``: :func:`tilegraph.pow` (torch's ``Tensor.pow``), the same as ``x ** 2``."""
        from tilegraph import ops

        return ops.pow(self, exponent)

    def sqrt(self):
        """``x ** 0.5`` (torch's ``Tensor.sqrt``)."""
        from tilegraph import ops

        return ops.pow(self, 0.5)

    def relu(self):
        """:func:`tilegraph.relu` (torch's ``Tensor.relu``)."""
        from tilegraph import ops

        return ops.relu(self)

    def softmax(self, dim: int, dtype=None):
        """:func:`tilegraph.softmax` over ``dim`` (torch's ``Tensor.softmax``; ``dtype``: ``x`` cast first)."""
        from tilegraph.ops.softmax import softmax

        return softmax(self, dim, dtype=dtype, where="tilegraph.TileTensor.softmax")

    def log_softmax(self, dim: int, dtype=None):
        """:func:`tilegraph.log_softmax` over ``dim`` (torch's ``Tensor.log_softmax``)."""
        from tilegraph.ops.softmax import log_softmax

        return log_softmax(self, dim, dtype=dtype, where="tilegraph.TileTensor.log_softmax")

    def exp(self):
        """:func:`tilegraph.exp` (torch's ``Tensor.exp``)."""
        from tilegraph import ops

        return ops.exp(self)

    def log(self):
        """:func:`tilegraph.log` (torch's ``Tensor.log``)."""
        from tilegraph import ops

        return ops.log(self)

    def tanh(self):
        """:func:`tilegraph.tanh` (torch's ``Tensor.tanh``)."""
        from tilegraph import ops

        return ops.tanh(self)

    def sigmoid(self):
        """:func:`tilegraph.sigmoid` (torch's ``Tensor.sigmoid``)."""
        from tilegraph import ops

        return ops.sigmoid(self)

    # -- torch's method forms of the operators ----------------------------------------------------
    def add(self, other, *, alpha=1):
        """torch's ``x.add(y, alpha=1)``: ``x + alpha * y``."""
        from tilegraph import ops

        return ops.add(self, _scaled(other, alpha, "tilegraph.TileTensor.add"))

    def sub(self, other, *, alpha=1):
        """torch's ``x.sub(y, alpha=1)``: ``x - alpha * y``."""
        from tilegraph import ops

        return ops.sub(self, _scaled(other, alpha, "tilegraph.TileTensor.sub"))

    subtract = sub

    def mul(self, other):
        """torch's ``x.mul(y)``: ``x * y``."""
        from tilegraph import ops

        return ops.mul(self, other)

    multiply = mul

    def div(self, other, *, rounding_mode=None):
        """torch's ``x.div(y, rounding_mode=None)``: ``x / y``, or ``x // y`` for
        ``rounding_mode="floor"`` (``"trunc"``, rounding toward 0, is not supported)."""
        from tilegraph import ops
        from tilegraph.ops.elementwise import floor_divide

        if rounding_mode is None:
            return ops.div(self, other)
        if rounding_mode == "floor":
            return floor_divide(self, other)
        raise TileError("tilegraph.TileTensor.div", "rounding_mode None (true division) or 'floor' (x // y); 'trunc' "
                        "is not supported", repr(rounding_mode))

    divide = true_divide = div

    def floor_divide(self, other):
        """torch's ``floor_divide``: ``x // y``, rounded toward -inf (:func:`tilegraph.floor_divide`)."""
        from tilegraph.ops.elementwise import floor_divide

        return floor_divide(self, other)

    def remainder(self, other):
        """torch's ``remainder``: ``x % y``, with the sign of ``y`` (:func:`tilegraph.remainder`)."""
        from tilegraph.ops.elementwise import remainder

        return remainder(self, other)

    def neg(self):
        """torch's ``neg``: ``-x``."""
        return -self

    negative = neg

    def square(self):
        """torch's ``square``: ``x ** 2``."""
        from tilegraph import ops

        return ops.pow(self, 2)

    def rsqrt(self):
        """torch's ``rsqrt``: ``x ** -0.5`` (an integer tensor as float64)."""
        from tilegraph import ops

        return ops.pow(self, -0.5)

    def reciprocal(self):
        """torch's ``reciprocal``: ``1 / x`` (an integer tensor as float64)."""
        from tilegraph import ops

        return ops.div(1.0, self)

    def matmul(self, other):
        """torch's ``x.matmul(y)``: ``x @ y``."""
        from tilegraph import ops

        return ops.matmul(self, other)

    def requires_grad_(self, requires_grad: bool = True):
        """torch's ``x.requires_grad_()`` on a tensor that is no Parameter: a TileError naming
        :func:`tilegraph.grad`, which differentiates with respect to any tensor without a flag
        (``loss.backward()`` fills the ``grad`` of Parameters only)."""
        raise TileError("tilegraph.TileTensor.requires_grad_", "a TileTensor needs no flag to be differentiated: "
                        "tg.grad(loss, [x]) gives the gradient with respect to any tensor x (loss.backward() fills "
                        "the .grad of Parameters only; tg.nn.Parameter(array) makes one)", repr(self))

    # -- torch's in-place methods: a TileTensor never changes (module comment at _IN_PLACE) ------------
    def zero_(self):
        """torch's ``p.zero_()`` on a Parameter (its values set to 0, as :meth:`Parameter.assign`
        sets them; returns ``p``). Any other tensor never changes in place: a TileError naming
        ``x = tg.zeros_like(x)``."""
        if getattr(self, "cells", None) is None:
            _not_in_place(self, "zero_", "x = tg.zeros_like(x)")
        return self.fill_(0)

    def fill_(self, value):
        """torch's ``p.fill_(value)`` on a Parameter (returns ``p``); a TileError naming
        ``tg.full_like(x, value)`` on any other tensor."""
        if getattr(self, "cells", None) is None:
            _not_in_place(self, "fill_", "x = tg.full_like(x, value)")
        if isinstance(value, TileTensor) or not isinstance(value, (bool, np.bool_, numbers.Real)):
            raise TileError(f"tilegraph.nn.Parameter({self.name or ''}).fill_", "value must be a real number",
                            f"{type(value).__name__} {value!r:.60}")
        self.assign(np.full(self.shape, value, dtype=self.dtype))
        return self

    def copy_(self, src):
        """torch's ``p.copy_(src)`` on a Parameter: its values set to ``src`` (an array, a torch
        tensor, a number or a TileTensor, computed; broadcast to ``p``'s shape and cast to its
        dtype, as torch's). Any other tensor never changes in place: a TileError."""
        where = f"tilegraph.nn.Parameter({self.name or ''}).copy_"
        if getattr(self, "cells", None) is None:
            _not_in_place(self, "copy_", "x = src (a TileTensor), or tg.from_numpy(array, x.chunks)")
        value = src.numpy() if isinstance(src, TileTensor) else _host_array(src, where)
        try:
            value = np.broadcast_to(value, self.shape)
        except ValueError:
            raise TileError(where, f"src must broadcast to the parameter's shape {self.shape}",
                            f"shape {np.shape(value)}") from None
        self.assign(np.asarray(value, dtype=self.dtype))
        return self

    # -- view-like reshapes and casts (torch's names) ----------------------------------------------
    def unsqueeze(self, dim: int):
        """A new dim of size 1 at ``dim`` (torch's ``Tensor.unsqueeze``; moves no data)."""
        from tilegraph.ops.shape import unsqueeze

        return unsqueeze(self, dim, "tilegraph.TileTensor.unsqueeze")

    def squeeze(self, dim=None):
        """Without the dims of size 1 (``dim``: only that one, or those of a tuple; a dim whose size is
        not 1 stays, as torch's ``Tensor.squeeze``)."""
        from tilegraph.ops.shape import squeeze

        return squeeze(self, dim, "tilegraph.TileTensor.squeeze")

    def flatten(self, start_dim: int = 0, end_dim: int = -1):
        """Dims ``start_dim`` to ``end_dim`` merged into one (torch's ``Tensor.flatten``), where the
        tiles allow it (:meth:`reshape`'s rule: only the first merged dim may be tiled)."""
        from tilegraph.ops.shape import flatten

        return flatten(self, start_dim, end_dim, "tilegraph.TileTensor.flatten")

    def to(self, *args, dtype=None, device=None, non_blocking: bool = False, copy: bool = False):
        """``x.to(np.float32)`` (or ``"float32"``, ``"fp32"``, ``torch.float32``, ``dtype=``; float16,
        float32, float64, bool and integer dtypes), or ``x.to(other)`` (``other``'s dtype, torch's):
        :func:`tilegraph.cast`, the gradient cast back; ``x`` itself when it has that dtype. There
        is no device to move to: the planner places every tile, and a device (``x.to("cuda")``,
        ``x.to(device, dtype)``, ``device=``) is a TileError saying so."""
        from tilegraph.ops.elementwise import _cast_checked

        where = "tilegraph.TileTensor.to"
        if device is not None:
            _no_device(where, device)
        if len(args) == 2 or (len(args) == 1 and dtype is not None):  # torch's to(device, dtype)
            _no_device(where, args[0])
        if len(args) > 2 or not (args or dtype is not None):
            raise TileError(where, "one dtype (x.to(dtype), x.to(dtype=...)) or a tensor whose dtype to take",
                            f"{len(args)} positional argument(s), dtype={dtype!r:.40}")
        target = args[0] if args else dtype
        if isinstance(target, TileTensor):
            target = target.dtype
        return _cast_checked(self, target, where)

    def type_as(self, other):
        """torch's ``type_as``: ``x.to(other.dtype)``."""
        if not isinstance(other, TileTensor):
            raise TileError("tilegraph.TileTensor.type_as", "other must be a TileTensor (x.to(dtype) for a dtype)",
                            f"{type(other).__name__} {other!r:.60}")
        return self.to(other.dtype)

    def cpu(self):
        """torch's ``cpu``: a TileError (no device is given here: the planner places every tile)."""
        _no_device("tilegraph.TileTensor.cpu", "cpu")

    def cuda(self, device=None):
        """torch's ``cuda``: a TileError (no device is given here: the planner places every tile)."""
        _no_device("tilegraph.TileTensor.cuda", "cuda" if device is None else device)

    def bool(self):
        """``x.to(np.bool_)`` (torch's ``Tensor.bool``)."""
        return self.to(np.bool_)

    def int(self):
        """``x.to(np.int32)`` (torch's ``Tensor.int``)."""
        return self.to(np.int32)

    def float(self):
        """``x.to(np.float32)`` (torch's ``Tensor.float``)."""
        return self.to(np.float32)

    def double(self):
        """``x.to(np.float64)`` (torch's ``Tensor.double``)."""
        return self.to(np.float64)

    def half(self):
        """``x.to(np.float16)`` (torch's ``Tensor.half``)."""
        return self.to(np.float16)

    def long(self):
        """``x.to(np.int64)`` (torch's ``Tensor.long``; no gradient flows through it)."""
        return self.to(np.int64)

    # -- any / all (torch's: nonzero elements are True) -----------------------------------------------
    def any(self, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM):
        """torch's ``any``: whether an element is True (nonzero) over ``dim`` (an int, a tuple, or
        every dim), a bool tensor; no gradient."""
        return self._any_all(dim, keepdim, "any")

    def all(self, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM):
        """torch's ``all``: whether every element is True (nonzero) over ``dim``, a bool tensor."""
        return self._any_all(dim, keepdim, "all")

    def _any_all(self, dim, keepdim, how: str):
        from tilegraph import ops

        truth = self if self.dtype.kind == "b" else self.ne(0)
        if how == "all":
            truth = ~truth
        found = ops.sum(truth, dim, keepdim).gt(0)  # a count of the True (or, for all, the False) elements
        return found if how == "any" else ~found

    # -- max / min / var / std ----------------------------------------------------------------------
    def max(self, dim=None, keepdim: bool = False):
        """:func:`tilegraph.max` (torch's ``Tensor.max``): ``(values, indices)`` along ``dim``, or the
        largest element without one."""
        from tilegraph.ops.reduce import _extremum

        return _extremum(self, dim, keepdim, True, "tilegraph.TileTensor.max")

    def argmax(self, dim=None, keepdim: bool = False):
        """torch's ``argmax``: the int64 indices of the largest elements along ``dim`` (the
        ``indices`` of :meth:`max`); without ``dim`` only for a 1-d tensor."""
        return self._arg("argmax", dim, keepdim, True)

    def argmin(self, dim=None, keepdim: bool = False):
        """torch's ``argmin``: as :meth:`argmax`, for the smallest elements."""
        return self._arg("argmin", dim, keepdim, False)

    def _arg(self, name: str, dim, keepdim: bool, largest: bool):
        from tilegraph.ops.reduce import _extremum

        where = f"tilegraph.TileTensor.{name}"
        if dim is None:
            if self.ndim != 1:
                raise TileError(where, "a dim (the index into the flattened tensor is not supported: flatten "
                                "it first where its tiles allow)", f"a tensor of shape {self.shape}, dim=None")
            dim = 0
        return _extremum(self, dim, keepdim, largest, where).indices

    def clone(self):
        """torch's ``clone``: the same tensor (TileTensors are never changed in place, so a copy
        would be equal in every use; the gradient flows through, as through torch's)."""
        return self

    def contiguous(self):
        """torch's ``contiguous``: the same tensor (each tile is stored whole)."""
        return self

    def tolist(self):
        """torch's ``tolist``: the computed values as nested Python lists (a number for 0-d)."""
        return self.numpy().tolist()

    def min(self, dim=None, keepdim: bool = False):
        """:func:`tilegraph.min` (torch's ``Tensor.min``)."""
        from tilegraph.ops.reduce import _extremum

        return _extremum(self, dim, keepdim, False, "tilegraph.TileTensor.min")

    def var(self, dim=ALL_DIMS, unbiased=None, keepdim: bool = NO_KEEPDIM, *, correction=None, keepdims=None,
            axis=None):
        """:func:`tilegraph.var` (torch's ``Tensor.var``; ``correction=1`` by default)."""
        from tilegraph.ops.reduce import var

        return var(self, dim, unbiased, keepdim, correction=correction, keepdims=keepdims, axis=axis,
                   where="tilegraph.TileTensor.var")

    def std(self, dim=ALL_DIMS, unbiased=None, keepdim: bool = NO_KEEPDIM, *, correction=None, keepdims=None,
            axis=None):
        """:func:`tilegraph.std` (torch's ``Tensor.std``)."""
        from tilegraph.ops.reduce import std

        return std(self, dim, unbiased, keepdim, correction=correction, keepdims=keepdims, axis=axis,
                   where="tilegraph.TileTensor.std")

    # -- comparisons: bool tensors (tilegraph.ops.where) -------------------------------------------
    # ``==`` and ``!=`` stay Python's identity (tensors are dict keys and set members while a graph is
    # recorded and differentiated): ``x.eq(y)`` / ``x.ne(y)`` compare values, as torch's do. Against
    # an array (``(pred == labels).mean()`` for an accuracy) identity is never what is meant, and
    # its False made NumPy's mean of it 0.0: that is a TileError naming ``eq``.
    def __eq__(self, other):
        return self._identity(other, "==", "eq")

    def __ne__(self, other):
        return self._identity(other, "!=", "ne")

    __hash__ = object.__hash__

    def _identity(self, other, symbol: str, name: str):
        # a number too: torch's ``ids != pad_id`` / ``mask == 0`` gave Python's True / False, which
        # went on silently into an ``if`` or failed far away ('bool' object has no attribute 'float')
        if is_array(other) or isinstance(other, (numbers.Number, np.bool_)):
            _identity_refused(symbol, name, other)
        if self is other:
            return symbol == "=="
        return NotImplemented  # Python's identity, as object's

    def __gt__(self, other):
        return self._compare(other, "gt", "__gt__")

    def __ge__(self, other):
        return self._compare(other, "ge", "__ge__")

    def __lt__(self, other):
        return self._compare(other, "lt", "__lt__")

    def __le__(self, other):
        return self._compare(other, "le", "__le__")

    def gt(self, other):
        """torch's ``gt``: ``self > other`` element by element, a bool tensor (no gradient)."""
        return self._compare(other, "gt", "gt")

    def ge(self, other):
        """torch's ``ge``: ``self >= other``."""
        return self._compare(other, "ge", "ge")

    def lt(self, other):
        """torch's ``lt``: ``self < other``."""
        return self._compare(other, "lt", "lt")

    def le(self, other):
        """torch's ``le``: ``self <= other``."""
        return self._compare(other, "le", "le")

    def eq(self, other):
        """torch's ``eq``: values equal, element by element (``==`` is identity here, see above)."""
        return self._compare(other, "eq", "eq")

    def ne(self, other):
        """torch's ``ne``: values differ, element by element."""
        return self._compare(other, "ne", "ne")

    def _compare(self, other, op: str, name: str):
        from tilegraph.ops.where import compare

        return compare(self, other, op, f"tilegraph.TileTensor.{name}")

    # -- logical ops on bool tensors (masks): tilegraph.ops.where.logical -----------------------------
    def __and__(self, other):
        return self._logical(other, "and", "__and__")

    def __rand__(self, other):
        return self._logical(other, "and", "__rand__")

    def __or__(self, other):
        return self._logical(other, "or", "__or__")

    def __ror__(self, other):
        return self._logical(other, "or", "__ror__")

    def __xor__(self, other):
        return self._logical(other, "xor", "__xor__")

    def __rxor__(self, other):
        return self._logical(other, "xor", "__rxor__")

    def __invert__(self):
        return self._logical(None, "not", "__invert__")

    def logical_and(self, other):
        """torch's ``logical_and`` of bool tensors: ``self & other``."""
        return self._logical(other, "and", "logical_and")

    def logical_or(self, other):
        """torch's ``logical_or`` of bool tensors: ``self | other``."""
        return self._logical(other, "or", "logical_or")

    def logical_xor(self, other):
        """torch's ``logical_xor`` of bool tensors: ``self ^ other``."""
        return self._logical(other, "xor", "logical_xor")

    def logical_not(self):
        """torch's ``logical_not`` of a bool tensor: ``~self``."""
        return self._logical(None, "not", "logical_not")

    def _logical(self, other, how: str, name: str):
        from tilegraph.ops.where import logical

        return logical(self, other, how, f"tilegraph.TileTensor.{name}")

    def where(self, condition, other):
        """torch's ``x.where(condition, other)``: :func:`tilegraph.where` ``(condition, x, other)``."""
        from tilegraph.ops.where import where

        return where(condition, self, other)

    def masked_fill(self, mask, value):
        """torch's ``masked_fill``: ``value`` where the bool ``mask`` holds (:func:`tilegraph.masked_fill`)."""
        from tilegraph.ops.where import masked_fill

        return masked_fill(self, mask, value, "tilegraph.TileTensor.masked_fill")

    def abs(self):
        """torch's ``abs``: :func:`tilegraph.abs`."""
        from tilegraph.ops.elementwise import absolute

        return absolute(self)

    __abs__ = abs

    def clamp(self, min=None, max=None):  # noqa: A002 - torch names
        """torch's ``clamp``: :func:`tilegraph.clamp`."""
        from tilegraph.ops.elementwise import clamp

        return clamp(self, min, max)

    clip = clamp

    def __neg__(self):
        from tilegraph import ops

        if self.dtype.kind == "b":  # as NumPy and torch refuse it
            raise TileError("tilegraph.TileTensor.__neg__", "negating a bool tensor is not supported (use a logical "
                            "op, or cast to a number dtype first)", f"a {self.dtype} tensor of shape {self.shape}")
        if self.dtype.kind == "u":
            raise TileError("tilegraph.TileTensor.__neg__", "negating an unsigned integer tensor is not supported "
                            "(its negatives do not exist; cast to a signed dtype first)",
                            f"a {self.dtype} tensor of shape {self.shape}")
        # an integer factor: -ids stays integer (as in NumPy and torch); a float one made it float64
        return ops.mul(self, -1 if self.dtype.kind == "i" else -1.0)

    @property
    def T(self):
        from tilegraph import ops

        return ops.transpose(self)

    @property
    def mT(self):
        """torch's ``mT``: the last two dims swapped (a batch of matrices transposed)."""
        if self.ndim < 2:
            raise TileError("tilegraph.TileTensor.mT", "a tensor of at least 2 dims", f"shape {self.shape}")
        return self.transpose(-2, -1)

    def t(self):
        """torch's ``t``: a 2-d tensor transposed; a 0-d or 1-d one as it is (no data moves)."""
        if self.ndim > 2:
            raise TileError("tilegraph.TileTensor.t", "a tensor of at most 2 dims (x.transpose(d0, d1) or x.mT "
                            "for more)", f"shape {self.shape}")
        return self.T if self.ndim == 2 else self

    def sum(self, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM, *, dtype=None, keepdims: bool | None = None, axis=None,
            out=None, **numpy):
        """:func:`tilegraph.sum` (torch's ``Tensor.sum``; ``keepdims`` and ``axis`` are accepted
        aliases, and ``out=None``, so that ``np.sum(x)`` calls it)."""
        from tilegraph import ops

        _no_numpy_extras("tilegraph.TileTensor.sum", numpy)
        return ops.sum(self, dim, keepdim, dtype=dtype, keepdims=keepdims, axis=axis, out=out)

    def mean(self, dim=ALL_DIMS, keepdim: bool = NO_KEEPDIM, *, dtype=None, keepdims: bool | None = None, axis=None,
             out=None, **numpy):
        """:func:`tilegraph.mean` (torch's ``Tensor.mean``; ``keepdims`` and ``axis`` are accepted
        aliases, and ``out=None``, so that ``np.mean(x)`` calls it)."""
        from tilegraph import ops

        _no_numpy_extras("tilegraph.TileTensor.mean", numpy)
        return ops.mean(self, dim, keepdim, dtype=dtype, keepdims=keepdims, axis=axis, out=out)

    def cumsum(self, dim: int, *, dtype=None):
        """torch's ``cumsum`` along ``dim``, across tiles (:func:`tilegraph.cumsum`)."""
        from tilegraph.ops.scan import cumsum

        return cumsum(self, dim, dtype=dtype, where="tilegraph.TileTensor.cumsum")

    def norm(self, p=2, dim=None, keepdim: bool = False, *, dtype=None):
        """torch's ``norm``: the 2-norm (``'fro'``), 1-norm or inf-norm over ``dim`` (:func:`tilegraph.norm`)."""
        from tilegraph.ops.reduce import norm

        return norm(self, p, dim, keepdim, dtype=dtype, where="tilegraph.TileTensor.norm")

    def expand(self, *sizes, tiles=None):
        """torch's ``expand``: ``x.expand(4, -1, 3)`` or ``x.expand((4, -1, 3))`` broadcasts size-1
        dims and adds leading ones (:func:`tilegraph.expand`; ``tiles`` for the dims that grow)."""
        from tilegraph.ops.shape import checked_expand

        return checked_expand(self, sizes, "tilegraph.TileTensor.expand", tiles=tiles)

    def expand_as(self, other):
        """torch's ``expand_as``: :meth:`expand` to ``other``'s shape, the grown dims tiled as ``other``'s."""
        from tilegraph.ops.shape import expand_as

        return expand_as(self, other, "tilegraph.TileTensor.expand_as")

    def rechunk(self, tiles):
        """``x.rechunk((None, 8))``: ``x`` cut into other tiles (:func:`tilegraph.rechunk`, which
        moves data between tiles where it must; a reshape never does)."""
        from tilegraph.ops.shape import rechunk

        return rechunk(self, tiles, "tilegraph.TileTensor.rechunk")

    def reshape(self, *shape):
        """``x.reshape(2, -1)`` or ``x.reshape((2, -1))``: :func:`tilegraph.reshape`, which moves no
        data between tiles and raises a TileError naming the tiling when the tiles do not allow it."""
        from tilegraph.ops.shape import checked_reshape

        where = "tilegraph.TileTensor.reshape"
        return checked_reshape(self, _sizes(shape, where), where)

    def view(self, *shape):
        """``x.view(2, -1)``: the same as :meth:`reshape`. Every tilegraph reshape is a view in
        torch's sense (no data moves between tiles); where the tiles do not allow one it raises, as
        torch's ``view`` does on a non-contiguous tensor. ``view(dtype)`` is not supported."""
        from tilegraph.ops.shape import checked_reshape

        where = "tilegraph.TileTensor.view"
        return checked_reshape(self, _sizes(shape, where), where)

    def permute(self, *dims):
        """``x.permute(2, 0, 1)`` or ``x.permute((2, 0, 1))``: dim ``i`` of the result is dim
        ``dims[i]`` of ``x``, with its tiles (any tiling allows it)."""
        from tilegraph.ops.shape import checked_permute

        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        return checked_permute(self, dims, "tilegraph.TileTensor.permute")

    def transpose(self, *dims):
        from tilegraph import ops

        return ops.transpose(self, *dims)

    # -- indexing and selections (tilegraph.ops.index: each result tile is part of one input tile) --
    def __getitem__(self, key):
        """``x[1]``, ``x[:, -1]``, ``x[..., ::2]``, ``x[None]``: torch's basic indexing (ints,
        slices with positive steps, None, one ``...``); tensors, arrays and lists as indices are
        not supported (:func:`tilegraph.ops.index.getitem`)."""
        from tilegraph.ops.index import getitem

        return getitem(self, key)

    def __iter__(self):
        """The slices along dim 0, as iterating a torch tensor gives."""
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d TileTensor")
        return iter(self.unbind(0))

    def __array__(self, *args, **kwargs):
        raise TileError("tilegraph.TileTensor.__array__", "a TileTensor is symbolic and does not turn into a "
                        "NumPy array implicitly: compute it with x.numpy() (or tg.compute(x, ...))", repr(self))

    # NumPy's functions and ufuncs called on a TileTensor (``np.var(x)``, ``np.exp(x)``): those with a
    # tilegraph op record it, with NumPy's meaning (np.var divides by N, np.max gives values, not
    # torch's (values, indices)); the others are a TileError naming the function (np.var(x) was
    # Python's TypeError about an unexpected keyword, np.transpose(x) an error about dims (None,)).
    def __array_function__(self, func, types, args, kwargs):
        return _numpy_call(func, args, kwargs)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _numpy_ufunc(ufunc, method, inputs, kwargs)

    def narrow(self, dim: int, start: int, length: int):
        """torch's ``narrow``: ``length`` elements of dim ``dim`` from ``start``."""
        from tilegraph.ops.index import narrow

        return narrow(self, dim, start, length, "tilegraph.TileTensor.narrow")

    def select(self, dim: int, index: int):
        """torch's ``select``: the slice at ``index`` of dim ``dim``, which is removed."""
        from tilegraph.ops.index import select

        return select(self, dim, index, "tilegraph.TileTensor.select")

    def split(self, split_size_or_sections, dim: int = 0):
        """torch's ``split``: pieces of one size along ``dim`` (the last may be smaller), or of the sizes listed."""
        from tilegraph.ops.index import split

        return split(self, split_size_or_sections, dim, "tilegraph.TileTensor.split")

    def chunk(self, chunks: int, dim: int = 0):
        """torch's ``chunk``: at most ``chunks`` equal pieces along ``dim``."""
        from tilegraph.ops.index import chunk

        return chunk(self, chunks, dim, "tilegraph.TileTensor.chunk")

    def unbind(self, dim: int = 0):
        """torch's ``unbind``: the slices along ``dim``, that dim removed."""
        from tilegraph.ops.index import unbind

        return unbind(self, dim, "tilegraph.TileTensor.unbind")


def _no_device(where: str, device):
    """A device where torch code names one: tilegraph's planner places every tile."""
    raise TileError(where, "there is no device to move a TileTensor to: the planner places every tile (drop "
                    ".to(device) / .cuda() / .cpu(); tg.config.placement and tg.connect(gpu=...) choose the "
                    "devices; x.to(dtype) converts)", f"{device!r:.60}")


def _identity_refused(symbol: str, name: str, other):
    raise TileError(f"tilegraph.TileTensor.__{name}__", f"{symbol} of a TileTensor is Python's identity (tensors are "
                    "dict keys while a graph is recorded): compare values element by element with "
                    f"x.{name}(y), y a TileTensor (tg.from_numpy(y) for an array) or a number",
                    f"{type(other).__name__} {other!r:.40}" if isinstance(other, (numbers.Number, np.bool_)) else
                    f"{type(other).__name__} of shape {tuple(np.shape(other))}")


def _scaled(other, alpha, where: str):
    """``alpha * other`` for torch's ``add(other, alpha=)`` / ``sub``: ``other`` itself for 1."""
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TileError(where, "alpha must be a real number", f"{type(alpha).__name__} {alpha!r:.60}")
    if alpha == 1:
        return other
    return other * alpha


# torch's in-place methods and the out-of-place form each error names. A TileTensor is a node of
# the recorded graph: changing it would change what every op recorded from it reads, their
# backward passes included (torch counts versions to refuse that; here nothing would notice), so
# the in-place forms are TileErrors naming the assignment to write. A Parameter takes zero_,
# fill_ and copy_ (new values, set as assign sets them, outside any graph: a torch init under
# no_grad); its arithmetic in place names p.assign.
_IN_PLACE = {
    "add_": "x = x + y (x.add(y))", "sub_": "x = x - y (x.sub(y))", "mul_": "x = x * y (x.mul(y))",
    "div_": "x = x / y (x.div(y))", "pow_": "x = x ** y (x.pow(y))", "neg_": "x = -x",
    "abs_": "x = x.abs()", "clamp_": "x = x.clamp(min, max)", "clip_": "x = x.clamp(min, max)",
    "exp_": "x = x.exp()", "log_": "x = x.log()", "sqrt_": "x = x.sqrt()", "rsqrt_": "x = x.rsqrt()",
    "square_": "x = x.square()", "tanh_": "x = x.tanh()", "sigmoid_": "x = x.sigmoid()",
    "relu_": "x = x.relu()", "floor_divide_": "x = x // y", "remainder_": "x = x % y",
    "masked_fill_": "x = x.masked_fill(mask, value)", "addcmul_": "x = x + value * a * b",
    "addcdiv_": "x = x + value * a / b", "lerp_": "x = x + weight * (end - x)",
    "normal_": "x = tg.from_numpy(rng.normal(mean, std, x.shape), x.chunks) (a Parameter: p.assign(array))",
    "uniform_": "x = tg.from_numpy(rng.uniform(low, high, x.shape), x.chunks) (a Parameter: p.assign(array))",
    "t_": "x = x.t()", "transpose_": "x = x.transpose(d0, d1)", "unsqueeze_": "x = x.unsqueeze(dim)",
    "squeeze_": "x = x.squeeze(dim)",
}


def _not_in_place(x: TileTensor, name: str, form: str):
    if getattr(x, "cells", None) is not None:  # a Parameter
        raise TileError(f"tilegraph.nn.Parameter({x.name or ''}).{name}", f"p.{name}(...) would change the "
                        "parameter in place: set its new values with p.assign(array) (e.g. p.assign(p.numpy() * 0.5)), "
                        "or p.zero_(), p.fill_(value), p.copy_(src)", repr(x))
    raise TileError(f"tilegraph.TileTensor.{name}", f"x.{name}(...) would change x in place, and a TileTensor never "
                    "changes (the ops recorded from it read it, their gradients too): make the new tensor, "
                    f"{form}", repr(x))


def _in_place_method(name: str, form: str):
    def method(self, *args, **kwargs):
        _not_in_place(self, name, form)

    method.__name__, method.__qualname__ = name, f"TileTensor.{name}"
    method.__doc__ = f"torch's in-place ``{name}``: a TileError naming the out-of-place form, ``{form}``."
    return method


for _name, _form in _IN_PLACE.items():
    setattr(TileTensor, _name, _in_place_method(_name, _form))
del _name, _form


def _sizes(shape: tuple, where: str) -> tuple:
    """The new shape of ``reshape(*shape)`` / ``view(*shape)``: sizes, or one tuple of them."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    for s in shape:
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TileError(where, "expected sizes (ints, one of them may be -1); a dtype view or a "
                            "tensor as shape is not supported", f"{shape!r}")
    return tuple(int(s) for s in shape)


def tensor_from_cells(tiling: Tiling, dtype, cells: np.ndarray, name: str | None = None) -> TileTensor:
    grid = np.empty(tiling.grid, dtype=object)
    for idx in np.ndindex(*tiling.grid):
        grid[idx] = leaf(cells[idx])
    return TileTensor(tiling, dtype, grid, name=name)


def assign_cells(cells: np.ndarray, tiling: Tiling, array, token: str | None = None) -> None:
    """Put a C-ordered copy of each tile of ``array`` into the existing cell of that tile; the
    cells' tokens are ``token-<tile index>`` (default: fresh ones)."""
    for idx in np.ndindex(*tiling.grid):
        cells[idx].set(np.array(array[tiling.slices(idx)], order="C"), token=None if token is None else f"{token}-{idx}")


def split_into_cells(array, tiling: Tiling) -> np.ndarray:
    """One cell per tile, each holding a C-ordered copy of that tile of ``array``."""
    from dask.base import tokenize  # content hash: the same data gives the same task keys

    xp = xp_of(array)
    cells = np.empty(tiling.grid, dtype=object)
    for idx in np.ndindex(*tiling.grid):
        # a copy: later changes to the caller's array must not reach the graph (and 0-d stays 0-d)
        tile = xp.array(array[tiling.slices(idx)], order="C")
        cells[idx] = Cell(tile, tile.shape, tile.dtype, token=f"np-{tokenize(tile)}")
    return cells


def is_array(x) -> bool:
    """Whether ``x`` is a NumPy array or a torch tensor: data a layer or an op takes as a torch
    user passes it (tiled for them), where a TileTensor is expected."""
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("torch")


def _host_array(array, where: str):
    """``array`` as an array tilegraph tiles: a NumPy or CuPy array as it is, a torch tensor as a
    NumPy array (its data, without autograd), anything else through ``np.asarray``."""
    if isinstance(getattr(array, "dtype", None), np.dtype) and hasattr(array, "shape"):
        return array
    if type(array).__module__.startswith("torch"):
        if str(array.dtype) == "torch.bfloat16":
            raise TileError(where, "bfloat16 is not supported (float16, float32 and float64 are): convert the "
                            "tensor first, e.g. t.float()", f"a torch tensor of shape {tuple(array.shape)}, bfloat16")
        if getattr(array, "device", None) is not None and array.device.type != "cpu":
            array = array.cpu()
        return array.detach().numpy()
    try:
        return np.asarray(array)
    except (ValueError, TypeError) as e:  # a ragged list: NumPy's "inhomogeneous shape"
        raise TileError(where, f"expected an array, or something NumPy makes one of ({str(e).partition('.')[0]})",
                        f"{type(array).__name__} {array!r:.60}") from None


def from_numpy(array, tiles=None, *, name: str | None = None) -> TileTensor:
    """Split a NumPy (or CuPy) array into tiles of the given sizes (``None``: one tile).

    ``tiles`` is one size per dimension (an int applies to all), ``None``/-1 for a whole dimension,
    or explicit dask-style chunks. A torch tensor (on the CPU) is taken as ``t.detach().numpy()``.
    """
    array = _host_array(array, "tilegraph.from_numpy")
    check_array_dtype("tilegraph.from_numpy", array.dtype, array.shape)  # not float128 nor complex
    tiling = Tiling.from_sizes(array.shape, tiles, where="tilegraph.from_numpy")
    return tensor_from_cells(tiling, array.dtype, split_into_cells(array, tiling), name=name)


def from_dask_array(x, *, name: str | None = None) -> TileTensor:
    """Wrap a dask array: each of its chunks becomes a tile (computed when the graph runs)."""
    from tilegraph._graph import Cell
    from tilegraph._lower import DaskKey

    where = "tilegraph.from_dask_array"
    if not hasattr(x, "__dask_graph__") or not hasattr(x, "chunks"):
        hint = " (tg.from_numpy takes a NumPy array)" if is_array(x) else ""
        raise TileError(where, f"expected a dask array{hint}", f"{type(x).__name__} {x!r:.60}")
    if any(isinstance(c, float) and math.isnan(c) for dim in x.chunks for c in dim):
        raise TileError(where, "the dask array's chunks must have known sizes (call x.compute_chunk_sizes() "
                        "first, as dask asks after boolean indexing)", f"chunks {x.chunks!r:.80}")
    check_array_dtype(where, x.dtype, x.shape)
    tiling = Tiling(x.chunks)
    cells = np.empty(tiling.grid, dtype=object)
    graph = x.__dask_graph__()
    for idx in np.ndindex(*tiling.grid):
        key = (x.name,) + tuple(idx)
        cells[idx] = Cell(DaskKey(graph, key), tiling.tile_shape(idx), x.dtype, token=f"dask-{key}")
    return tensor_from_cells(tiling, x.dtype, cells, name=name)


def _no_numpy_extras(where: str, given: dict) -> None:
    """NumPy's reduction arguments a TileTensor does not take (``np.sum(x, initial=1)`` and
    ``where=`` pass them on): a TileError naming them (it was Python's TypeError)."""
    if given:
        raise TileError(where, "the arguments of torch's and NumPy's reductions but initial= and where= (not "
                        "supported: add a constant, or mask with tg.where, before the reduction)",
                        ", ".join(f"{k}={v!r:.40}" for k, v in given.items()))


# -- creators: torch's zeros / ones / full and their _like forms ----------------------------------
# No host array of the tensor's size is made or sent: one 0-d leaf holds the value, and a kernel per
# tile fills the tile where it runs (in the leaf's dtype and array namespace: CuPy on a GPU worker).
def _fill_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    return Cost(0.0, float(np.prod(out_shapes[0])) * itemsize)


@kernel("fill", cost=_fill_cost)
def _fill(value, *, shape):
    """A tile of ``shape`` holding ``value`` (a 0-d array: the tile takes its dtype and namespace)."""
    out = xp_of(value).empty(shape, dtype=value.dtype)
    out[...] = value
    return out


def _size_arg(size: tuple, where: str) -> tuple[int, ...]:
    """The shape of ``zeros(2, 3)`` / ``zeros((2, 3))``: non-negative ints, or one sequence of them."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) for n in size):
        raise TileError(where, "expected a shape: sizes as ints, or one tuple of them", f"{size!r:.80}")
    if any(n < 0 for n in size):
        raise TileError(where, "sizes must be >= 0", f"shape {tuple(int(n) for n in size)}")
    shape = tuple(int(n) for n in size)
    check_numel(shape, where)
    return shape


def check_numel(shape: tuple[int, ...], where: str) -> None:
    """A TileError where no NumPy array can have ``shape`` (its element count past the index type:
    NumPy's bare "Maximum allowed dimension exceeded" or OverflowError)."""
    if math.prod(shape) > np.iinfo(np.intp).max or any(n > np.iinfo(np.intp).max for n in shape):
        raise TileError(where, f"a shape of at most {np.iinfo(np.intp).max} elements (what a NumPy array holds)",
                        f"shape {shape!r:.120}")


def _fill_dtype(value, dtype, where: str) -> np.dtype:
    """``dtype``, or torch's choice for ``value``: bool, int64 for an integer, float32 otherwise."""
    if dtype is not None:
        return as_dtype(dtype, where)
    if isinstance(value, (bool, np.bool_)):
        return np.dtype(np.bool_)
    return np.dtype(np.int64 if isinstance(value, numbers.Integral) else np.float32)


def _filled(tiling: Tiling, value, dtype: np.dtype, name: str | None, where: str) -> TileTensor:
    from dask.base import tokenize

    if isinstance(value, TileTensor) or not isinstance(value, (bool, np.bool_, numbers.Real)):
        raise TileError(where, "fill_value must be a real number (or a bool)", f"{type(value).__name__} {value!r:.60}")
    try:
        scalar = np.array(value, dtype=dtype)
    except (OverflowError, ValueError):
        raise TileError(where, f"fill_value does not fit the dtype {dtype}", repr(value)) from None
    ref = leaf(Cell(scalar, (), dtype, token=f"fill-{tokenize(scalar)}"))
    grid = np.empty(tiling.grid, dtype=object)
    for idx in np.ndindex(*tiling.grid):
        shape = tiling.tile_shape(idx)
        grid[idx] = emit1(_fill, [ref], shape, dtype, op="full", shape=shape)
    return TileTensor(tiling, dtype, grid, name=name)


def full(size, fill_value, *, tiles=None, dtype=None, name: str | None = None) -> TileTensor:
    """torch's ``full``: a tensor of shape ``size`` holding ``fill_value``, split into ``tiles``
    (as :func:`from_numpy`'s). Without ``dtype``, torch's: bool for a bool, int64 for an integer,
    float32 for a float. Each tile is made where it is used (no host array is sent).

    >>> import tilegraph as tg
    >>> x = tg.full((3, 4), 2.5, tiles=(2, 3))
    >>> x.dtype, x.chunks, float(x.sum())
    (dtype('float32'), ((2, 1), (3, 1)), 30.0)
    """
    where = "tilegraph.full"
    if not isinstance(size, (tuple, list)) and not isinstance(size, numbers.Integral):
        raise TileError(where, "size must be a tuple of ints (the shape)", f"{type(size).__name__} {size!r:.60}")
    shape = _size_arg((size,), where)
    dtype = _fill_dtype(fill_value, dtype, where)
    return _filled(Tiling.from_sizes(shape, tiles, where), fill_value, dtype, name, where)


def zeros(*size, tiles=None, dtype=None, name: str | None = None) -> TileTensor:
    """torch's ``zeros``: ``tg.zeros(2, 3)`` or ``tg.zeros((2, 3))``, split into ``tiles`` (as
    :func:`from_numpy`'s); ``dtype`` float32 unless given (torch's default).

    >>> import numpy as np, tilegraph as tg
    >>> tg.zeros(2, 3, tiles=(1, 2), dtype=np.float64).numpy()
    array([[0., 0., 0.],
           [0., 0., 0.]])
    """
    where = "tilegraph.zeros"
    shape = _size_arg(size, where)
    return _filled(Tiling.from_sizes(shape, tiles, where), 0, _fill_dtype(0.0, dtype, where), name, where)


def ones(*size, tiles=None, dtype=None, name: str | None = None) -> TileTensor:
    """torch's ``ones``: as :func:`zeros`, holding ones."""
    where = "tilegraph.ones"
    shape = _size_arg(size, where)
    return _filled(Tiling.from_sizes(shape, tiles, where), 1, _fill_dtype(1.0, dtype, where), name, where)


def arange(start, end=None, step=1, *, dtype=None, tiles=None, name: str | None = None) -> TileTensor:
    """torch's ``arange``: ``arange(end)`` or ``arange(start, end, step)``, the numbers from
    ``start`` up to ``end`` (not included) by ``step``, split into ``tiles`` (as
    :func:`from_numpy`'s). Without ``dtype``, torch's: int64 where ``start``, ``end`` and ``step``
    are all integers, float32 (torch's default float dtype, as :func:`zeros`) otherwise. The
    values are made on the client, one NumPy array cut into tiles (a leaf, as :func:`from_numpy`).

    As torch's: a float dtype has ``ceil((end - start) / step)`` elements ``start + i * step``
    (computed in float64, float32 for float16, then rounded); an integer dtype takes ``start``,
    ``end`` and ``step`` truncated to integers first (``arange(0, 5, 1.5, dtype=np.int64)``
    steps by 1; torch's int64 rule, which tilegraph applies to every integer dtype). A step of 0,
    one leading away from ``end``, a bound that is not finite, a bool argument and a bool dtype
    are TileErrors.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.arange(5, tiles=2)
    >>> x.dtype, x.chunks, x.numpy()
    (dtype('int64'), ((2, 2, 1),), array([0, 1, 2, 3, 4]))
    >>> tg.arange(1, 2.5, 0.5).numpy()
    array([1. , 1.5, 2. ], dtype=float32)
    """
    where = "tilegraph.arange"
    if end is None:
        start, end = 0, start
    args = {"start": start, "end": end, "step": step}
    for arg, v in args.items():
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
            raise TileError(where, f"{arg} must be a real number (an int or a float)", f"{type(v).__name__} {v!r:.60}")
        if not math.isfinite(v):
            raise TileError(where, "start, end and step must be finite (torch's 'unsupported range')", f"{arg}={v!r}")
    ints = all(isinstance(v, numbers.Integral) for v in args.values())
    if dtype is None:
        dtype = np.dtype(np.int64 if ints else np.float32)
    else:
        dtype = as_dtype(dtype, where)
        if dtype.kind not in "iuf":
            raise TileError(where, "dtype must be an integer or float dtype (torch's arange makes no bool tensor)",
                            str(dtype))
    shown = f"start={start!r}, end={end!r}, step={step!r}"
    if dtype.kind in "iu":
        lo, hi, st = (int(v) for v in (start, end, step))  # truncated toward 0, as torch's cast
        if not all(np.iinfo(np.int64).min <= v <= np.iinfo(np.int64).max for v in (lo, hi, st)):
            raise TileError(where, "start, end and step must fit int64", shown)
    else:
        lo, hi, st = float(start), float(end), float(step)
    if st == 0:
        raise TileError(where, "step must be nonzero", shown)
    if not ((st > 0 and hi >= lo) or (st < 0 and hi <= lo)):
        raise TileError(where, "step must lead from start to end (step > 0 with end >= start, or step < 0 with "
                        "end <= start), as torch's", shown)
    n = -((lo - hi) // st) if dtype.kind in "iu" else math.ceil((hi - lo) / st)
    check_numel((n,), where)
    if dtype.kind in "iu":
        values = (np.arange(n, dtype=np.int64) * st + lo).astype(dtype, copy=False)
    else:
        acc = np.dtype(np.float32 if dtype == np.float16 else np.float64)
        values = (acc.type(lo) + np.arange(n, dtype=acc) * acc.type(st)).astype(dtype, copy=False)
    tiling = Tiling.from_sizes(values.shape, tiles, where=where)
    return tensor_from_cells(tiling, dtype, split_into_cells(values, tiling), name=name)


def full_like(x: TileTensor, fill_value, *, dtype=None, name: str | None = None) -> TileTensor:
    """torch's ``full_like``: ``fill_value`` in the shape, tiling and dtype (unless ``dtype`` is
    given) of ``x``. Reads nothing of ``x``: no gradient flows to it, and it need not be computed."""
    return _like(x, fill_value, dtype, name, "tilegraph.full_like")


def zeros_like(x: TileTensor, *, dtype=None, name: str | None = None) -> TileTensor:
    """torch's ``zeros_like``: :func:`full_like` of 0.

    >>> import numpy as np, tilegraph as tg
    >>> tg.zeros_like(tg.from_numpy(np.arange(5), tiles=2)).chunks
    ((2, 2, 1),)
    """
    return _like(x, 0, dtype, name, "tilegraph.zeros_like")


def ones_like(x: TileTensor, *, dtype=None, name: str | None = None) -> TileTensor:
    """torch's ``ones_like``: :func:`full_like` of 1."""
    return _like(x, 1, dtype, name, "tilegraph.ones_like")


def _like(x: TileTensor, value, dtype, name, where: str) -> TileTensor:
    if not isinstance(x, TileTensor):
        raise TileError(where, "x must be a TileTensor (for a shape: tg.zeros, tg.ones, tg.full)",
                        f"{type(x).__name__} {x!r:.60}")
    return _filled(x.tiling, value, x.dtype if dtype is None else _fill_dtype(value, dtype, where), name, where)


# -- NumPy's protocols (TileTensor.__array_function__ / __array_ufunc__) -----------------------------
def _numpy_name(func) -> str:
    module = getattr(func, "__module__", None) or "numpy"
    name = getattr(func, "__name__", repr(func))
    return f"np.linalg.{name}" if module.endswith("linalg") else f"np.{name}"


def _numpy_refused(name: str, args, why: str = ""):
    tensors = [a for a in args if isinstance(a, TileTensor)] + \
        [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, TileTensor)]
    raise TileError(f"tilegraph.TileTensor ({name})", f"{name} of a TileTensor is not supported{why}: use "
                    "tilegraph's op where there is one (tg.exp, x.max(dim), x.var(dim, correction=0), ...), or "
                    f"compute the tensor first ({name}(x.numpy()))", repr(tensors[0]) if tensors else "")


def _np_option(name: str, **given) -> None:
    """NumPy arguments a tilegraph op has no counterpart for, named when given (not None)."""
    extra = {k: v for k, v in given.items() if v is not None}
    if extra:
        raise TileError(f"tilegraph.TileTensor ({name})", f"{name} of a TileTensor takes no "
                        f"{', '.join(k + '=' for k in extra)} (a TileTensor is never written in place)",
                        ", ".join(f"{k}={v!r:.40}" for k, v in extra.items()))


def _np_axes(axis) -> tuple | None:
    return None if axis is None else tuple(axis) if isinstance(axis, (tuple, list)) else (axis,)


def _np_var(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False, *, where=None, mean=None, correction=None,
            _std=False):
    from tilegraph.ops.reduce import std, var

    name = "np.std" if _std else "np.var"
    _np_option(name, out=out, where=where, mean=mean)
    if correction is not None and ddof != 0:
        raise TileError(f"tilegraph.TileTensor ({name})", "ddof= or correction=, not both (NumPy's rule)",
                        f"ddof={ddof!r}, correction={correction!r}")
    if dtype is not None:
        a = a.to(dtype)
    return (std if _std else var)(a, _np_axes(axis), keepdim=bool(keepdims),
                                  correction=ddof if correction is None else correction, where=f"tilegraph.{name}")


def _np_extremum(largest: bool):
    def extremum(a, axis=None, out=None, keepdims=False, initial=None, where=None):
        from tilegraph.ops.reduce import _extremum

        name = "np.max" if largest else "np.min"
        _np_option(name, out=out, initial=initial, where=where)
        axes = _np_axes(axis)
        if axes is None:  # NumPy's keepdims over every dim: the scalar with each dim kept as 1
            value = _extremum(a, None, False, largest, f"tilegraph.{name}")
            return value.reshape((1,) * a.ndim) if keepdims else value
        for d in sorted((int(d) % max(a.ndim, 1) for d in axes), reverse=True):  # NumPy's values, not (values, indices)
            a = _extremum(a, d, bool(keepdims), largest, f"tilegraph.{name}").values
        return a

    return extremum


def _np_arg(largest: bool):
    def arg(a, axis=None, out=None, *, keepdims=False):
        _np_option("np.argmax" if largest else "np.argmin", out=out)
        return (a.argmax if largest else a.argmin)(axis, bool(keepdims))

    return arg


def _np_any_all(how: str):
    def reduce(a, axis=None, out=None, keepdims=False, *, where=None):
        _np_option(f"np.{how}", out=out, where=where)
        return getattr(a, how)(ALL_DIMS if axis is None else _np_axes(axis), bool(keepdims))

    return reduce


def _np_transpose(a, axes=None):
    return a.permute(tuple(range(a.ndim))[::-1] if axes is None else tuple(axes))


def _np_reshape(a, shape=None, order="C", *, newshape=None, copy=None):
    if order != "C":
        raise TileError("tilegraph.TileTensor (np.reshape)", "order='C' (the only order of a TileTensor)", repr(order))
    return a.reshape(newshape if shape is None else shape)


def _np_clip(a, a_min=None, a_max=None, out=None, *, min=None, max=None):  # noqa: A002 - NumPy's names
    from tilegraph.ops.elementwise import clamp

    _np_option("np.clip", out=out)
    return clamp(a, a_min if min is None else min, a_max if max is None else max)


def _np_cumsum(a, axis=None, dtype=None, out=None):
    _np_option("np.cumsum", out=out)
    if axis is None:
        if a.ndim != 1:
            raise TileError("tilegraph.TileTensor (np.cumsum)", "an axis (the flattened cumulative sum is not "
                            "supported)", f"a tensor of shape {a.shape}, axis=None")
        axis = 0
    return a.cumsum(axis, dtype=dtype)


def _np_cat(stack: bool):
    def join(arrays, axis=0, out=None, *, dtype=None, casting=None):
        from tilegraph import ops

        _np_option("np.stack" if stack else "np.concatenate", out=out, dtype=dtype, casting=casting)
        return (ops.stack if stack else ops.cat)(list(arrays), axis)

    return join


def _np_where(condition, x=None, y=None):
    from tilegraph.ops.where import where

    if x is None or y is None:
        raise TileError("tilegraph.TileTensor (np.where)", "np.where(condition, x, y) (the indices of "
                        "np.where(condition) depend on the values: compute it first)", "one argument")
    return where(condition, x, y)


def _np_squeeze(a, axis=None):
    return a.squeeze(axis)


def _np_expand_dims(a, axis):
    for d in sorted(_np_axes(axis)):
        a = a.unsqueeze(d)
    return a


def _np_dot(a, b, out=None):
    from tilegraph import ops

    _np_option("np.dot", out=out)
    if not (isinstance(a, TileTensor) and isinstance(b, TileTensor)) or a.ndim > 2 or b.ndim > 2:
        raise TileError("tilegraph.TileTensor (np.dot)", "two TileTensors of 1 or 2 dims (x @ y; for more dims "
                        "np.dot is no matmul)", f"{type(a).__name__} and {type(b).__name__}")
    return ops.matmul(a, b)


def _numpy_own(func):
    """NumPy's own implementation: the function reads attributes (np.shape) or calls the tensor's
    method of its name (np.sum and np.mean call x.sum / x.mean with NumPy's arguments)."""
    return func._implementation


def _numpy_functions() -> dict:
    if not _NUMPY_FUNCTIONS:
        std = lambda *a, **k: _np_var(*a, _std=True, **k)  # noqa: E731 - np.std: np.var's arguments
        _NUMPY_FUNCTIONS.update({
            np.shape: _numpy_own(np.shape), np.ndim: _numpy_own(np.ndim), np.size: _numpy_own(np.size),
            np.sum: _numpy_own(np.sum), np.mean: _numpy_own(np.mean), np.var: _np_var, np.std: std,
            np.max: _np_extremum(True), np.amax: _np_extremum(True), np.min: _np_extremum(False),
            np.amin: _np_extremum(False), np.argmax: _np_arg(True), np.argmin: _np_arg(False),
            np.transpose: _np_transpose, np.reshape: _np_reshape, np.clip: _np_clip, np.cumsum: _np_cumsum,
            np.concatenate: _np_cat(False), np.stack: _np_cat(True), np.where: _np_where, np.squeeze: _np_squeeze,
            np.expand_dims: _np_expand_dims, np.dot: _np_dot, np.any: _np_any_all("any"), np.all: _np_any_all("all"),
        })
    return _NUMPY_FUNCTIONS


_NUMPY_FUNCTIONS: dict = {}


def _numpy_call(func, args, kwargs):
    handler = _numpy_functions().get(func)
    if handler is None:
        _numpy_refused(_numpy_name(func), args)
    return handler(*args, **kwargs)


#: the ufuncs of Python's operators, as the tensor's operator and its reflection: ``array < x``
#: arrives here as np.less(array, x) and is ``x > array`` (the error an array operand gets names
#: the operator, as when Python reflects it)
_UFUNC_OPERATORS = {
    "add": ("__add__", "__radd__"), "subtract": ("__sub__", "__rsub__"), "multiply": ("__mul__", "__rmul__"),
    "true_divide": ("__truediv__", "__rtruediv__"), "floor_divide": ("__floordiv__", "__rfloordiv__"),
    "remainder": ("__mod__", "__rmod__"), "power": ("__pow__", "__rpow__"), "matmul": ("__matmul__", "__rmatmul__"),
    "greater": ("__gt__", "__lt__"), "greater_equal": ("__ge__", "__le__"), "less": ("__lt__", "__gt__"),
    "less_equal": ("__le__", "__ge__"), "equal": ("__eq__", "__eq__"), "not_equal": ("__ne__", "__ne__"),
    "bitwise_and": ("__and__", "__rand__"), "bitwise_or": ("__or__", "__ror__"), "bitwise_xor": ("__xor__", "__rxor__"),
    "logical_and": ("logical_and", "logical_and"), "logical_or": ("logical_or", "logical_or"),
    "logical_xor": ("logical_xor", "logical_xor"),
}
#: one-operand ufuncs as the tensor's method of that meaning
_UFUNC_METHODS = {"negative": "__neg__", "absolute": "abs", "invert": "__invert__", "logical_not": "logical_not",
                  "exp": "exp", "log": "log", "tanh": "tanh", "sqrt": "sqrt", "square": "square"}


def _numpy_binary(name: str, a, b):
    method, reflected = _UFUNC_OPERATORS[name]
    out = getattr(a, method)(b) if isinstance(a, TileTensor) else getattr(b, reflected)(a)
    if out is NotImplemented:  # == / != of a number: Python's identity, which NumPy's call is not
        _identity_refused("==" if name == "equal" else "!=", "eq" if name == "equal" else "ne",
                          b if isinstance(a, TileTensor) else a)
    return out


def _numpy_extreme(name: str, a, b):
    """np.maximum(x, 0) / np.minimum(x, c): a clamp; of two tensors it is not supported."""
    from tilegraph.ops.elementwise import clamp

    tensor, number = (a, b) if isinstance(a, TileTensor) else (b, a)
    if isinstance(number, TileTensor):
        _numpy_refused(f"np.{name}", (a, b), " of two tensors (tg.where(a > b, a, b))")
    return clamp(tensor, min=number) if name == "maximum" else clamp(tensor, max=number)


def _numpy_ufunc(ufunc, method: str, inputs, kwargs):
    name = ufunc.__name__
    if method != "__call__":
        _numpy_refused(f"np.{name}.{method}", inputs)
    if kwargs:
        _np_option(f"np.{name}", **{k: "given" if v is None else v for k, v in kwargs.items()})
    if name in _UFUNC_OPERATORS:
        return _numpy_binary(name, *inputs)
    if name in _UFUNC_METHODS:
        return getattr(inputs[0], _UFUNC_METHODS[name])()
    if name in ("maximum", "minimum"):
        return _numpy_extreme(name, *inputs)
    _numpy_refused(f"np.{name}", inputs)
