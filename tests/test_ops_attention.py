"""Attention and rotary embedding against torch autograd, over all tilings, plus graph structure."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import TOL, by_dtype, by_mode, check_against_torch, randn
from tilegraph._graph import get_kernel, topo_order
from tilegraph.ops.attention import scaled_dot_product_attention as sdpa
from tilegraph.ops.rope import rope

torch = pytest.importorskip("torch")
F = torch.nn.functional

params, dtypes, _r = by_mode, by_dtype, randn


def torch_sdpa(q, k, v, causal=True, scale=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _qkv(rng, dtype, B=2, H=4, hkv=2, T=13, S=13, D=8):
    return [_r(rng, B, H, T, D, dtype=dtype), _r(rng, B, hkv, S, D, dtype=dtype), _r(rng, B, hkv, S, D, dtype=dtype)]


@pytest.fixture(params=["cpu", "cpu-unfused", "gpu", "gpu-row-blocks"])
def kernels(request, monkeypatch):
    """Which attention kernels run: the CPU ones (their softmax passes fused in Numba loops, or
    "cpu-unfused": as NumPy array operations, which other dtypes get), or the GPU versions (whole
    tiles in a few array operations), here on NumPy: a GPU worker runs the same code on CuPy;
    "gpu-row-blocks": with a causal mask, in blocks of 3 rows (of 256 on a GPU), each against
    the keys it sees."""
    if request.param == "cpu-unfused":
        import tilegraph.ops.attention as attention

        monkeypatch.setattr(attention, "one_pass", lambda xp, dtype: False)
    elif request.param != "cpu":
        for name in ("sdpa_fwd", "sdpa_bwd_dq", "sdpa_bwd_dkv", "sdpa_bwd"):
            k = get_kernel(name)
            assert k.gpu is not None, name
            monkeypatch.setattr(k, "fn", k.gpu)  # what the local scheduler's CPU tasks call
    if request.param == "gpu-row-blocks":
        import tilegraph.ops.attention as attention

        monkeypatch.setattr(attention, "_GPU_CAUSAL_ROWS", 3)
    return request.param


# --------------------------------------------------------------------------------------- sdpa ----
@params
@dtypes
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 2])
def test_sdpa(rng, mode, dtype, causal, hkv, kernels):
    # T = 15 tiles evenly (3 x 5); 13 gives a ragged last tile of one row
    T = 15 if mode == "even" else 13
    check_against_torch(lambda q, k, v: sdpa(q, k, v, is_causal=causal),
                        lambda q, k, v: torch_sdpa(q, k, v, causal), _qkv(rng, dtype, hkv=hkv, T=T, S=T),
                        "bhtD,bgtD,bgtD", mode)


@params
@dtypes
def test_sdpa_cross_lengths_and_scale(rng, mode, dtype, kernels):
    # non-causal with fewer keys than queries and their own tiling, GQA 4 -> 1
    arrays = _qkv(rng, dtype, hkv=1, T=13, S=7)
    check_against_torch(lambda q, k, v: sdpa(q, k, v, is_causal=False, scale=0.3),
                        lambda q, k, v: torch_sdpa(q, k, v, False, scale=0.3), arrays, "bhtD,bgsD,bgsD", mode)


@dtypes
@pytest.mark.parametrize("q_tiles,kv_tiles", [((5, 5, 3), (4, 4, 4, 1)), ((1, 12), (13,)), ((13,), (3, 10))])
def test_sdpa_causal_with_different_query_and_key_tiles(rng, dtype, q_tiles, kv_tiles, kernels):
    q, k, v = _qkv(rng, dtype, H=6, hkv=3)
    tq = tg.from_numpy(q, (1, (4, 2), q_tiles, None))
    tk, tv = (tg.from_numpy(a, (1, (1, 2), kv_tiles, None)) for a in (k, v))
    out = sdpa(tq, tk, tv, is_causal=True)
    r = _r(rng, *out.shape, dtype=dtype)
    grads = tg.grad((out * tg.from_numpy(r, out.chunks)).sum(), [tq, tk, tv])
    got = tg.compute(out, *grads)
    refs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    ref = torch_sdpa(*refs)
    (ref * torch.tensor(r)).sum().backward()
    rtol, atol = TOL[np.dtype(dtype)]
    for g, w in zip(got, [ref] + [t.grad for t in refs]):
        w = w.detach().numpy()
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * max(np.abs(w).max(), 1.0))


@pytest.mark.parametrize("mode", ["single", "ragged"])
@dtypes
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block,group_bytes,T", [(None, None, 150), (4, 1, 30), (7, 2000, 23), (7, 600, 23)])
def test_sdpa_row_blocks_and_head_groups_inside_a_tile(rng, monkeypatch, mode, dtype, causal, block, group_bytes, T):
    # The kernels cut a tile into row blocks and (batch x head) groups: the default sizes (T = 150
    # in one tile gives blocks of 64, 64 and 22), one head per group with tiny blocks, and blocks
    # of 7 that divide neither the tiles (10, 10, 3) nor the sequence, a few heads per group, and
    # a forward whose key tiles split into several score buffers (600 bytes: online rescaling).
    import tilegraph.ops.attention as attention

    if block is not None:
        monkeypatch.setattr(attention, "_BLOCK", block)
        monkeypatch.setattr(attention, "_GROUP_BYTES", group_bytes)
    check_against_torch(lambda q, k, v: sdpa(q, k, v, is_causal=causal),
                        lambda q, k, v: torch_sdpa(q, k, v, causal),
                        _qkv(rng, dtype, B=2, H=4, hkv=2, T=T, S=T, D=8), "bhtD,bgtD,bgtD", mode)


@pytest.mark.parametrize("mode", ["single", "ragged"])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_gpu_kernels_in_head_chunks(rng, monkeypatch, mode, causal):
    # score blocks over the budget: the GPU kernels cut the (batch x head) pairs into chunks (here
    # one pair each)
    import tilegraph.ops.attention as attention

    for name in ("sdpa_fwd", "sdpa_bwd_dq", "sdpa_bwd_dkv", "sdpa_bwd"):
        monkeypatch.setattr(get_kernel(name), "fn", get_kernel(name).gpu)
    monkeypatch.setattr(attention, "_GPU_SCORE_BYTES", 1)
    check_against_torch(lambda q, k, v: sdpa(q, k, v, is_causal=causal), lambda q, k, v: torch_sdpa(q, k, v, causal),
                        _qkv(np.random.default_rng(1), np.float64, T=23, S=23), "bhtD,bgtD,bgtD", mode)


def _kernels(tensors):
    roots = [r for t in tensors for r in t.grid.flat]
    return [n for n in topo_order(roots) if not n.is_leaf]


@dtypes
def test_fused_softmax_passes_against_numpy(rng, dtype):
    # The CPU kernels' one-pass loops on blocks the sdpa tests rarely make: a score buffer of
    # three key tiles (no mask, a causal one, one a row sees only from row 4 on), rows that see
    # no key at all (lim < -1: all 0, max -inf), and the transposed dK/dV block
    from tilegraph.ops import _attention_cpu as fa

    def visible(rows, width, lim):  # (rows, width): row r sees j <= r + lim
        return np.arange(width)[None, :] <= np.arange(rows)[:, None] + lim

    rtol = 1e-6 if dtype == np.float32 else 1e-13
    g, rows = 3, 7
    widths, lims = [5, 9, 4], [fa.NO_MASK, 2, -5]
    s0 = _r(rng, g, rows, sum(widths), dtype=dtype)
    seen = np.concatenate([visible(rows, w, lim) for w, lim in zip(widths, lims)], axis=1)
    s, m, l = s0.copy(), np.empty((g, rows), dtype), np.empty((g, rows), dtype)
    fa.softmax_rows(s, np.array([0, 5, 14]), np.array(widths), np.array(lims), m, l)
    want_m = np.where(seen, s0, -np.inf).max(axis=-1)
    want_p = np.where(seen, np.exp(s0 - want_m[..., None]), 0)
    np.testing.assert_array_equal(m, want_m)
    np.testing.assert_allclose(s, want_p, rtol=rtol, atol=0)
    np.testing.assert_allclose(l, want_p.sum(axis=-1), rtol=rtol)
    # all keys of the last entry hidden from every row, and a row that sees nothing anywhere
    s = s0[:, :, 14:].copy()
    fa.softmax_rows(s, np.array([0]), np.array([4]), np.array([-8]), m, l)
    assert (s == 0).all() and (m == -np.inf).all() and (l == 0).all()

    lse, delta = _r(rng, g, rows, dtype=dtype) + 3, _r(rng, g, rows, dtype=dtype)
    for lim in (fa.NO_MASK, 1, -3):
        sp, dp = s0[..., :9].copy(), _r(rng, g, rows, 9, dtype=dtype)
        want = np.where(visible(rows, 9, lim), np.exp(sp - lse[..., None]) * (dp - delta[..., None]), 0)
        fa.probs_rows(sp, dp, lse, delta, lim)
        np.testing.assert_allclose(dp, want, rtol=rtol, atol=1e-7 if dtype == np.float32 else 1e-15)
    cols = 9  # (keys x queries): key row r is seen by the queries j >= r + lim
    lse_c, delta_c = _r(rng, g, cols, dtype=dtype) + 3, _r(rng, g, cols, dtype=dtype)
    for lim in (fa.NO_MASK, 2, -4):
        seen_by = np.ones((rows, cols), bool) if lim == fa.NO_MASK else \
            np.arange(cols)[None, :] >= np.arange(rows)[:, None] + lim
        sp, dp = s0[..., :cols].copy(), _r(rng, g, rows, cols, dtype=dtype)
        want_p = np.where(seen_by, np.exp(sp - lse_c[:, None]), 0)
        want_ds = want_p * (dp - delta_c[:, None])
        fa.probs_cols(sp, dp, lse_c, delta_c, lim)
        np.testing.assert_allclose(sp, want_p, rtol=rtol, atol=1e-7 if dtype == np.float32 else 1e-15)
        np.testing.assert_allclose(dp, want_ds, rtol=rtol, atol=1e-7 if dtype == np.float32 else 1e-15)


@pytest.mark.parametrize("n", [1, 3, 4])
def test_sdpa_structure_never_materialises_t_by_t(rng, n):
    B, H, T, D = 2, 4, 13, 8
    q, k, v = _qkv(rng, np.float64, B=B, H=H, hkv=2, T=T, S=T, D=D)
    chunks = tuple(np.diff(np.linspace(0, T, n + 1).round().astype(int)))
    tq, tk, tv = (tg.from_numpy(a, (None, None, chunks, None)) for a in (q, k, v))
    out = sdpa(tq, tk, tv, is_causal=True)
    assert tg.compile([out]).n_nodes == n  # one forward kernel per query tile
    fwd = _kernels([out])
    # causal: query tile i reads key tiles 0..i only (a k and a v tile each)
    assert sorted(len(node.inputs) for node in fwd) == [1 + 2 * (i + 1) for i in range(n)]

    dq, dk, dv = tg.grad((out * tg.from_numpy(_r(rng, *out.shape), out.chunks)).sum(), [tq, tk, tv])
    nodes = _kernels([out, dq, dk, dv])
    by_name = {}
    for node in nodes:
        by_name[node.kernel.name] = by_name.get(node.kernel.name, 0) + 1
    # one tile along T: the whole backward of a tile pair is one task (_sdpa_bwd)
    want = {"sdpa_fwd": 1, "sdpa_bwd": 1} if n == 1 else {
        "sdpa_fwd": n, "sdpa_bwd_delta": n, "sdpa_bwd_dq": n, "sdpa_bwd_dkv": n}
    assert {name: by_name[name] for name in by_name if name.startswith("sdpa")} == want
    if n > 1:  # no tile anywhere in forward or backward spans the whole sequence
        for node in nodes:
            shapes = [r.shape for r in node.inputs] + [m[0] for m in node.out_meta]
            assert all(T not in s for s in shapes), f"{node} touches a tile with a full T dim: {shapes}"


# --------------------------------------------------------------------------------------- rope ----
def torch_rope(x, base=10000.0, position_offset=0):
    """Hugging Face Llama's rotary embedding: inv_freq, cos/sin tables, apply_rotary_pos_emb."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(position_offset, position_offset + x.shape[-2], dtype=torch.float64)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rotate_half(t):
        t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
        return torch.cat((-t2, t1), dim=-1)

    return x * cos + rotate_half(x) * sin


@params
@dtypes
@pytest.mark.parametrize("offset", [0, 5])
def test_rope(rng, mode, dtype, offset):
    x = _r(rng, 2, 4, 13, 8, dtype=dtype) * 2
    check_against_torch(lambda x: rope(x, position_offset=offset), lambda x: torch_rope(x, position_offset=offset),
                        [x], "bhtD", mode)
    check_against_torch(lambda x: rope(x, base=500.0, position_offset=offset),
                        lambda x: torch_rope(x, base=500.0, position_offset=offset), [x], "bhtD", mode)


# ---------------------------------------------------------------------------------- bad input ----
def _t(rng, shape, tiles=None, dtype=np.float64):
    return tg.from_numpy(_r(rng, *shape, dtype=dtype), tiles)


def test_sdpa_bad_inputs(rng):
    q, kv = _t(rng, (2, 4, 6, 8)), _t(rng, (2, 2, 6, 8))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.scaled_dot_product_attention\] the head dim D of q"):
        sdpa(_t(rng, (2, 4, 6, 8), (None, None, None, 4)), kv, kv)
    with pytest.raises(tg.TileError, match="the head dim D of k must be a single tile"):
        sdpa(q, _t(rng, (2, 2, 6, 8), (None, None, 3, 4)), kv)
    with pytest.raises(tg.TileError, match="must divide the query head count"):
        sdpa(q, _t(rng, (2, 3, 6, 8)), _t(rng, (2, 3, 6, 8)))
    with pytest.raises(tg.TileError, match=r"causal attention needs as many keys as queries.*T=6, S=5"):
        sdpa(q, _t(rng, (2, 2, 5, 8)), _t(rng, (2, 2, 5, 8)), is_causal=True)
    with pytest.raises(tg.TileError, match="inputs must share one dtype"):
        sdpa(q, _t(rng, (2, 2, 6, 8), dtype=np.float32), kv)
    with pytest.raises(tg.TileError, match="k and v must have the same shape"):
        sdpa(q, kv, _t(rng, (2, 2, 6, 4)))
    with pytest.raises(tg.TileError, match="k/v must be"):
        sdpa(q, _t(rng, (2, 2, 6, 4)), _t(rng, (2, 2, 6, 4)))
    with pytest.raises(tg.TileError, match="k and v must have the same tiles"):
        sdpa(q, kv, _t(rng, (2, 2, 6, 8), (None, None, 3, None)))
    with pytest.raises(tg.TileError, match="the batch dim of q and k/v must have the same tiles"):
        sdpa(q, _t(rng, (2, 2, 6, 8), (1, None, None, None)), _t(rng, (2, 2, 6, 8), (1, None, None, None)))
    with pytest.raises(tg.TileError, match="must have 4 dims"):
        sdpa(_t(rng, (4, 6, 8)), kv, kv)


def test_rope_bad_inputs(rng):
    with pytest.raises(tg.TileError, match=r"\[tilegraph.rope\] the head dim D must be even.*D=7"):
        rope(_t(rng, (1, 2, 5, 7)))
    with pytest.raises(tg.TileError, match="the head dim D must be a single tile"):
        rope(_t(rng, (1, 2, 5, 8), (None, None, None, 4)))
    with pytest.raises(tg.TileError, match="must have 4 dims"):
        rope(_t(rng, (2, 5, 8)))
    with pytest.raises(tg.TileError, match="position_offset must be a non-negative integer"):
        rope(_t(rng, (1, 2, 5, 8)), position_offset=-1)
