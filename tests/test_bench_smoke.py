"""The benchmarks still run: short runs of bench_gpt2, bench_peft (parts a and d), bench_checkpoint and bench_generate."""

from __future__ import annotations

import math
import re
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


def test_bench_peft_part_a_small_runs():
    """bench_peft.py part (a) (RunLoRA's graphs against the naive one, taking turns) on a small
    layer: a row per rank and gradient set, with finite times and the chosen variant named."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_peft.py"), "--parts", "a", "--rows", "1024", "--dim", "128",
         "--ranks", "4", "--row-tile", "256", "--repeat", "2", "--no-torch"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["4"]]
    assert [r[1] for r in rows] == ["xuv", "uv"], proc.stdout
    for r in rows:
        # r, grads, chosen, naive, runlora, by time (variant, ms), torch, naive/rl, torch/rl, frozen, naive/fz
        assert len(r) == 12, proc.stdout
        naive, runlora, ratio, frozen, bound = (float(r[k]) for k in (3, 4, 8, 10, 11))
        for t, q in ((runlora, ratio), (frozen, bound)):
            # times printed to 0.1 ms and ratios to 0.01: they agree up to that rounding (a slow
            # round on a loaded CI machine printed 1.4, 18.6 and 0.07, which is 0.0753 rounded)
            slack = 0.05 * (1 + q) + 0.005 * t + 1e-3
            assert naive > 0 and t > 0 and abs(naive - q * t) <= slack, proc.stdout
        assert "/" in r[2], proc.stdout  # forward/backward variant chosen


def test_bench_checkpoint_throughput_small_runs(tmp_path):
    """bench_checkpoint.py's throughput table (Zarr against numpy.save and safetensors, the formats
    taking turns, a warm-up round untimed) on the debug GPT-2's state."""
    pytest.importorskip("safetensors")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_checkpoint.py"), "--only", "throughput", "--flavor", "gpt2-debug",
         "--workers", "1", "--repeat", "2", "--warmup", "1", "--verbose", "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    table = {name: line for line in lines for name in ("zarr, 1 worker", "numpy.save / np.load", "safetensors")
             if line.startswith(name + " ")}
    assert len(table) == 3, proc.stdout
    numbers = [float(w.replace(",", "")) for w in table["zarr, 1 worker"].split()[3:]]
    assert len(numbers) == 4 and all(math.isfinite(v) and v > 0 for v in numbers), proc.stdout
    rounds = [line for line in lines if "save s:" in line]
    assert len(rounds) == 3 and all(len(line.split("save s:")[1].split("load s:")[0].split()) == 2 for line in rounds)
    assert not any(tmp_path.glob("*/zarr-*")) and not any(tmp_path.glob("*/npy-*")), "the bench left its files"


# -- each bench's quickest run, its bad flags, and what it needs installed -------------------------
def _bench(script, *args, env=None, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def _table(stdout: str, header_start: str, row_start: str) -> list[dict]:
    """The rows of a bench's table as {column: word} (one word per column; the header's two-word
    columns "tg tok/s", "torch tok/s", "step s", "worker MB" and "loss0 tg/torch" joined)."""
    lines = stdout.splitlines()
    header = [line for line in lines if line.startswith(header_start)]
    assert len(header) == 1, stdout
    for two in ("tg tok/s", "torch tok/s", "step s", "worker MB", "loss0 tg/torch"):
        header[0] = header[0].replace(two, two.replace(" ", "_"))
    cols = header[0].split()
    rows = [line.split() for line in lines if line.startswith(row_start)]
    assert rows and all(len(r) == len(cols) for r in rows), stdout
    return [dict(zip(cols, r)) for r in rows]


@pytest.mark.parametrize("script, args, message", [
    # a traceback (ZeroDivisionError, TypeError on an empty timing loop, torch's RuntimeError)
    ("bench_train.py", ["--workers", "0"], "argument --workers: an integer >= 1"),
    ("bench_train.py", ["--steps", "0"], "argument --steps: an integer >= 1"),
    ("bench_train.py", ["--threads", "-1"], "argument --threads: an integer >= 1"),
    # printed the header and no row
    ("bench_train.py", ["--repeat", "0"], "argument --repeat: an integer >= 1"),
    # silently run as --warmup 1
    ("bench_train.py", ["--warmup", "0"], "argument --warmup: an integer >= 1"),
    # --seq 0 ran the default sequence; --seq 1 stopped on a NaN loss (every target ignored)
    ("bench_gpt2.py", ["--flavor", "debug", "--seq", "0"], "argument --seq: an integer >= 2"),
    ("bench_gpt2.py", ["--flavor", "debug", "--seq", "1"], "argument --seq: an integer >= 2"),
    ("bench_gpt2.py", ["--flavor", "debug", "--workers", "0"], "argument --workers: an integer >= 1"),
    # a table of inf and nan
    ("bench_kernels.py", ["--repeat", "0"], "argument --repeat: an integer >= 1"),
    # a tiling error from tilegraph.from_numpy about tiles of size 0
    ("bench_attention.py", ["--shape", "1", "2", "32", "8", "--tiles", "64"], "--tiles 64: more tiles than T = 32"),
    ("bench_attention.py", ["--dtype", "int8"], "argument --dtype: invalid choice"),
    ("bench_peft.py", ["--parts", "b", "--steps", "0"], "argument --steps: an integer >= 1"),
    ("bench_generate.py", ["--flavor", "debug", "--new", "2"], "argument --new: an integer >= 3"),
    ("profile_gpu.py", ["--steps", "0"], "argument --steps: an integer >= 1"),
    ("bench_generate.py", ["--flavor", "debug", "--prompt", "30"], "--prompt + --new must be at most"),
    ("bench_peft.py", ["--parts", "d", "--d-warmup", "0"], "argument --d-warmup: an integer >= 1"),
    # a ValueError only after the whole tilegraph run
    ("bench_capacity.py", ["--torch-budget", "lots"], "--torch-budget: bytes or a size"),
    ("bench_capacity.py", ["--steps", "0"], "argument --steps: an integer >= 1"),
    ("bench_scale.py", ["--batch", "0"], "argument --batch: an integer >= 1"),
    # ran nothing and exited 0
    ("bench_checkpoint.py", ["--only", "throughputs"], "--only: a comma separated list of throughput"),
    # a CheckpointError after the throughput table
    ("bench_checkpoint.py", ["--only", "throughput,quantization", "--flavor", "gpt2-debug", "--methods", "int8,int3"],
     "unknown quantization method"),
    ("bench_checkpoint.py", ["--workers", "0"], "--workers: comma separated worker counts"),
    # ran the fits
    ("fit_kernel_coeffs.py", ["--fast"], "unrecognized arguments: --fast"),
])
def test_bench_bad_flag_is_a_usage_error_not_a_traceback(script, args, message):
    """A bad flag value stops the bench at once with argparse's usage error naming the flag: before,
    these gave tracebacks (ZeroDivisionError, KeyError, ...), a table of inf/nan, a silently used
    default, or (bench_checkpoint --only with a typo) nothing at all and exit 0."""
    proc = _bench(script, *args, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("script, args", [("bench_kernels.py", []), ("bench_attention.py", []),
                                          ("bench_train.py", ["--runtime", "embedded"])])
def test_bench_without_torch_says_to_install_it(script, args):
    """A bench whose ratios are against torch, run where torch is not installed (tilegraph itself
    does not need it), names the package to install instead of an ImportError traceback."""
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.path.insert(0, 'bench'); "
            f"sys.argv = [{script!r}, *{args!r}]; runpy.run_path('bench/{script}', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "needs torch, not installed here: pip install torch" in proc.stderr, \
        proc.stderr


def test_bench_gpt2_device_gpu_without_a_gpu_says_what_is_missing():
    """--device gpu where CuPy or torch's CUDA is missing: a usage error naming it (it was torch's
    AssertionError "Torch not compiled with CUDA enabled" from the header line)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    try:
        import cupy  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("a GPU machine: --device gpu runs")
    except ImportError:
        pass
    proc = _bench("bench_gpt2.py", "--device", "gpu", "--flavor", "debug", "--steps", "1", "--warmup", "1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "--device gpu" in proc.stderr and ("needs cupy" in proc.stderr or "needs torch with CUDA" in proc.stderr), \
        proc.stderr


def test_profile_gpu_without_a_gpu_says_what_is_missing():
    """bench/profile_gpu.py where CuPy or torch's CUDA is missing: a usage error naming it."""
    torch = pytest.importorskip("torch")
    try:
        import cupy  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("a GPU machine: the profile runs")
    except ImportError:
        pass
    proc = _bench("profile_gpu.py", "--flavor", "debug", "--steps", "1")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "needs cupy" in proc.stderr or "needs torch with CUDA" in proc.stderr, proc.stderr


def test_bench_train_feature_tile_runs():
    """bench_train.py --tile (its "feature tile") on both models: the batch was cut into whole-width
    tiles whatever --tile said, so every --tile below the width stopped in layer_norm / matmul with
    a tiling mismatch. Both models' rows, with the same first loss as torch's."""
    pytest.importorskip("torch")
    proc = _bench("bench_train.py", "--model", "all", "--width", "64", "--heads", "2", "--layers", "1",
                  "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "1", "--tile", "32", "--runtime", "local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _table(proc.stdout, "model ", ("mlp ", "blocks "))
    assert [r["model"] for r in rows] == ["mlp", "blocks"], proc.stdout
    for r in rows:
        assert math.isfinite(float(r["ratio"])) and float(r["ratio"]) > 0, proc.stdout
        assert float(r["tg_tok/s"]) > 0 and float(r["torch_tok/s"]) > 0 and r["outside"].endswith("%"), proc.stdout
        loss_tg, loss_torch = map(float, r["loss0_tg/torch"].split("/"))
        assert loss_tg == pytest.approx(loss_torch, rel=1e-4), proc.stdout
        assert int(r["nodes"]) > 0 and int(r["tasks"]) >= 1, proc.stdout


def test_bench_peft_part_a_no_torch_prints_no_torch_figures():
    """With --no-torch no torch run happens: part (a)'s torch time and torch/runlora ratio are "-",
    not "nan" (a ratio against a run that did not happen)."""
    proc = _bench("bench_peft.py", "--parts", "a", "--rows", "256", "--dim", "64", "--ranks", "4", "--row-tile", "128",
                  "--repeat", "1", "--no-torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["4"]]
    assert len(rows) == 2 and all(len(r) == 12 for r in rows), proc.stdout
    assert all(r[7] == "-" and r[9] == "-" for r in rows), proc.stdout  # torch, torch/rl
    assert "nan" not in proc.stdout, proc.stdout


def test_bench_attention_smallest_runs():
    """bench_attention.py on a small shape, 1 and 3 tiles (ragged): every kernel's time and the
    fwd / bwd / fwd+bwd ratios against torch's SDPA, finite."""
    pytest.importorskip("torch")
    proc = _bench("bench_attention.py", "--shape", "1", "2", "32", "8", "--tiles", "1", "3", "--repeat", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 1 tile: the fused backward, then the split one; 3 tiles: split
    assert proc.stdout.count("tile(s) along T") == 3 and proc.stdout.count("split backward") == 1, proc.stdout
    assert proc.stdout.count("  sdpa_fwd ") == 3 and proc.stdout.count("  sdpa_bwd ") == 1, proc.stdout
    for name in ("sdpa_bwd_delta", "sdpa_bwd_dq", "sdpa_bwd_dkv"):
        assert proc.stdout.count(f"  {name} ") == 2, proc.stdout
    ratios = [float(line.split()[-2].rstrip("x")) for line in proc.stdout.splitlines() if line.endswith("x torch")]
    assert len(ratios) == 9 and all(math.isfinite(x) and x > 0 for x in ratios), proc.stdout


def test_fit_kernel_coeffs_help_shows_usage_without_fitting():
    """fit_kernel_coeffs.py --help: the usage and docstring, not the fits run and printed."""
    proc = _bench("fit_kernel_coeffs.py", "--help", timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stdout + proc.stderr
    assert "coefficients (float32)" not in proc.stdout, proc.stdout


def test_bench_checkpoint_quantization_and_perplexity_quick_run(tmp_path):
    """bench_checkpoint.py's quantization and perplexity tables on the debug GPT-2, trained fewer
    steps than the schedule's 20 warmup steps (it stopped: "warmup must be <= total")."""
    proc = _bench("bench_checkpoint.py", "--only", "quantization,perplexity", "--quant-flavor", "gpt2-debug",
                  "--methods", "int8,int4", "--train-steps", "5", "--eval-batches", "2", "--dir", tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["fp32"], ["int8"], ["int4"])]
    # method, GPT-2 size, GPT-2 err, t(3) size, t(3) err; then method, perplexity, vs fp32, size
    quant, ppl = [r for r in rows if len(r) == 5], [r for r in rows if len(r) == 4]
    assert [r[0] for r in quant] == ["int8", "int4"] and [r[0] for r in ppl] == ["fp32", "int8", "int4"], proc.stdout
    assert all(0 < float(x) < 1 for r in quant for x in r[1:]), proc.stdout  # smaller than fp32, some error
    assert float(ppl[0][2]) == 1.0 and all(math.isfinite(float(r[1])) and float(r[2]) > 0 for r in ppl), proc.stdout
    assert not any(tmp_path.iterdir()), "the bench left its scratch folder"


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_capacity_tiny_runs():
    """bench_capacity.py on a tiny model: the state line, the plan (no bound: the state is far under
    the limit, printed as words rather than "bound inf MiB"), a loss per step, a line per worker
    and both torch runs."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = _bench("bench_capacity.py", "--dim", "64", "--layers", "1", "--vocab", "128", "--seq", "16", "--feature",
                  "64", "--batch-tile", "1", "--steps", "2", "--memory-limit", "500MB")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "x one worker's limit" in out and "plan: sharded" in out and "inf MiB" not in out, out
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses), out
    assert len([line for line in out.splitlines() if line.startswith("worker ")]) == 2, out
    torch_rows = [line for line in out.splitlines() if line.startswith("torch, one process")]
    # under the budget (a worker's limit) torch trains, or stops with the error that stopped it
    assert len(torch_rows) == 2 and "(under " in torch_rows[0] and "(with no limit)" in torch_rows[1], out
    assert "trained 2 steps" in torch_rows[0] or "stopped at " in torch_rows[0], out
    assert "trained 2 steps" in torch_rows[1], out


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_peft_parts_b_and_c_run():
    """bench_peft.py parts (b) (memory-saving backprop) and (c) (full fine-tuning vs LoRA on an
    int4 base), one step each: their memory tables, every row finite."""
    proc = _bench("bench_peft.py", "--parts", "b", "c", "--steps", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = ["exact", "rmm 0.5", "rmm 0.2", "recompute", "full fine-tune", "LoRA r8 int4 base"]
    rows = {}
    for line in proc.stdout.splitlines():
        for name in names:
            if line.strip().startswith(name + " ") and line.split()[len(name.split())].replace(",", "").isdigit():
                rows[name] = [float(w.replace(",", "")) for w in line.strip()[len(name):].split()]
    assert list(rows) == names, proc.stdout
    for name, r in rows.items():
        # trained, stored MB, plan peak MB, held MB, peak RSS MB, rise MB, loss first, loss last5, s/step
        assert len(r) == 9 and r[0] > 0 and all(math.isfinite(x) for x in r), (name, proc.stdout)
    assert rows["LoRA r8 int4 base"][0] < rows["full fine-tune"][0], proc.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_device_checks_quick_cpu_part_runs_in_its_time_limit(tmp_path):
    """bash bench/device_checks.sh with QUICK=1 (the README: it "tries it on any machine"): its
    check of the block stack on 4 worker processes ran the full 16-core shape and ran out of its
    40 s on 2 cores (exit 124)."""
    pytest.importorskip("torch")
    env = {**__import__("os").environ, "OUT": str(tmp_path), "QUICK": "1", "ONLY": "cpu-tasks"}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "device_checks.sh")], cwd=ROOT, capture_output=True,
                          text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert "scale-blocks-tasks: exit 0 " in summary, summary
    rows = [line.split() for line in (tmp_path / "scale-blocks-tasks.log").read_text().splitlines()
            if line.startswith("blocks ")]
    assert [(r[1], r[3]) for r in rows][-1][1] == "sharded" and float(rows[-1][11]) > 0, rows


def test_bench_generate_debug_runs():
    """bench_generate.py on the debug GPT-2, one round: tilegraph's replayed and recorded decoding
    (locally and on an embedded cluster), generate's whole call (here, as one task on the cluster's
    worker, with a round trip per token) and transformers' generate decode the same tokens (the
    bench stops otherwise), each row a finite time and ratio."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    proc = _bench("bench_generate.py", "--flavor", "debug", "--new", "6", "--rounds", "1", timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # rows "  <name> <ms> ms   torch / x <ratio>"
    rows = {m[1]: (float(m[2]), float(m[3])) for m in
            re.finditer(r"^  (\S.*?) +([\d.]+) ms   torch / x +([\d.]+)$", proc.stdout, re.M)}
    assert set(rows) == {"replay", "record", "cluster replay", "cluster record", "torch", "generate",
                         "cluster generate", "cluster per token", "torch generate"}, proc.stdout
    for ms, ratio in rows.values():
        assert math.isfinite(ms) and ms > 0 and math.isfinite(ratio) and ratio > 0, proc.stdout
    assert rows["torch"][1] == 1.0 and rows["torch generate"][1] == 1.0, proc.stdout
