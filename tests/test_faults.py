"""Losing a worker mid-training: a clear error naming the worker and the steps, never a hang, and
with ``restart_on_failure`` a restart from the last checkpoint on the workers left.

Each test starts its own embedded cluster of 2 worker processes (a killed or stopped worker must
not leak into other tests) and kills (SIGKILL) or stops (SIGSTOP) the worker process that holds
the model's state. The model is the README's first MLP: its step is a few milliseconds of
estimated work, far below ``tg.config.min_process_seconds``, so the plan keeps all of it on one
worker, which then holds every parameter and optimizer state tile: that is the worker to lose
(``_state_worker`` finds it from the parameters' futures).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import tilegraph as tg
import tilegraph._health
from conftest import fake_hosts, mse, stop_process
from tilegraph.trainer import STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_MIN, StepTimeoutError, WorkerLostError


class Cluster:
    """An embedded 2-worker cluster whose worker processes a test may kill or stop."""

    def __init__(self):
        self.rt = tg.connect(n_workers=2, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
        self.pids = self.rt.client.run(os.getpid)  # worker address -> process id
        self.stopped: list[int] = []

    def kill(self, addr: str) -> None:
        os.kill(self.pids[addr], signal.SIGKILL)

    def stop(self, addr: str) -> None:
        self.stopped.append(self.pids[addr])
        os.kill(self.pids[addr], signal.SIGSTOP)

    def close(self) -> None:
        for pid in self.stopped:  # a stopped process would outlive the cluster
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.rt.close()


@pytest.fixture
def cluster():
    c = Cluster()
    try:
        yield c
    finally:
        c.close()


def _data(step):
    x = np.random.default_rng(step).standard_normal((256, 16)).astype(np.float32)
    return x, np.tanh(x[:, :4])


def _trainer(rt, steps, **kw):
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-2, 4, steps))
    return tg.Trainer(model, opt, _data, rt, loss_fn=mse, batch_size=256, batch_tiles=[(64, 8), (64, None)],
                      progress=False, **kw)


def _state_worker(rt, optimizer) -> str:
    """The worker holding the parameters (waits for the step that computes them)."""
    from distributed import wait

    futures = [c.value.future for p in optimizer.params for c in p.cells.flat if hasattr(c.value, "future")]
    wait(futures)
    held = {w for ws in rt.client.who_has(futures).values() for w in ws}
    assert len(held) == 1, held  # the tiny plan keeps everything on one worker (module docstring)
    return held.pop()


def _lose_at(cluster, step: int, how: str):
    """An on_step hook that kills or stops the state's worker once ``step`` has finished."""
    lost = {}

    def hook(trainer, stats):
        if not lost and len(trainer.history) >= step:  # one metrics record per finished step
            addr = _state_worker(cluster.rt, trainer.optimizer)
            lost.update(addr=addr, at=time.perf_counter())
            if how == "kill":
                cluster.kill(addr)
            else:
                cluster.stop(addr)
    return hook, lost


@pytest.mark.distributed
def test_killed_worker_ends_training_with_a_clear_error(cluster):
    # one step per graph, one at a time: the step after the kill is the one that fails
    hook, lost = _lose_at(cluster, 5, "kill")
    trainer = _trainer(cluster.rt, 20, steps_per_graph=1, pipeline=False, on_step=[hook])
    with pytest.raises(WorkerLostError) as info:
        trainer.fit(20)
    msg = str(info.value)
    assert msg.startswith("[tilegraph.") and re.search(rf"lost worker {re.escape(lost['addr'])} \(left the cluster: its "
                                                      r"(process ended|connection to the scheduler closed).*\) while "
                                                      r"step 6 ran", msg), msg
    assert "Trainer.load_checkpoint" in msg and "restart_on_failure=True" in msg and "; received: " in msg
    assert info.value.workers == [lost["addr"]] and info.value.steps == range(6, 7)
    assert time.perf_counter() - lost["at"] < 5.0
    assert [r["step"] for r in trainer.history] == [1, 2, 3, 4, 5]


@pytest.mark.distributed
@pytest.mark.slow
def test_stopped_worker_is_named_within_the_deadline(cluster):
    # SIGSTOP keeps the worker's connections open: Dask alone would wait for its worker-ttl. The
    # trainer's "auto" limit (at least STEP_TIMEOUT_MIN for these millisecond steps) passes, the
    # worker has sent no heartbeat for STALL_SECONDS: the error names it.
    hook, lost = _lose_at(cluster, 5, "stop")
    trainer = _trainer(cluster.rt, 20, steps_per_graph=1, pipeline=False, on_step=[hook])
    with pytest.raises(WorkerLostError) as info:
        trainer.fit(20)
    elapsed = time.perf_counter() - lost["at"]
    assert re.search(rf"lost worker {re.escape(lost['addr'])} \(no heartbeat for \d+ s: stopped, hung or cut off from the network\) while "
                     r"step 6 ran; parameters and optimizer state live on the workers", str(info.value)), info.value
    assert info.value.stalled == [lost["addr"]] and info.value.steps == range(6, 7)
    # the "auto" limit grows with the slowest recent step (a loaded machine's steps can pass 1 s)
    deadline = max(STEP_TIMEOUT_MIN, tilegraph._health.STALL_SECONDS,
                   STEP_TIMEOUT_FACTOR * max(trainer._recent, default=0.0))
    assert deadline - 0.5 < elapsed < deadline + 4.0, (elapsed, deadline)


@pytest.mark.distributed
def test_busy_workers_run_past_a_step_timeout(cluster):
    # every worker answers but its only thread sleeps: a number of seconds ends the step with
    # StepTimeoutError ("auto" would wait on); nobody is named lost
    client = cluster.rt.client
    sleeps = []

    def block(trainer, stats):
        if len(trainer.history) == 3:
            sleeps.extend(client.submit(time.sleep, 5, workers=[a], pure=False) for a in cluster.pids)
            time.sleep(0.2)  # let the sleeps start before the next step is submitted
            block.at = time.perf_counter()

    trainer = _trainer(cluster.rt, 20, steps_per_graph=1, pipeline=False, on_step=[block], step_timeout=2)
    # the limit passes at 2 s; the workers are checked first (their heartbeats, 0.5 s apart, can
    # each take another look under load), so the error comes a little after it
    with pytest.raises(StepTimeoutError, match=r"\[tilegraph.TrainStep\] step 4 did not finish in time, and every "
                                               r"worker answers .*; received: no result after (\d+\.\d) s \(time "
                                               r"limit 2\.0 s\)") as info:
        trainer.fit(20)
    waited = float(re.search(r"no result after (\d+\.\d) s", str(info.value)).group(1))
    assert 2.0 <= waited < 5.0 and 1.8 < time.perf_counter() - block.at < 6.0, (waited, info.value)


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_step_without_a_time_limit_names_a_lost_worker(cluster, how, monkeypatch):
    # a TrainStep called as a first program does (no Trainer, so no time limit): the worker
    # killed, or stopped (SIGSTOP: its connections stay open, and Dask alone would wait for its
    # worker-ttl, a minute here), ends the next step with a WorkerLostError naming it; a worker
    # silent for 3 s counts as stalled here (10 s by default)
    monkeypatch.setattr(tilegraph._health, "STALL_SECONDS", 3.0)
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(64, 8), (64, None)], runtime=cluster.rt)
    losses = [step(*_data(i)) for i in (1, 2)]
    addr = _state_worker(cluster.rt, opt)
    (cluster.kill if how == "kill" else cluster.stop)(addr)
    t0 = time.perf_counter()
    with pytest.raises(WorkerLostError) as info:
        step(*_data(3))
    elapsed = time.perf_counter() - t0
    why = (r"left the cluster: its (process ended|connection to the scheduler closed).*" if how == "kill"
           else r"no heartbeat for \d+ s: stopped, hung or cut off from the network")
    assert re.match(rf"\[tilegraph.TrainStep\] lost worker {re.escape(addr)} \({why}\) while step 3 ran; parameters "
                    r"and optimizer state live on the workers", str(info.value)), info.value
    assert info.value.workers == [addr] and info.value.steps == range(3, 4) and np.isfinite(losses).all()
    # killed: at once; stopped: 3 s of silence, seen at the next look (every 2 s)
    assert elapsed < (5.0 if how == "kill" else 12.0), elapsed


@pytest.mark.distributed
def test_a_patient_step_waits_on_busy_workers(cluster, caplog):
    # PendingStep.result(timeout, patient=True) (the Trainer's "auto"): past the limit, with every
    # worker answering, it logs and waits on, and the step completes
    trainer = _trainer(cluster.rt, 4)
    step = trainer.step
    for i in (1, 2):
        step(*_data(i))
    sleeps = [cluster.rt.client.submit(time.sleep, 3, workers=[a], pure=False) for a in cluster.pids]
    time.sleep(0.2)
    pending = step.submit(*_data(3))
    with caplog.at_level("WARNING", logger="tilegraph"):
        loss = pending.result(timeout=1.0, patient=True)
    assert np.isfinite(loss) and pending.steps == range(3, 4) and len(sleeps) == 2
    assert re.search(r"step 3 still running after \d s \(time limit 1 s\); every worker answers, waiting on",
                     caplog.text), caplog.text


@pytest.mark.distributed
def test_restart_on_failure_resumes_from_the_last_checkpoint(cluster, tmp_path, caplog):
    # pipelined, several steps per graph (groups 1-4, 5-8, 9-12 end at the checkpoints): the kill
    # after step 6 loses the group 5-8; training resumes from step-000004 on the workers left
    hook, lost = _lose_at(cluster, 6, "kill")
    trainer = _trainer(cluster.rt, 12, checkpoint_dir=tmp_path / "ck", checkpoint_every=4, restart_on_failure=True,
                       on_step=[hook], log_dir=tmp_path / "log")
    with caplog.at_level("WARNING", logger="tilegraph"):
        res = trainer.fit(12)
    ck = tmp_path / "ck" / "step-000004"
    assert res.restarts == [{"failed": [5, 8], "workers": [lost["addr"]], "checkpoint": str(ck), "step": 4}]
    assert f"lost worker(s) {lost['addr']} while steps 5-8 ran; resuming from checkpoint {ck} (step 4)" in caplog.text
    assert res.steps == 12 and len(res.losses) == 12 and trainer.optimizer.step_count == 12
    assert [r["step"] for r in trainer.history if "loss" in r] == [*range(1, 7), *range(5, 13)]
    assert lost["addr"] not in cluster.rt.workers()
    # an uninterrupted run from the same checkpoint, on this cluster, gives the same losses and
    # weights: the same float32 arithmetic in the same order (the plan keeps each step on one
    # worker), so equal to float32 rounding; asserted within 1e-6 relative
    ref = _trainer(cluster.rt, 12)
    assert ref.load_checkpoint(ck) == 4
    want = ref.fit(8)
    np.testing.assert_allclose(res.losses[4:], want.losses, rtol=1e-6)
    with cluster.rt.as_current():
        got, expect = trainer.model.state_dict(), ref.model.state_dict()
    for k, v in expect.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


@pytest.mark.distributed
@pytest.mark.parametrize("hosts", [1, 2])
def test_restart_on_failure_of_a_sharded_gang_plan(cluster, tmp_path, caplog, hosts, monkeypatch):
    """A data-parallel plan (each worker process a share of the batch, the steps as one gang task
    per process; with 2 "hosts" its values go over the workers' comms): one process killed after
    step 6, training resumes from step 4's checkpoint on the workers there are then, and the
    steps after it equal an uninterrupted run from that checkpoint on the same cluster."""
    addrs = sorted(cluster.pids)
    if hosts == 2:  # each worker on a host of its own
        fake_hosts(monkeypatch, cluster.rt)
    lost = {}

    def hook(trainer, stats):
        if not lost and len(trainer.history) >= 6:
            lost.update(addr=addrs[1], at=time.perf_counter(),
                        gangs=[e.gang and e.gang.specs[0].shared[1] for e in trainer.step.executables])
            cluster.kill(addrs[1])

    trainer = _trainer(cluster.rt, 12, steps_per_graph=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=4,
                       restart_on_failure=True, on_step=[hook], parallel="sharded")
    with caplog.at_level("WARNING", logger="tilegraph"):
        res = trainer.fit(12)
    assert lost["gangs"] == [hosts == 1]  # the plan that lost its worker ran as gangs (shared memory, or comms: False)
    ck = tmp_path / "ck" / "step-000004"
    assert len(res.restarts) == 1 and res.restarts[0]["workers"] == [lost["addr"]], res.restarts
    assert res.restarts[0]["checkpoint"] == str(ck) and res.restarts[0]["step"] == 4
    assert res.steps == 12 and len(res.losses) == 12 and trainer.optimizer.step_count == 12
    assert time.perf_counter() - lost["at"] < 60.0
    ref = _trainer(cluster.rt, 12, steps_per_graph=1, parallel="sharded")
    assert ref.load_checkpoint(ck) == 4
    want = ref.fit(8)
    # the restart planned for the workers it found (the replacement of the lost one may have
    # joined by then or not), the reference for those there now: one process's sums or two's
    np.testing.assert_allclose(res.losses[4:], want.losses, rtol=1e-4)


@pytest.mark.distributed
def test_a_restart_goes_on_with_the_lost_workers_replacement(cluster, tmp_path):
    """The embedded cluster's nanny starts a killed worker again within seconds: the restart waits
    for it, so training goes on over two worker processes, and the next fit too (before: on the
    one left, for good, although the replacement had joined)."""
    addrs = sorted(cluster.pids)
    lost = {}

    def hook(trainer, stats):
        if not lost and len(trainer.history) >= 6:
            lost.update(addr=addrs[1])
            cluster.kill(addrs[1])

    trainer = _trainer(cluster.rt, 16, steps_per_graph=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=4,
                       restart_on_failure=True, on_step=[hook], parallel="sharded")
    res = trainer.fit(12)
    assert len(res.restarts) == 1 and res.restarts[0]["workers"] == [lost["addr"]], res.restarts
    workers = set(cluster.rt.workers())
    assert len(workers) == 2 and lost["addr"] not in workers
    for exe in trainer.step.executables:
        assert exe.parallel_summary().startswith("sharded over 2 worker processes"), exe.parallel_summary()
        assert set(exe.workers.memory_limits) == workers
    trainer.fit(4)
    assert all(e.parallel_summary().startswith("sharded over 2 worker processes") for e in trainer.step.executables)


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["sharded", "data", "zero3"])
def test_a_fit_plans_again_for_workers_that_joined(cluster, parallel):
    """A worker that joined after the last fit is used by the next one (the recorded plans were
    for the workers there were), and the steps go on as those of a run on the first workers."""
    rt = cluster.rt
    want = _trainer(rt, 8, steps_per_graph=1, parallel=parallel).fit(8).losses
    trainer = _trainer(rt, 8, steps_per_graph=1, parallel=parallel)
    got = trainer.fit(4).losses
    assert [e.parallel_summary().split(" (")[0].split(",")[0] for e in trainer.step.executables] == \
        [f"{parallel} over 2 worker processes"]
    # a worker started by hand (a batch job's), as tilegraph's declare their threads
    worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", rt.address, "--nthreads", "1",
                               "--resources", "CPU=1", "--no-dashboard", "--host", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        rt.client.wait_for_workers(3, timeout=60)
        got += trainer.fit(4).losses
        assert [e.parallel_summary().split(" (")[0].split(",")[0] for e in trainer.step.executables] == \
            [f"{parallel} over 3 worker processes"]
    finally:
        stop_process(worker)
    np.testing.assert_allclose(got, want, rtol=1e-4)  # (sums over 3 processes' shares, not 2: rounding)


@pytest.mark.distributed
def test_restart_on_failure_of_a_zero3_plan(cluster, tmp_path, caplog):
    """"zero3" keeps each parameter tile on one worker alone: the worker killed after step 6
    takes its share of the parameters with it, and training resumes from step 4's checkpoint as
    an uninterrupted run from that checkpoint does."""
    addrs = sorted(cluster.pids)
    lost = {}

    def hook(trainer, stats):
        if not lost and len(trainer.history) >= 6:
            lost.update(addr=addrs[1], strategies=[e.strategy for e in trainer.step.executables])
            cluster.kill(addrs[1])

    trainer = _trainer(cluster.rt, 12, steps_per_graph=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=4,
                       restart_on_failure=True, on_step=[hook], parallel="zero3")
    with caplog.at_level("WARNING", logger="tilegraph"):
        res = trainer.fit(12)
    assert lost["strategies"] == ["zero3"]
    ck = tmp_path / "ck" / "step-000004"
    assert len(res.restarts) == 1 and res.restarts[0]["workers"] == [lost["addr"]], res.restarts
    assert res.restarts[0]["checkpoint"] == str(ck) and res.restarts[0]["step"] == 4
    assert res.steps == 12 and len(res.losses) == 12 and trainer.optimizer.step_count == 12
    ref = _trainer(cluster.rt, 12, steps_per_graph=1, parallel="zero3")
    assert ref.load_checkpoint(ck) == 4
    np.testing.assert_allclose(res.losses[4:], ref.fit(8).losses, rtol=1e-4)


@pytest.mark.distributed
@pytest.mark.slow
def test_restart_on_failure_restarts_a_stopped_worker(cluster, tmp_path, monkeypatch):
    # a worker silent for 3 s counts as stalled here (10 s by default), with a 5 s step limit;
    # its nanny restarts it (~5 s: the nanny's kill of a stopped process times out first), and
    # training resumes from the checkpoint of step 4. Pipelined: the stop after step 6 catches
    # step 7 or 8 in flight
    monkeypatch.setattr(tilegraph._health, "STALL_SECONDS", 3.0)
    hook, lost = _lose_at(cluster, 6, "stop")
    trainer = _trainer(cluster.rt, 10, steps_per_graph=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=4,
                       restart_on_failure=True, on_step=[hook], step_timeout=5)
    res = trainer.fit(10)
    assert len(res.restarts) == 1 and res.restarts[0]["workers"] == [lost["addr"]]
    assert res.restarts[0]["step"] == 4 and res.restarts[0]["failed"][0] in (7, 8)
    assert res.steps == 10 and np.isfinite(res.losses).all()
    assert lost["addr"] not in cluster.rt.workers()
    # detection (3-5 s), the nanny's kill (~4 s), a fresh worker process, a re-plan, 6 steps and
    # their checkpoints: ~12-15 s on an idle machine
    assert time.perf_counter() - lost["at"] < 60.0


@pytest.mark.distributed
def test_restart_on_failure_without_a_checkpoint_yet_fails_clearly(cluster, tmp_path):
    hook, lost = _lose_at(cluster, 3, "kill")
    trainer = _trainer(cluster.rt, 8, steps_per_graph=1, pipeline=False, checkpoint_dir=tmp_path / "ck",
                       checkpoint_every=6, restart_on_failure=True, on_step=[hook])
    with pytest.raises(WorkerLostError) as info:
        trainer.fit(8)
    assert re.match(rf"\[tilegraph.Trainer.fit\] lost worker {re.escape(lost['addr'])} \(left the cluster.*\) while "
                    r"step 4 ran; .*; restart_on_failure has no checkpoint to resume from", str(info.value)), info.value


def test_fault_options_are_checked(tmp_path):
    for bad, got in ((0, "0"), (float("inf"), "inf"), ("5", "'5'")):
        with pytest.raises(tg.TileError, match=r"step_timeout must be 'auto', None \(no limit\) or a finite number "
                                               rf"of seconds > 0; received: {got}"):
            _trainer(None, 4, step_timeout=bad)
    with pytest.raises(tg.TileError, match=r"restart_on_failure resumes from checkpoints: it needs a checkpoint_dir"):
        _trainer(None, 4, restart_on_failure=True)
    assert _trainer(None, 4, restart_on_failure=True, checkpoint_dir=tmp_path).max_restarts == 3


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_compute_on_a_lost_worker_ends_with_a_clear_error(cluster, how):
    # tg.compute (and evaluations) watch their wait as training does: the worker running the
    # task killed, or stopped (SIGSTOP), ends tg.compute naming it instead of hanging
    import threading

    x = tg.from_numpy(np.random.default_rng(0).standard_normal((1500, 1500)).astype(np.float32))
    y = x
    for _ in range(40):  # seconds of work in one task
        y = (y @ x) * 1e-3
    lost = {}

    def lose():
        deadline = time.perf_counter() + 20
        while not lost and time.perf_counter() < deadline:
            busy = [a for a, keys in cluster.rt.client.processing().items() if keys]
            if busy:
                lost["addr"] = busy[0]
                (cluster.kill if how == "kill" else cluster.stop)(busy[0])
            time.sleep(0.05)

    t0 = time.perf_counter()
    threading.Thread(target=lose, daemon=True).start()
    with cluster.rt.as_current(), pytest.raises(WorkerLostError) as info:
        tg.compute(y.sum())
    assert time.perf_counter() - t0 < 40
    msg = str(info.value)
    assert msg.startswith(f"[tilegraph.compute] lost worker {lost['addr']}") and "tilegraph.compute ran" in msg
    assert ("no heartbeat" in msg) == (how == "stop")
