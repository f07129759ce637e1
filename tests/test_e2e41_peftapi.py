"""Adapters end to end (audit, round 3): loading adapters onto a model with the other kind,
adapters of a layer whose name is the dotted end of another's, a peft folder written over a Zarr
adapters checkpoint, and the errors of load_adapters named as the call the user made."""

import os

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._errors import TileError
from tilegraph.io._store import CheckpointError


def _trained_lora(targets=("attn.q", "attn.v")):
    """gpt2-debug with rank-4 LoRA whose V is nonzero (so the adapters change the logits)."""
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), list(targets), rank=4, alpha=8)
    rng = np.random.default_rng(1)
    for layer in peft.lora_layers(model).values():
        layer.lora_v.assign(rng.standard_normal(layer.lora_v.shape).astype(layer.lora_v.dtype))
    return model


def test_lora_adapters_loaded_onto_lotr_layers_say_the_layers_have_the_other_kind(tmp_path, local_scheduler):
    """The model has those layers, with a LoTR adapter: it said 'no Linear layer blocks.0.attn.q in the GPT2'."""
    peft.save_adapters(tmp_path / "a", _trained_lora())
    model = peft.apply_lotr(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v"], rank=4)
    with pytest.raises(TileError, match=r"blocks\.0\.attn\.q has a LoTR adapter \(LoTRLinear\), the checkpoint a LoRA "
                                        r"adapter for it") as e:
        peft.load_adapters(tmp_path / "a", model)
    assert "no Linear layer" not in str(e.value)
    assert sorted(peft.lotr_layers(model)) == ["blocks.0.attn.q", "blocks.0.attn.v", "blocks.1.attn.q",
                                                "blocks.1.attn.v"] and not peft.lora_layers(model)


class _Net(tg.nn.Module):
    """A Linear named ``fc1`` beside an MLP whose first layer is ``mlp.fc1``."""

    def __init__(self):
        self.fc1 = tg.nn.Linear(8, 8, seed=1)
        self.mlp = tg.nn.MLP(8, 16, seed=2)

    def forward(self, x):
        return self.mlp(self.fc1(x))


def _adapted_net(kind):
    net = _Net()
    if kind == "lora":
        net.fc1 = tg.nn.LoRALinear(net.fc1, 2, alpha=4, seed=0)
        net.fc1.lora_v.assign(np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32))
    else:
        left = tg.nn.Parameter(np.random.default_rng(4).standard_normal((8, 2)).astype(np.float32))
        right = tg.nn.Parameter(np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32))
        net.fc1 = peft.LoTRLinear(net.fc1, left, right, scale=2.0)
        net.fc1.lotr_core.assign(np.random.default_rng(6).standard_normal((2, 2)).astype(np.float32))
    return net


@pytest.mark.parametrize("kind", ["lora", "lotr"])
def test_adapters_of_a_layer_load_onto_it_alone_not_onto_layers_named_with_it_at_their_end(kind, tmp_path,
                                                                                           local_scheduler):
    """Adapters saved for ``fc1`` were put on ``fc1`` and ``mlp.fc1`` (a target matches dotted ends),
    and the load failed: 'LoRA layer mlp.fc1 has no stored adapter'."""
    net = _adapted_net(kind)
    x = tg.from_numpy(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    (want,) = tg.compute(net(x))
    peft.save_adapters(tmp_path / "a", net)

    model = peft.load_adapters(tmp_path / "a", _Net())
    assert sorted({**peft.lora_layers(model), **peft.lotr_layers(model)}) == ["fc1"]
    assert type(model.mlp.fc1) is tg.nn.Linear
    (got,) = tg.compute(model(x))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_a_peft_folder_is_not_written_over_a_zarr_adapters_checkpoint(tmp_path, local_scheduler):
    """save_adapters(format="peft") into the folder of save_adapters' Zarr checkpoint wrote
    adapter_config.json beside zarr.json, and load_adapters then read the peft files: the
    checkpoint's own adapters were hidden."""
    model = _trained_lora(["c_attn"])
    peft.save_adapters(tmp_path / "a", model)
    before = sorted(os.listdir(tmp_path / "a"))
    with pytest.raises(TileError, match=r"save_peft.*a folder that is not a tilegraph checkpoint.*"
                                        r"holds a Zarr checkpoint \(zarr\.json\)"):
        peft.save_adapters(tmp_path / "a", model, format="peft")
    assert sorted(os.listdir(tmp_path / "a")) == before
    # a peft folder is still replaced in place, as peft's save_pretrained does
    peft.save_adapters(tmp_path / "p", model, format="peft")
    peft.save_adapters(tmp_path / "p", model, format="peft")
    assert sorted(os.listdir(tmp_path / "p")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_load_adapters_of_a_missing_folder_is_named_as_the_call_made(tmp_path):
    """It was named tilegraph.io.load_checkpoint(...), a call the user did not make."""
    with pytest.raises(CheckpointError, match=r"^\[tilegraph\.peft\.load_adapters\] a checkpoint folder; received: "
                                              r".*missing does not exist \(a folder of save_adapters"):
        peft.load_adapters(tmp_path / "missing", models.build("gpt2-debug", seed=0))


def test_a_peft_adapter_initialized_by_changing_the_base_is_refused_and_its_conversion_loads(tmp_path,
                                                                                            local_scheduler):
    """peft's PiSSA (init_lora_weights="pissa") trains the adapter on W - B0 A0, and its
    from_pretrained subtracts that again: loaded onto the base as it is, the logits were 25% off,
    silently. Refused naming the option; the adapter peft converts for the original base
    (save_pretrained(..., path_initial_model_for_weight_conversion=...)) loads and gives peft's logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf_peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                      rms_norm_eps=1e-5, rope_theta=500.0, bos_token_id=0, eos_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    pm = hf_peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(tmp_path / "base"),
                                hf_peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                   init_lora_weights="pissa"))
    pm.eval()
    pm.peft_config["default"].init_lora_weights = True  # the initial adapter, as peft's PiSSA example saves it
    pm.save_pretrained(tmp_path / "initial")
    pm.peft_config["default"].init_lora_weights = "pissa"
    ids = np.random.default_rng(0).integers(0, 50, (2, 8))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.add_(0.3 * torch.randn(p.shape))
        want = pm(torch.tensor(ids)).logits.numpy()
    pm.save_pretrained(tmp_path / "pissa")
    pm.save_pretrained(tmp_path / "lora", path_initial_model_for_weight_conversion=str(tmp_path / "initial"))

    with pytest.raises(TileError, match=r'load_peft.*unsupported options set; received: init_lora_weights="pissa" '
                                        r"\(tilegraph reads .*change the base weights"):
        peft.load_adapters(tmp_path / "pissa", models.from_hf(tmp_path / "base"))
    model = peft.load_adapters(tmp_path / "lora", models.from_hf(tmp_path / "base"))
    (got,) = tg.compute(model(model.tiling.tile_ids(ids)))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_a_peft_folder_of_named_adapters_names_their_subfolders(tmp_path, local_scheduler):
    """peft's save_pretrained writes an adapter not named "default" into a subfolder named after it;
    load_adapters of the top folder said only 'a tilegraph checkpoint folder (a Zarr group with
    zarr.json)'."""
    model = _trained_lora(["c_attn"])
    peft.save_adapters(tmp_path / "out" / "mine", model, format="peft")
    peft.save_adapters(tmp_path / "out" / "other", model, format="peft")
    (tmp_path / "out" / "README.md").write_text("peft's model card\n")
    for fmt in (None, "peft"):
        with pytest.raises(TileError, match=r"load_peft.*holds adapter_config\.json; received: none in .*out \(holds: "
                                            r"README\.md, mine, other\); peft's save_pretrained wrote its adapters "
                                            r"named other than 'default' into subfolders: load one of .*out/mine, "
                                            r".*out/other"):
            peft.load_adapters(tmp_path / "out", models.build("gpt2-debug", seed=0), format=fmt)
    loaded = peft.load_adapters(tmp_path / "out" / "mine", models.build("gpt2-debug", seed=0))
    for name, layer in peft.lora_layers(model).items():
        np.testing.assert_array_equal(peft.lora_layers(loaded)[name].lora_v.numpy(), layer.lora_v.numpy())


@pytest.mark.parametrize("flavor,target,said", [
    ("gpt2-debug", "q_proj", "'q_proj' is a Hugging Face module name of llama, not of gpt2, whose Hugging Face module "
                             "names are c_attn, c_proj, c_fc"),
    ("llama-debug", "c_fc", "'c_fc' is a Hugging Face module name of gpt2, not of llama, whose Hugging Face module "
                            "names are q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
])
@pytest.mark.parametrize("apply", [lambda m, t: peft.apply_lora(m, [t], 4), lambda m, t: peft.apply_lotr(m, [t], 4),
                                   lambda m, t: peft.apply_grad_sketch(m, [t], "gaussian", 0.5)])
def test_another_architectures_hugging_face_name_says_whose_it_is(flavor, target, said, apply):
    """Only the model's Linear layers were listed: a Llama name on GPT-2 (peft configs are written per
    architecture) said nothing of what it names."""
    with pytest.raises(TileError, match=r"match no Linear layer.*received: targets=\[" + repr(target) + r"\] \("
                                        + said.replace("(", r"\(").replace(")", r"\)") + r"\)"):
        apply(models.build(flavor, seed=0), target)


def test_half_precision_adapters_on_their_float32_base_are_not_said_to_be_of_another_base(tmp_path,
                                                                                          local_scheduler):
    """Adapters trained on a float16 model, loaded onto the float32 model of the same weights, were
    said to be 'saved on another base' (the fingerprints differ by float16 rounding, 5e-4); a
    float32 model of other weights still is."""
    import warnings

    model = peft.apply_lora(models.build("gpt2-debug", seed=0, dtype=np.float16), ["attn.q"], 4)
    peft.save_adapters(tmp_path / "a", model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = peft.load_adapters(tmp_path / "a", models.build("gpt2-debug", seed=0))
    for name, layer in peft.lora_layers(model).items():
        np.testing.assert_array_equal(peft.lora_layers(loaded)[name].lora_u.numpy(), layer.lora_u.numpy())
    with pytest.warns(UserWarning, match=r"the base weights of 2 of the 2 adapted layers are not the ones"):
        peft.load_adapters(tmp_path / "a", models.build("gpt2-debug", seed=1))
