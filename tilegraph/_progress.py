"""What a fit shows and writes beside its steps: the progress display (a tqdm bar on a terminal
and in Jupyter, plain lines into a file or a pipe), TensorBoard scalars, and the helpers that keep
drawing ``loss.png`` off the steps' path (matplotlib imported in a thread aside, the drawing run
in one). Moved out of :mod:`tilegraph.trainer`, which uses them."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from tilegraph._errors import TileError

#: with stderr a file or a pipe, a progress line at most this often (seconds)
PROGRESS_LOG_SECONDS = 10.0


class _Aside:
    """``fn()`` run in a thread of its own; :meth:`result` waits for it and returns its value, or
    raises its error."""

    def __init__(self, fn: Callable):
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name="tilegraph-aside")
        self._thread.start()

    def _run(self, fn: Callable) -> None:
        try:
            self._out.append((True, fn()))
        except BaseException as e:
            self._out.append((False, e))

    def result(self):
        self._thread.join()
        ok, value = self._out[0]
        if not ok:
            raise value
        return value


#: the thread importing matplotlib aside (:func:`_import_matplotlib_aside`), once started
_MATPLOTLIB_IMPORT: list[threading.Thread] = []


def _import_matplotlib_aside() -> None:
    """Import what drawing ``loss.png`` takes (~0.7 s) in a thread of its own: the fit's first
    drawing then only draws (:func:`_matplotlib_imported` waits for it first)."""
    def load():
        try:
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401
        except Exception:  # (the drawing says what is wrong)
            pass

    if "matplotlib.backends.backend_agg" not in sys.modules and not _MATPLOTLIB_IMPORT:
        _MATPLOTLIB_IMPORT.append(threading.Thread(target=load, name="tilegraph-import-matplotlib"))
        _MATPLOTLIB_IMPORT[0].start()


def _matplotlib_imported() -> None:
    """Wait for the import of :func:`_import_matplotlib_aside`, if one runs: one package imported
    by two threads at once can fail in one of them (KeyError from importlib)."""
    if _MATPLOTLIB_IMPORT:
        _MATPLOTLIB_IMPORT[0].join()


def _in_jupyter() -> bool:
    """Whether this runs in a Jupyter kernel (ipykernel merely imported, by a test or a library,
    is not one)."""
    ipython = sys.modules.get("IPython")
    try:
        shell = ipython.get_ipython() if ipython is not None else None
    except Exception:
        return False
    # by the class's ancestry: Google Colab's shell is a subclass of it (named "Shell"), where
    # the exact name had sent the bar to plain lines on stderr every 10 s
    return shell is not None and any(c.__name__ == "ZMQInteractiveShell" for c in type(shell).__mro__)


def _progress(total: int, enabled: bool):
    """The progress display of a fit: a tqdm bar on a terminal and in Jupyter, plain lines when
    stderr is a file or a pipe. (A bar redrawn seldom into a file showed, at each later write such
    as an evaluation's line or the end, the rate of its last redraw up to 10 s before.)"""
    if enabled and not _on_a_terminal(sys.stderr) and not _in_jupyter():
        return _ProgressLines(total)
    import warnings

    from tqdm import TqdmWarning

    with warnings.catch_warnings():  # Jupyter without ipywidgets: tqdm.auto's text bar, without its warning
        warnings.simplefilter("ignore", TqdmWarning)
        from tqdm.auto import tqdm
    return tqdm(total=total, desc="train", unit="step", disable=not enabled, dynamic_ncols=True)


def _on_a_terminal(stream) -> bool:
    """Whether ``stream`` is a terminal: not None (pythonw, a service), not closed, and a TTY."""
    try:
        return stream is not None and stream.isatty()
    except (OSError, ValueError):  # (a closed file: "I/O operation on closed file")
        return False


class _ProgressLines:
    """What fit() uses of a tqdm bar (``update``, ``set_postfix``, ``write``, ``n``, ``refresh``,
    ``close``) as plain lines on stderr: one every ``every`` seconds, with the rate of the steps
    since the line before, and one at the end with the fit's mean rate::

        train: step 120/300, 5.1 s, 23.7 steps/s, ETA 7.6 s, loss=2.5876, tok_s=12,410
    """

    def __init__(self, total: int, desc: str = "train", every: float | None = None, file=None):
        # (every: PROGRESS_LOG_SECONDS as it is when the fit starts)
        self.total, self.desc, self.file = total, desc, file
        self.every = PROGRESS_LOG_SECONDS if every is None else every
        self.n = 0
        self._postfix = ""
        self._t0 = self._since_t = time.perf_counter()
        self._since_n = 0
        self._closed = False
        self._gone = False  # a stream that cannot be written (see _print)

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self._postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.perf_counter() - self._since_t >= self.every:
            self._line(final=False)

    def refresh(self) -> None:
        """After ``n`` was set back (a restart): the next rate counts from here."""
        self._since_t, self._since_n = time.perf_counter(), self.n

    def write(self, text: str) -> None:
        self._print(text, None)  # as tqdm.write: to stdout

    def _print(self, text: str, file) -> None:
        """``text`` as a line of ``file`` (None: stdout). A stream that cannot be written (stderr
        closed, ``2>&-``; the terminal of a run left behind by a logout) ends the lines, not the
        fit: the last line, at the end, raised "OSError: [Errno 9] Bad file descriptor" after
        every step had run, and the fit's result was lost (its records are in metrics.jsonl)."""
        if self._gone:
            return
        try:
            print(text, file=file, flush=True)
        except (OSError, ValueError):  # (ValueError: "I/O operation on closed file")
            self._gone = True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._line(final=True)

    def _line(self, final: bool) -> None:
        now = time.perf_counter()
        elapsed = now - self._t0
        if final:
            rate, what = (self.n / elapsed if elapsed > 0 else 0.0), " on average"
        else:
            dt = now - self._since_t
            rate, what = ((self.n - self._since_n) / dt if dt > 0 else 0.0), ""
        parts = [f"{self.desc}: step {self.n}/{self.total}", f"{elapsed:.1f} s", f"{rate:.3g} steps/s{what}"]
        if not final and rate > 0 and self.n < self.total:
            parts.append(f"ETA {(self.total - self.n) / rate:.1f} s")
        if self._postfix:
            parts.append(self._postfix)
        self._print(", ".join(parts), self.file or sys.stderr)
        self._since_t, self._since_n = now, self.n


def _tensorboard(setting, log_dir: Path | None) -> tuple[Path | None, type | None]:
    """``Trainer(tensorboard=...)``: the folder to write and the SummaryWriter class (both None when
    off). The class is imported here, so a missing package stops the Trainer before any step."""
    where = "tilegraph.Trainer"
    if setting is False or setting is None:
        return None, None
    if setting is True:
        if log_dir is None:
            raise TileError(where, "tensorboard=True writes under log_dir: give a log_dir, or a folder as tensorboard=",
                            "tensorboard=True, log_dir=None")
        folder = log_dir / "tensorboard"
    elif isinstance(setting, (str, os.PathLike)):
        if isinstance(setting, str) and not setting:  # (refused by user_path without the argument's name)
            raise TileError(where, "tensorboard must be True, False or a folder (a non-empty str or os.PathLike)",
                            repr(setting))
        from tilegraph.io._store import user_path

        folder = user_path(setting, where)
    else:
        raise TileError(where, "tensorboard must be True, False or a folder", repr(setting))
    from tilegraph.plotting import summary_writer_class

    return folder, summary_writer_class(where)


def _tensorboard_write(writer, record: dict) -> None:
    """A metrics record's numbers as TensorBoard scalars at its step: ``val_*`` keys under
    ``val/``, the others under ``train/`` (``val_loss`` -> ``val/loss``, ``lr`` -> ``train/lr``)."""
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return
    for key, value in record.items():
        if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        tag = f"val/{key[len('val_'):]}" if key.startswith("val_") else f"train/{key}"
        writer.add_scalar(tag, value, step, walltime=record.get("time"))
