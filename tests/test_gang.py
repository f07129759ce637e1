"""Gang steps: a data-parallel call as one task per worker process, the values between them going
through shared-memory channels (tilegraph.exec.gang, tilegraph.parallel.gang)."""

import os
import re
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
from dask.utils import key_split

import tilegraph as tg
from conftest import fake_hosts, fresh_transfer_logs
from tilegraph.exec import shm
from tilegraph.exec.gang import channel_path, read_channel, write_channel

needs_shm = pytest.mark.skipif(shm.shm_domain() is None, reason="no writable /dev/shm on this machine")


@needs_shm
def test_a_channel_carries_arrays_of_any_layout_once():
    values = (np.arange(300_000, dtype=np.float32).reshape(600, 500),
              np.asfortranarray(np.arange(600, dtype=np.float64).reshape(20, 30)),
              np.arange(30, dtype=np.int64)[::3],  # not contiguous
              np.asarray(2.5, np.float32), np.float64(-1.25), np.zeros((0, 3), np.float32), np.array([True, False]))
    name = f"test-{uuid.uuid4().hex}"
    size = write_channel(name, values)
    path = channel_path(os.getpid(), name)
    assert os.path.getsize(path) == size >= sum(np.asarray(v).nbytes for v in values)
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]  # renamed once complete
    got = read_channel(name, os.getpid(), timeout=5.0)
    assert not os.path.exists(path)  # out of its name once mapped: a channel is read once
    assert len(got) == len(values)
    for a, b in zip(got, values):
        b = np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert all(a.ctypes.data % 64 == 0 for a in got if a.size)
    got[0][0, 0] = -1.0  # private copy-on-write pages
    assert got[0][0, 0] == -1.0 and values[0][0, 0] == 0.0
    with pytest.raises(TypeError, match=r"channel bad: .* NumPy arrays .* dict"):
        write_channel("bad", (np.ones(2), {"a": 1}))


@needs_shm
def test_a_channel_file_is_written_over_only_once_its_reader_is_done():
    import gc

    from tilegraph.exec.gang import trim_pool

    trim_pool(0)
    first = (np.full((1000, 100), 1.0, np.float32),)
    write_channel("pool-a", first)
    inode = os.stat(channel_path(os.getpid(), "pool-a")).st_ino
    got = read_channel("pool-a", os.getpid(), timeout=5.0)
    view = got[0][10:20]  # a view keeps the mapping too
    del got
    gc.collect()
    write_channel("pool-b", (np.full((1000, 100), 2.0, np.float32),))  # same size: the first file is still read
    assert os.stat(channel_path(os.getpid(), "pool-b")).st_ino != inode
    second = read_channel("pool-b", os.getpid(), timeout=5.0)
    assert (view == 1.0).all()
    del view
    gc.collect()  # the first file is free now, and the next write of its size goes over it
    folder = os.path.dirname(channel_path(os.getpid(), "x"))
    assert [f for f in os.listdir(folder) if f.startswith("f-")]
    write_channel("pool-c", (np.full((1000, 100), 3.0, np.float32),))
    assert os.stat(channel_path(os.getpid(), "pool-c")).st_ino == inode
    third = read_channel("pool-c", os.getpid(), timeout=5.0)
    assert (third[0] == 3.0).all() and (second[0] == 2.0).all()
    del second, third
    gc.collect()
    assert len([f for f in os.listdir(folder) if f.startswith("f-")]) == 2
    trim_pool(0)
    assert not [f for f in os.listdir(folder) if f.startswith(("f-", "b-", "g-"))]


@needs_shm
def test_a_wait_for_a_channel_never_hangs():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=rf"channel nothing-here: its writer, worker process {gone.pid}, is gone"):
        read_channel("nothing-here", gone.pid, timeout=600.0)
    assert time.perf_counter() - t0 < 2.0
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"channel never-written: nothing came .* in 0.3 s .*exchange_timeout"):
        read_channel("never-written", os.getpid(), timeout=0.3)
    assert time.perf_counter() - t0 < 2.0


def test_comm_channel_mail_is_taken_once_and_dropped_once_its_call_ended():
    import asyncio

    from tilegraph.exec import comm_channel
    from tilegraph.exec.gang import PeerFailedError, failure_record

    values = (np.arange(6.0).reshape(2, 3), np.float32(2.5))
    assert asyncio.run(comm_channel._receive("c1-a", values)) == "OK"
    got = comm_channel.read("c1-a", "tcp://127.0.0.1:1", timeout=5.0)
    assert got is not None and len(got) == 2 and (got[0] == values[0]).all() and "c1-a" not in comm_channel._box
    asyncio.run(comm_channel._receive("c1-b", values))  # unread when its gang ends: dropped
    comm_channel.close("c1", max_age=600.0)
    assert "c1-b" not in comm_channel._box
    assert asyncio.run(comm_channel._receive("c1-c", values)) == "closed"  # late: dropped too
    assert "c1-c" not in comm_channel._box
    asyncio.run(comm_channel._receive("c2-a", error=failure_record(MemoryError("out of memory"))))
    with pytest.raises(PeerFailedError, match=r"channel c2-a: worker tcp://h:1 failed: MemoryError: out of memory") as e:
        comm_channel.read("c2-a", "tcp://h:1", timeout=5.0)
    assert type(e.value.first) is MemoryError and e.value.first.args == ("out of memory",)  # the writer's own error
    asyncio.run(comm_channel._receive("c3-a", values))  # a call whose gang never ran here: dropped when old
    comm_channel.close("c4", max_age=600.0)
    assert "c3-a" in comm_channel._box
    comm_channel.close("c4", max_age=0.0)
    assert "c3-a" not in comm_channel._box
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"channel c5-a: nothing came from worker tcp://h:1 in 0.3 s "
                                           r".*exchange_timeout_seconds"):
        comm_channel.read("c5-a", "tcp://h:1", timeout=0.3)
    assert time.perf_counter() - t0 < 2.0


def test_a_reader_learns_from_the_writers_worker_that_a_channel_will_not_come():
    """What the writer's worker answers a waiting reader, and the reason the reader then gives:
    nothing while the channel is neither sent nor its gang ended; after that, each way the values
    can fail to come."""
    import asyncio

    from tilegraph.exec import comm_channel

    class Worker:  # what _writer_gone asks: the scheduler, and the writer's worker (this process)
        class scheduler:
            @staticmethod
            async def ncores(workers):
                return {w: 1 for w in workers}

        class _Writer:
            def __getattr__(self, handler):
                async def call(**kw):
                    return await comm_channel._state(**kw)
                assert handler == comm_channel.STATE_HANDLER
                return call

        def rpc(self, addr):
            return self._Writer()

    def gone(name):
        return asyncio.run(comm_channel._writer_gone(Worker(), "tcp://w:1", name))

    assert gone("c8-a") is None  # may still come
    comm_channel._record("c8-a", "OK")
    assert gone("c8-a") == ("its writer, worker tcp://w:1, sent them and this worker answered that it took them in, "
                            "but they are not here (taken or dropped already)")
    comm_channel._record("c8-b", "closed")
    assert gone("c8-b").endswith("sent them after this worker had ended its part of this step")
    comm_channel._record("c8-c", "not delivered: CommClosedError: in <TCP (closed)>")
    assert gone("c8-c").endswith("could not send them: not delivered: CommClosedError: in <TCP (closed)>")
    assert gone("c8-d") is None
    comm_channel.close("c8", max_age=600.0)
    assert gone("c8-d") == "its writer, worker tcp://w:1, ended its part of this step without sending them"


def _read_from_nowhere():
    from tilegraph.exec import comm_channel

    t0 = time.perf_counter()
    try:
        comm_channel.read("c6-a", "tcp://127.0.0.1:9", timeout=600.0)
    except RuntimeError as e:
        return str(e), time.perf_counter() - t0
    return None


@pytest.mark.distributed
def test_a_wait_for_a_comm_channel_ends_when_its_writer_is_not_a_worker(embedded_runtime):
    message, took = embedded_runtime.client.submit(_read_from_nowhere, pure=False).result(timeout=60)
    assert "channel c6-a: its writer, worker tcp://127.0.0.1:9, is no longer one of the cluster's workers" in message
    assert took < 5.0


def _gpt2_step(runtime, strategy):
    from tilegraph import models

    model = models.build("gpt2-debug", seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 32))
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None), (2, None)],
                        runtime=runtime, parallel=strategy)
    return model, step, (ids, np.roll(ids, -1, axis=1))


def _state_futures(step):
    return [r.future for p in step.optimizer.params for c in p.cells.flat
            for r in (getattr(c.value, "replicas", ()) or (c.value,))]


def _tasks_then_gang(rt, monkeypatch):
    """The debug GPT-2's sharded step, 3 calls with the Dask-task exchange and 3 as gangs (each on
    a model of its own): ({exchange: losses}, the gang run's plan)."""
    runs = {}
    for exchange in ("tasks", "gang"):
        monkeypatch.setattr(tg.config, "exchange", exchange)
        _, step, batch = _gpt2_step(rt, "sharded")
        runs[exchange] = [step(*batch) for _ in range(3)]
        exe = step.plan(*batch)
        assert (exe.gang is not None) == (exchange == "gang")
    return runs, exe


def _running_gang(rt):
    """A sharded step of the debug GPT-2 that ran once as gangs: (step, batch, its plan)."""
    _, step, batch = _gpt2_step(rt, "sharded")
    step(*batch)
    exe = step.plan(*batch)
    assert exe.gang is not None
    return step, batch, exe


def _idle(rt, worker=None) -> bool:
    """Whether the workers (or ``worker``) run no task, waiting up to 30 s for it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = rt.client.processing()
        if not (busy.get(worker) if worker else any(busy.values())):
            return True
        time.sleep(0.05)
    return False


def _channel_files() -> int:
    """The channel files in this worker process's own shared-memory folder (not in every
    process's: another test's worker, killed, or another run on the machine leaves its own)."""
    folder = os.path.join(shm.SHM_ROOT, f"{shm._PREFIX}{os.getpid()}")
    return sum(f.startswith(("g-", ".g-")) for f in (os.listdir(folder) if os.path.isdir(folder) else ()))


def _mail() -> int:
    from tilegraph.exec import comm_channel

    return len(comm_channel._box)


@needs_shm
@pytest.mark.distributed
@pytest.mark.parametrize("strategy, hosts", [("data", 1), ("sharded", 1), ("data", 2), ("sharded", 2)])
def test_a_gang_step_is_one_task_per_process_and_equals_the_task_exchange(embedded_runtime, strategy, hosts,
                                                                         monkeypatch):
    """Each call runs as one task per worker process, on that process's worker; Dask moves
    nothing large between them; losses and parameters are bitwise those of the same plan run as
    Dask tasks; every channel is read and gone. On one host the channels are shared-memory
    files; between hosts (workers that share no /dev/shm) they go over the workers' comms."""
    from distributed import get_task_stream, wait

    client = embedded_runtime.client
    if hosts == 2:
        fake_hosts(monkeypatch, embedded_runtime)
    runs = {}
    for exchange in ("tasks", "gang"):
        monkeypatch.setattr(tg.config, "exchange", exchange)
        model, step, batch = _gpt2_step(embedded_runtime, strategy)
        losses = [step(*batch) for _ in range(2)]  # the second call sends the programs
        wait(_state_futures(step))
        fresh_transfer_logs(client)
        with get_task_stream(client) as ts:
            losses += [step(*batch) for _ in range(3)]
            wait(_state_futures(step))
        moved = sum(sum(t["total"] for t in log) for log in
                    client.run(lambda dask_worker: list(dask_worker.transfer_incoming_log)).values()) / 3
        with embedded_runtime.as_current():
            runs[exchange] = (losses, model.state_dict(), step.plan(*batch), ts.data, moved, model)
    losses, state, exe, stream, moved, model = runs["gang"]
    assert runs["tasks"][2].gang is None and exe.gang is not None and exe.strategy == strategy
    assert [list(spec.shared) for spec in exe.gang.specs] == [[True, hosts == 1], [hosts == 1, True]]
    assert losses == runs["tasks"][0]
    for k, v in runs["tasks"][1].items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    ran = [(t["key"], t["worker"]) for t in stream if t["key"].startswith("tg-gang-")]
    assert len(ran) == 3 * 2  # one per process per call
    for key, worker in ran:
        # the dashboard groups them under the phases of the step
        assert key_split(key) == "tg-gang-fwd-bwd-update", key
        assert worker == exe.gang.addrs[int(re.search(r"-p(\d+)-", key).group(1))], (key, worker)
    assert not [t["key"] for t in stream if t["key"].startswith(("tg-send-", "tg-receive-", "tg-push"))]
    params = sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in model.parameters())
    assert moved < 0.05 * params, (moved, params)  # batches and handles to the loss only
    if strategy == "sharded":  # each process's copy of each parameter is held by its own worker
        who = client.who_has([r.future for p in model.parameters() for c in p.cells.flat for r in c.value.replicas])
        for p in model.parameters():
            for c in p.cells.flat:
                assert [who[r.future.key] for r in c.value.replicas] == [(a,) for a in exe.gang.addrs]
    assert sum(client.run(_channel_files).values()) == 0
    assert sum(client.run(_mail).values()) == 0


def _execute_metrics(dask_scheduler) -> dict:
    """The scheduler's execute metrics by (task group, activity): seconds."""
    out: dict = {}
    for key, value in dask_scheduler.cumulative_worker_metrics.items():
        if isinstance(key, tuple) and key[0] == "execute" and key[-1] == "seconds":
            out[(key[-3], key[-2])] = out.get((key[-3], key[-2]), 0.0) + value
    return out


@needs_shm
@pytest.mark.distributed
def test_kernel_and_channel_seconds_show_on_the_dashboards_fine_performance_metrics(embedded_runtime, monkeypatch):
    """Dask's Fine Performance Metrics page breaks a task group's execute time down by activity:
    tilegraph adds each kernel's seconds (``kernel:matmul``, ...) for fused tasks and gangs, and a
    gang's waits for and writes to its channels."""
    client = embedded_runtime.client
    seen = {}
    for exchange, group in (("tasks", None), ("gang", "tg-gang-fwd-bwd-update")):
        monkeypatch.setattr(tg.config, "exchange", exchange)
        _, step, batch = _gpt2_step(embedded_runtime, "data")
        before = client.run_on_scheduler(_execute_metrics)
        for _ in range(2):
            step(*batch)
        deadline = time.monotonic() + 10  # the workers send their metrics with their heartbeats
        while time.monotonic() < deadline:
            time.sleep(0.5)
            after = client.run_on_scheduler(_execute_metrics)
            grown = {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}
            kernels = {k for k in grown if k[1] == "kernel:matmul" and k[0].startswith("tg-")}
            if kernels and (group is None or (group, "channel-read") in grown):
                break
        seen[exchange] = grown
        assert kernels, sorted(grown)
    gang = {a: v for (g, a), v in seen["gang"].items() if g == "tg-gang-fwd-bwd-update"}
    assert gang.get("kernel:matmul", 0) > 0 and "channel-read" in gang and "channel-write" in gang, gang
    # the fused tasks' groups are named after their part of the model
    assert any(g.startswith("tg-") and g != "tg-gang-fwd-bwd-update" and a == "kernel:matmul"
               for g, a in seen["tasks"]), sorted(seen["tasks"])


@pytest.mark.distributed
def test_exchange_names_and_where_a_gang_cannot_run(embedded_runtime, monkeypatch):
    _, step, batch = _gpt2_step(embedded_runtime, "sharded")
    with pytest.raises(tg.TileError, match=r"tilegraph.config.exchange.*'auto', 'gang', 'tasks'.*'fast'"):
        tg.config.exchange = "fast"
    # without shared memory between them, workers exchange over their comms
    monkeypatch.setattr(tg.config, "exchange", "gang")
    monkeypatch.setattr(tg.config, "shm_transfers", False)
    step.reset_plans()
    assert not any(any(s for q, s in enumerate(spec.shared) if q != p)
                   for p, spec in enumerate(step.plan(*batch).gang.specs))
    # workers whose handler of comm channels could not be installed: no gang without shared memory
    monkeypatch.setattr(embedded_runtime, "comm_channels", False)
    step.reset_plans()
    with pytest.raises(tg.TileError, match=r"received: tilegraph.config.shm_transfers is off, and the workers have no "
                                           r"tilegraph channel handler"):
        step.plan(*batch)
    fake_hosts(monkeypatch, embedded_runtime)
    monkeypatch.setattr(tg.config, "shm_transfers", True)
    step.reset_plans()
    with pytest.raises(tg.TileError, match=r"'gang' needs .*received: its workers do not share one /dev/shm .*several "
                                           r"hosts.*no tilegraph channel handler"):
        step.plan(*batch)
    monkeypatch.setattr(tg.config, "exchange", "auto")
    step.reset_plans()
    loss = step(*batch)
    assert step.plan(*batch).gang is None and np.isfinite(loss)
    # "zero3" leaves the parameters with their owners: its steps run as Dask tasks
    _, step, batch = _gpt2_step(embedded_runtime, "zero3")
    assert step.plan(*batch).gang is None and step.plan(*batch).strategy == "zero3"
    monkeypatch.setattr(tg.config, "exchange", "gang")
    step.reset_plans()
    with pytest.raises(tg.TileError, match=r"'gang' needs .*received: its parameters stay with their owners "
                                           r"\(parallel='zero3'\)"):
        step.plan(*batch)


@needs_shm
@pytest.mark.distributed
def test_gangs_of_two_models_in_flight_at_once_run_in_submission_order(embedded_runtime):
    """Two steps submitted before either is waited for: on every worker the gangs start in the
    order they were submitted (each after the last gang sent to its worker), so neither holds
    one worker while its task on the other waits behind the other step's. Each model trains
    as it does alone."""
    alone = []
    for strategy in ("sharded", "data"):
        _, step, batch = _gpt2_step(embedded_runtime, strategy)
        alone.append([step(*batch) for _ in range(3)])
    steps = [_gpt2_step(embedded_runtime, s) for s in ("sharded", "data")]
    pending = [[] for _ in steps]
    for _ in range(3):
        for i, (_, step, batch) in enumerate(steps):
            pending[i].append(step.submit(*batch))
    assert all(step.plan(*batch).gang is not None for _, step, batch in steps)
    assert [[p.result(timeout=120) for p in ps] for ps in pending] == alone
    for _ in range(100):  # finished gangs are forgotten: their results are not kept alive for the order
        if not embedded_runtime.last_gang:
            break
        time.sleep(0.05)
    assert not embedded_runtime.last_gang


@needs_shm
@pytest.mark.distributed
@pytest.mark.parametrize("hosts", [1, 2])
def test_a_gang_step_that_loses_a_worker_ends_with_the_worker_named(own_runtime, hosts, monkeypatch):
    """A worker process killed while gangs run: its peer's channel wait ends at once (its writer
    is gone: its pid, or over comms its address no longer answers), and the step ends with a
    WorkerLostError naming the killed worker within seconds; the surviving worker is free again
    (no thread left waiting)."""
    import signal

    from tilegraph.trainer import WorkerLostError

    rt = own_runtime
    if hosts == 2:
        fake_hosts(monkeypatch, rt)
    step, batch, exe = _running_gang(rt)
    pids = rt.client.run(os.getpid)
    victim, survivor = exe.gang.addrs[1], exe.gang.addrs[0]
    pending = [step.submit(*batch) for _ in range(40)]  # a few ms each
    pending[2].result()
    os.kill(pids[victim], signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(WorkerLostError) as info:
        for p in pending:
            p.result(timeout=60)
    assert time.perf_counter() - t0 < 15.0
    assert victim in info.value.workers and f"lost worker {victim}" in str(info.value)
    assert _idle(rt, survivor)
    assert rt.client.run(lambda: 1, workers=[survivor]) == {survivor: 1}


@needs_shm
@pytest.mark.distributed
def test_a_gang_on_workers_of_several_threads_equals_the_task_exchange(monkeypatch):
    """Workers of 2 threads: a gang's stages run their kernels on the worker's threads, and the
    plan trains as its Dask tasks do."""
    # the debug model's kernels are too small to be worth a second thread: make handing them over free
    monkeypatch.setattr(tg.config, "thread_handoff_seconds", 0.0)
    monkeypatch.setattr(tg.config, "kernel_gil_seconds", 0.0)
    rt = tg.connect(n_workers=2, threads_per_worker=2, dashboard=False, quiet=True, make_current=False)
    try:
        runs, exe = _tasks_then_gang(rt, monkeypatch)
        assert exe.n_replicas == 2 and max(p.prog.threads for p in exe.plans) == 2
        assert runs["gang"] == runs["tasks"]
    finally:
        rt.close()


@needs_shm
def test_a_failed_writer_leaves_its_error_in_the_channel():
    from tilegraph.exec.gang import PeerFailedError, _write_failure, failure_record

    error = tg.TileError("tilegraph.embedding", "ids must lie in [0, 96)", "120")
    _write_failure("failed-one", failure_record(error))
    t0 = time.perf_counter()
    with pytest.raises(PeerFailedError, match=rf"channel failed-one: worker process {os.getpid()} failed: TileError: "
                                              r"\[tilegraph.embedding\] ids must lie") as e:
        read_channel("failed-one", os.getpid(), timeout=600.0)
    assert time.perf_counter() - t0 < 1.0
    assert type(e.value.first) is tg.TileError and str(e.value.first) == str(error)  # the error itself, to raise
    _write_failure("failed-two", failure_record(OSError(28, "No space left on device", _Unpicklable())))
    with pytest.raises(PeerFailedError, match=r"failed: OSError: \[Errno 28\] No space left") as e:
        read_channel("failed-two", os.getpid(), timeout=600.0)
    assert e.value.first is None  # an error that does not pickle: its text alone


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not this one")


def _fail_channel_writes(dask_worker=None):
    import errno

    import tilegraph.exec.comm_channel as comm_channel
    import tilegraph.exec.gang as gang

    def full(name, values):
        raise OSError(errno.ENOSPC, "No space left on device", name)

    gang.write_channel = full
    send = comm_channel.Sender.send

    def refuse(self, addr, name, values=None, error=None):
        if error is None:
            raise OSError(errno.ENOSPC, "No space left on device", name)
        send(self, addr, name, values, error)

    comm_channel.Sender.send = refuse


@needs_shm
@pytest.mark.distributed
@pytest.mark.parametrize("hosts", [1, 2])
def test_a_gang_that_fails_ends_the_step_at_once_with_its_error(own_runtime, hosts, monkeypatch):
    """One process's gang fails (its shared memory full, or a send refused): it sends its error
    in place of the values the others wait for, so the step ends within seconds with that cause,
    not after the channel time limit."""
    rt = own_runtime
    if hosts == 2:
        fake_hosts(monkeypatch, rt)
    step, batch, exe = _running_gang(rt)
    rt.client.run(_fail_channel_writes, workers=[exe.gang.addrs[1]])
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="No space left on device") as info:
        step.submit(*batch).result(timeout=60)
    assert time.perf_counter() - t0 < 10.0
    assert _idle(rt), (info.value, rt.client.processing())  # neither gang waits on


def _lose_channel_mail(dask_worker=None):
    """This worker answers channel sends as delivered and files nothing: mail lost on the way."""
    import tilegraph.exec.comm_channel as comm_channel

    async def lose(name="", values=None, error=None):
        return "OK"

    dask_worker.handlers[comm_channel.HANDLER] = lose


@needs_shm
@pytest.mark.distributed
def test_a_comm_channel_lost_on_the_way_ends_the_step_within_seconds(own_runtime, monkeypatch):
    """A channel that never reaches its reader though its writer's send was answered: the reader
    learns that from the writer's worker and the step fails within seconds, naming the channel,
    the writer and what the writer knows of the send, not after the channel time limit
    (tilegraph.config.exchange_timeout_seconds, 600 s) as before."""
    rt = own_runtime
    fake_hosts(monkeypatch, rt)  # the channels go over the workers' comms
    step, batch, exe = _running_gang(rt)
    assert tg.config.exchange_timeout_seconds >= 600
    reader, writer = exe.gang.addrs[1], exe.gang.addrs[0]
    rt.client.run(_lose_channel_mail, workers=[reader])
    t0 = time.perf_counter()
    with pytest.raises(Exception, match=rf"waiting for values of channel [0-9a-f]+-p?\d+-1: its writer, worker "
                                        rf"{re.escape(writer)}, sent them and this worker answered that it took them "
                                        r"in, but they are not here") as info:
        step.submit(*batch).result(timeout=60)
    assert time.perf_counter() - t0 < 10.0
    assert _idle(rt), (info.value, rt.client.processing())


@needs_shm
@pytest.mark.distributed
def test_under_a_memory_bound_a_gang_runs_only_where_each_process_share_fits(embedded_runtime, monkeypatch):
    """Where a step's values are large against the workers' memory, the plan keeps its tasks
    small; it still runs as gangs when each process's share of the step (its peak estimate)
    fits in a worker, and trains as the small Dask tasks do; otherwise the Dask tasks run (and
    "gang" says why not)."""
    import tilegraph._lower as lower
    import tilegraph.parallel.gang as gang

    monkeypatch.setattr(lower, "_memory_limit", lambda runtime: 2 << 20)  # 2 MiB: the step's values take more
    losses = {}
    for share, exchange in ((1e-6, "auto"), (1e6, "auto"), (None, "tasks")):
        if share is not None:
            monkeypatch.setattr(gang, "GANG_MEMORY_SHARE", share)
        monkeypatch.setattr(tg.config, "exchange", exchange)
        _, step, batch = _gpt2_step(embedded_runtime, "sharded")
        exe = step.plan(*batch)
        assert exe.max_task_bytes < float("inf")
        assert (exe.gang is not None) == (share == 1e6), share
        # as Dask tasks under a memory bound, the parameters stay with their owners
        assert exe.strategy == ("sharded" if exe.gang is not None else "zero3")
        losses[(share, exchange)] = [step(*batch) for _ in range(3)]
    assert losses[(1e6, "auto")] == losses[(None, "tasks")] == losses[(1e-6, "auto")]
    monkeypatch.setattr(gang, "GANG_MEMORY_SHARE", 1e-6)
    monkeypatch.setattr(tg.config, "exchange", "gang")
    _, step, batch = _gpt2_step(embedded_runtime, "sharded")
    with pytest.raises(tg.TileError, match=r"each process's share of a step to fit .* received: a process's share "
                                           r"of the step holds about [\d,]+ MiB"):
        step.plan(*batch)


@pytest.mark.distributed
def test_comm_channels_between_hosts_go_over_the_clusters_tls(monkeypatch):
    """On a TLS cluster the comm channels use the workers' TLS connections (no port or
    connection of tilegraph's own): a gang between two "hosts" trains as the Dask tasks do."""
    pytest.importorskip("cryptography")  # temporary certificates
    with tg.connect(n_workers=2, threads_per_worker=1, tls=True, dashboard=False, quiet=True, make_current=False) as rt:
        assert all(w.startswith("tls://127.0.0.1:") for w in rt.workers())
        fake_hosts(monkeypatch, rt)
        runs, exe = _tasks_then_gang(rt, monkeypatch)
        assert not any(exe.gang.specs[0].shared[1:]) and runs["gang"] == runs["tasks"]


@needs_shm
@pytest.mark.distributed
def test_a_gang_over_two_hosts_of_two_workers_mixes_shared_memory_and_comms(monkeypatch):
    """Four worker processes, two on each of two "hosts": channels inside a host go through
    shared memory, those between hosts over the comms; the step trains as the Dask tasks do."""
    rt = tg.connect(n_workers=4, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    try:
        host = {a: f"host{i // 2}" for i, a in enumerate(sorted(rt.workers()))}
        fake_hosts(monkeypatch, rt, host)
        runs, exe = _tasks_then_gang(rt, monkeypatch)
        assert exe.n_replicas == 4
        assert [list(s.shared) for s in exe.gang.specs] == [[host[a] == host[b] for b in exe.gang.addrs]
                                                            for a in exe.gang.addrs]
        assert runs["gang"] == runs["tasks"]
        assert sum(rt.client.run(_channel_files).values()) == 0 and sum(rt.client.run(_mail).values()) == 0
    finally:
        rt.close()


def test_the_after_argument_of_a_gang_task_is_where_the_submit_puts_it():
    import inspect

    from tilegraph.exec.gang import AFTER_INDEX, run_gang

    # the task tuple holds the function first, then its arguments in order
    assert list(inspect.signature(run_gang).parameters).index("after") + 1 == AFTER_INDEX


@needs_shm
@pytest.mark.distributed
def test_a_gang_lets_go_of_each_element_of_a_stage_result_after_its_last_reader(embedded_runtime):
    """A stage's result tuple is not held whole until its last element is read: each element is
    dropped right after the last stage that reads it (at once when none does), never before."""
    _, step, batch = _gpt2_step(embedded_runtime, "sharded")
    exe = step.plan(*batch)
    assert exe.gang is not None
    split = 0
    for spec in exe.gang.specs:
        dropped_at = {}
        for t, stage in enumerate(spec.stages):
            for kind, which in stage.drop:
                dropped_at[(kind, which)] = t
        readers: dict[tuple, list[int]] = {}
        for t, stage in enumerate(spec.stages):
            for src in stage.inputs:
                if src[0] == "r":
                    readers.setdefault((src[1], src[2]), []).append(t)
        for (s, k), ts in readers.items():
            assert dropped_at[("e", (s, k))] == max(ts), (s, k)
        for s, stage in enumerate(spec.stages):
            mine = {which[1]: t for (kind, which), t in dropped_at.items() if kind == "e" and which[0] == s}
            if ("r", s) in dropped_at:  # no later stage reads any of it
                assert dropped_at[("r", s)] == s and not mine
            else:
                assert all(t >= s for t in mine.values())
                split += len(set(mine.values())) > 1
    assert split  # some stage's elements go at different stages


@needs_shm
@pytest.mark.distributed
@pytest.mark.parametrize("hosts", [1, 2])
def test_each_gangs_batch_tiles_are_made_on_its_own_worker(embedded_runtime, hosts, monkeypatch):
    """A batch tile too large to travel inside its task is a task of its own; it runs on the
    worker of the gang that reads it. Placed by Dask's choice instead, it could queue on the
    other worker behind that worker's gang, which holds the worker's thread while it waits for
    this gang's values: with one thread per worker, a step that waited forever (here, before
    the gangs' inputs were pinned to their workers)."""
    from distributed import get_task_stream

    from conftest import mse as _mse

    if hosts == 2:
        fake_hosts(monkeypatch, embedded_runtime)
    monkeypatch.setattr(tg.config, "exchange", "gang")
    monkeypatch.setattr(tg.config, "exchange_timeout_seconds", 30.0)  # a gang waiting forever fails
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 512)).astype(np.float32)  # tiles of 128 KiB: tasks of their own
    y = rng.standard_normal((512, 4)).astype(np.float32)
    model = tg.nn.MLP(512, 32, out_dim=4, tile=256, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, _mse, batch_tiles=[(128, 256), (128, None)], runtime=embedded_runtime,
                        parallel="sharded")
    step(x, y)
    exe = step.plan(x, y)
    assert exe.gang is not None
    for _ in range(3):
        with get_task_stream(embedded_runtime.client) as ts:
            step(x, y)
            assert _idle(embedded_runtime)
        # the tiles of this call: each gang's leaves are bound to them now
        home = {f"tgc-{ref.node.cell.token}": addr for addr, leaves in zip(exe.gang.addrs, exe.gang.leaves)
                for ref in leaves if ref.node.cell.token.startswith("batch0-")}
        ran = {t["key"]: t["worker"] for t in ts.data if t["key"] in home}
        assert len(home) == 8 and len(ran) == 8, (home, ran)  # 4 x 2 tiles of x, half per gang
        assert ran == home
