"""Adapters and memory-saving backprop tried from Python as a new fine-tuning user would: each
test names the defect it pins (a LoRA run's checkpoint reopened quantized, merge_lora and the
weight-gradient sketch, quantized saves of adapters, tg.checkpoint's torch keywords, checks)."""

import json
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph.sketch import apply_grad_sketch, sketched_layers


def _ids():
    return tg.from_numpy(np.arange(16).reshape(2, 8) % 96)


def _trained_lora(model):
    """LoRA on q and v with V set away from zero (as after training), so the adapters matter."""
    peft.apply_lora(model, ["attn.q", "attn.v"], rank=4, alpha=8)
    rng = np.random.default_rng(1)
    for layer in peft.lora_layers(model).values():
        layer.lora_v.assign((0.1 * rng.standard_normal(layer.lora_v.shape)).astype(np.float32))
    return model


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA model on an int4 base, saved as tilegraph.io.save_checkpoint saves it (no record of
    the adapters' settings) and with tilegraph train's tilegraph_peft.json; and its logits."""
    root = tmp_path_factory.mktemp("lora_run")
    tg.io.save_checkpoint(root / "q4", models.build("gpt2-debug", seed=0), quantize="int4")
    model = _trained_lora(peft.from_quantized(root / "q4"))
    logits = model(_ids()).numpy()
    tg.io.save_checkpoint(root / "plain", model)
    record = {"method": "lora", "rank": 4, "alpha": 8, "targets": ["attn.q", "attn.v"], "dropout": 0.0,
              "init": None, "base_in_checkpoint": True}
    tg.io.save_checkpoint(root / "recorded", model, files={"tilegraph_peft.json": json.dumps(record).encode()})
    return root, logits


# ------------------------------------------------- known defect 1: from_quantized and adapters ----
def test_from_quantized_restores_the_adapters_a_checkpoint_records(lora_run):
    """from_quantized dropped the adapters of a checkpoint saved from a LoRA model on a quantized
    base: adapters=True restores them (settings from tilegraph_peft.json), the same logits."""
    root, logits = lora_run
    model = peft.from_quantized(root / "recorded", adapters=True)
    assert sorted(peft.lora_layers(model)) == ["blocks.0.attn.q", "blocks.0.attn.v", "blocks.1.attn.q",
                                              "blocks.1.attn.v"]
    assert {m.alpha for m in peft.lora_layers(model).values()} == {8.0}
    assert len(peft.named_quantized(model)) == 12  # the base stays quantized
    np.testing.assert_allclose(model(_ids()).numpy(), logits, rtol=1e-6, atol=1e-6)


def test_from_quantized_says_when_it_leaves_adapters_out(lora_run):
    """Without a record of the adapters' alpha, from_quantized left them out without a word: now a
    warning names them, and adapters=True is refused saying how to add them back."""
    root, logits = lora_run
    with pytest.warns(UserWarning, match=r"holds adapters on 4 layers \(blocks\.0\.attn\.q.*left out"):
        base = peft.from_quantized(root / "plain")
    assert not peft.lora_layers(base)
    with pytest.raises(tg.TileError, match=r"from_quantized.*adapters=True restores .*tilegraph_peft\.json.*"
                                           r"load_into\(model, strict=False\)"):
        peft.from_quantized(root / "plain", adapters=True)
    with pytest.raises(tg.TileError, match=r"adapters must be True .* or False .*; received: 'yes'"):
        peft.from_quantized(root / "plain", adapters="yes")
    # the way the warning names gives the model back
    model = peft.apply_lora(base, ["attn.q", "attn.v"], rank=4, alpha=8)
    tg.io.load_checkpoint(root / "plain").load_into(model, strict=False)
    np.testing.assert_allclose(model(_ids()).numpy(), logits, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():  # a checkpoint with no adapters: nothing to say
        warnings.simplefilter("error")
        peft.from_quantized(root / "q4")


# -------------------------------------------------- known defect 2: merge_lora and the sketch ----
@pytest.mark.parametrize("adapt", ["lora", "lotr"])
def test_merge_lora_keeps_the_base_layers_grad_sketch(adapt):
    """merge_lora put back plain Linears without the grad_sketch settings of the layers it had
    adapted: the merged model trained those layers with exact gradients again."""
    model = apply_grad_sketch(models.build("gpt2-debug", seed=0), ["attn.q", "mlp.fc1"], "rademacher", 0.5, seed=3)
    before = {n: (m.grad_sketch, m.sketch_ratio, m.sketch_seed) for n, m, _ in peft._named_modules(model)
              if isinstance(m, tg.nn.Linear)}
    if adapt == "lora":
        peft.apply_lora(model, ["attn.q", "attn.v"], rank=2)
    else:
        peft.apply_lotr(model, ["attn.q", "attn.v"], rank=2)
    assert sorted(sketched_layers(model)) == ["blocks.0.mlp.fc1", "blocks.1.mlp.fc1"]  # q is adapted
    peft.merge_lora(model)
    after = {n: (m.grad_sketch, m.sketch_ratio, m.sketch_seed) for n, m, _ in peft._named_modules(model)
             if isinstance(m, tg.nn.Linear)}
    assert after == before
    assert sketched_layers(model)["blocks.1.attn.q"] == ("rademacher", 0.5)


# ------------------------------------------------------------ quantized saves of adapters ----
def test_save_checkpoint_quantize_keeps_adapters_exact(tmp_path):
    """save_checkpoint(model, quantize="int4") of a LoRA model quantized its lora_u and lora_v
    (2-D, so "weight matrices") to int4: the trained adapters came back 16 levels coarse."""
    model = _trained_lora(models.build("gpt2-debug", seed=0))
    tg.io.save_checkpoint(tmp_path / "q", model, quantize="int4")
    ck = tg.io.load_checkpoint(tmp_path / "q")
    assert ck.arrays["model/blocks.0.attn.q.weight"]["quantized"]["method"] == "int4"
    adapters = [n for n in ck.parameters if n.endswith((".lora_u", ".lora_v"))]
    assert len(adapters) == 8 and all(ck.arrays[f"model/{n}"]["quantized"] is None for n in adapters)
    state = dict(model.named_parameters())
    for n in adapters:
        np.testing.assert_array_equal(ck.array(n), state[n].numpy())
    assert tg.io.default_method("blocks.0.lotr_core", (4, 4), "int4") is None


# ------------------------------------------------------------ tg.checkpoint's torch keywords ----
def test_checkpoint_passes_keyword_arguments_to_fn_as_torch_does():
    """tg.checkpoint(fn, x, scale=3.0) and torch's preserve_rng_state= were a bare TypeError
    ('unexpected keyword argument'); torch passes keyword arguments on to fn."""
    x = tg.from_numpy(np.arange(6.0).reshape(2, 3))
    w = tg.from_numpy(np.full((2, 3), 0.5))

    def fn(a, scale=1.0, other=None):
        return (a * other).sum(1, keepdim=True) * scale + a

    got = tg.grad(tg.checkpoint(fn, x, scale=3.0, other=w, preserve_rng_state=False).sum(), [x, w])
    want = tg.grad(fn(x, scale=3.0, other=w).sum(), [x, w])
    for g, h in zip(got, want):
        np.testing.assert_allclose(g.numpy(), h.numpy())
    with pytest.raises(tg.TileError, match=r"\[tilegraph\.checkpoint\] preserve_rng_state must be a bool"):
        tg.checkpoint(fn, x, preserve_rng_state="no")


# ---------------------------------------------------------------------------- argument checks ----
@pytest.mark.parametrize("call, where", [
    (lambda: peft.apply_lora("gpt2", ["attn.q"], rank=2), "apply_lora"),
    (lambda: peft.apply_lotr(None, ["attn.q"], rank=2), "apply_lotr"),
    (lambda: peft.merge_lora("model"), "merge_lora"),
    (lambda: peft.trainable_parameters(3), "trainable_parameters"),
    (lambda: peft.load_adapters("adapters", "model"), "load_adapters"),
    (lambda: apply_grad_sketch(None, ["attn.q"]), "apply_grad_sketch"),
])
def test_peft_functions_refuse_what_is_not_a_model(call, where):
    """A non-Module given as the model was a bare TypeError ('vars() argument must have __dict__
    attribute') or AttributeError from the module walk."""
    with pytest.raises(tg.TileError, match=rf"{where}\] model must be a tilegraph\.nn\.Module"):
        call()


@pytest.mark.parametrize("apply", [peft.apply_lora, peft.apply_lotr])
def test_adapters_refuse_a_seed_numpy_cannot_take(apply):
    """apply_lora(..., seed='x') / seed=-1 gave NumPy's TypeError/ValueError from SeedSequence,
    and the model stays as it was."""
    model = models.build("gpt2-debug", seed=0)
    for seed in ("x", -1, 1.5):
        with pytest.raises(tg.TileError, match=rf"{apply.__name__}\] seed must be an int >= 0"):
            apply(model, ["attn.q"], rank=2, seed=seed)
    assert not peft.lora_layers(model) and not peft.lotr_layers(model)
    assert all(p.requires_grad for p in model.parameters())
