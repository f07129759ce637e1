"""tilegraph.plotting: the training plot (curves, smoothing, uniform guess, learning rate, runs) and
the TensorBoard writer lookup."""

import json
import math
import sys

import numpy as np
import pytest

from tilegraph import TileError
from tilegraph.plotting import has_tensorboard, plot_training, read_metrics, smooth, summary_writer_class


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33])
@pytest.mark.parametrize("window", [1, 2, 5, 12, 100])
def test_smooth_is_a_centered_mean_that_shrinks_at_the_ends(n, window):
    x = np.random.default_rng(n).standard_normal(n)
    want = []
    for i in range(n):
        h = min(i, n - 1 - i, window // 2)
        want.append(x[i - h:i + h + 1].mean())
    np.testing.assert_allclose(smooth(x, window), want, rtol=1e-12, atol=1e-12)
    line = 3.0 - 0.5 * np.arange(n)  # symmetric windows: no lag on a trend
    np.testing.assert_allclose(smooth(line, window), line, atol=1e-12)


def _records(run, steps, scale=1.0):
    out = []
    for s in steps:
        out.append({"run": run, "step": s, "loss": scale * 5.0 / s, "lr": 1e-3 * min(1.0, s / 5), "time": 0.0})
        if s % 10 == 0:
            out.append({"run": run, "step": s, "val_loss": scale * 6.0 / s, "val_ppl": math.exp(6.0 / s)})
    return out


def _lines(ax):
    return {line.get_label(): line for line in ax.get_lines()}


def test_plot_draws_raw_smoothed_validation_uniform_guess_and_learning_rate(tmp_path):
    records = _records("a", range(1, 45))  # steps 41-44 failed
    records.append({"run": "a", "restart": True, "step": 40, "failed": [41, 44], "workers": ["w"]})
    # after a restart from step 40's checkpoint: the rerun's values win
    records += _records("a", range(41, 51), scale=2.0) + _records("a", range(51, 101))
    fig = plot_training(records, vocab_size=257)
    ax, ax_lr = fig.axes
    lines = _lines(ax)
    raw = lines["train"]
    steps, losses = raw.get_data()
    assert list(steps) == list(range(1, 101))
    assert losses[44] == 2.0 * 5.0 / 45 and losses[59] == 5.0 / 60
    smoothed = next(line for label, line in lines.items() if label.startswith("train (centered mean of 5 steps)"))
    np.testing.assert_allclose(smoothed.get_ydata(), smooth(losses, 4))
    assert raw.get_alpha() < 0.5 and smoothed.get_linewidth() > raw.get_linewidth()  # the raw one faint
    val_steps, val = lines["validation"].get_data()
    assert list(val_steps) == list(range(10, 101, 10)) and val[3] == 6.0 / 40 and val[4] == 2.0 * 6.0 / 50
    guess = next(line for label, line in lines.items() if label.startswith("uniform guess"))
    assert guess.get_ydata()[0] == pytest.approx(math.log(257))
    lo, hi = ax.get_ylim()
    assert lo < math.log(257) < hi  # in view, though the training loss starts below it
    assert ax_lr.get_ylabel() == "learning rate" and ax_lr.get_xlabel() == "step"
    np.testing.assert_allclose(ax_lr.get_lines()[0].get_ydata()[:6], [2e-4, 4e-4, 6e-4, 8e-4, 1e-3, 1e-3])


def test_plot_takes_the_last_run_of_a_metrics_file_or_the_one_named(tmp_path):
    f = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in _records("old", range(1, 31)) + _records("new", range(1, 11)))
    f.write_text(text + '{"run": "new", "step": 11, "lo')  # a line cut by a kill
    assert len(read_metrics(f)) == 30 + 3 + 10 + 1
    steps, _ = _lines(plot_training(f).axes[0])["train"].get_data()
    assert list(steps) == list(range(1, 11))
    steps, _ = _lines(plot_training(f, run="old").axes[0])["train"].get_data()
    assert list(steps) == list(range(1, 31))


def test_plot_without_learning_rate_or_vocabulary_is_one_panel(tmp_path):
    fig = plot_training([{"step": s, "loss": 1.0 / s} for s in range(1, 5)])
    (ax,) = fig.axes
    assert ax.get_xlabel() == "step" and set(_lines(ax)) == {"train"}  # 4 steps: nothing to smooth
    assert plot_training([]).axes[0].get_lines() == []  # no records yet: an empty plot, no error
    assert len(plot_training([], vocab_size=257).axes[0].get_lines()) == 1


def test_plot_writes_a_png_atomically(tmp_path):
    path = tmp_path / "loss.png"
    plot_training(_records("a", range(1, 21)), vocab_size=257, path=path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]  # no temporary file left


@pytest.mark.parametrize("vocab", [0, 2.5, True, "257"])
def test_plot_bad_vocab_size(vocab):
    with pytest.raises(TileError, match=r"\[tilegraph.plotting.plot_training\] vocab_size must be a positive int"):
        plot_training(_records("a", range(1, 5)), vocab_size=vocab)


def test_summary_writer_missing_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # None in sys.modules: the import fails
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TileError, match=r"\[here\] TensorBoard logging needs a SummaryWriter: "
                                        r"pip install tensorboardX"):
        summary_writer_class("here")


def test_has_tensorboard_does_not_import_torch(monkeypatch):
    import importlib.util

    found = {"tensorboardX": None, "torch": object(), "tensorboard": None}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found[name])
    assert not has_tensorboard()
    found["tensorboard"] = object()  # torch with tensorboard: torch.utils.tensorboard works
    assert has_tensorboard()
    found.update(torch=None, tensorboard=None, tensorboardX=object())
    assert has_tensorboard()


def test_a_run_resumed_from_an_earlier_step_plots_the_branch_it_took():
    """Records of steps 1-20, then a resume from step 10's checkpoint logging 11-14 again (and a
    validation at 12): the curve is 1-10 then the new 11-14, never the old 15-20 after them."""
    from tilegraph.plotting import _curves

    old = [{"run": "r", "step": s, "loss": 10.0 - 0.1 * s, "lr": 1.0} for s in range(1, 21)]
    new = [{"run": "r", "step": s, "loss": 5.0, "lr": 0.5} for s in range(11, 15)]
    val = [{"run": "r", "step": 12, "val_loss": 4.0}]
    loss, val_loss, lr = _curves(old + new[:2] + val + new[2:], None)
    assert [s for s, _ in loss] == list(range(1, 15)) and [v for s, v in loss if s > 10] == [5.0] * 4
    assert val_loss == [(12, 4.0)] and lr[-1] == (14, 0.5)
