"""`tilegraph train --resume` as a new user meets it, and the ways a run ends badly:

- resuming an earlier checkpoint keeps it and sets the later ones (the abandoned branch) aside;
- without --out, the run goes on in the checkpoint's own run folder;
- without --steps, it finishes the run's step budget;
- settings the checkpoint fixes (its learning-rate schedule) and --init are refused, not ignored;
- the [peft] adapters come from the checkpoint when the job gives none;
- a NaN loss, a second Ctrl-C and an output path that cannot be a folder end in one line.

One 20-step run (checkpoints at 10, 15, 20) serves every test; those that resume it work on a copy."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import SMALL, _cli  # the small job, and `python -m tilegraph.cli` in a subprocess

pytestmark = pytest.mark.distributed

#: SMALL validating only at the end (its steps, 24, are what a config file may say: see the budget test)
CONFIG = SMALL.replace("eval_every = 12", "eval_every = 0")


def _main(capsys, *args):
    """``tilegraph ARGS`` in this process (for errors raised before a cluster starts): its one line
    of error (exit status 2)."""
    from tilegraph.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml`` and ``base``: a run of 20 steps, checkpoints every 5 (the
    newest 3 kept: steps 10, 15, 20)."""
    root = tmp_path_factory.mktemp("resume")
    (root / "small.toml").write_text(CONFIG)
    run = _cli("train", "small.toml", "--out", "base", "--steps", "20", "--set", "output.checkpoint_every=5",
               "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (root / "base" / "checkpoints").iterdir()) == [
        "step-000010", "step-000015", "step-000020"]
    return root


def _copy(root: Path, name: str) -> Path:
    shutil.copytree(root / "base", root / name)
    return root / name


def test_resuming_an_earlier_checkpoint_keeps_it_and_sets_the_later_ones_aside(root):
    import tilegraph as tg

    run_dir = _copy(root, "branch")
    ckdir = run_dir / "checkpoints"
    # a checkpoint every 2 steps, the newest 2 kept: 12 is pruned, never 10 (resumed from)
    run = _cli("train", "small.toml", "--resume", "branch/checkpoints/step-000010", "--out", "branch",
               "--steps", "6", "--lr", "0.003", "--set", "output.checkpoint_every=2",
               "--set", "output.checkpoint_keep=2", "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "set aside the checkpoints after step 10, of the branch this run abandons: step-000015, step-000020" \
           in run.stdout, run.stdout
    aside = [p for p in ckdir.iterdir() if p.name.startswith("abandoned-")]
    assert len(aside) == 1 and sorted(p.name for p in aside[0].iterdir()) == ["step-000015", "step-000020"]
    assert sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step-")) == [
        "step-000010", "step-000014", "step-000016"]
    assert tg.io.load_checkpoint(aside[0] / "step-000020").step == 20  # nothing lost
    assert [r["step"] for r in _steps(run_dir)][-6:] == list(range(11, 17))


def test_resume_without_out_goes_on_in_the_checkpoints_run_folder(root):
    run_dir = _copy(root, "own")
    # the command that tilegraph's refusal suggests continues that run, in its folder
    twice = _cli("train", "small.toml", "--out", "own", "--no-progress", cwd=root)
    assert twice.returncode == 2 and "--resume own/checkpoints/step-000020 continues it" in twice.stderr
    run = _cli("train", "small.toml", "--resume", "own/checkpoints/step-000020", "--steps", "2", "--no-progress",
               cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step-000022").is_dir() and not (root / "runs").exists()
    assert [r["step"] for r in _steps(run_dir)] == list(range(1, 23))
    assert f"metrics: {Path('own') / 'metrics.jsonl'}" in run.stdout


def test_resume_without_steps_finishes_the_runs_step_budget(root, capsys, monkeypatch):
    import tilegraph as tg

    run_dir = _copy(root, "budget")
    # a config file with another lr (and SMALL's steps = 24): not used, said in one warning line
    (root / "other.toml").write_text(CONFIG.replace("[train]\n", "[train]\nlr = 0.01\n"))
    run = _cli("train", "other.toml", "--resume", "budget/checkpoints/step-000015", "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "at step 15, to step 20" in run.stdout
    assert re.search(r"tilegraph train: warning: lr = 0\.01, steps = 24 in other\.toml not used: the resumed run "
                     r"keeps its checkpoint's learning-rate schedule \(lr 0\.003, warmup 4, steps 20, min_lr 0\.0003\)",
                     run.stderr), run.stderr
    ck = tg.io.load_checkpoint(run_dir / "checkpoints" / "step-000020")
    sched = tg.optim.schedule_from_spec(ck.optimizer_info["schedule"])
    resumed = _steps(run_dir)[-5:]
    assert [r["step"] for r in resumed] == list(range(16, 21)) and ck.step == 20
    assert [r["lr"] for r in resumed] == [sched(i) for i in range(16, 21)] and resumed[-1]["lr"] == 3e-4
    # at the end of its budget: --steps says how many more
    monkeypatch.chdir(root)
    err = _main(capsys, "train", "--resume", "budget/checkpoints/step-000020")
    assert "[tilegraph train --resume] --steps N, the steps to add: budget/checkpoints/step-000020 ends its run " \
           "(step 20 of the 20 steps" in err and err.endswith("received: no --steps"), err


@pytest.mark.parametrize("args, message", [
    (["--lr", "1"], r"\[tilegraph train --resume\] no learning-rate settings other than its checkpoint's schedule, "
                    r"which the resumed run keeps \(lr 0\.003, warmup 4, steps 20, min_lr 0\.0003\): leave them out, "
                    r"or start a new run .*--init base/checkpoints/step-000010 .*; received: --lr 1\.0$"),
    (["--set", "train.warmup=9", "--set", "train.min_lr=0"],
     r"received: --set train\.warmup=9; --set train\.min_lr=0$"),
    (["--init", "base/checkpoints/step-000020"],
     r"\[tilegraph train\] --init or --resume, not both: .*received: --init base/checkpoints/step-000020 "
     r"--resume base/checkpoints/step-000010$"),
])
def test_what_a_resumed_run_cannot_honour_is_refused(root, capsys, monkeypatch, args, message):
    monkeypatch.chdir(root)
    before = _listing(root / "base")
    err = _main(capsys, "train", "small.toml", "--resume", "base/checkpoints/step-000010", "--steps", "3", *args)
    assert re.search(message, err), err
    assert _listing(root / "base") == before and not (root / "runs").exists()


def test_resume_of_a_lora_run_takes_its_adapters_from_the_checkpoint(root, capsys, monkeypatch):
    (root / "data.toml").write_text("[data]" + CONFIG.split("[data]", 1)[1])  # no [model]: init's architecture
    run = _cli("train", "data.toml", "--init", "base/checkpoints/step-000020", "--set", "peft.method=lora",
               "--set", "peft.rank=4", "--set", "peft.dropout=0.1", "--out", "lora", "--steps", "4", "--no-progress",
               cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    # no [peft] given: the checkpoint's (tilegraph_peft.json)
    again = _cli("train", "data.toml", "--resume", "lora/checkpoints/step-000004", "--steps", "2", "--no-progress",
                 cwd=root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "lora rank 4 on attn.q, attn.v" in again.stdout and "at step 4, to step 6" in again.stdout
    ck = root / "lora" / "checkpoints" / "step-000006"
    record = json.loads((ck / "tilegraph_peft.json").read_text())  # written from the resumed job's settings
    assert (ck / "adapters").is_dir() and record["rank"] == 4 and record["dropout"] == 0.1  # dropout too (was 0)
    # [peft] settings given that differ from the checkpoint's are refused
    monkeypatch.chdir(root)
    err = _main(capsys, "train", "data.toml", "--resume", "lora/checkpoints/step-000006", "--steps", "2",
                "--set", "peft.rank=2")
    assert re.search(r"received: method = 'lora', rank = 2, .* here, method = 'lora', rank = 4, ", err), err


def test_a_nan_loss_is_one_line_and_the_folder_it_leaves_says_what_to_do(root, capsys, monkeypatch):
    run = _cli("train", "small.toml", "--out", "nan", "--set", "train.lr=1e6", "--steps", "30", "--no-progress",
               cwd=root)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert re.fullmatch(r"tilegraph train: error: \[tilegraph train\] a finite loss: train again with a lower "
                        r"learning rate \(--lr; this run's peak was 1e\+06\), in another --out or after deleting nan; "
                        r"received: loss became (nan|inf|-inf) at step \d+", last), last
    monkeypatch.chdir(root)
    err = _main(capsys, "train", "small.toml", "--out", "nan", "--steps", "2")
    assert "nan holds the metrics.jsonl of one that wrote no checkpoint, so nothing there can be resumed: pass " \
           "another --out, or delete nan" in err, err


def test_a_resumed_run_draws_the_batches_of_the_run_it_continues(root, capsys, monkeypatch):
    """The seed and batch size of the checkpoint's run replace the job's: a run started with
    --seed 7 and resumed without it goes on with the very losses of the run it continues (it drew
    the batches of the shipped seed before); another --seed on the command line is refused, one
    in a config file is named in a warning and not used."""
    straight = _cli("train", "small.toml", "--out", "s7", "--seed", "7", "--steps", "10",
                    "--set", "output.checkpoint_every=5", "--no-progress", cwd=root)
    assert straight.returncode == 0, straight.stderr[-3000:]
    shutil.copytree(root / "s7", root / "r7")
    (root / "seed3.toml").write_text(CONFIG.replace("[train]", "[train]\nseed = 3", 1))
    more = _cli("train", "seed3.toml", "--resume", "r7/checkpoints/step-000005", "--no-progress", cwd=root)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "seed = 3 in seed3.toml not used: the resumed run draws its checkpoint's batches (seed 7, batch_size" \
           in more.stderr, more.stderr[-3000:]
    want = [r["loss"] for r in _steps(root / "s7") if r["step"] > 5]
    got = [r["loss"] for r in _steps(root / "r7")][-5:]  # the resumed steps 6..10, after the copied ones
    assert len(want) == 5 and got == want, (got, want)
    monkeypatch.chdir(root)
    err = _main(capsys, "train", "small.toml", "--resume", "r7/checkpoints/step-000005", "--steps", "2", "--seed", "1")
    assert "the batches of the run it continues (seed 7, batch_size" in err and "received: --seed 1" in err, err


def test_a_second_ctrl_c_stops_at_once_in_one_line(root):
    import tilegraph as tg

    out_file, err_file = root / "int.out", root / "int.err"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tilegraph.cli", "train", "small.toml", "--out", "int",
                                 "--steps", "100000", "--set", "output.checkpoint_every=5", "--no-progress"],
                                cwd=root, stdout=out, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        metrics = root / "int" / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 12):  # a checkpoint is written
            assert time.time() < deadline and proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: to the whole process group
        while "stopping after the steps under way" not in err_file.read_text():
            assert time.time() < deadline and proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # while it writes its checkpoint or closes the cluster
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = err_file.read_text()
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    m = re.search(r"^tilegraph train: stopped at once; last checkpoint: (int/checkpoints/step-\d{6}) \(continue with "
                  r"tilegraph train small\.toml --resume (\S+)\)$", err.strip().splitlines()[-1])
    assert m and m.group(1) == m.group(2), err[-3000:]
    assert tg.io.load_checkpoint(root / m.group(1)).step >= 5
    assert not (root / "int" / ".tilegraph.lock").exists()


def test_a_sigterm_to_the_process_group_checkpoints_the_last_step(root):
    """Slurm's scancel (and `timeout`) signal every process of the job: the workers leave the
    SIGTERM to tilegraph train, which stops after the steps under way and checkpoints the last
    one. Before, the signal killed the workers (and the parameters they held): 'lost worker', no
    final checkpoint."""
    import tilegraph as tg

    out_file, err_file = root / "term.out", root / "term.err"
    with open(out_file, "w") as out, open(err_file, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tilegraph.cli", "train", "small.toml", "--out", "term",
                                 "--steps", "100000", "--no-progress"],
                                cwd=root, stdout=out, stderr=err, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        metrics = root / "term" / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 8):
            assert time.time() < deadline and proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # to every process of the group, the workers too
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stdout, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 130 and "lost worker" not in err and "Traceback" not in err, err[-3000:]
    m = re.search(r"^stopped at step (\d+); checkpoint: (term/checkpoints/step-\d{6}) ", stdout, re.M)
    assert m, stdout[-3000:] + err[-3000:]
    assert tg.io.load_checkpoint(root / m.group(2)).step == int(m.group(1)) >= 8


@pytest.mark.parametrize("out, message", [
    ("afile", r"\[--out\] an output folder, or a path where one can be made \(nothing was written\); "
              r"received: afile is not a folder"),
    ("afile/sub", r"\[--out\] an output folder, .*; received: afile/sub: afile is not a folder"),
    ("", r"\[--out\] an output folder \(a path; nothing was written\); received: ''"),
    ("/proc/x", r"\[--out\] could not write the output folder \(.+\); nothing was written; received: /proc/x"),
    ("/sys/x", r"\[--out\] could not write the output folder \(.+\); nothing was written; received: /sys/x"),
])
def test_an_output_path_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, monkeypatch, out, message):
    if out.startswith("/") and not Path(out).parent.is_dir():
        pytest.skip(f"no {Path(out).parent} here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("")
    err = _main(capsys, "train", "--out", out, "--steps", "2")
    assert re.fullmatch(r"tilegraph train: error: " + message, err), err
    assert sorted(os.listdir(tmp_path)) == ["afile"] and (tmp_path / "afile").read_text() == ""


def test_the_checkpoint_manager_keeps_what_it_protects_and_sets_aside_without_deleting(tmp_path):
    import tilegraph as tg

    model = tg.nn.MLP(4, 8, out_dim=2, tile=4, seed=0)
    mgr = tg.io.CheckpointManager(tmp_path / "ck", keep=2, async_save=False)
    for step in (1, 2, 3):
        mgr.save(step, model)
    assert [p.name for p in mgr.checkpoints()] == ["step-000002", "step-000003"]
    mgr.protect(mgr.path(2))
    moved = mgr.set_aside(2, "abandoned")
    assert moved == [tmp_path / "ck" / "abandoned" / "step-000003"] and tg.io.load_checkpoint(moved[0]).step == 3
    for step in (3, 4, 5):  # its names are free again; 2 is never pruned
        mgr.save(step, model)
    assert [p.name for p in mgr.checkpoints()] == ["step-000002", "step-000004", "step-000005"]
    assert [p.parent.name for p in mgr.set_aside(2, "abandoned")] == ["abandoned-2", "abandoned-2"]
    assert mgr.set_aside(2, "abandoned") == [] and not (tmp_path / "ck" / "abandoned-3").exists()
