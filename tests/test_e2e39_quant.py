"""End-to-end audit of quantized checkpoints and adapters (session 39): adapters saved on one base
and loaded onto another of the same shapes (another checkpoint, the float weights of the quantized
base they were trained on, a base with other adapters merged in, as a `tilegraph train` run
started from an adapted checkpoint has) were taken without a word, giving a model other than the
one trained. `save_adapters` now records a fingerprint of each adapted layer's base weight and
`load_adapters` warns, naming the layers whose base differs."""

import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft

TARGETS = ["attn.q", "attn.v"]
ADAPTED = [f"blocks.{i}.{k}" for i in range(2) for k in TARGETS]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An int4 checkpoint of gpt2-debug and LoRA adapters (V set non-zero) saved on its quantized base."""
    root = tmp_path_factory.mktemp("e2e39_quant")
    base = tg.io.save_checkpoint(root / "int4", models.build("gpt2-debug", seed=0), quantize="int4")
    model = peft.apply_lora(peft.from_quantized(base), TARGETS, rank=4, alpha=8)
    rng = np.random.default_rng(0)
    for name, p in model.named_parameters():
        if name.endswith("lora_v"):
            p.assign((0.1 * rng.standard_normal(p.shape)).astype(np.float32))
    ids = rng.integers(0, model.config.vocab_size, (2, 9))
    peft.save_adapters(root / "adapters", model)
    return {"base": base, "adapters": root / "adapters", "ids": ids, "logits": tg.compute(model(ids))[0]}


def _load(saved, model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft.load_adapters(saved["adapters"], model)
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return model, said


def test_base_probes_are_p_w_q_of_the_dequantized_weights(saved):
    """The fingerprint is P^T W Q of the weight the model computes with (NumPy on the weights
    models.from_zarr dequantizes), the same on a quantized base as on its dequantized copy."""
    quantized = peft.apply_lora(peft.from_quantized(saved["base"]), TARGETS, rank=4)
    dense = models.from_zarr(saved["base"])
    weights = dense.state_dict()
    got = peft.base_probes(quantized)
    assert sorted(got) == sorted(ADAPTED)
    for name in ADAPTED:
        w = weights[f"{name}.weight"].astype(np.float64)
        rng = np.random.default_rng(list(w.shape))
        left = rng.standard_normal((4, w.shape[0])).astype(np.float32)
        right = rng.standard_normal((w.shape[1], 4)).astype(np.float32)
        np.testing.assert_allclose(got[name], (left @ w @ right).ravel(), rtol=1e-5, atol=1e-5, err_msg=name)
    on_dense = peft.base_probes(peft.apply_lora(dense, TARGETS, rank=4))
    np.testing.assert_allclose([got[n] for n in ADAPTED], [on_dense[n] for n in ADAPTED], rtol=1e-6, atol=1e-6)


def test_adapters_on_the_base_they_were_saved_on_load_without_a_warning(saved):
    for model in (peft.from_quantized(saved["base"]), models.from_zarr(saved["base"]),
                  models.from_zarr(saved["base"], models.ModelTiling(feature=16)),  # other tiles: sums in another order
                  models.from_zarr(saved["base"], dtype="float64")):
        model, said = _load(saved, model)
        assert said == []
        np.testing.assert_allclose(tg.compute(model(saved["ids"]))[0], saved["logits"], rtol=1e-5, atol=1e-5)


def test_adapters_loaded_onto_another_base_warn_naming_its_layers(saved):
    # the float weights that the int4 base was quantized from: a model other than the one trained
    model, said = _load(saved, models.build("gpt2-debug", seed=0))
    assert len(said) == 1 and "the base weights of 4 of the 4 adapted layers are not the ones" in said[0], said
    assert all(name in said[0] for name in ADAPTED)
    assert np.abs(tg.compute(model(saved["ids"]))[0] - saved["logits"]).max() > 1e-2  # what the warning is about

    # a base with other adapters merged into attn.q only (a tilegraph train run from an adapted checkpoint)
    other = peft.apply_lora(peft.from_quantized(saved["base"]), ["attn.q"], rank=2, alpha=4, seed=1)
    for name, p in other.named_parameters():
        if name.endswith("lora_v"):
            p.assign(np.full(p.shape, 0.05, np.float32))
    peft.merge_lora(other)
    _, said = _load(saved, other)
    assert len(said) == 1 and "2 of the 4 adapted layers" in said[0], said
    assert "blocks.0.attn.q" in said[0] and "blocks.1.attn.q" in said[0] and "attn.v" not in said[0]


def test_adapters_saved_before_the_fingerprint_load_as_before(saved, tmp_path):
    """Adapters written without the fingerprint (by an older tilegraph) load without a check."""
    model = peft.load_adapters(saved["adapters"], peft.from_quantized(saved["base"]))
    tg.io.save_checkpoint(tmp_path / "old", peft._Adapters(model), metadata=peft.adapter_settings(model))
    _, said = _load({**saved, "adapters": tmp_path / "old"}, models.build("gpt2-debug", seed=1))
    assert said == []


def test_a_method_without_its_bit_budget_says_how_to_give_one(tmp_path):
    """`save_checkpoint(..., quantize="auto")` (and `tilegraph convert --quantize auto`) said
    "bits= one of [...]", a keyword that neither takes; the message now gives both spellings."""
    from tilegraph.io.quantize import quantize

    with pytest.raises(tg.TileError, match=r"method 'auto' needs a bit budget, one of \[2, 3, 4, 5, 6, 7, 8, 16\]: "
                                           r"quantize\(x, 'auto', 4\), or 'auto:4' as a checkpoint's quantize"):
        tg.io.save_checkpoint(tmp_path / "ck", models.build("gpt2-debug", seed=0), quantize="auto")
    with pytest.raises(tg.TileError, match=r"'auto:4' as a checkpoint's quantize"):
        quantize(np.ones((4, 4), np.float32), "auto")
    assert not (tmp_path / "ck").exists()


def test_a_checkpoint_of_a_model_holding_quantized_weights_says_they_are_stored_as_they_are(saved, tmp_path):
    """save_checkpoint(quantize="int8") of a model on an int4 base wrote its held weights as int4
    without a word: weights held quantized are stored as they are. Now a warning names them;
    asking for what they are (int4) or for nothing says nothing."""
    model = peft.from_quantized(saved["base"])
    with pytest.warns(UserWarning, match=r"quantize='int8': the model holds \d+ weights quantized already \(int4:4"):
        tg.io.save_checkpoint(tmp_path / "q8", model, quantize="int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tg.io.save_checkpoint(tmp_path / "q4", model, quantize="int4")
        tg.io.save_checkpoint(tmp_path / "plain", model)
