"""MPI launches as an HPC user meets them, with and without TLS (an end-to-end audit, round 4).
Each test is a defect found in that audit and fixed (see its docstring)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_newuser_mpi import _launch as launch
from test_security import make_certificates

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    pytest.importorskip("cryptography")
    return make_certificates(tmp_path_factory.mktemp("tls"), "tilegraph-test")


def _launch(cwd: Path, n: int, code: str, *args: str, timeout: float = 90) -> tuple[int, str, str]:
    """``mpiexec -n n python job.py *args`` with ``code`` as job.py: (status, stdout, stderr); a
    launch still running after ``timeout`` fails the test (a hang)."""
    return launch(cwd, n, code, *args, timeout=timeout)[:3]


# -- a distributed.Security under MPI ---------------------------------------------------------------

EMPTY_SECURITY = """
import distributed
import tilegraph as tg

with tg.connect(mpi=True, interface="lo", security=distributed.Security()) as rt:
    print("connected", rt.client.scheduler.address, flush=True)
"""


@pytest.mark.slow
def test_a_security_without_files_under_mpi_is_refused_not_plain_tcp(tmp_path):
    """Before: ``tg.connect(mpi=True, security=distributed.Security())`` (no CA file) started
    every rank on plain tcp:// without a word ("connected tcp://127.0.0.1:..."): a user who
    asked for security did not get it. Now one TileError, from the client rank alone."""
    rc, out, err = _launch(tmp_path, 3, EMPTY_SECURITY)
    assert rc != 0 and "connected" not in out, out + err[-3000:]
    assert err.count("TileError:") == 1, err[-3000:]
    assert ("[tilegraph.connect(mpi=True)] security=: a distributed.Security naming TLS files every rank can read"
            in err), err[-3000:]
    assert "received: Security(" in err and "without tls_ca_file" in err, err[-3000:]


SECURITY_FILES = """
import os, sys
import distributed
import numpy as np
import tilegraph as tg

ca, cert, key, missing_on = sys.argv[1:5]
if os.environ.get("PMI_RANK") == missing_on:  # this rank's node lacks the CA file
    ca = ca + ".not-on-this-node"
roles = {f"tls_{role}_{part}": path for role in ("scheduler", "worker", "client")
         for part, path in (("cert", cert), ("key", key))}
sec = distributed.Security(tls_ca_file=ca, require_encryption=True, **roles)
with tg.connect(mpi=True, interface="lo", security=sec) as rt:
    x = tg.from_numpy(np.arange(16.0).reshape(4, 4), (2, 2))
    assert np.array_equal((x + x).numpy(), 2 * np.arange(16.0).reshape(4, 4))
    print("connected", rt.client.scheduler.address, sorted(rt.workers()), flush=True)
"""


@pytest.mark.slow
def test_a_security_with_files_under_mpi_speaks_tls_on_every_rank(tmp_path, certs):
    """The README's ``security=`` form under MPI: the ranks serve and dial over tls://."""
    files = (certs["tls_ca_file"], certs["tls_cert"], certs["tls_key"])
    rc, out, err = _launch(tmp_path, 3, SECURITY_FILES, *files, "none", timeout=120)
    assert rc == 0, out + err[-3000:]
    assert "connected tls://127.0.0.1:" in out and "['tls://127.0.0.1:" in out, out


@pytest.mark.slow
def test_a_security_whose_files_one_rank_lacks_names_that_rank(tmp_path, certs):
    """Before: a Security's files were not checked on the ranks: the rank that lacked them
    failed alone, in Dask, while the others waited (a worker rank: 2 minutes, then "0 of 1
    worker rank joined"). Now every rank hears of it at once and the client rank names it."""
    files = (certs["tls_ca_file"], certs["tls_cert"], certs["tls_key"])
    t0 = time.monotonic()
    rc, out, err = _launch(tmp_path, 3, SECURITY_FILES, *files, "2", timeout=90)
    assert rc != 0 and "connected" not in out, out + err[-3000:]
    assert time.monotonic() - t0 < 60, "the error took the workers' wait"
    assert err.count("TileError:") == 1, err[-3000:]
    assert "every rank able to start" in err and "rank 2 on " in err, err[-3000:]
    assert "tls_ca_file: an existing file" in err and ".not-on-this-node" in err, err[-3000:]


# -- a rank that dies before MPI starts ------------------------------------------------------------

DIES_AT_START = """
import os
if os.environ.get("PMI_RANK") == os.environ["TEST_DEAD_RANK"]:  # this rank's node lacks a package
    raise ImportError("No module named 'a_package_this_node_lacks'")
import tilegraph as tg

with tg.connect(mpi=True, interface="lo") as rt:
    print("connected", len(rt.workers()), flush=True)
"""


def _processes_in(folder: Path) -> list[int]:
    """The processes whose working folder is ``folder`` (the ranks of a launch there)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and Path(os.readlink(entry / "cwd")) == folder:
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.parametrize("dead", ["2", "0"])
def test_a_rank_that_dies_before_mpi_starts_ends_the_job_instead_of_hanging(tmp_path, monkeypatch, dead):
    """Before: ``mpiexec -n 4`` where one rank failed an import (before tilegraph reached MPI)
    printed that rank's traceback, and the other three waited in MPI_Init without end, each
    spinning a core (MPICH's mpiexec does not end such a job; killed by the test's timeout after
    200 s). Now the ranks give up after TILEGRAPH_MPI_START_SECONDS (default 120 s), the client
    rank says why once, and nothing of the job is left running."""
    monkeypatch.setenv("TILEGRAPH_MPI_START_SECONDS", "5")
    monkeypatch.setenv("TEST_DEAD_RANK", dead)
    t0 = time.monotonic()
    rc, out, err = _launch(tmp_path, 4, DIES_AT_START, timeout=90)
    assert rc != 0 and "connected" not in out, out + err[-3000:]
    assert time.monotonic() - t0 < 60
    assert "ImportError: No module named 'a_package_this_node_lacks'" in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("[tilegraph.connect(mpi=True)]")]
    assert said == [f"[tilegraph.connect(mpi=True)] every rank of the launch to start MPI within 5 s (a rank that "
                    "ended before, its error above, leaves the others waiting in MPI_Init without end; so the job "
                    "ends; TILEGRAPH_MPI_START_SECONDS sets this wait); received: rank 1 of 4 on "
                    f"{os.uname().nodename} still waiting"], err[-3000:]
    assert not _processes_in(tmp_path), "ranks (or their watchers) left running"


def test_a_bad_start_wait_is_said_once_by_the_client_rank(tmp_path, monkeypatch):
    """Before: ``TILEGRAPH_MPI_START_SECONDS=soon mpiexec -n 3 ...`` raised the same TileError on
    every rank (mpiexec passes the environment on): three tracebacks for one mistake. Now the
    client rank says it once and the others exit with status 1."""
    pytest.importorskip("mpi4py")
    monkeypatch.setenv("TILEGRAPH_MPI_START_SECONDS", "soon")
    rc, out, err = _launch(tmp_path, 3, CONNECTS)
    assert rc != 0 and "connected" not in out, out + err[-3000:]
    assert err.count("TileError:") == 1, err[-3000:]
    assert ("[tilegraph.connect(mpi=True)] TILEGRAPH_MPI_START_SECONDS: a number of seconds > 0 (how long a rank "
            "waits for the others to start MPI); received: 'soon'") in err, err[-3000:]
    assert not _processes_in(tmp_path), "ranks (or their watchers) left running"


CONNECTS = """
import tilegraph as tg

with tg.connect(mpi=True, interface="lo") as rt:
    print("connected", len(rt.workers()), flush=True)
"""


def test_connect_mpi_without_mpiexec_says_how_to_launch(monkeypatch):
    """Before: ``tg.connect(mpi=True)`` in a script run with plain ``python`` said "dask-mpi needs
    at least 3 ranks ...; received: 1 rank", which did not tell that mpiexec was missing."""
    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    from tilegraph.runtime.connection import _MPI_RANK_ENV

    for pair in _MPI_RANK_ENV:
        for key in pair:
            monkeypatch.delenv(key, raising=False)
    script = ("import tilegraph as tg\ntry:\n    tg.connect(mpi=True)\nexcept tg.TileError as e:\n"
              "    print(e)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == (
        "[tilegraph.connect(mpi=True)] dask-mpi needs at least 3 ranks (scheduler, client, one worker): mpiexec -n "
        "3 or more; received: 1 rank (this process was not started by mpiexec: run it as `mpiexec -n 4 python "
        "script.py`, or `mpiexec -n 4 tilegraph train --mpi`)"), proc.stdout + proc.stderr[-2000:]


TLS_WITHOUT_FILES = """
import tilegraph as tg

with tg.connect(mpi=True, interface="lo", tls=True) as rt:
    print("connected", flush=True)
"""


@pytest.mark.slow
def test_tls_true_without_files_under_mpi_is_said_once(tmp_path):
    """Before: ``tg.connect(mpi=True, tls=True)`` raised the same TileError, with its traceback,
    on every rank (3 of them under ``mpiexec -n 3``). Now the client rank says it once."""
    rc, out, err = _launch(tmp_path, 3, TLS_WITHOUT_FILES)
    assert rc != 0 and "connected" not in out, out + err[-3000:]
    assert err.count("TileError:") == 1, err[-3000:]
    assert "TLS under MPI needs certificate files every rank can read" in err and "received: tls=True without files" \
        in err, err[-3000:]
