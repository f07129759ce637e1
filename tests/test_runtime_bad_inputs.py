"""Bad input to the runtime: one TileError each, fast, naming where, what was wrong and what was
received. A scheduler file whose "address" Dask cannot read, a worker memory limit under what a
worker process itself takes, the "No valid workers found" of a scatter, and a worker of another
tilegraph version that joins after connect."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import types

import distributed  # noqa: F401 - imported before any timed connect: a cold import takes 1-2 s
import numpy as np
import pytest
from conftest import connect_refused_within, stop_process

import tilegraph as tg
from tilegraph.runtime import MIN_WORKER_MEMORY_BYTES, Runtime, Workers

FILE_WANTS = r'a scheduler file whose "address" is a scheduler address: "tcp://HOST:PORT"'


# -- 1. a scheduler file's "address" ----------------------------------------------------------------
@pytest.mark.parametrize("address, problem", [
    ("garbage", "\"address\" 'garbage' is no Dask address"),
    ("tcp://127.0.0.1", "\"address\" 'tcp://127.0.0.1' is no Dask address"),  # no port
    ("http://127.0.0.1:1", "\"address\" 'http://127.0.0.1:1' is no Dask address"),  # no Dask scheme
    ("", '"address" is empty'),
    (5, '"address" is an int (5), not a string'),
    (["tcp://127.0.0.1:8786"], "\"address\" is a list (['tcp://127.0.0.1:8786']), not a string"),
    (None, '"address" is null, not a string'),
])
def test_a_scheduler_file_with_a_malformed_address_names_the_file_and_the_address(tmp_path, address, problem):
    """It was Dask's raw ValueError ("missing port number in address 'garbage'", "unknown address
    scheme 'http'") that named no file, or, for a number, a misleading 'no "address"'. The file is
    whole (valid JSON): it is not read again for 2 s, and nothing is dialled."""
    path = tmp_path / "sched.json"
    path.write_text(json.dumps({"address": address, "type": "Scheduler"}))
    msg, _ = connect_refused_within(1.5, rf"^\[tilegraph\.connect\] {FILE_WANTS}", scheduler_file=str(path), timeout=5)
    assert f"received: {str(path)!r}: {problem}" in msg, msg


def test_the_cli_reports_a_malformed_scheduler_file_address_in_one_line(tmp_path):
    """`tilegraph train --set runtime.scheduler_file=...` printed a full traceback."""
    path = tmp_path / "s.json"
    path.write_text('{"address": "garbage"}')
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "train", "--set", f"runtime.scheduler_file={path}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "Traceback" not in run.stderr, run.stderr
    assert f"received: {str(path)!r}: \"address\" 'garbage' is no Dask address" in run.stderr, run.stderr


# -- 2. a worker memory limit under what a worker takes -----------------------------------------------
@pytest.mark.parametrize("limit, shown", [
    ("100MB", "memory_limit='100MB': 95.37 MiB per worker"),
    ("1MB", "memory_limit='1MB': 0.95 MiB per worker"),
    (200 << 20, f"memory_limit={200 << 20}: 200.00 MiB per worker"),
])
def test_a_memory_limit_under_what_a_worker_takes_is_refused_before_anything_starts(limit, shown):
    """The nanny killed and restarted such a worker every second, and after ~32 s Dask's scatter
    raised "TimeoutError: No valid workers found" (with quiet=True the reason never showed)."""
    msg, _ = connect_refused_within(2.0, rf"^\[tilegraph\.connect\] a memory limit of at least "
                               rf"{MIN_WORKER_MEMORY_BYTES >> 20} MiB per worker", n_workers=1, threads_per_worker=1,
                          memory_limit=limit, dashboard=False, quiet=True)
    assert msg.endswith(f"received: {shown}"), msg


def test_an_auto_memory_limit_under_what_a_worker_takes_says_why(monkeypatch):
    import distributed.system

    monkeypatch.setattr(distributed.system, "MEMORY_LIMIT", 64 << 20)  # a tiny machine
    msg, _ = connect_refused_within(2.0, r"a memory limit of at least \d+ MiB per worker.*give fewer workers \(n_workers\)",
                          n_workers=1, threads_per_worker=1, dashboard=False, quiet=True)
    assert "received: memory_limit='auto': " in msg and "for each worker of 1 thread" in msg, msg


def test_a_memory_limit_per_mpi_rank_under_what_a_worker_takes_is_refused(tmp_path):
    """Each worker rank takes the limit given: every rank finds it too small before any takes its
    role, and the client rank says so (the others end with status 1)."""
    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    from test_newuser_mpi import _launch

    code = ("import tilegraph as tg\n"
            "try:\n"
            "    tg.connect(mpi=True, interface='lo', memory_limit='100MB')\n"
            "except tg.TileError as e:\n"
            "    print('raised:', e)\n")
    _, out, err, seconds = _launch(tmp_path, 3, code, timeout=60)
    assert ("raised: [tilegraph.connect(mpi=True)] a memory limit of at least "
            f"{MIN_WORKER_MEMORY_BYTES >> 20} MiB per worker") in out, out + err
    assert "received: memory_limit='100MB': 95.37 MiB per worker" in out
    assert seconds < 30


# -- 2b. Dask's "No valid workers found" on a scatter -----------------------------------------------------
class _NoWorkerClient:
    """A client whose scatter fails as Dask's does when no worker is running to take values."""

    def scatter(self, *args, **kwargs):
        raise TimeoutError("No valid workers found")


def test_scatter_cells_with_no_worker_alive_is_a_tile_error_keeping_the_cause():
    rt = Runtime.__new__(Runtime)  # no cluster: only what scatter_cells reads
    rt.client, rt.last_workers, rt.address = _NoWorkerClient(), Workers.of({}), "tcp://127.0.0.1:8786"
    cell = types.SimpleNamespace(value=np.ones(4, np.float32), set=lambda v: None)
    with pytest.raises(tg.TileError, match=r"^\[tilegraph\.Runtime\.scatter_cells\] a worker of the scheduler at "
                                           r"tcp://127\.0\.0\.1:8786 alive and running to take the values.*keep "
                                           r"restarting.*memory limit.*received: TimeoutError: No valid workers "
                                           r"found$") as e:
        rt.scatter_cells([cell])
    assert isinstance(e.value.__cause__, TimeoutError)


def test_the_programs_upload_with_no_worker_alive_is_a_tile_error_keeping_the_cause():
    from tilegraph._lower import Executable

    exe = Executable.__new__(Executable)  # only what _programs reads
    exe._program_futures, exe.structure, exe._program_id = None, "s", "p"
    exe.clusters, exe.plans, exe.worker_of = [types.SimpleNamespace(id=0)], [types.SimpleNamespace(prog=None)], {}
    runtime = types.SimpleNamespace(client=_NoWorkerClient(), address="tcp://127.0.0.1:8786")
    with pytest.raises(tg.TileError, match=r"^\[tilegraph\.Executable\] a worker of the scheduler at .* to take the "
                                           r"step's programs: none is") as e:
        exe._programs(runtime)
    assert isinstance(e.value.__cause__, TimeoutError)


def test_other_scatter_timeouts_pass_unchanged():
    from tilegraph.runtime import no_worker_alive_error

    with pytest.raises(TimeoutError, match="something else"):
        with no_worker_alive_error("here", "values"):
            raise TimeoutError("something else")


# -- 3. a worker of another tilegraph version that joins after connect --------------------------------
@pytest.mark.distributed
def test_a_worker_of_another_tilegraph_version_joining_after_connect_is_refused(tmp_path):
    """connect checks the workers there; one that joins later (a worker started by hand, a batch
    job's) is checked when a plan first sees it, with the same error, and checked once."""
    preload = tmp_path / "other_version.py"
    preload.write_text("import tilegraph\ntilegraph.__version__ = '0.0.0-other'\n")
    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False) as rt:
        x = tg.from_numpy(np.ones((8, 8), np.float32), (4, 4))
        (ok,) = tg.compute((x @ x).sum(), runtime=rt)
        assert float(ok) == 8 * 8 * 8
        (first,) = rt.workers()
        worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", rt.address, "--nthreads", "1",
                                   "--no-nanny", "--no-dashboard", "--host", "127.0.0.1", "--preload", str(preload)],
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            rt.client.wait_for_workers(2, timeout=60)
            (late,) = set(rt.workers()) - {first}
            for attempt in (lambda: rt.snapshot(), lambda: tg.compute((x @ x).sum(), runtime=rt)):
                t0 = time.monotonic()
                with pytest.raises(tg.TileError, match=rf"^\[tilegraph\.Runtime\] every worker running tilegraph "
                                                       rf"{tg.__version__} \(this client's\); received: {late}: "
                                                       r"0\.0\.0-other \(joined after connect\)$"):
                    attempt()
                assert time.monotonic() - t0 < 5
            assert rt._version_checked == {first}  # the one checked before is not asked again
        finally:  # killed: the cluster's plugins have it leave SIGTERM to the client's process
            worker.kill()
            stop_process(worker)
        deadline = time.monotonic() + 10
        while len(rt.workers()) > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        (ok,) = tg.compute((x @ x).sum(), runtime=rt)  # without it, plans run again
        assert float(ok) == 8 * 8 * 8
