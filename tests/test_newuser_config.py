"""``tilegraph train`` tried as a new user would: the shipped config copied and adapted to one's own
data and model. Each test runs the command in this process and stops it where the cluster would
start (:func:`stopped_at_connect`), or earlier at an error, so none of them trains."""

import json
import re

import pytest

import tilegraph


class Connected(Exception):
    """What the stand-in for ``tilegraph.connect`` raises: the job got past its checks and its data."""


@pytest.fixture
def stopped_at_connect(monkeypatch, tmp_path):
    """Work in ``tmp_path``; ``tilegraph.connect`` stops the job (nothing trains), after copying
    the output folder as the job left it then to ``run.at-connect`` (a job that stops before
    training removes what it wrote)."""
    import shutil

    def connect(*args, **kwargs):
        if (tmp_path / "run").is_dir():
            shutil.copytree(tmp_path / "run", tmp_path / "run.at-connect")
        raise Connected

    monkeypatch.setattr(tilegraph, "connect", connect)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _train(*args, out="run") -> int:
    from tilegraph.cli import main

    return main(["train", *args, "--out", out, "--no-progress"])


def _refused(capsys, *args) -> str:
    """The one line of error of a refused ``tilegraph train ARGS``."""
    code = _train(*args)
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err


def _corpus(folder, sizes):
    """Python files a.py, b.py, ... of ``sizes`` bytes each in ``folder``."""
    folder.mkdir()
    for name, size in zip("abcdefgh", sizes):
        line = "def f(x):\n    return x + 1\n"
        (folder / f"{name}.py").write_text((line * (size // len(line) + 1))[:size])


# ----------------------------------------------------------------------------------- [data] ----
def test_max_mb_limits_a_corpus_of_ones_own_files(stopped_at_connect, capsys):
    # max_mb applied to "stdlib" alone: a folder of one's own was read in full, whatever it said
    _corpus(stopped_at_connect / "corpus", [40_000, 40_000, 40_000])
    with pytest.raises(Connected):
        _train("--set", 'data.sources=["corpus"]', "--set", "data.max_mb=0.05")
    meta = json.loads((stopped_at_connect / "run.at-connect" / "tokens.bin.json").read_text())
    assert not (stopped_at_connect / "run").exists()  # stopped before training: nothing of it left
    assert sum(s["bytes"] for s in meta["sources"]) == 50_000
    assert [s.get("cut", False) for s in meta["sources"]] == [False, True] and meta["files_left_out"] == 1
    # what the train line says of the corpus
    from tilegraph.cli.train import build_corpus
    from tilegraph.io import ByteTokenizer

    data = {"sources": ["corpus"], "patterns": ["*.py"], "max_mb": 0.05}
    _, corpus = build_corpus(data, stopped_at_connect / "again.bin", ByteTokenizer(eos=True))
    assert corpus == "50,002 tokens from 2 files (the first 0.05 MB of text, [data] max_mb; 1 file after it not read)"


def test_a_validation_split_too_small_for_one_evaluation_batch_is_refused_before_training(stopped_at_connect,
                                                                                           capsys):
    # it failed in the evaluation after the last step, with a metrics.jsonl left that refused a rerun
    _corpus(stopped_at_connect / "corpus", [3000])
    err = _refused(capsys, "--set", 'data.sources=["corpus"]')
    assert ("[tilegraph train [data]] a validation split (val_fraction = 0.05 of the 3,001 tokens) holding one "
            "evaluation batch: train.batch_size / train.accum_steps = 8 windows of seq_len + 1 = 65 tokens") in err
    assert err.rstrip().endswith("received: 150 tokens, 2 windows")
    assert not (stopped_at_connect / "run" / "metrics.jsonl").exists()


def test_a_corpus_smaller_than_one_window_names_the_data_settings(stopped_at_connect, capsys):
    (stopped_at_connect / "tiny.txt").write_text("hello world\n")
    err = _refused(capsys, "--set", 'data.sources=["tiny.txt"]')
    assert re.search(r"\[tilegraph train \[data\]\] the train split must hold at least one window of seq_len \+ 1 "
                     r"= 65 tokens: give more text in sources, a smaller seq_len or a smaller val_fraction; "
                     r"received: 13 tokens", err)


def test_a_source_that_is_missing_is_named_as_data_sources(stopped_at_connect, capsys):
    err = _refused(capsys, "--set", 'data.sources=["nope"]')
    assert "[tilegraph train [data] sources] each source must be an existing text file or folder; received: nope" in err


def test_a_glob_among_the_sources_reads_the_files_it_matches(stopped_at_connect, capsys):
    # "corpus/*.py" was refused as no existing file or folder
    _corpus(stopped_at_connect / "corpus", [20_000, 20_000])
    (stopped_at_connect / "corpus" / "notes.md").write_text("not this one\n")
    with pytest.raises(Connected):
        _train("--set", 'data.sources=["corpus/*.py"]', "--set", 'data.patterns=["*.md"]')
    meta = json.loads((stopped_at_connect / "run.at-connect" / "tokens.bin.json").read_text())
    assert not (stopped_at_connect / "run").exists()  # stopped before training: nothing of it left
    assert [s["path"].rsplit("/", 1)[1] for s in meta["sources"]] == ["a.py", "b.py"]
    err = _refused(capsys, "--set", 'data.sources=["corpus/*.py", "other/*.txt"]')
    assert "[tilegraph train [data] sources] a glob that matches files or folders; received: 'other/*.txt' matches " \
           "nothing" in err


def test_stdlib_patterns_that_match_nothing_name_the_sources_and_patterns(stopped_at_connect, capsys):
    # was "no files found ...; received: no sources", with sources = ["stdlib"]
    err = _refused(capsys, "--set", 'data.patterns=["*.xyz"]')
    assert ("none of the standard library's files matches [data] patterns; received: sources = ['stdlib'], "
            "patterns = ['*.xyz']") in err


@pytest.mark.parametrize("value, found", [("bytes", "'bytes' (no such file)"), ('""', "'' (empty)"),
                                          (".", "'.' (a folder)")])
def test_a_tokenizer_that_is_neither_byte_nor_a_file_names_the_setting(stopped_at_connect, capsys, value, found):
    # "bytes" was "[tilegraph.io.BPETokenizer.load] expected a tokenizer JSON file; received: bytes"
    err = _refused(capsys, "--set", f"data.tokenizer={value}")
    assert (f'[tilegraph train [data] tokenizer] "byte", or the path of a BPE tokenizer JSON file '
            f"(tilegraph.io.BPETokenizer.save); received: {found}") in err


# ---------------------------------------------------------------------------------- [model] ----
@pytest.mark.parametrize("flavor", ["gpt2-debug", "llama-debug"])
def test_a_model_switch_given_as_text_is_refused(stopped_at_connect, capsys, flavor):
    # tie_embeddings = "no" (a non-empty string) tied the embeddings
    err = _refused(capsys, "--set", f"model.flavor={flavor}", "--set", "model.tie_embeddings=no")
    config = "GPT2Config" if flavor.startswith("gpt2") else "LlamaConfig"
    assert f"[tilegraph.models.{config}] tie_embeddings must be true or false; received: 'no'" in err


# ---------------------------------------------------------------------------------- [train] ----
def test_min_lr_above_lr_names_both_settings(stopped_at_connect, capsys):
    # was named as warmup_cosine's base_lr, after the corpus was read
    err = _refused(capsys, "--set", "train.min_lr=1e-2")
    assert "train.min_lr (0.01) must be at most train.lr (0.003): the learning rate decays from lr to min_lr" in err
    assert not (stopped_at_connect / "run" / "tokens.bin").exists()


def test_a_warmup_longer_than_the_run_is_said(stopped_at_connect, capsys):
    # warmup was cut to the run's steps without a word
    with pytest.raises(Connected):
        _train("--steps", "10", "--set", "data.max_mb=0.1")
    err = capsys.readouterr().err
    assert ("[train] warmup = 15 is more than the run's 10 steps: the learning rate rises over all 10 to "
            "lr = 0.003 (no decay to min_lr)") in err
    with pytest.raises(Connected):
        _train("--steps", "15", "--set", "data.max_mb=0.1", out="run2")
    assert "warmup" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- the end of a run ----
def test_a_max_seq_len_shorter_than_the_sample_prompt_ends_the_run_with_its_summary(tmp_path, capsys, monkeypatch):
    # the sample after training asked generate for -1 new tokens: exit status 2 after a good run,
    # its loss, checkpoint and metrics lines unprinted
    from tilegraph.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "1", "--out", "run", "--no-progress", "--set", "model.max_seq_len=3",
                 "--set", "data.seq_len=3", "--set", "data.max_mb=0.02", "--set", "train.warmup=0",
                 "--set", "train.eval_batches=1"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint: run/checkpoints/step-000001" in out
    assert "no sample: max_seq_len 3 leaves no room after the prompt 'def ' (4 tokens)" in out


# ---------------------------------------------------------------- session 20's CLI audit ----
def test_a_job_refused_for_its_data_leaves_no_output_behind(stopped_at_connect, capsys):
    _corpus(stopped_at_connect / "corpus", [3000])
    err = _refused(capsys, "--set", 'data.sources=["corpus"]')  # tokenized, then refused: too little validation
    assert "or a smaller batch_size (or a larger accum_steps)" in err
    assert not (stopped_at_connect / "run").exists()  # the folder it made, with its tokens.bin, is gone
    mine = stopped_at_connect / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    assert _train("--set", 'data.sources=["corpus"]', out="mine") == 2
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]  # what was there stays, what it added goes


def test_a_missing_relative_source_says_where_it_was_looked_for(stopped_at_connect, capsys):
    (stopped_at_connect / "proj").mkdir()
    (stopped_at_connect / "proj" / "corpus.txt").write_text("text\n" * 1000)
    (stopped_at_connect / "proj" / "my.toml").write_text('[data]\nsources = ["corpus.txt"]\n')
    code = _cli_main(["train", "proj/my.toml", "--out", "run", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"received: corpus.txt (looked for {stopped_at_connect / 'corpus.txt'}: a config's " \
        "relative paths are taken from the folder the command runs in, not the config's)" in err


def test_misspelt_keys_get_a_suggestion(stopped_at_connect, capsys):
    err = _refused(capsys, "--set", "train.stepz=3")
    assert "with a known key (did you mean train.steps?); received: 'train.stepz=3'" in err and len(err) < 200
    (stopped_at_connect / "t.toml").write_text("[trian]\nlr = 1\n[train]\nwarmpu = 2\n[model]\nn_layer = 2\n")
    assert _cli_main(["train", "t.toml", "--out", "run"]) == 2
    err = capsys.readouterr().err
    assert "unknown [trian] (did you mean [train]?), train.warmpu (did you mean warmup?) in t.toml" in err
    (stopped_at_connect / "m.toml").write_text("[model]\nn_layer = 2\n")
    assert _cli_main(["train", "m.toml", "--out", "run"]) == 2
    assert "received: unknown n_layer (did you mean n_layers?) ([model] of m.toml)" in capsys.readouterr().err
    err = _refused(capsys, "--set", "model.dim=-4")
    assert "dim must be a positive int; received: -4 ([model] of shipped default.toml" in err


def _cli_main(argv) -> int:
    from tilegraph.cli import main

    return main(argv)


def test_resuming_a_checkpoint_outside_a_run_folder_says_where_it_writes(tmp_path, monkeypatch, capsys):
    from tilegraph.cli.runs import output_folder

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck8").mkdir()
    out, _ = output_folder(None, "runs/default", {}, "ck8")
    assert str(out) == "runs/default"
    assert capsys.readouterr().err.strip() == ("tilegraph train: writing to runs/default ([output] dir): ck8 is not "
                                               "in a run's checkpoints folder (RUN/checkpoints/step-N), whose run "
                                               "would go on; --out names another")
    output_folder("elsewhere", "runs/default", {}, "ck8")  # --out given: nothing to say
    assert capsys.readouterr().err == ""
