"""Soak guards: what a long run holds stays bounded, step after step.

Measured on the 2-core development machine (embedded cluster; a tiny MLP's ``TrainStep`` loop of
5,000 steps on 1 and on 2 workers, "data" parallel on 2; ``Trainer.fit`` of 3,000 steps with an
evaluation and a checkpoint every 100 steps; 200 ``fit(10)`` calls on one trainer;
``tilegraph train`` for 4,000 steps on 1 worker and 2,400 "data" parallel on 2), sampled every
200-250 steps:

- the scheduler held 2-17 tasks and the client as many futures (202-205 for the debug GPT-2
  "data" parallel: its weights and optimizer state on both workers), never more with the steps;
- each worker held 2-11 task records, 20-22 file descriptors and 3-5 threads, the same at the
  last sample as at the first; the client's descriptors rose by 2 to 6 in the first hundreds of
  steps (connections and files opened once: the loss plot's fonts) and not after, its threads
  not at all; its resident memory rose by 7-13 MB over 4,000-5,000 steps (Dask's cache of key
  names, its spans until the bound of ``SPANS_KEPT``, and ``Trainer.history``: ~460 B a step,
  kept on purpose) and by ~70 MB over the first 150 of 200 short fits, then stayed (matplotlib
  and the allocator: drawing the plot 200 times in a bare process grows it by 30 MB, then flat);
- the step rate did not drift (``tilegraph train``: 14.9 ms per step over the first 200 steps,
  12.5 ms over the last; "data" parallel 16.8 and 17.5); the shared-memory files of a "data"
  step's gangs were reused, not added to; nothing was left in /tmp or /dev/shm after a run;
- ``loss.png`` took 0.16-0.33 s to draw at 400 and at 4,000 steps alike (1.8 s at 400,000
  records, which ``PLOT_INTERVAL_FACTOR`` spaces 37 s apart); the checkpoint folder held the
  newest ``checkpoint_keep`` checkpoints, each of the same size.

The bounds below leave a wide margin over those numbers, and catch what grows by one per step
(or per graph, per evaluation, per checkpoint, per fit): that adds 100 and more between the two
samples of each test.
"""

import os

import numpy as np
import psutil
import pytest

import tilegraph as tg
from conftest import mse

pytestmark = pytest.mark.distributed

#: tasks the scheduler, and futures the client, may hold at any sample of a tiny MLP's loop
#: (measured: at most 17)
HELD = 40
#: client file descriptors that may open between the two samples (measured: 0-2 after the first
#: hundred steps; the first of them open lazily, which the first sample comes after)
CLIENT_FDS_OPENED = 4
#: worker task records at any sample (measured: at most 11)
WORKER_TASKS = 30


def _worker_state(dask_worker) -> dict:
    import os

    import psutil

    shm = f"/dev/shm/tilegraph-{os.getpid()}"  # a "data" step's gang files (tilegraph.exec.shm)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": psutil.Process().num_threads(),
            "tasks": len(dask_worker.state.tasks), "shm_files": len(os.listdir(shm)) if os.path.isdir(shm) else 0}


def _scheduler_tasks(dask_scheduler) -> int:
    return len(dask_scheduler.tasks)


def _sample(rt, step: int) -> dict:
    client = rt.client
    return {"step": step, "tasks": client.run_on_scheduler(_scheduler_tasks), "futures": len(client.futures),
            "fds": len(os.listdir("/proc/self/fd")), "threads": psutil.Process().num_threads(),
            "workers": client.run(_worker_state)}


def _assert_bounded(first: dict, last: dict, samples: list) -> None:
    """What the client, the scheduler and each worker hold at ``last`` against ``first``."""
    report = "\n".join(map(str, samples))
    assert max(s["tasks"] for s in samples) <= HELD, report
    assert max(s["futures"] for s in samples) <= HELD, report
    assert last["fds"] - first["fds"] <= CLIENT_FDS_OPENED, report
    assert last["threads"] <= first["threads"] + 1, report
    assert last["workers"].keys() == first["workers"].keys(), report  # (no worker replaced meanwhile)
    for addr, w in last["workers"].items():
        w0 = first["workers"][addr]
        assert w["fds"] <= w0["fds"] + 2, report
        assert w["threads"] <= w0["threads"] + 1, report
        assert w["tasks"] <= WORKER_TASKS, report
        assert w["shm_files"] <= w0["shm_files"] + 2, report


def _batch(step: int):
    x = np.random.default_rng(step).standard_normal((32, 16)).astype(np.float32)
    return x, np.tanh(x[:, :4])


@pytest.mark.parametrize("parallel", ["tiles", "data"])
def test_a_train_step_loop_holds_as_much_at_step_300_as_at_step_100(embedded_runtime, parallel):
    """A plain ``TrainStep`` loop, a new batch each step, on 2 workers: tasks, futures, file
    descriptors, threads and shared-memory files do not grow with the steps."""
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(16, 8), (16, None)], runtime=embedded_runtime,
                        parallel=parallel)
    samples = []
    for i in range(1, 301):
        loss = step(*_batch(i))
        if i in (100, 200, 300):
            samples.append(_sample(embedded_runtime, i))
    assert np.isfinite(loss)
    _assert_bounded(samples[0], samples[-1], samples)


def test_a_fit_with_evaluations_and_checkpoints_holds_as_much_at_step_400_as_at_step_100(embedded_runtime,
                                                                                         tmp_path):
    """``Trainer.fit`` as a long run has it: a graph per step, an evaluation and an asynchronous
    checkpoint every 50 steps, the metrics log; only ``checkpoint_keep`` checkpoints stay."""
    samples = []

    def sample(trainer, stats):
        step = trainer.history[-1]["step"]
        if step in (100, 250, 400):
            samples.append(_sample(embedded_runtime, step))

    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = tg.Trainer(model, opt, _batch, embedded_runtime, loss_fn=mse, batch_size=32,
                         eval_data=lambda i: _batch(10**6 + i), eval_every=50, eval_batches=2, log_dir=tmp_path,
                         checkpoint_every=50, checkpoint_dir=tmp_path / "ck", checkpoint_keep=2, progress=False,
                         steps_per_graph=1, on_step=[sample])
    res = trainer.fit(400)
    assert res.steps == 400 and np.isfinite(res.losses).all()
    assert [s["step"] for s in samples] == [100, 250, 400]
    _assert_bounded(samples[0], samples[-1], samples)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000350", "step-000400"]
    with open(tmp_path / "metrics.jsonl") as f:
        assert sum(1 for _ in f) == 400 + 400 // 50  # a record per step and per evaluation


def test_many_short_fits_on_one_trainer_leave_nothing_behind(embedded_runtime, tmp_path):
    """An epoch loop: 30 ``fit(5)`` calls on one trainer, each drawing loss.png and writing a
    checkpoint at its end. Each fit opens and closes the metrics log and its folder locks, and
    starts and stops its helper threads: none of them stays."""
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = tg.Trainer(model, opt, _batch, embedded_runtime, loss_fn=mse, batch_size=32,
                         eval_data=lambda i: _batch(10**6 + i), eval_every=5, eval_batches=1, log_dir=tmp_path,
                         checkpoint_every=5, checkpoint_dir=tmp_path / "ck", checkpoint_keep=2, progress=False)
    samples = []
    for fit in range(1, 31):
        trainer.fit(5)
        if fit in (10, 20, 30):
            samples.append(_sample(embedded_runtime, 5 * fit))
    _assert_bounded(samples[0], samples[-1], samples)
    # between fits only the model's and optimizer's values are held (measured: 3 futures after
    # each fit): one future kept per fit would add 10 between two samples
    assert max(s["futures"] for s in samples) <= samples[0]["futures"] + 5, samples
    assert len(trainer.history) == 30 * (5 + 1)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000145", "step-000150"]  # no lock left
    assert not (tmp_path / ".tilegraph.lock").exists()
