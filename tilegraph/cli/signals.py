"""A clean stop on Ctrl-C or SIGTERM for the commands that run on the embedded cluster without
checkpoints to write (``tilegraph eval``, ``generate``): the work under way is abandoned, the
cluster closed (its worker processes and their semaphores), and the exit status is a shell's
128 + the signal (130, 143), as ``tilegraph train``'s."""

from __future__ import annotations

import signal
import threading
from typing import Callable

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
    the way out) and returns 128 + the signal; a second one while it closes stops at once (the
    default action). Outside the main thread (no handlers there), ``fn()`` alone."""
    if threading.current_thread() is not threading.main_thread():
        return fn()

    def stop(signum, frame):
        signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
        say_now(f"{where}: {signal.Signals(signum).name}: stopping, closing the cluster (again to stop at once)\n")
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return fn()
    except Stopped as e:
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
