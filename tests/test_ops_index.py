"""Indexing and selections (``x[...]``, narrow, select, split, chunk, unbind) against torch:
forward and gradients over single, even and ragged tilings; which tiles the result reuses; and
the errors of indices torch refuses or tilegraph does not support."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for
from tilegraph.ops.index import TileIndexError

torch = pytest.importorskip("torch")

E = Ellipsis
KEYS = [
    1, -1, (slice(None), -1), (E, slice(None, None, 2)), (None, 0), (slice(1, None), slice(None, None, 3), 4),
    (slice(-3, -1), None, slice(1, 9, 4)), (2, slice(2, 5), slice(None, None, 5)), (E, 3), (0, E, None),
    (slice(None), slice(1, 2)), (slice(0, 100), slice(-100, 3)), (),
]


@by_mode
@by_dtype
@pytest.mark.parametrize("key", KEYS, ids=repr)
def test_getitem_matches_torch(rng, mode, dtype, key):
    x = randn(rng, 5, 7, 9, dtype=dtype)
    out = check_against_torch(lambda t: t[key], lambda t: t[key], [x], "abc", mode)
    assert out.shape == x[key].shape


@by_mode
def test_empty_selections_are_empty_tensors_with_zero_gradients(rng, mode):
    x = randn(rng, 5, 7)
    check_against_torch(lambda t: t[3:1] * 2.0, lambda t: t[3:1] * 2.0, [x], "ab", mode)
    tx = tg.from_numpy(x, tiles_for(x.shape, "ab", mode, {}))
    y = tx[:, 4:4]
    assert y.shape == (5, 0) and y.numpy().shape == (5, 0)


@by_mode
@pytest.mark.parametrize("how", ["narrow", "select", "split", "split_list", "chunk", "unbind"])
def test_selections_match_torch(rng, mode, how):
    x = randn(rng, 6, 10, 4)
    calls = {
        "narrow": (lambda t: t.narrow(1, 3, 5), lambda t: t.narrow(1, 3, 5)),
        "select": (lambda t: tg.select(t, -2, 7), lambda t: torch.select(t, -2, 7)),
        "split": (lambda t: tg.cat([p * float(i + 1) for i, p in enumerate(t.split(3, 1))], 1),
                  lambda t: torch.cat([p * float(i + 1) for i, p in enumerate(t.split(3, 1))], 1)),
        "split_list": (lambda t: t.split([1, 0, 5], 0)[2] - t.split([1, 0, 5], 0)[0],
                       lambda t: t.split([1, 0, 5], 0)[2] - t.split([1, 0, 5], 0)[0]),
        "chunk": (lambda t: tg.cat([p * float(i + 1) for i, p in enumerate(tg.chunk(t, 4, 0))], 0),
                  lambda t: torch.cat([p * float(i + 1) for i, p in enumerate(torch.chunk(t, 4, 0))], 0)),
        "unbind": (lambda t: tg.stack([r * float(i) for i, r in enumerate(t.unbind(2))], 0),
                   lambda t: torch.stack([r * float(i) for i, r in enumerate(t.unbind(2))], 0)),
    }
    fn, tfn = calls[how]
    check_against_torch(fn, tfn, [x], "abc", mode)


def test_piece_counts_follow_torch():
    x = tg.from_numpy(np.arange(10.0), tiles=4)
    t = torch.arange(10.0)
    for n in (1, 3, 4, 6, 10, 11):
        assert [p.shape[0] for p in x.chunk(n)] == [len(p) for p in t.chunk(n)]
    for n in (1, 3, 4, 10, 12):
        assert [p.shape[0] for p in x.split(n)] == [len(p) for p in t.split(n)]
    for key in (slice(-15, 3), slice(8, 100), slice(3, 1), -10):
        assert np.array_equal(x[key].numpy(), t[key].numpy())


def test_a_selection_keeps_the_tiles_it_does_not_cut():
    x = tg.from_numpy(np.arange(24.0).reshape(4, 6), tiles=(2, 3))
    head, tail = x.split(3, 1)  # along the tile boundary: the input's own tiles, no kernel
    assert head.chunks == ((2, 2), (3,)) and head.grid[0, 0] is x.grid[0, 0] and tail.grid[1, 0] is x.grid[1, 1]
    y = x[1:, 2:4]  # cuts four tiles: one part of each
    assert y.chunks == ((1, 2), (1, 1))
    assert all(ref.node.kernel.name == "slice" for ref in y.grid.flat)
    assert x[:, :].grid is x.grid and x[...] is x


def test_gradient_of_an_unselected_tile_is_zero_and_of_a_kept_tile_the_cotangent():
    a = np.arange(24.0).reshape(4, 6)
    x = tg.from_numpy(a, tiles=(2, 3))
    (g,) = tg.grad((x[:2, 3:] * 2.0).sum(), [x])
    want = np.zeros_like(a)
    want[:2, 3:] = 2.0
    np.testing.assert_array_equal(g.numpy(), want)


def test_iteration_gives_the_rows_as_torch_does():
    a = np.arange(12.0).reshape(3, 4)
    x = tg.from_numpy(a, tiles=(2, 3))
    rows = [r.numpy() for r in x]
    assert len(rows) == 3 and all(np.array_equal(r, w) for r, w in zip(rows, a))
    with pytest.raises(TypeError, match="0-d"):
        iter(tg.from_numpy(np.float64(1.0)))


def test_indexing_inside_a_trained_model():
    # the last position's hidden state feeds a linear head (a classifier over sequences)
    rng = np.random.default_rng(0)
    emb = tg.nn.Embedding(11, 8, dtype=np.float64, seed=0)
    head = tg.nn.Linear(8, 3, dtype=np.float64, seed=1)
    ids = rng.integers(0, 11, size=(4, 5))
    labels = rng.integers(0, 3, size=(4,))
    params = [*emb.parameters(), *head.parameters()]
    loss = tg.cross_entropy(head(emb(tg.from_numpy(ids, tiles=(2, 2)))[:, -1]), tg.from_numpy(labels, tiles=2))
    grads = tg.grad(loss, params)
    got = tg.compute(loss, *grads)

    t_emb = torch.tensor(emb.weight.numpy(), requires_grad=True)
    t_w = torch.tensor(head.weight.numpy(), requires_grad=True)
    t_b = torch.tensor(head.bias.numpy(), requires_grad=True)
    hidden = t_emb[torch.tensor(ids)][:, -1]
    w = t_w if t_w.shape == (8, 3) else t_w.T
    t_loss = torch.nn.functional.cross_entropy(hidden @ w + t_b, torch.tensor(labels))
    t_loss.backward()
    np.testing.assert_allclose(got[0], t_loss.item(), rtol=1e-12)
    for g, want in zip(got[1:], (t_emb.grad, t_w.grad, t_b.grad)):
        np.testing.assert_allclose(g, want.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("key, error, what", [
    ((slice(None), slice(None), 0), TileIndexError, "too many indices"),
    (3, TileIndexError, "out of range for dim 0 of size 3"),
    ((0, -5), TileIndexError, "out of range for dim 1 of size 4"),
    ((E, E), TileIndexError, "single ellipsis"),
    (slice(None, None, -1), tg.TileError, "steps must be positive"),
    (slice(None, None, 0), tg.TileError, "steps must be positive"),
    (slice(0.5, 2), tg.TileError, "slice starts must be ints"),
    ([0, 1], tg.TileError, "advanced indexing"),
    (np.array([0, 2]), tg.TileError, "advanced indexing"),
    (True, tg.TileError, "boolean index"),
    ("a", tg.TileError, "received: str 'a'"),
])
def test_bad_indices_are_named(key, error, what):
    x = tg.from_numpy(np.zeros((3, 4)), tiles=2)
    with pytest.raises(error, match="TileTensor.__getitem__") as info:
        x[key]
    assert what in str(info.value)
    if error is TileIndexError:
        assert isinstance(info.value, IndexError)
    with pytest.raises(tg.TileError, match="advanced indexing"):
        x[tg.from_numpy(np.array([0, 1]))]


@pytest.mark.parametrize("call, what", [
    (lambda x: x.narrow(1, 2, 3), "start + length must lie within dim 1 of size 4"),
    (lambda x: x.narrow(1, -5, 1), "start out of range"),
    (lambda x: x.narrow(2, 0, 1), "dim out of range"),
    (lambda x: x.narrow(0, 1.0, 1), "start must be an int"),
    (lambda x: x.select(0, 3), "out of range for dim 0"),
    (lambda x: x.split(0), "split_size must be a positive int"),
    (lambda x: x.split([1, 1]), "add up to dim 0's size 3"),
    (lambda x: x.split("2"), "an int or a list"),
    (lambda x: x.chunk(0, 1), "chunks must be a positive int"),
    (lambda x: x.unbind(5), "dim out of range"),
])
def test_bad_selections_are_named(call, what):
    x = tg.from_numpy(np.zeros((3, 4)), tiles=2)
    with pytest.raises(tg.TileError, match="TileTensor") as info:
        call(x)
    assert what in str(info.value)


def test_a_tensor_never_becomes_an_array_implicitly():
    x = tg.from_numpy(np.zeros((3, 4)), tiles=2)
    with pytest.raises(tg.TileError, match=r"x\.numpy\(\)"):
        np.asarray(x)
    assert np.array_equal(x.narrow(0, -2, 2).numpy(), np.zeros((2, 4)))  # negative start: from the end


def test_selections_run_on_the_cluster_and_on_emulated_gpu_workers():
    old = tg.config.gpu_array_module, tg.config.placement
    tg.config.gpu_array_module = "numpy"
    try:
        a = np.random.default_rng(0).standard_normal((64, 48))
        x = tg.from_numpy(a, tiles=(32, 20))
        y = (x[5:50:3, 7:] * 2.0).sum()
        (g,) = tg.grad(y, [x])
        want = np.zeros_like(a)
        want[5:50:3, 7:] = 2.0
        with tg.connect(n_workers=1, gpu=1, threads_per_worker=1, dashboard=False, quiet=True):
            for placement in ("cpu", "gpu"):
                tg.config.placement = placement
                got_y, got_g = tg.compute(y, g)
                np.testing.assert_allclose(got_y, 2.0 * a[5:50:3, 7:].sum(), rtol=1e-12)
                np.testing.assert_array_equal(got_g, want)
    finally:
        tg.config.gpu_array_module, tg.config.placement = old
