"""End to end: a long training run with interruptions, where features meet (restarts after a lost
worker with evaluations, resuming a run across worker counts and strategies, the CLI's resume).
Each compares with an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal

import numpy as np
import pytest
from conftest import mse, regression_data

import tilegraph as tg


def _trainer(rt, steps, **kw):
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-2, 4, steps), clip_grad_norm=1.0)
    return tg.Trainer(model, opt, regression_data(0, 256), rt, loss_fn=mse, batch_size=256, batch_tiles=[(64, 8), (64, None)],
                      eval_data=regression_data(1, 256), eval_batches=1, progress=False, **kw)


@pytest.mark.distributed
def test_restart_after_a_lost_worker_keeps_each_evaluation_once(tmp_path):
    """A worker killed after step 7 (evaluations every 2 steps, checkpoints every 4): the restart
    from step 4's checkpoint evaluates steps 6 and 8 again. FitResult.val_losses kept the
    abandoned evaluation of step 6 beside the rerun's ((6, v) twice), while FitResult.losses
    keeps only the rerun's; now it holds one per step, those of an uninterrupted run."""
    from distributed import wait

    rt = tg.connect(n_workers=2, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    try:
        pids = rt.client.run(os.getpid)
        lost = []

        def hook(trainer, stats):
            if not lost and trainer.optimizer.step_count >= 7:
                futures = [c.value.future for p in trainer.optimizer.params for c in p.cells.flat
                           if hasattr(c.value, "future")]
                wait(futures)
                held = {w for ws in rt.client.who_has(futures).values() for w in ws}
                lost.append(sorted(held)[0])
                os.kill(pids[lost[0]], signal.SIGKILL)

        trainer = _trainer(rt, 12, checkpoint_dir=tmp_path / "ck", checkpoint_every=4, eval_every=2,
                           restart_on_failure=True, on_step=[hook], steps_per_graph=1)
        res = trainer.fit(12)
        assert len(res.restarts) == 1 and res.restarts[0]["step"] == 4, res.restarts
        assert [s for s, _ in res.val_losses] == [2, 4, 6, 8, 10, 12]
        ref = _trainer(rt, 12, eval_every=2, steps_per_graph=1)
        want = ref.fit(12)
        np.testing.assert_allclose(res.losses, want.losses, rtol=1e-5)
        np.testing.assert_allclose([v for _, v in res.val_losses], [v for _, v in want.val_losses], rtol=1e-5)
    finally:
        rt.close()


#: a run whose weight decay and clipping are not the shipped config's (0.1 and 1.0)
OWN_UPDATE = """
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
weight_decay = 0.0
clip_grad_norm = 0.05
eval_every = 0
eval_batches = 1
[output]
checkpoint_every = 6
checkpoint_keep = 0
"""


@pytest.mark.distributed
def test_cli_resume_without_the_config_keeps_the_runs_weight_decay_and_clipping(tmp_path):
    """`tilegraph train --resume CHECKPOINT` without the run's config (it reads the data, the
    schedule and the batches from the checkpoint) trained on with the shipped config's
    weight_decay 0.1 and clip_grad_norm 1.0 instead of the run's 0.0 and 0.05: its losses left the
    uninterrupted run's. Now it keeps the checkpoint's, as it does the schedule; another value on
    the command line is refused."""
    from test_cli import _cli

    (tmp_path / "own.toml").write_text(OWN_UPDATE)
    full = _cli("train", "own.toml", "--out", "full", "--no-progress", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    ck = "full/checkpoints/step-000006"
    refused = _cli("train", "--resume", ck, "--out", "other", "--set", "train.weight_decay=0.3", cwd=tmp_path)
    assert refused.returncode == 2 and "the weight decay and gradient clipping of the run it continues " \
        "(weight_decay 0, clip_grad_norm 0.05, from its checkpoint)" in refused.stderr, refused.stderr[-3000:]
    assert "received: --set train.weight_decay=0.3" in refused.stderr
    run = _cli("train", "--resume", ck, "--out", "resumed", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]

    def losses(folder):
        records = map(json.loads, (tmp_path / folder / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in records if "loss" in r}

    want, got = losses("full"), losses("resumed")
    assert sorted(got) == list(range(7, 13))
    np.testing.assert_allclose([got[s] for s in range(7, 13)], [want[s] for s in range(7, 13)], rtol=1e-5)


def _token_trainer(tmp_path, token_file="t.bin", seq_len=16, **data_kw):
    import dataclasses

    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    if not (tmp_path / "t.bin").is_file():
        (tmp_path / "text.txt").write_text("hello tilegraph, resumed " * 400)
        build_token_file([tmp_path / "text.txt"], tmp_path / "t.bin", ByteTokenizer(eos=True))
    data = TokenDataset(tmp_path / token_file, seq_len, split="train", seed=0, **data_kw)
    cfg = dataclasses.replace(tg.models.GPT2Config.flavor("debug"), vocab_size=data.vocab_size, max_seq_len=16)
    model = tg.models.build(cfg, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.Trainer(model, opt, data, batch_size=4, progress=False)


def test_loading_a_checkpoint_of_other_windows_warns(tmp_path):
    """A checkpoint loaded into a Trainer whose TokenDataset cuts other windows than the run's (another
    seq_len; another val_fraction or token file, so another train split) was taken without a word,
    as another batch_size was not before it warned: the next batches are other windows than the
    run's. The same data at another path (a run folder copied) is the same run."""
    import shutil
    import warnings

    first = _token_trainer(tmp_path)
    first.save_checkpoint(tmp_path / "ck")
    shutil.copy(tmp_path / "t.bin", tmp_path / "copy.bin")
    shutil.copy(tmp_path / "t.bin.json", tmp_path / "copy.bin.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _token_trainer(tmp_path, "copy.bin").load_checkpoint(tmp_path / "ck")
    with pytest.warns(UserWarning, match=r"written by a run with seq_len 16; this trainer has seq_len 8: from step 1 "
                      r"on, the next batches are other windows than that run's") as caught:
        _token_trainer(tmp_path, seq_len=8).load_checkpoint(tmp_path / "ck")
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with pytest.warns(UserWarning, match=r"written by a run with split tokens \[0, \d+\) of \d+; this trainer has "
                      r"split tokens \[0, \d+\) of \d+: from step 1 on, the next batches are other windows"):
        _token_trainer(tmp_path, val_fraction=0.3).load_checkpoint(tmp_path / "ck")


@pytest.mark.distributed
def test_cli_resume_checks_the_checkpoints_batch_against_the_workers(tmp_path, capsys):
    """A run of batch_size 4 in 4 micro-batches (one window each), resumed without its config onto
    2 worker processes with parallel = "sharded": the config's own batch (8 / 1) passed the check of
    [runtime] against [train], then the checkpoint's replaced it, and the job read its text, started
    the cluster and resumed before the first step failed inside tilegraph.Executable. Now the
    settings as the checkpoint completes them are checked, before any work, naming the keys."""
    from test_cli import _cli

    from tilegraph.cli import main

    (tmp_path / "own.toml").write_text(OWN_UPDATE)
    run = _cli("train", "own.toml", "--out", "small", "--steps", "2", "--set", "train.accum_steps=4",
               "--set", "runtime.workers=1", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    ck = str(tmp_path / "small" / "checkpoints" / "step-000002")
    code = main(["train", "--resume", ck, "--steps", "1", "--no-progress", "--set", "runtime.workers=2",
                 "--set", "runtime.parallel=sharded"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert "train.batch_size / train.accum_steps (4 / 4) must give each of the runtime.workers (2) worker " \
        "processes a sequence with runtime.parallel = 'sharded'" in err and f"--resume {ck}" in err, err


@pytest.mark.distributed
def test_cli_lost_worker_says_how_to_resume_in_the_commands_words(tmp_path):
    """A worker process killed under `tilegraph train` (2 workers, "sharded"): the error told the
    command-line user to call Trainer.load_checkpoint(...) or build Trainer(restart_on_failure=True),
    the Python API's advice. Now it names the --resume command of the newest checkpoint and [train]
    restart_on_failure."""
    import subprocess
    import time

    import psutil
    from test_cli import _cli, training

    (tmp_path / "own.toml").write_text(OWN_UPDATE)
    with training(tmp_path, "run", "own.toml", "--steps", "200", "--set", "runtime.workers=2",
                  "--set", "runtime.parallel=sharded", records=8) as proc:
        ckdir = tmp_path / "run" / "checkpoints"
        deadline = time.time() + 60
        while not (ckdir / "step-000006").is_dir():  # committed within a step or two
            assert time.time() < deadline and proc.poll() is None
            time.sleep(0.05)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "multiprocessing.spawn" in " ".join(p.cmdline())]
        assert len(workers) == 2, workers
        os.kill(workers[-1].pid, signal.SIGKILL)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail("the run went on after its worker was killed")
    err = (tmp_path / "run.err").read_text()
    assert code == 2, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert "Trainer.load_checkpoint" not in line and "Trainer(restart_on_failure" not in line, line
    found = re.search(r"\[tilegraph train\] lost worker \S+ \(left the cluster.*\) while .* ran: what it held of the "
                      r"parameters and optimizer state is gone; continue from the newest checkpoint, (\S+), with "
                      r"tilegraph train own.toml --set runtime.workers=2 --set runtime.parallel=sharded --resume (\S+) \(the "
                      r"steps after it run again\); or set \[train\] "
                      r"restart_on_failure \(--set train.restart_on_failure=2\)", line)
    assert found and found.group(1) == found.group(2), line
