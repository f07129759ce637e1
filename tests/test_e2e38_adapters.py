"""Adapters end to end (audit, round 2): LoRA dropout under gradient accumulation, merging and
exporting, quantized bases, RunLoRA's graphs on ragged tilings, LoTR, against peft + torch."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import peft

N16 = 16


# ------------------------------------------------------- dropout: a mask per micro-batch ----
def _identity_adapter(p=0.5):
    """A LoRA layer whose V's gradient shows the adapter's dropped-out input: W = 0, U = I (rank n),
    scale 1, V = 0; with loss = sum(y), dV[k, :] = sum over rows of D(x)[:, k]."""
    base = tg.nn.Linear(N16, N16, bias=False, dtype=np.float64, seed=0)
    base.weight.assign(np.zeros((N16, N16)))
    layer = tg.nn.LoRALinear(base, N16, N16, dropout=p, seed=0)
    layer.lora_u.assign(np.eye(N16))
    return layer


def _sgd_step(batch, accum_steps, p=0.5):
    layer = _identity_adapter(p)
    opt = tg.optim.SGD([layer.lora_u, layer.lora_v], lr=1.0)
    step = tg.TrainStep(layer, opt, lambda m, x: m(x).sum(), accum_steps=accum_steps)
    step(batch)
    return -layer.lora_v.numpy()[:, 0] * (1 - p)  # the mean over micro-batches of kept x, unscaled


def test_each_micro_batch_of_an_accumulated_step_draws_its_own_mask(local_scheduler):
    """torch + peft draw a new lora_dropout mask at every forward call, so each micro-batch of an
    accumulated step has its own; here the two micro-batches (one row each: ones, then twos) shared
    one mask, and the accumulated gradient took only the values 0 and (1 + 2) / 2."""
    batch = np.stack([np.ones(N16), 2 * np.ones(N16)])
    got = _sgd_step(batch, accum_steps=2)
    # each feature's value: (m0 * 1 + m1 * 2) / 2 for the two micro-batches' keep bits m0, m1
    assert set(np.round(got, 12)) <= {0.0, 0.5, 1.0, 1.5}
    assert {0.5, 1.0} & set(np.round(got, 12)), f"one mask for both micro-batches: {got}"
    # the accumulated gradient is the mean of the two micro-batches' own steps (same start values)
    alone = [_sgd_step(batch[j:j + 1], accum_steps=1) for j in range(2)]
    np.testing.assert_allclose(got, (alone[0] + alone[1]) / 2, rtol=0, atol=1e-12)
    # and a run again from the same start (a resumed run) draws the same masks
    np.testing.assert_array_equal(_sgd_step(batch, accum_steps=2), got)


def _accum_trainer(model, opt):
    ids = np.random.default_rng(0).integers(0, 96, (32, 9))

    def batch(step):
        rows = np.random.default_rng([1, step]).integers(0, 32, 4)
        return ids[rows, :-1], ids[rows, 1:]

    return tg.Trainer(model, opt, batch, loss_fn=lambda m, x, y: tg.cross_entropy(m(x), y), batch_size=4,
                      accum_steps=2, progress=False)


def _dropout_lora():
    model = peft.apply_lora(tg.models.build("gpt2-debug", seed=0), ["attn.q", "mlp.fc1"], 4, 8, dropout=0.3, seed=2)
    return model, tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-2)


def test_an_accumulated_lora_dropout_run_resumes_bit_exactly(tmp_path, local_scheduler):
    """The micro-batches' own masks come from their rows and the adapters: a run resumed from a
    checkpoint draws the masks of the run it continues."""
    straight, opt = _dropout_lora()
    losses = _accum_trainer(straight, opt).fit(4).losses
    first, opt = _dropout_lora()
    trainer = _accum_trainer(first, opt)
    assert trainer.fit(2).losses == losses[:2]
    trainer.save_checkpoint(tmp_path / "ck")
    second, opt = _dropout_lora()
    for layer in peft.lora_layers(second).values():  # (other seeds: the checkpoint's come back)
        layer.dropout_seed += 1
    resumed = _accum_trainer(second, opt)
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.fit(2).losses == losses[2:]
    for name, p in straight.named_parameters():
        np.testing.assert_array_equal(dict(second.named_parameters())[name].numpy(), p.numpy(), err_msg=name)


def test_each_data_parallel_replica_seeds_the_masks_of_its_own_rows():
    """LoRA dropout's seeds read one row block each: split among replicas, every replica draws the
    masks of its rows from its own tiles (no seed, no dropped-out tile crosses processes)."""
    from collections import Counter

    from tilegraph.parallel.data_parallel import split_replicas

    x = tg.from_numpy(np.random.default_rng(0).standard_normal((8, 6, 16)), (2, 3, 8))
    layer = tg.nn.LoRALinear(tg.nn.Linear(16, 12, tile=8, out_tile=6, dtype=np.float64, seed=0), 4, 8,
                             dropout=0.3, seed=0)
    with tg.nn.training():
        y = layer(x)
        grads = tg.grad((y * y).sum(), [layer.lora_u, layer.lora_v])
    roots = [r for g in grads for r in g.grid.flat]
    groups = {id(x.grid[idx].node.cell): idx[0] * 2 // x.tiling.grid[0] for idx in np.ndindex(*x.tiling.grid)}
    dp = split_replicas(roots, replicated=list(range(len(roots))), groups=groups, replicas=2)
    placed = Counter((n.kernel.name, dp.replica[id(n)]) for n in dp.nodes if not n.is_leaf)
    assert placed[("dropout_seed", 0)] == placed[("dropout_seed", 1)] == 4  # 4 row blocks each
    assert placed[("dropout", 0)] == placed[("dropout", 1)] > 0
    assert not {n.kernel.name for n in dp.nodes if id(n) in dp.exchange} & {"dropout", "dropout_seed"}


# ---------------------------------------------- targets named as peft users name them ----
@pytest.mark.parametrize("arch, tie, target, said", [
    ("gpt2-debug", True, "lm_head", r"'lm_head' is the output layer, which this GPT2 ties to its embedding wte "
                                    r"\(tie_embeddings=True\): the logits use wte's weight"),
    ("llama-debug", True, "lm_head", r"ties to its embedding embed \(tie_embeddings=True\)"),
    ("llama-debug", False, "embed_tokens", r"'embed_tokens' is the Hugging Face name of embed \(Embedding\): no "
                                           r"Linear layer"),
    ("gpt2-debug", True, "mlp.c_proj", r"'mlp.c_proj' is the Hugging Face name of blocks.0.mlp.fc2 \(Linear\), "
                                       r"blocks.1.mlp.fc2 \(Linear\): name them as tilegraph does, or by the Hugging "
                                       r"Face module names c_attn, c_proj, c_fc"),
])
def test_a_target_that_is_a_hugging_face_name_says_what_it_names(arch, tie, target, said):
    """peft's target_modules=["lm_head"] on GPT-2 (whose lm_head is tied to wte), or Llama's
    "embed_tokens", were refused as matching nothing, with no word of why."""
    import dataclasses

    config = dataclasses.replace(tg.models.config(arch), tie_embeddings=tie)
    with pytest.raises(tg.TileError, match=said):
        peft.apply_lora(tg.models.build(config), [target], rank=2)


def test_row_seeds_give_each_row_block_the_mask_of_its_own_seed():
    from tilegraph.ops.dropout import keep_mask, row_seed_tensor, step_seed

    x = np.random.default_rng(1).standard_normal((5, 4, 9))
    tx = tg.from_numpy(x, (2, 3, 4))  # ragged: rows (2, 2, 1) x (3, 1), features (4, 4, 1)
    seeds = row_seed_tensor(tx, base=11)
    assert seeds.shape == (3, 2)
    got = tg.ops.dropout(tx, 0.4, seed=seeds).numpy()
    for i, rows in enumerate((slice(0, 2), slice(2, 4), slice(4, 5))):
        for j, cols in enumerate((slice(0, 3), slice(3, 4))):
            seed = step_seed(11, x[rows, cols, :4])
            assert int(seeds.numpy()[i, j]) == seed
            keep = keep_mask(seed, x.shape, 0.4, (rows.start, cols.start, 0), x[rows, cols].shape)
            np.testing.assert_array_equal(got[rows, cols], np.where(keep, x[rows, cols] * (1 / 0.6), 0.0))
    other = tg.from_numpy(x, (1, 4, 9))
    with pytest.raises(tg.TileError, match=r"one seed per row block of x .*for x of tile grid \(5, 1, 1\)"):
        tg.ops.dropout(other, 0.4, seed=seeds)


def test_a_peft_adapter_on_gpt2s_tied_lm_head_says_the_output_layer_is_the_embedding(tmp_path):
    """peft's save_pretrained of GPT-2 with target_modules=["c_attn", "lm_head"] (lm_head tied to
    wte): loading it said "no linear module lm_head in the gpt2 model", as if the folder were of
    another model."""
    from tilegraph.io import safetensors as st
    from tilegraph.peft_hf import load_peft, save_peft

    model = peft.apply_lora(tg.models.build("gpt2-debug", seed=0), ["c_attn"], rank=2)
    save_peft(tmp_path / "ad", model)
    tensors = dict(st.load_file(tmp_path / "ad" / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((2, 32), np.float32)  # as peft writes it
    tensors["base_model.model.lm_head.lora_B.weight"] = np.zeros((96, 2), np.float32)
    st.save_file(tensors, tmp_path / "ad" / "adapter_model.safetensors")
    with pytest.raises(tg.TileError, match=r"for modules of the model \(1 problem\); received: lm_head has an adapter, "
                       r"and the gpt2 model ties its output layer to the embedding \(tie_embeddings=True"):
        load_peft(tmp_path / "ad", tg.models.build("gpt2-debug", seed=0))


# ------------------------------------------------ RunLoRA's choice inside a ragged model ----
def _lora_grads(variant, quantized_dir=None):
    tiling = tg.models.ModelTiling(feature=48, vocab=50, batch=2, seq=7)
    base = tg.models.build("llama-debug", tiling, seed=0, dtype=np.float64)
    if quantized_dir is not None:
        tg.io.save_checkpoint(quantized_dir, base, quantize="int8")
        base = peft.from_quantized(quantized_dir)
    model = peft.apply_lora(base, ["attn.q", "attn.o", "mlp.down"], rank=20, alpha=8, seed=1, variant=variant)
    for layer in peft.lora_layers(model).values():  # V = 0 would hide U's gradient
        layer.lora_v.assign(np.random.default_rng(2).standard_normal(layer.lora_v.shape) * 0.1)
    ids = np.random.default_rng(0).integers(0, 128, (3, 31))
    loss = tg.cross_entropy(model(ids[:, :-1]), ids[:, 1:])
    chosen = {ctx.backward for ctx in _lora_contexts(loss)}
    return tg.compute(loss, *tg.grad(loss, peft.trainable_parameters(model))), chosen


def _lora_contexts(loss) -> list:
    """The LoRA ops' contexts (their chosen backward graph) in the graph of ``loss``."""
    from tilegraph.ops.lora import LoRAContext

    seen, stack, out = set(), [loss], []
    while stack:
        t = stack.pop()
        if t._record is None or id(t) in seen:
            continue
        seen.add(id(t))
        ctx = t._record.ctx
        ctx = ctx[0] if isinstance(ctx, tuple) and ctx and isinstance(ctx[0], LoRAContext) else ctx  # (quantized base)
        if isinstance(ctx, LoRAContext):
            out.append(ctx)
        stack.extend(a for a in t._record.args if isinstance(a, tg.TileTensor))
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "int8"])
def test_the_graphs_runlora_picks_per_layer_equal_the_naive_graph_on_ragged_tiles(quantized, tmp_path, local_scheduler):
    """Rank 20 over feature tiles of 48 + 16 (ragged), 90 rows in tiles of 2 x 7: the chosen
    forward and backward graphs give the naive graph's loss and gradients (float64)."""
    got, chosen = _lora_grads(None, tmp_path / "a" if quantized else None)
    want, naive = _lora_grads(("f1", "b1"), tmp_path / "b" if quantized else None)
    assert naive == {"b1"} and chosen - {"b1"}, chosen  # another graph than the naive one was chosen
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-13)
