"""Layer norm and RMS norm over the last dim, which may be split into several tiles.

Both share one :class:`Norm` op: layer norm centres the rows (``center=True``), RMS norm does not.
When the last dim is one tile (the common case) the forward and the backward are each ONE fused
kernel per tile; the backward kernel also returns that tile's partial weight/bias gradients, which
are summed over the row tiles afterwards. When the last dim is split, every tile computes partial
statistics (count, mean, M2 for layer norm; sum of squares for RMS norm), one kernel per row group
merges them (a tree above :data:`FAN_IN` tiles), and one kernel per tile normalises; the backward
merges ``sum(g w xhat)`` (and ``sum(g w)``) the same way.

The fused CPU kernels are Numba loops (a row at a time, statistics accumulated in float64): the
NumPy expressions take several passes over the tile and are several times slower.

>>> import numpy as np, tilegraph as tg
>>> from tilegraph.ops.norm import layer_norm
>>> x = tg.from_numpy(np.array([[1.0, 2.0, 3.0, 6.0]]), tiles=(1, 2))
>>> layer_norm(x, (4,)).numpy().round(3)
array([[-1.069, -0.535,  0.   ,  1.604]])
"""

from __future__ import annotations

import numbers

import numba
import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import emit, emit1, kernel
from tilegraph._tensor import TileTensor, Tiling

from ._common import acc_dtype, new_tensor, require_float, require_same_chunks, require_tensor, xp_of
from ._gpu import ROW_THREADS, gpu_or_generic, row_kernel, sum_keepdims
from ._tree import merge_tree
from .softmax import row_groups, rowwise_cost

__all__ = ["layer_norm", "rms_norm"]


# -------------------------------------------------------------------------- kernel arguments ----
# Kernels take the data tile(s) first, then the row statistics (``mean, rstd`` for layer norm,
# ``rstd`` for RMS norm; shape (..., 1)), then any merged sums, then the weight and bias tiles
# that are present.
def _unpack(rest, center, n_sums=0, has_w=False, has_b=False):
    """Split ``rest`` into ``(mean, rstd, sums, w, b)``; absent ones are ``None``."""
    rest = list(rest)
    mean = rest.pop(0) if center else None
    rstd = rest.pop(0)
    sums = [rest.pop(0) for _ in range(n_sums)]
    w = rest.pop(0) if has_w else None
    b = rest.pop(0) if has_b else None
    return mean, rstd, sums, w, b


def _row_stats(mean, rstd, center):
    return (mean, rstd) if center else (rstd,)


def _param_grads(ga, xhat, grad_w: bool, grad_b: bool) -> list:
    """This tile's partial weight and bias gradients (those asked for): sums over all rows."""
    n = ga.shape[-1]
    outs = []
    if grad_w:
        outs.append((ga * xhat).reshape(-1, n).sum(axis=0))
    if grad_b:
        outs.append(ga.reshape(-1, n).sum(axis=0))
    return outs


def _one_or_tuple(outs):
    return outs[0] if len(outs) == 1 else tuple(outs)


# ------------------------------------------------------------------- fused kernels (NumPy/CuPy) ----
def _norm_fwd_xp(x, *wb, eps, center, has_w, has_b):
    """Whole rows in one tile: returns ``y`` and the row statistics."""
    xp = xp_of(x)
    w = wb[0] if has_w else None
    b = wb[int(has_w)] if has_b else None
    xa = x.astype(acc_dtype(x.dtype), copy=False)
    mean = xa.mean(axis=-1, keepdims=True) if center else None
    xc = xa - mean if center else xa
    rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    y = xc * rstd
    if has_w:
        y *= w
    if has_b:
        y += b
    return (y.astype(x.dtype, copy=False),) + _row_stats(mean, rstd, center)


def _norm_bwd_xp(x, g, *rest, center, has_w, grad_w, grad_b):
    """Whole rows in one tile: returns ``dx`` and this tile's partial ``dweight``/``dbias`` (C,),
    each where asked for (``grad_w``, ``grad_b``: the parameter needs a gradient; ``has_w``: the
    weight is there, which ``dx`` reads)."""
    mean, rstd, _, w, _ = _unpack(rest, center, has_w=has_w)
    xa, ga = x.astype(rstd.dtype, copy=False), g.astype(rstd.dtype, copy=False)
    xhat = (xa - mean) * rstd if center else xa * rstd
    gw = ga * w if has_w else ga
    dx = gw - xhat * (gw * xhat).mean(axis=-1, keepdims=True)
    if center:
        dx -= gw.mean(axis=-1, keepdims=True)
    dx *= rstd
    return _one_or_tuple([dx.astype(x.dtype, copy=False), *_param_grads(ga, xhat, grad_w, grad_b)])


# ---------------------------------------------------------------------- fused kernels (Numba) ----
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # vectorised row sums; keeps inf/nan semantics
# error_model="numpy": a division by 0 gives inf (then NaN), as torch's and the tiled path's, where
# Python's ZeroDivisionError came out of the kernel (eps=0 with a constant row, or a zero row for RMS)


@numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _nb_norm_fwd(x, w, b, y, mean_out, rstd_out, eps, center, has_w, has_b):
    rows, n = x.shape
    for r in range(rows):
        mu = 0.0
        if center:
            s = 0.0
            for j in range(n):
                s += x[r, j]
            mu = s / n
            mean_out[r] = mu
        q = 0.0
        for j in range(n):
            d = x[r, j] - mu
            q += d * d
        rs = 1.0 / np.sqrt(q / n + eps)
        rstd_out[r] = rs
        # one loop per case, so that each one vectorises
        if has_w and has_b:
            for j in range(n):
                y[r, j] = (x[r, j] - mu) * rs * w[j] + b[j]
        elif has_w:
            for j in range(n):
                y[r, j] = (x[r, j] - mu) * rs * w[j]
        elif has_b:
            for j in range(n):
                y[r, j] = (x[r, j] - mu) * rs + b[j]
        else:
            for j in range(n):
                y[r, j] = (x[r, j] - mu) * rs


@numba.njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _nb_norm_bwd(x, g, mean, rstd, w, dx, dw, db, center, has_w, grad_w, grad_b):
    rows, n = x.shape
    gw = np.empty(n, dtype=np.float64)
    xh = np.empty(n, dtype=np.float64)
    for r in range(rows):
        mu = mean[r] if center else 0.0
        rs = rstd[r]
        s1 = 0.0
        s2 = 0.0
        for j in range(n):
            xh[j] = (x[r, j] - mu) * rs
            gw[j] = g[r, j] * w[j] if has_w else g[r, j]
            s1 += gw[j] * xh[j]
            s2 += gw[j]
        c1 = s1 / n
        c2 = s2 / n if center else 0.0
        for j in range(n):
            dx[r, j] = rs * (gw[j] - c2 - xh[j] * c1)
        if grad_w:
            for j in range(n):
                dw[j] += g[r, j] * xh[j]
        if grad_b:
            for j in range(n):
                db[j] += g[r, j]


_NUMBA_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _rows(a):
    """``a`` as a C-contiguous (rows x last dim) matrix (no copy where it is one; NumPy or CuPy)."""
    return xp_of(a).ascontiguousarray(a).reshape(-1, a.shape[-1])


def _vec(a, dtype):
    """A contiguous 1-d array for Numba; an empty one stands for an absent input."""
    return np.empty(0, dtype) if a is None else np.ascontiguousarray(a).reshape(-1)


def _norm_fwd_cpu(x, *wb, eps, center, has_w, has_b):
    if x.dtype not in _NUMBA_DTYPES:
        return _norm_fwd_xp(x, *wb, eps=eps, center=center, has_w=has_w, has_b=has_b)
    w = wb[0] if has_w else None
    b = wb[int(has_w)] if has_b else None
    x2 = _rows(x)
    y = np.empty_like(x2)
    mean = np.empty(x2.shape[0] if center else 0, x.dtype)
    rstd = np.empty(x2.shape[0], x.dtype)
    _nb_norm_fwd(x2, _vec(w, x.dtype), _vec(b, x.dtype), y, mean, rstd, float(eps), center, has_w, has_b)
    stat_shape = x.shape[:-1] + (1,)
    return (y.reshape(x.shape),) + _row_stats(mean.reshape(stat_shape) if center else None,
                                              rstd.reshape(stat_shape), center)


def _norm_bwd_cpu(x, g, *rest, center, has_w, grad_w, grad_b):
    if x.dtype not in _NUMBA_DTYPES:
        return _norm_bwd_xp(x, g, *rest, center=center, has_w=has_w, grad_w=grad_w, grad_b=grad_b)
    mean, rstd, _, w, _ = _unpack(rest, center, has_w=has_w)
    x2, g2 = _rows(x), _rows(g)
    n = x2.shape[1]
    dx = np.empty_like(x2)
    dw = np.zeros(n if grad_w else 0, np.float64)
    db = np.zeros(n if grad_b else 0, np.float64)
    _nb_norm_bwd(x2, g2, _vec(mean, x.dtype), _vec(rstd, x.dtype), _vec(w, x.dtype), dx, dw, db, center,
                 has_w, grad_w, grad_b)
    outs = [dx.reshape(x.shape)]
    if grad_w:
        outs.append(dw.astype(x.dtype))
    if grad_b:
        outs.append(db.astype(x.dtype))
    return _one_or_tuple(outs)


# ------------------------------------------------------------------ fused kernels (CUDA) ----
# One block per row: the row statistics (accumulated in double), then the row written, in one
# launch (the array code takes some ten launches forward and fifteen backward, GPT-2 124M's 25
# norms 27 ms of its 166 ms step on an H200); the backward also writes g * xhat, summed over the
# rows afterwards for the weight gradient.
_NORM_FWD_CU = r"""
extern "C" __global__ void tilegraph_norm_fwd(const T* x, const T* w, const T* b, T* y, T* mean_out, T* rstd_out,
                                              int n, double eps, int center, int has_w, int has_b) {
    __shared__ double red[32];
    const long long r = blockIdx.x;
    const T* xr = x + r * n;
    T* yr = y + r * n;
    double mu = 0.0;
    if (center) {
        double s = 0.0;
        for (int j = threadIdx.x; j < n; j += blockDim.x) s += (double)xr[j];
        mu = tilegraph_block_reduce(s, red, 0) / n;
    }
    double q = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) { double d = (double)xr[j] - mu; q += d * d; }
    const double rs = 1.0 / sqrt(tilegraph_block_reduce(q, red, 0) / n + eps);
    if (threadIdx.x == 0) { if (center) mean_out[r] = (T)mu; rstd_out[r] = (T)rs; }
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        double v = ((double)xr[j] - mu) * rs;
        if (has_w) v *= (double)w[j];
        if (has_b) v += (double)b[j];
        yr[j] = (T)v;
    }
}
"""
_NORM_BWD_CU = r"""
extern "C" __global__ void tilegraph_norm_bwd(const T* x, const T* g, const T* mean, const T* rstd, const T* w,
                                              T* dx, T* gxhat, int n, int center, int has_w) {
    __shared__ double red[32];
    const long long r = blockIdx.x;
    const T* xr = x + r * n;
    const T* gr = g + r * n;
    const double mu = center ? (double)mean[r] : 0.0, rs = (double)rstd[r];
    double s1 = 0.0, s2 = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const double xh = ((double)xr[j] - mu) * rs, gw = has_w ? (double)gr[j] * (double)w[j] : (double)gr[j];
        s1 += gw * xh;
        s2 += gw;
    }
    s1 = tilegraph_block_reduce(s1, red, 0) / n;
    s2 = center ? tilegraph_block_reduce(s2, red, 0) / n : 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const double xh = ((double)xr[j] - mu) * rs, gw = has_w ? (double)gr[j] * (double)w[j] : (double)gr[j];
        dx[r * n + j] = (T)(rs * (gw - s2 - xh * s1));
        if (has_w) gxhat[r * n + j] = (T)((double)gr[j] * xh);
    }
}
"""


def _norm_fwd_cuda(x, *wb, eps, center, has_w, has_b):
    if x.size == 0 or any(a.dtype != x.dtype for a in wb):
        return _norm_fwd_xp(x, *wb, eps=eps, center=center, has_w=has_w, has_b=has_b)
    xp, n = xp_of(x), x.shape[-1]
    x2 = _rows(x)
    w = _rows(wb[0]) if has_w else x2   # (an absent input: any array, never read)
    b = _rows(wb[int(has_w)]) if has_b else x2
    y = xp.empty_like(x2)
    mean = xp.empty(x2.shape[0] if center else 1, x.dtype)
    rstd = xp.empty(x2.shape[0], x.dtype)
    row_kernel("norm_fwd", _NORM_FWD_CU, x.dtype)(
        (x2.shape[0],), (ROW_THREADS,), (x2, w, b, y, mean, rstd, np.int32(n), np.float64(eps), np.int32(center),
                                         np.int32(has_w), np.int32(has_b)))
    stat_shape = x.shape[:-1] + (1,)
    return (y.reshape(x.shape),) + _row_stats(mean.reshape(stat_shape) if center else None,
                                              rstd.reshape(stat_shape), center)


def _norm_bwd_cuda(x, g, *rest, center, has_w, grad_w, grad_b):
    mean, rstd, _, w, _ = _unpack(rest, center, has_w=has_w)
    if x.size == 0 or any(a is not None and a.dtype != x.dtype for a in (g, mean, rstd, w)):
        return _norm_bwd_xp(x, g, *rest, center=center, has_w=has_w, grad_w=grad_w, grad_b=grad_b)
    xp, n = xp_of(x), x.shape[-1]
    x2, g2 = _rows(x), _rows(g)
    dx = xp.empty_like(x2)
    gxhat = xp.empty_like(x2) if has_w else dx
    row_kernel("norm_bwd", _NORM_BWD_CU, x.dtype)(
        (x2.shape[0],), (ROW_THREADS,), (x2, g2, _rows(mean) if center else x2, _rows(rstd),
                                         _rows(w) if has_w else x2, dx, gxhat, np.int32(n), np.int32(center),
                                         np.int32(has_w)))
    outs = [dx.reshape(x.shape)]
    if grad_w:  # (with a frozen weight the kernel still writes g * xhat, which nothing sums)
        outs.append(sum_keepdims(gxhat, (0,)).reshape(n))
    if grad_b:
        outs.append(sum_keepdims(g2, (0,)).reshape(n))
    return _one_or_tuple(outs)


_norm_fwd = kernel("norm_fwd", cost=rowwise_cost(8), cpu=_norm_fwd_cpu,
                   gpu=gpu_or_generic("norm_fwd", _norm_fwd_cuda, _norm_fwd_xp))(_norm_fwd_xp)
_norm_bwd = kernel("norm_bwd", cost=rowwise_cost(12), cpu=_norm_bwd_cpu,
                   gpu=gpu_or_generic("norm_bwd", _norm_bwd_cuda, _norm_bwd_xp))(_norm_bwd_xp)


# ------------------------------------------------------------------ split-row kernels ----
@kernel("norm_stats", cost=rowwise_cost(3))
def _norm_stats(x, center):
    """Partial statistics of one tile: ``(mean, M2)`` (layer norm) or the sum of squares (RMS)."""
    xa = x.astype(acc_dtype(x.dtype), copy=False)
    if not center:
        return (xa * xa).sum(axis=-1, keepdims=True)
    mean = xa.mean(axis=-1, keepdims=True)
    xc = xa - mean
    return mean, (xc * xc).sum(axis=-1, keepdims=True)


@kernel("norm_merge", cost=rowwise_cost(6))
def _norm_merge(*parts, counts, center, final, eps):
    """Merge partial statistics of tiles with ``counts`` columns each (Chan et al.'s parallel
    variance for layer norm). ``final``: return ``(mean, rstd)`` / ``rstd`` instead of partials."""
    xp = xp_of(parts[0])
    n = sum(counts)
    if center:
        means, m2s = parts[0::2], parts[1::2]
        mean = sum(c * m for c, m in zip(counts, means)) / n
        m2 = sum(q + c * (m - mean) ** 2 for c, m, q in zip(counts, means, m2s))
    else:
        mean, m2 = None, sum(parts[1:], parts[0])
    if not final:
        return (mean, m2) if center else m2
    rstd = 1.0 / xp.sqrt(m2 / n + eps)
    return (mean, rstd) if center else rstd


@kernel("norm_apply", cost=rowwise_cost(4))
def _norm_apply(x, *rest, center, has_w, has_b):
    mean, rstd, _, w, b = _unpack(rest, center, has_w=has_w, has_b=has_b)
    xa = x.astype(rstd.dtype, copy=False)
    y = (xa - mean) * rstd if center else xa * rstd
    if has_w:
        y *= w
    if has_b:
        y += b
    return y.astype(x.dtype, copy=False)


@kernel("norm_bwd_stats", cost=rowwise_cost(6))
def _norm_bwd_stats(x, g, *rest, center, has_w, grad_w, grad_b):
    """Partial row sums ``sum(g w xhat)`` (and ``sum(g w)``), plus partial ``dweight``/``dbias``
    where asked for."""
    mean, rstd, _, w, _ = _unpack(rest, center, has_w=has_w)
    xa, ga = x.astype(rstd.dtype, copy=False), g.astype(rstd.dtype, copy=False)
    xhat = (xa - mean) * rstd if center else xa * rstd
    gw = ga * w if has_w else ga
    outs = [(gw * xhat).sum(axis=-1, keepdims=True)]
    if center:
        outs.append(gw.sum(axis=-1, keepdims=True))
    return _one_or_tuple(outs + _param_grads(ga, xhat, grad_w, grad_b))


@kernel("norm_bwd_apply", cost=rowwise_cost(6))
def _norm_bwd_apply(x, g, *rest, n, center, has_w):
    mean, rstd, sums, w, _ = _unpack(rest, center, n_sums=2 if center else 1, has_w=has_w)
    xa, ga = x.astype(rstd.dtype, copy=False), g.astype(rstd.dtype, copy=False)
    xhat = (xa - mean) * rstd if center else xa * rstd
    gw = ga * w if has_w else ga
    dx = gw - xhat * (sums[0] / n)
    if center:
        dx -= sums[1] / n
    dx *= rstd
    return dx.astype(x.dtype, copy=False)


@kernel("norm_sum_groups", cost=rowwise_cost(1))
def _sum_groups(*parts, groups, dtype):
    """Sum the inputs in ``groups`` consecutive equal groups; ``dtype``: cast the sums to it."""
    k = len(parts) // groups
    outs = []
    for i in range(groups):
        acc = parts[i * k].copy()
        for p in parts[i * k + 1:(i + 1) * k]:
            acc += p
        outs.append(acc if dtype is None else acc.astype(dtype, copy=False))
    return _one_or_tuple(outs)


def _sum_items(items: list, dtype, op: str):
    """Sum tuples of tile refs elementwise (a tree over many), the results cast to ``dtype``."""
    k = len(items[0])
    if len(items) == 1 and all(r.dtype == np.dtype(dtype) for r in items[0]):
        return items[0]

    def merge(group, final):
        ins = [item[i] for i in range(k) for item in group]
        meta = [(r.shape, dtype if final else r.dtype) for r in group[0]]
        return tuple(emit(_sum_groups, ins, meta, op=op, groups=k, dtype=np.dtype(dtype).name if final else None))

    return merge_tree(items, merge)


# ----------------------------------------------------------------------------------------- op ----
class Norm(Op):
    """Normalise over the last dim: layer norm (``center=True``) or RMS norm (``center=False``).

    Positional args ``(x, weight, bias)``; ``weight``/``bias`` are ``None`` or (C,) TileTensors
    with the tiles of ``x``'s last dim.
    """

    def __init__(self, center: bool):
        self.center = center
        self.name = "layer_norm" if center else "rms_norm"

    def forward(self, x, weight, bias, eps):
        grid, last = x.tiling.grid, x.ndim - 1
        acc = acc_dtype(x.dtype)
        has_w, has_b = weight is not None, bias is not None
        n_stats = 2 if self.center else 1
        out = np.empty(grid, dtype=object)
        stats = {}  # row-group key -> (mean, rstd) or (rstd,)
        for key, tiles in row_groups(grid, last):
            stat_shape = x.grid[tiles[0]].shape[:-1] + (1,)
            if len(tiles) == 1:
                (idx,) = tiles
                refs = emit(_norm_fwd, [x.grid[idx]] + _params(weight, bias, idx[-1]),
                            [(x.grid[idx].shape, x.dtype)] + [(stat_shape, acc)] * n_stats, op=self.name,
                            eps=float(eps), center=self.center, has_w=has_w, has_b=has_b)
                out[idx], stats[key] = refs[0], tuple(refs[1:])
                continue
            parts = [(x.grid[idx].shape[-1], tuple(emit(_norm_stats, [x.grid[idx]], [(stat_shape, acc)] * n_stats,
                                                      op=self.name, center=self.center))) for idx in tiles]

            def merge(group, final, stat_shape=stat_shape):
                counts = [c for c, _ in group]
                refs = emit(_norm_merge, [r for _, rs in group for r in rs], [(stat_shape, acc)] * n_stats,
                            op=self.name, counts=tuple(counts), center=self.center, final=final, eps=float(eps))
                return tuple(refs) if final else (sum(counts), tuple(refs))

            stats[key] = merge_tree(parts, merge)
            for idx in tiles:
                out[idx] = emit1(_norm_apply, [x.grid[idx], *stats[key]] + _params(weight, bias, idx[-1]),
                                 x.grid[idx].shape, x.dtype, op=self.name, center=self.center, has_w=has_w,
                                 has_b=has_b)
        y = new_tensor(x.tiling, x.dtype, lambda idx: out[idx])
        return y, (x, weight, bias, stats)

    def backward(self, ctx, g):
        return self.vjp(ctx, g, (True, True, True))

    def vjp(self, ctx, g, needed):
        """``dx``, and ``dweight``/``dbias`` where they are needed: a frozen weight or bias (a LoRA
        fine-tune's norms) gets no partial sums, in the kernels or after them."""
        x, weight, bias, stats = ctx
        grid, last = x.tiling.grid, x.ndim - 1
        acc = acc_dtype(x.dtype)
        has_w = weight is not None
        grad_w, grad_b = has_w and bool(needed[1]), bias is not None and bool(needed[2])
        n_sums = 2 if self.center else 1
        op = f"{self.name}_bwd"
        dx = np.empty(grid, dtype=object)
        param_parts: list[list] = [[] for _ in range(grid[-1])]  # per tile of C: (dw, db) partials
        for key, tiles in row_groups(grid, last):
            st = list(stats[key])
            stat_shape = st[0].shape
            if len(tiles) == 1:
                (idx,) = tiles
                ins = [x.grid[idx], g.grid[idx], *st] + _params(weight, None, idx[-1])
                meta = [(x.grid[idx].shape, x.dtype)] + _param_meta(x, idx, grad_w, grad_b, acc)
                refs = emit(_norm_bwd, ins, meta, op=op, center=self.center, has_w=has_w, grad_w=grad_w,
                            grad_b=grad_b)
                dx[idx] = refs[0]
                param_parts[idx[-1]].append(tuple(refs[1:]))
                continue
            sums = []
            for idx in tiles:
                ins = [x.grid[idx], g.grid[idx], *st] + _params(weight, None, idx[-1])
                meta = [(stat_shape, acc)] * n_sums + _param_meta(x, idx, grad_w, grad_b, acc)
                refs = emit(_norm_bwd_stats, ins, meta, op=op, center=self.center, has_w=has_w, grad_w=grad_w,
                            grad_b=grad_b)
                sums.append(tuple(refs[:n_sums]))
                param_parts[idx[-1]].append(tuple(refs[n_sums:]))
            total = _sum_items(sums, acc, op)
            for idx in tiles:
                ins = [x.grid[idx], g.grid[idx], *st, *total] + _params(weight, None, idx[-1])
                dx[idx] = emit1(_norm_bwd_apply, ins, x.grid[idx].shape, x.dtype, op=op, n=x.shape[-1],
                                center=self.center, has_w=has_w)
        dxt = new_tensor(x.tiling, x.dtype, lambda idx: dx[idx])
        if not (grad_w or grad_b):
            return dxt, None, None
        finished = [_sum_items(parts, x.dtype, op) for parts in param_parts]
        ptiling = Tiling((x.chunks[-1],))
        dw = new_tensor(ptiling, x.dtype, lambda j: finished[j[0]][0]) if grad_w else None
        db = new_tensor(ptiling, x.dtype, lambda j: finished[j[0]][int(grad_w)]) if grad_b else None
        return dxt, dw, db


def _params(weight, bias, j) -> list:
    return [p.grid[j] for p in (weight, bias) if p is not None]


def _param_meta(x, idx, grad_w, grad_b, acc) -> list:
    shape = (x.grid[idx].shape[-1],)
    return [(shape, acc)] * (int(grad_w) + int(grad_b))


_layer_norm_op = Norm(center=True)
_rms_norm_op = Norm(center=False)


def _check(where, x, weight, bias, eps):
    require_tensor(x, where, "x")
    require_float(x, where, "x")
    if x.ndim == 0:
        raise TileError(where, "x needs at least one dim (normalised over the last)", "a 0-d tensor")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        require_tensor(p, where, name)
        if p.shape != (x.shape[-1],):
            raise TileError(where, f"{name} must have shape ({x.shape[-1]},), the last dim of x",
                            f"{name} of shape {p.shape} for x of shape {x.shape}")
        if p.dtype != x.dtype:
            raise TileError(where, f"{name} must have the dtype of x (cast explicitly)",
                            f"{name} {p.dtype}, x {x.dtype}")
        require_same_chunks(where, f"{name} and the last dim of x", p.chunks[0], x.chunks[-1])
    # numbers.Real: a NumPy scalar (np.float32(1e-5) from a config or an array) is a number too
    if isinstance(eps, bool) or not (isinstance(eps, numbers.Real) and eps >= 0):
        raise TileError(where, "eps must be a non-negative number", repr(eps))


def _normalized_shape(x: TileTensor, normalized_shape, where: str) -> tuple[int, ...]:
    """``normalized_shape`` as a tuple: the last dims of ``x``, torch's second argument."""
    order = "layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5), torch's order"
    if isinstance(normalized_shape, TileTensor):  # tilegraph's older order, (x, weight, bias, eps)
        raise TileError(where, f"the second argument is normalized_shape ({order}), not the weight: "
                        f"write layer_norm(x, {(x.shape[-1],) if x.ndim else ()}, weight, bias)",
                        f"a TileTensor of shape {normalized_shape.shape} as normalized_shape")
    if normalized_shape is None:
        raise TileError(where, f"normalized_shape is required ({order}); without a weight write "
                        f"layer_norm(x, {(x.shape[-1],) if x.ndim else ()}, None, bias)", "None")
    shape = (normalized_shape,) if isinstance(normalized_shape, numbers.Integral) else normalized_shape
    try:
        shape = tuple(shape)
    except TypeError:  # neither an int nor a sequence
        shape = ()
    ints = all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in shape)
    if not shape or not ints or len(shape) > x.ndim or tuple(int(n) for n in shape) != x.shape[x.ndim - len(shape):]:
        raise TileError(where, f"normalized_shape must be the last dim(s) of x, e.g. {x.shape[-1:]}, as an int or "
                        "a tuple of ints", f"normalized_shape {normalized_shape!r} for x of shape {x.shape}")
    return tuple(int(n) for n in shape)


def layer_norm(x: TileTensor, normalized_shape, weight: TileTensor | None = None, bias: TileTensor | None = None,
               eps: float = 1e-5) -> TileTensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last ``len(normalized_shape)`` dims
    (biased variance), torch's ``F.layer_norm`` with its argument order.

    ``weight`` and ``bias`` have shape ``normalized_shape`` and the tiles of those dims of ``x``.
    Normalising over several dims treats them as one, so only the first of them may be tiled.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.array([[1.0, 2.0, 3.0, 6.0]]), tiles=(1, 2))
    >>> w = tg.from_numpy(np.full(4, 2.0), tiles=2)
    >>> tg.layer_norm(x, (4,), w).numpy().round(3)
    array([[-2.138, -1.069,  0.   ,  3.207]])
    """
    where = "tilegraph.layer_norm"
    require_tensor(x, where, "x")
    shape = _normalized_shape(x, normalized_shape, where)
    for name, p in (("weight", weight), ("bias", bias)):
        if isinstance(p, TileTensor) and p.shape != shape:
            raise TileError(where, f"{name} must have shape {shape} (normalized_shape)",
                            f"{name} of shape {p.shape} for x of shape {x.shape}")
    if len(shape) == 1:
        _check(where, x, weight, bias, eps)
        return _layer_norm_op(x, weight, bias, eps=float(eps))
    from .shape import checked_reshape

    # several dims normalised as one: merge them, normalise the last dim, split them again
    flat = (int(np.prod(shape)),)
    try:
        xm = checked_reshape(x, x.shape[:-len(shape)] + flat, where)
        wm, bm = (None if p is None else checked_reshape(require_tensor(p, where, name), flat, where)
                  for name, p in (("weight", weight), ("bias", bias)))
    except TileError as e:
        raise TileError(where, f"normalising over the last {len(shape)} dims {shape} merges them into one: "
                        f"{e.what}", e.received) from None
    _check(where, xm, wm, bm, eps)
    return checked_reshape(_layer_norm_op(xm, wm, bm, eps=float(eps)), x.shape, where)


def rms_norm(x: TileTensor, weight: TileTensor | None = None, eps: float = 1e-6) -> TileTensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim (Llama's RMSNorm). The arguments
    are ``(x, weight, eps)``: torch's ``F.rms_norm(x, normalized_shape, weight, eps)`` is
    ``rms_norm(x, weight, eps)`` here (its default eps, None, is the dtype's machine epsilon)."""
    if isinstance(weight, (numbers.Integral, tuple, list)) and not isinstance(weight, bool):
        raise TileError("tilegraph.rms_norm", "the second argument is the weight: rms_norm(x, weight=None, "
                        "eps=1e-6) normalises the last dim; torch's F.rms_norm(x, normalized_shape, weight, eps) "
                        "is tg.rms_norm(x, weight, eps) (torch's default eps is np.finfo(dtype).eps)",
                        f"{type(weight).__name__} {weight!r:.60} as weight")
    _check("tilegraph.rms_norm", x, weight, None, eps)
    return _rms_norm_op(x, weight, None, eps=float(eps))
