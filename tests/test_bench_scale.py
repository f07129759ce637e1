"""The scaling benchmark still runs: a tiny block stack on 1x1 and 2x1, with the DDP row."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_scale_tiny_blocks_runs():
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--width", "64", "--layers", "1", "--batch", "2",
         "--seq", "32", "--steps", "1", "--warmup", "1", "--configs", "1x1,2x1", "--models", "blocks"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = [line for line in lines if line.startswith("model ")]
    assert len(header) == 1, proc.stdout
    col = header[0].split()  # a word per column
    assert {"WxT", "strategy", "used", "exch", "auto", "tok/s", "outside", "dask_CPU", "MB/step", "ratio",
            "peak_MiB", "held_MiB"} <= set(col), header[0]
    rows = [dict(zip(col, line.split())) for line in lines if line.startswith("blocks ")]
    assert all(len(r) == len(col) for r in rows), proc.stdout
    got = {(r["WxT"], r["strategy"]): r for r in rows}
    # torch eager for each total of threads; one tilegraph row for 1 worker, one per strategy for 2;
    # PyTorch DDP beside tilegraph's 2x1
    # (the default strategies: tiles, data and sharded, what "auto" picks across processes)
    expected = {("1x1", "torch"), ("1x2", "torch"), ("1x1", "tiles"), ("2x1", "tiles"), ("2x1", "data"),
                ("2x1", "sharded"), ("2x1", "torch-DDP")}
    assert set(got) == expected and len(rows) == len(expected), proc.stdout
    for r in rows:
        tok_s, ratio = float(r["tok/s"]), float(r["ratio"])
        assert math.isfinite(tok_s) and tok_s > 0, proc.stdout
        assert math.isfinite(ratio) and ratio > 0, proc.stdout
    for key in [("1x1", "tiles"), ("2x1", "tiles"), ("2x1", "data"), ("2x1", "sharded")]:
        r = got[key]
        assert r["used"] in ("tiles", "data", "sharded", "zero3") and r["auto"] in ("tiles", "data", "sharded", "zero3"), r
        assert float(r["MB/step"]) >= 0 and r["outside"].endswith("%"), r
        # CPU times come in 10 ms ticks against a wall time of tens of ms: no upper bound holds
        assert 0 <= float(r["dask_CPU"].rstrip("%")), r
        # the workers hold at least the parameters and AdamW's two moments (1 layer x 64: 0.2 MiB)
        assert float(r["held_MiB"]) >= 0.1 and float(r["peak_MiB"]) > float(r["held_MiB"]), r
    assert float(got[("1x1", "tiles")]["MB/step"]) == 0  # one process: nothing moves between processes
    # two row tiles on two workers: the data-parallel plan applies and exchanges gradients
    assert got[("2x1", "data")]["used"] == "data", proc.stdout
    # one gang task per worker process where both share /dev/shm (this machine), else Dask tasks
    assert got[("2x1", "data")]["exch"] in ("gang", "tasks") and got[("1x1", "tiles")]["exch"] == "-", proc.stdout
    assert float(got[("2x1", "data")]["MB/step"]) > 0, proc.stdout
    assert float(got[("2x1", "torch-DDP")]["MB/step"]) > 0, proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_scale_debug_gpt2_runs_every_strategy_on_two_workers():
    # GPT-2's rows call bench_gpt2.py's timing functions; a model this small keeps one row tile
    # per worker process all the same, so the data and sharded plans apply
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--models", "gpt2", "--gpt2-flavor", "debug",
         "--batch", "4", "--seq", "16", "--steps", "1", "--warmup", "1", "--configs", "2x1",
         "--strategies", "tiles,data,sharded"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("gpt2-debug ")]
    # torch eager with 2 threads, then tilegraph's three strategies on 2 x 1, each the one used
    assert [(r[1], r[3], r[4]) for r in rows] == [("1x2", "torch", "-"), ("2x1", "tiles", "tiles"),
                                                   ("2x1", "data", "data"), ("2x1", "sharded", "sharded")], proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_scale_lab_runs_each_worker_on_a_node_of_its_own():
    """``--lab RATE``: the 2 x 1 rows again with the workers on two nodes of a lab (tests/netlab.py),
    exchanging values over their comms (gang-comm), and the line comparing them with the embedded
    cluster's."""
    from netlab import lab_missing

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    missing = lab_missing()
    if missing is not None:
        pytest.skip(f"no network namespaces here: {missing}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_scale.py"), "--models", "gpt2", "--gpt2-flavor", "debug",
         "--batch", "4", "--seq", "16", "--steps", "1", "--warmup", "1", "--configs", "2x1",
         "--strategies", "data", "--lab", "1gbit", "--no-ddp"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("gpt2-debug ")]
    # torch eager, then data parallel on the embedded cluster (shared memory) and on the lab's nodes
    assert [(r[1], r[2], r[3], r[4], r[5]) for r in rows[1:]] == [
        ("2x1", "embedded", "data", "data", "gang"), ("2x1", "lab", "data", "data", "gang-comm")], proc.stdout
    assert float(rows[2][7]) > 0, proc.stdout
    assert "# gpt2-debug 2x1 data: 2 nodes at 1gbit / embedded = " in proc.stdout, proc.stdout
