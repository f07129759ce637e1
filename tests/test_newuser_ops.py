"""A PyTorch user writing models with tilegraph's functional ops, autograd and nn layers: each test
is a defect such a user hit (a raw Python error, a misleading message or a silently wrong dtype)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tilegraph as tg


def test_negating_an_integer_tensor_stays_integer_as_in_torch():
    ids = tg.from_numpy(np.arange(5, dtype=np.int32), 2)
    neg = -ids
    want = (-torch.arange(5, dtype=torch.int32)).numpy()
    assert neg.dtype == want.dtype  # was float64
    np.testing.assert_array_equal(neg.numpy(), want)
    assert (-tg.from_numpy(np.ones(2, np.float16))).dtype == np.float16
    x = tg.from_numpy(np.arange(3.0))
    np.testing.assert_array_equal(tg.grad((-x * x).sum(), [x])[0].numpy(), -2 * np.arange(3.0))
    with pytest.raises(tg.TileError, match=r"__neg__\] negating a bool tensor.*received: a bool tensor"):
        -tg.from_numpy(np.array([True, False]))  # was a float64 [-1., -0.]
    with pytest.raises(tg.TileError, match=r"unsigned integer.*received: a uint8 tensor"):
        -tg.from_numpy(np.arange(3, dtype=np.uint8))


@pytest.mark.parametrize("call", [lambda x: tg.softmax(x, dim=1.0), lambda x: tg.softmax(x, dim=None),
                                  lambda x: tg.log_softmax(x, dim="1"), lambda x: x.transpose(0.0, 1),
                                  lambda x: tg.transpose(x, 0, None)])
def test_a_dim_that_is_no_int_is_a_tile_error(call):
    x = tg.from_numpy(np.ones((2, 3)))
    with pytest.raises(tg.TileError, match=r"dim must be an int.*received: "):  # was a raw TypeError
        call(x)
    np.testing.assert_allclose(tg.softmax(x, dim=np.int64(-1)).numpy(), np.full((2, 3), 1 / 3))


@pytest.mark.parametrize("eps", [np.float32(0.25), np.float64(0.25)])
def test_norms_take_a_numpy_scalar_eps(eps):
    a = np.random.default_rng(0).standard_normal((3, 6))
    x = tg.from_numpy(a, (2, 4))
    ta = torch.tensor(a)
    # were "eps must be a non-negative number; received: np.float32(0.25)"
    np.testing.assert_allclose(tg.layer_norm(x, (6,), eps=eps).numpy(),
                               F.layer_norm(ta, (6,), eps=float(eps)).numpy(), atol=1e-12)
    np.testing.assert_allclose(tg.rms_norm(x, eps=eps).numpy(), F.rms_norm(ta, (6,), eps=float(eps)).numpy(),
                               atol=1e-12)
    layer = tg.nn.LayerNorm(6, eps=eps, tile=4, dtype=np.float64)
    np.testing.assert_allclose(layer(x).numpy(), F.layer_norm(ta, (6,), eps=float(eps)).numpy(), atol=1e-12)
    with pytest.raises(tg.TileError, match="eps must be a non-negative number; received: True"):
        tg.rms_norm(x, eps=True)


def _qkv(hq=4, hkv=2):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, hq, 5, 4))
    k, v = rng.standard_normal((2, 1, hkv, 5, 4))
    return q, k, v


def test_sdpa_takes_torchs_enable_gqa_and_checks_scale():
    q, k, v = _qkv()
    tq, tk, tv = (tg.from_numpy(a, (1, 2, 2, 4)) for a in (q, k, v))
    out = tg.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)  # was a raw TypeError
    want = F.scaled_dot_product_attention(*(torch.tensor(a) for a in (q, k, v)), is_causal=True, enable_gqa=True)
    np.testing.assert_allclose(out.numpy(), want.numpy(), atol=1e-12)
    with pytest.raises(tg.TileError, match=r"enable_gqa=False.*received: q heads 4, k heads 2"):
        tg.scaled_dot_product_attention(tq, tk, tv, enable_gqa=False)
    same = tg.scaled_dot_product_attention(tq, tq, tq, enable_gqa=False)
    np.testing.assert_allclose(same.numpy(), F.scaled_dot_product_attention(*(torch.tensor(q),) * 3).numpy(),
                               atol=1e-12)
    for bad in ("0.5", True, float("nan")):  # "a" was a raw ValueError, "0.5" and True silently taken
        with pytest.raises(tg.TileError, match="scale must be None"):
            tg.scaled_dot_product_attention(tq, tq, tq, scale=bad)


@pytest.mark.parametrize("offset", [None, "2", 1.5, float("inf"), float("nan"), True])
def test_rope_position_offset_is_checked(offset):
    x = tg.from_numpy(np.ones((1, 1, 3, 4)))
    with pytest.raises(tg.TileError, match="position_offset must be a non-negative integer"):  # were raw errors
        tg.rope(x, position_offset=offset)


def test_causal_self_attention_checks_its_input_and_tile():
    layer = tg.nn.CausalSelfAttention(8, 2, seed=0)
    x = np.ones((2, 5, 8), np.float32)
    with pytest.raises(tg.TileError, match=r"x must be a \(B, T, C\) TileTensor with C = 8.*received: shape \(5, 8\)"):
        layer(tg.from_numpy(x[0]))  # was "ValueError: not enough values to unpack"
    with pytest.raises(tg.TileError, match="received: ndarray"):
        layer(x)
    with pytest.raises(tg.TileError, match=r"tile must be a positive int.*received: tile='4' \(str\)"):
        tg.nn.CausalSelfAttention(8, 2, tile="4")  # was "TypeError: not all arguments converted ..."
    assert layer(tg.from_numpy(x)).shape == (2, 5, 8)


def test_grad_of_a_loss_recorded_under_no_grad_says_why():
    x = tg.from_numpy(np.ones(3))
    with tg.no_grad():
        loss = (x * x).sum()
    with pytest.raises(tg.TileError, match=r"the loss has no recorded history.*no_grad"):
        tg.grad(loss, [x])
    assert tg.grad(loss, [x], allow_unused=True) == [None]


@pytest.mark.parametrize("expr", [lambda u: 0 - u, lambda u: u * -1, lambda u: u - 300])
def test_numbers_an_unsigned_tensor_cannot_hold_are_a_tile_error(expr):
    u = tg.from_numpy(np.array([1, 2, 3], np.uint8))
    with pytest.raises(tg.TileError, match=r"^\[tilegraph.affine\] numbers that a uint8 tensor holds"):
        tg.compute(expr(u))  # was NumPy's OverflowError: Python integer -1 out of bounds for uint8
    assert tg.compute(u * 2)[0].tolist() == [2, 4, 6]
