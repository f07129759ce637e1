"""Softmax, log-softmax, layer norm and RMS norm against torch, with the normalised dim tiled too."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import MODES, TOL, by_dtype, by_mode, check_against_torch, randn, tiles_for
from tilegraph.ops.norm import layer_norm, rms_norm
from tilegraph.ops.reduce import FAN_IN
from tilegraph.ops.softmax import log_softmax, softmax

torch = pytest.importorskip("torch")
F = torch.nn.functional

params, dtypes, _r = by_mode, by_dtype, randn


def _torch_rms_norm(x, w=None, eps=1e-6):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _kernels(*tensors):
    """Kernel calls behind ``tensors`` and the names of their kernels."""
    from tilegraph._graph import topo_order

    nodes = [n for n in topo_order([r for t in tensors for r in t.grid.flat]) if not n.is_leaf]
    assert tg.compile(list(tensors)).n_nodes == len(nodes)
    return len(nodes), {n.kernel.name for n in nodes}


def _backward(y, rng):
    """Run ``y``'s own backward with a leaf cotangent: the gradients without any other op's kernels."""
    g = tg.from_numpy(_r(rng, *y.shape, dtype=y.dtype), y.chunks)
    return y._record.op.backward(y._record.ctx, g)


# ------------------------------------------------------------------------------------ softmax ----
@params
@dtypes
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_softmax(rng, mode, dtype, dim):
    x = _r(rng, 6, 10, 12, dtype=dtype) * 3
    check_against_torch(lambda x: softmax(x, dim), lambda x: torch.softmax(x, dim), [x], "btc", mode)
    check_against_torch(lambda x: log_softmax(x, dim), lambda x: torch.log_softmax(x, dim), [x], "btc", mode)


@pytest.mark.parametrize("log", [False, True])
def test_softmax_over_many_tiles_is_a_tree(rng, log):
    x = _r(rng, 3, 40)
    fn, tfn = (log_softmax, torch.log_softmax) if log else (softmax, torch.softmax)
    t = tg.from_numpy(x, (3, 2))  # 20 tiles per row: 3 partial merges, then a final one
    y = fn(t, 1)
    np.testing.assert_allclose(y.numpy(), tfn(torch.tensor(x), 1).numpy(), rtol=1e-12, atol=1e-12)
    merges = -(-20 // FAN_IN) + 1
    assert _kernels(y) == (20 + merges + 20, {"softmax_stats", "softmax_merge", "softmax_apply"})
    (gx,) = tg.grad((y * y).sum(), [t])
    xt = torch.tensor(x, requires_grad=True)
    (tfn(xt, 1) ** 2).sum().backward()
    np.testing.assert_allclose(gx.numpy(), xt.grad.numpy(), rtol=1e-10, atol=1e-12)


@dtypes
def test_softmax_with_masked_tiles(rng, dtype):
    # a causal mask: whole tiles of a row are -inf, which must not turn the merge into NaN
    x = _r(rng, 2, 9, 9, dtype=dtype)
    x = np.where(np.triu(np.ones((9, 9), bool), 1), -np.inf, x).astype(dtype)
    want = torch.log_softmax(torch.tensor(x), -1).numpy()
    for mode in MODES:
        check_against_torch(lambda x: softmax(x, -1), lambda x: torch.softmax(x, -1), [x], "btc", mode)
        t = tg.from_numpy(x, tiles_for(x.shape, "btc", mode))
        got = log_softmax(t, -1).numpy()
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=TOL[x.dtype][0], atol=1e-6)


def test_softmax_fused_kernel_counts(rng):
    x = tg.from_numpy(_r(rng, 4, 6, 16, dtype=np.float32), (2, 3, None))  # 4 tiles, whole rows
    y = softmax(x, -1)
    assert _kernels(y) == (4, {"softmax"})
    (dx,) = _backward(y, rng)
    assert _kernels(dx) == (8, {"softmax", "softmax_bwd"})
    # split rows: per row group 2 local statistics, ONE merge, 2 normalisations
    x = tg.from_numpy(_r(rng, 4, 16, dtype=np.float32), (2, 8))
    y = softmax(x, -1)
    assert _kernels(y) == (2 * (2 + 1 + 2), {"softmax_stats", "softmax_merge", "softmax_apply"})


# --------------------------------------------------------------------------------- norms ----
AFFINE = {"none": (), "weight": ("w",), "bias": ("b",), "both": ("w", "b")}


@params
@dtypes
@pytest.mark.parametrize("affine", list(AFFINE))
def test_layer_norm(rng, mode, dtype, affine):
    x = _r(rng, 6, 10, 12, dtype=dtype) * 2 + 0.5
    parts = AFFINE[affine]
    w, b = _r(rng, 12, dtype=dtype), _r(rng, 12, dtype=dtype)
    arrays = [x] + [{"w": w, "b": b}[p] for p in parts]

    def ours(x, *p):
        kw = dict(zip(parts, p))
        return layer_norm(x, (12,), kw.get("w"), kw.get("b"))

    def ref(x, *p):
        kw = dict(zip(parts, p))
        return F.layer_norm(x, (12,), kw.get("w"), kw.get("b"))

    check_against_torch(ours, ref, arrays, ",".join(["btc"] + ["c"] * len(parts)), mode)


@params
@dtypes
@pytest.mark.parametrize("weighted", [False, True])
def test_rms_norm(rng, mode, dtype, weighted):
    x = _r(rng, 6, 10, 12, dtype=dtype) * 2 + 0.5
    if weighted:
        w = _r(rng, 12, dtype=dtype)
        check_against_torch(rms_norm, _torch_rms_norm, [x, w], "btc,c", mode)
    else:
        check_against_torch(rms_norm, _torch_rms_norm, [x], "btc", mode)


@pytest.mark.parametrize("center", [True, False])
def test_norm_over_many_tiles_and_eps(rng, center):
    x, w, b = _r(rng, 5, 40) * 0.01, _r(rng, 40), _r(rng, 40)
    if center:
        fn = lambda x, w, b: layer_norm(x, (40,), w, b, eps=1e-3)  # noqa: E731
        tfn = lambda x, w, b: F.layer_norm(x, (40,), w, b, eps=1e-3)  # noqa: E731
        arrays, dims = [x, w, b], "ac,c,c"
    else:
        fn, tfn = (lambda x, w: rms_norm(x, w, eps=1e-3)), (lambda x, w: _torch_rms_norm(x, w, eps=1e-3))
        arrays, dims = [x, w], "ac,c"
    check_against_torch(fn, tfn, arrays, dims, "single")
    ts = [tg.from_numpy(a, (2,) * a.ndim) for a in arrays]  # 20 tiles along the normalised dim
    y = fn(*ts)
    grads = tg.grad((y * y).sum(), ts)
    refs = [torch.tensor(a, requires_grad=True) for a in arrays]
    (tfn(*refs) ** 2).sum().backward()
    got = tg.compute(y, *grads)
    np.testing.assert_allclose(got[0], tfn(*refs).detach().numpy(), rtol=1e-10, atol=1e-12)
    for g, r in zip(got[1:], refs):
        np.testing.assert_allclose(g, r.grad.numpy(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("center", [True, False])
def test_norm_fused_kernel_counts(rng, center):
    x = tg.from_numpy(_r(rng, 4, 6, 16, dtype=np.float32), (2, 3, None))  # 4 tiles, whole rows
    w = tg.from_numpy(_r(rng, 16, dtype=np.float32))
    b = tg.from_numpy(_r(rng, 16, dtype=np.float32)) if center else None
    y = layer_norm(x, (16,), w, b) if center else rms_norm(x, w)
    assert _kernels(y) == (4, {"norm_fwd"})
    dx, dw, db = _backward(y, rng)
    assert _kernels(dx) == (8, {"norm_fwd", "norm_bwd"})
    # dweight and dbias: one kernel sums the 4 row tiles' partials of both
    grads = [dx, dw] + ([db] if center else [])
    assert _kernels(*grads) == (9, {"norm_fwd", "norm_bwd", "norm_sum_groups"})
    # one row tile: forward and backward are one kernel each, the partials are the gradients
    x1 = tg.from_numpy(_r(rng, 8, 16, dtype=np.float32))
    y1 = layer_norm(x1, (16,), w, b) if center else rms_norm(x1, w)
    grads = [g for g in _backward(y1, rng) if g is not None]
    assert _kernels(y1, *grads) == (2, {"norm_fwd", "norm_bwd"})


@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("chunks", [(2, 3, None), (2, 3, 8)], ids=["whole-rows", "split-rows"])
def test_a_frozen_weight_and_bias_get_no_partial_sums(rng, center, chunks):
    """Issue 13 (a LoRA fine-tune's norms are frozen): with weight and bias that need no gradient,
    the backward's kernels make dx alone (no partial dweight/dbias per row tile, no sums of them),
    and dx equals torch autograd's; with the weight trainable and the bias frozen, dweight alone."""
    xs, gs = _r(rng, 4, 6, 16), _r(rng, 4, 6, 16)
    ws, bs = _r(rng, 16) + 1, _r(rng, 16)
    for trainable in ((), ("weight",)):
        x = tg.from_numpy(xs, chunks)
        w = tg.nn.Parameter(ws, chunks[-1], requires_grad="weight" in trainable)
        b = tg.nn.Parameter(bs, chunks[-1], requires_grad=False) if center else None
        y = layer_norm(x, (16,), w, b) if center else rms_norm(x, w)
        loss = (y * tg.from_numpy(gs, chunks)).sum()
        inputs = [x] + ([w] if trainable else [])
        grads = tg.grad(loss, inputs)
        bwd = [n for n in _backward_kernels(loss, grads) if n.kernel.name.startswith("norm_")]
        names = {n.kernel.name for n in bwd}
        assert names <= {"norm_bwd", "norm_bwd_stats", "norm_bwd_apply", "norm_sum_groups"}, names
        assert ("norm_sum_groups" in names) == (bool(trainable) or chunks[-1] is not None), names
        outs = {n.kernel.name: len(n.out_meta) for n in bwd}
        if chunks[-1] is None:  # the fused kernel: dx (and dweight's partial where asked)
            assert outs["norm_bwd"] == 1 + bool(trainable), outs
        else:  # row sums of the split rows (1 or 2), then the partials asked for
            assert outs["norm_bwd_stats"] == 1 + center + bool(trainable), outs
        xt = torch.tensor(xs, requires_grad=True)
        wt = torch.tensor(ws, requires_grad=bool(trainable))
        yt = F.layer_norm(xt, (16,), wt, torch.tensor(bs)) if center else _torch_rms_norm(xt, wt, 1e-6)
        (yt * torch.tensor(gs)).sum().backward()
        got = tg.compute(*grads)
        np.testing.assert_allclose(got[0], xt.grad.numpy(), rtol=1e-9, atol=1e-10)
        if trainable:
            np.testing.assert_allclose(got[1], wt.grad.numpy(), rtol=1e-9, atol=1e-10)


def _backward_kernels(loss, grads) -> list:
    """The kernel calls computing ``grads`` that the forward of ``loss`` does not."""
    from tilegraph._graph import topo_order

    forward = {id(n) for n in topo_order(list(loss.grid.flat))}
    return [n for n in topo_order([r for g in grads for r in g.grid.flat]) if not n.is_leaf and id(n) not in forward]


def test_norm_split_rows_kernel_counts(rng):
    x = tg.from_numpy(_r(rng, 4, 12), (2, 4))  # 2 row groups of 3 tiles
    w = tg.from_numpy(_r(rng, 12), 4)
    y = layer_norm(x, (12,), w, w)
    assert _kernels(y) == (2 * (3 + 1 + 3), {"norm_stats", "norm_merge", "norm_apply"})


def test_norm_float16_upcasts_statistics(rng):
    x = _r(rng, 3, 12) * 4 + 100  # a large mean: float16 statistics would lose the rows
    want = F.layer_norm(torch.tensor(x), (12,)).numpy()
    for tiles in (None, (3, 5)):
        t = tg.from_numpy(x.astype(np.float16), tiles)
        y = layer_norm(t, (12,))
        assert y.dtype == np.float16
        np.testing.assert_allclose(y.numpy(), want, atol=0.02)


@dtypes
@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("affine", list(AFFINE))
def test_fused_numba_kernels_match_the_array_api_ones(rng, dtype, center, affine):
    # the CPU runs the Numba versions; the NumPy/CuPy versions (the GPU path) must agree with them
    from tilegraph.ops.norm import _norm_bwd, _norm_fwd

    has_w, has_b = "w" in AFFINE[affine], "b" in AFFINE[affine] and center
    x, g = _r(rng, 2, 5, 12, dtype=dtype) + 1, _r(rng, 2, 5, 12, dtype=dtype)
    wb = [_r(rng, 12, dtype=dtype) for _ in range(int(has_w) + int(has_b))]
    kw = dict(center=center, has_w=has_w, has_b=has_b)
    fwd = [_norm_fwd.impl(dev)(x, *wb, eps=1e-5, **kw) for dev in ("cpu", "gpu")]
    for frozen in (False, True):  # a frozen weight and bias: dx alone, the same
        bkw = dict(center=center, has_w=has_w, grad_w=has_w and not frozen, grad_b=has_b and not frozen)
        bwd = [_norm_bwd.impl(dev)(x, g, *fwd[0][1:], *wb[:int(has_w)], **bkw) for dev in ("cpu", "gpu")]
        assert len(_as_tuple(bwd[0])) == 1 + (int(has_w) + int(has_b)) * (not frozen)
        for a, b in zip(fwd[0] + _as_tuple(bwd[0]), fwd[1] + _as_tuple(bwd[1])):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_allclose(a, b, rtol=TOL[np.dtype(dtype)][0], atol=TOL[np.dtype(dtype)][1])


def _as_tuple(v):
    return v if isinstance(v, tuple) else (v,)


# -------------------------------------------------------------------------------- errors ----
def test_errors(rng):
    x = tg.from_numpy(_r(rng, 4, 12), (2, 4))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.layer_norm\] weight must have shape \(12,\)"):
        layer_norm(x, (12,), tg.from_numpy(_r(rng, 6)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.rms_norm\] weight and the last dim of x must have "
                                           r"the same tiles; received: \(6, 6\) vs \(4, 4, 4\)"):
        rms_norm(x, tg.from_numpy(_r(rng, 12), 6))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.layer_norm\] bias must have the dtype of x"):
        layer_norm(x, (12,), None, tg.from_numpy(_r(rng, 12, dtype=np.float32), 4))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.layer_norm\] x must have a floating dtype; "
                                           r"received: int64"):
        layer_norm(tg.from_numpy(np.arange(12).reshape(3, 4)), (4,))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.softmax\] x must have a floating dtype"):
        softmax(tg.from_numpy(np.arange(12).reshape(3, 4)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.softmax\] dim out of range"):
        softmax(x, 2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.layer_norm\] weight must be a TileTensor"):
        layer_norm(x, (12,), np.ones(12))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.rms_norm\] eps must be a non-negative number"):
        rms_norm(x, eps=-1.0)
