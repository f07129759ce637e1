"""A new user's clusters: a scheduler without workers, MPI launches whose ranks disagree, and the
faults a user meets on them; each test is a defect found and fixed (see the report of each)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
import tilegraph.runtime
from conftest import mse

ROOT = Path(__file__).resolve().parents[1]


def _data(step):
    x = np.random.default_rng(step).standard_normal((64, 16)).astype(np.float32)
    return x, np.tanh(x[:, :4])


def _trainer(rt, **kw):
    """The README's small MLP on random data: a step of a few milliseconds."""
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    return tg.Trainer(model, opt, _data, rt, loss_fn=mse, batch_size=64, batch_tiles=[(32, 8), (32, None)],
                      progress=False, **kw)


def _mpiexec():
    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


@pytest.fixture
def workerless_scheduler():
    """A Dask scheduler (in this process) without any worker, as on a cluster whose worker jobs
    are still queued; yields the in-process cluster (``scale(1)`` adds a thread worker)."""
    from distributed import LocalCluster

    cluster = LocalCluster(n_workers=0, processes=False, protocol="tcp", host="127.0.0.1",
                           dashboard_address="127.0.0.1:0")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.mark.distributed
def test_a_cluster_without_workers_is_a_clear_error_not_a_dask_timeout(workerless_scheduler, monkeypatch):
    """Before: ``Trainer.fit`` on a scheduler without workers raised Dask's "TimeoutError: No
    valid workers found" from deep inside ``client.scatter``."""
    monkeypatch.setattr(tilegraph.runtime, "WORKERS_WAIT_SECONDS", 1.0)
    with tg.connect(workerless_scheduler.scheduler_address, timeout=5, make_current=False) as rt:
        x = tg.from_numpy(np.arange(6.0), (3,))
        t0 = time.perf_counter()
        with rt.as_current(), pytest.raises(tg.TileError) as err:
            tg.compute(x * 2.0)
        assert time.perf_counter() - t0 < 10
        msg = str(err.value)
        assert "at least one worker" in msg and workerless_scheduler.scheduler_address in msg, msg
        assert "no worker for 1 s" in msg, msg


@pytest.mark.distributed
def test_a_plan_waits_for_a_worker_that_joins(workerless_scheduler):
    with tg.connect(workerless_scheduler.scheduler_address, timeout=5, make_current=False) as rt:
        workerless_scheduler.scale(1)  # joins while the plan waits
        x = tg.from_numpy(np.arange(6.0), (3,))
        with rt.as_current():
            (got,) = tg.compute(x * 2.0)
        np.testing.assert_array_equal(got, np.arange(6.0) * 2.0)


MPI_RANKS_DISAGREE = """
import sys
from mpi4py import MPI
import tilegraph as tg
rank = MPI.COMM_WORLD.Get_rank()
tls = dict(tls_ca_file=sys.argv[1], tls_cert=sys.argv[2],
           tls_key=sys.argv[3] if rank != 2 else sys.argv[3] + ".missing")  # not on rank 2's node
rt = tg.connect(mpi=True, interface=sys.argv[4] or None, **tls)
print("connected", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", ["interface", "tls"])
def test_an_mpi_rank_that_cannot_start_ends_the_job_with_its_reason(tmp_path, case):
    """Before: ``interface="ib0"`` missing on the scheduler's host, or TLS files missing on one
    rank's node, raised on that rank alone; the other ranks waited in dask-mpi's broadcast without
    end, each spinning a core, until the batch system killed the job."""
    mpiexec = _mpiexec()
    sys.path.insert(0, str(Path(__file__).parent))
    from test_security import make_certificates

    certs = make_certificates(tmp_path / "tls", "tilegraph-test")
    (tmp_path / "job.py").write_text(MPI_RANKS_DISAGREE)
    key = certs["tls_key"]
    if case == "interface":  # every rank has its files; the interface is nowhere
        for name in ("key.pem.missing",):
            shutil.copy(key, tmp_path / "tls" / name)
    args = [certs["tls_ca_file"], certs["tls_cert"], key, "nosuch0" if case == "interface" else ""]
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, "job.py", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "connected" not in proc.stdout
    if case == "interface":
        assert "[tilegraph.connect(mpi=True)] interface:" in proc.stderr, proc.stderr[-3000:]
        assert "'nosuch0' is not a valid network interface" in proc.stderr, proc.stderr[-3000:]
    else:
        assert "rank 2 on " in proc.stderr and "key.pem.missing" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("tilegraph._errors.TileError:") == 1, proc.stderr[-3000:]  # said once, by the client rank


@pytest.mark.distributed
def test_a_scheduler_that_went_away_is_named_not_a_key_error(workerless_scheduler, tmp_path):
    """Before: once the client had lost its scheduler, ``repr(rt)``, ``rt.processors()`` and every
    ``tg.compute`` raised Dask's empty record's "KeyError: 'workers'", ``Trainer.fit``
    "AttributeError: 'NoneType' object has no attribute 'broadcast'" and
    ``Trainer.save_checkpoint`` "ValueError: No clients found"."""
    from distributed import Client

    workerless_scheduler.scale(1)
    rt = tg.connect(workerless_scheduler.scheduler_address, timeout=2, make_current=False)
    try:
        address = workerless_scheduler.scheduler_address
        trainer = _trainer(rt)
        trainer.fit(1)
        workerless_scheduler.close()  # the scheduler ends
        deadline = time.monotonic() + 30
        while rt.client.status not in ("closed", "closing") and time.monotonic() < deadline:
            time.sleep(0.2)  # Dask's client tries to reconnect for a while, then closes
        assert isinstance(rt.client, Client) and rt.client.status in ("closed", "closing")
        assert "unreachable" in repr(rt) and address in repr(rt)
        with pytest.raises(tg.TileError, match=r"lost the scheduler at " + address.replace(".", r"\.")):
            rt.processors()
        with rt.as_current(), pytest.raises(tg.TileError, match="a connected Dask scheduler"):
            tg.compute(tg.from_numpy(np.arange(4.0), (2,)) * 2.0)
        with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.fit\] a connected Dask scheduler"):
            trainer.fit(1)
        with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.save_checkpoint\] a connected Dask"):
            trainer.save_checkpoint(tmp_path / "ck")
    finally:
        rt.close()


@pytest.mark.distributed
def test_a_hung_scheduler_is_an_error_within_the_time_limit(workerless_scheduler, monkeypatch):
    """Before: a scheduler that kept its connection open but never answered (stopped, hung) made
    ``repr(rt)``, ``rt.processors()`` and each plan wait without end."""
    import asyncio

    workerless_scheduler.scale(1)
    monkeypatch.setattr(tilegraph.runtime, "SCHEDULER_ANSWER_SECONDS", 0.5)
    with tg.connect(workerless_scheduler.scheduler_address, timeout=5, make_current=False) as rt:
        scheduler = workerless_scheduler.scheduler
        identity = scheduler.handlers["identity"]

        async def hung(*args, **kwargs):
            await asyncio.sleep(5)
            return identity(*args, **kwargs)

        scheduler.handlers["identity"] = hung
        try:
            t0 = time.perf_counter()
            with pytest.raises(tg.TileError, match="to answer within 0.5 s"):
                rt.processors()
            assert time.perf_counter() - t0 < 3
            assert "unreachable" in repr(rt)
        finally:
            scheduler.handlers["identity"] = identity
        assert rt.processors()["cpu"] >= 1  # answering again


@pytest.fixture
def workers_without_nanny(workerless_scheduler):
    """Two ``dask worker --no-nanny`` processes (as dask-mpi's ranks run) on the in-process
    scheduler; yields (runtime, {address: pid}). Stopped ones are continued, all are ended."""
    import signal

    from conftest import stop_process

    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker",
                               workerless_scheduler.scheduler_address, "--no-nanny", "--nthreads", "1",
                               "--host", "127.0.0.1", "--no-dashboard"], stderr=subprocess.DEVNULL)
             for _ in range(2)]
    rt = None
    try:
        rt = tg.connect(workerless_scheduler.scheduler_address, timeout=10, make_current=False)
        rt.client.wait_for_workers(2, timeout=60)
        yield rt, rt.client.run(os.getpid)
    finally:
        if rt is not None:
            rt.close()
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
            stop_process(p)


@pytest.mark.distributed
@pytest.mark.slow
def test_restart_on_failure_removes_a_stopped_worker_that_has_no_nanny(workers_without_nanny, tmp_path,
                                                                        monkeypatch):
    """Before: ``restart_on_failure`` on workers without a nanny (``dask worker --no-nanny``, the
    ranks of dask-mpi) ended the fit with Dask's "ValueError: Restarting workers requires a nanny
    to be used" when a worker stalled. Now the stalled worker is removed and training resumes on
    the others."""
    import signal

    import tilegraph._health

    rt, pids = workers_without_nanny
    monkeypatch.setattr(tilegraph._health, "STALL_SECONDS", 3.0)  # 10 s by default
    stopped = {}

    def hook(trainer, stats):
        if not stopped and len(trainer.history) >= 6:
            from distributed import wait

            futures = [c.value.future for p in trainer.optimizer.params for c in p.cells.flat
                       if hasattr(c.value, "future")]
            wait(futures)
            addr = next(w for ws in rt.client.who_has(futures).values() for w in ws)
            stopped["addr"] = addr
            os.kill(pids[addr], signal.SIGSTOP)

    trainer = _trainer(rt, steps_per_graph=1, checkpoint_dir=tmp_path / "ck", checkpoint_every=4,
                       restart_on_failure=True, on_step=[hook], step_timeout=5)
    res = trainer.fit(10)
    assert len(res.restarts) == 1 and res.restarts[0]["workers"] == [stopped["addr"]], res.restarts
    assert res.restarts[0]["step"] == 4 and res.steps == 10 and np.isfinite(res.losses).all()
    assert stopped["addr"] not in rt.workers()


MPI_WORKER_FAILS = """
import asyncio
from mpi4py import MPI
import distributed
import tilegraph as tg
import tilegraph.runtime
tilegraph.runtime.MPI_WORKERS_WAIT_SECONDS = 3
if MPI.COMM_WORLD.Get_rank() == 3:  # a worker rank that cannot reach the scheduler
    async def never(self):
        await asyncio.sleep(6)
        raise OSError("cannot reach the scheduler (simulated)")
    distributed.Worker.start_unsafe = never
rt = tg.connect(mpi=True, interface="lo")
print("connected", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_an_mpi_worker_rank_that_never_joins_is_named(tmp_path):
    """Before: rank 1 waited 120 s, then raised Dask's WorkerStartTimeoutError (a page of
    traceback, no word of which ranks or why)."""
    mpiexec = _mpiexec()
    (tmp_path / "job.py").write_text(MPI_WORKER_FAILS)
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, "job.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "connected" not in proc.stdout
    assert "[tilegraph.connect(mpi=True)] every worker rank (ranks 2 to 3) to join the scheduler at tcp://" \
        in proc.stderr, proc.stderr[-3000:]
    assert "received: 1 of 2 worker ranks joined" in proc.stderr, proc.stderr[-3000:]
    assert "WorkerStartTimeoutError" not in proc.stderr


@pytest.mark.distributed
def test_an_embedded_cluster_without_dashboard_shows_no_dashboard_link():
    """connect(dashboard=False) still gave rt.dashboard_link (and its repr) a link that answers 404:
    the scheduler's HTTP server serves /health, not the dashboard."""
    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True) as rt:
        assert rt.dashboard_link is None
        assert "dashboard" not in repr(rt) and "1 worker" in repr(rt)
