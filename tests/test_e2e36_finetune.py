"""Fine-tune and ship, across features: a Hugging Face model converted to a quantized Zarr
checkpoint, LoRA on the quantized base, then the adapters, the merged model and the exported
folder checked against transformers and peft (tiny random models, logits in float32)."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from hf_helpers import hf_model_cache
from tilegraph import models, peft

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # transformers' own

VOCAB = 40
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 7))


def _hf_config(arch: str):
    if arch == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                       bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                    tie_word_embeddings=arch == "llama-tied", bos_token_id=0, eos_token_id=0)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return hf_model_cache(tmp_path_factory, _hf_config, 0.3)


TARGETS = {"gpt2": ["c_attn", "c_fc"], "llama": ["q_proj", "v_proj", "down_proj"],
           "llama-tied": ["q_proj", "v_proj", "down_proj"]}


def _logits(model) -> np.ndarray:
    return tg.compute(model(IDS))[0]


def _hf_logits(hf) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(IDS)).logits.numpy()


def _quantized_base(hf_models, arch, tmp_path, method="int4"):
    _, folder = hf_models(arch)
    return tg.io.save_checkpoint(tmp_path / f"{arch}-{method}", models.from_hf(folder), quantize=method)


def _fine_tuned(ck, arch):
    model = peft.apply_lora(peft.from_quantized(ck), TARGETS[arch], rank=4, alpha=8)
    opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=2e-2, weight_decay=0.0)
    trainer = tg.Trainer(model, opt, lambda step: (IDS[:, :-1], IDS[:, 1:]), batch_size=2, progress=False,
                         loss_fn=lambda m, x, y: tg.cross_entropy(m(x), y))
    losses = trainer.fit(3).losses
    assert losses[-1] < losses[0]
    return model


# --------------------------------------------------------------- to_hf of a quantized base ----
@pytest.mark.parametrize("arch", ["llama", "llama-tied", "gpt2"])
def test_to_hf_of_a_model_on_a_quantized_base_writes_its_linear_weights(hf_models, arch, tmp_path):
    """to_hf left out every weight held quantized (not a Parameter): the folder had only the
    embeddings, norms and biases, and transformers loaded it with the Linear weights drawn at
    random (logits off by ~10). Merged or not, they are written dequantized now."""
    ck = _quantized_base(hf_models, arch, tmp_path)
    model = _fine_tuned(ck, arch)
    adapted = _logits(model)
    with pytest.warns(UserWarning, match="the folder holds the base weights, without the model's"):
        model.to_hf(tmp_path / "base")  # the base under the adapters: what peft's folder loads onto
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    np.testing.assert_allclose(_hf_logits(base), _logits(models.from_zarr(ck)), rtol=1e-4, atol=1e-4)

    peft.merge_lora(model)  # the adapted layers become plain Linear, the others stay quantized
    model.to_hf(tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    np.testing.assert_allclose(_hf_logits(hf), adapted, rtol=1e-4, atol=1e-4)
    got = models.generate(model, IDS[:, :4], 6)
    want = hf.generate(torch.tensor(IDS[:, :4]), max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()
    np.testing.assert_array_equal(got, want)


def _randomize_adapters(model, seed=1) -> None:
    rng = np.random.default_rng(seed)
    for layer in peft.lora_layers(model).values():
        layer.lora_v.assign((0.5 * rng.standard_normal(layer.lora_v.shape)).astype(np.float32))


def _peft_logits(model, tmp_path) -> np.ndarray:
    """The logits of Hugging Face peft over ``model``'s base (to_hf) with its adapters (peft's layout)."""
    hf_peft = pytest.importorskip("peft")
    with pytest.warns(UserWarning, match="the folder holds the base weights, without the model's"):
        model.to_hf(tmp_path / "ref-base")  # the base: what peft's folder loads onto
    peft.save_adapters(tmp_path / "ref-adapters", model, format="peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ref-base")
    return _hf_logits(hf_peft.PeftModel.from_pretrained(base, tmp_path / "ref-adapters"))


# ------------------------------------------------- tilegraph train --init of an adapted model ----
@pytest.mark.parametrize("method,record", [("lora", False), ("none", False), ("lora", True)])
def test_train_init_from_a_quantized_checkpoint_holding_adapters_keeps_them(hf_models, method, record, tmp_path):
    """`tilegraph train --init CK` with [peft] method = "lora", CK a quantized-base model saved with
    its adapters (tg.io.save_checkpoint in Python): the run's model dropped the adapters and
    started from the base (logits off by ~10), where a float checkpoint, or method = "none", had
    them merged. And CK a checkpoint of such a run (its tilegraph_peft.json): every Linear weight
    came dequantized, where the README says a quantized init under adapters stays quantized. Now
    the adapters are merged and the other Linear weights stay quantized, in both."""
    import json

    from tilegraph.cli.finetune import PEFT_FILE, init_model, peft_record

    ck = _quantized_base(hf_models, "llama", tmp_path)
    settings = {"method": "lora", "rank": 4, "alpha": 8, "targets": ["q_proj", "v_proj"], "dropout": 0.0}
    model = peft.apply_lora(peft.from_quantized(ck), settings["targets"], rank=4, alpha=8)
    _randomize_adapters(model)
    want = _peft_logits(model, tmp_path)
    saved = tg.io.save_checkpoint(tmp_path / "adapted", model)
    if record:  # as tilegraph train writes it into the checkpoints of a run on CK
        (saved / PEFT_FILE).write_text(json.dumps(peft_record(settings, str(ck), True)))
    init, quantized = init_model(str(saved), method)
    assert quantized == (method == "lora") and not peft.lora_layers(init)
    if quantized:  # only the adapted layers were dequantized to merge them
        assert {n for n, _ in peft.named_quantized(init)} == {
            f"blocks.{i}.{k}.weight" for i in range(2) for k in ("attn.k", "attn.o", "mlp.gate", "mlp.up", "mlp.down")
        } | {"lm_head.weight"}
    np.testing.assert_allclose(_logits(init), want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------- peft's own folder with lm_head adapted ----
def test_load_peft_folder_with_lm_head_adapter_as_peft_saves_it(hf_models, tmp_path):
    """peft's save_pretrained with lm_head among the targets also writes lm_head's base weight
    (base_model.model.lm_head.base_layer.weight, its save_embedding_layers): load_adapters refused
    the folder ("unexpected key"). A copy equal to the model's weight is taken now; continued
    training on the int4 base equals peft + torch on the dequantized base, step for step. A copy
    that differs (the float model's, onto the quantized one) is named."""
    hf_peft = pytest.importorskip("peft")
    ck = _quantized_base(hf_models, "llama", tmp_path)
    models.from_zarr(ck).to_hf(tmp_path / "base")
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    config = hf_peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"],
                                init_lora_weights=False)
    ref = hf_peft.get_peft_model(base, config)
    with pytest.warns(UserWarning, match="save_embedding_layers"):
        ref.save_pretrained(tmp_path / "adapters")
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=2e-2, weight_decay=0.0)
    want = []
    for _ in range(3):
        logits = ref(torch.tensor(IDS[:, :-1])).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(IDS[:, 1:]).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())

    model = peft.load_adapters(tmp_path / "adapters", peft.from_quantized(ck))
    assert "lm_head" in peft.lora_layers(model)
    topt = tg.optim.AdamW(peft.trainable_parameters(model), lr=2e-2, weight_decay=0.0)
    trainer = tg.Trainer(model, topt, lambda step: (IDS[:, :-1], IDS[:, 1:]), batch_size=2, progress=False,
                         loss_fn=lambda m, x, y: tg.cross_entropy(m(x), y))
    np.testing.assert_allclose(trainer.fit(3).losses, want, rtol=1e-5)

    _, folder = hf_models("llama")  # the float weights: lm_head differs from the int4 one
    with pytest.raises(tg.TileError, match=r"lm_head.base_layer.weight differs from the model's lm_head.weight"):
        peft.load_adapters(tmp_path / "adapters", models.from_hf(folder))
