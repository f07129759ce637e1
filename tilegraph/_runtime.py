"""Connection to Dask distributed: the embedded local cluster, a remote scheduler, or dask-mpi."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import Any, Sequence

from tilegraph._errors import TileError

__all__ = ["Runtime", "connect", "current_runtime"]

_CURRENT: list["Runtime"] = []

#: the only interface the embedded cluster (scheduler, nannies, workers, dashboards) listens on
LOCALHOST = "127.0.0.1"


def current_runtime() -> "Runtime | None":
    """The runtime that ``tilegraph.compute`` and training use (the last one connected)."""
    while _CURRENT and _CURRENT[-1].closed:
        _CURRENT.pop()
    return _CURRENT[-1] if _CURRENT else None


class Runtime:
    """A connected Dask distributed client (and the cluster, when tilegraph started it).

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, client, cluster=None, mpi: bool = False, make_current: bool = True):
        self.client = client
        self.cluster = cluster
        self.mpi = mpi
        self.closed = False
        #: whether CPU workers declare a "CPU" resource; CPU tasks then ask for {"CPU": 1}
        self.cpu_resource = False
        #: the worker address of each entry of worker_threads(), for pinning planned tasks
        self.worker_addrs: dict[str, list[str]] = {"cpu": [], "gpu": []}
        try:
            _check_worker_versions(client)
        except BaseException:  # nothing half-connected is left behind
            client.close()
            if cluster is not None:
                cluster.close()
            raise
        try:
            client.register_plugin(_malloc_plugin())
        except Exception as e:  # a scheduler that refuses plugins still works, only slower
            logging.getLogger("tilegraph").warning("could not tune worker malloc: %s", e)
        self.worker_threads()  # learn the workers' resources (plans refresh it)
        if make_current:
            _CURRENT.append(self)

    @contextlib.contextmanager
    def as_current(self):
        """Make this runtime the current one inside a ``with`` block."""
        _CURRENT.append(self)
        try:
            yield self
        finally:
            _CURRENT.remove(self)

    # -- information ----------------------------------------------------------------------------
    @property
    def dashboard_link(self) -> str | None:
        try:
            return self.client.dashboard_link
        except Exception:
            return None

    def workers(self) -> dict[str, dict]:
        return self.client.scheduler_info(n_workers=-1)["workers"]

    def processors(self) -> dict[str, int]:
        """Worker threads per device class (a worker with a GPU resource counts as GPU)."""
        return {dev: sum(threads) for dev, threads in self.worker_threads().items()}

    def worker_threads(self) -> dict[str, list[int]]:
        """Threads of each worker process per device class: a worker with ``{"GPU": n}`` counts as
        n single-stream GPU processors, any other worker as one CPU process with its threads.

        Workers tilegraph starts (embedded, MPI) declare ``{"CPU": threads}`` and CPU tasks then
        ask for ``{"CPU": 1}``; on a cluster whose workers declare no CPU resource, CPU tasks carry
        no restriction (a restriction nobody offers would leave them waiting forever).
        """
        workers = sorted(self.workers().items())
        self.cpu_resource = any(w.get("resources", {}).get("CPU") for _, w in workers)
        out: dict[str, list[int]] = {"cpu": [], "gpu": []}
        self.worker_addrs = {"cpu": [], "gpu": []}
        for addr, w in workers:
            res = w.get("resources", {})
            if res.get("GPU"):
                out["gpu"].extend([1] * int(res["GPU"]))
                self.worker_addrs["gpu"].extend([addr] * int(res["GPU"]))
            elif res.get("CPU") or not self.cpu_resource:
                out["cpu"].append(int(w.get("nthreads", 1)))
                self.worker_addrs["cpu"].append(addr)
        return out

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self.workers())} workers"
        return f"<tilegraph.Runtime {self.client.scheduler.address} {state} dashboard={self.dashboard_link}>"

    # -- execution ------------------------------------------------------------------------------
    def submit_layers(self, layers: dict[str, dict], keys: Sequence[str],
                      workers: dict[str, str] | None = None) -> list:
        """Submit one lowered step as a single graph; returns futures for ``keys``.

        CPU and GPU tasks carry their resource restriction; ``workers`` maps task keys to the
        worker the plan put them on (a loose restriction: Dask would otherwise run every task
        next to the parameters, on one worker).
        """
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

        parts = {}
        deps: dict[str, set] = {}
        for name in ("data", "dask"):
            if layers.get(name):
                parts[name] = MaterializedLayer(layers[name])
                deps[name] = set()
        below = set(parts)
        workers = workers or {}
        tasks = []
        for dev, resources in (("cpu", {"CPU": 1} if self.cpu_resource else None), ("gpu", {"GPU": 1})):
            by_worker: dict[str | None, dict] = {}
            for key, task in (layers.get(dev) or {}).items():
                by_worker.setdefault(workers.get(key), {})[key] = task
            for i, (addr, sub) in enumerate(sorted(by_worker.items(), key=lambda kv: kv[0] or "")):
                ann = {"resources": resources} if resources else {}
                if addr is not None:
                    ann.update(workers=[addr], allow_other_workers=True)
                parts[f"{dev}-{i}"] = MaterializedLayer(sub, annotations=ann or None)
                tasks.append(f"{dev}-{i}")
        # task layers depend on each other in all directions; declare it so culling keeps them all
        for name in tasks:
            deps[name] = below | (set(tasks) - {name})
        graph = HighLevelGraph(parts, deps)
        return self.client.get(graph, list(keys), sync=False)

    def scatter_cells(self, cells) -> None:
        """Move the array values of ``cells`` to the workers; the cells then hold references."""
        from tilegraph._graph import ValueRef

        local = [c for c in cells if not isinstance(c.value, ValueRef) and hasattr(c.value, "shape")]
        if not local:
            return
        futures = self.client.scatter([c.value for c in local], hash=False)
        for c, f in zip(local, futures):
            c.set(ValueRef(f, None))

    def kernel_stats(self, reset: bool = False) -> dict:
        """Kernel/task seconds and task counts summed over all workers (see ``_lower.kernel_stats``)."""
        from tilegraph._lower import kernel_stats

        per_worker = self.client.run(kernel_stats, reset)
        total = {"kernel_seconds": 0.0, "task_seconds": 0.0, "tasks": 0, "by_kernel": {}, "by_scope": {}}
        for stats in per_worker.values():
            for k in ("kernel_seconds", "task_seconds", "tasks"):
                total[k] += stats[k]
            for part in ("by_kernel", "by_scope"):
                for name, dt in stats[part].items():
                    total[part][name] = total[part].get(name, 0.0) + dt
        return total

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.client.close()
        finally:
            if self.cluster is not None:
                self.cluster.close()
        if self in _CURRENT:
            _CURRENT.remove(self)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _worker_spec(n_workers: int, threads: int, gpu: int, memory_limit, quiet: bool) -> dict:
    from distributed import Nanny

    spec = {}
    for i in range(n_workers):
        # Every listener on the loopback interface: a Dask worker runs whatever function a peer
        # sends it, so a worker reachable from the network is remote code execution for anyone.
        opts: dict[str, Any] = {"host": LOCALHOST, "dashboard_address": f"{LOCALHOST}:0",
                                "nthreads": threads, "memory_limit": memory_limit,
                                "resources": {"GPU": 1} if i < gpu else {"CPU": threads},
                                "silence_logs": logging.ERROR if quiet else logging.WARN}
        spec[f"{'gpu' if i < gpu else 'cpu'}-{i}"] = {"cls": Nanny, "options": opts}
    return spec


def connect(address: str | None = None, *, scheduler_file: str | None = None, mpi: bool = False,
            n_workers: int | None = None, gpu: int | None = None, threads_per_worker: int | None = None,
            dashboard: bool = True, timeout: float = 10.0, quiet: bool = False, memory_limit="auto",
            make_current: bool = True, interface: str | None = None, dask_config: dict | None = None) -> Runtime:
    """Connect to Dask distributed and make it the current runtime.

    - ``connect()``: start the embedded local cluster (bound to 127.0.0.1, dashboard URL printed);
      ``n_workers`` processes (default 1, or one per GPU) with ``threads_per_worker`` threads
      (default: the cores divided among the workers), the first ``gpu`` of them
      declaring the resource ``{"GPU": 1}`` (default: one per visible CUDA device).
    - ``connect("tcp://host:8786")``: an existing scheduler.
    - ``connect(scheduler_file="scheduler.json")``: a scheduler started with ``--scheduler-file``.
    - ``connect(mpi=True)``: inside ``mpiexec -n N``, dask-mpi makes rank 0 the scheduler, ranks
      >= 2 workers, and rank 1 runs the rest of the script; ``interface`` picks the network
      interface the ranks listen on (e.g. "ib0"; default: the host's address).

    The embedded cluster applies :data:`EMBEDDED_DASK_CONFIG` (low-overhead Dask settings; the
    worker profiler is off) updated with ``dask_config``.

    The runtime becomes the current one (used by ``tilegraph.compute`` and training) unless
    ``make_current=False``; see :meth:`Runtime.as_current`.

    >>> import tilegraph as tg
    >>> with tg.connect(n_workers=1, dashboard=False, quiet=True) as rt:  # doctest: +SKIP
    ...     print(rt.processors())
    """
    from distributed import Client

    where = "tilegraph.connect"
    if sum(x is not None and x is not False for x in (address, scheduler_file, mpi or None)) > 1:
        raise TileError(where, "give at most one of address, scheduler_file and mpi=True",
                        f"address={address!r}, scheduler_file={scheduler_file!r}, mpi={mpi!r}")
    if mpi:
        from tilegraph._mpi import initialize_mpi

        n_mpi_workers = initialize_mpi(interface=interface)
        client = Client()
        client.wait_for_workers(n_mpi_workers, timeout=120)  # a plan needs to know its workers
        return Runtime(client, mpi=True, make_current=make_current)
    if address is not None or scheduler_file is not None:
        target = address if address is not None else f"scheduler file {scheduler_file}"
        if scheduler_file is not None and not os.path.exists(scheduler_file):
            raise TileError(where, "scheduler file does not exist", repr(scheduler_file))
        try:
            client = Client(address, scheduler_file=scheduler_file, timeout=f"{timeout}s")
        except (OSError, TimeoutError) as e:
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s; is it running "
                            "and reachable?", f"{target} ({type(e).__name__}: {e})") from None
        return Runtime(client, make_current=make_current)

    from distributed import Scheduler, SpecCluster

    ncpu = os.cpu_count() or 1
    if gpu is None:
        gpu = _visible_gpus()
    if n_workers is None:
        # One process with a thread per core by default: tiles then move between kernels without
        # serialisation (kernels release the GIL). Measured on 2 cores: 1 x 2 threads trains the
        # bench MLP 1.8x faster than 2 processes x 1 thread.
        n_workers = max(1, gpu) if gpu else 1
    if n_workers < 1 or (gpu or 0) > n_workers:
        raise TileError(where, "need n_workers >= 1 and gpu <= n_workers", f"n_workers={n_workers}, gpu={gpu}")
    if threads_per_worker is None:
        threads_per_worker = max(1, ncpu // n_workers)
    import dask

    # the scheduler and the spawned workers read these while they start
    with dask.config.set({**EMBEDDED_DASK_CONFIG, **(dask_config or {})}):
        if quiet:
            _quiet_logs()
        cluster = SpecCluster(
            workers=_worker_spec(n_workers, threads_per_worker, gpu, memory_limit, quiet),
            scheduler={"cls": Scheduler, "options": {"host": LOCALHOST, "dashboard": dashboard,
                                                      "dashboard_address": f"{LOCALHOST}:0"}},
            silence_logs=logging.ERROR if quiet else logging.WARN,
            name="tilegraph",
        )
        client = Client(cluster)
        client.wait_for_workers(n_workers, timeout=60)
        if quiet:  # worker processes take their logging setup from the parent's config: quiet them here
            client.run(_quiet_logs)
    rt = Runtime(client, cluster, make_current=make_current)
    if dashboard:
        print(f"tilegraph: embedded cluster with {n_workers} workers x {threads_per_worker} threads"
              f"{f', {gpu} GPU' if gpu else ''}; dashboard: {rt.dashboard_link}", flush=True)
    return rt


def _worker_version() -> str | None:
    """This process's tilegraph version (run on each worker); None where tilegraph is missing."""
    try:
        import tilegraph

        return tilegraph.__version__
    except ImportError:
        return None


def _check_worker_versions(client) -> None:
    """Workers must run the client's tilegraph: tasks carry programs of kernel names and
    parameters that another version may read differently, or not at all."""
    import tilegraph

    try:
        versions = client.run(_worker_version)
    except ImportError as e:  # a worker that cannot even unpickle the check
        raise TileError("tilegraph.connect", "workers with tilegraph installed", f"a worker raised {e!r}") from None
    wrong = {addr: v for addr, v in versions.items() if v != tilegraph.__version__}
    if wrong:
        raise TileError("tilegraph.connect", f"every worker running tilegraph {tilegraph.__version__} (this client's)",
                        ", ".join(f"{addr}: {'not installed' if v is None else v}" for addr, v in sorted(wrong.items())))


def _tune_malloc() -> bool:
    """Keep tile-sized allocations on glibc's heap in this process (a worker).

    Dask's nanny starts workers with MALLOC_TRIM_THRESHOLD_=64 KiB, which also switches off glibc's
    adaptive mmap threshold: every allocation above 128 KiB is then a fresh mmap. Tile kernels
    allocate and free large arrays all the time; on the bench block stack that was 340,000 page
    faults and 1.6 s of system time per 3.6 s step. With blocks up to 32 MiB served from the heap
    and up to 1 GiB of freed memory kept for reuse: 7,000 faults, 2.7 s per step.

    One malloc arena for all threads: a tile allocated by one kernel thread and freed by another
    otherwise lands in another thread's arena, whose heap keeps growing and shrinking. Measured on
    the bench block stack with in-task threads (noisy): 19,000-21,000 page faults per step without,
    2,000-15,000 with it, and 0.04-0.28 s instead of 0.22-0.35 s of system time.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # mallopt parameter numbers from malloc.h
    return (bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))
            and bool(libc.mallopt(m_arena_max, 1)))


def _malloc_plugin():
    """A worker plugin applying :func:`_tune_malloc` on every worker, also those joining later."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class MallocPlugin(WorkerPlugin):
        name = "tilegraph-malloc"
        idempotent = True

        def setup(self, worker) -> None:
            _tune_malloc()

    return MallocPlugin()


_DASK_LOGGERS = ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core",
                 "distributed.worker", "distributed.http.proxy", "distributed.batched", "tornado.application")


def _quiet_logs() -> None:
    for name in _DASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


#: Dask settings of the embedded cluster (``connect(dask_config=...)`` overrides them).
#: Measured on the 2-core development machine: root-task queuing halves flat-graph throughput;
#: an idle embedded cluster burnt ~20% of a core in periodic callbacks (10 ms worker profiler,
#: 20 ms event-loop ticks, 100 ms memory and work-stealing polls), about halved by these intervals.
EMBEDDED_DASK_CONFIG = {
    "distributed.scheduler.worker-saturation": float("inf"),
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.scheduler.work-stealing-interval": "1s",
}



def _visible_gpus() -> int:
    try:
        import cupy  # noqa: F401 - only counts devices when the GPU extra is installed

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0
