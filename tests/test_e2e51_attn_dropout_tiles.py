"""Attention dropout inside the attention kernels on every tiling. Session 50 dropped the weights
inside the kernels only where the queries and the keys are one tile each along T and S; any other
tiling (a sequence cut into tiles, as ModelTiling does past 1,024 positions, or as a user does to
save memory) took the composed ops, which form the (B, H, T, S) scores as tiles: memory growing
with T * S, the very thing the kernels avoid. Now the forward, dQ and dK/dV kernels take the same
dropout factors with the key and query offsets of their tiles: the same mask as the composed
path, element for element, on single, even and ragged tilings, key tiles unlike the query tiles,
grouped heads, a causal mask, and queries after a KV cache (q_offset). (Their GPU versions:
test_e2e50_dropout's emulated GPU worker test, on tiled sequences too.)"""

import numpy as np
import pytest

import tilegraph as tg
from conftest import randn
from tilegraph._graph import topo_order
from tilegraph.ops import attention as attention_ops
from tilegraph.ops.attention_masked import masked_attention
from tilegraph.ops.dropout import keep_mask, step_seed, _scope_seed

torch = pytest.importorskip("torch")
sdpa = tg.ops.scaled_dot_product_attention

B, H, T, D = 2, 4, 11, 4


def _kernels(*ts) -> set:
    return {n.kernel.name for n in topo_order([x for t in ts for x in t.grid.flat]) if not n.is_leaf}


def _first_tile(t: tg.TileTensor) -> np.ndarray:
    return t.numpy()[tuple(slice(0, c[0]) for c in t.chunks)]


def _torch_reference(q, k, v, r, keep, p, causal, q_offset):
    """Output and the gradients of sum(out * r) by torch autograd, the given keep mask (B, H, T, S)
    on the weights, k and v repeated to q's heads."""
    q, k, v = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ kr.transpose(-1, -2) / np.sqrt(q.shape[-1])
    if causal:
        t, s = scores.shape[-2:]
        seen = torch.arange(s)[None, :] <= torch.arange(t)[:, None] + q_offset
        scores = scores.masked_fill(~seen, -torch.inf)
    out = (torch.softmax(scores, -1) * torch.from_numpy(keep) / (1 - p)) @ vr
    (out * torch.from_numpy(r)).sum().backward()
    return [out.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()]


TILINGS = {  # (q's T tile, k's S tile, q's head tile, k's head tile)
    "single": (None, None, None, None),
    "even T and S": (4, 4, None, None),
    "ragged T, other S": (4, 3, None, None),
    "ragged, heads tiled": (5, 6, 2, 2),
    "grouped, heads unpaired": (4, 5, 1, 1),
}


@pytest.mark.parametrize("tiles", TILINGS)
@pytest.mark.parametrize("causal,q_offset", [(True, 0), (False, 0), (True, 3)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_dropout_in_the_kernels_on_every_tiling_matches_torch(tiles, causal, q_offset, dtype, rng):
    tq, ts, hq, hk = tiles_ = TILINGS[tiles]
    kv_heads = 2 if tiles.startswith("grouped") else H
    S = T + q_offset
    p = 0.3
    q, r = randn(rng, B, H, T, D, dtype=dtype), randn(rng, B, H, T, D, dtype=dtype)
    k, v = randn(rng, B, kv_heads, S, D, dtype=dtype), randn(rng, B, kv_heads, S, D, dtype=dtype)
    qt, rt = (tg.from_numpy(a, (1, hq, tq, None)) for a in (q, r))
    kt, vt = (tg.from_numpy(a, (1, hk, ts, None)) for a in (k, v))
    out = sdpa(qt, kt, vt, dropout_p=p, is_causal=causal, q_offset=q_offset)
    grads = tg.grad((out * rt).sum(), [qt, kt, vt])
    # inside the kernels: no score tile, no softmax or dropout op
    assert not {"softmax", "dropout", "matmul"} & _kernels(out, *grads), _kernels(out, *grads)
    got = tg.compute(out, *grads)
    seed = step_seed(_scope_seed("attention_dropout"), _first_tile(qt), _first_tile(kt))
    keep = keep_mask(seed, (B, H, T, S), p)
    assert 0 < keep.mean() < 1
    want = _torch_reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                            r.astype(np.float64), keep, p, causal, q_offset)
    rtol, atol = (1e-10, 1e-12) if dtype == np.float64 else (2e-4, 2e-5)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * max(1.0, np.abs(w).max()), err_msg=f"{tiles}: {name}")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tiles", ["single", "ragged T, other S", "grouped, heads unpaired"])
def test_the_kernels_drop_what_the_composed_ops_drop_on_the_same_tiles(monkeypatch, fused, tiles, rng):
    """The composed path (what a mask takes) on the same tiles: the same values and gradients,
    with the one-tile backward in one kernel (fused) or in the dQ and dK/dV kernels."""
    monkeypatch.setattr(attention_ops, "_FUSED_BACKWARD", fused)
    tq, ts, hq, hk = TILINGS[tiles]
    kv_heads = 2 if tiles.startswith("grouped") else H
    q, r = randn(rng, B, H, T, D), randn(rng, B, H, T, D)
    k, v = randn(rng, B, kv_heads, T, D), randn(rng, B, kv_heads, T, D)
    qt, rt = (tg.from_numpy(a, (1, hq, tq, None)) for a in (q, r))
    kt, vt = (tg.from_numpy(a, (1, hk, ts, None)) for a in (k, v))

    def run(fn):
        out = fn()
        return _kernels(out), tg.compute(out, *tg.grad((out * rt).sum(), [qt, kt, vt]))

    names, got = run(lambda: sdpa(qt, kt, vt, dropout_p=0.2, is_causal=True))
    composed_names, want = run(lambda: masked_attention(qt, kt, vt, None, causal=True, scale=1 / np.sqrt(D),
                                                        dropout_p=0.2))
    assert "dropout" in composed_names and "dropout" not in names
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-12)


def test_a_sequence_in_tiles_with_dropout_takes_the_memory_of_one_without(rng):
    """Peak bytes of a forward and backward, the sequence in 4 tiles: with dropout inside the
    kernels as without dropout (the seed's 8 bytes apart); the composed ops formed the (B, H, T, S)
    scores and weights as tiles, and held more than those bytes again."""
    from tilegraph._graph import peak_live_bytes

    t = 128
    q, k, v, r = (randn(rng, B, H, t, 16) for _ in range(4))
    tiles = (1, None, 32, None)

    def peak(fn):
        qt, kt, vt, rt = (tg.from_numpy(a, tiles) for a in (q, k, v, r))
        grads = tg.grad((fn(qt, kt, vt) * rt).sum(), [qt, kt, vt])
        roots = [x for g in grads for x in g.grid.flat]
        return peak_live_bytes(topo_order(roots), roots)

    without = peak(lambda a, b, c: sdpa(a, b, c, is_causal=True))
    inside = peak(lambda a, b, c: sdpa(a, b, c, dropout_p=0.1, is_causal=True))
    composed = peak(lambda a, b, c: masked_attention(a, b, c, None, causal=True, scale=0.25, dropout_p=0.1))
    assert inside <= without + 64, (inside, without)
    assert composed > without + B * H * t * t * 8, (composed, without)


def test_a_llama_with_its_sequence_in_tiles_drops_inside_the_kernels():
    """A model in training with attention dropout and the sequence in tiles (as ModelTiling
    makes it past 1,024 positions): sdpa kernels, no score tiles (no softmax op)."""
    from tilegraph import models
    from tilegraph.models.tiling import ModelTiling

    cfg = models.LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, hidden=64, max_seq_len=64,
                             attn_dropout=0.1)
    model = models.Llama(cfg, ModelTiling(seq=16, batch=1))
    model.train()
    logits = model(np.random.default_rng(0).integers(0, 64, (2, 48)))
    names = _kernels(logits)
    assert {"sdpa_fwd", "dropout_seed"} <= names and "softmax" not in names, names
