"""Autograd: finite differences, summed gradients of reused values, and its error messages."""

import numpy as np
import pytest

import tilegraph as tg


def _f(x, w):
    h = tg.gelu(x @ w)
    return (h * h + x @ w).mean() + (w * w).sum() * 0.1


@pytest.mark.parametrize("tiles", [(None, None), (2, 3), (3, 2)])
def test_gradients_match_finite_differences(rng, tiles):
    x0 = rng.standard_normal((5, 6))
    w0 = rng.standard_normal((6, 4))
    x = tg.from_numpy(x0, tiles)
    w = tg.from_numpy(w0, (tiles[1], None))
    gx, gw = tg.compute(*tg.grad(_f(x, w), [x, w]))

    def value(xa, wa):
        return float(_f(tg.from_numpy(xa, tiles), tg.from_numpy(wa, (tiles[1], None))).numpy())

    eps = 1e-6
    for arr, g, which in ((x0, gx, 0), (w0, gw, 1)):
        for idx in [(0, 0), (1, 2), tuple(s - 1 for s in arr.shape)]:
            plus, minus = arr.copy(), arr.copy()
            plus[idx] += eps
            minus[idx] -= eps
            args_p = (plus, w0) if which == 0 else (x0, plus)
            args_m = (minus, w0) if which == 0 else (x0, minus)
            fd = (value(*args_p) - value(*args_m)) / (2 * eps)
            assert abs(fd - g[idx]) < 1e-6 * max(1.0, abs(fd)), (which, idx, fd, g[idx])


def test_value_used_several_times_gets_summed_gradient(rng):
    a = rng.standard_normal((4, 3))
    x = tg.from_numpy(a, (2, 3))
    y = x * x + x * 3.0 + tg.relu(x)  # x reaches the loss through four paths
    (g,) = tg.grad(y.sum(), [x])
    np.testing.assert_allclose(g.numpy(), 2 * a + 3.0 + (a > 0), rtol=1e-12)


def test_gradient_with_respect_to_an_intermediate(rng):
    x = tg.from_numpy(rng.standard_normal((3, 3)))
    h = x * 2.0
    (gh,) = tg.grad((h * h).sum(), [h])
    np.testing.assert_allclose(gh.numpy(), 2 * h.numpy())


def test_non_scalar_loss_is_a_clear_error(rng):
    x = tg.from_numpy(rng.standard_normal((3, 2)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.grad\] loss must be a scalar.*received: loss of shape \(3, 2\)"):
        tg.grad(x * 2.0, [x])


def test_unused_input_is_reported(rng):
    x = tg.from_numpy(rng.standard_normal(3))
    y = tg.from_numpy(rng.standard_normal(3))
    with pytest.raises(tg.TileError, match=r"inputs\[1\] does not affect the loss"):
        tg.grad((x * x).sum(), [x, y])
    gx, gy = tg.grad((x * x).sum(), [x, y], allow_unused=True)
    assert gy is None


def test_no_grad_records_no_history_and_changes_no_value(rng):
    import threading

    x = tg.from_numpy(rng.standard_normal((4, 6)), (2, 3))
    want = tg.compute(tg.gelu(x @ tg.transpose(x, 0, 1)).sum())[0]
    with tg.no_grad():
        y = tg.gelu(x @ tg.transpose(x, 0, 1)).sum()
        with tg.no_grad():  # nested: still off after the inner block
            pass
        z = (x * 2.0).sum()
        other = []  # another thread records as usual
        th = threading.Thread(target=lambda: other.append((x * x).sum()))
        th.start()
        th.join()
    assert y._record is None and z._record is None and other[0]._record is not None
    np.testing.assert_array_equal(tg.compute(y)[0], want)
    with pytest.raises(tg.TileError, match=r"inputs\[0\] does not affect the loss"):
        tg.grad(y, [x])
    assert (x * x).sum()._record is not None  # on again after the block
    (g,) = tg.grad(other[0], [x])
    np.testing.assert_allclose(g.numpy(), 2 * x.numpy())
