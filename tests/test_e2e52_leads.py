"""Leads of earlier sessions, closed: ``tilegraph train``'s second Ctrl-C ("again to stop at
once") is not lost when it lands inside a finalizer."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest


def _wait(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


class _Finalized:
    """An object whose finalizer receives a SIGINT (the handler runs inside ``__del__``)."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def sigint_restored():
    before, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    yield
    signal.signal(signal.SIGINT, before)
    sys.unraisablehook = hook


def test_a_second_ctrl_c_in_a_finalizer_still_stops_train_at_once(sigint_restored, capfd):
    # Before: train's second Ctrl-C went to Python's default handler, whose KeyboardInterrupt,
    # raised inside a finalizer (Dask's futures have them), Python printed as "Exception ignored
    # in ..." and dropped; the run went on to its graceful stop as if there had been no second one
    from tilegraph.cli.signals import InterruptAgain

    again = InterruptAgain()
    signal.signal(signal.SIGINT, again)  # as train's first stop leaves it
    hook = sys.unraisablehook
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with again.catching():
            _Finalized()  # dropped at once: its __del__ runs, the interrupt is raised in it
            _wait(5)
    assert time.monotonic() - start < 4
    assert sys.unraisablehook is hook
    assert "Exception ignored" not in capfd.readouterr().err


def test_a_second_ctrl_c_outside_finalizers_raises_at_once(sigint_restored, capfd):
    from tilegraph.cli.signals import InterruptAgain

    again = InterruptAgain()
    signal.signal(signal.SIGINT, again)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with again.catching():
            os.kill(os.getpid(), signal.SIGINT)
            _wait(5)
    assert time.monotonic() - start < 1
    assert capfd.readouterr().err == ""


def test_other_unraisable_errors_still_reach_the_previous_hook(sigint_restored):
    from tilegraph.cli.signals import InterruptAgain

    seen = []
    sys.unraisablehook = lambda info: seen.append(type(info.exc_value).__name__)

    class Failing:
        def __del__(self):
            raise ValueError("in a finalizer")

    again = InterruptAgain()
    with again.catching():
        Failing()
    # (a KeyboardInterrupt raised by something else than the second Ctrl-C's handler too)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with again.catching():
        _Finalized()
        _wait(0.3)
    assert seen == ["ValueError", "KeyboardInterrupt"]


def test_no_resend_outlives_the_block(sigint_restored):
    """A swallowed interrupt whose resends are still pending when the block ends (the fit ended
    first) sends nothing afterwards: no KeyboardInterrupt lands after train restored its
    handlers."""
    from tilegraph.cli.signals import InterruptAgain

    again = InterruptAgain()
    signal.signal(signal.SIGINT, again)
    got = []
    with again.catching():
        sys.unraisablehook(type("Info", (), {"exc_value": KeyboardInterrupt(), "exc_type": KeyboardInterrupt,
                                            "exc_traceback": None, "err_msg": None, "object": None})())
    signal.signal(signal.SIGINT, lambda *a: got.append(1))
    _wait(0.3)
    assert got == [] and not any(t.name == "tilegraph-stop-again" and t.is_alive() for t in threading.enumerate())
