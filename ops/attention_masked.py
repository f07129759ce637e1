"""Attention with an explicit mask (torch's ``attn_mask``): an encoder's padding mask, a mask of
any pattern, an additive bias. Written with the tile ops (``q k^T``, the mask, softmax, ``p v``),
so the score matrix (B, H, T, S) exists as tiles and autograd derives the backward; the causal
attention of :mod:`tilegraph.ops.attention` never forms it, and stays the path without a mask.

Semantics are torch's: a bool mask holds True where a query attends to a key; a float mask is
added to the scores (``-inf`` where it must not); either broadcasts to (B, H, T, S). With
``is_causal=True`` as well, both apply. A query row that attends to no key gives zeros (and
zero gradients), as torch's SDPA gives them.
"""

from __future__ import annotations

import numpy as np

from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor, from_numpy

from .matmul import matmul
from .shape import rechunk
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
        keep = mask > -np.inf
        if np.isnan(mask).any():
            raise TileError(WHERE, "a float mask without NaN (-inf masks a score out)", "a mask holding NaN")
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
        keep = mask.gt(-np.inf)
        add = where(keep, mask, 0.0)
    if causal is not None:
        c = _as_4d(causal, causal.shape)
        keep = logical_and(keep, from_numpy(np.ascontiguousarray(c), _tiles_like(c.shape, chunks)))
    return keep, add


def masked_attention(q: TileTensor, k: TileTensor, v: TileTensor, attn_mask, *, causal: bool, scale: float,
                     q_offset: int = 0) -> TileTensor:
    """``softmax(q k^T * scale + mask) v`` for q (B, H, T, D), k and v (B, H, S, D), checked by
    the caller (:func:`tilegraph.ops.scaled_dot_product_attention`) but for the mask and the heads."""
    B, H, T, D = q.shape
    S = k.shape[2]
    if k.shape[1] != H:
        raise TileError(WHERE, "attn_mask with as many kv heads as query heads (grouped-query attention takes "
                        "no mask yet: repeat k's and v's heads)", f"q heads {H}, k heads {k.shape[1]}")
    if not isinstance(attn_mask, (TileTensor, np.ndarray)):
        raise TileError(WHERE, "attn_mask must be a TileTensor or a NumPy array (bool: True where a query attends "
                        "to a key; float: added to the scores)", f"{type(attn_mask).__name__} {attn_mask!r:.60}")
    problem = _mask_problem(attn_mask, q.dtype, (B, H, T, S))
    if problem is not None:
        raise TileError(WHERE, f"attn_mask must be {problem}", f"attn_mask of shape {tuple(attn_mask.shape)} and "
                        f"dtype {attn_mask.dtype}, for q {q.shape} and k {k.shape}")
    if tuple(k.chunks[1]) != tuple(q.chunks[1]):  # (the heads of q k^T go tile by tile)
        k = rechunk(k, (k.chunks[0], q.chunks[1], k.chunks[2], k.chunks[3]), WHERE)
        v = rechunk(v, (v.chunks[0], q.chunks[1], v.chunks[2], v.chunks[3]), WHERE)
    chunks = (q.chunks[0], q.chunks[1], q.chunks[2], k.chunks[2])
    keep_causal = _causal_keep(T, S, q_offset) if causal else None
    if isinstance(attn_mask, TileTensor):
        keep, add = _tile_mask(attn_mask, keep_causal, chunks)
    else:
        keep, add = _numpy_mask(attn_mask, q.dtype, keep_causal, chunks)
    scores = matmul(q * float(scale), k, trans_b=True)     # (B, H, T, S)
    if add is not None:
        scores = scores + add
    if keep is None:
        return matmul(softmax(scores, -1), v)
    # masked scores at the dtype's lowest, not -inf: a row that sees no key then has a finite
    # softmax (uniform), which the keep mask zeroes, and no NaN reaches the gradients
    lowest = float(np.finfo(q.dtype).min)
    probs = where(keep, softmax(where(keep, scores, lowest), -1), 0.0)
    return matmul(probs, v)                                 # (B, H, T, D)
