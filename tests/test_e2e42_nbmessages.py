"""What a notebook user is told (session 42): the line ``tg.connect`` prints, and the line an
interrupt (the kernel's stop button, Ctrl-C) leaves when it lands after a fit's last step.

- ``tg.connect(dashboard=False)`` printed nothing, while ``tg.connect()`` printed a line saying
  what it started: with the dashboard off the user saw no word of the workers started;
- an interrupt during the final checkpoint or the end-of-fit work raised with no
  "interrupted:" line (one during the steps printed "interrupted: stopped after step N, ..."),
  leaving the user to guess whether the last checkpoint was written.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from dask.utils import format_bytes

import tilegraph as tg
from conftest import mse


# -- tg.connect's line -----------------------------------------------------------------------------
@pytest.fixture
def connected():
    """``connect(**kw)`` for the test, every runtime it made closed afterwards."""
    made = []

    def connect(**kw):
        made.append(tg.connect(n_workers=1, threads_per_worker=1, make_current=False, **kw))
        return made[-1]

    yield connect
    for rt in made:
        rt.close()


@pytest.mark.distributed
def test_connect_without_a_dashboard_says_what_it_started(connected, capsys):
    """``dashboard=False`` printed no line at all: now the same line as with a dashboard (workers,
    threads, memory, the scheduler's address) ending in "dashboard: off"."""
    rt = connected(dashboard=False)
    out = capsys.readouterr().out
    (limit,) = {w["memory_limit"] for w in rt.workers().values()}
    assert out == (f"tilegraph: embedded cluster with 1 worker x 1 thread, {format_bytes(limit)} each; "
                   f"scheduler {rt.address}; dashboard: off\n")
    assert rt.address.startswith("tcp://127.0.0.1:") and rt.dashboard_link is None


@pytest.mark.distributed
def test_connect_quiet_without_a_dashboard_prints_nothing_and_with_one_the_link(connected, capsys):
    """``quiet=True, dashboard=False`` stays silent (the CLI, scripts and tests rely on it); with
    a dashboard the line names it, quiet or not (its link is found nowhere else); workers without
    a memory limit are said to have none."""
    connected(dashboard=False, quiet=True)
    assert capsys.readouterr().out == ""
    rt = connected(quiet=True, memory_limit=None)
    out = capsys.readouterr().out
    assert out.startswith("tilegraph: embedded cluster with 1 worker x 1 thread, no memory limit; ")
    assert out.endswith(f"; scheduler {rt.address}; dashboard: {rt.dashboard_link}\n")
    assert rt.dashboard_link.startswith("http://127.0.0.1:")


# -- an interrupt after the last step ---------------------------------------------------------------
def _data(step):
    x = np.random.default_rng([0, step]).standard_normal((32, 8)).astype(np.float32)
    return x, np.tanh(x[:, :2])


def _trainer(tmp_path, runtime=None, **kw):
    """A 2-layer MLP trained on a regression, checkpointed every 2 steps into tmp_path/ck."""
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = tg.Trainer(model, opt, _data, runtime, loss_fn=mse, batch_size=32, batch_tiles=[(16, 8), (16, None)],
                         progress=False, checkpoint_dir=tmp_path / "ck", checkpoint_every=2, **kw)
    return model, opt, trainer


def _interrupted(trainer, steps: int, capsys) -> str:
    """``trainer.fit(steps)``, interrupted: the line it printed (the only one)."""
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(steps)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("interrupted")]
    assert len(said) == 1, said
    return said[0]


def _assert_resumes(model, path, tmp_path) -> None:
    """The checkpoint ``path`` holds ``model``'s weights at step 4 (a fresh trainer loads it)."""
    fresh, _, again = _trainer(tmp_path / "again")
    assert again.load_checkpoint(path) == 4
    for (name, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)


def _stop_during_final_save(trainer, monkeypatch, step: int, then=None):
    """Hold ``trainer``'s background save of ``step`` until the returned event is set, and press
    the stop button (a KeyboardInterrupt) the first time the fit waits for that save; once the
    event is set the save finishes (``then(save)`` in place of its own finish, e.g. a failure).
    Returns the event and the list of the step counts at the stop."""
    from tilegraph.io.zarr import PendingSave

    ck = trainer.checkpoints
    real_finish, real_wait, go_on, stops = PendingSave.finish, ck.wait, threading.Event(), []

    def finish(self):  # the save of ``step`` commits once the interrupt has been said
        if self.path != ck.path(step):
            return real_finish(self)
        assert go_on.wait(120)
        return (then or real_finish)(self)

    def wait(*args, **kwargs):  # the stop button while fit waits for that save
        if not stops and ck.busy and ck.pending_step == step:
            stops.append(trainer.optimizer.step_count)
            raise KeyboardInterrupt
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(PendingSave, "finish", finish)
    ck.wait = wait
    return go_on, stops


def _check_final_save_interrupted(tmp_path, capsys, monkeypatch, runtime=None):
    model, opt, trainer = _trainer(tmp_path, runtime)
    ck = trainer.checkpoints
    go_on, stops = _stop_during_final_save(trainer, monkeypatch, 4)
    try:
        line = _interrupted(trainer, 4, capsys)
    finally:
        go_on.set()
    assert stops == [4]
    assert line == ("interrupted: stopped after step 4, every step run logged, the fit's last; the "
                    f"checkpoint of step 4 is still being written in the background ({ck.path(4)}; it completes "
                    "unless the process ends first: trainer.wait_for_checkpoint() waits for it and runs the "
                    f"on_checkpoint hooks); the last complete one: {ck.path(2)}")
    assert [r["step"] for r in trainer.history if "loss" in r] == [1, 2, 3, 4]
    assert ck.wait() == ck.path(4)
    _assert_resumes(model, ck.path(4), tmp_path)


def test_an_interrupt_during_the_final_background_save_says_it_goes_on(local_scheduler, tmp_path, capsys,
                                                                        monkeypatch):
    """The stop button while fit waits for the last (background) checkpoint: the traceback came
    with no word; now the line says every step ran, the save goes on in the background, and
    names the last complete checkpoint. The save then commits, and loads back as step 4."""
    _check_final_save_interrupted(tmp_path, capsys, monkeypatch)


@pytest.mark.distributed
def test_an_interrupt_during_the_final_background_save_on_the_cluster(embedded_runtime, tmp_path, capsys,
                                                                       monkeypatch):
    """The same on the embedded cluster, where fit waits for the save in a thread it watches the
    workers from."""
    with embedded_runtime.as_current():
        _check_final_save_interrupted(tmp_path, capsys, monkeypatch, embedded_runtime)


def test_an_interrupt_in_the_final_checkpoints_hook_says_it_was_written(local_scheduler, tmp_path, capsys):
    """The stop button in an ``on_checkpoint`` hook of the last checkpoint (run at the end of
    fit, once the save committed): the line says that checkpoint was written, and where."""
    model, opt, trainer = _trainer(tmp_path)

    def hook(tr, path):
        if path.name == "step-000004":
            raise KeyboardInterrupt

    trainer.on_checkpoint = [hook]
    line = _interrupted(trainer, 4, capsys)
    path = trainer.checkpoints.path(4)
    assert line == ("interrupted: stopped after step 4, every step run logged, the fit's last; the "
                    f"checkpoint of step 4 was written: {path}")
    _assert_resumes(model, path, tmp_path)


def test_an_interrupt_as_the_final_checkpoint_starts_says_it_was_not_written(local_scheduler, tmp_path, capsys):
    """A save waited for (``async_checkpoint=False``) interrupted as it starts: the line said
    "stopped after step 4, every step run logged (fit again ...)" with no word of the checkpoint;
    now it says it was not written, and names the last complete one."""
    model, opt, trainer = _trainer(tmp_path, async_checkpoint=False)
    real = trainer._start_checkpoint

    def start(step):
        if step == 4:
            raise KeyboardInterrupt
        return real(step)

    trainer._start_checkpoint = start
    line = _interrupted(trainer, 4, capsys)
    ck = trainer.checkpoints
    assert line == ("interrupted: stopped after step 4, every step run logged, the fit's last; the "
                    "checkpoint of step 4 was not written (trainer.save_checkpoint(path) writes one); the last "
                    f"complete one: {ck.path(2)}")
    assert ck.checkpoints() == [ck.path(2)]
    assert trainer.save_checkpoint(tmp_path / "by-hand") == tmp_path / "by-hand"
    _assert_resumes(model, tmp_path / "by-hand", tmp_path)


def test_an_interrupt_during_the_steps_says_what_it_said(local_scheduler, tmp_path, capsys):
    """Before the last step the line is unchanged (tests/test_newuser_trainer.py pins it)."""
    _, opt, trainer = _trainer(tmp_path)

    def hook(tr, stats):
        if opt.step_count == 2:
            raise KeyboardInterrupt

    trainer.on_step = [hook]
    line = _interrupted(trainer, 4, capsys)
    assert line == f"interrupted: stopped after step {opt.step_count}, every step run logged (fit again to go on from there)"
