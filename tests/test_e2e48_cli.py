"""The command line on settings and records it took without a word (three gaps an audit left):

- ``tilegraph train`` with text files alone and a ``[data] text_field`` the user set (config file or
  ``--set``): ignored, unsaid (eval's ``--text-field`` was refused there already); records among
  the sources still take it, and the shipped config's value in a copy of it is no choice;
- ``tilegraph info`` of a checkpoint whose tilegraph_data.json is JSON but holds bad values (a
  seq_len of -3 or "abc", a text_field "" or 5): shown as they were, without a word;
- ``tilegraph train --resume`` of a checkpoint whose records (tilegraph_data.json, the Trainer's and
  the optimizer's values in zarr.json, the adapters' record) hold bad values: taken as they were
  (passed over, a failure inside the first step or on the schedule, or refused as the job's own
  settings); now one error naming the file, the key, what it must be and what it holds, and the
  run folder left as it was.

The refusals run in this process (``cli.main``), before any cluster starts; one 2-step run (a
subprocess) serves the --resume tests, the small checkpoint of test_cli_damaged.py the info ones."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_cli import _cli  # `python -m tilegraph.cli` in a subprocess
from test_e2e47_clidamage import _error, _main, ck, good  # noqa: F401  (ck, good: a small checkpoint recording a run's [data])


CONFIG = """
[model]
flavor = "gpt2-debug"
vocab_size = "tokenizer"
[data]
sources = ["corpus.txt"]
seq_len = 16
[train]
steps = 2
batch_size = 2
warmup = 1
eval_every = 0
eval_batches = 1
"""

#: what --resume says of a checkpoint whose records hold bad values ({ck}: the checkpoint as given)
BAD_RECORDS = ("tilegraph train: error: [tilegraph train --resume] a checkpoint whose records hold values as tilegraph "
               "train writes them: a resumed run takes the run's settings from them (tilegraph_data.json: its [data] "
               "and token count; zarr.json: its batches, evaluations, optimizer and learning-rate schedule; the "
               "adapters' record: its [peft]); put the run's files back (the same file of another of its "
               "checkpoints), or start a new run from its weights (--init {ck} and another --out); received: ")


def _snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry below ``folder``: its kind, and for a file its size, mtime and digest."""
    found = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            found[str(p.relative_to(folder))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            found[str(p.relative_to(folder))] = ("dir",)
    return found


# ----------------------------------------------------------------- train [data] text_field ----
@pytest.fixture
def texts(tmp_path, monkeypatch) -> Path:
    """``tmp_path`` as the working folder, holding c.toml (CONFIG), corpus.txt and a folder of
    text files (docs/a.txt, docs/b.md)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "corpus.txt").write_text("hello world, this is some text. " * 200)
    (tmp_path / "docs").mkdir()
    for name in ("a.txt", "b.md"):
        (tmp_path / "docs" / name).write_text("some words of text " * 100)
    return tmp_path


def test_train_refuses_a_text_field_set_on_the_command_line_for_text_files(capsys, texts):
    err = _error(capsys, "train", "c.toml", "--set", "data.text_field=body", "--out", "run", "--no-progress")
    assert err == ("tilegraph train: error: [tilegraph train [data] text_field] files of records among the sources "
                   "(JSON Lines: .jsonl, .ndjson; or .json): it names the field of their records that holds the text; "
                   "a text file is read whole and has no fields (leave [data] text_field out); received: text_field = "
                   f"'body' (--set data.text_field=body) with 1 text file ({texts / 'corpus.txt'})"), err
    assert not (texts / "run").exists()
    # a folder of text files: each named (the patterns that read them too)
    err = _error(capsys, "train", "c.toml", "--set", "data.text_field=body", "--set", 'data.sources=["docs"]',
                 "--set", 'data.patterns=["*.txt", "*.md"]', "--out", "run", "--no-progress")
    assert err.endswith(f"received: text_field = 'body' (--set data.text_field=body) with 2 text files "
                        f"({texts / 'docs' / 'a.txt'}, {texts / 'docs' / 'b.md'})"), err
    assert not (texts / "run").exists()


@pytest.mark.parametrize("value", ["body", "text"])
def test_train_refuses_a_text_field_of_a_config_file_for_text_files(capsys, texts, value):
    """Another field than the shipped config's "text" in a config file, and any on the command line
    ("text" too, as eval's --text-field text): the user's choice, refused."""
    (texts / "mine.toml").write_text(CONFIG.replace("seq_len = 16", f'seq_len = 16\ntext_field = "{value}"'))
    if value == "body":
        err = _error(capsys, "train", "mine.toml", "--out", "run", "--no-progress")
        assert err.endswith(f"(leave [data] text_field out); received: text_field = 'body' (in mine.toml) with 1 text "
                            f"file ({texts / 'corpus.txt'})"), err
    err = _error(capsys, "train", "c.toml", "--set", f"data.text_field={value}", "--out", "run", "--no-progress")
    assert err.endswith(f"received: text_field = '{value}' (--set data.text_field={value}) with 1 text file "
                        f"({texts / 'corpus.txt'})"), err
    assert not (texts / "run").exists()


def test_a_text_field_with_records_among_the_sources_or_the_shipped_one_is_taken(texts):
    """The corpus as train builds it: a text file and JSON Lines with the field the user named
    (the field read from the records), and the shipped config's "text" in a copy of it (no
    choice of the user's: every copy holds it) with text files alone."""
    from tilegraph.cli.runs import given_settings
    from tilegraph.cli.train import build_corpus, text_field_choice
    from tilegraph.io import ByteTokenizer

    (texts / "r.jsonl").write_text("".join(json.dumps({"body": f"record {i} of text " * 4}) + "\n" for i in range(40)))
    d = {"sources": ["corpus.txt", "r.jsonl"], "patterns": ["*.txt"], "max_mb": 1.0, "text_field": "body"}
    given = given_settings(None, ["data.text_field=body"], {})
    assert text_field_choice(d, given) == "--set data.text_field=body"
    meta, corpus = build_corpus(d, texts / "tokens.bin", ByteTokenizer(eos=True), text_field_choice(d, given))
    assert meta["text_field"] == "body" and corpus.endswith("from 2 files"), (meta, corpus)
    # the shipped config's value in a config file: not the user's choice, nothing refused
    (texts / "copy.toml").write_text('[data]\ntext_field = "text"\n')
    d = {"sources": ["corpus.txt"], "patterns": ["*.txt"], "max_mb": 1.0, "text_field": "text"}
    assert text_field_choice(d, given_settings("copy.toml", [], {})) is None
    assert text_field_choice(d, given_settings(None, [], {})) is None  # unset: the default
    meta, _ = build_corpus(d, texts / "t2.bin", ByteTokenizer(eos=True), None)
    assert "text_field" not in meta


# --------------------------------------------------------------- info: bad data values ----
@pytest.mark.parametrize("key, value, said", [
    ("seq_len", -3, "seq_len = -3 (not an integer >= 1)"),
    ("seq_len", "abc", "seq_len = 'abc' (not an integer >= 1)"),
    ("text_field", "", "text_field = '' (not a non-empty string)"),
    ("text_field", 5, "text_field = 5 (not a non-empty string)"),
])
def test_info_names_bad_values_of_the_data_record(capsys, ck, key, value, said):  # noqa: F811
    code, out, err = _main(capsys, "info", ck)
    assert code == 0 and "bad values" not in out, (out, err)  # the record as a run writes it
    record = json.loads((ck / "tilegraph_data.json").read_text())
    (ck / "tilegraph_data.json").write_text(json.dumps({**record, key: value}))
    code, out, err = _main(capsys, "info", ck)
    assert code == 0, err  # as info does for an unreadable record: what it can, then the rest
    assert f"data (tilegraph_data.json): bad values, {ck}/tilegraph_data.json: {said} (values no run writes: edited " \
           "or damaged; tilegraph eval and train --resume refuse them where they read them)\n" in out, out
    assert f"{key} = {value!r}" in out.split("bad values")[0]  # the record itself, still shown
    assert "tokenizer (tilegraph_tokenizer.json): " in out and "chunks: every chunk file there" in out


def test_info_names_every_bad_value_of_the_data_record_at_once(capsys, ck):  # noqa: F811
    record = json.loads((ck / "tilegraph_data.json").read_text())
    (ck / "tilegraph_data.json").write_text(json.dumps({**record, "seq_len": 0, "tokens": "many",
                                                        "tokenizer": 5}))
    code, out, err = _main(capsys, "info", ck)
    assert code == 0, err
    assert (f"bad values, {ck}/tilegraph_data.json: seq_len = 0 (not an integer >= 1), tokens = 'many' (not an "
            "integer >= 0), tokenizer = 5 (not a non-empty string: \"byte\" or a path) (values") in out, out


# ------------------------------------------------------------------ --resume: bad records ----
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A folder holding c.toml, corpus.txt and ``run``: a 2-step run of CONFIG (one checkpoint)."""
    root = tmp_path_factory.mktemp("e2e48")
    (root / "c.toml").write_text(CONFIG)
    (root / "corpus.txt").write_text("hello world, this is some text. " * 400)
    run = _cli("train", "c.toml", "--out", "run", "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    return root


@pytest.fixture
def resumable(base, tmp_path, monkeypatch) -> Path:
    """A copy of ``base``'s run folder as ``run`` in the working folder ``tmp_path``."""
    shutil.copytree(base / "run", tmp_path / "run")
    shutil.copy(base / "corpus.txt", tmp_path / "corpus.txt")
    monkeypatch.chdir(tmp_path)
    return tmp_path / "run"


CK = "run/checkpoints/step-000002"


def _data(record: dict, key: str, value) -> None:
    record["data"][key] = value


def _attr(*path):
    def edit(record: dict, _, value) -> None:
        section = record["zarr"]["attributes"]["tilegraph"]
        for part in path[:-1]:
            section = section[part]
        section[path[-1]] = value
    return edit


@pytest.mark.parametrize("edit, key, value, said", [
    (_data, "seq_len", -3, "tilegraph_data.json: seq_len = -3 (not an integer >= 1)"),
    (_data, "seq_len", "abc", "tilegraph_data.json: seq_len = 'abc' (not an integer >= 1)"),
    (_data, "text_field", 5, "tilegraph_data.json: text_field = 5 (not a non-empty string)"),
    (_data, "tokens", -1, "tilegraph_data.json: tokens = -1 (not an integer >= 0)"),
    (_data, "tokenizer", 5, "tilegraph_data.json: tokenizer = 5 (not a non-empty string: \"byte\" or a path)"),
    (_attr("trainer", "batch_size"), None, "2", "zarr.json: trainer.batch_size = '2' (not an integer >= 1, as "
                                                "[train] batch_size)"),
    (_attr("trainer", "rng", "data_seed"), None, -5, "zarr.json: trainer.rng.data_seed = -5 (not an integer in "
                                                     "[0, 2**63 - 1], as [train] seed)"),
    (_attr("trainer", "rng"), None, "x", "zarr.json: trainer.rng = 'x' (not a JSON object)"),
    (_attr("trainer", "eval_batches"), None, 0, "zarr.json: trainer.eval_batches = 0 (not an integer >= 1, as "
                                                "[train] eval_batches)"),
    (_attr("optimizer", "hyper", "weight_decay"), None, "x", "zarr.json: optimizer.hyper.weight_decay = 'x' (not a "
                                                             "number >= 0, as [train] weight_decay)"),
    (_attr("optimizer", "schedule", "total"), None, "x", "zarr.json: optimizer.schedule.total = 'x' (not an integer "
                                                         ">= 1, as [train] steps)"),
])
def test_resume_refuses_a_bad_recorded_value_naming_file_and_key(capsys, resumable, edit, key, value, said):
    ckpt = resumable / "checkpoints" / "step-000002"
    record = {"data": json.loads((ckpt / "tilegraph_data.json").read_text()),
              "zarr": json.loads((ckpt / "zarr.json").read_text())}
    edit(record, key, value)
    (ckpt / "tilegraph_data.json").write_text(json.dumps(record["data"]))
    (ckpt / "zarr.json").write_text(json.dumps(record["zarr"]))
    before = _snapshot(resumable)
    err = _error(capsys, "train", "--resume", CK, "--steps", 1, "--no-progress")
    assert err == BAD_RECORDS.format(ck=CK) + f"{CK}/{said}", err
    assert _snapshot(resumable) == before  # nothing written, moved or removed


def test_resume_names_every_bad_value_and_the_adapters_record(capsys, resumable):
    ckpt = resumable / "checkpoints" / "step-000002"
    record = json.loads((ckpt / "tilegraph_data.json").read_text())
    (ckpt / "tilegraph_data.json").write_text(json.dumps({**record, "seq_len": 0, "val_fraction": 2}))
    (ckpt / "tilegraph_peft.json").write_text(json.dumps({"method": "lora", "rank": -1, "alpha": 16,
                                                          "targets": ["attn.q"]}))
    before = _snapshot(resumable)
    err = _error(capsys, "train", "--resume", CK, "--steps", 1, "--no-progress")
    assert err.endswith(f"received: {CK}/tilegraph_data.json: seq_len = 0 (not an integer >= 1); "
                        f"{CK}/tilegraph_data.json: val_fraction = 2 (not a number > 0 and < 1); "
                        f"{CK}/tilegraph_peft.json: rank = -1 (not an integer >= 1, as [peft] rank)"), err
    assert _snapshot(resumable) == before


def test_resume_refuses_a_text_field_set_for_the_runs_text_files(capsys, resumable):
    """The run's text is a text file (its record's sources): a text_field given is refused, the
    run folder (its tokens.bin) untouched."""
    corpus = json.loads((resumable / "checkpoints" / "step-000002" / "tilegraph_data.json").read_text())["sources"]
    before = _snapshot(resumable)
    err = _error(capsys, "train", "--resume", CK, "--steps", 1, "--set", "data.text_field=body", "--no-progress")
    assert err.endswith(f"(leave [data] text_field out); received: text_field = 'body' (--set data.text_field=body) "
                        f"with 1 text file ({corpus[0]})"), err
    assert _snapshot(resumable) == before
