"""Connection to Dask distributed: the embedded local cluster, a remote scheduler, or dask-mpi."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import socket
import ssl
import struct
import sys
import time
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
        try:
            client.register_plugin(_unchain_plugin())
        except Exception as e:  # training still works; the workers' task records grow with the steps
            logging.getLogger("tilegraph").warning("could not install the task-record cleanup on the workers: %s", e)
        try:
            from tilegraph.exec.shm import shm_plugin

            client.register_plugin(shm_plugin())
        except Exception as e:  # values then still go through shared memory, but what a dead worker
            # left there stays until the host restarts
            logging.getLogger("tilegraph").warning("could not install the shared-memory cleanup on the workers: %s", e)
        #: each worker's shared-memory domain (``exec.shm.shm_domain``), as asked so far
        self._shm_domains: dict[str, str | None] = {}
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
        #: each worker's memory limit in bytes (None: no limit), as of the last worker_threads()
        self.memory_limits = {addr: w.get("memory_limit") or None for addr, w in workers}
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
        state = "closed" if self.closed else _plural(len(self.workers()), "worker")
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
        # "transfer" tasks (picking what another process reads, taking it in there) need no
        # resource, and run before the tasks waiting for a thread next to them: readers wait
        for dev, ann0 in (("cpu", {"resources": {"CPU": 1}} if self.cpu_resource else {}),
                          ("gpu", {"resources": {"GPU": 1}}), ("transfer", {"priority": TRANSFER_PRIORITY})):
            by_worker: dict[str | None, dict] = {}
            for key, task in (layers.get(dev) or {}).items():
                by_worker.setdefault(workers.get(key), {})[key] = task
            for i, (addr, sub) in enumerate(sorted(by_worker.items(), key=lambda kv: kv[0] or "")):
                ann = dict(ann0)
                if addr is not None:
                    ann.update(workers=[addr], allow_other_workers=True)
                parts[f"{dev}-{i}"] = MaterializedLayer(sub, annotations=ann or None)
                tasks.append(f"{dev}-{i}")
        # task layers depend on each other in all directions; declare it so culling keeps them all
        for name in tasks:
            deps[name] = below | (set(tasks) - {name})
        graph = HighLevelGraph(parts, deps)
        return self.client.get(graph, list(keys), sync=False)

    def scatter_cells(self, cells, workers: Sequence[str | None] | None = None) -> None:
        """Move the array values of ``cells`` to the workers; the cells then hold references.

        ``workers`` names each cell's worker (None: Dask's choice; a tuple: a copy on each of
        those workers, each a value of its own: a :class:`CopiesRef`). Values go in batches of at
        most a ``config.task_memory_fraction`` share of the smallest worker memory limit (and
        at least one value): a worker takes in each message whole, and spills what it holds to
        disk only between messages."""
        from tilegraph._config import config
        from tilegraph._graph import CopiesRef, ValueRef

        workers = [None] * len(cells) if workers is None else list(workers)
        local = [(c, w) for c, w in zip(cells, workers) if not isinstance(c.value, ValueRef) and hasattr(c.value, "shape")]
        if not local:
            return
        limits = [v for v in (getattr(self, "memory_limits", None) or {}).values() if v]
        budget = config.task_memory_fraction * min(limits) if limits else float("inf")
        # One scatter per worker: a value several workers read gets a copy (a key) of its own on
        # each; one key broadcast to several workers would lose its extra replicas to Dask's
        # active memory manager once no task waits for them, and move again every step.
        by_worker: dict[str | None, list] = {}
        copies: dict[int, list] = {}
        for c, w in local:
            addrs = (w if isinstance(w, tuple) else (w,)) or (None,)
            for addr in addrs:
                by_worker.setdefault(addr, []).append(c)
            if len(addrs) > 1:
                copies[id(c)] = []
        done: dict[int, ValueRef] = {}

        def send(batch: list, w: str | None) -> None:
            futures = self.client.scatter([c.value for c in batch], hash=False, workers=None if w is None else [w])
            for c, f in zip(batch, futures):
                if id(c) in copies:
                    copies[id(c)].append((w, ValueRef(f, None)))
                else:
                    done[id(c)] = ValueRef(f, None)

        for w, group in by_worker.items():
            batch, size = [], 0
            for c in group:
                if batch and size + c.value.nbytes > budget:
                    send(batch, w)
                    batch, size = [], 0
                batch.append(c)
                size += c.value.nbytes
            send(batch, w)
        for c, _ in local:  # set last: every copy is made from the array itself
            if id(c) in copies:
                first = copies[id(c)][0][1]
                c.set(CopiesRef(first.future, None, tuple(copies[id(c)])))
            else:
                c.set(done[id(c)])

    def shm_domains(self, addrs) -> dict[str, str | None]:
        """Which of the workers ``addrs`` share ``/dev/shm`` (equal strings; None: none), asked
        once per worker."""
        from tilegraph.exec.shm import shm_domain

        missing = [a for a in addrs if a not in self._shm_domains]
        if missing:
            try:
                self._shm_domains.update(self.client.run(shm_domain, workers=missing))
            except Exception:  # a worker that left: its values go over TCP
                self._shm_domains.update({a: None for a in missing})
        return {a: self._shm_domains.get(a) for a in addrs}

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


#: Dask priority of the tasks that move values between worker processes (picking out of a
#: result what another process reads, taking it in there); a step's tasks have priority 0,
#: and higher runs first
TRANSFER_PRIORITY = 100

#: memory a worker process takes before it holds any data: measured 121 MiB (RSS) for an idle
#: embedded worker with tilegraph, NumPy and Dask loaded, plus room for a task's transient
#: buffers
WORKER_BASE_BYTES = 160 << 20


def _memory_settings(memory_limit, threads: int, cores: int) -> dict:
    """Dask settings for workers with this memory limit: Dask spills task results to disk once
    they take more than its "target" share of the limit (default 0.6), not counting the process's
    own memory; under a small limit (a model larger than the workers' memory) that left no room
    for the running task, and the worker went past 95% and was killed. Here the target is
    lowered by the process's own share (:data:`WORKER_BASE_BYTES`) and by a running task's
    (``config.task_memory_fraction``: the planner keeps each task's inputs and outputs under it)."""
    from tilegraph._config import config

    import dask
    from distributed.worker_memory import parse_memory_limit

    try:
        limit = parse_memory_limit(memory_limit, threads, total_cores=cores, logger=logging.getLogger(__name__))
    except (ValueError, TypeError):
        return {}  # Dask's own error follows, when the worker starts
    target = dask.config.get("distributed.worker.memory.target")
    if not limit or not target:
        return {}
    return {"distributed.worker.memory.target":
            max(0.1, target - WORKER_BASE_BYTES / limit - config.task_memory_fraction)}


def _worker_spec(n_workers: int, threads: int, gpu: int, memory_limit, quiet: bool, security=None) -> dict:
    from distributed import Nanny

    spec = {}
    for i in range(n_workers):
        # Every listener on the loopback interface: a Dask worker runs whatever function a peer
        # sends it, so a worker reachable from the network is remote code execution for anyone.
        opts: dict[str, Any] = {"host": LOCALHOST, "dashboard_address": f"{LOCALHOST}:0",
                                "nthreads": threads, "memory_limit": memory_limit,
                                "resources": {"GPU": 1} if i < gpu else {"CPU": threads},
                                "silence_logs": logging.ERROR if quiet else logging.WARN}
        if security is not None:  # nanny and worker speak tls:// with the cluster's certificates
            opts.update(security=security, protocol="tls")
        spec[f"{'gpu' if i < gpu else 'cpu'}-{i}"] = {"cls": Nanny, "options": opts}
    return spec


def connect(address: str | None = None, *, scheduler_file: str | None = None, mpi: bool = False,
            n_workers: int | None = None, gpu: int | None = None, threads_per_worker: int | None = None,
            dashboard: bool = True, timeout: float = 10.0, quiet: bool = False, memory_limit="auto",
            make_current: bool = True, interface: str | None = None, dask_config: dict | None = None,
            security=None, tls: bool = False, tls_ca_file: str | None = None, tls_cert: str | None = None,
            tls_key: str | None = None) -> Runtime:
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

    TLS (``tls://``, every connection encrypted and both ends showing a certificate signed by the
    cluster's CA): give ``tls_ca_file``, ``tls_cert`` and ``tls_key`` (PEM files; all three), or a
    ``distributed.Security`` as ``security``. A client uses them to reach a ``tls://`` scheduler;
    the embedded cluster and the MPI ranks serve with them. ``tls=True`` without files gives the
    embedded cluster temporary certificates of its own (MPI ranks need the files: no key is sent
    between them).

    Connecting to a scheduler first checks, within ``timeout`` seconds, that the peer greets in
    the Dask protocol: a silent port, an HTTP server (a dashboard) or a TLS/plain mismatch is a
    :class:`TileError` naming the address, not a hang.

    The embedded cluster, and the ranks of an MPI launch, apply :data:`CLUSTER_DASK_CONFIG`
    (low-overhead Dask settings; the worker profiler is off) updated with ``dask_config``.

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
    # what shapes a cluster tilegraph starts, given where it starts none (MPI decides the workers)
    shaping = {"n_workers": n_workers, "gpu": gpu, "threads_per_worker": threads_per_worker,
               "memory_limit": None if memory_limit == "auto" else memory_limit}
    if address is not None or scheduler_file is not None:
        shaping.update(dask_config=dask_config, interface=interface)
    given = {k: v for k, v in shaping.items() if v is not None}
    if given and (mpi or address is not None or scheduler_file is not None):
        cluster = "an MPI launch's workers are one per rank from mpiexec" if mpi else \
            "an existing cluster keeps the workers and settings it was started with"
        raise TileError(where, f"{', '.join(given)} only for the embedded cluster ({cluster})",
                        ", ".join(f"{k}={v!r}" for k, v in given.items()))
    tls_files = _tls_files(where, tls_ca_file, tls_cert, tls_key)
    if security is not None and (tls_files or tls):
        raise TileError(where, "give security= or the TLS files (tls_ca_file, tls_cert, tls_key), not both",
                        f"security={security!r}, tls={tls!r}, tls_cert={tls_cert!r}")
    if mpi:
        from tilegraph._mpi import initialize_mpi

        n_mpi_workers = initialize_mpi(interface=interface, security=security, tls=tls, tls_files=tls_files,
                                       dask_config=dask_config)
        client = Client()  # it reads the scheduler's address and the TLS settings from dask's config
        client.wait_for_workers(n_mpi_workers, timeout=120)  # a plan needs to know its workers
        return Runtime(client, mpi=True, make_current=make_current)
    if address is not None or scheduler_file is not None:
        if scheduler_file is not None:
            address = _read_scheduler_file(where, scheduler_file, timeout)
            target = f"{address} (scheduler file {scheduler_file})"
        else:
            target = address
        address, security = _client_security(where, address, security, tls, tls_files)
        _probe_scheduler(where, address, target, timeout, security)
        import dask

        try:
            with dask.config.set(LOG_LENGTH_DASK_CONFIG):  # the client's own logs (the cluster's are its own)
                client = Client(address, timeout=f"{timeout}s", security=security)
        except (OSError, TimeoutError) as e:
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s; is it running "
                            "and reachable?", f"{target} ({type(e).__name__}: {e})") from None
        return Runtime(client, make_current=make_current)

    _refuse_unguarded_script(where)
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
    security = _embedded_security(where, security, tls, tls_files)
    scheduler_opts = {"host": LOCALHOST, "dashboard": dashboard, "dashboard_address": f"{LOCALHOST}:0"}
    if security is not None:
        scheduler_opts.update(security=security, protocol="tls")
    import dask

    # the scheduler and the spawned workers read these while they start
    settings = {**CLUSTER_DASK_CONFIG, **_memory_settings(memory_limit, threads_per_worker, ncpu), **(dask_config or {})}
    with dask.config.set(settings):
        if quiet:
            _quiet_logs()
        cluster = SpecCluster(
            workers=_worker_spec(n_workers, threads_per_worker, gpu, memory_limit, quiet, security),
            scheduler={"cls": Scheduler, "options": scheduler_opts},
            silence_logs=logging.ERROR if quiet else logging.WARN,
            name="tilegraph", security=security,
        )
        client = Client(cluster)  # with the cluster's security
        client.wait_for_workers(n_workers, timeout=60)
        if quiet:  # worker processes take their logging setup from the parent's config: quiet them here
            client.run(_quiet_logs)
    rt = Runtime(client, cluster, make_current=make_current)
    if dashboard:
        print(f"tilegraph: embedded cluster with {_plural(n_workers, 'worker')} x {_plural(threads_per_worker, 'thread')}"
              f"{f', {gpu} GPU' if gpu else ''}{', TLS' if security is not None else ''}; "
              f"dashboard: {rt.dashboard_link}", flush=True)
    return rt


# -- TLS ------------------------------------------------------------------------------------------
_TLS_ARGS = ("tls_ca_file", "tls_cert", "tls_key")


def _tls_files(where: str, ca_file, cert, key) -> tuple[str, str, str] | None:
    """The TLS files (CA, certificate, key) checked before anything connects: all three or none
    (None and "" mean none), each a readable PEM file, the certificate and key a pair."""
    given = {name: os.fspath(v) for name, v in zip(_TLS_ARGS, (ca_file, cert, key)) if v}
    if not given:
        return None
    missing = [name for name in _TLS_ARGS if name not in given]
    if missing:
        raise TileError(where, "TLS needs all three of tls_ca_file, tls_cert and tls_key (PEM files)",
                        f"{', '.join(f'{k}={v!r}' for k, v in given.items())}; missing {', '.join(missing)}")
    for name, path in given.items():
        if not os.path.isfile(path):
            raise TileError(where, f"{name}: an existing file", repr(path))
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise TileError(where, f"{name}: a readable file", f"{path!r} ({e.strerror})") from None
    ca_file, cert, key = (given[name] for name in _TLS_ARGS)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as e:
        raise TileError(where, "tls_ca_file: a PEM CA certificate", f"{ca_file!r} ({e})") from None
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise TileError(where, "tls_cert and tls_key: a PEM certificate and its private key",
                        f"tls_cert={cert!r}, tls_key={key!r} ({e})") from None
    return ca_file, cert, key


def _security_from_files(files: tuple[str, str, str]):
    """One certificate for every role (scheduler, workers, clients), every connection encrypted."""
    from distributed import Security

    ca_file, cert, key = files
    return Security(require_encryption=True, tls_ca_file=ca_file,
                    **{f"tls_{role}_{part}": path for role in ("scheduler", "worker", "client")
                       for part, path in (("cert", cert), ("key", key))})


def _temporary_security(where: str):
    """Certificates made for this cluster alone (in memory; ``Security.temporary``)."""
    from distributed import Security

    try:
        return Security.temporary()
    except ImportError:
        raise TileError(where, "tls=True without certificate files makes temporary ones, which needs the "
                        "cryptography package: pip install cryptography (or give tls_ca_file, tls_cert, tls_key)",
                        "cryptography is not installed") from None


def _check_security(where: str, security):
    from distributed import Security

    if not isinstance(security, Security):
        raise TileError(where, "security: a distributed.Security", f"{type(security).__name__}")
    return security


_GUARD_HELP = ('put the script\'s code under `if __name__ == "__main__":` (the embedded cluster starts '
               'its worker processes by running the main script again, as Python\'s multiprocessing '
               '"spawn" does, and each would start a cluster of its own)')


def _refuse_unguarded_script(where: str) -> None:
    """Refuse to start the embedded cluster from a script's top-level code outside
    ``if __name__ == "__main__":``: every worker process would run that code again on starting
    and fail (a page of tracebacks ending in "Nanny failed to start"). Checked here, before
    anything starts: the line of the main script that led to this call, against the script's
    own source. In a worker started that way, the call itself is refused."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise TileError(where, _GUARD_HELP, "connect() called while this process was starting as a worker of "
                        "an embedded cluster (it runs the main script again)")
    import dask

    main = sys.modules.get("__main__")
    if main is None:
        return
    path = getattr(main, "__file__", None)
    name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if (dask.config.get("distributed.worker.multiprocessing-method", "spawn") == "fork"
            or name == "__main__" or name.endswith(".__main__")):
        return  # the workers do not run it again (a package's __main__ is skipped, as multiprocessing does)
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None or not path:
        return  # not called from a script's top level (a notebook, python -c, a function run by a thread, ...)
    line = frame.f_lineno
    try:
        import ast

        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return
    for node in ast.walk(tree):  # the line in the body of such an if
        if (isinstance(node, ast.If) and _is_main_test(node.test)
                and node.body[0].lineno <= line <= node.body[-1].end_lineno):
            return
    raise TileError(where, _GUARD_HELP, f"called from {path}, line {line}, outside such a block")


def _is_main_test(test) -> bool:
    """Whether ``test`` reads ``__name__ == "__main__"`` (either way round)."""
    import ast

    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _embedded_security(where: str, security, tls: bool, files):
    """The embedded cluster's Security, or None for plain tcp:// on 127.0.0.1."""
    if security is not None:
        return _check_security(where, security)
    if files:
        return _security_from_files(files)
    return _temporary_security(where) if tls else None


def _client_security(where: str, address: str, security, tls: bool, files):
    """The address to dial and the Security to dial it with (None: dask's configured default).

    Certificates given make a scheme-less address tls://; a tcp:// address with certificates, or
    a tls:// address without any (here or in dask's config), is an error rather than a refusal.
    """
    from distributed import Security

    if files:
        security = _security_from_files(files)
    elif security is not None:
        security = _check_security(where, security)
    elif tls:
        raise TileError(where, "tls=True for a running scheduler needs its CA and a client certificate: "
                        "tls_ca_file, tls_cert and tls_key (or security=)", address)
    wants_tls = security is not None and bool(security.tls_ca_file and security.tls_client_cert)
    if "://" not in address and wants_tls:
        address = f"tls://{address}"
    scheme = address.split("://", 1)[0] if "://" in address else "tcp"
    if scheme == "tcp" and wants_tls:
        raise TileError(where, "TLS certificates were given, so a tls:// scheduler address", address)
    if scheme == "tls" and security is None:
        security = Security()  # dask's config may name the files (distributed.comm.tls.*)
        if not (security.tls_ca_file and security.tls_client_cert):
            raise TileError(where, "a tls:// scheduler needs its CA and a client certificate: tls_ca_file, "
                            "tls_cert and tls_key (or security=, or dask config distributed.comm.tls.*)", address)
    return address, security


# -- is a Dask scheduler there? -------------------------------------------------------------------
#: a greeting longer than this is no Dask handshake (which is about a hundred bytes)
_MAX_GREETING = 1 << 20
#: how long a peer may stay silent before a second connection asks whether it is an HTTP server
_HTTP_CHECK_AFTER = 0.5
#: sent on that second connection: an HTTP request (GET / with an empty line after it), which both
#: Python's http.server and Tornado (Dask's dashboards) answer; 7 bytes, fewer than the 8-byte
#: length a Dask server reads first, so a slow Dask server that gets it waits for more and drops it
_HTTP_PROBE = b"GET /\n\n"


def _read_scheduler_file(where: str, path, timeout: float) -> str:
    """The scheduler address in a scheduler file. A file that is being written (dask writes it
    in place) is read again for up to 2 s before its content counts as wrong."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise TileError(where, "scheduler file does not exist", repr(path))
    deadline = time.monotonic() + min(2.0, timeout)
    while True:
        try:
            with open(path) as f:
                info = json.load(f)
            problem = None if isinstance(info, dict) else f"JSON {type(info).__name__}, not an object"
        except json.JSONDecodeError as e:
            problem = f"invalid JSON ({e})"
        except (OSError, UnicodeDecodeError) as e:
            raise TileError(where, "a readable scheduler file", f"{path!r} ({e})") from None
        if problem is None:
            address = info.get("address")
            if isinstance(address, str) and address:
                return address
            problem = f"no \"address\" (keys: {', '.join(map(str, info)) or 'none'})"
        if time.monotonic() >= deadline:
            raise TileError(where, "a scheduler file: a JSON object with the scheduler's \"address\" (what "
                            "`dask scheduler --scheduler-file` and dask-mpi write)", f"{path!r}: {problem}")
        time.sleep(0.1)


def _probe_scheduler(where: str, address: str, target: str, timeout: float, security) -> None:
    """Check within ``timeout`` that a Dask server answers at a tcp:// or tls:// ``address``.

    Dask's client waits without limit for the peer's handshake, and reads the first 8 bytes of
    whatever comes as the length of a message: a port that accepts and stays silent hangs it, an
    HTTP server's answer becomes a 3 EiB allocation (MemoryError). A Dask server greets first,
    at once: this reads that greeting with a deadline, answers it with a copy (a valid handshake,
    so the server does not log a broken connection), and hangs up; the Client then connects.
    """
    from distributed.comm import parse_address, parse_host_port

    scheme, loc = parse_address(address)
    if scheme not in ("tcp", "tls"):
        return  # other transports (inproc, ucx, ws): Dask's own timeout only
    host, port = parse_host_port(loc)
    deadline = time.monotonic() + timeout
    ctx = security.get_connection_args("client")["ssl_context"] if scheme == "tls" else None
    sock = _dial(where, host, port, deadline, ctx, address, target, timeout)
    with contextlib.closing(sock):
        greeting = _Greeting(sock)
        try:
            done = greeting.read(min(deadline, time.monotonic() + _HTTP_CHECK_AFTER))
            if not done and ctx is None:
                _check_not_http(host, port, deadline)
            done = done or greeting.read(deadline)
        except ssl.SSLError as e:  # TLS 1.3: a refused client certificate shows at the first read
            raise TileError(where, f"a TLS connection the scheduler at {address} accepts (is this client's "
                            "certificate signed by the scheduler's CA?)", f"{target} (SSLError: {e})") from None
        except _NotDask as e:
            raise TileError(where, f"the peer at {address} does not speak the Dask protocol{e.hint}",
                            f"{target}: {e.what}") from None
        if not done:
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s: the peer at {address} "
                            "accepted the connection but sent no Dask handshake (a Dask scheduler sends one at "
                            "once); is the address right? (a tls:// scheduler needs its tls:// address and "
                            "certificates)", target)
        try:
            sock.sendall(greeting.data)
        except OSError:
            pass  # the Client's own connection will tell


class _NotDask(Exception):
    def __init__(self, what: str, hint: str = " (is it a dashboard/HTTP port?)"):
        self.what, self.hint = what, hint


_TLS_HINT = " (it speaks TLS: connect to its tls:// address with tls_ca_file, tls_cert and tls_key)"


def _is_http(first: bytes) -> bool:
    """An HTTP status line, or the HTML page that http.server sends an HTTP/0.9 request."""
    return first.startswith(b"HTTP/") or first.lstrip()[:9].lower().startswith((b"<!doctype", b"<html"))


def _classify(first: bytes, closed: bool) -> _NotDask:
    """What a peer that is not a Dask server sent: HTTP, a TLS alert, nothing, or other bytes."""
    if _is_http(first):
        line = first.split(b"\n", 1)[0].strip().decode("latin-1")
        return _NotDask(f"it answered in HTTP ({line[:60]!r})")
    if first[:1] == b"\x15" and first[1:2] == b"\x03":  # a TLS alert record
        return _NotDask("it answered with a TLS alert", _TLS_HINT)
    if not first and closed:
        return _NotDask("it closed the connection without a Dask handshake",
                        " (is it a dashboard/HTTP port, or a tls:// scheduler?)")
    return _NotDask(f"its first bytes are no Dask handshake: {first[:40]!r}")


class _Greeting:
    """A Dask server's handshake as it arrives: an 8-byte little-endian length, then the message."""

    def __init__(self, sock):
        self.sock, self.data = sock, b""

    def read(self, until: float) -> bool:
        """Read until the greeting is complete (True) or ``until`` passes (False)."""
        while True:
            need = 8 if len(self.data) < 8 else 8 + self._length() - len(self.data)
            if need <= 0:
                return True
            left = until - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(min(need, 65536))
            except (TimeoutError, socket.timeout):
                return False
            except ssl.SSLError:  # an OSError too, but the caller explains it (a refused certificate)
                raise
            except OSError as e:  # reset by the peer
                raise _NotDask(f"the connection failed during the Dask handshake ({e})",
                               " (is it a dashboard/HTTP port, or a tls:// scheduler?)") from None
            if not chunk:
                raise _classify(self.data, closed=True)
            self.data += chunk

    def _length(self) -> int:
        (n,) = struct.unpack("<Q", self.data[:8])
        if not 8 <= n <= _MAX_GREETING:
            raise _classify(self.data, closed=False)
        return n


def _dial(where, host, port, deadline, ctx, address, target, timeout):
    """A socket connected (and TLS-handshaken) to host:port; refused attempts are retried until
    the deadline, as Dask does (a scheduler may still be starting)."""
    delay, last = 0.02, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s; is it running and reachable?",
                            f"{target} ({type(last).__name__}: {last})" if last else target)
        try:
            sock = socket.create_connection((host, port), timeout=left)
        except OSError as e:
            last = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(2 * delay, 0.5)
            continue
        if ctx is None:
            return sock
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return ctx.wrap_socket(sock)
        except (TimeoutError, socket.timeout):
            sock.close()
            raise TileError(where, f"no Dask scheduler answered within {timeout:g} s: the peer at {address} did not "
                            "complete a TLS handshake (is it a tcp:// scheduler?)", target) from None
        except (ssl.SSLError, OSError) as e:
            sock.close()
            raise TileError(where, f"a TLS handshake with the scheduler at {address} (is it a tls:// scheduler, "
                            "and its certificate signed by tls_ca_file?)",
                            f"{target} ({type(e).__name__}: {e})") from None


def _check_not_http(host, port, deadline) -> None:
    """A peer silent on a first connection: ask on a second one whether it is an HTTP server."""
    try:
        sock = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
    except OSError:
        return
    with contextlib.closing(sock):
        try:
            sock.sendall(_HTTP_PROBE)
            sock.settimeout(max(0.001, min(deadline, time.monotonic() + 1.0) - time.monotonic()))
            first = sock.recv(256)
        except OSError:
            return
        if not first:
            raise _classify(b"", closed=True)
        if _is_http(first) or first[:2] == b"\x15\x03":
            raise _classify(first, closed=False)
        # anything else (a slow Dask server's greeting): the first connection decides


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


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


def _tune_malloc(memory_limit: float | None = None) -> bool:
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

    Under a ``memory_limit`` (bytes) the heap keeps at most an eighth of it and serves blocks up
    to a 32nd of it, and after a task that leaves the process above half its limit, the heap's
    free pages go back to the system (``malloc_trim``): freed memory kept for reuse counts in the
    process's memory as Dask sees it, a worker over 70% of its limit spills everything it can,
    and at 80% it stops running tasks until its memory falls, which spilling alone cannot bring
    about (measured: a sharded model 2.3x the workers' 400 MB limit paused both workers for good
    in its second step; with the trim it trains).
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # mallopt parameter numbers from malloc.h
    limit = memory_limit or float("inf")
    if limit < float("inf"):
        from tilegraph.exec import program

        program.AFTER_TASK[:] = [functools.partial(_trim_above, libc, limit / 2)]
    return (bool(libc.mallopt(m_mmap_threshold, int(min(32 << 20, limit / 32))))
            and bool(libc.mallopt(m_trim_threshold, int(min(1 << 30, limit / 8))))
            and bool(libc.mallopt(m_arena_max, 1)))


def _trim_above(libc, threshold: float) -> None:
    """Give the heap's free pages back to the system when this process uses over ``threshold``
    bytes (its resident set, from /proc: ~10 us)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            rss = int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return
    if rss > threshold:
        libc.malloc_trim(0)


def peak_resident_bytes() -> int | None:
    """This process's peak resident memory (Linux ``VmHWM``; None elsewhere). Unlike
    ``ru_maxrss``, which a process started by fork and exec inherits from its parent (a Dask
    worker from the process that started the cluster), it counts this process's memory alone."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _malloc_plugin():
    """A worker plugin applying :func:`_tune_malloc` on every worker, also those joining later."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class MallocPlugin(WorkerPlugin):
        name = "tilegraph-malloc"
        idempotent = True

        def setup(self, worker) -> None:
            _tune_malloc(getattr(getattr(worker, "memory_manager", None), "memory_limit", None))

    return MallocPlugin()


def _unchain(state, key) -> None:
    """Unlink the finished task ``key`` from its dependencies in memory (a worker's state machine).

    A Dask worker forgets a released task only once it has no dependents left, and a dependent
    stays linked until it is forgotten itself. Training steps form an endless chain: step n's
    task reads the parameters step n-1's task left, and the newest one always holds the current
    parameters; so the worker kept a released record of every step before it, back to the first
    (measured over 5,500 steps of the debug GPT-2, one per graph: +1 task record and +41 KB of
    worker memory per step; with this plugin 4 records and +0.4 KB per step, Dask's cache of key
    names). A task in memory never reads its inputs again; unlinked from them, each input is
    forgotten as soon as the scheduler releases it, as it would be at the end of a finite graph.
    An input still linked to tasks that wait for it keeps those links; a task computed again
    gets its inputs linked anew by the scheduler's compute-task message."""
    ts = state.tasks.get(key)
    if ts is None or ts.state != "memory":
        return
    for dep in [d for d in ts.dependencies if d.state == "memory"]:
        ts.dependencies.discard(dep)
        dep.dependents.discard(ts)


def _unchain_plugin():
    """A worker plugin applying :func:`_unchain` to tilegraph's tasks (keys ``tg-...``) as they
    finish, on every worker, also those joining later; other tasks keep Dask's bookkeeping."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class UnchainPlugin(WorkerPlugin):
        name = "tilegraph-unchain"
        idempotent = True

        def setup(self, worker) -> None:
            self.state = worker.state

        def transition(self, key, start, finish, **kwargs) -> None:
            # called by the worker's state machine, on its event loop, after each transition
            if finish == "memory" and isinstance(key, str) and key.startswith("tg-"):
                _unchain(self.state, key)

    return UnchainPlugin()


_DASK_LOGGERS = ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core",
                 "distributed.worker", "distributed.http.proxy", "distributed.batched", "tornado.application")


def _quiet_logs() -> None:
    for name in _DASK_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # A failing task's error reaches the client, which raises it with the kernel and op named;
    # the worker's own "Compute Failed" record of it (a Dask traceback) would only repeat it.
    logging.getLogger("distributed.worker").setLevel(logging.CRITICAL)


#: Dask settings that bound what the scheduler, the workers and the client keep of past work.
#: Dask keeps the last ``low-level-log-length`` entries of each of its logs: the scheduler's
#: transition log and event topics, each worker's transition and stimulus logs, and the "recent
#: messages" of every batched stream, each of which is a whole message under 1 MB (graphs with
#: their inline batches, compute-task messages with their arguments). Dask's default of 1,000 let
#: the client of the debug GPT-2 grow by ~16 KB per step until the logs filled (139 to 155 MB
#: over the first 1,000 steps of one step per graph, and for far longer with several steps per
#: graph; with 100, 134.8 MB at step 500 and 136.0 MB at step 1,000); 100 entries keep a few seconds of history, which is what debugging a hung step reads
#: (``Client.story``, the worker's ``story``) and what the failure checks read (a worker's
#: removal among the scheduler's events, see ``_train.worker_health``).
LOG_LENGTH_DASK_CONFIG = {
    "distributed.admin.low-level-log-length": 100,
}

#: Dask settings of the clusters tilegraph starts: the embedded one, and the scheduler and
#: workers of an MPI launch (``connect(dask_config=...)`` overrides them in both).
#: Measured on the 2-core development machine: root-task queuing halves flat-graph throughput;
#: an idle embedded cluster burnt ~20% of a core in periodic callbacks (10 ms worker profiler,
#: 20 ms event-loop ticks, 100 ms memory and work-stealing polls), about halved by these intervals.
CLUSTER_DASK_CONFIG = {
    "distributed.scheduler.worker-saturation": float("inf"),
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    "distributed.scheduler.work-stealing-interval": "1s",
    # A worker that sends no heartbeat (one every 0.5 s) for this long is restarted through its
    # nanny: its futures are lost, so every wait on them fails (tilegraph names the worker) instead
    # of hanging behind a stopped process (Dask's default: 5 minutes). Longest silence measured on
    # 2 cores: 2.7 s, in GPT-2 124M's data-parallel gradient exchange (2 workers x 1 thread). The
    # scheduler looks every ttl, so a stall ends waits in 1-2 minutes; the Trainer checks sooner.
    "distributed.scheduler.worker-ttl": "60s",
    **LOG_LENGTH_DASK_CONFIG,
}



def _visible_gpus() -> int:
    try:
        import cupy  # noqa: F401 - only counts devices when the GPU extra is installed

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0
