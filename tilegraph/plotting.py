"""Plots and logs of training runs: one function draws the training plot for
:meth:`tilegraph.Trainer.plot` (``loss.png``) and for notebooks; TensorBoard's writer, when installed.

>>> records = [{"run": "a", "step": s, "loss": 5.0 / s, "lr": 1e-3} for s in range(1, 41)]
>>> records.append({"run": "a", "step": 40, "val_loss": 0.2})
>>> fig = plot_training(records, vocab_size=257)
>>> [ax.get_ylabel() for ax in fig.axes]
['loss (nats)', 'learning rate']

It takes the records of ``Trainer.history`` or of a ``metrics.jsonl`` file (its path will do):
one record per step (``loss``, ``lr``) and one per evaluation (``val_loss``).
"""

from __future__ import annotations

import functools
import io
import json
import math
import os
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from tilegraph._config import is_int
from tilegraph._errors import TileError

__all__ = ["plot_training", "read_metrics", "smooth", "has_tensorboard", "summary_writer_class"]

#: what to install for TensorBoard logging (the writer of torch.utils.tensorboard needs both torch
#: and tensorboard; tensorboardX needs neither)
TENSORBOARD_INSTALL = "pip install tensorboardX (or, with torch, pip install tensorboard)"


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl`` file, in order (a line cut short by a kill, or one that
    is not a JSON object, is skipped)."""
    where = "tilegraph.plotting.read_metrics"
    if not isinstance(path, (str, os.PathLike)):
        raise TileError(where, "path must be a metrics.jsonl file (str or os.PathLike)", repr(path))
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:  # missing, a folder, unreadable: Python's error named neither the function nor the fix
        raise TileError(where, "path must be a readable metrics.jsonl file (Trainer(log_dir=...) writes one)",
                        f"{str(path)!r}: {e.strerror or e}") from None
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def smooth(values, window: int) -> np.ndarray:
    """Centered moving average of ``values`` over ``window`` points (an odd count: ``window`` or
    one more). Near the ends the window shrinks symmetrically, down to the end point alone, so a
    steep start is not pulled up the way a trailing average (an EMA) pulls it.

    >>> smooth([0.0, 1.0, 2.0, 3.0, 10.0], 3).tolist()
    [0.0, 1.0, 2.0, 5.0, 10.0]
    """
    x = np.asarray(values, dtype=np.float64)
    n = len(x)
    i = np.arange(n)
    half = np.minimum(np.minimum(i, n - 1 - i), max(0, int(window) // 2))  # points each side
    sums = np.concatenate([[0.0], np.cumsum(x)])
    return (sums[i + half + 1] - sums[i - half]) / (2 * half + 1)


def on_lineage(records: list[dict], lineage: list) -> list[dict]:
    """The records on ``lineage``, the path of run segments that led to a step: a list of
    ``[segment, last_step]`` (what a Trainer's checkpoints record, oldest first), each segment's
    records taken after the step its predecessor ended at, up to its own last step. A segment of
    None stands for the records that carry none (written before segments were recorded)."""
    kept, after = [], 0
    for segment, last in lineage:
        kept += [r for r in records if r.get("segment") == segment and isinstance(r.get("step"), int)
                 and after < r["step"] <= last]
        after = last
    return kept


def record_lineage(lineage) -> list | None:
    """``lineage`` as read from a checkpoint or a metrics record, checked: a list of
    ``[segment, step]`` pairs (None where it is not one: an older file, or a damaged one)."""
    if not isinstance(lineage, list) or not all(
            isinstance(p, list) and len(p) == 2 and (p[0] is None or isinstance(p[0], str))
            and isinstance(p[1], int) and not isinstance(p[1], bool) for p in lineage):
        return None
    return lineage


def _curves(records: list[dict], run: str | None) -> tuple[list, list, list]:
    """(step, loss), (step, val_loss) and (step, lr) of one run, sorted by step: the path that led
    to its last record. A resumed run's segment records the path it continues (its first record's
    ``lineage``), so a resume from an earlier checkpoint, or from a branch set aside, draws that
    branch and not the ones it left. In records without segments (older files), where the run
    went back to an earlier step, the records from that step on before it are dropped."""
    if run is None:  # a metrics.jsonl of several runs: the last one
        runs = [r["run"] for r in records if "run" in r]
        run = runs[-1] if runs else None
    if run is not None:
        records = [r for r in records if r.get("run") == run]
    segments = [r["segment"] for r in records if isinstance(r.get("segment"), str)]
    if segments:  # the path that led to the last segment's records, then those records
        final = segments[-1]
        lineage = next((record_lineage(r.get("lineage")) for r in records
                        if r.get("segment") == final and "lineage" in r), None) or []
        records = on_lineage(records, [*lineage, [final, math.inf]])
    kept: list[dict] = []
    last = 0  # the newest step with a training loss
    for r in (r for r in records if isinstance(r.get("step"), int)):
        if "loss" in r:
            if r["step"] <= last:  # a step logged again: the run went back to before it
                kept = [k for k in kept if k["step"] < r["step"]]
            last = r["step"]
        kept.append(r)

    def curve(key):
        by_step = {r["step"]: r[key] for r in kept if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])}
        return sorted(by_step.items())

    return curve("loss"), curve("val_loss"), curve("lr")


def plot_training(records: Iterable[dict] | str | os.PathLike, *, vocab_size: int | None = None,
                  path: str | os.PathLike | None = None, run: str | None = None, window: int | None = None,
                  title: str | None = None):
    """Draw a training run: the raw training loss (faint) under its centered moving average, the
    validation loss, the uniform-guess line ``ln(vocab_size)`` and, below, the learning rate.

    - ``records``: ``Trainer.history``, records read from ``metrics.jsonl``, or that file's path.
    - ``vocab_size``: draws the loss of a uniform guess over that many tokens (None: no line).
    - ``run``: the run id to draw (records carry it as ``"run"``); None: the last run in
      ``records``.
    - ``window``: points the centered moving average spans (None: a 25th of the steps, at most
      201; 1: none).
    - ``path``: also write a PNG there (written under a temporary name, then renamed, so a
      reader never sees half a file).

    Returns the :class:`matplotlib.figure.Figure`: a notebook shows it inline (as the cell's
    value, or with ``display(fig)``), with or without ``%matplotlib inline``. It is drawn without
    pyplot, so it needs no display and leaves pyplot's current figure and backend alone.
    """
    from matplotlib.figure import Figure

    where = "tilegraph.plotting.plot_training"
    if isinstance(records, (str, os.PathLike)):
        records = read_metrics(records)
    records = _records(records, where)
    if vocab_size is not None and not is_int(vocab_size, 1):
        raise TileError(where, "vocab_size must be a positive int or None", repr(vocab_size))
    if window is not None and not is_int(window, 1):  # 0, -3 or 2.5 were taken silently for "no smoothing"
        raise TileError(where, "window must be an int >= 1 (1: no smoothing) or None (a 25th of the steps)",
                        repr(window))
    train, val, lr = _curves(records, run)

    fig = Figure(figsize=(7, 5), dpi=100, layout="constrained")
    fig._repr_png_ = functools.partial(_png, fig)  # shown inline in any notebook
    # the loss on top; the learning rate in a short panel under it, on the same steps
    if lr:
        ax, ax_lr = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    else:
        ax, ax_lr = fig.subplots(), None
    if train:
        steps, losses = map(np.asarray, zip(*train))
        w = int(window) if window is not None else min(201, max(1, len(steps) // 25))
        if w > 1:
            ax.plot(steps, losses, color="C0", lw=0.8, alpha=0.25, label="train")
            span = 2 * (w // 2) + 1  # smooth() averages w // 2 points each side
            ax.plot(steps, smooth(losses, w), color="C0", lw=1.6, label=f"train (centered mean of {span} steps)")
        else:
            ax.plot(steps, losses, color="C0", lw=1.2, label="train")
    if val:
        ax.plot(*zip(*val), "o-", color="C1", ms=4, label="validation")
    if vocab_size is not None:
        guess = math.log(vocab_size)
        if ax.has_data():  # axhline does not widen the autoscaled limits: keep the line in view
            lo, hi = ax.get_ylim()
            ax.set_ylim(min(lo, guess - 0.05 * (hi - lo)), max(hi, guess + 0.05 * (hi - lo)))
        ax.axhline(guess, color="gray", ls="--", lw=1, label=f"uniform guess (ln {vocab_size} = {guess:.2f})")
    ax.set_ylabel("loss (nats)")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize="small")
    if title:
        ax.set_title(title)
    if ax_lr is not None:
        ax_lr.plot(*zip(*lr), color="C2", lw=1.2)
        ax_lr.set_ylabel("learning rate")
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax_lr.grid(alpha=0.3)
    (ax_lr or ax).set_xlabel("step")

    if path is not None:
        path = _png_path(path)
        # the format is the path's (a PNG without a suffix): the temporary name keeps the suffix,
        # where its ".png" had made "loss.pdf" a PNG file under a .pdf name
        fmt = path.suffix[1:].lower() or "png"
        formats = fig.canvas.get_supported_filetypes()
        if fmt not in formats:
            raise TileError(where, f"path's suffix must name an image format: {', '.join(sorted(formats))} "
                            "(none: PNG)", f"path={str(path)!r}")
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
        try:
            fig.savefig(tmp, format=fmt)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return fig


def _png(fig) -> bytes:
    """``fig`` as PNG bytes: the ``_repr_png_`` that :func:`plot_training` gives its figure. A
    Figure made without pyplot had an image in a notebook only once ``%matplotlib inline`` (or a
    pyplot import) registered matplotlib's formatter; before, a fresh kernel showed the text
    "<Figure size 700x500 with 2 Axes>". Where that formatter is registered, it goes first."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _records(records, where: str) -> list[dict]:
    """``plot_training``'s records as a list of dicts (None, a dict, or a list of numbers failed
    inside with Python's TypeError or AttributeError)."""
    if isinstance(records, Mapping) or not isinstance(records, Iterable):
        raise TileError(where, "records must be a list of metrics records (Trainer.history, read_metrics(...)) "
                        "or a metrics.jsonl path", type(records).__name__)
    records = list(records)
    bad = next(((i, r) for i, r in enumerate(records) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise TileError(where, "each record must be a dict (such as {'step': 1, 'loss': 2.3})",
                        f"records[{bad[0]}] = {repr(bad[1])[:80]}")
    return records


def _png_path(path) -> Path:
    """``plot_training``'s ``path``: a file in an existing folder (a folder given for it would
    fail only at the rename, with the temporary file's name in Python's error)."""
    where = "tilegraph.plotting.plot_training"
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, str) and not path:
        # ("" was Path("."): "not a folder ... received: path='.'", naming a path not given)
        raise TileError(where, "path must be a file name (a non-empty str or os.PathLike) or None", repr(path))
    path = Path(path)
    if path.is_dir():
        raise TileError(where, "path must name the PNG file to write, not a folder (e.g. FOLDER/loss.png)",
                        f"path={str(path)!r}: a folder")
    if not path.parent.is_dir():
        raise TileError(where, "path's folder must exist", f"path={str(path)!r}: no folder {str(path.parent)!r}")
    return path


# ----------------------------------------------------------------------------- TensorBoard ----
def has_tensorboard() -> bool:
    """Whether :func:`summary_writer_class` will find a writer (without importing torch)."""
    from importlib.util import find_spec

    return find_spec("tensorboardX") is not None or (find_spec("torch") is not None
                                                      and find_spec("tensorboard") is not None)


def summary_writer_class(where: str = "tilegraph.plotting.summary_writer_class"):
    """TensorBoard's ``SummaryWriter``: tensorboardX's (light, no torch) or else torch's. Raises a
    :class:`~tilegraph.TileError` naming what to install when neither imports."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # no torch, or torch without the tensorboard package
            raise TileError(where, f"TensorBoard logging needs a SummaryWriter: {TENSORBOARD_INSTALL}",
                            f"neither tensorboardX nor torch.utils.tensorboard imports ({e})") from None
    return SummaryWriter
