"""Training end to end: an MLP learns a synthetic task locally and on the embedded cluster."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import mse


def _data(seed=0, n=256):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    w = rng.standard_normal((16, 4)).astype(np.float32) / 4
    return x, np.tanh(x @ w)


def _train(steps, runtime=None, seed=0, **compile_options):
    x, y = _data()
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=seed)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-2, 10, steps), weight_decay=0.0,
                         clip_grad_norm=1.0)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(64, 8), (64, None)], runtime=runtime, **compile_options)
    losses = [step(x, y) for _ in range(steps)]
    return losses, model, step


def test_mlp_reaches_low_loss_locally():
    losses, _, step = _train(150)
    assert losses[-1] < 0.1 * losses[0]
    assert losses[-1] < 0.01
    assert step.last.record_seconds == 0.0  # replayed, not recorded again


def test_nan_loss_stops_with_the_step():
    model = tg.nn.Linear(2, 1, seed=0)
    opt = tg.optim.SGD(model.parameters(), lr=1.0)
    step = tg.TrainStep(model, opt, lambda m, x: (m(x) * m(x)).sum())
    x = np.array([[np.nan, 1.0]], np.float32)
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 1"):
        step(x)


@pytest.mark.distributed
def test_mlp_trains_on_the_embedded_cluster(embedded_runtime):
    losses, model, step = _train(60, runtime=embedded_runtime)
    local, local_model, _ = _train(60)
    assert losses[-1] < 0.2 * losses[0]
    # the same graph on 2 worker processes gives the same numbers as the local scheduler
    np.testing.assert_allclose(losses, local, rtol=1e-5)
    # parameters stayed on the workers: the cells hold references to remote results
    from tilegraph._graph import ValueRef

    assert all(isinstance(c.value, ValueRef) for p in model.parameters() for c in p.cells.flat)
    with embedded_runtime.as_current():
        state = model.state_dict()
    for k, v in local_model.state_dict().items():
        np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
def test_one_and_two_workers_agree(threads, monkeypatch):
    # kernels this small would run one after another inside a task; here they use the threads
    monkeypatch.setattr(tg.config, "thread_handoff_seconds", 0.0)
    monkeypatch.setattr(tg.config, "kernel_gil_seconds", 0.0)
    monkeypatch.setattr(tg.config, "min_process_seconds", 1e-4)  # and a few ms of work spread over 2 workers
    results = []
    for n in (1, 2):
        with tg.connect(n_workers=n, threads_per_worker=threads, dashboard=False, quiet=True) as rt:
            # small tasks, so that two workers really share the step; the tiles plan ("auto" takes
            # data parallelism where a tiles plan would span both processes)
            losses, _, step = _train(12, runtime=rt, target_seconds=5e-5, parallel="tiles")
            exe = step.plan(*_data())
            assert step.last.tasks > 4 and {c.proc for c in exe.clusters} == set(range(n))
            assert max(p.prog.threads for p in exe.plans) == threads
            results.append(losses)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6)
    np.testing.assert_allclose(results[0], _train(12)[0], rtol=1e-6)  # and the local scheduler


def _accum_run(k, runtime=None, steps=3):
    x, y = _data(n=64)
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=1)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=0.5)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(8, 8), (8, None)], accum_steps=k, runtime=runtime)
    losses = [step(x[16 * i:16 * i + 32], y[16 * i:16 * i + 32]) for i in range(steps)]
    with (runtime.as_current() if runtime else __import__("contextlib").nullcontext()):
        return losses, model.state_dict(), step


@pytest.mark.parametrize("k", [2, 4])
def test_gradient_accumulation_matches_one_big_batch(k):
    want, want_state, _ = _accum_run(1)
    got, state, step = _accum_run(k)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, v in want_state.items():
        np.testing.assert_allclose(state[name], v, rtol=2e-5, atol=1e-6, err_msg=name)
    assert step.optimizer.step_count == 3  # one update per call, not per micro-batch
    # rows that do not divide by k run as micro-batches of unequal rows (tests/test_e2e47_accum.py)
    assert np.isfinite(step(np.ones((33, 16), np.float32), np.ones((33, 4), np.float32)))
    assert step.optimizer.step_count == 4


@pytest.mark.distributed
def test_gradient_accumulation_on_the_embedded_cluster(embedded_runtime):
    want, want_state, _ = _accum_run(1)
    got, state, _ = _accum_run(2, runtime=embedded_runtime)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, v in want_state.items():
        np.testing.assert_allclose(state[name], v, rtol=2e-5, atol=1e-6, err_msg=name)


def _worker_bytes(dask_worker):
    def size(v):
        if isinstance(v, tuple):
            return sum(size(x) for x in v)
        return getattr(v, "nbytes", 0)
    return sum(size(v) for v in dask_worker.data.values())


@tg._graph.kernel("test_big_and_small")
def _big_and_small(x):
    return x * 2.0, x[:1, :1].copy()


@pytest.mark.distributed
def test_values_kept_on_workers_do_not_hold_their_task_result(embedded_runtime):
    # one task makes a 2 MB value that another task reads and a 8-byte value that stays on the
    # workers (as a parameter does): after the run only the small one may remain
    import time

    from distributed import wait

    from tilegraph._graph import emit, emit1
    from tilegraph._lower import Executable
    from tilegraph.ops.reduce import _reduce_sum

    x = tg.from_numpy(np.ones((512, 512)))
    big, small = emit(_big_and_small, [x.grid[0, 0]], [((512, 512), np.float64), ((1, 1), np.float64)], op="two")
    total = emit1(_reduce_sum, [big], (1, 1), np.float64, op="sum", axes=(0, 1), shape=(1, 1), scale=1.0)
    exe = Executable([small, total], runtime=embedded_runtime, target_seconds=1e-9)
    assert exe.n_tasks == 2
    kept, got = exe.run(fetch=[1])
    assert np.asarray(got).item() == 2.0 * 512 * 512
    wait([kept.future])
    deadline = time.monotonic() + 20  # Dask drops what nobody wants a moment after the tasks finished
    while True:
        held = sum(embedded_runtime.client.run(_worker_bytes).values())
        if held < 1000 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert held < 1000, held
    value = embedded_runtime.client.gather(kept.future)
    assert np.asarray(value if kept.index is None else value[kept.index]).item() == 1.0


def _grouped_run(groups, runtime=None):
    """AdamW with a warmup schedule and clipping, stepped by groups of batches (1: TrainStep())."""
    x, y = _data(n=96)
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=3)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(2e-2, 3, 8), clip_grad_norm=0.5)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(8, 8), (8, None)], runtime=runtime)
    batches = [(x[8 * i:8 * i + 16], y[8 * i:8 * i + 16]) for i in range(sum(groups))]
    pending, k = [], 0
    for g in groups:
        pending += step.submit_steps(batches[k:k + g]) if g > 1 else [step.submit(*batches[k])]
        k += g
    losses = [p.result() for p in pending]
    norms = [p.stats.grad_norm for p in pending]
    with (runtime.as_current() if runtime else __import__("contextlib").nullcontext()):
        state = {**model.state_dict(), **{f"{p.name}.{k}": tg.compute(t)[0] for p, st in
                                          zip(opt.params, opt.state_tensors()) for k, t in st.items()}}
    return losses, norms, state, opt, step


@pytest.mark.parametrize("groups", [[3, 2, 1], [6]])
def test_steps_in_one_graph_equal_steps_one_at_a_time(groups):
    want_losses, want_norms, want, _, one = _grouped_run([1] * 6)
    losses, norms, got, opt, step = _grouped_run(groups)
    assert losses == want_losses and norms == want_norms  # bitwise: the same kernels in the same order
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    assert opt.step_count == 6
    assert step.last.nodes == groups[-1] * one.last.nodes  # the last group's graph holds all its steps


@pytest.mark.distributed
def test_steps_in_one_graph_on_the_embedded_cluster(embedded_runtime):
    want_losses, want_norms, want, _, _ = _grouped_run([1] * 6)
    losses, norms, got, _, step = _grouped_run([4, 2], runtime=embedded_runtime)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-6)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    assert step.last.tasks <= 2  # two steps of tiny kernels: one task (or two), not one per step


def test_submit_steps_rejects_mixed_batches_and_accumulation():
    x, y = _data(n=32)
    model = tg.nn.MLP(16, 8, out_dim=4, tile=8, seed=0)
    step = tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.1), mse)
    with pytest.raises(tg.TileError, match=r"batches with one signature.*received: batch 1: "):
        step.submit_steps([(x[:8], y[:8]), (x[:16], y[:16])])
    with pytest.raises(tg.TileError, match=r"at least one batch; received: an empty list"):
        step.submit_steps([])
    acc = tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.1), mse, accum_steps=2,
                       batch_tiles=[(8, 8), (8, None)])
    with pytest.raises(tg.TileError, match=r"accum_steps=1 .*received: accum_steps=2"):
        acc.submit_steps([(x[:8], y[:8])] * 2)
    assert acc.auto_steps_per_graph(x[:8], y[:8]) == 1


def test_auto_steps_per_graph_groups_only_short_steps(monkeypatch):
    x, y = _data(n=32)
    model = tg.nn.MLP(16, 8, out_dim=4, tile=8, seed=0)
    step = tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.1), mse, batch_tiles=[(8, 8), (8, None)])
    est = step.plan(x, y).est_seconds()
    assert 0 < est < tg.config.graph_seconds / 4  # a few dozen tiny kernels
    k = step.auto_steps_per_graph(x, y)
    assert k == min(tg.config.max_steps_per_graph, int(tg.config.graph_seconds / est)) and k > 1
    monkeypatch.setattr(tg.config, "graph_seconds", est / 2)  # steps longer than a graph's worth: one each
    assert step.auto_steps_per_graph(x, y) == 1


def test_eval_step_evaluates_several_batches_per_graph():
    x, y = _data(n=64)
    model = tg.nn.MLP(16, 8, out_dim=4, tile=8, seed=0)
    ev = tg.EvalStep(model, mse, batch_tiles=[(8, 8), (8, None)])
    batches = [(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]) for i in range(8)]
    want = [float(np.mean((tg.compute(model(tg.from_numpy(b[0], (8, 8))))[0] - b[1]) ** 2)) for b in batches]
    got = ev.losses(batches)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert [ev(*b) for b in batches] == got  # one at a time: the same numbers
    assert max(n for n, _ in ev._cache) == 8  # one graph held all eight batches
    with pytest.raises(tg.TileError, match=r"batches with one signature.*received: batch 1: "):
        ev.losses([batches[0], (x[:16], y[:16])])
