"""An HPC user's first steps with MPI: ``mpiexec -n N`` scripts that connect more than once,
forget to close, launch too few ranks, give a setting the scheduler cannot read, or forget
``mpi=True``. Each launch ends within its time limit (a hang is a failure, never a wait)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mpich_shm_files, mpiexec_or_skip, remove_mpich_shm_since, stop_process

import tilegraph as tg


def _launch(tmp_path: Path, n: int, code: str, *args: str, timeout: float = 90) -> tuple[int, str, str, float]:
    """``mpiexec -n n python job.py *args`` with ``code`` as job.py: (status, stdout, stderr,
    seconds); a launch still running after ``timeout`` is stopped and fails the test (a hang)."""
    (tmp_path / "job.py").write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_COMM_WORLD_", "PMIX_"))}
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    shm_before = mpich_shm_files()
    proc = subprocess.Popen([mpiexec_or_skip(), "-n", str(n), sys.executable, "job.py", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} still ran after {timeout} s (a hang)\n{out[-2000:]}\n{err[-3000:]}")
    finally:
        if proc.returncode != 0:  # (ranks ended by MPI_Abort or a signal)
            remove_mpich_shm_since(shm_before)
    return proc.returncode, out, err, time.monotonic() - t0


CONNECT_TWICE = """
import numpy as np
import tilegraph as tg
rt = tg.connect(mpi=True, interface="lo")
print("first", len(rt.workers()), flush=True)
rt.close()
rt = tg.connect(mpi=True, interface="lo")        # a script that trains twice, a cell run again
x = tg.from_numpy(np.arange(16.0).reshape(4, 4), (2, 2))
print("second", len(rt.workers()), float(tg.compute((x + 1.0).sum())[0]), flush=True)
try:
    tg.connect(mpi=True, interface=None)          # the ranks took their roles with interface="lo"
except tg.TileError as e:
    print("refused:", e, flush=True)
rt.close()
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_second_connect_mpi_in_one_script_connects_again_instead_of_hanging(tmp_path):
    """Before: the second ``tg.connect(mpi=True)`` of a script entered dask-mpi's launch again,
    whose collective calls the scheduler and worker ranks (busy being them) never joined: it
    hung, spinning a core, until the batch system killed the job."""
    rc, out, err, _ = _launch(tmp_path, 3, CONNECT_TWICE)
    assert rc == 0, out + err[-3000:]
    assert "first 1" in out and "second 1 136.0" in out, out + err[-3000:]
    assert "refused: [tilegraph.connect(mpi=True)] the settings of this script's first connect(mpi=True)" in out
    assert "interface 'lo' -> None" in out, out


FORGETS_TO_CLOSE = """
import tilegraph as tg
rt = tg.connect(mpi=True, interface="lo")
rt2 = tg.connect(mpi=True, interface="lo")
print("connected", len(rt.workers()), len(rt2.workers()), flush=True)
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_runtimes_left_open_end_the_mpi_job_without_reconnect_errors(tmp_path):
    """Before: a runtime the script did not close (two here) saw dask-mpi's exit handler shut the
    scheduler down under it: "Failed to reconnect to scheduler after 30.00 seconds, closing
    client" and CancelledError tracebacks as the job ended."""
    rc, out, err, _ = _launch(tmp_path, 3, FORGETS_TO_CLOSE)
    assert rc == 0 and "connected 1 1" in out, out + err[-3000:]
    assert "Failed to reconnect" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_are_told_once_that_dask_mpi_needs_three(tmp_path):
    """Before: ``mpiexec -n 2`` printed the same TileError (and its traceback) from both ranks."""
    rc, out, err, _ = _launch(tmp_path, 2, "import tilegraph as tg\ntg.connect(mpi=True)\n")
    assert rc != 0
    assert err.count("TileError: [tilegraph.connect(mpi=True)] dask-mpi needs at least 3 ranks") == 1, err
    assert "received: 2 ranks" in err


SCHEDULER_FAILS = """
import tilegraph as tg
tg.connect(mpi=True, interface="lo", dask_config={"distributed.admin.tick.interval": "soon"})
print("connected", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_a_scheduler_rank_that_cannot_start_ends_the_job_with_its_reason(tmp_path):
    """Before: a setting the scheduler cannot read (here a tick interval of "soon") raised on
    rank 0 alone, and the client and worker ranks waited for its address without end."""
    rc, out, err, seconds = _launch(tmp_path, 3, SCHEDULER_FAILS, timeout=60)
    assert rc != 0 and "connected" not in out, (rc, out[-2000:])
    assert "[tilegraph.connect(mpi=True)] the scheduler (rank 0 on " in err, (rc, seconds, out[-2000:], err[-3000:])
    assert "Invalid time unit: soon" in err, err[-3000:]
    assert seconds < 45


@pytest.mark.distributed
@pytest.mark.slow
def test_dask_config_that_is_no_mapping_under_mpi_is_a_tile_error(tmp_path):
    """Before: ``dask_config=["..."]`` was a bare "TypeError: 'list' object is not a mapping" on
    every rank."""
    code = "import tilegraph as tg\ntg.connect(mpi=True, interface='lo', dask_config=['tick 1s'])\n"
    rc, out, err, _ = _launch(tmp_path, 3, code, timeout=60)
    assert rc != 0
    assert "TypeError" not in err, err[-3000:]
    assert err.count("TileError: [tilegraph.connect(mpi=True)] dask_config must be a dict of Dask config keys") == 1, err
    assert "received: ['tick 1s']" in err


@pytest.mark.parametrize("rank_env", [{"PMI_RANK": "1", "PMI_SIZE": "4"},
                                      {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}])
def test_the_embedded_cluster_in_a_rank_of_an_mpi_launch_is_refused(monkeypatch, rank_env):
    """Before: ``mpiexec -n 4 tilegraph train`` (no --mpi) or a script's ``tg.connect()`` under
    mpiexec started an embedded cluster in every rank, each over all the node's cores; the CLI's
    other ranks stopped on "runs/default is in use by tilegraph train", which named no cause."""
    for key in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in rank_env.items():
        monkeypatch.setenv(key, value)
    t0 = time.monotonic()
    with pytest.raises(tg.TileError) as info:
        tg.connect(n_workers=1, dashboard=False, quiet=True, make_current=False)
    assert time.monotonic() - t0 < 5  # refused before any cluster starts
    msg = str(info.value)
    assert msg.startswith("[tilegraph.connect] under an MPI launch of several ranks, tg.connect(mpi=True)"), msg
    assert "`tilegraph train --mpi`" in msg
    rank, size = (v for k, v in sorted(rank_env.items(), key=lambda kv: "SIZE" in kv[0]))
    assert f"received: an embedded cluster asked for in rank {rank} of {size}" in msg, msg


def test_a_launch_of_one_rank_may_start_the_embedded_cluster(monkeypatch):
    """``mpiexec -n 1 python train.py`` (one rank: one job) is no reason to refuse."""
    from tilegraph.runtime.connection import _refuse_mpi_rank

    monkeypatch.setenv("PMI_SIZE", "1")
    monkeypatch.setenv("PMI_RANK", "0")
    _refuse_mpi_rank("tilegraph.connect")  # no error


@pytest.mark.distributed
def test_a_scheduler_file_not_written_yet_is_waited_for(embedded_runtime, tmp_path):
    """A batch job starts ``mpiexec ... dask-mpi --scheduler-file s.json &`` and its training
    right after it. Before: connecting before the scheduler wrote the file was an error at once
    ("scheduler file does not exist"), where Dask's own Client waits for it."""
    from conftest import scheduler_file_written_later

    path = tmp_path / "s.json"
    with scheduler_file_written_later(path, embedded_runtime.client.scheduler.address, 1.0), \
            tg.connect(scheduler_file=str(path), timeout=10, make_current=False) as rt:
        assert len(rt.workers()) == 2
    # never written: an error once the timeout has passed; a folder that does not exist, at once
    t0 = time.monotonic()
    with pytest.raises(tg.TileError, match=r"scheduler file does not exist.*received: '.*never.json' \(waited 1 s"):
        tg.connect(scheduler_file=str(tmp_path / "never.json"), timeout=1)
    assert 1 <= time.monotonic() - t0 < 4
    t0 = time.monotonic()
    with pytest.raises(tg.TileError, match=r"scheduler file does not exist.*\(nor its folder\)"):
        tg.connect(scheduler_file=str(tmp_path / "no" / "s.json"), timeout=5)
    assert time.monotonic() - t0 < 1


def test_tilegraph_train_in_a_rank_without_mpi_is_refused_before_any_work(monkeypatch, tmp_path, capsys):
    """``mpiexec -n 4 tilegraph train`` without --mpi read the data and took the output folder's
    lock in every rank before the embedded cluster's refusal: the other ranks' first words were
    "runs/default is in use". The refusal comes first, and nothing is written."""
    from tilegraph.cli import main

    for key in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("PMI_RANK", "2")
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "1", "--out", "r"]) == 2
    err = capsys.readouterr().err
    assert "[tilegraph train (no --mpi)] under an MPI launch of several ranks" in err
    assert not (tmp_path / "r").exists()
