"""Connection to Dask distributed: the embedded local cluster, a remote scheduler, or dask-mpi
(:mod:`~tilegraph.runtime.mpi`); the checks made on connecting are in
:mod:`~tilegraph.runtime.connection`, what runs on the workers in
:mod:`~tilegraph.runtime.worker_setup`."""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import signal
import threading
import uuid
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import numpy as np

from tilegraph import _config
from tilegraph._config import number_check, require_arg
from tilegraph._errors import TileError
from tilegraph.runtime.connection import (_ADDRESS, _address_ok, _client_security, _embedded_security,  # noqa: F401
                                          _probe_scheduler, _read_scheduler_file, _refuse_unguarded_script,
                                          _tls_files)
from tilegraph.runtime.worker_setup import (CLUSTER_DASK_CONFIG, DROP_FETCHED, LOG_LENGTH_DASK_CONFIG, PREFETCH,
                                            _check_worker_versions, _malloc_plugin, _quiet_logs,
                                            _send_interval_plugins, _signals_plugin, _stop_queue_plugin, _unchain_plugin,
                                            bounded_spans_plugins, drop_fetched_plugin, event_addresses_plugin,
                                            live_group_dependencies_plugin, scheduler_send_intervals,
                                            set_send_interval, short_key_sets)

__all__ = ["Runtime", "Workers", "connect", "current_runtime"]

_CURRENT: list["Runtime"] = []

#: the only interface the embedded cluster (scheduler, nannies, workers, dashboards) listens on
LOCALHOST = "127.0.0.1"


#: the statuses of a worker leaving the cluster (retired by ``client.retire_workers`` or a cluster
#: scaling down: Dask moves its values to the others, then removes it; or closing): plans leave
#: it out, and no value is sent to it
LEAVING = ("closing_gracefully", "closing", "closed")

#: how long :meth:`Runtime.scatter_cells` waits for a worker it was to send values to, found
#: leaving the cluster, to be gone (its retirement ends once its values have moved), so that the
#: error names it as gone
LEAVING_WAIT_SECONDS = 10.0

#: the name of the keys of the values :meth:`Runtime.scatter_cells` sends to the workers
#: (parameters, batches): what Dask's dashboard shows for them (``tg-value-<uuid>``)
VALUE_KEY_PREFIX = "tg-value"


def _staying(info: Mapping[str, dict]) -> dict[str, dict]:
    """The workers of ``info`` (the scheduler's records) not leaving the cluster (:data:`LEAVING`);
    all of them where every one is."""
    return {a: w for a, w in info.items() if w.get("status") not in LEAVING} or dict(info)


def current_runtime() -> "Runtime | None":
    """The runtime that ``tilegraph.compute`` and training use (the last one connected)."""
    while _CURRENT and _CURRENT[-1].closed:
        _CURRENT.pop()
    return _CURRENT[-1] if _CURRENT else None


def _optional_setup(what: str, setup) -> bool:
    """Run ``setup()``; where it fails, log that tilegraph could not ``what`` and go on. Returns
    whether it worked."""
    try:
        setup()
        return True
    except Exception as e:
        logging.getLogger("tilegraph").warning("could not %s: %s", what, e)
        return False


def _shorten_send_intervals(client) -> None:
    """:data:`~tilegraph.runtime.worker_setup.SEND_INTERVAL_SECONDS` on every batched stream: the
    client's, the workers' and the scheduler's (this client's stream too)."""
    set_send_interval(getattr(client, "scheduler_comm", None))
    for plugin in _send_interval_plugins():
        client.register_plugin(plugin)
    client.run_on_scheduler(scheduler_send_intervals)


@dataclass(frozen=True)
class Workers:
    """The cluster's workers as one ``scheduler_info`` call saw them: what a plan is made for.

    ``threads``: per device class, the threads of each worker process: a worker with
    ``{"GPU": n}`` counts as n single-stream GPU processors, any other worker as one CPU process
    with its threads; where every worker has a GPU, each also counts as a CPU process with its
    threads (CPU tasks then run beside the GPU's). Workers tilegraph starts (embedded, MPI) declare ``{"CPU": threads}`` and
    CPU tasks then ask for ``{"CPU": 1}`` (``cpu_resource``); on a cluster whose workers declare
    no CPU resource, CPU tasks carry no restriction (a restriction nobody offers would leave them
    waiting forever). ``addrs``: the worker of each entry of ``threads``. ``memory_limits``: each
    worker's limit in bytes (None: none).
    """

    threads: Mapping[str, tuple[int, ...]]
    addrs: Mapping[str, tuple[str, ...]]
    memory_limits: Mapping[str, int | None]
    cpu_resource: bool

    @classmethod
    def of(cls, info: Mapping[str, dict]) -> "Workers":
        """From the ``workers`` of ``Client.scheduler_info()``."""
        workers = sorted(info.items())
        cpu_resource = any(w.get("resources", {}).get("CPU") for _, w in workers)
        threads: dict[str, list[int]] = {"cpu": [], "gpu": []}
        addrs: dict[str, list[str]] = {"cpu": [], "gpu": []}
        for addr, w in workers:
            res = w.get("resources", {})
            if res.get("GPU"):
                threads["gpu"] += [1] * int(res["GPU"])
                addrs["gpu"] += [addr] * int(res["GPU"])
            elif res.get("CPU") or not cpu_resource:
                threads["cpu"].append(int(w.get("nthreads", 1)))
                addrs["cpu"].append(addr)
        if not threads["cpu"]:  # GPU workers alone (the embedded cluster on a GPU machine): CPU
            # tasks carry no restriction and run on them, with their threads
            for addr, w in workers:
                threads["cpu"].append(int(w.get("nthreads", 1)))
                addrs["cpu"].append(addr)
        return cls(MappingProxyType({d: tuple(t) for d, t in threads.items()}),
                   MappingProxyType({d: tuple(a) for d, a in addrs.items()}),
                   MappingProxyType({addr: w.get("memory_limit") or None for addr, w in workers}), cpu_resource)

    def processors(self) -> dict[str, int]:
        """Worker threads per device class."""
        return {dev: sum(t) for dev, t in self.threads.items()}

    @property
    def memory_limit(self) -> float:
        """The smallest memory limit of the workers (bytes; inf where none is set)."""
        return min((v or float("inf") for v in self.memory_limits.values()), default=float("inf"))


class Runtime:
    """A connected Dask distributed client (and the cluster, when tilegraph started it).

    Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, client, cluster=None, mpi: bool = False, make_current: bool = True):
        # checked as connect checks its flags: make_current="no" made it the current one
        _check_connect_arguments("tilegraph.Runtime", mpi=mpi, make_current=make_current)
        mpi, make_current = bool(mpi), bool(make_current)
        if not hasattr(client, "scheduler") or not hasattr(client, "submit"):  # Runtime(address): use connect
            raise TileError("tilegraph.Runtime", "client must be a dask.distributed Client (tg.connect(address) "
                            "connects to a scheduler by its address)", f"{type(client).__name__} {client!r:.60}")
        self.client = client
        self.cluster = cluster
        #: the scheduler's address, kept for messages (a client that lost its scheduler forgets it)
        self.address = getattr(client.scheduler, "address", None)
        self.mpi = mpi
        self.closed = False
        #: the workers as the last plan saw them (:meth:`snapshot`): what its tasks are pinned to,
        #: and what a health check compares the live workers with
        self.last_workers = Workers.of({})
        try:
            #: the workers whose tilegraph version was checked (each once: :meth:`snapshot` checks
            #: those that join later)
            self._version_checked: set[str] = _check_worker_versions(client)
        except BaseException:  # nothing half-connected is left behind
            client.close()
            if cluster is not None:
                cluster.close()
            raise
        # Each setup below is optional: where the cluster refuses it (a scheduler that takes no
        # plugins, say), everything still works and a warning says what is lost.
        from tilegraph.exec.comm_channel import channel_plugin
        from tilegraph.exec.shm import shm_plugin
        from tilegraph.exec.spill import spill_plugin

        # slower: freed heap memory stays with the workers
        _optional_setup("tune worker malloc", lambda: client.register_plugin(_malloc_plugin()))
        # slower: every value a worker spilled to disk is copied again where a task reads it
        _optional_setup("read spilled values back aligned", lambda: client.register_plugin(spill_plugin()))
        # a retired worker's process may log Dask's false "Worker process died unexpectedly" (a TypeError)
        _optional_setup("quiet the false error of a retired worker's process",
                        lambda: client.register_plugin(_stop_queue_plugin()))
        if cluster is not None:  # the workers of the cluster it started: a signal to the process group
            # would stop them, and lose the state they hold, before this process writes its checkpoint
            _optional_setup("leave SIGINT/SIGTERM to this process",
                            lambda: client.register_plugin(_signals_plugin()))
        # with Dask's batching delays on every hop between dependent tasks
        _optional_setup("shorten Dask's send intervals", lambda: _shorten_send_intervals(client))
        # a "zero3" step's processes hold every parameter they fetched until the step ends, and
        # each task waits for its parameters to arrive
        _optional_setup("install the scheduler's drop and prefetch of fetched parameters",
                        lambda: client.register_plugin(drop_fetched_plugin()))
        # a worker lost after a scatter to every worker is reported as a scheduler that did not answer
        _optional_setup("keep the scheduler's event log readable",
                        lambda: client.register_plugin(event_addresses_plugin()))
        # the workers' task records grow with the steps
        _optional_setup("install the task-record cleanup on the workers",
                        lambda: client.register_plugin(_unchain_plugin()))
        # the scheduler keeps a span per graph run on an idle cluster, and the workers their metrics
        _optional_setup("bound the scheduler's spans and the workers' span metrics",
                        lambda: [client.register_plugin(p) for p in bounded_spans_plugins()])
        # the dashboard's task-group graph fails on every refresh between training steps
        _optional_setup("keep the dashboard's task-group graph drawable",
                        lambda: client.register_plugin(live_group_dependencies_plugin()))
        # values still go through shared memory, but what a dead worker left there stays until
        # the host restarts
        _optional_setup("install the shared-memory cleanup on the workers",
                        lambda: client.register_plugin(shm_plugin()))
        #: whether every worker has the handler of gang channels over its comms (between
        #: processes that share no ``/dev/shm``: :mod:`tilegraph.exec.comm_channel`); without
        #: it, gangs run only where every worker shares one /dev/shm
        self.comm_channels = _optional_setup("install the gang channel handler on the workers",
                                             lambda: client.register_plugin(channel_plugin()))
        #: the workers warned of for a memory limit too small to run in (:meth:`_warn_small_workers`)
        self._memory_warned: set[str] = set()
        #: each worker's ``exec.gang.gang_identity()`` (its shared-memory domain first), as asked so far
        self._gang_ids: dict[str, tuple | None] = {}
        #: the measured link between hosts (:meth:`link_bytes_per_second`): (the two workers, bytes/s)
        self._link: tuple[tuple[str, str], float | None] | None = None
        #: the last gang task submitted to each worker (``Executable._submit_gang``) with every
        #: gang task of its call, and the lock that keeps their order that of the submissions
        self.last_gang: dict[str, tuple[Any, tuple]] = {}
        self.gang_lock = threading.Lock()
        self.snapshot(wait=0)  # learn the workers' resources (every plan takes a fresh snapshot); a
        # scheduler may have none yet (worker jobs still queued): a plan waits for them
        if make_current:
            _CURRENT.append(self)
        if cluster is not None:
            _close_at_exit(self)

    @contextlib.contextmanager
    def as_current(self):
        """Make this runtime the current one inside a ``with`` block."""
        _CURRENT.append(self)
        try:
            yield self
        finally:
            if self in _CURRENT:  # close() inside the block took it out already
                _CURRENT.remove(self)

    # -- information ----------------------------------------------------------------------------
    #: False for an embedded cluster started with ``dashboard=False``: its scheduler's HTTP
    #: server answers /health but no dashboard page, so no link is shown
    has_dashboard: bool = True

    @property
    def dashboard_link(self) -> str | None:
        """The dashboard's address (None where there is none)."""
        if not self.has_dashboard:
            return None
        try:
            return self.client.dashboard_link
        except Exception:
            return None

    def workers(self) -> dict[str, dict]:
        """The scheduler's record of each worker, by address (one scheduler call)."""
        return self._workers("tilegraph.Runtime.workers")

    def _workers(self, where: str) -> dict[str, dict]:
        """:meth:`workers`, failing as ``where`` with a TileError when the scheduler is gone or
        does not answer within :data:`SCHEDULER_ANSWER_SECONDS`. Dask's ``scheduler_info`` gives
        an empty record once its client has lost the scheduler (every call then ended in
        "KeyError: 'workers'"), and waits without end on a scheduler that is stopped or hung."""
        self.require_open(where)  # also: a client that lost its scheduler for good
        client = self.client
        address = self.address
        try:
            info = _scheduler_identity(client, -1, SCHEDULER_ANSWER_SECONDS)
        except TimeoutError as e:
            raise TileError(where, f"the Dask scheduler at {address} to answer within {SCHEDULER_ANSWER_SECONDS:g} s "
                            "(is it stopped or hung, or the network to it down?)",
                            f"{type(e).__name__}: {e}".rstrip(": ")) from None
        except OSError as e:  # the client is reconnecting: its scheduler is gone, or the network to it
            raise TileError(where, f"a reachable Dask scheduler: the connection to {address} failed (the scheduler "
                            "ended, or the network to it is down)", f"{type(e).__name__}: {e}".rstrip(": ")) from None
        return info.get("workers", {})

    def require_open(self, where: str, then: str | None = None) -> None:
        """Raise a TileError naming ``where`` when this runtime was closed, or its client lost
        the scheduler for good: its client can ask nothing any more (Dask's own errors are
        "RuntimeError: IOLoop is closed", "KeyError: 'workers'", "AttributeError: 'NoneType'
        object has no attribute 'broadcast'" or "No clients found"). ``then``: what to do after
        connecting again, for a caller bound to this runtime (a Trainer is: connecting again
        alone changed nothing for it)."""
        if self.closed:
            raise TileError(where, "an open runtime: this one was closed (Runtime.close, or the end of its "
                            f"`with` block); connect again with tg.connect(...){f', then {then}' if then else ''}",
                            repr(self))
        status = getattr(self.client, "status", "running")
        if status in ("closing", "closed", "failed"):
            raise TileError(where, f"a connected Dask scheduler: this runtime's client lost the scheduler at "
                            f"{self.address} and stopped reconnecting (the scheduler ended, or the network to it "
                            "failed); what the workers held (parameters, optimizer state) is gone with it: start a "
                            "cluster, connect again with tg.connect(...) and resume from a checkpoint",
                            f"Dask client status {status!r}")

    def scheduler_problem(self, seconds: float | None = None, probe: bool = True) -> str | None:
        """What is wrong with the scheduler, said in a few words naming it, or None while it
        answers: this runtime's client lost its connection to it (Dask's client then reconnects
        for a while, then gives up), or (``probe``) it does not answer within ``seconds``
        (default :data:`SCHEDULER_PROBE_SECONDS`: it answers in milliseconds). For an error of
        work on the workers, which then failed for that reason (the scheduler ended, stopped or
        hung), not for what Dask's error of it says (a cancelled future, a worker health check
        that timed out). Without ``probe``, only the client's state is read (no wait)."""
        if self.closed:
            return None
        status = getattr(self.client, "status", "running")
        if status == "connecting":
            return (f"the connection to the Dask scheduler at {self.address} was lost (the scheduler ended, or the "
                    "network to it failed)")
        if status in ("closing", "closed", "failed"):
            return (f"the Dask scheduler at {self.address} was lost for good (the scheduler ended, or the network to "
                    "it failed, and the client stopped reconnecting)")
        if not probe:
            return None
        client = self.client
        seconds = SCHEDULER_PROBE_SECONDS if seconds is None else seconds
        try:
            _scheduler_identity(client, 0, seconds)
        except TimeoutError:
            return (f"the Dask scheduler at {self.address} does not answer within {seconds:g} s (stopped or hung, or "
                    "the network to it down)")
        except OSError:
            return (f"the connection to the Dask scheduler at {self.address} failed (the scheduler ended, or the "
                    "network to it is down)")
        return None

    def processors(self) -> dict[str, int]:
        """Worker threads per device class (a worker with a GPU resource counts as GPU)."""
        return Workers.of(self.workers()).processors()

    def worker_threads(self) -> dict[str, list[int]]:
        """Threads of each worker process per device class, as the scheduler sees them now (see
        :class:`Workers`); changes nothing."""
        return {dev: list(t) for dev, t in Workers.of(self.workers()).threads.items()}

    def snapshot(self, wait: float | None = None) -> "Workers":
        """The workers now (one scheduler call), kept as :attr:`last_workers`: a plan is made
        for one snapshot and submits its tasks with it.

        A cluster without a worker has nothing to plan for: its tasks would wait for one without
        end, and the parameters' upload fails with Dask's "No valid workers found". The snapshot
        waits up to ``wait`` seconds (None: :data:`WORKERS_WAIT_SECONDS`; 0: not at all) for a
        first worker, then raises a TileError naming the scheduler.

        A worker seen for the first time (one that joined after ``connect``) must run this
        client's tilegraph, as at ``connect``; another version's is a TileError."""
        info = self._workers("tilegraph.Runtime")
        wait = WORKERS_WAIT_SECONDS if wait is None else wait
        if not info and wait:
            try:
                self.client.wait_for_workers(1, timeout=wait)
            except (TimeoutError, OSError):
                start = f"dask worker {self.address}"
                if str(self.address).startswith("tls://"):  # without them a worker cannot join (it ends at once)
                    start += " --tls-ca-file ca.pem --tls-cert cert.pem --tls-key key.pem"
                raise TileError("tilegraph.Runtime", "a cluster with at least one worker to run on: start "
                                f"workers (`{start}`, or your batch job's), or "
                                f"wait for them first (rt.client.wait_for_workers(n))",
                                f"the scheduler at {self.address} had no worker for "
                                f"{wait:g} s") from None
            info = self._workers("tilegraph.Runtime")
        new = [addr for addr in info if addr not in self._version_checked]
        if new:  # joined after connect (a worker started by hand, a batch job's): checked as there
            self._version_checked |= _check_worker_versions(self.client, new, "tilegraph.Runtime", late=True)
        self._warn_small_workers(info)
        # a worker retiring (its values moving to the others) is left out: a plan for it would
        # pin tasks to a worker about to go
        self.last_workers = Workers.of(_staying(info))
        return self.last_workers

    def _warn_small_workers(self, info: Mapping[str, dict]) -> None:
        """Warn (once per worker) of workers started elsewhere (``dask worker --memory-limit``, a
        batch job's) under :data:`MIN_WORKER_MEMORY_BYTES`, which ``connect`` refuses for the
        embedded cluster: such a worker is killed and restarted, or paused, over and over, and
        the first step failed after 10 s with "No valid workers found" and advice for the
        embedded cluster (``tg.connect(memory_limit=...)``, refused for this one)."""
        from dask.utils import format_bytes

        small = {a: w["memory_limit"] for a, w in sorted(info.items()) if a not in self._memory_warned
                 and 0 < (w.get("memory_limit") or 0) < MIN_WORKER_MEMORY_BYTES}
        if not small:
            return
        self._memory_warned |= set(small)
        named = ", ".join(f"{a} ({format_bytes(limit)})" for a, limit in small.items())
        warnings.warn(f"[tilegraph.Runtime] {_plural(len(small), 'worker')} of the scheduler at {self.address} "
                      f"{'runs' if len(small) == 1 else 'run'} under a memory limit below "
                      f"{MIN_WORKER_MEMORY_BYTES >> 20} MiB: {named}. A worker process takes 125-187 MiB itself: "
                      "under such a limit Dask kills and restarts it, or pauses it, over and over, and no task "
                      "runs there; start the workers with a larger one (dask worker --memory-limit 1GiB, or none)",
                      RuntimeWarning, stacklevel=3)

    def __repr__(self) -> str:
        if self.closed:  # the client's scheduler connection is gone
            return "<tilegraph.Runtime closed>"
        try:
            state = _plural(len(self.workers()), "worker")
        except TileError as e:  # a repr never raises (a notebook shows it after a failure)
            return f"<tilegraph.Runtime {self.address} unreachable: {e.what}>"
        link = self.dashboard_link
        return f"<tilegraph.Runtime {self.address} {state}{f' dashboard={link}' if link else ''}>"

    def _repr_html_(self) -> str:
        """What Jupyter shows for a runtime: the scheduler, the workers and the dashboard as a link
        (the text repr's link cannot be clicked), as for Dask's own Client."""
        from html import escape

        if self.closed:
            return "<p><b>tilegraph.Runtime</b>: closed</p>"
        try:
            workers = self.workers()
        except TileError as e:  # (a repr never raises)
            return f"<p><b>tilegraph.Runtime</b> {escape(str(self.address))}: unreachable ({escape(e.what)})</p>"
        from dask.utils import format_bytes

        threads = sum(int(w.get("nthreads", 0)) for w in workers.values())
        limits = [w.get("memory_limit") or 0 for w in workers.values()]
        memory = f", {format_bytes(sum(limits))} memory limit in all" if limits and all(limits) else ""
        link = self.dashboard_link
        dash = f'<a href="{escape(link, quote=True)}" target="_blank">{escape(link)}</a>' if link else "off"
        kind = "embedded cluster" if self.cluster is not None else "MPI launch" if self.mpi else "cluster"
        return (f"<p><b>tilegraph.Runtime</b> ({kind}): scheduler <code>{escape(str(self.address))}</code>, "
                f"{_plural(len(workers), 'worker')}, {_plural(threads, 'thread')}{memory}<br>"
                f"Dask dashboard: {dash}</p>")

    # -- execution ------------------------------------------------------------------------------
    def submit_layers(self, layers: dict[str, dict], keys: Sequence[str],
                      workers: dict[str, str] | None = None, cpu_resource: bool | None = None,
                      drop_fetched: dict[str, str] | None = None, prefetch: bool = False) -> list:
        """Submit one lowered step as a single graph; returns futures for ``keys``.

        CPU and GPU tasks carry their resource restriction (CPU tasks ask for ``{"CPU": 1}``
        where ``cpu_resource``: the plan's :class:`Workers` say whether the CPU workers offer one;
        None: as of the last snapshot); ``workers`` maps task keys to the worker the plan put
        them on (a loose restriction: Dask would otherwise run every task next to the
        parameters, on one worker; strict for gang tasks and for the tasks of the ``"data"`` and
        ``"dask"`` layers it names: the inputs of gang tasks). ``drop_fetched`` (a "zero3" plan)
        maps task keys to their phase, "forward", "backward" or "update": what such a task
        fetched from another worker is dropped there once it has run and no task there that
        would read it soon waits for it (:func:`~tilegraph.runtime.worker_setup.drop_fetched_plugin`);
        with ``prefetch``, a worker fetches what such a task reads from other workers as soon as
        the task before it there is sent there.
        """
        from dask.highlevelgraph import HighLevelGraph, MaterializedLayer

        parts = {}
        deps: dict[str, set] = {}
        workers = workers or {}

        phases = drop_fetched or {}

        def split(name: str, ann0: dict, strict: bool) -> list[str]:
            """Layer ``name`` as one part per worker its tasks are pinned to (one more for the
            others) and phase of ``drop_fetched``; the names of the parts."""
            by_worker: dict[tuple[str, str], dict] = {}
            for key, task in (layers.get(name) or {}).items():
                by_worker.setdefault((workers.get(key) or "", phases.get(key, "")), {})[key] = task
            names = []
            for i, ((addr, phase), sub) in enumerate(sorted(by_worker.items())):
                ann = dict(ann0)
                if phase:
                    ann[DROP_FETCHED] = phase
                    if prefetch:
                        ann[PREFETCH] = True
                if addr:
                    ann.update(workers=[addr], allow_other_workers=not strict)
                names.append(f"{name}-{i}")
                parts[names[-1]] = MaterializedLayer(sub, annotations=ann or None)
            return names

        # those it pins, strictly: the inputs of gang tasks
        below = set(split("data", {}, True) + split("dask", {}, True))
        for name in below:  # a dask graph split by worker reads across its parts
            deps[name] = below - {name}
        # "transfer" tasks (picking what another process reads, taking it in there) need no
        # resource, and run before the tasks waiting for a thread next to them: readers wait;
        # a gang task is pinned strictly: two on one worker would wait for each other
        cpu_resource = self.last_workers.cpu_resource if cpu_resource is None else cpu_resource
        cpu = {"resources": {"CPU": 1}} if cpu_resource else {}
        tasks = (split("cpu", cpu, False) + split("gpu", {"resources": {"GPU": 1}}, False)
                 + split("transfer", {"priority": TRANSFER_PRIORITY}, False) + split("gang", cpu, True))
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
        budget = config.task_memory_fraction * self.last_workers.memory_limit  # inf: no limit
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
        self._require_staying(sorted(w for w in by_worker if w is not None))

        def send(batch: list, w: str | None) -> None:
            with no_worker_alive_error("tilegraph.Runtime.scatter_cells", "the values sent to the workers (parameters, "
                                       "a batch)", self.address):
                # named as tilegraph's tasks are (Dask's own names, "ndarray-<uuid>", said nothing
                # on the dashboard): a key of its own per value, as hash=False gives
                named = {f"{VALUE_KEY_PREFIX}-{uuid.uuid4().hex}": c.value for c in batch}
                futures = self.client.scatter(named, workers=None if w is None else [w])
            for c, f in zip(batch, (futures[k] for k in named)):
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

    def _require_staying(self, addrs: Sequence[str]) -> None:
        """Raise Dask's ``CommClosedError`` (what a step's error handling takes for a lost worker)
        where one of the workers ``addrs`` left the cluster or is leaving it (:data:`LEAVING`),
        once it is gone (up to :data:`LEAVING_WAIT_SECONDS`). Before, a scatter to such a worker
        failed in the scheduler, which logged a traceback ("Exception while handling op
        scatter ... KeyError"), or, for a worker retiring, after 2 s with "No valid workers
        found", which read as workers that died (an adaptive cluster scaling down as the first
        step sent the parameters)."""
        if not addrs:
            return
        import time

        deadline = time.perf_counter() + LEAVING_WAIT_SECONDS
        while True:
            info = self._workers("tilegraph.Runtime.scatter_cells")
            leaving = [a for a in addrs if a in info and info[a].get("status") in LEAVING]
            gone = [a for a in addrs if a not in info]
            if not leaving and not gone:
                return
            if not leaving or time.perf_counter() > deadline:
                break
            time.sleep(0.1)
        from distributed.comm.core import CommClosedError

        raise CommClosedError(f"tilegraph: values to send to worker {(gone + leaving)[0]}, which "
                              f"{'left the cluster' if gone else 'is leaving the cluster (retiring)'}")

    def shm_domains(self, addrs) -> dict[str, str | None]:
        """Which of the workers ``addrs`` share ``/dev/shm`` (equal strings; None: none): the
        first element of their :meth:`gang_identities`."""
        return {a: ident[0] if ident else None for a, ident in self.gang_identities(addrs).items()}

    def _two_hosts(self, addrs: Sequence[str] | None) -> tuple[str, str] | None:
        """Two of the workers ``addrs`` (default: all) on different hosts; None on one host."""
        return _hosts_apart(self.shm_domains(sorted(self.workers() if addrs is None else set(addrs))))

    def spans_hosts(self, addrs: Sequence[str] | None = None) -> bool:
        """Whether the workers ``addrs`` (default: all) run on more than one host (by their
        shared-memory domains, else their addresses)."""
        return self._two_hosts(addrs) is not None

    def link_bytes_per_second(self, addrs: Sequence[str] | None = None) -> float | None:
        """Bytes per second of a value moved between workers (``addrs``, default: all) on two
        hosts, as Dask moves a task's result to a task on another worker (the cluster's comms:
        TCP, or TLS): a :data:`LINK_PROBE_BYTES` value, less the time of a one-byte one, the
        best of three tries.
        Measured once, and again only when the two workers it measures between change. None
        where the workers are all on one host (or fewer than two), or where the measure failed
        (a warning says why); the planner then takes
        ``tilegraph._config.DEFAULT_TRANSFER_BYTES_PER_SECOND``."""
        pair = self._two_hosts(addrs)
        if pair is None:
            return None
        if self._link is not None and self._link[0] == pair:
            return self._link[1]
        try:
            value = _measure_link(self.client, *pair)
        except Exception as e:  # a worker gone meanwhile, a timeout: plan with the default
            default = _config.DEFAULT_TRANSFER_BYTES_PER_SECOND / 1e9
            warnings.warn(f"tilegraph could not measure the link between workers {pair[0]} and {pair[1]} "
                          f"({type(e).__name__}: {e}); plans take {default:g} GB/s "
                          "(set tilegraph.config.transfer_bytes_per_second)", RuntimeWarning, stacklevel=2)
            value = None
        self._link = (pair, value)
        return value

    def gang_done(self, addr: str, future) -> None:
        """Forget ``future``, the last gang task submitted to worker ``addr``, once it is done
        (nothing then needs to wait for it)."""
        with self.gang_lock:
            if self.last_gang.get(addr, (None,))[0] is future:
                del self.last_gang[addr]

    def gang_identities(self, addrs) -> dict[str, tuple | None]:
        """Each worker's ``exec.gang.gang_identity()`` (shared-memory domain, pid namespace, pid,
        free shared memory), asked once per worker; None for a worker that did not answer."""
        from tilegraph.exec.gang import gang_identity

        missing = [a for a in addrs if a not in self._gang_ids]
        if missing:
            try:
                self._gang_ids.update(self.client.run(gang_identity, workers=missing))
            except Exception:  # a worker that left: no gang on it, its values go over TCP
                self._gang_ids.update({a: None for a in missing})
        return {a: self._gang_ids.get(a) for a in addrs}

    def kernel_stats(self, reset: bool = False) -> dict:
        """Kernel/task seconds and task counts summed over all workers (see ``_lower.kernel_stats``)."""
        from tilegraph._lower import kernel_stats

        self.require_open("tilegraph.Runtime.kernel_stats")
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
        _OPEN_EMBEDDED.pop(id(self), None)  # (a closed runtime is not kept for the exit)
        try:
            self.client.close()
        finally:
            if self.cluster is not None:
                _close_cluster(self.cluster)
        if self in _CURRENT:
            _CURRENT.remove(self)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: the embedded runtimes open, by id, with the process that started them:
#: :func:`_close_open_embedded` closes them as that process exits
_OPEN_EMBEDDED: dict[int, tuple[Runtime, int]] = {}
#: the exit hook, once registered
_EXIT_HOOK: list = []


def _close_at_exit(rt: Runtime) -> None:
    """Have the embedded runtime ``rt`` closed as the interpreter exits, if the script left it
    open (its :meth:`~Runtime.close` forgets it).

    Left to Dask, the workers went first, and the scheduler logged each one's end as an ERROR
    ("Removing worker ... caused the cluster to lose scattered data, which can't be recovered":
    the parameters) at the end of a script that had done its work. This closes the client, then
    the cluster, as ``rt.close()`` does, which says nothing.

    It runs as the main thread ends, before Python's thread pools shut down: a
    ``threading._register_atexit`` hook (these run last registered first, so before that of
    ``concurrent.futures``, imported with distributed). An ``atexit`` handler runs after them,
    too late for steps still pending: the scheduler (in this process) reads every graph in such
    a pool, and the steps' futures run their callbacks in one, and each failed with "cannot
    schedule new futures after shutdown", logged as an ERROR. Once the pools are shut down, no
    graph runs on this cluster anyway: a thread of the script still running then loses nothing
    it could have done (it finds the runtime closed)."""
    if not _EXIT_HOOK:  # one hook for every runtime: it cannot be unregistered
        import threading

        try:
            threading._register_atexit(_close_open_embedded)
        except (AttributeError, RuntimeError):  # (no such hook, or the interpreter is exiting already)
            import atexit

            atexit.register(_close_open_embedded)
        _EXIT_HOOK.append(_close_open_embedded)
    _OPEN_EMBEDDED[id(rt)] = (rt, os.getpid())


def _close_open_embedded() -> None:
    """Close every embedded runtime this process started that is still open (quietly: an error
    closing is not the script's). A child forked from it leaves them alone: their client's event
    loop thread is not there, and the cluster is its parent's."""
    for rt, pid in list(_OPEN_EMBEDDED.values()):
        if pid == os.getpid():
            with contextlib.suppress(Exception):
                rt.close()


#: seconds an embedded cluster's worker gets to close, on top of Dask's 5, per GiB it had
#: spilled to disk: a worker deletes its spill files as it closes, and a disk that discards
#: freed blocks takes its time (the 2-core machine: 3.3 GiB in 5.4-8 s)
CLOSE_SECONDS_PER_SPILLED_GIB = 10.0
#: the most a worker is given to close, however much it spilled
CLOSE_SECONDS_MAX = 120.0


def _close_cluster(cluster) -> None:
    """Close an embedded cluster (``cluster.close()``), first giving each worker that spilled
    to disk the time to delete its files. Dask waits 4 s for a worker process to stop, kills
    it, then waits 5 s more: a worker deleting gigabytes of spilled files was killed, and where
    the killed process took longer to end (its kernel still freeing the files),
    ``cluster.close()`` raised TimeoutError half way, the scheduler left open, at the end of a
    job that had finished (the 8.1x capacity bench). Such a timeout now ends in a warning
    naming it, with the scheduler closed."""
    try:
        _close_cluster_of_dask(cluster)
    finally:
        _forget_closed_servers()


def _forget_closed_servers() -> None:
    """Let the closed embedded cluster's scheduler and nannies, which ran in this process, be
    freed. Dask memoizes, for every comm handler it has called, whether it takes a ``comm``
    (``distributed.core._expects_comm``, a ``functools.cache`` keyed by the bound method), and so
    kept every scheduler and nanny that ever served here, with what they held: each
    ``connect()`` / ``close()`` cycle of a notebook kept one more scheduler (its task groups and
    spans, its log of up to 10,000 records, another handler on the ``distributed.scheduler``
    logger). Measured: +15,800 Python blocks and +1.4 MB per cycle of a 200-step fit and 100
    ``tg.compute`` calls; with the memo emptied, +600 blocks (Dask's bounded key-name cache) and
    no growth. The memo only saves an ``inspect.signature`` per handler of the servers still
    running, which Dask then computes again."""
    from distributed import core

    memo = getattr(core, "_expects_comm", None)
    if callable(getattr(memo, "cache_clear", None)):
        memo.cache_clear()


def _close_cluster_of_dask(cluster) -> None:
    """The closing itself, for :func:`_close_cluster` (which then lets go of the servers)."""
    import asyncio

    try:
        spilled = cluster.sync(_spilled_bytes, cluster)
        slow = {n: 5 + CLOSE_SECONDS_PER_SPILLED_GIB * b / 2**30 for n, b in spilled.items() if b > 0}
        if slow:
            cluster.sync(_close_nannies, slow)
    except Exception:  # (a cluster already closing or broken: Dask's own close below does what it can)
        pass
    try:
        cluster.close()
    except (TimeoutError, asyncio.TimeoutError):
        scheduler = getattr(cluster, "scheduler", None)
        with contextlib.suppress(Exception):
            if scheduler is not None and scheduler.status.name not in ("closing", "closed"):
                cluster.sync(scheduler.close)
        with contextlib.suppress(Exception):
            cluster.close()  # (the rest of Dask's close: its event loop stopped)
        warnings.warn("tilegraph: a worker process of the embedded cluster did not end within the time Dask "
                      "gives it after killing it (its system was still freeing its memory or its spilled "
                      "files); the cluster is closed", RuntimeWarning, stacklevel=4)


async def _spilled_bytes(cluster) -> dict:
    """Each live nanny of ``cluster`` -> the bytes its worker last reported spilled to disk."""
    workers = getattr(getattr(cluster, "scheduler", None), "workers", None) or {}
    out = {}
    for nanny in list(cluster.workers.values()):
        ws = workers.get(getattr(nanny, "worker_address", None))
        if ws is not None and getattr(nanny, "status", None) is not None and nanny.status.name == "running":
            out[nanny] = int((ws.metrics.get("spilled_bytes") or {}).get("disk", 0) or 0)
    return out


async def _close_nannies(timeouts: dict) -> None:
    import asyncio

    await asyncio.gather(*(nanny.close(timeout=min(t, CLOSE_SECONDS_MAX), reason="tilegraph-close")
                           for nanny, t in timeouts.items()), return_exceptions=True)


@contextlib.contextmanager
def no_worker_alive_error(where: str, what: str, address: str | None = None):
    """Turn Dask's ``TimeoutError("No valid workers found")`` raised in the block (a scatter: Dask
    waits for a running worker to take the values, then gives up) into a TileError naming
    ``where`` and ``what`` was being sent, the original as its ``__cause__``. With a
    ``quiet=True`` cluster the workers' logs, which say why they are gone, are not shown."""
    try:
        yield
    except TimeoutError as e:
        if "No valid workers found" not in str(e):
            raise
        at = f" of the scheduler at {address}" if address else ""
        # the embedded cluster's workers take their limit from connect; others from how they were started
        embedded = any(rt.address == address for rt, _ in _OPEN_EMBEDDED.values())
        more = "tg.connect(memory_limit=...)" if embedded or not address else \
            "start them with a larger `dask worker --memory-limit` (or your batch job's setting)"
        raise TileError(where, f"a worker{at} alive and running to take {what}: none is. The workers died, keep "
                        "restarting or are paused (killed by their nanny for exceeding their memory limit, say: "
                        f"give them more memory, {more}, and see the workers' log)",
                        f"{type(e).__name__}: {e}") from e


#: how long ``connect(mpi=True)`` waits for every worker rank to join the scheduler
MPI_WORKERS_WAIT_SECONDS = 120.0


@functools.cache
def _identity_takes_n_workers() -> bool:
    """Whether this Dask distributed's ``Scheduler.identity`` takes ``n_workers`` (2025.4.0 on);
    before it, it has no such parameter and answers with every worker's record."""
    from distributed import Scheduler

    return "n_workers" in inspect.signature(Scheduler.identity).parameters


def _scheduler_identity(client, n_workers: int, timeout: float) -> dict:
    """The scheduler's ``identity`` with the records of at most ``n_workers`` workers (-1: all;
    0: none, a cheap question), within ``timeout`` seconds (Dask's TimeoutError past it). A
    scheduler of distributed < 2025.4 (this process's own, or a remote one older than it) has no
    ``n_workers`` and sends every record: asked with it, it answered with a TypeError."""
    if _identity_takes_n_workers():
        try:
            return client.sync(client.scheduler.identity, n_workers=n_workers, callback_timeout=timeout)
        except TypeError as e:  # a remote scheduler older than this client
            if "n_workers" not in str(e):
                raise
    return client.sync(client.scheduler.identity, callback_timeout=timeout)


#: how long the scheduler may take to answer a question about its workers before the runtime says
#: it does not answer (a stopped or hung scheduler keeps its connections open and never answers)
SCHEDULER_ANSWER_SECONDS = 10.0

#: how long :meth:`Runtime.scheduler_problem` waits for the scheduler's answer (it comes within
#: milliseconds: this is for a scheduler that is stopped or hung)
SCHEDULER_PROBE_SECONDS = 2.0

#: how long a plan waits for a first worker on a cluster that has none (:meth:`Runtime.snapshot`):
#: a worker started by hand, or a batch job starting, joins within seconds
WORKERS_WAIT_SECONDS = 30.0

#: the value :meth:`Runtime.link_bytes_per_second` moves between two hosts' workers (bytes): a
#: few tens of milliseconds on a 10 Gb/s network, long against the hops it subtracts
LINK_PROBE_BYTES = 32 << 20

#: how long the link measure may take in all before the planner gives up on it (seconds)
LINK_PROBE_TIMEOUT = 20.0


def _hosts_apart(domains: Mapping[str, str | None]) -> tuple[str, str] | None:
    """Two workers on different hosts (by their shared-memory domain, else their address's
    host), the first in address order and the first on another host; None on one host."""
    from distributed.comm import get_address_host

    host = {a: d if d is not None else get_address_host(a) for a, d in sorted(domains.items())}
    if not host:
        return None
    first = next(iter(host))
    other = next((a for a, h in host.items() if h != host[first]), None)
    return None if other is None else (first, other)


def _probe_value(n: int):
    """A value of ``n`` random bytes (incompressible: Dask may compress what it sends)."""
    import numpy as np

    return np.frombuffer(np.random.default_rng().bytes(n), np.uint8)


def _probe_read(value) -> int:
    return int(value.nbytes)


def _measure_link(client, a: str, b: str, size: int = LINK_PROBE_BYTES, tries: int = 3) -> float | None:
    """Bytes per second of a ``size``-byte value made on worker ``a`` and read by a task on
    worker ``b``, the time of a one-byte value subtracted (Dask's hops); the best of ``tries``
    (the first move between two workers runs slower: 0.5 against 1.7-2.1 GB/s over loopback).
    None where the big value moved no slower than the small one."""
    import time

    from distributed import wait

    best = {}
    deadline = time.perf_counter() + LINK_PROBE_TIMEOUT
    for n in (1, size):
        for _ in range(tries):
            src = client.submit(_probe_value, n, workers=[a], allow_other_workers=False, pure=False)
            wait(src, timeout=max(0.0, deadline - time.perf_counter()))
            t0 = time.perf_counter()
            got = client.submit(_probe_read, src, workers=[b], allow_other_workers=False, pure=False)
            if got.result(timeout=max(0.0, deadline - t0)) != n:  # pragma: no cover - a broken worker
                raise RuntimeError(f"the probe read {got.result()} bytes of {n}")
            best[n] = min(best.get(n, float("inf")), time.perf_counter() - t0)
            del src, got
    moved = best[size] - best[1]
    return size / moved if moved > 0 else None


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


#: the smallest memory limit a worker process runs under (bytes): a worker process took 125 MiB
#: (resident) idle and 187 MiB after its first training step (tilegraph's executor loaded), and
#: Dask pauses a worker at 80% of its limit and its nanny kills it at 95%. Measured on one worker
#: training a small MLP: under 1-180 MiB the nanny killed and restarted the worker every second
#: (the step ended in Dask's "No valid workers found" after 32 s); under 200 and 225 MiB it stayed
#: paused; under 250 MiB it trained.
MIN_WORKER_MEMORY_BYTES = 256 << 20


def _check_worker_memory(where: str, memory_limit, threads: int, cores: int, workers: int | None = None) -> None:
    """Refuse a per-worker memory limit (``connect``'s ``memory_limit`` as Dask reads it for a
    worker of ``threads`` threads on ``cores`` cores) under :data:`MIN_WORKER_MEMORY_BYTES`,
    before any worker starts: under it a worker never runs a task (it is killed and restarted,
    or paused, over and over) and the first upload failed after half a minute with Dask's "No
    valid workers found". No limit (None, 0) passes; so does a value Dask cannot read (checked
    before, by :func:`_memory_limit_ok`)."""
    from dask.utils import format_bytes
    from distributed.worker_memory import parse_memory_limit

    quiet = logging.getLogger(f"{__name__}.memory_check")  # Dask's own warnings come when the workers start
    quiet.propagate, quiet.disabled = False, True
    try:
        limit = parse_memory_limit(memory_limit, threads, total_cores=cores, logger=quiet)
    except (ValueError, TypeError):
        return
    if not limit or limit >= MIN_WORKER_MEMORY_BYTES:
        return
    if memory_limit == "auto":
        given = (f"memory_limit='auto': {format_bytes(limit)} for each worker of {_plural(threads, 'thread')} "
                 f"(the machine's memory in the share of its {_plural(cores, 'core')}"
                 f"{f' that each of the {workers} workers has' if workers else ''})")
        fix = "fewer workers (n_workers), or more threads per worker"
    else:
        given = f"memory_limit={memory_limit!r}: {format_bytes(limit)} per worker"
        fix = "a larger memory_limit (or None: no limit)"
    raise TileError(where, f"a memory limit of at least {MIN_WORKER_MEMORY_BYTES >> 20} MiB per worker: "
                    "what a worker process itself takes, with room for a task (under less, Dask kills and "
                    f"restarts the worker, or pauses it, over and over, and no task ever runs); give {fix}", given)


#: the embedded cluster's default: a worker process per this many cores (:func:`default_workers`)
CORES_PER_WORKER = 4


def default_workers(ncpu: int, gpu: int, threads_per_worker: int | None) -> int:
    """The embedded cluster's worker processes when ``connect`` is not told: one per GPU; else
    one where ``threads_per_worker`` is given (one process of that many threads); else one per
    :data:`CORES_PER_WORKER` cores, at least one (so one, with a thread per core, up to 7 cores).

    Inside a process tiles move between kernels without serialisation (kernels release the
    GIL), but one process does not keep many threads busy. Measured on 2 cores: 1 x 2 threads
    trains the bench MLP 1.8x faster than 2 processes x 1 thread. On 16 cores (the block stack,
    batch 16, against torch with 16 threads): 1 x 16 0.60, 2 x 8 0.93, 4 x 4 0.95, 8 x 2 0.73,
    16 x 1 0.85 (sharded); `tilegraph train` 18,758 tok/s on 1 x 16, 23,460 on 4 x 4.
    """
    if gpu:
        return gpu
    if threads_per_worker is not None:
        return 1
    return max(1, ncpu // CORES_PER_WORKER)


def _check_embedded_size(where: str, n_workers: int | None, gpu: int | None, threads_per_worker: int | None) -> None:
    """Refuse, before any process starts, an embedded cluster of more worker processes than this
    machine may run (:func:`tilegraph._config.over_worker_limit`, the limit of ``tilegraph
    train``'s [runtime] workers: ``n_workers=100000`` began spawning processes) or of more threads
    per worker than it has any use for (:func:`tilegraph._config.over_thread_limit`). Only what
    was given is checked: ``gpu`` where it sets the count (a worker per GPU, n_workers not
    given); the default count, one per 4 cores or per visible GPU, is within the limit."""
    name, count = ("n_workers", n_workers) if n_workers is not None else ("gpu", gpu)
    over = _config.over_worker_limit(where, count)
    if over is not None:
        most, why = over
        starts = ("that many worker processes" if n_workers is not None
                  else "a worker process per GPU (n_workers not given)")
        raise TileError(where, f"{name} at most {most} ({why}): the embedded cluster starts {starts} on this "
                        "machine (to start more on purpose: "
                        f"{_config.MAX_WORKERS_VARIABLE}={count} in the environment, e.g. os.environ, before "
                        "tilegraph.connect; a cluster started elsewhere, reached by address, scheduler_file or "
                        "mpi=True, brings its own workers and has no such limit)", f"{name}={count}")
    over = _config.over_thread_limit(threads_per_worker)
    if over is not None:
        most, why = over
        raise TileError(where, f"threads_per_worker at most {most} ({why}): threads past the cores only share them "
                        "out, and each worker plans work for every thread it declares",
                        f"threads_per_worker={threads_per_worker}")


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


# -- the arguments of connect ------------------------------------------------------------------
_MEMORY_LIMIT = ('"auto", None or 0 (no limit), a fraction of the memory (0 < x <= 1), a number of bytes, '
                 'or a size such as "4GiB"')


def _memory_limit_ok(limit) -> bool:
    """Whether Dask reads ``limit`` as a worker memory limit >= 0 (sizes through Dask's own
    ``parse_bytes``, as the workers read them)."""
    if limit is None or (isinstance(limit, str) and limit == "auto"):
        return True
    if isinstance(limit, str) and limit.strip():
        from dask.utils import parse_bytes

        try:
            limit = parse_bytes(limit)
        except ValueError:
            return False
    return number_check(finite=True)[0](limit)


def _none_or(check):
    ok, want = check
    return (lambda v: v is None or ok(v)), want


#: (check, what it wants) of the arguments of :func:`connect` that describe where to connect or
#: the cluster to start; None (the default) where that may be None
_CONNECT_CHECKS = {
    "address": _none_or((_address_ok, _ADDRESS)),
    "scheduler_file": _none_or(((lambda v: isinstance(v, (str, os.PathLike))), "a path (str or os.PathLike)")),
    "n_workers": _none_or(number_check(1, whole=True)),
    "gpu": _none_or(number_check(whole=True)),
    "threads_per_worker": _none_or(number_check(1, whole=True)),
    "memory_limit": (_memory_limit_ok, _MEMORY_LIMIT),
    "timeout": (number_check(strict=True, finite=True)[0], "a finite number of seconds > 0"),
}
#: connect's flags: a truthy string ("no", "False" from a config file) or a number counted as True
#: (dashboard="no" started the dashboard, mpi="no" an MPI launch)
_FLAG = ((lambda v: isinstance(v, (bool, np.bool_))), "True or False")
_CONNECT_CHECKS.update(dict.fromkeys(("mpi", "quiet", "make_current", "tls"), _FLAG))
_CONNECT_CHECKS["dashboard"] = ((lambda v: isinstance(v, (bool, np.bool_)) or (
    isinstance(v, (int, np.integer)) and 1024 <= v <= 65535)),
    "True, False or the embedded cluster's dashboard port (1024-65535, e.g. 8787: on 127.0.0.1, which an "
    "ssh tunnel reaches)")


def _check_connect_arguments(where: str, **args) -> None:
    for name, value in args.items():
        require_arg(where, name, value, _CONNECT_CHECKS[name])


def connect(address: str | None = None, *, scheduler_file: str | None = None, mpi: bool = False,
            n_workers: int | None = None, gpu: int | None = None, threads_per_worker: int | None = None,
            dashboard: bool | int = True, timeout: float = 10.0, quiet: bool = False, memory_limit="auto",
            make_current: bool = True, interface: str | None = None, dask_config: dict | None = None,
            security=None, tls: bool = False, tls_ca_file: str | None = None, tls_cert: str | None = None,
            tls_key: str | None = None) -> Runtime:
    """Connect to Dask distributed and make it the current runtime.

    - ``connect()``: start the embedded local cluster (bound to 127.0.0.1, dashboard URL printed;
      ``dashboard=8787`` serves the dashboard on that port, for an ssh tunnel to reach);
      ``n_workers`` processes (default: one per GPU, else one per :data:`CORES_PER_WORKER`
      cores and at least one; one where only ``threads_per_worker`` is given) with
      ``threads_per_worker`` threads (default: the cores divided among the workers), the first ``gpu`` of them
      declaring the resource ``{"GPU": 1}`` (default: one per visible CUDA device). At most
      :data:`tilegraph._config.WORKERS_PER_CORE` worker processes per usable core, as
      ``tilegraph train`` (``$TILEGRAPH_MAX_WORKERS`` sets another limit), each of at most
      :data:`tilegraph._config.THREADS_PER_CORE` threads per core: more is refused before any starts.
    - ``connect("tcp://host:8786")``: an existing scheduler.
    - ``connect(scheduler_file="scheduler.json")``: a scheduler started with ``--scheduler-file``.
    - ``connect(mpi=True)``: inside ``mpiexec -n N``, dask-mpi makes rank 0 the scheduler, ranks
      >= 2 workers, and rank 1 runs the rest of the script; ``interface`` picks the network
      interface the ranks listen on (e.g. "ib0"; default: the host's address). Each worker rank
      gets the cores mpiexec bound it to, or its share of its node's, and ``memory_limit`` (per
      worker rank; "auto": the node's memory in the share of its cores).

    TLS (``tls://``, every connection encrypted and both ends showing a certificate signed by the
    cluster's CA): give ``tls_ca_file``, ``tls_cert`` and ``tls_key`` (PEM files; all three), or a
    ``distributed.Security`` as ``security``. A client uses them to reach a ``tls://`` scheduler;
    the embedded cluster and the MPI ranks serve with them. ``tls=True`` without files gives the
    embedded cluster temporary certificates of its own (MPI ranks need the files: no key is sent
    between them).

    The embedded cluster prints one line saying what it started: its workers, their threads and
    memory limit, the scheduler's address and the dashboard's (or "dashboard: off").
    ``quiet=True`` keeps the scheduler's and workers' logs below ERROR off the console; the line
    is still printed where there is a dashboard (its link is found nowhere else), and left out
    with ``dashboard=False`` (quiet and no dashboard: nothing printed).

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
    _check_connect_arguments(where, address=address, scheduler_file=scheduler_file, n_workers=n_workers, gpu=gpu,
                             threads_per_worker=threads_per_worker, memory_limit=memory_limit, timeout=timeout,
                             mpi=mpi, dashboard=dashboard, quiet=quiet, make_current=make_current, tls=tls)
    port = 0 if isinstance(dashboard, (bool, np.bool_)) else int(dashboard)  # 0: a free one
    mpi, dashboard, quiet, make_current, tls = (bool(v) for v in (mpi, dashboard, quiet, make_current, tls))
    if port and (mpi or address is not None or scheduler_file is not None):
        raise TileError(where, "dashboard=PORT only for the embedded cluster (a cluster started elsewhere, or by "
                        "dask-mpi, serves its dashboard where it was started)", f"dashboard={port}")
    if sum(x is not None and x is not False for x in (address, scheduler_file, mpi or None)) > 1:
        raise TileError(where, "give at most one of address, scheduler_file and mpi=True",
                        f"address={address!r}, scheduler_file={scheduler_file!r}, mpi={mpi!r}")
    # what shapes a cluster tilegraph starts, given where it starts none (MPI decides the workers)
    shaping = {"n_workers": n_workers, "gpu": gpu, "threads_per_worker": threads_per_worker,
               "memory_limit": None if memory_limit == "auto" or mpi else memory_limit}
    if address is not None or scheduler_file is not None:
        shaping.update(dask_config=dask_config, interface=interface)
    given = {k: v for k, v in shaping.items() if v is not None}
    if given and (mpi or address is not None or scheduler_file is not None):
        cluster = "an MPI launch's workers are one per rank from mpiexec" if mpi else \
            "an existing cluster keeps the workers and settings it was started with"
        raise TileError(where, f"{', '.join(given)} only for the embedded cluster ({cluster})",
                        ", ".join(f"{k}={v!r}" for k, v in given.items()))
    if not mpi and address is None and scheduler_file is None:  # (else none of the three is given by now)
        _check_embedded_size(where, n_workers, gpu, threads_per_worker)
    if interface is not None and not mpi and address is None and scheduler_file is None:
        raise TileError(where, "interface only with mpi=True (the network interface the ranks listen on); the "
                        "embedded cluster listens on 127.0.0.1 alone", f"interface={interface!r}")
    if dask_config is not None and not mpi and not isinstance(dask_config, Mapping):  # (MPI: its ranks check)
        raise TileError(where, "dask_config must be a mapping of Dask settings (e.g. {'distributed.comm.timeouts."
                        "connect': '30s'}) or None", f"{type(dask_config).__name__} {dask_config!r:.80}")
    rank_problem = None  # under MPI: a problem of this rank's, which every rank must hear of
    try:
        tls_files = _tls_files(where, tls_ca_file, tls_cert, tls_key)
    except TileError as e:
        if not mpi:
            raise
        # the files may be missing on this node only: the ranks that found them would wait
        # for this one without end
        rank_problem, tls_files = e, None
    if security is not None and (tls_files or tls):
        raise TileError(where, "give security= or the TLS files (tls_ca_file, tls_cert, tls_key), not both",
                        f"security={security!r}, tls={tls!r}, tls_cert={tls_cert!r}")
    if mpi and rank_problem is None and memory_limit != "auto":
        try:  # a limit given is each worker rank's, whatever its threads ("auto": decided on the ranks)
            _check_worker_memory(f"{where}(mpi=True)", memory_limit, 1, 1)
        except TileError as e:  # every rank finds it (or, for a share of the memory, the ranks on a small node)
            rank_problem = e
    if mpi:
        from tilegraph.runtime.mpi import initialize_mpi

        n_mpi_workers = initialize_mpi(interface=interface, security=security, tls=tls, tls_files=tls_files,
                                       dask_config=dask_config, problem=rank_problem, memory_limit=memory_limit)
        client = Client()  # it reads the scheduler's address and the TLS settings from dask's config
        try:
            client.wait_for_workers(n_mpi_workers, timeout=MPI_WORKERS_WAIT_SECONDS)  # a plan needs to know its workers
        except TimeoutError:  # Dask's WorkerStartTimeoutError, a page of traceback
            joined = len(client.scheduler_info(n_workers=-1).get("workers", {}))
            address = client.scheduler.address
            client.close()  # the script's exit then ends the scheduler and the workers that joined
            raise TileError(f"{where}(mpi=True)", f"every worker rank (ranks 2 to {n_mpi_workers + 1}) to join the scheduler at "
                            f"{address} within {MPI_WORKERS_WAIT_SECONDS:g} s: the others failed to start or cannot "
                            "reach it (see their output above; across nodes, pick an interface every node reaches: "
                            "interface=\"ib0\" or [runtime] interface)",
                            f"{joined} of {_plural(n_mpi_workers, 'worker rank')} joined") from None
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
    _warn_open_embedded(where)
    from distributed import Scheduler, SpecCluster

    ncpu = _config.usable_cores()
    if gpu is None:
        gpu = _visible_gpus()
    if n_workers is None:
        n_workers = default_workers(ncpu, gpu, threads_per_worker)
    if n_workers < 1 or (gpu or 0) > n_workers:
        raise TileError(where, "need n_workers >= 1 and gpu <= n_workers", f"n_workers={n_workers}, gpu={gpu}")
    if threads_per_worker is None:
        threads_per_worker = max(1, ncpu // n_workers)
    _check_worker_memory(where, memory_limit, threads_per_worker, ncpu, n_workers)
    security = _embedded_security(where, security, tls, tls_files)
    scheduler_opts = {"host": LOCALHOST, "dashboard": dashboard, "dashboard_address": f"{LOCALHOST}:{port}"}
    if security is not None:
        scheduler_opts.update(security=security, protocol="tls")
    import dask

    # the scheduler and the spawned workers read these while they start
    settings = {**CLUSTER_DASK_CONFIG, **_memory_settings(memory_limit, threads_per_worker, ncpu), **(dask_config or {})}
    with dask.config.set(settings):
        if quiet:
            _quiet_logs()
        short_key_sets()
        with _interrupt_held() as interrupted:
            try:
                cluster = SpecCluster(
                    workers=_worker_spec(n_workers, threads_per_worker, gpu, memory_limit, quiet, security),
                    # what cluster.scale(n) / adapt() add: a CPU worker as the others, on 127.0.0.1
                    # (without one, scaling up logged a TypeError from Dask and no worker came)
                    worker=_worker_spec(1, threads_per_worker, 0, memory_limit, quiet, security)["cpu-0"],
                    scheduler={"cls": Scheduler, "options": scheduler_opts},
                    silence_logs=logging.ERROR if quiet else logging.WARN,
                    name="tilegraph", security=security,
                )
            except Exception:
                # a Ctrl-C to the whole process group (a terminal's) also stops the worker processes
                # as they start: Dask's "Nanny failed to start" is then the interrupt, and says so
                if interrupted():
                    raise KeyboardInterrupt from None
                raise
        client = None
        try:  # interrupted from here on (a notebook's stop button), the cluster is closed, not left running
            if interrupted():
                raise KeyboardInterrupt
            _stop_gc_diagnosis()  # the scheduler's start turned it on
            client = Client(cluster)  # with the cluster's security
            client.wait_for_workers(n_workers, timeout=60)
            if quiet:  # worker processes take their logging setup from the parent's config: quiet them here
                client.run(_quiet_logs)
            rt = Runtime(client, cluster, make_current=make_current)
        except BaseException:
            try:
                if client is not None:
                    client.close()
            finally:
                try:
                    cluster.close()
                finally:
                    _forget_closed_servers()
            raise
    rt.has_dashboard = bool(dashboard)
    if dashboard or not quiet:  # quiet without a dashboard: silent (the CLI; scripts and tests)
        print(_started_line(rt, n_workers, threads_per_worker, gpu, security is not None), flush=True)
    return rt


def _started_line(rt: Runtime, n_workers: int, threads: int, gpu: int, tls: bool) -> str:
    """The line :func:`connect` prints for the embedded cluster it started, e.g.
    ``tilegraph: embedded cluster with 2 workers x 4 threads, 7.45 GiB each; scheduler
    tcp://127.0.0.1:40213; dashboard: http://127.0.0.1:8787/status`` (``dashboard: off``)."""
    from dask.utils import format_bytes

    try:  # the limits the workers run under (memory_limit="auto": the machine's, in their share of cores)
        limits = {w.get("memory_limit") or 0 for w in rt.workers().values()}
    except Exception:  # (a scheduler that does not answer: the line without them)
        limits = set()
    if limits == {0}:
        memory = ", no memory limit"
    elif len(limits) == 1:
        memory = f", {format_bytes(limits.pop())} each"
    else:
        memory = ""
    link = rt.dashboard_link
    return (f"tilegraph: embedded cluster with {_plural(n_workers, 'worker')} x {_plural(threads, 'thread')}"
            f"{memory}{f', {gpu} GPU' if gpu else ''}{', TLS' if tls else ''}; scheduler {rt.address}; "
            f"dashboard: {link if link else 'off'}")


def _stop_gc_diagnosis() -> None:
    """Take Dask's GC diagnosis out of this process, where the embedded cluster's scheduler runs
    (its start turns it on). It is a ``gc.callbacks`` hook making psutil calls on every collection,
    in whichever thread collects, the main one too: a Ctrl-C (a notebook's stop button) landing
    there raised KeyboardInterrupt inside the hook, where Python prints "Exception ignored in:
    <bound method GCDiagnosis._gc_callback ...>" and drops it, and training ran on to its end (1
    run in 7 of a fit interrupted 1.5 s in). Dask counts who asked for it; ``force`` removes it
    whatever the count (another in-process scheduler or worker would keep it otherwise), and their
    own disable at close then finds nothing to undo. What is lost: the scheduler's warnings that
    garbage collection took much of this process's time."""
    from distributed.gc import disable_gc_diagnosis

    disable_gc_diagnosis(force=True)


@contextlib.contextmanager
def _interrupt_held():
    """Hold back a Ctrl-C (SIGINT: a notebook's stop button too) until the block ends; yields a
    function saying whether one came. Dask's cluster start, interrupted half-way, leaves a worker
    process running that nothing closes (closing that cluster fails on the worker it never
    finished starting), and a second ``connect`` then starts another beside it. Only in the main
    thread, where Python's own handler is the one installed."""
    got: list[bool] = []
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: False
        return
    signal.signal(signal.SIGINT, lambda signum, frame: got.append(True))
    try:
        yield lambda: bool(got)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _warn_open_embedded(where: str) -> None:
    """Warn when an embedded cluster an earlier ``connect`` started is still open: a notebook cell
    run again started a second one beside it, and what was made on the first (a model's
    parameters) stays on its workers."""
    earlier = [rt for rt in dict.fromkeys(_CURRENT) if not rt.closed and rt.cluster is not None]
    if earlier:
        warnings.warn(f"[{where}] the embedded cluster of an earlier tg.connect() is still running "
                      f"({earlier[-1]!r}) and this starts another beside it, on the same cores (a cell run "
                      "again?); what was made on the earlier one (a model's parameters) stays there: close it "
                      "first (rt.close()), or keep using it instead of connecting again (once rt names the new "
                      "one: rt.close(), then tg.current_runtime().close() closes the earlier one)", stacklevel=3)


# -- TLS ------------------------------------------------------------------------------------------
_TLS_ARGS = ("tls_ca_file", "tls_cert", "tls_key")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _visible_gpus() -> int:
    try:
        import cupy  # noqa: F401 - only counts devices when the GPU extra is installed

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0
