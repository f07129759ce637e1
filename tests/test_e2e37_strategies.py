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
