"""Matrix products over tiles: each output tile is one kernel call summing over the K tiles."""

from __future__ import annotations

import itertools

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from . import _blas as blas
from ._common import new_tensor, numel, require_float, require_same_chunks, require_same_dtype, require_tensor

__all__ = ["matmul", "linear"]


def _mm_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    nk = params["nk"]
    n_out = out_shapes[0][-1]
    flops = 2.0 * sum(numel(s) for s in in_shapes[:nk]) * n_out
    nbytes = (sum(numel(s) for s in in_shapes) + numel(out_shapes[0])) * itemsize
    return Cost(flops, float(nbytes))


@kernel("matmul", cost=_mm_cost)
def _matmul(*tiles, nk, trans_b, bias):
    acc = None
    for a, b in zip(tiles[:nk], tiles[nk:2 * nk]):
        if trans_b:
            b = b.swapaxes(-1, -2)
        if b.ndim == 2:  # one GEMM over all leading rows, not one per batch; later K tiles add into it
            rows = a.reshape(-1, a.shape[-1])
            flat = blas.matmul(rows, b, None if acc is None else acc.reshape(rows.shape[0], b.shape[1]))
            if acc is None:
                acc = flat.reshape(a.shape[:-1] + (b.shape[-1],))
        elif acc is None:
            acc = a @ b
        else:
            acc += a @ b
    if bias:
        acc += tiles[-1]
    return acc


def _tn_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n = params["n"]
    flops = 2.0 * sum(numel(s) for s in in_shapes[:n]) * out_shapes[0][-1]
    nbytes = (sum(numel(s) for s in in_shapes) + numel(out_shapes[0])) * itemsize
    return Cost(flops, float(nbytes))


@kernel("matmul_tn", cost=_tn_cost)
def _matmul_tn(*tiles, n, batched):
    acc = None
    for a, g in zip(tiles[:n], tiles[n:]):
        if not batched:  # later row tiles add into the first one's product
            acc = blas.matmul(a.reshape(-1, a.shape[-1]).T, g.reshape(-1, g.shape[-1]), acc)
        elif acc is None:
            acc = a.swapaxes(-1, -2) @ g
        else:
            acc += a.swapaxes(-1, -2) @ g
    return acc


class Matmul(Op):
    """``a @ b`` (``b`` transposed in its last two dims when ``trans_b``), optional bias epilogue.

    ``a``: (..., M, K); ``b``: (K, N), or (..., K, N) with the same leading dims as ``a``.
    """

    name = "matmul"

    def forward(self, a, b, bias=None, trans_b=False):
        where = "tilegraph.matmul"
        require_tensor(a, where, "a")
        require_tensor(b, where, "b")
        if bias is not None:
            require_tensor(bias, where, "bias")
        require_same_dtype(where, a=a, b=b, bias=bias)
        require_float(a, where, "a")
        if a.ndim < 2 or b.ndim < 2:
            raise TileError(where, "both operands need at least 2 dims", f"shapes {a.shape} and {b.shape}")
        kb, nb = (b.ndim - 1, b.ndim - 2) if trans_b else (b.ndim - 2, b.ndim - 1)
        if a.shape[-1] != b.shape[kb]:
            raise TileError(where, "contraction dims differ", f"a {a.shape} @ b {b.shape}"
                            + (" (b transposed)" if trans_b else ""))
        require_same_chunks(where, f"contraction dim (a dim {a.ndim - 1}, b dim {kb})", a.chunks[-1], b.chunks[kb],
                            f" (cut a's last dim as b's: a.rechunk(a.chunks[:-1] + (b.chunks[{kb}],)), or build a so)")
        batched = b.ndim > 2
        if batched:
            if b.ndim != a.ndim or a.shape[:-2] != b.shape[:-2]:
                raise TileError(where, "a batched b needs the same leading dims as a",
                                f"a {a.shape}, b {b.shape}")
            require_same_chunks(where, "leading (batch) dims", a.chunks[:-2], b.chunks[:-2])
        if bias is not None:
            require_tensor(bias, where, "bias")
            if bias.shape != (b.shape[nb],):
                raise TileError(where, f"bias must have shape ({b.shape[nb]},)", str(bias.shape))
            require_same_chunks(where, "bias and the output's last dim", bias.chunks[0], b.chunks[nb])
        tiling = Tiling(a.chunks[:-1] + (b.chunks[nb],))
        nk = a.tiling.grid[-1]

        def fill(idx):
            lead, j = idx[:-1], idx[-1]
            bl = lead[:-1] if batched else ()
            ins = [a.grid[lead + (k,)] for k in range(nk)]
            ins += [b.grid[bl + ((j, k) if trans_b else (k, j))] for k in range(nk)]
            if bias is not None:
                ins.append(bias.grid[j])
            return emit1(_matmul, ins, tiling.tile_shape(idx), a.dtype, op="matmul", nk=nk,
                         trans_b=trans_b, bias=bias is not None)

        return new_tensor(tiling, a.dtype, fill), (a, b, bias, trans_b)

    def backward(self, ctx, g):
        a, b, bias, trans_b = ctx
        if trans_b:  # y = a @ b^T: da = g @ b, db = g^T @ a
            da = _matmul_op(g, b)
            db = _matmul_tn_op(g, a, batched=b.ndim > 2)
        else:
            da = _matmul_op(g, b, trans_b=True)
            db = _matmul_tn_op(a, g, batched=b.ndim > 2)
        dbias = None
        if bias is not None:
            from .reduce import sum_dims

            dbias = sum_dims(g, tuple(range(g.ndim - 1)), (False,) * (g.ndim - 1))
        return da, db, dbias


class MatmulTN(Op):
    """``a^T @ g`` contracting every leading dim of ``a`` and ``g`` (the weight gradient), or per
    batch when ``batched``."""

    name = "matmul_tn"

    def forward(self, a, g, batched=False):
        where = "tilegraph.matmul_tn"
        if a.shape[:-1] != g.shape[:-1]:
            raise TileError(where, "a and g must share all but the last dim", f"{a.shape} and {g.shape}")
        require_same_chunks(where, "rows of a and g", a.chunks[:-1], g.chunks[:-1])
        if batched:
            tiling = Tiling(a.chunks[:-2] + (a.chunks[-1], g.chunks[-1]))
        else:
            tiling = Tiling((a.chunks[-1], g.chunks[-1]))
        contract = a.tiling.grid[-2:-1] if batched else a.tiling.grid[:-1]

        split = _split_partials()

        def fill(idx):
            lead, kk, j = idx[:-2], idx[-2], idx[-1]
            pairs = []
            for m in itertools.product(*[range(n) for n in contract]):
                rows = lead + m if batched else m
                pairs.append((a.grid[rows + (kk,)], g.grid[rows + (j,)]))
            shape = tiling.tile_shape(idx)
            if split and len(pairs) > 1:
                # one product per row tile, where that tile was made, then a sum tree: the row
                # tiles' kernels run in parallel, and across processes only gradient-sized
                # partial sums travel, never the activations
                from .reduce import _tree

                parts = [emit1(_matmul_tn, [p, q], shape, a.dtype, op="matmul_tn", n=1, batched=batched)
                         for p, q in pairs]
                return _tree(parts, shape, a.dtype, (), 1.0, "matmul_tn")
            ins = [p[0] for p in pairs] + [p[1] for p in pairs]
            return emit1(_matmul_tn, ins, shape, a.dtype, op="matmul_tn", n=len(pairs), batched=batched)

        return new_tensor(tiling, a.dtype, fill), None


def _split_partials() -> bool:
    from tilegraph._lower import config

    return config.split_weight_grads


_matmul_op = Matmul()
_matmul_tn_op = MatmulTN()


def matmul(a: TileTensor, b: TileTensor, bias: TileTensor | None = None, *, trans_b: bool = False) -> TileTensor:
    """``a @ b (+ bias)``: a (..., M, K), b (K, N) or (..., K, N); K tiles must match.

    ``trans_b=True`` computes ``a @ b^T`` for b (N, K) or (..., N, K) without copying b into its
    transpose (e.g. a tied output projection over an embedding table).

    >>> import numpy as np, tilegraph as tg
    >>> a = tg.from_numpy(np.ones((3, 4)), tiles=(2, 2)); b = tg.from_numpy(np.ones((4, 5)), tiles=(2, 5))
    >>> tg.matmul(a, b).numpy()[0]
    array([4., 4., 4., 4., 4.])

    A 1-D operand is a row (``a``) or a column (``b``) whose dim the result drops, as in torch:
    ``matrix @ vector`` is a vector, ``vector @ vector`` a scalar; a 1-D ``a`` takes a ``bias`` and
    ``trans_b`` too (torch's ``nn.Linear`` on one sample of shape ``(in_features,)``).
    """
    if isinstance(a, TileTensor) and isinstance(b, TileTensor) and 0 in (a.ndim, b.ndim):
        raise TileError("tilegraph.matmul", "both operands need at least 1 dim, as in torch (a 0-d tensor "
                        "multiplies with *)", f"shapes {a.shape} and {b.shape}")
    if isinstance(a, TileTensor) and isinstance(b, TileTensor) and a.ndim == 1 and b.ndim == 2 and \
            (bias is not None or trans_b):
        from .shape import checked_reshape

        where = "tilegraph.matmul"
        out = _matmul_op(checked_reshape(a, (1,) + a.shape, where), b, bias, trans_b=trans_b)
        return checked_reshape(out, out.shape[1:], where)
    if bias is None and not trans_b and isinstance(a, TileTensor) and isinstance(b, TileTensor) and \
            1 in (a.ndim, b.ndim) and min(a.ndim, b.ndim) >= 1:
        from .shape import checked_reshape

        where = "tilegraph.matmul"
        a2 = checked_reshape(a, (1,) + a.shape, where) if a.ndim == 1 else a
        b2 = checked_reshape(b, b.shape + (1,), where) if b.ndim == 1 else b
        out = _matmul_op(a2, b2)
        shape = out.shape[:-2] + ((out.shape[-2],) if a.ndim > 1 else ()) + ((out.shape[-1],) if b.ndim > 1 else ())
        return checked_reshape(out, shape, where)
    return _matmul_op(a, b, bias, trans_b=trans_b)


def linear(x: TileTensor, weight: TileTensor, bias: TileTensor | None = None) -> TileTensor:
    """``x @ weight + bias`` with ``weight`` stored (in, out), as tilegraph stores every weight
    (features last; GPT-2's Conv1D layout). torch's ``F.linear`` takes (out, in) and computes
    ``x @ weight.T``: pass a torch weight transposed.

    >>> import numpy as np, tilegraph as tg
    >>> tg.linear(tg.from_numpy(np.ones((2, 3))), tg.from_numpy(np.ones((3, 4)))).shape
    (2, 4)
    """
    where = "tilegraph.linear"
    require_tensor(x, where, "x")
    require_tensor(weight, where, "weight")
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[0]:
        hint = (" (torch's (out, in) layout? tilegraph stores weights (in, out): pass it transposed)"
                if weight.ndim == 2 and x.ndim >= 1 and x.shape[-1] == weight.shape[1] else "")
        raise TileError(where, f"weight of shape (in, out) with in = x's last dim{hint}",
                        f"x {x.shape}, weight {weight.shape}")
    return matmul(x, weight, bias)  # (a 1-D x: one sample, as torch's F.linear takes it)

