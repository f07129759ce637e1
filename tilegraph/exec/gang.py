"""One task per worker process per call: a data-parallel step whose exchanges never wait for Dask.

A data-parallel or sharded step written as Dask tasks crosses the scheduler at every boundary:
the backward task ends, a send task writes the gradients, the owner's receive task maps them,
its update runs, a pick and a push send the new parameters, the other process's receive maps
them, and only then may the next forward start. Each of those dependent hops is a round trip
through the scheduler (6-25 ms on 2 busy cores): measured on the block stack, 2 workers x 1
thread, about 0.1 s of a 1.45 s step went to hops, against 0.07 s of copying.

A *gang* step runs all of one process's tasks of the call, in one order valid for every process
(so no two processes wait on each other), inside a single Dask task pinned to that process's
worker; every worker runs its own at the same time. What one process reads of another's goes
through a *channel*: the producer writes the values to one file in its shared-memory folder
(``/dev/shm/tilegraph-<pid>``, see :mod:`tilegraph.exec.shm`) as soon as the stage that made
them ends, under a temporary name renamed when complete; the reader waits for the name, maps
the file (copy-on-write, no copy) and takes it out of the channel's name; once the reader's last
array over it is gone the file is free, and its writer writes the next call's values over it
(writing over existing pages of ``/dev/shm`` takes half the time of new ones; a gang leaves at
most what it wrote free). That needs the two processes on one host, sharing ``/dev/shm`` and one
process-id namespace; between processes that do not (several hosts), or with
``tilegraph.config.shm_transfers`` off, a channel goes over the workers' own comms instead
(:mod:`tilegraph.exec.comm_channel`). The plan says which, per pair of processes
(``GangSpec.shared``).

A wait never hangs: it fails when the writer's process is gone, when Dask cancelled this task
(the client released the step: an interrupt, a lost worker elsewhere), or after
``timeout`` seconds (``tilegraph.config.exchange_timeout_seconds``).
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import pickle
import time
import uuid
import weakref
from typing import Any, NamedTuple

import numpy as np

from tilegraph.exec.program import Bound, measured_exactly, run_cluster, task_meter
from tilegraph.exec.shm import SHM_ROOT, _PREFIX, _folder, shm_domain
from tilegraph.io._store import process_alive, write_file

__all__ = ["GangSpec", "Stage", "ChannelWaitError", "PeerFailedError", "run_gang", "AFTER_INDEX", "gang_identity",
           "write_channel", "read_channel", "check_wait", "channel_path", "trim_pool"]

#: bytes of the header-length field at the start of a channel file; data blocks align to this
_ALIGN = 64


class Stage(NamedTuple):
    """One task of the call, run inside the gang: its program (index into the gang's programs)
    and where each of its inputs comes from: ``("x", i)`` the gang task's argument i (a leaf:
    parameter, batch tile), ``("r", s, k)`` element k of stage s's result, ``("c", ch, j)``
    value j of channel ch. ``sends``: the channels written after it, as (channel, elements of
    its result, reading process). ``drop``: what no later stage reads: stage results
    (``("r", s)``), elements of them (``("e", (s, k))``) and channels (``("c", ch)``)."""

    prog: int
    inputs: tuple
    sends: tuple
    drop: tuple


class GangSpec:
    """What one process's gang task runs: its :class:`Stage` s in order, the channels it reads
    as (name, writer process), the elements of its result (``("r", s, k)`` or ``("c", ch, j)``),
    for each process whether channels with it go through shared memory (``shared``; else over
    the workers' comms, :mod:`tilegraph.exec.comm_channel`), each process's pid (shared-memory
    channel files live in the writer's folder) and worker address, and the wait limit in
    seconds. A plain object, not a tuple: Dask looks for tasks and keys inside tuple arguments."""

    __slots__ = ("stages", "reads", "outputs", "shared", "pids", "addrs", "timeout")

    def __init__(self, stages: tuple, reads: tuple, outputs: tuple, shared: tuple, pids: tuple = (),
                 addrs: tuple = (), timeout: float = 0.0):
        self.stages, self.reads, self.outputs, self.shared = stages, reads, outputs, shared
        self.pids, self.addrs, self.timeout = pids, addrs, timeout

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state):
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)

    def bound(self, pids: tuple, addrs: tuple, timeout: float) -> "GangSpec":
        """This spec for one call: with the workers' pids and addresses and the wait limit."""
        return GangSpec(self.stages, self.reads, self.outputs, self.shared, pids, addrs, timeout)


class ChannelWaitError(RuntimeError):
    """A gang's wait for another process's values ended without them: that process is gone, the
    step was cancelled, or nothing came within the time limit (the client names the worker)."""


class PeerFailedError(RuntimeError):
    """Another process of a gang step failed before it sent what this one waits for: its error
    (it wrote that in place of the values, so that no process of the step waits on). ``first``:
    that error itself where it crossed (see :func:`failure_record`), which the client raises in
    place of this one (``tilegraph._lower.first_failure``)."""

    def __init__(self, message: str, first: BaseException | None = None):
        super().__init__(message)
        self.first = first


#: the most bytes of a pickled error a failed gang sends its readers (else its text alone)
FAILURE_PICKLE_MAX = 1 << 16


def failure_record(error: BaseException) -> dict:
    """What a failed gang sends each reader in place of values: its error's text and, where it
    pickles within ``FAILURE_PICKLE_MAX`` bytes, the error itself (base64; Dask pickles errors
    between workers and client the same way), so that the step raises the error that caused it
    (a TileError for a token id out of range) whichever process's result the client met first."""
    record = {"error": f"{type(error).__name__}: {error}"[:2000]}
    try:
        raw = pickle.dumps(error)
    except Exception:  # (an error holding something that does not pickle: its text alone)
        return record
    if len(raw) <= FAILURE_PICKLE_MAX:
        record["pickled"] = base64.b64encode(raw).decode("ascii")
    return record


def peer_failed(name: str, who: str, record: dict) -> PeerFailedError:
    """The error of a reader of channel ``name`` whose writer, ``who``, sent ``record``
    (:func:`failure_record`) in place of the values."""
    first = None
    if record.get("pickled"):
        try:
            first = pickle.loads(base64.b64decode(record["pickled"]))
        except Exception:  # (a class this process cannot import: the text says what it was)
            first = None
    return PeerFailedError(f"tilegraph: gang step: channel {name}: {who} failed: {record.get('error')}",
                           first if isinstance(first, BaseException) else None)


def gang_identity() -> tuple[str | None, str | None, int, int]:
    """(shared-memory domain, process-id namespace, pid, free bytes in shared memory) of this
    worker process: a gang needs the first two equal on every worker (run on each worker)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    try:
        st = os.statvfs(SHM_ROOT)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return shm_domain(), ns, os.getpid(), free


def channel_path(pid: int, name: str) -> str:
    return os.path.join(SHM_ROOT, f"{_PREFIX}{pid}", f"g-{name}")


def _as_array(v, name: str) -> np.ndarray:
    if isinstance(v, np.ndarray):  # (np.ascontiguousarray would make a 0-d array 1-d)
        return v if v.flags.c_contiguous else v.copy(order="C")
    if isinstance(v, (np.generic, float, int, bool)):
        return np.asarray(v)
    raise TypeError(f"tilegraph: channel {name}: a gang step moves NumPy arrays between processes; received "
                    f"{type(v).__name__}")


def write_channel(name: str, values: tuple) -> int:
    """Write ``values`` (NumPy arrays) to this process's channel file ``name``: a header (length,
    then JSON of each value's dtype, shape and offset), then the values at 64-byte offsets;
    renamed to its final name only once complete (:func:`channel_path`), written over a free file
    of the same size where one is left (:func:`read_channel`). Returns the bytes written."""
    arrays = [_as_array(v, name) for v in values]
    entries, offset = [], 0
    for a in arrays:
        entries.append([a.dtype.str, list(a.shape), offset])
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    head = json.dumps(entries).encode()
    start = -(-(8 + len(head)) // _ALIGN) * _ALIGN
    parts: list[Any] = [len(head).to_bytes(8, "little") + head + bytes(start - 8 - len(head))]
    for a in arrays:
        parts.append(a.reshape(-1) if a.ndim else a.reshape(1))
        pad = -a.nbytes % _ALIGN
        if pad:
            parts.append(bytes(pad))
    folder = _folder()
    final = os.path.join(folder, f"g-{name}")
    tmp = os.path.join(folder, f".g-{name}.tmp")
    size = start + offset
    if _claim_free(folder, size, tmp):  # a file a reader is done with: its pages exist already
        write_file(tmp, parts, overwrite=True)
    else:
        write_file(tmp, parts)
    os.rename(tmp, final)
    return size


def _free_files(folder: str) -> list[tuple[int, str]]:
    """This folder's free channel files, as (size, name): ``f-<size>-<id>``."""
    out = []
    for entry in os.listdir(folder):
        if entry.startswith("f-"):
            size = entry.split("-")[1]
            if size.isdigit():
                out.append((int(size), entry))
    return out


def _claim_free(folder: str, size: int, tmp: str) -> bool:
    """Take a free file of ``size`` bytes (renamed to ``tmp``); False where none is there.
    Writing over a file's existing pages in ``/dev/shm`` takes half the time of writing a new
    one (80 MB: 12-15 ms against 28 ms on the 2-core machine)."""
    for n, entry in _free_files(folder):
        if n == size:
            try:
                os.rename(os.path.join(folder, entry), tmp)
                return True
            except FileNotFoundError:  # taken by another thread of this process
                continue
    return False


def trim_pool(keep_bytes: int) -> None:
    """Remove this process's free channel files beyond ``keep_bytes`` (what its last gang wrote:
    enough for the next call of the same plan), the largest first."""
    folder = _folder()
    free = sorted(_free_files(folder), reverse=True)
    total = sum(n for n, _ in free)
    for n, entry in free:
        if total <= keep_bytes:
            break
        try:
            os.unlink(os.path.join(folder, entry))
        except FileNotFoundError:
            pass
        total -= n


def _release(folder: str, busy: str, size: int) -> None:
    """A reader is done with channel file ``busy`` (its mapping closed): it becomes free for its
    writer to reuse; gone where the writer's folder is (the writer closed)."""
    try:
        os.rename(os.path.join(folder, busy), os.path.join(folder, f"f-{size}-{busy[2:]}"))
    except OSError:
        pass


def _cancelled() -> bool:
    """Whether Dask no longer wants the task running in this thread (its key released or
    cancelled); False outside a worker."""
    try:
        from distributed import get_worker
        from distributed.worker import thread_state

        key = getattr(thread_state, "key", None)
        if key is None:
            return False
        ts = get_worker().state.tasks.get(key)
    except (ImportError, ValueError):
        return False
    return ts is None or ts.state in ("cancelled", "released")


def check_wait(name: str, waited: float, timeout: float, writer: str, gone: str | None = None) -> None:
    """End a wait for channel ``name`` (either transport) with ChannelWaitError when its writer
    is ``gone`` (why), when Dask cancelled this task, or when nothing came from ``writer`` in
    ``timeout`` seconds (``waited`` so far)."""
    what = gone
    if what is None and _cancelled():
        what = "this step was cancelled"
    if what is None and waited > timeout:
        what = f"nothing came from {writer} in {timeout:g} s (tilegraph.config.exchange_timeout_seconds)"
    if what is not None:
        raise ChannelWaitError(f"tilegraph: gang step: waiting for values of channel {name}: {what}")


#: writers' pids found stale in this process (their worker started again by its nanny at the same
#: address, after the client asked its pid): the plan's pid -> the pid of that worker's process now
_RESTARTED: dict[int, int] = {}


def _restarted_as(pid: int, addr: str | None) -> int | None:
    """The pid of the process now running the worker at ``addr``, which the plan knew as process
    ``pid`` (gone): a worker its nanny started again at the same address (a fixed
    ``--worker-port``, a job scheduler's) keeps its address and gets a new process. None where
    that worker does not answer with another live process of this host."""
    if addr is None:
        return None
    from tilegraph.exec.comm_channel import worker_pid

    now = worker_pid(addr)
    if now is None or now == pid or not process_alive(now):
        return None
    _RESTARTED[pid] = now
    return now


def read_channel(name: str, pid: int, timeout: float, addr: str | None = None) -> tuple:
    """The values of channel ``name`` written by process ``pid`` (of the worker at ``addr``):
    waits until its file exists, maps it (copy-on-write) and takes it out of the channel's name;
    once the last array over the mapping is gone, the file is left free for its writer to write
    over (``f-<size>-<id>``, see :func:`write_channel`). A writer's process found gone whose
    worker answers from another process (started again at the same address) is read from there.
    Raises ChannelWaitError, naming the channel, when the writer's process is gone, when Dask
    cancelled this task, or after ``timeout`` seconds."""
    for _ in range(len(_RESTARTED)):  # (restarted more than once: its latest process)
        if pid not in _RESTARTED:
            break
        pid = _RESTARTED[pid]
    path = channel_path(pid, name)
    t0 = time.perf_counter()
    pause, checked = 0.0, t0
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            break
        except FileNotFoundError:
            pass
        now = time.perf_counter()
        if now - checked > 0.05:
            checked = now
            gone = None
            if not process_alive(pid):
                again = _restarted_as(pid, addr)
                if again is not None:
                    pid, path = again, channel_path(again, name)
                    continue
                gone = f"its writer, worker process {pid}{f' (worker {addr})' if addr else ''}, is gone"
            check_wait(name, now - t0, timeout, f"worker process {pid}", gone)
        time.sleep(pause)
        pause = min(1e-3, pause * 2 or 2e-5)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    # out of the channel's name at once (read once); free for the writer to reuse once the last
    # array over the mapping is gone (copy-on-write: nothing written here reaches the file)
    folder = os.path.dirname(path)
    busy = f"b-{uuid.uuid4().hex}"
    os.rename(path, os.path.join(folder, busy))
    weakref.finalize(mm, _release, folder, busy, size)
    n = int.from_bytes(mm[:8], "little")
    entries = json.loads(bytes(mm[8:8 + n]))
    if isinstance(entries, dict):  # what the writer wrote instead when it failed
        raise peer_failed(name, f"worker process {pid}", entries)
    start = -(-(8 + n) // _ALIGN) * _ALIGN
    out = []
    for dtype, shape, offset in entries:
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        a = np.frombuffer(mm, dt, count, start + offset) if count else np.empty(0, dt)
        out.append(a.reshape(tuple(shape)))
    return tuple(out)


#: where ``after`` is in a gang task's tuple ``(run_gang, spec, call, bound, programs, after, *args)``
#: (``Executable._submit_gang`` sets it as it submits)
AFTER_INDEX = 5


def run_gang(spec: GangSpec, call: str, bound: Bound, programs: list, after, *args):
    """A gang task: run ``spec``'s stages in order, writing and reading channels (named
    ``<call>-<channel>``; ``call`` is the call's own name) between them; returns the elements
    ``spec.outputs`` names. Argument i is ``args[i]``, or its element ``bound.ext_index[i]`` where
    that is not None. ``after``: the previous gang task's result on this worker (only ordering
    the two)."""
    from tilegraph.exec import comm_channel

    args = tuple(a if i is None else a[i] for a, i in zip(args, bound.ext_index))
    results: dict[int, tuple] = {}
    received: dict[int, tuple] = {}
    reads = spec.reads
    sender: list = []  # the comm sends' Sender, made at the first

    meter = task_meter()  # the waits and writes show on Dask's Fine Performance Metrics page

    def channel(ch: int) -> tuple:
        got = received.get(ch)
        if got is None:
            name, writer = reads[ch]
            with meter.meter("channel-read"):
                if spec.shared[writer]:
                    got = read_channel(f"{call}-{name}", spec.pids[writer], spec.timeout,
                                       spec.addrs[writer] if spec.addrs else None)
                else:
                    got = comm_channel.read(f"{call}-{name}", spec.addrs[writer], spec.timeout)
            received[ch] = got
        return got

    def send(name: str, reader: int, values: tuple | None, error: dict | None = None) -> int:
        """Channel ``name`` to process ``reader``: its values, or this gang's error (a
        :func:`failure_record`); the bytes it took in shared memory."""
        if spec.shared[reader]:
            if error is not None:
                _write_failure(f"{call}-{name}", error)
                return 0
            return write_channel(f"{call}-{name}", values)
        if not sender:
            sender.append(comm_channel.Sender())
        if error is None:
            values = tuple(_as_array(v, name) for v in values)
        sender[0].send(spec.addrs[reader], f"{call}-{name}", values, error)
        return 0

    def value(src: tuple):
        if src[0] == "x":
            return args[src[1]]
        if src[0] == "r":
            return results[src[1]][src[2]]
        return channel(src[1])[src[2]]

    outputs = spec.outputs
    kept: dict[int, Any] = {}  # the result's elements, taken as soon as they exist
    written = 0
    sent: set[str] = set()
    try:
        for s, stage in enumerate(spec.stages):
            ins = [value(src) for src in stage.inputs]
            results[s] = list(run_cluster(Bound((None,) * len(ins)), programs[stage.prog], *ins))
            for name, idx, reader in stage.sends:
                with meter.meter("channel-write"):
                    written += send(name, reader, tuple(results[s][k] for k in idx))
                sent.add(name)
            for i, src in enumerate(outputs):
                if src[0] == "r" and src[1] == s:
                    kept[i] = results[s][src[2]]
            for kind, which in stage.drop:
                if kind == "e":
                    results[which[0]][which[1]] = None
                else:
                    (results if kind == "r" else received).pop(which, None)
        out = measured_exactly(tuple(kept[i] if i in kept else value(src) for i, src in enumerate(outputs)))
        if sender:
            with meter.meter("channel-write"):  # the comm sends, until delivered
                sender[0].finish(spec.timeout)
    except BaseException as e:  # the other processes must not wait for what this one will not send
        message = failure_record(e)
        for stage in spec.stages:
            for name, _, reader in stage.sends:
                if name not in sent:
                    try:
                        send(name, reader, None, message)
                    except Exception:  # (no room, no connection): that reader fails by its own checks
                        pass
        if sender:
            try:
                sender[0].finish(min(spec.timeout, 5.0))
            except Exception:
                pass
        raise
    finally:
        if not all(spec.shared):
            comm_channel.close(call, spec.timeout)
    trim_pool(written)
    return out


def _write_failure(name: str, record: dict) -> None:
    """Write channel ``name`` as failed, with ``record`` (:func:`failure_record`; readers raise
    PeerFailedError)."""
    head = json.dumps(record).encode()
    try:
        folder = _folder()
        tmp = os.path.join(folder, f".g-{name}.tmp")
        write_file(tmp, [len(head).to_bytes(8, "little") + head])
        os.rename(tmp, os.path.join(folder, f"g-{name}"))
    except OSError:  # no room even for this: the readers see this process alive, and wait
        pass
