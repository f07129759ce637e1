"""`tilegraph train --resume` as a new user meets it, and the ways a run ends badly:

- resuming an earlier checkpoint keeps it and sets the later ones (the abandoned branch) aside;
- without --out, the run goes on in the checkpoint's own run folder;
- without --steps, it finishes the run's step budget;
- settings the checkpoint fixes (its learning-rate schedule) and --init are refused, not ignored;
- the [peft] adapters and the gradient sketch come from the checkpoint when the job gives none;
- the checkpoint's metadata is read once;
- a legacy checkpoint (before Zarr) that does not fit changes nothing;
- a NaN loss, a second Ctrl-C and an output path that cannot be a folder end in one line.

One 20-step run (checkpoints at 10, 15, 20) serves the tests, and a 2-step run with a gradient sketch
those of the sketch; those that resume one work on a copy."""

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from test_cli import SMALL, _cli, training  # the small job; `python -m tilegraph.cli` in a subprocess

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


def test_resuming_a_branch_set_aside_sets_the_live_one_aside_and_draws_its_own_steps(root):
    """Before: a resume from ``checkpoints/abandoned-*/step-N`` (back to a branch left earlier)
    kept the live branch's checkpoints in place (to be pruned as this run's older ones), and
    ``loss.png`` joined the live branch's steps to it: 1-10, the live 11-14, then 21-22."""
    from tilegraph.plotting import _curves, read_metrics

    run_dir = _copy(root, "back")
    ckdir = run_dir / "checkpoints"
    run = _cli("train", "small.toml", "--resume", "back/checkpoints/step-000010", "--steps", "4",
               "--set", "output.checkpoint_every=2", "--no-progress", cwd=root)  # the live branch: 11-14
    assert run.returncode == 0, run.stderr[-3000:]
    aside = next(p for p in ckdir.iterdir() if p.name.startswith("abandoned-"))
    run = _cli("train", "small.toml", "--resume", f"back/checkpoints/{aside.name}/step-000020", "--steps", "2",
               "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "set aside the checkpoints after step 10, of the branch this run abandons: step-000012, step-000014" \
           in run.stdout, run.stdout
    live = sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step-"))
    assert "step-000022" in live and not {"step-000012", "step-000014"} & set(live), live
    drawn = dict(_curves(read_metrics(run_dir / "metrics.jsonl"), None)[0])
    first = {r["step"]: r["loss"] for r in _steps(root / "base")}
    assert sorted(drawn) == list(range(1, 23))
    assert all(drawn[s] == first[s] for s in range(1, 21)), "the curve took the live branch's steps 11-14"


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
    # past the 20 steps its schedule spans: one line in the command's words, no Python warning
    assert "note: steps 21-22 go past the 20 steps of the run's learning-rate schedule (lr 0.003, warmup 4, " \
           "steps 20, min_lr 0.0003) and run at its floor, lr 0.0003 (train.min_lr); for a new schedule over more " \
           "steps, start a run from these weights: --init own/checkpoints/step-000020 --out NEW" in run.stdout
    assert "UserWarning" not in run.stderr and [r["lr"] for r in _steps(run_dir)][-2:] == [3e-4, 3e-4]


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


@pytest.fixture(scope="module")
def sketched(root):
    """``sketched``: a run of 2 steps with a weight-gradient sketch (rows, ratio 0.5), given on the
    command line only; its checkpoint is step 2."""
    run = _cli("train", "small.toml", "--out", "sketched", "--steps", "2", "--set", "peft.grad_sketch=rows",
               "--set", "peft.sketch_ratio=0.5", "--set", "output.checkpoint_every=0", "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rows weight-gradient sketch 0.5 on *.mlp.*" in run.stdout, run.stdout
    return root / "sketched"


SKETCH = {"grad_sketch": "rows", "sketch_ratio": 0.5, "sketch_targets": ["*.mlp.*"]}


def test_resume_of_a_sketched_run_keeps_its_gradient_sketch(root, sketched):
    """Resumed without the settings it was started with, a run with sketched weight gradients
    went on with exact ones: its checkpoints now record the sketch (tilegraph_sketch.json)."""
    shutil.copytree(sketched, root / "sketched-more")
    run = _cli("train", "small.toml", "--resume", "sketched-more/checkpoints/step-000002", "--steps", "1",
               "--no-progress", cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rows weight-gradient sketch 0.5 on *.mlp.*" in run.stdout and "at step 2, to step 3" in run.stdout, \
        run.stdout
    record = root / "sketched-more" / "checkpoints" / "step-000003" / "tilegraph_sketch.json"
    assert json.loads(record.read_text()) == SKETCH


@pytest.mark.parametrize("checkpoint, args, message", [
    ("sketched", ["--set", "peft.sketch_ratio=0.25"],
     r"\[tilegraph train --resume\] the weight gradients of the run it continues \(grad_sketch = 'rows', "
     r"sketch_ratio = 0\.5, sketch_targets = \['\*\.mlp\.\*'\], from its checkpoint's tilegraph_sketch\.json\): "
     r"leave them out, or start a new run .*; received: --set peft\.sketch_ratio=0\.25$"),
    ("sketched", ["--set", "peft.grad_sketch=none"], r"received: --set peft\.grad_sketch=none$"),
    # exact gradients are recorded too: a sketch is not switched on halfway
    ("base", ["--set", "peft.grad_sketch=gaussian", "--set", "peft.sketch_ratio=0.3"],
     r"the weight gradients of the run it continues \(grad_sketch = 'none', from .*; received: "
     r"--set peft\.grad_sketch=gaussian; --set peft\.sketch_ratio=0\.3$"),
], ids=["another ratio", "no sketch", "a sketch on an exact run"])
def test_another_gradient_sketch_on_the_command_line_is_refused(root, sketched, capsys, monkeypatch, checkpoint,
                                                                 args, message):
    monkeypatch.chdir(root)
    before = _listing(root / checkpoint)
    ck = f"{checkpoint}/checkpoints/" + ("step-000002" if checkpoint == "sketched" else "step-000020")
    err = _main(capsys, "train", "small.toml", "--resume", ck, "--steps", "1", *args)
    assert re.search(message, err), err
    assert _listing(root / checkpoint) == before


def test_a_config_files_gradient_sketch_is_named_and_not_used_on_resume(root, sketched, capsys, monkeypatch):
    """A config file (perhaps the one the run started from, with flags over it) names another
    sketch: a warning, and the checkpoint's is used. A checkpoint written before the sketch was
    recorded takes the job's, as before."""
    from tilegraph.cli.config import apply_overrides, load_config
    from tilegraph.cli.runs import given_settings, plan_resume

    monkeypatch.chdir(root)
    (root / "gaussian.toml").write_text('[peft]\ngrad_sketch = "gaussian"\nsketch_targets = ["*"]\n')

    def planned(checkpoint):
        """The [peft] sketch of `tilegraph train gaussian.toml --resume CHECKPOINT --set train.steps=1`."""
        cfg, source = load_config("gaussian.toml")
        apply_overrides(cfg, ["train.steps=1"])
        plan_resume(checkpoint, cfg, given_settings("gaussian.toml", ["train.steps=1"], {}), source)
        return {k: cfg["peft"][k] for k in SKETCH}

    assert planned("sketched/checkpoints/step-000002") == SKETCH
    assert capsys.readouterr().err.strip() == (
        "tilegraph train: warning: grad_sketch = 'gaussian', sketch_targets = ['*'] in gaussian.toml not used: the "
        "resumed run computes its weight gradients as its checkpoint's run did (grad_sketch = 'rows', sketch_ratio = "
        "0.5, sketch_targets = ['*.mlp.*'])")
    old = root / "old" / "checkpoints" / "step-000002"
    shutil.copytree(sketched / "checkpoints" / "step-000002", old)
    (old / "tilegraph_sketch.json").unlink()  # as checkpoints were written before it was recorded
    assert planned(str(old)) == {"grad_sketch": "gaussian", "sketch_ratio": 0.2, "sketch_targets": ["*"]}
    assert capsys.readouterr().err == ""


def test_a_resume_reads_its_checkpoints_metadata_once(root, sketched, monkeypatch):
    """zarr.json (the attributes) and the records beside it are read once and handed on: the
    resume's checks, its output folder's and the Trainer's load read them four times."""
    from tilegraph.cli import main

    shutil.copytree(sketched, root / "once")
    ck = (root / "once" / "checkpoints" / "step-000002").resolve()
    reads = []
    read_text = Path.read_text

    def counted(self, *args, **kwargs):
        if Path(self).resolve().parent == ck:
            reads.append(Path(self).name)
        return read_text(self, *args, **kwargs)

    monkeypatch.chdir(root)
    monkeypatch.setattr(Path, "read_text", counted)
    assert main(["train", "small.toml", "--resume", "once/checkpoints/step-000002", "--steps", "1",
                 "--set", "output.checkpoint_keep=0", "--no-progress"]) == 0
    assert sorted(reads) == ["tilegraph_data.json", "tilegraph_sketch.json", "zarr.json"], reads


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


@pytest.mark.parametrize("args, message", [
    (["--set", "data.seq_len=16"], r"\[tilegraph train --resume\] the windows of the run it continues \(seq_len 32, "
                                   r"from its checkpoint\).*received: --set data\.seq_len=16$"),
    (["--set", "data.max_mb=0.6"], r"\[tilegraph train --resume\] the text of the run it continues \([\d,]+ tokens "
                                   r"\(sha256 \w+\)\).*received: [\d,]+ tokens \(sha256 \w+\) from --set "
                                   r"data\.max_mb=0\.6$"),
])
def test_a_resumed_run_reads_the_text_and_windows_of_the_run_it_continues(root, capsys, monkeypatch, args, message):
    # other [data] would draw other batches and another validation split, and the run's own
    # token file was rebuilt in place from it
    from tilegraph.cli import main

    monkeypatch.chdir(root)
    before = {p: p.read_bytes() for p in (root / "base").glob("tokens.bin*")}
    code = main(["train", "small.toml", "--resume", "base/checkpoints/step-000010", "--steps", "3", *args])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (after small.toml's dim, named in a warning)
    assert code == 2 and re.search(message, err), (code, err)
    assert {p: p.read_bytes() for p in (root / "base").glob("tokens.bin*")} == before
    assert not list((root / "base").glob(".tokens.resumed*"))


def test_a_run_on_ones_own_text_resumes_without_its_config(tmp_path):
    # the checkpoint records the run's [data] (tilegraph_data.json): without it the resume read the
    # shipped default's text (and is now refused for reading other text)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("def f(x):\n    return x * 2\n" * 3000)
    (tmp_path / "own.toml").write_text(CONFIG.replace("[data]\n", '[data]\nsources = ["text"]\npatterns = ["*.txt"]\n'))
    first = _cli("train", "own.toml", "--out", "own", "--steps", "4", "--no-progress", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    tokens = re.search(r"([\d,]+) tokens from 1 file", first.stdout).group(1)
    elsewhere = tmp_path / "elsewhere"  # another working folder: the recorded paths are absolute
    elsewhere.mkdir()
    more = _cli("train", "--resume", str(tmp_path / "own" / "checkpoints" / "step-000004"), "--steps", "2",
                "--no-progress", cwd=elsewhere)
    assert more.returncode == 0, more.stderr[-3000:]
    assert f"{tokens} tokens from 1 file" in more.stdout, more.stdout


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

    with training(root, "int", "small.toml", "--steps", "100000", "--set", "output.checkpoint_every=5",
                  records=12) as proc:  # a checkpoint is written
        err_file, deadline = root / "int.err", time.time() + 240
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: to the whole process group
        while "stopping after the steps under way" not in err_file.read_text():
            assert time.time() < deadline and proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # while it writes its checkpoint or closes the cluster
        proc.wait(timeout=120)
    err = err_file.read_text()
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    m = re.search(r"^tilegraph train: stopped at once; last checkpoint: (int/checkpoints/step-\d{6}) \(continue with "
                  r"tilegraph train small\.toml --set output\.checkpoint_every=5 --resume (\S+)\)$",
                  err.strip().splitlines()[-1])
    assert m and m.group(1) == m.group(2), err[-3000:]
    assert tg.io.load_checkpoint(root / m.group(1)).step >= 5
    assert not (root / "int" / ".tilegraph.lock").exists()


def test_a_sigterm_to_the_process_group_checkpoints_the_last_step(root):
    """Slurm's scancel (and `timeout`) signal every process of the job: the workers leave the
    SIGTERM to tilegraph train, which stops after the steps under way and checkpoints the last
    one. Before, the signal killed the workers (and the parameters they held): 'lost worker', no
    final checkpoint."""
    import tilegraph as tg

    with training(root, "term", "small.toml", "--steps", "100000", records=8) as proc:
        os.killpg(proc.pid, signal.SIGTERM)  # to every process of the group, the workers too
        proc.wait(timeout=180)
    out_file, err_file = root / "term.out", root / "term.err"
    stdout, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 143 and "lost worker" not in err and "Traceback" not in err, err[-3000:]
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


# ---------------------------------------------------------------------- legacy checkpoints ----
def _legacy_trainer(seed: int):
    """A debug GPT-2 (weights of ``seed``), its AdamW (no step yet) and a Trainer of them."""
    import numpy as np

    import tilegraph as tg
    from tilegraph.trainer import lm_loss

    model = tg.models.build("gpt2-debug", seed=seed)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    ids = np.zeros((2, 9), dtype=np.int64)
    trainer = tg.Trainer(model, opt, lambda step: (ids[:, :-1], ids[:, 1:]), loss_fn=lm_loss, batch_size=2,
                         progress=False)
    return model, opt, trainer


def _write_legacy(folder: Path, model, opt, change=lambda arrays, state: None) -> None:
    """A checkpoint of tilegraph's format before Zarr, as its Trainer wrote it: the Hugging Face
    folder of the model, ``optimizer.safetensors`` (every moment 0.5) and ``trainer_state.json``
    (step 7), after ``change(arrays, state)`` edits the moments and the state."""
    import numpy as np

    from tilegraph.io.safetensors import save_file

    model.to_hf(folder)
    names = {id(p): n for n, p in model.named_parameters()}
    arrays = {f"{names[id(p)]}.{k}": np.full(p.shape, 0.5, np.float32) for p in opt.params for k in opt.state_names}
    state = {"format": "tilegraph-trainer-1", "step": 7, "optimizer": "AdamW",
             "parameters": [names[id(p)] for p in opt.params]}
    change(arrays, state)
    save_file(arrays, folder / "optimizer.safetensors")
    (folder / "trainer_state.json").write_text(json.dumps(state))


def _moments(opt) -> list:
    return [t.numpy() for st in opt.state_tensors() for t in st.values()]


def test_a_legacy_checkpoint_resumes_weights_optimizer_state_and_step(tmp_path):
    import numpy as np

    source, source_opt, _ = _legacy_trainer(seed=1)
    _write_legacy(tmp_path / "legacy", source, source_opt)
    model, opt, trainer = _legacy_trainer(seed=0)
    assert trainer.load_checkpoint(tmp_path / "legacy") == 7 and opt.step_count == 7
    want = source.state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    assert all((m == 0.5).all() for m in _moments(opt))


@pytest.mark.parametrize("change, message", [
    # the weights loaded, then the optimizer's state failed: the model was left with the checkpoint's weights
    (lambda arrays, state: arrays.pop("wte.weight.exp_avg"),
     r"\[tilegraph\.Trainer\.load_checkpoint\] optimizer state for every parameter in \S+optimizer\.safetensors; "
     r"received: missing: wte\.weight\.exp_avg$"),
    (lambda arrays, state: arrays.update({"blocks.0.attn.q.weight.exp_avg_sq": arrays["wte.weight.exp_avg"]}),
     r"received: shape of blocks\.0\.attn\.q\.weight\.exp_avg_sq: \(96, 32\), expected \(32, 32\)$"),
    (lambda arrays, state: arrays.clear(),
     r"received: missing: wte\.weight\.exp_avg; missing: wte\.weight\.exp_avg_sq; missing: wpe\.weight\.exp_avg"),
    # weights and state set, then a KeyError
    (lambda arrays, state: state.pop("step"),
     r"\[tilegraph\.Trainer\.load_checkpoint\] a trainer_state\.json naming the checkpoint's step \(an integer "
     r">= 0\); received: \S+trainer_state\.json: step None$"),
], ids=["a moment missing", "a moment of another shape", "no moments", "no step"])
def test_a_legacy_checkpoint_that_does_not_fit_changes_nothing(tmp_path, change, message):
    """A legacy checkpoint (Hugging Face weights, optimizer.safetensors) is checked whole before
    the model or the optimizer changes, as a Zarr one is; the error names what is wrong."""
    import numpy as np

    import tilegraph as tg

    source, source_opt, _ = _legacy_trainer(seed=1)
    _write_legacy(tmp_path / "legacy", source, source_opt, change)
    model, opt, trainer = _legacy_trainer(seed=0)
    before, moments = model.state_dict(), _moments(opt)
    with pytest.raises(tg.TileError) as error:
        trainer.load_checkpoint(tmp_path / "legacy")
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert opt.step_count == 0 and all(np.array_equal(a, b) for a, b in zip(_moments(opt), moments))
    assert re.search(message, str(error.value)), error.value


def test_a_legacy_checkpoint_without_its_optimizer_file_changes_nothing(tmp_path):
    import numpy as np

    import tilegraph as tg

    source, source_opt, _ = _legacy_trainer(seed=1)
    _write_legacy(tmp_path / "legacy", source, source_opt)
    (tmp_path / "legacy" / "optimizer.safetensors").unlink()
    model, opt, trainer = _legacy_trainer(seed=0)
    before = model.state_dict()
    with pytest.raises(tg.TileError) as error:
        trainer.load_checkpoint(tmp_path / "legacy")
    assert all(np.array_equal(v, before[k]) for k, v in model.state_dict().items())
    assert re.search(r"optimizer\.safetensors\)\] cannot read the file; received: .*No such file", str(error.value))


def test_resuming_a_checkpoint_of_the_earlier_format_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source, source_opt, _ = _legacy_trainer(seed=1)
    _write_legacy(tmp_path / "legacy", source, source_opt)
    err = _main(capsys, "train", "--resume", "legacy")
    assert "[tilegraph train --resume] a Zarr checkpoint" in err and "tilegraph.Trainer.load_checkpoint" in err
    assert "tilegraph convert legacy NEW" in err and "received: legacy: a Hugging Face folder with trainer_state.json" in err


def test_a_resume_takes_the_runs_architecture_from_its_checkpoint(root, capsys, monkeypatch):
    """A run whose [model] came from the command line resumes without it (as tilegraph's own
    'continue with tilegraph train --resume CKPT' says); a [model] key given that disagrees with
    the checkpoint is refused in one line (it built the job's model and failed on every array)."""
    from tilegraph.cli import main

    monkeypatch.chdir(root)
    assert main(["train", "small.toml", "--out", "arch", "--steps", "2", "--set", "model.dim=48", "--no-progress",
                 "--set", "output.checkpoint_every=0"]) == 0
    capsys.readouterr()
    assert main(["train", "small.toml", "--resume", "arch/checkpoints/step-000002", "--steps", "1",
                 "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint: arch/checkpoints/step-000003" in out
    # the config file's flavor (dim 32) is not the run's: named, and not used
    assert ("tilegraph train: warning: flavor = 'gpt2-debug' has dim 32, arch/checkpoints/step-000002 dim 48 "
            "in small.toml not used: the resumed run keeps its checkpoint's GPT2Config") in err
    err = _main(capsys, "train", "small.toml", "--resume", "arch/checkpoints/step-000003", "--steps", "1",
                "--set", "model.dim=32")
    assert "[tilegraph train [model]] [model] keys that agree with --resume's GPT2Config" in err
    assert "received: dim = 32, arch/checkpoints/step-000003 has 48" in err


def test_a_run_resumes_with_the_command_that_started_it(root, capsys, monkeypatch):
    """A flavor on the command line and dim in the config file: the resume with the same command
    was refused ("flavor = 'gpt2-debug' has dim 32, ... dim 48"), each group of keys checked
    without the other's."""
    from tilegraph.cli import main

    monkeypatch.chdir(root)
    (root / "dim48.toml").write_text(CONFIG.replace("[model]", "[model]\ndim = 48", 1))
    args = ["train", "dim48.toml", "--set", "model.flavor=gpt2-debug", "--no-progress", "--set",
            "output.checkpoint_every=0"]
    assert main(args + ["--out", "flagged", "--steps", "2"]) == 0
    capsys.readouterr()
    assert main(args + ["--resume", "flagged/checkpoints/step-000002", "--steps", "1"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint: flagged/checkpoints/step-000003" in out and "warning" not in err
