"""Dask's worker profiler, switched on for a while: the window of a performance report.

The clusters tilegraph starts run with the worker profiler off (``CLUSTER_DASK_CONFIG``: it
samples every task thread every 10 ms, and with Dask's other periodic callbacks an idle cluster
burnt ~20% of a core). A worker reads ``distributed.worker.profile.enabled`` once, as it starts
(``Worker.__init__`` adds its ``profile`` and ``profile-cycle`` periodic callbacks only then), so
setting the config later changes nothing: :func:`worker_profiler` starts a sampling callback of
its own on each worker whose profiler is off (``Worker.trigger_profile`` every
``distributed.worker.profile.interval``, as Dask's does) and stops it, and only it, afterwards.
A worker whose own profiler runs (a cluster started with it on: Dask's default, so most external
clusters) is left as it is. The samples of the window go into the worker's profile history (one
entry as the window starts, one as it ends, not one per ``cycle``: a window longer than the
history's ``low-level-log-length`` cycles kept all of it), where ``Client.profile``, the
dashboard's ``/profile`` and the performance report read them.

The administrative (event loop) and scheduler profiles are others: Dask starts their sampling
threads as a server starts, and never on Python 3.11; they stay as they are.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Iterator

logger = logging.getLogger("tilegraph")

#: the name of the sampling callback in a worker's ``periodic_callbacks`` (not Dask's
#: ``profile``: Dask's own, where it runs, is never touched)
CALLBACK = "tilegraph-profile"

#: the attribute of a worker holding the windows open on it (the callback stops with the last)
_HOLDERS = "_tilegraph_profile_windows"

#: how long switching the profiler on or off waits for the workers to answer
SWITCH_TIMEOUT_SECONDS = 10.0


def profiler_state(dask_worker=None) -> str:
    """What samples this worker's tasks now (run on a worker by ``client.run``): ``"dask"``
    (its own profiler, on since it started), ``"tilegraph"`` (a report window's), ``"off"``."""
    callbacks = getattr(dask_worker, "periodic_callbacks", {})
    own = callbacks.get("profile")
    if own is not None and own.is_running():
        return "dask"
    ours = callbacks.get(CALLBACK)
    if ours is not None and ours.is_running():
        return "tilegraph"
    return "off"


def _profiler_on(token: str, dask_worker=None) -> str:
    """Start sampling this worker's task threads for the window ``token`` (run on the worker, in
    its event loop, by ``client.run``). Returns what it did: ``"started"``, ``"joined"`` (another
    window's callback runs), ``"own"`` (Dask's profiler runs: nothing to do) or
    ``"unsupported"`` (a worker without Dask's profiling methods)."""
    import dask
    from dask.utils import parse_timedelta
    from tornado.ioloop import PeriodicCallback

    callbacks = getattr(dask_worker, "periodic_callbacks", None)
    if (not isinstance(callbacks, dict) or not callable(getattr(dask_worker, "trigger_profile", None))
            or not callable(getattr(dask_worker, "cycle_profile", None))):
        return "unsupported"
    own = callbacks.get("profile")
    if own is not None and own.is_running():
        return "own"
    holders = getattr(dask_worker, _HOLDERS, None)
    if holders is None:
        holders = set()
        setattr(dask_worker, _HOLDERS, holders)
    holders.add(token)
    pc = callbacks.get(CALLBACK)
    if pc is not None and pc.is_running():
        return "joined"
    interval = parse_timedelta(dask.config.get("distributed.worker.profile.interval"), default="ms")
    # the samples before the window (none: the profiler was off) are not of it, and the window's
    # gather in the recent profile from here: a profile asked for since the window started (the
    # report's) finds this entry, and with it the recent samples, until the window's end files them
    dask_worker.cycle_profile()
    pc = PeriodicCallback(dask_worker.trigger_profile, interval * 1000)
    callbacks[CALLBACK] = pc  # (in the worker's callbacks: stopped with the others if it closes)
    pc.start()
    return "started"


def _profiler_off(token: str, dask_worker=None) -> str:
    """End the window ``token`` on this worker (run by ``client.run``): the last window open
    stops the sampling callback and files the samples gathered in the worker's profile history.
    Returns ``"stopped"``, ``"held"`` (another window is still open) or ``"none"`` (no window
    of this token: Dask's own profiler, a worker that joined meanwhile)."""
    holders = getattr(dask_worker, _HOLDERS, None)
    if not holders or token not in holders:
        return "none"
    holders.discard(token)
    if holders:
        return "held"
    pc = dask_worker.periodic_callbacks.pop(CALLBACK, None)
    if pc is not None:
        pc.stop()
    dask_worker.cycle_profile()  # the window's samples, in one entry stamped now (after it started)
    return "stopped"


def _switch(client, function, token: str, workers: list[str] | None = None) -> dict:
    """``client.run(function, token)`` on ``workers`` (None: all), each worker's error returned,
    waiting at most ``SWITCH_TIMEOUT_SECONDS``; a client that lost its scheduler asks nothing
    (it would wait out the time-out for an answer that cannot come)."""
    status = getattr(client, "status", "running")
    if status != "running":
        raise RuntimeError(f"the client is {status}")
    return client.sync(client._run, function, token, workers=workers, on_error="return",
                       callback_timeout=SWITCH_TIMEOUT_SECONDS)


@contextlib.contextmanager
def worker_profiler(client) -> Iterator[dict]:
    """Sample the task threads of every worker of ``client``'s cluster while the block runs
    (what Dask's worker profiler does, where it is off), and put every worker back as it was
    after it, also when the block ends by an error or an interrupt. Yields what each worker did
    (``_profiler_on``'s words, or the error it raised). A worker that could not be switched
    (one that did not answer, say) is a warning in the log, never an error: the block runs as
    it would have, with fewer samples. Workers that join during the block are not sampled."""
    token = uuid.uuid4().hex
    done: dict | None = None  # None: not known which workers started (ended off on every one)
    try:
        try:
            done = _switch(client, _profiler_on, token)
        except Exception as e:  # (the scheduler gone, say: the block's own work says so; or a
            # time-out, after which a worker may still start: ``done`` stays None)
            logger.warning("tilegraph: could not turn the worker profiler on for the performance report: %s: %s",
                           type(e).__name__, e)
        else:
            failed = {addr: r for addr, r in done.items() if isinstance(r, BaseException)}
            if failed:
                logger.warning("tilegraph: could not turn the worker profiler on for the performance report on %s",
                               ", ".join(f"{a} ({type(r).__name__}: {r})" for a, r in sorted(failed.items())))
        # (outside the handler: an error of the block is not chained to the switch's)
        yield {} if done is None else done
    finally:
        # (an interrupt while the workers were being switched on: any of them may have started)
        touched = None if done is None else [addr for addr, r in done.items() if r in ("started", "joined")]
        if touched is None or touched:
            try:
                off = _switch(client, _profiler_off, token, touched)
            except Exception as e:
                off = {"the workers": e}
            # a worker gone meanwhile took its callback with it; one still there keeps sampling
            failed = {a: r for a, r in off.items() if isinstance(r, BaseException)}
            if failed:
                logger.warning("tilegraph: could not turn the worker profiler off again after the performance "
                               "report on %s", ", ".join(f"{a} ({type(r).__name__}: {r})"
                                                         for a, r in sorted(failed.items())))
