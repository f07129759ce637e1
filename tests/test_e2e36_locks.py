"""End to end: one run at a time in a Trainer's folders (the lock `tilegraph train` takes on its run
folder, now taken by Trainer.fit on its checkpoint_dir and log_dir too), and `tilegraph train
--resume` without the run's config evaluating as the run did (eval_every, eval_batches)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import mse, regression_data

import tilegraph as tg

LOCK = ".tilegraph.lock"


def _trainer(model=None, opt=None, **kw):
    """A small MLP trainer in this process (no cluster), evaluating every step."""
    model = model or tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    opt = opt or tg.optim.AdamW(model.parameters(), lr=1e-2)
    return tg.Trainer(model, opt, regression_data(0, 64), loss_fn=mse, batch_size=64, eval_data=regression_data(1, 64), eval_batches=1,
                      eval_every=1, progress=False, **kw)


#: another process fitting in the folders argv[1] (checkpoint_dir) and argv[2] (log_dir): after its
#: first step it writes argv[3] and waits (up to 2 minutes) for argv[4] to exist, then ends its fit
HOLDER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_e2e36_locks import _trainer
ck, log, ready, go = map(Path, sys.argv[1:5])
def wait(trainer, stats):
    if not ready.exists():
        ready.write_text(str(trainer.optimizer.step_count))
        deadline = time.time() + 120
        while not go.exists() and time.time() < deadline:
            time.sleep(0.05)
_trainer(checkpoint_dir=ck, log_dir=log, on_step=[wait], steps_per_graph=1).fit(2)
print("done", flush=True)
"""


def _holder(tmp_path):
    """Start :data:`HOLDER` on ``tmp_path/ck`` and ``tmp_path/log``; returns (process, go file)
    once it has run a step (its fit holds the folders)."""
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(tests=str(Path(__file__).parent)),
                             str(tmp_path / "ck"), str(tmp_path / "log"), str(ready), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ready.exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(proc.communicate()[1][-3000:])
        time.sleep(0.05)
    return proc, go


def _runs(log: Path) -> set:
    return {json.loads(line)["run"] for line in (log / "metrics.jsonl").read_text().splitlines()}


def test_fit_refuses_folders_another_process_is_fitting_in(tmp_path, capsys):
    """Two processes running Trainer(..., checkpoint_dir=D, log_dir=L).fit on the same folders both
    trained: the second failed only at its first checkpoint ("must not exist yet"), and
    metrics.jsonl interleaved two run ids. Now the second fit is refused at once, naming the folder
    and the other process's pid and host, with nothing written; `tilegraph train` into L is refused
    naming the Trainer's fit; once the first fit ends (its lock gone) the folders are free."""
    proc, go = _holder(tmp_path)
    try:
        before = (tmp_path / "log" / "metrics.jsonl").read_bytes()
        second = _trainer(checkpoint_dir=tmp_path / "ck", log_dir=tmp_path / "log")
        with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.fit\] a checkpoint_dir no other run is using") \
                as caught:
            second.fit(2)
        message = str(caught.value)
        assert f"{tmp_path / 'ck'} is in use by tilegraph.Trainer.fit (pid {proc.pid} on {socket.gethostname()})" \
            in message and f"received: {tmp_path / 'ck' / LOCK}" in message, message
        assert second.optimizer.step_count == 0 and (tmp_path / "log" / "metrics.jsonl").read_bytes() == before
        held = json.loads((tmp_path / "ck" / LOCK).read_text())
        assert held == {"pid": proc.pid, "host": socket.gethostname(), "by": "tilegraph.Trainer.fit"}
        assert json.loads((tmp_path / "log" / LOCK).read_text())["pid"] == proc.pid  # its locks left as they were
        # the log_dir alone is held too (another checkpoint_dir, the same metrics.jsonl)
        with pytest.raises(tg.TileError, match=r"a log_dir no other run is using.* is in use by tilegraph.Trainer.fit "
                           rf"\(pid {proc.pid} "):
            _trainer(checkpoint_dir=tmp_path / "ck2", log_dir=tmp_path / "log").fit(1)
        assert not (tmp_path / "ck2" / LOCK).exists()  # the checkpoint_dir it took first, given back
        # tilegraph train names the Trainer holding its output folder
        from tilegraph.cli import main

        assert main(["train", "--out", str(tmp_path / "log"), "--steps", "1", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by tilegraph.Trainer.fit (pid {proc.pid} on " in err, err
    finally:
        go.write_text("")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "done" in out, err[-3000:]
    assert not (tmp_path / "ck" / LOCK).exists() and not (tmp_path / "log" / LOCK).exists()
    with pytest.warns(UserWarning, match="ends with another run's records"):  # free now (a run of its own)
        res = _trainer(checkpoint_dir=tmp_path / "ck3", log_dir=tmp_path / "log").fit(1)
    assert res.steps == 1 and len(_runs(tmp_path / "log")) == 2


def test_fit_takes_over_the_lock_of_a_process_that_is_gone(tmp_path):
    """A fit killed (SIGKILL: no cleanup) leaves its lock: the next fit there takes it over, as
    `tilegraph train` does a dead run's, and gives it back when it ends."""
    proc, go = _holder(tmp_path)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert json.loads((tmp_path / "ck" / LOCK).read_text())["pid"] == proc.pid  # left behind
    seen = []

    def look(trainer, stats):
        seen.append(json.loads((tmp_path / "ck" / LOCK).read_text())["pid"])

    trainer = _trainer(checkpoint_dir=tmp_path / "ck", log_dir=tmp_path / "log", on_step=[look])
    with pytest.warns(UserWarning, match="ends with another run's records"):  # the killed run's first step
        res = trainer.fit(2)
    assert res.steps == 2 and seen == [os.getpid()] * 2
    assert not (tmp_path / "ck" / LOCK).exists() and not (tmp_path / "log" / LOCK).exists()


def test_a_trainer_built_again_in_this_process_fits_and_one_still_fitting_blocks_it(tmp_path):
    """In one process (a notebook): the lock is held while a fit runs and given back however it
    ends (returned, KeyboardInterrupt, an error), so a Trainer built again on the same folders (its
    cell run again) fits and continues the run; a trainer still fitting in another thread is
    named, as another process is."""
    ck, log = tmp_path / "ck", tmp_path / "log"
    inside = []

    def look(trainer, stats):
        inside.append((json.loads((ck / LOCK).read_text()), json.loads((log / LOCK).read_text())["pid"]))

    first = _trainer(checkpoint_dir=ck, log_dir=log, on_step=[look])
    first.fit(2)
    mine = {"pid": os.getpid(), "host": socket.gethostname(), "by": "tilegraph.Trainer.fit"}
    assert inside == [(mine, os.getpid())] * 2 and not (ck / LOCK).exists() and not (log / LOCK).exists()

    def stop(trainer, stats):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the notebook's stop button
        _trainer(first.model, first.optimizer, checkpoint_dir=ck, log_dir=log, on_step=[stop]).fit(2)
    assert not (ck / LOCK).exists() and not (log / LOCK).exists()

    def fail(trainer, stats):
        raise RuntimeError("a hook's bug")

    with pytest.raises(RuntimeError, match="a hook's bug"):
        _trainer(first.model, first.optimizer, checkpoint_dir=ck, log_dir=log, on_step=[fail]).fit(1)
    assert not (ck / LOCK).exists() and not (log / LOCK).exists()
    # the cell run again: a new Trainer on the same model, optimizer and folders goes on (the run's id)
    again = _trainer(first.model, first.optimizer, checkpoint_dir=ck, log_dir=log)
    start = first.optimizer.step_count
    again.fit(1)
    assert first.optimizer.step_count == start + 1 and _runs(log) == {first.run_id}

    # a trainer whose fit still runs (in a thread) holds them
    running, go, errors = threading.Event(), threading.Event(), []

    def wait(trainer, stats):
        running.set()
        go.wait(60)

    def background():
        try:
            _trainer(checkpoint_dir=tmp_path / "ck2", log_dir=tmp_path / "log2", on_step=[wait],
                     steps_per_graph=1).fit(2)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert running.wait(60)
        with pytest.raises(tg.TileError, match=r"a log_dir no other run is using.* is in use by another Trainer of "
                           rf"this process \(pid {os.getpid()} on .*\), whose fit still runs"):
            _trainer(checkpoint_dir=tmp_path / "ck3", log_dir=tmp_path / "log2").fit(1)
    finally:
        go.set()
        thread.join(120)
    assert not errors and not (tmp_path / "log2" / LOCK).exists() and not (tmp_path / "ck3" / LOCK).exists()


#: a run that evaluates otherwise than the shipped config (eval_every 100, eval_batches 4)
OWN_EVAL = """
[model]
flavor = "gpt2-debug"
vocab_size = "tokenizer"
[data]
max_mb = 0.3
seq_len = 32
[train]
steps = 12
batch_size = 4
warmup = 3
eval_every = 4
eval_batches = 1
[output]
checkpoint_every = 6
checkpoint_keep = 0
"""


@pytest.mark.distributed
def test_cli_resume_without_the_config_evaluates_as_the_run_did(tmp_path):
    """`tilegraph train --resume CHECKPOINT` without the run's config took [train] eval_every and
    eval_batches from the shipped config: the resumed run evaluated only at its end, over 4 batches
    where the run's covered 1, and the validation curve jumped where it resumed. Now checkpoints
    record both and the resumed run keeps them: its validation losses are the uninterrupted run's.
    The run's folder holds no lock once it ends (the job's and its Trainer's)."""
    from test_cli import _cli

    (tmp_path / "own.toml").write_text(OWN_EVAL)
    full = _cli("train", "own.toml", "--out", "full", "--no-progress", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    assert not (tmp_path / "full" / LOCK).exists() and not (tmp_path / "full" / "checkpoints" / LOCK).exists()
    ck = "full/checkpoints/step-000006"
    run = _cli("train", "--resume", ck, "--out", "resumed", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "warning" not in run.stderr, run.stderr

    def val(folder):
        records = map(json.loads, (tmp_path / folder / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}

    want, got = val("full"), val("resumed")
    assert sorted(want) == [4, 8, 12] and sorted(got) == [8, 12], (want, got)
    np.testing.assert_allclose([got[8], got[12]], [want[8], want[12]], rtol=1e-5)
    state = tg.io.load_checkpoint(tmp_path / ck).trainer_state
    assert state["eval_every"] == 4 and state["eval_batches"] == 1


def test_resume_keeps_the_checkpoints_evaluation_settings_unless_the_command_line_gives_others(capsys):
    """The rule of keep_eval_settings: the checkpoint's values where the job gives none; a config
    file's other value named in a warning and not used (as for the neighbouring kept settings); a
    command-line value used (they change no weight, only what is measured), another eval_batches
    with a warning line; a checkpoint without the record leaves the job's values (the earlier
    behaviour)."""
    from tilegraph.cli.runs import keep_eval_settings

    state = {"eval_every": 4, "eval_batches": 1}
    t = {"eval_every": 100, "eval_batches": 4}
    keep_eval_settings(state, 6, t, {})
    assert t == {"eval_every": 4, "eval_batches": 1} and capsys.readouterr().err == ""

    t = {"eval_every": 100, "eval_batches": 8}
    keep_eval_settings(state, 6, t, {"train.eval_every": "my.toml", "train.eval_batches": "my.toml"})
    err = capsys.readouterr().err
    assert t == {"eval_every": 4, "eval_batches": 1}
    assert "warning: eval_every = 100, eval_batches = 8 in my.toml not used: the resumed run evaluates as its " \
        "checkpoint's run did (eval_every 4, eval_batches 1" in err, err

    t = {"eval_every": 2, "eval_batches": 3}
    keep_eval_settings(state, 6, t, {"train.eval_every": "--set train.eval_every=2",
                                     "train.eval_batches": "--set train.eval_batches=3"})
    err = capsys.readouterr().err
    assert t == {"eval_every": 2, "eval_batches": 3} and len(err.splitlines()) == 1, err
    assert "warning: --set train.eval_batches=3: the validation losses after step 6 cover 3 batches, the run's up " \
        "to it 1 batch" in err, err

    t = {"eval_every": 100, "eval_batches": 4}
    keep_eval_settings({"batch_size": 4}, 6, t, {})  # written before they were recorded
    assert t == {"eval_every": 100, "eval_batches": 4} and capsys.readouterr().err == ""
