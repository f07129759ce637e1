"""``tg.nn.defaults`` (the tile, dtype, seed and init that the layers built in a block share) and
``Linear.reset_parameters`` (a layer's init drawn again), with which the shipped models are
written: their weights must be the very ones the earlier explicit code drew (every layer given
``tile=, dtype=, seed=, init_std=``, GPT-2's residual projections built twice)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from tilegraph import models, nn
from tilegraph._errors import TileError
from tilegraph.models.tiling import ModelTiling
from test_e2e40_readme import readme_python


def _explicit_gpt2(cfg, tile, dtype, seed) -> dict[str, nn.Module]:
    """GPT-2's layers as the model built them before tg.nn.defaults: every argument on every layer."""
    rng, std = np.random.default_rng(seed), 0.02
    kw = dict(tile=tile, dtype=dtype)
    layers = {"wte": nn.Embedding(cfg.vocab_size, cfg.dim, vocab_tile=None, seed=rng, init_std=std, **kw),
              "wpe": nn.Embedding(cfg.max_seq_len, cfg.dim, seed=rng, init_std=0.01, **kw)}
    for i in range(cfg.n_layers):
        attn = nn.CausalSelfAttention(cfg.dim, cfg.n_heads, bias=True, seed=rng, init_std=std, **kw)
        mlp = nn.MLP(cfg.dim, cfg.hidden, act="gelu_tanh", seed=rng, init_std=std, **kw)
        res = std / math.sqrt(2 * cfg.n_layers)
        attn.o = nn.Linear(cfg.dim, cfg.dim, seed=rng, init_std=res, **kw)
        mlp.fc2 = nn.Linear(cfg.hidden, cfg.dim, seed=rng, init_std=res, **kw)
        layers[f"blocks.{i}.attn"], layers[f"blocks.{i}.mlp"] = attn, mlp
    if not cfg.tie_embeddings:
        layers["lm_head"] = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, seed=rng, init_std=std, **kw)
    return layers


def _explicit_llama(cfg, tile, dtype, seed) -> dict[str, nn.Module]:
    rng, std = np.random.default_rng(seed), 0.02
    kw = dict(tile=tile, dtype=dtype, seed=rng, init_std=std)
    layers = {"embed": nn.Embedding(cfg.vocab_size, cfg.dim, **kw)}
    for i in range(cfg.n_layers):
        layers[f"blocks.{i}.attn"] = nn.CausalSelfAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, bias=False,
                                                            rope=True, rope_base=cfg.rope_base, **kw)
        layers[f"blocks.{i}.mlp"] = nn.SwiGLU(cfg.dim, cfg.hidden, **kw)
    if not cfg.tie_embeddings:
        layers["lm_head"] = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, **kw)
    return layers


@pytest.mark.parametrize("flavor, explicit", [("gpt2-debug", _explicit_gpt2), ("llama-debug", _explicit_llama)])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_shipped_models_draw_the_weights_of_the_explicit_code(flavor, explicit, tied, dtype):
    cfg = dataclasses.replace(models.config(flavor), tie_embeddings=tied)
    tile = 3 * cfg.head_dim  # a ragged last tile of the width
    model = models.build(cfg, tiling=ModelTiling(feature=tile), seed=5, dtype=dtype)
    state = model.state_dict()
    reference = explicit(cfg, tile, dtype, 5)
    compared = 0
    for prefix, layer in reference.items():
        for name, value in layer.state_dict().items():
            got = state[f"{prefix}.{name}"]
            assert got.dtype == np.dtype(dtype) and np.array_equal(got, value), f"{prefix}.{name}"
            compared += 1
    assert compared >= 10
    params = dict(model.named_parameters())  # the tiles too: the model's feature tile everywhere
    assert params[next(n for n in params if n.endswith("mlp.fc1.weight") or n.endswith("mlp.gate.weight"))].chunks[0] \
        == tuple([tile] * (cfg.dim // tile) + ([cfg.dim % tile] if cfg.dim % tile else []))


def test_a_block_sets_what_the_layers_are_not_given():
    with nn.defaults(tile=4, dtype="float64", seed=0, init_std=0.5):
        a = nn.Linear(8, 6)
        b = nn.Linear(8, 6, tile=2, dtype="float32", init_std=0.1, seed=9)  # its own arguments win
        e = nn.Embedding(10, 8)
        ln = nn.LayerNorm(8)
        head = nn.Linear(8, 10, bias=False, out_tile=5)
    assert a.weight.chunks == ((4, 4), (4, 2)) and a.weight.dtype == np.float64
    assert b.weight.chunks == ((2, 2, 2, 2), (2, 2, 2)) and b.weight.dtype == np.float32
    assert e.weight.chunks == ((10,), (4, 4)) and e.weight.dtype == np.float64  # the vocabulary tile is not the tile
    assert ln.weight.chunks == ((4, 4),) and ln.weight.dtype == np.float64
    assert head.weight.chunks == ((4, 4), (5, 5))
    # init_std: N(0, std^2) weights, zero biases (torch's uniform init is bounded by 1/sqrt(8) < 0.36)
    assert np.all(a.bias.numpy() == 0) and np.abs(a.weight.numpy()).max() > 0.5
    assert b.weight.numpy().std() < 0.2
    # one generator made from the seed, drawn one layer after another
    rng = np.random.default_rng(0)
    a2 = nn.Linear(8, 6, tile=4, dtype="float64", seed=rng, init_std=0.5)
    b2 = nn.Linear(8, 6, tile=2, dtype="float32", init_std=0.1, seed=9)
    e2 = nn.Embedding(10, 8, tile=4, dtype="float64", seed=rng, init_std=0.5)
    for x, y in ((a, a2), (b, b2), (e, e2)):
        assert all(np.array_equal(v, y.state_dict()[k]) for k, v in x.state_dict().items())


def test_blocks_nest_and_end_with_their_block():
    with nn.defaults(tile=4, dtype="float64"):
        with nn.defaults(tile=2):
            inner = nn.Linear(4, 4, seed=0)
        outer = nn.Linear(4, 4, seed=0)
    after = nn.Linear(4, 4, seed=0)
    assert inner.weight.chunks == ((2, 2), (2, 2)) and inner.weight.dtype == np.float64
    assert outer.weight.chunks == ((4,), (4,)) and outer.weight.dtype == np.float64
    assert after.weight.chunks == ((4,), (4,)) and after.weight.dtype == np.float32  # float32 outside a block
    assert nn.Linear(4, 4, dtype=None).weight.dtype == np.float32  # (None was NumPy's float64)
    # torch's inits outside a block: uniform Linear, N(0, 1) Embedding
    assert np.abs(nn.Linear(100, 50, seed=1).weight.numpy()).max() <= 0.1
    assert 0.9 < nn.Embedding(200, 50, seed=1).weight.numpy().std() < 1.1
    with pytest.raises(TileError):
        with nn.defaults(dtype="float16"):
            raise TileError("here", "an error in the block", "-")
    assert nn.Linear(4, 4).weight.dtype == np.float32  # the failed block's defaults are gone


def test_same_code_and_seed_give_the_same_weights():
    def build():
        with nn.defaults(seed=3, tile=8):
            return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    one, two = build(), build()
    for k, v in one.state_dict().items():
        assert np.array_equal(v, two.state_dict()[k])
    assert not np.array_equal(one.layers[0].weight.numpy()[:4], one.layers[2].weight.numpy()[:4])  # drawn in turn
    # no seed anywhere: fresh weights each time, as torch's without manual_seed
    assert not np.array_equal(nn.Linear(16, 16).weight.numpy(), nn.Linear(16, 16).weight.numpy())


def test_reset_parameters_draws_again_keeping_tiles_and_dtype():
    lin = nn.Linear(300, 200, tile=128, out_tile=64, dtype="float64", seed=0)
    chunks = lin.weight.chunks
    lin.reset_parameters(init_std=0.01, seed=4)
    w, b = lin.weight.numpy(), lin.bias.numpy()
    assert lin.weight.chunks == chunks and lin.bias.chunks == ((64, 64, 64, 8),) and w.dtype == np.float64
    assert 0.0095 < w.std() < 0.0105 and abs(w.mean()) < 5e-4 and np.all(b == 0)
    again = nn.Linear(300, 200, tile=128, out_tile=64, dtype="float64", seed=4, init_std=0.01)
    assert np.array_equal(w, again.weight.numpy())  # the constructor's draws
    lin.reset_parameters(seed=4)  # torch's uniform init
    assert np.abs(lin.weight.numpy()).max() <= 1 / math.sqrt(300) and np.any(lin.bias.numpy() != 0)
    with nn.defaults(seed=4, init_std=0.01):  # the block's seed and init
        lin.reset_parameters()
    assert np.array_equal(lin.weight.numpy(), w)
    with nn.deferred_init():  # nothing drawn, nothing assigned
        empty = nn.Linear(8, 4, seed=0)
        empty.reset_parameters(init_std=0.1)
    assert all(c.value is None for c in empty.weight.cells.flat)


@pytest.mark.parametrize("kwargs, said", [
    (dict(tile=0), "tile=0"), (dict(tile=2.5), "tile=2.5"), (dict(dtype="int8"), "'int8'"),
    (dict(seed=-1), "seed=-1"), (dict(seed=1.5), "seed=1.5"), (dict(init_std=0.0), "init_std=0.0"),
    (dict(init_std=float("nan")), "init_std=nan"), (dict(init_std="0.02"), "init_std='0.02'"),
])
def test_bad_defaults_are_refused_naming_the_argument(kwargs, said):
    with pytest.raises(TileError) as e:
        with nn.defaults(**kwargs):
            pass
    assert "[tilegraph.nn.defaults]" in str(e.value) and said in str(e.value)


@pytest.mark.parametrize("build, said", [
    (lambda: nn.Linear(3, 4, init_std=-1), "[tilegraph.nn.Linear] init_std must be a finite number > 0"),
    (lambda: nn.Linear(3, 4, seed="x"), "[tilegraph.nn.Linear] seed must be an int >= 0"),
    (lambda: nn.MLP(3, 4, init_std=True), "[tilegraph.nn.MLP] init_std"),
    (lambda: nn.Embedding(3, 4, seed=-2), "[tilegraph.nn.Embedding] seed must be an int >= 0"),
    (lambda: nn.CausalSelfAttention(8, 2, seed=0.5), "[tilegraph.nn.CausalSelfAttention] seed"),
    (lambda: nn.Linear(3, 4).reset_parameters(init_std=-0.1), "[tilegraph.nn.Linear.reset_parameters] init_std"),
])
def test_bad_seed_or_init_std_names_the_layer(build, said):
    # before: NumPy's own ValueError "scale < 0" or TypeError "SeedSequence expects int ..."
    with pytest.raises(TileError) as e:
        build()
    assert said in str(e.value) and "received" in str(e.value)


def test_readme_writing_a_model_runs(capsys):
    exec(readme_python("Writing a model"), {"__name__": "readme"})
    assert capsys.readouterr().out.strip() == "(2, 16, 128)"


@pytest.mark.parametrize("flavor", ["gpt2-debug", "llama-debug"])
def test_a_shipped_model_ignores_the_block_it_is_built_in(flavor):
    # its ModelTiling, dtype and seed say everything: an outer block must not retile or redraw it
    plain = models.build(flavor, seed=2)
    with nn.defaults(tile=8, dtype="float64", seed=11, init_std=1.0):
        inside = models.build(flavor, seed=2)
        assert nn.Linear(16, 16).weight.chunks == ((8, 8), (8, 8))  # (the block is in force)
    for (name, p), (_, q) in zip(plain.named_parameters(), inside.named_parameters()):
        assert p.chunks == q.chunks and np.array_equal(p.numpy(), q.numpy()), name
    with pytest.raises(TileError, match=r"inherit must be a bool; received: inherit='no'"):
        with nn.defaults(inherit="no"):
            pass


def test_apply_is_an_init_pass_as_nanogpts():
    class Net(nn.Module):
        def __init__(self):
            self.wte = nn.Embedding(50, 64, padding_idx=0, seed=0)
            self.blocks = nn.ModuleList([nn.MLP(64, 256, seed=i) for i in range(2)])
            self.ln = nn.LayerNorm(64)
            self.shared = self.blocks[0]  # one module under two names: visited once

    order = []
    net = Net()

    def init(m):
        order.append(m)
        if isinstance(m, (nn.Linear, nn.Embedding)):
            m.reset_parameters(init_std=0.02)

    with nn.defaults(seed=1):
        assert net.apply(init) is net
    assert len(order) == len({id(m) for m in order}) == len(list(net.modules()))
    assert order[-1] is net and order.index(net.blocks[0].fc1) < order.index(net.blocks[0])  # children first
    for name, p in net.named_parameters():
        v = p.numpy()
        if name.endswith("bias") and not name.startswith("ln"):
            assert np.all(v == 0), name
        elif name.endswith("weight") and not name.startswith("ln"):
            assert 0.015 < v[1:].std() < 0.025, name
    assert np.all(net.wte.weight.numpy()[0] == 0)  # the padding row stays zeros
    again = Net()
    with nn.defaults(seed=1):
        again.apply(init)
    assert all(np.array_equal(v, again.state_dict()[k]) for k, v in net.state_dict().items())  # same seed, same pass
    with pytest.raises(TileError, match=r"\[Net.apply\] a function of a module .*; received: 3 \(int\)"):
        net.apply(3)


def test_embedding_and_norms_reset_parameters():
    e = nn.Embedding(300, 40, padding_idx=-1, tile=16, vocab_tile=128, dtype="float64", seed=0)
    chunks = e.weight.chunks
    e.reset_parameters(init_std=0.5, seed=3)
    w = e.weight.numpy()
    assert e.weight.chunks == chunks and w.dtype == np.float64 and np.all(w[-1] == 0)
    assert 0.48 < w[:-1].std() < 0.52
    assert np.array_equal(w, nn.Embedding(300, 40, padding_idx=-1, dtype="float64", seed=3, init_std=0.5).weight.numpy())
    ln, rms = nn.LayerNorm(8, tile=4), nn.RMSNorm(8)
    ln.weight.assign(np.full(8, 3, np.float32))
    ln.bias.assign(np.full(8, 2, np.float32))
    rms.weight.assign(np.zeros(8, np.float32))
    ln.reset_parameters()
    rms.reset_parameters()
    assert np.all(ln.weight.numpy() == 1) and np.all(ln.bias.numpy() == 0) and ln.weight.chunks == ((4, 4),)
    assert np.all(rms.weight.numpy() == 1)
    nn.LayerNorm(8, elementwise_affine=False).reset_parameters()  # nothing to reset
    with pytest.raises(TileError, match=r"\[tilegraph.nn.Embedding.reset_parameters\] init_std"):
        e.reset_parameters(init_std=-1)
