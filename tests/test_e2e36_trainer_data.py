"""The Trainer as a PyTorch user training a model of their own meets it (an MLP classifier on float
features with a cross-entropy over class labels, an MLP regressor with an MSE loss, ``data`` and
``eval_data`` callables): how the callables are numbered, perplexity shown only for a language
model, samples/s for data that is not tokens, and the second Ctrl-C of a caller that stops the
fit itself (``tilegraph train``)."""

from __future__ import annotations

import json
import math
import os
import re
import signal

import numpy as np
import pytest

import tilegraph as tg
import tilegraph._progress
from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

B, D, CLASSES = 8, 4, 3


def _arrays(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, D)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0).astype(np.int64)  # classes 0..2


def _classifier(data, eval_data=None, **kw):
    model = tg.nn.MLP(D, 8, out_dim=CLASSES, tile=8, seed=0)
    opt = tg.optim.SGD(model.parameters(), lr=0.1)
    kw = {"progress": False, "eval_batches": 2, **kw}
    return opt, tg.Trainer(model, opt, data, loss_fn=lambda m, x, y: tg.cross_entropy(m(x), y),
                           eval_data=eval_data, **kw)


def _regressor(data, eval_data=None, **kw):
    model = tg.nn.MLP(D, 8, out_dim=2, tile=8, seed=0)
    opt = tg.optim.SGD(model.parameters(), lr=0.05)
    kw = {"progress": False, "eval_batches": 2, **kw}
    return opt, tg.Trainer(model, opt, data, loss_fn=lambda m, x, y: tg.mse_loss(m(x), y), eval_data=eval_data, **kw)


def _records(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


# -- 1. how data(step) and eval_data(i) are numbered -------------------------------------------------
def test_data_is_called_with_the_step_numbers_from_1_and_a_resumed_run_goes_on_with_the_same(tmp_path):
    """data(step) gets the optimizer step's number (1, 2, ...: as metrics.jsonl and the checkpoints
    number them), eval_data(i) the batch index 0 .. eval_batches - 1: both documented; a second fit
    and a trainer resumed from a checkpoint call data with the numbers the uninterrupted run did."""
    x, y = _arrays(6 * B)
    calls = []

    def data(step):
        calls.append(step)
        return x[(step - 1) * B:step * B], y[(step - 1) * B:step * B]  # the documented slicing

    def eval_data(i):
        calls.append(("eval", i))
        return x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]

    _, whole = _classifier(data, eval_data, log_dir=tmp_path / "whole")
    whole.fit(6)
    uninterrupted, calls[:] = list(calls), []
    assert uninterrupted == [1, 2, 3, 4, 5, 6, ("eval", 0), ("eval", 1)]
    assert [r["step"] for r in _records(tmp_path / "whole") if "loss" in r] == [1, 2, 3, 4, 5, 6]

    _, first = _classifier(data, eval_data, checkpoint_dir=tmp_path / "ck")
    first.fit(3)
    _, resumed = _classifier(data, eval_data)
    assert resumed.load_checkpoint(tmp_path / "ck" / "step-000003") == 3
    resumed.fit(3)
    steps = [c for c in calls if not isinstance(c, tuple)]
    assert steps == [1, 2, 3, 4, 5, 6]  # the same batches as the run that was not interrupted
    calls[:] = []
    first.fit(3)  # a second fit of the same trainer: steps 4..6
    assert [c for c in calls if not isinstance(c, tuple)] == [4, 5, 6]

    doc = tg.Trainer.__doc__
    assert "``data(step)`` with the number of the\n      optimizer step" in doc and "counted from 1" in doc
    assert "X[(step - 1) * B:step * B]" in doc and "``i = 0 .. eval_batches - 1``" in doc


def test_a_slice_past_the_end_of_the_data_is_refused_naming_the_call_and_the_numbering():
    """The user slicing ``X[step * B:(step + 1) * B]`` (counting from 0) reaches past the end at the
    last step: the empty batch failed inside the TrainStep ("batch[0] ... no dim of size 0"),
    naming neither data(step) nor how the steps count."""
    x, y = _arrays(2 * B)
    _, trainer = _classifier(lambda step: (x[step * B:(step + 1) * B], y[step * B:(step + 1) * B]))
    with pytest.raises(tg.TileError, match=r"\[tilegraph\.Trainer\.fit\] data\(step\) must return arrays with at "
                       r"least one element .*counted from 1.*X\[\(step - 1\) \* B:step \* B\].*"
                       r"received: data\(2\) item 0: shape \(0, 4\)"):
        trainer.fit(2)

    # eval_batches past the held-out rows: the same, for eval_data(i) numbered from 0
    _, trainer = _classifier(lambda step: (x[:B], y[:B]),
                             lambda i: (x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]), eval_batches=3)
    with pytest.raises(tg.TileError, match=r"\[tilegraph\.Trainer\.evaluate\] eval_data\(i\) must return arrays "
                       r"with at least one element .*i = 0 \.\. eval_batches - 1.*received: eval_data\(2\) item 0"):
        trainer.evaluate()

    # a list of batches indexed by the step: its IndexError says how data is called
    batches = [(x[:B], y[:B]), (x[B:], y[B:])]
    _, trainer = _classifier(lambda step: batches[step])
    with pytest.raises(IndexError) as err:
        trainer.fit(2)
    assert any("counted from 1 (data(2) here)" in note and "batches[step - 1]" in note
               for note in getattr(err.value, "__notes__", []))


# -- 2. perplexity only for a language model ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["classifier", "regressor"])
def test_no_perplexity_for_a_classifier_or_a_regressor(tmp_path, capsys, kind):
    """exp of an MSE, or of a cross-entropy over class labels, is no perplexity: the evaluation line,
    metrics.jsonl and TensorBoard's scalars said "perplexity 1.00" / val_ppl for them."""
    x, y = _arrays(4 * B)
    target = y if kind == "classifier" else np.tanh(x[:, :2])
    data = lambda step: (x[:B], target[:B])  # noqa: E731
    eval_data = lambda i: (x[(i + 1) * B:(i + 2) * B], target[(i + 1) * B:(i + 2) * B])  # noqa: E731
    make = _classifier if kind == "classifier" else _regressor
    _, trainer = make(data, eval_data, eval_every=2, log_dir=tmp_path, progress=True)
    res = trainer.fit(4)
    said = capsys.readouterr()
    evals = [r for r in _records(tmp_path) if "val_loss" in r]
    assert [(r["step"], r["val_loss"]) for r in evals] == res.val_losses
    assert not [r for r in evals if "val_ppl" in r]
    for step, val in res.val_losses:
        assert f"step {step}: loss " in said.out and f"validation loss {val:.4f}\n" in said.out
    assert "perplexity" not in said.out + said.err
    assert trainer.language_model is False


def _token_ids(step, rows=4, seq=6, vocab=16):
    ids = np.random.default_rng([7, step]).integers(0, vocab, (rows, seq + 1))
    return ids[:, :-1], ids[:, 1:]


def _tiny_lm(vocab=16):
    return tg.nn.Sequential(tg.nn.Embedding(vocab, 8, seed=0), tg.nn.Linear(8, vocab, seed=1))


def test_a_language_model_keeps_its_perplexity_and_tokens_per_s(tmp_path, capsys):
    """A language model's output is unchanged: token ids (B, T) and their next-token targets
    (B, T) from a callable, or a token dataset: val_ppl, "(perplexity ...)", tokens_per_s and
    tok_s, as before. ``perplexity=`` says it outright either way; another value is refused."""
    model = _tiny_lm()
    opt = tg.optim.SGD(model.parameters(), lr=0.1)
    trainer = tg.Trainer(model, opt, _token_ids, loss_fn=tg.trainer.lm_loss, eval_data=_token_ids, eval_batches=1,
                         log_dir=tmp_path / "ids", progress=True)
    res = trainer.fit(2)
    out = capsys.readouterr().out
    (ev,) = [r for r in _records(tmp_path / "ids") if "val_loss" in r]
    assert ev["val_ppl"] == math.exp(ev["val_loss"]) and trainer.language_model and trainer.token_batches
    assert f"validation loss {ev['val_loss']:.4f} (perplexity {math.exp(ev['val_loss']):.2f})" in out
    steps = [r for r in _records(tmp_path / "ids") if "loss" in r]
    assert all(r["tokens_per_s"] > 0 and "samples_per_s" not in r for r in steps)
    assert res.tokens_per_s * res.seconds == pytest.approx(2 * 4 * 6)  # B x T tokens a step

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the tile graph trains a model\n" * 60)
    build_token_file([corpus], tmp_path / "c.tok", ByteTokenizer(eos=True))
    train = TokenDataset(tmp_path / "c.tok", seq_len=8, split="train", seed=0)
    val = TokenDataset(tmp_path / "c.tok", seq_len=8, split="val", seed=0)
    model = _tiny_lm(257)
    trainer = tg.Trainer(model, tg.optim.SGD(model.parameters(), lr=0.1), train, batch_size=4, eval_data=val,
                         eval_batches=1, log_dir=tmp_path / "tok", progress=True)
    res = trainer.fit(2)
    out = capsys.readouterr()
    records = _records(tmp_path / "tok")
    (ev,) = [r for r in records if "val_loss" in r]
    assert ev["val_ppl"] == math.exp(ev["val_loss"])
    assert f"step 2: loss {res.losses[-1]:.4f}, validation loss {ev['val_loss']:.4f} " \
           f"(perplexity {math.exp(ev['val_loss']):.2f})" in out.out
    assert all("tokens_per_s" in r and "samples_per_s" not in r for r in records if "loss" in r)
    assert "tok_s=" in out.err and res.tokens_per_s * res.seconds == pytest.approx(2 * 4 * 8)

    # said outright: a float model of a sequence is a language model; token ids need not be one
    x, y = _arrays(2 * B)
    _, trainer = _classifier(lambda s: (x[:B], y[:B]), lambda i: (x[B:], y[B:]), perplexity=True, eval_batches=1)
    trainer.fit(1)
    assert "val_ppl" in trainer.history[-1]
    model = _tiny_lm()
    trainer = tg.Trainer(model, tg.optim.SGD(model.parameters(), lr=0.1), _token_ids,
                         loss_fn=tg.trainer.lm_loss, eval_data=_token_ids, eval_batches=1, progress=False,
                         perplexity=False)
    trainer.fit(1)
    assert "val_loss" in trainer.history[-1] and "val_ppl" not in trainer.history[-1]
    with pytest.raises(tg.TileError, match=r"perplexity must be None .*True or False.*received: perplexity='yes'"):
        _classifier(lambda s: (x[:B], y[:B]), perplexity="yes")


# -- 3. samples/s for data that is not tokens --------------------------------------------------------
def test_float_features_report_samples_per_second_not_tokens(tmp_path, capsys, monkeypatch):
    """A (B, D) batch of float features counted B x D "tokens" (tok_s, tokens_per_s): it is B
    samples a step, reported as samples_per_s (metrics.jsonl, the progress, FitResult)."""
    x, y = _arrays(B)
    _, trainer = _classifier(lambda step: (x, y), log_dir=tmp_path, progress=True)
    monkeypatch.setattr(tilegraph._progress, "PROGRESS_LOG_SECONDS", 0.0)  # a line every step
    res = trainer.fit(3)
    err = capsys.readouterr().err
    steps = [r for r in _records(tmp_path) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["samples_per_s"] > 0 and "tokens_per_s" not in r for r in steps)
    assert res.samples_per_s * res.seconds == pytest.approx(3 * B)  # rows, not rows x features
    assert res.tokens_per_s == 0.0 and trainer.token_batches is False
    assert "samples_per_s=" in err and "tok_s" not in err


# -- 4. a second Ctrl-C under a caller that stops the fit itself -------------------------------------
def _cli_like_stop(trainer, said):
    """tilegraph train's SIGINT handler: the first asks the trainer to stop, the next interrupts."""
    def stop(signum, frame):
        trainer.request_stop()
        signal.signal(signum, signal.default_int_handler)
        said.append("tilegraph train: SIGINT: stopping after the steps under way")
    return stop


def test_a_second_ctrl_c_after_request_stop_leaves_the_words_to_the_caller(capsys):
    """Under tilegraph train (whose handler calls request_stop, then lets a second Ctrl-C through
    as a KeyboardInterrupt), the Trainer printed the notebook's "fit again to go on from there"
    before the command's own "stopped at once"; in a notebook (no request_stop) it stays."""
    x, y = _arrays(B)
    _, trainer = _classifier(lambda step: (x, y), steps_per_graph=1, progress=True)
    said = []

    def ctrl_c_twice(t, stats):
        if t.optimizer.step_count == 2:
            os.kill(os.getpid(), signal.SIGINT)  # the first: request_stop
            os.kill(os.getpid(), signal.SIGINT)  # the second: KeyboardInterrupt here

    trainer.on_step.append(ctrl_c_twice)
    previous = signal.signal(signal.SIGINT, _cli_like_stop(trainer, said))
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.fit(6)
    finally:
        signal.signal(signal.SIGINT, previous)
    out = capsys.readouterr()
    assert said and "fit again" not in out.out + out.err and "interrupted: stopped after" not in out.out + out.err
    assert [r["step"] for r in trainer.history if "loss" in r] == list(range(1, trainer.optimizer.step_count + 1))

    # the notebook's stop button (no request_stop): its line stays
    _, trainer = _classifier(lambda step: (x, y), steps_per_graph=1, progress=True)

    def stop_button(t, stats):
        if t.optimizer.step_count == 2:
            raise KeyboardInterrupt

    trainer.on_step.append(stop_button)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(6)
    out = capsys.readouterr()
    assert re.search(r"interrupted: stopped after step \d+, every step run logged \(fit again to go on from there\)",
                     out.out + out.err)
