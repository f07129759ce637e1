"""Layout ops: transpose (any permutation) and tile-compatible reshape."""

from __future__ import annotations

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import new_tensor, norm_dim, numel, require_tensor, xp_of

__all__ = ["transpose", "reshape"]


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
        perm = tuple(reversed(range(x.ndim)))
    elif len(dims) == 2:  # torch semantics: swap two dims
        d0, d1 = (norm_dim(d, x.ndim, where) for d in dims)
        perm = list(range(x.ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
        perm = tuple(perm)
    else:
        perm = tuple(norm_dim(d, x.ndim, where) for d in dims)
        if sorted(perm) != list(range(x.ndim)):
            raise TileError(where, f"expected two dims or a permutation of {x.ndim} dims", repr(dims))
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


class Reshape(Op):
    name = "reshape"

    def forward(self, x, shape):
        where = "tilegraph.reshape"
        new_chunks: list = [(1,)] * len(shape)
        # For each new dim, which old dim's tile index it follows (None: single tile).
        follow: list = [None] * len(shape)
        for go, gn in _groups(x.shape, shape):
            rest_old_single = all(len(x.chunks[d]) == 1 for d in go[1:])
            if len(gn) == 1 and rest_old_single:  # identity or merge: tiles of the first old dim grow
                inner = numel([x.shape[d] for d in go[1:]])
                new_chunks[gn[0]] = tuple(c * inner for c in x.chunks[go[0]])
                follow[gn[0]] = go[0]
            elif len(go) == 1 and all(c % numel([shape[d] for d in gn[1:]]) == 0 for c in x.chunks[go[0]]):
                inner = numel([shape[d] for d in gn[1:]])  # split: tiles of the old dim are whole rows
                new_chunks[gn[0]] = tuple(c // inner for c in x.chunks[go[0]])
                follow[gn[0]] = go[0]
                for d in gn[1:]:
                    new_chunks[d] = (shape[d],)
            elif all(len(x.chunks[d]) == 1 for d in go):
                for d in gn:
                    new_chunks[d] = (shape[d],)
            else:
                raise TileError(where, f"reshape is not tile-compatible: dims {go} of {x.shape} "
                                f"(tiles {[x.chunks[d] for d in go]}) cannot become dims {gn} of {shape}; "
                                "only the first dim of a merged group may be tiled, and a split dim's "
                                "tiles must hold whole rows of the inner dims", f"shape {shape}")
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

    One ``-1`` may stand for the remaining size.
    """
    where = "tilegraph.reshape"
    require_tensor(x, where, "x")
    shape = tuple(int(s) for s in shape)
    if shape.count(-1) > 1:
        raise TileError(where, "at most one -1 in the new shape", repr(shape))
    if -1 in shape:
        known = numel([s for s in shape if s != -1])
        if known == 0 or x.size % known:
            raise TileError(where, f"cannot infer -1 for {x.size} elements", repr(shape))
        shape = tuple(x.size // known if s == -1 else s for s in shape)
    if numel(shape) != x.size:
        raise TileError(where, f"new shape must hold {x.size} elements ({x.shape})", repr(shape))
    if shape == x.shape:
        return x
    return _reshape_op(x, shape=shape)
