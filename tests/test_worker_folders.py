"""Relative paths on a cluster whose workers run in other working folders than the client, as
every cluster started apart from the client does (a batch job's workers, `dask worker` started
elsewhere, other nodes): a checkpoint named `run/checkpoints/step-N` is the client's folder's,
for the workers that write and read its tiles too."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import stop_process

import tilegraph as tg


@pytest.fixture
def cluster_elsewhere(tmp_path):
    """A `dask scheduler` and a `dask worker` whose working folder is tmp_path/elsewhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sched = tmp_path / "scheduler.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": elsewhere}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", "0", "--no-dashboard", "--scheduler-file", str(sched)], **quiet)]
    rt = None
    try:
        deadline = time.monotonic() + 60
        while not sched.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        procs.append(subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", "--scheduler-file",
                                       str(sched), "--nthreads", "1", "--memory-limit", "1GB", "--host", "127.0.0.1",
                                       "--no-dashboard"], **quiet))
        rt = tg.connect(scheduler_file=str(sched), timeout=30, make_current=False, quiet=True)
        rt.client.wait_for_workers(1, timeout=60)
        yield rt, elsewhere
    finally:
        if rt is not None:
            rt.close()
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGCONT)
            stop_process(p)


@pytest.mark.distributed
def test_a_relative_checkpoint_path_is_the_clients_folder_on_workers_elsewhere(cluster_elsewhere, tmp_path,
                                                                              monkeypatch):
    """Before: the save's tiles went to the workers as `run/ck/.step-1.tmp-...`, a folder each
    worker looked for in its own working folder: SaveAbandoned ("the save's temporary folder,
    to write in; received: removed: the save was abandoned"), as `tilegraph train --out run` on
    such a cluster failed at its first checkpoint."""
    rt, elsewhere = cluster_elsewhere
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, lambda m, x, y: ((m(x) - y) ** 2).mean(), runtime=rt)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    step(x, np.tanh(x[:, :4]))  # the weights now live on the worker, which writes them
    with rt.as_current():
        want = model.state_dict()
    path = tg.io.save_checkpoint("run/ck/step-1", model, opt, runtime=rt)
    assert (here / "run" / "ck" / "step-1" / "zarr.json").exists() and not (elsewhere / "run").exists()
    loaded = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=1)
    tg.io.load_checkpoint(path, runtime=rt).load_into(loaded)  # its tiles read on the worker
    with rt.as_current():
        got = loaded.state_dict()
    assert set(got) == set(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
