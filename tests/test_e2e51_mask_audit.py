"""An audit of attention masks against torch: scaled_dot_product_attention's attn_mask and
tg.nn.SelfAttention's attn_mask= with padding_mask=.

- a NaN in a float TileTensor mask made its row zeros (the mask's keep was ``mask > -inf``, False
  for NaN) where torch gives NaN (a NumPy mask with NaN is refused; a TileTensor's values are
  known only when it runs);
- a NumPy float mask is cast to the scores' dtype, but its masked-out entries were decided before
  the cast: -1e9 in float16 (or -1e39 in float32) became -inf in the scores while the key still
  counted, and a row of them gave NaN where torch (mask.to(q.dtype)) gives zeros;
- SelfAttention with a padding_mask combined the attn_mask with it before checking it: an int
  mask became an additive float one (1 added to every score, nothing masked), a list or a torch
  tensor was taken, a wrong shape was NumPy's raw ValueError or an error of tilegraph.logical_and,
  a NumPy float64 mask on a float32 layer with a TileTensor padding mask was refused as a
  TileTensor of another dtype, NaN got through; a TileTensor attn_mask tiled unlike the padding
  mask failed in tilegraph.where ("dim 3 must have the same tiles") where SDPA itself re-tiles;
- CausalSelfAttention(x, mask) (a mask where the cache goes) said only "cache must be a KVCache".
"""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_mode, check_against_torch, randn, tiles_for

torch = pytest.importorskip("torch")
F = torch.nn.functional
sdpa = tg.scaled_dot_product_attention

B, H, T, S, D = 2, 3, 6, 7, 4


def _qkv(rng, dtype, t=T, s=S, hkv=H):
    return randn(rng, B, H, t, D, dtype=dtype), randn(rng, B, hkv, s, D, dtype=dtype), randn(rng, B, hkv, s, D,
                                                                                             dtype=dtype)


# ------------------------------------------------------------------ scaled_dot_product_attention ----
@by_mode
def test_a_nan_in_a_float_tile_tensor_mask_gives_nan_as_torch_not_zeros(mode, rng):
    q, k, v = _qkv(rng, np.float64)
    bias = randn(rng, T, S)
    bias[2, 3] = np.nan
    bias[4, :] = -np.inf                     # a row masked out entirely still gives zeros
    sizes: dict = {}
    tq, tk, tv = (tg.from_numpy(a, tiles_for(a.shape, "bhtD" if a is q else "bhsD", mode, sizes)) for a in (q, k, v))
    got = sdpa(tq, tk, tv, attn_mask=tg.from_numpy(bias, tiles_for(bias.shape, "ts", mode, sizes))).numpy()
    want = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), attn_mask=torch.from_numpy(bias)).numpy()
    assert np.isnan(want[:, :, 2]).all() and np.isnan(got[:, :, 2]).all()      # was zeros
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert np.all(got[:, :, 4] == 0)


@by_mode
def test_a_numpy_float_mask_past_the_dtype_range_masks_out_as_torch(mode, rng):
    """-1e39 is -inf in float32: a row of it gives zeros (was NaN), other rows as torch; gradients."""
    q, k, v = _qkv(rng, np.float32)
    bias = np.zeros((T, S))
    bias[1] = -1e39
    bias[3, :4] = -1e39
    with np.errstate(over="ignore"):
        cast = bias.astype(np.float32)
    out = check_against_torch(lambda q, k, v: sdpa(q, k, v, attn_mask=bias),
                              lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                             attn_mask=torch.from_numpy(cast)),
                              [q, k, v], "bhtD,bhsD,bhsD", mode)
    assert np.all(out.numpy()[:, :, 1] == 0)


def test_a_float16_query_with_a_minus_1e9_padding_bias(rng):
    """The usual additive padding mask (0 / -1e9, float64) on float16 q: the padded rows give zeros."""
    q, k, v = _qkv(rng, np.float16, s=T)
    lengths = np.array([T, 0])                # the second sequence is all padding
    bias = np.where(np.arange(T)[None, :] < lengths[:, None], 0.0, -1e9)[:, None, None, :]
    got = sdpa(*(tg.from_numpy(a, (1, 2, 4, None)) for a in (q, k, v)), attn_mask=bias).numpy()
    with np.errstate(over="ignore"):
        cast = bias.astype(np.float16)
    want = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), attn_mask=torch.from_numpy(cast)).numpy()
    assert not np.isnan(got).any()
    assert np.all(got[1] == 0)
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------------- tg.nn.SelfAttention ----
C, HEADS = 12, 3


def _torch_layer(attn, x, mask, heads, kv_heads):
    """torch's SelfAttention from ``attn``'s weights, with the whole (B, H, T, T) ``mask``."""
    sd = {name: torch.tensor(np.asarray(w), requires_grad=False) for name, w in attn.state_dict().items()}
    b, t, c = x.shape
    hd = c // heads

    def lin(name, a):
        return a @ sd[f"{name}.weight"] + sd[f"{name}.bias"]

    def split(a, n):
        return a.reshape(b, t, n, hd).transpose(1, 2)

    y = F.scaled_dot_product_attention(split(lin("q", x), heads), split(lin("k", x), kv_heads),
                                       split(lin("v", x), kv_heads), attn_mask=mask, enable_gqa=kv_heads != heads)
    return lin("o", y.transpose(1, 2).reshape(b, t, c))


@by_mode
@pytest.mark.parametrize("kinds", ["tile mask, numpy padding", "numpy mask, tile padding", "both tiles"])
def test_self_attention_combines_masks_of_any_tiles_as_torch(mode, kinds, rng):
    """Grouped heads, causal, a float (H, T, T) bias with -inf and a padding mask, tiled unlike each
    other and x: forward and the gradients of x and of the bias as torch's."""
    attn = tg.nn.SelfAttention(C, HEADS, 1, causal=True, dtype=np.float64, seed=2,
                               tile={"single": None, "even": 4, "ragged": 8}[mode])
    x = randn(rng, B, T, C)
    bias = randn(rng, HEADS, T, T)
    bias[0, 2, :] = -np.inf
    padding = np.array([[1] * T, [1, 1, 1, 1, 0, 0]])
    xt = tg.from_numpy(x, tiles_for(x.shape, "btc", mode))
    other = {"single": None, "even": 2, "ragged": 4}[mode]
    bt = tg.from_numpy(bias, (1, other, 5 if mode != "single" else None))
    pt = tg.from_numpy(padding, (1, 4 if mode != "single" else None))
    am, pm = {"tile mask, numpy padding": (bt, padding), "numpy mask, tile padding": (bias, pt),
              "both tiles": (bt, pt)}[kinds]
    out = attn(xt, attn_mask=am, padding_mask=pm)
    r = rng.standard_normal(out.shape)
    wrt = [xt] + ([am] if isinstance(am, tg.TileTensor) else [])
    got = tg.compute(out, *tg.grad((out * tg.from_numpy(r, out.chunks)).sum(), wrt))

    x_ref, b_ref = torch.tensor(x, requires_grad=True), torch.tensor(bias, requires_grad=True)
    keep = torch.from_numpy(padding[:, None, None, :] != 0) & torch.ones(T, T, dtype=torch.bool).tril()
    want = _torch_layer(attn, x_ref, torch.where(keep, b_ref, -torch.inf), HEADS, 1)
    (want * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(got[0], want.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got[1], x_ref.grad.numpy(), rtol=1e-10, atol=1e-12)
    if len(got) > 2:
        np.testing.assert_allclose(got[2], b_ref.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_self_attention_a_numpy_float64_mask_with_a_tile_padding_mask_on_a_float32_layer(rng):
    """Taken as without the padding mask (a NumPy mask is cast to the scores' dtype); was refused
    as 'a float mask of the scores' dtype, float32 (cast it: mask.to(...))'."""
    attn = tg.nn.SelfAttention(C, HEADS, seed=0)
    x = randn(rng, B, T, C, dtype=np.float32)
    bias = np.where(rng.random((T, T)) < 0.8, 0.25, -np.inf)
    np.fill_diagonal(bias, 0.0)
    padding = np.array([[1] * T, [1, 1, 1, 0, 0, 0]])
    got = attn(tg.from_numpy(x), attn_mask=bias, padding_mask=tg.from_numpy(padding)).numpy()
    mask = torch.from_numpy(np.where(padding[:, None, None, :] != 0, bias, -np.inf).astype(np.float32))
    want = _torch_layer(attn, torch.from_numpy(x), mask, HEADS, HEADS).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


_PADDING = np.array([[1] * T, [1, 1, 1, 1, 0, 0]])


@pytest.mark.parametrize("mask, message", [
    # was taken: 1 added to every score, nothing masked
    (np.ones((T, T), np.int64), r"attn_mask must be a bool mask \(True: attend\) or a float one.*dtype int64"),
    (lambda: tg.from_numpy(np.ones((T, T), np.int64)), r"a bool mask .*received: attn_mask of shape \(6, 6\) and "
                                                        r"dtype int64"),
    ([[True] * T] * T, "attn_mask must be a TileTensor or a NumPy array.*received: list"),        # was taken
    (lambda: torch.ones(T, T, dtype=torch.bool), "a TileTensor or a NumPy array.*received: Tensor"),  # was taken
    # was NumPy's "operands could not be broadcast together"
    (np.ones((T, T + 1), bool), r"broadcasts to the scores' shape \(B, H, T, S\) = \(2, 3, 6, 6\); received: "
                                r"attn_mask of shape \(6, 7\) and dtype bool, for 3 heads and x of \(B, T\) = \(2, 6\)"),
    (np.zeros((T, T + 1)), r"broadcasts to the scores' shape .*attn_mask of shape \(6, 7\) and dtype float64"),
    # was an error of tilegraph.logical_and
    (lambda: tg.from_numpy(np.ones((T, T + 1), bool)), r"broadcasts to the scores' shape .*shape \(6, 7\)"),
    (np.full((T, T), np.nan, np.float32), "without NaN"),                                          # was taken
])
@pytest.mark.parametrize("tile_padding", [False, True])
def test_self_attention_checks_attn_mask_with_a_padding_mask_as_without(mask, message, tile_padding, rng):
    attn = tg.nn.SelfAttention(C, HEADS, seed=0)
    x = tg.from_numpy(randn(rng, B, T, C, dtype=np.float32))
    mask = mask() if callable(mask) else mask
    padding = tg.from_numpy(_PADDING) if tile_padding else _PADDING
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.SelfAttention\] .*" + message):
        attn(x, attn_mask=mask, padding_mask=padding)


def test_a_mask_given_to_causal_self_attention_points_to_self_attention(rng):
    attn = tg.nn.CausalSelfAttention(C, HEADS, seed=0)
    x = tg.from_numpy(randn(rng, B, T, C, dtype=np.float32))
    for mask in (np.ones((T, T), bool), tg.from_numpy(np.ones((T, T), bool))):
        with pytest.raises(tg.TileError, match=r"cache must be a tilegraph.nn.KVCache or None \(it takes no mask: "
                                               r"tg.nn.SelfAttention\(dim, heads, causal=True\) takes attn_mask=.*"
                                               r"received: \w+ of shape \(6, 6\)"):
            attn(x, mask)
