"""Randomized matmul for weight gradients (tilegraph.ops.rmm, tilegraph.sketch; arXiv:2201.13195):
the graph computes exactly the estimator of its seed, the estimator is unbiased for every sketch
(Monte-Carlo), dX/db/the forward are exact, the backward keeps ratio * N rows instead of N, the
sketch changes every training step, training still learns, and bad input is refused."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph._graph import topo_order
from tilegraph.ops import rmm
from tilegraph.ops.dropout import step_seed
from tilegraph.sketch import apply_grad_sketch, sketched_layers

from conftest import by_mode, tiles_for

KINDS = rmm.SKETCHES
by_kind = pytest.mark.parametrize("kind", KINDS)


def _row_boxes(x: tg.TileTensor) -> list[np.ndarray]:
    """Global row indices of each row tile of ``x`` (all but the last dim), in grid order."""
    return [rmm._box_rows(x.shape[:-1], off, shape) for _, off, shape in rmm._row_tiles(x)]


def _sketch_matrix(kind, seed, k, n_rows, boxes, x2d) -> np.ndarray:
    """S (N, k) as the tile kernels build it, assembled over the row tiles ``boxes``; ``seed``: one
    per row tile for a dense sketch (a list), else the one seed."""
    s = np.zeros((n_rows, k))
    if kind == "wta-crs":
        idx, scale = rmm.wta_crs_plan(np.linalg.norm(x2d, axis=1), k, seed)
        s[idx, np.arange(k)] = scale
        return s
    seeds = seed if kind in rmm._DENSE else [seed] * len(boxes)
    for rows, one in zip(boxes, seeds):
        s[rows] = rmm.sketch_block(kind, one, rows, k, n_rows).T
    return s


def _step_seeds(kind, base, w_np, w, x_np, x):
    """The seeds the graph draws with: a dense sketch's one per row tile of x, hashing the base
    seed, the weight's first tile and the row tile's first tile; the others' one, hashing the
    weight's and x's first tiles."""
    first_w = w_np[w.tiling.slices((0,) * w.ndim)]
    if kind not in rmm._DENSE:
        return step_seed(base, first_w, x_np[x.tiling.slices((0,) * x.ndim)])
    return [step_seed(base, first_w, x_np[x.tiling.slices(li + (0,))]) for li, _, _ in rmm._row_tiles(x)]


# --------------------------------------------------------------------- graph vs estimator ----
@by_kind
@by_mode
def test_graph_computes_the_estimator_of_its_seed_and_dx_db_forward_are_exact(kind, mode):
    rng = np.random.default_rng(0)
    x_np, w_np, b_np = rng.standard_normal((3, 7, 6)), rng.standard_normal((6, 5)), rng.standard_normal(5)
    r_np = rng.standard_normal((3, 7, 5))
    sizes: dict = {}
    x, w, b, r = (tg.from_numpy(a, tiles_for(a.shape, dims, mode, sizes))
                  for a, dims in ((x_np, "btn"), (w_np, "nm"), (b_np, "m"), (r_np, "btm")))
    y = tg.ops.sketched_linear(x, w, b, sketch=kind, ratio=0.3, seed=7)
    y_exact = tg.ops.linear(x, w, b)
    grads = tg.grad((y * r).sum(), [x, w, b])
    exact = tg.grad((y_exact * r).sum(), [x, w, b])
    (yv, dx, dw, db), (ye, dxe, dwe, dbe) = tg.compute(y, *grads), tg.compute(y_exact, *exact)
    np.testing.assert_array_equal(yv, ye)     # the forward is the exact one
    np.testing.assert_array_equal(dx, dxe)    # dX = dY W^T, exact (needs W, not X)
    np.testing.assert_array_equal(db, dbe)
    np.testing.assert_allclose(dx, r_np @ w_np.T, rtol=1e-12)
    # dW is the estimate (S^T X)^T (S^T dY) for this step's seeds (hashes of the weight and the input)
    n_rows = 21
    k = rmm.sketch_size(kind, 0.3, n_rows)
    seed = _step_seeds(kind, 7, w_np, w, x_np, x)
    s = _sketch_matrix(kind, seed, k, n_rows, _row_boxes(x), x_np.reshape(n_rows, 6))
    want = (s.T @ x_np.reshape(n_rows, 6)).T @ (s.T @ r_np.reshape(n_rows, 5))
    np.testing.assert_allclose(dw, want, rtol=1e-10, atol=1e-10)
    assert not np.allclose(dw, dwe, rtol=1e-3)  # ... and not the exact gradient


# ------------------------------------------------------------------------ unbiasedness ----
# N = 20 rows in one tile, 4 even tiles, or 8 + 8 + 4; dY correlated with X as gradients are.
_N, _n, _m, _RATIO, _TRIALS = 20, 4, 3, 0.4, 4000
_CHUNKS = {"single": (20,), "even": (5, 5, 5, 5), "ragged": (8, 8, 4)}


def _draws(kind, mode, transform=None):
    """Per seed 0.._TRIALS-1, the sketched estimate of X^T dY (trials, n, m), with X, dY and k
    (vectorised: the sketches are stacked and every estimate is one batched product)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((_N, _n))
    dy = x @ rng.standard_normal((_n, _m)) + 0.5 * rng.standard_normal((_N, _m))
    offsets = np.cumsum((0,) + _CHUNKS[mode][:-1])
    boxes = [np.arange(o, o + c) for o, c in zip(offsets, _CHUNKS[mode])]
    k = rmm.sketch_size(kind, _RATIO, _N)
    seeds = [[t * len(boxes) + i for i in range(len(boxes))] if kind in rmm._DENSE else t for t in range(_TRIALS)]
    s = np.stack([_sketch_matrix(kind, t, k, _N, boxes, x) for t in seeds])  # (trials, N, k)
    if transform is not None:
        s = transform(s, k)
    xs, ys = np.einsum("tik,in->tkn", s, x), np.einsum("tik,im->tkm", s, dy)
    return np.einsum("tkn,tkm->tnm", xs, ys), x, dy, k


def _monte_carlo(kind, mode, transform=None):
    """Mean over seeds 0.._TRIALS-1 of the sketched X^T dY, and the exact X^T dY."""
    est, x, dy, _ = _draws(kind, mode, transform)
    return est.mean(axis=0), x.T @ dy


@by_kind
@by_mode
def test_every_sketch_is_unbiased(kind, mode):
    mean, exact = _monte_carlo(kind, mode)
    err = np.linalg.norm(mean - exact) / np.linalg.norm(exact)
    # measured, 4000 draws: 0.5% (rows) to 1.8% (dct); the standard error is ~1.3% (0.7% wta-crs)
    assert err < 0.04, f"{kind} {mode}: mean of {_TRIALS} sketched estimates is {err:.1%} off X^T dY"


def test_the_monte_carlo_check_catches_a_mis_scaled_sketch():
    # the DCT scaled by k * N as the public reference does (instead of N / k): ~k^2 too large
    mean, exact = _monte_carlo("dct", "ragged", transform=lambda s, k: s * math.sqrt(k * _N) / math.sqrt(_N / k))
    assert np.linalg.norm(mean - exact) / np.linalg.norm(exact) > 10


def test_wta_crs_keeps_the_winners_and_weights_the_rest():
    norms = np.array([10.0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    idx, scale = rmm.wta_crs_plan(norms, 4, seed=0)
    # p = (10, 1 x 11) / 21; scores (1 - 10/21) / 3 = 0.175 < 1/4 and (1 - 11/21) / 2 = 0.238: |C| = 1
    assert idx[0] == 0 and scale[0] == 1.0 and 0 not in idx[1:]
    np.testing.assert_allclose(scale[1:] ** 2, (11 / 21) / ((1 / 21) * 3))  # (1 - P_C) / (p_j (k - |C|))
    # no norms known (all zero): uniform p with the proper scale sqrt(N / k), not unscaled rows
    idx, scale = rmm.wta_crs_plan(np.zeros(12), 3, seed=0)
    np.testing.assert_allclose(scale, math.sqrt(12 / 3))


# ------------------------------------------------------------------ what the backward keeps ----
def _kept_bytes(loss, wrt, layer_scope: str) -> tuple[int, set]:
    """Bytes of the values made before the backward (activations, the sketch and its seed; not
    parameters or other leaves) that the backward kernels of ``layer_scope`` read, and their ids."""
    grads = tg.grad(loss, wrt)
    kept = {}
    for node in topo_order([r for g in grads for r in g.grid.flat]):
        if node.scope != f"{layer_scope}:backward":
            continue
        for r in node.inputs:
            if not r.node.is_leaf and not r.node.scope.endswith(":backward"):
                kept[(id(r.node), r.index)] = r.nbytes
    return sum(kept.values()), {key[0] for key in kept}


@pytest.mark.parametrize("kind", KINDS + (None,))
def test_backward_keeps_ratio_times_the_activation_bytes_and_never_x(kind):
    rng = np.random.default_rng(0)
    x0 = tg.from_numpy(rng.standard_normal((4, 250, 64)).astype(np.float32), (1, 125, 32))
    x = tg.relu(x0)  # an activation (N = 1000 rows, 256 KB)
    layer = tg.nn.Linear(64, 48, tile=32, seed=0, grad_sketch=kind, sketch_ratio=0.2)
    y = layer(x)
    r = tg.from_numpy(rng.standard_normal(y.shape).astype(np.float32), y.chunks)
    kept, ids = _kept_bytes((y * r).sum(), [layer.weight, layer.bias], "linear")
    if kind is None:
        assert kept == x.size * 4
        return
    k = rmm.sketch_size(kind, 0.2, 1000)
    # the seeds (one per row tile of x for a dense sketch, 4 x 2 here), or WTA-CRS's rows and scales
    plan = {"gaussian": 8 * 8, "rademacher": 8 * 8, "rows": 8, "dct": 8}.get(kind, k * 16)
    assert kept == k * 64 * 4 + plan  # S^T X (k, n) and the sketch's description
    assert not ids & {id(r.node) for r in x.grid.flat}
    assert kept / (x.size * 4) <= 0.2125  # measured: 0.2000 (0.2125 wta-crs): >= 4.7x less


# --------------------------------------------------------------------------- training ----
def _lm_loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


@pytest.mark.parametrize("kind", ["rademacher", "wta-crs"])
def test_training_with_sketched_gradients_learns_and_draws_a_new_sketch_every_step(kind, monkeypatch):
    model = apply_grad_sketch(models.build("gpt2-debug", seed=0), ["c_attn", "attn.o", "*.mlp.*"], kind, 0.5)
    assert len(sketched_layers(model)) == 2 * 6
    seeds = []
    fn = rmm._seed_k.fn

    def recording(*tiles, base, ndim=1):
        out = fn(*tiles, base=base, ndim=ndim)
        seeds.append((base, int(out.reshape(-1)[0])))
        return out

    monkeypatch.setattr(rmm._seed_k, "fn", recording)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (4, 17))
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-2), _lm_loss)
    losses = [step(ids[:, :-1], ids[:, 1:]) for _ in range(8)]
    assert losses[-1] < 0.9 * losses[0], losses
    per_layer: dict = {}
    for base, seed in seeds:
        per_layer.setdefault(base, []).append(seed)
    # a new seed every step (and for a dense sketch every row tile of each step)
    assert len(per_layer) == 12, per_layer.keys()
    assert all(len(set(s)) == len(s) and len(s) % 8 == 0 for s in per_layer.values()), per_layer


def test_the_largest_seeds_train_and_larger_ones_are_refused_up_front():
    """A seed of 2**64 or more was accepted and failed in the first step, inside the kernel that
    hashes it as 8 bytes ("OverflowError: int too big to convert"), and so did apply_grad_sketch's
    seed when a later layer's seed + i passed 2**64 - 1. Seeds that fit train (2**63 - 1, TOML's
    largest integer, for a whole model; 2**64 - 1 for one layer); larger ones are refused where
    they are given, the model's with the layer that does not fit."""
    model = apply_grad_sketch(models.build("gpt2-debug", seed=0), ["*.mlp.*"], "rows", 0.5, seed=2**63 - 1)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (4, 17))
    step = tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.1), _lm_loss)
    assert np.isfinite([step(ids[:, :-1], ids[:, 1:]) for _ in range(2)]).all()
    layer = tg.nn.Linear(6, 3, grad_sketch="rows", sketch_ratio=0.5, sketch_seed=2**64 - 1, seed=0)
    x = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
    step = tg.TrainStep(layer, tg.optim.SGD(layer.parameters(), lr=0.1), lambda m, x: tg.sum(m(x) * m(x)))
    assert np.isfinite(step(x))
    for seed in (2**64, 2**70):
        with pytest.raises(tg.TileError, match=r"sketch_seed must be an int >= 0 and <= 2\*\*64 - 1; "
                                               rf"received: {seed}"):
            apply_grad_sketch(models.build("gpt2-debug", seed=0), ["*.mlp.*"], "rows", 0.5, seed=seed)
        with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Linear\] sketch_seed must be"):
            tg.nn.Linear(4, 4, grad_sketch="rows", sketch_seed=seed)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.sketch.apply_grad_sketch\] seed \+ i <= 2\*\*64 - 1 for every "
                                           r"chosen layer .*the last chosen is layer \d+, blocks.1.mlp.fc2\): seed <= "
                                           rf"2\*\*64 - 1 - \d+; received: {2**64 - 1}"):
        apply_grad_sketch(models.build("gpt2-debug", seed=0), ["*.mlp.*"], "rows", 0.5, seed=2**64 - 1)


# -------------------------------------------------------------------------- bad input ----
def test_apply_grad_sketch_targets_and_turning_it_off():
    model = models.build("gpt2-debug", seed=0)
    apply_grad_sketch(model, ["c_fc", "blocks.1.attn.q"], "dct", 0.25, seed=3)
    assert sketched_layers(model) == {"blocks.0.mlp.fc1": ("dct", 0.25), "blocks.1.mlp.fc1": ("dct", 0.25),
                                      "blocks.1.attn.q": ("dct", 0.25)}
    apply_grad_sketch(model, ["*"], None)
    assert sketched_layers(model) == {}


def test_bad_inputs():
    model = models.build("gpt2-debug", seed=0)
    for ratio in (0, -0.1, 1.5, float("nan"), True, "0.2"):
        with pytest.raises(tg.TileError, match=r"sketch_ratio must be a number in \(0, 1\]"):
            apply_grad_sketch(model, ["c_fc"], "gaussian", ratio)
        with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Linear\] sketch_ratio"):
            tg.nn.Linear(4, 4, grad_sketch="gaussian", sketch_ratio=ratio)
    with pytest.raises(tg.TileError, match=r"grad_sketch must be None or one of gaussian, rademacher, rows, dct, "
                                           r"wta-crs; received: 'fourier'"):
        tg.nn.Linear(4, 4, grad_sketch="fourier")
    with pytest.raises(tg.TileError, match=r"sketch_seed must be an int >= 0"):
        tg.nn.Linear(4, 4, grad_sketch="rows", sketch_seed=-1)
    with pytest.raises(tg.TileError, match=r"targets \['nothing'\] match no Linear layer of the GPT2; its Linear "
                                           r"layers: blocks.0.attn.q, .*blocks.1.mlp.fc2"):
        apply_grad_sketch(model, ["mlp.fc1", "nothing"], "rows")
    x, w = tg.from_numpy(np.ones((4, 3))), tg.from_numpy(np.ones((3, 2)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.sketched_linear\] grad_sketch must be"):
        tg.ops.sketched_linear(x, w, sketch="srht")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.sketched_linear\] sketch must be one of"):
        tg.ops.sketched_linear(x, w, sketch=None)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.matmul\] contraction dims differ"):
        tg.ops.sketched_linear(x, tg.from_numpy(np.ones((4, 2))))
    assert sketched_layers(model) == {}  # nothing changed


# ------------------------------------------------ audit (issue 13): variance, training quality ----
@by_mode
def test_gaussian_sketch_variance_matches_the_formula(mode):
    """RMM: for a Gaussian S (E[S^T S] = I, k rows),
    E||est - G||_F^2 = (||X||_F^2 ||dY||_F^2 + ||X^T dY||_F^2) / k, G = X^T dY."""
    est, x, dy, k = _draws("gaussian", mode)
    g = x.T @ dy
    measured = ((est - g) ** 2).sum(axis=(1, 2)).mean()
    formula = (np.sum(x ** 2) * np.sum(dy ** 2) + np.sum(g ** 2)) / k
    # measured, 4000 draws: 0.985 / 0.997 / 0.989 of the formula (single / even / ragged), standard
    # error ~1.3%; dY correlated with X makes the ||X^T dY||^2 term 19% of it, so a formula (or a
    # sketch) without it would be off by more than the 10% allowed
    assert abs(measured / formula - 1) < 0.10, (mode, k, measured, formula)


def _chain_batches(vocab, n_batches, shape=(8, 33), seed=100):
    """Token batches of a noisy chain: each token follows its predecessor as (7 t + 3) mod vocab with
    probability 1/2, else is uniform; a new batch every step (loss floor ~2.9 nats, from 4.6)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        ids = np.empty(shape, np.int64)
        ids[:, 0] = rng.integers(0, vocab, shape[0])
        for t in range(1, shape[1]):
            follow = rng.random(shape[0]) < 0.5
            ids[:, t] = np.where(follow, (7 * ids[:, t - 1] + 3) % vocab, rng.integers(0, vocab, shape[0]))
        out.append(ids)
    return out


def test_training_with_a_gaussian_sketch_at_ratio_half_reaches_the_exact_loss(local_scheduler):
    """RMM: a model trained with ratio 0.5 reaches a loss close to exact training. The
    same gpt2-debug (seed 0), the same 100 batches, SGD with momentum (no per-weight normalisation
    that would hide a mis-scaled estimate): exact weight gradients against a Gaussian sketch of half
    the rows in every Linear."""
    from tilegraph.exec.program import one_blas_thread

    final = {}
    for kind in (None, "gaussian"):
        model = models.build("gpt2-debug", seed=0)
        if kind is not None:
            apply_grad_sketch(model, ["*"], kind, 0.5)
            assert len(sketched_layers(model)) == 12
        step = tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), _lm_loss)
        # one BLAS thread: the sketch's (k x N) products are big enough for OpenBLAS to start its
        # threads, which on 2 busy cores made the test take 50 s instead of 6
        with one_blas_thread():
            losses = [step(ids[:, :-1], ids[:, 1:]) for ids in _chain_batches(model.config.vocab_size, 100)]
        final[kind] = float(np.mean(losses[-5:]))  # the last 5 batches, the same for both
        # both fell clearly: measured 4.58 -> 3.52 (exact), 3.58 (gaussian)
        assert final[kind] < 0.85 * losses[0], (kind, losses[0], final[kind])
    # measured over 8 seeds (model, data and sketch): the sketched final loss is 0.8% to 2.3% above
    # the exact one (seed 0: +1.7%); 5% leaves twice the worst. A sketch over-scaled by 2 (an
    # estimate 4x too large) ends 8-10% above.
    assert abs(final["gaussian"] / final[None] - 1) < 0.05, final
