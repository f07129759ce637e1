"""PyTorch names where tilegraph mirrors PyTorch: ``is_causal``, ``keepdim``, ``layer_norm``'s
argument order, ``permute`` / ``view`` / ``reshape``. Each is measured against torch autograd
(forward and gradients) over single, even and ragged tilings; old spellings either keep working
or fail with an error that says what to write, never bind silently to something else."""

import re
import warnings

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for

torch = pytest.importorskip("torch")
F = torch.nn.functional

params, dtypes, _r = by_mode, by_dtype, randn


# ------------------------------------------------------------------------ is_causal (SDPA) ----
def _qkv(rng, dtype, T=13, S=13, H=4, hkv=2):
    return [_r(rng, 2, H, T, 8, dtype=dtype), _r(rng, 2, hkv, S, 8, dtype=dtype), _r(rng, 2, hkv, S, 8, dtype=dtype)]


def _torch_sdpa(q, k, v, **kw):
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), **kw)


@params
@dtypes
@pytest.mark.parametrize("kw", [{}, {"is_causal": False}, {"is_causal": True}], ids=["default", "False", "True"])
def test_sdpa_is_causal_as_torch(rng, mode, dtype, kw):
    # the default is torch's: not causal
    check_against_torch(lambda q, k, v: tg.scaled_dot_product_attention(q, k, v, **kw),
                        lambda q, k, v: _torch_sdpa(q, k, v, **kw), _qkv(rng, dtype), "bhtD,bgtD,bgtD", mode)


@params
def test_sdpa_positional_arguments_bind_as_torch(rng, mode):
    # torch's order (q, k, v, attn_mask, dropout_p, is_causal): nanoGPT's call ports unchanged
    check_against_torch(lambda q, k, v: tg.scaled_dot_product_attention(q, k, v, None, 0.0, True),
                        lambda q, k, v: _torch_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True),
                        _qkv(rng, np.float64), "bhtD,bgtD,bgtD", mode)
    check_against_torch(lambda q, k, v: tg.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0,
                                                                        is_causal=False, scale=0.3),
                        lambda q, k, v: _torch_sdpa(q, k, v, scale=0.3), _qkv(rng, np.float64, S=7),
                        "bhtD,bgsD,bgsD", mode)


def test_sdpa_causal_alias_warns_and_matches_is_causal(rng):
    q, k, v = (tg.from_numpy(a, (1, 2, 5, None)) for a in _qkv(rng, np.float64))
    for flag in (True, False):
        with pytest.warns(DeprecationWarning, match=r"causal=\.\.\.\) is deprecated: use is_causal="):
            old = tg.scaled_dot_product_attention(q, k, v, causal=flag)
        new = tg.scaled_dot_product_attention(q, k, v, is_causal=flag)
        np.testing.assert_array_equal(*tg.compute(old, new))


def test_sdpa_unsupported_or_conflicting_arguments_are_errors(rng):
    q, k, v = (tg.from_numpy(a) for a in _qkv(rng, np.float64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for is_causal in (True, False):  # an explicit False conflicts too, not only a True
            with pytest.raises(tg.TileError, match=r"pass is_causal= or causal= \(the same parameter\), not both; "
                                                   rf"received: is_causal={is_causal}, causal=True"):
                tg.scaled_dot_product_attention(q, k, v, is_causal=is_causal, causal=True)
    # tilegraph's old positional 4th argument (causal) is torch's attn_mask: an error, never a mask
    with pytest.raises(tg.TileError, match=r"a positional 4th argument is attn_mask, as in torch: pass "
                                           r"is_causal=True by name; received: attn_mask=True"):
        tg.scaled_dot_product_attention(q, k, v, True)
    for p in (1.0, -0.1, "0.1", True):  # dropout_p: a probability in [0, 1), as torch's F.dropout's
        with pytest.raises(tg.TileError, match=r"dropout_p must be a number in \[0, 1\) .*; received: "
                                               + re.escape(repr(p))):
            tg.scaled_dot_product_attention(q, k, v, dropout_p=p)
    with pytest.raises(tg.TileError, match=r"is_causal must be a bool; received: 'yes'"):
        tg.scaled_dot_product_attention(q, k, v, is_causal="yes")
    with pytest.raises(TypeError):  # scale is keyword-only, as in torch
        tg.scaled_dot_product_attention(q, k, v, None, 0.0, False, 0.5)


def test_models_stay_causal(rng):
    # the attention layer of GPT-2 and Llama: a later position must not change an earlier output
    attn = tg.nn.CausalSelfAttention(8, 2, tile=4, dtype=np.float64, seed=0)
    x = _r(rng, 1, 6, 8)
    x2 = x.copy()
    x2[:, -1] += 1.0
    a, b = (attn(tg.from_numpy(v, (1, 3, 4))).numpy() for v in (x, x2))
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.allclose(a[:, -1], b[:, -1])


# ---------------------------------------------------------------------------- keepdim ----
@params
@dtypes
@pytest.mark.parametrize("name", ["sum", "mean"])
@pytest.mark.parametrize("dim", [None, 0, 1, -1, (0, 2), [2, 0], ()], ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
def test_reductions_keepdim(rng, mode, dtype, name, dim, keepdim):
    x = _r(rng, 5, 7, 6, dtype=dtype)
    tfn = getattr(torch, name)
    ref = (lambda x: tfn(x, dim, keepdim=keepdim)) if dim is not None else (
        (lambda x: tfn(x, (0, 1, 2), keepdim=keepdim)))
    check_against_torch(lambda x: getattr(tg, name)(x, dim, keepdim=keepdim), ref, [x], "abc", mode)
    # the method, keepdim positional as in torch's x.sum(dim, keepdim)
    check_against_torch(lambda x: getattr(x, name)(dim, keepdim), ref, [x], "abc", mode)


@params
def test_keepdims_is_an_alias_and_both_is_an_error(rng, mode):
    x = _r(rng, 5, 7, 6)
    check_against_torch(lambda x: tg.mean(x, 1, keepdims=True), lambda x: torch.mean(x, 1, keepdims=True),
                        [x], "abc", mode)
    check_against_torch(lambda x: x.sum(-1, keepdims=True), lambda x: x.sum(-1, keepdims=True), [x], "abc", mode)
    t = tg.from_numpy(x)
    for fn, where in ((tg.sum, "sum"), (tg.mean, "mean"), (tg.TileTensor.sum, "sum")):
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.{where}\] pass keepdim= or keepdims= "
                                               r"\(the same parameter\), not both; received: keepdim=False"):
            fn(t, 0, False, keepdims=True)


def test_keepdim_output_tiles(rng):
    t = tg.from_numpy(_r(rng, 5, 7, 6), (2, 3, 6))
    assert t.sum(1, keepdim=True).chunks == ((2, 2, 1), (1,), (6,))
    assert t.mean((0, 2), True).chunks == ((1,), (3, 3, 1), (1,))
    assert t.sum().shape == () and t.sum(keepdim=True).shape == (1, 1, 1)


# --------------------------------------------------------------------------- layer_norm ----
@params
@dtypes
@pytest.mark.parametrize("affine", ["", "w", "wb", "b"])
def test_layer_norm_torch_order(rng, mode, dtype, affine):
    x = _r(rng, 6, 10, 12, dtype=dtype) * 2 + 0.5
    params = [_r(rng, 12, dtype=dtype) for _ in affine]

    def call(fn, x, *p):
        kw = dict(zip(affine, p))
        return fn(x, (12,), kw.get("w"), kw.get("b"), 1e-3)

    check_against_torch(lambda *a: call(tg.layer_norm, *a), lambda *a: call(F.layer_norm, *a), [x, *params],
                        ",".join(["btc"] + ["c"] * len(params)), mode)


@params
@dtypes
def test_layer_norm_normalized_shape_forms(rng, mode, dtype):
    x, w, b = _r(rng, 6, 5, 12, dtype=dtype), _r(rng, 12, dtype=dtype), _r(rng, 12, dtype=dtype)
    # an int, keywords
    check_against_torch(lambda x, w, b: tg.layer_norm(x, 12, weight=w, bias=b, eps=1e-4),
                        lambda x, w, b: F.layer_norm(x, [12], weight=w, bias=b, eps=1e-4), [x, w, b], "btc,c,c", mode)
    # over the last two dims (merged into one, so only the first of them may be tiled)
    w2, b2 = _r(rng, 5, 12, dtype=dtype), _r(rng, 5, 12, dtype=dtype)
    check_against_torch(lambda x, w, b: tg.layer_norm(x, (5, 12), w, b), lambda x, w, b: F.layer_norm(x, (5, 12), w, b),
                        [x, w2, b2], "btC,tC,tC", mode)
    check_against_torch(lambda x: tg.layer_norm(x, (6, 5, 12)), lambda x: F.layer_norm(x, (6, 5, 12)), [x], "bTC",
                        mode)


def test_layer_norm_module_matches_torch(rng):
    x = _r(rng, 3, 7, 12)
    ln = tg.nn.LayerNorm(12, tile=5, dtype=np.float64)
    ln.load_state_dict({"weight": _r(rng, 12), "bias": _r(rng, 12)})
    ref = torch.nn.LayerNorm(12, dtype=torch.float64)
    ref.load_state_dict({k: torch.tensor(v) for k, v in ln.state_dict().items()})
    np.testing.assert_allclose(ln(tg.from_numpy(x, (2, 3, 5))).numpy(), ref(torch.tensor(x)).detach().numpy(),
                               rtol=1e-12, atol=1e-12)


def test_layer_norm_old_order_is_a_clear_error(rng):
    x = tg.from_numpy(_r(rng, 4, 12), (2, 4))
    w, b = (tg.from_numpy(_r(rng, 12), 4) for _ in range(2))
    order = r"\(layer_norm\(x, normalized_shape, weight=None, bias=None, eps=1e-5\), torch's order\)"
    # layer_norm(x, weight, bias) and layer_norm(x, None, bias): the order before torch's
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.layer_norm\] the second argument is normalized_shape "
                                           rf"{order}, not the weight: write layer_norm\(x, \(12,\), weight, bias\); "
                                           r"received: a TileTensor of shape \(12,\) as normalized_shape"):
        tg.layer_norm(x, w, b)
    with pytest.raises(tg.TileError, match=rf"normalized_shape is required {order}; without a weight write "
                                           r"layer_norm\(x, \(12,\), None, bias\); received: None"):
        tg.layer_norm(x, None, b)
    with pytest.raises(TypeError, match="normalized_shape"):
        tg.layer_norm(x, weight=w)
    for bad in ((6,), (4, 13), 12.0, "12", (), (2, 4, 12)):
        with pytest.raises(tg.TileError, match=r"normalized_shape must be the last dim\(s\) of x, e\.g\. \(12,\)"):
            tg.layer_norm(x, bad)
    with pytest.raises(tg.TileError, match=r"weight must have shape \(4, 12\) \(normalized_shape\); received: "
                                           r"weight of shape \(12,\)"):
        tg.layer_norm(x, (4, 12), w)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.layer_norm\] normalising over the last 2 dims \(4, 12\) "
                                           r"merges them into one: reshape is not tile-compatible.*dims \[1\] must "
                                           r"be one tile each"):
        tg.layer_norm(x, (4, 12))


# ------------------------------------------------------------------ permute / view / reshape ----
@params
@dtypes
@pytest.mark.parametrize("dims", [(2, 0, 1), (1, 2, 0), (0, 2, 1), (-1, 0, -2), (0, 1, 2)], ids=str)
def test_permute(rng, mode, dtype, dims):
    x = _r(rng, 5, 7, 6, dtype=dtype)
    check_against_torch(lambda x: x.permute(*dims), lambda x: x.permute(*dims), [x], "abc", mode)
    check_against_torch(lambda x: x.permute(dims) * 2, lambda x: x.permute(dims) * 2, [x], "abc", mode)
    check_against_torch(lambda x: tg.permute(x, dims), lambda x: torch.permute(x, dims), [x], "abc", mode)


@params
@dtypes
@pytest.mark.parametrize("method", ["view", "reshape"])
def test_view_and_reshape(rng, mode, dtype, method):
    x = _r(rng, 6, 5, 12, dtype=dtype)
    # merge the untiled inner dims into the tiled first one; split it back; split whole heads
    for labels, shape in (("bTC", (-1, 12)), ("bTC", (30, 12)), ("bTC", (6, 60)), ("bTC", (-1,)),
                          ("btC", (6, 5, 3, 4)), ("btC", (6, 5, 2, 6)), ("bTC", (6, 1, 5, 12, 1))):
        check_against_torch(lambda x: getattr(x, method)(*shape), lambda x: getattr(x, method)(*shape), [x],
                            labels, mode)
        check_against_torch(lambda x: getattr(x, method)(shape), lambda x: getattr(x, method)(shape), [x],
                            labels, mode)
    # there and back: (6, 5, 12) -> (6, 60) -> (6, 5, 12), with the tiles it started with
    out = check_against_torch(lambda x: getattr(x, method)(6, 60).reshape(6, 5, 12) * 3,
                              lambda x: getattr(x, method)(6, 60).reshape(6, 5, 12) * 3, [x], "bTC", mode)
    assert out.chunks == tg.from_numpy(x, tiles_for(x.shape, "bTC", mode)).chunks


@params
def test_reshape_regroups_whole_rows(rng, mode):
    # (4, 6) -> (8, 3): each row tile of (4, 6) is a contiguous run of whole rows of 3
    x = _r(rng, 4, 6)
    out = check_against_torch(lambda x: x.view(8, 3), lambda x: x.view(8, 3), [x], "aC", mode)
    rows = tg.from_numpy(x, tiles_for(x.shape, "aC", mode)).chunks[0]
    assert out.chunks == (tuple(2 * c for c in rows), (3,))


def test_permute_view_reshape_errors_name_shape_tiling_and_request(rng):
    t = tg.from_numpy(_r(rng, 4, 6), (2, 3))
    tiles = r"a tensor of shape \(4, 6\) with tiles \(\(2, 2\), \(3, 3\)\)"
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.TileTensor.view\] reshape is not tile-compatible: {tiles} "
                                           r"cannot become \(24,\) without moving data between tiles; dims \[0, 1\] "
                                           r".* dims \[1\] must be one tile each; received: shape \(24,\)"):
        t.view(-1)
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.TileTensor.reshape\] reshape is not tile-compatible: "
                                           rf"{tiles} cannot become \(4, 3, 2\).*dims \[1\] \(sizes \(6,\), tiles "
                                           r"\(\(3, 3\),\)\) become dims \[1, 2\] \(sizes \(3, 2\)\): each tile holds "
                                           r"a run of \[3\] elements, which must be whole rows of dims \[2\] "
                                           r"\(multiples of 2\)"):
        t.reshape(4, 3, 2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.reshape\] reshape is not tile-compatible"):
        tg.reshape(t, (3, 8))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.view\] new shape must hold 24 elements "
                                           r"\(the shape is \(4, 6\)\); received: \(5, 5\)"):
        t.view(5, 5)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.view\] cannot infer -1 for a tensor of shape "
                                           r"\(4, 6\)"):
        t.view(-1, 5)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.view\] expected sizes .* a dtype view"):
        t.view(np.float32)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.permute\] expected a permutation of the 2 dims "
                                           r"of a tensor of shape \(4, 6\) \(each dim once\); received: dims \(1, 1\)"):
        t.permute(1, 1)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.permute\] expected a permutation of the 2 dims of a tensor "
                                           r"of shape \(4, 6\); received: dims \(1, 0, 2\)"):
        tg.permute(t, (1, 0, 2))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.permute\] dim out of range for a 2-d tensor"):
        t.permute(0, 2)


def test_layout_ops_are_one_kernel_per_tile(rng):
    t = tg.from_numpy(_r(rng, 6, 5, 12), (4, 5, 12))
    for y in (t.permute(2, 0, 1), t.view(-1, 12), t.reshape(6, 5, 3, 4)):
        assert y.ntiles == t.ntiles == 2
        assert tg.compile([y]).n_nodes == 2
