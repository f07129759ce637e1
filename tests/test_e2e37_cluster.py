"""A user's own Dask cluster (a scheduler and workers started by hand) and what happens when it
misbehaves mid-fit: each test is a defect found in that audit and fixed (see its docstring)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tilegraph as tg
from conftest import mse, regression_data, stop_process
from tilegraph.trainer import WorkerLostError


def _trainer(rt, **kw):
    """The README's first MLP on random regression data: a step of a few milliseconds, whose
    tiny plan keeps every parameter and optimizer state tile on one worker."""
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    kw.setdefault("steps_per_graph", 1)
    return tg.Trainer(model, opt, regression_data(0, 64), rt, loss_fn=mse, progress=False, **kw)


def _state_worker(rt, optimizer) -> str:
    """The worker holding the parameters (waits for the step that computes them)."""
    from distributed import wait

    futures = [c.value.future for p in optimizer.params for c in p.cells.flat if hasattr(c.value, "future")]
    wait(futures)
    held = {w for ws in rt.client.who_has(futures).values() for w in ws}
    assert len(held) == 1, held  # the tiny plan keeps everything on one worker
    return held.pop()


def _killing_eval_data(rt, at_step: int, lost: dict):
    """An ``eval_data(i)`` that kills the worker holding the model's state the first time it is
    asked for the evaluation after step ``at_step`` (it runs in the client as that evaluation
    starts, before its graph), and returns once the scheduler has removed it."""
    held = regression_data(1, 64)

    def eval_data(i):
        trainer = lost["trainer"]
        if not lost.get("addr") and trainer.optimizer.step_count == at_step:
            addr = _state_worker(rt, trainer.optimizer)
            lost["addr"] = addr
            os.kill(rt.client.run(os.getpid, workers=[addr])[addr], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while addr in rt.workers() and time.monotonic() < deadline:  # gone before the evaluation's graph
                time.sleep(0.05)  # (which then fails at once, before the workers are checked)
        return held(i)
    return eval_data


# -- a worker lost during an evaluation inside fit ---------------------------------------------

@pytest.mark.distributed
def test_a_worker_lost_in_an_evaluation_is_named_with_its_step(own_runtime, tmp_path):
    """Before: the error said "lost worker ... while the evaluation ran" (no step) and its
    ``steps`` were None."""
    lost: dict = {}
    trainer = _trainer(own_runtime, eval_data=_killing_eval_data(own_runtime, 4, lost), eval_every=4,
                       eval_batches=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=2)
    lost["trainer"] = trainer
    with pytest.raises(WorkerLostError) as err:
        trainer.fit(6)
    e = err.value
    assert e.workers == [lost["addr"]], e
    assert "the evaluation after step 4" in e.what, e.what
    assert list(e.steps) == [4], e.steps
    assert "step-000002" in e.what  # what to resume from, as for a step's loss


@pytest.mark.distributed
def test_a_restart_after_a_worker_lost_in_an_evaluation_says_so(own_runtime, tmp_path, caplog):
    """Before: the restart was logged as "lost worker(s) ... while training ran" and its record
    in ``metrics.jsonl`` and ``FitResult.restarts`` had ``"failed": null``."""
    lost: dict = {}
    trainer = _trainer(own_runtime, eval_data=_killing_eval_data(own_runtime, 4, lost), eval_every=4,
                       eval_batches=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=2, restart_on_failure=True,
                       log_dir=tmp_path / "log")
    lost["trainer"] = trainer
    with caplog.at_level(logging.WARNING, logger="tilegraph"):
        res = trainer.fit(6)
    assert res.restarts == [{"failed": [4, 4], "during": "the evaluation after step 4", "workers": [lost["addr"]],
                             "checkpoint": str(tmp_path / "ck" / "step-000002"), "step": 2}], res.restarts
    logged = [r.getMessage() for r in caplog.records if "resuming from checkpoint" in r.getMessage()]
    assert len(logged) == 1 and "while the evaluation after step 4 ran" in logged[0], logged
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    restart = [r for r in records if r.get("restart")]
    assert len(restart) == 1 and restart[0]["failed"] == [4, 4]
    assert restart[0]["during"] == "the evaluation after step 4"
    # the run went on from step 2's checkpoint as an uninterrupted one does
    want = _trainer(None, eval_data=regression_data(1, 64), eval_every=4, eval_batches=1).fit(6)
    np.testing.assert_allclose(res.losses, want.losses, rtol=1e-5)
    np.testing.assert_allclose([v for _, v in res.val_losses], [v for _, v in want.val_losses], rtol=1e-5)
    assert [s for s, _ in res.val_losses] == [4, 6]


# -- one worker ----------------------------------------------------------------------------------

@pytest.fixture
def one_worker():
    """An embedded cluster of one worker process (as a user's single ``dask worker``)."""
    rt = tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    try:
        yield rt
    finally:
        rt.close()


@pytest.mark.distributed
def test_the_lost_worker_of_a_one_worker_cluster_is_named(one_worker):
    """Before: "[tilegraph.TrainStep] step 5 failed and the Dask scheduler did not answer
    (CommClosedError: ...)", after a page of Dask's "Failed to serialize <WorkerState ...>"
    (a plan on one worker scatters its programs to every worker, and Dask logs that event with
    objects no client can receive; the failed step's look at the event log then broke), and
    ``restart_on_failure`` did not restart (no WorkerLostError)."""
    rt = one_worker
    (addr,) = rt.workers()

    def hook(trainer, stats):
        if trainer.optimizer.step_count == 5:
            os.kill(rt.client.run(os.getpid)[addr], signal.SIGKILL)

    trainer = _trainer(rt, on_step=[hook])
    with pytest.raises(WorkerLostError) as err:
        trainer.fit(40)
    assert err.value.workers == [addr], err.value
    assert f"lost worker {addr} (left the cluster" in str(err.value)
    assert rt.client.get_events("all")  # the event log reads again


# -- fitting again after a lost worker -----------------------------------------------------------

@pytest.mark.distributed
def test_fit_again_after_a_lost_worker_is_refused_until_a_checkpoint_is_loaded(own_runtime, tmp_path):
    """Before: the second ``fit`` ran steps 7 and 8, each failing: "lost worker X while step 7
    ran" (it was lost during step 5) or "the cluster lost tasks or data of step 8 (no worker was
    found missing)", and counted them (the optimizer's step count went on past the steps that
    never ran)."""
    rt = own_runtime

    def hook(trainer, stats):
        if trainer.optimizer.step_count == 5:
            addr = _state_worker(rt, trainer.optimizer)
            os.kill(rt.client.run(os.getpid)[addr], signal.SIGKILL)

    ck = tmp_path / "ck"
    trainer = _trainer(rt, on_step=[hook], checkpoint_dir=ck, checkpoint_every=4, pipeline=False)
    with pytest.raises(WorkerLostError):
        trainer.fit(8)
    count = trainer.optimizer.step_count
    t0 = time.perf_counter()
    with pytest.raises(tg.TileError, match="the model's values on the workers to train on") as err:
        trainer.fit(2)
    assert time.perf_counter() - t0 < 2 and trainer.optimizer.step_count == count
    assert f"resume from the newest committed checkpoint, {ck / 'step-000004'} (step 4)" in str(err.value), err.value
    assert "tiles on the workers are gone" in err.value.received
    trainer.on_step = []
    assert trainer.load_checkpoint(ck / "step-000004") == 4
    got = trainer.fit(4).losses
    want = _trainer(None).fit(8).losses[4:]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# -- the performance report ----------------------------------------------------------------------

@pytest.mark.distributed
def test_the_performance_report_is_of_the_trainers_cluster_and_shows_the_callers_code(embedded_runtime, one_worker,
                                                                                         tmp_path):
    """Before: the report's "Calling Code" was contextlib's ``ExitStack.__exit__`` (a frame inside
    fit), and with another runtime connected after the trainer's (``one_worker`` here, not even
    made current), the report was that cluster's: its address, its one worker, none of the fit's
    tasks (Dask's ``performance_report`` asks the default client's scheduler)."""
    import html

    rt = embedded_runtime
    trainer = _trainer(rt, performance_report=tmp_path / "report.html", steps_per_graph=2)
    trainer.fit(4)  # the line of the caller's code: e2e37-report-marker
    text = html.unescape((tmp_path / "report.html").read_text())
    code = text[text.index("Calling Code"):][:300]
    assert "def test_the_performance_report_is_of_the_trainers_cluster" in code, code  # (not ExitStack's)
    assert f"Address: {rt.address}" in text and f"Address: {one_worker.address}" not in text
    assert "tg-" in text  # the fit's tasks are in its task stream


# -- a scheduler started by hand, lost mid-fit -------------------------------------------------

class HandCluster:
    """``dask scheduler`` and one ``dask worker`` started from the shell, as a user does; the
    runtime connects through the scheduler file."""

    def __init__(self, tmp_path):
        self.file = tmp_path / "scheduler.json"
        self.procs = []
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.scheduler = self._start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0",
                                      "--no-dashboard", "--scheduler-file", str(self.file)], quiet)
        deadline = time.monotonic() + 60
        while not self.file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._start(["distributed.cli.dask_worker", "--scheduler-file", str(self.file), "--nthreads", "1",
                     "--memory-limit", "1GB", "--host", "127.0.0.1", "--no-dashboard"], quiet)
        self.rt = tg.connect(scheduler_file=str(self.file), timeout=30, make_current=False)
        self.rt.client.wait_for_workers(1, timeout=60)

    def _start(self, args, quiet):
        self.procs.append(subprocess.Popen([sys.executable, "-m", *args], **quiet))
        return self.procs[-1]

    def close(self):
        try:
            self.rt.close()
        finally:
            for p in reversed(self.procs):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)
                stop_process(p)


@pytest.fixture
def hand_cluster(tmp_path):
    c = None
    try:
        c = HandCluster(tmp_path)
        yield c
    finally:
        if c is not None:
            c.close()


@pytest.mark.distributed
def test_a_scheduler_killed_mid_fit_is_named_with_what_went_with_it(hand_cluster, tmp_path):
    """Before: "[tilegraph.TrainStep] step 5 failed and the Dask scheduler did not answer
    (TileError: [tilegraph.TrainStep] the Dask scheduler to answer a health check within 10 s;
    received: TimeoutError: timed ...)": no address, nothing of what was lost or how to go on;
    a fit again then said "what a lost worker held is gone"."""
    rt = hand_cluster.rt
    killed = {}

    def hook(trainer, stats):
        if trainer.optimizer.step_count == 5 and not killed:
            killed["at"] = time.perf_counter()
            hand_cluster.scheduler.kill()

    ck = tmp_path / "ck"
    trainer = _trainer(rt, on_step=[hook], checkpoint_dir=ck, checkpoint_every=3)
    with pytest.raises(tg.TileError) as err:
        trainer.fit(400)
    took = time.perf_counter() - killed["at"]
    msg = str(err.value)
    assert type(err.value) is tg.TileError and msg.startswith("[tilegraph.Trainer.fit] a Dask scheduler that answers")
    assert f"the connection to the Dask scheduler at {rt.address} was lost" in msg, msg
    assert f"resume from the newest committed checkpoint, {ck / 'step-000003'} (step 3)" in msg, msg
    assert took < 20, took  # (10 s of them: a worker health check waits for the scheduler it lost)
    t0 = time.perf_counter()
    with pytest.raises(tg.TileError, match="a Dask scheduler that answers|a connected Dask scheduler") as again:
        trainer.fit(2)
    assert time.perf_counter() - t0 < 5 and rt.address in str(again.value)


@pytest.mark.distributed
def test_a_trainer_whose_runtime_was_closed_says_to_build_it_again(one_worker, embedded_runtime):
    """Before: "an open runtime: this one was closed ...; connect again with tg.connect(...)", and
    after connecting again the trainer's fit said the same (it stays bound to the closed runtime,
    whose workers held its model's values)."""
    trainer = _trainer(one_worker)
    trainer.fit(2)
    one_worker.close()
    with embedded_runtime.as_current():  # connected again
        with pytest.raises(tg.TileError, match="an open runtime") as err:
            trainer.fit(2)
    assert "build the model, optimizer and a Trainer on the new runtime" in str(err.value), err.value


# -- workers started with too little memory ----------------------------------------------------

@pytest.mark.distributed
def test_a_worker_started_elsewhere_with_too_little_memory_is_warned_of():
    """Before: nothing was said at connect (the embedded cluster refuses such a limit), and the
    first step failed 10 s later with "No valid workers found" and the embedded cluster's
    advice, tg.connect(memory_limit=...), which connect refuses for an existing cluster."""
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, processes=False, protocol="tcp", memory_limit="200MB", host="127.0.0.1",
                      dashboard_address="127.0.0.1:0") as cluster:
        with pytest.warns(RuntimeWarning, match=r"runs under a memory limit below 256 MiB: tcp://.*\(190.73 MiB\)"):
            rt = tg.connect(cluster.scheduler_address, make_current=False)
        rt.close()


def test_no_worker_alive_advice_fits_the_cluster():
    from tilegraph.runtime import no_worker_alive_error

    with pytest.raises(tg.TileError, match=r"start them with a larger `dask worker --memory-limit`"):
        with no_worker_alive_error("tilegraph.Runtime.scatter_cells", "the values", "tcp://10.0.0.1:8786"):
            raise TimeoutError("No valid workers found")
