"""`tilegraph eval` / `generate` on checkpoints of `tilegraph train` runs: the run's records
(tilegraph_data.json: its windows' seq_len, its JSON Lines text_field) are what eval reads by
default; a --tokenizer other than the checkpoint's is warned of; a run's tokens.bin given as
--data is named as one. Losses against a NumPy loss over the same windows."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import cli, models
from tilegraph.io import BPETokenizer, ByteTokenizer, TokenDataset, build_token_file
from tilegraph.models import ModelTiling

MAX_SEQ = 32


def _nll(model, ds: TokenDataset, batches) -> float:
    """Mean next-token loss of the windows at ``batches`` (lists of offsets), in NumPy."""
    per_batch = []
    for offsets in batches:
        x, y = ds.read(offsets)
        z = model(x).numpy().astype(np.float64)
        z -= z.max(axis=-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
        per_batch.append(-np.take_along_axis(logp, y[..., None], axis=-1).mean())
    return float(np.mean(per_batch))


def _eval(capsys, *args):
    code = cli.main(["eval", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def _loss(out: str) -> float:
    return float(re.search(r"^loss ([\d.]+), perplexity", out, re.M).group(1))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    """A JSON Lines corpus whose records hold their text in "body" (and the same in "text")."""
    root = tmp_path_factory.mktemp("jsonl")
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "value", "import", "numpy", "tile", "graph", "the", "and"]
    docs = ["\n".join(" ".join(rng.choice(words, 8)) for _ in range(12)) for _ in range(12)]
    (root / "body.jsonl").write_text("".join(json.dumps({"id": k, "body": d}) + "\n" for k, d in enumerate(docs)))
    (root / "text.jsonl").write_text("".join(json.dumps({"id": k, "text": d}) + "\n" for k, d in enumerate(docs)))
    return root


@pytest.fixture(scope="module")
def bpe(jsonl):
    return BPETokenizer.train([jsonl / "body.jsonl"], vocab_size=300, text_field="body")


def _checkpoint(path, tokenizer, record: dict | None):
    """A checkpoint as `tilegraph train` writes it: the model, its tokenizer and its [data] record."""
    cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=300, max_seq_len=MAX_SEQ)
    tg.io.save_checkpoint(path, models.build(cfg, ModelTiling(batch=2, seq=16), seed=0),
                          files=cli.tokenizer_files(tokenizer))
    if record is not None:
        (path / "tilegraph_data.json").write_text(json.dumps(record))
    return path


@pytest.fixture(scope="module")
def run_checkpoint(tmp_path_factory, jsonl, bpe):
    """A BPE run's checkpoint that trained on body.jsonl ([data] text_field = "body") with seq_len 16."""
    record = {"sources": [str(jsonl / "body.jsonl")], "patterns": ["*.py"], "max_mb": 4,
              "tokenizer": str(jsonl / "bpe.json"), "seq_len": 16, "val_fraction": 0.05, "text_field": "body"}
    return _checkpoint(tmp_path_factory.mktemp("run") / "step-000010", bpe, record)


def test_eval_reads_the_runs_text_field_and_seq_len(tmp_path, capsys, jsonl, bpe, run_checkpoint):
    # it said: each record to hold its text in the field 'text' (and eval had no way to say otherwise);
    # and its windows were the shipped config's 64 tokens (here the model's 32), not the run's 16
    code, out, err = _eval(capsys, run_checkpoint, "--data", jsonl / "body.jsonl", "--batches", 4, "--batch-size", 2,
                           "--local")
    assert code == 0, err
    assert "8 windows of 16 (the run's [data] seq_len) spread over it" in out
    build_token_file([jsonl / "body.jsonl"], tmp_path / "tok.bin", bpe, text_field="body")
    ds = TokenDataset(tmp_path / "tok.bin", 16, split="train", val_fraction=0.0)
    want = _nll(models.from_zarr(run_checkpoint), ds, ds.eval_offsets(2, 4))
    assert _loss(out) == pytest.approx(want, abs=6e-5)
    # --seq-len still wins over the record
    code, out, err = _eval(capsys, run_checkpoint, "--data", jsonl / "body.jsonl", "--batches", 4, "--batch-size", 2,
                           "--seq-len", 24, "--local")
    assert code == 0, err
    assert "windows of 24 spread" in out


def test_eval_names_the_recorded_text_field_it_looked_for(capsys, jsonl, run_checkpoint):
    code, out, err = _eval(capsys, run_checkpoint, "--data", jsonl / "text.jsonl", "--local")
    assert code != 0
    assert "in the field 'body'" in err and "the run's [data] text_field, which" in err
    assert "tilegraph_data.json records" in err


def test_eval_text_field_names_the_field_of_other_records(capsys, jsonl, run_checkpoint):
    """--data of records whose text is in another field than the run's: --text-field names it
    (there was no way round the run's field, nor before it the default "text"); the loss is that
    of the same text read through the run's own field."""
    code, out, err = _eval(capsys, run_checkpoint, "--data", jsonl / "text.jsonl", "--text-field", "text", "--local")
    assert code == 0, err
    code, own, err = _eval(capsys, run_checkpoint, "--data", jsonl / "body.jsonl", "--local")
    assert code == 0, err
    assert _loss(out) == _loss(own)


def test_eval_without_a_record_keeps_the_shipped_defaults(tmp_path, capsys, jsonl, bpe):
    ck = _checkpoint(tmp_path / "step-000001", bpe, None)
    code, out, err = _eval(capsys, ck, "--data", jsonl / "text.jsonl", "--batches", 2, "--batch-size", 2, "--local")
    assert code == 0, err
    assert "4 windows of 32 spread over it" in out  # min(shipped 64, max_seq_len 32); JSON Lines' field "text"
    # a damaged record (seq_len no integer, text_field empty): refused where eval would take its seq_len (it
    # measured windows of the shipped 64 without a word); with --seq-len its values are not used, and said so
    (ck / "tilegraph_data.json").write_text(json.dumps({"seq_len": "16", "text_field": ""}))
    code, out, err = _eval(capsys, ck, "--data", jsonl / "text.jsonl", "--batches", 2, "--batch-size", 2, "--local")
    assert code == 2 and "without --seq-len, eval's windows are as long as the run's" in err, err
    assert "seq_len = '16' (not an integer >= 1), text_field = '' (not a non-empty string)" in err
    code, out, err = _eval(capsys, ck, "--data", jsonl / "text.jsonl", "--batches", 2, "--batch-size", 2,
                           "--seq-len", 32, "--local")
    assert code == 0, err
    assert "4 windows of 32 spread over it" in out and "not used (the flags given replace it)" in err


def test_eval_and_generate_warn_of_another_tokenizer(capsys, jsonl, run_checkpoint):
    # it ran silently: a byte tokenizer's ids are other tokens to a BPE model (a loss of nothing)
    code, out, err = _eval(capsys, run_checkpoint, "--tokenizer", "byte", "--data", jsonl / "text.jsonl",
                           "--batches", 2, "--batch-size", 2, "--local")
    assert "warning: --tokenizer byte (ByteTokenizer(eos=True)) is not the tokenizer" in err
    assert "BPETokenizer(vocab_size=300" in err and "leave --tokenizer out" in err
    code = cli.main(["generate", str(run_checkpoint), "--tokenizer", "byte", "--max-new-tokens", "2", "--local"])
    _, err = capsys.readouterr()
    assert code == 0 and "tilegraph generate: warning: --tokenizer byte" in err


def test_eval_takes_the_same_tokenizer_given_as_a_file_without_a_warning(tmp_path, capsys, jsonl, bpe,
                                                                          run_checkpoint):
    bpe.save(tmp_path / "bpe.json")
    code, out, err = _eval(capsys, run_checkpoint, "--tokenizer", tmp_path / "bpe.json", "--data",
                           jsonl / "body.jsonl", "--batches", 2, "--batch-size", 2, "--local")
    assert code == 0, err
    assert "warning" not in err


def test_eval_of_a_checkpoint_whose_tokenizer_cannot_load_takes_tokenizer_without_a_warning(tmp_path, capsys, jsonl):
    ck = _checkpoint(tmp_path / "step-000001", ByteTokenizer(eos=True), None)
    (ck / "tilegraph_tokenizer.json").write_text("{not json")  # --tokenizer is the way round it
    code, out, err = _eval(capsys, ck, "--tokenizer", "byte", "--data", jsonl / "text.jsonl", "--batches", 2,
                           "--batch-size", 2, "--local")
    assert code == 0, err
    assert "warning" not in err


def test_eval_names_a_runs_token_file_given_as_data(tmp_path, capsys, run_checkpoint, jsonl, bpe):
    # it said: expected a UTF-8 text file; this one contains NUL bytes (binary?)
    build_token_file([jsonl / "body.jsonl"], tmp_path / "tokens.bin", bpe, text_field="body")
    code, out, err = _eval(capsys, run_checkpoint, "--data", tmp_path / "tokens.bin", "--local")
    assert code != 0
    assert f"{tmp_path / 'tokens.bin'} is a token file of tilegraph (a run's tokens.bin)" in err
    assert "--data takes text" in err and "tilegraph_data.json" in err


# ------------------------------------------------- a real run: eval reproduces its val_loss ----
RUN = """
[model]
max_seq_len = 32
[data]
sources = ["body.jsonl"]
text_field = "body"
tokenizer = "bpe.json"
seq_len = 16
val_fraction = 0.2
[train]
steps = 3
batch_size = 4
eval_every = 0
eval_batches = 2
[output]
checkpoint_every = 0
[runtime]
workers = 1
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory, jsonl, bpe):
    """A 3-step `tilegraph train` run on body.jsonl ([data] text_field "body", seq_len 16, BPE)."""
    import os
    import shutil

    root = tmp_path_factory.mktemp("trained")
    shutil.copy(jsonl / "body.jsonl", root / "body.jsonl")
    bpe.save(root / "bpe.json")
    (root / "run.toml").write_text(RUN)
    here = os.getcwd()
    try:
        os.chdir(root)
        assert cli.main(["train", "run.toml", "--out", "run", "--no-progress"]) == 0
    finally:
        os.chdir(here)
    return root


def test_eval_of_a_runs_checkpoint_is_its_validation_loss(trained, capsys):
    # it read the shipped config's corpus (the standard library's .py files) in windows of 64
    # tokens (the model's 32 here): no way to measure the run's validation loss again
    capsys.readouterr()
    ck = trained / "run" / "checkpoints" / "step-000003"
    code, out, err = _eval(capsys, ck, "--batches", 2, "--batch-size", 4, "--local")
    assert code == 0, err
    assert "the validation split (last 20%) of the run's text (tilegraph_data.json)" in out
    assert "windows of 16 (the run's [data] seq_len)" in out
    metrics = [json.loads(line) for line in (trained / "run" / "metrics.jsonl").read_text().splitlines()]
    val_loss = [m["val_loss"] for m in metrics if "val_loss" in m][-1]
    assert _loss(out) == pytest.approx(val_loss, abs=1e-4)
    assert "warning" not in err


def test_eval_names_the_runs_text_when_it_moved_or_changed(tmp_path, trained, capsys):
    import shutil

    ck = tmp_path / "step-000003"
    shutil.copytree(trained / "run" / "checkpoints" / "step-000003", ck)
    record = json.loads((ck / "tilegraph_data.json").read_text())
    text = tmp_path / "body.jsonl"
    record["sources"] = [str(text)]
    (ck / "tilegraph_data.json").write_text(json.dumps(record))
    code, out, err = _eval(capsys, ck, "--local")  # gone
    assert code != 0
    assert "without --data, eval reads the held-out part of the text the run trained on" in err
    assert f"{ck / 'tilegraph_data.json'} records ({text})" in err and "--data" in err
    # changed: fewer records than the run read
    lines = (trained / "body.jsonl").read_text().splitlines(keepends=True)
    text.write_text("".join(lines[:-2]))
    code, out, err = _eval(capsys, ck, "--batches", 1, "--batch-size", 2, "--local")
    assert code == 0, err
    assert re.search(r"warning: the run's text is not what it trained on: [\d,]+ tokens now, "
                     rf"{record['tokens']:,} then", err)


def test_a_converted_checkpoint_is_evaluated_as_the_run_was(tmp_path, trained, capsys):
    # convert left tilegraph_data.json behind: the int8 copy was measured on the standard library
    # in windows of 32, its source on the run's text in windows of 16 (no comparison of the two)
    ck = trained / "run" / "checkpoints" / "step-000003"
    for dst, extra in ((tmp_path / "q.zarr", ["--to", "zarr", "--quantize", "int8"]), (tmp_path / "hf", [])):
        assert cli.main(["convert", str(ck), str(dst), *extra]) == 0
        capsys.readouterr()
        code, out, err = _eval(capsys, dst, "--batches", 2, "--batch-size", 4, "--local")
        assert code == 0, err
        assert "of the run's text (tilegraph_data.json)" in out and "windows of 16 (the run's [data] seq_len)" in out
