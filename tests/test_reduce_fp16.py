"""float16 reductions accumulate in float32 and cast last, as torch's do: a mean, variance or
sum over many halves comes out as torch's, where a float16 running sum overflowed to inf."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_mode, tiles_for

torch = pytest.importorskip("torch")


@by_mode
@pytest.mark.parametrize("dim", [None, 0, 1, (0, 1)], ids=str)
def test_half_means_and_variances_match_torch(mode, dim):
    rng = np.random.default_rng(0)
    h = (30.0 + rng.standard_normal((64, 96))).astype(np.float16)  # 6144 values of about 30: a float16 sum is inf
    x = tg.from_numpy(h, tiles_for(h.shape, "ab", mode))
    t = torch.tensor(h)
    kw = {} if dim is None else {"dim": dim}
    for name in ("mean", "var", "std"):
        got = getattr(x, name)(**kw)
        want = getattr(t, name)(**kw)
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.double().numpy(), rtol=2e-3, err_msg=name)
    got = x.sum(**kw).numpy()
    np.testing.assert_array_equal(np.isinf(got), np.isinf(t.sum(**kw).numpy()))  # overflow where torch's does


def test_half_mean_gradient_is_torchs():
    h = np.full((8, 4096), 30, np.float16)
    x = tg.from_numpy(h, tiles=(4, 1000))
    (g,) = tg.grad(x.mean() * 2.0, [x])
    t = torch.tensor(h, requires_grad=True)
    (t.mean() * 2.0).backward()
    got = g.numpy()
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, t.grad.numpy())
