"""Layout ops: transpose / permute (any permutation, any tiling) and tile-compatible reshape.

Both mirror torch: ``tg.permute(x, (2, 0, 1))`` / ``x.permute(2, 0, 1)``, ``tg.transpose(x, 0, 1)``,
``tg.reshape(x, (4, -1))`` / ``x.reshape(4, -1)`` / ``x.view(4, -1)``. A permutation carries each
dim's tiles along, so it works on every tiling. A reshape never moves data between tiles: it
works where each tile of the input becomes whole tiles of the output, and raises a TileError
that names the shape, the tiling and what was asked (and what tiling would allow it) elsewhere.
"""

from __future__ import annotations

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import new_tensor, norm_dim, numel, require_tensor, xp_of

__all__ = ["permute", "reshape", "transpose", "checked_permute", "checked_reshape"]


def _copy_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    return Cost(0.0, 2.0 * numel(out_shapes[0]) * itemsize)


@kernel("transpose", cost=_copy_cost)
def _transpose(x, perm):
    return xp_of(x).ascontiguousarray(x.transpose(perm))


@kernel("reshape", cost=_copy_cost)
def _reshape(x, shape):
    return x.reshape(shape)


class Transpose(Op):
    name = "transpose"

    def forward(self, x, perm):
        tiling = Tiling(tuple(x.chunks[p] for p in perm))

        def fill(idx):
            src = [0] * x.ndim
            for d, p in enumerate(perm):
                src[p] = idx[d]
            return emit1(_transpose, [x.grid[tuple(src)]], tiling.tile_shape(idx), x.dtype, op="transpose",
                         perm=perm)

        return new_tensor(tiling, x.dtype, fill), perm

    def backward(self, perm, g):
        return (_transpose_op(g, perm=tuple(int(i) for i in np.argsort(perm))),)


_transpose_op = Transpose()


def transpose(x: TileTensor, *dims) -> TileTensor:
    """``transpose(x)`` reverses dims; ``transpose(x, d0, d1)`` swaps two; a full permutation permutes."""
    where = "tilegraph.transpose"
    require_tensor(x, where, "x")
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])
    if not dims:
        return checked_permute(x, tuple(reversed(range(x.ndim))), where)
    if len(dims) == 2:  # torch semantics: swap two dims
        d0, d1 = (norm_dim(d, x.ndim, where) for d in dims)
        perm = list(range(x.ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        return checked_permute(x, tuple(perm), where)
    return checked_permute(x, dims, where)


def permute(x: TileTensor, dims) -> TileTensor:
    """torch's ``permute``: dim ``i`` of the result is dim ``dims[i]`` of ``x``, with its tiles.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.zeros((2, 3, 4)), tiles=(1, 3, 2))
    >>> tg.permute(x, (2, 0, 1)).chunks
    ((2, 2), (1, 1), (3,))
    """
    return checked_permute(x, dims, "tilegraph.permute")


def checked_permute(x: TileTensor, dims, where: str) -> TileTensor:
    """:func:`permute`, its errors labelled ``where`` (the public name the user called)."""
    require_tensor(x, where, "x")
    if isinstance(dims, (int, np.integer)):
        dims = (dims,)
    dims = tuple(dims)
    if len(dims) != x.ndim or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) for d in dims):
        raise TileError(where, f"expected a permutation of the {x.ndim} dims of a tensor of shape {x.shape}",
                        f"dims {dims!r}")
    perm = tuple(norm_dim(int(d), x.ndim, where) for d in dims)
    if sorted(perm) != list(range(x.ndim)):
        raise TileError(where, f"expected a permutation of the {x.ndim} dims of a tensor of shape {x.shape} "
                        "(each dim once)", f"dims {dims!r}")
    if perm == tuple(range(x.ndim)):
        return x
    return _transpose_op(x, perm=perm)


def _groups(old: tuple, new: tuple):
    """Pair runs of dims with equal products: [(old dims, new dims)], ignoring size-1 dims."""
    oi = [d for d, n in enumerate(old) if n != 1]
    ni = [d for d, n in enumerate(new) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(oi) and j < len(ni):
        go, gn = [oi[i]], [ni[j]]
        po, pn = old[oi[i]], new[ni[j]]
        while po != pn:
            if po < pn:
                i += 1
                go.append(oi[i])
                po *= old[oi[i]]
            else:
                j += 1
                gn.append(ni[j])
                pn *= new[ni[j]]
        groups.append((go, gn))
        i += 1
        j += 1
    return groups


def _reshape_plan(x: TileTensor, shape: tuple, where: str):
    """New chunks for ``x`` reshaped to ``shape`` without moving data between tiles, and for each
    new dim the old dim whose tile index it follows (None: one tile).

    Dims are reshaped in groups of equal size (``_groups``). Where only the first old dim of a
    group is tiled, each tile is one contiguous run of the group's elements; it stays one tile when
    that run is whole rows of the new inner dims, and the first new dim takes the tiles.
    """
    new_chunks: list = [(1,)] * len(shape)
    follow: list = [None] * len(shape)
    for go, gn in _groups(x.shape, shape):
        inner_new = numel([shape[d] for d in gn[1:]])
        runs = tuple(c * numel([x.shape[d] for d in go[1:]]) for c in x.chunks[go[0]])  # elements per tile
        tiled_inner = [d for d in go[1:] if len(x.chunks[d]) > 1]
        if not tiled_inner and all(r % inner_new == 0 for r in runs):
            new_chunks[gn[0]] = tuple(r // inner_new for r in runs)
            follow[gn[0]] = go[0]
            for d in gn[1:]:
                new_chunks[d] = (shape[d],)
            continue
        old = f"dims {go} (sizes {tuple(x.shape[d] for d in go)}, tiles {tuple(x.chunks[d] for d in go)})"
        new = f"dims {gn} (sizes {tuple(shape[d] for d in gn)})"
        if tiled_inner:
            why = (f"{old} become {new}, and only the first dim of such a group may be split into tiles: "
                   f"dims {tiled_inner} must be one tile each")
        else:
            why = (f"{old} become {new}: each tile holds a run of {sorted(set(runs))} elements, which must be "
                   f"whole rows of dims {gn[1:]} (multiples of {inner_new})")
        raise TileError(where, f"reshape is not tile-compatible: a tensor of shape {x.shape} with tiles "
                        f"{x.chunks} cannot become {shape} without moving data between tiles; {why}",
                        f"shape {shape}")
    return new_chunks, follow


class Reshape(Op):
    name = "reshape"

    def forward(self, x, shape, where="tilegraph.reshape"):
        new_chunks, follow = _reshape_plan(x, shape, where)
        tiling = Tiling(new_chunks)
        grid_src = [d for d in range(x.ndim) if len(x.chunks[d]) > 1]

        def fill(idx):
            src = [0] * x.ndim
            for nd, od in enumerate(follow):
                if od is not None:
                    src[od] = idx[nd]
            return emit1(_reshape, [x.grid[tuple(src)]], tiling.tile_shape(idx), x.dtype, op="reshape",
                         shape=tiling.tile_shape(idx))

        if any(d not in follow for d in grid_src):  # pragma: no cover - guarded above
            raise AssertionError("reshape lost a tiled dim")
        return new_tensor(tiling, x.dtype, fill), x

    def backward(self, x, g):
        return (_reshape_op(g, shape=x.shape),)


_reshape_op = Reshape()


def reshape(x: TileTensor, shape) -> TileTensor:
    """Reshape without moving data between tiles (split or merge dims whose tiles allow it).

    One ``-1`` may stand for the remaining size. Merging dims keeps the tiles of the first of them
    (the others must be one tile each); splitting a dim needs tiles that hold whole rows of the
    new inner dims.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.zeros((6, 4, 5)), tiles=(4, None, None))
    >>> tg.reshape(x, (-1, 5)).chunks
    ((16, 8), (5,))
    """
    return checked_reshape(x, shape, "tilegraph.reshape")


def checked_reshape(x: TileTensor, shape, where: str) -> TileTensor:
    """:func:`reshape`, its errors labelled ``where`` (the public name the user called)."""
    require_tensor(x, where, "x")
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise TileError(where, f"at most one -1 in the new shape (of a tensor of shape {x.shape})", repr(shape))
    if any(s < -1 for s in shape):
        raise TileError(where, f"sizes must be non-negative or -1 (reshaping a tensor of shape {x.shape})",
                        repr(shape))
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        if known == 0 or x.size % known:
            raise TileError(where, f"cannot infer -1 for a tensor of shape {x.shape} ({x.size} elements)",
                            repr(shape))
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    if numel(shape) != x.size:
        raise TileError(where, f"new shape must hold {x.size} elements (the shape is {x.shape})", repr(shape))
    if shape == x.shape:
        return x
    return _reshape_op(x, shape=shape, where=where)
