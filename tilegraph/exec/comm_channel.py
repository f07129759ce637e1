"""Gang channels between worker processes that share no ``/dev/shm``: over the workers' own comms.

A gang step (:mod:`tilegraph.exec.gang`) moves the values one process reads of another's through
*channels*. Between processes of one host they are files in shared memory; between hosts (or
where ``tilegraph.config.shm_transfers`` is off) this module carries them over the connections
Dask's workers already keep with each other: the writer's gang hands the values to its worker's
event loop, which sends them as one message to the reader's worker (Dask's serialization: NumPy
arrays travel as raw frames, no pickling of their data); a handler there
(``tilegraph_channel``, installed on every worker by :func:`channel_plugin`) files them in the
process's mailbox, where the reader's gang takes them. The sends run on the event loop while the
gang's thread goes on with its next stage, so moving values overlaps the compute, and they use
whatever the cluster's comms use: TCP, or TLS with the certificates of the cluster's
``security`` (no port of tilegraph's own is opened).

A gang waits for every send it started before it returns, so a value that could not be
delivered fails the step naming the reader's worker. A reader's wait never hangs: it fails when
the writer's worker is no longer one of the cluster's (the scheduler is asked once a second
while the wait lasts; it drops a worker whose process ended at once, one that stopped answering
after its time-to-live), when the values will not come though the writer's worker is there (it
is asked once a second too: its send was answered, which this worker does only after filing
them, or its gang of the call ended without sending them; the error says which), when Dask
cancelled the task, after the time limit, or at once with the writer's
error when the writer's gang failed (it sends that in place of what it will not send).

Each call's channels are named after the call (``<call>-<channel>``, a name of its own per call),
so what arrives for a call whose gang has ended on this worker is dropped, and what a gang left
unread is dropped as it ends; values for a call whose gang never started here (a step cancelled
before it ran) are dropped once they are older than the channel time limit.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import OrderedDict
from typing import Any

#: the worker handler's name (an operation of Dask's worker server)
HANDLER = "tilegraph_channel"
#: the handler telling a reader whether a call's gang ended on this worker, and how its send of a
#: channel went
STATE_HANDLER = "tilegraph_channel_state"
#: the handler answering a worker process's pid (a gang's reader finds a writer's worker started
#: again by its nanny at the same address: :func:`tilegraph.exec.gang.read_channel`)
PID_HANDLER = "tilegraph_pid"
#: seconds between asking the scheduler whether a writer's worker is still there, while a
#: reader waits
PING_SECONDS = 1.0
#: how many ended calls a worker remembers (values still arriving for them are dropped)
_CLOSED_MAX = 4096

_cond = threading.Condition()
#: channel name -> (arrival time, its values, or the writer's error: ``exec.gang.failure_record``)
_box: dict[str, tuple[float, Any]] = {}
#: calls whose gang ended on this worker
_closed: OrderedDict[str, None] = OrderedDict()
#: channel name -> how its send from this worker went: the reader's worker's answer ("OK", or
#: "closed": its gang of the call had ended), or why it was not delivered (the last _CLOSED_MAX)
_sent: OrderedDict[str, str] = OrderedDict()


def _call_of(name: str) -> str:
    return name.split("-", 1)[0]


async def _receive(name: str = "", values=None, error: dict | None = None) -> str:
    """The worker handler: file a channel's values (or its writer's error) in the mailbox."""
    with _cond:
        if _call_of(name) in _closed:
            return "closed"
        _box[name] = (time.monotonic(), error if error is not None else tuple(values))
        _cond.notify_all()
    return "OK"


async def _state(call: str = "", name: str = "") -> dict:
    """The worker handler a reader asks: whether ``call``'s gang ended on this worker, and how
    the send of channel ``name`` went (None: it was not sent, or not yet answered)."""
    with _cond:
        return {"ended": call in _closed, "sent": _sent.get(name)}


async def _pid() -> int:
    """The worker handler answering this worker process's pid."""
    return os.getpid()


def install(worker) -> None:
    """Install the channel handlers on ``worker`` (a Dask worker; idempotent)."""
    worker.handlers[HANDLER] = _receive
    worker.handlers[STATE_HANDLER] = _state
    worker.handlers[PID_HANDLER] = _pid


async def _pid_of(worker, addr: str) -> int | None:
    if addr not in await worker.scheduler.ncores(workers=[addr]):  # (gone: no connection tried)
        return None
    return int(await getattr(worker.rpc(addr), PID_HANDLER)())


def worker_pid(addr: str, timeout: float = 2.0) -> int | None:
    """The pid of the process of the worker at ``addr`` now, asked from a task of this worker
    (None: that worker is no longer one of the cluster's, did not answer within ``timeout``
    seconds, or has no handler: no channel plugin)."""
    try:
        worker = _worker()
        return _submit(worker, _pid_of(worker, addr)).result(timeout)
    except Exception:
        return None


def channel_plugin():
    """A worker plugin installing the channel handler on every worker, also those joining later."""
    from tilegraph.exec import setup_plugin

    return setup_plugin("tilegraph-channels", install)


def _worker():
    from distributed import get_worker

    return get_worker()


def _submit(worker, coro):
    return asyncio.run_coroutine_threadsafe(coro, worker.loop.asyncio_loop)


class Sender:
    """The sends of one gang: each started on its worker's event loop at once, all waited for by
    :meth:`finish`."""

    def __init__(self):
        self.worker = _worker()
        self.pending: list[tuple[str, str, Any]] = []

    def send(self, addr: str, name: str, values: tuple | None = None, error: dict | None = None) -> None:
        """Send channel ``name``'s ``values`` (NumPy arrays, not to be written to afterwards) or
        its writer's ``error`` (``exec.gang.failure_record``) to the worker at ``addr``."""
        from distributed.protocol.serialize import to_serialize

        msg: dict[str, Any] = {"name": name}
        if error is None:
            msg["values"] = to_serialize(list(values))
        else:
            msg["error"] = error
        rpc = self.worker.rpc(addr)

        async def go():
            try:
                reply = await getattr(rpc, HANDLER)(**msg)
            except Exception as e:
                _record(name, f"not delivered: {type(e).__name__}: {e}")
                raise
            _record(name, str(reply))  # (after the reader's worker filed it: a reader asking finds it there)
            return reply

        self.pending.append((addr, name, _submit(self.worker, go())))

    def finish(self, timeout: float) -> None:
        """Wait until every send is delivered; a ChannelWaitError naming the reader's worker for
        the first that was not (within ``timeout`` seconds in all)."""
        from tilegraph.exec.gang import ChannelWaitError

        end = time.monotonic() + timeout
        pending, self.pending = self.pending, []
        for addr, name, fut in pending:
            try:
                fut.result(timeout=max(0.0, end - time.monotonic()))
            except Exception as e:
                for _, _, other in pending:
                    other.cancel()
                what = (f"not delivered in {timeout:g} s (tilegraph.config.exchange_timeout_seconds)"
                        if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}")
                if isinstance(e, TimeoutError):
                    _record(name, f"not delivered: {what}")
                raise ChannelWaitError(f"tilegraph: gang step: sending channel {name} to worker {addr}: {what}") from e


def _record(name: str, how: str) -> None:
    with _cond:
        _sent[name] = how
        while len(_sent) > _CLOSED_MAX:
            _sent.popitem(last=False)


async def _writer_gone(worker, addr: str, name: str) -> str | None:
    """Why the values of channel ``name`` will never come from the worker at ``addr`` (None: they
    may still): the scheduler no longer counts that worker among its workers (it removes one
    whose process ended at once, one that stopped answering after its time-to-live), or that
    worker's send of them was answered (the answer comes after this worker filed them: they
    would be here), or its gang of the call ended without sending them."""
    if addr not in await worker.scheduler.ncores(workers=[addr]):
        return f"its writer, worker {addr}, is no longer one of the cluster's workers"
    try:
        state = await getattr(worker.rpc(addr), STATE_HANDLER)(call=_call_of(name), name=name)
    except Exception:  # (a worker without the handler, or not answering: the checks above and the time limit)
        return None
    sent = state.get("sent")
    if sent is None and not state.get("ended"):
        return None
    how = {None: "ended its part of this step without sending them",
           "OK": "sent them and this worker answered that it took them in, but they are not here (taken or "
                 "dropped already)",
           "closed": "sent them after this worker had ended its part of this step"}.get(sent, f"could not send them: "
                                                                                          f"{sent}")
    return f"its writer, worker {addr}, {how}"


def read(name: str, addr: str, timeout: float) -> tuple:
    """The values of channel ``name`` written by the worker at ``addr``: waits until they are in
    this process's mailbox and takes them out. Raises ChannelWaitError, naming the channel and the
    worker, when the scheduler no longer counts that worker among its workers, when that worker
    sent them (they were lost) or ended its gang without sending them, when Dask cancelled this task, or after ``timeout``
    seconds; PeerFailedError with the writer's error when its gang failed."""
    from tilegraph.exec.gang import check_wait, peer_failed

    t0 = time.monotonic()
    worker = None
    ping, pinged = None, t0
    with _cond:
        while name not in _box:
            _cond.wait(0.05)
            if name in _box:
                break
            now = time.monotonic()
            gone = None
            # (the lock is held from the look into the mailbox above to here: the writer's
            # answer came after whatever it delivered was filed)
            if ping is not None and ping.done():
                try:
                    gone = ping.result()
                except Exception:  # the scheduler did not answer: the client sees to that
                    pass
                ping, pinged = None, now
            elif ping is None and now - pinged > PING_SECONDS:
                worker = worker or _worker()
                ping = _submit(worker, _writer_gone(worker, addr, name))
            check_wait(name, now - t0, timeout, f"worker {addr}", gone)
        _, got = _box.pop(name)
    if isinstance(got, dict):
        raise peer_failed(name, f"worker {addr}", got)
    return got


def close(call: str, max_age: float) -> None:
    """The gang of ``call`` ended on this worker: drop what it left unread and whatever still
    arrives for it, and values older than ``max_age`` seconds (calls whose gang never ran here)."""
    prefix = f"{call}-"
    now = time.monotonic()
    with _cond:
        _closed[call] = None
        while len(_closed) > _CLOSED_MAX:
            _closed.popitem(last=False)
        for name in [n for n, (t, _) in _box.items() if n.startswith(prefix) or now - t > max_age]:
            del _box[name]
