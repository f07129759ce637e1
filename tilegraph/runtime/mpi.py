"""dask-mpi launch: rank 0 runs the scheduler, rank 1 the client script, ranks >= 2 workers."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

from tilegraph._errors import TileError

#: on the client rank, once :func:`initialize_mpi` has given the ranks their roles: the settings
#: of that launch and its worker count (the other ranks never return from it)
_LAUNCH: dict | None = None


def initialize_mpi(interface: str | None = None, quiet: bool = True, *, security=None, tls: bool = False,
                   tls_files: tuple[str, str, str] | None = None, dask_config: dict | None = None,
                   problem: TileError | None = None, memory_limit="auto") -> int:
    """Turn this MPI rank into its dask-mpi role; on the client rank, return the worker count.

    Every rank applies the embedded cluster's Dask settings (``CLUSTER_DASK_CONFIG``: no worker
    profiler, slower periodic callbacks, no root-task queuing), updated with ``dask_config``.

    With ``tls_files`` (CA, certificate, key: checked by ``connect``; every rank must be able to
    read them) or a ``distributed.Security``, every rank speaks ``tls://``.

    ``memory_limit``: each worker rank's (as ``connect`` takes it, checked there; "auto": the
    node's memory in the share of its cores that the rank's threads have), with the embedded
    cluster's spill settings for it (``runtime._memory_settings``).

    ``problem``: what ``connect`` found wrong on this rank before (its TLS files, say). The ranks
    agree on such problems, and on ``interface``, before any of them takes its role
    (:func:`_agree_on_problems`): the client rank raises a TileError naming them, the others exit
    with status 1.
    """
    try:
        from dask_mpi import initialize
        with _start_watchdog():
            from mpi4py import MPI
    except ImportError as e:
        raise TileError("tilegraph.connect(mpi=True)", "needs the mpi extra: pip install 'tilegraph[mpi]'",
                        f"ImportError: {e}") from None
    from tilegraph.runtime import _plural

    global _LAUNCH
    if _LAUNCH is not None:  # a second connect(mpi=True) in this script (the ranks have their roles)
        return _connect_again(interface, _tls_config(security, tls, tls_files), dask_config, problem)
    comm = MPI.COMM_WORLD
    if comm.Get_size() < 3:
        if comm.Get_rank() != 1 and comm.Get_size() > 1:  # rank 1 (the client's) says why, once
            raise SystemExit(1)
        from tilegraph.runtime.connection import _MPI_RANK_ENV

        launched = any(os.environ.get(size) for _, size in _MPI_RANK_ENV)
        raise TileError("tilegraph.connect(mpi=True)", "dask-mpi needs at least 3 ranks (scheduler, client, "
                        "one worker): mpiexec -n 3 or more", _plural(comm.Get_size(), "rank") + (
                            "" if launched else " (this process was not started by mpiexec: run it as "
                            "`mpiexec -n 4 python script.py`, or `mpiexec -n 4 tilegraph train --mpi`)"))
    if dask_config is not None and not (isinstance(dask_config, Mapping)
                                        and all(isinstance(k, str) for k in dask_config)):
        if comm.Get_rank() != 1:  # the same on every rank: the client rank says why, once
            raise SystemExit(1)
        raise TileError("tilegraph.connect(mpi=True)", "dask_config must be a dict of Dask config keys "
                        "(\"distributed.admin.tick.interval\": \"1s\", ...) and their values", _short(dask_config))
    tls_config = {}
    if problem is None:  # (a Security naming files this rank lacks: every rank must hear of it)
        try:
            tls_config = _tls_config(security, tls, tls_files)
        except TileError as e:
            problem = e
    _agree_on_problems(comm, interface, problem)
    from tilegraph.runtime import _visible_gpus
    from tilegraph.runtime.worker_setup import CLUSTER_DASK_CONFIG, _quiet_logs, ignore_stop_signals, short_key_sets

    if comm.Get_rank() == 0:  # the scheduler's rank
        short_key_sets()
    if quiet:  # dask-mpi ranks log connection noise (CommClosedError) at a clean shutdown
        _quiet_logs()
        if comm.Get_rank() != 1:  # scheduler and workers: their comms close under them at exit
            for name in ("distributed.batched", "distributed.core", "distributed.worker"):
                logging.getLogger(name).setLevel(logging.CRITICAL)

    import dask

    # Process-wide, not in a `with` block: dask-mpi's Scheduler and Worker read dask's config
    # while they run (the logs' lengths, the periodic callbacks' intervals) or start (their
    # Security), and so do the Client on rank 1 (after initialize() returns) and dask-mpi's
    # closing client at exit. As in the embedded cluster: the logs' lengths bound what every rank
    # keeps of past work; with the rest (no profiler, slower ticks, no root-task queuing) the
    # workers' Dask threads took 7.5-9.4% of the cores instead of 10.2-11.8%, and 2 worker ranks
    # x 1 thread went from 0.89-0.96 to 0.96-1.02 of the embedded cluster's tokens/s
    # (bench_scale --mpi on 2 cores, GPT-2 6x768 and the block stack, data and sharded).
    dask.config.set({**CLUSTER_DASK_CONFIG, **(dask_config or {})})
    if tls_config:
        dask.config.set(tls_config)
    if comm.Get_rank() != 1:  # a job scheduler's SIGTERM (Slurm signals every rank) is the client's to
        # handle: it stops after the steps under way and checkpoints, which needs the scheduler and
        # workers alive; they end when the client's exit shuts the cluster down
        ignore_stop_signals()
    if comm.Get_rank() >= 2:  # a worker: one BLAS thread per kernel, as a nanny gives the embedded
        # cluster's workers (OPENBLAS_NUM_THREADS=1; too late here, NumPy has loaded OpenBLAS): its
        # kernels run on the worker's own threads, and OpenBLAS's threads beside them only compete
        # for the rank's cores (and gave other float rounding than the embedded cluster's workers)
        from tilegraph.exec.program import one_blas_thread

        one_blas_thread()  # not as a context: for the rank's life
    # Per-rank worker options are decided here, before initialize() turns this rank into a worker.
    threads = _worker_threads(comm, MPI)
    gpus = _visible_gpus()
    options = {"resources": {"GPU": 1} if gpus else {"CPU": threads}}
    limit = _rank_memory_limit(memory_limit, threads)
    if comm.Get_rank() >= 2 and limit:
        from tilegraph.runtime import _memory_settings

        dask.config.set(_memory_settings(limit, threads, os.cpu_count() or 1))
    try:
        initialize(interface=interface, nthreads=threads, worker_options=options, dashboard=comm.Get_rank() == 0,
                   protocol="tls" if tls_config else None, exit=True, memory_limit=limit or None)
    except Exception as e:
        if comm.Get_rank() != 0:
            raise  # a worker rank that fails to start: the client rank names it after its wait for them
        _end_job(comm, e)
    _end_launch_at_exit()
    _LAUNCH = {"settings": (interface, tls_config, dask_config or {}), "workers": comm.Get_size() - 2}
    return _LAUNCH["workers"]


#: how long a rank waits in MPI's start for every rank of the launch (``TILEGRAPH_MPI_START_SECONDS``
#: overrides it): MPICH's MPI_Init waits for them all, without limit and spinning a core, and its
#: mpiexec does not end a job one of whose ranks exited before starting MPI
MPI_START_WAIT_SECONDS = 120.0


@contextlib.contextmanager
def _start_watchdog():
    """End this rank if MPI's start (mpi4py's import, which runs MPI_Init) takes longer than
    :data:`MPI_START_WAIT_SECONDS`: a rank that failed before it (an import error on its node, a
    script that raised) never joins, and the others waited in MPI_Init until the batch system
    killed the job (seen with `mpiexec -n 4`, one rank failing an import: 3 ranks spinning).

    MPI_Init holds the GIL, so no Python thread or signal handler runs while it waits: a forked
    watcher process, which only waits on a pipe, does. When the wait ends without the pipe closing,
    the client rank's watcher says why (the dead rank's own error is above it), and each watcher
    kills its rank (SIGKILL: a signal handler of Python's would never run), which ends the job."""
    import select
    import signal
    import socket
    import sys

    if "mpi4py.MPI" in sys.modules or not hasattr(os, "fork"):
        yield  # MPI started before (or a platform without fork: MPI_Init's own behaviour)
        return
    from tilegraph.runtime.connection import _MPI_RANK_ENV

    rank, size = next(((os.environ[r], os.environ.get(n, "?")) for r, n in _MPI_RANK_ENV if r in os.environ),
                      ("?", "?"))  # (MPICH, Open MPI, PMIx)
    wait = _start_wait_seconds(rank)
    message = (f"[tilegraph.connect(mpi=True)] every rank of the launch to start MPI within {wait:g} s (a rank that "
               "ended before, its error above, leaves the others waiting in MPI_Init without end; so the job "
               "ends; TILEGRAPH_MPI_START_SECONDS sets this wait); received: rank "
               f"{rank} of {size} on {socket.gethostname()} still waiting\n").encode()
    readable, writable = os.pipe()
    watcher = os.fork()
    if watcher == 0:  # the watcher: os calls alone (a forked copy of a process that may run threads)
        try:
            os.close(writable)
            # the others give the client rank time to say why (once) before the job goes down
            if not select.select([readable], [], [], wait if rank == "1" else wait + 3)[0]:  # (closed: MPI started)
                if rank == "1":
                    os.write(2, message)
                    select.select([], [], [], 0.5)  # (for mpiexec to pass the line on before the ranks go)
                os.kill(os.getppid(), signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(readable)
    try:
        yield
    finally:
        os.close(writable)
        os.waitpid(watcher, 0)


def _start_wait_seconds(rank: str = "?") -> float:
    """``TILEGRAPH_MPI_START_SECONDS`` (default :data:`MPI_START_WAIT_SECONDS`). A bad value is the
    same on every rank (mpiexec passes the environment on): the client rank (``rank`` "1", or
    one whose rank is unknown) raises the error, the others exit with status 1 without a word (as
    many copies of it as ranks before)."""
    text = os.environ.get("TILEGRAPH_MPI_START_SECONDS", "")
    try:
        wait = float(text) if text else MPI_START_WAIT_SECONDS
    except ValueError:
        wait = -1.0
    if not wait > 0 and rank not in ("1", "?"):
        raise SystemExit(1)
    if not wait > 0:
        raise TileError("tilegraph.connect(mpi=True)", "TILEGRAPH_MPI_START_SECONDS: a number of seconds > 0 (how "
                        "long a rank waits for the others to start MPI)", repr(text))
    return wait


def _end_job(comm, error: Exception) -> None:
    """End the whole job from the scheduler's rank, whose scheduler failed (to start, say: a
    value of ``dask_config`` it cannot read). Every other rank waits for the scheduler's address
    in dask-mpi's busy MPI broadcast: the job went on, a core spinning per rank, until the batch
    system killed it. Says why, naming the rank and host, then aborts every rank."""
    import socket
    import sys
    import time

    print(f"[tilegraph.connect(mpi=True)] the scheduler (rank 0 on {socket.gethostname()}) failed, so the MPI job "
          "ends (a Dask setting it cannot read? connect's dask_config, DASK_CONFIG's files); "
          f"received: {type(error).__name__}: {_short(error)}", file=sys.stderr, flush=True)
    # The launcher forwards each rank's output from a pipe; once Abort reaches it, it tears the
    # ranks and their pipes down, and a line written just before can be lost with them (once, in
    # a full test run, such a job's stderr came back empty): give it time to pass the line on.
    time.sleep(0.5)
    comm.Abort(1)


def _short(value, limit: int = 300) -> str:
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _end_launch_at_exit() -> None:
    """Have this client rank end the launch as its script ends: its open clients closed first (a
    client still open as the scheduler shut down logged "Failed to reconnect to scheduler after
    30.00 seconds" and tracebacks), then the scheduler and workers shut down, through a client
    of its own, as dask-mpi's ``send_close_signal`` does.

    dask-mpi does it from an ``atexit`` handler whose client starts its event loop's thread
    there, which CPython 3.12.0 and 3.12.1 refuse at shutdown ("can't create new thread at
    interpreter shutdown", gh-113964): the workers never heard, and mpiexec waited for them for
    good after the training had ended. So the loop's thread starts here, and the closing client
    runs on it; dask-mpi's handler is taken back."""
    import atexit

    from dask_mpi.initialize import send_close_signal
    from distributed.utils import LoopRunner

    runner = LoopRunner(asynchronous=False)
    runner.start()  # (its thread, started now; at exit no thread need start)

    def end_launch() -> None:
        from distributed import Client

        _close_clients()
        try:
            with Client(loop=runner.loop) as client:
                client.shutdown()
        finally:
            runner.stop()

    atexit.unregister(send_close_signal)
    atexit.register(end_launch)


def _close_clients() -> None:
    """Close this client rank's open Dask clients (at exit, before the cluster shuts down)."""
    from distributed.client import _global_clients

    for client in list(_global_clients.values()):
        try:
            client.close(timeout=2)
        except Exception:
            pass  # exiting anyway


def _connect_again(interface, tls_config: dict, dask_config: dict | None, problem: TileError | None) -> int:
    """The worker count of the launch this client rank made before, for a second connect(mpi=True)
    (a script that trains twice, a notebook cell run again). The ranks took their roles at the
    first one: the scheduler and the workers run until this script ends, and no longer take part
    in the collective calls of a launch (a second launch waited for them without end, spinning a
    core). So a client connects to the same scheduler, with the same settings."""
    if problem is not None:
        raise problem
    before = _LAUNCH["settings"]
    now = (interface, tls_config, dask_config or {})
    if now != before:
        names = ("interface", "TLS", "dask_config")
        changed = [f"{name} {b!r} -> {n!r}" for name, b, n in zip(names, before, now) if b != n]
        raise TileError("tilegraph.connect(mpi=True)", "the settings of this script's first connect(mpi=True): "
                        "its ranks took their roles (scheduler, workers) then, with those settings, and keep them "
                        "until the script ends", "; ".join(changed))
    return _LAUNCH["workers"]


def _interface_problem(interface: str | None) -> str | None:
    """Why this rank cannot listen on ``interface`` (None: it can, or no interface was named)."""
    if interface is None:
        return None
    from distributed.utils import get_ip_interface

    try:
        get_ip_interface(interface)
    except (ValueError, KeyError) as e:
        return str(e)
    return None


def _agree_on_problems(comm, interface: str | None, problem: TileError | None) -> None:
    """End every rank when any rank found a problem: ``problem`` (``connect``'s checks of its
    files on that rank) or an ``interface`` it does not have. The client rank (rank 1, the
    user's script) raises a TileError naming the ranks and their hosts; the others exit with
    status 1 without a traceback of their own.

    Collective. dask-mpi's ranks wait for each other: the scheduler (rank 0) sends its address,
    which the others wait for in a busy MPI broadcast. A rank that raised alone left the others
    waiting without end, each spinning a core (seen: ``interface="ib0"`` on a host without it,
    a ValueError on rank 0 and a job that ran until the batch system killed it)."""
    import socket

    mine = str(problem) if problem is not None else _interface_problem(interface)
    found = [(rank, host, text) for rank, (host, text) in
             enumerate(comm.allgather((socket.gethostname(), mine))) if text is not None]
    if not found:
        return
    if comm.Get_rank() != 1:  # the client rank (the user's script) says why; the others end quietly
        raise SystemExit(1)
    texts = {text for _, _, text in found}
    if len(texts) == 1 and len(found) == comm.Get_size():  # the same on every rank
        if problem is not None:
            raise problem
        raise TileError("tilegraph.connect(mpi=True)", "interface: a network interface with an IPv4 address on "
                        "every rank's host (or None: the host's address)", f"interface={interface!r}: {mine}")
    ranks = "; ".join(f"rank {rank} on {host}: {text}" for rank, host, text in found)
    raise TileError("tilegraph.connect(mpi=True)", "every rank able to start: the interface and TLS files "
                    "on every rank's host", f"interface={interface!r}; {ranks}")


def _worker_threads(comm, MPI) -> int:
    """Threads of this rank's worker: the cores mpiexec bound it to, or, when it may use the
    whole node, the node's cores shared among the worker ranks on that node (ranks 0 and 1, the
    scheduler and the client, mostly wait). Called by every rank: it is collective."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    workers_here = sum(r >= 2 for r in node.allgather(comm.Get_rank()))
    node.Free()
    cores = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    if mine < cores:  # bound by mpiexec (--bind-to core, ...): those cores are this rank's
        return max(1, mine)
    return max(1, cores // max(1, workers_here))


def _rank_memory_limit(memory_limit, threads: int) -> int:
    """A worker rank's memory limit in bytes (0: none), from ``connect``'s ``memory_limit``:
    "auto" is the node's memory times the share of its cores that the rank's ``threads`` are
    (each of the node's worker ranks gets its part, as its cores)."""
    from distributed.worker_memory import parse_memory_limit

    return parse_memory_limit(memory_limit, threads, total_cores=os.cpu_count() or 1,
                              logger=logging.getLogger(__name__)) or 0


def _tls_config(security, tls: bool, tls_files) -> dict:
    """Dask config keys that make this rank's scheduler, worker or client use TLS ({}: plain tcp).

    Each rank reads the files itself, so no key travels between ranks: MPI's own network is
    usually not encrypted, which is why ``tls=True`` without files (temporary certificates made
    on one rank) is refused here, and so is a ``distributed.Security`` that holds no files (an
    empty one ran the job over plain tcp:// without a word; ``Security.temporary()``'s
    certificates, made on each rank apart, would not know each other's).
    """
    where = "tilegraph.connect(mpi=True)"
    if tls_files:
        ca_file, cert, key = tls_files
        roles = {role: (cert, key) for role in ("scheduler", "worker", "client")}
    elif security is not None:
        ca_file, roles = _security_files(where, security)
    elif tls:
        raise TileError(where, "TLS under MPI needs certificate files every rank can read: "
                        "tls_ca_file, tls_cert and tls_key (temporary certificates would have to travel between "
                        "ranks over MPI's network, which is usually not encrypted)", "tls=True without files")
    else:
        return {}
    config = {"distributed.comm.require-encryption": True, "distributed.comm.tls.ca-file": ca_file}
    for role, (cert, key) in roles.items():
        config[f"distributed.comm.tls.{role}.cert"] = cert
        config[f"distributed.comm.tls.{role}.key"] = key
    return config


def _security_files(where: str, security) -> tuple[str, dict[str, tuple[str, str | None]]]:
    """The CA file and each role's (certificate, key) files of a ``distributed.Security`` given
    under MPI, checked on this rank as ``connect`` checks its ``tls_*`` files. A user who asked
    for security gets TLS on every rank or this error, never plain tcp://."""
    from tilegraph.runtime.connection import _check_security, _tls_files

    security = _check_security(where, security)
    roles = ("scheduler", "worker", "client")
    paths = {"tls_ca_file": security.tls_ca_file}
    for role in roles:
        paths[f"tls_{role}_cert"] = getattr(security, f"tls_{role}_cert")
        paths[f"tls_{role}_key"] = getattr(security, f"tls_{role}_key")
    needs = ("security=: a distributed.Security naming TLS files every rank can read, its tls_ca_file and a "
             "certificate (and key) for each of the scheduler, worker and client roles, e.g. Security(tls_ca_file=..., "
             "tls_scheduler_cert=..., ...) (or give tls_ca_file, tls_cert and tls_key instead); the MPI ranks "
             "would otherwise speak plain tcp://")
    in_memory = [name for name, value in paths.items() if isinstance(value, str) and "-----BEGIN" in value]
    if in_memory:  # Security.temporary(): each rank would make certificates of its own
        raise TileError(where, needs, f"{security!r} holds certificates in memory ({', '.join(in_memory)}), not "
                        "files: each rank would make its own, which the others' do not trust")
    missing = [name for name, value in paths.items() if not value and not name.endswith("_key")]
    if missing:
        raise TileError(where, needs, f"{security!r} without {', '.join(missing)}")
    for role in roles:  # each file there and readable on this rank, a certificate and its key a pair
        cert, key = paths[f"tls_{role}_cert"], paths[f"tls_{role}_key"]
        _tls_files(f"{where} security= ({role})", paths["tls_ca_file"], cert, key or cert)
    return paths["tls_ca_file"], {role: (paths[f"tls_{role}_cert"], paths[f"tls_{role}_key"]) for role in roles}
