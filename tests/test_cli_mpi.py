"""``mpiexec -n N tilegraph train CONFIG --mpi``: the installed command itself under an MPI launch
(rank 0 the scheduler, rank 1 the command, ranks >= 2 workers), a tiny config: it trains its
steps, logs them, writes a checkpoint that loads, and ends within a time limit (a hang fails the
test instead of holding up CI). Too few ranks (``-n 2``, ``-n 1``) end at once with one error line
naming the rank count, and write nothing.

Scripts that call the library under mpiexec: test_mpi.py and test_newuser_mpi.py (which also run
``python -m tilegraph.cli train`` under mpiexec, without a config file or with ``[runtime] mpi``)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import mpiexec_or_skip
from test_cli import end_group

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

#: a few steps of the debug GPT-2 on a little of the standard library's sources; the ranks listen on
#: the loopback interface (one host)
TINY = """
[model]
flavor = "gpt2-debug"
vocab_size = "tokenizer"
[data]
max_mb = 0.1
seq_len = 32
[train]
steps = 4
batch_size = 4
warmup = 1
eval_every = 0
[output]
checkpoint_every = 0
[runtime]
interface = "lo"
"""


def _tilegraph() -> list[str]:
    """The installed ``tilegraph`` command (the entry point users run), else the module."""
    here = Path(sys.executable).parent / "tilegraph"
    found = str(here) if here.exists() else shutil.which("tilegraph")
    return [found] if found else [sys.executable, "-m", "tilegraph.cli"]


def _launch(cwd: Path, n: int, args: list[str], timeout: float) -> tuple[int, str, str, float]:
    """``mpiexec -n n tilegraph *args`` in ``cwd``: (status, stdout, stderr, seconds). A launch still
    running after ``timeout`` seconds is ended with its process group (every rank) and fails the
    test (a hang)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for key in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE"):
        env.pop(key, None)  # pytest itself run under a launch: this one is a launch of its own
    t0 = time.monotonic()
    proc = subprocess.Popen([mpiexec_or_skip(), "-n", str(n), *_tilegraph(), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        # then mpiexec alone, the ranks left to go with it: a SIGKILL to the whole group killed
        # multiprocessing's resource tracker too, and its semaphores stayed in /dev/shm
        end_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} tilegraph {' '.join(args)} still ran after {timeout} s (a hang)\n"
                    f"{out[-2000:]}\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - t0


def test_mpiexec_tilegraph_train_config_mpi_trains_and_writes_a_checkpoint_that_loads(tmp_path):
    import tilegraph as tg

    (tmp_path / "tiny.toml").write_text(TINY)
    rc, out, err, seconds = _launch(tmp_path, 4, ["train", "tiny.toml", "--mpi", "--out", "run", "--no-progress"],
                                    timeout=150)
    assert rc == 0, (rc, seconds, out[-3000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert out.count("tilegraph train: GPT2") == 1, out[-3000:]  # one rank (1) ran the command
    assert "loss " in out and " -> " in out, out[-3000:]  # its summary: loss first -> last
    # every step trained and logged, by the one rank that writes files
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4], records
    assert all(math.isfinite(r["loss"]) for r in steps), steps
    assert len({r["run"] for r in records}) == 1
    # the final checkpoint (written by the command's rank and the 2 worker ranks) loads, whole
    ck_path = tmp_path / "run" / "checkpoints" / "step-000004"
    assert f"checkpoint: {Path('run') / 'checkpoints' / 'step-000004'}" in out or str(ck_path) in out, out[-3000:]
    ck = tg.io.load_checkpoint(ck_path)
    assert ck.step == 4 and ck.trainer_state["next_step"] == 5
    assert ck.check(read=True) == []  # every chunk there, each matching its CRC32C
    assert ck.optimizer_info["step_count"] == 4
    model = ck.model
    assert model.config.vocab_size == 257  # the byte tokenizer's, recorded beside it
    assert (ck_path / "tilegraph_tokenizer.json").is_file()
    ids = [[ord(c) for c in "def f"]]
    import numpy as np

    logits = model(np.asarray(ids, dtype=np.int64)).numpy()
    assert logits.shape == (1, 5, 257) and np.isfinite(logits).all()
    assert not (tmp_path / "run" / ".tilegraph.lock").exists()
    assert not [p for p in (tmp_path / "run").rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("n", [2, 1])
def test_mpiexec_tilegraph_train_mpi_on_fewer_than_3_ranks_is_one_error_line_at_once(tmp_path, n):
    (tmp_path / "tiny.toml").write_text(TINY)
    rc, out, err, seconds = _launch(tmp_path, n, ["train", "tiny.toml", "--mpi", "--out", "run", "--no-progress"],
                                    timeout=60)
    assert rc != 0, (rc, out[-2000:], err[-3000:])
    assert seconds < 45, seconds  # at once: no wait for ranks that never come
    assert "Traceback" not in err, err[-3000:]
    said = ("tilegraph train: error: [tilegraph.connect(mpi=True)] dask-mpi needs at least 3 ranks (scheduler, "
            f"client, one worker): mpiexec -n 3 or more; received: {n} rank{'s' if n > 1 else ''}")
    assert err.count(said) == 1, err[-3000:]  # said once, by the command's rank
    assert [line for line in err.splitlines() if line.strip()] == [said], err[-3000:]
    assert "tilegraph train: GPT2" not in out, out[-2000:]  # no training started
    assert not (tmp_path / "run").exists()  # nothing written
