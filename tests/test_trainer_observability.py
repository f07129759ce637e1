"""What the Trainer reports of its own speed (an observability audit): the performance report's
default graph is the fit's second, not its first (recorded and compiled); a report_step outside
the fit is a warning, not silence; writing the report is not training time; step_seconds is the
step's share of its graph's time from when it could start (pipelined steps were timed from their
submission, behind the step before: their sum exceeded the wall time by 60%); StepStats.tasks
counts the Dask tasks a step ran (it counted the plan's clusters: 8 for a gang step of 3)."""

import json

import numpy as np
import pytest

import tilegraph as tg
from conftest import mse
from test_trainer import _data, _setup


@pytest.mark.distributed
def test_the_default_report_is_of_the_second_graph_and_not_training_time(embedded_runtime, tmp_path):
    model, opt, _ = _setup(steps=6)
    trainer = tg.Trainer(model, opt, _data(0), embedded_runtime, loss_fn=mse, batch_size=32,
                         batch_tiles=[(16, 8), (16, None)], progress=False, steps_per_graph=2,
                         performance_report=tmp_path / "r.html", log_dir=tmp_path / "run")
    opened = []  # the steps submitted when the report opened: those before its graph
    start = trainer._start_report
    trainer._start_report = lambda stack: (opened.append(opt.step_count), start(stack))
    res = trainer.fit(6)
    assert opened == [2]  # the graph of steps 3-4 (it opened at the first, recorded and compiled)
    html = (tmp_path / "r.html").read_text()
    assert "Dask Performance Report" in html
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the steps' times add up to no more than the fit's (a report's writing, ~0.3 s, is not in either)
    assert sum(r["step_seconds"] for r in records if "loss" in r) <= res.seconds


@pytest.mark.distributed
def test_a_report_step_outside_the_fit_is_a_warning(embedded_runtime, tmp_path):
    model, opt, _ = _setup(steps=6)
    trainer = tg.Trainer(model, opt, _data(0), embedded_runtime, loss_fn=mse, batch_size=32,
                         batch_tiles=[(16, 8), (16, None)], progress=False, performance_report=tmp_path / "r.html",
                         report_step=100)
    with pytest.warns(UserWarning, match=r"report_step=100 is not among this fit's steps 1-3: no performance report "
                                         r"is written to .*r\.html"):
        trainer.fit(3)
    assert not (tmp_path / "r.html").exists()


def test_pipelined_step_seconds_add_up_to_the_wall_time(tmp_path):
    _, _, trainer = _setup(steps=30, log_dir=tmp_path / "run", steps_per_graph=1)
    res = trainer.fit(30)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["step_seconds"] for r in records if "loss" in r]
    assert len(seconds) == 30 and all(s > 0 for s in seconds)
    assert sum(seconds) <= res.seconds


@pytest.mark.distributed
@pytest.mark.parametrize("parallel, least", [("data", 3), ("tiles", 1)])
def test_step_stats_count_the_dask_tasks_a_step_ran(embedded_runtime, parallel, least):
    from distributed import get_task_stream

    from tilegraph import models
    from tilegraph.trainer import lm_loss

    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, lm_loss, runtime=embedded_runtime, batch_tiles=[(2, None)] * 2,
                        parallel=parallel)
    ids = np.random.default_rng(0).integers(0, 96, (4, 16))
    step(ids, np.roll(ids, -1, 1))
    with get_task_stream(client=embedded_runtime.client) as ts:
        step(ids, np.roll(ids, -1, 1))
    ran = [t for t in ts.data if str(t["key"]).startswith("tg-")]
    assert step.last.tasks == len(ran) >= least


def test_a_kernels_first_call_in_a_process_counts_as_compiling():
    """A kernel's first call in a process compiles it (or loads its cached machine code): up to a
    second for the embedding's, which read as 82-93% of a fresh worker's first fit."""
    from tilegraph.exec import program

    x = tg.from_numpy(np.arange(6.0).reshape(2, 3), tiles=(1, 3))
    program._CALLED.discard("exp")
    tg.compute(tg.exp(x))  # warm the rest
    program.kernel_stats(reset=True)
    program._CALLED.discard("exp")
    tg.compute(tg.exp(x))
    by_scope = program.kernel_stats()["by_scope"]
    assert program.FIRST_CALLS in by_scope and len(by_scope) == 2, by_scope  # the first tile's call, the second's
