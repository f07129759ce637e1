"""Bad input to the command line is one clear line (``tilegraph <cmd>: error: [where] what;
received: ...``, exit status 2), never a traceback: config files, settings, generate's flags,
convert's --quantize; and a reader that goes away (``| head -1``) ends a command quietly."""

import dataclasses
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from test_cli import _cli  # runs `python -m tilegraph.cli` in a subprocess

import tilegraph as tg


def _main(capsys, *args):
    """``tilegraph ARGS`` in this process (faster than a subprocess; an uncaught exception fails
    the test as a traceback would): its exit status and its one line of error."""
    from tilegraph.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A Hugging Face folder and a Zarr checkpoint of a debug GPT-2 whose vocabulary holds the byte
    tokenizer's ids (generate them with --tokenizer byte)."""
    from tilegraph import models
    from tilegraph.io.zarr import save_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
    model.to_hf(root / "hf")
    save_checkpoint(root / "zarr", model)
    return root


# ------------------------------------------------------------------------------ train: config ----
def test_a_config_file_that_cannot_be_read_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    err = _main(capsys, "train", "folder", "--out", "run")
    assert "a TOML config file, not a folder; received: folder (a folder)" in err
    (tmp_path / "latin1.toml").write_bytes(b"\xff[train]\n")
    err = _main(capsys, "train", "latin1.toml", "--out", "run")
    assert re.search(r"a TOML config file in UTF-8; received: latin1\.toml: 'utf-8' codec can't decode byte 0xff", err)
    assert not (tmp_path / "run").exists()


def test_a_config_section_that_is_no_table_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for text in ("train = 3\n", "model = 3\n"):
        (tmp_path / "flat.toml").write_text(text)
        err = _main(capsys, "train", "flat.toml", "--out", "run")
        assert f"sections ([train], ...) that are tables of settings; received: {text.strip()} in flat.toml" in err


def test_a_folder_as_config_is_one_line_from_the_command(tmp_path):
    run = _cli("train", str(tmp_path), "--out", "run", cwd=tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("tilegraph train: error: [tilegraph train] a TOML config file, not a folder")


@pytest.mark.parametrize("args, message", [
    (["--set", "data.max_mb=inf"], r"data\.max_mb must be a finite number, not inf"),
    (["--set", "train.step_timeout=inf"], r"train\.step_timeout must be a finite number, not inf"),
    (["--lr", "inf"], r"train\.lr must be a finite number, not inf"),
    # every float setting, [model] ones too; a value out of range keeps its range's message
    (["--set", "train.min_lr=inf", "--set", "train.weight_decay=inf", "--set", "train.clip_grad_norm=inf",
      "--set", "peft.alpha=inf", "--set", "peft.scale=inf", "--set", "model.norm_eps=nan",
      "--set", "train.lr=-inf"],
     [r"train\.lr must be a number > 0, not -inf"]
     + [rf"{name} must be a finite number, not {value}[; ]" for name, value in (
         ("train.min_lr", "inf"), ("train.weight_decay", "inf"), ("train.clip_grad_norm", "inf"),
         ("peft.alpha", "inf"), ("peft.scale", "inf"), ("model.norm_eps", "nan"))]),
    # the job validates on at least one window of the val split, at the end even with eval_every = 0
    (["--set", "data.val_fraction=0"], r"data\.val_fraction must be a number > 0 and < 1, not 0"),
    (["--set", "data.val_fraction=0", "--set", "train.eval_every=0"], r"data\.val_fraction must be a number > 0"),
    # a share of every batch per worker process: named as the settings (it was Executable's batch_tiles, after
    # the cluster started)
    (["--set", "runtime.workers=2", "--set", "runtime.parallel=data", "--set", "train.batch_size=1"],
     r"train\.batch_size / train\.accum_steps \(1 / 1\) must give each of the runtime\.workers \(2\) worker "
     r"processes a sequence with runtime\.parallel = 'data'"),
    (["--set", "runtime.workers=3", "--set", "runtime.parallel=sharded", "--set", "train.batch_size=4",
      "--set", "train.accum_steps=2"], r"\(4 / 2\) must give each of the runtime\.workers \(3\)"),
    # zero3 runs as Dask tasks: a gang asked for was refused when the first step was planned
    (["--set", "runtime.workers=2", "--set", "runtime.parallel=zero3", "--set", "runtime.exchange=gang"],
     r"runtime\.exchange must be \"auto\" or \"tasks\" with runtime\.parallel = \"zero3\" \(.*\), not \"gang\""),
])
def test_settings_that_cannot_run_are_refused_before_any_work(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(tmp_path)
    err = _main(capsys, "train", "--out", "run", *args)
    assert all(re.search(m, err) for m in ([message] if isinstance(message, str) else message)), err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------- generate ----
@pytest.mark.parametrize("args, message", [
    (["--strategy", "sample", "--seed", "-1"], r"--seed must be an integer >= 0; received: --seed=-1"),
    (["--strategy", "sample", "--seed", "-1", "--local"], r"--seed must be an integer >= 0"),
    # 0 is out of range as -1 is (it was taken for "not given", then greedy refused it)
    (["--top-k", "0"], r"--top-k must be an integer >= 1; received: --top-k=0"),
    (["--top-p", "0"], r"--top-p must be a number > 0 and <= 1; received: --top-p=0\.0"),
    (["--strategy", "sample", "--temperature", "inf"], r"--temperature must be a finite number > 0"),
    (["--repetition-penalty", "0"], r"--repetition-penalty must be a finite number > 0"),
    (["--max-new-tokens", "-3"], r"--max-new-tokens must be an integer >= 0"),
    # greedy decoding ignores a temperature: refused, as --top-k and --top-p are
    (["--temperature", "0.5"], r"greedy decoding .* takes no --top-k, --top-p or --temperature \(to sample: "
                               r"--strategy sample, top_k or top_p\); received: --temperature 0\.5 \(greedy: the "
                               r"default strategy without --top-k or --top-p\)"),
    (["--strategy", "greedy", "--temperature", "1"], r"received: --temperature 1\.0 with --strategy greedy"),
    (["--strategy", "top_k"], r"--strategy top_k needs --top-k and no --top-p \(--strategy sample combines both\); "
                              r"received: --strategy top_k$"),
    (["--strategy", "top_p", "--top-k", "3", "--top-p", "0.5"],
     r"--strategy top_p needs --top-p and no --top-k .*received: --strategy top_p --top-k 3 --top-p 0\.5$"),
])
def test_generate_flags_are_checked_and_named_as_flags(ckpt, capsys, args, message):
    err = _main(capsys, "generate", str(ckpt / "hf"), "--tokenizer", "byte", *args)
    assert err.startswith("tilegraph generate: error: [tilegraph generate] ") and re.search(message, err.strip()), err


def test_generate_samples_with_the_flags_it_accepts(ckpt, capsys):
    from tilegraph.cli import main

    for args in (["--top-k", "5", "--temperature", "0.7", "--seed", "3"], ["--strategy", "sample", "--top-p", "0.9"],
                 []):
        assert main(["generate", str(ckpt / "hf"), "--tokenizer", "byte", "--local", "--max-new-tokens", "3",
                     "--ids", *args]) == 0
        ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1].split()
        assert len(ids) == 7 and ids[:4] == ["100", "101", "102", "32"]  # "def " and 3 new tokens


def test_a_prompt_that_leaves_no_room_is_named(ckpt, capsys):
    # the default --max-new-tokens fills the model's max_seq_len (32): it was negative, and named so
    err = _main(capsys, "generate", str(ckpt / "hf"), "--tokenizer", "byte", "--prompt", "x" * 40)
    assert "a --prompt of fewer tokens than the model's max_seq_len=32 (room for new ones); received: 40 tokens" in err


def test_generate_refuses_a_tokenizer_whose_ids_the_model_lacks(tmp_path, capsys, monkeypatch):
    """A checkpoint whose recorded tokenizer (the byte one, 257 ids) has ids past the model's
    vocabulary (96): named before any generation (a prompt of spaces fits, so generation ran and
    failed on the end of text id)."""
    from tilegraph import models
    from tilegraph.cli import tokenizer_files
    from tilegraph.io import ByteTokenizer
    from tilegraph.io.zarr import save_checkpoint

    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=96), seed=0)
    save_checkpoint(tmp_path / "ck", model, files=tokenizer_files(ByteTokenizer(eos=True)))
    generation = sys.modules["tilegraph.models.generate"]  # the module (tilegraph.models.generate is its function)
    monkeypatch.setattr(generation, "generate", lambda *a, **k: pytest.fail("generate() ran"))
    err = _main(capsys, "generate", str(tmp_path / "ck"), "--local", "--prompt", "  ", "--strategy", "sample")
    message = (r"a tokenizer whose ids fit the model's vocab_size=96 \(--tokenizer: the one the model was trained "
               r"with\); received: ByteTokenizer\(eos=True\) with 257 ids, \S+ with vocab_size 96$")
    assert err.startswith("tilegraph generate: error: [tilegraph generate] ") and re.search(message, err.strip()), err


@pytest.mark.parametrize("strategy", ["greedy", "sample"])
def test_generate_on_a_model_of_more_ids_than_its_tokenizer_decodes_only_those(tmp_path, capsys, strategy):
    """A model of vocab_size 400 (a padded vocabulary; an --init model trained on a smaller
    tokenizer) with the byte tokenizer (257 ids) generates text: only ids the tokenizer decodes are
    picked. Before, a stale check refused every such checkpoint ("a tokenizer that decodes every
    id"), which no tokenizer but a larger one could meet, though `tilegraph train` made it."""
    from tilegraph import models
    from tilegraph.cli import main, tokenizer_files
    from tilegraph.io import ByteTokenizer
    from tilegraph.io.zarr import save_checkpoint

    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=400), seed=0)
    save_checkpoint(tmp_path / "ck", model, files=tokenizer_files(ByteTokenizer(eos=True)))
    assert main(["generate", str(tmp_path / "ck"), "--local", "--prompt", "ab", "--max-new-tokens", "12",
                 "--strategy", strategy, "--ids"]) == 0
    text, ids = capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)
    ids = [int(i) for i in ids.split()]
    assert text.startswith("ab") and len(ids) > 2 and max(ids) < 257, (text, ids)


def test_generate_refuses_a_negative_seed(local_scheduler):
    from tilegraph import models
    from tilegraph.models.generate import generate

    model = models.build("gpt2-debug", seed=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph\.models\.generate\] seed must be None, an int >= 0 .*"
                                           r"received: -1$"):
        generate(model, np.array([[1, 2]]), 2, strategy="sample", seed=-1)
    assert generate(model, np.array([[1, 2]]), 2, strategy="sample", seed=np.random.SeedSequence(5)).shape == (1, 4)


# ------------------------------------------------------------------------------------- convert ----
def test_an_empty_bit_count_is_refused(ckpt, tmp_path, capsys):
    from tilegraph.io import CheckpointError
    from tilegraph.io.zarr import quantize_rule

    err = _main(capsys, "convert", str(ckpt / "hf"), str(tmp_path / "q"), "--quantize", "kashin:")
    assert "the bits after ':' must be an integer (or no ':' for the method's default); received: 'kashin:'" in err
    assert not (tmp_path / "q").exists()
    with pytest.raises(CheckpointError, match="received: 'int8:'"):
        quantize_rule("int8:", "test")
    assert quantize_rule({"w": "kashin"}, "test")("w", (64, 256)) == {"method": "kashin", "bits": None}


def test_quantize_to_an_inferred_hf_destination_says_it_was_inferred(ckpt, tmp_path, capsys):
    err = _main(capsys, "convert", str(ckpt / "zarr"), str(tmp_path / "hfdir"), "--quantize", "int8")
    assert "--to zarr writes a quantized Zarr checkpoint" in err and "--to hf" not in err
    assert (f"received: --quantize int8 with a Hugging Face destination, inferred from the source (convert writes "
            f"the other format, and {ckpt / 'zarr'} is a Zarr checkpoint)") in err
    err = _main(capsys, "convert", str(ckpt / "zarr"), str(tmp_path / "hfdir"), "--to", "hf", "--quantize", "int8")
    assert err.rstrip().endswith("received: --quantize int8 with --to hf")
    assert not (tmp_path / "hfdir").exists()


def test_an_empty_quantize_is_not_ignored(ckpt, tmp_path, capsys):
    # --quantize "" was taken for no --quantize: the HF folder written, the option ignored
    err = _main(capsys, "convert", str(ckpt / "zarr"), str(tmp_path / "hfdir"), "--quantize", "")
    assert "--quantize applies to a Zarr destination" in err and not (tmp_path / "hfdir").exists()


# --------------------------------------------------------------------------------- broken pipe ----
@pytest.mark.parametrize("which", ["versions", "checkpoint"])
def test_a_reader_gone_ends_the_command_quietly(ckpt, tmp_path, which):
    """``tilegraph info | head -1``: the pipe's reader gone before the output (closed here before
    the command starts, so the first write fails), the command exits 141 (128 + SIGPIPE, as a
    shell reports a tool the signal ended) and prints nothing to stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        run = subprocess.run([sys.executable, "-m", "tilegraph.cli", "info", *([str(ckpt / "zarr")]
                                                                               if which == "checkpoint" else [])],
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=300, cwd=tmp_path)
    finally:
        os.close(write)
    assert run.returncode == 141 and run.stderr == "", run.stderr


# ---------------------------------------------------------------------------- step time limit ----
def test_the_still_running_warning_says_what_it_waits_for(monkeypatch, caplog):
    from tilegraph import _health, _train

    monkeypatch.setattr(_train, "worker_health", lambda runtime: _health.WorkerHealth(silence={"tcp://w:1": 0.2}))
    step = _train.PendingStep.__new__(_train.PendingStep)  # only its steps are read
    step.steps = range(1, 2)
    with caplog.at_level(logging.WARNING, logger="tilegraph"):
        assert step._check_workers(None, 59.0, True, waited=60.2, checked=1.0) == 59.0
    assert caplog.messages == ["step 1 still running after 60 s (time limit 59 s); every worker answers, waiting on: "
                               "the step goes on (the workers are checked again in 59 s)"]


def test_settings_that_only_mpi_reads_are_refused_without_it(capsys, tmp_path, monkeypatch):
    """interface (the network interface of MPI ranks) given without mpi was ignored without a word,
    by tg.connect and by tilegraph train's [runtime]; a dask_config that is no mapping was a
    TypeError inside Dask."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.connect\] interface only with mpi=True.*received: "
                                           r"interface='ib0'"):
        tg.connect(interface="ib0")
    with pytest.raises(tg.TileError, match=r"dask_config must be a mapping.*received: str 'x'"):
        tg.connect(dask_config="x")
    monkeypatch.chdir(tmp_path)
    err = _main(capsys, "train", "--set", "runtime.interface=ib0", "--steps", "1")
    assert "[tilegraph train [runtime]] interface only with mpi (--mpi)" in err and "interface = 'ib0'" in err
