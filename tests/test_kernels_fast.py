"""The float32 GELU/SiLU kernels built without libm calls (ops/elementwise.py) and the fused AdamW
kernel: against torch float32 at the shared tolerance, and against float64 values to within a
few float32 ulp, over a dense grid on [-20, 20] plus zeros, tiny and denormal inputs."""

import math

import numpy as np
import pytest

import tilegraph as tg
from conftest import TOL, check_against_torch
from tilegraph.ops import elementwise as ew

torch = pytest.importorskip("torch")
F = torch.nn.functional

S2PI = math.sqrt(2.0 / math.pi)


def _inputs() -> np.ndarray:
    tiny = np.geomspace(1e-45, 1.0, 2001)
    special = [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1e-30, -1e-30, 20.0, -20.0, 19.999, -19.999]
    x = np.concatenate([np.linspace(-20.0, 20.0, 400_001), tiny, -tiny, special]).astype(np.float32)
    assert np.any(x == 0) and np.any(np.abs(x) == 20) and np.any((x != 0) & (np.abs(x) < 1e-38))
    return x


def _sigmoid(z):
    return np.where(z >= 0, 1.0 / (1.0 + np.exp(-np.abs(z))), np.exp(-np.abs(z)) / (1.0 + np.exp(-np.abs(z))))


def _erfc(z):
    return np.array([math.erfc(t) for t in z.ravel()]).reshape(z.shape)


def _exact(act: str, x64: np.ndarray):
    """(y, dy/dx) in float64 from formulations without cancellation (the tails stay relatively exact)."""
    if act == "gelu_tanh":
        z = 2.0 * S2PI * (x64 + 0.044715 * x64 ** 3)
        s = _sigmoid(z)
        return x64 * s, s + x64 * 2.0 * S2PI * (1 + 3 * 0.044715 * x64 ** 2) * s * _sigmoid(-z)
    if act == "gelu":
        cdf = 0.5 * _erfc(-x64 / math.sqrt(2.0))
        return x64 * cdf, cdf + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    s = _sigmoid(x64)
    return x64 * s, s * (1 + x64 * _sigmoid(-x64))


KERNELS = {
    "gelu_tanh": (lambda x: ew._gelu_cpu(x, approximate="tanh"),
                  lambda x, g: ew._gelu_bwd_cpu(x, g, approximate="tanh")),
    "gelu": (lambda x: ew._gelu_cpu(x), lambda x, g: ew._gelu_bwd_cpu(x, g)),
    "silu": (ew._silu_k.impl("cpu"), ew._silu_bwd_k.impl("cpu")),
}
TG = {"gelu_tanh": lambda x: tg.gelu(x, approximate="tanh"), "gelu": tg.gelu, "silu": tg.silu}
TORCH = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


@pytest.mark.parametrize("act", list(KERNELS))
def test_fast_f32_matches_torch_f32(act):
    """Forward and backward through the graph (several tiles) against torch float32."""
    x = _inputs()
    check_against_torch(TG[act], TORCH[act], [x], "n", "ragged")


@pytest.mark.parametrize("act", list(KERNELS))
def test_fast_f32_near_exact(act):
    x = _inputs()
    fwd, bwd = KERNELS[act]
    y, dy = _exact(act, x.astype(np.float64))
    got_y, got_dy = fwd(x), bwd(x, np.ones_like(x))
    assert got_y.dtype == got_dy.dtype == np.float32
    for what, got, want in (("forward", got_y, y), ("backward", got_dy, dy)):
        err = np.abs(got.astype(np.float64) - want)
        # within 3 float32 ulp of max(|value|, 1): rounding level of float32 arithmetic
        ulp = np.spacing(np.maximum(np.abs(want), 1.0).astype(np.float32)).astype(np.float64)
        worst = int(np.argmax(err / ulp))
        assert err[worst] <= 3 * ulp[worst], f"{what} at x={x[worst]!r}: {got[worst]!r} vs {want[worst]!r}"
    # the left tail is relatively accurate too (x sigmoid(z) and x Phi(x) never cancel): what is
    # left is the float32 rounding of the exponent's argument, growing with |argument| <= 88
    keep = (x < 0) & (np.abs(y) > 1e-30)
    rel = np.abs(got_y[keep] - y[keep]) / np.abs(y[keep])
    assert rel.max() < 2e-5, f"forward tail: relative error {rel.max():.3g} at x={x[keep][rel.argmax()]!r}"
    # exact values where they are exact
    assert got_y[x == 0].tolist() == [0.0] * int(np.sum(x == 0))
    assert np.all(got_dy[x == 0] == 0.5)


@pytest.mark.parametrize("act", list(KERNELS))
def test_fast_f32_special_values(act):
    fwd, bwd = KERNELS[act]
    x = np.array([np.nan, 1e30, -1e30, 3e38, -3e38, 200.0, -200.0], np.float32)
    y, dy = fwd(x), bwd(x, np.ones_like(x))
    assert np.isnan(y[0]) and np.isnan(dy[0])
    np.testing.assert_array_equal(y[1:], np.array([1e30, 0.0, 3e38, 0.0, 200.0, 0.0], np.float32))
    np.testing.assert_array_equal(dy[1:], np.array([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], np.float32))
    assert np.all(np.signbit(y[[2, 4, 6]]))  # -0.0 on the far left, as torch


@pytest.mark.parametrize("act", list(KERNELS))
def test_fast_f32_keeps_inputs_and_layout(act):
    """Non-contiguous inputs work and nothing is written into the inputs."""
    fwd, bwd = KERNELS[act]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 10)) * 3).astype(np.float32)[:, ::2]
    g = rng.standard_normal((6, 5)).astype(np.float32)
    x0, g0 = x.copy(), g.copy()
    y, dx = fwd(x), bwd(x, g)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(g, g0)
    ty = TORCH[act](torch.tensor(x0, requires_grad=True))
    rtol, atol = TOL[np.dtype(np.float32)]
    np.testing.assert_allclose(y, ty.detach().numpy(), rtol=rtol, atol=atol)
    tx = torch.tensor(x0, requires_grad=True)
    TORCH[act](tx).backward(torch.tensor(g0))
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=rtol, atol=atol * float(np.abs(g0).max()))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adamw_kernel_matches_torch_and_keeps_inputs(dtype):
    from tilegraph.optim import _adamw_cpu

    rng = np.random.default_rng(1)
    shape = (37, 29)
    p, g, m = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    v = (rng.random(shape) * 0.1).astype(dtype)
    v[0, :5] = 0.0
    g[0, :3] = 0.0
    m[0, :3] = 0.0
    p0, g0, m0, v0 = p.copy(), g.copy(), m.copy(), v.copy()
    lr, betas, eps, wd, step = 3e-3, (0.8, 0.95), 1e-8, 0.1, 7
    po, mo, vo = _adamw_cpu(p, g, m, v, np.array([lr, step], np.float64), beta1=betas[0], beta2=betas[1],
                            eps=eps, weight_decay=wd)
    for a, a0 in ((p, p0), (g, g0), (m, m0), (v, v0)):
        np.testing.assert_array_equal(a, a0)
    assert all(o.dtype == dtype and o.shape == shape for o in (po, mo, vo))
    tp = torch.tensor(p0, requires_grad=True)
    tp.grad = torch.tensor(g0)
    opt = torch.optim.AdamW([tp], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    opt.state[tp] = {"step": torch.tensor(float(step - 1)), "exp_avg": torch.tensor(m0),
                     "exp_avg_sq": torch.tensor(v0)}
    opt.step()
    st = opt.state[tp]
    tol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(po, tp.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(mo, st["exp_avg"].numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(vo, st["exp_avg_sq"].numpy(), rtol=tol, atol=tol)


def test_bench_kernels_runs():
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--gelu-shape", "64", "48", "--adamw-shape", "64", "48",
                          "--repeat", "2"], capture_output=True, text=True, timeout=600, check=True).stdout
    for name in ("gelu_tanh_bwd", "gelu_erf", "silu_bwd", "adamw vs torch"):
        assert name in out, out


@pytest.mark.parametrize("threads", [1, 2])
def test_kernels_run_without_numpy_float_warnings(threads):
    # inf and NaN come out as in torch; the warnings NumPy would print from inside tilegraph's
    # kernels (on the workers, a line per kernel) are off, on every kernel thread
    import warnings

    x = tg.from_numpy(np.full((8, 8), 1e30, np.float32), tiles=(4, 8))
    y = (x * x) - (x * x)  # overflow, then inf - inf
    exe = tg.compile([y], fuse=True)
    exe.plans[0].prog.threads = threads
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning would raise
        got = tg.compute(y) if threads == 1 else exe.run()
    values = got[0] if threads == 1 else np.concatenate([np.asarray(v) for v in got])
    assert np.isnan(values).all()
