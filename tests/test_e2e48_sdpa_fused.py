"""The fused attention backward (one ``sdpa_bwd`` task per tile pair when the queries and keys are
one tile each along T) against the split delta / dQ / dK-dV kernels and torch autograd."""

import numpy as np
import pytest

import tilegraph as tg
import tilegraph.ops.attention as attention
from conftest import randn
from tilegraph._graph import get_kernel, topo_order
from tilegraph.ops.attention import scaled_dot_product_attention as sdpa

torch = pytest.importorskip("torch")

TOL = {np.float64: 1e-12, np.float32: 2e-5, np.float16: 2e-3}


def _grads(arrays, tiles, causal, q_offset, dout):
    q, k, v = (tg.from_numpy(a, t) for a, t in zip(arrays, tiles))
    out = sdpa(q, k, v, is_causal=causal, q_offset=q_offset)
    loss = (out * tg.from_numpy(dout, out.chunks)).sum()
    grads = tg.grad(loss, [q, k, v])
    nodes = [n for n in topo_order([r for t in grads for r in t.grid.flat]) if not n.is_leaf]
    names = sorted({n.kernel.name for n in nodes if n.kernel.name.startswith("sdpa")})
    return [g.numpy() for g in grads], names


def _arrays(dtype, B, H, hkv, T, S, D, seed=0):
    rng = np.random.default_rng(seed)
    return [randn(rng, B, H, T, D, dtype=dtype), randn(rng, B, hkv, S, D, dtype=dtype),
            randn(rng, B, hkv, S, D, dtype=dtype)], randn(rng, B, H, T, D, dtype=dtype)


@pytest.mark.parametrize("impl", ["cpu", "cpu-unfused", "gpu-code"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("causal,hkv,T,S,block,group_bytes", [
    (True, 4, 23, 23, 5, 1),        # key blocks of 5 (the last of 3), one head per group
    (True, 2, 23, 23, 7, 2000),     # grouped-query heads, a few heads per group
    (False, 2, 19, 19, 4, 600),
    (True, 2, 6, 17, 4, 600),       # the last 6 of 17 positions (q_offset 11): early key blocks seen by all
    (True, 4, 1, 9, None, None),    # one query row against a cache (decoding's shape)
    (True, 4, 150, 150, None, None),  # the default blocks of 64 (64, 64, 22)
])
def test_fused_backward_equals_the_split_kernels(monkeypatch, impl, dtype, causal, hkv, T, S, block, group_bytes):
    if impl == "cpu-unfused":
        monkeypatch.setattr(attention, "one_pass", lambda xp, dtype: False)
    elif impl == "gpu-code":  # the GPU versions run on NumPy, as a GPU worker runs them on CuPy
        for name in ("sdpa_fwd", "sdpa_bwd_dq", "sdpa_bwd_dkv", "sdpa_bwd"):
            monkeypatch.setattr(get_kernel(name), "fn", get_kernel(name).gpu)
    if block is not None:
        monkeypatch.setattr(attention, "_BLOCK", block)
        monkeypatch.setattr(attention, "_GROUP_BYTES", group_bytes)
    arrays, dout = _arrays(dtype, 2, 4, hkv, T, S, 8)
    tiles = [(1, 2, None, None), (1, hkv // 2, None, None), (1, hkv // 2, None, None)]  # head tiles pair up
    fused, names = _grads(arrays, tiles, causal, S - T if causal else 0, dout)
    assert names == ["sdpa_bwd", "sdpa_fwd"]
    monkeypatch.setattr(attention, "_FUSED_BACKWARD", False)
    split, names = _grads(arrays, tiles, causal, S - T if causal else 0, dout)
    assert names == ["sdpa_bwd_delta", "sdpa_bwd_dkv", "sdpa_bwd_dq", "sdpa_fwd"]
    for a, b, what in zip(fused, split, "qkv"):
        assert a.dtype == b.dtype == dtype, what
        scale = max(1.0, float(np.abs(b.astype(np.float64)).max()))
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=0,
                                   atol=TOL[dtype] * scale, err_msg=f"d{what}")
    # and both against torch autograd (float64)
    if dtype == np.float64:
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in arrays)
        g = tq.shape[1] // tk.shape[1]
        mask = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T) if causal else None
        ref = torch.nn.functional.scaled_dot_product_attention(
            tq, tk.repeat_interleave(g, dim=1), tv.repeat_interleave(g, dim=1), attn_mask=mask)
        (ref * torch.tensor(dout)).sum().backward()
        for a, t, what in zip(fused, (tq, tk, tv), "qkv"):
            np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"d{what}")


@pytest.mark.parametrize("tiles,fused", [
    ([(1, None, None, None)] * 3, True),                                      # one tile everywhere
    ([(1, 2, None, None), (1, 1, None, None), (1, 1, None, None)], True),     # 2 query heads per kv head tile
    ([(1, 1, None, None), (1, 1, None, None), (1, 1, None, None)], False),    # query head tiles of 1: half a kv head's group
    ([(1, 2, (6, 6), None), (1, 1, None, None), (1, 1, None, None)], False),  # queries tiled along T
    ([(1, 2, None, None), (1, 1, (4, 8), None), (1, 1, (4, 8), None)], False),  # keys tiled along T
])
def test_which_tilings_get_the_fused_backward(tiles, fused):
    """One sdpa_bwd task per (batch, head) tile pair exactly where query head tile p reads kv head
    tile p alone and T is one tile on both sides; the split kernels elsewhere."""
    arrays, dout = _arrays(np.float64, 2, 4, 2, 12, 12, 8)
    got, names = _grads(arrays, tiles, True, 0, dout)
    assert ("sdpa_bwd" in names) is fused, names
    assert ("sdpa_bwd_dq" in names) is not fused, names
