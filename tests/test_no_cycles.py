"""A model, its recorded graphs and the values they hold on the workers are freed when the user lets
go of them, by reference counting alone. Ops whose backward saves their own output (attention,
cross entropy, ...) made output -> its record -> ctx -> output a reference cycle, so every
recorded step lived until Python's cyclic collector ran, and with it the parameters it read: a
deleted model's values stayed on the workers (GPT-2 6 x 768 sharded over 2 workers: 626 MiB each)
and a notebook cell run again held two models."""

import gc
import time
import weakref

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph.sketch import apply_grad_sketch


@pytest.fixture
def no_collector():
    """Python's cyclic collector off for the test (what it would free is what the test looks for)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _adapted(model, kind):
    if kind == "recompute":
        model.recompute = True
    elif kind == "lora":
        peft.apply_lora(model, ["attn.q", "attn.v", "*.mlp.*"], rank=2, dropout=0.1)
    elif kind == "lotr":
        peft.apply_lotr(model, ["attn.q", "attn.v"], rank=2)
    elif kind in ("dct", "wta-crs"):
        apply_grad_sketch(model, ["*.mlp.*"], kind=kind, ratio=0.5)
    return model


@pytest.mark.parametrize("kind", ["plain", "recompute", "lora", "lotr", "dct", "wta-crs", "label_smoothing"])
@pytest.mark.parametrize("arch", ["gpt2-debug", "llama-debug"])
def test_a_recorded_loss_and_its_gradients_are_freed_without_the_cyclic_collector(arch, kind, no_collector):
    model = _adapted(models.build(arch, models.ModelTiling(feature=16, batch=1, seq=4), seed=1, dtype=np.float32), kind)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
    params = [p for p in model.parameters() if p.requires_grad]
    loss = tg.cross_entropy(model(ids[:, :-1]), model.tiling.tile_ids(ids[:, 1:]),
                            label_smoothing=0.1 if kind == "label_smoothing" else 0.0)
    grads = tg.grad(loss, params)
    refs = [weakref.ref(x) for x in (model, params[0], loss, grads[-1])]
    del model, params, loss, grads
    alive = [name for name, r in zip(("model", "a parameter", "the loss", "a gradient"), refs) if r() is not None]
    assert not alive, f"{alive} held by reference cycles"


def _held(dask_worker=None) -> list[str]:
    return sorted(str(k) for k in dask_worker.state.data if not str(k).startswith("tg-program-"))


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["tiles", "sharded", "zero3"])
def test_a_deleted_model_s_values_leave_the_workers(parallel, own_runtime, no_collector):
    rt = own_runtime
    model = models.build("gpt2-debug", models.ModelTiling(), seed=1, dtype=np.float32)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y), runtime=rt, parallel=parallel,
                        batch_tiles=[(2, None), (2, None)])
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 9))
    for _ in range(3):
        step(ids[:, :-1], ids[:, 1:])
    assert any(rt.client.run(_held).values()), "the step's state is on the workers"
    del step, opt, model
    deadline = time.time() + 10  # (the client tells the scheduler to release them; it takes a moment)
    while any((held := rt.client.run(_held)).values()):
        assert time.time() < deadline, f"still on the workers after the model was deleted: {held}"
        time.sleep(0.05)


def _held_bytes(dask_worker=None) -> int:
    return sum(dask_worker.state.tasks[k].nbytes for k in dask_worker.state.data
               if not str(k).startswith("tg-program-"))


def _at_rest(rt) -> int:
    """The bytes of values the workers hold once the client has let go of what it is done with."""
    time.sleep(0.5)
    return sum(rt.client.run(_held_bytes).values())


@pytest.mark.distributed
@pytest.mark.parametrize("limit", [None, 0.001])
def test_waits_that_time_out_keep_no_earlier_step_s_state(limit, own_runtime, no_collector, monkeypatch):
    """A wait for a step looks at the workers every WATCH_SECONDS (2 s) or its time limit. Each
    look was a TimeoutError from Dask's wait, held in a reference cycle with the frames it passed
    through, and they with the step's values: every step of over 2 s left a whole state on the
    workers until a cyclic collection (GPT-2 6x768 data-parallel: 2-5 states of 937 MiB per
    worker). Here every wait looks hundreds of times; the workers hold one state after 6 steps,
    as after 1 (and a loss or two)."""
    from tilegraph import _lower

    monkeypatch.setattr(_lower, "WATCH_SECONDS", 0.001)
    rt = own_runtime
    model = models.build("gpt2-debug", models.ModelTiling(), seed=1, dtype=np.float32)
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-3), lambda m, x, y: tg.cross_entropy(m(x), y),
                        runtime=rt, parallel="data")
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 9))
    batch = (ids[:, :-1], ids[:, 1:])
    step.submit_steps([batch])[-1].result(limit, patient=True)
    one = _at_rest(rt)
    for _ in range(6):
        step.submit_steps([batch])[-1].result(limit, patient=True)
    after = _at_rest(rt)
    assert after < 1.5 * one, f"{after / one:.1f} states held after 6 steps"  # (one: 0.7 MB; + a few losses)


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["tiles", "sharded"])
def test_a_failed_step_s_error_keeps_none_of_its_futures(parallel, own_runtime):
    """A step's task error is kept by its Dask future; raised itself, it kept the frames it passed
    through (the failed step's, holding that future and the step's others), so every failed
    step's futures stayed until the client closed (10 failures held 10 futures more, 23 sharded). The error raised
    is a copy, with the worker's traceback and tilegraph's note; raised twice, each has its own
    note (the note was added to the one error again each time)."""
    rt = own_runtime
    model = models.build("gpt2-debug", models.ModelTiling(), seed=1, dtype=np.float32)
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-3), lambda m, x, y: tg.cross_entropy(m(x), y),
                        runtime=rt, parallel=parallel)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 9))
    bad = ids.copy()
    bad[0, 0] = 10 ** 6  # a token id out of range: the embedding's kernel fails
    step(ids[:, :-1], ids[:, 1:])
    gc.collect()
    before = len(rt.client.futures)
    for _ in range(5):
        with pytest.raises(tg.TileError, match=r"ids must lie in \[0, 96\)") as info:
            step(bad[:, :-1], bad[:, 1:])
        assert info.value.__traceback__ is not None
        step(ids[:, :-1], ids[:, 1:])
    del info
    gc.collect()
    deadline = time.time() + 10  # (the client lets go of a future on its event loop: a moment later)
    while len(rt.client.futures) > before and time.time() < deadline:
        time.sleep(0.05)
    assert len(rt.client.futures) <= before, [f"{k}: {v.status}" for k, v in rt.client.futures.items()]
    pending = step.submit_steps([(bad[:, :-1], bad[:, 1:])])[-1]
    notes = []
    for _ in range(2):
        with pytest.raises(tg.TileError) as info:
            pending.result()
        notes.append([n for n in getattr(info.value, "__notes__", []) if n.startswith("[tilegraph.TrainStep]")])
    assert [len(n) for n in notes] == [1, 1], notes


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["EvalStep", "compute"])
def test_failed_evaluations_and_computes_keep_none_of_their_futures(how, own_runtime):
    """The same for tg.compute and EvalStep, whose values come back through tilegraph's gather: the
    error raised is a copy (the worker's traceback kept), and the failed graphs' futures go."""
    rt = own_runtime
    model = models.build("gpt2-debug", models.ModelTiling(), seed=1, dtype=np.float32)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 9))
    bad = ids.copy()
    bad[0, 0] = 10 ** 6
    evaluate = tg.EvalStep(model, lambda m, x, y: tg.cross_entropy(m(x), y), runtime=rt)

    def run(batch):
        if how == "EvalStep":
            return evaluate(batch[:, :-1], batch[:, 1:])
        return tg.compute(model(batch[:, :4]), runtime=rt)

    run(ids)
    gc.collect()
    before = len(rt.client.futures)
    for _ in range(5):
        with pytest.raises(tg.TileError, match=r"ids must lie in \[0, 96\)") as info:
            run(bad)
        assert any("in tile kernel 'embedding'" in n for n in info.value.__notes__)  # (the worker's note, copied)
        assert info.value.__traceback__ is not None
        run(ids)
    del info
    gc.collect()
    deadline = time.time() + 10
    while len(rt.client.futures) > before and time.time() < deadline:
        time.sleep(0.05)
    assert len(rt.client.futures) <= before, [f"{k}: {v.status}" for k, v in rt.client.futures.items()]
