"""LoRA dropout (peft's lora_dropout): the adapter's input dropped out in training steps only, a
new mask every step and every micro-batch from a counter-based generator seeded by the layer's U
and V and the rows of its input, against torch autograd with the exact mask; no dropout in
evaluation, generation or a plain forward."""

import math

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._graph import topo_order
from tilegraph.ops import lora as L
from tilegraph.ops.dropout import keep_mask, step_seed

from conftest import MODES, TOL, _close, lm_ids, lm_loss, tiles_for

B, T, N_IN, M_OUT, RANK, ALPHA, P = 2, 5, 7, 9, 4, 3.0, 0.3
ALLOWED = [(f, b) for f in L.DROPOUT_FORWARD for b in L.DROPOUT_BACKWARD]


def _first_tile(p) -> np.ndarray:
    return p.numpy()[tuple(slice(0, c[0]) for c in p.chunks)]


def _mask_of(layer, x: np.ndarray, chunks=None) -> np.ndarray:
    """The keep-mask the layer's dropout uses now on ``x`` tiled as ``chunks`` (default: one tile):
    each row block's seed hashes U's and V's first tiles and the block's first tile of x."""
    chunks = chunks or tuple((s,) for s in x.shape)
    u, v = _first_tile(layer.lora_u), _first_tile(layer.lora_v)
    starts = [np.cumsum((0,) + tuple(c)) for c in chunks[:-1]]
    mask = np.zeros(x.shape, bool)
    for lead in np.ndindex(*[len(c) for c in chunks[:-1]]):
        rows = tuple(slice(b[i], b[i + 1]) for b, i in zip(starts, lead))
        seed = step_seed(layer.dropout_seed, u, v, x[rows + (slice(0, chunks[-1][0]),)])
        mask[rows] = keep_mask(seed, x.shape, layer.dropout, offset=[r.start for r in rows] + [0],
                               tile_shape=x[rows].shape)
    return mask


def _layer(mode, dropout=P, variant=None, seed=0):
    sizes: dict = {}
    n_tile, m_tile = (tiles_for((N_IN, M_OUT), "nm", mode, sizes))
    base = tg.nn.Linear(N_IN, M_OUT, tile=n_tile, out_tile=m_tile, dtype=np.float64, seed=seed)
    layer = tg.nn.LoRALinear(base, RANK, ALPHA, dropout=dropout, variant=variant, seed=seed)
    # V starts at zero (the adapter adds nothing): give it values so every gradient is exercised
    layer.lora_v.assign(np.random.default_rng(seed + 1).standard_normal((RANK, M_OUT)))
    return layer, sizes


def _torch_lora(layer, x, r, mask):
    """Forward and gradients of sum(y * r) by torch: base(x) + scale * lora_B(lora_A(mask * x / (1 - p)))."""
    torch = pytest.importorskip("torch")
    base = torch.nn.Linear(N_IN, M_OUT, dtype=torch.float64)
    lora_a = torch.nn.Linear(N_IN, RANK, bias=False, dtype=torch.float64)
    lora_b = torch.nn.Linear(RANK, M_OUT, bias=False, dtype=torch.float64)
    with torch.no_grad():
        base.weight.copy_(torch.tensor(layer.weight.numpy().T))
        base.bias.copy_(torch.tensor(layer.bias.numpy()))
        lora_a.weight.copy_(torch.tensor(layer.lora_u.numpy().T))
        lora_b.weight.copy_(torch.tensor(layer.lora_v.numpy().T))
    tx = torch.tensor(x, requires_grad=True)
    dropped = tx * torch.tensor(mask, dtype=torch.float64) / (1 - layer.dropout)
    y = base(tx) + layer.scale * lora_b(lora_a(dropped))
    (y * torch.tensor(r)).sum().backward()
    return y.detach().numpy(), tx.grad.numpy(), lora_a.weight.grad.numpy().T, lora_b.weight.grad.numpy().T


# ------------------------------------------------------------------------- against torch ----
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ALLOWED + [None], ids=["-".join(v) for v in ALLOWED] + ["auto"])
def test_training_forward_and_gradients_match_torch_with_the_mask_used(variant, mode):
    layer, sizes = _layer(mode, variant=variant)
    rng = np.random.default_rng(2)
    x, r = rng.standard_normal((B, T, N_IN)), rng.standard_normal((B, T, M_OUT))
    tx = tg.from_numpy(x, tiles_for(x.shape, "btn", mode, sizes))
    tr = tg.from_numpy(r, tiles_for(r.shape, "btm", mode, sizes))
    with tg.nn.training():
        y = layer(tx)
        grads = tg.grad((y * tr).sum(), [tx, layer.lora_u, layer.lora_v])
    ctx = y._record.ctx
    assert ctx.dropout == P and ctx.backward in L.DROPOUT_BACKWARD
    if variant is not None:
        assert ctx.backward == variant[1]
    mask = _mask_of(layer, x, tx.chunks)
    assert 0 < mask.sum() < mask.size  # some elements dropped, some kept
    want = _torch_lora(layer, x, r, mask)
    rtol, atol = TOL[np.dtype(np.float64)]
    for got, w, what in zip(tg.compute(y, *grads), want, ("y", "dx", "dU", "dV")):
        _close(got, w, rtol, atol, what)
    # the dropout really is on: without the mask torch's answer is another one
    assert not np.allclose(tg.compute(y)[0], _torch_lora(layer, x, r, np.ones_like(mask))[0])


def test_quantized_base_with_dropout_equals_the_dequantized_one():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 12)).astype(np.float32)
    q = peft.QuantizedTensor.from_array(w, (8, 6), "int8")
    dense = tg.nn.Linear(16, 12, tile=8, out_tile=6, bias=False, seed=0)
    dense.weight.assign(q.dequantized().numpy())
    x = tg.from_numpy(rng.standard_normal((6, 16)).astype(np.float32), (3, 8))
    out = []
    for base in (peft.QuantizedLinear(q), dense):
        layer = tg.nn.LoRALinear(base, 2, 4, dropout=0.25, seed=5)
        layer.lora_v.assign(np.ones((2, 12), np.float32))
        with tg.nn.training():
            y = layer(x)
            out.append(tg.compute(y, *tg.grad(y.sum(), [x, layer.lora_u, layer.lora_v])))
    for a, b in zip(*out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_recomputed_block_draws_the_same_mask():
    layer, _ = _layer("even")
    x = tg.from_numpy(np.random.default_rng(4).standard_normal((B, T, N_IN)), (1, 5, 7))
    got = []
    for wrap in (lambda f, a: f(a), tg.checkpoint):
        with tg.nn.training():
            y = wrap(layer, x)
            got.append(tg.compute(y, *tg.grad((y * y).sum(), [x, layer.lora_u, layer.lora_v])))
    for a, b in zip(*got):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_the_mask_is_regenerated_in_the_backward_never_stored():
    layer, sizes = _layer("even")
    x = tg.from_numpy(np.ones((B, T, N_IN)), tiles_for((B, T, N_IN), "btn", "even", sizes))
    with tg.nn.training():
        y = layer(x)
        grads = tg.grad(y.sum(), [x, layer.lora_u, layer.lora_v])
    forward = topo_order(list(y.grid.flat))
    backward = topo_order([r for g in grads for r in g.grid.flat])
    in_forward = {id(n) for n in forward}
    drops = [n for n in backward if n.kernel is not None and n.kernel.name == "dropout"]
    # the backward drops out X again (for dU, dV) and dX's adapter part, with its own kernels ...
    assert drops and not any(id(n) in in_forward for n in drops)
    # ... from the seed tiles of this layer's step, one per row block of x, made in the forward
    seeds = {id(n) for n in forward + backward if n.kernel is not None and n.kernel.name == "dropout_seed"}
    assert len(seeds) == math.prod(x.tiling.grid[:-1]) and seeds <= in_forward


# ------------------------------------------------------------------------ the mask itself ----
def test_keep_mask_fraction_tiles_and_tilings():
    p, shape = 0.1, (300, 400)
    mask = keep_mask(12345, shape, p)
    sigma = math.sqrt(p * (1 - p) / mask.size)
    assert abs(mask.mean() - (1 - p)) < 5 * sigma  # 5 sigma: ~1 in 3.5 million by chance
    # another seed: an independent mask (agreement p^2 + (1-p)^2, not 1)
    other = keep_mask(12346, shape, p)
    agree = (mask == other).mean()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 5 * math.sqrt(agree * (1 - agree) / mask.size)
    # tiles of one tensor get their own masks (rows 0-99 and 100-199 differ), and a tile's mask
    # is the whole tensor's mask at its place, whatever the tiling
    assert (mask[:100] != mask[100:200]).any()
    np.testing.assert_array_equal(keep_mask(12345, shape, p, (100, 150), (50, 70)), mask[100:150, 150:220])
    ones = np.ones(shape, np.float32)
    outs = [tg.ops.dropout(tg.from_numpy(ones, tiles), p, seed=12345).numpy() for tiles in (None, (64, 128), (7, 400))]
    for y in outs:
        np.testing.assert_array_equal(y, mask * np.float32(1 / (1 - p)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_kernel_equals_the_array_kernel_bit_for_bit(dtype):
    """The Numba CPU kernel and the NumPy/CuPy one give the same bits (zeros' signs, NaN kept)."""
    from tilegraph.ops.dropout import _dropout_k

    rng = np.random.default_rng(8)
    cases = (((3, 5, 7), (2, 10, 14), (9, 40, 30)), ((13,), (4,), (40,)), ((64, 96), (0, 0), (64, 96)))
    for tile, offset, whole in cases:
        a = rng.standard_normal(tile).astype(dtype)
        a.reshape(-1)[:3] = (np.nan, -np.inf, -0.0)
        seed = np.array([2 ** 63 + 99], np.uint64)
        for p in (0.05, 0.5, 0.9):
            params = dict(p=p, shape=whole, offset=offset, itemsize=a.itemsize)
            with np.errstate(invalid="ignore"):  # -inf * 0
                want, got = _dropout_k.fn(seed, a, **params), _dropout_k.cpu(seed, a, **params)
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
            finite = np.isfinite(a) & (a != 0)  # NaN, -inf (inf * 0 is NaN, as in torch) and -0.0 aside
            keep = keep_mask(int(seed[0]), whole, p, offset, tile)
            np.testing.assert_array_equal((want != 0)[finite], keep[finite])


def test_dropout_op_gradient_uses_the_same_mask():
    rng = np.random.default_rng(5)
    x, r = rng.standard_normal((6, 10)), rng.standard_normal((6, 10))
    tx = tg.from_numpy(x, (4, 3))
    y = tg.ops.dropout(tx, 0.4, seed=9)
    (dx,) = tg.grad((y * tg.from_numpy(r, (4, 3))).sum(), [tx])
    got_y, got_dx = tg.compute(y, dx)
    mask = keep_mask(9, x.shape, 0.4)
    np.testing.assert_allclose(got_y, x * mask / 0.6, rtol=1e-15)
    np.testing.assert_allclose(got_dx, r * mask / 0.6, rtol=1e-15)
    assert tg.ops.dropout(tx, 0.0) is tx


def test_mask_changes_every_training_step():
    """The losses of replayed TrainStep steps are those of the mask hashed from that step's U and V."""
    layer, _ = _layer("single", dropout=0.5)
    rng = np.random.default_rng(6)
    x, r = rng.standard_normal((B, T, N_IN)), rng.standard_normal((B, T, M_OUT))
    opt = tg.optim.SGD([layer.lora_u, layer.lora_v], lr=0.05)
    step = tg.TrainStep(layer, opt, lambda m, tx, tr: (m(tx) * tr).sum())

    def loss_with(mask):
        return float((_torch_lora(layer, x, r, mask)[0] * r).sum())

    masks = []
    for _ in range(3):
        mask = _mask_of(layer, x)
        want, without = loss_with(mask), loss_with(np.ones_like(mask))
        got = step(x, r)
        assert got == pytest.approx(want, rel=1e-10) and got != pytest.approx(without, rel=1e-6)
        if masks:  # a new mask, and the step used it (not the previous one)
            assert (mask != masks[-1]).any()
            assert got != pytest.approx(loss_with(masks[-1]), rel=1e-6)
        masks.append(mask)


# ------------------------------------------------------------------------- dropout = 0 ----
def test_dropout_zero_is_bit_identical_to_the_layer_without_dropout():
    """A TrainStep of a LoRALinear with dropout=0 records the graph of lora_linear without dropout:
    the same kernels, the same losses and parameters bit for bit."""
    rng = np.random.default_rng(7)
    x, r = rng.standard_normal((B, T, N_IN)), rng.standard_normal((B, T, M_OUT))
    runs = []
    for direct in (False, True):
        layer, sizes = _layer("ragged", dropout=0.0)
        if direct:  # the op as it was called before dropout existed
            def loss_fn(m, tx, tr):
                return (tg.ops.lora_linear(tx, m.weight, m.lora_u, m.lora_v, m.bias, scale=m.scale) * tr).sum()
        else:
            def loss_fn(m, tx, tr):
                return (m(tx) * tr).sum()
        step = tg.TrainStep(layer, tg.optim.AdamW([layer.lora_u, layer.lora_v], lr=1e-2), loss_fn,
                            batch_tiles=[tiles_for(x.shape, "btn", "ragged", sizes),
                                         tiles_for(r.shape, "btm", "ragged", sizes)])
        losses = [step(x, r) for _ in range(3)]
        kernels = sorted(n.kernel.name for n in topo_order(step.plan(x, r).roots) if n.kernel is not None)
        runs.append((losses, layer.lora_u.numpy(), layer.lora_v.numpy(), kernels))
    (la, ua, va, ka), (lb, ub, vb, kb) = runs
    assert la == lb
    np.testing.assert_array_equal(ua, ub)
    np.testing.assert_array_equal(va, vb)
    assert ka == kb and "matmul" in ka and not {"dropout", "dropout_seed"} & set(ka)


# ------------------------------------------------------------------- no dropout outside ----
def _pair_of_models():
    """gpt2-debug with LoRA adapters, without and with dropout, their V equal and not zero."""
    out = []
    for dropout in (0.0, 0.3):
        model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v", "mlp.fc1"], rank=4,
                                alpha=8, dropout=dropout, seed=0)
        for i, (name, m) in enumerate(sorted(peft.lora_layers(model).items())):
            m.lora_v.assign(np.random.default_rng(i).standard_normal(m.lora_v.shape).astype(np.float32) * 0.5)
        out.append(model)
    return out


def test_evaluation_generation_and_plain_forward_have_no_dropout():
    plain, dropped = _pair_of_models()
    vocab = plain.config.vocab_size
    ids = lm_ids(vocab, 1, (2, 8))
    # a plain forward: no dropout (bit for bit the model without it) ...
    np.testing.assert_array_equal(tg.compute(dropped(ids))[0], tg.compute(plain(ids))[0])
    # ... while a training step's forward has it
    with tg.nn.training():
        assert not np.allclose(tg.compute(dropped(ids))[0], tg.compute(plain(ids))[0], atol=1e-4)
    # Trainer evaluation
    data = lm_ids(vocab, 2, (4, 9))
    evals = []
    for model in (plain, dropped):
        trainer = tg.Trainer(model, tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-3),
                             lambda step: (data[:, :-1], data[:, 1:]), loss_fn=lm_loss, batch_size=4,
                             eval_data=lambda i: (data[:, :-1], data[:, 1:]), progress=False)
        evals.append(trainer.evaluate(2))
    assert evals[0] == evals[1]
    # generation (greedy, with the KV cache)
    prompt = lm_ids(vocab, 3, (2, 4))
    np.testing.assert_array_equal(models.generate(dropped, prompt, 5), models.generate(plain, prompt, 5))


# ------------------------------------------------------------------------------ training ----
def test_training_with_dropout_lowers_the_loss():
    runs = {}
    for dropout in (0.0, 0.1):
        model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v"], rank=4, alpha=8,
                                dropout=dropout)
        ids = lm_ids(model.config.vocab_size, 1, (4, 9))
        opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=2e-2, weight_decay=0.0)
        trainer = tg.Trainer(model, opt, lambda step: (ids[:, :-1], ids[:, 1:]), loss_fn=lm_loss, batch_size=4,
                             progress=False)
        runs[dropout] = trainer.fit(8).losses
    losses = runs[0.1]
    assert losses[-1] < losses[0] - 0.05
    # the first step's adapters add nothing (V = 0): same loss; then dropout changes the updates
    assert losses[0] == pytest.approx(runs[0.0][0], rel=1e-6)
    assert losses[3:] != pytest.approx(runs[0.0][3:], rel=1e-6)


# ---------------------------------------------------------------------------- bad values ----
@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "0.1", None, True, False],
                         ids=lambda v: repr(v))
def test_bad_dropout_is_an_error_naming_it(bad):
    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.peft.apply_lora\] dropout must be a number in \[0, 1\)"
                                           rf".*received: {__import__('re').escape(repr(bad))}"):
        peft.apply_lora(model, ["attn.q"], rank=2, dropout=bad)
    assert not peft.lora_layers(model) and all(p.requires_grad for p in model.parameters())  # nothing changed
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.LoRALinear\] dropout must be a number in \[0, 1\)"):
        tg.nn.LoRALinear(tg.nn.Linear(6, 5, seed=0), 2, dropout=bad)
    x = tg.from_numpy(np.ones((2, 3)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.dropout\] p must be a number in \[0, 1\)"):
        tg.ops.dropout(x, bad)


def test_merged_variants_are_refused_with_dropout():
    model = models.build("gpt2-debug", seed=0)
    for variant in (("f2", "b1"), ("f1", "b4"), ("f1", "b5")):
        with pytest.raises(tg.TileError, match=r"with dropout > 0 a variant whose adapter branch reads the "
                                               r"dropped-out X apart from X W: forward f1 and backward b1, b2, b3"):
            peft.apply_lora(model, ["attn.q"], rank=2, dropout=0.1, variant=variant)
        peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2, variant=variant)  # fine without
    t = {k: tg.from_numpy(np.ones(s)) for k, s in dict(x=(3, 4), w=(4, 5), u=(4, 2), v=(2, 5)).items()}
    with pytest.raises(tg.TileError, match=r"\[tilegraph.lora_linear\] with dropout > 0"):
        tg.ops.lora_linear(t["x"], t["w"], t["u"], t["v"], variant=("f2", "b5"), dropout=0.5)
    # chosen automatically: never a merged one, even where it has the fewest FLOPs
    assert L.choose_variant(8192, 1024, 1024, 8) == ("f2", "b5")
    assert L.choose_variant(8192, 1024, 1024, 8, dropout=True) == ("f1", "b1")


# ----------------------------------------------------------------------------------- CLI ----
def test_cli_peft_dropout(tmp_path):
    from tilegraph.cli import add_adapters, apply_overrides, build_model, check_config, load_config, make_tokenizer

    path = tmp_path / "job.toml"
    path.write_text('[peft]\nmethod = "lora"\nrank = 4\ndropout = 0.05\n')
    cfg, source = load_config(str(path))
    check_config(cfg, source)
    model = add_adapters(build_model(cfg["model"], make_tokenizer("byte"), 0, 64), cfg["peft"], 0)
    layers = peft.lora_layers(model)
    assert layers and all(m.dropout == 0.05 for m in layers.values())
    cfg, source = load_config(None)
    assert cfg["peft"]["dropout"] == 0.0
    for pairs, message in ((["peft.method=lora", "peft.dropout=1"], r"peft\.dropout must be a number >= 0 and < 1, "
                                                                     r"not 1"),
                           (["peft.method=lotr", "peft.dropout=0.1"], r"peft\.dropout must be 0 with peft\.method = "
                                                                       r"'lotr'")):
        cfg, source = load_config(None)
        apply_overrides(cfg, pairs)
        with pytest.raises(tg.TileError, match=message):
            check_config(cfg, source)
