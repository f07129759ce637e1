"""What runs on the workers or shapes them: the version check, malloc tuning, the plugins that
unlink finished tasks and bound what Dask keeps of past graphs (spans, their metrics), quiet logs,
and the Dask settings of the clusters tilegraph starts."""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import time

from tilegraph._errors import TileError


def _worker_version() -> str | None:
    """This process's tilegraph version (run on each worker); None where tilegraph is missing."""
    try:
        import tilegraph

        return tilegraph.__version__
    except ImportError:
        return None


def _check_worker_versions(client, workers=None, where: str = "tilegraph.connect", late: bool = False) -> set[str]:
    """Workers must run the client's tilegraph: tasks carry programs of kernel names and
    parameters that another version may read differently, or not at all. Asks ``workers``
    (default: all; one ``client.run``) and returns those that answered with this version; a
    worker that does not answer (it left meanwhile) is neither refused nor returned. ``late``:
    they joined after ``connect`` (said in the error)."""
    import tilegraph

    try:
        versions = client.run(_worker_version, workers=None if workers is None else list(workers), on_error="return")
    except ImportError as e:  # a worker that cannot even unpickle the check
        raise TileError(where, "workers with tilegraph installed", f"a worker raised {e!r}") from None
    # a worker that could not be reached (OSError: it left after the scheduler listed it) is not
    # checked now; one that could not run the check (no tilegraph, another one's modules) is refused
    failed = {addr: v for addr, v in versions.items() if isinstance(v, BaseException) and not isinstance(v, OSError)}
    for addr, e in sorted(failed.items()):
        if isinstance(e, ImportError):
            raise TileError(where, "workers with tilegraph installed", f"worker {addr} raised {e!r}")
    answered = {addr: v for addr, v in versions.items() if not isinstance(v, BaseException)}
    wrong = {addr: f"{'not installed' if v is None else v}" for addr, v in answered.items() if v != tilegraph.__version__}
    wrong.update({addr: f"the version check failed ({type(e).__name__}: {e})" for addr, e in failed.items()})
    if wrong:
        joined = " (joined after connect)" if late else ""
        raise TileError(where, f"every worker running tilegraph {tilegraph.__version__} (this client's)",
                        ", ".join(f"{addr}: {v}{joined}" for addr, v in sorted(wrong.items())))
    return set(answered)


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


def reset_peak_resident() -> bool:
    """Start this process's :func:`peak_resident_bytes` anew from its current resident memory
    (Linux: ``/proc/self/clear_refs``); False where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def ignore_stop_signals() -> bool:
    """Leave SIGINT and SIGTERM to the client process, in a process of a cluster that tilegraph
    started (an embedded cluster's worker; under MPI the scheduler and worker ranks). A terminal's
    Ctrl-C and a job scheduler (Slurm's scancel, ``timeout``) signal the whole process group: a
    worker killed by it takes the parameters and optimizer state it holds with it, before the
    client, stopping after the steps under way, can write its final checkpoint. Such a process
    still ends with the client: when it closes the cluster, or (embedded) when the client process
    is gone (Dask's parent-alive pipe). Returns whether the handlers were set (only the main
    thread may set them)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return True


def _exit_collection() -> None:
    """At a process's exit: collect the garbage there is now (its finalizers run, as the
    interpreter's own collection would run them), then freeze what is left, so the interpreter's
    collections while it tears its modules down no longer walk every object still alive."""
    import gc

    gc.collect()
    gc.freeze()


#: set once :func:`_exit_collection` is registered in this process
_QUICK_EXIT: list = []


def quick_exit() -> None:
    """Have this process end without the interpreter's walks of every live object as it tears
    its modules down (:func:`_exit_collection`, once however often it is asked): after a
    `tilegraph train` the client holds ~240,000 objects, and those walks took 0.7 s between the
    last line printed and the exit; an embedded cluster's worker process (NumPy, Numba, Dask and
    tilegraph) spent 0.2-0.3 s of its end on them, which its cluster's close waits for. The
    `tilegraph` command and the embedded workers ask for it."""
    import atexit

    if not _QUICK_EXIT:
        atexit.register(_exit_collection)
        _QUICK_EXIT.append(_exit_collection)


def _signals_plugin():
    """A worker plugin applying :func:`ignore_stop_signals` on every worker, also those joining
    later (a nanny's replacement), and :func:`quick_exit` (the workers of a cluster tilegraph
    started: their processes end with it)."""
    from distributed.diagnostics.plugin import WorkerPlugin

    class SignalsPlugin(WorkerPlugin):
        name = "tilegraph-signals"
        idempotent = True

        def setup(self, worker) -> None:
            quick_exit()
            if not ignore_stop_signals():
                logging.getLogger("tilegraph").warning(
                    "worker %s could not leave SIGINT/SIGTERM to the client (its plugins run outside the main "
                    "thread): a signal to the process group stops it", worker.address)

    return SignalsPlugin()


class _RetiredWorkerStopQueue(logging.Filter):
    """Drop the one record Dask's worker process logs, falsely, as it ends after a retirement.

    A worker that closes itself (``client.retire_workers``, a cluster scaling down, ``adapt``)
    gets no stop message from its nanny; its process then closes the nanny's stop queue while
    the thread that watches it still reads, and that thread can find the queue's handle gone
    between two reads: ``distributed.nanny - ERROR - Worker process died unexpectedly`` and a
    traceback ending in ``TypeError: 'NoneType' object cannot be interpreted as an integer``,
    on the console, after one retirement in a few (seen after 3 of some 10 here; with Dask
    2026.8's plain ``LocalCluster`` too, 1 of 6). Nothing died: the worker had closed. Dropped is only that record, and only when its
    error is that TypeError, raised inside ``multiprocessing.connection``, and no worker of this
    process still runs; the nanny's other errors (an EOFError or OSError: its process gone) stay.
    """

    MESSAGE = "Worker process died unexpectedly"

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == self.MESSAGE and _closed_stop_queue_read(record.exc_info)
                    and not _worker_running())


def _closed_stop_queue_read(exc_info) -> bool:
    """Whether ``exc_info`` is the TypeError of a ``multiprocessing`` connection read after that
    connection was closed (its handle None) in this process."""
    if not exc_info or exc_info[0] is not TypeError or exc_info[2] is None:
        return False
    tb = exc_info[2]
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame  # (Connection._recv, whose ``handle`` it read before the close set it None)
    return frame.f_globals.get("__name__") == "multiprocessing.connection" and frame.f_locals.get("handle", 0) is None


def _worker_running() -> bool:
    """Whether a Dask worker of this process is running (not closing or closed)."""
    from distributed import Worker
    from distributed.core import Status

    return any(w.status not in (Status.closing, Status.closed, Status.failed) for w in list(Worker._instances))


def quiet_retired_stop_queue() -> None:
    """Install :class:`_RetiredWorkerStopQueue` on Dask's nanny logger of this process (a worker's)."""
    log = logging.getLogger("distributed.nanny")
    if not any(isinstance(f, _RetiredWorkerStopQueue) for f in log.filters):
        log.addFilter(_RetiredWorkerStopQueue())


def _stop_queue_plugin():
    """A worker plugin applying :func:`quiet_retired_stop_queue` on every worker, also those
    joining later."""
    from distributed import WorkerPlugin

    class StopQueuePlugin(WorkerPlugin):
        name = "tilegraph-retired-stop-queue"
        idempotent = True

        def setup(self, worker) -> None:
            quiet_retired_stop_queue()

    return StopQueuePlugin()


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


#: How long a Dask batched stream holds a message back after its last send, to send it with
#: others. Dask's own: 2 ms (worker -> scheduler, scheduler -> client), 5 ms (scheduler ->
#: worker) and 10 ms (client -> scheduler), fixed in its code. Every hop of a task that another
#: one, or the client, waits for pays them: on the 2-core development machine a decoded token
#: (one small task, its fetch, the next token's graph) took 22 ms with Dask's, 12.4 ms with 1 ms
#: and 11.6 ms with none. A burst of messages inside the interval still goes as one.
SEND_INTERVAL_SECONDS = 0.001


def set_send_interval(stream) -> None:
    """Make a Dask ``BatchedSend`` hold messages back at most :data:`SEND_INTERVAL_SECONDS`."""
    if hasattr(stream, "interval"):
        stream.interval = SEND_INTERVAL_SECONDS


def scheduler_send_intervals(dask_scheduler) -> None:
    """:func:`set_send_interval` on the scheduler's streams to its workers and clients (run on
    the scheduler, once per connecting client: Dask opens a client's stream after the plugins'
    ``add_client``)."""
    for stream in [*getattr(dask_scheduler, "stream_comms", {}).values(),
                   *getattr(dask_scheduler, "client_comms", {}).values()]:
        set_send_interval(stream)


def _send_interval_plugins():
    """A worker plugin and a scheduler plugin applying :func:`set_send_interval` to each worker's
    stream to the scheduler and the scheduler's to each worker, also those joining later."""
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

    class WorkerSendInterval(WorkerPlugin):
        name = "tilegraph-send-interval"
        idempotent = True

        def setup(self, worker) -> None:
            set_send_interval(getattr(worker, "batched_stream", None))

    class SchedulerSendInterval(SchedulerPlugin):
        name = "tilegraph-send-interval"
        idempotent = True

        async def start(self, scheduler) -> None:
            scheduler_send_intervals(scheduler)

        def add_worker(self, scheduler=None, worker=None, **kwargs) -> None:
            set_send_interval(getattr(scheduler, "stream_comms", {}).get(worker))

    return WorkerSendInterval(), SchedulerSendInterval()


_DASK_LOGGERS = ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core",
                 "distributed.worker", "distributed.http.proxy", "distributed.batched", "tornado.application")


class _ShortKeySets(logging.Filter):
    """Dask's scheduler logs every key a removed worker took with it: for a model's scattered
    parameters, hundreds of lines' worth that bury the error tilegraph raises. Such a set of
    keys is shortened to its first three and its count."""

    _SET = re.compile(r"\{'[^']*'(?:, '[^']*')+\}")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > 400:
            record.msg, record.args = self._SET.sub(self._short, message), ()
        return True

    @staticmethod
    def _short(match: re.Match) -> str:
        keys = match.group(0)[1:-1].split(", ")
        return match.group(0) if len(keys) <= 5 else "{" + ", ".join(keys[:3]) + f", ... ({len(keys)} keys)}}"


def short_key_sets() -> None:
    """Shorten the sets of keys in the Dask scheduler's log records (:class:`_ShortKeySets`) of
    a scheduler in this process."""
    log = logging.getLogger("distributed.scheduler")
    if not any(isinstance(f, _ShortKeySets) for f in log.filters):
        log.addFilter(_ShortKeySets())


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
#: removal among the scheduler's events, see ``_health.worker_health``).
LOG_LENGTH_DASK_CONFIG = {
    "distributed.admin.low-level-log-length": 100,
}

#: Dask settings of the clusters tilegraph starts: the embedded one, and the scheduler and
#: workers of an MPI launch (``connect(dask_config=...)`` overrides them in both).
#: Measured on the 2-core development machine: root-task queuing halves flat-graph throughput;
#: an idle embedded cluster burnt ~20% of a core in periodic callbacks (10 ms worker profiler,
#: 20 ms event-loop ticks, 100 ms memory and work-stealing polls), about halved by these intervals
#: (and work stealing off).
CLUSTER_DASK_CONFIG = {
    "distributed.scheduler.worker-saturation": float("inf"),
    "distributed.worker.profile.enabled": False,
    "distributed.admin.tick.interval": "1s",
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "2s",
    # tilegraph places every task of a multi-process plan itself (a loose worker restriction,
    # so that a task still runs if its worker is gone); Dask's work stealing moved planned tasks
    # to the other worker under load (seen in CI: a tile task of a 2-worker plan ran on the worker
    # the plan did not choose), which costs the transfers the plan avoided.
    "distributed.scheduler.work-stealing": False,
    # A worker that sends no heartbeat (one every 0.5 s) for this long is restarted through its
    # nanny: its futures are lost, so every wait on them fails (tilegraph names the worker) instead
    # of hanging behind a stopped process (Dask's default: 5 minutes). Longest silence measured on
    # 2 cores: 2.7 s, in GPT-2 124M's data-parallel gradient exchange (2 workers x 1 thread). The
    # scheduler looks every ttl, so a stall ends waits in 1-2 minutes; the Trainer checks sooner.
    "distributed.scheduler.worker-ttl": "60s",
    **LOG_LENGTH_DASK_CONFIG,
}


#: The finished "default" spans the scheduler keeps besides the first (:func:`forget_spans`), as
#: Dask's logs keep their last ``low-level-log-length`` entries.
SPANS_KEPT = LOG_LENGTH_DASK_CONFIG["distributed.admin.low-level-log-length"]
#: The entries of a worker's ``digests_total`` above which those of spans are folded into
#: entries without a span (:func:`fold_span_digests`): about 8-16 per span run there.
WORKER_DIGESTS_KEPT = 2000


def _span_tree(span) -> list:
    return list(span.traverse_spans())


def forget_spans(scheduler, keep: int = SPANS_KEPT) -> int:
    """Forget the finished "default" spans of Dask's spans extension on ``scheduler`` but the
    first and the newest ``keep``; returns how many root spans it forgot.

    Dask opens a new default span for every graph submitted to a cluster with nothing left to
    run (each ``tg.compute``, ``generate``, checkpoint save or load, a ``Decoder``'s token), and
    keeps every span, with the task groups it ran, for the life of the scheduler: measured over
    3,000 ``tg.compute`` calls, 3,000 spans, +87 Python blocks and +6.5 KB in the process of the
    embedded scheduler (the client's) per call. A span is forgotten only once every task group
    it ran is gone from the scheduler (a task group alive again would look its span up). Its
    metrics (what the dashboard's Fine Performance Metrics page sums over all spans) are added
    to the first span's, so that page's totals stay those of the whole run."""
    ext = getattr(scheduler, "extensions", {}).get("spans")
    if ext is None:
        return 0
    defaults = [s for s in ext.root_spans if s.name == ("default",)]
    if len(defaults) <= keep + 1:
        return 0
    archive, live = defaults[0], scheduler.task_groups
    gone = []
    for span in defaults[1:-keep] if keep else defaults[1:]:
        tree = _span_tree(span)
        if any(live.get(tg.name) is tg for s in tree for tg in s.groups):
            continue  # (a task group still there: its tasks, or new ones, may read its span)
        for s in tree:
            for k, v in s._cumulative_worker_metrics.items():
                archive._cumulative_worker_metrics[k] += v
        gone.append(span)
    if not gone:
        return 0
    ids = {s.id for span in gone for s in _span_tree(span)}
    for sid in ids:
        ext.spans.pop(sid, None)
    ext.root_spans[:] = [s for s in ext.root_spans if s.id not in ids]
    for index in (ext.spans_search_by_name, ext.spans_search_by_tag):
        for name in list(index):
            index[name] = [s for s in index[name] if s.id not in ids]
            if not index[name]:
                del index[name]
    return len(gone)


def _tolerant_span_heartbeat(scheduler) -> None:
    """Have the spans extension of ``scheduler`` take a worker's metrics of a span it forgot
    (:func:`forget_spans`; a worker reports its last ones at its next heartbeat) into the first
    default span, where Dask's own would fail the heartbeat with a KeyError."""
    ext = getattr(scheduler, "extensions", {}).get("spans")
    if ext is None or getattr(ext, "_tilegraph_tolerant", False):
        return
    dask_heartbeat = ext.heartbeat

    def heartbeat(ws, data):
        try:
            known = {k: v for k, v in data.items() if k[1] in ext.spans}
            defaults = ext.spans_search_by_name.get(("default",))
            if len(known) < len(data) and defaults:
                for key, v in data.items():
                    if key not in known:
                        defaults[0]._cumulative_worker_metrics[(key[0], *key[2:])] += v
        except Exception:  # (another Dask's layout of these: its own handler, as without this)
            known = data
        dask_heartbeat(ws, known)

    ext.heartbeat = heartbeat
    ext._tilegraph_tolerant = True


def fold_span_digests(worker, limit: int = WORKER_DIGESTS_KEPT) -> bool:
    """Where ``worker.digests_total`` holds more than ``limit`` entries, fold those of spans
    (keys ``(context, span id, prefix, activity, unit)``) into entries of no span (``None`` in
    the span id's place): the sums (``digests_total``) and maxima (``digests_max``) stay, the
    span ids go. Dask adds about 8 such entries per span that ran a task there and never
    removes them (measured: +28 Python blocks and +2.7 KB of worker memory per ``tg.compute``
    call); it reads neither mapping itself (the scheduler gets the metrics from the entries
    since the last heartbeat, kept apart). Returns whether it folded."""
    total = getattr(worker, "digests_total", None)
    if total is None or len(total) <= limit:
        return False
    from distributed.spans import CONTEXTS_WITH_SPAN_ID  # ("execute", "p2p"): the keys that carry one
    peak = getattr(worker, "digests_max", None)
    for key in [k for k in total if isinstance(k, tuple) and len(k) > 1 and k[0] in CONTEXTS_WITH_SPAN_ID
                and k[1] is not None]:
        folded = (key[0], None, *key[2:])
        total[folded] += total.pop(key)
        if peak is not None and key in peak:
            peak[folded] = max(peak.get(folded, 0), peak.pop(key))
    return True


def bounded_spans_plugins():
    """A scheduler plugin applying :func:`forget_spans` after each graph submitted (every
    ``SPANS_KEPT`` of them) and a worker plugin applying :func:`fold_span_digests` as tasks
    finish, on every worker, also those joining later."""
    from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

    class BoundedSpans(SchedulerPlugin):
        name = "tilegraph-bounded-spans"
        idempotent = True

        def __init__(self):
            self.scheduler = None
            self.graphs = 0

        async def start(self, scheduler) -> None:
            self.scheduler = scheduler
            _tolerant_span_heartbeat(scheduler)

        def update_graph(self, scheduler, **kwargs) -> None:
            self.graphs += 1
            if self.graphs > 0 and self.graphs % max(1, SPANS_KEPT) == 0:  # (a pass over the spans: not every graph)
                try:
                    forget_spans(scheduler)
                except Exception as e:  # another Dask's spans: keep them all, as Dask does, and say so once
                    self.graphs = -(1 << 62)
                    logging.getLogger("tilegraph").warning("tilegraph: the scheduler's spans are no longer bounded "
                                                           "(%s: %s)", type(e).__name__, e)

    class FoldSpanDigests(WorkerPlugin):
        name = "tilegraph-fold-span-digests"
        idempotent = True
        worker = None  # (None again after a failure: nothing more folded)

        def setup(self, worker) -> None:
            self.worker = worker

        def transition(self, key, start, finish, **kwargs) -> None:
            if finish == "memory" and self.worker is not None:
                try:
                    fold_span_digests(self.worker)
                except Exception:  # another Dask's digests: left as Dask keeps them
                    self.worker = None

    return BoundedSpans(), FoldSpanDigests()


def prune_group_dependencies(scheduler) -> int:
    """Take out of every task group's ``dependencies`` on ``scheduler`` the groups the scheduler
    no longer has; returns how many it took out.

    Dask removes a task group once all its tasks are forgotten, but leaves it among the
    dependencies of the groups that read it. Training keeps such a pair for good: the group of
    the step tasks (``tg-fwd-bwd-update``, whose newest task holds the parameters) read the
    values sent to the workers (``tg-value``, a batch), which are forgotten after the step. The
    dashboard's task-group graph (``/groups``, ``/individual-groups``) looks every dependency up
    among the live groups: between two steps (and after training) it failed on every refresh
    with a KeyError naming the batch's group ("KeyError: 'ndarray'", logged by the scheduler; the
    page stayed blank), and each step's batch group, made anew, joined the stale one there."""
    live = scheduler.task_groups
    removed = 0
    for group in list(live.values()):
        stale = [d for d in group.dependencies if live.get(d.name) is not d]
        if stale:
            group.dependencies.difference_update(stale)
            removed += len(stale)
    return removed


def live_group_dependencies_plugin():
    """A scheduler plugin applying :func:`prune_group_dependencies` once the scheduler has
    forgotten tasks: on its event loop right after the transitions that forgot them (Dask removes
    an emptied group after its plugins have seen the transition), once per such batch."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class LiveGroupDependencies(SchedulerPlugin):
        name = "tilegraph-live-group-dependencies"
        idempotent = True

        def __init__(self):
            self.scheduler = None
            self.due = False

        async def start(self, scheduler) -> None:
            self.scheduler = scheduler

        def transition(self, key, start, finish, *args, **kwargs) -> None:
            if finish == "forgotten" and not self.due and self.scheduler is not None:
                self.due = True
                self.scheduler.loop.add_callback(self._prune)

        def _prune(self) -> None:
            self.due = False
            try:
                prune_group_dependencies(self.scheduler)
            except Exception as e:  # another Dask's task groups: left as Dask keeps them, said once
                self.scheduler = None
                logging.getLogger("tilegraph").warning("tilegraph: the scheduler's task-group dependencies are no "
                                                       "longer pruned (%s: %s)", type(e).__name__, e)

    return LiveGroupDependencies()


#: the annotation of a task whose inputs fetched from other workers are dropped there once it
#: has run (:func:`drop_fetched_plugin`): the tasks of a "zero3" plan
DROP_FETCHED = "tilegraph_drop_fetched"
#: the annotation of a task whose inputs held by other workers its worker fetches as soon as the
#: task before it there (one whose result it reads) is sent there (:func:`drop_fetched_plugin`)
PREFETCH = "tilegraph_prefetch"


def event_addresses_plugin():
    """A scheduler plugin that keeps the scheduler's event log sendable to a client: Dask's
    ``Scheduler.replicate`` (which a scatter with ``broadcast=True`` runs: the programs of a plan
    on one worker go that way) logs its workers as ``WorkerState`` objects, which do not
    serialize, and from then on every ``client.get_events("all")`` failed ("cannot pickle
    'weakref.ReferenceType' object", the connection closed). That is where a failed step looks
    for the workers removed since it began: a worker lost on a one-worker cluster was reported
    as "the Dask scheduler did not answer", not as the lost worker it was, and
    ``restart_on_failure`` did not restart. This puts their addresses in such an event's place
    (the logged message is the object the plugins get)."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class EventAddresses(SchedulerPlugin):
        name = "tilegraph-event-addresses"
        idempotent = True

        def log_event(self, topic, msg) -> None:
            from distributed.scheduler import WorkerState

            if not isinstance(msg, dict):
                return
            for key, value in msg.items():
                if isinstance(value, (list, tuple, set)) and any(isinstance(w, WorkerState) for w in value):
                    msg[key] = [w.address if isinstance(w, WorkerState) else w for w in value]

    return EventAddresses()


def drop_fetched_plugin():
    """A scheduler plugin that, when a task annotated :data:`DROP_FETCHED` (its phase: "forward",
    "backward" or "update") has run on a worker, drops that worker's copies of the task's inputs
    that another worker also holds and that no task pinned there will read soon: after a
    forward task, none but the backward's waits there; after any other, none at all. A "zero3"
    step's tasks fetch each layer's parameters from their owner: a copy goes once the layer's
    forward tasks there have read it, and the backward fetches it again, as FSDP gathers a
    layer again for its backward, so a process holds the fetched parameters of the layers
    under way, not of every layer it has run (Dask keeps a replica while its key lives, until
    the parameter is replaced at the step's end, unless its memory manager drops it, every 2 s
    and keeping one per waiting task). The owner's copy stays: its update waits for it there.
    Dask's own ``request_remove_replicas`` does it, never the last copy; a worker whose running
    task still reads the value keeps it (and tells the scheduler).

    It also fetches ahead, as FSDP prefetches the next layer: when a task annotated
    :data:`DROP_FETCHED` is sent to its worker, that worker is asked to fetch (Dask's
    ``request_acquire_replicas``) the values held elsewhere that its next tasks read: those
    annotated :data:`PREFETCH`, pinned to that worker, reading the task's result. Dask fetches a
    task's inputs only once it may start, so each "zero3" task waited for its layer's parameters
    with its worker idle. A value not yet made is left to the task (Dask fetches it then)."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class DropFetched(SchedulerPlugin):
        name = "tilegraph-drop-fetched"
        idempotent = True

        def __init__(self):
            self.scheduler = None
            #: copies dropped so far
            self.dropped = 0
            #: values fetched ahead so far
            self.prefetched = 0

        async def start(self, scheduler) -> None:
            self.scheduler = scheduler

        def transition(self, key, start, finish, *args, **kwargs) -> None:
            if self.scheduler is None or finish not in ("processing", "memory"):
                return
            ts = self.scheduler.tasks.get(key)
            if finish == "processing":
                if ts is not None and (ts.annotations or {}).get(DROP_FETCHED):
                    self.scheduler.loop.add_callback(self._prefetch, key)
                return
            if start != "processing":
                return
            phase = (ts.annotations or {}).get(DROP_FETCHED) if ts is not None else None
            if not phase:
                return
            addr = kwargs.get("worker")
            if addr is None and ts.who_has and len(ts.who_has) == 1:
                addr = next(iter(ts.who_has)).address
            deps = [d.key for d in ts.dependencies]
            if addr is not None and deps:  # after the transitions under way: they may still use them
                self.scheduler.loop.add_callback(self._drop, addr, deps, phase)

        def _prefetch(self, key) -> None:
            """Task ``key`` was sent to its worker: that worker now fetches what its next tasks
            (annotated :data:`PREFETCH`, pinned there, reading ``key``'s value) read from other
            workers, while ``key`` runs."""
            s = self.scheduler
            ts = s.tasks.get(key)
            if ts is None or ts.state != "processing":  # (done already, or gone)
                return
            ws = ts.processing_on
            if ws is None or ws.address not in s.workers:
                return
            want = set()
            for d in ts.dependents:
                if not (d.annotations or {}).get(PREFETCH) or ws.address not in (d.worker_restrictions or ()):
                    continue
                want.update(dd.key for dd in d.dependencies
                            if dd is not ts and dd.state == "memory" and dd.who_has and ws not in dd.who_has)
            if want:
                self.prefetched += len(want)
                s.request_acquire_replicas(ws.address, sorted(want, key=str),
                                           stimulus_id=f"tilegraph-prefetch-{time.time()}")

        def _drop(self, addr: str, keys: list, phase: str) -> None:
            s = self.scheduler
            ws = s.workers.get(addr)
            if ws is None:
                return
            drop = []
            for key in keys:
                ts = s.tasks.get(key)
                if ts is None or ts.state != "memory" or ws not in ts.who_has or len(ts.who_has) < 2:
                    continue
                if any(w.processing_on is ws or (w.worker_restrictions and addr in w.worker_restrictions and (
                        phase != "forward" or (w.annotations or {}).get(DROP_FETCHED) != "backward"))
                       for w in ts.waiters or ()):
                    continue  # read there soon
                drop.append(key)
            if drop:
                self.dropped += len(drop)
                s.request_remove_replicas(addr, drop, stimulus_id=f"tilegraph-drop-fetched-{time.time()}")

    return DropFetched()
