"""LoRA adapters in Hugging Face peft's folder layout, against the real peft: tilegraph -> peft,
peft -> tilegraph, save_peft -> load_peft round trips, and bad input.

The HF models are tiny with random weights (tests/hf_helpers.py); logits are compared in float32.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import hf_model_cache
from tilegraph import models, peft
from tilegraph.io import safetensors as st
from tilegraph.models import ModelTiling
from tilegraph.peft_hf import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft, save_peft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
hf_peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()

VOCAB, B, T = 50, 2, 8
TILINGS = {
    "single": lambda arch: ModelTiling(),
    "ragged": lambda arch: ModelTiling(feature=16 if arch == "gpt2" else 24, vocab=20, batch=2, seq=3),
}


def _hf_config(arch: str):
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=3, n_positions=16, n_inner=40,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                    rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=0, eos_token_id=0)


def _tg_config(arch: str):
    if arch == "gpt2":
        return models.GPT2Config(vocab_size=VOCAB, max_seq_len=16, dim=24, n_layers=2, n_heads=3, hidden=40)
    return models.LlamaConfig(vocab_size=VOCAB, max_seq_len=16, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                              hidden=40, rope_base=500.0)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return hf_model_cache(tmp_path_factory, _hf_config, 0.2)


IDS = np.random.default_rng(0).integers(0, VOCAB, (B, T))


def _logits(model) -> np.ndarray:
    (out,) = tg.compute(model(model.tiling.tile_ids(IDS)))
    return out


def _hf_logits(hf) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits.numpy()


def _rel(got, want) -> float:
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def _randomize_adapters(model, seed=1) -> None:
    """Nonzero V (and fresh U) for every LoRA layer, so that the adapters change the logits."""
    rng = np.random.default_rng(seed)
    for layer in peft.lora_layers(model).values():
        layer.lora_u.assign((0.3 * rng.standard_normal(layer.lora_u.shape)).astype(np.float32))
        layer.lora_v.assign((0.3 * rng.standard_normal(layer.lora_v.shape)).astype(np.float32))


def _adapted_tilegraph(arch: str, tiling) -> models.CausalLM:
    """A tilegraph model with LoRA of two ranks and alphas (GPT-2's c_attn as three adapters)."""
    model = models.build(_tg_config(arch), tiling, seed=3)
    if arch == "gpt2":
        peft.apply_lora(model, ["c_attn", "attn.o"], rank=4, alpha=8, seed=1)
        peft.apply_lora(model, ["blocks.1.mlp.fc2"], rank=2, alpha=3, seed=2)
    else:
        peft.apply_lora(model, ["q_proj", "v_proj", "o_proj", "up_proj"], rank=4, alpha=8, seed=1)
        peft.apply_lora(model, ["blocks.1.mlp.down"], rank=2, alpha=3, seed=2)
    _randomize_adapters(model)
    return model


# ------------------------------------------------------------------------- tilegraph -> peft ----
@pytest.mark.parametrize("arch,mode", [("gpt2", "ragged"), ("llama", "single")])
def test_peft_loads_what_save_peft_writes(tmp_path, arch, mode):
    model = _adapted_tilegraph(arch, TILINGS[mode](arch))
    want = _logits(model)
    with pytest.warns(UserWarning, match="the folder holds the base weights, without the model's"):
        model.to_hf(tmp_path / "base")  # the base, onto which peft loads the adapters
    save_peft(tmp_path / "adapter", model, base_model_name_or_path=str(tmp_path / "base"))

    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    if arch == "gpt2":
        assert config["fan_in_fan_out"] is True
        assert config["target_modules"] == ["attn.c_proj", "c_attn", "h.1.mlp.c_proj"]
        # q, k and v have their own U: one stacked adapter of rank 12 (alpha 3 x 8 keeps the scale)
        assert (config["r"], config["lora_alpha"]) in ((12, 24), (4, 8))
    else:
        assert config["fan_in_fan_out"] is False
        assert config["target_modules"] == ["layers.1.mlp.down_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
        assert (config["r"], config["lora_alpha"]) == (4, 8)
        assert config["rank_pattern"] == {"model.layers.1.mlp.down_proj": 2}
        assert config["alpha_pattern"] == {"model.layers.1.mlp.down_proj": 3}

    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    base_logits = _hf_logits(base)
    hf = hf_peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    hf.eval()
    got = _hf_logits(hf)
    assert _rel(base_logits, want) > 1e-2  # the adapters matter
    assert _rel(got, want) < 1e-5
    loaded = [name for name, _ in hf.named_parameters() if "lora_A" in name]
    written = st.load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert len(loaded) == sum(key.endswith("lora_A.weight") for key in written)  # every adapter loaded


# ------------------------------------------------------------------------- peft -> tilegraph ----
def _peft_model(hf_models, arch: str):
    """A peft model on the tiny HF model (a copy), lora_B random, saved with save_pretrained."""
    hf0, folder = hf_models(arch)
    hf = type(hf0)(hf0.config)
    hf.load_state_dict(hf0.state_dict())
    if arch == "gpt2":
        config = hf_peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["c_attn", "c_proj", "c_fc"],
                                    rank_pattern={"mlp.c_proj": 2}, alpha_pattern={"c_fc": 5}, task_type="CAUSAL_LM")
    else:
        config = hf_peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, task_type="CAUSAL_LM",
                                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    pm = hf_peft.get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    pm.eval()
    return pm, folder


@pytest.mark.parametrize("arch,mode", [("gpt2", "single"), ("llama", "ragged")])
def test_load_peft_reads_what_peft_writes_and_save_peft_writes_it_back(hf_models, tmp_path, arch, mode):
    pm, base_folder = _peft_model(hf_models, arch)
    pm.save_pretrained(tmp_path / "adapter")
    want = _hf_logits(pm)

    model = load_peft(tmp_path / "adapter", models.from_hf(base_folder, TILINGS[mode](arch)))
    layers = peft.lora_layers(model)
    # GPT-2: q, k and v for c_attn, attn.o, mlp.fc1, mlp.fc2 in 2 blocks; Llama: 7 layers in 2 blocks
    assert len(layers) == (2 * 6 if arch == "gpt2" else 2 * 7)
    if arch == "gpt2":
        assert (layers["blocks.0.mlp.fc2"].rank, layers["blocks.0.mlp.fc1"].alpha) == (2, 5.0)
    else:  # rsLoRA: scale alpha / sqrt(r) = 8 / 2, tilegraph's alpha / r
        assert layers["blocks.0.attn.q"].scale == pytest.approx(4.0)
    assert _rel(_logits(model), want) < 1e-5

    # written back: the tensors peft wrote, and a config peft reads to the same model
    save_peft(tmp_path / "again", model)
    theirs = st.load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    ours = st.load_file(tmp_path / "again" / ADAPTER_WEIGHTS)
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    fresh = load_peft(tmp_path / "again", models.from_hf(base_folder, TILINGS[mode](arch)))
    assert _rel(_logits(fresh), want) < 1e-5


# ---------------------------------------------------------------------------- round trip ----
def test_save_peft_then_load_peft_gives_the_same_adapters(tmp_path):
    tiling = TILINGS["ragged"]("gpt2")
    model = _adapted_tilegraph("gpt2", tiling)
    save_peft(tmp_path / "a", model)
    meta = st.SafetensorsFile(tmp_path / "a" / ADAPTER_WEIGHTS).metadata
    assert "tilegraph.lora_blocks" in meta  # the stacked c_attn's blocks
    fresh = load_peft(tmp_path / "a", models.build(_tg_config("gpt2"), tiling, seed=3))
    want, got = peft.lora_layers(model), peft.lora_layers(fresh)
    assert sorted(got) == sorted(want)
    for name, layer in want.items():
        assert (got[name].rank, got[name].alpha) == (layer.rank, layer.alpha), name
        for attr in ("lora_u", "lora_v"):
            np.testing.assert_allclose(getattr(got[name], attr).numpy(), getattr(layer, attr).numpy(), rtol=1e-6,
                                       atol=1e-7, err_msg=f"{name}.{attr}")
    # into a model that already has the LoRA layers: values and alphas replaced
    again = _adapted_tilegraph("gpt2", tiling)
    _randomize_adapters(again, seed=5)
    load_peft(tmp_path / "a", again)
    np.testing.assert_allclose(_logits(again), _logits(model), rtol=1e-5, atol=1e-6)

    # trained on in peft as one rank-12 adapter (B no longer block-diagonal): q, k and v get rank 12
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_B.weight"
    tensors = dict(st.load_file(tmp_path / "a" / ADAPTER_WEIGHTS))
    tensors[key] = tensors[key] + np.float32(0.05)
    st.save_file(tensors, tmp_path / "a" / ADAPTER_WEIGHTS, metadata=meta)
    merged = load_peft(tmp_path / "a", models.build(_tg_config("gpt2"), tiling, seed=3))
    assert peft.lora_layers(merged)["blocks.0.attn.k"].rank == 12
    assert peft.lora_layers(merged)["blocks.1.attn.k"].rank == 4  # still block-diagonal: split again
    with pytest.warns(UserWarning, match="the folder holds the base weights, without the model's"):
        model.to_hf(tmp_path / "base")  # the base, onto which peft loads the adapters
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    hf = hf_peft.PeftModel.from_pretrained(base, tmp_path / "a")
    hf.eval()
    assert _rel(_logits(merged), _hf_logits(hf)) < 1e-5


def test_save_and_load_adapters_in_either_format_keep_the_dropout(tmp_path):
    tiling = TILINGS["single"]("gpt2")
    model = models.build(_tg_config("gpt2"), tiling, seed=3)
    peft.apply_lora(model, ["c_attn", "c_fc"], rank=4, alpha=8, dropout=0.1, seed=1)
    _randomize_adapters(model)
    peft.save_adapters(tmp_path / "p", model, format="peft")
    peft.save_adapters(tmp_path / "z", model)
    assert json.loads((tmp_path / "p" / ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.1
    for folder in ("p", "z"):  # the peft folder is recognised by its adapter_config.json
        fresh = peft.load_adapters(tmp_path / folder, models.build(_tg_config("gpt2"), tiling, seed=3))
        layers = peft.lora_layers(fresh)
        assert sorted(layers) == sorted(peft.lora_layers(model)), folder
        assert {m.dropout for m in layers.values()} == {0.1}, folder
        np.testing.assert_allclose(_logits(fresh), _logits(model), rtol=1e-5, atol=1e-6, err_msg=folder)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.peft.save_adapters\] format must be one of 'zarr', "
                       r"'peft'; received: 'safetensors'"):
        peft.save_adapters(tmp_path / "q", model, format="safetensors")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.peft.load_adapters\] format must be one of"):
        peft.load_adapters(tmp_path / "p", model, format="bin")
    peft.lora_layers(model)["blocks.0.attn.q"].dropout = 0.2
    with pytest.raises(tg.TileError, match=r"one dropout for every LoRA layer .*blocks.0.attn.q: 0.2"):
        save_peft(tmp_path / "r", model)


# ----------------------------------------------------------------------------- bad input ----
class _Tiny(tg.nn.Module):
    def __init__(self):
        self.fc = tg.nn.Linear(4, 4, seed=0)


def test_save_peft_refuses_what_peft_cannot_express(tmp_path):
    where = r"\[tilegraph.peft_hf.save_peft\(.*\)\] "
    with pytest.raises(tg.TileError, match=where + r"a model with LoRA layers .* GPT2 has none"):
        save_peft(tmp_path / "x", models.build(_tg_config("gpt2")))
    lotr = peft.apply_lotr(models.build(_tg_config("gpt2")), ["attn.q"], rank=2)
    with pytest.raises(tg.TileError, match=where + r"LoRA layers only: peft has no LoTR adapter.*received: LoTR "
                       r"layers blocks.0.attn.q, blocks.1.attn.q"):
        save_peft(tmp_path / "x", lotr)
    part = peft.apply_lora(models.build(_tg_config("gpt2")), ["blocks.0.attn.q", "attn.o"], rank=2)
    with pytest.raises(tg.TileError, match=where + r"LoRA on every tilegraph layer of a fused Hugging Face module.*"
                       r"received: blocks.0.attn.q \(part of HF transformer.h.0.attn.c_attn, which also holds "
                       r"blocks.0.attn.k, blocks.0.attn.v\)"):
        save_peft(tmp_path / "x", part)
    with pytest.raises(tg.TileError, match=where + r"a model with a Hugging Face name map .*received: _Tiny"):
        save_peft(tmp_path / "x", peft.apply_lora(_Tiny(), ["fc"], rank=2))
    assert not (tmp_path / "x").exists()


def _edit_config(folder, **changes):
    path = folder / ADAPTER_CONFIG
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_load_peft_bad_input(tmp_path):
    gpt2 = lambda: models.build(_tg_config("gpt2"))  # noqa: E731
    good = tmp_path / "good"
    save_peft(good, peft.apply_lora(gpt2(), ["c_attn"], rank=4, alpha=8))
    where = r"\[tilegraph.peft_hf.load_peft\(.*\)\] "

    def copy(name):
        shutil.copytree(good, tmp_path / name)
        return tmp_path / name

    with pytest.raises(tg.TileError, match=where + r"a peft adapter folder .*received: no such folder"):
        load_peft(tmp_path / "nowhere", gpt2())
    bare = copy("bare")
    (bare / ADAPTER_CONFIG).unlink()
    with pytest.raises(tg.TileError, match=where + r"a peft adapter folder holds adapter_config.json; received: none "
                       r"in .* \(holds: adapter_model.safetensors\)"):
        load_peft(bare, gpt2())
    pickled = copy("pickled")
    (pickled / ADAPTER_WEIGHTS).rename(pickled / "adapter_model.bin")
    with pytest.raises(tg.TileError, match=r"holds adapter_model.safetensors \(adapter_model.bin is a pickle"):
        load_peft(pickled, gpt2())
    broken = copy("broken")
    (broken / ADAPTER_CONFIG).write_text("{not json")
    with pytest.raises(tg.TileError, match=where + r"adapter_config.json must be a JSON object; received: .*"):
        load_peft(broken, gpt2())
    ia3 = copy("ia3")
    _edit_config(ia3, peft_type="IA3")
    with pytest.raises(tg.TileError, match=where + r"a LoRA adapter: peft_type \"LORA\".*received: peft_type 'IA3'"):
        load_peft(ia3, gpt2())
    dora = copy("dora")
    _edit_config(dora, use_dora=True, bias="all", modules_to_save=["lm_head"], lora_dropout=0.2)
    with pytest.raises(tg.TileError, match=where + r"a plain LoRA adapter .* unsupported options set; received: "
                       r"use_dora=true .*; bias=\"all\" .*; modules_to_save=\[\"lm_head\"\]") as e:
        load_peft(dora, gpt2())
    assert "lora_dropout" not in str(e.value)  # dropout > 0 reads (as dropout 0)

    with pytest.raises(tg.TileError, match=where + r"adapter_model.safetensors to hold LoRA adapters for modules of "
                       r"the model \(2 problems\); received: no linear module transformer.h.0.attn.c_attn in the "
                       r"llama model"):
        load_peft(good, models.build(_tg_config("llama")))
    with pytest.raises(tg.TileError, match=where + r"adapters of the model's shapes; received: "
                       r"transformer.h.0.attn.c_attn: lora_A \(12, 24\), lora_B \(72, 12\); the model's \(96 x 32\) "
                       r"layer takes lora_A \(r, 32\), lora_B \(96, r\)"):
        load_peft(good, models.build("gpt2-debug"))
    odd = copy("odd")
    tensors = dict(st.load_file(good / ADAPTER_WEIGHTS))
    tensors["base_model.model.transformer.h.7.attn.c_attn.lora_A.weight"] = np.zeros((4, 24), np.float32)
    tensors["base_model.model.transformer.h.7.attn.c_attn.lora_B.weight"] = np.zeros((72, 4), np.float32)
    tensors["base_model.model.transformer.h.0.attn.c_proj.lora_A.weight"] = np.zeros((4, 24), np.float32)
    tensors["base_model.model.transformer.wte.lora_embedding_A"] = np.zeros((4, VOCAB), np.float32)
    st.save_file(tensors, odd / ADAPTER_WEIGHTS)
    with pytest.raises(tg.TileError, match=r"\(3 problems\); received: unexpected key base_model.model.transformer.wte"
                       r".lora_embedding_A .*; transformer.h.0.attn.c_proj has lora_A but not lora_B; no linear module "
                       r"transformer.h.7.attn.c_attn in the gpt2 model"):
        load_peft(odd, gpt2())
    ranked = copy("ranked")
    _edit_config(ranked, r=8)
    with pytest.raises(tg.TileError, match=r"transformer.h.0.attn.c_attn: rank 12 in the weights, 8 in "
                       r"adapter_config.json"):
        load_peft(ranked, gpt2())
    with pytest.raises(tg.TileError, match=where + r"adapters that fit the model's layers; received: blocks.0.attn.q: "
                       r"the model's LoRA layer has rank 2, the adapter 4"):
        load_peft(good, peft.apply_lora(gpt2(), ["c_attn"], rank=2))
    with pytest.raises(tg.TileError, match=r"the model's LoRA layer blocks.0.mlp.fc1 has no adapter in the folder"):
        load_peft(good, peft.apply_lora(gpt2(), ["c_attn", "c_fc"], rank=4))
