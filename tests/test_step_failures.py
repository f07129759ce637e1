"""A training step that fails on the workers changes nothing; a step recorded before the model
changed in place (LoRA applied or merged) or over frozen weights says so instead of training the
graph of before."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph.trainer import lm_loss


@pytest.fixture(scope="module")
def own_cluster():
    """A cluster of this file's own: a failed step's error, which Dask keeps (its FutureState)
    with the client's frames that raised it, holds that step's values on the workers until the
    cluster closes (a leak left open, older than these tests); the shared cluster's tests that
    count what the workers hold would see them."""
    from conftest import _two_workers

    yield from _two_workers()


@pytest.fixture(autouse=True)
def _collect():
    """After each test, collect the cycles its raised errors made (a traceback holds the frames
    that hold the model, whose parameters would stay on the shared cluster's workers)."""
    yield
    import gc

    gc.collect()


def _batch(vocab: int, seed: int = 0):
    ids = np.random.default_rng(seed).integers(0, vocab, (4, 16))
    return ids, np.roll(ids, -1, 1)


def _step(model, runtime=None, **options):
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.TrainStep(model, opt, lm_loss, runtime=runtime, batch_tiles=[(2, None)] * 2, **options), opt


def _reference_and_fresh(runtime, steps: int, **options):
    """An uninterrupted run's ``steps`` losses, then a fresh model's step, its optimizer and its
    first step's loss (the runs the tests below compare)."""
    x, y = _batch(96)
    step, _ = _step(models.build("gpt2-debug", seed=0), runtime, **options)
    want = [step(x, y) for _ in range(steps)]
    step, opt = _step(models.build("gpt2-debug", seed=0), runtime, **options)
    return want, step, opt, [step(x, y)]


@pytest.mark.distributed
@pytest.mark.parametrize("exchange", ["auto", "tasks"])
@pytest.mark.parametrize("bad", ["targets", "ids"])
def test_a_step_that_fails_on_the_workers_changes_nothing(own_cluster, monkeypatch, exchange, bad):
    """A token id or target out of range fails the step in a worker's kernel. The step then
    changed nothing: the next steps give the losses of a run without it, the optimizer counts
    no step for it, the model's forward is what it was, and the error says so (before, every
    parameter pointed at the failed update: every later step, forward and save failed with that
    first error)."""
    monkeypatch.setattr(tg.config, "exchange", exchange)
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, own_cluster, parallel="sharded")
    want = [step(x, y) for _ in range(3)]

    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, own_cluster, parallel="sharded")
    got = [step(x, y)]
    with own_cluster.as_current():
        before = tg.compute(model(x[:1]))[0]
    bad_batch = (x, y + 96) if bad == "targets" else (x + 96, y)
    with pytest.raises(tg.TileError, match="must lie in") as e:
        step(*bad_batch)
    assert any("the failed step changed nothing" in n and "after step 1" in n for n in e.value.__notes__)
    assert opt.step_count == 1
    with own_cluster.as_current():
        np.testing.assert_array_equal(tg.compute(model(x[:1]))[0], before)
    got += [step(x, y) for _ in range(2)]
    assert got == want and opt.step_count == 3


@pytest.mark.distributed
@pytest.mark.parametrize("shm", [True, False])
@pytest.mark.parametrize("row", [0, 3])
@pytest.mark.parametrize("timeout", [None, 60.0])
def test_a_bad_row_in_either_process_s_share_raises_the_kernel_s_error(own_cluster, monkeypatch, shm, row, timeout):
    """A gang step (each worker process runs its share of the batch in one task) with one bad
    row: the step raises the kernel's own TileError whichever process's share holds it. Before,
    a bad row in the second process's share raised ``PeerFailedError`` out of the first's (the
    loss the client waits for comes from there), and ``except tg.TileError`` missed it. Over
    shared memory and over the workers' comms (between hosts), with and without a time limit."""
    monkeypatch.setattr(tg.config, "shm_transfers", shm)
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, own_cluster, parallel="sharded")
    step(x, y)
    assert step.plan(x, y).gang is not None  # one gang task per process
    bad = x.copy()
    bad[row, 5] = 96 + row
    with pytest.raises(tg.TileError, match=rf"ids must lie in \[0, 96\); received: {96 + row}") as e:
        step.submit(bad, y).result(timeout=timeout)
    assert any("the failed step changed nothing" in n for n in e.value.__notes__)
    assert opt.step_count == 1


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["data", "sharded"])
def test_the_step_after_a_failed_one_runs_at_once(own_cluster, monkeypatch, parallel):
    """Bad and good batches in turn, each step submitted as soon as the one before raised: the
    failed step's gang on the other worker may still be ending then. The next step's gang waited
    for it, failed with its error without running, and left its peer waiting for its values until
    the exchange time limit (600 s; here 20): a WorkerLostError though no worker was lost, and
    every later step failed (3 runs in 4 with "data" before the fix)."""
    monkeypatch.setattr(tg.config, "exchange_timeout_seconds", 20.0)
    x, y = _batch(96)
    want, step, opt, got = _reference_and_fresh(own_cluster, 4, parallel=parallel)
    for _ in range(3):
        with pytest.raises(tg.TileError, match="targets must lie in"):
            step(x, y + 96)
        got.append(step.submit(x, y).result(timeout=15.0))
    assert got == want and opt.step_count == 4


def _fail_the_next_update(dask_worker=None):
    """On this worker, the next call of AdamW's kernel raises (then it is AdamW again)."""
    from tilegraph._graph import get_kernel

    kern = get_kernel("adamw")
    kept = kern.cpu

    def failing(*args, **kwargs):
        kern.cpu = kept
        raise MemoryError("injected: the update failed on this worker")

    kern.cpu = failing


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["data", "sharded"])
@pytest.mark.parametrize("timeout", [None, 60.0])
def test_a_step_that_failed_on_one_process_after_its_exchange_fails(own_cluster, monkeypatch, parallel, timeout):
    """One process's task fails after its last exchange (its update): the other's finished, and
    the loss the client waits for came from it. Before, that step returned its loss as if it had
    trained (the two replicas' states then differed, one of them failed values), and the steps
    submitted after it waited for the exchange time limit and raised a WorkerLostError, no worker
    lost: the model was gone. Now the step raises the failing process's error and changes nothing;
    the steps submitted after it raise at once (their tasks on the failed process fail without
    running, and their peers, which would wait for them, are cancelled), and the next step trains."""
    monkeypatch.setattr(tg.config, "exchange_timeout_seconds", 30.0)
    x, y = _batch(96)
    want, step, opt, got = _reference_and_fresh(own_cluster, 3, parallel=parallel)
    assert step.plan(x, y).gang is not None
    second = sorted(own_cluster.client.scheduler_info()["workers"])[1]
    own_cluster.client.run(_fail_the_next_update, workers=[second])
    pending = [step.submit(x, y) for _ in range(3)]
    time.sleep(1.0)  # the loss is computed by then: what the step replaced must be kept all the same
    for i, p in enumerate(pending):
        with pytest.raises(MemoryError, match="injected: the update failed on this worker") as e:
            p.result(timeout=timeout)
        note = "the failed step changed nothing" if i == 0 else "submitted before an earlier one failed"
        assert any(note in n and "after step 1" in n for n in e.value.__notes__), e.value.__notes__
    assert opt.step_count == 1
    got += [step(x, y) for _ in range(2)]
    assert got == want and opt.step_count == 3


@pytest.mark.distributed
def test_results_waited_for_out_of_order_put_back_the_earliest_failed_step(own_cluster):
    """Step 2 fails (a target out of range) and step 3, submitted before it failed, reads its
    values; step 3's result is waited for first. Before, its rollback put back what step 2 had
    made (its failed values): step 2's own rollback then did nothing, and every later step failed.
    Now both are undone, and each error says what the model is."""
    x, y = _batch(96)
    want, step, opt, got = _reference_and_fresh(own_cluster, 3)
    second, third = step.submit(x, y + 96), step.submit(x, y)
    with pytest.raises(tg.TileError, match="targets must lie in") as e:
        third.result()
    assert e.value.__notes__[-1] == ("[tilegraph.TrainStep] step 2 failed, and this step read its values: neither "
                                     "changed anything: the model's parameters and optimizer state are those after "
                                     "step 1")
    with pytest.raises(tg.TileError, match="targets must lie in") as e:
        second.result()
    assert e.value.__notes__[-1] == ("[tilegraph.TrainStep] the failed step changed nothing: the model's parameters "
                                     "and optimizer state are those after step 1")
    assert opt.step_count == 1
    got += [step(x, y) for _ in range(2)]
    assert got == want and opt.step_count == 3


@pytest.mark.distributed
def test_a_failed_group_of_steps_changes_nothing(own_cluster):
    """Several steps submitted as one graph (submit_steps, as the Trainer does for small models):
    one bad batch among them, and none of them counts; the steps again give a run's losses."""
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    step, _ = _step(model, own_cluster)
    want = [p.result() for p in step.submit_steps([(x, y)] * 3)]

    model = models.build("gpt2-debug", seed=0)
    step, opt = _step(model, own_cluster)
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
    with pytest.raises(tg.TileError, match=r"an optimizer parameter that requires a gradient.*"
                                           r"\(wte.weight\) has requires_grad=False, and so have the"):
        step(x, y)


def test_an_optimizer_parameter_frozen_since_is_skipped():
    """A TrainStep whose optimizer holds a frozen parameter (requires_grad=False) updated it all
    the same, and then refused it; now it is skipped as torch's optimizers skip it (no update,
    its state and update count kept) while the others train (tests/test_e2e37_loop.py compares
    it with torch)."""
    x, y = _batch(96)
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    wte = model.wte.weight.numpy()
    model.wte.requires_grad_(False)
    tg.TrainStep(model, opt, lm_loss)(x, y)
    assert np.array_equal(model.wte.weight.numpy(), wte)
    assert opt.param_steps[opt.params.index(model.wte.weight)] == 0 and opt.step_count == 1


@pytest.mark.distributed
def test_a_step_s_result_after_its_runtime_closed_says_so():
    """Steps submitted, the runtime closed, then ``.result()``: a TileError naming the closed
    runtime, as every other use after close gives (it was Dask's bare "No clients found")."""
    x, y = _batch(96)
    rt = tg.connect(n_workers=1, threads_per_worker=1, quiet=True, dashboard=False, make_current=False)
    try:
        step, _ = _step(models.build("gpt2-debug", seed=0), rt)
        pending = [step.submit(x, y) for _ in range(2)]
    finally:
        rt.close()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.PendingStep.result\] an open runtime: this one was closed"):
        pending[-1].result()


@pytest.mark.distributed
def test_what_a_step_replaced_is_let_go_once_its_loss_is_computed(own_cluster):
    """A step keeps what its cells held before it (to put back if it fails) only until its loss
    is computed, not until its result is asked for: else the old parameters and optimizer state
    would stay on the workers beside the new ones to the step's end."""
    import time

    x, y = _batch(96)
    step, _ = _step(models.build("gpt2-debug", seed=0), own_cluster)
    pending = step.submit(x, y)
    futures = pending._undo.losses
    deadline = time.monotonic() + 60
    while (any(f.status == "pending" for f in futures) or pending._undo.before is not None) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pending._undo.before is None  # let go, and the result not asked for yet
    assert np.isfinite(pending.result())
