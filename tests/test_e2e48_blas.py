"""The CPU kernels' matrix products through MKL (ops/_blas.py): every operand layout MKL takes gives
NumPy's product, the others go to NumPy untouched, the choice follows TILEGRAPH_BLAS, and the
matmul kernels and a training step agree with the NumPy path."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tilegraph as tg
from tilegraph._errors import TileError
from tilegraph.ops import _blas as blas

try:  # torch first: MKL loaded into a process before torch takes over torch's own (ops/_blas.py), and
    import torch  # noqa: F401  the rest of the suite compares with torch in this process
except ImportError:
    pass
GEMM, WHY = blas._load_mkl()
needs_mkl = pytest.mark.skipif(GEMM is None, reason=f"MKL's library is not installed here ({WHY}); the test extra "
                                                    "installs it on Linux x86-64")


@pytest.fixture
def use(monkeypatch):
    """Switch this process's products to ``"mkl"`` or ``"numpy"`` for the test."""
    def choose(name):
        monkeypatch.setitem(blas._state, "gemm", GEMM if name == "mkl" else {})
        monkeypatch.setitem(blas._state, "backend", name)
    return choose


def _operands(rng, dtype, m=37, k=29, n=23):
    """(a, b) pairs of every layout MKL takes: row-major, column-major (a transpose), rows or
    columns sliced out of a larger array."""
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    wide_a = rng.standard_normal((m, k + 9)).astype(dtype)
    wide_a[:, 4:4 + k] = a
    tall_b = rng.standard_normal((2 * k, n)).astype(dtype)
    tall_b[::2] = b
    return {"C C": (a, b), "F F": (np.asfortranarray(a), np.asfortranarray(b)),
            "a^T of C": (np.ascontiguousarray(a.T).T, b), "column slice": (wide_a[:, 4:4 + k], b),
            "every other row": (a, tall_b[::2]), "3-D reshaped, transposed": (
                np.ascontiguousarray(a.T).reshape(k, 1, m).reshape(k, m).T, b)}


@needs_mkl
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mkl_products_of_every_layout_equal_numpys(use, dtype):
    use("mkl")
    rng = np.random.default_rng(0)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    for name, (a, b) in _operands(rng, dtype).items():
        assert blas._layout(a) is not None and blas._layout(b) is not None, name  # (MKL takes them)
        got = blas.matmul(a, b)
        assert got.dtype == dtype and got.flags.c_contiguous, name
        np.testing.assert_allclose(got, a @ b, **tol, err_msg=name)
        out = rng.standard_normal(got.shape).astype(dtype)
        want = out + a @ b
        assert blas.matmul(a, b, out) is out  # out += a @ b, in place
        np.testing.assert_allclose(out, want, **tol, err_msg=name)


@needs_mkl
def test_what_mkl_cannot_take_goes_to_numpy_unchanged(use, monkeypatch):
    use("mkl")
    calls = []
    monkeypatch.setitem(blas._state, "gemm", {k: (lambda *a, f=f: calls.append(1) or f(*a)) for k, f in GEMM.items()})
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((6, 5)), rng.standard_normal((5, 4))
    cases = {"float16": (a.astype(np.float16), b.astype(np.float16)), "ints": (a.astype(np.int64), b.astype(np.int64)),
             "mixed dtypes": (a.astype(np.float32), b), "both strides > 1": (rng.standard_normal((12, 10))[::2, ::2], b),
             "a vector": (a[0], b), "3-D": (a[None], b), "empty": (a[:0], b),
             "big-endian": (a.astype(">f8"), b.astype(">f8"))}
    for name, (x, y) in cases.items():
        np.testing.assert_array_equal(blas.matmul(x, y), x @ y, err_msg=name)
    # out holding an operand: NumPy's product first, then the sum (a BLAS call would read what it writes)
    sq = rng.standard_normal((5, 5))
    want = sq + sq @ sq
    np.testing.assert_allclose(blas.matmul(sq, sq, sq), want, rtol=1e-13)
    assert calls == []
    blas.matmul(a, b)
    assert calls == [1]


@needs_mkl
def test_the_same_inputs_give_the_same_bits_at_any_alignment(use):
    """Strict conditional numerical reproducibility: MKL may otherwise pick its code path by the
    address of the data (a resumed run would differ in the last bits)."""
    use("mkl")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((64, 200)).astype(np.float32)
    b = rng.standard_normal((200, 48)).astype(np.float32)
    results = set()
    for shift in range(8):
        buf = np.empty(a.size + shift, np.float32)
        moved = buf[shift:].reshape(a.shape)
        moved[...] = a
        results.add(blas.matmul(moved, b).tobytes())
    assert len(results) == 1


@pytest.mark.parametrize("value", ["numpy", "NumPy", "", None])
def test_numpy_is_the_default(monkeypatch, value):
    monkeypatch.setattr(blas, "_state", {})
    if value is None:
        monkeypatch.delenv(blas.BLAS_ENV, raising=False)
    else:
        monkeypatch.setenv(blas.BLAS_ENV, value)
    monkeypatch.setattr(blas, "_in_worker", lambda: True)  # (even in a worker, on an Intel CPU)
    monkeypatch.setattr(blas, "_intel_cpu", lambda: True)
    assert blas.backend() == "numpy"
    a = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(blas.matmul(a, a.T), np.full((3, 3), 2.0, np.float32))


@pytest.mark.parametrize("worker,intel,torch_loaded", [(True, True, False), (False, True, False),
                                                       (True, False, False), (True, True, True)])
def test_auto_takes_mkl_in_a_worker_on_intel_without_torch_only(monkeypatch, worker, intel, torch_loaded):
    """auto: MKL only in a Dask worker process, on an Intel CPU, where torch is not loaded; and
    elsewhere MKL is not even loaded (loaded before torch, it takes over torch's own MKL)."""
    monkeypatch.setattr(blas, "_state", {})
    monkeypatch.setenv(blas.BLAS_ENV, "auto")
    monkeypatch.setattr(blas, "_in_worker", lambda: worker)
    monkeypatch.setattr(blas, "_intel_cpu", lambda: intel)
    monkeypatch.setattr(blas, "_torch_loaded", lambda: torch_loaded)
    loads = []
    monkeypatch.setattr(blas, "_load_mkl", lambda: loads.append(1) or (GEMM, WHY))
    want = "mkl" if worker and intel and not torch_loaded and GEMM is not None else "numpy"
    assert blas.backend() == want
    assert loads == ([1] if worker and intel and not torch_loaded else [])


@pytest.mark.parametrize("value", ["auto", None])
def test_a_users_own_process_never_loads_mkl_by_default_or_under_auto(value):
    """A script that multiplies without a cluster (kernels in its own process) and may import
    torch afterwards: MKL is not in the process (loaded first, it would take over torch's)."""
    code = ("import numpy as np, tilegraph as tg\n"
            "x = tg.from_numpy(np.ones((64, 64), np.float32), tiles=32)\n"
            "(x @ x).numpy()\n"
            "from tilegraph.ops import _blas\n"
            "print(_blas.backend(), any('libmkl' in line for line in open('/proc/self/maps')))\n")
    env = {k: v for k, v in os.environ.items() if k != blas.BLAS_ENV}
    if value is not None:
        env[blas.BLAS_ENV] = value
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["numpy", "False"], proc.stdout


@pytest.mark.distributed
def test_the_workers_of_a_cluster_multiply_as_the_environment_says(embedded_runtime, monkeypatch):
    """The default: NumPy in the workers. TILEGRAPH_BLAS=auto where a cluster starts: its workers
    take MKL (where installed, on an Intel CPU), and their products train as NumPy's do."""
    assert set(embedded_runtime.client.run(blas.backend).values()) == {"numpy"}
    monkeypatch.setenv(blas.BLAS_ENV, "auto")
    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False) as rt:
        assert set(rt.client.run(blas.backend).values()) == {"mkl" if GEMM is not None and blas._intel_cpu()
                                                             else "numpy"}


def test_a_bad_choice_or_mkl_missing_is_named(monkeypatch):
    monkeypatch.setattr(blas, "_state", {})
    monkeypatch.setenv(blas.BLAS_ENV, "openblas")
    with pytest.raises(TileError, match=r"TILEGRAPH_BLAS environment variable\] one of numpy, auto, mkl; "
                                        r"received: 'openblas'"):
        blas.backend()
    monkeypatch.setattr(blas, "_state", {})
    monkeypatch.setenv(blas.BLAS_ENV, "mkl")
    monkeypatch.setattr(blas, "_mkl_paths", lambda: [])
    with pytest.raises(TileError, match=r"TILEGRAPH_BLAS=mkl\] MKL's runtime library, loadable here; received: no "
                                        r"MKL runtime library .* pip install \"tilegraph\[mkl\]\""):
        blas.backend()
    monkeypatch.setattr(blas, "_state", {})
    monkeypatch.setenv(blas.BLAS_ENV, "auto")  # auto without MKL: NumPy, no error
    assert blas.backend() == "numpy"


def _train(steps=3):
    """A 2-layer MLP over K-tiled weights (products summed over K tiles, weight gradients over row
    tiles): losses and trained weights, float64."""
    rng = np.random.default_rng(3)
    model = tg.nn.MLP(24, 40, out_dim=8, tile=16, seed=0, dtype="float64")
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-2), lambda m, x, y: ((m(x) - y) ** 2).mean(),
                        batch_tiles=[(6, 16), (6, 8)])
    losses = [step(rng.standard_normal((18, 24)), rng.standard_normal((18, 8))) for _ in range(steps)]
    return losses, {k: v.copy() for k, v in model.state_dict().items()}


@needs_mkl
def test_a_training_step_through_mkl_equals_the_numpy_one(use):
    use("numpy")
    want_losses, want = _train()
    use("mkl")
    losses, got = _train()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-13, err_msg=k)


def test_bench_kernels_times_the_products():
    """bench_kernels.py --only gemm: NumPy's, tilegraph's and torch's GFLOP/s on each shape."""
    pytest.importorskip("torch")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "bench/bench_kernels.py", "--only", "gemm", "--repeat", "1"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if " x " in line and "|" in line]
    assert len(rows) == 5, proc.stdout
    for r in rows:  # numpy, mkl, torch GFLOP/s | mkl / torch time ("-" without MKL)
        numbers = [r[-5], r[-3]] + ([r[-4], r[-1]] if GEMM is not None else [])
        assert all(np.isfinite(float(v)) and float(v) > 0 for v in numbers), r
        assert GEMM is not None or r[-4] == r[-1] == "-", r
