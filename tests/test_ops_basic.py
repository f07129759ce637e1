"""Elementwise, reduction, matmul and layout ops against torch autograd, over all tilings."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn

torch = pytest.importorskip("torch")
F = torch.nn.functional

params, dtypes, _r = by_mode, by_dtype, randn


@params
@dtypes
@pytest.mark.parametrize("name", ["add", "sub", "mul", "div"])
def test_binary_broadcast(rng, mode, dtype, name):
    a, b = _r(rng, 3, 7, 6, dtype=dtype), _r(rng, 7, 1, dtype=dtype)
    if name == "div":
        b = np.abs(b) + 0.5
    fn = getattr(tg, name)
    tfn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}[name]
    check_against_torch(fn, tfn, [a, b], "btc,tC", mode)
    check_against_torch(fn, tfn, [a, b[:, 0].reshape(1, 1, 7)[..., :1] * np.ones((1, 1, 6), dtype)],
                        "btc,BTc", mode)


@params
@dtypes
def test_bias_broadcast_and_scalars(rng, mode, dtype):
    x, bias = _r(rng, 2, 5, 9, dtype=dtype), _r(rng, 9, dtype=dtype)
    check_against_torch(lambda x, b: (x + b) * 0.5 - 1.0 + 2.0 * x, lambda x, b: (x + b) * 0.5 - 1.0 + 2.0 * x,
                        [x, bias], "btc,c", mode)
    check_against_torch(lambda x: 3.0 - x / 4.0, lambda x: 3.0 - x / 4.0, [x], "btc", mode)


@params
@dtypes
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "relu", "silu"])
def test_activations(rng, mode, dtype, act):
    x = _r(rng, 4, 11, 6, dtype=dtype) * 3
    fn = {"gelu": tg.gelu, "gelu_tanh": lambda x: tg.gelu(x, approximate="tanh"), "relu": tg.relu,
          "silu": tg.silu}[act]
    tfn = {"gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
           "silu": F.silu}[act]
    check_against_torch(fn, tfn, [x], "btc", mode)


@params
@dtypes
@pytest.mark.parametrize("dim,keepdims", [(None, False), (0, False), (1, True), ((0, 2), False), (-1, True)])
def test_sum_mean(rng, mode, dtype, dim, keepdims):
    x = _r(rng, 5, 7, 6, dtype=dtype)
    tdim = dim if dim is not None else tuple(range(3))
    check_against_torch(lambda x: tg.sum(x, dim, keepdims=keepdims),
                        lambda x: torch.sum(x, tdim, keepdim=keepdims), [x], "abc", mode)
    check_against_torch(lambda x: tg.mean(x, dim, keepdims=keepdims),
                        lambda x: torch.mean(x, tdim, keepdim=keepdims), [x], "abc", mode)


def test_sum_is_a_tree_over_many_tiles(rng):
    from tilegraph.ops.reduce import FAN_IN

    x = _r(rng, 100)
    t = tg.from_numpy(x, 2)  # 50 tiles -> two levels of partial sums
    s = t.sum()
    kernels = tg.compile([s]).n_nodes
    assert kernels == -(-50 // FAN_IN) + 1
    np.testing.assert_allclose(s.numpy(), x.sum())


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_])
def test_integer_and_bool_tensors_follow_numpys_dtypes(dtype):
    """Arithmetic on integer (and bool) tensors gives NumPy's values and dtypes: a fraction, a
    true division or a mean makes floats, integer scalars keep integers, sums of small integers
    and booleans are int64; over one tile and over a tree of them. Before, ``x * 0.5`` of an
    integer tensor was all zeros and a mean truncated."""
    a = (np.arange(40).reshape(20, 2) % 7).astype(dtype)
    b = (np.arange(40).reshape(20, 2) % 5 + 1).astype(dtype)
    for tiles in ((20, 2), (1, 2)):  # one tile; 20 row tiles (a tree of partial sums)
        x, y = tg.from_numpy(a, tiles), tg.from_numpy(b, tiles)
        cases = {"x * 0.5": (x * 0.5, a * 0.5), "x / 2": (x / 2, a / 2), "x + 0.7": (x + 0.7, a + 0.7),
                 "x * 3": (x * 3, a * 3), "2 * x": (2 * x, 2 * a), "x + 1": (x + 1, a + 1),
                 "x / y": (x / y, a / b), "x * y": (x * y, a * b), "x + y": (x + y, a + b),
                 "sum": (tg.sum(x), a.sum()), "sum 0": (tg.sum(x, 0), a.sum(0)),
                 "mean": (tg.mean(x), a.mean()), "mean 1": (tg.mean(x, 1, keepdim=True), a.mean(1, keepdims=True)),
                 "mean of one": (tg.mean(tg.from_numpy(a[:, :1]), 1), a[:, :1].mean(1))}  # scale 1: still a float
        for what, (t, ref) in cases.items():
            got = t.numpy()
            assert got.dtype == ref.dtype == t.dtype, (what, tiles, got.dtype, ref.dtype, t.dtype)
            np.testing.assert_allclose(got, ref, rtol=1e-12, err_msg=f"{what}, tiles {tiles}")


def test_bool_subtraction_is_refused_and_empty_means_are_nan():
    x = tg.from_numpy(np.arange(6) > 2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.sub\].*bool"):
        x - x
    empty = tg.from_numpy(np.zeros((0, 4), np.float32))
    assert np.isnan(tg.mean(empty).numpy()) and tg.mean(empty).dtype == np.float32
    assert float(tg.sum(empty).numpy()) == 0.0


def test_linear_names_a_weight_in_torchs_layout():
    """tg.linear takes weights (in, out): one given in torch's (out, in) layout is named as such."""
    x = tg.from_numpy(np.ones((4, 8), np.float32))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.linear\].*torch's \(out, in\) layout.*x \(4, 8\), weight \(6, 8\)"):
        tg.linear(x, tg.from_numpy(np.ones((6, 8), np.float32)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.linear\] weight of shape \(in, out\)"):
        tg.linear(x, tg.from_numpy(np.ones((5, 6), np.float32)))


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu"])
def test_float16_activations_compute_in_float32(act):
    """float16 tiles go through the float32 kernels and back (the Numba kernels take float32 and
    float64 only; float16 raised NotImplementedError inside a kernel), forward and backward, as
    torch computes half activations."""
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float16)
    fn = {"gelu": tg.gelu, "gelu_tanh": lambda t: tg.gelu(t, approximate="tanh"), "silu": tg.silu}[act]
    tfn = {"gelu": torch.nn.functional.gelu, "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
           "silu": torch.nn.functional.silu}[act]
    t = tg.from_numpy(x, (3, 4))
    y, (g,) = fn(t), tg.grad((fn(t) * t).sum(), [t])
    tx = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    ty = tfn(tx)
    (ty * tx).sum().backward()
    assert y.numpy().dtype == g.numpy().dtype == np.float16
    np.testing.assert_allclose(y.numpy(), ty.detach().numpy().astype(np.float16), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(g.numpy(), tx.grad.numpy().astype(np.float16), atol=5e-3, rtol=5e-3)


def test_models_run_in_float16_and_refuse_other_dtypes():
    from tilegraph import models

    logits = tg.compute(models.build("gpt2-debug", dtype=np.float16)(np.array([[1, 2, 3]])))[0]
    assert logits.dtype == np.float16 and np.isfinite(logits).all()
    for bad in (np.int32, "bogus"):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.models.GPT2\] dtype must be a floating dtype"):
            models.build("gpt2-debug", dtype=bad)


def test_bad_operands_are_named():
    """Operands that are neither tensors nor real numbers, reduction dims that are not ints and
    unknown compile options give one TileError each (they were AttributeErrors and TypeErrors
    from inside); division by zero gives
    NumPy's inf and NaN."""
    a = tg.from_numpy(np.arange(6.0).reshape(2, 3))
    for op, make in (("add", lambda: a + np.ones(3)), ("add", lambda: np.ones(3) + a), ("mul", lambda: a * True),
                     ("add", lambda: a + "x"), ("sub", lambda: a - 1j), ("div", lambda: a / [2])):
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.{op}\] . must be a TileTensor or a real number"):
            make()
    with pytest.raises(tg.TileError, match=r"wrap a NumPy array with tg.from_numpy"):
        a * np.ones(3)
    for dim in (1.0, "x", (0, 1.5), True):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.sum\] dim must be None, an int or a tuple of ints"):
            a.sum(dim)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.compile\] keyword arguments among fuse, .*received: foo=1"):
        tg.compute(a, foo=1)
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal((a / 0).numpy(), np.arange(6.0).reshape(2, 3) / np.float64(0))


@params
@dtypes
def test_a_number_over_a_tensor_as_torch(rng, mode, dtype):
    x = np.abs(_r(rng, 4, 6, dtype=dtype)) + 0.5
    check_against_torch(lambda t: 3.0 / t - 1 / (t + 1.0), lambda t: 3.0 / t - 1 / (t + 1.0), [x], "ab", mode)
    check_against_torch(lambda t: 2.0 ** t + 0.5 ** (t * 2.0), lambda t: 2.0 ** t + 0.5 ** (t * 2.0), [x], "ab", mode)


def test_a_number_over_an_integer_tensor_is_a_float_and_a_bad_base_is_named():
    ids = tg.from_numpy(np.arange(1, 5))
    got = (2 / ids).numpy()
    assert got.dtype == np.float64 and np.array_equal(got, 2 / np.arange(1, 5))
    np.testing.assert_allclose((2 ** ids).numpy(), 2.0 ** np.arange(1, 5), rtol=1e-14)
    with np.errstate(divide="ignore"):
        assert (1.0 / tg.from_numpy(np.zeros(2))).numpy().tolist() == [np.inf, np.inf]
    for base in (0, -2.0, True, "2"):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.__rpow__\] a number to a tensor's power "
                           r"needs a positive real base"):
            base ** ids


@params
@dtypes
def test_matmul_2d_and_batched(rng, mode, dtype):
    a, b = _r(rng, 7, 9, dtype=dtype), _r(rng, 9, 5, dtype=dtype)
    check_against_torch(tg.matmul, torch.matmul, [a, b], "mk,kn", mode)
    x = _r(rng, 3, 7, 9, dtype=dtype)
    check_against_torch(tg.matmul, torch.matmul, [x, b], "bmk,kn", mode)
    y = _r(rng, 3, 9, 4, dtype=dtype)
    check_against_torch(tg.matmul, torch.matmul, [x, y], "bmk,bkn", mode)


@params
@dtypes
def test_matmul_with_b_transposed(rng, mode, dtype):
    x, w = _r(rng, 2, 6, 8, dtype=dtype), _r(rng, 10, 8, dtype=dtype)  # w: (N, K), e.g. a tied embedding
    out = check_against_torch(lambda x, w: tg.matmul(x, w, trans_b=True), lambda x, w: x @ w.T, [x, w],
                              "btk,nk", mode)
    assert "transpose" not in {n.kernel.name for n in _nodes(out)}  # b is read in place, never copied
    y = _r(rng, 2, 5, 8, dtype=dtype)
    check_against_torch(lambda x, y: tg.matmul(x, y, trans_b=True), lambda x, y: x @ y.transpose(-1, -2), [x, y],
                        "btk,bnk", mode)


@params
@dtypes
def test_matmul_bias_epilogue(rng, mode, dtype):
    x, w, b = _r(rng, 2, 6, 8, dtype=dtype), _r(rng, 8, 10, dtype=dtype), _r(rng, 10, dtype=dtype)
    out = check_against_torch(lambda x, w, b: tg.matmul(x, w, bias=b), lambda x, w, b: x @ w + b,
                              [x, w, b], "btk,kn,n", mode)
    # the bias is added inside the matmul kernels: no separate add tiles
    assert {n.kernel.name for n in _nodes(out)} == {"matmul"}


def _nodes(t):
    from tilegraph._graph import topo_order

    return [n for n in topo_order(list(t.grid.flat)) if not n.is_leaf]


@params
@dtypes
def test_transpose(rng, mode, dtype):
    x = _r(rng, 4, 7, 6, dtype=dtype)
    check_against_torch(lambda x: tg.transpose(x, 0, 2), lambda x: x.transpose(0, 2), [x], "abc", mode)
    check_against_torch(lambda x: tg.transpose(x, (1, 2, 0)), lambda x: x.permute(1, 2, 0), [x], "abc", mode)
    m = _r(rng, 5, 3, dtype=dtype)
    check_against_torch(lambda m: m.T, lambda m: m.T, [m], "ab", mode)


@params
@dtypes
def test_reshape_split_and_merge(rng, mode, dtype):
    x = _r(rng, 2, 5, 12, dtype=dtype)
    # split features into heads (tiles of 12 hold whole heads of 4) and merge back
    check_against_torch(lambda x: tg.reshape(x, (2, 5, 3, 4)), lambda x: x.reshape(2, 5, 3, 4),
                        [x], "btC", mode)
    check_against_torch(lambda x: tg.reshape(x, (2, 5, 3, 4)).reshape(2, 5, 12) * 2,
                        lambda x: x.reshape(2, 5, 3, 4).reshape(2, 5, 12) * 2, [x], "btC", mode)
    check_against_torch(lambda x: tg.reshape(x, (10, 12)), lambda x: x.reshape(10, 12), [x], "bTc", mode)
    check_against_torch(lambda x: tg.reshape(x, (2, 5, 12, 1)), lambda x: x.reshape(2, 5, 12, 1),
                        [x], "btc", mode)


def test_reshape_split_with_tiled_heads(rng):
    x = _r(rng, 2, 3, 12)
    t = tg.from_numpy(x, (1, 3, 8))  # tiles of 8 features = 2 heads of 4
    np.testing.assert_array_equal(tg.reshape(t, (2, 3, 3, 4)).numpy(), x.reshape(2, 3, 3, 4))


def test_reshape_incompatible_tiles_is_a_clear_error(rng):
    t = tg.from_numpy(_r(rng, 4, 6), (2, 3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.reshape\] reshape is not tile-compatible"):
        tg.reshape(t, (24,))
