"""Embedding and cross-entropy against torch autograd, over all tilings, plus their errors."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn
from tilegraph._graph import topo_order
from tilegraph.ops.embedding import embedding
from tilegraph.ops.loss import cross_entropy

torch = pytest.importorskip("torch")
F = torch.nn.functional

params, dtypes, _r = by_mode, by_dtype, randn


def _kernels(*tensors):
    roots = [r for t in tensors for r in t.grid.flat]
    return [n.kernel.name for n in topo_order(roots) if not n.is_leaf]


def _torch_ce(ignore_index=-100, reduction="mean"):
    def fn(x, t):
        out = F.cross_entropy(x.reshape(-1, x.shape[-1]), t.reshape(-1).long(), ignore_index=ignore_index,
                              reduction=reduction)
        return out.reshape(t.shape) if reduction == "none" else out

    return fn


# ------------------------------------------------------------------------------ embedding ----
@params
@dtypes
@pytest.mark.parametrize("vocab", [13, 12])
def test_embedding(rng, mode, dtype, vocab):
    ids, w = rng.integers(0, vocab, (3, 7)), _r(rng, vocab, 10, dtype=dtype)
    check_against_torch(embedding, F.embedding, [ids, w], "bt,vc", mode, grad_of=[1])


@params
@dtypes
def test_embedding_repeated_ids_sum_their_gradients(rng, mode, dtype):
    ids, w = np.full((3, 7), 5), _r(rng, 13, 10, dtype=dtype)
    ids[1, 2:5] = 12
    check_against_torch(embedding, F.embedding, [ids, w], "bt,vc", mode, grad_of=[1])


@params
def test_embedding_other_id_shapes_and_dtypes(rng, mode):
    w = _r(rng, 13, 10)
    check_against_torch(embedding, F.embedding, [rng.integers(0, 13, (12,)).astype(np.int32), w], "t,vc", mode,
                        grad_of=[1])
    check_against_torch(embedding, F.embedding, [rng.integers(0, 13, (2, 3, 5)), w], "abt,vc", mode, grad_of=[1])


def test_embedding_graph_shape(rng):
    ids = tg.from_numpy(rng.integers(0, 13, (3, 7)), (2, 4))  # 2 x 2 id tiles
    w = tg.from_numpy(_r(rng, 13, 10), (5, 4))  # 3 x 3 weight tiles
    out = embedding(ids, w)
    assert out.chunks == ((2, 1), (4, 3), (4, 4, 2))
    assert _kernels(out).count("embedding") == 4 * 3  # one per output tile, all V tiles at once
    (gw,) = tg.grad(out.sum(), [w])
    assert _kernels(gw).count("embedding_bwd") == 9  # one per weight tile


@pytest.mark.parametrize("bad", [13, -1])
@pytest.mark.parametrize("where", ["forward", "gradient"])
def test_embedding_out_of_range_id_is_reported(rng, bad, where):
    ids = rng.integers(0, 13, (3, 7))
    ids[2, 6] = bad  # in the last id tile only
    tids, w = tg.from_numpy(ids, (2, 4)), tg.from_numpy(_r(rng, 13, 10), (5, 4))
    out = embedding(tids, w)
    target = out if where == "forward" else tg.grad(out.sum(), [w])[0]
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.embedding\] ids must lie in \[0, 13\); received: {bad}"):
        tg.compute(target)


def test_embedding_bad_inputs(rng):
    w = tg.from_numpy(_r(rng, 13, 10))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.embedding\] ids must have an integer dtype"):
        embedding(tg.from_numpy(np.zeros((3, 7))), w)
    ids = tg.from_numpy(rng.integers(0, 13, (3, 7)))
    with pytest.raises(tg.TileError, match=r"weight must be 2-d"):
        embedding(ids, tg.from_numpy(_r(rng, 13)))
    with pytest.raises(tg.TileError, match=r"weight must have a floating dtype"):
        embedding(ids, tg.from_numpy(np.zeros((13, 10), np.int64)))
    with pytest.raises(tg.TileError, match=r"ids must be a TileTensor"):
        embedding(np.zeros((3, 7), np.int64), w)


# -------------------------------------------------------------------------- cross entropy ----
def _targets(rng, shape, vocab, ignored=(), ignore_index=-100):
    t = rng.integers(0, vocab, shape)
    for idx in ignored:
        t[idx] = ignore_index
    return t


@params
@dtypes
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab", [13, 12])
def test_cross_entropy(rng, mode, dtype, reduction, vocab):
    x = _r(rng, 3, 7, vocab, dtype=dtype) * 3
    t = _targets(rng, (3, 7), vocab, ignored=[(0, 1), (2, 6), (1, 0)])
    check_against_torch(lambda x, t: cross_entropy(x, t, reduction=reduction), _torch_ce(reduction=reduction),
                        [x, t], "btv,bt", mode, grad_of=[0])


@params
@dtypes
def test_cross_entropy_custom_ignore_index_and_2d(rng, mode, dtype):
    x, t = _r(rng, 12, 13, dtype=dtype), _targets(rng, (12,), 13)
    t[[0, 5, 11]] = 2  # ignore_index may be a valid class
    check_against_torch(lambda x, t: cross_entropy(x, t, ignore_index=2), _torch_ce(ignore_index=2),
                        [x, t], "nv,n", mode, grad_of=[0])
    check_against_torch(lambda x, t: cross_entropy(x, t, reduction="none"), _torch_ce(reduction="none"),
                        [x, t.astype(np.int32)], "nv,n", mode, grad_of=[0])


def test_cross_entropy_large_logits_are_stable(rng):
    x, t = _r(rng, 7, 13) * 1000, _targets(rng, (7,), 13)
    check_against_torch(cross_entropy, _torch_ce(), [x, t], "nv,n", "ragged", grad_of=[0])


def test_cross_entropy_all_ignored_mean_is_nan_with_zero_gradient(rng):
    x = tg.from_numpy(_r(rng, 3, 7, 13), (2, 4, 5))
    t = tg.from_numpy(np.full((3, 7), -100), (2, 4))
    loss = cross_entropy(x, t)
    (gx,) = tg.grad(loss, [x])
    got, g = tg.compute(loss, gx)
    assert np.isnan(got) and got.shape == ()
    np.testing.assert_array_equal(g, 0)
    assert cross_entropy(x, t, reduction="sum").numpy() == 0


def test_cross_entropy_many_row_tiles_use_a_tree(rng):
    from tilegraph.ops.reduce import FAN_IN

    x, t = _r(rng, 20, 13), _targets(rng, (20,), 13, ignored=[3, 17])
    out = check_against_torch(cross_entropy, _torch_ce(), [x, t], "nV,n", "single", grad_of=[0])
    tx, tt = tg.from_numpy(x, (1, 5)), tg.from_numpy(t, 1)  # 20 row tiles x 3 vocab tiles
    loss = cross_entropy(tx, tt)
    names = _kernels(loss)
    assert names.count("cross_entropy_stats") == 60 and names.count("cross_entropy_merge") == 20
    assert names.count("cross_entropy_total") == -(-20 // FAN_IN) and names.count("cross_entropy_reduce") == 1
    np.testing.assert_allclose(loss.numpy(), out.numpy(), rtol=1e-12)
    (gx,) = tg.grad(loss, [tx])
    assert _kernels(gx).count("cross_entropy_bwd") == 60  # one per logits tile, from the saved lse


def test_cross_entropy_bad_inputs(rng):
    x = tg.from_numpy(_r(rng, 3, 7, 13), (2, 4, 5))
    t = rng.integers(0, 13, (3, 7))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cross_entropy\] targets must have an integer dtype"):
        cross_entropy(x, tg.from_numpy(t.astype(np.float64), (2, 4)))
    with pytest.raises(tg.TileError, match=r"logits must have a floating dtype"):
        cross_entropy(tg.from_numpy(np.zeros((3, 7, 13), np.int64), (2, 4, 5)), tg.from_numpy(t, (2, 4)))
    with pytest.raises(tg.TileError, match=r"targets must have the shape of logits without the last"):
        cross_entropy(x, tg.from_numpy(t[:, :6], (2, 4)))
    with pytest.raises(tg.TileError, match=r"targets and the leading dims of logits must have the same tiles"):
        cross_entropy(x, tg.from_numpy(t, (3, 4)))
    with pytest.raises(tg.TileError, match=r"reduction must be one of"):
        cross_entropy(x, tg.from_numpy(t, (2, 4)), reduction="avg")
    with pytest.raises(tg.TileError, match=r"ignore_index must be an int"):
        cross_entropy(x, tg.from_numpy(t, (2, 4)), ignore_index=None)


@pytest.mark.parametrize("bad", [13, -1])
def test_cross_entropy_out_of_range_target_is_reported(rng, bad):
    t = rng.integers(0, 13, (3, 7))
    t[2, 6] = bad
    loss = cross_entropy(tg.from_numpy(_r(rng, 3, 7, 13), (2, 4, 5)), tg.from_numpy(t, (2, 4)))
    with pytest.raises(tg.TileError, match=rf"targets must lie in \[0, 13\) or equal ignore_index \(-100\); "
                                           rf"received: {bad}"):
        loss.numpy()


def test_language_model_head_end_to_end(rng):
    """embedding -> matmul -> cross_entropy, gradients of both weights against torch."""
    ids, targets = rng.integers(0, 13, (3, 7)), _targets(rng, (3, 7), 13, ignored=[(1, 1)])
    wte, head = _r(rng, 13, 10), _r(rng, 10, 13)

    def fn(ids, wte, head, targets):
        return cross_entropy(tg.matmul(embedding(ids, wte), head), targets)

    def tfn(ids, wte, head, targets):
        return _torch_ce()(F.embedding(ids, wte) @ head, targets)

    check_against_torch(fn, tfn, [ids, wte, head, targets], "bt,vc,cv,bt", "ragged", grad_of=[1, 2])


@dtypes
def test_array_namespace_kernels_match_the_numba_ones(rng, dtype, monkeypatch):
    """The xp kernels (what runs on CuPy) give the same results as the Numba CPU kernels."""
    from tilegraph._graph import get_kernel

    for name in ("embedding", "embedding_bwd", "cross_entropy_stats", "cross_entropy_bwd"):
        monkeypatch.setattr(get_kernel(name), "cpu", None)
    ids, w = rng.integers(0, 13, (3, 7)), _r(rng, 13, 10, dtype=dtype)
    check_against_torch(embedding, F.embedding, [ids, w], "bt,vc", "ragged", grad_of=[1])
    x, t = _r(rng, 3, 7, 13, dtype=dtype), _targets(rng, (3, 7), 13, ignored=[(0, 1)])
    for reduction in ("mean", "none"):
        check_against_torch(lambda x, t: cross_entropy(x, t, reduction=reduction), _torch_ce(reduction=reduction),
                            [x, t], "btv,bt", "ragged", grad_of=[0])
    bad = ids.copy()
    bad[2, 6] = 13
    with pytest.raises(tg.TileError, match=r"ids must lie in \[0, 13\); received: 13"):
        embedding(tg.from_numpy(bad, (2, 4)), tg.from_numpy(w, (5, 4))).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cpu_kernels_over_row_blocks_equal_the_plain_expressions(dtype):
    """The CPU cross-entropy kernels work through a tile in blocks of rows (a ragged last one);
    they give what the whole-tile expressions give: targets inside and outside the tile, ignored
    rows, mean and none reductions."""
    from tilegraph.ops import loss as L

    rng = np.random.default_rng(3)
    n, v, offset = 301, 5003, 5003
    x = (rng.standard_normal((n, v)) * 4).astype(dtype)
    tgt = rng.integers(0, 3 * v, n)
    tgt[::7] = -100
    assert len(list(L._row_blocks(n, v, x.itemsize))) > 2
    for got, want in zip(L._ce_stats_cpu(x, tgt, offset), L._ce_stats_xp(x, tgt, offset)):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=2e-6 if dtype == np.float32 else 1e-12)
    lse = (np.log(np.exp(x.astype(np.float64)).sum(1)) + 0.3).astype(dtype)
    for reduction, g, tot in (("mean", np.asarray(1.5, dtype), [np.array([0.0, 250.0])]),
                              ("none", rng.standard_normal(n).astype(dtype), [])):
        kw = dict(offset=offset, ignore_index=-100, reduction=reduction)
        got, want = L._ce_bwd_cpu(x, tgt, lse, g, *tot, **kw), L._ce_bwd_xp(x, tgt, lse, g, *tot, **kw)
        assert got.dtype == want.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["numpy", "list", "torch"])
def test_cross_entropy_takes_integer_arrays_as_targets_tiled_as_the_logits(kind, local_scheduler):
    """A model's logits of NumPy ids against the ids shifted, as torch's F.cross_entropy takes a
    tensor of targets: the array is tiled as the logits' leading dims (ragged here), and the loss
    and gradients are those of the same targets given as a TileTensor."""
    from tilegraph import models

    model = models.build("gpt2-debug", models.ModelTiling(batch=1, seq=3, vocab=40), seed=1)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
    targets = {"numpy": ids[:, 1:], "list": ids[:, 1:].tolist(),
               "torch": pytest.importorskip("torch").tensor(ids[:, 1:])}[kind]
    got = tg.cross_entropy(model(ids[:, :-1]), targets)
    want = tg.cross_entropy(model(ids[:, :-1]), model.tiling.tile_ids(ids[:, 1:]))
    g, w = tg.compute(got, *tg.grad(got, model.parameters()[:2])), tg.compute(want, *tg.grad(want, model.parameters()[:2]))
    for a, b in zip(g, w):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad, match", [
    (None, r"be a TileTensor or an array of integers .*received: NoneType"),
    (np.zeros((2, 8)), r"array of integers .*received: ndarray of dtype float64"),
    (np.zeros((2, 7), dtype=np.int64), r"shape of logits without the last \(class\) dim; received: logits \(2, 8, 5\), "
                                        r"targets \(2, 7\) \(ndarray\)"),
])
def test_cross_entropy_refuses_targets_that_are_not_class_indices_of_the_logits_rows(bad, match):
    logits = tg.from_numpy(np.zeros((2, 8, 5), dtype=np.float32), tiles=(1, 4, None))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cross_entropy\] targets must .*" + match):
        tg.cross_entropy(logits, bad)
