"""Helpers shared by the op modules: array namespaces, tensor building, validation, costs."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from tilegraph._config import FLOAT_DTYPES, is_int  # noqa: F401 - FLOAT_DTYPES: for the op modules
from tilegraph._errors import TileError
from tilegraph._graph import Cost, TileRef, xp_of  # noqa: F401 - xp_of is used by the op modules
from tilegraph._tensor import Default, TileTensor, Tiling, resolve_alias  # noqa: F401 - for the op modules


def new_tensor(tiling: Tiling, dtype, fill: Callable[[tuple[int, ...]], object]) -> TileTensor:
    """A TileTensor whose tile at grid index ``idx`` is ``fill(idx)``: a TileRef of the shape
    ``tiling.tile_shape(idx)`` and of ``dtype``, which is checked here, as the graph is recorded
    (a tile declared otherwise made a tensor whose tiles disagreed with it: a wrong result, or an
    error at compute naming a kernel whose output matched what it had been declared)."""
    dtype = np.dtype(dtype)
    grid = np.empty(tiling.grid, dtype=object)
    chunks = tiling.chunks
    for idx in np.ndindex(*tiling.grid):
        ref = grid[idx] = fill(idx)
        if (type(ref) is not TileRef or (ref.dtype is not dtype and ref.dtype != dtype)
                or ref.shape != tuple([c[i] for c, i in zip(chunks, idx)])):
            _bad_tile(tiling, dtype, idx, ref)
    return TileTensor(tiling, dtype, grid)


def _bad_tile(tiling: Tiling, dtype: np.dtype, idx: tuple, ref) -> None:
    want = f"shape {tiling.tile_shape(idx)} and dtype {dtype}"
    if type(ref) is not TileRef:
        got = type(ref).__name__ + (f" of shape {tuple(ref.shape)}" if hasattr(ref, "shape") else "")
        raise TileError("tilegraph.new_tensor", f"fill({idx}) must return a TileRef (what emit1 returns) of "
                        f"tile {idx}'s {want}", got)
    node = ref.node
    made = f" by kernel {node.kernel.name!r} of op {node.op!r}" if node.kernel is not None else ""
    raise TileError("tilegraph.new_tensor", f"tile {idx} of a tensor with tiles {tiling.chunks} must have {want} "
                    "(declare it so in emit1: tiling.tile_shape(idx), and the tensor's dtype)",
                    f"a tile of shape {ref.shape}, dtype {ref.dtype}{made}")


def require_tensor(x, where: str, name: str) -> TileTensor:
    if not isinstance(x, TileTensor):
        raise TileError(where, f"{name} must be a TileTensor", type(x).__name__)
    return x


def require_float(x: TileTensor, where: str, name: str = "input") -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TileError(where, f"{name} must have a floating dtype", str(x.dtype))


def require_same_dtype(where: str, **tensors: TileTensor) -> np.dtype:
    dts = {k: t.dtype for k, t in tensors.items() if t is not None}
    if len(set(dts.values())) > 1:
        got = ", ".join(f"{k}={v}" for k, v in dts.items())
        raise TileError(where, "inputs must share one dtype (cast explicitly)", got)
    return next(iter(dts.values()))


def require_same_chunks(where: str, what: str, a: Sequence[int], b: Sequence[int], hint: str = "") -> None:
    if tuple(a) != tuple(b):
        raise TileError(where, f"{what} must have the same tiles", f"{tuple(a)} vs {tuple(b)}{hint}")


def norm_dim(dim: int, ndim: int, where: str) -> int:
    if not is_int(dim):
        raise TileError(where, f"dim must be an int (a dim of the {ndim}-d tensor; negative counts from the end)",
                        f"{dim!r} ({type(dim).__name__})")
    if not -max(ndim, 1) <= dim < max(ndim, 1):  # a 0-d tensor takes 0 and -1, as in torch
        raise TileError(where, f"dim out of range for a {ndim}-d tensor", str(dim))
    return int(dim) % ndim if ndim else 0


def acc_dtype(dtype) -> np.dtype:
    """Dtype that statistics (max, sum-exp, log-sum-exp, moments) are accumulated in: at least
    float32 (float16 inputs are upcast)."""
    return np.promote_types(np.dtype(dtype), np.float32)


def numel(shape) -> int:
    return math.prod(int(n) for n in shape)  # (np.prod on a small tuple costs ~3 us a call; planning makes thousands)


def elementwise_cost(flops_per_elem: float) -> Callable:
    def cost(in_shapes, out_shapes, itemsize, params) -> Cost:
        n_out = sum(numel(s) for s in out_shapes)
        n_in = sum(numel(s) for s in in_shapes)
        return Cost(flops=flops_per_elem * n_out, bytes=float((n_in + n_out) * itemsize))

    return cost
