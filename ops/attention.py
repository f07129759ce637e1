"""Scaled dot-product attention over tiles, flash-attention style.

q is (B, H, T, D), k and v are (B, Hkv, S, D) with Hkv dividing H (grouped-query attention: query
head h reads kv head h // (H // Hkv)). B, H, T and S may be tiled; D is one tile.

Forward: one kernel per q tile (b, h, i). It reads the k/v tiles that query tile i can see (for a
causal mask only key tiles starting at or before its last query position) and folds them in one
after another with an online softmax (running row max ``m`` and row sum ``l``), so at most a
(tile_T x tile_S) score block per head exists at a time. Besides the output it returns the row
log-sum-exp ``lse = m + log(l)``, the only thing backward keeps besides q, k, v and the output.

Backward (flash-attention 2): ``delta_i = rowsum(dO_i * O_i)``; one kernel per kv tile (b, g, j)
recomputes ``P = exp(q k^T * scale - lse)`` for every query tile and query head that reads it and
accumulates dK_j and dV_j; one kernel per q tile (b, h, i) does the same for dQ_i.
"""

from __future__ import annotations

import math

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import (elementwise_cost, numel, require_float, require_same_chunks, require_same_dtype,
                      require_tensor, xp_of)

__all__ = ["scaled_dot_product_attention"]

WHERE = "tilegraph.scaled_dot_product_attention"


# ---------------------------------------------------------------------------- kernel helpers ----
def _cat_heads(tiles):
    """Head tiles (b, h_p, n, D) side by side along dim 1."""
    if len(tiles) == 1:
        return tiles[0]
    return xp_of(tiles[0]).concatenate(tiles, axis=1)


def _pick_heads(x, heads: tuple):
    """``x[:, heads]``; a plain slice when ``heads`` is a contiguous run (no GQA repetition)."""
    lo = heads[0]
    if heads == tuple(range(lo, lo + len(heads))):
        return x[:, lo:lo + len(heads)]
    xp = xp_of(x)
    return xp.take(x, xp.asarray(heads), axis=1)


#: Rows of a tile handled together: query rows in the forward and dQ kernels, key rows in dK/dV.
#: A causal block multiplies only by the keys its last query can see (or the queries its first key
#: is seen by), so the work above the diagonal shrinks to one triangle per block instead of half
#: the tile, and a (b, h, block, keys) score block stays cache-sized.
_BLOCK = 64


def _blocks(n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``_BLOCK`` rows covering ``range(n)``."""
    return [(a, min(a + _BLOCK, n)) for a in range(0, n, _BLOCK)]


def _mask_future_keys(s, d: int) -> None:
    """Set ``s[..., r, c] = -inf`` in place where key column c lies after query row r.

    ``s`` is (b, h, rows, cols) with rows = queries and cols = keys, and ``d`` is the absolute
    position of row 0 minus that of column 0: column c lies after row r when ``c - r > d``. Only
    columns from ``d + 1`` on can be masked, so the bias covers just that (rows x few) corner.
    """
    c0 = max(d + 1, 0)
    if c0 >= s.shape[-1]:
        return
    xp = xp_of(s)
    corner = s[..., c0:]
    r = xp.arange(corner.shape[-2])[:, None]
    c = xp.arange(corner.shape[-1])[None, :] + c0
    corner += xp.where(c - r > d, s.dtype.type(-np.inf), s.dtype.type(0))


def _mask_past_queries(st, e: int) -> None:
    """The transposed case: ``st`` is (b, h, rows, cols) with rows = keys and cols = queries, and
    ``e`` the absolute position of key row 0 minus that of query column 0; sets ``-inf`` where
    key row r lies after query column c (``c - r < e``), touching only the first columns."""
    n = min(e + st.shape[-2] - 1, st.shape[-1])
    if n <= 0:
        return
    xp = xp_of(st)
    corner = st[..., :n]
    r = xp.arange(corner.shape[-2])[:, None]
    c = xp.arange(n)[None, :]
    corner += xp.where(c - r < e, st.dtype.type(-np.inf), st.dtype.type(0))


def _split_kv(tiles, n_k: int, n_h: int):
    """The flat input list ``k tiles (key-tile major, head-tile minor), then v tiles`` per key tile."""
    ks = [tiles[j * n_h:(j + 1) * n_h] for j in range(n_k)]
    vs = [tiles[(n_k + j) * n_h:(n_k + j + 1) * n_h] for j in range(n_k)]
    return ks, vs


def _kv_blocks(kv, n_k: int, n_h: int, heads: tuple, k_offs: tuple):
    """``(k, v, k_off)`` per key tile, k and v as (b, h, sk, D) for the query heads ``heads``."""
    ks, vs = _split_kv(kv, n_k, n_h)
    return [(_pick_heads(_cat_heads(k), heads), _pick_heads(_cat_heads(v), heads), o)
            for k, v, o in zip(ks, vs, k_offs)]


def _visible(causal: bool, last_q: int, k_off: int, sk: int) -> int:
    """How many leading keys of a key tile at ``k_off`` query position ``last_q`` can see."""
    return min(sk, last_q + 1 - k_off) if causal else sk


def _attn_cost(mult: float, first_k: int):
    """``mult * b*h*tq*sk*D`` flops over all score blocks (the forward does 2 GEMMs: mult 4)."""

    def cost(in_shapes, out_shapes, itemsize, params) -> Cost:
        b, h, tq, d = in_shapes[0]
        n_h = params["n_h"]
        sk = sum(s[2] for s in in_shapes[first_k:first_k + params["n_k"] * n_h:n_h])
        nbytes = (sum(numel(s) for s in in_shapes) + sum(numel(s) for s in out_shapes)) * itemsize
        return Cost(mult * b * h * tq * sk * d, float(nbytes))

    return cost


# ---------------------------------------------------------------------------------- kernels ----
@kernel("sdpa_fwd", cost=_attn_cost(4.0, 1))
def _sdpa_fwd(q, *kv, n_k, n_h, heads, q_off, k_offs, causal, scale):
    """Output and row log-sum-exp of one q tile over ``n_k`` key tiles, by online softmax."""
    xp = xp_of(q)
    kvs = _kv_blocks(kv, n_k, n_h, heads, k_offs)
    b, h, tq, _ = q.shape
    out = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty((b, h, tq), dtype=q.dtype)
    for a0, a1 in _blocks(tq):
        qb = q[:, :, a0:a1] * q.dtype.type(scale)            # (b, h, rows, D), scale folded in once
        m = l = acc = None      # running row max, row sum of exp(s - m), sum of exp(s - m) @ v
        for k, v, k_off in kvs:
            w = _visible(causal, q_off + a1 - 1, k_off, k.shape[2])
            if w <= 0:
                continue
            s = qb @ k[:, :, :w].swapaxes(-1, -2)            # (b, h, rows, w)
            if causal:
                _mask_future_keys(s, q_off + a0 - k_off)
            m_new = s.max(axis=-1) if m is None else xp.maximum(m, s.max(axis=-1))
            # A row with no visible key yet keeps m = -inf; shift it by 0 instead (exp(-inf) = 0).
            shift = xp.where(xp.isfinite(m_new), m_new, q.dtype.type(0))
            s -= shift[..., None]
            p = xp.exp(s, out=s)
            if m is None:       # the first key block needs no rescaling of earlier sums
                l = p.sum(axis=-1)
                acc = p @ v[:, :, :w]
            else:
                alpha = xp.exp(m - shift)
                l = l * alpha + p.sum(axis=-1)
                acc *= alpha[..., None]
                acc += p @ v[:, :, :w]
            m = m_new
        out[:, :, a0:a1] = acc / l[..., None]
        lse[:, :, a0:a1] = m + xp.log(l)
    return out, lse


@kernel("sdpa_bwd_delta", cost=elementwise_cost(2))
def _sdpa_delta(do, o):
    """``rowsum(dO * O)``, the softmax-gradient correction of each query row.   # (b, h, tq)"""
    return (do * o).sum(axis=-1)


@kernel("sdpa_bwd_dq", cost=_attn_cost(6.0, 4))
def _sdpa_dq(q, do, lse, delta, *kv, n_k, n_h, heads, q_off, k_offs, causal, scale):
    """dQ of one q tile: sum over key tiles of ``dS @ k * scale``, ``dS = P * (dO v^T - delta)``."""
    xp = xp_of(q)
    kvs = _kv_blocks(kv, n_k, n_h, heads, k_offs)
    sc = q.dtype.type(scale)
    dq = xp.zeros(q.shape, dtype=q.dtype)
    for a0, a1 in _blocks(q.shape[2]):
        qb = q[:, :, a0:a1] * sc                              # (b, h, rows, D)
        dob = do[:, :, a0:a1]
        lse_b = lse[:, :, a0:a1, None]
        delta_b = delta[:, :, a0:a1, None]
        dqb = dq[:, :, a0:a1]
        for k, v, k_off in kvs:
            w = _visible(causal, q_off + a1 - 1, k_off, k.shape[2])
            if w <= 0:
                continue
            k_w = k[:, :, :w]
            p = qb @ k_w.swapaxes(-1, -2)                     # (b, h, rows, w)
            if causal:
                _mask_future_keys(p, q_off + a0 - k_off)
            p -= lse_b
            xp.exp(p, out=p)
            ds = dob @ v[:, :, :w].swapaxes(-1, -2)
            ds -= delta_b
            ds *= p
            dqb += ds @ k_w
        dqb *= sc
    return dq


def _dkv_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    b, _, sk, d = in_shapes[0]
    n_i, n_p = params["n_i"], params["n_p"]
    tq = sum(s[2] for s in in_shapes[2:2 + n_i * n_p:n_p])
    h = params["h_hi"] - params["h_lo"]
    nbytes = (sum(numel(s) for s in in_shapes) + sum(numel(s) for s in out_shapes)) * itemsize
    return Cost(8.0 * b * h * tq * sk * d, float(nbytes))


@kernel("sdpa_bwd_dkv", cost=_dkv_cost)
def _sdpa_dkv(k, v, *qs, n_i, n_p, h_lo, h_hi, groups, q_offs, k_off, causal, scale):
    """dK and dV of one kv tile, summed over the query tiles that see it and over the ``groups``
    query heads sharing each kv head.

    ``qs`` holds q tiles (query-tile major, head-tile minor), then dO, lse and delta tiles in the
    same order; heads ``h_lo:h_hi`` of each concatenation are the query heads of this kv tile.
    Scores are formed transposed, (keys x queries), so every product is a plain ``a @ b`` or
    ``a @ b^T`` and dK, dV come out without transposing a score block.
    """
    xp = xp_of(k)
    per = n_i * n_p
    b, g, sk, d = k.shape
    sc = k.dtype.type(scale)
    k_rep = xp.repeat(k, groups, axis=1) if groups > 1 else k   # (b, h, sk, D)
    v_rep = xp.repeat(v, groups, axis=1) if groups > 1 else v
    tiles = []
    for i in range(n_i):
        parts = [qs[n * per + i * n_p:n * per + (i + 1) * n_p] for n in range(4)]
        tiles.append([_cat_heads(t)[:, h_lo:h_hi] for t in parts] + [q_offs[i]])
    dk = xp.zeros(k_rep.shape, dtype=k.dtype)
    dv = xp.zeros(v_rep.shape, dtype=v.dtype)
    for c0, c1 in _blocks(sk):
        kb = k_rep[:, :, c0:c1] * sc                          # (b, h, rows, D)
        vb = v_rep[:, :, c0:c1]
        dkb, dvb = dk[:, :, c0:c1], dv[:, :, c0:c1]
        for q, do, lse, delta, q_off in tiles:
            # causal: query rows before the block's first key see none of it
            r0 = max(0, k_off + c0 - q_off) if causal else 0
            if r0 >= q.shape[2]:
                continue
            q_r, do_r = q[:, :, r0:], do[:, :, r0:]
            pt = kb @ q_r.swapaxes(-1, -2)                    # (b, h, rows, queries) = P^T logits
            if causal:
                _mask_past_queries(pt, k_off + c0 - q_off - r0)
            pt -= lse[:, :, None, r0:]
            xp.exp(pt, out=pt)
            dvb += pt @ do_r
            dst = vb @ do_r.swapaxes(-1, -2)                  # (dO v^T)^T
            dst -= delta[:, :, None, r0:]
            dst *= pt
            dkb += dst @ q_r
    dk *= sc
    if groups > 1:
        dk = dk.reshape(b, g, groups, sk, d).sum(axis=2)
        dv = dv.reshape(b, g, groups, sk, d).sum(axis=2)
    return dk, dv


# ------------------------------------------------------------------------------ tile mapping ----
def _overlapping(chunks: tuple, lo: int, hi: int) -> tuple[list[int], int]:
    """Tiles of a dim with ``chunks`` that overlap ``[lo, hi)``, and the offset of the first one."""
    offs = np.cumsum((0,) + chunks[:-1])
    tiles = [p for p, (o, n) in enumerate(zip(offs, chunks)) if o < hi and o + n > lo]
    return tiles, int(offs[tiles[0]])


def _visible_keys(causal: bool, q_off: int, tq: int, k_offs: tuple) -> list[int]:
    """Key tiles query rows ``[q_off, q_off + tq)`` attend to (causal: those starting by the last row)."""
    return [j for j, o in enumerate(k_offs) if not causal or o <= q_off + tq - 1]


class _Layout:
    """Tile bookkeeping shared by forward and backward: offsets and the GQA head mapping."""

    def __init__(self, q: TileTensor, k: TileTensor, causal: bool):
        self.q, self.k, self.causal = q, k, causal
        self.groups = q.shape[1] // k.shape[1]
        self.q_offs = q.tiling.offsets(2)
        self.k_offs = k.tiling.offsets(2)
        self.qh_offs = q.tiling.offsets(1)
        self.kh_offs = k.tiling.offsets(1)

    def kv_heads_for(self, hq: int) -> tuple[list[int], tuple]:
        """kv head tiles read by query head tile ``hq``, and each query head's index into them."""
        h0 = self.qh_offs[hq]
        h1 = h0 + self.q.chunks[1][hq]
        g = self.groups
        tiles, start = _overlapping(self.k.chunks[1], h0 // g, (h1 - 1) // g + 1)
        return tiles, tuple(h // g - start for h in range(h0, h1))

    def q_heads_for(self, hk: int) -> tuple[list[int], int, int]:
        """Query head tiles that read kv head tile ``hk``, and the slice of their concatenation."""
        g = self.groups
        lo = self.kh_offs[hk] * g
        hi = lo + self.k.chunks[1][hk] * g
        tiles, start = _overlapping(self.q.chunks[1], lo, hi)
        return tiles, lo - start, hi - start

    def keys_for(self, i: int) -> list[int]:
        return _visible_keys(self.causal, self.q_offs[i], self.q.chunks[2][i], self.k_offs)

    def queries_for(self, j: int) -> list[int]:
        k0 = self.k_offs[j]
        return [i for i, (o, n) in enumerate(zip(self.q_offs, self.q.chunks[2]))
                if not self.causal or o + n - 1 >= k0]

    def kv_inputs(self, k: TileTensor, v: TileTensor, b: int, hq: int, i: int):
        """Inputs and params that give one q tile its k/v blocks (as the forward kernel wants them)."""
        htiles, heads = self.kv_heads_for(hq)
        keys = self.keys_for(i)
        ins = [k.grid[b, p, j, 0] for j in keys for p in htiles]
        ins += [v.grid[b, p, j, 0] for j in keys for p in htiles]
        params = dict(n_k=len(keys), n_h=len(htiles), heads=heads, q_off=self.q_offs[i],
                      k_offs=tuple(self.k_offs[j] for j in keys))
        return ins, params


# --------------------------------------------------------------------------------------- op ----
class ScaledDotProductAttention(Op):
    name = "scaled_dot_product_attention"

    def forward(self, q, k, v, causal=True, scale=None):
        _validate(q, k, v, causal)
        d = q.shape[3]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        lay = _Layout(q, k, causal)
        out_grid = np.empty(q.tiling.grid, dtype=object)
        lse_tiling = Tiling(q.chunks[:3])
        lse_grid = np.empty(lse_tiling.grid, dtype=object)
        for b, hq, i, _ in np.ndindex(*q.tiling.grid):
            shape = q.tiling.tile_shape((b, hq, i, 0))
            ins, params = lay.kv_inputs(k, v, b, hq, i)
            o, lse = emit(_sdpa_fwd, [q.grid[b, hq, i, 0]] + ins, [(shape, q.dtype), (shape[:3], q.dtype)],
                          op=self.name, causal=causal, scale=scale, **params)
            out_grid[b, hq, i, 0] = o
            lse_grid[b, hq, i] = lse
        out = TileTensor(q.tiling, q.dtype, out_grid)
        lse = TileTensor(lse_tiling, q.dtype, lse_grid)
        return out, (q, k, v, out, lse, lay, scale)

    def backward(self, ctx, g):
        q, k, v, out, lse, lay, scale = ctx
        causal = lay.causal
        if g.chunks != out.chunks:
            raise TileError(WHERE, "the output gradient must have the tiles of the output",
                            f"{g.chunks} vs {out.chunks}")
        delta = np.empty(lse.tiling.grid, dtype=object)
        for idx in np.ndindex(*lse.tiling.grid):
            delta[idx] = emit1(_sdpa_delta, [g.grid[idx + (0,)], out.grid[idx + (0,)]],
                               lse.tiling.tile_shape(idx), q.dtype, op=f"{self.name}_bwd")

        dq_grid = np.empty(q.tiling.grid, dtype=object)
        for b, hq, i, _ in np.ndindex(*q.tiling.grid):
            ins, params = lay.kv_inputs(k, v, b, hq, i)
            ins = [q.grid[b, hq, i, 0], g.grid[b, hq, i, 0], lse.grid[b, hq, i], delta[b, hq, i]] + ins
            dq_grid[b, hq, i, 0] = emit1(_sdpa_dq, ins, q.tiling.tile_shape((b, hq, i, 0)), q.dtype,
                                         op=f"{self.name}_bwd", causal=causal, scale=scale, **params)

        dk_grid = np.empty(k.tiling.grid, dtype=object)
        dv_grid = np.empty(v.tiling.grid, dtype=object)
        for b, hk, j, _ in np.ndindex(*k.tiling.grid):
            htiles, h_lo, h_hi = lay.q_heads_for(hk)
            queries = lay.queries_for(j)
            ins = [k.grid[b, hk, j, 0], v.grid[b, hk, j, 0]]
            for src, tail in ((q.grid, (0,)), (g.grid, (0,)), (lse.grid, ()), (delta, ())):
                ins += [src[(b, p, i) + tail] for i in queries for p in htiles]
            shape = k.tiling.tile_shape((b, hk, j, 0))
            dk, dv = emit(_sdpa_dkv, ins, [(shape, k.dtype), (shape, v.dtype)], op=f"{self.name}_bwd",
                          n_i=len(queries), n_p=len(htiles), h_lo=h_lo, h_hi=h_hi, groups=lay.groups,
                          q_offs=tuple(lay.q_offs[i] for i in queries), k_off=lay.k_offs[j],
                          causal=causal, scale=scale)
            dk_grid[b, hk, j, 0] = dk
            dv_grid[b, hk, j, 0] = dv
        return (TileTensor(q.tiling, q.dtype, dq_grid), TileTensor(k.tiling, k.dtype, dk_grid),
                TileTensor(v.tiling, v.dtype, dv_grid))


def _validate(q, k, v, causal: bool) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        require_tensor(t, WHERE, name)
        if t.ndim != 4:
            raise TileError(WHERE, f"{name} must have 4 dims (B, heads, seq, D)", f"shape {t.shape}")
    require_same_dtype(WHERE, q=q, k=k, v=v)
    require_float(q, WHERE, "q")
    B, H, T, D = q.shape
    if k.shape != v.shape:
        raise TileError(WHERE, "k and v must have the same shape", f"k {k.shape}, v {v.shape}")
    if k.shape[0] != B or k.shape[3] != D:
        raise TileError(WHERE, "k/v must be (B, Hkv, S, D) with the B and D of q (B, H, T, D)",
                        f"q {q.shape}, k {k.shape}")
    hkv = k.shape[1]
    if hkv == 0 or H % hkv:
        raise TileError(WHERE, "the kv head count must divide the query head count (grouped-query "
                        "attention)", f"H={H}, Hkv={hkv}")
    if causal and k.shape[2] != T:
        raise TileError(WHERE, "causal attention needs as many keys as queries (T == S)",
                        f"T={T}, S={k.shape[2]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.chunks[3]) != 1:
            raise TileError(WHERE, f"the head dim D of {name} must be a single tile",
                            f"tiles {t.chunks[3]}")
    require_same_chunks(WHERE, "k and v", k.chunks, v.chunks)
    require_same_chunks(WHERE, "the batch dim of q and k/v", q.chunks[0], k.chunks[0])


_sdpa_op = ScaledDotProductAttention()


def scaled_dot_product_attention(q: TileTensor, k: TileTensor, v: TileTensor, causal: bool = True,
                                 scale: float | None = None) -> TileTensor:
    """``softmax(q k^T * scale + causal mask) v`` over tiles, as torch's ``is_causal`` SDPA.

    q: (B, H, T, D); k, v: (B, Hkv, S, D) with Hkv dividing H (query head h uses kv head
    h // (H // Hkv)); ``scale`` defaults to 1/sqrt(D). T, S, B and the heads may be tiled, D not.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.ones((1, 1, 4, 2)), tiles=(1, 1, 2, 2))
    >>> scaled_dot_product_attention(x, x, x).numpy()[0, 0, 3]
    array([1., 1.])
    """
    return _sdpa_op(q, k, v, causal=bool(causal), scale=scale)
