"""A training step that fails on the workers changes nothing; a step recorded before the model
changed in place (LoRA applied or merged) or over frozen weights says so instead of training the
graph of before."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph.trainer import lm_loss


def _batch(vocab: int, seed: int = 0):
    ids = np.random.default_rng(seed).integers(0, vocab, (4, 16))
    return ids, np.roll(ids, -1, 1)


def _step(model, runtime=None, **options):
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.TrainStep(model, opt, lm_loss, runtime=runtime, batch_tiles=[(2, None)] * 2, **options), opt


@pytest.mark.distributed
@pytest.mark.parametrize("exchange", ["auto", "tasks"])
@pytest.mark.parametrize("bad", ["targets", "ids"])
def test_a_step_that_fails_on_the_workers_changes_nothing(embedded_runtime, monkeypatch, exchange, bad):
    """A token id or target out of range fails the step in a worker's kernel. The step then
    changed nothing: the next steps give the losses of a run without it, the optimizer counts
    no step for it, the model's forward is what it was, and the error says so (before, every
    parameter pointed at the failed update: every later step, forward and save failed with that
    first error)."""
    monkeypatch.setattr(tg.config, "exchange", exchange)
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, embedded_runtime, parallel="sharded")
    want = [step(x, y) for _ in range(3)]

    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, embedded_runtime, parallel="sharded")
    got = [step(x, y)]
    with embedded_runtime.as_current():
        before = tg.compute(model(x[:1]))[0]
    bad_batch = (x, y + 96) if bad == "targets" else (x + 96, y)
    with pytest.raises(tg.TileError, match="must lie in") as e:
        step(*bad_batch)
    assert any("the failed step changed nothing" in n and "after step 1" in n for n in e.value.__notes__)
    assert opt.step_count == 1
    with embedded_runtime.as_current():
        np.testing.assert_array_equal(tg.compute(model(x[:1]))[0], before)
    got += [step(x, y) for _ in range(2)]
    assert got == want and opt.step_count == 3


@pytest.mark.distributed
def test_a_failed_group_of_steps_changes_nothing(embedded_runtime):
    """Several steps submitted as one graph (submit_steps, as the Trainer does for small models):
    one bad batch among them, and none of them counts; the steps again give a run's losses."""
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    step, _ = _step(model, embedded_runtime)
    want = [p.result() for p in step.submit_steps([(x, y)] * 3)]

    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, embedded_runtime)
    pending = step.submit_steps([(x, y), (x, y + 96), (x, y)])
    with pytest.raises(tg.TileError, match="targets must lie in"):
        for p in pending:
            p.result()
    assert opt.step_count == 0
    assert [p.result() for p in step.submit_steps([(x, y)] * 3)] == want


def test_a_step_made_before_the_model_changed_in_place_says_so():
    """peft.merge_lora and apply_lora change a model in place. A TrainStep made before went on
    training the graph of before: after merge_lora the detached adapters (the merged model never
    changed), after apply_lora the weights it froze. Now: a clear error each. An EvalStep
    evaluates the model as it is now."""
    x, y = _batch(96)
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), targets=["attn.q", "attn.v"], rank=4, alpha=8)
    opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-2)
    step = tg.TrainStep(model, opt, lm_loss)
    ev = tg.EvalStep(model, lm_loss)
    for _ in range(2):
        step(x, y)
    ev(x, y)
    peft.merge_lora(model)
    with pytest.raises(tg.TileError, match=r"the model changed since this step was made .*lora_u"):
        step(x, y)
    assert ev(x, y) == tg.EvalStep(model, lm_loss)(x, y)

    model = models.build("gpt2-debug", seed=0)
    step, _ = _step(model)
    step(x, y)
    peft.apply_lora(model, targets=["attn.q"], rank=4)
    with pytest.raises(tg.TileError, match=r"every optimizer parameter to require a gradient.*"
                                           r"\(wte.weight\) has requires_grad=False"):
        step(x, y)


def test_an_optimizer_over_frozen_weights_is_refused():
    """A TrainStep whose optimizer holds a frozen parameter (requires_grad=False) updated it all
    the same; now the step names it."""
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    model.wte.requires_grad_(False)
    with pytest.raises(tg.TileError, match=r"\(wte.weight\) has requires_grad=False"):
        tg.TrainStep(model, opt, lm_loss)(x, y)
