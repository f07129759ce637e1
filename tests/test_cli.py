"""The command line: `tilegraph train` from a TOML config (checkpoint, resume), bad configs, info."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import shm_mapped

pytestmark = pytest.mark.distributed

SMALL = """
[model]
flavor = "gpt2-debug"
vocab_size = "tokenizer"
[data]
max_mb = 0.3
seq_len = 32
[train]
steps = 24
batch_size = 4
warmup = 4
eval_every = 12
eval_batches = 2
"""


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "tilegraph.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def end_group(proc, grace: float = 30.0) -> None:
    """End ``proc``, started in a process group of its own (``start_new_session=True``), and every
    process of its group, without leaving multiprocessing's named semaphores behind in /dev/shm
    (``sem.mp-*``): the process is killed alone and its group left to drain (its Dask workers go
    when their parent does, then multiprocessing's resource tracker, which unlinks the semaphores
    left over). A SIGKILL to the whole group killed the tracker with the others: 12 files in
    /dev/shm for each command so ended. What still runs after ``grace`` seconds is killed, the
    resource trackers last: they unlink what is left once the others are gone (killed with them
    at once, a child that outlived the command, say a rank or a loader's process, left 12 files)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if _drained(proc.pid, grace):
        return
    for pid, args in _group_members(proc.pid):
        if "multiprocessing.resource_tracker" not in args:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    _drained(proc.pid, 10.0)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def group_semaphores(pgid: int) -> set[str]:
    """The multiprocessing named semaphores (``/dev/shm/sem.mp-*``) that the processes of group
    ``pgid`` have open now, by their memory maps."""
    return {path for path in shm_mapped(pid for pid, _ in _group_members(pgid))
            if os.path.basename(path).startswith("sem.mp-")}


@contextlib.contextmanager
def semaphore_group(script, grace: float = 30.0):
    """Run ``python script`` in a process group of its own until it prints "ready"; yield the
    process and the semaphores its group has open then (some: else there is nothing to check),
    and end the group on leaving (:func:`end_group`, ``grace`` seconds)."""
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-3000:]
        made = group_semaphores(proc.pid)
        assert made, "no semaphore seen: nothing to check"
        yield proc, made
    finally:
        end_group(proc, grace)


def _drained(pgid: int, seconds: float) -> bool:
    """Wait up to ``seconds`` until no process of group ``pgid`` runs; returns whether none does."""
    deadline = time.monotonic() + seconds
    while _group_runs(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _group_runs(pgid: int) -> bool:
    """Whether a process of process group ``pgid`` still runs (a zombie does not: one that nothing
    reaps would hold the group forever)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return not os.path.isdir("/proc") or bool(_group_members(pgid))


def _group_members(pgid: int) -> list[tuple[int, str]]:
    """The processes of group ``pgid`` that run (not zombies), with their command lines, by /proc
    (none where there is no /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else ()):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, group = f.read().rsplit(")", 1)[1].split()[:3]  # after "pid (name)": state ppid pgrp
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if state != "Z" and int(group) == pgid:
            out.append((int(pid), args))
    return out


@contextlib.contextmanager
def training(cwd, out: str, *args, records: int):
    """``tilegraph train *args --out OUT --no-progress`` in a process group of its own (a signal
    to the group reaches its workers too, as a terminal's Ctrl-C or Slurm's scancel does), its
    output in OUT.out and OUT.err beside OUT; yields the process once OUT/metrics.jsonl holds
    ``records`` records; ended with its group if it still runs at the end (:func:`end_group`)."""
    out_file, err_file = Path(cwd) / f"{out}.out", Path(cwd) / f"{out}.err"
    with open(out_file, "w") as o, open(err_file, "w") as e:
        proc = subprocess.Popen([sys.executable, "-m", "tilegraph.cli", "train", *args, "--out", out, "--no-progress"],
                                cwd=cwd, stdout=o, stderr=e, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        metrics, deadline = Path(cwd) / out / "metrics.jsonl", time.time() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= records):
            assert time.time() < deadline and proc.poll() is None, err_file.read_text()[-3000:]
            time.sleep(0.2)
        yield proc
    finally:
        end_group(proc)


def test_train_writes_a_checkpoint_transformers_loads_and_resumes(tmp_path):
    (tmp_path / "small.toml").write_text(SMALL)
    run = _cli("train", "small.toml", "--out", "run", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", run.stdout).groups())
    assert last < first - 1.0  # the loss falls from the uniform guess (ln 257 = 5.55)
    ck = tmp_path / "run" / "checkpoints" / "step-000024"
    assert {p.name for p in ck.iterdir()} >= {"zarr.json", "model", "optimizer", "tilegraph_tokenizer.json"}
    info = _cli("info", str(ck), cwd=tmp_path)
    assert info.returncode == 0, info.stderr[-3000:]
    assert "step 24" in info.stdout and "model/wte.weight" in info.stdout and "optimizer/exp_avg/wte.weight" in info.stdout
    hf_dir = tmp_path / "hf"
    conv = _cli("convert", str(ck), str(hf_dir), cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert (hf_dir / "tilegraph_tokenizer.json").is_file()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "val_loss" in r] == [12, 24]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000

    from transformers import GPT2LMHeadModel

    import tilegraph as tg
    from tilegraph import models

    hf = GPT2LMHeadModel.from_pretrained(hf_dir)
    assert hf.config.eos_token_id == hf.config.bos_token_id == 256  # the byte tokenizer's end of text
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    import torch

    with torch.no_grad():
        want = hf(torch.tensor(ids)).logits.numpy()
    got = models.from_hf(hf_dir)(ids).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(models.from_zarr(ck)(ids).numpy(), got)

    gen = _cli("generate", str(ck), "--prompt", "def ", "--max-new-tokens", "8", "--local", "--ids", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    text, ids = gen.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.startswith("def ") and [int(i) for i in ids.split()][:4] == list(b"def ") and len(ids.split()) == 12

    # the same output again without --resume: refused before any work, nothing touched
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    twice = _cli("train", "small.toml", "--out", "run", "--no-progress", cwd=tmp_path)
    assert twice.returncode == 2 and "holds one (metrics.jsonl, checkpoints step-000024..step-000024)" in twice.stderr
    assert "--resume run/checkpoints/step-000024 continues it" in twice.stderr and "Traceback" not in twice.stderr
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics
    # a folder another live run holds is refused naming it; a lock whose process is gone is taken over
    lock = tmp_path / "run" / ".tilegraph.lock"
    import socket

    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    busy = _cli("train", "small.toml", "--out", "run", "--no-progress", "--resume", str(ck), "--steps", "4",
                cwd=tmp_path)
    assert busy.returncode == 2 and f"in use by tilegraph train (pid {os.getpid()}" in busy.stderr
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname()}))

    again = _cli("train", "small.toml", "--out", "run", "--no-progress", "--resume", str(ck), "--steps", "4",
                 cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "at step 24" in again.stdout
    assert not lock.exists()
    resumed = tg.io.load_checkpoint(tmp_path / "run" / "checkpoints" / "step-000028")
    assert resumed.step == 28
    # the schedule continued (its total budget saved), and the metrics hold the whole run under one id
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 29)) and len({r["run"] for r in records}) == 1
    sched = tg.optim.schedule_from_spec(resumed.optimizer_info["schedule"])
    assert resumed.optimizer_info["schedule"]["total"] == 24
    assert [r["lr"] for r in steps] == [sched(i) for i in range(1, 29)]
    del tg


def test_bad_configs_are_one_clear_line(tmp_path):
    (tmp_path / "bad.toml").write_text('[train]\nstepz = 3\n')
    run = _cli("train", "bad.toml", "--out", "run", cwd=tmp_path)
    assert run.returncode == 2 and "unknown train.stepz" in run.stderr and "Traceback" not in run.stderr
    (tmp_path / "flavor.toml").write_text('[model]\nflavor = "gpt5"\n')
    run = _cli("train", "flavor.toml", "--out", "run", cwd=tmp_path)
    assert run.returncode == 2 and "unknown flavor" in run.stderr and "'gpt5'" in run.stderr
    run = _cli("train", "missing.toml", cwd=tmp_path)
    assert run.returncode == 2 and "missing.toml" in run.stderr
    assert not (tmp_path / "run").exists()  # nothing was written


def test_generate_without_a_tokenizer_is_a_clear_error(tmp_path):
    from tilegraph import models

    models.build("gpt2-debug").to_hf(tmp_path / "hf")
    run = _cli("generate", str(tmp_path / "hf"), cwd=tmp_path)
    assert run.returncode == 2 and "a tokenizer: tilegraph_tokenizer.json" in run.stderr and "Traceback" not in run.stderr
    # a path that is no folder at all is named as such (not as a folder without a tokenizer)
    run = _cli("generate", str(tmp_path / "nope"), "--prompt", "x", cwd=tmp_path)
    assert run.returncode == 2 and "nope does not exist" in run.stderr and "tokenizer" not in run.stderr


def test_info_prints_versions(tmp_path):
    run = _cli("info", cwd=tmp_path)
    assert run.returncode == 0 and "tilegraph" in run.stdout and "dask" in run.stdout


@pytest.mark.parametrize("model, want", [
    # the default's max_seq_len (64, the job's windows) and dim survive a key added to its flavor
    ('flavor = "gpt2-debug"\nn_layers = 1\n', {"n_layers": 1, "max_seq_len": 64, "dim": 64, "vocab_size": 257}),
    ('n_heads = 2\n', {"n_heads": 2, "dim": 64, "vocab_size": 257}),
    # another flavor keeps its own shape, and takes the job's vocabulary and windows
    ('flavor = "llama-debug"\n', {"dim": 64, "hidden": 176, "n_kv_heads": 2, "vocab_size": 257, "max_seq_len": 64}),
])
def test_model_sections_override_the_default_key_by_key(tmp_path, model, want):
    from tilegraph.cli import build_model, load_config, make_tokenizer

    (tmp_path / "c.toml").write_text("[model]\n" + model)
    cfg, _ = load_config(str(tmp_path / "c.toml"))
    built = build_model(cfg["model"], make_tokenizer(cfg["data"]["tokenizer"]), 0, cfg["data"]["seq_len"])
    assert {k: getattr(built.config, k) for k in want} == want


@pytest.mark.parametrize("model, message", [
    ('vocab_size = 100\n', r"vocab_size of at least the tokenizer's 257 .*received: gpt2-debug with vocab_size 100"),
    ('flavor = "llama-debug"\nvocab_size = 128\n', r"received: llama-debug with vocab_size 128"),
    ('max_seq_len = 16\n', r"max_seq_len of at least \[data\] seq_len = 64; received: gpt2-debug with max_seq_len 16"),
])
def test_a_model_that_does_not_fit_the_job_stops_before_training(tmp_path, model, message):
    (tmp_path / "c.toml").write_text("[model]\n" + model)
    run = _cli("train", "c.toml", "--out", "run", cwd=tmp_path)
    assert run.returncode == 2 and re.search(message, run.stderr) and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()  # nothing was written


def test_info_lists_the_model_flavors(tmp_path):
    run = _cli("info", cwd=tmp_path)
    assert run.returncode == 0
    assert re.search(r"llama-debug +LlamaConfig +2 layers x 64 wide, 4 heads, vocab 128", run.stdout)


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], r"train\.steps must be an integer >= 1, not 0"),
    (["--lr", "-1"], r"train\.lr must be a number > 0, not -1\.0"),
    (["--set", "train.lr=fast"], r"train\.lr must be a number > 0, not 'fast'"),
    (["--set", 'train.steps="ten"', "--set", "output.checkpoint_every=-3"],
     r"train\.steps must be an integer >= 1, not 'ten'; output\.checkpoint_every must be an integer >= 0, not -3"),
    (["--set", "train.eval_batches=0"], r"train\.eval_batches must be an integer >= 1, not 0"),
    (["--set", "data.seq_len=2.5"], r"data\.seq_len must be an integer >= 1, not 2\.5"),
    (["--set", "runtime.mpi=1"], r"runtime\.mpi must be true or false, not 1"),
    (["--set", "model.recompute=yes"], r"model\.recompute must be true or false, not 'yes'"),
    (["--batch-size", "6", "--set", "train.accum_steps=4"], r"train\.batch_size \(6\) must be a multiple of train\.accum_steps \(4\)"),
    (["--set", "train.nope=1"], r"\[tilegraph train --set\] section\.key=value with a known key .*received: 'train\.nope=1'"),
    (["--set", "lr"], r"received: 'lr'"),
    (["--set", "runtime.parallel=zero", "--set", "runtime.exchange=1", "--set", "train.step_timeout=-1",
      "--set", "train.restart_on_failure=true"],
     r"runtime\.parallel must be one of 'auto', 'tiles', 'data', 'sharded', 'zero3', not 'zero'; runtime\.exchange must be "
     r"one of 'auto', 'gang', 'tasks', not 1; train\.restart_on_failure must be an integer >= 0, not True; "
     r"train\.step_timeout must be \"auto\", 0 \(no limit\) or seconds > 0, not -1"),
    (["--set", "runtime.address=tcp://127.0.0.1:1", "--set", "runtime.workers=2"],
     r"workers only for the embedded cluster .*received: address = 'tcp://127\.0\.0\.1:1', workers = 2"),
    (["--set", "runtime.address=tcp://127.0.0.1:1", "--set", "runtime.scheduler_file=s.json"],
     r"at most one of address, scheduler_file and mpi .*received: address = .*, scheduler_file = 's\.json'"),
    # a cluster of the user's is reached before the data is read (or the run folder made)
    (["--set", "runtime.scheduler_file=nowhere/s.json"], r"scheduler file does not exist.*'nowhere/s\.json' \(nor its folder\)"),
    (["--set", "runtime.scheduler_file=bad.json"], r"a scheduler file: a JSON object .*'bad\.json': invalid JSON"),
    # a width mistyped by a few zeros: refused before any weight is drawn (512 GiB)
    (["--set", "model.dim=65536"], r"weights fit this process's memory .*GPT2Config\(dim=65536, n_layers=2, .*512\.\d GiB"),
])
def test_bad_settings_are_one_line_each_and_nothing_is_written(tmp_path, args, message):
    (tmp_path / "bad.json").write_text("{not json")
    run = _cli("train", "--out", "run", *args, cwd=tmp_path)
    assert run.returncode == 2, run.stdout + run.stderr
    assert re.search(message, run.stderr) and "Traceback" not in run.stderr, run.stderr
    assert not (tmp_path / "run").exists()


def test_bad_settings_in_a_config_file_name_the_file(tmp_path):
    (tmp_path / "bad.toml").write_text('[train]\nsteps = "ten"\nlr = -1\n')
    run = _cli("train", "bad.toml", "--out", "run", cwd=tmp_path)
    assert run.returncode == 2
    assert re.search(r"train\.steps must be an integer >= 1, not 'ten'; train\.lr must be a number > 0, not -1 "
                     r"\(in bad\.toml\)", run.stderr), run.stderr


def test_set_overrides_any_key(tmp_path):
    from tilegraph.cli import apply_overrides, check_config, load_config

    cfg, _ = load_config(None)
    apply_overrides(cfg, ["train.lr=1e-3", "model.n_layers=4", "data.tokenizer=byte", 'output.dir="x y"',
                          "model.flavor=llama-debug"])
    check_config(cfg, "test")
    assert cfg["train"]["lr"] == 1e-3 and cfg["data"]["tokenizer"] == "byte" and cfg["output"]["dir"] == "x y"
    # another flavor drops the default flavor's shape keys (dim), as in a config file, and keeps
    # the ones given on the command line and those of the job (init: where the weights come from)
    assert cfg["model"] == {"flavor": "llama-debug", "vocab_size": "tokenizer", "max_seq_len": 64, "init": "",
                            "recompute": False, "n_layers": 4}


def test_sigterm_stops_with_a_checkpoint_that_resumes(tmp_path):
    (tmp_path / "small.toml").write_text(SMALL.replace("steps = 24", "steps = 100000").replace("eval_every = 12",
                                                                                                "eval_every = 0"))
    proc = subprocess.Popen([sys.executable, "-m", "tilegraph.cli", "train", "small.toml", "--out", "run",
                             "--no-progress"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.time() + 240
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):
            assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]  # 128 + SIGTERM (130 is Ctrl-C's)
    step = int(re.search(r"stopped at step (\d+)", out).group(1))
    assert "SIGTERM: stopping after the steps under way" in err and step >= 5
    import tilegraph as tg

    ck = tg.io.load_checkpoint(tmp_path / "run" / "checkpoints" / f"step-{step:06d}")
    assert ck.step == step and (ck.path / "tilegraph_tokenizer.json").is_file()
    logged = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    assert logged == list(range(1, step + 1))
    assert not (tmp_path / "run" / ".tilegraph.lock").exists()


def test_convert_hf_to_a_quantized_zarr_checkpoint_and_back(tmp_path):
    from tilegraph import models

    model = models.build(models.GPT2Config(vocab_size=200, max_seq_len=32, dim=128, n_layers=1, n_heads=4), seed=0)
    model.to_hf(tmp_path / "hf")
    conv = _cli("convert", "hf", "q4", "--quantize", "int4", cwd=tmp_path)
    assert conv.returncode == 0, conv.stderr[-3000:]
    info = _cli("info", "q4", cwd=tmp_path)
    assert info.returncode == 0 and "int4:4" not in info.stdout and " int4 " in info.stdout, info.stdout
    assert "float32" in info.stdout  # the norms and biases stay exact
    back = _cli("convert", "q4", "hf2", cwd=tmp_path)
    assert back.returncode == 0, back.stderr[-3000:]
    ids = np.arange(12, dtype=np.int64).reshape(2, 6)
    want, got = model(ids).numpy(), models.from_hf(tmp_path / "hf2")(ids).numpy()
    assert 0 < np.linalg.norm(got - want) < 0.3 * np.linalg.norm(want)  # quantized (int4 ~0.1-0.2 per matrix)
    again = _cli("convert", "hf", "q4", cwd=tmp_path)
    assert again.returncode == 2 and "does not exist yet" in again.stderr
    bad = _cli("convert", "hf", "q3", "--quantize", "int3", cwd=tmp_path)
    assert bad.returncode == 2 and "unknown quantization method" in bad.stderr and not (tmp_path / "q3").exists()


def test_recompute_from_the_config_trains_the_same_losses(tmp_path):
    (tmp_path / "small.toml").write_text(SMALL.replace("steps = 24", "steps = 6").replace("eval_every = 12",
                                                                                           "eval_every = 0"))
    runs = {}
    for name, extra in (("plain", []), ("recompute", ["--set", "model.recompute=true"])):
        run = _cli("train", "small.toml", "--out", name, "--no-progress", *extra, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
                      if "loss" in json.loads(x)]
    assert len(runs["plain"]) == 6
    np.testing.assert_allclose(runs["recompute"], runs["plain"], rtol=1e-5)


@pytest.mark.parametrize("parallel, exchange, said", [
    ("sharded", "auto", "sharded over 2 worker processes, one gang task per process and step (values through shared "
                        "memory)"),
    ("data", "tasks", "data over 2 worker processes, values as Dask tasks"),
])
def test_the_config_picks_the_parallel_strategy_and_the_exchange(tmp_path, parallel, exchange, said):
    """[runtime] parallel and exchange reach the steps: on 2 worker processes a "data" or
    "sharded" job gives each process a row tile of its own (the default tiling would put the
    debug model's small batch in one), says how its steps ran, and trains as one process does
    (float32, sums in another order)."""
    (tmp_path / "small.toml").write_text(SMALL)
    runs = {}
    for name, extra in (("one", ["--set", "runtime.workers=1"]),
                        ("two", ["--set", "runtime.workers=2", "--set", f"runtime.parallel={parallel}",
                                 "--set", f"runtime.exchange={exchange}", "--set", "train.restart_on_failure=1"])):
        run = _cli("train", "small.toml", "--out", name, "--no-progress", *extra, cwd=tmp_path)
        assert run.returncode == 0, run.stdout + run.stderr
        runs[name] = [r["loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                      if "loss" in r and "val_loss" not in r]
        if name == "two":
            assert f"parallel: {said}" in run.stdout, run.stdout
        else:
            assert "parallel: tiles over 1 worker process" in run.stdout, run.stdout
    assert len(runs["one"]) == len(runs["two"]) == 24
    np.testing.assert_allclose(runs["two"], runs["one"], rtol=2e-4)


def test_the_jobs_exchange_setting_does_not_outlive_the_command(tmp_path, monkeypatch):
    """[runtime] exchange holds for the job; in a process that goes on (a notebook calling the
    command), tg.config.exchange is the caller's again afterwards."""
    import tilegraph as tg
    from tilegraph.cli import main

    (tmp_path / "small.toml").write_text(SMALL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    assert main(["train", "small.toml", "--out", "run", "--steps", "2", "--no-progress",
                 "--set", 'runtime.exchange="gang"']) == 0
    assert tg.config.exchange == "tasks"
