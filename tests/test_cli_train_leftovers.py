"""`tilegraph train` as an audit left it, each now fixed:

- ``--resume`` takes the tokenizer from its checkpoint: the BPE file the run started with may
  have moved (it was refused, naming a path the user never typed);
- ``--set KEY`` without ``=VALUE`` says the ``=`` is missing (not "did you mean KEY?");
- the commands that messages suggest quote their paths (a path with a space broke them);
- SIGTERM stops with a checkpoint and exit status 143 (128 + SIGTERM; it was 130, SIGINT's);
- a ``--set`` value that a flag then overrides is checked all the same;
- ``--out`` inside a checkpoint or a run's checkpoints folder is refused;
- the README's LoRA run (default targets attn.q, attn.v on GPT-2) says in one line why it wrote
  no peft layout and how to get one, instead of printing save_peft's error.

One 4-step run on a BPE tokenizer, in a folder whose name holds a space, serves most of them."""

import os
import re
import shlex
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_cli import SMALL, _cli, training  # the small job; `python -m tilegraph.cli` in a subprocess

pytestmark = pytest.mark.distributed

CONFIG = SMALL.replace("eval_every = 12", "eval_every = 0").replace("max_mb = 0.3", "max_mb = 0.1")
RUN = "sp ace/run one"  # the run folder: a space in two of its names
CKPT = f"{RUN}/checkpoints/step-000004"


def _main(capsys, *args) -> str:
    """``tilegraph ARGS`` in this process (errors raised before a cluster starts): its one line of
    error (exit status 2)."""
    from tilegraph.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml``, ``bpe.json`` (a BPE tokenizer) and the 4-step run ``RUN``
    trained with it (its one checkpoint: ``CKPT``)."""
    from tilegraph.io import BPETokenizer

    root = tmp_path_factory.mktemp("leftovers")
    (root / "small.toml").write_text(CONFIG)
    BPETokenizer.train([os.__file__], vocab_size=300).save(root / "bpe.json")
    run = _cli("train", "small.toml", "--out", RUN, "--steps", "4", "--set", "data.tokenizer=bpe.json",
               "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (root / CKPT / "bpe_tokenizer.json").is_file()
    return root


def test_resume_uses_the_checkpoints_tokenizer_when_the_file_has_moved(root, tmp_path):
    shutil.copytree(root / RUN, tmp_path / "run")
    shutil.copy(root / "small.toml", tmp_path)
    # the run's tilegraph_data.json names root/bpe.json, which is not there for this resume
    moved = (root / "bpe.json").rename(root / "bpe-moved.json")
    try:
        run = _cli("train", "--resume", "run/checkpoints/step-000004", "--steps", "2", "--no-progress",
                   cwd=tmp_path)
    finally:
        moved.rename(root / "bpe.json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resumed from run/checkpoints/step-000004 at step 4, to step 6" in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-000006" / "bpe_tokenizer.json").is_file()


def test_set_without_a_value_says_the_equals_sign_is_missing(capsys):
    err = _main(capsys, "train", "--set", "train.steps")
    assert err == ("tilegraph train: error: [tilegraph train --set] section.key=value: an '=' and the value after "
                   "the key (train.steps=VALUE); received: 'train.steps' (no '=')"), err


def test_a_set_value_that_a_flag_overrides_is_checked(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = _main(capsys, "train", "--set", "train.steps=[1,2]", "--steps", "2", "--out", "run")
    assert err.endswith("received: train.steps must be an integer >= 1, not [1, 2] (--set train.steps=[1,2], "
                        "which --steps 2 overrides)"), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("out, found", [
    (CKPT, r"it is a checkpoint"),
    (f"{CKPT}/inner", r"inside the checkpoint .*/step-000004"),
    (f"{RUN}/checkpoints", r"the checkpoints folder of the run .*/run one"),
    (f"{RUN}/checkpoints/new", r"inside .*/run one/checkpoints, the checkpoints folder of the run .*/run one"),
])
def test_an_output_folder_inside_a_checkpoint_or_a_runs_checkpoints_is_refused(root, capsys, monkeypatch, out,
                                                                                found):
    monkeypatch.chdir(root)
    before = sorted(str(p) for p in (root / RUN).rglob("*"))
    err = _main(capsys, "train", "small.toml", "--steps", "2", "--out", out)
    assert re.fullmatch(r"tilegraph train: error: \[--out\] an output folder outside every checkpoint and every "
                        r"run's checkpoints folder \(a run writes its own checkpoints/ in it; nothing was written\): "
                        rf"pass another; received: {re.escape(out)}: {found}", err), err
    assert sorted(str(p) for p in (root / RUN).rglob("*")) == before


def test_suggested_commands_quote_their_paths(root, capsys, monkeypatch):
    from tilegraph.cli.runs import diverged, resume_command
    from tilegraph.cli.train import past_schedule_note

    # a second run into the folder: the --resume it suggests is one shell word
    monkeypatch.chdir(root)
    err = _main(capsys, "train", "small.toml", "--out", RUN, "--steps", "2", "--set", "data.tokenizer=byte")
    m = re.search(r"\(--resume (.*) continues it\)", err)
    assert m and shlex.split(m.group(1)) == [CKPT], err
    assert shlex.split(resume_command("my config.toml", Path(CKPT)))[2:] == ["my config.toml", "--resume", CKPT]
    # a NaN loss: --init the last checkpoint, or delete the folder
    opt = SimpleNamespace(schedule=SimpleNamespace(spec={"base_lr": 1.0}))
    text = str(diverged(FloatingPointError("loss became nan at step 3"), opt, root / RUN))
    assert shlex.split(re.search(r"--init (.*?)\)", text).group(1)) == [str(root / CKPT)], text
    text = str(diverged(FloatingPointError("loss became nan at step 3"), opt, root / "sp ace" / "no run"))
    assert shlex.split(re.search(r"after deleting (.*?); received", text).group(1)) == [str(root / "sp ace/no run")]
    # steps past the schedule: the --init of a new run
    spec = {"name": "warmup_cosine", "base_lr": 1e-3, "warmup": 1, "total": 4, "min_lr": 1e-4}
    resume = SimpleNamespace(path=CKPT, checkpoint=SimpleNamespace(optimizer_info={"schedule": spec}))
    note = past_schedule_note(resume, 4, 6)
    assert shlex.split(re.search(r"--init (.*) --out NEW$", note).group(1)) == [CKPT], note


def test_sigterm_stops_with_a_checkpoint_and_exit_status_143(tmp_path):
    (tmp_path / "small.toml").write_text(CONFIG)
    (tmp_path / "sp ace").mkdir()
    with training(tmp_path, "sp ace/term", "small.toml", "--steps", "100000", "--set", "output.checkpoint_every=0",
                  records=2) as proc:
        proc.send_signal(signal.SIGTERM)  # to the command alone, as `kill PID` sends it
        proc.wait(timeout=120)
    stdout, err = (tmp_path / "sp ace/term.out").read_text(), (tmp_path / "sp ace/term.err").read_text()
    assert proc.returncode == 128 + signal.SIGTERM == 143, (proc.returncode, err[-3000:])
    assert "tilegraph train: SIGTERM: stopping after the steps under way" in err, err[-3000:]
    m = re.search(r"^stopped at step (\d+); checkpoint: .* \(continue with (.*)\)$", stdout, re.M)
    assert m, stdout[-3000:] + err[-3000:]
    assert shlex.split(m.group(2)) == ["tilegraph", "train", "small.toml", "--set", "output.checkpoint_every=0",
                                       "--resume", f"sp ace/term/checkpoints/step-{int(m.group(1)):06d}"]


def test_the_readmes_lora_run_says_why_it_wrote_no_peft_layout(root, tmp_path):
    base = str(root / CKPT)
    small = ["--set", "data.max_mb=0.1", "--set", "data.seq_len=32", "--set", "train.batch_size=4"]
    run = _cli("train", "--init", base, "--set", "peft.method=lora", *small, "--steps", "2", "--out", "lora",
               "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [x for x in run.stdout.splitlines() + run.stderr.splitlines() if "peft layout" in x]
    assert lines == ["adapters (peft layout): none, as peft's adapter covers a whole fused module and the targets "
                     "attn.q, attn.v adapt only part of gpt2's (c_attn holds attn.q, attn.k, attn.v): for a peft "
                     """layout, adapt all of them: --set 'peft.targets=["attn.q", "attn.v", "attn.k"]'"""], lines
    assert "not written" not in run.stdout + run.stderr and "save_peft" not in run.stdout + run.stderr
    # what it suggests gives one
    suggested = shlex.split(lines[0].rpartition(": ")[2])
    run = _cli("train", "--init", base, "--set", "peft.method=lora", *suggested, *small, "--steps", "2",
               "--out", "lora3", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^adapters \(peft layout\): lora3/checkpoints/step-000002/adapters-peft$", run.stdout, re.M), \
        run.stdout[-3000:]
