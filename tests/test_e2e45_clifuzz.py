"""Bad input to the command line as a new user who mistypes things meets it (session 45's audit:
each subcommand's flags fed wrong types, empty strings, files for folders and back, damaged
checkpoints and config files). What it found:

- an empty flag value (``--resume "$CK"`` with CK unset) was taken for the flag left out: train
  --resume "" started a new run, --init "" a fresh model, --tls-ca-file/--tls-cert/--tls-key ""
  the config's (no TLS: plain tcp://), generate and eval --tokenizer "" the checkpoint's own;
  ``train ""`` said "a TOML config file, not a folder; received:  (a folder)". Each is named as
  the empty string it is, as CHECKPOINT, SRC and DST were;
- a checkpoint's zarr.json whose tilegraph attributes had another type than a save writes (a
  step of "x" or null, parameters 3, a model of "x", an optimizer, trainer or metadata that is
  no object) was a ValueError, TypeError or AttributeError traceback of every command that read
  it (a step of -1, 2.5 or true was taken: --resume went on from "step 2.5");
- ``tilegraph train --out RUN`` on a run folder holding a partly copied checkpoint (a step-N
  folder without its zarr.json) told the user to ``--resume`` that one, which --resume refuses:
  it names the newest complete checkpoint, or says there is none;
- ``--tokenizer /dev/null`` (there, but no file) said "no such file";
- ``convert CK OUT --quantize ''`` showed the empty method as nothing ("--quantize  with");
- a path argument with a name longer than the file system takes (a prompt given as generate's
  CHECKPOINT, say; or a path in --set) was "OSError: [Errno 36] File name too long" and a
  traceback: each is named (the flag or positional where it was one) with its first characters;
- ``generate --stop`` of bytes that are no UTF-8 (a lone surrogate) was taken and never matched;
- ``eval --data a.txt --data b.txt`` evaluated b.txt alone (the last --data won): both are read;
- ``train --steps 1000000000000`` (a typo of a few zeros) without checkpoints or evaluations
  between sat at "step 0" for minutes: the fit scanned every step for the next one it waits at
  before submitting the first.

Each error is one line, exit status 2, and nothing is written."""

import json
import shutil
import signal
from pathlib import Path

import pytest

from test_e2e39_cli import SMALL  # the debug GPT-2 on a little of the stdlib, one worker process
from test_e2e40_cli import _main  # tilegraph ARGS run in a folder: exit status, stdout, stderr

EMPTY = "'' (an empty string: an unset shell variable?)"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml`` and ``ck``, a Zarr checkpoint of a debug GPT-2 (no
    optimizer) whose vocabulary holds the byte tokenizer's ids."""
    import dataclasses

    from tilegraph import models
    from tilegraph.io.zarr import save_checkpoint

    root = tmp_path_factory.mktemp("e2e45")
    (root / "small.toml").write_text(SMALL)
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
    save_checkpoint(root / "ck", model)
    return root


def _tree(folder: Path) -> dict:
    """Every path under ``folder`` with its size and mtime (a file's), to tell nothing changed."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in folder.rglob("*")}


def _error(root: Path, *args) -> str:
    """The one line of error of ``tilegraph ARGS`` run in ``root``: exit status 2, no traceback,
    nothing written or changed in ``root``."""
    before = _tree(root)
    code, out, err = _main(root, *args)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert _tree(root) == before
    return lines[0]


# ------------------------------------------------------------------------ empty flag values ----
@pytest.mark.parametrize("args, where, what", [
    (["train", "small.toml", "--resume", "", "--out", "out"], "tilegraph train --resume",
     "a path: a checkpoint folder (RUN/checkpoints/step-N)"),
    (["train", "small.toml", "--init", "", "--out", "out"], "tilegraph train --init",
     "a path: a checkpoint folder or a Hugging Face folder (for a fresh model, leave --init out)"),
    (["train", "small.toml", "--tls-ca-file", "", "--out", "out"], "tilegraph train --tls-ca-file",
     "a path: a PEM file"),
    (["train", "small.toml", "--tls-cert", "", "--out", "out"], "tilegraph train --tls-cert", "a path: a PEM file"),
    (["train", "small.toml", "--tls-key", "", "--out", "out"], "tilegraph train --tls-key", "a path: a PEM file"),
    (["train", "", "--out", "out"], "tilegraph train", "CONFIG, a path"),
    (["generate", "ck", "--local", "--tokenizer", ""], "tilegraph generate --tokenizer",
     "'byte' or the path of a BPE tokenizer JSON (for the checkpoint's own, leave --tokenizer out)"),
    (["eval", "ck", "--local", "--tokenizer", ""], "tilegraph eval --tokenizer",
     "'byte' or the path of a BPE tokenizer JSON (for the checkpoint's own, leave --tokenizer out)"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_an_empty_flag_value_is_named_not_taken_for_the_flag_left_out(root, args, where, what):
    """--resume "" trained a new run (2 steps from scratch, exit status 0), --init "" a fresh model,
    a TLS flag "" fell back to the config's (none: no TLS), --tokenizer "" to the checkpoint's."""
    command = args[0]
    assert _error(root, *args) == f"tilegraph {command}: error: [{where}] {what}; received: {EMPTY}"


def test_a_tokenizer_that_is_no_regular_file_is_not_called_missing(root):
    assert _error(root, "generate", "ck", "--local", "--tokenizer", "/dev/null") == (
        "tilegraph generate: error: [tilegraph generate --tokenizer] \"byte\", or the path of a BPE tokenizer JSON "
        "file (tilegraph.io.BPETokenizer.save); received: '/dev/null' (not a regular file)")
    assert _error(root, "generate", "ck", "--local", "--tokenizer", "nope.json").endswith(
        "received: 'nope.json' (no such file)")


def test_an_empty_quantize_method_is_shown_as_one(root):
    assert _error(root, "convert", "ck", "out", "--quantize", "") == (
        "tilegraph convert: error: [tilegraph convert] --quantize applies to a Zarr destination (a Hugging Face "
        "folder holds the dequantized weights; --to zarr writes a quantized Zarr checkpoint); received: --quantize "
        "'' with a Hugging Face destination, inferred from the source (convert writes the other format, and ck is "
        "a Zarr checkpoint)")


def test_a_stop_string_of_bytes_no_text_holds_is_refused(root):
    """--stop $'\\xff' (a Latin-1 terminal's byte, a lone surrogate to Python) could never match:
    generation ran to --max-new-tokens as if no --stop were given, while --prompt refused it."""
    assert _error(root, "generate", "ck", "--local", "--tokenizer", "byte", "--stop", "a\udcff") == (
        "tilegraph generate: error: [tilegraph generate --stop] text must be valid UTF-8, but it holds undecodable "
        "bytes (lone surrogates); received: '\\udcff' (bytes b'\\xff') at character 1 of 2")


def test_each_repeated_data_flag_of_eval_is_read(root):
    """`--data a.txt --data b.txt` evaluated b.txt alone, a.txt dropped without a word (the last
    --data replaced the earlier ones): a missing first one went unnoticed."""
    (root / "b.txt").write_text("def f(x):\n    return x\n" * 200)
    try:
        assert _error(root, "eval", "ck", "--local", "--tokenizer", "byte", "--data", "missing.txt", "--data",
                      "b.txt") == ("tilegraph eval: error: [tilegraph eval --data] each source must be an existing "
                                   "text file or folder; received: missing.txt")
    finally:
        (root / "b.txt").unlink()


LONG = "a" * 300
SHOWN = f"'{LONG[:40]}'... (300 characters)"
WANT = "a path whose every name fits the file system (at most 255 bytes a name)"


@pytest.mark.parametrize("args, where", [
    (["info", LONG], "[tilegraph info] CHECKPOINT, "),
    (["generate", LONG, "--local"], "[tilegraph generate] CHECKPOINT, "),
    (["eval", LONG, "--local"], "[tilegraph eval] CHECKPOINT, "),
    (["eval", "ck", "--local", "--data", LONG], "[tilegraph eval --data] "),
    (["convert", LONG, "out"], "[tilegraph convert] SRC, "), (["convert", "ck", LONG], "[tilegraph convert] DST, "),
    (["generate", "ck", "--local", "--tokenizer", LONG], "[tilegraph generate --tokenizer] "),
    (["train", LONG], "[tilegraph train] CONFIG, "),
    (["train", "small.toml", "--out", LONG], "[tilegraph train --out] "),
    (["train", "small.toml", "--init", LONG, "--out", "out"], "[tilegraph train --init] "),
    (["train", "small.toml", "--resume", LONG, "--out", "out"], "[tilegraph train --resume] "),
    (["train", "small.toml", "--tls-ca-file", LONG, "--out", "out"], "[tilegraph train --tls-ca-file] "),
], ids=lambda v: " ".join(a if a != LONG else "LONG" for a in v) if isinstance(v, list) else None)
def test_a_path_with_a_name_too_long_for_the_file_system_is_named(root, args, where):
    """A name past 255 bytes (a prompt given as generate's CHECKPOINT, say) was "OSError: [Errno 36]
    File name too long" and a traceback, from whichever stat() came first."""
    assert _error(root, *args) == f"tilegraph {args[0]}: error: {where}{WANT}; received: {SHOWN}"


def test_a_config_path_with_a_name_too_long_is_one_line_too(root):
    """A path in a config or --set: the command's one line (where it was checked first varies)."""
    for pair in (f"data.tokenizer={LONG}", f'data.sources=["{LONG}"]', f"model.init={LONG}"):
        assert _error(root, "train", "small.toml", "--set", pair, "--out", "out") == (
            f"tilegraph train: error: [tilegraph train] {WANT}; received: {SHOWN}"), pair


# ------------------------------------------------------------- damaged checkpoint attributes ----
ATTRS = [("step", "x", "step 'x' (an int >= 0)"), ("step", None, "step None (an int >= 0)"),
         ("step", -1, "step -1 (an int >= 0)"), ("step", 2.5, "step 2.5 (an int >= 0)"),
         ("step", True, "step True (an int >= 0)"), ("parameters", 3, "parameters 3 (a list of names)"),
         ("model", "x", "model 'x' (an object)"), ("optimizer", "x", "optimizer 'x' (an object)"),
         ("trainer", 3, "trainer 3 (an object)"), ("metadata", [1], "metadata [1] (an object)"),
         ("arrays", 3, "arrays 3 (an object)")]
COMMANDS = [["info", "{ck}"], ["info", "{ck}", "--verify"], ["generate", "{ck}", "--local", "--tokenizer", "byte"],
            ["eval", "{ck}", "--local", "--tokenizer", "byte"], ["convert", "{ck}", "out"],
            ["train", "small.toml", "--init", "{ck}", "--out", "out"],
            ["train", "small.toml", "--resume", "{ck}", "--out", "out"]]


@pytest.mark.parametrize("key, value, received", ATTRS, ids=[f"{k}={v!r}" for k, v, _ in ATTRS])
def test_a_checkpoint_attribute_of_another_type_is_named_by_every_command(root, key, value, received):
    """Each command that reads a checkpoint ended in a traceback (ValueError: invalid literal for
    int() ... 'x'; TypeError: 'int' object is not iterable; AttributeError: 'str' object has no
    attribute 'get'), or took a step of -1, 2.5 or true."""
    name = f"bad-{key}-{json.dumps(value)}".replace('"', "")
    ck = root / name
    shutil.copytree(root / "ck", ck)
    try:
        doc = json.loads((ck / "zarr.json").read_text())
        doc["attributes"]["tilegraph"][key] = value
        (ck / "zarr.json").write_text(json.dumps(doc))
        for args in COMMANDS:
            command = " ".join(args[:1] + (["--init"] if "--init" in args else ["--resume"] if "--resume" in args
                                           else []))
            assert _error(root, *[a.format(ck=name) for a in args]) == (
                f"tilegraph {args[0]}: error: [tilegraph.io.load_checkpoint({name})] a zarr.json whose tilegraph "
                "attributes have the types a save writes (this one is damaged or was edited); received: "
                f"{name}/zarr.json: {received}"), command
    finally:
        shutil.rmtree(ck)


def test_a_checkpoint_as_a_save_writes_it_still_loads(root):
    from tilegraph.io.zarr import load_checkpoint

    ck = load_checkpoint(root / "ck")
    assert ck.step == 0 and ck.parameters and isinstance(ck.metadata, dict)


# ------------------------------------------------------------------- a partly copied run ----
def test_a_run_folder_with_a_partly_copied_checkpoint_names_the_complete_one(root):
    """An interrupted copy of a run folder (step-000002 without its zarr.json): "--resume
    run/checkpoints/step-000002 continues it", which --resume then refused as no checkpoint."""
    run = root / "copied"
    shutil.copytree(root / "ck", run / "checkpoints" / "step-000001")
    shutil.copytree(root / "ck" / "model", run / "checkpoints" / "step-000002" / "model")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    try:
        assert _error(root, "train", "small.toml", "--out", "copied") == (
            "tilegraph train: error: [tilegraph train] an output folder without an earlier run; copied holds one "
            "(metrics.jsonl, checkpoints step-000001..step-000002): pass --resume CHECKPOINT to continue it (--resume "
            "copied/checkpoints/step-000001 continues it), or another --out; received: copied")
        shutil.rmtree(run / "checkpoints" / "step-000001")
        assert _error(root, "train", "small.toml", "--out", "copied") == (
            "tilegraph train: error: [tilegraph train] an output folder without an earlier run; copied holds one "
            "(metrics.jsonl, checkpoints step-000002..step-000002): pass --resume CHECKPOINT to continue it (none of "
            "them is a complete checkpoint to continue from), or another --out; received: copied")
    finally:
        shutil.rmtree(run)


# --------------------------------------------------------------------- a huge step budget ----
@pytest.mark.distributed
def test_a_huge_step_budget_starts_its_first_step_at_once(root, monkeypatch):
    """--steps 1000000000000 with no checkpoint or evaluation before the last step: the fit looked
    through every step for the next one it waits at before it submitted the first (minutes at
    "step 0" for 10**9 steps, as if it hung). Stopped (as by Ctrl-C) once its first step is
    logged: exit status 130, with a checkpoint."""
    from tilegraph.trainer import Trainer

    log = Trainer._log

    def stop_after_a_step(self, out, record):
        log(self, out, record)
        if "loss" in record:
            self.request_stop()

    def too_long(*_):
        raise AssertionError("no step within 60 s of --steps 1000000000000")

    monkeypatch.setattr(Trainer, "_log", stop_after_a_step)
    old = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(60)
    try:
        code, out, err = _main(root, "train", "small.toml", "--steps", 10 ** 12, "--out", "huge", "--no-progress")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    try:
        assert code == 130, err
        # (the steps submitted with the first run to their end: a checkpoint of one of them)
        assert list((root / "huge" / "checkpoints").glob("step-*/zarr.json")), (out, err)
    finally:
        shutil.rmtree(root / "huge", ignore_errors=True)
