"""Cluster operations during training, round 2 (an end-to-end audit): checkpoint managers sharing
a folder, workers retired, added, restarted or unequal while a Trainer runs. Each test is a defect
found in that audit and fixed (see its docstring)."""

from __future__ import annotations

import gc
import json
import os
import socket

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.io import zarr as tz


def _mlp(seed=0):
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=seed)
    return model, tg.optim.AdamW(model.parameters(), lr=1e-2)


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


# -- two CheckpointManagers on one folder --------------------------------------------------------

def test_a_second_manager_on_a_folder_takes_it_and_the_first_is_refused(tmp_path):
    """Before: two managers with ``keep=2`` on one folder (a notebook cell made again, two
    training loops) each pruned the other's checkpoints, and the first's ``latest()`` named the
    second's. Now the last to save owns the folder; the other is refused at its next save and
    prunes nothing."""
    model, opt = _mlp()
    first = tz.CheckpointManager(tmp_path, keep=2)
    second = tz.CheckpointManager(tmp_path, keep=2)
    for step in (10, 20):
        first.save(step, model, opt)
    first.wait()
    second.save(25, model, opt)
    second.wait()
    assert _names(tmp_path) == ["step-000020", "step-000025"]
    with pytest.raises(tz.CheckpointError, match=r"CheckpointManager\(.*\)\.save\] a folder this manager still "
                       r"saves in: another CheckpointManager of this process has saved in .* since .*; received: "
                       r"step 30"):
        first.save(30, model, opt)
    with pytest.raises(tz.CheckpointError, match=r"\.prune\] a folder this manager still saves in"):
        first.prune()
    assert _names(tmp_path) == ["step-000020", "step-000025"]  # nothing written, nothing pruned
    second.save(30, model, opt)
    second.wait()
    assert _names(tmp_path) == ["step-000025", "step-000030"]
    del second  # gone (a notebook's old trainer collected): the first may save there again
    gc.collect()
    first.save(40, model, opt)
    first.wait()
    assert _names(tmp_path) == ["step-000030", "step-000040"]


def test_a_manager_that_saved_then_lost_the_folder_does_not_prune_after_its_save(tmp_path):
    """A save under way when another manager takes the folder commits, and prunes nothing there
    with its own ``keep`` (the other's checkpoints are that one's to keep)."""
    model, opt = _mlp()
    first = tz.CheckpointManager(tmp_path, keep=1, async_save=False)
    second = tz.CheckpointManager(tmp_path, keep=3, async_save=False)
    first.save(1, model, opt)
    second.save(2, model, opt)
    second.save(3, model, opt)
    first._finish(first.path(1))  # (as a background save of the first committing after the other took over)
    assert _names(tmp_path) == ["step-000001", "step-000002", "step-000003"]


def test_a_save_that_keep_would_delete_at_once_is_refused(tmp_path):
    """Before: ``save(5)`` in a folder holding ``keep`` checkpoints of later steps committed and
    was deleted at once by its own prune: no error, no checkpoint."""
    model, opt = _mlp()
    mgr = tz.CheckpointManager(tmp_path, keep=2, async_save=False)
    for step in (10, 20):
        mgr.save(step, model, opt)
    with pytest.raises(tz.CheckpointError, match=r"\.save\] a step keep=2 keeps: .* holds 2 checkpoints of later "
                       r"steps, so this one would be deleted as soon as it is saved\. Move them aside first "
                       r"\(set_aside\(5\)\), or save in another dir; received: step 5; later: step-000010, "
                       r"step-000020"):
        mgr.save(5, model, opt)
    mgr.save(15, model, opt)  # one later checkpoint: kept beside it
    assert _names(tmp_path) == ["step-000015", "step-000020"]
    moved = mgr.set_aside(5)
    assert len(moved) == 2
    mgr.save(5, model, opt)
    assert _names(tmp_path) == ["abandoned", "step-000005"]


def test_a_manager_refuses_a_folder_another_live_process_trains_in(tmp_path):
    """Before: a manager in one process saved and pruned (``keep``) in the folder that another
    process's ``Trainer.fit`` or ``tilegraph train`` held, deleting that run's checkpoints."""
    model, opt = _mlp()
    (tmp_path / ".tilegraph.lock").write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                                          "by": "tilegraph.Trainer.fit"}))
    mgr = tz.CheckpointManager(tmp_path, keep=1, async_save=False)
    with pytest.raises(tz.CheckpointError, match=r"\.save\] a folder no other run is using: .* is in use by "
                       rf"tilegraph\.Trainer\.fit \(pid {os.getppid()} on .*\), whose checkpoints"):
        mgr.save(1, model, opt)
    assert _names(tmp_path) == []
    (tmp_path / ".tilegraph.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                                          "by": "tilegraph.Trainer.fit"}))
    mgr.save(1, model, opt)  # this process's own fit holds it: its manager saves
    assert _names(tmp_path) == ["step-000001"]


def test_a_trainer_made_again_on_its_folder_saves_and_resumes(tmp_path):
    """A notebook cell run again: a second Trainer on the first's checkpoint_dir, resumed from
    its newest checkpoint, saves and prunes there (its manager takes the folder); the first
    trainer's manager, if fitting again, is refused rather than pruning the second's."""
    from conftest import mse, regression_data

    def trainer(folder=tmp_path):
        model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
        return tg.Trainer(model, opt, regression_data(0, 32), None, loss_fn=mse, progress=False,
                          checkpoint_dir=folder, checkpoint_every=2, checkpoint_keep=2)

    first = trainer()
    first.fit(4)
    second = trainer()
    second.load_checkpoint(tmp_path / "step-000004")
    res = second.fit(4)
    assert _names(tmp_path) == ["step-000006", "step-000008"]
    want = trainer(tmp_path / "alone").fit(8)
    np.testing.assert_allclose(res.losses, want.losses[4:], rtol=1e-6)
    with pytest.raises(tz.CheckpointError, match=r"another CheckpointManager of this process has saved"):
        first.checkpoints.save(10, first.model, first.optimizer)


# -- a worker started again by its nanny at the same address -------------------------------------

def _dp_trainer(rt, **kw):
    """The README's first MLP, data parallel over the runtime's workers (a gang step each)."""
    from conftest import mse, regression_data

    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    return tg.Trainer(model, opt, regression_data(0, 64), rt, loss_fn=mse, progress=False, steps_per_graph=1,
                      parallel="tiles" if rt is None else "data", **kw)


@pytest.mark.distributed
def test_a_gang_step_reads_from_a_worker_whose_process_changed_at_its_address(own_runtime, monkeypatch):
    """A worker its nanny starts again at the same address (``dask worker --worker-port``, a job
    scheduler's fixed ports) keeps its address and gets a new process, while the runtime keeps
    the pid it asked once. Before: every gang step after it failed ("waiting for values of channel
    ...: its writer, worker process N, is gone", N the old pid), also after load_checkpoint, so
    training never went on on that cluster. Now a reader whose writer's process is gone asks that
    worker for its process and reads from it. (The stale pid is given here as the runtime
    would keep it; the slow test below restarts a worker for real.)"""
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    victim = sorted(own_runtime.workers())[1]
    real = own_runtime.gang_identities
    monkeypatch.setattr(own_runtime, "gang_identities", lambda addrs: {
        a: (v[0], v[1], dead.pid, v[3]) if a == victim and v is not None else v for a, v in real(addrs).items()})
    monkeypatch.setattr(tg.config, "exchange", "gang")
    got = _dp_trainer(own_runtime).fit(3)
    want = _dp_trainer(None).fit(3)
    np.testing.assert_allclose(got.losses, want.losses, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_training_resumes_on_a_worker_restarted_at_its_fixed_port(tmp_path):
    """The same with a real cluster: a scheduler and two ``dask worker --worker-port`` processes,
    one restarted by its nanny between fits (its state gone with it); load_checkpoint and fit go
    on with the losses of an uninterrupted run. Before: "the cluster lost tasks or data of step 3
    (no worker was found missing) ... ChannelWaitError: ... worker process N, is gone"."""
    import socket
    import subprocess
    import time

    from conftest import stop_process

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    sf = tmp_path / "s.json"
    procs = [subprocess.Popen(["dask", "scheduler", "--scheduler-file", str(sf), "--no-dashboard", "--port", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 60
        while not sf.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(2):
            procs.append(subprocess.Popen(["dask", "worker", "--scheduler-file", str(sf), "--nthreads", "1",
                                           "--worker-port", str(free_port()), "--no-dashboard",
                                           "--memory-limit", "2GB"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        rt = tg.connect(scheduler_file=str(sf), make_current=False)
        try:
            rt.client.wait_for_workers(2, timeout=60)
            trainer = _dp_trainer(rt, checkpoint_dir=tmp_path / "ck", checkpoint_every=2)
            first = trainer.fit(2).losses
            victim = sorted(rt.workers())[1]
            before = rt.client.run(os.getpid)[victim]
            rt.client.restart_workers([victim])
            rt.client.wait_for_workers(2, timeout=60)
            assert victim in rt.workers() and rt.client.run(os.getpid)[victim] != before
            trainer.load_checkpoint(tmp_path / "ck" / "step-000002")
            then = trainer.fit(2).losses
        finally:
            rt.close()
    finally:
        for p in procs[::-1]:
            stop_process(p)
    want = _dp_trainer(None).fit(4)
    np.testing.assert_allclose(first + then, want.losses, rtol=1e-5)
