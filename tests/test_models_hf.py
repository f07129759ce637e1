"""GPT-2 and Llama against Hugging Face transformers: logits, gradients, an AdamW step, export.

Every HF model here is built from a tiny config with random weights (norm gains and biases too,
so that a wrong name map cannot hide behind HF's ones/zeros init) and saved with save_pretrained.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import hf_model_cache
from tilegraph import models
from tilegraph.io import safetensors as st
from tilegraph.io.hf import to_hf_state
from tilegraph.models import ModelTiling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, B, T = 50, 3, 8


def _hf_config(arch: str):
    if arch.startswith("gpt2"):
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=3, n_positions=16, n_inner=40,
                                       bos_token_id=0, eos_token_id=0, tie_word_embeddings=arch == "gpt2")
    # grouped-query attention: 4 query heads share 2 key/value heads
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                    rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=0, eos_token_id=0,
                                    tie_word_embeddings=arch == "llama-tied")


ARCHS = ["gpt2", "gpt2-untied", "llama-gqa", "llama-tied"]
# width 24 (gpt2, head_dim 8) or 32 (llama, head_dim 8); MLP hidden 40; vocab 50; ids (3, 8)
TILINGS = {
    "single": lambda arch: ModelTiling(),
    "even": lambda arch: ModelTiling(feature=8, vocab=25, batch=1, seq=4),
    "ragged": lambda arch: ModelTiling(feature=16 if arch.startswith("gpt2") else 24, vocab=20, batch=2, seq=3),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    # the untied Llama is saved in shards, so every test on it also reads an index
    return hf_model_cache(tmp_path_factory, _hf_config, 0.2,
                          lambda arch: {"max_shard_size": "20KB" if arch == "llama-gqa" else "1GB"})


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (B, T)), rng.integers(0, VOCAB, (B, T))


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


# ------------------------------------------------------------------------ forward and backward ----
@pytest.mark.parametrize("mode", list(TILINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_gradients_match_transformers(hf_models, arch, mode):
    hf, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS[mode](arch))
    assert type(model) is (models.GPT2 if arch.startswith("gpt2") else models.Llama)
    ids, tgt = _batch()
    logits = model(model.tiling.tile_ids(ids))
    assert logits.shape == (B, T, VOCAB)
    loss = tg.cross_entropy(logits, model.tiling.tile_ids(tgt))
    names = [n for n, _ in model.named_parameters()]
    got = tg.compute(logits, loss, *tg.grad(loss, model.parameters()))

    hf.zero_grad()
    ref = hf(torch.tensor(ids)).logits
    ref_loss = torch.nn.functional.cross_entropy(ref.reshape(-1, VOCAB), torch.tensor(tgt).reshape(-1))
    ref_loss.backward()
    assert _rel(got[0], ref.detach().numpy()) < 1e-5
    assert float(got[1]) == pytest.approx(ref_loss.item(), rel=1e-5)

    grads = to_hf_state(model, dict(zip(names, got[2:])))
    ref_params = dict(hf.named_parameters())  # a tied output weight appears once, as the embedding
    assert set(grads) == set(ref_params)
    for name, g in grads.items():
        assert _rel(g, ref_params[name].grad.numpy()) < 1e-4, name


@pytest.mark.parametrize("arch", ARCHS)
def test_one_adamw_step_matches_torch(hf_models, arch):
    hf0, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["ragged"](arch))
    if arch.startswith("gpt2"):  # the folder's dropout (HF's 0.1) off: torch's step below runs in eval mode
        model.set_dropout(embd_dropout=0.0, attn_dropout=0.0, resid_dropout=0.0)
    hf = type(hf0)(hf0.config)
    hf.load_state_dict(hf0.state_dict())
    hf.eval()
    before = {n: p.detach().numpy().copy() for n, p in hf.named_parameters()}
    ids, tgt = _batch(1)
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    t = model.tiling
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), **hyper),
                        lambda m, x, y: tg.cross_entropy(m(x), y), batch_tiles=[(t.batch, t.seq)] * 2)
    loss = step(ids, tgt)

    opt = torch.optim.AdamW(hf.parameters(), **hyper)
    ref_loss = torch.nn.functional.cross_entropy(hf(torch.tensor(ids)).logits.reshape(-1, VOCAB),
                                                 torch.tensor(tgt).reshape(-1))
    ref_loss.backward()
    opt.step()

    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    after = to_hf_state(model)
    decay = 1 - hyper["lr"] * hyper["weight_decay"]
    for name, p in hf.named_parameters():
        want, g = p.detach().numpy(), p.grad.numpy()
        # Some gradients are zero in exact arithmetic (GPT-2's key bias: softmax ignores a shift
        # shared by all keys), so both sides hold rounding noise there, which Adam scales up to a
        # step of about lr with an arbitrary sign. Those entries only have to stay within one step.
        noise = np.abs(g) <= 1e-5 * np.abs(g).max()
        assert (~noise).any(), name
        assert np.all(np.abs(after[name] - decay * before[name])[noise] <= 1.01 * hyper["lr"]), name
        got, want, old = after[name][~noise], want[~noise], before[name][~noise]
        assert _rel(got, want) < 1e-5, name
        # the update itself (about lr per entry), not only the parameter it lands on
        assert _rel(got - old, want - old) < 1e-3, name


# ------------------------------------------------------------------------------------ export ----
def _load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_to_hf_round_trip_gives_the_same_logits(hf_models, arch, tmp_path):
    hf, folder = hf_models(arch)
    model = models.from_hf(folder, TILINGS["even"](arch))
    out = tmp_path / "export"
    model.to_hf(out, max_shard_bytes=8192 if arch == "llama-tied" else None)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == ("gpt2" if arch.startswith("gpt2") else "llama")
    assert cfg["architectures"] == ["GPT2LMHeadModel" if arch.startswith("gpt2") else "LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] == (arch in ("gpt2", "llama-tied"))
    assert cfg["bos_token_id"] == 0  # HF-only keys of the imported config are written back
    sharded = (out / st.INDEX_NAME).exists()
    assert sharded == (arch == "llama-tied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary folder left behind

    back = _load_hf(out)
    ids, _ = _batch(2)
    want = _hf_logits(hf, ids)
    assert _rel(_hf_logits(back, ids), want) < 1e-6
    assert _rel(model(ids).numpy(), want) < 1e-5
    for name, p in back.state_dict().items():
        np.testing.assert_array_equal(p.numpy(), hf.state_dict()[name].numpy(), err_msg=name)


@pytest.mark.parametrize("flavor", ["gpt2-debug", "llama-debug"])
def test_built_model_exports_to_transformers(flavor, tmp_path):
    model = models.build(flavor, ModelTiling(feature=16, vocab=40, seq=5), seed=3)
    model.to_hf(tmp_path / "m")
    back = _load_hf(tmp_path / "m")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 11))
    got = model(ids).numpy()
    assert got.shape == (2, 11, model.config.vocab_size)
    assert _rel(got, _hf_logits(back, ids)) < 1e-5
    # and back again: the same parameters
    again = models.from_hf(tmp_path / "m")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_to_hf_refuses_to_clobber_and_leaves_nothing_partial(tmp_path, monkeypatch):
    model = models.build("gpt2-debug")
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("old")
    with pytest.raises(tg.TileError, match=r"the target exists and is not an empty folder"):
        model.to_hf(target)

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "save_file", broken)
    full = r"to_hf\(.*out\)\] could not write the Hugging Face folder \(the disk is full\); a folder already there " \
           r"is untouched; received: .*out$"
    with pytest.raises(tg.TileError, match=full):
        model.to_hf(target, overwrite=True)
    with pytest.raises(tg.TileError, match=full.replace("out", "fresh")):
        model.to_hf(tmp_path / "fresh")
    # a folder that cannot be made (under a file): named, no traceback of the OS's
    (tmp_path / "file").write_text("x")
    with pytest.raises(tg.TileError, match=r"could not write the Hugging Face folder .*received: .*file/hf$"):
        model.to_hf(tmp_path / "file" / "hf")
    # the previous folder is intact, nothing new and no temporary folders exist
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]
    assert (target / "keep.txt").read_text() == "old"

    monkeypatch.undo()
    model.to_hf(target, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "out"]


# ---------------------------------------------------------------------------------- bad input ----
def test_strict_load_reports_every_problem_at_once(hf_models, tmp_path):
    _, folder = hf_models("gpt2")
    tensors = dict(st.load_file(folder / "model.safetensors"))
    del tensors["transformer.h.0.ln_1.bias"]
    tensors["transformer.h.1.mlp.c_fc.weight"] = np.zeros((40, 24), np.float32)
    tensors["transformer.h.0.attn.extra"] = np.zeros(3, np.float32)
    tensors["transformer.h.0.attn.bias"] = np.zeros((1, 1, 16, 16), np.float32)  # a mask buffer: ignored
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    st.save_file(tensors, bad / "model.safetensors")
    with pytest.raises(tg.TileError) as e:
        models.from_hf(bad)
    msg = str(e.value)
    assert "does not match the gpt2 model (3 problems)" in msg
    assert "missing: transformer.h.0.ln_1.bias" in msg
    assert "unexpected: transformer.h.0.attn.extra" in msg
    assert "shape of transformer.h.1.mlp.c_fc.weight: expected (24, 40), got (40, 24)" in msg
    assert "attn.bias" not in msg.replace("ln_1.bias", "")


def test_checkpoint_without_the_transformer_prefix_loads(hf_models, tmp_path):
    hf, folder = hf_models("gpt2")
    tensors = {k.removeprefix("transformer."): v for k, v in st.load_file(folder / "model.safetensors").items()}
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    st.save_file(tensors, tmp_path / "model.safetensors")
    ids, _ = _batch()
    assert _rel(models.from_hf(tmp_path)(ids).numpy(), _hf_logits(hf, ids)) < 1e-5


def test_unknown_flavor():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.config\] unknown flavor; known: gpt2-debug, .*"
                                           r"received: 'gpt3'"):
        models.build("gpt3")
    with pytest.raises(tg.TileError, match=r"GPT2Config.flavor\] unknown flavor; known: debug, gpt2, gpt2-medium"):
        models.GPT2Config.flavor("llama-debug")
    with pytest.raises(tg.TileError, match=r"expected a flavor name or a model config"):
        models.build(42)


def test_flavors_have_the_advertised_sizes():
    def n_params(cfg):  # count from the config alone: building a 1.1B model is slow
        kv = cfg.head_dim * getattr(cfg, "n_kv_heads", cfg.n_heads)
        if isinstance(cfg, models.GPT2Config):
            per = 2 * cfg.dim * (cfg.dim + kv + cfg.hidden) + 7 * cfg.dim + 2 * kv + cfg.hidden  # + biases, norms
            return cfg.vocab_size * cfg.dim + cfg.max_seq_len * cfg.dim + cfg.n_layers * per + 2 * cfg.dim
        per = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv + 3 * cfg.dim * cfg.hidden + 2 * cfg.dim
        return (2 - cfg.tie_embeddings) * cfg.vocab_size * cfg.dim + cfg.n_layers * per + cfg.dim

    expect = {"gpt2": 124.4e6, "gpt2-medium": 354.8e6, "llama-110m": 110.5e6, "tinyllama-1.1b": 1100.0e6}
    for name, n in expect.items():
        assert n_params(models.config(name)) == pytest.approx(n, rel=2e-3), name
    for name in ("gpt2-debug", "llama-debug"):
        assert models.build(name).num_parameters() == n_params(models.config(name))


def test_contradicting_config_fields():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.GPT2Config\] n_heads must divide dim; "
                                           r"received: dim=30, n_heads=4"):
        models.GPT2Config(dim=30, n_heads=4)
    with pytest.raises(tg.TileError, match=r"n_kv_heads must divide n_heads; received: n_heads=4, n_kv_heads=3"):
        models.LlamaConfig(dim=32, n_heads=4, n_kv_heads=3)
    with pytest.raises(tg.TileError, match=r"head_dim \(dim / n_heads\) must be even"):
        models.LlamaConfig(dim=36, n_heads=4)
    with pytest.raises(tg.TileError, match=r"n_layers must be a positive int; received: 0"):
        models.GPT2Config(n_layers=0)


def test_tiling_that_does_not_fit():
    cfg = models.config("gpt2-debug")  # dim 32, 4 heads of 8, vocab 96, 32 positions
    with pytest.raises(tg.TileError, match=r"\[tilegraph.models.GPT2\] the feature tile must hold whole heads "
                                           r"\(a multiple of head_dim 8 = dim 32 / n_heads 4\); received: feature=12"):
        models.build(cfg, ModelTiling(feature=12))
    with pytest.raises(tg.TileError, match=r"the feature tile must not exceed the width dim=32"):
        models.build(cfg, ModelTiling(feature=40))
    with pytest.raises(tg.TileError, match=r"the vocab tile must not exceed vocab_size=96.*received: vocab=100"):
        models.build(cfg, ModelTiling(vocab=100))
    with pytest.raises(tg.TileError, match=r"batch tile must be a positive int or None; received: 0"):
        models.build(cfg, ModelTiling(batch=0))
    with pytest.raises(tg.TileError, match=r"tiling must be a ModelTiling or None"):
        models.build(cfg, (8, 8))
    model = models.build(cfg)
    with pytest.raises(tg.TileError, match=r"at most max_seq_len=32 tokens; received: seq=33"):
        model(np.zeros((1, 33), np.int64))


def test_default_tiling_is_coarse_and_fits():
    for name in models.FLAVORS:
        cfg = models.config(name)
        t = ModelTiling.default(cfg, batch=8, seq=cfg.max_seq_len)
        t.check(cfg)
        assert t.feature is None or t.feature % cfg.head_dim == 0
    t = ModelTiling.default(models.config("tinyllama-1.1b"), batch=8, seq=2048)
    assert (t.feature, t.vocab, t.batch, t.seq) == (1024, 8000, 2, 1024)
    assert t.heads_per_tile(models.config("tinyllama-1.1b")) == 16
    assert ModelTiling.default(models.config("gpt2-debug")) == ModelTiling()


@pytest.mark.parametrize("change, message", [
    ({"model_type": "bert"}, r"unsupported model_type; supported: gpt2, llama; received: 'bert'"),
    ({"hidden_act": "gelu"}, r"does not implement; received: hidden_act='gelu' \(supported: 'silu'\)"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"no rope scaling\); received: rope_type='linear'"),
    ({"head_dim": 16}, r"head_dim=16 \(supported: hidden_size / num_attention_heads = 8\)"),
])
def test_from_hf_rejects_configs_it_cannot_run(hf_models, tmp_path, change, message):
    _, folder = hf_models("llama-tied")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(tg.TileError, match=message):
        models.from_hf(tmp_path)


def test_from_hf_needs_a_config(tmp_path):
    with pytest.raises(tg.TileError, match=r"a Hugging Face model folder needs config.json; received: none in"):
        models.from_hf(tmp_path)
