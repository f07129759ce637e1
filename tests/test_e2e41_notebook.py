"""tilegraph's Trainer as a notebook user drives it (cells run again, a fit in a thread of its own
while the next cell runs, arguments typed from a config or computed with NumPy), and the
defects that turned up (session 41):

- a second ``fit`` of a Trainer while its first one still ran (``threading.Thread(target=
  trainer.fit, ...)`` and the next cell, or a hook calling ``fit``) ran beside it on the same
  step count: ``data(step)`` was asked for the same steps twice and ``history`` read steps
  1, 2, 3, 4, 6, 5, 7, 6, ...; ``load_checkpoint`` meanwhile moved the running fit's step;
- ``batch_size=True`` was taken (as 1 row); ``steps_per_graph``, ``step_timeout`` and
  ``restart_on_failure`` refused NumPy's integers (``np.int64(2)``: "must be 'auto' or an int
  >= 1"), which the other counts (``accum_steps``, ``eval_batches``) take;
- an empty ``log_dir``, ``checkpoint_dir``, ``tensorboard`` or ``performance_report`` was
  refused as "a path (a str or pathlib.Path, not empty)", naming no argument.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.trainer import lm_loss


def _data(step):
    """Token ids of gpt2-debug's vocabulary (96), a batch of 4 rows of 16 next-token pairs."""
    ids = np.random.default_rng(step).integers(0, 96, size=(4, 17))
    return ids[:, :-1], ids[:, 1:]


@pytest.fixture
def model_opt():
    model = models.build("gpt2-debug")
    return model, tg.optim.AdamW(model.parameters(), lr=1e-3)


def _trainer(model_opt, **kw):
    model, opt = model_opt
    return tg.Trainer(model, opt, _data, loss_fn=lm_loss, progress=False, **kw)


# -- one fit at a time -----------------------------------------------------------------------------
def test_a_fit_started_while_one_runs_in_a_thread_is_refused_naming_it(local_scheduler, model_opt):
    """The notebook pattern: ``threading.Thread(target=trainer.fit, args=(N,)).start()`` to keep
    the kernel free, then ``trainer.fit(2)`` (or ``load_checkpoint``) in the next cell. It ran a
    second loop on the same step count (history 1, 2, 3, 4, 6, 5, 7, 6, ...); it is refused, the
    running fit goes on undisturbed, and a fit after it works."""
    trainer = _trainer(model_opt, steps_per_graph=1, pipeline=False)
    in_step, tried = threading.Event(), threading.Event()

    def hold(tr, stats):  # the first step's hook keeps the fit running until the main thread tried
        if not in_step.is_set():
            in_step.set()
            assert tried.wait(60)

    trainer.on_step = [hold]
    out: dict = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", trainer.fit(3)))
    thread.start()
    try:
        assert in_step.wait(120)
        with pytest.raises(tg.TileError) as info:
            trainer.fit(2)
        with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.load_checkpoint\] no other fit of this Trainer "
                           r"running.*received: load_checkpoint\('nowhere'\) while fit\(3\) runs from step 1"):
            trainer.load_checkpoint("nowhere")
    finally:
        tried.set()
        thread.join(120)
    e = info.value
    assert e.where == "tilegraph.Trainer.fit"
    assert "no other fit of this Trainer running: its fit is still running (in another thread" in e.what
    assert e.received == "fit(2) while fit(3) runs from step 1 (now at step 1)"
    assert out["result"].steps == 3 and len(out["result"].losses) == 3
    assert [r["step"] for r in trainer.history] == [1, 2, 3]
    # the refused calls held nothing: the next fit goes on from step 4
    trainer.on_step = []
    assert trainer.fit(1).steps == 1 and [r["step"] for r in trainer.history] == [1, 2, 3, 4]


def test_a_hook_calling_fit_is_refused_and_the_fit_goes_on(local_scheduler, model_opt):
    """A hook that calls ``trainer.fit`` (or ``load_checkpoint``) ran a fit inside the fit, whose
    steps the outer loop then logged again."""
    caught: list = []

    def nested(tr, stats):
        for call in (lambda: tr.fit(1), lambda: tr.load_checkpoint("nowhere")):
            try:
                call()
            except tg.TileError as e:
                caught.append(e)

    trainer = _trainer(model_opt, steps_per_graph=1, on_step=[nested])
    assert trainer.fit(2).steps == 2
    assert [r["step"] for r in trainer.history] == [1, 2]
    assert [e.where for e in caught] == ["tilegraph.Trainer.fit", "tilegraph.Trainer.load_checkpoint"] * 2
    assert all("its fit is still running" in e.what for e in caught)


# -- arguments -------------------------------------------------------------------------------------
def test_batch_size_true_is_refused(model_opt):
    """``batch_size=True`` was taken, as a batch size of True (1 row)."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] batch_size must be an int >= 1 \(the rows of a "
                       r"step's batch\); received: batch_size=True"):
        _trainer(model_opt, batch_size=True)


@pytest.mark.parametrize("name, value, stored", [
    ("steps_per_graph", np.int64(2), 2),
    ("step_timeout", np.int64(5), 5.0),
    ("step_timeout", np.float32(2.5), 2.5),
])
def test_numpy_numbers_are_taken_as_the_other_counts_are(model_opt, name, value, stored):
    """``np.int64(2)`` was refused as not "an int >= 1" (steps_per_graph) or not "a finite number
    of seconds" (step_timeout), where accum_steps, eval_batches and checkpoint_every take it."""
    trainer = _trainer(model_opt, **{name: value})
    assert getattr(trainer, name) == stored and type(getattr(trainer, name)) is type(stored)


@pytest.mark.parametrize("value, restarts", [(np.int64(2), 2), (np.True_, 3), (0, 0)])
def test_restart_on_failure_takes_numpy_values(model_opt, tmp_path, value, restarts):
    trainer = _trainer(model_opt, restart_on_failure=value, checkpoint_dir=tmp_path / "ck")
    assert trainer.max_restarts == restarts


@pytest.mark.parametrize("name, value, what", [
    ("steps_per_graph", np.int64(0), r"steps_per_graph must be 'auto' or an int >= 1; received: np.int64\(0\)"),
    ("steps_per_graph", "Auto", r"steps_per_graph must be 'auto' or an int >= 1; received: 'Auto'"),
    ("step_timeout", np.bool_(True), r"step_timeout must be 'auto', None \(no limit\) or a finite number of "
                                     r"seconds > 0; received: np.True_"),
    ("restart_on_failure", np.int64(-1), r"restart_on_failure must be a bool or the number of restarts allowed "
                                         r"\(an int >= 0\); received: np.int64\(-1\)"),
    ("restart_on_failure", 1.5, r"restart_on_failure must be a bool or the number of restarts allowed "
                                r"\(an int >= 0\); received: 1.5"),
])
def test_wrong_numbers_are_still_refused_naming_the_argument(model_opt, tmp_path, name, value, what):
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] " + what):
        _trainer(model_opt, checkpoint_dir=tmp_path / "ck", **{name: value})


@pytest.mark.parametrize("name, what", [
    ("log_dir", "log_dir must be a folder"),
    ("checkpoint_dir", "checkpoint_dir must be a folder"),
    ("tensorboard", "tensorboard must be True, False or a folder"),
    ("performance_report", "performance_report must be a file path"),
])
def test_an_empty_path_is_refused_naming_the_argument(model_opt, name, what):
    """``log_dir=""`` (a config's empty value) said "a path (a str or pathlib.Path, not empty);
    received: ''", naming no argument."""
    with pytest.raises(tg.TileError) as info:
        _trainer(model_opt, **{name: ""})
    assert info.value.where == "tilegraph.Trainer"
    assert info.value.what.startswith(what) and "a non-empty str or os.PathLike" in info.value.what
    assert info.value.received.endswith("''")


# -- the progress display -------------------------------------------------------------------------
class _GoneStream:
    """stderr of a process whose descriptor 2 is closed (``2>&-``) or whose terminal hung up."""

    def isatty(self) -> bool:
        return False

    def write(self, text: str) -> int:
        raise OSError(9, "Bad file descriptor")

    def flush(self) -> None:
        raise OSError(9, "Bad file descriptor")


@pytest.mark.parametrize("stderr", [_GoneStream(), None])
def test_a_stderr_that_cannot_be_written_ends_the_progress_lines_not_the_fit(local_scheduler, model_opt, tmp_path,
                                                                           monkeypatch, stderr):
    """With stderr closed, the fit ran every step, then raised "OSError: [Errno 9] Bad file
    descriptor" from its last progress line, and its FitResult was lost; with no stderr at all
    (``sys.stderr`` None: pythonw, a service), it failed before the first step with
    "AttributeError: 'NoneType' object has no attribute 'isatty'"."""
    monkeypatch.setattr("tilegraph._progress.PROGRESS_LOG_SECONDS", 0.0)  # a line at every step
    monkeypatch.setattr("sys.stderr", stderr)
    model, opt = model_opt
    trainer = tg.Trainer(model, opt, _data, loss_fn=lm_loss, log_dir=tmp_path / "run", steps_per_graph=1)
    result = trainer.fit(3)
    assert result.steps == 3 and len(result.losses) == 3
    assert [r["step"] for r in tg.plotting.read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


# -- the plot --------------------------------------------------------------------------------------
def test_trainer_plot_shows_the_image_in_a_notebook_after_an_interrupted_fit(local_scheduler, model_opt, tmp_path):
    """A cell ending in ``trainer.plot()`` (a log_dir given) showed ``PosixPath('.../loss.png')``,
    not the curve: the path returned now displays as the PNG it names, and is still that Path.
    Drawn after a fit stopped by the stop button (a hook raising KeyboardInterrupt), it holds the
    steps logged before the stop."""
    formatters = pytest.importorskip("IPython.core.formatters")
    stop_at = {"calls": 0}

    def stop(tr, stats):
        stop_at["calls"] += 1
        if stop_at["calls"] == 2:
            raise KeyboardInterrupt

    trainer = _trainer(model_opt, steps_per_graph=1, log_dir=tmp_path / "run", on_step=[stop])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(6)
    logged = [r["step"] for r in trainer.history]
    assert logged and logged == list(range(1, len(logged) + 1)) and len(logged) < 6

    path = trainer.plot()
    assert path == tmp_path / "run" / "loss.png" and isinstance(path, type(tmp_path))
    assert repr(path) == f"{type(tmp_path).__name__}({str(path)!r})"  # no private class name shown
    shown, _ = formatters.DisplayFormatter().format(path)
    assert shown["image/png"] == path.read_bytes() and shown["image/png"].startswith(b"\x89PNG\r\n\x1a\n")
    # a path that is no PNG (another format asked for, a folder derived from it) shows as text
    pdf = trainer.plot(tmp_path / "loss.pdf")
    assert pdf.is_file() and "image/png" not in formatters.DisplayFormatter().format(pdf)[0]
    assert "image/png" not in formatters.DisplayFormatter().format(path.parent)[0]


def test_trainer_plot_to_an_empty_path_names_the_path_given(model_opt):
    """``trainer.plot("")`` said "path must name the PNG file to write, not a folder; received:
    path='.'", a path the user never gave."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.plotting.plot_training\] path must be a file name \(a "
                       r"non-empty str or os.PathLike\) or None; received: ''$"):
        _trainer(model_opt).plot("")


@pytest.mark.parametrize("path", [None, "", 3])
def test_save_checkpoint_refuses_what_is_no_path_as_the_trainers_call(model_opt, path):
    """``trainer.save_checkpoint(None)`` was refused by "[tilegraph.io.save_checkpoint] a path (a
    str or pathlib.Path, not empty)": another function's name, and no argument named."""
    with pytest.raises(tg.TileError) as info:
        _trainer(model_opt).save_checkpoint(path)
    e = info.value
    assert e.where == "tilegraph.Trainer.save_checkpoint" and e.received == f"path={path!r}"
    assert e.what == "a path (a non-empty str or os.PathLike) as path: the checkpoint folder to write"


def test_a_fit_results_repr_is_a_short_summary():
    """A notebook shows ``trainer.fit(n)`` at the end of a cell by its repr: the dataclass's printed
    every loss and every kernel time (2.7 kB on one line for a 3-step fit of gpt2-debug)."""
    from tilegraph._fit import FitResult

    assert repr(FitResult(3, [4.57, 4.52, 4.588], seconds=0.097, tokens_per_s=1978.1, kernel_seconds={"a": 1.0})) == \
        "FitResult(steps=3, losses=[4.57, 4.52, 4.588], seconds=0.097, tokens_per_s=1,978)"
    long = FitResult(1000, [float(i) for i in range(1000)], val_losses=[(s, 2.0) for s in range(100, 1001, 100)],
                     seconds=12.3, samples_per_s=56.0, checkpoints=["/a/step-1", "/a/step-2"], stopped=True)
    text = repr(long)
    assert len(text) < 250 and "998" in text and "... 7 earlier" in text and "'/a/step-2'" in text, text
