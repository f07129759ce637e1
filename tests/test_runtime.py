"""Runtime: embedded cluster, remote addresses, GPU resource placement, packaging."""

import json
import os
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from distributed.diagnostics.plugin import WorkerPlugin

import tilegraph as tg
from test_cli import end_group

pytestmark = pytest.mark.distributed


def test_embedded_cluster_binds_localhost_and_prints_dashboard(capsys):
    with tg.connect(n_workers=1, threads_per_worker=1) as rt:
        out = capsys.readouterr().out
        assert "dashboard: http://127.0.0.1:" in out
        assert rt.client.scheduler.address.startswith("tcp://127.0.0.1:")
        assert tg.current_runtime() is rt
        x = tg.from_numpy(np.arange(12.0).reshape(3, 4), (2, 2))
        np.testing.assert_array_equal((x * 2.0).numpy(), np.arange(12.0).reshape(3, 4) * 2)
    assert rt.closed and tg.current_runtime() is not rt


def test_a_workers_snapshot_classifies_workers_by_their_resources():
    """``Workers.of`` reads one ``scheduler_info``: a worker offering GPUs counts as one
    single-stream processor per GPU; with a "CPU" resource declared anywhere, only the workers
    declaring it run CPU tasks; the snapshot cannot be changed afterwards."""
    from tilegraph.runtime import Workers

    info = {"tcp://b:2": {"nthreads": 4, "resources": {"CPU": 4}, "memory_limit": 2 << 30},
            "tcp://a:1": {"nthreads": 1, "resources": {"GPU": 2}, "memory_limit": 0},
            "tcp://c:3": {"nthreads": 8, "resources": {}, "memory_limit": 1 << 30}}
    w = Workers.of(info)
    assert w.cpu_resource
    assert dict(w.threads) == {"cpu": (4,), "gpu": (1, 1)} and dict(w.addrs) == {"cpu": ("tcp://b:2",),
                                                                                 "gpu": ("tcp://a:1", "tcp://a:1")}
    assert w.memory_limit == 1 << 30 and w.memory_limits["tcp://a:1"] is None  # 0: no limit
    assert w.processors() == {"cpu": 4, "gpu": 2}
    # without a CPU resource anywhere, every non-GPU worker runs CPU tasks, unrestricted
    plain = Workers.of({a: dict(i, resources={}) for a, i in info.items()})
    assert not plain.cpu_resource and dict(plain.threads) == {"cpu": (1, 4, 8), "gpu": ()}
    # GPU workers alone (the embedded cluster on a GPU machine): CPU tasks run on them, unrestricted,
    # with their threads
    gpus = Workers.of({"tcp://a:1": {"nthreads": 16, "resources": {"GPU": 1}}})
    assert dict(gpus.threads) == {"cpu": (16,), "gpu": (1,)} and dict(gpus.addrs)["cpu"] == ("tcp://a:1",)
    assert not gpus.cpu_resource
    with pytest.raises(TypeError):
        w.threads["cpu"] = (1,)
    with pytest.raises(AttributeError):
        w.cpu_resource = False
    assert Workers.of({}).memory_limit == float("inf")


def test_asking_for_worker_threads_changes_nothing_a_plan_reads(embedded_runtime):
    """A plan keeps the snapshot it was made with (its tasks' pinning and resources); asking the
    runtime for its threads later neither changes that nor what the runtime last planned with."""
    rt = embedded_runtime
    with rt.as_current():
        exe = tg.compile([tg.from_numpy(np.ones((4, 4)), (2, 2)) * 2.0])
    before = rt.last_workers
    assert exe.workers == before and exe.workers.processors() == rt.processors()
    assert rt.worker_threads() == {d: list(t) for d, t in exe.workers.threads.items()}
    assert rt.last_workers is before  # worker_threads() and processors() took no snapshot
    assert exe.memory_limit == exe.workers.memory_limit


def test_a_closed_runtime_is_named_as_closed():
    x = tg.from_numpy(np.ones(4))
    rt = tg.connect(n_workers=1, threads_per_worker=1, quiet=True, dashboard=False, make_current=False)
    with rt.as_current():
        exe = tg.compile([x * 2.0])
    rt.close()
    assert repr(rt) == "<tilegraph.Runtime closed>"  # it raised AttributeError
    with pytest.raises(tg.TileError, match=r"\[tilegraph.compile\] an open runtime: this one was closed"):
        tg.compute(x, runtime=rt)  # Dask's "IOLoop is closed" before
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Executable.run\] an open runtime"):
        exe.run()


_GROUP_SIGNAL_SCRIPT = """
import signal, sys, time
import numpy as np
import tilegraph as tg

if __name__ == "__main__":
    rt = tg.connect(n_workers=2, threads_per_worker=1, quiet=True, dashboard=False)
    x = tg.from_numpy(np.arange(8.0), 4)
    import os
    pids = sorted(rt.client.run(os.getpid).values())
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
    signal.signal(signal.SIGINT, lambda *a: got.append("INT"))
    print("ready", flush=True)
    while len(got) < 2:
        time.sleep(0.05)
    time.sleep(1.0)  # a worker that the signals killed would be gone by now
    with rt.as_current():
        total = float((x * 2.0).sum().numpy())
    same = sorted(rt.client.run(os.getpid).values()) == pids  # not restarted by their nannies
    print("same workers", same, "total", total, "signals", ",".join(got), flush=True)
    rt.close()
"""


def test_a_signal_to_the_process_group_leaves_the_embedded_workers_to_the_client(tmp_path):
    """A job scheduler's SIGTERM and a terminal's Ctrl-C reach every process of the group: the
    embedded cluster's workers leave them to the client (which stops training after the steps
    under way and checkpoints: the workers hold the state), and go when it closes the cluster.
    Before, a SIGTERM to the group killed the workers, and with them the parameters."""
    import signal

    script = tmp_path / "group.py"
    script.write_text(_GROUP_SIGNAL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        end_group(proc)  # (a SIGKILL to the group left multiprocessing's semaphores in /dev/shm)
    assert proc.returncode == 0, err[-2000:]
    assert "same workers True total 56.0 signals TERM,INT" in out, out + err[-2000:]


def _listening(pid: int) -> list[tuple[str, int]]:
    import psutil

    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def test_embedded_cluster_listens_only_on_loopback():
    """A Dask worker runs any function a peer sends it: a worker reachable from the network would
    be remote code execution for anyone who can reach its port. Every socket that the embedded
    cluster's processes (scheduler and nannies in this one, the workers) listen on is loopback."""
    import ipaddress

    before = set(_listening(os.getpid()))
    with tg.connect(n_workers=2, threads_per_worker=1, dashboard=True, quiet=True) as rt:
        worker_pids = rt.client.run(os.getpid)
        sockets = {"client process": set(_listening(os.getpid())) - before}
        sockets.update({addr: set(_listening(pid)) for addr, pid in worker_pids.items()})
        for where, socks in sockets.items():
            assert socks, f"{where} listens on nothing?"  # the check below must see something
            exposed = [s for s in socks if not ipaddress.ip_address(s[0]).is_loopback]
            assert not exposed, f"{where} listens on {exposed}"
        # and each worker's own dashboard (its HTTP server) is among them, on loopback
        ports = rt.client.run(lambda dask_worker: dask_worker.http_server.port)
        for addr, port in ports.items():
            assert ("127.0.0.1", port) in sockets[addr]


def test_connect_to_an_address_and_a_scheduler_file(embedded_runtime, tmp_path):
    addr = embedded_runtime.client.scheduler.address
    with tg.connect(addr) as rt:
        assert rt.processors()["cpu"] == 2
        assert float(tg.from_numpy(np.ones(4)).sum().numpy()) == 4.0
    path = tmp_path / "sched.json"
    # what `dask scheduler --scheduler-file` writes, less the worker details (Client.write_scheduler_file
    # fails now and then: the workers' metrics it copies can hold tuple keys, which JSON refuses)
    path.write_text(json.dumps({"type": "Scheduler", "address": addr}))
    with tg.connect(scheduler_file=str(path)) as rt:
        assert len(rt.workers()) == 2


def test_connect_to_nothing_is_a_clear_error():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.connect\] no Dask scheduler answered within 1 s.*"
                                           r"received: tcp://127.0.0.1:9"):
        tg.connect("tcp://127.0.0.1:9", timeout=1)
    with pytest.raises(tg.TileError, match=r"scheduler file does not exist"):
        tg.connect(scheduler_file="/nonexistent/sched.json")
    with pytest.raises(tg.TileError, match=r"at most one of"):
        tg.connect("tcp://127.0.0.1:9", scheduler_file="x.json")


@pytest.fixture
def emulated_gpu():
    old = tg.config.gpu_array_module
    tg.config.gpu_array_module = "numpy"  # GPU-placed tasks run NumPy kernels on the "GPU" worker
    yield
    tg.config.gpu_array_module = old


def test_gpu_annotated_tasks_run_only_on_the_gpu_worker(emulated_gpu):
    from distributed import get_task_stream

    rng = np.random.default_rng(0)
    # matmuls of 1024^3 per tile: the cost model has them save more on the GPU than the values
    # crossing between the devices cost; the rest is cheap
    a = tg.from_numpy(rng.standard_normal((2048, 2048)).astype(np.float32), 1024)
    b = tg.from_numpy(rng.standard_normal((2048, 2048)).astype(np.float32), 1024)
    c = tg.from_numpy(np.ones(8, np.float32))
    with tg.connect(n_workers=2, gpu=1, threads_per_worker=1, dashboard=False, quiet=True) as rt:
        gpu_workers = {addr for addr, w in rt.workers().items() if w["resources"].get("GPU")}
        assert len(gpu_workers) == 1 and rt.processors() == {"cpu": 1, "gpu": 1}
        y = tg.gelu(a @ b) + 1.0
        loss = (y * y).mean() + (c * 2.0).sum()  # c's kernels: small, on a leaf: the CPU
        grads = tg.grad(loss, [a, b])
        exe = tg.compile([loss, *grads], placement="auto", target_seconds=1e-5)
        devices = {c.device for c in exe.clusters}
        assert devices == {"cpu", "gpu"}  # heavy matmuls on the GPU, light ops on the CPU
        with get_task_stream(rt.client) as ts:
            values = exe.run()
        layers, keys = exe.lower()
        gpu_keys = {k for k, c in zip(keys, exe.clusters) if c.device == "gpu"}
        ran = {t["key"]: t["worker"] for t in ts.data}
        gpu_ran = {k: w for k, w in ran.items() if k in gpu_keys}
        assert gpu_ran and set(gpu_ran.values()) == gpu_workers
        # and every CPU task asked for the CPU resource, which only the other worker offers
        assert exe.workers.cpu_resource and set(layers["cpu"]) and len(layers["cpu"]) == len(keys) - len(gpu_keys)
        cpu_ran = {k: w for k, w in ran.items() if k in layers["cpu"]}
        assert cpu_ran and set(cpu_ran.values()).isdisjoint(gpu_workers)
    want = tg.compute(loss, *grads)
    for v, w in zip(values[:1], want[:1]):
        np.testing.assert_allclose(np.asarray(v).reshape(()), w, rtol=1e-6)


def _placed(*tensors):
    from tilegraph._graph import topo_order
    from tilegraph.plan.cluster import place

    work = [n for n in topo_order([r for t in tensors for r in t.grid.flat]) if not n.is_leaf]
    place(work, "auto", True)
    return work


def test_auto_placement_keeps_small_kernels_on_the_cpu_and_follows_gpu_values():
    rng = np.random.default_rng(0)
    small = tg.from_numpy(rng.standard_normal((32, 32)).astype(np.float32))
    # kernels this small take less time on the CPU than a GPU's launches: the whole graph stays
    assert {n.device for n in _placed(tg.gelu(small @ small).sum())} == {"cpu"}
    big = tg.from_numpy(rng.standard_normal((1024, 1024)).astype(np.float32))
    work = _placed(tg.gelu(big @ big).sum() + (small * 2.0).sum())
    devices = {}
    for n in work:
        devices.setdefault(n.op, set()).add(n.device)
    assert devices["matmul"] == {"gpu"}  # 2 GFLOP: the GPU
    # the cheap kernels reading GPU values stay on the GPU (no trip to the host between them);
    # the one that reads only a leaf and nothing from the GPU stays on the CPU
    assert devices["gelu"] == {"gpu"}
    assert {n.device for n in work if n.inputs and all(i.node.is_leaf for i in n.inputs)
            and n.op != "matmul"} == {"cpu"}
    assert work[-1].device == "gpu"  # the final sum reads a GPU value


def test_gpu_placement_without_gpu_workers_is_a_clear_error(embedded_runtime):
    x = tg.from_numpy(np.ones((4, 4)))
    with pytest.raises(tg.TileError, match=r"placement 'gpu' needs workers with a GPU resource"):
        tg.compile([x @ x], placement="gpu", runtime=embedded_runtime)


def test_no_top_level_ops_models_io_packages(tmp_path):
    code = ("import importlib.util, io, tilegraph.io, tilegraph.ops, tilegraph.models;"
            "assert importlib.util.find_spec('ops') is None;"
            "assert importlib.util.find_spec('models') is None;"
            "assert io.__file__ != tilegraph.io.__file__ if hasattr(io, '__file__') else True;"
            "assert tilegraph.ops.__name__ == 'tilegraph.ops'")
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True,
                   env={**os.environ, "PYTHONPATH": ""})


def test_workers_keep_tile_allocations_on_the_heap(embedded_runtime):
    from tilegraph.runtime.worker_setup import _tune_malloc

    plugins = embedded_runtime.client.run(lambda dask_worker: sorted(dask_worker.plugins))
    assert all("tilegraph-malloc" in p for p in plugins.values())
    if sys.platform.startswith("linux"):
        assert all(embedded_runtime.client.run(_tune_malloc).values())


def test_values_living_on_workers_come_back_and_feed_graphs(embedded_runtime):
    with embedded_runtime.as_current():
        m = tg.nn.MLP(4, 8, tile=2, seed=0)
        before = m.state_dict()
        embedded_runtime.scatter_cells([c for p in m.parameters() for c in p.cells.flat])
        from tilegraph._graph import ValueRef

        assert all(isinstance(c.value, ValueRef) for p in m.parameters() for c in p.cells.flat)
        after = m.state_dict()
        x = np.ones((3, 4), np.float32)
        y = m(tg.from_numpy(x, (3, 2))).numpy()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    h = x @ before["fc1.weight"] + before["fc1.bias"]
    h = 0.5 * h * (1 + np.vectorize(__import__("math").erf)(h / np.sqrt(2)))
    np.testing.assert_allclose(y, h @ before["fc2.weight"] + before["fc2.bias"], rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_values_of_a_closed_runtime_are_a_clear_error():
    m = tg.nn.MLP(4, 8, tile=2, seed=0)
    x = tg.from_numpy(np.ones((3, 4), np.float32), (3, 2))
    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False) as rt:
        rt.scatter_cells([c for p in m.parameters() for c in p.cells.flat])
        with pytest.raises(tg.TileError, match=r"run it inside `with rt.as_current\(\):`.*held by another runtime "
                           r"\(scheduler tcp://127.0.0.1:\d+\), the graph runs on no runtime"):
            m(x).numpy()  # not the current runtime: the values are still there
    # a forward (the parameters are leaves inside the graph) and a parameter itself (a root)
    for compute in (lambda: m(x).numpy(), lambda: m.fc1.weight.numpy()):
        with pytest.raises(tg.TileError, match=r"a runtime that was closed, and went with it.*take what you need "
                           r"out before closing .*received: \d+ tiles held by a closed runtime"):
            compute()


def test_kernels_unpickle_where_their_module_was_never_imported():
    # a worker that has imported only tilegraph finds a kernel registered in tilegraph.io
    import pickle

    from tilegraph.io import data

    payload = pickle.dumps(data._windows_k)
    code = ("import pickle, sys; k = pickle.loads(sys.stdin.buffer.read()); "
            "assert k.name == 'token_windows' and 'tilegraph.io.data' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, check=True)
    assert out.stdout.strip() == b"ok"


from tilegraph._graph import emit1 as _emit1, kernel as _kernel  # noqa: E402


@_kernel("test_user_scaled_add")
def _user_scaled_add(x, y, *, alpha):
    return x + alpha * y


def test_a_kernel_defined_outside_tilegraph_runs_on_the_workers(embedded_runtime):
    # as a kernel written in a notebook or a script would: the workers cannot import its module
    from tilegraph.ops._common import new_tensor

    a = np.arange(12.0).reshape(3, 4)
    x = tg.from_numpy(a, (2, 2))
    y = new_tensor(x.tiling, x.dtype, lambda idx: _emit1(_user_scaled_add, [x.grid[idx], x.grid[idx]],
                                                         x.grid[idx].shape, x.dtype, op="user", alpha=2.0))
    with embedded_runtime.as_current():
        np.testing.assert_array_equal(y.numpy(), 3 * a)


INTERACTIVE = """
import numpy as np
import tilegraph as tg
from tilegraph._graph import emit1, kernel
from tilegraph.ops._common import new_tensor

if __name__ == "__main__":
    @kernel("interactive_scaled_add")   # as in a notebook cell: workers cannot import it
    def scaled_add(x, y, *, alpha):
        return x + alpha * y

    with tg.connect(quiet=True, dashboard=False):
        a = np.arange(12.0).reshape(3, 4)
        x = tg.from_numpy(a, (2, 2))
        y = new_tensor(x.tiling, x.dtype, lambda idx: emit1(scaled_add, [x.grid[idx], x.grid[idx]],
                                                            x.grid[idx].shape, x.dtype, op="user", alpha=2.0))
        assert np.array_equal(y.numpy(), 3 * a)
        print("ok")
"""


def test_a_kernel_defined_in_an_interactive_main_travels_by_value(tmp_path):
    (tmp_path / "script.py").write_text(INTERACTIVE)
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_planned_tasks_run_on_the_worker_the_plan_chose(monkeypatch):
    from distributed import get_task_stream

    monkeypatch.setattr(tg.config, "min_process_seconds", 1e-5)  # spread even this small graph

    rng = np.random.default_rng(0)
    x = tg.from_numpy(rng.standard_normal((4, 64, 64)), (1, 64, 64))  # four independent row tiles
    w = tg.from_numpy(rng.standard_normal((64, 64)), 64)
    y = x
    for _ in range(6):
        y = tg.gelu(y @ w)
    loss = (y * y).mean()
    with tg.connect(n_workers=2, threads_per_worker=1, dashboard=False, quiet=True) as rt:
        exe = tg.compile([loss, *tg.grad(loss, [w])], target_seconds=1e-5)
        assert set(exe.worker_of.values()) == set(rt.workers())  # the plan uses both workers
        with get_task_stream(rt.client) as ts:
            exe.run()
        _, keys = exe.lower()
        ran = {t["key"]: t["worker"] for t in ts.data}
        planned = {keys[cid]: addr for cid, addr in exe.worker_of.items()}
        assert planned and all(ran[k] == addr for k, addr in planned.items())
        # each task's program was sent to that worker alone
        who = rt.client.who_has(exe._program_futures[1])
        for c, f in zip(exe.clusters, exe._program_futures[1]):
            assert set(who[f.key]) == {exe.worker_of[c.id]}


def _busy(i):
    import time

    time.sleep(0.15)
    return i


@pytest.mark.distributed
def test_a_busy_worker_keeps_the_tasks_planned_for_it(embedded_runtime):
    # the plan's placement holds while the other worker idles: Dask's work stealing (which moved
    # 11 of 30 such tasks to the idle worker) is off in the clusters tilegraph starts
    busy, idle = sorted(embedded_runtime.workers())
    layers = {"cpu": {f"tg-busy-{i}": (_busy, i) for i in range(16)}}
    keys = list(layers["cpu"])
    futures = embedded_runtime.submit_layers(layers, keys, workers=dict.fromkeys(keys, busy))
    assert embedded_runtime.client.gather(futures) == list(range(16))
    who = embedded_runtime.client.who_has(futures)
    assert {w for k in keys for w in who[k]} == {busy}


def test_an_optional_cluster_setup_that_fails_is_a_warning_not_an_error(caplog):
    from tilegraph.runtime import _optional_setup

    def refused():
        raise RuntimeError("plugins refused")

    with caplog.at_level("WARNING", logger="tilegraph"):
        assert _optional_setup("install the thing", refused) is False
        assert _optional_setup("install the other thing", lambda: None) is True
    assert [r.getMessage() for r in caplog.records] == ["could not install the thing: plugins refused"]


def _scheduler_send_intervals(dask_scheduler) -> dict:
    return {"workers": {a: bc.interval for a, bc in dask_scheduler.stream_comms.items()},
            "clients": sorted({bc.interval for bc in dask_scheduler.client_comms.values()})}


@pytest.mark.distributed
def test_dask_streams_hold_messages_back_briefly_also_to_a_worker_that_joins_later(own_runtime):
    """Every batched stream of the cluster (the client's, the scheduler's to each worker and
    client, each worker's) waits at most SEND_INTERVAL_SECONDS (Dask's own: 2-10 ms per hop);
    also a worker restarted by its nanny (a new process that registers anew)."""
    from tilegraph.runtime.worker_setup import SEND_INTERVAL_SECONDS

    rt = own_runtime
    want = SEND_INTERVAL_SECONDS
    assert want < 0.002 and rt.client.scheduler_comm.interval == want
    got = rt.client.run_on_scheduler(_scheduler_send_intervals)
    assert got["clients"] == [want] and set(got["workers"].values()) == {want}
    assert set(rt.client.run(lambda dask_worker: dask_worker.batched_stream.interval).values()) == {want}
    first = sorted(got["workers"])[0]
    pid = rt.client.run(os.getpid, workers=[first])[first]
    rt.client.restart_workers([first])
    rt.client.wait_for_workers(2, timeout=60)
    got = rt.client.run_on_scheduler(_scheduler_send_intervals)
    assert len(got["workers"]) == 2 and set(got["workers"].values()) == {want}, got
    new = rt.client.run(os.getpid)
    assert pid not in new.values()  # a new process
    # a second client of the same cluster: its streams too, and no warning of a plugin replaced
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tg.connect(rt.client.scheduler.address, make_current=False) as other:
            assert other.client.scheduler_comm.interval == want
            got = rt.client.run_on_scheduler(_scheduler_send_intervals)
            assert got["clients"] == [want], got
    assert set(rt.client.run(lambda dask_worker: dask_worker.batched_stream.interval).values()) == {want}


@pytest.mark.distributed
def test_programs_go_to_the_workers_once_and_fetches_share_a_task(embedded_runtime, monkeypatch):
    from distributed import Future, get_task_stream

    import tilegraph._lower as lower

    monkeypatch.setattr(lower, "FETCH_WHOLE_MAX_BYTES", 0)  # every fetch through a pick task (see below)

    rng = np.random.default_rng(0)

    def graph():
        x = tg.from_numpy(rng.standard_normal((8, 16)).astype(np.float32), (4, 8))
        w = tg.from_numpy(np.ones((16, 4), np.float32), (8, 4))
        loss = (x @ w).mean()
        return [loss, *tg.grad(loss, [w])]

    roots = graph()
    exe = tg.compile(roots, runtime=embedded_runtime)
    with get_task_stream(embedded_runtime.client) as ts:
        first = exe.run()
    futures = exe._program_futures[1]
    assert exe.run()[0] == pytest.approx(float(first[0]))
    assert exe._program_futures[1] is futures  # scattered once, reused
    layers, _ = exe.lower(programs=futures)
    assert all(isinstance(task[2], Future) for task in layers["cpu"].values())
    # every fetched root of a task comes back through one small task per task
    fetches = [t["key"] for t in ts.data if str(t["key"]).startswith("tg-fetch")]
    sources = {exe.root_location(r)[0] for r in exe.roots if not r.node.is_leaf}
    assert len(fetches) == len(sources) < len(exe.roots)
    # an executable of the same graph and plan names its tasks the same, and its programs apart
    # (a program key shared with a dropped executable could be freed after this one sent it)
    rng = np.random.default_rng(0)
    again = tg.compile(graph(), runtime=embedded_runtime)
    assert again.lower()[1] == exe.lower()[1]
    assert not {f.key for f in again._programs(embedded_runtime)} & {f.key for f in futures}

    # a small result comes back whole, with no pick task to wait for; a larger one through one
    monkeypatch.setattr(lower, "FETCH_WHOLE_MAX_BYTES", 1 << 20)
    for limit, picks in ((1 << 20, 0), (100, len(sources))):
        monkeypatch.setattr(lower, "FETCH_WHOLE_MAX_BYTES", limit)
        with get_task_stream(embedded_runtime.client) as ts:
            got = exe.run()
        assert got[0] == pytest.approx(float(first[0])) and np.allclose(got[1], first[1])
        assert len([t for t in ts.data if str(t["key"]).startswith("tg-fetch")]) == picks


@pytest.mark.distributed
def test_an_executable_of_the_plan_of_one_just_dropped_runs(embedded_runtime):
    """The programs of an executable dropped just before another of the same plan scatters its
    own stay apart: the new one's tasks never lose them (Dask frees a released key on the worker
    through the scheduler, after a scatter may have sent it again)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    for _ in range(6):
        xt = tg.from_numpy(x, (4, 8))
        w = tg.from_numpy(np.ones((16, 4), np.float32), (8, 4))
        exe = tg.compile([(xt @ w).mean()], runtime=embedded_runtime)
        assert exe.run()[0] == pytest.approx(float((x @ np.ones((16, 4))).mean()), rel=1e-5)
        del exe, xt, w


def test_workers_of_another_tilegraph_version_are_refused(embedded_runtime, monkeypatch):
    """A client must not drive workers of another tilegraph: their kernels and programs may differ."""
    addr = embedded_runtime.client.scheduler.address
    monkeypatch.setattr(tg, "__version__", "0.0.0-other")
    with pytest.raises(tg.TileError, match=r"every worker running tilegraph 0\.0\.0-other.*received: tcp://127"):
        tg.connect(addr, make_current=False)


def test_an_error_inside_a_kernel_is_one_clear_error_on_a_quiet_cluster(tmp_path):
    """The client raises the kernel's own error (kernel and op named); the workers of a quiet
    cluster (the CLI's) do not print Dask's "Compute Failed" record and traceback of it."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import numpy as np, tilegraph as tg\n"
        "if __name__ == '__main__':\n"
        "    with tg.connect(quiet=True, dashboard=False):\n"
        "        table = tg.from_numpy(np.ones((4, 3), np.float32))\n"
        "        ids = tg.from_numpy(np.array([[1, 7]]))\n"
        "        try:\n"
        "            tg.embedding(ids, table).numpy()\n"
        "        except tg.TileError as e:\n"
        "            print('raised:', e, '|', e.__notes__)\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "raised: [tilegraph.embedding] ids must lie in [0, 4); received: 7" in run.stdout
    assert "in tile kernel 'embedding' of op 'embedding'" in run.stdout
    assert "Compute Failed" not in run.stderr and "Traceback" not in run.stderr, run.stderr


@pytest.mark.distributed
def test_a_tile_larger_than_a_workers_memory_limit_fails_before_running():
    with tg.connect(n_workers=1, threads_per_worker=1, memory_limit="400MB", dashboard=False, quiet=True,
                    make_current=False) as rt:
        a = tg.from_numpy(np.ones((20000, 8), np.float32))
        b = tg.from_numpy(np.ones((8, 20000), np.float32))
        with pytest.raises(tg.TileError, match=r"fit in a worker's memory limit \(381 MiB\): 'matmul'.* reads and "
                                               r"writes 1,527 MiB; use smaller tiles.*received: tiles \[\(20000, 8\), "
                                               r"\(8, 20000\)\] -> \[\(20000, 20000\)\]"):
            tg.compute(a @ b, runtime=rt)
        assert not rt.client.who_has()  # nothing was submitted
        a, b = tg.from_numpy(np.ones((2000, 8), np.float32)), tg.from_numpy(np.ones((8, 2000), np.float32))
        (ok,) = tg.compute((a @ b).sum(), runtime=rt)  # tiles that fit run
        assert float(ok) == 2000 * 2000 * 8


UNGUARDED = {
    "top level": ('import tilegraph as tg\n\nrt = tg.connect(quiet=True, dashboard=False)\nprint("started")\n', 3),
    "a function called at top level": ('import tilegraph as tg\n\n\ndef main():\n'
                                       '    return tg.connect(quiet=True, dashboard=False)\n\n\n'
                                       'rt = main()\nprint("started")\n', 8),
}


@pytest.mark.parametrize("case", sorted(UNGUARDED))
def test_a_script_starting_the_embedded_cluster_outside_a_main_guard_is_told_so(tmp_path, case):
    """The workers of the embedded cluster run the main script again on starting: a script that
    calls connect() outside `if __name__ == "__main__":` gets one error naming its line, before
    any worker starts (it was a page of tracebacks ending in "Nanny failed to start")."""
    code, line = UNGUARDED[case]
    (tmp_path / "script.py").write_text(code)
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "started" not in out.stdout
    assert 'if __name__ == "__main__":' in out.stderr and f"script.py, line {line}," in out.stderr, out.stderr[-2000:]
    assert "Nanny" not in out.stderr and out.stderr.count("Traceback") == 1, out.stderr[-2000:]


def test_a_script_read_from_standard_input_starts_the_embedded_cluster(tmp_path):
    """`python - <<EOF` (a script on standard input) starts the embedded cluster: its "<stdin>"
    is no file for the worker processes to run again (they failed: "Nanny failed to start")."""
    code = ("import numpy as np\nimport tilegraph as tg\n\nwith tg.connect(n_workers=2, threads_per_worker=1, "
            "quiet=True, dashboard=False) as rt:\n    print('sum', tg.from_numpy(np.ones((4, 4)), (2, 2)).numpy().sum(), "
            "len(rt.workers()))\n")
    out = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "sum 16.0 2", out.stderr[-2000:]


def test_a_package_main_needs_no_guard_and_guards_read_either_way(tmp_path):
    """`python -m pkg` runs pkg/__main__.py, which worker processes do not run again (as
    multiprocessing skips it): no guard needed there. The guard test reads both orders."""
    import ast

    from tilegraph.runtime.connection import _is_main_test

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import numpy as np\nimport tilegraph as tg\n\n"
                                     "with tg.connect(quiet=True, dashboard=False):\n"
                                     "    print('sum', tg.from_numpy(np.ones((4, 4)), (2, 2)).numpy().sum())\n")
    out = subprocess.run([sys.executable, "-m", "pkg"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "sum 16.0", out.stderr[-2000:]
    tests = [ast.parse(src).body[0].test for src in ('if __name__ == "__main__": pass', "if '__main__' == __name__: pass",
                                                     'if __name__ != "__main__": pass', 'if name == "__main__": pass')]
    assert [_is_main_test(t) for t in tests] == [True, True, False, False]


def test_a_worker_process_starting_up_may_not_start_a_cluster(monkeypatch):
    """The backstop in the worker: connect() while the process is still starting (running the
    main script again) is refused with the same advice."""
    import multiprocessing

    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(tg.TileError, match="starting as a worker") as e:
        tg.connect(quiet=True)
    assert 'if __name__ == "__main__":' in str(e.value)


def test_default_workers_of_the_embedded_cluster():
    from tilegraph.runtime import default_workers

    assert [default_workers(n, 0, None) for n in (1, 2, 4, 7, 8, 16, 64)] == [1, 1, 1, 1, 2, 4, 16]
    assert default_workers(16, 0, 2) == 1  # threads_per_worker alone: one process of that many threads
    assert default_workers(16, 2, None) == 2  # a process per GPU


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is set through Linux's sched_setaffinity")
def test_the_embedded_cluster_sizes_itself_by_the_cores_this_process_may_use(tmp_path):
    """Under `taskset -c 0` (or a batch scheduler's binding), the machine's other cores are not
    this job's: the embedded cluster starts one thread, not a thread per core of the machine."""
    code = ("import os\nos.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
            "import tilegraph as tg\nfrom tilegraph._config import usable_cores\n"
            "if __name__ == '__main__':\n    with tg.connect(quiet=True, dashboard=False) as rt:\n"
            "        print(usable_cores(), rt.processors(), tg.from_numpy(__import__('numpy').ones(4)).numpy().sum())\n")
    out = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "1 {'cpu': 1, 'gpu': 0} 4.0", (out.stdout, out.stderr[-2000:])


@pytest.mark.distributed
def test_fetching_two_remote_leaves_of_one_shape_at_once_gives_each_its_own_value(embedded_runtime):
    # a graph whose roots are all leaves runs no task, only a fetch; two such graphs of equal
    # shape on different values held by the workers took one Dask key, so the second got the
    # first one's value while that was still held
    held = []
    for fill in (0.0, 1.0):
        on_workers = tg.compile([tg.from_numpy(np.full((4, 4), fill, np.float32)) + 0.0],
                                runtime=embedded_runtime).run(fetch=[])[0]
        leaf = tg.from_numpy(np.zeros((4, 4), np.float32))
        leaf.grid.flat[0].node.cell.set(on_workers)
        held.append(tg.compile([leaf], runtime=embedded_runtime))
    pending = [exe.run(wait=False) for exe in held]  # both in flight at once
    from tilegraph._lower import gather

    got = [gather(embedded_runtime, p)[0] for p in pending]
    np.testing.assert_array_equal(got[0], np.zeros((4, 4), np.float32))
    np.testing.assert_array_equal(got[1], np.ones((4, 4), np.float32))


def _spill(mib: int, dask_worker=None) -> int:
    """Store ``mib`` MiB of values on this worker through its spill buffer (what does not fit
    under its memory target goes to disk); returns how many went to disk."""
    for i in range(mib // 16):
        dask_worker.data[f"tg-test-spill-{i}"] = np.ones(16 << 17)  # 16 MiB
    return len(dask_worker.data.slow)


class _SlowClose(WorkerPlugin):
    """A worker plugin whose teardown takes ``seconds``: a worker that needs that long to close
    (as one deleting gigabytes of spilled files on a slow disk)."""

    name = "tg-test-slow-close"

    def __init__(self, seconds: float):
        self.seconds = seconds

    def setup(self, worker):
        pass

    def teardown(self, worker):
        time.sleep(self.seconds)


def test_closing_gives_a_worker_that_spilled_the_time_to_delete_its_files(monkeypatch):
    """A worker deletes its spill files as it closes; Dask kills one that has not ended within 4 s
    (and raised TimeoutError from ``close()`` where the killed process took over 5 s more to
    end). ``Runtime.close`` gives each worker that spilled to disk 10 s per GiB more: a worker
    that spilled and takes 6 s to close ends by itself (the old close killed it after 4 s)."""
    from tilegraph import runtime as runtime_mod

    given = {}
    close_nannies = runtime_mod._close_nannies

    async def recorded(timeouts):
        given.update({n.worker_address: t for n, t in timeouts.items()})
        await close_nannies(timeouts)

    monkeypatch.setattr(runtime_mod, "_close_nannies", recorded)
    rt = tg.connect(n_workers=1, threads_per_worker=1, memory_limit="400MB", quiet=True, dashboard=False,
                    make_current=False)
    try:
        (on_disk,) = rt.client.run(_spill, 512).values()
        assert on_disk > 0
        rt.client.register_plugin(_SlowClose(6.0))
        deadline = time.monotonic() + 10
        while not any(rt.cluster.sync(runtime_mod._spilled_bytes, rt.cluster).values()):
            assert time.monotonic() < deadline, "the worker's heartbeat never reported what it spilled"
            time.sleep(0.2)
    except BaseException:
        rt.close()
        raise
    t0 = time.monotonic()
    rt.close()
    assert rt.closed
    (timeout,) = given.values()
    assert timeout >= 5 + 10 * 0.25, given  # over a quarter GiB spilled
    assert 6 <= time.monotonic() - t0 < 60  # its teardown ran to its end


def test_a_worker_that_outlives_dask_s_kill_ends_close_in_a_warning_not_an_exception():
    """Where ``cluster.close()`` raises TimeoutError (a killed worker process that took longer
    to end than Dask waits), ``Runtime.close`` closes the scheduler and finishes Dask's close,
    and says so in a warning, instead of raising at the end of a job that has finished."""
    import asyncio

    from tilegraph.runtime import _close_cluster

    class Status:
        name = "running"

    class Scheduler:
        status = Status()
        closed = False

        async def close(self):
            Scheduler.closed = True

    class Cluster:
        workers = {}
        scheduler = Scheduler()
        calls = 0

        def sync(self, func, *args):
            return asyncio.run(func(*args))

        def close(self):
            Cluster.calls += 1
            if Cluster.calls == 1:
                raise asyncio.TimeoutError()

    with pytest.warns(RuntimeWarning, match="did not end within the time Dask gives it"):
        _close_cluster(Cluster())
    assert Scheduler.closed and Cluster.calls == 2
