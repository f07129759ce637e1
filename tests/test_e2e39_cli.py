"""`tilegraph train` / `eval` / `info` as a user meets them when resuming and reading data
(session 39's audit of the command line):

- a resume, or a new run from --init, with the very config that started the run (naming the
  shipped flavor, whose shipped dim the run has) is neither warned about nor refused;
- the note on relative paths goes only with a source that was not found (and a relative glob that
  matches nothing), a bad patterns or text_field is refused as such, before any work;
- a corpus shorter than one window names the user's files and the seq_len that fits, not the
  job's own tokens.bin;
- --resume (and info, eval) of a save's temporary folder, of a checkpoint that is gone, of a run
  that holds no checkpoint yet, and of a run whose recorded sources moved: one clear error each.

One 2-step run serves the tests; the errors come before any cluster starts."""

import json
import re
import shutil
from pathlib import Path

import pytest

from tilegraph._errors import TileError
from tilegraph.io import ByteTokenizer, build_token_file

pytestmark = pytest.mark.distributed

#: tests/test_cli.py's SMALL, on one worker process and a little text: the config names the
#: shipped flavor, so the run has the shipped config's dim 64 (the flavor's own is 32)
SMALL = """
[model]
flavor = "gpt2-debug"
vocab_size = "tokenizer"
[data]
max_mb = 0.05
seq_len = 32
[train]
steps = 2
batch_size = 4
warmup = 1
eval_every = 0
eval_batches = 1
[output]
checkpoint_every = 0
[runtime]
workers = 1
"""


def _run(capsys, *args) -> tuple[int, str, str]:
    from tilegraph.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _error(capsys, *args) -> str:
    """The one line of error of ``tilegraph ARGS`` (exit status 2)."""
    code, _, err = _run(capsys, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml`` and ``run``, a 2-step run of it (its checkpoint step-000002)."""
    from tilegraph.cli import main

    root = tmp_path_factory.mktemp("e2e39cli")
    (root / "small.toml").write_text(SMALL)
    here = Path.cwd()
    try:
        import os

        os.chdir(root)
        assert main(["train", "small.toml", "--out", "run", "--no-progress"]) == 0
    finally:
        os.chdir(here)
    assert (root / "run" / "checkpoints" / "step-000002" / "zarr.json").is_file()
    return root


# ------------------------------------------------------- the run's own config, resumed ----
def test_a_resume_with_the_config_that_started_the_run_warns_nothing(root, capsys, monkeypatch):
    """`tilegraph train small.toml --resume run/checkpoints/step-000002`, small.toml the config the
    run started from, printed "warning: flavor = 'gpt2-debug' has dim 32, ... dim 64 in small.toml
    not used": a config naming the shipped flavor keeps the shipped dim 64, and the check compared
    the flavor's own shape."""
    monkeypatch.chdir(root)
    shutil.copytree(root / "run", root / "again")
    code, out, err = _run(capsys, "train", "small.toml", "--resume", "again/checkpoints/step-000002", "--steps", "1",
                          "--no-progress")
    assert code == 0, err
    assert "warning" not in err, err
    assert "checkpoint: again/checkpoints/step-000003" in out


def test_a_new_run_from_the_checkpoint_of_its_own_config_is_not_refused(root, capsys, monkeypatch):
    """`tilegraph train small.toml --init run/checkpoints/step-000002 --out new` was refused:
    "[model] keys that agree with model.init's GPT2Config ...; received: flavor = 'gpt2-debug' has
    dim 32, run/checkpoints/step-000002 dim 64"."""
    monkeypatch.chdir(root)
    code, out, err = _run(capsys, "train", "small.toml", "--init", "run/checkpoints/step-000002", "--out", "fromit",
                          "--steps", "1", "--no-progress")
    assert code == 0, err
    assert "from run/checkpoints/step-000002" in out and "warning" not in err, err


def test_a_flavor_agrees_with_its_shape_with_or_without_the_inherited_keys():
    """The check of a given flavor against a model: the model the config trains (the flavor with
    the shipped dim it keeps) or one of the flavor's own shape agree; another is named, in the
    flavor's own numbers as before."""
    import dataclasses

    from tilegraph import models
    from tilegraph.cli.config import load_config
    from tilegraph.cli.finetune import architecture_disagreements, inherited_model_keys

    def model(**changes):
        return models.build(dataclasses.replace(models.config("gpt2-debug"), max_seq_len=64, **changes), seed=0)

    cfg, _ = load_config(None)
    given = {"model.flavor": "small.toml", "model.vocab_size": "small.toml"}
    inherited = inherited_model_keys(cfg, given)
    assert inherited == {"dim": 64}
    keys = {"flavor": "gpt2-debug"}
    assert architecture_disagreements(model(dim=64), keys, "ck", inherited) == []  # the config's model
    assert architecture_disagreements(model(), keys, "ck", inherited) == []  # the flavor's own
    assert architecture_disagreements(model(dim=48), keys, "ck", inherited) == [
        ("flavor", "flavor = 'gpt2-debug' has dim 32, ck dim 48")]
    assert architecture_disagreements(model(dim=64), keys, "ck") != []  # (without them: as it was)
    # another flavor keeps no shape keys of the shipped config
    other, _ = load_config(None)
    other["model"] = {k: v for k, v in other["model"].items() if k != "dim"} | {"flavor": "llama-debug"}
    assert inherited_model_keys(other, {"model.flavor": "x.toml"}) == {}


# ----------------------------------------------------------------------- reading the data ----
def _corpus(d: dict, tmp_path: Path):
    from tilegraph.cli.train import build_corpus

    return build_corpus({"patterns": ["*.txt"], "max_mb": 1, "text_field": "text", **d}, tmp_path / "tokens.bin",
                        ByteTokenizer(eos=True))


def test_the_relative_path_note_goes_only_with_a_source_not_found(tmp_path, monkeypatch):
    """The note "(looked for CWD/...: a config's relative paths are taken from the folder the
    command runs in...)" was added to any received that was no existing path: "received:
    ['/abs/*.txt'] (looked for /cwd/['/abs/*.txt']: ...)". A bad patterns or text_field is now
    named by its key; a relative glob that matches nothing gets the note."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(TileError) as e:
        _corpus({"sources": ["docs"], "patterns": ["/abs/*.txt"]}, tmp_path)
    assert str(e.value).startswith("[tilegraph train [data] patterns] patterns must be") and "looked for" not in str(
        e.value)
    with pytest.raises(TileError) as e:
        _corpus({"sources": ["docs/a.jsonl"], "text_field": ""}, tmp_path)
    assert str(e.value).startswith("[tilegraph train [data] text_field] text_field must") and "looked for" not in str(
        e.value)
    with pytest.raises(TileError) as e:
        _corpus({"sources": ["missing.txt"]}, tmp_path)
    assert str(e.value).endswith(f"received: missing.txt (looked for {tmp_path / 'missing.txt'}: a config's "
                                 "relative paths are taken from the folder the command runs in, not the config's)")
    with pytest.raises(TileError) as e:
        _corpus({"sources": ["nodocs/*.txt"]}, tmp_path)
    assert str(e.value).endswith(f"received: 'nodocs/*.txt' matches nothing (looked for {tmp_path / 'nodocs/*.txt'}: "
                                 "a config's relative paths are taken from the folder the command runs in, not the "
                                 "config's)")
    with pytest.raises(TileError) as e:
        _corpus({"sources": [str(tmp_path / "missing.txt")]}, tmp_path)
    assert "looked for" not in str(e.value)
    with pytest.raises(TileError) as e:  # a folder of .json records: the patterns that read them
        _corpus({"sources": ["docs"], "patterns": ["*.md"]}, tmp_path)
    assert 'for .json records patterns = ["*.json"]' in str(e.value) and "looked for" not in str(e.value)


@pytest.mark.parametrize("key, value, want", [
    ("patterns", ["/abs/*.txt"], "data.patterns must be a non-empty list of file name patterns, each relative"),
    ("patterns", [""], "data.patterns must be a non-empty list of file name patterns, each relative"),
    ("text_field", "", "data.text_field must be a non-empty string, not ''"),
])
def test_bad_patterns_and_text_field_are_refused_with_the_config(key, value, want):
    """They passed the config's checks and failed once the job read its data, named as [data]
    sources (after a cluster at [runtime] address had been reached)."""
    from tilegraph.cli.config import check_config, load_config

    cfg, _ = load_config(None)
    cfg["data"][key] = value
    with pytest.raises(TileError, match=re.escape(want)):
        check_config(cfg, "x.toml")


def test_the_shipped_config_says_text_field_reads_json_files_too():
    import importlib.resources

    text = (importlib.resources.files("tilegraph.configs") / "default.toml").read_text()
    assert ('text_field = "text"         # the field of the records of a JSON Lines (.jsonl, .ndjson) or .json file '
            "that holds their text: a document each") in text


def _splits(tmp_path: Path, text: str, seq_len: int, name: str = "tiny.txt", batch_size: int = 8):
    from tilegraph.cli.train import open_splits

    (tmp_path / name).write_text(text)
    meta = build_token_file([tmp_path / name], tmp_path / "tokens.bin", ByteTokenizer(eos=True))
    d = {"seq_len": seq_len, "val_fraction": 0.05, "sources": [name]}
    return open_splits(tmp_path / "tokens.bin", d, {"seed": 0, "batch_size": batch_size, "accum_steps": 1},
                       meta["count"], meta["sources"])


def test_a_corpus_shorter_than_one_window_names_the_users_file_and_what_fits(tmp_path, monkeypatch):
    """It said "received: 4,752 tokens (5,002 in tokens.bin, val_fraction=0.05)": the job's own
    token file (removed when the job is refused), not the user's. Now the file read, and the
    largest seq_len that fits (which does)."""
    monkeypatch.chdir(tmp_path)
    text = "word " * 1000 + "\n"  # 5,002 tokens with the end-of-text
    with pytest.raises(TileError) as e:
        _splits(tmp_path, text, 5000)
    message = str(e.value)
    assert "tokens.bin" not in message
    assert message.endswith("received: 4,752 tokens in the train split of the 5,002 tokens from tiny.txt "
                            "(val_fraction = 0.05); seq_len = 31 at most fits them"), message
    _splits(tmp_path, text, 31)  # it does
    with pytest.raises(TileError, match="holding one evaluation batch"):
        _splits(tmp_path, text, 32)
    with pytest.raises(TileError) as e:  # too little for any window
        _splits(tmp_path, "hello world\n", 64)
    assert str(e.value).endswith("received: 13 tokens in the train split of the 13 tokens from tiny.txt "
                                 "(val_fraction = 0.05); no seq_len fits them: the validation split holds 0 tokens, "
                                 "too few for an evaluation batch of 8 windows (train.batch_size / "
                                 "train.accum_steps): give more text, or a larger val_fraction")


# -------------------------------------------------- resuming what is no checkpoint (yet) ----
def test_resume_info_and_eval_of_a_saves_temporary_folder_name_it(root, capsys, monkeypatch):
    """A save's temporary folder (``.step-N.tmp-PID-HEX-HOST``) was "[tilegraph.io.load_checkpoint(...)]
    a tilegraph checkpoint folder (a Zarr group with zarr.json); received: ... is not one"."""
    monkeypatch.chdir(root)
    tmp = root / "run" / "checkpoints" / ".step-000004.tmp-999-abcd-somehost"
    shutil.copytree(root / "run" / "checkpoints" / "step-000002", tmp)
    (tmp / "zarr.json").unlink()
    try:
        shown = "run/checkpoints/.step-000004.tmp-999-abcd-somehost"
        for command, where in ((["train", "small.toml", "--resume", shown], "tilegraph train --resume"),
                               (["info", shown], "tilegraph info")):
            err = _error(capsys, *command)
            assert err.endswith(f"[{where}] a checkpoint folder (RUN/checkpoints/step-N of tilegraph train), not the "
                                "temporary folder of a save: it becomes run/checkpoints/step-000004 once its save "
                                "completes; a save under way, or one that was interrupted, leaves it, and it is never "
                                "loaded; the newest complete checkpoint is run/checkpoints/step-000002; received: "
                                f"{shown}, a save's temporary folder"), err
        err = _error(capsys, "eval", shown, "--local")
        assert "the temporary folder of a save: it becomes run/checkpoints/step-000004" in err, err
    finally:
        shutil.rmtree(tmp)


def test_resume_of_a_checkpoint_that_is_gone_names_those_there(root, capsys, monkeypatch):
    monkeypatch.chdir(root)
    err = _error(capsys, "train", "small.toml", "--resume", "run/checkpoints/step-000001")
    assert err.endswith("received: run/checkpoints/step-000001 does not exist (run/checkpoints holds step-000002, "
                        "the newest run/checkpoints/step-000002; [output] checkpoint_keep keeps the newest "
                        "checkpoints of a run, deleting older ones)"), err


def test_a_run_without_a_checkpoint_yet_is_named_as_such(root, capsys, monkeypatch):
    """A run folder before its first checkpoint (a save under way) was "[tilegraph.io.load_checkpoint(half)]
    a tilegraph checkpoint folder (a Zarr group with zarr.json); received: half is not one" from
    info and --resume, and "holds neither" from eval."""
    monkeypatch.chdir(root)
    half = root / "half"
    (half / "checkpoints").mkdir(parents=True)
    shutil.copy(root / "run" / "metrics.jsonl", half)
    (half / "checkpoints" / ".step-000002.tmp-999-abcd-somehost").mkdir()
    what = ("a run writes one every [output] checkpoint_every steps and at its end; received: half, a run folder of "
            "tilegraph train without a complete checkpoint yet; the temporary folder of a save under way or "
            "interrupted: .step-000002.tmp-999-abcd-somehost")
    assert _error(capsys, "info", "half").endswith(what)
    assert _error(capsys, "train", "small.toml", "--resume", "half").endswith(what)
    assert _error(capsys, "train", "small.toml", "--resume", "half/checkpoints").endswith(
        what.replace("half, a run folder of tilegraph train", "half/checkpoints, the checkpoints folder of a run"))
    err = _error(capsys, "eval", "half", "--local")
    assert "received: half holds neither (a run folder of tilegraph train without a complete checkpoint yet" in err


def test_a_resume_whose_recorded_sources_moved_says_where_they_come_from(root, capsys, monkeypatch):
    """A run on one's own text, resumed without its config after the text moved, said only "each
    source must be an existing text file or folder; received: /abs/corpus.txt"."""
    monkeypatch.chdir(root)
    run = root / "moved"
    shutil.copytree(root / "run", run)
    record = run / "checkpoints" / "step-000002" / "tilegraph_data.json"
    data = json.loads(record.read_text())
    data["sources"] = [str(root / "gone.txt")]
    record.write_text(json.dumps(data))
    err = _error(capsys, "train", "--resume", "moved/checkpoints/step-000002", "--steps", "1")
    assert ("each source must be an existing text file or folder: the resumed run reads the text of the run it "
            "continues, from the [data] sources moved/checkpoints/step-000002/tilegraph_data.json records "
            f"({root / 'gone.txt'}); put them back, or name where they are now: --set 'data.sources=[\"PATH\"]'") in err
    assert err.endswith(f"received: {root / 'gone.txt'}")


def test_a_folder_inside_a_checkpoint_names_the_checkpoint(root, capsys, monkeypatch):
    """Its model/ folder (a tab completion too far) was "[tilegraph.io.load_checkpoint(...)] a
    tilegraph checkpoint (a Zarr group without tilegraph's attributes is not one)"."""
    monkeypatch.chdir(root)
    ck = "run/checkpoints/step-000002"
    for command, where in ((["train", "small.toml", "--resume", f"{ck}/model"], "tilegraph train --resume"),
                           (["info", f"{ck}/model/wte.weight"], "tilegraph info")):
        err = _error(capsys, *command)
        assert f"[{where}] a checkpoint folder (RUN/checkpoints/step-N of tilegraph train), not a folder inside one: " \
               f"pass {ck}; received: {command[-1]}, inside the checkpoint {ck}" in err, err
    err = _error(capsys, "eval", f"{ck}/optimizer", "--local")
    assert f"not a folder inside one: pass {ck}; received: {ck}/optimizer, inside the checkpoint {ck}" in err, err


def test_a_token_file_among_the_sources_is_named_as_one(root, tmp_path):
    """A run's tokens.bin given as [data] sources was "expected a UTF-8 text file; this one contains
    NUL bytes (binary?)", nothing saying it is a token file nor what to give instead."""
    tokens = root / "run" / "tokens.bin"
    with pytest.raises(TileError) as e:
        _corpus({"sources": [str(tokens)]}, tmp_path)
    assert (f"contains NUL bytes (binary?): {tokens} is a token file of tilegraph (a run's tokens.bin, "
            "build_token_file), ids of its tokenizer; [data] sources takes text: the files it was made from") in str(
        e.value)
    (tmp_path / "other.bin").write_bytes(b"\x00\x01" * 10)  # binary, no token file: as it was
    with pytest.raises(TileError) as e:
        _corpus({"sources": [str(tmp_path / "other.bin")]}, tmp_path)
    assert "token file" not in str(e.value) and "contains NUL bytes (binary?); received:" in str(e.value)


def test_a_resume_whose_recorded_text_changed_says_so(root, capsys, monkeypatch):
    """A resume without [data] keys whose recorded sources hold other text now (a file edited) was
    told to "leave [data] sources, patterns, max_mb and tokenizer as that run had them", none of
    which it gave."""
    monkeypatch.chdir(root)
    run = root / "edited"
    shutil.copytree(root / "run", run)
    (root / "text.txt").write_text("other text\n" * 2000)
    record = run / "checkpoints" / "step-000002" / "tilegraph_data.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "sources": [str(root / "text.txt")]}))
    err = _error(capsys, "train", "--resume", "edited/checkpoints/step-000002", "--steps", "1")
    assert ("from the [data] sources its checkpoint records (tilegraph_data.json), which the job reads: they hold "
            "other text now than when the run read them") in err and "leave [data] sources" not in err, err
    assert re.search(r"received: 22,001 tokens \(sha256 \w+\); read then, not now: \S+\.py, \S+\.py, \S+\.py and "
                     rf"5 more; read now, not then: {re.escape(str(root / 'text.txt'))}$", err), err
    assert not list(run.glob(".tokens.resumed*"))  # the run's token file as it was
