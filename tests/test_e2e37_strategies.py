"""End-to-end audit of the parallel strategies (session 37): batch inputs that are not rows; the refusals."""

import numpy as np
import pytest

from conftest import fake_hosts

from tilegraph._graph import Cell
from tilegraph.parallel.data_parallel import _row_tiles_hint


def _cells(rows_per_tile):
    """A batch array's cells: one column of row tiles of these sizes."""
    cells = np.empty((len(rows_per_tile), 1), dtype=object)
    for i, r in enumerate(rows_per_tile):
        cells[i, 0] = Cell(None, (r, 16), np.float32, token=f"t{i}")
    return cells


def test_the_row_tile_hint_says_one_row_in_the_singular():
    """A micro-batch of 2 rows (accum_steps=4 of 8) in one row tile on 2 processes: the refusal
    said "row tiles have at most 1 rows"."""
    assert "at most 1 row," in _row_tiles_hint([_cells([2])], 2)
    assert "at most 2 rows," in _row_tiles_hint([_cells([3])], 2)
    assert _row_tiles_hint([_cells([1])], 2) == "this batch has 1 row"


def _weighted(m, x, y, w):
    d = m(x) - y
    return (d * d * w).mean()


def _scaled(m, x, y, s):
    d = m(x) - y
    return (d * d).mean() * s


def _mlp_step(fn, batch_tiles, runtime=None, **options):
    import tilegraph as tg

    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=0.5)
    return model, tg.TrainStep(model, opt, fn, batch_tiles=batch_tiles, runtime=runtime, **options)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
@pytest.mark.parametrize("exchange", ["auto", "tasks", "gangs over two hosts"])
def test_a_batch_with_a_scalar_or_an_array_given_whole_shares_its_rows(embedded_runtime, strategy, exchange,
                                                                       monkeypatch):
    """A loss of the batch's rows and of an input that is not rows (a 0-d loss scale; per-output
    weights in one tile beside row tiles): every replica reads that input whole, as it reads the
    parameters, and the step trains as one process does. Before, the scalar (and the weights'
    one tile) counted as a batch of one row tile, so the step was refused ("the batch needs at
    least 2 row tiles ... batch_tiles whose row tiles have at most 4 rows ... or no
    batch_tiles"), whatever the tiling."""
    import tilegraph as tg

    if exchange == "gangs over two hosts":  # (values over the workers' comms instead of shared memory)
        fake_hosts(monkeypatch, embedded_runtime)
    else:
        monkeypatch.setattr(tg.config, "exchange", exchange)
    rng = np.random.default_rng(0)
    w = np.array([1.0, 2.0, 0.5, 3.0], np.float32)
    cases = [(_scaled, np.float32(2.0), None), (_scaled, np.float32(2.0), [(4, 8), (4, None), ()]),
             (_weighted, w, [(4, 8), (4, None), (None,)])]
    for fn, extra, tiles in cases:
        local_model, local = _mlp_step(fn, tiles)
        model, step = _mlp_step(fn, tiles, embedded_runtime, parallel=strategy)
        batches = []
        for _ in range(3):
            x = rng.standard_normal((8, 16)).astype(np.float32)
            batches.append((x, np.tanh(x[:, :4]), extra))
        want = [local(*b) for b in batches]
        got = [step(*b) for b in batches]
        exe = step.plan(*batches[0])
        assert (exe.strategy, exe.n_replicas) == (strategy, 2)
        np.testing.assert_allclose(got, want, rtol=2e-5)
        with embedded_runtime.as_current():
            state = model.state_dict()
        for k, v in local_model.state_dict().items():
            np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-6)
        evaluate = tg.EvalStep(model, fn, batch_tiles=tiles, runtime=embedded_runtime, parallel=strategy)
        np.testing.assert_allclose(evaluate(*batches[0]), tg.EvalStep(local_model, fn, batch_tiles=tiles)(*batches[0]),
                                   rtol=2e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
def test_a_smaller_batch_given_batch_tiles_is_shared_per_process(embedded_runtime, strategy):
    """An epoch's last, smaller batch (3 rows) and the micro-batches of accum_steps=4 (2 rows),
    under row tiles of 4 given for the full batch: a tile per process, as without batch_tiles.
    Before, the row tile larger than the rows made one tile of them, and the step was refused
    ("the batch needs at least 2 row tiles"), where the README says such a batch trains."""
    rng = np.random.default_rng(1)
    tiles = [(4, 8), (4, None)]

    def batch(rows):
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        return x, np.tanh(x[:, :4])

    for accum, sizes in ((1, (8, 8, 3, 8)), (4, (8, 8))):
        local_model, local = _mlp_step(_scaled_one, tiles, accum_steps=accum)
        model, step = _mlp_step(_scaled_one, tiles, embedded_runtime, parallel=strategy, accum_steps=accum)
        batches = [batch(n) for n in sizes]
        np.testing.assert_allclose([step(*b) for b in batches], [local(*b) for b in batches], rtol=2e-5)
        with embedded_runtime.as_current():
            state = model.state_dict()
        for k, v in local_model.state_dict().items():
            np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-6)
    full = batch(8)  # a full batch in one tile still has nothing to share: refused as before
    _, whole = _mlp_step(_scaled_one, [(8, 8), (8, None)], embedded_runtime, parallel=strategy)
    with pytest.raises(Exception, match="needs at least 2 row tiles"):
        whole(*full)


def _scaled_one(m, x, y):
    d = m(x) - y
    return (d * d).mean()


@pytest.mark.distributed
def test_an_input_of_another_length_is_not_cut_per_process(embedded_runtime):
    """Without batch_tiles, "data" cut every batch array's first dim per process, per-output
    weights of shape (4,) too: a tile error naming `b.rechunk` that the user could not act on.
    Only the arrays of the batch's rows are cut now."""
    rng = np.random.default_rng(2)
    w = np.array([1.0, 2.0, 0.5, 3.0], np.float32)
    local_model, local = _mlp_step(_weighted, None)
    model, step = _mlp_step(_weighted, None, embedded_runtime, parallel="data")
    batches = []
    for _ in range(3):
        x = rng.standard_normal((6, 16)).astype(np.float32)
        batches.append((x, np.tanh(x[:, :4]), w))
    np.testing.assert_allclose([step(*b) for b in batches], [local(*b) for b in batches], rtol=2e-5)
    assert step.plan(*batches[0]).n_replicas == 2
