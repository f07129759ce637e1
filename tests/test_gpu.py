"""CuPy kernels on a real GPU worker (marked gpu: skipped on machines without CUDA and CuPy)."""

import numpy as np
import pytest

import tilegraph as tg

pytestmark = [pytest.mark.gpu, pytest.mark.distributed]


def _model_graph(rng):
    x = tg.from_numpy(rng.standard_normal((4, 64, 96)).astype(np.float32), (2, 32, 48))
    w = tg.from_numpy((rng.standard_normal((96, 96)) / 10).astype(np.float32), (48, 48))
    b = tg.from_numpy(np.zeros(96, np.float32), (48,))
    g = tg.from_numpy(np.ones(96, np.float32), (48,))
    h = tg.layer_norm(tg.gelu(tg.matmul(x, w, bias=b), approximate="tanh"), (96,), g, b)
    q = tg.transpose(tg.reshape(h, (4, 64, 8, 12)), 1, 2)
    a = tg.scaled_dot_product_attention(q, q, q, is_causal=True)
    loss = (a * a).mean() + tg.softmax(h, -1).sum() * 1e-3
    return loss, tg.grad(loss, [x, w, b])


def test_cupy_kernels_match_numpy_on_a_gpu_worker():
    rng = np.random.default_rng(0)
    loss, grads = _model_graph(rng)
    want = tg.compute(loss, *grads)  # NumPy on the local scheduler
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True) as rt:
        exe = tg.compile([loss, *grads], placement="gpu")
        assert {c.device for c in exe.clusters} == {"gpu"}
        got = tg.compute(loss, *grads, placement="gpu")
        assert rt.processors()["gpu"] == 1
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)
