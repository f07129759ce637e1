"""A batch of one row under a strategy that shares the batch's rows among worker processes
("data", "sharded", "zero3"): the last batch of an epoch, or a micro-batch of an uneven
accumulation (5 rows, accum_steps=4: 2, 1, 1, 1). Before, the step was refused ("the batch needs
at least 2 row tiles"), stopping a run at the end of its first epoch, or in the middle of an
accumulated step after its first micro-batch; now it runs as parallel='tiles' with a warning,
and trains as one process does."""

import warnings

import numpy as np
import pytest

import tilegraph as tg


def _step(runtime=None, **options):
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0, dtype="float64")
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    return model, tg.TrainStep(model, opt, _loss, runtime=runtime, **options)


def _loss(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _batch(rng, rows):
    x = rng.standard_normal((rows, 16))
    return x, np.tanh(x[:, :4])


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
def test_a_batch_of_one_row_runs_in_one_process_and_trains_as_one_process(embedded_runtime, strategy):
    rng = np.random.default_rng(0)
    batches = [_batch(rng, n) for n in (6, 1, 6, 1)]
    local_model, local = _step()
    want = [local(*b) for b in batches]
    model, step = _step(embedded_runtime, parallel=strategy)
    got = []
    with pytest.warns(UserWarning, match=rf"parallel='{strategy}' shares a batch's rows among the 2 worker processes, "
                                         r"and this batch has 1 row: its step runs as parallel='tiles'") as caught:
        for b in batches:
            got.append(step(*b))
    assert len(caught) == 1 and caught[0].filename == __file__  # once (the plan is kept), at the user's line
    np.testing.assert_allclose(got, want, rtol=1e-10)
    assert step.plan(*batches[0]).n_replicas == 2 and step.plan(*batches[1]).n_replicas == 1
    with embedded_runtime.as_current():
        state = model.state_dict()
    for k, v in local_model.state_dict().items():
        np.testing.assert_allclose(state[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "zero3"])
def test_an_uneven_accumulation_with_one_row_micro_batches_trains_as_the_whole_batch(embedded_runtime, strategy):
    """5 rows, accum_steps=4: micro-batches of 2, 1, 1 and 1 rows; the first shared by the 2
    processes, the others in one; the update is the whole batch's (one plain step)."""
    rng = np.random.default_rng(1)
    batches = [_batch(rng, 5) for _ in range(3)]
    local_model, local = _step()
    want = [local(*b) for b in batches]
    model, step = _step(embedded_runtime, parallel=strategy, accum_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = [step(*b) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-10)
    with embedded_runtime.as_current():
        state = model.state_dict()
    for k, v in local_model.state_dict().items():
        np.testing.assert_allclose(state[k], v, rtol=1e-9, atol=1e-12, err_msg=k)


@pytest.mark.distributed
def test_several_rows_in_one_row_tile_are_still_refused(embedded_runtime):
    """8 rows that batch_tiles keeps in one tile: that tiling shares nothing, a mistake named as
    before (running them in one process would hide it for the whole run)."""
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0, dtype="float64")
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-2), _loss, runtime=embedded_runtime,
                        parallel="data", batch_tiles=[(8, 16), (8, 4)])
    with pytest.raises(tg.TileError, match="needs at least 2 row tiles"):
        step(*_batch(np.random.default_rng(2), 8))
