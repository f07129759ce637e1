"""The GPT-2 benchmark still runs: one short debug-flavor run on Dask's local scheduler."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_gpt2_debug_runs():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_gpt2.py"), "--flavor", "debug", "--steps", "1", "--warmup", "1",
         "--runtime", "local"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = [line for line in lines if line.startswith("flavor ")]
    assert len(header) == 1, proc.stdout
    col = [w for w in header[0].replace("tg/torch", "").replace("tok/s", "").split() if w != "s"]  # a word per column
    rows = [line.split() for line in lines if line.startswith("debug ")]
    assert len(rows) == 1, proc.stdout
    row = dict(zip(col, rows[0]))
    ratio = float(row["ratio"])
    assert math.isfinite(ratio) and ratio > 0, proc.stdout
    assert int(row["k"]) > 1  # the debug flavor's short steps run several to a graph
    # both frameworks start from the same weights and batch: the first losses agree
    loss_tg, loss_torch = map(float, row["loss0"].split("/"))
    assert loss_tg == pytest.approx(loss_torch, rel=1e-4), proc.stdout


def test_bench_peft_part_d_debug_runs():
    """bench_peft.py part (d) (LoRA tilegraph vs peft + torch) on the debug GPT-2: both train from
    the same weights, so the first losses agree."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_peft.py"), "--parts", "d", "--d-flavor", "debug", "--seq", "32",
         "--d-warmup", "1", "--d-rounds", "1", "--d-steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {name: line.split() for line in proc.stdout.splitlines()
            for name in ("tg LoRA", "peft+torch LoRA") if line.strip().startswith(name + " ")}
    assert len(rows) == 2, proc.stdout
    ratio = [line for line in proc.stdout.splitlines() if line.startswith("ratio tg LoRA / peft+torch LoRA")]
    assert len(ratio) == 1, proc.stdout
    words = ratio[0].split()
    median = float(words[words.index("rounds") + 1])
    assert math.isfinite(median) and median > 0, proc.stdout
    rel = float(words[words.index("differ") + 2])
    assert rel < 1e-4, proc.stdout
