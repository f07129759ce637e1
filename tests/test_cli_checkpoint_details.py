"""Details of checkpoints that worked without a test:

1. ``tilegraph train --help`` says what ``--steps`` counts: the steps of a run, and on a resume
   the steps added after the checkpoint's step (the behaviour itself: test_cli_resume.py,
   ``test_resuming_an_earlier_checkpoint_keeps_it_and_sets_the_later_ones_aside`` resumes step 10
   with ``--steps 6`` and logs steps 11-16; ``test_resume_without_steps_finishes_the_runs_step_budget``
   the run without ``--steps``);
2. a single Ctrl-C (SIGINT) during ``tilegraph train`` finishes the steps under way, writes one
   final checkpoint of the step reached and exits 130 with a message (the second Ctrl-C and
   SIGTERM have their tests in test_cli_resume.py and test_cli.py);
3. ``tilegraph info CHECKPOINT`` prints the step, the format and the user metadata;
4. the tokenizer files of a checkpoint are written into its temporary folder before it is
   verified and renamed (committed), never after.
"""

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from test_cli import SMALL, _cli, training  # the small job; `python -m tilegraph.cli` in a subprocess

#: SMALL without the validation every 12 steps (the run below stops at a Ctrl-C, not at its budget)
CONFIG = SMALL.replace("eval_every = 12", "eval_every = 0")


# -- 1. what --steps counts ----------------------------------------------------------------------
def test_train_help_says_steps_count_the_run_and_on_resume_the_steps_added(tmp_path):
    run = _cli("train", "--help", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    text = " ".join(run.stdout.split())  # argparse wraps the help at the terminal's width
    m = re.search(r"--steps STEPS (.*?) --lr LR", text)
    assert m, text
    steps_help = m.group(1)
    # a fresh run: the steps it runs; a resumed one: the steps added after the checkpoint's step
    assert steps_help.startswith("optimizer steps to run (overrides [train] steps)"), steps_help
    assert "with --resume, the steps added after the checkpoint's step" in steps_help, steps_help
    assert "without --steps a resumed run finishes the step budget it started with" in steps_help, steps_help
    # --resume's own help sends the reader to --steps for the same rule
    r = re.search(r"--resume RESUME (.*?) --no-progress", text)
    assert r and "up to its step budget (see --steps)" in r.group(1), text


# -- 2. a single Ctrl-C -----------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_single_ctrl_c_finishes_the_steps_under_way_and_checkpoints_the_step_reached(tmp_path):
    import tilegraph as tg

    (tmp_path / "small.toml").write_text(CONFIG)
    # no periodic checkpoint (checkpoint_every = 0: only at the end): the one found is the Ctrl-C's
    with training(tmp_path, "run", "small.toml", "--steps", "100000", "--set", "output.checkpoint_every=0",
                  records=3) as proc:
        signalled = time.time()
        os.killpg(proc.pid, signal.SIGINT)  # one Ctrl-C, as a terminal sends it: to the whole process group
        proc.wait(timeout=120)
        took = time.time() - signalled
    out_file, err_file, metrics = tmp_path / "run.out", tmp_path / "run.err", tmp_path / "run" / "metrics.jsonl"
    stdout, err = out_file.read_text(), err_file.read_text()
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert took < 120
    assert "tilegraph train: SIGINT: stopping after the steps under way and writing a checkpoint (again to stop " \
           "at once)" in err, err[-3000:]
    assert "stopped at once" not in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    m = re.search(r"^stopped at step (\d+); checkpoint: (run/checkpoints/step-(\d{6})) \(continue with "
                  r"tilegraph train small\.toml --set output\.checkpoint_every=0 --resume run/checkpoints/step-\d{6}\)$",
                  stdout, re.M)
    assert m, stdout[-3000:] + err[-3000:]
    step = int(m.group(1))
    assert int(m.group(3)) == step >= 3
    logged = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if "loss" in r]
    assert logged == list(range(1, step + 1))  # every step run was logged, and the checkpoint is of the last
    ckdir = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ckdir.iterdir()] == [f"step-{step:06d}"]  # one checkpoint, the final one
    ck = tg.io.load_checkpoint(ckdir / f"step-{step:06d}")
    assert ck.step == step and ck.trainer_state["next_step"] == step + 1
    assert (ck.path / "tilegraph_tokenizer.json").is_file()
    leftovers = [str(p) for p in (tmp_path / "run").rglob("*") if ".tmp" in p.name]  # .step-N.tmp-PID-HEX-HOST
    assert not leftovers, leftovers
    assert not (tmp_path / "run" / ".tilegraph.lock").exists()


# -- 3. tilegraph info CHECKPOINT ------------------------------------------------------------------------
def test_info_prints_a_checkpoints_step_format_and_metadata(tmp_path):
    import tilegraph as tg
    from tilegraph import models

    model = models.build("gpt2-debug", seed=0)
    path = tg.io.save_checkpoint(tmp_path / "ck", model, step=5, metadata={"note": "hello", "n": 3})
    info = tg.io.load_checkpoint(path).info
    run = _cli("info", str(path), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"checkpoint {path}: step 5, format {info['format']} v{info['version']}, created "), \
        run.stdout
    meta = [line for line in lines if line.startswith("metadata: ")]
    assert len(meta) == 1 and json.loads(meta[0][len("metadata: "):]) == {"note": "hello", "n": 3}, run.stdout
    assert "model/wte.weight" in run.stdout  # and its arrays

    bare = tg.io.save_checkpoint(tmp_path / "bare", model, step=2)  # no metadata: no metadata line
    run = _cli("info", str(bare), cwd=tmp_path)
    assert run.returncode == 0 and ": step 2, format " in run.stdout, run.stderr[-3000:]
    assert "metadata:" not in run.stdout, run.stdout


# -- 4. the tokenizer files go in before the commit ----------------------------------------------------
def test_the_tokenizer_files_are_in_the_temporary_folder_when_it_is_verified_and_renamed(tmp_path, monkeypatch):
    """The files tilegraph train hands the Trainer (tokenizer_files: the tokenizer's description
    and the Hugging Face tokenizer.json and tokenizer_config.json) are in the checkpoint's
    temporary folder when it is verified and when it is renamed to its name, in the periodic
    (background) saves of fit and in Trainer.save_checkpoint."""
    import tilegraph as tg
    from tilegraph.cli import tokenizer_files
    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file
    from tilegraph.io import zarr as tz
    from tilegraph.io._store import TMP_MARK

    tok = ByteTokenizer(eos=True)
    files = tokenizer_files(tok)
    assert {"tilegraph_tokenizer.json", "tokenizer.json", "tokenizer_config.json"} <= set(files), sorted(files)
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    build_token_file([tmp_path / "a.txt"], tmp_path / "t.bin", tok)
    data = TokenDataset(tmp_path / "t.bin", 16, split="train", seed=0)
    import dataclasses

    config = dataclasses.replace(tg.models.config("gpt2-debug"), vocab_size=tok.vocab_size, max_seq_len=16)
    model = tg.models.build(config, seed=0)

    def missing(folder: Path) -> list[str]:
        return [n for n, data in files.items()
                if not ((folder / n).is_file() and (folder / n).read_bytes() == data)]

    verified, renamed = [], []
    real_verify, real_rename = tz._verify, os.rename

    def verify(tmp, *args, **kwargs):
        verified.append((Path(tmp).name, missing(Path(tmp))))
        return real_verify(tmp, *args, **kwargs)

    def rename(src, dst, *args, **kwargs):
        if TMP_MARK in Path(src).name:  # a checkpoint's commit (not the other renames of a run)
            assert not os.path.exists(dst)
            renamed.append((Path(dst).name, missing(Path(src))))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(tz, "_verify", verify)
    monkeypatch.setattr(os, "rename", rename)  # (io/zarr.py commits with os.rename)
    trainer = tg.Trainer(model, tg.optim.AdamW(model.parameters(), lr=1e-3), data, batch_size=2, progress=False,
                         checkpoint_dir=tmp_path / "ck", checkpoint_every=2, checkpoint_files=files)
    res = trainer.fit(4)
    final = trainer.save_checkpoint(tmp_path / "final")
    assert [Path(p).name for p in res.checkpoints] == ["step-000002", "step-000004"]
    assert renamed == [("step-000002", []), ("step-000004", []), ("final", [])], renamed
    assert len(verified) == 3 and all(TMP_MARK in name and not gone for name, gone in verified), verified
    for folder in (tmp_path / "ck" / "step-000004", final):
        assert not missing(folder)
        assert tg.io.load_checkpoint(folder).step == 4


def test_info_says_when_a_checkpoint_is_damaged_and_verify_reads_every_chunk(tmp_path):
    """tilegraph info checks that every chunk file is there with its size (a stat each) and exits 1
    naming what is wrong; --verify also reads every chunk against its CRC32C, which finds a flipped
    bit in a file of the right size. An intact checkpoint passes both."""
    import tilegraph as tg
    from tilegraph import models

    path = tg.io.save_checkpoint(tmp_path / "ck", models.build("gpt2-debug", seed=0), step=1)
    for extra in ((), ("--verify",)):
        run = _cli("info", str(path), *extra, cwd=tmp_path)
        assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith("chunks: every chunk "), run.stderr
    chunk = path / "model" / "wte.weight" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[10] ^= 1
    chunk.write_bytes(bytes(data))
    run = _cli("info", str(path), cwd=tmp_path)
    assert run.returncode == 0, run.stderr  # the sizes are right: only reading finds it
    run = _cli("info", str(path), "--verify", cwd=tmp_path)
    assert run.returncode == 1 and "DAMAGED: 1 problem" in run.stderr, run.stderr
    assert re.search(r"array 'model/wte.weight': a chunk failed its checksum \(corrupted.*c\.0\.0: CRC32C [0-9a-f]{8} of "
                     r"its bytes, [0-9a-f]{8} stored", run.stderr), run.stderr
    short = path / "model" / "wpe.weight" / "c.0.0"
    short.write_bytes(short.read_bytes()[:100])
    run = _cli("info", str(path), cwd=tmp_path)
    assert run.returncode == 1 and "wrong size: model/wpe.weight/c.0.0: 100 bytes, expected " in run.stderr, run.stderr
    assert tg.io.load_checkpoint(path).check() == [f"wrong size: model/wpe.weight/c.0.0: 100 bytes, expected "
                                                   f"{32 * 32 * 4 + 4}"]
