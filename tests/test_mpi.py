"""dask-mpi launch: mpiexec starts scheduler, client and workers; the example trains."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import stop_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[1]


def _mpiexec():
    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def _ranks_print(tmp_path, code: str, *args: str, n: int = 4) -> dict:
    """Run ``code`` on ``n`` MPI ranks; the values its ``print('NAME', value)`` lines print (rank 1's)."""
    proc = subprocess.run([_mpiexec(), "-n", str(n), sys.executable, "-c", code, *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = set(re.findall(r"print\('(\w+)'", code))
    return {m.group(1): eval(m.group(2), {"inf": float("inf")})
            for m in re.finditer(r"^(\w+) (.*)$", proc.stdout, re.M) if m.group(1) in names}


def test_mpiexec_launch_trains(tmp_path):
    mpiexec = _mpiexec()
    assert mpiexec, "the mpi extra (mpich) provides mpiexec"
    proc = subprocess.run([mpiexec, "-n", "4", sys.executable, str(ROOT / "examples" / "mpi_train.py"),
                           "--steps", "15", "--interface", "lo"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 MPI workers" in proc.stdout
    # each worker rank gets its share of the node's cores (two worker ranks here)
    cores = os.cpu_count() or 1
    assert f"processors {{'cpu': {2 * max(1, cores // 2)}" in proc.stdout, proc.stdout
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", proc.stdout).groups())
    assert last < 0.5 * first
    assert "Traceback" not in proc.stderr  # shutdown noise stays out of users' faces


def test_mpi_needs_three_ranks(tmp_path):
    mpiexec = _mpiexec()
    code = "import tilegraph as tg; tg.connect(mpi=True)"
    for n, received in (("2", "received: 2 ranks"), ("1", "received: 1 rank\n")):
        proc = subprocess.run([mpiexec, "-n", n, sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode != 0
        assert "dask-mpi needs at least 3 ranks" in proc.stderr and received in proc.stderr, proc.stderr


def test_mpi_ranks_get_the_low_overhead_settings_of_the_embedded_cluster(tmp_path):
    """The scheduler and worker ranks run as the embedded cluster does (no worker profiler, no
    root-task queuing, no work stealing, slow periodic ticks), and ``dask_config`` reaches every
    rank."""
    code = (
        "import tilegraph as tg\n"
        "rt = tg.connect(mpi=True, interface='lo', dask_config={'distributed.admin.tick.interval': '3s'})\n"
        "def worker(dask_worker):\n"
        "    return sorted(dask_worker.periodic_callbacks), dask_worker.periodic_callbacks['tick'].callback_time\n"
        "def scheduler(dask_scheduler):\n"
        "    return dask_scheduler.WORKER_SATURATION, 'stealing' in dask_scheduler.extensions or 'stealing' in dask_scheduler.periodic_callbacks\n"
        "print('workers', list(rt.client.run(worker).values()))\n"
        "print('scheduler', rt.client.run_on_scheduler(scheduler))\n"
        "rt.close()\n")
    got = _ranks_print(tmp_path, code)
    workers = got["workers"]
    assert len(workers) == 2
    for callbacks, tick_ms in workers:
        assert "profile" not in callbacks and "profile-cycle" not in callbacks, callbacks
        assert tick_ms == 3000  # dask_config given to connect
    saturation, stealing = got["scheduler"]
    assert saturation == float("inf") and stealing is False


def test_worker_ranks_take_the_memory_limit_given_to_connect(tmp_path):
    """``connect(mpi=True, memory_limit=...)`` is each worker rank's limit, with the embedded
    cluster's lower spill target for it; "auto" gives each of a node's worker ranks the share of
    the memory that its cores are of the node's."""
    import psutil

    code = (
        "import sys, tilegraph as tg\n"
        "rt = tg.connect(mpi=True, interface='lo', memory_limit=sys.argv[1])\n"
        "def worker(dask_worker):\n"
        "    import dask\n"
        "    return (dask_worker.memory_manager.memory_limit, dask.config.get('distributed.worker.memory.target'),\n"
        "            dask_worker.state.nthreads)\n"
        "print('workers', list(rt.client.run(worker).values()))\n"
        "rt.close()\n")
    for given in ("1GB", "auto"):
        workers = _ranks_print(tmp_path, code, given)["workers"]
        assert len(workers) == 2
        for limit, target, threads in workers:
            if given == "1GB":
                assert limit == 10**9 and target < 0.6  # Dask's default target, lowered for the process and a task
            else:
                share = psutil.virtual_memory().total * min(1.0, threads / (os.cpu_count() or 1))
                assert limit == pytest.approx(share, rel=0.01) and threads == max(1, (os.cpu_count() or 1) // 2)


def test_a_worker_rank_that_sees_a_gpu_declares_it_and_the_others_their_cores(tmp_path):
    """Each worker rank decides its resources before dask-mpi starts its worker: {"GPU": 1} where
    it sees a CUDA device (here rank 2 is made to see one), else {"CPU": its threads}; the plan
    then finds a GPU worker among them."""
    code = (
        "from mpi4py import MPI\n"
        "import tilegraph as tg, tilegraph.runtime as runtime\n"
        "if MPI.COMM_WORLD.Get_rank() == 2:\n"
        "    runtime._visible_gpus = lambda: 1\n"
        "rt = tg.connect(mpi=True, interface='lo')\n"
        "res = rt.client.run(lambda dask_worker: (dict(dask_worker.state.total_resources), dask_worker.state.nthreads))\n"
        "print('resources', sorted(res.values(), key=str))\n"
        "print('processors', rt.processors())\n"
        "rt.close()\n")
    got = _ranks_print(tmp_path, code)
    threads = max(1, (os.cpu_count() or 1) // 2)
    assert got["resources"] == [({"CPU": threads}, threads), ({"GPU": 1}, threads)], got
    assert got["processors"]["gpu"] == 1, got


def test_cli_trains_under_mpiexec_with_mpi_in_its_config(tmp_path):
    """`[runtime] mpi = true` in the config does what --mpi does."""
    mpiexec = _mpiexec()
    (tmp_path / "mpi.toml").write_text("[runtime]\nmpi = true\ninterface = \"lo\"\n")
    proc = subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "tilegraph.cli", "train", "mpi.toml", "--steps", "3",
                           "--no-progress", "--out", "run", "--set", "output.checkpoint_every=0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("tilegraph train: GPT2") == 1  # one rank ran the command
    assert len(_losses(tmp_path / "run")) == 3


def _losses(run_dir: Path) -> list[float]:
    import json

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def test_cli_trains_under_mpiexec_like_two_embedded_workers(tmp_path):
    """`mpiexec -n 4 tilegraph train --mpi`: rank 0 the scheduler, rank 1 the command, 2 workers.
    The debug GPT-2's 20 steps give the losses of the embedded cluster with 2 workers of 1 thread
    (the same plan, so the same arithmetic), and only rank 1 writes files."""
    mpiexec = _mpiexec()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "tilegraph.cli", "train", "--steps", "20", "--no-progress"]
    mpi = subprocess.run([mpiexec, "-n", "4", *cli, "--mpi", "--out", "mpi"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=240, env=env)
    assert mpi.returncode == 0, mpi.stdout + mpi.stderr
    assert mpi.stdout.count("tilegraph train: GPT2") == 1  # one rank ran the command
    (tmp_path / "w2.toml").write_text("[runtime]\nworkers = 2\n")
    embedded = subprocess.run([*cli, "w2.toml", "--out", "embedded"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=240, env={**env, "OMP_NUM_THREADS": "1"})
    assert embedded.returncode == 0, embedded.stdout + embedded.stderr
    want = _losses(tmp_path / "embedded")
    assert len(want) == 20 and want[-1] < want[0]
    assert _losses(tmp_path / "mpi") == want
    from tilegraph.io.zarr import is_checkpoint

    assert is_checkpoint(tmp_path / "mpi" / "checkpoints" / "step-000020")  # written by rank 1 and the workers


@pytest.fixture
def dask_mpi_cluster(tmp_path):
    """The Jupyter pattern's cluster: `mpiexec -n 3 dask-mpi --scheduler-file s.json` (a
    scheduler and two workers on the loopback interface), stopped afterwards whatever happens."""
    mpiexec = _mpiexec()
    dask_mpi = Path(sys.executable).parent / "dask-mpi"
    if not dask_mpi.exists():
        pytest.skip("the mpi extra's dask-mpi command is not installed")
    sched = tmp_path / "s.json"
    # the README's config file for such clusters
    readme = (ROOT / "README.md").read_text()
    (tmp_path / "tilegraph.yaml").write_text(re.search(r"```yaml\n(distributed:\n.*?)```", readme, re.S).group(1))
    proc = subprocess.Popen([mpiexec, "-n", "3", str(dask_mpi), "--scheduler-file", str(sched), "--interface", "lo",
                             "--nthreads", "1", "--scheduler-port", "0"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "DASK_CONFIG": str(tmp_path / "tilegraph.yaml")})
    try:
        yield proc, sched
    finally:
        stop_process(proc)


def test_connect_to_a_dask_mpi_cluster_by_its_scheduler_file(dask_mpi_cluster):
    import time

    import numpy as np

    import tilegraph as tg

    proc, sched = dask_mpi_cluster
    deadline = time.monotonic() + 60
    while not sched.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert sched.exists(), "dask-mpi wrote no scheduler file"
    with tg.connect(scheduler_file=str(sched), timeout=30, make_current=False) as rt:
        rt.client.wait_for_workers(2, timeout=60)
        rt.snapshot()  # the workers that joined, as the next plan sees them
        # the README's settings reached the ranks: no profiler, no root-task queuing
        assert all("profile" not in cbs for cbs in rt.client.run(lambda dask_worker: list(dask_worker.periodic_callbacks)).values())
        assert rt.client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.WORKER_SATURATION) == float("inf")
        assert rt.client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.worker_ttl) == 60
        x = tg.from_numpy(np.arange(64.0).reshape(8, 8), (4, 4))
        with rt.as_current():
            np.testing.assert_allclose(((x @ x) + 1.0).numpy(), np.arange(64.0).reshape(8, 8) @
                                       np.arange(64.0).reshape(8, 8) + 1.0)
        rt.client.shutdown()  # the scheduler stops, and dask-mpi's ranks with it
    assert proc.wait(timeout=60) == 0
