"""dask-mpi launch: mpiexec starts scheduler, client and workers; the example trains."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def _mpiexec():
    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def test_mpiexec_launch_trains(tmp_path):
    mpiexec = _mpiexec()
    assert mpiexec, "the mpi extra (mpich) provides mpiexec"
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, str(ROOT / "examples" / "mpi_train.py"),
                           "--steps", "15", "--interface", "lo"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 MPI workers" in proc.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < 0.5 * first
    assert "Traceback" not in proc.stderr  # shutdown noise stays out of users' faces


def test_mpi_needs_three_ranks(tmp_path):
    mpiexec = _mpiexec()
    code = "import tilegraph as tg; tg.connect(mpi=True)"
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "dask-mpi needs at least 3 ranks" in proc.stderr
