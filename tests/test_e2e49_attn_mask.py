"""scaled_dot_product_attention with torch's attn_mask: a bool mask (True where a query attends to
a key) or a float one added to the scores, broadcast to (B, H, T, S), a NumPy array or a
TileTensor, alone or with is_causal; a query that attends to no key gives zeros. Compared with
torch's SDPA, forward and gradients, on single, even and ragged tilings. It was refused
("attn_mask is not supported"), so an encoder with padding had to write attention by hand."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for

torch = pytest.importorskip("torch")
F = torch.nn.functional
sdpa = tg.ops.scaled_dot_product_attention

B, H, T, S, D = 2, 3, 7, 7, 4


def _qkv(rng, dtype, t=T, s=S):
    return randn(rng, B, H, t, D, dtype=dtype), randn(rng, B, H, s, D, dtype=dtype), randn(rng, B, H, s, D, dtype=dtype)


def _padding(lengths, s=S):
    """(B, 1, 1, S) bool: the first lengths[b] keys of row b are real tokens."""
    return (np.arange(s)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]


@by_mode
@by_dtype
def test_a_padding_mask_matches_torch(mode, dtype, rng):
    q, k, v = _qkv(rng, dtype)
    mask = _padding([S, 4])
    check_against_torch(lambda q, k, v: sdpa(q, k, v, attn_mask=mask),
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask)),
                        [q, k, v], "bhtD,bhsD,bhsD", mode)


@by_mode
def test_a_float_mask_as_a_tile_tensor_matches_torch_with_its_gradient(mode, rng):
    """An additive (T, S) bias with -inf entries, a TileTensor whose gradient is asked for too."""
    q, k, v = _qkv(rng, np.float64)
    bias = randn(rng, T, S)
    bias[1, 2] = bias[4, :3] = -np.inf
    check_against_torch(lambda q, k, v, m: sdpa(q, k, v, m),
                        lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m),
                        [q, k, v, bias], "bhtD,bhsD,bhsD,ts", mode)


@by_mode
def test_a_row_that_attends_to_nothing_gives_zeros_as_torch(mode, rng):
    q, k, v = _qkv(rng, np.float64)
    mask = rng.random((B, H, T, S)) < 0.6
    mask[0, 1, 2, :] = False   # a bool row with no key
    out = check_against_torch(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m),
                              lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                              [q, k, v, mask], "bhtD,bhsD,bhsD,bhts", mode)
    assert np.all(out.numpy()[0, 1, 2] == 0)
    bias = np.zeros((T, S))
    bias[3] = -np.inf           # a float row of -inf
    check_against_torch(lambda q, k, v: sdpa(q, k, v, attn_mask=bias),
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(bias)),
                        [q, k, v], "bhtD,bhsD,bhsD", mode)


@by_mode
def test_a_mask_with_is_causal_applies_both_as_torch(mode, rng):
    q, k, v = _qkv(rng, np.float32)
    mask = _padding([S, 5])
    check_against_torch(lambda q, k, v: sdpa(q, k, v, attn_mask=mask, is_causal=True),
                        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask),
                                                                       is_causal=True),
                        [q, k, v], "bhtD,bhsD,bhsD", mode)


def test_a_mask_with_is_causal_and_q_offset(rng):
    """New positions against a cache of 3 before them: query t sees keys 0..3 + t, and the mask."""
    q, k, v = _qkv(rng, np.float64, t=4, s=7)
    mask = _padding([7, 6], s=7)
    got = sdpa(tg.from_numpy(q, (1, 2, 3, None)), tg.from_numpy(k, (1, 2, 4, None)), tg.from_numpy(v, (1, 2, 4, None)),
               attn_mask=mask, is_causal=True, q_offset=3).numpy()
    causal = np.arange(7)[None, :] <= 3 + np.arange(4)[:, None]
    want = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)),
                                          attn_mask=torch.from_numpy(mask & causal)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_tile_tensor_mask_of_other_tiles_and_key_tiles_apart_from_query_tiles(rng):
    """A bool TileTensor mask tiled unlike the scores is cut to their tiles; T and S apart."""
    q, k, v = _qkv(rng, np.float64, t=5, s=9)
    mask = rng.random((B, 1, 5, 9)) < 0.7
    mask[..., 0] = True
    got = sdpa(tg.from_numpy(q, (1, 2, 2, None)), tg.from_numpy(k, (1, 1, 4, None)), tg.from_numpy(v, (1, 1, 4, None)),
               attn_mask=tg.from_numpy(mask, (2, 1, 3, 5))).numpy()
    want = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)), attn_mask=torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_masked_encoder_trains_as_torch(rng):
    """A TrainStep over attention with a padding mask given as an input of the step."""
    x = randn(rng, B, T, 6, dtype=np.float32)
    lengths = [T, 3]
    w = randn(rng, 6, 3 * 6, dtype=np.float32) * 0.3

    class Enc(tg.nn.Module):
        def __init__(self):
            self.w = tg.nn.Parameter(w.copy(), tiles=(None, 6))

        def forward(self, x, mask):
            qkv = tg.matmul(x, self.w)
            q, k, v = (qkv[:, :, i * 6:(i + 1) * 6].reshape(B, T, 2, 3).transpose(1, 2) for i in range(3))
            return sdpa(q, k, v, attn_mask=mask).sum()

    m = Enc()
    step = tg.TrainStep(m, tg.optim.SGD(m.parameters(), lr=0.1), lambda mm, x, mask: mm(x, mask))
    mask = _padding(lengths)
    tw = torch.tensor(w, requires_grad=True)
    opt = torch.optim.SGD([tw], lr=0.1)
    for _ in range(3):
        qkv = torch.from_numpy(x) @ tw
        q, k, v = (qkv[:, :, i * 6:(i + 1) * 6].reshape(B, T, 2, 3).transpose(1, 2) for i in range(3))
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.from_numpy(mask)).sum()
        opt.zero_grad()
        ref.backward()
        opt.step()
        assert float(step(x, mask)) == pytest.approx(ref.item(), rel=1e-4, abs=1e-4)


@pytest.mark.parametrize("mask, message", [
    (np.ones((T, S), np.int64), "a bool mask .True: attend. or a float one"),
    (np.ones((2, T, S), bool), r"broadcasts to the scores' shape \(B, H, T, S\) = \(2, 3, 7, 7\)"),
    (np.ones((T, S + 1), bool), "broadcasts to the scores' shape"),
    ([[True]], "a TileTensor or a NumPy array"),
    (True, "a positional 4th argument is attn_mask"),
])
def test_bad_masks_are_named(mask, message, rng):
    q, k, v = (tg.from_numpy(a) for a in _qkv(rng, np.float32))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.scaled_dot_product_attention\] .*" + message):
        sdpa(q, k, v, mask)


def test_a_float_tile_mask_of_another_dtype_and_nan_are_refused(rng):
    q, k, v = (tg.from_numpy(a) for a in _qkv(rng, np.float32))
    with pytest.raises(tg.TileError, match=r"a float mask of the scores' dtype, float32.*dtype float64"):
        sdpa(q, k, v, tg.from_numpy(np.zeros((T, S))))
    with pytest.raises(tg.TileError, match="without NaN"):
        sdpa(q, k, v, np.full((T, S), np.nan, np.float32))


# ---------------------------------------------------------------------- tg.nn.SelfAttention ----
def _torch_attention(attn, x, heads, mask=None):
    """torch's same layer from ``attn``'s weights (tilegraph's Linear weights are (in, out))."""
    sd = {k: torch.from_numpy(np.asarray(v)) for k, v in attn.state_dict().items()}
    b, t, c = x.shape

    def lin(name, a):
        return a @ sd[f"{name}.weight"] + sd[f"{name}.bias"]

    def split(a):
        return a.reshape(b, t, heads, c // heads).transpose(1, 2)

    xt = torch.from_numpy(x)
    y = F.scaled_dot_product_attention(split(lin("q", xt)), split(lin("k", xt)), split(lin("v", xt)), attn_mask=mask)
    return lin("o", y.transpose(1, 2).reshape(b, t, c)).numpy()


@by_mode
def test_self_attention_with_a_padding_mask_matches_torch(mode, rng):
    x = randn(rng, B, T, 12)
    attn = tg.nn.SelfAttention(12, 3, tile={"single": None, "even": 4, "ragged": 8}[mode], dtype=np.float64, seed=1)
    lengths = [T, 4]
    padding = np.arange(T)[None, :] < np.asarray(lengths)[:, None]
    xt = tg.from_numpy(x, tiles_for(x.shape, "btc", mode))
    want = _torch_attention(attn, x, 3, torch.from_numpy(padding[:, None, None, :]))
    for given in (padding, padding.astype(np.int64), tg.from_numpy(padding.astype(np.int64), (1, None))):
        np.testing.assert_allclose(attn(xt, padding_mask=given).numpy(), want, rtol=1e-10, atol=1e-12)
    # padding changes nothing a real token sees
    x2 = x.copy()
    x2[1, 4:] = 7.0
    got = attn(tg.from_numpy(x2, tiles_for(x.shape, "btc", mode)), padding_mask=padding).numpy()
    np.testing.assert_allclose(got[1, :4], want[1, :4], rtol=1e-10, atol=1e-12)
    # with an attn_mask as well, both apply
    extra = rng.random((T, T)) < 0.8
    np.fill_diagonal(extra, True)
    both = torch.from_numpy(padding[:, None, None, :] & extra)
    np.testing.assert_allclose(attn(xt, attn_mask=extra, padding_mask=padding).numpy(),
                               _torch_attention(attn, x, 3, both), rtol=1e-10, atol=1e-12)
    bias = np.where(extra, 0.5, -np.inf)
    np.testing.assert_allclose(attn(xt, attn_mask=tg.from_numpy(bias), padding_mask=padding).numpy(),
                               _torch_attention(attn, x, 3, torch.from_numpy(np.where(padding[:, None, None, :],
                                                                                      bias, -np.inf))),
                               rtol=1e-10, atol=1e-12)


def test_self_attention_is_bidirectional_by_default_and_causal_when_asked(rng):
    x = randn(rng, B, T, 8)
    enc = tg.nn.SelfAttention(8, 2, dtype=np.float64, seed=3)
    np.testing.assert_allclose(enc(tg.from_numpy(x)).numpy(), _torch_attention(enc, x, 2), rtol=1e-10, atol=1e-12)
    dec = tg.nn.SelfAttention(8, 2, causal=True, dtype=np.float64, seed=3)
    ref = tg.nn.CausalSelfAttention(8, 2, dtype=np.float64, seed=3)
    np.testing.assert_array_equal(dec(tg.from_numpy(x)).numpy(), ref(tg.from_numpy(x)).numpy())


def test_self_attention_trains_with_the_padding_mask_as_a_step_input(rng):
    x = randn(rng, B, T, 8, dtype=np.float32)
    padding = (np.arange(T)[None, :] < np.array([[T], [3]])).astype(np.int64)
    attn = tg.nn.SelfAttention(8, 2, seed=4)
    before = _torch_attention(attn, x, 2, torch.from_numpy(padding[:, None, None, :] != 0))
    step = tg.TrainStep(attn, tg.optim.SGD(attn.parameters(), lr=0.0),
                        lambda m, x, pm: (m(x, padding_mask=pm) * m(x, padding_mask=pm)).mean())
    assert float(step(x, padding)) == pytest.approx(float((before ** 2).mean()), rel=1e-5)


def test_self_attention_bad_arguments_are_named(rng):
    attn = tg.nn.SelfAttention(8, 2, seed=0)
    x = tg.from_numpy(randn(rng, B, T, 8, dtype=np.float32))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.SelfAttention\] padding_mask must be \(B, T\) = "
                                           r"\(2, 7\) bool or 0/1 integers.*received: shape \(2, 6\), dtype bool"):
        attn(x, padding_mask=np.ones((B, T - 1), bool))
    with pytest.raises(tg.TileError, match=r"padding_mask must be .*received: shape \(2, 7\), dtype float64"):
        attn(x, padding_mask=np.ones((B, T)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.SelfAttention\] causal must be a bool"):
        tg.nn.SelfAttention(8, 2, causal="yes")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.SelfAttention\] n_heads must divide dim"):
        tg.nn.SelfAttention(8, 3)
