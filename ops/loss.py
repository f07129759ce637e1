"""Cross-entropy over logits whose vocabulary (last) dim may be split into several tiles.

Forward, per row tile:
1. one ``cross_entropy_stats`` kernel per vocab tile: the rows' local max ``m``, ``s = sum exp(x - m)``
   and the target's logit when the target falls in that tile (0 otherwise);
2. one ``cross_entropy_merge`` kernel: the log-sum-exp merge ``lse = M + log(sum_k s_k exp(m_k - M))``
   with ``M = max_k m_k``, and the loss per row ``lse - target_logit`` (0 for ignored rows);
3. for ``reduction="mean"``/``"sum"``: a tree of ``(loss sum, row count)`` partials ending in one
   kernel that writes the scalar loss.

Only ``lse`` per row (and the total count) is saved for the backward pass, never the softmax:
each logits tile's gradient ``(softmax - onehot(target)) * weight`` is one kernel call.
"""

from __future__ import annotations

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import (acc_dtype, elementwise_cost, new_tensor, numel, require_float, require_same_chunks,
                      require_tensor, xp_of)
from .embedding import check_index_range, require_integer
from .softmax import _finite_or_zero
from ._tree import merge_tree

__all__ = ["cross_entropy", "mse_loss", "mean_parts", "count_weighted", "add_totals"]

_WHERE = "tilegraph.cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


def check_reduction(reduction, where: str) -> str:
    """A loss's ``reduction``: one of :data:`_REDUCTIONS` (the ops and the nn loss modules)."""
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise TileError(where, f"reduction must be one of {_REDUCTIONS}", repr(reduction))
    return reduction
_CPU_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------------- kernels ----
def _stats_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n = numel(in_shapes[0])
    return Cost(4.0 * n, float(n * itemsize + 3 * numel(out_shapes[0]) * 8))


def _bwd_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n = numel(out_shapes[0])
    return Cost(4.0 * n, float(2 * n * itemsize))


def _ce_stats_xp(x, tgt, offset, smoothing=0.0, vocab=0):
    xp = xp_of(x)
    rows = tgt.shape
    x2 = x.reshape(-1, x.shape[-1]).astype(acc_dtype(x.dtype), copy=False)
    m = x2.max(axis=1)
    # a row that is -inf all over this tile (masked or padded classes) adds s = 0, not exp(nan)
    s = xp.exp(x2 - _finite_or_zero(xp, m)[:, None]).sum(axis=1)
    local = tgt.reshape(-1).astype(xp.int64, copy=False) - offset
    hit = (local >= 0) & (local < x2.shape[1])
    t = xp.take_along_axis(x2, xp.where(hit, local, 0)[:, None], axis=1)[:, 0]
    t = xp.where(hit, t, 0)
    if smoothing:
        t = _smoothed_target(t, x2, smoothing, vocab)
    return m.reshape(rows), s.reshape(rows), t.reshape(rows)


def _smoothed_target(t, x2, smoothing, vocab):
    """The target term of a label-smoothed loss, over this vocab tile: with the target
    distribution ``(1 - e) onehot + e / V``, the loss ``lse - sum_j q_j x_j`` needs
    ``(1 - e) x_target + e / V sum_j x_j``, which sums over the tiles as the target logit does."""
    return (1 - smoothing) * t + (smoothing / vocab) * x2.sum(axis=1)


#: rows per block of the CPU kernels: a block's temporary (rows x vocab tile) stays in the core's
#: cache while it is read back (about 512 KiB)
_BLOCK_BYTES = 1 << 19


def _block_rows(v: int, itemsize: int) -> int:
    return max(1, _BLOCK_BYTES // max(1, v * itemsize))


def _row_blocks(n: int, v: int, itemsize: int):
    step = _block_rows(v, itemsize)
    return ((i, min(i + step, n)) for i in range(0, n, step))


def _ce_stats_cpu(x, tgt, offset, smoothing=0.0, vocab=0):
    # NumPy's SIMD exp over blocks of rows held in cache: 6x the scalar-exp Numba loop this
    # replaced (and 2x the whole-tile NumPy expressions, whose temporaries leave the cache) on a
    # 1024 x 6283 float32 tile; the sums are NumPy's pairwise ones
    if x.dtype not in _CPU_DTYPES or x.size == 0:
        return _ce_stats_xp(x, tgt, offset, smoothing, vocab)
    rows = tgt.shape
    n, v = numel(rows), x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(n, v))
    m = x2.max(axis=1)
    m0 = _finite_or_zero(np, m)  # as _ce_stats_xp: a row -inf all over the tile adds s = 0
    s = np.empty(n, x2.dtype)
    buf = np.empty((min(n, _block_rows(v, x2.itemsize)), v), x2.dtype)
    for lo, hi in _row_blocks(n, v, x2.itemsize):
        b = buf[:hi - lo]
        np.subtract(x2[lo:hi], m0[lo:hi, None], out=b)
        np.exp(b, out=b)
        b.sum(axis=1, out=s[lo:hi])
    local = tgt.reshape(-1).astype(np.int64, copy=False) - offset
    hit = (local >= 0) & (local < v)
    t = np.where(hit, x2[np.arange(n), np.where(hit, local, 0)], 0).astype(x2.dtype, copy=False)
    if smoothing:
        t = _smoothed_target(t, x2, smoothing, vocab).astype(x2.dtype, copy=False)
    return m.reshape(rows), s.reshape(rows), t.reshape(rows)


def _ce_merge_xp(*tiles, n, vocab, ignore_index, reduction, out_dtype):
    ms, ss, ts, tgt = tiles[:n], tiles[n:2 * n], tiles[2 * n:3 * n], tiles[3 * n]
    xp = xp_of(ms[0])
    check_index_range(xp, tgt, vocab, _WHERE, "targets", allowed=ignore_index)
    big = ms[0]
    for m in ms[1:]:
        big = xp.maximum(big, m)
    total = ss[0] * xp.exp(ms[0] - big)
    for m, s in zip(ms[1:], ss[1:]):
        total += s * xp.exp(m - big)
    lse = big + xp.log(total)
    target_logit = ts[0]
    for t in ts[1:]:
        target_logit = target_logit + t
    keep = tgt != ignore_index
    loss = xp.where(keep, lse - target_logit, 0)
    if reduction == "none":
        return lse, loss.astype(out_dtype)
    part = xp.empty(2, dtype=np.float64)
    part[0] = loss.astype(np.float64).sum()
    part[1] = keep.sum()
    return lse, part


def _ce_total_xp(*parts):
    tot = parts[0].copy()
    for p in parts[1:]:
        tot += p
    return tot


def _ce_reduce_xp(*parts, reduction, out_dtype):
    xp = xp_of(parts[0])
    tot = _ce_total_xp(*parts)
    if reduction == "sum":
        loss = tot[0]
    else:  # mean over the rows that are not ignored; none left -> nan, as torch
        loss = xp.where(tot[1] > 0, tot[0] / xp.maximum(tot[1], 1), np.nan)
    return xp.asarray(loss, dtype=out_dtype).reshape(()), tot


def _row_weights(xp, tgt, g, tot, ignore_index, reduction, acc):
    """Per row: d loss / d (row loss), i.e. the cotangent (over the count for "mean"), 0 if ignored."""
    keep = tgt != ignore_index
    if reduction == "none":
        w = g.astype(acc)
    elif reduction == "sum":
        w = xp.broadcast_to(g.astype(acc), tgt.shape)
    else:
        count = tot[0][1]
        w = xp.broadcast_to(xp.where(count > 0, g / xp.maximum(count, 1), 0).astype(acc), tgt.shape)
    return xp.where(keep, w, 0).astype(acc).reshape(-1)


def _ce_bwd_xp(x, tgt, lse, g, *tot, offset, ignore_index, reduction, smoothing=0.0, vocab=0):
    # (softmax - q) * w with the target distribution q = (1 - e) onehot + e / V
    xp = xp_of(x)
    acc = lse.dtype
    w = _row_weights(xp, tgt, g, tot, ignore_index, reduction, acc)
    x2 = x.reshape(-1, x.shape[-1]).astype(acc, copy=False)
    p = xp.exp(x2 - lse.reshape(-1)[:, None])
    p *= w[:, None]
    if smoothing:
        p -= (w * (smoothing / vocab))[:, None]
    local = tgt.reshape(-1).astype(xp.int64, copy=False) - offset
    (r,) = xp.nonzero((local >= 0) & (local < x2.shape[1]))
    p[r, local[r]] -= w[r] * (1 - smoothing)
    return p.astype(x.dtype, copy=False).reshape(x.shape)


def _ce_bwd_cpu(x, tgt, lse, g, *tot, offset, ignore_index, reduction, smoothing=0.0, vocab=0):
    # exp(x - lse) * w over blocks of rows held in cache (NumPy's SIMD exp): 3x the scalar-exp
    # Numba loop this replaced on a 1024 x 6283 float32 tile
    if x.dtype not in _CPU_DTYPES or x.size == 0:
        return _ce_bwd_xp(x, tgt, lse, g, *tot, offset=offset, ignore_index=ignore_index, reduction=reduction,
                          smoothing=smoothing, vocab=vocab)
    w = _row_weights(np, tgt, g, tot, ignore_index, reduction, lse.dtype).astype(x.dtype, copy=False)
    n, v = w.shape[0], x.shape[-1]
    x2 = np.ascontiguousarray(x.reshape(n, v))
    lse2 = lse.reshape(-1).astype(x.dtype, copy=False)
    out = np.empty(x2.shape, x.dtype)
    for lo, hi in _row_blocks(n, v, x2.itemsize):
        o = out[lo:hi]
        np.subtract(x2[lo:hi], lse2[lo:hi, None], out=o)
        np.exp(o, out=o)
        o *= w[lo:hi, None]
        if smoothing:
            o -= (w[lo:hi] * x.dtype.type(smoothing / vocab))[:, None]
    local = tgt.reshape(-1).astype(np.int64, copy=False) - offset
    (r,) = np.nonzero((local >= 0) & (local < v))
    out[r, local[r]] -= w[r] * x.dtype.type(1 - smoothing) if smoothing else w[r]
    return out.reshape(x.shape)


_ce_stats_k = kernel("cross_entropy_stats", cost=_stats_cost, cpu=_ce_stats_cpu)(_ce_stats_xp)
_ce_merge_k = kernel("cross_entropy_merge", cost=elementwise_cost(8))(_ce_merge_xp)
_ce_total_k = kernel("cross_entropy_total", cost=elementwise_cost(1))(_ce_total_xp)
_ce_reduce_k = kernel("cross_entropy_reduce", cost=elementwise_cost(1))(_ce_reduce_xp)
_ce_bwd_k = kernel("cross_entropy_bwd", cost=_bwd_cost, cpu=_ce_bwd_cpu)(_ce_bwd_xp)


# ---------------------------------------------------------------------------------------- ops ----
class CrossEntropy(Op):
    """Loss of logits (..., V) against integer targets (...); see :func:`cross_entropy`."""

    name = "cross_entropy"

    def forward(self, logits, targets, ignore_index, reduction, label_smoothing=0.0):
        acc = acc_dtype(logits.dtype)
        # only a smoothed loss passes the smoothing to the kernels: the plain one's are unchanged
        smooth = {"smoothing": label_smoothing, "vocab": logits.shape[-1]} if label_smoothing else {}
        vocab = logits.shape[-1]
        offsets = logits.tiling.offsets(logits.ndim - 1)
        n_v = logits.tiling.grid[-1]
        row_grid = targets.tiling.grid
        lse = np.empty(row_grid, dtype=object)
        rows_out = np.empty(row_grid, dtype=object)
        for r in np.ndindex(*row_grid):
            tgt = targets.grid[r]
            rows = tgt.shape
            stats = [emit(_ce_stats_k, [logits.grid[r + (k,)], tgt], [(rows, acc)] * 3, op="cross_entropy",
                          offset=offsets[k], **smooth) for k in range(n_v)]
            ms, ss, ts = zip(*stats)
            second = (rows, logits.dtype) if reduction == "none" else ((2,), np.float64)
            lse[r], rows_out[r] = emit(_ce_merge_k, [*ms, *ss, *ts, tgt], [(rows, acc), second],
                                       op="cross_entropy", n=n_v, vocab=vocab, ignore_index=ignore_index,
                                       reduction=reduction, out_dtype=str(logits.dtype))
        ctx = dict(logits=logits, targets=targets, lse=lse, tot=None, ignore_index=ignore_index,
                   reduction=reduction, smooth=smooth)
        if reduction == "none":
            return new_tensor(targets.tiling, logits.dtype, lambda r: rows_out[r]), ctx

        def merge(group: list, final: bool):  # the rows' (loss sum, count) totals, then the loss
            if not final:
                return emit1(_ce_total_k, group, (2,), np.float64, op="cross_entropy")
            return emit(_ce_reduce_k, group, [((), logits.dtype), ((2,), np.float64)], op="cross_entropy",
                        reduction=reduction, out_dtype=str(logits.dtype))

        loss, ctx["tot"] = merge_tree(list(rows_out.flat), merge)
        return new_tensor(Tiling(()), logits.dtype, lambda idx: loss), ctx

    def backward(self, ctx, g):
        return _ce_bwd_op(g, ctx["logits"], ctx["targets"], lse=ctx["lse"], tot=ctx["tot"],
                          ignore_index=ctx["ignore_index"], reduction=ctx["reduction"], smooth=ctx["smooth"]), None


class CrossEntropyBackward(Op):
    """Logits gradient of :class:`CrossEntropy`, one kernel per logits tile from the saved lse."""

    name = "cross_entropy_bwd"

    def forward(self, g, logits, targets, lse, tot, ignore_index, reduction, smooth=None):
        offsets = logits.tiling.offsets(logits.ndim - 1)
        if reduction == "none" and g.chunks != targets.chunks:  # pragma: no cover - autograd keeps tiles
            raise TileError("tilegraph.cross_entropy_bwd", "the cotangent must be tiled like the targets",
                            f"{g.chunks} vs {targets.chunks}")

        def fill(idx):
            r, k = idx[:-1], idx[-1]
            ins = [logits.grid[idx], targets.grid[r], lse[r], g.grid[r] if reduction == "none" else g.grid[()]]
            if reduction == "mean":
                ins.append(tot)
            return emit1(_ce_bwd_k, ins, logits.tiling.tile_shape(idx), logits.dtype, op="cross_entropy_bwd",
                         offset=offsets[k], ignore_index=ignore_index, reduction=reduction, **(smooth or {}))

        return new_tensor(logits.tiling, logits.dtype, fill), None


_ce_op = CrossEntropy()
_ce_bwd_op = CrossEntropyBackward()


# ------------------------------------------------- accumulation over micro-batches of a mean ----
def mean_parts(loss: TileTensor):
    """``(tot, rows)`` when ``loss`` is a :func:`cross_entropy` mean (``tot``: the ref of its
    float64 ``[loss sum, rows counted]``, ``rows``: how many targets it had, ignored ones included);
    None for any other loss. Gradient accumulation weights micro-batches by their counted rows
    with it, so that k micro-batches give one batch's token-weighted mean (see :func:`count_weighted`)."""
    rec = getattr(loss, "_record", None)
    if rec is None or rec.op is not _ce_op or rec.ctx["reduction"] != "mean":
        return None
    return rec.ctx["tot"], numel(rec.ctx["targets"].shape)


def _count_weighted_xp(g, *ins, rows, mode):
    """``mode`` "first": ``g * c/rows``; "add": ``acc + g * c/rows``; "last": ``(acc + g * c/rows)
    * rows / N`` (0 when N is), where ``c`` is this micro-batch's count of rows (``tot[1]``) and
    ``N`` the batch's (the accumulated ``[sum, count]`` plus this one's)."""
    xp = xp_of(g)
    tot = ins[-1]
    out = g * (tot[1] / rows).astype(g.dtype)
    if mode == "first":
        return out
    out += ins[0]
    if mode == "last":
        n = ins[1][1] + tot[1]
        out *= xp.where(n > 0, rows / xp.maximum(n, 1), 0).astype(g.dtype)
    return out


_count_weighted_k = kernel("mean_count_weighted", cost=elementwise_cost(3))(_count_weighted_xp)


def count_weighted(g: TileTensor, tot, rows: int, mode: str, acc: TileTensor | None = None, acc_tot=None) -> TileTensor:
    """One micro-batch's gradient ``g`` of a mean over its counted rows, weighted for accumulation.

    The accumulator holds ``sum_j g_j c_j / rows`` (each micro-batch's gradient of its sum, over
    the rows one has, so nothing grows with the batch: float16 stays in range, and with nothing
    ignored every weight is exactly 1); the last micro-batch divides by ``N / rows``. The result is
    the gradient of the batch's mean over all its counted rows, whatever each micro-batch counted:
    a micro-batch whose rows are all ignored adds nothing (its own mean is nan)."""
    def ins(idx):  # g, then the accumulator ("add", "last") and its totals ("last"), then tot
        held = [] if mode == "first" else [acc.grid[idx]] + ([acc_tot] if mode == "last" else [])
        return [g.grid[idx], *held, tot]

    return new_tensor(g.tiling, g.dtype, lambda idx: emit1(_count_weighted_k, ins(idx), g.tiling.tile_shape(idx),
                                                            g.dtype, op="accumulate", rows=int(rows), mode=mode))


def add_totals(a, b):
    """The ref of ``a + b`` for two ``[loss sum, rows counted]`` refs."""
    return emit1(_ce_total_k, [a, b], (2,), np.float64, op="accumulate")


def _targets_like(logits: TileTensor, targets) -> TileTensor:
    """``targets`` as a TileTensor: one as it is; an array (NumPy, a list, a CPU torch tensor) of
    the shape of ``logits`` without its class dim, tiled as those dims of ``logits`` are (as torch
    takes its targets: a model's logits of NumPy ids, the ids shifted, need no tiling of their own)."""
    if isinstance(targets, TileTensor):
        return targets
    from tilegraph._tensor import _host_array, from_numpy

    array = _host_array(targets, f"{_WHERE} targets")
    if array.dtype.kind not in "iu":
        raise TileError(_WHERE, "targets must be a TileTensor or an array of integers (class indices: NumPy, a "
                        "list, a torch tensor)", f"{type(targets).__name__} of dtype {array.dtype}")
    if array.shape != logits.shape[:-1]:
        raise TileError(_WHERE, "targets must have the shape of logits without the last (class) dim",
                        f"logits {logits.shape}, targets {array.shape} ({type(targets).__name__})")
    return from_numpy(array, logits.chunks[:-1])


def cross_entropy(logits: TileTensor, targets: TileTensor, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0, *, weight=None) -> TileTensor:
    """Cross-entropy of ``logits`` (..., V), classes in the LAST dim, against integer ``targets`` (...)
    tiled like the leading dims of ``logits`` (an integer NumPy array or torch tensor is tiled so);
    V may span several tiles.

    Rows whose target equals ``ignore_index`` count for nothing. ``reduction``: ``"mean"`` (over the
    rows not ignored; nan when all are, as torch), ``"sum"`` (both give a scalar of shape ()), or
    ``"none"`` (shape of ``targets``, 0 at ignored rows). ``label_smoothing`` in [0, 1] mixes the
    target with the uniform distribution over the V classes, as torch's: each row's loss is
    ``(1 - e) (lse - x_target) + e (lse - mean_j x_j)``. Targets outside ``[0, V)`` that are not
    ``ignore_index`` raise a TileError when the graph runs. Unlike torch, whose class dim is dim 1,
    the classes are last: torch's equivalent is ``F.cross_entropy(logits.reshape(-1, V),
    targets.reshape(-1))``. Class weights (torch's ``weight=``, its third positional argument, where
    tilegraph's is ``ignore_index``) are not supported: the TileError shows the rows' weighted mean
    to write instead.

    >>> import numpy as np, tilegraph as tg
    >>> from tilegraph.ops.loss import cross_entropy
    >>> logits = tg.from_numpy(np.zeros((2, 4)), tiles=(1, 3))
    >>> round(float(cross_entropy(logits, tg.from_numpy(np.array([1, 3]), tiles=1)).numpy()), 6)  # log(4)
    1.386294
    """
    require_tensor(logits, _WHERE, "logits")
    if weight is None and _is_weights(ignore_index):
        weight = ignore_index  # torch's third positional argument
    _no_class_weights(weight)
    targets = _targets_like(logits, targets)
    require_float(logits, _WHERE, "logits")
    require_integer(targets, _WHERE, "targets")
    check_reduction(reduction, _WHERE)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TileError(_WHERE, "ignore_index must be an int", repr(ignore_index))
    if (isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float, np.integer, np.floating))
            or not 0 <= label_smoothing <= 1):
        raise TileError(_WHERE, "label_smoothing must be a number in [0, 1] (as torch's)", f"{label_smoothing!r:.60}")
    if logits.ndim < 1:
        raise TileError(_WHERE, "logits need a class dim (..., V)", f"shape {logits.shape}")
    if targets.shape != logits.shape[:-1]:
        raise TileError(_WHERE, "targets must have the shape of logits without the last (class) dim",
                        f"logits {logits.shape}, targets {targets.shape}")
    require_same_chunks(_WHERE, "targets and the leading dims of logits", targets.chunks, logits.chunks[:-1],
                        f" (cut the targets as the logits' rows: targets.rechunk({logits.chunks[:-1]}); in a step, "
                        "give the inputs and the targets the same row tiles in batch_tiles)")
    return _ce_op(logits, targets, ignore_index=int(ignore_index), reduction=reduction,
                  label_smoothing=float(label_smoothing))


def _is_weights(x) -> bool:
    """Whether ``x``, passed as ``ignore_index``, is torch's third positional argument (``weight``)."""
    return isinstance(x, (TileTensor, list, tuple)) or getattr(x, "ndim", 0) >= 1


def _no_class_weights(weight) -> None:
    """A TileError for class weights (not supported) that shows what computes torch's weighted mean."""
    if weight is None:
        return
    shape = weight.shape if isinstance(weight, TileTensor) else tuple(np.shape(weight))
    raise TileError(_WHERE, "class weights (torch's weight=, its third positional argument; tilegraph's third is "
                    "ignore_index) are not supported: weight each row's loss instead, w_rows = w[targets] in NumPy "
                    "(0 for ignored rows), then (tg.cross_entropy(logits, targets, reduction='none') * "
                    "tg.from_numpy(w_rows.astype(logits.dtype), logits.chunks[:-1])).sum() / w_rows.sum(), torch's "
                    "weighted mean",
                    f"weight: {type(weight).__name__} of shape {shape}")


def mse_loss(input: TileTensor, target, reduction: str = "mean") -> TileTensor:
    """torch's ``F.mse_loss``: the squared differences of ``input`` and ``target`` (of one shape and
    dtype), their mean (``"mean"``), sum (``"sum"``, both of shape ()) or each (``"none"``).
    ``target`` may be tiled otherwise than ``input`` (it is rechunked to ``input``'s tiles: a
    batch given without ``batch_tiles`` against a tiled model's output), or be an array (NumPy, a
    CPU torch tensor), tiled as ``input``.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.array([[1.0, 2.0, 4.0]]), tiles=(1, 2))
    >>> float(tg.mse_loss(x, np.zeros((1, 3))))
    7.0
    """
    where = "tilegraph.mse_loss"
    require_tensor(input, where, "input")
    require_float(input, where, "input")
    check_reduction(reduction, where)
    if not isinstance(target, TileTensor):
        from tilegraph._tensor import _host_array, from_numpy

        array = _host_array(target, f"{where} target")
        if array.shape != input.shape:
            raise TileError(where, "target must have the shape of input",
                            f"input {input.shape}, target {array.shape} ({type(target).__name__})")
        target = from_numpy(array, input.chunks)
    if target.shape != input.shape:
        raise TileError(where, "target must have the shape of input", f"input {input.shape}, target {target.shape}")
    if target.dtype != input.dtype:
        raise TileError(where, f"target must have the dtype of input, {input.dtype} (cast it: "
                        f"a.astype(np.{input.dtype}) for an array, t.to('{input.dtype}') for a TileTensor)",
                        f"target of dtype {target.dtype}")
    if target.chunks != input.chunks:
        from .shape import rechunk

        target = rechunk(target, input.chunks, where)
    d = input - target
    return d * d if reduction == "none" else (d * d).mean() if reduction == "mean" else (d * d).sum()
