"""Randomized matrix multiplication for the weight gradient of a linear layer (RMM,
arXiv:2201.13195; WTA-CRS, arXiv:2305.15265).

``Y = X W + b`` is exact. For the backward, the layer keeps a sketch ``Xs = S^T X`` (k, n) of its
input instead of X (N, n), ``N`` the rows of X (all leading dims), and the sketch's description: a
seed, or for WTA-CRS the k chosen rows and their scales. The backward regenerates S and estimates

    dW ~= Xs^T (S^T dY)        (unbiased: E[S S^T] = I)

while dX = dY W^T and db = sum(dY) stay exact. Sketches (S is N x k, column j is sketch row j):

- ``"gaussian"``: entries N(0, 1) / sqrt(k);
- ``"rademacher"``: entries +-1 / sqrt(k);
- ``"rows"``: k rows drawn uniformly with replacement, each scaled by sqrt(N / k);
- ``"dct"``: k rows of the orthonormal DCT-II along the N rows, drawn uniformly with replacement,
  scaled by sqrt(N / k) (the public reference scales by k * N: about k^2 times too large);
- ``"wta-crs"``: winner-take-all column-row sampling: the rows of largest p_i kept as they are and
  the others sampled from p with scale (1 - P_C) / (p_j (k - |C|)); here p_i is proportional to
  ||x_i|| alone (the forward has no dY yet; WTA-CRS's estimator stays unbiased either way).

k = ratio * N rows (at least 1; WTA-CRS: at least 10, as its paper), at most N. Over tiles: each
row tile of X makes its rows' share ``S_r^T X_r`` (k, tile columns) and a sum tree adds them,
so Xs has one tile per column tile of X; dY's row tiles are those of X, so the backward's
``S_r`` is the forward's.

Seeds change every step without help from the training loop, and every input draws its own
sketch: a dense sketch ("gaussian", "rademacher") is drawn per row tile, from a hash of the layer's
base seed, a sample of the weight's first tile (which every optimizer step changes) and a sample
of that row tile of X; the sketches drawn over all rows at once ("rows", "dct", "wta-crs") hash the
weight's first tile and X's first tile. Replayed steps (``TrainStep``) therefore draw a fresh sketch
each time; each micro-batch of an accumulated step, which shares the weights, draws its own (with
one seed from the weights alone they all drew the same S, and their estimates' errors added up
instead of averaging out); data-parallel replicas, which share out the row tiles of one graph,
draw the one-process run's sketch. The same weights and the same input draw the same sketch.

>>> import numpy as np, tilegraph as tg
>>> x = tg.from_numpy(np.ones((20, 4))); w = tg.from_numpy(np.ones((4, 3)))
>>> sketched_linear(x, w, sketch="gaussian", ratio=0.25).numpy()[0]      # the forward is exact
array([4., 4., 4.])
>>> sketch_size("gaussian", 0.25, 20), sketch_size("wta-crs", 0.25, 20)
(5, 10)
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit, emit1, kernel, xp_of
from tilegraph._tensor import TileTensor, Tiling

from ._common import new_tensor, numel
from .dropout import _seed_k, row_seed_tensor
from .matmul import _matmul_op, _matmul_tn_op
from .reduce import _tree

__all__ = ["sketched_linear", "sketch_size", "check_grad_sketch", "sketch_block", "wta_crs_plan", "SKETCHES"]

WHERE = "tilegraph.sketched_linear"
#: the sketches of the weight gradient (None in ``tg.nn.Linear`` means exact)
SKETCHES = ("gaussian", "rademacher", "rows", "dct", "wta-crs")
_SAMPLED = ("rows", "wta-crs")  # S^T A gathers k scaled rows of A (no dense S)
_DENSE = ("gaussian", "rademacher")  # S drawn per row tile, each from its own seed
#: WTA-CRS keeps at least this many rows (its paper's k = min(max(floor(N * ratio), 10), N))
WTA_MIN_ROWS = 10


# ------------------------------------------------------------------------------ checking ----
#: the largest seed of a sketched layer (the step's seed kernel hashes it as 8 bytes)
SEED_MAX = 2**64 - 1


def check_grad_sketch(sketch, ratio, seed, where: str = WHERE) -> tuple[str | None, float, int]:
    """The validated ``(sketch, ratio, seed)``; ``sketch=None`` means an exact weight gradient."""
    if sketch is not None and sketch not in SKETCHES:
        raise TileError(where, f"grad_sketch must be None or one of {', '.join(SKETCHES)}", repr(sketch))
    # (the range alone refuses NaN and inf; math.isfinite raised OverflowError on an int past any float, 10**400)
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0.0 < ratio <= 1.0:
        raise TileError(where, "sketch_ratio must be a number in (0, 1] (the share of rows kept)", repr(ratio)[:100])
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= SEED_MAX:
        # (the step's seed hashes it as 8 bytes: 2**64 and past failed in the first step's kernel,
        # "int too big to convert")
        raise TileError(where, "sketch_seed must be an int >= 0 and <= 2**64 - 1", repr(seed))
    return sketch, float(ratio), int(seed)


def sketch_size(sketch: str, ratio: float, n_rows: int) -> int:
    """k, the rows of the sketch of an N-row activation: floor(ratio * N), at least 1 (WTA-CRS:
    at least 10), at most N."""
    k = math.floor(ratio * n_rows + 1e-9)  # 0.29 * 100 is 28.999...: count it as 29
    return min(max(k, WTA_MIN_ROWS if sketch == "wta-crs" else 1), n_rows)


# --------------------------------------------------------------------------- the sketches ----
def _rng(seed: int, stream: int) -> np.random.Generator:
    """Stream 0: draws shared by every tile (sampled rows, DCT frequencies); stream 1 + r: the
    dense block of the row tile whose first row is r."""
    return np.random.default_rng([int(seed), int(stream)])


def sketch_block(kind: str, seed: int, rows: np.ndarray, k: int, n_rows: int) -> np.ndarray:
    """``S_r^T`` (k, len(rows)) in float64: the columns of S^T for the global row indices
    ``rows`` (ascending, one row tile's rows) of an N-row matrix, for a dense sketch or "rows".
    Assembled over the row tiles of any tiling, it is the same S for tilings whose tiles start at
    the same rows; every S has E[S S^T] = I."""
    rows = np.asarray(rows, dtype=np.int64)
    if kind == "gaussian":
        return _rng(seed, 1 + rows[0]).standard_normal((k, rows.size)) / math.sqrt(k)
    if kind == "rademacher":
        signs = _rng(seed, 1 + rows[0]).integers(0, 2, (k, rows.size)) * 2.0 - 1.0
        return signs / math.sqrt(k)
    if kind == "dct":
        # row f of the orthonormal DCT-II: sqrt(2/N) c_f cos(pi (2i + 1) f / (2N)), c_0 = 1/sqrt(2);
        # times sqrt(N/k) that is sqrt(2/k) c_f cos(...) (NOT k * N, the reference's trap)
        freq = _rng(seed, 0).integers(0, n_rows, k)
        block = np.cos(np.pi * np.outer(freq, 2 * rows + 1) / (2 * n_rows)) * math.sqrt(2.0 / k)
        block[freq == 0] *= 1.0 / math.sqrt(2.0)
        return block
    if kind == "rows":
        idx, scale = _uniform_rows(seed, k, n_rows)
        return (idx[:, None] == rows[None, :]) * scale[:, None]
    raise AssertionError(kind)


def _uniform_rows(seed: int, k: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    idx = _rng(seed, 0).integers(0, n_rows, k)
    return idx, np.full(k, math.sqrt(n_rows / k))


def wta_crs_plan(norms: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """WTA-CRS's k rows and their scales (sqrt of the estimator's weights) for row scores
    ``norms`` (p_i proportional to them, plus a tiny eps so that every row can be drawn).

    The |C| rows of largest p are kept with weight 1: with the top-k probabilities sorted,
    score_c = (1 - sum of the top c) / (k - c) for c = 1..k-1, and |C| = argmin_c score_c
    (0 when 1/k is below every score). The other k - |C| rows are drawn with replacement from p
    restricted to the rest, each with weight (1 - P_C) / (p_j (k - |C|)): unbiased. All-zero or
    non-finite scores fall back to uniform p with that same weight (the reference leaves the rows
    unscaled there, which is biased).
    """
    norms = np.asarray(norms, dtype=np.float64)
    n = norms.size
    total = float(norms.sum())
    if not math.isfinite(total) or total <= 0.0:
        p = np.full(n, 1.0 / n)
    else:
        p = norms / total + 1e-12 / n
        p /= p.sum()
    order = np.argsort(-p, kind="stable")
    n_det = 0
    if k > 1:
        top = p[order[:k - 1]]
        score = (1.0 - np.cumsum(top)) / (k - np.arange(1, k))
        best = int(np.argmin(score))
        n_det = 0 if 1.0 / k < score[best] else best + 1
    kept, rest = order[:n_det], order[n_det:]
    m = k - n_det
    mass = float(p[rest].sum())
    if mass > 0.0:
        q = p[rest] / mass
        pick = _rng(seed, 0).choice(rest.size, size=m, p=q)
        weight = 1.0 / (q[pick] * m)  # = (1 - P_C) / (p_j (k - |C|))
    else:  # the kept rows hold all of p: the drawn rows count for nothing
        pick = _rng(seed, 0).integers(0, rest.size, m)
        weight = np.zeros(m)
    idx = np.concatenate([kept, rest[pick]]).astype(np.int64)
    return idx, np.sqrt(np.concatenate([np.ones(n_det), weight]))


def _box_rows(lead_shape, offset, shape) -> np.ndarray:
    """Global row indices (row-major over the leading dims) of a tile's rows, ascending."""
    if len(lead_shape) == 1:
        return np.arange(offset[0], offset[0] + shape[0], dtype=np.int64)
    grids = np.indices(shape).reshape(len(shape), -1) + np.asarray(offset)[:, None]
    return np.ravel_multi_index(tuple(grids), lead_shape).astype(np.int64)


# -------------------------------------------------------------------------------- kernels ----
def _seed_of(tile) -> int:
    """The seed held by a one-element tile (on the host or a GPU)."""
    return int(tile.reshape(-1)[0])


def _sketch_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n_in = numel(in_shapes[-1])
    k = params["k"]
    flops = float(k * in_shapes[-1][-1]) if params["kind"] in _SAMPLED else 2.0 * k * n_in
    return Cost(flops, float((n_in + numel(out_shapes[0])) * itemsize))


@kernel("rmm_sketch", cost=_sketch_cost)
def _sketch_k(*ins, kind, k, n_rows, lead_shape, offset):
    """This row tile's share ``S_r^T A_r`` (k, columns) of the sketch of A (X, or dY)."""
    a = ins[-1]
    xp = xp_of(a)
    a2 = a.reshape(-1, a.shape[-1])
    rows = _box_rows(lead_shape, offset, a.shape[:-1])
    if kind not in _SAMPLED:
        block = sketch_block(kind, _seed_of(ins[0]), rows, k, n_rows)
        return xp.asarray(block.astype(a.dtype)) @ a2
    if kind == "rows":
        idx, scale = _uniform_rows(_seed_of(ins[0]), k, n_rows)
    else:
        idx, scale = (np.asarray(v.get() if xp is not np else v) for v in ins[:2])
    pos = np.minimum(np.searchsorted(rows, idx), rows.size - 1)
    hit = np.nonzero(rows[pos] == idx)[0]  # the sketch rows that fall in this tile
    out = xp.zeros((k, a2.shape[1]), a.dtype)
    if hit.size:
        out[xp.asarray(hit)] = a2[xp.asarray(pos[hit])] * xp.asarray(scale[hit].astype(a.dtype))[:, None]
    return out


@kernel("rmm_row_sumsq")
def _row_sumsq_k(a):
    """Squared norms (float64) of a tile's rows, over its columns."""
    a2 = a.reshape(-1, a.shape[-1]).astype(np.float64)
    return (a2 * a2).sum(axis=1)


@kernel("rmm_wta_plan")
def _wta_plan_k(seed, *parts, k, n_rows, lead_shape, boxes, n_col_tiles):
    """WTA-CRS's rows and scales from every tile's row norms (float64, summed over column tiles)."""
    xp = xp_of(parts[0])
    host = [np.asarray(p.get() if xp is not np else p) for p in (seed, *parts)]
    seed, parts = int(host[0].reshape(-1)[0]), host[1:]
    sumsq = np.zeros(n_rows)
    for i, (offset, shape) in enumerate(boxes):
        sumsq[_box_rows(lead_shape, offset, shape)] = sum(parts[i * n_col_tiles:(i + 1) * n_col_tiles])
    idx, scale = wta_crs_plan(np.sqrt(sumsq), k, seed)
    return xp.asarray(idx), xp.asarray(scale)


# ------------------------------------------------------------------------------ tile graph ----
def _row_tiles(a: TileTensor):
    """(grid index, offsets, shape) of each tile of the leading dims, in grid order."""
    lead = a.tiling.grid[:-1]
    offs = [a.tiling.offsets(d) for d in range(len(lead))]
    for li in np.ndindex(*lead):
        yield li, tuple(offs[d][i] for d, i in enumerate(li)), tuple(a.chunks[d][i] for d, i in enumerate(li))


def _plan(x: TileTensor, w: TileTensor, sketch: str, k: int, seed: int):
    """The sketch's description: for a dense sketch, a tensor of one seed per row tile of ``x``
    (hashing the base seed, the weight's first tile and that row tile's first tile: each input
    draws its own sketch, and no row tile waits for another's); for the others, tile refs: (seed,)
    or, for WTA-CRS, (rows, scales), from one seed hashing the weight's and ``x``'s first tiles."""
    if sketch in _DENSE:
        return row_seed_tensor(x, w, base=seed)
    n_rows = math.prod(x.shape[:-1])
    seed_ref = emit1(_seed_k, [w.grid[(0,) * w.ndim], x.grid[(0,) * x.ndim]], (1,), np.uint64, op="rmm", base=seed)
    if sketch != "wta-crs":
        return (seed_ref,)
    parts, boxes = [], []
    for li, offset, shape in _row_tiles(x):
        boxes.append((offset, shape))
        parts += [emit1(_row_sumsq_k, [x.grid[li + (c,)]], (math.prod(shape),), np.float64, op="rmm")
                  for c in range(x.tiling.grid[-1])]
    return tuple(emit(_wta_plan_k, [seed_ref, *parts], [((k,), np.int64), ((k,), np.float64)], op="rmm",
                      k=k, n_rows=n_rows, lead_shape=x.shape[:-1], boxes=tuple(boxes),
                      n_col_tiles=x.tiling.grid[-1]))


def _plan_refs(plan, li) -> list:
    """The plan's inputs to the sketch kernel of row tile ``li``."""
    if isinstance(plan, TileTensor):  # one seed per row tile (a vector x: one, at (0,))
        return [plan.grid[li if li else (0,)]]
    return list(plan)


def _sketch(a: TileTensor, plan, sketch: str, k: int) -> TileTensor:
    """``S^T A`` (k, columns of A): one kernel per tile of A, summed over the row tiles."""
    tiling = Tiling(((k,), a.chunks[-1]))
    tiles = list(_row_tiles(a))
    n_rows = math.prod(a.shape[:-1])

    def fill(idx):
        c = idx[1]
        shape = tiling.tile_shape(idx)
        parts = [emit1(_sketch_k, [*_plan_refs(plan, li), a.grid[li + (c,)]], shape, a.dtype, op="rmm", kind=sketch, k=k,
                       n_rows=n_rows, lead_shape=a.shape[:-1], offset=offset) for li, offset, _ in tiles]
        return parts[0] if len(parts) == 1 else _tree(parts, shape, a.dtype, (), 1.0, "rmm")

    return new_tensor(tiling, a.dtype, fill)


class RMMContext(NamedTuple):
    """What the backward keeps: the weight (for the exact dX), the sketched activations
    ``xs = S^T X`` (k, n), the sketch's description (seeds, or WTA-CRS's rows and scales),
    never X itself."""

    w: TileTensor
    has_bias: bool
    xs: TileTensor
    plan: tuple | TileTensor
    sketch: str
    k: int


class SketchedLinear(Op):
    """``Y = X W + b`` exactly; the weight gradient from a sketch of X (see the module doc)."""

    name = "sketched_linear"

    def forward(self, x, w, bias=None, *, sketch="gaussian", ratio=0.2, seed=0):
        sketch, ratio, seed = check_grad_sketch(sketch, ratio, seed)
        if sketch is None:
            raise TileError(WHERE, f"sketch must be one of {', '.join(SKETCHES)}", "None")
        y, _ = _matmul_op.forward(x, w, bias)  # validates the operands; exact
        if w.ndim != 2:
            raise TileError(WHERE, "the weight must be 2-d (in, out)", str(w.shape))
        k = sketch_size(sketch, ratio, math.prod(x.shape[:-1]))
        plan = _plan(x, w, sketch, k, seed)
        return y, RMMContext(w, bias is not None, _sketch(x, plan, sketch, k), plan, sketch, k)

    def backward(self, ctx: RMMContext, dy):
        dx = _matmul_op(dy, ctx.w, trans_b=True)  # exact: needs W, not X
        dw = _matmul_tn_op(ctx.xs, _sketch(dy, ctx.plan, ctx.sketch, ctx.k))
        db = None
        if ctx.has_bias:
            from .reduce import sum_dims

            db = sum_dims(dy, tuple(range(dy.ndim - 1)), (False,) * (dy.ndim - 1))
        return dx, dw, db


_rmm_op = SketchedLinear()


def sketched_linear(x: TileTensor, weight: TileTensor, bias: TileTensor | None = None, *,
                    sketch: str = "gaussian", ratio: float = 0.2, seed: int = 0) -> TileTensor:
    """``x @ weight + bias`` whose weight gradient is estimated from a sketch of ``x`` with
    ``ratio * N`` rows (``sketch``: one of :data:`SKETCHES`); ``seed`` is the base seed mixed
    into each step's. The forward, dX and the bias gradient are exact. See the module doc."""
    return _rmm_op(x, weight, bias, sketch=sketch, ratio=ratio, seed=seed)
