"""The command line on damaged or odd input files, as a new user meets them; each is one error
line naming the file (or flag, or config key) and what is wrong, and nothing is written:

- ``tilegraph convert`` of a checkpoint whose tilegraph_tokenizer.json (or another JSON file it
  copies) is damaged: it was copied as it was into the destination, without a word;
- a damaged tilegraph_data.json (not JSON, or a bad seq_len): ``tilegraph eval --data`` measured
  windows of the shipped config's seq_len instead of the run's, unsaid;
- ``tilegraph eval --text-field`` with text files alone (no records, no fields): ignored, unsaid;
- a ``--seed`` (or ``[train] seed``) past 2**63 - 1: accepted, and a run with a gradient sketch
  failed in its first step ("OverflowError: int too big to convert" in a kernel);
- a folder of Hugging Face weights (``*.safetensors``) without its config.json: "holds neither".

The small checkpoint of test_cli_damaged.py serves them (no training); the commands run in this
process (``cli.main``), the embedded cluster never started (``--local``, or refused before it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_cli_damaged import good  # noqa: F401  (the fixture: a small checkpoint with its tokenizer)

from tilegraph import cli


def _main(capsys, *args) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _error(capsys, *args) -> str:
    """The one error line of ``tilegraph ARGS`` (exit status 2, no traceback, nothing printed)."""
    code, out, err = _main(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and out == "", (code, out, err)
    assert lines[0].startswith(f"tilegraph {args[0]}: error: ["), lines[0]
    return lines[0]


@pytest.fixture
def ck(good, tmp_path) -> Path:  # noqa: F811
    """A copy of the checkpoint (a byte tokenizer, gpt2-debug: max_seq_len 32) that records a run's
    [data] as tilegraph train does: its text (corpus.txt) and windows of 16."""
    from tilegraph.cli.runs import data_record

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world, this is some text. " * 200)
    folder = tmp_path / "ck"
    shutil.copytree(good, folder)
    record = data_record({"sources": [str(corpus)], "patterns": ["*.txt"], "max_mb": 1.0, "tokenizer": "byte",
                          "seq_len": 16, "val_fraction": 0.1, "text_field": "text"}, 6401)
    (folder / "tilegraph_data.json").write_text(json.dumps(record))
    return folder


# ----------------------------------------------------------------------------- convert ----
@pytest.mark.parametrize("to", [[], ["--to", "zarr"]])
def test_convert_refuses_a_damaged_tokenizer_record_and_writes_nothing(capsys, ck, tmp_path, to):
    (ck / "tilegraph_tokenizer.json").write_text('{"kind": "by')  # a copy cut short
    out = tmp_path / "out"
    out.mkdir()
    err = _error(capsys, "convert", ck, out / "dst", *to)
    assert err.startswith("tilegraph convert: error: [tilegraph convert] readable files beside the model (JSON "
                          "objects; tilegraph_tokenizer.json describing a tokenizer): convert copies them into the "
                          "destination as they are; restore it (from another checkpoint of the run, or where the "
                          "model came from), or remove it to convert the model without it (nothing was written); "
                          f"received: {ck}/tilegraph_tokenizer.json: JSONDecodeError: Unterminated string"), err
    assert list(out.iterdir()) == []  # no destination, half-written or temporary


def test_convert_lists_every_damaged_file_at_once(capsys, ck, tmp_path):
    (ck / "tilegraph_tokenizer.json").write_text(json.dumps({"kind": "wordpiece"}))  # JSON, but no tokenizer
    (ck / "tilegraph_data.json").write_text("[1")
    (ck / "generation_config.json").write_text('"x"')
    err = _error(capsys, "convert", ck, tmp_path / "dst")
    assert err.endswith(f"restore them (from another checkpoint of the run, or where the model came from), or remove "
                        f"them to convert the model without them (nothing was written); received: "
                        f"{ck}/generation_config.json: str, not a JSON object; {ck}/tilegraph_data.json: "
                        "JSONDecodeError: Expecting ',' delimiter: line 1 column 3 (char 2); "
                        f"{ck}/tilegraph_tokenizer.json: unknown tokenizer kind (expected 'byte' or 'bpe') "
                        "('wordpiece')"), err
    assert not (tmp_path / "dst").exists()


def test_convert_without_a_tokenizer_still_converts(capsys, ck, tmp_path):
    """The tokenizer is optional to convert: a checkpoint without one converts (the model alone)."""
    for name in ("tilegraph_tokenizer.json", "tokenizer.json", "tokenizer_config.json"):
        (ck / name).unlink(missing_ok=True)
    code, out, err = _main(capsys, "convert", ck, tmp_path / "hf")
    assert code == 0, err
    assert (tmp_path / "hf" / "model.safetensors").is_file() and not (tmp_path / "hf" / "tokenizer.json").exists()


# -------------------------------------------------------------------------------- eval ----
EVAL = ("--batches", 1, "--batch-size", 2, "--local")


def test_eval_uses_the_runs_seq_len_from_an_undamaged_record(capsys, ck):
    code, out, err = _main(capsys, "eval", ck, "--data", ck.parent / "corpus.txt", *EVAL)
    assert code == 0, err
    assert "windows of 16 (the run's [data] seq_len)" in out


@pytest.mark.parametrize("text, problem", [
    ('{"seq_len": 1', "Expecting ',' delimiter"),
    ('["a"]', "list, not a JSON object"),
])
def test_eval_data_refuses_an_unreadable_record_without_seq_len(capsys, ck, text, problem):
    """--data names the text, but the windows' length was the shipped config's (32 here) unsaid."""
    (ck / "tilegraph_data.json").write_text(text)
    err = _error(capsys, "eval", ck, "--data", ck.parent / "corpus.txt", *EVAL)
    assert err.startswith("tilegraph eval: error: [tilegraph eval] a readable tilegraph_data.json in the checkpoint: "
                          "without --seq-len, eval's windows are as long as the run's, its [data] seq_len, which it "
                          f"records (or give --seq-len); received: {ck}/tilegraph_data.json: "), err
    assert problem in err
    # --seq-len names what it recorded: it runs, and says the record is not read
    code, out, err = _main(capsys, "eval", ck, "--data", ck.parent / "corpus.txt", "--seq-len", 8, *EVAL)
    assert code == 0, err
    assert "windows of 8 spread" in out
    assert err.startswith(f"tilegraph eval: warning: {ck}/tilegraph_data.json: ") and err.rstrip().endswith(
        "not read (the flags given replace it)"), err


def test_eval_refuses_a_record_with_a_bad_seq_len(capsys, ck):
    record = json.loads((ck / "tilegraph_data.json").read_text())
    (ck / "tilegraph_data.json").write_text(json.dumps({**record, "seq_len": -16}))
    for data in ([], ["--data", ck.parent / "corpus.txt"]):  # the run's text is fine: only --seq-len is wanting
        err = _error(capsys, "eval", ck, *data, *EVAL)
        assert err.endswith("a readable tilegraph_data.json in the checkpoint: without --seq-len, eval's windows are "
                            "as long as the run's, its [data] seq_len, which it records (or give --seq-len); "
                            f"received: {ck}/tilegraph_data.json: seq_len = -16 (not an integer >= 1)"), err
    code, out, err = _main(capsys, "eval", ck, "--seq-len", 8, *EVAL)  # the run's text, in windows of 8
    assert code == 0, err
    assert "of the run's text (tilegraph_data.json)" in out and "windows of 8 spread" in out
    assert "seq_len = -16 (not an integer >= 1): not used (the flags given replace it)" in err


def test_eval_refuses_a_record_whose_text_is_damaged_without_data(capsys, ck):
    """Bad [data] sources: it measured the default corpus (the standard library) instead, unsaid."""
    record = json.loads((ck / "tilegraph_data.json").read_text())
    (ck / "tilegraph_data.json").write_text(json.dumps({**record, "sources": "corpus.txt"}))
    err = _error(capsys, "eval", ck, *EVAL)
    assert err.endswith("a readable tilegraph_data.json in the checkpoint: without --data, eval reads the held-out "
                        "part of the text the run trained on, which it records (or name text to evaluate on with "
                        f"--data); received: {ck}/tilegraph_data.json: sources = 'corpus.txt' (not a non-empty list "
                        "of paths)"), err


# ---------------------------------------------------------------------- --text-field ----
def test_eval_refuses_a_text_field_for_text_files(capsys, ck, tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    for name in ("a.txt", "b.md"):
        (folder / name).write_text("some words of text " * 100)
    for data, files in (([ck.parent / "corpus.txt"], f"1 text file ({ck.parent / 'corpus.txt'})"),
                        ([folder], f"2 text files ({folder / 'a.txt'}, {folder / 'b.md'})")):
        err = _error(capsys, "eval", ck, "--data", *data, "--text-field", "body", *EVAL)
        assert err == ("tilegraph eval: error: [tilegraph eval --text-field] files of records among the sources "
                       "(JSON Lines: .jsonl, .ndjson; or .json): it names the field of their records that holds the "
                       "text; a text file is read whole and has no fields (leave --text-field out); received: "
                       f"--text-field 'body' with {files}"), err
    # the run's own text (its record's sources): text files too
    err = _error(capsys, "eval", ck, "--text-field", "body", *EVAL)
    assert err.endswith(f"received: --text-field 'body' with the run's text ({ck}/tilegraph_data.json): 1 text file "
                        f"({ck.parent / 'corpus.txt'})"), err


def test_eval_takes_a_text_field_with_records_among_text_files(capsys, ck, tmp_path):
    records = tmp_path / "r.jsonl"
    records.write_text("".join(json.dumps({"body": f"record {i} of some text"}) + "\n" for i in range(50)))
    code, out, err = _main(capsys, "eval", ck, "--data", ck.parent / "corpus.txt", records, "--text-field", "body",
                           *EVAL)
    assert code == 0, err


# ---------------------------------------------------------------------------- --seed ----
@pytest.mark.parametrize("seed", [-1, 2 ** 63, 2 ** 70])
def test_train_refuses_a_seed_out_of_range_naming_the_flag(capsys, tmp_path, monkeypatch, seed):
    monkeypatch.chdir(tmp_path)
    err = _error(capsys, "train", "--seed", seed, "--out", "run", "--no-progress")
    assert err == ("tilegraph train: error: [tilegraph train] valid settings; received: train.seed must be an "
                   f"integer in [0, 2**63 - 1], not {seed} (set by --seed) (in shipped default.toml "
                   "(examples/configs/) and the command line)"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("seed", [-1, 2 ** 64])
def test_train_refuses_a_config_seed_out_of_range_naming_the_key(capsys, tmp_path, monkeypatch, seed):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(f"[train]\nseed = {seed}\n")
    err = _error(capsys, "train", "c.toml", "--out", "run", "--no-progress")
    assert err == ("tilegraph train: error: [tilegraph train] valid settings; received: train.seed must be an "
                   f"integer in [0, 2**63 - 1], not {seed} (in c.toml)"), err
    assert not (tmp_path / "run").exists()


def test_the_largest_seed_passes_the_checks():
    from tilegraph.cli import check_config, load_config
    from tilegraph.cli.config import SEED_MAX

    cfg, source = load_config(None)
    cfg["train"]["seed"] = SEED_MAX
    check_config(cfg, source)  # (a gradient sketch hashes seed + layer in 8 bytes: room for 2**63 layers)


# ------------------------------------------------------------- weights, no config.json ----
@pytest.fixture
def weights_alone(good, tmp_path) -> Path:  # noqa: F811
    """A Hugging Face folder of the checkpoint, its config.json gone (the weights copied alone)."""
    hf = tmp_path / "hf"
    assert cli.main(["convert", str(good), str(hf)]) == 0
    (hf / "config.json").unlink()
    return hf


WANT_CONFIG = ("a Hugging Face folder with its config.json beside the weights: config.json describes the model "
               "(architecture and sizes), which is built before the weights are read; put the config.json that came "
               "with the weights into the folder; received: {hf} holds model.safetensors but no config.json")


@pytest.mark.parametrize("command", [
    ["generate", "{hf}", "--local"], ["eval", "{hf}", "--local"], ["convert", "{hf}", "{tmp}/dst"],
    ["convert", "{hf}", "{tmp}/dst", "--to", "zarr"], ["train", "--init", "{hf}", "--out", "{tmp}/run"],
])
def test_weights_without_config_json_are_named_as_such(capsys, weights_alone, tmp_path, command):
    capsys.readouterr()
    args = [a.format(hf=weights_alone, tmp=tmp_path) for a in command]
    err = _error(capsys, *args)
    where = "tilegraph train --init" if command[0] == "train" else f"tilegraph {command[0]}"
    assert err == f"tilegraph {command[0]}: error: [{where}] " + WANT_CONFIG.format(hf=weights_alone), err
    assert not (tmp_path / "dst").exists() and not (tmp_path / "run").exists()


def test_info_names_weights_without_config_json(capsys, weights_alone):
    capsys.readouterr()
    (weights_alone / "Config.json").write_text("{}")  # another spelling: named
    err = _error(capsys, "info", weights_alone)
    assert err.endswith(f"received: {weights_alone} holds model.safetensors but no config.json (Config.json is "
                        "there: the name must be config.json, in lower case), the weights of a Hugging Face model "
                        "without the file that describes it, and no zarr.json"), err
