"""Scaled dot-product attention over tiles, flash-attention style.

q is (B, H, T, D), k and v are (B, Hkv, S, D) with Hkv dividing H (grouped-query attention: query
head h reads kv head h // (H // Hkv)). B, H, T and S may be tiled (any tile sizes, the key tiles
need not match the query tiles); D is one tile. With a causal mask the queries are the last T of
the S positions (``q_offset = S - T`` positions come before them: decoding against a KV cache).

Forward: one kernel per q tile (b, h, i). It reads the k/v tiles that query tile i can see (for a
causal mask only key tiles starting at or before its last query position) and folds them in with
an online softmax (running row max ``m`` and row sum ``l``), so the scores never exist for a
whole sequence: only for a block of query rows against a run of key tiles that fits a byte budget
(or against one key tile, when that alone is larger). Besides the output it returns the row
log-sum-exp ``lse = m + log(l)``, the only thing backward keeps besides q, k, v and the output.

Backward (flash-attention 2): ``delta_i = rowsum(dO_i * O_i)``; one kernel per kv tile (b, g, j)
recomputes ``P = exp(q k^T * scale - lse)`` for every query tile and query head that reads it and
accumulates dK_j and dV_j; one kernel per q tile (b, h, i) does the same for dQ_i. Where T and S
are one tile each and the head tiles pair up (the usual CPU tiling), one kernel per (b, head)
tile pair does all of it, forming each score block once (``_sdpa_bwd``).

Inside a kernel (see ``_BLOCK``) the rows of a tile are walked in blocks, so that a causal kernel
skips the keys above the diagonal, and batch x heads in groups, so that each score block stays in
cache. Between a block's two matrix products, its mask, max, exponential and sums (and the
backward's ``dS``) are one Numba pass (``ops/_attention_cpu.py``) for float32 and float64 NumPy
arrays, and NumPy array operations otherwise; bench/bench_attention.py times the kernels against
torch.

float16 (as torch's, and as tilegraph's other ops): every kernel computes in float32 and casts its
results to float16 last; the row log-sum-exp and the backward's ``delta`` stay float32 tensors.
Computing in float16 made the gradients 2-4x less accurate than torch's float16.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit, emit1, kernel, to_host
from tilegraph._tensor import TileTensor, Tiling

from ._common import (Default, acc_dtype, elementwise_cost, numel, require_float, require_same_chunks,
                      require_same_dtype, require_tensor, resolve_alias, xp_of)
from ._attention_cpu import NO_MASK, one_pass, probs_cols, probs_rows, softmax_rows
from .dropout import check_dropout, scale_mask
from ._gpu import ROW_THREADS, fused, gpu_or_generic, row_kernel

__all__ = ["scaled_dot_product_attention", "kv_cache_append", "kv_cache_write", "sdpa_at"]

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


# Inside one tile the kernels walk blocks of ``_BLOCK`` rows: query rows in the forward and dQ
# kernels, key rows in dK/dV. A causal block multiplies only by the keys its last query can see
# (or the queries that see its first key), so the work above the diagonal shrinks to one
# (block x block) triangle per block instead of half the tile, and only that corner is masked.
# Batch and heads are flattened into one dim and cut into groups whose score block takes at most
# ``_GROUP_BYTES``: a score block that stays in cache between the GEMM that writes it and the
# passes that read it makes the one-tile forward ~30% faster than one (b, h, 64, 256) block.
# Both values were measured on (2, 12, 256, 64) float32, single thread (bench/bench_attention.py).
_BLOCK = 64
_GROUP_BYTES = 512 * 1024
#: one _sdpa_bwd task per tile pair where the tiling allows it (False: the delta, dQ and dK/dV
#: kernels everywhere, for tests and bench/bench_attention.py)
_FUSED_BACKWARD = True


def _blocks(n: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``_BLOCK`` rows covering ``range(n)``."""
    return [(a, min(a + _BLOCK, n)) for a in range(0, n, _BLOCK)]


def _head_groups(n: int, rows: int, width: int, itemsize: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``n`` heads whose (rows x width) score blocks fit the budget."""
    per = max(1, _GROUP_BYTES // max(1, rows * width * itemsize))
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def _future_keys(xp, rows: int, cols: int, d: int):
    """Where keys lie after queries in a (rows = queries, cols = keys) block whose query row 0 sits
    ``d`` positions after key column 0: ``(c0, mask)`` with ``mask`` for columns ``c0:`` only (no
    earlier column lies after any row), or None when no key does."""
    c0 = max(d + 1, 0)
    if c0 >= cols:
        return None
    return c0, xp.arange(c0, cols)[None, :] - xp.arange(rows)[:, None] > d


def _past_queries(xp, rows: int, cols: int, e: int):
    """The transposed case, a (rows = keys, cols = queries) block whose key row 0 sits ``e``
    positions after query column 0: ``(n, mask)`` for columns ``:n``, or None."""
    n = min(e + rows - 1, cols)
    if n <= 0:
        return None
    return n, xp.arange(n)[None, :] - xp.arange(rows)[:, None] < e


def _split_kv(tiles, n_k: int, n_h: int):
    """The flat input list ``k tiles (key-tile major, head-tile minor), then v tiles`` per key tile."""
    ks = [tiles[j * n_h:(j + 1) * n_h] for j in range(n_k)]
    vs = [tiles[(n_k + j) * n_h:(n_k + j + 1) * n_h] for j in range(n_k)]
    return ks, vs


def _flat(x):
    """(b, h, ...) as (b * h, ...), the one head dim the kernels loop over."""
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _kv_blocks(kv, n_k: int, n_h: int, heads: tuple, k_offs: tuple):
    """``(k, v, k_off)`` per key tile, k and v as (b * h, sk, D) for the query heads ``heads``."""
    ks, vs = _split_kv(kv, n_k, n_h)
    return [(_flat(_pick_heads(_cat_heads(k), heads)), _flat(_pick_heads(_cat_heads(v), heads)), o)
            for k, v, o in zip(ks, vs, k_offs)]


def _attn_cost(mult: float, first_k: int):
    """``mult * b*h*tq*sk*D`` flops over all score blocks (the forward does 2 GEMMs: mult 4)."""

    def cost(in_shapes, out_shapes, itemsize, params) -> Cost:
        b, h, tq, d = in_shapes[0]
        n_h = params["n_h"]
        sk = sum(s[2] for s in in_shapes[first_k:first_k + params["n_k"] * n_h:n_h])
        nbytes = (sum(numel(s) for s in in_shapes) + sum(numel(s) for s in out_shapes)) * itemsize
        return Cost(mult * b * h * tq * sk * d, float(nbytes))

    return cost


def _query_block_plan(kvs, causal: bool, q_off: int, a0: int, a1: int):
    """For query rows ``[a0, a1)`` of a tile at ``q_off``: ``(k, v, w, lim, k_off)`` per key tile
    with visible keys, ``w`` of its leading keys visible to the last row; with a causal mask row r
    sees the keys ``j <= r + lim`` (``lim`` None: every key); ``k_off`` the tile's first key."""
    plan = []
    for k, v, k_off in kvs:
        w = min(k.shape[1], q_off + a1 - k_off) if causal else k.shape[1]
        if w > 0:
            plan.append((k, v, w, q_off + a0 - k_off if causal else None, k_off))
    return plan


def _span_layout(span) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each key tile of ``span`` starts in its score buffer, its width and its ``lim``
    (NO_MASK where there is no mask): the arguments of the fused pass, ``softmax_rows``."""
    widths = [w for _, _, w, _, _ in span]
    return (np.cumsum([0] + widths[:-1]).astype(np.int64), np.array(widths, dtype=np.int64),
            np.array([NO_MASK if lim is None else lim for _, _, _, lim, _ in span], dtype=np.int64))


def _spans(plan, rows: int, itemsize: int) -> list[list]:
    """``plan`` cut into runs of adjacent key tiles whose scores, one head's (rows x keys) block,
    fit _GROUP_BYTES: each run gets one softmax pass over one score buffer."""
    spans, width = [[]], 0
    for entry in plan:
        if spans[-1] and rows * (width + entry[2]) * itemsize > _GROUP_BYTES:
            spans.append([])
            width = 0
        spans[-1].append(entry)
        width += entry[2]
    return spans


# ------------------------------------------------------------------------------ GPU kernels ----
# On a GPU every array operation is a kernel launch (some 10 us of Python and driver time), so the
# CPU kernels' cache-sized blocks (64 rows x a few heads) turn one 512-position tile into about a
# thousand launches: GPT-2 124M (8 x 512) spent 1.6 of its 1.9 s per step on an H100 in them. The
# GPU versions take a tile at once: each product is one batched GEMM over all (batch x head)
# pairs and the causal mask one boolean (queries x keys) array; heads are cut into chunks only
# where a score block would pass _GPU_SCORE_BYTES. They follow the CPU kernels' arithmetic (the
# same lse, rows without a visible key as there) and run on NumPy as well, where tests compare them.
_GPU_SCORE_BYTES = 256 * 2**20


def _sum_groups(x, b: int, g: int, groups: int):
    """(b * g * groups, sk, D) per query head as (b, g, sk, D): summed over the ``groups`` query
    heads that share each kv head."""
    x = x.reshape(b, g * groups, *x.shape[1:])
    return x.reshape(b, g, groups, *x.shape[2:]).sum(axis=2) if groups > 1 else x


def _score_chunks(n: int, rows: int, cols: int, itemsize: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``n`` heads whose (rows x cols) score blocks take at most _GPU_SCORE_BYTES."""
    per = max(1, _GPU_SCORE_BYTES // max(1, rows * cols * itemsize))
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def _positions(xp, offs, lengths):
    """The positions of tiles starting at ``offs`` with ``lengths`` rows, side by side."""
    return xp.concatenate([xp.arange(o, o + n) for o, n in zip(offs, lengths)])


def _later(xp, rows_at, row_lengths, cols_at, col_lengths, keys_are_rows: bool):
    """The causal mask of a (rows x cols) score block: ``(r, c, keys_are_rows)``, the rows' and
    the columns' positions, masked where the key lies after the query; None when no key lies after
    any query (decided from the offsets alone, with no look at device memory)."""
    keys_at, key_lengths = (rows_at, row_lengths) if keys_are_rows else (cols_at, col_lengths)
    last_key = max(o + n for o, n in zip(keys_at, key_lengths)) - 1
    if last_key <= min(cols_at if keys_are_rows else rows_at):  # the first query sees every key
        return None
    return _positions(xp, rows_at, row_lengths), _positions(xp, cols_at, col_lengths), keys_are_rows


def _mask_array(later):
    """The boolean (rows x cols) array of a mask from _later, true where masked."""
    r, c, keys_are_rows = later
    return r[:, None] > c[None, :] if keys_are_rows else c[None, :] > r[:, None]


# The passes over a score block, fused on a CUDA device (ops._gpu), as array code elsewhere. A
# mask from _later travels as its positions (``mode`` 0: none, 1: masked where the column's
# position is later, 2: the row's), never as a boolean block.
def _mask_args(xp, later):
    """``(r, c, mode)`` for the fused kernels: the rows' positions as a column, the columns'."""
    if later is None:
        zero = xp.zeros(1, np.int64)
        return zero[:, None], zero, np.int32(0)
    r, c, keys_are_rows = later
    return r[:, None], c, np.int32(2 if keys_are_rows else 1)


_MASKED = "(mode == 1 && c > r) || (mode == 2 && r > c)"


def _exp_shifted_generic(lse, r, c, mode, p):
    if mode:
        xp_of(p).copyto(p, p.dtype.type(-np.inf), where=_mask_array((r[:, 0], c, mode == 2)))
    p -= lse
    return xp_of(p).exp(p, out=p)


#: ``p = exp(p - lse)`` in place, masked entries 0 (``lse`` broadcast over p; +inf for a row that
#: saw no key)
_exp_shifted = fused("attn_exp_shifted", "T lse, int64 r, int64 c, int32 mode", "T p",
                     f"p = ({_MASKED}) ? (T)0 : exp(p - lse);", _exp_shifted_generic)


def _ds_generic(delta, p, ds):
    ds -= delta
    ds *= p
    return ds


#: ``dS = (dO v^T - delta) * P`` in place of ``dO v^T``
_ds_of = fused("attn_ds", "T delta, T p", "T ds", "ds = (ds - delta) * p;", _ds_generic)

_SOFTMAX_ROWS_CU = r"""
extern "C" __global__ void tilegraph_softmax_rows(T* s, const long long* rpos, const long long* cpos, T* shift_out,
                                                  T* l_out, int rows, int cols, int mode) {
    __shared__ double red[32];
    const long long row = blockIdx.x;
    T* sr = s + row * cols;
    const long long r = mode ? rpos[row % rows] : 0;
    double m = -__longlong_as_double(0x7ff0000000000000LL);
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const long long c = cpos[mode ? j : 0];
        if (!(MASKED)) m = tilegraph_max_nan(m, (double)sr[j]);
    }
    m = tilegraph_block_reduce(m, red, 1);
    const T shift = isfinite(m) ? (T)m : (T)0;
    double l = 0.0;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        const long long c = cpos[mode ? j : 0];
        const T p = (MASKED) ? (T)0 : exp(sr[j] - shift);
        sr[j] = p;
        l += (double)p;
    }
    l = tilegraph_block_reduce(l, red, 0);
    if (threadIdx.x == 0) { shift_out[row] = shift; l_out[row] = (T)l; }
}
""".replace("MASKED", _MASKED)


def _softmax_rows_generic(s, later):
    """Scores (heads, rows, cols) to ``exp(s - shift)`` in place, masked entries 0; returns the
    row shift (the row max, 0 where not finite) and the row sums."""
    xp = xp_of(s)
    if later is not None:
        xp.copyto(s, s.dtype.type(-np.inf), where=_mask_array(later))
    m = s.max(axis=-1)
    shift = xp.where(xp.isfinite(m), m, s.dtype.type(0))
    s -= shift[..., None]
    p = xp.exp(s, out=s)
    return shift, p.sum(axis=-1)


def _softmax_rows_cuda(s, later):
    xp = xp_of(s)
    if s.size == 0 or not s.flags.c_contiguous:
        return _softmax_rows_generic(s, later)
    n, rows, cols = s.shape
    r, c, mode = _mask_args(xp, later)
    shift = xp.empty((n, rows), s.dtype)
    l = xp.empty((n, rows), s.dtype)
    row_kernel("softmax_rows", _SOFTMAX_ROWS_CU, s.dtype)(
        (n * rows,), (ROW_THREADS,), (s, xp.ascontiguousarray(r.reshape(-1)), xp.ascontiguousarray(c), shift, l,
                                      np.int32(rows), np.int32(cols), mode))
    return shift, l


_softmax_rows = gpu_or_generic("softmax_rows", _softmax_rows_cuda, _softmax_rows_generic)


def _cat_keys(xp, tiles):
    """Key tiles (each a list of head tiles) as one (b, heads, keys, D) array."""
    parts = [_cat_heads(t) for t in tiles]
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=2)


def _whole_keys(xp, kv, n_k: int, n_h: int, heads: tuple, q_off: int, tq: int, k_offs: tuple, causal: bool):
    """A query tile's keys and values, all key tiles side by side, as (b * h, S, D) for the
    query heads ``heads``; the causal mask of its ``tq`` queries (None: none or nothing masked);
    the key tiles' ``(offset, length)``."""
    ks, vs = _split_kv(kv, n_k, n_h)
    k = _flat(_pick_heads(_cat_keys(xp, ks), heads))
    v = _flat(_pick_heads(_cat_keys(xp, vs), heads))
    spans = [(o, t[0].shape[2]) for o, t in zip(k_offs, ks)]
    later = _later(xp, (q_off,), (tq,), k_offs, [n for _, n in spans], False) if causal else None
    return k, v, later, spans


#: with a causal mask, the GPU kernels cut a tile into blocks of at least this many rows (queries;
#: keys in dK/dV), each multiplied by the keys (queries) it can see alone: half a tile's scores lie
#: above the diagonal, two blocks skip a quarter of them, four three eighths (more blocks, more
#: launches)
_GPU_CAUSAL_ROWS = 256


def _causal_blocks(n: int, causal: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` row blocks of a tile of ``n`` rows (one block without a causal mask)."""
    k = max(1, n // _GPU_CAUSAL_ROWS) if causal else 1
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def _count_before(spans, position: int) -> int:
    """How many of the positions of tiles ``spans`` ((offset, length), ascending) lie before ``position``."""
    return sum(max(0, min(n, position - o)) for o, n in spans)


def _query_blocks(tq: int, causal: bool, spans, q_off: int, n_keys: int):
    """``(a0, a1, w)`` per row block of a query tile at ``q_off``: ``w`` the leading keys (of key
    tiles ``spans``) that the block's last row sees, all ``n_keys`` without a causal mask."""
    for a0, a1 in _causal_blocks(tq, causal):
        yield a0, a1, _count_before(spans, q_off + a1) if causal else n_keys


def _mask_rows(later, r0: int, r1: int, c0: int, c1: int):
    """The mask of block ``[r0, r1) x [c0, c1)`` of a score block, from _later's (None: none)."""
    return None if later is None else (later[0][r0:r1], later[1][c0:c1], later[2])


def _float16_in_float32(keep: tuple = ()):
    """A kernel of float16 tiles run on those tiles widened to float32: the project's rule for
    float16, as torch's (scores, softmax statistics and products accumulate in float32, each
    result is cast to float16 last). Results at the positions in ``keep`` (the row log-sum-exp)
    stay float32. The kernel's first tile says whether it is float16; works on NumPy and CuPy
    arrays alike; int tiles (a position) pass as they are."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(*arrays, **params):
            if arrays[0].dtype != np.float16:
                return fn(*arrays, **params)
            out = fn(*[a.astype(np.float32) if a.dtype == np.float16 else a for a in arrays], **params)
            if isinstance(out, tuple):
                return tuple(o if i in keep else o.astype(np.float16) for i, o in enumerate(out))
            return out.astype(np.float16)

        return run

    return wrap


def _lse_for_exp(xp, lse):
    """``lse`` with -inf (a row that saw no key) as +inf, so that ``exp(s - lse)`` is 0 there."""
    return xp.where(xp.isneginf(lse), lse.dtype.type(np.inf), lse)


# Dropout on the attention weights inside the kernels (``drop``: the probability and where the
# task's tiles sit, (p, B, H, T, S, b0, h0, q_offset): its first batch row and query head, and the
# positions before the queries; the step's seed tile comes last among the inputs). Weight
# (b, h, t, s) keeps as element ((b * H + h) * T + t) * S + s of
# ops.dropout.keep_mask(seed, (B, H, T, S), p): the mask of the composed path
# (ops.attention_masked), element for element, on any tiling.
def _first_row(drop, q_off: int) -> int:
    """Query row (0..T) of the first query of a tile at position ``q_off``; 0 without ``drop``."""
    return 0 if drop is None else q_off - drop[7]


def _drop_factors(xp, seed, drop, heads: int, g0: int, g1: int, r0: int, r1: int, cols: int, dtype,
                  transposed: bool = False, c0: int = 0):
    """keep / (1 - p) for the weights of flat heads ``g0:g1`` (``heads`` per batch row of the task),
    query rows ``r0:r1`` (of T) and keys ``c0:c0 + cols`` (of S): (heads, rows, cols), or
    (heads, cols, rows) ``transposed`` (the backward's P^T blocks)."""
    p, _, H, T, S, b0, h0, _ = drop
    n = np.arange(g0, g1, dtype=np.int64)
    head = (b0 + n // heads) * H + h0 + n % heads
    base = ((head[:, None] * T + np.arange(r0, r1, dtype=np.int64)[None, :]) * S + c0).astype(np.uint64)
    return scale_mask(xp, seed, p, base, cols, dtype, transposed)


@_float16_in_float32(keep=(1,))
def _sdpa_fwd_gpu(q, *kv, n_k, n_h, heads, q_off, k_offs, causal, scale, drop=None):
    """_sdpa_fwd in a few launches: per head chunk and row block, the scores against every key
    the block sees, one softmax, one product with v."""
    xp = xp_of(q)
    kv, seed = (kv[:-1], kv[-1]) if drop is not None else (kv, None)
    b, h, tq, d = q.shape
    t0 = _first_row(drop, q_off)
    k, v, later, spans = _whole_keys(xp, kv, n_k, n_h, heads, q_off, tq, k_offs, causal)
    qf = _flat(q)
    sc = q.dtype.type(scale)
    out = xp.empty(qf.shape, dtype=q.dtype)
    lse = xp.empty(qf.shape[:2], dtype=q.dtype)
    with np.errstate(divide="ignore", invalid="ignore"):    # rows with no visible key: NaN, as torch
        for g0, g1 in _score_chunks(b * h, tq, k.shape[1], q.itemsize):
            for a0, a1, w in _query_blocks(tq, causal, spans, q_off, k.shape[1]):
                if w == 0:
                    out[g0:g1, a0:a1], lse[g0:g1, a0:a1] = np.nan, -np.inf
                    continue
                p = xp.matmul(qf[g0:g1, a0:a1] * sc, k[g0:g1, :w].swapaxes(-1, -2))      # (heads, rows, w)
                shift, l = _softmax_rows(p, _mask_rows(later, a0, a1, 0, w))
                if seed is not None:  # (the key tiles side by side: the keys from k_offs[0] on)
                    p *= _drop_factors(xp, seed, drop, h, g0, g1, t0 + a0, t0 + a1, w, p.dtype, c0=k_offs[0])
                o = xp.matmul(p, v[g0:g1, :w])
                o /= l[..., None]
                out[g0:g1, a0:a1] = o
                lse[g0:g1, a0:a1] = shift + xp.log(l)
    return out.reshape(b, h, tq, d), lse.reshape(b, h, tq)


@_float16_in_float32()
def _sdpa_dq_gpu(q, do, lse, delta, *kv, n_k, n_h, heads, q_off, k_offs, causal, scale, seed=None, drop=None):
    """_sdpa_dq in a few launches per head chunk (with ``drop``, the seed tile last among ``kv``
    unless given as ``seed``, as _bwd_gpu does)."""
    xp = xp_of(q)
    if drop is not None and seed is None:
        kv, seed = kv[:-1], kv[-1]
    b, h, tq, d = q.shape
    t0 = _first_row(drop, q_off)
    k, v, later, spans = _whole_keys(xp, kv, n_k, n_h, heads, q_off, tq, k_offs, causal)
    qf, dof, delta = _flat(q), _flat(do), _flat(delta)
    lse = _lse_for_exp(xp, _flat(lse))
    sc = q.dtype.type(scale)
    dq = xp.empty(qf.shape, dtype=q.dtype)
    for g0, g1 in _score_chunks(b * h, tq, k.shape[1], q.itemsize):
        for a0, a1, w in _query_blocks(tq, causal, spans, q_off, k.shape[1]):
            if w == 0:
                dq[g0:g1, a0:a1] = 0
                continue
            p = xp.matmul(qf[g0:g1, a0:a1] * sc, k[g0:g1, :w].swapaxes(-1, -2))          # (heads, rows, w)
            _exp_shifted(lse[g0:g1, a0:a1, None], *_mask_args(xp, _mask_rows(later, a0, a1, 0, w)), p)
            ds = xp.matmul(dof[g0:g1, a0:a1], v[g0:g1, :w].swapaxes(-1, -2))
            if seed is not None:  # the gradient of the undropped weights: dO v^T times the factors
                ds *= _drop_factors(xp, seed, drop, h, g0, g1, t0 + a0, t0 + a1, w, ds.dtype, c0=k_offs[0])
            _ds_of(delta[g0:g1, a0:a1, None], p, ds)
            dq[g0:g1, a0:a1] = xp.matmul(ds, k[g0:g1, :w])
    dq *= sc
    return dq.reshape(b, h, tq, d)


@_float16_in_float32()
def _sdpa_dkv_gpu(k, v, *qs, n_i, n_p, h_lo, h_hi, groups, q_offs, k_off, causal, scale, seed=None, drop=None):
    """_sdpa_dkv in a few launches per head chunk: the query tiles side by side, scores transposed
    (with ``drop``, the seed tile last among ``qs`` unless given as ``seed``, as _bwd_gpu does)."""
    xp = xp_of(k)
    if drop is not None and seed is None:
        qs, seed = qs[:-1], qs[-1]
    t0 = _first_row(drop, q_offs[0])  # (the query tiles side by side: the queries from q_offs[0] on)
    per = n_i * n_p
    b, g, sk, d = k.shape

    def side_by_side(m):  # input kind m (q, dO, lse, delta) of every query tile, heads h_lo:h_hi
        parts = [_cat_heads(qs[m * per + i * n_p:m * per + (i + 1) * n_p])[:, h_lo:h_hi] for i in range(n_i)]
        return _flat(parts[0] if n_i == 1 else xp.concatenate(parts, axis=2))

    q, do, lse, delta = (side_by_side(m) for m in range(4))  # (n, TQ, D) and (n, TQ)
    lse = _lse_for_exp(xp, lse)
    spans = [(o, qs[i * n_p].shape[2]) for i, o in enumerate(q_offs)]
    later = _later(xp, (k_off,), (sk,), q_offs, [n for _, n in spans], True) if causal else None
    sc = k.dtype.type(scale)
    k_rep = _flat(xp.repeat(k, groups, axis=1) if groups > 1 else k)   # (n, sk, D)
    v_rep = _flat(xp.repeat(v, groups, axis=1) if groups > 1 else v)
    dk = xp.empty(k_rep.shape, dtype=k.dtype)
    dv = xp.empty(v_rep.shape, dtype=v.dtype)
    tq = q.shape[1]
    for g0, g1 in _score_chunks(k_rep.shape[0], sk, tq, k.itemsize):
        for a0, a1 in _causal_blocks(sk, causal):
            c0 = _count_before(spans, k_off + a0) if causal else 0   # queries before the block's first key
            if c0 == tq:
                dk[g0:g1, a0:a1] = dv[g0:g1, a0:a1] = 0
                continue
            pt = xp.matmul(k_rep[g0:g1, a0:a1] * sc, q[g0:g1, c0:].swapaxes(-1, -2))  # (heads, rows, TQ - c0): P^T logits
            _exp_shifted(lse[g0:g1, None, c0:], *_mask_args(xp, _mask_rows(later, a0, a1, c0, tq)), pt)
            factors = None if seed is None else _drop_factors(xp, seed, drop, h_hi - h_lo, g0, g1, t0 + c0, t0 + tq,
                                                              a1 - a0, pt.dtype, transposed=True, c0=k_off + a0)
            dv[g0:g1, a0:a1] = xp.matmul(pt if factors is None else pt * factors, do[g0:g1, c0:])
            dst = xp.matmul(v_rep[g0:g1, a0:a1], do[g0:g1, c0:].swapaxes(-1, -2))       # (dO v^T)^T
            if factors is not None:
                dst *= factors
            _ds_of(delta[g0:g1, None, c0:], pt, dst)
            dk[g0:g1, a0:a1] = xp.matmul(dst, q[g0:g1, c0:])
    dk *= sc
    return _sum_groups(dk, b, g, groups), _sum_groups(dv, b, g, groups)


# ---------------------------------------------------------------------------------- kernels ----
@kernel("sdpa_fwd", cost=_attn_cost(4.0, 1), gpu=_sdpa_fwd_gpu)
@_float16_in_float32(keep=(1,))
def _sdpa_fwd(q, *kv, n_k, n_h, heads, q_off, k_offs, causal, scale, drop=None):
    """Output and row log-sum-exp of one q tile over ``n_k`` key tiles, by online softmax.

    The scores of adjacent key tiles go side by side into one buffer (see _spans), so with the
    usual tile sizes each query block takes one softmax pass and no running-max rescaling.

    float16 tiles are computed in float32 (:func:`_float16_in_float32`): the output is cast to float16, the
    log-sum-exp stays float32 (the backward's ``exp(s - lse)`` needs its digits). With ``drop``
    (see _drop_factors; the seed tile last among ``kv``) the weights are dropped after their row
    sums, before the product with v: the log-sum-exp is the undropped softmax's.
    """
    xp = xp_of(q)
    kv, seed = (kv[:-1], kv[-1]) if drop is not None else (kv, None)
    b, h, tq, d = q.shape
    t0 = _first_row(drop, q_off)
    kvs = _kv_blocks(kv, n_k, n_h, heads, k_offs)
    q = _flat(q)                                              # (n, tq, D), n = b * h
    sc, ninf = q.dtype.type(scale), q.dtype.type(-np.inf)
    out = xp.empty(q.shape, dtype=q.dtype)
    lse = xp.empty(q.shape[:2], dtype=q.dtype)
    for a0, a1 in _blocks(tq):
        plan = _query_block_plan(kvs, causal, q_off, a0, a1)
        if not plan:    # no visible key at all (as torch: NaN output)
            out[:, a0:a1], lse[:, a0:a1] = np.nan, -np.inf
            continue
        spans = _spans(plan, a1 - a0, q.itemsize)
        width = max(sum(w for _, _, w, _, _ in span) for span in spans)
        # each score buffer's mask, max, exp and sum in one pass (per span: where, columns, lim)
        fuse = one_pass(xp, q.dtype)
        layouts = [_span_layout(span) for span in spans] if fuse else [None] * len(spans)
        for g0, g1 in _head_groups(b * h, a1 - a0, width, q.itemsize):
            qb = q[g0:g1, a0:a1] * sc                         # (heads, rows, D): scale folded in once
            m = l = acc = None  # running row max, row sum of exp(s - m), sum of exp(s - m) @ v
            for span, layout in zip(spans, layouts):
                s = xp.empty((g1 - g0, a1 - a0, sum(w for _, _, w, _, _ in span)), dtype=q.dtype)
                c = 0
                for k, v, w, lim, _ in span:
                    xp.matmul(qb, k[g0:g1, :w].swapaxes(-1, -2), out=s[..., c:c + w])
                    mask = None if fuse or lim is None else _future_keys(xp, a1 - a0, w, lim)
                    if mask is not None:
                        xp.copyto(s[..., c + mask[0]:c + w], ninf, where=mask[1])
                    c += w
                beta = None  # the span's own rescaling, where its max is not the running one
                if fuse:  # masked scores become 0, the rest exp(s - m_span)
                    m_s, l_s = np.empty(s.shape[:2], dtype=q.dtype), np.empty(s.shape[:2], dtype=q.dtype)
                    softmax_rows(s, *layout, m_s, l_s)
                    p = s
                    if m is None:
                        m, l = m_s, l_s
                    else:
                        m_new = xp.maximum(m, m_s)
                        shift = xp.where(xp.isfinite(m_new), m_new, q.dtype.type(0))
                        alpha, beta = xp.exp(m - shift), xp.exp(m_s - shift)
                        l = l * alpha + l_s * beta
                        acc *= alpha[..., None]
                        m = m_new
                else:
                    m_new = s.max(axis=-1) if m is None else xp.maximum(m, s.max(axis=-1))
                    # A row with no visible key yet keeps m = -inf; shift it by 0 instead (exp(-inf) = 0).
                    shift = xp.where(xp.isfinite(m_new), m_new, q.dtype.type(0))
                    s -= shift[..., None]
                    p = xp.exp(s, out=s)
                    if m is None:   # the first key block needs no rescaling of earlier sums
                        l = p.sum(axis=-1)
                    else:
                        alpha = xp.exp(m - shift)
                        l = l * alpha + p.sum(axis=-1)
                        acc *= alpha[..., None]
                    m = m_new
                c = 0
                for k, v, w, _, k_off in span:
                    if seed is not None:  # (after the row sums: they are the undropped softmax's)
                        p[..., c:c + w] *= _drop_factors(xp, seed, drop, h, g0, g1, t0 + a0, t0 + a1, w, p.dtype,
                                                         c0=k_off)
                    pv = p[..., c:c + w] @ v[g0:g1, :w]
                    if beta is not None:
                        pv *= beta[..., None]
                    acc = pv if acc is None else xp.add(acc, pv, out=acc)
                    c += w
            xp.divide(acc, l[..., None], out=out[g0:g1, a0:a1])
            lse[g0:g1, a0:a1] = m + xp.log(l)
    return out.reshape(b, h, tq, d), lse.reshape(b, h, tq)


@kernel("sdpa_bwd_delta", cost=elementwise_cost(2))
def _sdpa_delta(do, o):
    """``rowsum(dO * O)``, the softmax-gradient correction of each query row.   # (b, h, tq)
    float16 tiles: summed in float32, and kept so (as the log-sum-exp)."""
    acc = acc_dtype(do.dtype)
    return (do.astype(acc, copy=False) * o.astype(acc, copy=False)).sum(axis=-1)


@kernel("sdpa_bwd_dq", cost=_attn_cost(6.0, 4), gpu=_sdpa_dq_gpu)
@_float16_in_float32()
def _sdpa_dq(q, do, lse, delta, *kv, n_k, n_h, heads, q_off, k_offs, causal, scale, drop=None):
    """dQ of one q tile: sum over key tiles of ``dS @ k * scale``, ``dS = P * (dO v^T - delta)``
    (with ``drop``, the seed tile last among ``kv``: dO v^T times the dropout factors); float16
    tiles are computed in float32 and dQ cast to float16 last."""
    xp = xp_of(q)
    kv, seed = (kv[:-1], kv[-1]) if drop is not None else (kv, None)
    b, h, tq, d = q.shape
    t0 = _first_row(drop, q_off)
    kvs = _kv_blocks(kv, n_k, n_h, heads, k_offs)
    q, do, lse, delta = _flat(q), _flat(do), _flat(lse), _flat(delta)
    sc, ninf = q.dtype.type(scale), q.dtype.type(-np.inf)
    dq = xp.zeros(q.shape, dtype=q.dtype)
    fuse = one_pass(xp, q.dtype)
    for a0, a1 in _blocks(tq):
        plan = _query_block_plan(kvs, causal, q_off, a0, a1)
        if not plan:
            continue
        for g0, g1 in _head_groups(b * h, a1 - a0, max(w for _, _, w, _, _ in plan), q.itemsize):
            qb = q[g0:g1, a0:a1] * sc                         # (heads, rows, D)
            do_b = do[g0:g1, a0:a1]
            dq_b = dq[g0:g1, a0:a1]
            # (contiguous: the fused pass then has one compiled form per dtype)
            lse_b, delta_b = xp.ascontiguousarray(lse[g0:g1, a0:a1]), xp.ascontiguousarray(delta[g0:g1, a0:a1])
            for k, v, w, lim, k_off in plan:
                k_w = k[g0:g1, :w]
                p = qb @ k_w.swapaxes(-1, -2)                 # (heads, rows, w)
                ds = do_b @ v[g0:g1, :w].swapaxes(-1, -2)
                if seed is not None:  # the gradient of the undropped weights: dO v^T times the factors
                    ds *= _drop_factors(xp, seed, drop, h, g0, g1, t0 + a0, t0 + a1, w, ds.dtype, c0=k_off)
                if fuse:  # P = exp(s - lse) and dS = P * (dP - delta) in one pass
                    probs_rows(p, ds, lse_b, delta_b, NO_MASK if lim is None else lim)
                else:
                    mask = None if lim is None else _future_keys(xp, a1 - a0, w, lim)
                    if mask is not None:
                        xp.copyto(p[..., mask[0]:], ninf, where=mask[1])
                    p -= lse_b[..., None]
                    xp.exp(p, out=p)
                    ds -= delta_b[..., None]
                    ds *= p
                dq_b += ds @ k_w
            dq_b *= sc
    return dq.reshape(b, h, tq, d)


def _dkv_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    b, _, sk, d = in_shapes[0]
    n_i, n_p = params["n_i"], params["n_p"]
    tq = sum(s[2] for s in in_shapes[2:2 + n_i * n_p:n_p])
    h = params["h_hi"] - params["h_lo"]
    nbytes = (sum(numel(s) for s in in_shapes) + sum(numel(s) for s in out_shapes)) * itemsize
    return Cost(8.0 * b * h * tq * sk * d, float(nbytes))


@kernel("sdpa_bwd_dkv", cost=_dkv_cost, gpu=_sdpa_dkv_gpu)
@_float16_in_float32()
def _sdpa_dkv(k, v, *qs, n_i, n_p, h_lo, h_hi, groups, q_offs, k_off, causal, scale, drop=None):
    """dK and dV of one kv tile, summed over the query tiles that see it and over the ``groups``
    query heads sharing each kv head.

    ``qs`` holds q tiles (query-tile major, head-tile minor), then dO, lse and delta tiles in the
    same order; heads ``h_lo:h_hi`` of each concatenation are the query heads of this kv tile.
    Scores are formed transposed, (keys x queries), so dK and dV come out of plain ``a @ b``
    products without transposing a score block. float16 tiles are computed in float32, dK and
    dV cast to float16 last. With ``drop`` (the seed tile last among ``qs``): dV from the dropped
    weights, dS from dO v^T times the dropout factors.
    """
    xp = xp_of(k)
    qs, seed = (qs[:-1], qs[-1]) if drop is not None else (qs, None)
    per = n_i * n_p
    b, g, sk, d = k.shape
    sc, ninf = k.dtype.type(scale), k.dtype.type(-np.inf)
    k_rep = _flat(xp.repeat(k, groups, axis=1) if groups > 1 else k)   # (n, sk, D), n = b * h
    v_rep = _flat(xp.repeat(v, groups, axis=1) if groups > 1 else v)
    tiles = []                                                # (q, dO, lse, delta, q_off) per q tile
    for i in range(n_i):
        parts = (_cat_heads(qs[m * per + i * n_p:m * per + (i + 1) * n_p])[:, h_lo:h_hi] for m in range(4))
        tiles.append(tuple(_flat(t) for t in parts) + (q_offs[i],))
    dk = xp.zeros(k_rep.shape, dtype=k.dtype)
    dv = xp.zeros(v_rep.shape, dtype=v.dtype)
    fuse = one_pass(xp, k.dtype)
    for c0, c1 in _blocks(sk):
        plan = []                   # (q tile, first query row that sees key c0, lim) per q tile
        for t in tiles:
            r0 = max(0, k_off + c0 - t[-1]) if causal else 0
            n_q = t[0].shape[1] - r0
            if n_q > 0:  # key row r is seen by the queries j >= r + lim of the block
                plan.append((t, r0, k_off + c0 - t[-1] - r0 if causal else None))
        if not plan:
            continue
        width = max(t[0].shape[1] - r0 for t, r0, _ in plan)
        for g0, g1 in _head_groups(k_rep.shape[0], c1 - c0, width, k.itemsize):
            kb = k_rep[g0:g1, c0:c1] * sc                     # (heads, rows, D)
            vb = v_rep[g0:g1, c0:c1]
            dk_b, dv_b = dk[g0:g1, c0:c1], dv[g0:g1, c0:c1]
            for (q, do, lse, delta, q_off), r0, lim in plan:
                q_r, do_r = q[g0:g1, r0:], do[g0:g1, r0:]
                lse_r, delta_r = xp.ascontiguousarray(lse[g0:g1, r0:]), xp.ascontiguousarray(delta[g0:g1, r0:])
                pt = kb @ q_r.swapaxes(-1, -2)                # (heads, rows, queries): P^T logits
                dst = vb @ do_r.swapaxes(-1, -2)              # (dO v^T)^T
                factors = None
                if seed is not None:
                    t0 = _first_row(drop, q_off) + r0
                    factors = _drop_factors(xp, seed, drop, h_hi - h_lo, g0, g1, t0, t0 + q.shape[1] - r0, c1 - c0,
                                            k.dtype, transposed=True, c0=k_off + c0)
                    dst *= factors
                if fuse:  # P^T and dS^T in one pass
                    probs_cols(pt, dst, lse_r, delta_r, NO_MASK if lim is None else lim)
                else:
                    mask = None if lim is None else _past_queries(xp, c1 - c0, pt.shape[-1], lim)
                    if mask is not None:
                        xp.copyto(pt[..., :mask[0]], ninf, where=mask[1])
                    pt -= lse_r[:, None]
                    xp.exp(pt, out=pt)
                    dst -= delta_r[:, None]
                    dst *= pt
                if factors is not None:
                    pt *= factors
                dv_b += pt @ do_r
                dk_b += dst @ q_r
    dk *= sc
    return _sum_groups(dk, b, g, groups), _sum_groups(dv, b, g, groups)


# One kernel for the whole backward of a tile pair: when the queries and the keys are one tile each
# along T (the usual CPU tiling: batch and heads tiled, the sequence whole) and the head tiles pair
# up, the dQ and dK/dV kernels above would each recompute the same score and dO v^T products. Here
# every (keys x queries) block is formed once and feeds all three gradients: 5 products per block
# instead of 7, one exponential pass instead of two, and delta made in the same task (GPT-2 124M's
# (2, 12, 256, 64) float32 tiles, one thread: 8.5 ms instead of 12.3 for delta, dQ and dK/dV;
# bench/bench_attention.py).
def _bwd_gpu(q, k, v, o, do, lse, *seed, groups, q_off, causal, scale, drop=None):
    """_sdpa_bwd from the GPU kernels above (a few launches each): delta, dQ, then dK and dV."""
    delta = _sdpa_delta.impl("cpu")(do, o)  # (with dropout too: o is the dropped weights' output)
    heads = tuple(hq // groups for hq in range(q.shape[1]))
    seed = seed[0] if drop is not None else None
    dq = _sdpa_dq_gpu(q, do, lse, delta, k, v, n_k=1, n_h=1, heads=heads, q_off=q_off, k_offs=(0,),
                      causal=causal, scale=scale, seed=seed, drop=drop)
    dk, dv = _sdpa_dkv_gpu(k, v, q, do, lse, delta, n_i=1, n_p=1, h_lo=0, h_hi=q.shape[1], groups=groups,
                           q_offs=(q_off,), k_off=0, causal=causal, scale=scale, seed=seed, drop=drop)
    return dq, dk, dv


def _bwd_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    """Five (T x S x D) products per (batch, query head) pair."""
    b, h, tq, d = in_shapes[0]
    nbytes = (sum(numel(s) for s in in_shapes) + sum(numel(s) for s in out_shapes)) * itemsize
    return Cost(10.0 * b * h * tq * in_shapes[1][2] * d, float(nbytes))


@kernel("sdpa_bwd", cost=_bwd_cost, gpu=_bwd_gpu)
@_float16_in_float32()
def _sdpa_bwd(q, k, v, o, do, lse, *seed, groups, q_off, causal, scale, drop=None):
    """dQ, dK and dV of one query tile and the one key tile it reads (``groups`` query heads per kv
    head; the queries sit ``q_off`` positions after the first key), scores formed transposed as in
    _sdpa_dkv; float16 tiles are computed in float32 and the gradients cast to float16 last. With
    ``drop`` (the seed tile last): dV from the dropped weights, dS from dO v^T times the factors."""
    xp = xp_of(q)
    seed = seed[0] if drop is not None else None
    b, h, tq, d = q.shape
    t0 = _first_row(drop, q_off)
    g, sk = k.shape[1], k.shape[2]
    sc = q.dtype.type(scale)
    delta = _flat((do * o).sum(axis=-1))                      # (n, tq), n = b * h
    k_rep = _flat(xp.repeat(k, groups, axis=1) if groups > 1 else k)
    v_rep = _flat(xp.repeat(v, groups, axis=1) if groups > 1 else v)
    q, do, lse = _flat(q), _flat(do), _flat(lse)
    dq = xp.zeros(q.shape, dtype=q.dtype)
    dk = xp.zeros(k_rep.shape, dtype=k.dtype)
    dv = xp.zeros(v_rep.shape, dtype=v.dtype)
    fuse = one_pass(xp, q.dtype)
    for c0, c1 in _blocks(sk):
        r0 = max(0, c0 - q_off) if causal else 0              # the first query row that sees key c0
        if r0 >= tq:
            break                                             # no query sees this key or any later one
        lim = c0 - q_off - r0 if causal else None             # key row r is seen by the queries j >= r + lim
        for g0, g1 in _head_groups(k_rep.shape[0], c1 - c0, tq - r0, q.itemsize):
            kb = k_rep[g0:g1, c0:c1] * sc                     # (heads, rows, D)
            q_r, do_r = q[g0:g1, r0:], do[g0:g1, r0:]
            lse_r, delta_r = xp.ascontiguousarray(lse[g0:g1, r0:]), xp.ascontiguousarray(delta[g0:g1, r0:])
            pt = kb @ q_r.swapaxes(-1, -2)                    # (heads, rows, queries): P^T logits
            dst = v_rep[g0:g1, c0:c1] @ do_r.swapaxes(-1, -2)  # (dO v^T)^T
            factors = None if seed is None else _drop_factors(xp, seed, drop, h, g0, g1, t0 + r0, t0 + tq, c1 - c0,
                                                              q.dtype, transposed=True, c0=c0)
            if factors is not None:
                dst *= factors
            if fuse:  # P^T and dS^T in one pass
                probs_cols(pt, dst, lse_r, delta_r, NO_MASK if lim is None else lim)
            else:
                mask = None if lim is None else _past_queries(xp, c1 - c0, pt.shape[-1], lim)
                if mask is not None:
                    xp.copyto(pt[..., :mask[0]], q.dtype.type(-np.inf), where=mask[1])
                pt -= lse_r[:, None]
                xp.exp(pt, out=pt)
                dst -= delta_r[:, None]
                dst *= pt
            if factors is not None:
                pt *= factors
            dv[g0:g1, c0:c1] += pt @ do_r
            dk[g0:g1, c0:c1] += dst @ q_r
            dq[g0:g1, r0:] += dst.swapaxes(-1, -2) @ kb       # dS K scale (kb holds the scale)
    dk *= sc
    return dq.reshape(b, h, tq, d), _sum_groups(dk, b, g, groups), _sum_groups(dv, b, g, groups)


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

    def __init__(self, q: TileTensor, k: TileTensor, causal: bool, q_offset: int = 0):
        self.q, self.k, self.causal, self.q_offset = q, k, causal, q_offset
        self.groups = q.shape[1] // k.shape[1]
        # positions of the query tiles among the keys: the kernels compare them with key offsets
        self.q_offs = tuple(o + q_offset for o in q.tiling.offsets(2))
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

    def one_tile_pairs(self) -> bool:
        """Whether the queries and the keys are one tile each along T and query head tile p reads
        exactly kv head tile p (and only it reads that): the backward is then one _sdpa_bwd
        task per (batch, head) tile."""
        return (len(self.q.chunks[2]) == 1 and len(self.k.chunks[2]) == 1
                and self.q.chunks[1] == tuple(n * self.groups for n in self.k.chunks[1]))

    def drop_at(self, p: float, b: int, h0: int) -> tuple:
        """The kernels' ``drop`` parameter for a task of batch tile ``b`` whose first query head is
        ``h0``: see _drop_factors."""
        B, H, T, _ = self.q.shape
        return (float(p), B, H, T, self.k.shape[2], int(self.q.tiling.offsets(0)[b]), int(h0),
                self.q_offset)

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
def _scale(scale, q: TileTensor) -> float:
    """The scores' scale: ``scale`` as given, or torch's default 1/sqrt(D) (D, q's head dim)."""
    return 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)


class ScaledDotProductAttention(Op):
    name = "scaled_dot_product_attention"

    def forward(self, q, k, v, causal, scale=None, q_offset=0, dropout=0.0, seed=None):
        """``dropout`` > 0 with ``seed``, the (1,) seed tile of the mask (attention_dropout_seed)."""
        _validate(q, k, v, causal, q_offset)
        scale = _scale(scale, q)
        lay = _Layout(q, k, causal, q_offset)
        out_grid = np.empty(q.tiling.grid, dtype=object)
        lse_tiling = Tiling(q.chunks[:3])
        lse_grid = np.empty(lse_tiling.grid, dtype=object)
        stat = acc_dtype(q.dtype)  # lse (and the backward's delta): float32 for float16 q
        for b, hq, i, _ in np.ndindex(*q.tiling.grid):
            shape = q.tiling.tile_shape((b, hq, i, 0))
            ins, params = lay.kv_inputs(k, v, b, hq, i)
            if dropout:
                ins, params = ins + [seed.grid[(0,)]], {**params, "drop": lay.drop_at(dropout, b, lay.qh_offs[hq])}
            o, lse = emit(_sdpa_fwd, [q.grid[b, hq, i, 0]] + ins, [(shape, q.dtype), (shape[:3], stat)],
                          op=self.name, causal=causal, scale=scale, **params)
            out_grid[b, hq, i, 0] = o
            lse_grid[b, hq, i] = lse
        out = TileTensor(q.tiling, q.dtype, out_grid)
        lse = TileTensor(lse_tiling, stat, lse_grid)
        return out, (q, k, v, out, lse, lay, scale, dropout, seed)

    def backward(self, ctx, g):
        q, k, v, out, lse, lay, scale, dropout, seed = ctx
        causal = lay.causal
        if g.chunks != out.chunks:
            raise TileError(WHERE, "the output gradient must have the tiles of the output",
                            f"{g.chunks} vs {out.chunks}")
        if _FUSED_BACKWARD and lay.one_tile_pairs():
            return self._fused_backward(q, k, v, out, lse, lay, scale, g, dropout, seed)
        delta = np.empty(lse.tiling.grid, dtype=object)
        for idx in np.ndindex(*lse.tiling.grid):
            delta[idx] = emit1(_sdpa_delta, [g.grid[idx + (0,)], out.grid[idx + (0,)]],
                               lse.tiling.tile_shape(idx), lse.dtype, op=f"{self.name}_bwd")

        dq_grid = np.empty(q.tiling.grid, dtype=object)
        for b, hq, i, _ in np.ndindex(*q.tiling.grid):
            ins, params = lay.kv_inputs(k, v, b, hq, i)
            ins = [q.grid[b, hq, i, 0], g.grid[b, hq, i, 0], lse.grid[b, hq, i], delta[b, hq, i]] + ins
            if dropout:
                ins, params = ins + [seed.grid[(0,)]], {**params, "drop": lay.drop_at(dropout, b, lay.qh_offs[hq])}
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
            drop = {}
            if dropout:  # (the first of this kv tile's query heads)
                ins, drop = ins + [seed.grid[(0,)]], {"drop": lay.drop_at(dropout, b, lay.kh_offs[hk] * lay.groups)}
            dk, dv = emit(_sdpa_dkv, ins, [(shape, k.dtype), (shape, v.dtype)], op=f"{self.name}_bwd",
                          n_i=len(queries), n_p=len(htiles), h_lo=h_lo, h_hi=h_hi, groups=lay.groups,
                          q_offs=tuple(lay.q_offs[i] for i in queries), k_off=lay.k_offs[j],
                          causal=causal, scale=scale, **drop)
            dk_grid[b, hk, j, 0] = dk
            dv_grid[b, hk, j, 0] = dv
        return (TileTensor(q.tiling, q.dtype, dq_grid), TileTensor(k.tiling, k.dtype, dk_grid),
                TileTensor(v.tiling, v.dtype, dv_grid))

    def _fused_backward(self, q, k, v, out, lse, lay, scale, g, dropout=0.0, seed=None):
        """One _sdpa_bwd task per (batch, head) tile pair: see _Layout.one_tile_pairs."""
        grids = [np.empty(t.tiling.grid, dtype=object) for t in (q, k, v)]
        for b, h, _, _ in np.ndindex(*q.tiling.grid):
            at = (b, h, 0, 0)
            ins = [q.grid[at], k.grid[at], v.grid[at], out.grid[at], g.grid[at], lse.grid[b, h, 0]]
            drop = {}
            if dropout:
                ins, drop = ins + [seed.grid[(0,)]], {"drop": lay.drop_at(dropout, b, lay.qh_offs[h])}
            grads = emit(_sdpa_bwd, ins, [(t.tiling.tile_shape(at), t.dtype) for t in (q, k, v)],
                         op=f"{self.name}_bwd", groups=lay.groups, q_off=lay.q_offs[0], causal=lay.causal,
                         scale=scale, **drop)
            for grid, grad in zip(grids, grads):
                grid[at] = grad
        return tuple(TileTensor(t.tiling, t.dtype, grid) for t, grid in zip((q, k, v), grids))


def _validate(q, k, v, causal: bool, q_offset: int = 0) -> None:
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
    if causal and k.shape[2] != q_offset + T:
        raise TileError(WHERE, "causal attention needs as many keys as queries, counting the q_offset "
                        "positions before them (q_offset + T == S)", f"T={T}, S={k.shape[2]}, q_offset={q_offset}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.chunks[3]) != 1:
            raise TileError(WHERE, f"the head dim D of {name} must be a single tile",
                            f"tiles {t.chunks[3]}")
    require_same_chunks(WHERE, "k and v", k.chunks, v.chunks)
    require_same_chunks(WHERE, "the batch dim of q and k/v", q.chunks[0], k.chunks[0])


_sdpa_op = ScaledDotProductAttention()
_NOT_CAUSAL = Default(False)


def scaled_dot_product_attention(q: TileTensor, k: TileTensor, v: TileTensor, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = _NOT_CAUSAL, *, scale: float | None = None,
                                 enable_gqa: bool | None = None, q_offset: int = 0,
                                 causal: bool | None = None) -> TileTensor:
    """``softmax(q k^T * scale + mask) v`` over tiles, torch's SDPA with its argument names.

    q: (B, H, T, D); k, v: (B, Hkv, S, D) with Hkv dividing H (query head h uses kv head
    h // (H // Hkv), torch's ``enable_gqa=True``, which may be passed; ``enable_gqa=False`` asks,
    as in torch, for as many kv heads as query heads); ``scale`` defaults to 1/sqrt(D). T, S, B and
    the heads may be tiled, D not. As in torch, attention is NOT causal unless ``is_causal=True``.
    ``attn_mask`` is torch's: a bool mask (True where a query attends to a key) or a float one
    (added to the scores), a TileTensor or a NumPy array broadcasting to (B, H, T, S), with
    ``is_causal=True`` too where given; a query that attends to no key gives zeros, as in torch.
    ``dropout_p`` (in [0, 1)) is torch's too: each attention weight is zeroed with that
    probability after the softmax and the others scaled by 1 / (1 - p), whenever it is given
    (as torch's functional form does: a module passes ``p if self.training else 0``); the mask
    is seeded from the first tiles of q and k and the module recording the call, and regenerated
    in the backward. Without a mask, dropout runs inside the attention kernels, on any tiling;
    with a mask the scores exist as tiles (the ops
    :func:`tilegraph.ops.attention_masked.masked_attention` records: memory B H T S, where the
    attention kernels never form them), with the same dropout mask; grouped-query heads are
    repeated to q's heads there. ``q_offset`` (tilegraph's own): with
    ``is_causal``, query row t sits at position ``q_offset + t`` and sees keys ``0..q_offset + t``,
    so ``S == q_offset + T`` (new positions against a KV cache of the ``q_offset`` before them);
    without ``is_causal`` it changes nothing. ``causal=`` is the older name of ``is_causal``, still
    accepted (with a DeprecationWarning); passing both is an error.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.ones((1, 1, 4, 2)), tiles=(1, 1, 2, 2))
    >>> scaled_dot_product_attention(x, x, x, is_causal=True).numpy()[0, 0, 3]
    array([1., 1.])
    """
    if causal is not None:
        warnings.warn("scaled_dot_product_attention(causal=...) is deprecated: use is_causal=... (torch's "
                      "name; the default is False, as in torch)", DeprecationWarning, stacklevel=2)
    is_causal = resolve_alias(WHERE, "is_causal", is_causal, "causal", causal)
    if isinstance(attn_mask, (bool, np.bool_)):
        raise TileError(WHERE, "attn_mask must be a mask tensor or None; a positional 4th argument is attn_mask, "
                        "as in torch: pass is_causal=True by name", f"attn_mask={attn_mask!r}")
    dropout_p = check_dropout(dropout_p, WHERE, "dropout_p")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TileError(WHERE, "is_causal must be a bool", f"{is_causal!r} ({type(is_causal).__name__})")
    if isinstance(q_offset, bool) or not isinstance(q_offset, (int, np.integer)) or q_offset < 0:
        raise TileError(WHERE, "q_offset must be a non-negative int", repr(q_offset))
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise TileError(WHERE, "scale must be None (1/sqrt(D)) or a finite number",
                        f"{scale!r} ({type(scale).__name__})")
    if enable_gqa is not None:
        if not isinstance(enable_gqa, (bool, np.bool_)):
            raise TileError(WHERE, "enable_gqa must be a bool", f"{enable_gqa!r} ({type(enable_gqa).__name__})")
        if (not enable_gqa and all(isinstance(t, TileTensor) and t.ndim == 4 for t in (q, k))
                and q.shape[1] != k.shape[1]):
            raise TileError(WHERE, "with enable_gqa=False q, k and v need the same number of heads (as in "
                            "torch); pass enable_gqa=True (or leave it out) for grouped-query attention",
                            f"q heads {q.shape[1]}, k heads {k.shape[1]}")
    if attn_mask is None and dropout_p > 0:
        from .attention_masked import attention_dropout_seed

        _validate(q, k, v, bool(is_causal), int(q_offset))
        return _sdpa_op(q, k, v, causal=bool(is_causal), scale=scale, q_offset=int(q_offset), dropout=dropout_p,
                        seed=attention_dropout_seed(q, k))
    if attn_mask is not None:
        from .attention_masked import masked_attention

        _validate(q, k, v, bool(is_causal), int(q_offset))
        return masked_attention(q, k, v, attn_mask, causal=bool(is_causal),
                                scale=_scale(scale, q),
                                q_offset=int(q_offset), dropout_p=dropout_p)
    return _sdpa_op(q, k, v, causal=bool(is_causal), scale=scale, q_offset=int(q_offset))


# --------------------------------------------------------------------------------- KV cache ----
def _append_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    return Cost(0.0, 2.0 * numel(out_shapes[0]) * itemsize)


@kernel("kv_cache_append", cost=_append_cost)
def _kv_cache_append(*tiles):
    """Tiles (b, h, s_i, D) joined along the sequence dim: a cache tile grown by new positions."""
    return xp_of(tiles[0]).concatenate(tiles, axis=2)


def kv_cache_append(past: TileTensor | None, new: TileTensor, block: int) -> TileTensor:
    """Keys (or values) ``past`` (B, H, S, D) followed by ``new`` (B, H, T, D) along the sequence dim.

    Past tiles are reused as they are, wherever they live; only past's last tile may grow: new
    positions are copied into it while it holds fewer than ``block`` rows, so decoding one token
    at a time copies at most one ``block``-row tile per step (never the whole cache) and the
    cache keeps about S / block tiles instead of one per token. The rest of ``new`` keeps its own
    tiles. B, H and D must be tiled as in ``past``. Inference only: no gradient flows through.

    >>> import numpy as np, tilegraph as tg
    >>> a = tg.from_numpy(np.zeros((1, 1, 3, 2)), tiles=(1, 1, 2, 2))
    >>> kv_cache_append(a, tg.from_numpy(np.ones((1, 1, 1, 2))), block=4).chunks[2]
    (2, 2)
    """
    where = "tilegraph.ops.attention.kv_cache_append"
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise TileError(where, "block must be a positive int", repr(block))
    for name, t in (("past", past), ("new", new)):
        if t is not None or name == "new":
            require_tensor(t, where, name)
            if t.ndim != 4:
                raise TileError(where, f"{name} must have 4 dims (B, heads, seq, D)", f"shape {t.shape}")
    if past is None:
        return new
    require_same_dtype(where, past=past, new=new)
    for d, what in ((0, "batch"), (1, "head"), (3, "head dim")):
        require_same_chunks(where, f"the {what} dim of past and new", past.chunks[d], new.chunks[d])
    # One entry per sequence tile of the result: [rows, grid columns (B tiles, H tiles, 1, 1) of
    # the tiles it joins]; an entry of several columns becomes one appended tile.
    seq: list[list] = [[n, [past.grid[:, :, j:j + 1]]] for j, n in enumerate(past.chunks[2])]
    for j, n in enumerate(new.chunks[2]):
        col = new.grid[:, :, j:j + 1]
        if seq[-1][0] + n <= block:
            seq[-1][0] += n
            seq[-1][1].append(col)
        else:
            seq.append([n, [col]])
    chunks = list(past.chunks)
    chunks[2] = tuple(n for n, _ in seq)
    tiling = Tiling(chunks)
    grid = np.empty(tiling.grid, dtype=object)
    for j, (n, cols) in enumerate(seq):
        if len(cols) == 1:
            grid[:, :, j:j + 1] = cols[0]
            continue
        for b, h in np.ndindex(*tiling.grid[:2]):
            shape = (past.chunks[0][b], past.chunks[1][h], n, past.shape[3])
            grid[b, h, j, 0] = emit1(_kv_cache_append, [c[b, h, 0, 0] for c in cols], shape, past.dtype,
                                     op="kv_cache_append")
    return TileTensor(tiling, past.dtype, grid)


# ----------------------------------------------------------- decoding at a position in a tile ----
# A decoding step whose graph holds no position: the position is the value of a one-tile (1,)
# int64 tensor, and the last cache tile has room for ``block`` rows (zeros past the positions
# written), so the same recorded and planned graph runs token after token with new values in its
# leaves (tilegraph.models.Decoder): recording and planning were about half of a GPT-2 token.
def _position(pos) -> int:
    """The position a (1,) int tile holds (read on the host: one wait on a GPU)."""
    return int(to_host(pos).reshape(-1)[0])


def _sdpa_at_gpu(q, *tiles, n_k, n_h, heads, k_offs, scale):
    """The GPU version reads every key it is given (a mask then zeroes their weights, and 0 times
    what a row not written yet holds need not be 0): the keys after the position are cut off first."""
    *kv, pos = tiles
    p = _position(pos) + q.shape[2] - 1               # the last query's position
    keep = [j for j, o in enumerate(k_offs) if o <= p]
    ks, vs = kv[:n_k * n_h], kv[n_k * n_h:]
    kv = [t[j * n_h + i][:, :, :p + 1 - k_offs[j]] for t in (ks, vs) for j in keep for i in range(n_h)]
    return _sdpa_fwd_gpu(q, *kv, n_k=len(keep), n_h=n_h, heads=heads, q_off=p - q.shape[2] + 1,
                         k_offs=tuple(k_offs[j] for j in keep), causal=True, scale=scale)[0]


@kernel("sdpa_at", cost=_attn_cost(4.0, 1), gpu=_sdpa_at_gpu)
def _sdpa_at(q, *tiles, n_k, n_h, heads, k_offs, scale):
    """_sdpa_fwd's output for a q tile whose first row sits at the position the last input holds:
    keys after it (the unwritten rows of the last cache tile among them) are never read."""
    *kv, pos = tiles
    return _sdpa_fwd.fn(q, *kv, n_k=n_k, n_h=n_h, heads=heads, q_off=_position(pos), k_offs=k_offs, causal=True,
                        scale=scale)[0]


def sdpa_at(q: TileTensor, k: TileTensor, v: TileTensor, position: TileTensor, *, scale: float | None = None) -> TileTensor:
    """Causal attention of queries q (B, H, T, D), one sequence tile, whose first row sits at the
    position held by ``position`` (a one-tile (1,) int64 TileTensor), against keys and values
    (B, Hkv, S, D) of which only those up to each query's position are read: S may run past the
    last query (room of a cache tile not yet written). Inference only: no gradient flows through.

    >>> import numpy as np, tilegraph as tg
    >>> kv = np.arange(8.0).reshape(1, 1, 4, 2)              # positions 2 and 3: room not written yet
    >>> x, q = tg.from_numpy(kv, tiles=(1, 1, 2, 2)), tg.from_numpy(kv[:, :, 1:2])
    >>> sdpa_at(q, x, x, tg.from_numpy(np.array([1]))).numpy()[0, 0, 0].round(4)
    array([1.9983, 2.9983])
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("position", position)):
        require_tensor(t, WHERE, name)
    if position.shape != (1,) or position.dtype.kind not in "iu":
        raise TileError(WHERE, "position must be an int TileTensor of shape (1,)", f"{position.dtype} {position.shape}")
    _validate(q, k, v, False)
    if len(q.chunks[2]) != 1:
        raise TileError(WHERE, "sdpa_at takes queries in one sequence tile", f"tiles {q.chunks[2]}")
    scale = _scale(scale, q)
    lay = _Layout(q, k, False)
    pos = position.grid[0]
    grid = np.empty(q.tiling.grid, dtype=object)
    for b, hq, i, _ in np.ndindex(*q.tiling.grid):
        htiles, heads = lay.kv_heads_for(hq)
        keys = range(len(k.chunks[2]))
        ins = [q.grid[b, hq, i, 0]] + [k.grid[b, p, j, 0] for j in keys for p in htiles]
        ins += [v.grid[b, p, j, 0] for j in keys for p in htiles] + [pos]
        grid[b, hq, i, 0] = emit1(_sdpa_at, ins, q.tiling.tile_shape((b, hq, i, 0)), q.dtype,
                                  op="scaled_dot_product_attention", n_k=len(keys), n_h=len(htiles), heads=heads,
                                  k_offs=tuple(lay.k_offs), scale=scale)
    return TileTensor(q.tiling, q.dtype, grid)


@kernel("kv_cache_write", cost=_append_cost)
def _kv_cache_write(*tiles, rows, off):
    """A cache tile of ``rows`` rows starting at position ``off``: the old tile (if given; zeros
    after it) with the new position's keys written at the row the position tile says."""
    *old, new, pos = tiles
    xp = xp_of(new)
    row = _position(pos) - off
    if not 0 <= row <= rows - new.shape[2]:
        raise TileError("tilegraph.ops.attention.kv_cache_write", f"a position in this cache tile [{off}, {off + rows})",
                        f"position {row + off}")
    out = xp.zeros(new.shape[:2] + (rows,) + new.shape[3:], dtype=new.dtype)
    if old:
        out[:, :, :old[0].shape[2]] = old[0]
    out[:, :, row:row + new.shape[2]] = new
    return out


@kernel("kv_cache_rows", cost=_append_cost)
def _kv_cache_rows(tile, rows):
    """The first ``rows`` rows of a cache tile (a tile with room, cut back to what it holds)."""
    return tile[:, :, :rows]


def kv_cache_write(past: TileTensor | None, new: TileTensor, position: TileTensor, length: int, block: int) -> TileTensor:
    """Keys (or values) ``past`` (B, H, S, D), of which the first ``length`` positions are written,
    with ``new`` (B, H, 1, D) written at position ``length`` (the value of ``position``, a one-tile
    (1,) int64 TileTensor, at run time). Past tiles are reused as they are; the write goes into the
    last tile where it has room (rows past ``length``, or fewer than ``block`` rows: it grows to
    ``block``), else into a new ``block``-row tile; the rows of that tile after the position are
    zeros. So within one tile the graph is the same for every position: only the position tile's
    value and the cache tile's change. Inference only: no gradient flows through.

    >>> import numpy as np, tilegraph as tg
    >>> k = kv_cache_write(None, tg.from_numpy(np.ones((1, 1, 1, 2))), tg.from_numpy(np.array([0])), 0, 4)
    >>> k.chunks[2], k.numpy()[0, 0, :, 0]
    ((4,), array([1., 0., 0., 0.]))
    """
    where = "tilegraph.ops.attention.kv_cache_write"
    require_tensor(new, where, "new")
    require_tensor(position, where, "position")
    if new.ndim != 4 or new.shape[2] != 1:
        raise TileError(where, "new must have shape (B, heads, 1, D)", f"shape {new.shape}")
    if position.shape != (1,) or position.dtype.kind not in "iu":
        raise TileError(where, "position must be an int TileTensor of shape (1,)", f"{position.dtype} {position.shape}")
    if past is None:
        chunks, old, off, rows = (), None, 0, block
    else:
        require_tensor(past, where, "past")
        require_same_dtype(where, past=past, new=new)
        for d, what in ((0, "batch"), (1, "head"), (3, "head dim")):
            require_same_chunks(where, f"the {what} dim of past and new", past.chunks[d], new.chunks[d])
        offs, last = past.tiling.offsets(2), past.chunks[2][-1]
        if not offs[-1] <= length <= past.shape[2]:
            raise TileError(where, f"length in the last tile of past [{offs[-1]}, {past.shape[2]}]", repr(length))
        if length < past.shape[2] or last < block:   # room in the last tile (or it may grow)
            chunks, old, off, rows = past.chunks[2][:-1], past.grid[:, :, -1], offs[-1], max(last, block)
        else:
            chunks, old, off, rows = past.chunks[2], None, past.shape[2], block
    tiling = Tiling(new.chunks[:2] + (chunks + (rows,),) + new.chunks[3:])
    grid = np.empty(tiling.grid, dtype=object)
    if past is not None:
        grid[:, :, :len(chunks)] = past.grid[:, :, :len(chunks)]
    pos = position.grid[0]
    for b, h in np.ndindex(*tiling.grid[:2]):
        ins = ([] if old is None else [old[b, h, 0]]) + [new.grid[b, h, 0, 0], pos]
        shape = (new.chunks[0][b], new.chunks[1][h], rows, new.shape[3])
        grid[b, h, -1, 0] = emit1(_kv_cache_write, ins, shape, new.dtype, op="kv_cache_append", rows=rows, off=off)
    return TileTensor(tiling, new.dtype, grid)


def kv_cache_rows(past: TileTensor, length: int) -> TileTensor:
    """``past`` cut to its first ``length`` positions, which must lie beyond all but its last tile
    (a cache whose last tile has room, before positions are appended to it another way)."""
    offs = past.tiling.offsets(2)
    if length == past.shape[2]:
        return past
    if not offs[-1] < length < past.shape[2]:
        raise TileError("tilegraph.ops.attention.kv_cache_rows", f"length in the last tile ({offs[-1]}, {past.shape[2]})",
                        repr(length))
    tiling = Tiling(past.chunks[:2] + (past.chunks[2][:-1] + (length - offs[-1],),) + past.chunks[3:])
    grid = np.empty(tiling.grid, dtype=object)
    grid[:, :, :-1] = past.grid[:, :, :-1]
    for b, h in np.ndindex(*tiling.grid[:2]):
        grid[b, h, -1, 0] = emit1(_kv_cache_rows, [past.grid[b, h, -1, 0]], tiling.tile_shape((b, h, len(offs) - 1, 0)),
                                  past.dtype, op="kv_cache_append", rows=length - offs[-1])
    return TileTensor(tiling, past.dtype, grid)
