"""Layout ops: transpose / permute (any permutation, any tiling) and tile-compatible reshape.

``tg.cat`` / ``tg.stack`` join tensors along a dim by reusing their tiles (``cat`` runs no kernel;
``stack`` one reshape per tile). ``x.expand(...)`` / ``x.expand_as(y)`` broadcast size-1 dims and
add leading ones, as torch's (each result tile a broadcast copy of one input tile). All mirror
torch: ``tg.permute(x, (2, 0, 1))`` / ``x.permute(2, 0, 1)``,
``tg.transpose(x, 0, 1)``, ``tg.reshape(x, (4, -1))`` / ``x.reshape(4, -1)`` / ``x.view(4, -1)``. A
permutation carries each dim's tiles along, so it works on every tiling. A reshape never moves data
between tiles: it works where each tile of the input becomes whole tiles of the output, and raises a TileError
that names the shape, the tiling and what was asked (and what tiling would allow it) elsewhere.
"""

from __future__ import annotations

import itertools

import numpy as np

from tilegraph._autograd import Op
from tilegraph._config import is_int
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling, from_numpy, is_array

from ._common import new_tensor, norm_dim, numel, require_tensor, xp_of

__all__ = ["permute", "reshape", "transpose", "cat", "stack", "checked_permute", "checked_reshape", "unsqueeze",
           "squeeze", "flatten", "expand", "expand_as", "checked_expand", "rechunk", "fit_last_dim"]


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
        if x.ndim == 0:  # dims 0 and -1 of a 0-d tensor: itself, as in torch
            return x
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
    try:
        dims = tuple(dims)
    except TypeError:  # None, a float: tuple() would say only "not iterable"
        raise TileError(where, f"expected a permutation of the {x.ndim} dims of a tensor of shape {x.shape}",
                        f"dims {dims!r:.60}") from None
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
            fix = tuple(None if d in tiled_inner else x.chunks[d] for d in range(x.ndim))
            why = (f"{old} become {new}, and only the first dim of such a group may be split into tiles "
                   f"(x.rechunk({fix}) first makes it so, moving the data): dims {tiled_inner} must be one tile each")
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
    try:
        sizes = tuple(shape)
    except TypeError:  # None, a float
        sizes = None
    if sizes is None or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in sizes):
        # int() would take "4" or 2.5 (as 2) and raise a bare TypeError for None or a nested tuple
        raise TileError(where, f"the new shape must be a tuple of ints (reshaping a tensor of shape {x.shape})",
                        f"{shape!r:.60}")
    shape = tuple(int(s) for s in sizes)
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


# ------------------------------------------------------------- unsqueeze / squeeze / flatten ----
# torch's view-like reshapes, as TileTensor methods: each is a :func:`checked_reshape` (size-1 dims
# come and go without moving data; flatten merges dims where the tiles allow it).
def unsqueeze(x: TileTensor, dim: int, where: str = "tilegraph.unsqueeze") -> TileTensor:
    """``x`` with a new dim of size 1 at ``dim`` (``-x.ndim - 1 <= dim <= x.ndim``, torch's)."""
    require_tensor(x, where, "x")
    d = norm_dim(dim, x.ndim + 1, where)
    return checked_reshape(x, x.shape[:d] + (1,) + x.shape[d:], where)


def squeeze(x: TileTensor, dim=None, where: str = "tilegraph.squeeze") -> TileTensor:
    """``x`` without its dims of size 1 (``dim``: an int or a tuple, only those; a named dim whose
    size is not 1 stays, as in torch)."""
    require_tensor(x, where, "x")
    if dim is None:
        dims = {d for d, n in enumerate(x.shape) if n == 1}
    else:
        given = tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)
        dims = {d for d in (norm_dim(g, x.ndim, where) for g in given) if x.ndim and x.shape[d] == 1}
    return checked_reshape(x, tuple(n for d, n in enumerate(x.shape) if d not in dims), where)


def flatten(x: TileTensor, start_dim: int = 0, end_dim: int = -1, where: str = "tilegraph.flatten") -> TileTensor:
    """Dims ``start_dim`` to ``end_dim`` (both included) merged into one (torch's ``flatten``); the
    tiles must allow it, as for :func:`reshape` (only the first of the merged dims may be tiled)."""
    require_tensor(x, where, "x")
    if x.ndim == 0:
        return checked_reshape(x, (1,), where)
    s, e = norm_dim(start_dim, x.ndim, where), norm_dim(end_dim, x.ndim, where)
    if s > e:
        raise TileError(where, "start_dim must not come after end_dim", f"start_dim={start_dim}, end_dim={end_dim} "
                        f"for a {x.ndim}-d tensor")
    return checked_reshape(x, x.shape[:s] + (numel(x.shape[s:e + 1]),) + x.shape[e + 1:], where)


# ---------------------------------------------------------------------------- cat / stack ----
class Cat(Op):
    """``cat(tensors, dim)``: the output's tiles along ``dim`` are the inputs' tiles, in order (no
    kernel runs); the gradient of each input is its run of the cotangent's tiles."""

    name = "cat"

    def forward(self, *tensors, dim):
        grid = np.concatenate([t.grid for t in tensors], axis=dim)
        chunks = list(tensors[0].chunks)
        chunks[dim] = tuple(c for t in tensors for c in t.chunks[dim])
        return TileTensor(Tiling(chunks), tensors[0].dtype, grid), (dim, [t.tiling.grid[dim] for t in tensors],
                                                                     [t.tiling for t in tensors])

    def backward(self, ctx, g):
        dim, counts, tilings = ctx
        if g.chunks != Tiling([c if d != dim else tuple(x for t in tilings for x in t.chunks[dim])
                               for d, c in enumerate(tilings[0].chunks)]).chunks:  # pragma: no cover
            raise AssertionError(f"cat's cotangent has tiles {g.chunks}")
        out, start = [], 0
        for n, tiling in zip(counts, tilings):
            index = [slice(None)] * g.ndim
            index[dim] = slice(start, start + n)
            out.append(TileTensor(tiling, g.dtype, g.grid[tuple(index)]))
            start += n
        return out


_cat_op = Cat()


def _tensor_list(tensors, where: str) -> list:
    if isinstance(tensors, TileTensor) or not isinstance(tensors, (tuple, list)) or not tensors:
        raise TileError(where, "tensors must be a non-empty list or tuple of TileTensors (torch's first argument)",
                        f"{type(tensors).__name__} {tensors!r:.60}")
    for i, t in enumerate(tensors):
        require_tensor(t, where, f"tensors[{i}]")
    dtypes = {str(t.dtype) for t in tensors}
    if len(dtypes) > 1:
        raise TileError(where, "tensors must share one dtype (cast them first, e.g. x.to(np.float32))",
                        ", ".join(str(t.dtype) for t in tensors))
    return list(tensors)


def cat(tensors, dim: int = 0) -> TileTensor:
    """torch's ``cat``: ``tensors`` joined along ``dim``, whose tiles are the inputs' tiles (no data
    moves, no kernel runs). The tensors must have the same shape, and the same tiles, in every other
    dim (a TileError names the first that differs).

    >>> import numpy as np, tilegraph as tg
    >>> a, b = tg.from_numpy(np.zeros((2, 3)), tiles=(1, 3)), tg.from_numpy(np.ones((3, 3)), tiles=(2, 3))
    >>> tg.cat([a, b]).chunks
    ((1, 1, 2, 1), (3,))
    """
    where = "tilegraph.cat"
    tensors = _tensor_list(tensors, where)
    first = tensors[0]
    d = norm_dim(dim, first.ndim, where)
    if first.ndim == 0:
        raise TileError(where, "zero-dimensional tensors cannot be concatenated (use tg.stack)", repr(first))
    for i, t in enumerate(tensors[1:], 1):
        if t.ndim != first.ndim:
            raise TileError(where, f"tensors must have the same number of dims (tensors[0] has {first.ndim})",
                            f"tensors[{i}] of shape {t.shape}")
        for e in range(first.ndim):
            if e == d:
                continue
            if t.shape[e] != first.shape[e]:
                raise TileError(where, f"tensors must have the same size in every dim but dim {d}",
                                f"shapes {first.shape} (tensors[0]) and {t.shape} (tensors[{i}]) differ in dim {e}")
            if t.chunks[e] != first.chunks[e]:
                def cut(x, y):  # x rechunked to y's tiles in every dim but d
                    return tuple(y.chunks[k] if k != d else x.chunks[k] for k in range(x.ndim))

                raise TileError(where, f"tensors must have the same tiles in every dim but dim {d} (tiles are "
                                "reused, never cut again: build them with the same tiles there, or cut one as the "
                                f"other, which moves data: tensors[0].rechunk({cut(first, t)}) or "
                                f"tensors[{i}].rechunk({cut(t, first)}))",
                                f"tiles {first.chunks[e]} (tensors[0]) and {t.chunks[e]} (tensors[{i}]) in dim {e}")
    if len(tensors) == 1:
        return first
    return _cat_op(*tensors, dim=d)


def stack(tensors, dim: int = 0) -> TileTensor:
    """torch's ``stack``: ``tensors`` (of one shape and tiling) along a new dim ``dim``, one tile of
    size 1 each (:func:`cat` of their ``unsqueeze(dim)``).

    >>> import numpy as np, tilegraph as tg
    >>> a = tg.from_numpy(np.zeros((4, 3)), tiles=(2, 3))
    >>> tg.stack([a, a, a], dim=1).chunks
    ((2, 2), (1, 1, 1), (3,))
    """
    where = "tilegraph.stack"
    tensors = _tensor_list(tensors, where)
    first = tensors[0]
    for i, t in enumerate(tensors[1:], 1):
        if t.shape != first.shape:
            raise TileError(where, f"tensors must all have one shape ({first.shape}, as tensors[0])",
                            f"tensors[{i}] of shape {t.shape}")
    d = norm_dim(dim, first.ndim + 1, where)
    return cat([unsqueeze(t, d, where) for t in tensors], d)


# ------------------------------------------------------------------------------- rechunk ----
@kernel("rechunk", cost=_copy_cost)
def _rechunk(*tiles, grid, index):
    """One tile made of parts of ``tiles`` (C order over ``grid``, the count of input tiles per
    dim); ``index[d][k]`` is the (start, stop) in its tile of the k-th input tile along dim d."""
    shape = tuple(sum(b - a for a, b in pieces) for pieces in index)
    out = xp_of(tiles[0]).empty(shape, dtype=tiles[0].dtype)
    starts = [np.cumsum([0] + [b - a for a, b in pieces]) for pieces in index]
    for t, pos in zip(tiles, np.ndindex(*grid)):
        src = tuple(slice(*index[d][k]) for d, k in enumerate(pos))
        dst = tuple(slice(int(starts[d][k]), int(starts[d][k + 1])) for d, k in enumerate(pos))
        out[dst] = t[src]
    return out


class Rechunk(Op):
    """``x`` with the tiles ``chunks``: each result tile is one kernel over the input tiles it
    overlaps (an input tile it equals is reused, no kernel); the gradient is rechunked back."""

    name = "rechunk"

    def forward(self, x, chunks):
        tiling = Tiling(chunks)
        # per dim, per result tile: the (input tile, start, stop) parts it is made of
        per_dim = []
        for d in range(x.ndim):
            offsets = x.tiling.offsets(d)
            parts = []
            for o, n in zip(tiling.offsets(d), tiling.chunks[d]):
                parts.append([(k, max(o, s) - s, min(o + n, s + c) - s)
                              for k, (s, c) in enumerate(zip(offsets, x.chunks[d])) if s < o + n and o < s + c]
                             or [(0, 0, 0)])  # a dim of size 0 overlaps nothing: an empty slice of its one tile
            per_dim.append(parts)

        def fill(idx):
            parts = [per_dim[d][i] for d, i in enumerate(idx)]
            shape = tiling.tile_shape(idx)
            if all(len(p) == 1 for p in parts):
                ref = x.grid[tuple(p[0][0] for p in parts)]
                if ref.shape == shape:
                    return ref  # an input tile as it is
            ins = [x.grid[src] for src in itertools.product(*[[k for k, _, _ in p] for p in parts])]
            return emit1(_rechunk, ins, shape, x.dtype, op="rechunk", grid=tuple(len(p) for p in parts),
                         index=tuple(tuple((a, b) for _, a, b in p) for p in parts))

        return new_tensor(tiling, x.dtype, fill), x.chunks

    def backward(self, chunks, g):
        return (_rechunk_op(g, chunks=chunks),)


_rechunk_op = Rechunk()


def rechunk(x: TileTensor, tiles, where: str = "tilegraph.rechunk") -> TileTensor:
    """``x`` cut into other tiles (``tiles`` as :func:`tilegraph.from_numpy` takes them: one size
    per dim, None for a whole dim, or each dim's sizes), as dask's ``rechunk``. Unlike a reshape
    this moves data between tiles: each result tile that is not one of ``x``'s is a copy kernel over
    the tiles it overlaps. ``x`` itself where the tiles are already those. Also ``x.rechunk(tiles)``.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(10.0).reshape(2, 5))
    >>> y = tg.rechunk(x, (None, 2))
    >>> y.chunks, float(y.numpy()[1, 3])
    (((2,), (2, 2, 1)), 8.0)
    """
    require_tensor(x, where, "x")
    tiling = Tiling.from_sizes(x.shape, tiles, where=where)
    if tiling.chunks == x.chunks:
        return x
    return _rechunk_op(x, chunks=tiling.chunks)


def fit_last_dim(x, weight: TileTensor, where: str, what: str) -> TileTensor:
    """An input of a layer whose ``weight`` tiles its first dim as the input's last: a NumPy array
    (or a torch tensor) becomes a TileTensor tiled so (one tile in every other dim), a TileTensor of
    that size tiled otherwise (a batch given without ``batch_tiles``, a concatenation) is rechunked
    to it, as a torch user expects the layer to take any input of its width. An input of another
    width or dtype is a TileError naming the layer (its place in the model); anything else goes on
    as it is, for the op's own checks to name."""
    from tilegraph._graph import current_scope

    chunks = tuple(weight.chunks[0])
    scope = current_scope()  # the layer's attribute path in the model (a model of one layer: its type)
    here = f"{where} ({scope})" if scope and scope != where.rpartition(".")[2].lower() else where
    if not isinstance(x, TileTensor) and not is_array(x):
        return x
    if np.ndim(x) < 1 or np.shape(x)[-1] != sum(chunks):
        raise TileError(here, f"the input's last dim must be the layer's {what} ({sum(chunks)})",
                        f"{type(x).__name__} of shape {tuple(np.shape(x))}")
    if not isinstance(x, TileTensor):
        x = from_numpy(x, (None,) * (np.ndim(x) - 1) + (chunks,))
    if x.dtype != weight.dtype:
        raise TileError(here, f"the input's dtype must be the layer's, {weight.dtype} (cast the data, as torch "
                        f"needs too: a NumPy batch with a.astype(np.{weight.dtype}), a TileTensor with "
                        f"x.to('{weight.dtype}'))", f"input of dtype {x.dtype}, shape {x.shape}")
    if x.chunks[-1] != chunks:
        return rechunk(x, tuple(x.chunks[:-1]) + (chunks,), where)
    return x


# ------------------------------------------------------------------------ expand / expand_as ----
def expand(x: TileTensor, *sizes, tiles=None) -> TileTensor:
    """torch's ``expand``: ``x`` broadcast to ``sizes`` (ints, or one tuple of them). ``-1`` keeps a
    dim; new dims may come first (not as -1); only dims of size 1 may grow (to any size, 0 too).
    The gradient sums over the dims that were broadcast.

    The dims ``x`` keeps keep its tiles. A dim that grows (or is new) is one tile, or tiled by
    ``tiles`` (one entry per result dim, as ``tg.from_numpy``'s; None for a dim ``x`` keeps):
    a tensor it is added to must have the same tiles there. :func:`expand_as` takes them from
    the other tensor.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(3.0).reshape(3, 1), tiles=(2, 1))
    >>> y = tg.expand(x, 2, -1, 4, tiles=(None, None, 3))
    >>> y.shape, y.chunks
    ((2, 3, 4), ((2,), (2, 1), (3, 1)))
    >>> y.numpy()[1, 2]
    array([2., 2., 2., 2.])
    """
    return checked_expand(x, sizes, "tilegraph.expand", tiles=tiles)


def expand_as(x: TileTensor, other: TileTensor, where: str = "tilegraph.expand_as") -> TileTensor:
    """torch's ``expand_as``: :func:`expand` to ``other``'s shape; the dims that grow (or are
    new) take ``other``'s tiles, so the result combines with ``other`` element by element."""
    require_tensor(x, where, "x")
    require_tensor(other, where, "other")
    lead = other.ndim - x.ndim
    grown = [d for d in range(other.ndim) if d < lead or x.shape[d - lead] != other.shape[d]]
    tiles = [other.chunks[d] if d in grown else None for d in range(other.ndim)]
    return checked_expand(x, other.shape, where, tiles=tiles if lead >= 0 else None)


def checked_expand(x: TileTensor, sizes, where: str, tiles=None) -> TileTensor:
    """:func:`expand`, its errors labelled ``where`` (the public name the user called)."""
    from .reduce import broadcast_dims

    require_tensor(x, where, "x")
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    sizes = tuple(sizes)
    if any(not is_int(s) for s in sizes):
        raise TileError(where, "expected sizes (ints, -1 to keep a dim), or one tuple of them",
                        f"{sizes!r:.80}")
    sizes = tuple(int(s) for s in sizes)
    from tilegraph._tensor import check_numel

    check_numel(tuple(max(s, 1) for s in sizes), where)
    lead = len(sizes) - x.ndim
    if lead < 0:
        raise TileError(where, f"expected at least {x.ndim} sizes, one per dim of the tensor of shape {x.shape} "
                        "(new leading dims may come before them)", f"{len(sizes)} sizes {sizes}")
    shape, dims, keep = [], [], []
    for r, s in enumerate(sizes):
        d = r - lead
        if d < 0:  # a new leading dim: not in x (gradient: summed away)
            if s < 0:
                raise TileError(where, f"the size of new leading dim {r} must be >= 0 (-1 keeps a dim of x, and "
                                "this dim is not one)", f"sizes {sizes} for a tensor of shape {x.shape}")
            shape.append(s)
            dims.append(r)
            keep.append(False)
            continue
        n = x.shape[d]
        if s == -1 or s == n:
            shape.append(n)
            continue
        if s < -1 or n != 1:
            raise TileError(where, f"dim {d} of the tensor of shape {x.shape} (size {n}) cannot expand to {s}: "
                            "only dims of size 1 may grow (-1 keeps a dim)", f"sizes {sizes}")
        shape.append(s)  # a size-1 dim of x that grows (gradient: summed, kept with size 1)
        dims.append(r)
        keep.append(True)
    kept = {r: x.chunks[r - lead] for r in range(len(shape)) if r not in dims}
    if tiles is None:
        spec = [kept.get(r) for r in range(len(shape))]
    else:
        if isinstance(tiles, Tiling):
            tiles = tiles.chunks
        spec = list(tiles) if isinstance(tiles, (tuple, list)) else [tiles] * len(shape)
        if len(spec) != len(shape):
            raise TileError(where, f"tiles needs one entry per dim of the result (shape {tuple(shape)})",
                            f"tiles={tiles!r}")
        spec = [kept[r] if r in kept and spec[r] is None else spec[r] for r in range(len(shape))]
    tiling = Tiling.from_sizes(shape, spec, where)
    for r, chunks in kept.items():
        if tiling.chunks[r] != chunks:
            raise TileError(where, f"dim {r} keeps the size of dim {r - lead} of x, and with it x's tiles {chunks} "
                            "(expand moves no data between tiles; give None for that dim)",
                            f"tiles {tiling.chunks[r]} for dim {r}")
    if not dims:
        return x
    return broadcast_dims(x, tiling, tuple(dims), tuple(keep))
