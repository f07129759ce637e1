"""Attention with an explicit mask (torch's ``attn_mask``: an encoder's padding mask, a mask of
any pattern, an additive bias) or with dropout on the attention weights (``dropout_p``).
Written with the tile ops (``q k^T``, the mask, softmax, dropout, ``p v``), so the score matrix
(B, H, T, S) exists as tiles and autograd derives the backward; the attention kernels of
:mod:`tilegraph.ops.attention` never form it, and stay the path without a mask (with dropout
too: they drop the same weights inside, on any tiling).

Semantics are torch's: a bool mask holds True where a query attends to a key; a float mask is
added to the scores (``-inf`` where it must not); either broadcasts to (B, H, T, S). With
``is_causal=True`` as well, both apply. A query row that attends to no key gives zeros (and
zero gradients), as torch's SDPA gives them. A NumPy float mask is cast to the scores' dtype
first (as torch needs ``mask.to(q.dtype)``): what overflows it, -1e9 in float16, is -inf there
and masks out; NaN in it is refused. A TileTensor's NaN, known only when it runs, gives NaN, as
in torch. Grouped-query heads (k and v with fewer heads than
q) are repeated to q's heads here (torch's ``enable_gqa``), their gradients summed back.

Dropout (torch's ``dropout_p``) zeroes each attention weight with probability p after the softmax
and scales the others by 1 / (1 - p), with :func:`tilegraph.ops.dropout`'s counter-based mask:
element i of the (B, H, T, S) weights keeps ``keep_mask(seed, (B, H, T, S), p)[i]`` for a seed
that hashes the first tiles of q and k with the module the call is recorded in (so a replayed
step draws a new mask as its input changes, and a recomputed block the same mask again); the
backward regenerates the mask, none is stored.
"""

from __future__ import annotations

import numpy as np

from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor, from_numpy

from .dropout import _DROPOUT, _scope_seed, seed_tensor
from .matmul import matmul
from .shape import expand, rechunk, reshape
from .softmax import softmax
from .where import logical_and, where

WHERE = "tilegraph.scaled_dot_product_attention"


def _mask_problem(attn_mask, dtype: np.dtype, target: tuple) -> str | None:
    """What is wrong with ``attn_mask`` for scores of ``target`` shape and ``dtype``, or None."""
    kind = attn_mask.dtype.kind
    if kind != "b" and kind != "f":
        return "a bool mask (True: attend) or a float one (added to the scores)"
    if kind == "f" and isinstance(attn_mask, TileTensor) and attn_mask.dtype != dtype:
        return f"a float mask of the scores' dtype, {dtype} (cast it: mask.to({dtype.name!r}))"
    try:
        fits = attn_mask.ndim <= 4 and np.broadcast_shapes(attn_mask.shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        return f"a mask that broadcasts to the scores' shape (B, H, T, S) = {target}"
    return None


def check_mask(attn_mask, dtype: np.dtype, target: tuple, where: str = WHERE, against: str = "") -> None:
    """Raise the TileError that says what is wrong with ``attn_mask`` (None: no mask) for scores of
    ``target`` shape (B, H, T, S) and ``dtype``: not a TileTensor nor a NumPy array, neither bool
    nor float, a float TileTensor of another dtype, a shape that does not broadcast to ``target``,
    NaN in a NumPy mask (a TileTensor's NaN, known only when it runs, gives NaN, as in torch).
    ``against`` ends the message's received part (what the target came from)."""
    if attn_mask is None:
        return
    if not isinstance(attn_mask, (TileTensor, np.ndarray)):
        raise TileError(where, "attn_mask must be a TileTensor or a NumPy array (bool: True where a query attends "
                        "to a key; float: added to the scores)", f"{type(attn_mask).__name__} {attn_mask!r:.60}")
    problem = _mask_problem(attn_mask, np.dtype(dtype), tuple(target))
    if problem is not None:
        raise TileError(where, f"attn_mask must be {problem}", f"attn_mask of shape {tuple(attn_mask.shape)} and "
                        f"dtype {attn_mask.dtype}{against}")
    if isinstance(attn_mask, np.ndarray) and attn_mask.dtype.kind == "f" and np.isnan(attn_mask).any():
        raise TileError(where, "attn_mask must be a float mask without NaN (-inf masks a score out)",
                        f"a mask holding NaN, of shape {tuple(attn_mask.shape)}")


def numpy_float_mask(mask: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A NumPy float mask in the scores' ``dtype``, as it is added to them: a value past the
    dtype's range (-1e9 in float16) becomes -inf and masks its score out, as torch's
    ``mask.to(q.dtype)`` makes it."""
    with np.errstate(over="ignore"):
        return np.asarray(mask).astype(dtype)


def _causal_keep(t: int, s: int, q_offset: int) -> np.ndarray:
    """(T, S): query t (at position q_offset + t) sees keys 0..q_offset + t."""
    return np.arange(s)[None, :] <= q_offset + np.arange(t)[:, None]


def _tiles_like(shape: tuple, chunks: tuple) -> tuple:
    """The tiles of a (1-padded, 4-D) mask of ``shape`` against scores of ``chunks``: a dim of one
    (broadcast) whole, the others as the scores'."""
    return tuple(None if n == 1 else c for n, c in zip(shape, chunks))


def _as_4d(a, shape: tuple):
    return a.reshape((1,) * (4 - len(shape)) + tuple(shape))


def _numpy_mask(mask: np.ndarray, dtype: np.dtype, causal: np.ndarray | None, chunks: tuple):
    """(keep, add) TileTensors from a NumPy mask: keep (bool) where a score may count, add (floats
    of ``dtype``, 0 where masked) to add to the scores; None where there is nothing to keep out or
    nothing to add."""
    mask = _as_4d(np.asarray(mask), np.shape(mask))
    add = None
    if mask.dtype.kind == "b":
        keep = mask
    else:
        mask = numpy_float_mask(mask, dtype)  # (what overflows the dtype is -inf: masked out, not NaN)
        keep = mask > -np.inf
        values = np.where(keep, mask, 0).astype(dtype)
        add = values if values.any() else None
        if keep.all():
            keep = None
    if causal is not None:
        keep = causal if keep is None else keep & causal
    out = []
    for a in (keep, add):
        out.append(None if a is None else from_numpy(np.ascontiguousarray(a), _tiles_like(a.shape, chunks)))
    return out


def _tile_mask(mask: TileTensor, causal: np.ndarray | None, chunks: tuple):
    """(keep, add) as :func:`_numpy_mask`, from a mask that is a TileTensor (a TileTensor keep,
    add; the mask's tiles matched to the scores' where they differ)."""
    if mask.ndim < 4:
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    want = _tiles_like(mask.shape, chunks)
    if any(w is not None and tuple(c) != tuple(w) for c, w in zip(mask.chunks, want)):
        mask = rechunk(mask, tuple(w if w is not None else c for w, c in zip(want, mask.chunks)), WHERE)
    if mask.dtype.kind == "b":
        keep, add = mask, None
    else:
        # ne, not gt: a NaN is kept and gives NaN, as in torch (gt made its row silently zeros)
        keep = mask.ne(-np.inf)
        add = where(keep, mask, 0.0)
    if causal is not None:
        c = _as_4d(causal, causal.shape)
        keep = logical_and(keep, from_numpy(np.ascontiguousarray(c), _tiles_like(c.shape, chunks)))
    return keep, add


def attention_dropout_seed(q: TileTensor, k: TileTensor) -> TileTensor:
    """The (1,) uint64 seed of the attention weights' dropout mask: a hash of the first tiles of
    ``q`` and ``k`` and of the module the call is recorded in (see the module doc)."""
    return seed_tensor(q, k, base=_scope_seed("attention_dropout"))


def _repeat_heads(t: TileTensor, heads: int) -> TileTensor:
    """k or v (B, Hkv, S, D) as (B, heads, S, D): query head h reads kv head h // (heads // Hkv)."""
    b, hkv, s, d = t.shape
    group = heads // hkv
    grouped = expand(reshape(t, (b, hkv, 1, s, d)), b, hkv, group, s, d)
    return reshape(grouped, (b, heads, s, d))


def masked_attention(q: TileTensor, k: TileTensor, v: TileTensor, attn_mask, *, causal: bool, scale: float,
                     q_offset: int = 0, dropout_p: float = 0.0) -> TileTensor:
    """``dropout(softmax(q k^T * scale + mask)) v`` for q (B, H, T, D), k and v (B, Hkv, S, D)
    with Hkv dividing H, checked by the caller (:func:`tilegraph.ops.scaled_dot_product_attention`)
    but for the mask; ``attn_mask`` None: no mask (the path of ``dropout_p > 0`` alone)."""
    B, H, T, D = q.shape
    S = k.shape[2]
    check_mask(attn_mask, q.dtype, (B, H, T, S), against=f", for q {q.shape} and k {k.shape}")
    seed = attention_dropout_seed(q, k) if dropout_p > 0 else None
    if k.shape[1] != H:  # grouped-query heads: each kv head serves H // Hkv query heads
        k, v = _repeat_heads(k, H), _repeat_heads(v, H)
    if tuple(k.chunks[1]) != tuple(q.chunks[1]):  # (the heads of q k^T go tile by tile)
        k = rechunk(k, (k.chunks[0], q.chunks[1], k.chunks[2], k.chunks[3]), WHERE)
        v = rechunk(v, (v.chunks[0], q.chunks[1], v.chunks[2], v.chunks[3]), WHERE)
    chunks = (q.chunks[0], q.chunks[1], q.chunks[2], k.chunks[2])
    keep_causal = _causal_keep(T, S, q_offset) if causal else None
    if isinstance(attn_mask, TileTensor):
        keep, add = _tile_mask(attn_mask, keep_causal, chunks)
    elif attn_mask is not None:
        keep, add = _numpy_mask(attn_mask, q.dtype, keep_causal, chunks)
    elif causal:  # dropout alone: the causal pattern is the mask
        keep, add = _numpy_mask(keep_causal, q.dtype, None, chunks)
    else:
        keep, add = None, None
    scores = matmul(q * float(scale), k, trans_b=True)     # (B, H, T, S)
    if add is not None:
        scores = scores + add
    if keep is None:
        probs = softmax(scores, -1)
    else:
        # masked scores at the dtype's lowest, not -inf: a row that sees no key then has a finite
        # softmax (uniform), which the keep mask zeroes, and no NaN reaches the gradients
        lowest = float(np.finfo(q.dtype).min)
        probs = softmax(where(keep, scores, lowest), -1)
        if attn_mask is not None:  # (causal alone leaves every row its first key: exp(lowest - max) is 0)
            probs = where(keep, probs, 0.0)
    if seed is not None:
        probs = _DROPOUT(probs, seed, p=float(dropout_p))
    return matmul(probs, v)                                 # (B, H, T, D)
