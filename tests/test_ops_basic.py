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
