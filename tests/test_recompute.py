"""Activation recompute (tilegraph.checkpoint, ``model.recompute``): the same gradients and losses
as without it, and a backward that reads of each block's forward only the block's input."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._graph import topo_order
from tilegraph.models import ModelTiling

ARCHS = ["gpt2-debug", "llama-debug"]
# gpt2-debug: dim 32, head_dim 8, vocab 96; llama-debug: dim 64, head_dim 16, vocab 128; ids (2, 8)
TILINGS = {
    "single": lambda arch: ModelTiling(),
    "even": lambda arch: ModelTiling(feature=8 if arch.startswith("gpt2") else 16, vocab=24 if arch.startswith("gpt2") else 32,
                                     batch=1, seq=4),
    "ragged": lambda arch: ModelTiling(feature=24 if arch.startswith("gpt2") else 48, vocab=20, batch=2, seq=3),
}


def _ids(vocab, shape=(3, 8), seed=0):
    return np.random.default_rng(seed).integers(0, vocab, shape)


def _lm_loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


def _loss_and_grads(arch, tiling, recompute, dtype=np.float64):
    model = models.build(arch, tiling, seed=1, dtype=dtype)
    model.recompute = recompute
    ids = _ids(model.config.vocab_size)
    loss = tg.cross_entropy(model(ids[:, :-1]), model.tiling.tile_ids(ids[:, 1:]))
    return model, loss, tg.grad(loss, model.parameters())


@pytest.mark.parametrize("mode", list(TILINGS))
@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_with_recompute_equal_those_without(arch, mode, local_scheduler):
    _, loss, grads = _loss_and_grads(arch, TILINGS[mode](arch), False)
    want = tg.compute(loss, *grads)
    model, loss, grads = _loss_and_grads(arch, TILINGS[mode](arch), True)
    got = tg.compute(loss, *grads)
    names = ["loss"] + [n for n, _ in model.named_parameters()]
    for name, g, w in zip(names, got, want):
        # float64; measured: bitwise equal (the recompute records the same kernels on the same tiles)
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14, err_msg=name)


def _forward_reads_per_block(model, loss, grads):
    """Per block: the forward values (non-leaf tiles the loss depends on) and the forward leaves
    that the block's backward kernels (scope ``blocks.i...:backward`` or ``:recompute``) read."""
    forward = {id(n) for n in topo_order(list(loss.grid.flat))}
    backward = [n for n in topo_order([r for g in grads for r in g.grid.flat]) if id(n) not in forward]
    reads = []
    for i in range(model.config.n_layers):
        name = f"blocks.{i}"
        mine = [n for n in backward if n.scope.split(":")[0] == name or n.scope.startswith(name + ".")]
        values, leaves = {}, set()
        for n in mine:
            for r in n.inputs:
                if id(r.node) in forward:
                    if r.node.is_leaf:
                        leaves.add(id(r.node))
                    else:
                        values[(id(r.node), r.index)] = r
        reads.append((values, leaves, mine))
    return reads, forward


@pytest.mark.parametrize("arch", ARCHS)
def test_the_backward_of_a_block_reads_only_its_input_and_parameters(arch):
    tiling = TILINGS["ragged"](arch)
    ids = _ids(models.config(arch).vocab_size)
    B, T, C = ids.shape[0], ids.shape[1] - 1, models.config(arch).dim
    activation = B * T * C * 8  # bytes of one (B, T, C) float64 activation
    for recompute in (False, True):
        model, loss, grads = _loss_and_grads(arch, tiling, recompute)
        reads, forward = _forward_reads_per_block(model, loss, grads)
        for i, (values, leaves, mine) in enumerate(reads):
            params = {id(r.node) for _, p in model.blocks[i].named_parameters() for r in p.grid.flat}
            kept = sum(r.nbytes for r in values.values())
            outside = all(not (r.node.scope == f"blocks.{i}" or r.node.scope.startswith(f"blocks.{i}."))
                          for r in values.values())
            if recompute:
                # one (B, T, C) activation made before the block (by the embedding or block i-1):
                # its input, in its tiles; of the leaves, the block's own parameters
                assert outside and kept == activation, (i, kept, activation)
                made_by = f"blocks.{i - 1}" if i else {"gpt2-debug": "gpt2", "llama-debug": "embed"}[arch]
                assert {r.node.scope for r in values.values()} == {made_by}
                assert leaves <= params
                redo = [n for n in mine if n.scope.endswith(":recompute")]
                gates = [n for n in redo if n.op == "recompute"]
                assert len(gates) == len(values)  # one gate per input tile, then the block again
                # each gate waits for a tile of the block output's cotangent: the scheduler cannot
                # run the recompute during the forward pass (and hold its values until the backward)
                assert all(id(g.inputs[1].node) not in forward for g in gates)
                assert len(redo) > len(gates)
            else:
                # the activations inside the block (norms, q/k/v, attention, MLP hidden ...):
                # measured 17.25x the block input on gpt2-debug, 19.1x on llama-debug (these ids)
                assert not outside and kept >= 8 * activation, (i, kept / activation)


def test_recompute_adds_the_forward_only_and_keeps_frozen_weights_without_gradients():
    """LoRA on gpt2-debug: the backward with recompute is the backward without it plus the
    recomputed forward kernels; no gradient of a frozen base weight appears."""
    counts = {}
    for recompute in (False, True):
        model = peft.apply_lora(models.build("gpt2-debug", TILINGS["even"]("gpt2-debug"), seed=0), ["c_attn"],
                                rank=4, alpha=8)
        model.recompute = recompute
        ids = _ids(model.config.vocab_size)
        loss = _lm_loss(model, ids[:, :-1], model.tiling.tile_ids(ids[:, 1:]))
        grads = tg.grad(loss, peft.trainable_parameters(model))
        forward = {id(n) for n in topo_order(list(loss.grid.flat))}
        nodes = [n for n in topo_order([r for g in grads for r in g.grid.flat]) if id(n) not in forward]
        counts[recompute] = (sum(1 for n in nodes if not n.scope.endswith(":recompute")),
                             sum(1 for n in nodes if n.scope.endswith(":recompute")))
    assert counts[True][0] == counts[False][0] and counts[False][1] == 0 < counts[True][1], counts


@pytest.mark.parametrize("arch", ARCHS)
def test_training_with_recompute_gives_the_same_losses(arch):
    losses = {}
    for recompute in (False, True):
        cls = models.GPT2 if arch.startswith("gpt2") else models.Llama
        model = cls(models.config(arch), TILINGS["even"](arch), seed=0, recompute=recompute)
        ids = _ids(model.config.vocab_size, (2, 9), seed=2)
        step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-2), _lm_loss, batch_tiles=[(1, 4)] * 2)
        losses[recompute] = [step(ids[:, :-1], ids[:, 1:]) for _ in range(3)]
        # two steps in one graph: the second step's parameters are the first one's update
        losses[recompute] += [p.result() for p in step.submit_steps([(ids[:, :-1], ids[:, 1:])] * 2)]
    assert losses[False][-1] < losses[False][0]
    np.testing.assert_allclose(losses[True], losses[False], rtol=1e-6)  # float32


def test_checkpoint_of_a_function_with_closure_and_plain_arguments():
    rng = np.random.default_rng(0)
    x = tg.from_numpy(rng.standard_normal((5, 6)), (2, 4))
    w = tg.from_numpy(rng.standard_normal((6, 6)), (4, 4))
    scale = tg.from_numpy(rng.standard_normal((6, 6)), (4, 4)) * 0.5  # computed outside: read as it is

    def fn(h, k):
        return tg.gelu(h @ (w + scale)) * k + h

    y = tg.checkpoint(fn, x, 3.0)
    assert tg.checkpoint(lambda h: h, x) is x  # nothing recorded inside: nothing to recompute
    plain = fn(x, 3.0)
    want = tg.compute(*tg.grad((plain * plain).sum(), [x, w]))
    got = tg.compute(*tg.grad((y * y).sum(), [x, w]))
    for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, rtol=1e-12)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.checkpoint\] fn must return one TileTensor"):
        tg.checkpoint(lambda h: (h, h), x)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.checkpoint\] fn must be callable"):
        tg.checkpoint(x, x)


def test_decoding_with_a_cache_does_not_recompute():
    model = models.build("gpt2-debug", seed=0)
    ids = _ids(model.config.vocab_size, (2, 5))
    want = models.generate(model, ids, 3)
    model.recompute = True
    np.testing.assert_array_equal(models.generate(model, ids, 3), want)


def test_build_takes_recompute():
    from tilegraph import models

    assert models.build("gpt2-debug", recompute=True).recompute is True
    assert models.build("llama-debug").recompute is False


def test_a_checkpointed_block_inside_no_grad_runs_as_it_is():
    # inference (tg.no_grad: evaluation, generation) of a model with recompute on: no history to
    # keep, and nothing to recompute (it failed on the history it expected)
    block = tg.nn.MLP(4, 8, seed=0, dtype=np.float64)
    x = tg.from_numpy(np.ones((2, 4)))
    with tg.no_grad():
        y = tg.checkpoint(block, x)
    np.testing.assert_array_equal(y.numpy(), block(x).numpy())


def test_checkpoint_takes_torchs_use_reentrant_keyword():
    block = tg.nn.MLP(4, 8, seed=0, dtype=np.float64)
    x = tg.from_numpy(np.ones((2, 4)))
    (gx,) = tg.grad(tg.checkpoint(block, x, use_reentrant=False).sum(), [x])  # torch code as written for it
    np.testing.assert_allclose(gx.numpy(), tg.grad(block(x).sum(), [x])[0].numpy())
    with pytest.raises(tg.TileError, match=r"use_reentrant=False .*received: use_reentrant=True"):
        tg.checkpoint(block, x, use_reentrant=True)
