"""Async checkpoints of :class:`tilegraph.Trainer` commit promptly while training goes on, and
a worker lost during fit says which checkpoint can be resumed.

Before, a background save submitted its write tasks from its own thread, after the steps the
loop had submitted meanwhile (on one-thread workers they queued behind them), and the first
save's thread imported zarr while the loop held the GIL: with ``checkpoint_every=3`` the step-3
checkpoint was still a temporary folder after step 6, and a worker killed then left no checkpoint
at all, while the error said "resume from a checkpoint (Trainer.load_checkpoint)".

Each cluster test starts its own embedded cluster of 2 worker processes x 1 thread (a killed
worker must not leak into other tests). The model is test_faults.py's MLP: its plan keeps all of
it on one worker, which holds every parameter and optimizer state tile (the worker to kill).
"""

from __future__ import annotations

import os
import signal

import pytest

from conftest import _two_workers
from test_faults import _trainer as _faults_trainer
from tilegraph.io.zarr import SAVE_PRIORITY, Checkpoint, complete_checkpoints, prepare_save
from tilegraph.trainer import WorkerLostError


@pytest.fixture
def rt():
    yield from _two_workers()


def _trainer(rt, steps, **kw):
    """test_faults.py's trainer, a graph per step (each step's hooks run before the next is submitted)."""
    return _faults_trainer(rt, steps, steps_per_graph=1, **kw)


def _committed(folder) -> list[str]:
    # (not a CheckpointManager of its own: starting, it removes this process's temporary folders)
    return [p.name for p in complete_checkpoints(folder)] if folder.is_dir() else []


def _kill_state_worker_at(rt, step: int):
    """An on_step hook that kills (SIGKILL) the worker holding the state once ``step`` finished."""
    from distributed import wait

    pids = rt.client.run(os.getpid)
    killed = {}

    def hook(trainer, stats):
        if not killed and len(trainer.history) >= step:
            if trainer.checkpoints is not None:  # the save under way commits first (it runs while training goes on)
                trainer.checkpoints.wait()
            futures = [c.value.future for p in trainer.optimizer.params for c in p.cells.flat
                       if hasattr(c.value, "future")]
            wait(futures)
            held = {w for ws in rt.client.who_has(futures).values() for w in ws}
            assert len(held) == 1, held  # the tiny plan keeps everything on one worker
            killed["addr"] = held.pop()
            os.kill(pids[killed["addr"]], signal.SIGKILL)
    return hook, killed


@pytest.mark.distributed
def test_save_submits_its_writes_at_once_above_the_steps_priority(rt, tmp_path):
    # start() hands the workers their write tasks (on the caller's thread, before the next steps
    # are submitted), at a priority above a step's tasks (0); finish() commits
    trainer = _trainer(rt, 8)
    trainer.fit(2)
    pending = prepare_save(tmp_path / "ck", trainer.model, trainer.optimizer, runtime=rt)
    pending.start()
    keys = {f.key for f in pending._futures}
    assert keys and not (tmp_path / "ck").exists()  # started, not committed

    def priorities(keys, dask_scheduler=None):
        return {k: dask_scheduler.tasks[k].priority for k in keys if k in dask_scheduler.tasks}

    from distributed import wait

    wait(pending._futures)  # (the submission reaches the scheduler in its own time)
    assert not (tmp_path / "ck").exists()  # written, not committed
    got = rt.client.run_on_scheduler(priorities, keys)
    assert got and all(p[0] == -SAVE_PRIORITY for p in got.values()), got  # Dask stores -priority first
    assert pending.finish() == tmp_path / "ck"
    assert Checkpoint(tmp_path / "ck").step == 2 and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.distributed
def test_lost_worker_names_the_committed_checkpoint(rt, tmp_path):
    hook, killed = _kill_state_worker_at(rt, 6)
    trainer = _trainer(rt, 12, checkpoint_every=3, checkpoint_dir=tmp_path / "ck", on_step=[hook])
    with pytest.raises(WorkerLostError) as info:
        trainer.fit(12)
    msg = str(info.value)
    ck = tmp_path / "ck" / "step-000003"
    assert f"lost worker {killed['addr']} (left the cluster" in msg
    assert f"resume from the newest committed checkpoint, {ck} (step 3)" in msg, msg
    assert f"Trainer.load_checkpoint({str(ck)!r})" in msg and "restart_on_failure=True" in msg
    assert "resume from a checkpoint (Trainer.load_checkpoint)" not in msg  # the generic hint, replaced
    assert _committed(tmp_path / "ck") == ["step-000003"]


@pytest.mark.distributed
def test_lost_worker_before_any_checkpoint_says_none_was_committed(rt, tmp_path):
    hook, killed = _kill_state_worker_at(rt, 2)
    trainer = _trainer(rt, 12, checkpoint_every=5, checkpoint_dir=tmp_path / "ck", on_step=[hook])
    with pytest.raises(WorkerLostError) as info:
        trainer.fit(12)
    msg = str(info.value)
    assert f"no checkpoint was committed yet in {tmp_path / 'ck'}" in msg, msg
    assert "nothing of this run can be resumed" in msg and "resume from a checkpoint" not in msg
    assert info.value.workers == [killed["addr"]]
