"""A clean stop on Ctrl-C or SIGTERM for the commands that run on the embedded cluster without
checkpoints to write (``tilegraph eval``, ``generate``): the work under way is abandoned, the
cluster closed (its worker processes and their semaphores), and the exit status is a shell's
128 + the signal (130, 143), as ``tilegraph train``'s. A second signal while it closes ends the
process at once (its worker processes killed), with the same status.

``tilegraph train``'s second Ctrl-C (:class:`InterruptAgain`) is kept from the same loss: one
that lands inside a finalizer is raised again once the finalizer returns."""

from __future__ import annotations

import os
import _thread
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from tilegraph.cli.train import say_now


class Stopped(BaseException):
    """Raised in the main thread by :func:`run_stoppable`'s handler (not an ``Exception``: no
    ``except Exception`` on the way out swallows it, and every ``with`` block closes)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_stoppable(where: str, fn: Callable[[], int]) -> int:
    """``fn()`` with SIGINT and SIGTERM stopping it: the first says so in one line, raises
    :class:`Stopped` where the main thread is (the runtime's ``with`` block closes the cluster on
    the way out) and returns 128 + the signal; a second one while it closes ends the process at
    once (:func:`_end_now`). Outside the main thread (no handlers there), ``fn()`` alone.

    A signal that lands while the main thread runs a finalizer (a ``__del__``, a
    ``weakref.finalize`` callback: Dask's futures have them) raises :class:`Stopped` where Python
    only prints it ("Exception ignored in ...") and goes on: the command then ran to its end and
    exited 0, though it had said it was stopping. Such a swallowed stop is raised again as soon as
    the finalizer returns, and a ``fn()`` that returns after a stop was asked still exits with
    128 + the signal."""
    if threading.current_thread() is not threading.main_thread():
        return fn()
    asked: list[int] = []  # the signal of the stop, once asked
    swallowed: list[int] = []  # the signal of a stop a finalizer swallowed, to be raised again
    done: list[bool] = []  # once fn() has ended
    sending = threading.Lock()  # held while the stop is sent again

    def stop(signum, frame):
        for sig in previous:  # the next one, of either kind, while the cluster closes
            signal.signal(sig, again)
        asked.append(signum)
        say_now(f"{where}: {signal.Signals(signum).name}: stopping, closing the cluster (again to stop at once)\n")
        raise Stopped(signum)

    def again(signum, frame):
        if swallowed:  # (not a second signal: the first one's stop, raised again out of the finalizer)
            if _running(frame, unraisable.__code__):  # (it landed in the hook itself: sent again shortly)
                return
            signum = swallowed.pop()
            if done:  # (fn() ended first: its status is already 128 + the signal)
                return
            raise Stopped(signum)
        from tilegraph._progress import _in_jupyter

        if _in_jupyter():  # (a command run inside a notebook's kernel: the kernel stays)
            raise KeyboardInterrupt
        _end_now(where, signum)

    def unraisable(info):
        if not isinstance(info.exc_value, Stopped):
            hook(info)
        elif not swallowed:  # the signal again, from another thread: `again` raises the stop where it lands
            swallowed.append(info.exc_value.signum)
            _resend(info.exc_value.signum, lambda: bool(swallowed) and not done, sending)

    clusters = _clusters()
    hook = sys.unraisablehook
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    sys.unraisablehook = unraisable
    try:
        code = fn()
        if asked:  # (its stop swallowed where no finalizer reports it: the command is still stopped)
            _close_left_clusters(clusters)
            return 128 + asked[0]
        return code
    except Stopped as e:
        _close_left_clusters(clusters)
        return 128 + e.signum
    finally:
        done.append(True)  # (a stop raised again after this would escape the command)
        with sending:  # (one sent as fn() ended is pending here, handled first by `again` below)
            pass
        for sig, handler in previous.items():  # (a pending signal is handled first, by `again`)
            signal.signal(sig, handler)
        sys.unraisablehook = hook


class InterruptAgain:
    """SIGINT's handler once a first stop has asked ``tilegraph train`` to finish the steps under
    way: the second Ctrl-C raises KeyboardInterrupt there and then ("again to stop at once").

    Raised while the main thread runs a finalizer (a ``__del__``, a ``weakref.finalize``
    callback: Dask's futures have them), Python only prints that KeyboardInterrupt ("Exception
    ignored in ...") and goes on: the run went on to its graceful stop, ignoring the second
    Ctrl-C. Within :meth:`catching`, such a swallowed interrupt is taken by the unraisable hook
    (nothing printed) and SIGINT sent again from a thread every 50 ms until it lands outside a
    finalizer, as :func:`run_stoppable` does for its stop."""

    def __init__(self):
        self._pending: list[bool] = []  # a swallowed interrupt, to be raised again
        self._ended: list[bool] = []  # once the block of catching() has ended
        self._sending = threading.Lock()  # held while SIGINT is sent again
        self._hook = sys.unraisablehook

    def __call__(self, signum, frame) -> None:
        if _running(frame, InterruptAgain._unraisable.__code__):  # (a resend inside the hook: sent again shortly)
            return
        self._pending.clear()
        raise KeyboardInterrupt

    def _unraisable(self, info) -> None:
        if not isinstance(info.exc_value, KeyboardInterrupt) or signal.getsignal(signal.SIGINT) is not self:
            self._hook(info)
        elif not self._pending:
            self._pending.append(True)
            _resend(signal.SIGINT, lambda: bool(self._pending) and not self._ended, self._sending)

    @contextmanager
    def catching(self) -> Iterator[None]:
        """The block during which a second Ctrl-C swallowed by a finalizer is raised again (only
        in the main thread, where signal handlers run)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        try:
            yield
        finally:
            self._ended.append(True)
            with self._sending:  # (a resend under way lands first; none follows)
                pass
            sys.unraisablehook = self._hook


def _resend(signum: int, pending: Callable[[], bool], lock: threading.Lock) -> None:
    """``signum`` to the main thread again, every 50 ms while ``pending()``, sent from another
    thread (sent from the main thread, its handler would run at once, inside the unraisable hook)
    holding ``lock``. A signal, not ``_thread.interrupt_main``: it also cuts short a wait of the
    main thread's."""
    main = threading.main_thread().ident

    def send():
        while True:
            time.sleep(0.05)
            with lock:
                if not pending():
                    return
                if hasattr(signal, "pthread_kill"):
                    signal.pthread_kill(main, signum)
                else:
                    _thread.interrupt_main(signum)

    threading.Thread(target=send, name="tilegraph-stop-again", daemon=True).start()


def _running(frame, code) -> bool:
    """Whether ``code`` runs in ``frame`` or a frame that called it."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _clusters() -> set:
    """The Dask clusters (``SpecCluster``: the embedded one) of this process, by id."""
    spec = sys.modules.get("distributed.deploy.spec")
    return set() if spec is None else {id(c) for c in list(spec.SpecCluster._instances)}


def _close_left_clusters(before: set) -> None:
    """Close the clusters made since ``before`` (:func:`_clusters`) that a stop left open: one
    whose start it cut short, which nothing of tilegraph holds yet, was closed by Dask's exit
    hook after the command returned, where a second Ctrl-C printed tracebacks ("Exception
    ignored in atexit callback") instead of stopping at once. Here a second signal still does."""
    spec = sys.modules.get("distributed.deploy.spec")
    if spec is None:
        return
    for cluster in list(spec.SpecCluster._instances):
        if id(cluster) in before or getattr(cluster, "status", spec.Status.closed) == spec.Status.closed:
            continue
        try:
            cluster.close(timeout=10)  # (as the exit hook would)
        except Exception:  # (what a half-started cluster fails to close: the exit hook tries again)
            pass


def _end_now(where: str, signum: int) -> None:
    """End this process now, with a shell's 128 + ``signum``: its worker processes (the embedded
    cluster's) killed first, its output flushed, one line said. Before, a second Ctrl-C raised
    KeyboardInterrupt inside the cluster's close, which it cut short: Dask's exit hook then
    closed the cluster again, waiting ~10 s for workers already told to stop (the "stop at
    once" took longer than the first stop's close), sometimes printing tracebacks. Nothing of
    these commands is left to write (no checkpoint, no lock)."""
    import multiprocessing

    say_now(f"{where}: {signal.Signals(signum).name} again: stopped at once\n")
    for child in multiprocessing.active_children():  # (the nannies' worker processes)
        try:
            child.kill()
        except Exception:  # (already gone)
            pass
    try:  # their semaphores unlinked, as an exit would (else the resource tracker warns of them as leaked)
        from multiprocessing.util import _run_finalizers

        _run_finalizers(0)
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(128 + signum)
