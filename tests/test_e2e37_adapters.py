"""Adapters and memory-saving backprop from a notebook (audit): LoRA dropout under activation
recompute with the backward recorded after the forward's ``tg.nn.training()`` block, a gradient
sketch asked of layers whose weight is frozen (adapters), and load_adapters given a checkpoint of
the whole model."""

import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph.sketch import apply_grad_sketch, sketched_layers


def _ids(vocab, shape=(3, 9), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


# ------------------------------------------------ recompute records in the forward's training mode ----
def _lora_dropout_model(recompute):
    model = models.build("gpt2-debug", seed=1, dtype=np.float64)
    peft.apply_lora(model, ["attn.o", "c_proj"], rank=4, dropout=0.3)
    for layer in peft.lora_layers(model).values():  # V = 0 would hide the adapter's gradients
        layer.lora_v.assign(np.random.default_rng(5).standard_normal(layer.lora_v.shape) * 0.1)
    model.recompute = recompute
    return model


def _grads(recompute, how):
    model = _lora_dropout_model(recompute)
    params = peft.trainable_parameters(model)
    ids = _ids(model.config.vocab_size)
    if how == "inside":  # the reference: forward and backward recorded in one training() block, as TrainStep does
        with tg.nn.training():
            loss = tg.cross_entropy(model(ids[:, :-1]), ids[:, 1:])
            grads = tg.grad(loss, params)
    elif how == "backward after the block":  # a torch-style notebook loop
        with tg.nn.training():
            loss = tg.cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        loss.backward()
        grads = [p.grad for p in params]
    else:  # "eval before the backward": model.train() for the forward, model.eval() before the backward
        model.train()
        loss = tg.cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        model.eval()
        grads = tg.grad(loss, params)
    return tg.compute(loss, *grads)


@pytest.mark.parametrize("how", ["backward after the block", "eval before the backward"])
def test_recompute_with_lora_dropout_gives_the_gradients_of_the_forwards_masks(how, local_scheduler):
    """The recompute recorded the block again in the mode of the moment of the backward: outside
    the forward's ``tg.nn.training()`` (or after ``model.eval()``) it had no dropout, and the
    gradients (float64) differed from those without recompute by up to 0.017; they are now the same."""
    want = _grads(False, "inside")
    for recompute in (False, True):
        got = _grads(recompute, how)
        for i, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=f"recompute={recompute}, output {i}")


def test_recompute_puts_back_the_mode_of_the_moment(local_scheduler):
    """The recompute's mode is the forward's only while it records: the modules' train()/eval()
    flags and tg.nn.training()'s mode are back as they were after the backward."""
    model = _lora_dropout_model(True)
    ids = _ids(model.config.vocab_size)
    model.train()
    loss = tg.cross_entropy(model(ids[:, :-1]), ids[:, 1:])
    model.eval()
    with tg.nn.training(False):
        tg.grad(loss, peft.trainable_parameters(model))
        assert not tg.nn.is_training() and not model.blocks[0].attn.o.training
    assert not any(m.training for m in model.modules())


# ----------------------------------------------------- gradient sketches of frozen (adapted) layers ----
def test_grad_sketch_of_adapted_layers_is_refused_naming_them():
    """A target matching only LoRA layers was 'matches no Linear layer' (the layers are there,
    with a frozen base weight); it says so now."""
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v"], rank=4)
    with pytest.raises(tg.TileError, match=r"'attn\.q' matches only layers whose base weight is frozen: "
                                           r"blocks\.0\.attn\.q \(LoRALinear\)"):
        apply_grad_sketch(model, ["attn.q"], "gaussian", 0.5)
    assert sketched_layers(model) == {}
    with pytest.raises(tg.TileError, match=r"targets \['nothing'\] match no Linear layer"):
        apply_grad_sketch(model, ["nothing"], "gaussian", 0.5)


def test_grad_sketch_of_frozen_layers_warns_that_it_changes_nothing(local_scheduler):
    """apply_lora freezes every base weight: a sketch on them was taken without a word and
    changed nothing (the backward computes no weight gradient of a frozen weight, so no sketch:
    the step graph is the same, node for node). It is named in a warning now."""
    from tilegraph._graph import topo_order

    def graph_nodes(sketch):
        model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
        if sketch:
            with pytest.warns(UserWarning, match=r"frozen weight \(requires_grad=False: blocks\.0\.mlp\.fc1, "
                                                 r"blocks\.1\.mlp\.fc1\).*the sketch changes nothing"):
                apply_grad_sketch(model, ["c_fc"], "gaussian", 0.5)
        ids = _ids(model.config.vocab_size)
        loss = tg.cross_entropy(model(ids[:, :-1]), ids[:, 1:])
        grads = tg.grad(loss, peft.trainable_parameters(model))
        return len(topo_order([r for t in (loss, *grads) for r in t.grid.flat]))

    assert graph_nodes(True) == graph_nodes(False)
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
    with pytest.warns(UserWarning, match=r"blocks\.0\.attn\.q \(LoRALinear\)"):  # a pattern over both kinds
        apply_grad_sketch(model, ["attn.*"], "rows", 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_grad_sketch(model, ["attn.*"], None)  # turning it off: nothing to warn of
        apply_grad_sketch(models.build("gpt2-debug", seed=0), ["c_fc"], "gaussian", 0.5)  # trained weights


# --------------------------------------------------- load_adapters of a whole model's checkpoint ----
def test_load_adapters_of_a_whole_model_checkpoint_says_how_to_load_it(tmp_path, local_scheduler):
    """A Trainer's (or save_checkpoint's) checkpoint holds the adapters with the whole model;
    load_adapters said it 'holds no LoRA or LoTR metadata', as of a checkpoint without adapters."""
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
    tg.io.save_checkpoint(tmp_path / "ck", model)
    base = models.build("gpt2-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"whole model with adapters on 2 layers \(blocks\.0\.attn\.q, "
                                           r"blocks\.1\.attn\.q\).*load_checkpoint\(path\)\.model"):
        peft.load_adapters(tmp_path / "ck", base)
    assert peft.lora_layers(base) == {} and all(p.requires_grad for p in base.parameters())
    back = tg.io.load_checkpoint(tmp_path / "ck").model  # what the message says works
    assert sorted(peft.lora_layers(back)) == ["blocks.0.attn.q", "blocks.1.attn.q"]
    tg.io.save_checkpoint(tmp_path / "plain", models.build("gpt2-debug", seed=0))
    with pytest.raises(tg.TileError, match="holds no LoRA or LoTR metadata$"):
        peft.load_adapters(tmp_path / "plain", base)


# ------------------------------------------------------------- targets that are not Linear layers ----
@pytest.mark.parametrize("arch, target, said", [
    ("gpt2-debug", "wte", r"'wte' matches wte \(Embedding\), no Linear layer"),
    ("gpt2-debug", "ln_1", r"'ln_1' matches blocks\.0\.ln_1 \(LayerNorm\), blocks\.1\.ln_1 \(LayerNorm\), no Linear"),
    ("llama-debug", "attn_norm", r"blocks\.0\.attn_norm \(RMSNorm\)"),
    ("gpt2-debug", "attn", r"'attn' matches blocks\.0\.attn \(CausalSelfAttention\), blocks\.1\.attn "
                           r"\(CausalSelfAttention\), which hold Linear layers: 'attn\.\*' names them"),
    ("llama-debug", "blocks.1", r"'blocks\.1' matches blocks\.1 \(Block\), which hold Linear layers: 'blocks\.1\.\*'"),
])
def test_a_target_naming_an_embedding_a_norm_or_a_block_says_what_it_is(arch, target, said):
    """peft's LoRA takes Embedding targets, and 'attn' or 'mlp' read as a module's name: such a
    target was 'match no Linear layer', as one naming nothing; it names what it matches now."""
    model = models.build(arch, seed=0)
    with pytest.raises(tg.TileError, match=said):
        peft.apply_lora(model, [target], rank=2)
    assert peft.lora_layers(model) == {}
    with pytest.raises(tg.TileError, match=said):
        apply_grad_sketch(model, [target], "gaussian", 0.5)
    with pytest.raises(tg.TileError, match=r"received: targets=\['nothing'\]$"):  # matches nothing: said as before
        peft.apply_lora(model, ["nothing"], rank=2)


def test_load_adapters_of_a_peft_embedding_adapter_names_it(tmp_path, local_scheduler):
    """A peft folder with an adapter on embed_tokens (lora_embedding_A/B, and the base weight peft
    saves with it) was three bare 'unexpected key' problems, the third 'a base weight of a module
    without lora_A and lora_B'; the two adapter keys are named as an Embedding's adapter now."""
    transformers = pytest.importorskip("transformers")
    hf_peft = pytest.importorskip("peft")
    models.build("llama-debug", seed=0).to_hf(tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    config = hf_peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's: save_embedding_layers set to True
        hf_peft.get_peft_model(hf, config).save_pretrained(tmp_path / "adapters")
    model = models.build("llama-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"\(2 problems\); received: unexpected key base_model\.model\.model\."
                                           r"embed_tokens\.lora_embedding_A \(peft's adapter of an nn\.Embedding, "
                                           r"model\.embed_tokens: tilegraph's LoRA adapts Linear layers only\); "
                                           r"unexpected key [^;]*lora_embedding_B \([^;]*\)$"):
        peft.load_adapters(tmp_path / "adapters", model)
    assert peft.lora_layers(model) == {}


# ------------------------------------------------------------------------- apply_lora a second time ----
def test_a_second_apply_lora_over_adapted_layers_warns_that_they_keep_theirs():
    """apply_lora(["attn.q"], rank=4) then apply_lora(["attn.*"], rank=8): the q layers kept their
    rank-4 adapter without a word (a target matching only them is refused, one matching them
    among others was not); a warning names them now."""
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=4)
    with pytest.warns(UserWarning, match=r"match 2 layers with an adapter already, which keep it as it is.*"
                                         r"blocks\.0\.attn\.q \(LoRALinear, rank 4\), blocks\.1\.attn\.q"):
        peft.apply_lora(model, ["attn.*"], rank=8)
    ranks = {name: layer.rank for name, layer in peft.lora_layers(model).items()}
    assert ranks["blocks.0.attn.q"] == 4 and ranks["blocks.0.attn.k"] == 8 and len(ranks) == 8
    lotr = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=4)
    with pytest.warns(UserWarning, match=r"blocks\.0\.attn\.q \(LoRALinear, rank 4\)"):
        peft.apply_lotr(lotr, ["c_attn"], rank=2)
    assert sorted(peft.lotr_layers(lotr)) == ["blocks.0.attn.k", "blocks.0.attn.v", "blocks.1.attn.k",
                                              "blocks.1.attn.v"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # other layers only: nothing to warn of
        peft.apply_lora(model, ["mlp.fc2"], rank=2)
        peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.*"], rank=2)


def test_float16_dropout_draws_the_float32_mask_and_lora_dropout_trains(local_scheduler):
    # Numba compiles no float16 kernel: tg.dropout of a float16 tensor, and so LoRA dropout on a
    # float16 model, failed with NotImplementedError in tile kernel 'dropout'.
    x = np.random.default_rng(0).standard_normal((6, 40))
    kept = {dt: tg.dropout(tg.from_numpy(x.astype(dt), tiles=(3, 16)), 0.5, seed=1).numpy() != 0
            for dt in (np.float16, np.float32)}
    np.testing.assert_array_equal(kept[np.float16], kept[np.float32])
    model = peft.apply_lora(models.build("gpt2-debug", seed=0, dtype=np.float16), ["c_attn"], rank=4, alpha=8,
                            dropout=0.2)
    step = tg.TrainStep(model, tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-3), tg.trainer.lm_loss)
    ids = np.random.default_rng(1).integers(0, 96, (2, 17))
    losses = [float(step(ids[:, :-1], ids[:, 1:])) for _ in range(3)]
    assert all(np.isfinite(losses))
    v = model.blocks[0].attn.q.lora_v.numpy()
    assert np.isfinite(v).all() and np.abs(v).max() > 0  # the adapters trained (V starts at 0)


def test_train_init_of_a_checkpoint_saved_with_adapters_fine_tunes_every_weight(tmp_path):
    # `tilegraph train --init CK` (full fine-tuning, [peft] method "none") of a checkpoint of an
    # adapted model: the adapters come merged, and merge_lora left every weight frozen, so the run
    # ended with "[tilegraph.optim.AdamW] params must hold at least one Parameter; received: params: empty".
    from tilegraph.cli.finetune import init_model

    adapted = peft.apply_lora(models.build("gpt2-debug", seed=0), ["c_attn"], rank=4, alpha=8)
    tg.io.save_checkpoint(tmp_path / "ck", adapted)
    model, quantized = init_model(str(tmp_path / "ck"), "none")
    assert not quantized and not peft.lora_layers(model)
    assert all(p.requires_grad for p in model.parameters())
    lora_model, _ = init_model(str(tmp_path / "ck"), "lora")  # [peft] adds its own after: as before
    assert not peft.lora_layers(lora_model)
