"""Workers leaving while a TrainStep is used on its own, and graphs that carry the model's weights
(an end-to-end audit). Each test is a defect found in that audit and fixed (see its docstring)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import tilegraph as tg
from conftest import counting_scatters, mse, regression_data, retire_as_values_are_sent
from tilegraph import _health


def _step(rt, parallel="data"):
    """The README's first MLP and AdamW as a TrainStep on ``rt``'s workers (None: this process)."""
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    if rt is None:
        return tg.TrainStep(model, opt, mse)
    return tg.TrainStep(model, opt, mse, runtime=rt, parallel=parallel)


def _reference(steps: int) -> list[float]:
    step, data = _step(None), regression_data(0, 64)
    return [step(*data(i)) for i in range(1, steps + 1)]


# -- a worker retired under a TrainStep used directly ---------------------------------------------

@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:parallel='(data|sharded)' shares")
@pytest.mark.parametrize("parallel", ["data", "sharded"])
def test_a_step_called_after_a_worker_retired_runs_on_the_workers_left(own_runtime, parallel, caplog):
    """``for x, y in batches: step(x, y)`` with ``client.retire_workers([one])`` mid-loop: Dask
    moved the worker's values to the worker left, yet the step failed ("lost worker ... (left the
    cluster) ...; what a lost worker held is gone"), and so did every later one (the step counted,
    its plan still on the worker gone). Now the step is undone, planned again for the worker left
    and run again: the losses of a run that never lost a worker."""
    rt, data = own_runtime, regression_data(0, 64)
    step = _step(rt, parallel)
    victim = sorted(rt.workers())[1]
    got = []
    with caplog.at_level(logging.WARNING, logger="tilegraph"):
        for i in range(1, 7):
            if i == 4:
                rt.client.retire_workers([victim])
            got.append(step(*data(i)))
    assert victim not in rt.workers() and step.optimizer.step_count == 6
    np.testing.assert_allclose(got, _reference(6), rtol=1e-5)
    said = [r.getMessage() for r in caplog.records if "the step runs again" in r.getMessage()]
    assert len(said) == 1 and victim in said[0] and "retired from the cluster" in said[0], said


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:parallel='data' shares")
def test_a_submitted_step_after_a_worker_retired_says_to_submit_it_again(own_runtime):
    """``step.submit(x, y).result()`` after a worker retired: the error now says the step changed
    nothing and to submit it again (its workers' values are on the worker left), and names the
    worker as retired; submitted again, it gives the uninterrupted run's loss."""
    rt, data = own_runtime, regression_data(0, 64)
    step = _step(rt)
    victim = sorted(rt.workers())[1]
    got = [step.submit(*data(i)).result() for i in (1, 2)]
    rt.client.retire_workers([victim])
    pending = step.submit(*data(3))
    with pytest.raises(tg.WorkerLostError, match="submit it again") as info:
        pending.result()
    text = str(info.value)
    assert victim in text and "retired from the cluster" in text and "those after step 2" in text, text
    assert pending.undone_on_workers_left == ([victim], "retired from the cluster")
    assert step.optimizer.step_count == 2
    got.append(step.submit(*data(3)).result())
    np.testing.assert_allclose(got, _reference(3), rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:parallel='data' shares")
def test_a_step_called_as_a_worker_retires_while_it_is_sent_runs_on_the_worker_left(own_runtime, monkeypatch):
    """A worker retired as ``step(x, y)`` sent the first step (an adaptive cluster scaling down
    an idle worker): Dask's bare ``CommClosedError: tilegraph: values to send to worker ...,
    which left the cluster``, and the same at every later call (the plan still named it). Now
    the step, not counted, is planned again for the worker left and sent again."""
    rt, data = own_runtime, regression_data(0, 64)
    victim = retire_as_values_are_sent(monkeypatch, rt)
    step = _step(rt)
    got = [step(*data(i)) for i in (1, 2, 3)]
    assert victim not in rt.workers() and step.optimizer.step_count == 3
    np.testing.assert_allclose(got, _reference(3), rtol=1e-5)


def test_a_retired_worker_is_named_so_in_a_lost_worker_error():
    """A worker removed by ``retire_workers`` (an expected removal, or named by a retire-workers
    event) was reported as having "left the cluster", as one that died."""
    events = [(1.0, {"action": "remove-worker", "worker": "tcp://a:1", "expected": True}),
              (2.0, {"action": "remove-worker", "worker": "tcp://b:1", "expected": False}),
              (3.0, {"action": "retire-workers", "retired": ["tcp://c:1"], "could-not-retire": []}),
              (4.0, "a plain message")]
    assert _health.retired_in(events) == {"tcp://a:1", "tcp://c:1"}
    health = _health.WorkerHealth(lost=["tcp://a:1", "tcp://b:1"], retired={"tcp://a:1"})
    text = str(_health.lost_worker_error(health, "step 4", None))
    assert "tcp://a:1 (retired from the cluster: retire_workers, by a user or a cluster scaling down)" in text
    assert "tcp://b:1 (left the cluster" in text


# -- the weights held here inside every tg.compute graph -------------------------------------------

@pytest.mark.distributed
def test_repeated_compute_of_a_forward_sends_the_parameters_once(embedded_runtime, monkeypatch):
    """``tg.compute(model(x))`` on a cluster, again and again (a notebook's cell): the parameters
    held here went inside every graph (GPT-2 124M: 475 MB and Dask's "Sending large graph"
    warning at every call). Now those larger than a task carries are lent to the workers once
    (as generate and EvalStep do), and sent again only once changed; the user's input still
    travels with the graph, and the values are this process's."""
    import warnings

    rt = embedded_runtime
    model = tg.nn.Linear(1024, 3072, tile=512, out_tile=1024, seed=0)   # a 12 MiB weight in 6 tiles
    x = np.random.default_rng(0).standard_normal((4, 1024)).astype(np.float32)
    want = tg.compute(model(tg.from_numpy(x)))[0]   # (in this process)
    sent = counting_scatters(monkeypatch, rt)
    with rt.as_current():
        for i in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = tg.compute(model(tg.from_numpy(x)))[0]
            np.testing.assert_array_equal(got, want)
            assert not [w for w in caught if "large graph" in str(w.message)], [str(w.message) for w in caught]
        assert sent == [6, 0, 0], sent   # (the bias, 4 KiB a tile, travels inside the task)
        assert all(isinstance(c.value, np.ndarray) for p in model.parameters() for c in p.cells.flat)
        new = np.random.default_rng(1).standard_normal((1024, 3072)).astype(np.float32)
        model.weight.assign(new)   # changed here: sent again, and computed with
        got = tg.compute(model(tg.from_numpy(x)))[0]
    np.testing.assert_array_equal(got, tg.compute(model(tg.from_numpy(x)))[0])
    np.testing.assert_allclose(got, x @ new + model.bias.numpy(), rtol=1e-4, atol=1e-4)
    assert sent[3:] == [6], sent
