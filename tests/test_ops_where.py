"""Comparisons, where, masked_fill, abs and clamp against torch: forward and gradients over
single, even and ragged tilings, with broadcasting, numbers for either value, and the errors."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for

torch = pytest.importorskip("torch")


@by_mode
@by_dtype
def test_abs_and_clamp_as_torch(rng, mode, dtype):
    x = randn(rng, 5, 7, dtype=dtype)
    x[0, :3] = [0.0, -0.5, 0.5]  # at 0 and at the clamp bounds: the gradients' edge cases
    check_against_torch(lambda t: t.abs() * 2.0, lambda t: t.abs() * 2.0, [x], "ab", mode)
    check_against_torch(lambda t: abs(t), lambda t: abs(t), [x], "ab", mode)
    check_against_torch(lambda t: tg.clamp(t, -0.5, 0.5), lambda t: torch.clamp(t, -0.5, 0.5), [x], "ab", mode)
    check_against_torch(lambda t: t.clamp(min=0.0), lambda t: t.clamp(min=0.0), [x], "ab", mode)
    check_against_torch(lambda t: t.clip(max=0.5), lambda t: t.clip(max=0.5), [x], "ab", mode)


@by_mode
@by_dtype
@pytest.mark.parametrize("op", ["gt", "ge", "lt", "le", "eq", "ne"])
def test_comparisons_as_torch(rng, mode, dtype, op):
    a = np.round(randn(rng, 4, 6, dtype=dtype))  # whole numbers: equal elements exist
    b = np.round(randn(rng, 6, dtype=dtype))
    ta, tb = tg.from_numpy(a, tiles_for(a.shape, "xy", mode)), tg.from_numpy(b, tiles_for(b.shape, "y", mode))
    for got, want in ((getattr(ta, op)(tb), getattr(torch.tensor(a), op)(torch.tensor(b))),
                      (getattr(ta, op)(0.0), getattr(torch.tensor(a), op)(0.0))):
        assert got.dtype == np.bool_ and got.shape == tuple(want.shape)
        np.testing.assert_array_equal(got.numpy(), want.numpy())


@by_mode
@by_dtype
def test_where_as_torch(rng, mode, dtype):
    c = rng.standard_normal((4, 1, 6)) > 0
    a, b = randn(rng, 4, 5, 6, dtype=dtype), randn(rng, 5, 1, dtype=dtype)
    check_against_torch(lambda c, a, b: tg.where(c, a, b), torch.where, [c, a, b], "xZy,xzy,z1", mode)
    check_against_torch(lambda c, a: tg.where(c, a, 0.5), lambda c, a: torch.where(c, a, 0.5), [c, a], "xZy,xzy", mode)
    check_against_torch(lambda c, b: tg.where(c, -1, b), lambda c, b: torch.where(c, -1.0, b), [c, b], "xZy,z1", mode)
    check_against_torch(lambda a: a.where(a > 0, 0.0), lambda a: a.where(a > 0, 0.0), [a], "xzy", mode)


@by_mode
def test_masked_fill_as_torch(rng, mode):
    x = randn(rng, 3, 8, 8)
    causal = np.triu(np.ones((8, 8), bool), 1)  # a custom attention's mask, broadcast over the batch
    check_against_torch(lambda x, m: tg.softmax(x.masked_fill(m, float("-inf")), -1),
                        lambda x, m: torch.softmax(x.masked_fill(m, float("-inf")), -1), [x, causal], "bqk,qk", mode)
    check_against_torch(lambda x: x.masked_fill(x < 0, 0.0), lambda x: x.masked_fill(x < 0, 0.0), [x], "bqk", mode)


def test_an_l1_loss_trains_through_abs():
    rng = np.random.default_rng(0)
    lin = tg.nn.Linear(4, 1, dtype=np.float64, seed=0)
    x, y = rng.standard_normal((32, 4)), rng.standard_normal((32, 1))
    step = tg.TrainStep(lin, tg.optim.SGD(lin.parameters(), lr=0.05), lambda m, x, y: (m(x) - y).abs().mean())
    losses = [step(x, y) for _ in range(20)]
    assert losses[-1] < losses[0] * 0.9


def test_bad_operands_are_named():
    x = tg.from_numpy(np.ones((2, 3)))
    i = tg.from_numpy(np.arange(6).reshape(2, 3))
    cases = [
        (lambda: tg.where(x, x, x), r"\[tilegraph.where\] condition must be a bool TileTensor .*received: a float64"),
        (lambda: tg.where(x > 0, 1.0, 2.0), r"input or other must be a TileTensor \(for a 0/1 mask: "),
        (lambda: tg.where(x > 0, x, i), r"input and other of one dtype .*float64 and int64"),
        (lambda: tg.where(x > 0, x, np.ones(3)), r"other must be a TileTensor or a real number \(wrap a NumPy"),
        (lambda: x.masked_fill(x > 0, x), r"\[tilegraph.TileTensor.masked_fill\] value must be a real number"),
        (lambda: x.masked_fill(np.ones((2, 3), bool), 0.0), r"mask must be a bool TileTensor"),
        (lambda: x.masked_fill(tg.from_numpy(np.ones((4, 2, 3), bool)), 0.0),
         r"a mask that broadcasts to x's shape \(2, 3\); received: mask of shape \(4, 2, 3\)"),
        (lambda: x.gt(i), r"\[tilegraph.TileTensor.gt\] tensors of one dtype .*float64 > int64"),
        (lambda: x > "a", r"a TileTensor or a real number to compare with; received: str 'a'"),
        (lambda: tg.clamp(x), r"\[tilegraph.clamp\] at least one of min and max"),
        (lambda: tg.clamp(x, x), r"min must be a real number or None \(a tensor bound: tg.where\)"),
        (lambda: tg.from_numpy(np.ones(3, bool)).abs(), r"\[tilegraph.abs\] x must have a float or integer dtype"),
        (lambda: tg.from_numpy(np.ones(3, bool)) > tg.from_numpy(np.ones(3, bool)), r"numbers to order"),
    ]
    for make, what in cases:
        with pytest.raises(tg.TileError, match=what):
            make()
