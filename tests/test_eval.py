"""Evaluation: the Trainer's validation loss over windows spread across the split, with perplexity
in the metrics, the log line and FitResult; `tilegraph eval CHECKPOINT` against a NumPy loss over
the same windows, its bad input; `tilegraph generate` with a repetition penalty and stop strings
on a Zarr checkpoint."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import cli, models
from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file
from tilegraph.models import ModelTiling

SEQ = 32  # the checkpoint's max_seq_len


def _nll(model, ds: TokenDataset, batches) -> float:
    """Mean next-token loss of the windows at ``batches`` (lists of offsets), in NumPy."""
    per_batch = []
    for offsets in batches:
        x, y = ds.read(offsets)
        z = model(x).numpy().astype(np.float64)                      # (B, T, V)
        z -= z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        per_batch.append(-np.take_along_axis(logp, y[..., None], axis=-1).mean())
    return float(np.mean(per_batch))


def _model(seed=0):
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=257, max_seq_len=SEQ)
    return models.build(cfg, ModelTiling(batch=2, seq=16), seed=seed)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "numpy", "tile", "graph", "the", "and"]
    for k in range(3):
        (root / f"m{k}.py").write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(60)) + "\n")
    (root / "notes.txt").write_text("héllo wörld\n" * 40)
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Zarr checkpoint as `tilegraph train` writes it: a byte-level GPT-2, its tokenizer recorded."""
    path = tmp_path_factory.mktemp("ck") / "step-000001"
    tg.io.save_checkpoint(path, _model(), files=cli.tokenizer_files(ByteTokenizer(eos=True)))
    return path


# -------------------------------------------------------------------------------- the Trainer ----
def test_evaluation_reads_windows_spread_over_the_split_and_the_same_each_time(tmp_path, corpus):
    build_token_file([corpus], tmp_path / "tok.bin", ByteTokenizer(eos=True))
    train = TokenDataset(tmp_path / "tok.bin", SEQ, split="train", val_fraction=0.3)
    val = TokenDataset(tmp_path / "tok.bin", SEQ, split="val", val_fraction=0.3)
    model = _model()
    opt = tg.optim.SGD(model.parameters(), lr=0.0)
    trainer = tg.Trainer(model, opt, train, batch_size=4, eval_data=val, eval_batches=3, progress=False)
    windows = val.eval_offsets(4, 3)
    starts = np.concatenate(windows)
    assert starts[-1] - starts[0] > 0.8 * (val.hi - val.lo)  # across the split, not its first 12 windows
    want = _nll(model, val, windows)
    got = trainer.evaluate()
    assert got == pytest.approx(want, rel=1e-5) and trainer.evaluate() == got
    assert trainer.evaluate(1) == pytest.approx(_nll(model, val, val.eval_offsets(4, 1)), rel=1e-5)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.evaluate\] batches \(or eval_batches\) must "
                                               r"be an int >= 1"):
            trainer.evaluate(bad)


def test_evaluation_reads_the_same_windows_whatever_accum_steps_is(tmp_path, corpus):
    """With accum_steps = k a step reads batch_size windows as k micro-batches, and evaluation
    reads its eval_batches batches so too: the same windows, the same loss. Before, it read
    eval_batches micro-batches (a k-th of the windows): validation losses of runs that differ only
    in accumulation differed (5.0312 against 5.0291 on the debug GPT-2)."""
    build_token_file([corpus], tmp_path / "tok.bin", ByteTokenizer(eos=True))
    train = TokenDataset(tmp_path / "tok.bin", SEQ, split="train", val_fraction=0.3)
    val = TokenDataset(tmp_path / "tok.bin", SEQ, split="val", val_fraction=0.3)
    model = _model()
    want = _nll(model, val, val.eval_offsets(4, 3))
    for k in (1, 2, 4):
        opt = tg.optim.SGD(model.parameters(), lr=0.0)
        trainer = tg.Trainer(model, opt, train, batch_size=4, eval_data=val, eval_batches=3, accum_steps=k,
                             progress=False)
        assert trainer.evaluate() == pytest.approx(want, rel=1e-6), k


def test_a_regressors_validation_loss_is_logged_without_a_perplexity(tmp_path, capsys):
    """exp of an MSE is no perplexity: it is neither shown nor logged (val_ppl) for a regressor;
    FitResult.val_perplexities computes it all the same (a language model's: tests/test_e2e36_trainer_data.py)."""
    w = np.random.default_rng(100).standard_normal((8, 2)).astype(np.float32) / 3

    def data(seed):
        def batch(step):
            x = np.random.default_rng([seed, step]).standard_normal((16, 8)).astype(np.float32)
            return x, np.tanh(x @ w)
        return batch

    def mse(m, x, y):
        d = m(x) - y
        return (d * d).mean()

    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    trainer = tg.Trainer(model, opt, data(0), loss_fn=mse, batch_size=16, eval_data=data(1), eval_every=3,
                         eval_batches=2, log_dir=tmp_path, progress=False)
    res = trainer.fit(6)
    assert [s for s, _ in res.val_losses] == [3, 6]
    assert res.val_perplexities == [(s, math.exp(v)) for s, v in res.val_losses]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [(r["step"], r["val_loss"]) for r in evals] == res.val_losses and not any("val_ppl" in r for r in evals)
    out = capsys.readouterr().out
    for step, loss in res.val_losses:
        assert f"step {step}: loss " in out and f"validation loss {loss:.4f}\n" in out
    assert "perplexity" not in out
    assert tg.trainer.perplexity(1e4) == math.inf and math.isnan(tg.trainer.perplexity(float("nan")))


# ----------------------------------------------------------------------------- tilegraph eval ----
@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The folder `tilegraph eval` makes its temporary token file in (empty again afterwards)."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _eval(capsys, *args):
    code = cli.main(["eval", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _printed(out: str) -> tuple[float, float]:
    loss, ppl = re.search(r"^loss ([\d.]+), perplexity ([\d.]+)$", out, re.M).groups()
    return float(loss), float(ppl)


def test_eval_prints_the_loss_and_perplexity_of_a_checkpoint(tmp_path, scratch, capsys, corpus, checkpoint):
    code, out, err = _eval(capsys, checkpoint, "--data", corpus, "--batches", 5, "--batch-size", 3, "--seq-len", 24,
                           "--local")
    assert code == 0, err
    loss, ppl = _printed(out)
    # the same windows, read here: all of the corpus (no split), 15 windows spread over it
    build_token_file([corpus], tmp_path / "tok.bin", ByteTokenizer(eos=True))
    ds = TokenDataset(tmp_path / "tok.bin", 24, split="train", val_fraction=0.0)
    want = _nll(models.from_zarr(checkpoint), ds, ds.eval_offsets(3, 5))
    assert loss == pytest.approx(want, abs=6e-5) and ppl == pytest.approx(math.exp(want), abs=2e-3)
    assert f"the corpus: {ds.count:,} tokens, 15 windows of 24 spread over it" in out
    # more batches than the corpus holds: every window (79 of 32 tokens in 2,549; 9 whole batches of 8)
    code, out, _ = _eval(capsys, checkpoint, "--data", corpus / "m0.py", "--batches", 10 ** 6, "--batch-size", 1,
                         "--local")
    assert code == 0 and "2,549 tokens, 79 windows of 32 spread over all of it (99.2% of its tokens)" in out
    code, out, _ = _eval(capsys, checkpoint, "--data", corpus / "m0.py", "--batches", 10 ** 6, "--local")
    assert code == 0 and "72 windows of 32 spread over it (90.4% of its tokens)" in out
    assert not list(scratch.iterdir())  # the token file was temporary


def test_eval_defaults_to_the_validation_split_of_the_training_corpus(capsys, checkpoint):
    code, out, err = _eval(capsys, checkpoint, "--batches", 2, "--local")
    assert code == 0, err
    assert "the validation split (last 5%) of the default training corpus" in out
    assert "16 windows of 32 spread over it" in out  # --batch-size 8; --seq-len: the model's max_seq_len
    loss, _ = _printed(out)
    assert abs(loss - math.log(257)) < 0.5  # an untrained model: about the uniform guess


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nowhere"], r"a checkpoint folder \(tilegraph train\) or a Hugging Face folder; received: .*nowhere "
                        r"does not exist"),
    (["{ck}", "--data", "{tmp}/empty"], r"the corpus is empty: every file found has no text"),
    (["{ck}", "--data", "{tmp}/missing.txt"], r"each source must be an existing text file or folder"),
    (["{ck}", "--data", "{tmp}/tiny.txt"], r"a corpus of at least --batch-size=8 windows of --seq-len \+ 1 = "
                                                 r"33 tokens; received: 4 tokens from 1 source"),
    (["{ck}", "--seq-len", "33"], r"--seq-len of at most the model's max_seq_len=32; received: 33"),
    (["{ck}", "--batches", "0"], r"--batches must be an integer >= 1; received: 0"),
    (["{ck}", "--batch-size", "-2"], r"--batch-size must be an integer >= 1; received: -2"),
])
def test_eval_bad_input_is_one_clear_line(tmp_path, scratch, capsys, checkpoint, args, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    (tmp_path / "tiny.txt").write_text("abc")
    args = [a.format(tmp=tmp_path, ck=checkpoint) for a in args]
    code, out, err = _eval(capsys, *args, "--local")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("tilegraph eval: error: ") and re.search(message, err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "scratch", "tiny.txt"]  # nothing written
    assert not list(scratch.iterdir())


@pytest.mark.distributed
def test_eval_on_the_embedded_cluster_agrees_with_local(capsys, corpus, checkpoint):
    args = [str(checkpoint), "--data", str(corpus), "--batches", "4", "--batch-size", "4"]
    code, local, err = _eval(capsys, *args, "--local")
    assert code == 0, err
    run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "eval", *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert _printed(run.stdout) == pytest.approx(_printed(local), abs=2e-4)


# ------------------------------------------------------------------------- tilegraph generate ----
def test_generate_stops_at_a_stop_string_and_takes_a_repetition_penalty(capsys, checkpoint):
    base = ["generate", str(checkpoint), "--prompt", "def ", "--max-new-tokens", "20", "--local", "--ids"]
    assert cli.main(base) == 0
    free_text, free_ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    free_ids = [int(i) for i in free_ids.split()]
    assert free_text.startswith("def ") and len(free_ids) == 24
    new = ByteTokenizer(eos=True).decode(free_ids[4:])
    stop = new[6:8]
    assert cli.main(base + ["--stop", stop, "--stop", "\\t~never"]) == 0
    text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    end = new.index(stop) + len(stop)
    assert text == "def " + new[:end] and [int(i) for i in ids.split()] == free_ids[:4 + end]
    # a penalty changes the continuation (a random model repeats a few bytes)
    assert cli.main(base + ["--repetition-penalty", "3"]) == 0
    pen_ids = [int(i) for i in capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1].split()]
    assert pen_ids[:4] == free_ids[:4] and pen_ids != free_ids
    assert len(set(pen_ids[4:])) >= len(set(free_ids[4:]))
    assert cli.main(base + ["--repetition-penalty", "-1"]) == 2
    assert "--repetition-penalty must be a finite number > 0; received: --repetition-penalty=-1.0" in capsys.readouterr().err


def test_unescape_reads_newlines_and_tabs():
    assert cli.unescape(r"a\nb\tc\\n") == "a\nb\tc\\n" and cli.unescape("plain") == "plain"


@pytest.mark.distributed
def test_a_worker_lost_during_an_evaluation_of_this_processs_model_says_it_can_run_again(own_runtime):
    """`tilegraph eval` evaluates a model loaded here: its parameters are only lent to the
    workers, so a worker lost meanwhile is a WorkerLostError naming it that says the evaluation
    can run again on the workers left (not the training's "resume from a checkpoint"), and it does."""
    import os
    import signal
    import threading
    import time

    from test_generate import _stall_decoding

    rt = own_runtime
    model = models.build("gpt2-debug", seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 16))
    ev = tg.EvalStep(model, lambda m, i: tg.cross_entropy(m(i[:, :-1]), i[:, 1:]), runtime=rt)
    want = ev(ids)
    rt.client.run(_stall_decoding, where="tasks")
    pids = rt.client.run(os.getpid)
    got = {}

    def evaluate():
        try:
            got["loss"] = ev(ids)
        except Exception as e:
            got["error"] = e

    thread = threading.Thread(target=evaluate)
    thread.start()
    deadline = time.monotonic() + 30
    while not (busy := [a for a, keys in rt.client.processing().items() if any(k.startswith("tg-") for k in keys)]):
        assert time.monotonic() < deadline and thread.is_alive(), got
        time.sleep(0.05)
    os.kill(pids[busy[0]], signal.SIGKILL)
    thread.join(60)
    error = got.get("error")
    assert type(error).__name__ == "WorkerLostError", got
    assert str(error).startswith(f"[tilegraph.EvalStep] lost worker {busy[0]}"), error
    assert "only lent to the workers for the evaluation: it can run again on the workers left" in str(error)
    assert "Trainer" not in str(error)
    rt.client.run(_stall_decoding, where="tasks", stall=False)
    assert ev(ids) == pytest.approx(want, rel=1e-6)
