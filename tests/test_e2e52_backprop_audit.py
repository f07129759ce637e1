"""Audit of the memory-saving backprop and the adapters: activation recompute with dropout (layer,
attention inside the kernels, LoRA), grad sketches and LoRA/LoTR; weight-gradient sketches
(unbiased through the tile kernels, redrawn every step, reproduced on resume, edge sizes and
dtypes, frozen weights); LoTR's checks under save/load/merge; bad inputs. Each check against the
same computation without the feature (or the exact gradient), on single, even and ragged tiles."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._graph import topo_order
from tilegraph.ops import rmm
from tilegraph.sketch import apply_grad_sketch

from conftest import MODES, lm_ids, tiles_for
from test_recompute import ARCHS, TILINGS  # gpt2-debug and llama-debug; single, even and ragged tilings


@pytest.fixture(autouse=True)
def _in_process():
    old = tg.config.local_scheduler
    tg.config.local_scheduler = "sync"
    yield
    tg.config.local_scheduler = old


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(a, b))


# ------------------------------------------------------------- recompute x dropout, sketches, adapters ----
def _with_dropout(arch):
    cfg = models.config(arch)
    if arch.startswith("gpt2"):
        return dataclasses.replace(cfg, attn_dropout=0.2, resid_dropout=0.1, embd_dropout=0.1)
    return dataclasses.replace(cfg, attn_dropout=0.2)


def _nonzero_adapters(model):
    """Adapters start as the identity (LoRA's V, LoTR's cores zero): give them values, so that every
    adapter gradient is nonzero and compared."""
    rng = np.random.default_rng(7)
    for layer in peft.lora_layers(model).values():
        layer.lora_v.assign(0.3 * rng.standard_normal(layer.lora_v.shape))
    for layer in peft.lotr_layers(model).values():
        layer.lotr_core.assign(0.3 * rng.standard_normal(layer.lotr_core.shape))
    return model


SETUPS = {
    # every parameter trains; the MLPs' weight gradients sketched (WTA-CRS plans from ||x_i||)
    "sketch": lambda m: apply_grad_sketch(m, ["mlp.*"], "wta-crs", 0.5),
    "lora-dropout": lambda m: _nonzero_adapters(peft.apply_lora(m, ["attn.q", "attn.v"], rank=4, alpha=8,
                                                                dropout=0.3)),
    "lotr": lambda m: _nonzero_adapters(peft.apply_lotr(m, ["attn.q", "attn.v"], rank=4)),
}


def _training_grads(arch, mode, setup, recompute, training=True):
    model = SETUPS[setup](models.build(_with_dropout(arch), TILINGS[mode](arch), seed=1, dtype=np.float64))
    model.recompute = recompute
    ids = lm_ids(model.config.vocab_size, 0, (3, 9))
    params = peft.trainable_parameters(model)
    if training:
        with tg.nn.training():
            loss = tg.cross_entropy(model(ids[:, :-1]), model.tiling.tile_ids(ids[:, 1:]))
    else:
        loss = tg.cross_entropy(model(ids[:, :-1]), model.tiling.tile_ids(ids[:, 1:]))
    return tg.compute(loss, *tg.grad(loss, params))


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_recompute_in_training_with_every_dropout_gives_the_gradients_without_it(arch, mode, setup):
    """Attention dropout (inside the kernels), residual/embedding dropout (GPT-2) and LoRA dropout
    in training, with grad sketches or LoRA/LoTR adapters: the recomputed forward draws the same
    masks (and sketches), so loss and gradients equal those without recompute, bit for bit."""
    want = _training_grads(arch, mode, setup, False)
    got = _training_grads(arch, mode, setup, True)
    assert len(got) == len(want) and all(np.abs(g).max() > 0 for g in got[1:])  # every gradient exercised
    if setup == "lotr":
        # R and L are shared by the blocks: their gradients' per-block terms are summed in another
        # order with recompute (measured: 9e-19 apart on 1e-3); every other gradient bit for bit
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-16)
    else:
        assert _max_diff(got, want) == 0.0
    if mode == "ragged":  # ... and the dropout is really on: evaluation gives another loss
        assert _training_grads(arch, mode, setup, False, training=False)[0] != want[0]


def test_recompute_of_llama_with_dropout_trains_as_without_it():
    """A replayed TrainStep of a Llama with attention and LoRA dropout: the same losses and adapter
    values with and without recompute, step after step (new masks each step, the same in both)."""
    runs = []
    ids = lm_ids(128, 2, (2, 9))
    for recompute in (False, True):
        model = models.build(_with_dropout("llama-debug"), TILINGS["even"]("llama-debug"), seed=0,
                             dtype=np.float64, recompute=recompute)
        peft.apply_lora(model, ["attn.q", "attn.v"], rank=4, alpha=8, dropout=0.2)
        step = tg.TrainStep(model, tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-2), 
                            lambda m, x, y: tg.cross_entropy(m(x), y))
        losses = [step(ids[:, :-1], ids[:, 1:]) for _ in range(3)]
        runs.append((losses, {k: np.asarray(v) for k, v in model.state_dict().items() if "lora_" in k}))
    assert len(set(runs[0][0])) == 3
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-12)
    for name, value in runs[0][1].items():
        np.testing.assert_allclose(runs[1][1][name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_of_a_plain_function_draws_the_forwards_dropout_masks(mode):
    """tg.checkpoint of a function (not a module) calling ops.dropout and sdpa with dropout_p: their
    masks are seeded from the scope they are recorded in, and the recompute was recorded in the
    backward's scope (``...:backward``), so it drew other masks than its forward: the gradients were
    those of another mask (found by this audit; fixed: the recompute records in the forward's scope)."""
    rng = np.random.default_rng(0)
    sizes: dict = {}
    x_np, w_np = rng.standard_normal((6, 8)), rng.standard_normal((8, 5))
    x = tg.from_numpy(x_np, tiles_for(x_np.shape, "nk", mode, sizes))
    w = tg.from_numpy(w_np, tiles_for(w_np.shape, "km", mode, sizes))
    q_np = rng.standard_normal((2, 2, 8, 4))
    q = tg.from_numpy(q_np, tiles_for(q_np.shape, "bhtD", mode))  # D in one tile

    def mlp(a, p=0.5):
        return tg.ops.dropout(tg.gelu(a @ w), p)

    def attention(a, p=0.3):
        return tg.scaled_dot_product_attention(a, a * 0.5, a, dropout_p=p, is_causal=True)

    for fn, arg, wrt in ((mlp, x, [x, w]), (attention, q, [q])):
        results = []
        for wrap in (lambda f, a: f(a), tg.checkpoint):
            y = wrap(fn, arg)
            results.append(tg.compute(y, *tg.grad((y * y).sum(), wrt)))
        assert _max_diff(results[1], results[0]) == 0.0, fn.__name__
        y = fn(arg, 0.0)  # the dropout is on: without it the output is another
        assert not np.allclose(tg.compute(y)[0], results[0][0]), fn.__name__


def test_a_recompute_that_records_another_graph_is_an_error():
    """fn must record the same graph when called again. A fn whose second call returned fewer rows
    (or handed its input on) was differentiated as if it were the forward: silently wrong
    gradients (3s where 2s were due, found by this audit). Now a TileError naming fn."""
    x = tg.from_numpy(np.ones((4, 3)))
    for second in (lambda a: (a * 3)[:2], lambda a: a):
        calls = []

        def counter(a, second=second):
            calls.append(1)
            return a * 2 if len(calls) == 1 else second(a)

        y = tg.checkpoint(counter, x)
        with pytest.raises(tg.TileError, match=r"tilegraph.checkpoint \(the recompute\).*counter.*same graph"):
            tg.grad(y.sum(), [x])
    # a fn that records the same graph again is fine
    (g,) = tg.grad(tg.checkpoint(lambda a: a * 2, x).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), 2.0)


# --------------------------------------------------------------------------- grad sketches ----
_N, _n, _m, _RATIO, _TRIALS = 20, 4, 3, 0.4, 2000
_CHUNKS = {"single": (20,), "even": (5, 5, 5, 5), "ragged": (8, 8, 4)}


def _kernel_estimate(kind, seed, x, dy, chunks, dtype):
    """X_s^T (S^T dY) computed by the layer's own tile kernels (the seed kernel's output given:
    ``seed``, and for a dense sketch one seed per row tile from it), over the row tiles ``chunks``:
    the seed/plan, the sketch of every row tile, their sum."""
    k = rmm.sketch_size(kind, _RATIO, _N)
    offsets = np.cumsum((0,) + chunks[:-1])
    seed_tile = np.array([seed], np.uint64)
    if kind == "wta-crs":
        parts = [rmm._row_sumsq_k.fn(x[o:o + c]) for o, c in zip(offsets, chunks)]
        plan = rmm._wta_plan_k.fn(seed_tile, *parts, k=k, n_rows=_N, lead_shape=(_N,),
                                  boxes=tuple(((o,), (c,)) for o, c in zip(offsets, chunks)), n_col_tiles=1)
    else:
        plan = (seed_tile,)

    def plan_of(i):
        return (np.array([seed * len(chunks) + i], np.uint64),) if kind in rmm._DENSE else plan

    def sketch(a):
        return sum(rmm._sketch_k.fn(*plan_of(i), a[o:o + c], kind=kind, k=k, n_rows=_N, lead_shape=(_N,), offset=(o,))
                   for i, (o, c) in enumerate(zip(offsets, chunks)))

    xs, ys = sketch(x.astype(dtype)), sketch(dy.astype(dtype))
    assert xs.dtype == dtype and xs.shape == (k, _n)
    return xs.astype(np.float64).T @ ys.astype(np.float64)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
@pytest.mark.parametrize("kind", rmm.SKETCHES)
def test_every_sketch_is_unbiased_through_its_tile_kernels(kind, dtype):
    """Monte-Carlo (ALGORITHMS.md section 4): the mean over 2000 seeds of the estimate the kernels
    compute (ragged row tiles: 8 + 8 + 4) is within a few percent of X^T dY, in float64 and float16;
    a single estimate is not X^T dY (it is random)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((_N, _n))
    dy = x @ rng.standard_normal((_n, _m)) + 0.5 * rng.standard_normal((_N, _m))
    exact = x.T @ dy
    est = np.stack([_kernel_estimate(kind, t, x, dy, _CHUNKS["ragged"], dtype) for t in range(_TRIALS)])
    err = np.linalg.norm(est.mean(0) - exact) / np.linalg.norm(exact)
    # standard error of the mean ~1.3-1.8% (wta-crs ~0.7%) in float64
    assert err < 0.05, f"{kind} {np.dtype(dtype)}: {err:.1%}"
    assert np.linalg.norm(est[0] - exact) / np.linalg.norm(exact) > 0.01


def _seed_recorder(monkeypatch):
    seeds: list = []
    fn = rmm._seed_k.fn

    def recording(*tiles, base, ndim=1):
        out = fn(*tiles, base=base, ndim=ndim)
        seeds.append((base, int(out.reshape(-1)[0])))
        return out

    monkeypatch.setattr(rmm._seed_k, "fn", recording)
    return seeds


def _sketched_gpt2(kind="rows"):
    model = models.build("gpt2-debug", TILINGS["ragged"]("gpt2-debug"), seed=0, dtype=np.float64)
    return apply_grad_sketch(model, ["mlp.*"], kind, 0.5, seed=11)


def test_a_replayed_and_a_multi_step_train_step_draw_a_new_sketch_every_step(monkeypatch):
    seeds = _seed_recorder(monkeypatch)
    model = _sketched_gpt2("gaussian")
    ids = lm_ids(96, 3, (4, 9))
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-2),
                        lambda m, x, y: tg.cross_entropy(m(x), y))
    losses = [step(ids[:, :-1], ids[:, 1:]) for _ in range(3)]
    losses += [p.result() for p in step.submit_steps([(ids[:, :-1], ids[:, 1:])] * 2)]  # 2 steps, one graph
    per_layer: dict = {}
    for base, seed in seeds:
        per_layer.setdefault(base, []).append(seed)
    # 4 sketched layers (fc1, fc2 of 2 blocks), 5 steps: a new seed for every row tile of every step
    # (a new S every step; a Gaussian S is drawn per row tile)
    assert len(per_layer) == 4, per_layer
    assert all(len(s) == len(set(s)) and len(s) % 5 == 0 for s in per_layer.values()), per_layer
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_resume_from_a_checkpoint_draws_the_sketches_of_the_uninterrupted_run(tmp_path, monkeypatch):
    """The seed is a hash of the weight: a run restored from a checkpoint (weights and AdamW state)
    draws, step for step, the sketches and losses of the run that went on."""
    seeds = _seed_recorder(monkeypatch)
    ids = lm_ids(96, 4, (4, 9))

    def loss_fn(m, x, y):
        return tg.cross_entropy(m(x), y)

    model = _sketched_gpt2("wta-crs")
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, loss_fn)
    whole = [step(ids[:, :-1], ids[:, 1:]) for _ in range(4)]
    whole_seeds = list(seeds)
    seeds.clear()

    model = _sketched_gpt2("wta-crs")
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, loss_fn)
    first = [step(ids[:, :-1], ids[:, 1:]) for _ in range(2)]
    tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    resumed = _sketched_gpt2("wta-crs")
    resumed_opt = tg.optim.AdamW(resumed.parameters(), lr=1e-2)
    tg.io.load_checkpoint(tmp_path / "ck").restore(resumed, resumed_opt)
    step = tg.TrainStep(resumed, resumed_opt, loss_fn)
    second = [step(ids[:, :-1], ids[:, 1:]) for _ in range(2)]
    assert seeds == whole_seeds and len(set(s for _, s in seeds)) == len(seeds) == 16
    np.testing.assert_array_equal(first + second, whole)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_a_batch_of_one_row_and_a_ratio_below_one_row(dtype):
    """N = 1: k = 1 row (WTA-CRS's floor of 10 cut to N); "rows", "dct", "rademacher" and "wta-crs"
    then give the exact dW, gaussian a positive multiple of it. N = 20 at ratio 0.01 (0.2 rows):
    k = 1, and "rows" gives N x one row's outer product."""
    rng = np.random.default_rng(3)
    x_np, w_np, r_np = (rng.standard_normal(s).astype(dtype) for s in ((1, 6), (6, 3), (1, 3)))
    x, w = tg.from_numpy(x_np), tg.from_numpy(w_np)
    exact = x_np.astype(np.float64).T @ r_np.astype(np.float64)
    tol = 2e-3 if dtype == np.float16 else 1e-12
    for kind in rmm.SKETCHES:
        assert rmm.sketch_size(kind, 0.2, 1) == 1
        y = tg.ops.sketched_linear(x, w, sketch=kind, ratio=0.2)
        (dw,) = tg.compute(*tg.grad((y * tg.from_numpy(r_np)).sum(), [w]))
        assert dw.dtype == dtype and dw.shape == (6, 3)
        dw = dw.astype(np.float64)
        if kind == "gaussian":
            c = float((dw * exact).sum() / (exact * exact).sum())
            assert c > 0
            np.testing.assert_allclose(dw, c * exact, rtol=tol * 10, atol=tol * 10)
        else:
            np.testing.assert_allclose(dw, exact, rtol=tol, atol=tol * np.abs(exact).max(), err_msg=kind)
    x_np = rng.standard_normal((20, 6)).astype(dtype)
    dy_np = rng.standard_normal((20, 3)).astype(dtype)
    assert rmm.sketch_size("rows", 0.01, 20) == 1 and rmm.sketch_size("wta-crs", 0.01, 20) == 10
    y = tg.ops.sketched_linear(tg.from_numpy(x_np, (7, 6)), w, sketch="rows", ratio=0.01)
    (dw,) = tg.compute(*tg.grad((y * tg.from_numpy(dy_np, (7, 3))).sum(), [w]))
    outer = [20 * np.outer(x_np[i], dy_np[i]).astype(np.float64) for i in range(20)]
    assert min(np.abs(dw.astype(np.float64) - o).max() for o in outer) <= (0.1 if dtype == np.float16 else 1e-10)


def test_a_sketch_on_a_frozen_weight_warns_does_no_sketch_work_and_leaves_dx_exact():
    model = tg.nn.MLP(6, 8, seed=0, dtype=np.float64)
    model.fc1.weight.requires_grad = False
    with pytest.warns(UserWarning, match=r"apply_grad_sketch.*frozen.*fc1"):
        apply_grad_sketch(model, ["fc1", "fc2"], "gaussian", 0.5)
    exact = tg.nn.MLP(6, 8, seed=0, dtype=np.float64)
    x = tg.from_numpy(np.random.default_rng(5).standard_normal((10, 6)), (4, 6))
    got, want = [], []
    for m, out in ((model, got), (exact, want)):
        loss = (m(x) ** 2).sum()
        grads = tg.grad(loss, [x, m.fc1.bias, m.fc2.weight])
        # only the trainable fc2's sketch runs: fc1 (frozen) keeps and sketches nothing
        scopes = {n.scope.split(":")[0] for n in topo_order([r for t in (loss, *grads) for r in t.grid.flat])
                  if n.op == "rmm"}
        assert scopes == ({"fc2"} if m is model else set())
        out += tg.compute(*grads)[:2]
    # dX and fc1's db: exact (fc2's dX is dY W^T, exact; fc1 has no dW to estimate)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def test_a_sketch_target_that_is_an_adapters_frozen_base_is_refused_naming_it():
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
    with pytest.raises(tg.TileError, match=r"apply_grad_sketch.*'attn.q' matches only layers whose base weight is "
                                           r"frozen: blocks.0.attn.q \(LoRALinear\)"):
        apply_grad_sketch(model, ["attn.q"], "rows", 0.5)


# -------------------------------------------------------------------------------- LoTR ----
def test_lotr_shares_storage_starts_as_the_base_and_counts_under_checkpoint_load_and_merge(tmp_path):
    tiling = TILINGS["ragged"]("gpt2-debug")
    ids = lm_ids(96, 1, (2, 9))

    def build(seed):
        return peft.apply_lotr(models.build("gpt2-debug", tiling, seed=0, dtype=np.float64), ["attn.q", "attn.v"],
                               rank=4, seed=seed)

    def shared(model):
        layers = list(peft.lotr_layers(model).values())
        return len(layers) == 4 and all(l.lotr_left is layers[0].lotr_left and l.lotr_right is layers[0].lotr_right
                                        for l in layers)

    base = models.build("gpt2-debug", tiling, seed=0, dtype=np.float64)
    model = build(9)
    np.testing.assert_array_equal(tg.compute(model(ids))[0], tg.compute(base(ids))[0])  # identity at init
    count = 2 * 32 * 4 + 4 * 4 * 4  # 2 d r + L r^2, one (32, 32) group of 4 layers
    assert shared(model) and sum(p.size for p in peft.trainable_parameters(model)) == count
    opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-2, weight_decay=0.0)
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))
    [step(ids[:, :-1], ids[:, 1:]) for _ in range(2)]
    trained = tg.compute(model(ids))[0]
    assert shared(model) and not np.array_equal(trained, tg.compute(base(ids))[0])

    tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    restored = build(3)
    tg.io.load_checkpoint(tmp_path / "ck").restore(
        restored, tg.optim.AdamW(peft.trainable_parameters(restored), lr=1e-2, weight_decay=0.0))
    peft.save_adapters(tmp_path / "ad", model)
    loaded = peft.load_adapters(tmp_path / "ad", models.build("gpt2-debug", tiling, seed=0, dtype=np.float64))
    for other in (restored, loaded):
        assert shared(other) and sum(p.size for p in peft.trainable_parameters(other)) == count
        np.testing.assert_array_equal(tg.compute(other(ids))[0], trained)
    peft.merge_lora(loaded)
    assert not peft.lotr_layers(loaded)
    np.testing.assert_allclose(tg.compute(loaded(ids))[0], trained, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- bad inputs ----
def _mlp():
    return tg.nn.MLP(4, 8, seed=0)


BAD = {
    # (call, where, what, received)
    "ratio 0": (lambda: apply_grad_sketch(_mlp(), ["fc1"], "gaussian", 0), "apply_grad_sketch", r"\(0, 1\]", "0"),
    "ratio 1.5": (lambda: apply_grad_sketch(_mlp(), ["fc1"], "gaussian", 1.5), "apply_grad_sketch", r"\(0, 1\]", "1.5"),
    "ratio nan": (lambda: apply_grad_sketch(_mlp(), ["fc1"], "rows", math.nan), "apply_grad_sketch", r"\(0, 1\]", "nan"),
    # math.isfinite(10**400) raised OverflowError (found by this audit)
    "ratio 10**400": (lambda: apply_grad_sketch(_mlp(), ["fc1"], "rows", 10**400), "apply_grad_sketch",
                      r"\(0, 1\]", "1000000000"),
    "Linear ratio 10**400": (lambda: tg.nn.Linear(4, 3, grad_sketch="rows", sketch_ratio=-10**400), "tilegraph.nn.Linear",
                             r"\(0, 1\]", "-1000000000"),
    "unknown sketch": (lambda: apply_grad_sketch(_mlp(), ["fc1"], "gauss", 0.2), "apply_grad_sketch",
                       "one of gaussian, rademacher, rows, dct, wta-crs", "'gauss'"),
    "Linear sketch": (lambda: tg.nn.Linear(4, 3, grad_sketch="Gaussian"), "tilegraph.nn.Linear", "one of gaussian",
                      "'Gaussian'"),
    "targets": (lambda: apply_grad_sketch(_mlp(), ["nothing"], "rows", 0.2), "apply_grad_sketch",
                "match no Linear layer of the MLP; its Linear layers: fc1, fc2", "nothing"),
    "op sketch None": (lambda: tg.ops.sketched_linear(tg.from_numpy(np.ones((3, 4))), tg.from_numpy(np.ones((4, 2))),
                                                      sketch=None), "sketched_linear", "one of gaussian", "None"),
    "lotr targets": (lambda: peft.apply_lotr(models.build("gpt2-debug"), ["nope"], rank=2), "apply_lotr",
                     "match no Linear layer", "nope"),
    "lotr rank": (lambda: peft.apply_lotr(models.build("gpt2-debug"), ["attn.q"], rank=0), "apply_lotr",
                  "rank must be an int >= 1", "0"),
    "lora dropout": (lambda: peft.apply_lora(models.build("gpt2-debug"), ["attn.q"], rank=2, dropout=1.0), "apply_lora",
                     r"dropout must be a number in \[0, 1\)", "1.0"),
    "recompute value": (lambda: setattr(models.build("gpt2-debug"), "recompute", "yes"), "GPT2.recompute",
                        "True or False", "'yes'"),
    "checkpoint fn": (lambda: tg.checkpoint(3, tg.from_numpy(np.ones(3))), "tilegraph.checkpoint", "callable", "int"),
    "checkpoint output": (lambda: tg.checkpoint(lambda a: (a, a), tg.from_numpy(np.ones(3))), "tilegraph.checkpoint",
                          "one TileTensor", "tuple"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_option_is_one_error_naming_where_what_and_received(case):
    call, where, what, received = BAD[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one clear error, not a warning on the way
        with pytest.raises(tg.TileError) as info:
            call()
    text = str(info.value)
    assert where in text.split("]")[0], text
    head, _, tail = text.partition("received:")
    assert tail and __import__("re").search(what, head) and received in tail, text
