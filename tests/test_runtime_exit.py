"""The embedded cluster and the process it runs in: no Dask hook left in the garbage collector,
a quiet exit without ``rt.close()``, and ``connect``'s flags."""

import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import runtime as tg_runtime


def _dask_gc_callbacks() -> list:
    """The callbacks in ``gc.callbacks`` that come from distributed (its GC diagnosis)."""
    return [cb for cb in gc.callbacks if getattr(cb, "__module__", "").startswith("distributed")]


@pytest.fixture
def one_worker():
    rt = tg.connect(n_workers=1, threads_per_worker=1, quiet=True, dashboard=False, make_current=False)
    yield rt
    rt.close()


def test_no_dask_gc_callback_runs_in_the_process_of_the_embedded_scheduler(one_worker):
    """The scheduler's start installs Dask's GC diagnosis, a ``gc.callbacks`` hook that runs in
    the main thread too: a Ctrl-C landing in it was printed as "Exception ignored in: <bound method
    GCDiagnosis._gc_callback ...>" and dropped, and the interrupted fit ran on to its end."""
    assert _dask_gc_callbacks() == []  # [<bound method GCDiagnosis._gc_callback ...>] before
    with one_worker.as_current():
        assert float((tg.from_numpy(np.arange(8.0), 4) * 2.0).sum().numpy()) == 56.0
    gc.collect()
    assert _dask_gc_callbacks() == []


def test_a_closed_embedded_runtime_is_not_kept_for_the_exit():
    rt = tg.connect(n_workers=1, threads_per_worker=1, quiet=True, dashboard=False, make_current=False)
    try:
        assert rt in [r for r, _ in tg_runtime._OPEN_EMBEDDED.values()]  # (the shared test cluster too)
    finally:
        rt.close()
    assert rt not in [r for r, _ in tg_runtime._OPEN_EMBEDDED.values()]
    ref = weakref.ref(rt)
    del rt
    gc.collect()
    assert ref() is None


_EXIT_SCRIPT = """
import sys
import numpy as np
import tilegraph as tg

if __name__ == "__main__":
    rt = tg.connect(n_workers=int(sys.argv[2]), threads_per_worker=1, dashboard=False)
    model = tg.nn.MLP(4, 8, out_dim=2, tile=4, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, lambda m, x: (m(x) * m(x)).mean(), batch_tiles=[(4, None)])
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    print("loss", float(step(x)), flush=True)  # the parameters now live on the workers
    if sys.argv[1] == "pending":
        pending = [step.submit(x) for _ in range(5)]
    print("end", flush=True)
"""


@pytest.mark.parametrize("case, workers", [("done", 1), ("pending", 2)])
def test_a_script_leaving_the_embedded_cluster_open_exits_quietly(tmp_path, case, workers):
    """Without ``rt.close()``, Dask's exit handlers closed the workers first: the scheduler logged
    "ERROR - Removing worker ... caused the cluster to lose scattered data, which can't be
    recovered" (the parameters) and, with steps pending, "cannot schedule new futures after
    shutdown" (Python's thread pools, which the scheduler needs, had ended before them)."""
    script = tmp_path / "leave_open.py"
    script.write_text(_EXIT_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), case, str(workers)], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "end", proc.stdout
    assert "ERROR" not in proc.stderr and "lose" not in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr[-3000:]


_FLAGS = ("mpi", "dashboard", "quiet", "make_current", "tls")


@pytest.fixture
def no_cluster_starts(monkeypatch):
    """Whatever would start or reach a cluster raises :class:`Started` instead."""
    import distributed

    from tilegraph.runtime import mpi

    class Started(Exception):
        pass

    def start(*args, **kwargs):
        raise Started

    for owner, name in ((distributed, "SpecCluster"), (distributed, "Client"), (mpi, "initialize_mpi")):
        monkeypatch.setattr(owner, name, start)
    return Started


@pytest.mark.parametrize("flag", _FLAGS)
@pytest.mark.parametrize("value", ["no", "yes", 1, None])
def test_a_flag_of_connect_that_is_no_bool_is_refused_before_a_cluster_starts(no_cluster_starts, flag, value):
    """``dashboard="no"`` started the dashboard, ``quiet="yes"`` counted as true, ``mpi="no"``
    started an MPI launch: a string is truthy."""
    with pytest.raises(tg.TileError) as e:
        tg.connect(n_workers=1, **{flag: value})
    what = ("True, False or the embedded cluster's dashboard port (1024-65535, e.g. 8787: on 127.0.0.1, which an "
            "ssh tunnel reaches)" if flag == "dashboard" else "True or False")
    assert str(e.value) == f"[tilegraph.connect] {flag} must be {what}; received: {flag}={value!r}"


@pytest.mark.parametrize("flag", _FLAGS)
def test_numpy_bools_are_flags_of_connect(no_cluster_starts, flag):
    with pytest.raises(no_cluster_starts):  # past the checks: the cluster would start
        tg.connect(n_workers=1, **{flag: np.False_})
