"""torch names a porting user still missed: zeros / ones / full and their _like forms, expand /
expand_as, cumsum, norm, and sum / mean with dtype= (and NumPy's out=None, so np.sum(x) and
np.mean(x) work). Each against torch autograd (forward and gradients) over single, even and ragged
tilings in float64 and float32; the graph each records (kernel counts, no host array of a
created tensor's size); and the errors of what torch refuses or tilegraph does not support."""

import math

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for


def _named(call, x, what: str) -> None:
    """``call(x)`` raises a TileError whose message holds ``what``."""
    with pytest.raises(tg.TileError) as info:
        call(x)
    assert what in str(info.value)


torch = pytest.importorskip("torch")

TORCH_DTYPE = {np.float32: torch.float32, np.float64: torch.float64}


def _kernels(t) -> list[str]:
    """The kernel name of each tile of ``t`` (the last kernel that made it)."""
    return [ref.node.kernel.name for ref in t.grid.flat]


def _graph_kernels(*tensors) -> list[str]:
    """The kernel names of every node the tensors' tiles depend on (leaves left out)."""
    from tilegraph._graph import topo_order

    return [n.kernel.name for n in topo_order([r for t in tensors for r in t.grid.flat]) if n.kernel is not None]


# ------------------------------------------------------------------------------ creators ----
@by_mode
@by_dtype
def test_creators_combine_with_a_tensor_as_in_torch(rng, mode, dtype):
    td = TORCH_DTYPE[dtype]

    def fn(t):
        return (t * tg.full(t.shape, 1.5, tiles=t.chunks, dtype=dtype) + tg.ones(*t.shape, tiles=t.chunks, dtype=dtype)
                - tg.zeros(t.shape, tiles=t.chunks, dtype=dtype) + tg.full_like(t, -2.0) * tg.ones_like(t)
                + tg.zeros_like(t))

    def tfn(t):
        return (t * torch.full(t.shape, 1.5, dtype=td) + torch.ones(*t.shape, dtype=td) - torch.zeros(t.shape, dtype=td)
                + torch.full_like(t, -2.0) * torch.ones_like(t) + torch.zeros_like(t))

    check_against_torch(fn, tfn, [randn(rng, 7, 10, dtype=dtype)], "ab", mode)


@pytest.mark.parametrize("make, tmake", [
    (lambda: tg.zeros(2, 3), lambda: torch.zeros(2, 3)),
    (lambda: tg.ones((4,)), lambda: torch.ones((4,))),
    (lambda: tg.zeros([]), lambda: torch.zeros([])),
    (lambda: tg.full((2, 2), 7), lambda: torch.full((2, 2), 7)),
    (lambda: tg.full((3,), True), lambda: torch.full((3,), True)),
    (lambda: tg.full((2,), 2.5), lambda: torch.full((2,), 2.5)),
    (lambda: tg.full((2,), 2.7, dtype=np.int64), lambda: torch.full((2,), 2.7, dtype=torch.int64)),
    (lambda: tg.full((2,), float("-inf"), dtype="float64"),
     lambda: torch.full((2,), float("-inf"), dtype=torch.float64)),
    (lambda: tg.full((2,), 3, dtype=torch.float16), lambda: torch.full((2,), 3, dtype=torch.float16)),
    (lambda: tg.ones(0, 3, tiles=(None, 2)), lambda: torch.ones(0, 3)),
    (lambda: tg.full_like(tg.from_numpy(np.arange(5), tiles=2), 2.7), lambda: torch.full_like(torch.arange(5), 2.7)),
    (lambda: tg.ones_like(tg.from_numpy(np.arange(5), tiles=2), dtype=np.float64),
     lambda: torch.ones_like(torch.arange(5), dtype=torch.float64)),
], ids=lambda f: "")
def test_creator_values_and_dtypes_are_torchs(make, tmake):
    got, want = make(), tmake()
    assert got.dtype == np.dtype(str(want.dtype).removeprefix("torch."))
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_a_created_tensor_is_one_scalar_leaf_and_a_fill_kernel_per_tile():
    x = tg.full((10, 7), 3.0, tiles=(4, 3), dtype=np.float64)
    assert x.chunks == ((4, 4, 2), (3, 3, 1))
    assert _kernels(x) == ["fill"] * 9
    leaves = {id(ref.node.inputs[0].node) for ref in x.grid.flat}
    assert len(leaves) == 1  # one value, shared by every tile
    cell = x.grid[0, 0].node.inputs[0].node.cell
    assert cell.value.shape == () and cell.value.dtype == np.float64  # never a host array of the tensor's size
    got = tg.compute(x)[0]
    assert got.dtype == np.float64 and np.array_equal(got, np.full((10, 7), 3.0))
    # the same value and tiling twice: the same task keys (the leaf's token is its content)
    assert tg.full((10, 7), 3.0, tiles=(4, 3), dtype=np.float64).grid[0, 0].node.inputs[0].node.cell.token == cell.token


def test_like_forms_keep_the_tiling_and_read_nothing_of_x():
    a = np.arange(12.0).reshape(3, 4)
    x = tg.from_numpy(a, tiles=(2, 3))
    y = x * 2.0
    for z in (tg.zeros_like(y), tg.ones_like(y), tg.full_like(y, 5)):
        assert z.chunks == y.chunks and z.dtype == y.dtype
        assert "mul" not in _graph_kernels(z)  # y is never computed for it
    # no gradient flows through a created tensor (torch: it does not require grad)
    (g,) = tg.grad((y * tg.ones_like(y)).sum() + tg.full_like(x, 3.0).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), np.full_like(a, 2.0))
    with pytest.raises(tg.TileError, match="does not affect the loss"):
        tg.grad(tg.zeros_like(x).sum(), [x])


@pytest.mark.parametrize("call, what", [
    (lambda: tg.zeros(-1, 3), "[tilegraph.zeros] sizes must be >= 0; received: shape (-1, 3)"),
    (lambda: tg.ones((2, -4)), "[tilegraph.ones] sizes must be >= 0; received: shape (2, -4)"),
    (lambda: tg.zeros(2.5), "[tilegraph.zeros] expected a shape: sizes as ints, or one tuple of them; "
                            "received: (2.5,)"),
    (lambda: tg.zeros(2, 3, tiles=(4, 1)), "[tilegraph.zeros] tile size of dim 0 is larger than the dimension (2)"),
    (lambda: tg.zeros(2, 3, tiles=(1,)), "[tilegraph.zeros] expected one tile size per dimension (2 for shape (2, 3))"),
    (lambda: tg.ones(4, tiles=0), "[tilegraph.ones] tile size of dim 0 must be positive; received: 0"),
    (lambda: tg.zeros(3, dtype=np.complex64), "[tilegraph.zeros] expected a bool, integer or float dtype; "
                                              "received: complex64"),
    (lambda: tg.full(3.0, 1.0), "[tilegraph.full] size must be a tuple of ints (the shape); received: float 3.0"),
    (lambda: tg.full((2,), "a"), "[tilegraph.full] fill_value must be a real number (or a bool); received: str 'a'"),
    (lambda: tg.full((2,), 300, dtype=np.uint8), "[tilegraph.full] fill_value does not fit the dtype uint8; "
                                                 "received: 300"),
    (lambda: tg.full((2,), float("nan"), dtype=np.int32), "fill_value does not fit the dtype int32; received: nan"),
    (lambda: tg.zeros_like(np.zeros(3)), "[tilegraph.zeros_like] x must be a TileTensor (for a shape: tg.zeros, "
                                         "tg.ones, tg.full); received: ndarray"),
    (lambda: tg.full_like(tg.zeros(2), tg.zeros(1)), "[tilegraph.full_like] fill_value must be a real number"),
])
def test_bad_creations_are_named(call, what):
    with pytest.raises(tg.TileError) as info:
        call()
    assert what in str(info.value)


# ---------------------------------------------------------------------- expand / expand_as ----
EXPANDS = [
    ((3, 1, 5), (2, 3, 4, 5)),
    ((3, 1, 5), (-1, 6, -1)),
    ((3, 1, 5), ((4, 3, 1, 5),)),  # one tuple, a size-1 dim kept as 1
    ((3, 1, 5), (3, 0, 5)),  # a size-1 dim grown to nothing
    ((1, 4), (2, 3, 4)),
    ((), (2, 3)),
    ((6,), (-1,)),  # nothing to do: x itself
]


@by_mode
@by_dtype
@pytest.mark.parametrize("shape, sizes", EXPANDS, ids=str)
def test_expand_matches_torch(rng, mode, dtype, shape, sizes):
    x = randn(rng, *shape, dtype=dtype)
    labels = "abc"[:len(shape)]
    check_against_torch(lambda t: t.expand(*sizes), lambda t: t.expand(*sizes), [x], labels, mode)
    check_against_torch(lambda t: tg.expand(t, *sizes) * 2.0, lambda t: t.expand(*sizes) * 2.0, [x], labels, mode)


@by_mode
@by_dtype
def test_expand_as_takes_the_other_tensors_tiles(rng, mode, dtype):
    x, y = randn(rng, 3, 1, 5, dtype=dtype), randn(rng, 2, 3, 4, 5, dtype=dtype)
    # x's dim of size 1 and y's of size 4 are labelled apart (e, f): y's own tiles there
    out = check_against_torch(lambda a, b: a.expand_as(b) * b, lambda a, b: a.expand_as(b) * b, [x, y], "aec,dafc",
                              mode)
    sizes = {}
    tiles_for(x.shape, "aec", mode, sizes)
    assert out.chunks == tg.from_numpy(y, tiles_for(y.shape, "dafc", mode, sizes)).chunks
    check_against_torch(lambda a, b: tg.expand_as(a, b) - b, lambda a, b: a.expand_as(b) - b, [x, y], "aec,dafc", mode)


@by_mode
@by_dtype
def test_expand_with_tiles_for_the_grown_dims(rng, mode, dtype):
    x = randn(rng, 6, 1, dtype=dtype)
    ty = randn(rng, 4, 6, 9, dtype=dtype)
    y_tiles = tiles_for(ty.shape, "dab", mode)
    a_tiles = tiles_for(x.shape, "a", mode)[0]

    def fn(t, y):
        return t.expand(4, -1, 9, tiles=(y_tiles[0], None, y_tiles[2])) + y

    out = check_against_torch(fn, lambda t, y: t.expand(4, -1, 9) + y, [x, ty], "ae,dab", mode)
    assert out.chunks[1] == tg.from_numpy(x, (a_tiles, None)).chunks[0]


def test_expand_records_one_kernel_per_tile_and_its_gradient_is_a_sum():
    x = tg.from_numpy(np.arange(6.0).reshape(3, 1, 2), tiles=(2, 1, 1))
    y = x.expand(5, 3, 4, 2, tiles=(2, None, 3, None))
    assert y.chunks == ((2, 2, 1), (2, 1), (3, 1), (1, 1))
    assert _kernels(y) == ["expand"] * y.ntiles
    assert y.grid[2, 1, 1, 0].node.inputs[0] is x.grid[1, 0, 0]  # each tile a broadcast of the tile it comes from
    (g,) = tg.grad(y.sum(), [x])
    assert set(_kernels(g)) == {"reduce_sum"}
    np.testing.assert_array_equal(g.numpy(), np.full((3, 1, 2), 20.0))
    assert x.expand(3, -1, 2) is x and x.expand_as(x) is x


@pytest.mark.parametrize("call, what", [
    (lambda x: x.expand(4, 2), "[tilegraph.TileTensor.expand] dim 0 of the tensor of shape (3, 1) (size 3) cannot "
                               "expand to 4: only dims of size 1 may grow (-1 keeps a dim); received: sizes (4, 2)"),
    (lambda x: x.expand(3), "[tilegraph.TileTensor.expand] expected at least 2 sizes, one per dim of the tensor of "
                            "shape (3, 1) (new leading dims may come before them); received: 1 sizes (3,)"),
    (lambda x: x.expand(-1, 3, 2), "[tilegraph.TileTensor.expand] the size of new leading dim 0 must be >= 0 (-1 keeps "
                                   "a dim of x, and this dim is not one); received: sizes (-1, 3, 2)"),
    (lambda x: x.expand(3, -2), "dim 1 of the tensor of shape (3, 1) (size 1) cannot expand to -2"),
    (lambda x: x.expand(3, 2.0), "[tilegraph.TileTensor.expand] expected sizes (ints, -1 to keep a dim), or one tuple "
                                 "of them; received: (3, 2.0)"),
    (lambda x: x.expand(3, 4, tiles=(None, 2, 1)), "[tilegraph.TileTensor.expand] tiles needs one entry per dim of the "
                                                   "result (shape (3, 4)); received: tiles=(None, 2, 1)"),
    (lambda x: x.expand(3, 4, tiles=(3, 2)), "[tilegraph.TileTensor.expand] dim 0 keeps the size of dim 0 of x, and "
                                             "with it x's tiles (2, 1)"),
    (lambda x: x.expand(3, 4, tiles=(None, 5)), "[tilegraph.TileTensor.expand] tile size of dim 1 is larger than the "
                                                "dimension (4)"),
    (lambda x: tg.expand(x, 2, 4, 5), "[tilegraph.expand] dim 0 of the tensor of shape (3, 1) (size 3) cannot expand "
                                      "to 4"),
    (lambda x: x.expand_as(np.zeros((3, 4))), "[tilegraph.TileTensor.expand_as] other must be a TileTensor; "
                                              "received: ndarray"),
    (lambda x: x.expand_as(tg.zeros(4)), "[tilegraph.TileTensor.expand_as] expected at least 2 sizes"),
    (lambda x: tg.expand_as(x, tg.zeros(2, 5)), "[tilegraph.expand_as] dim 0 of the tensor of shape (3, 1) (size 3) "
                                                "cannot expand to 2"),
])
def test_bad_expands_are_named(call, what):
    _named(call, tg.from_numpy(np.zeros((3, 1)), tiles=(2, 1)), what)


# ---------------------------------------------------------------------------------- cumsum ----
@by_mode
@by_dtype
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumsum_matches_torch(rng, mode, dtype, dim):
    x = randn(rng, 7, 10, 5, dtype=dtype)
    check_against_torch(lambda t: t.cumsum(dim), lambda t: t.cumsum(dim), [x], "abc", mode)
    check_against_torch(lambda t: tg.cumsum(t * t, dim), lambda t: torch.cumsum(t * t, dim), [x], "abc", mode)


@by_dtype
@pytest.mark.parametrize("n, tile", [(31, 4), (32, 4), (33, 4), (33, 1), (9, 3)])
def test_cumsum_over_many_tiles_matches_torch(rng, dtype, n, tile):
    # each gradient is the reversed scan: both directions, over runs of tiles of every length
    x = randn(rng, 3, n, dtype=dtype)
    r = randn(rng, 3, n, dtype=dtype)
    tx = tg.from_numpy(x, (2, tile))
    y = tx.cumsum(1)
    (g,) = tg.grad((y * tg.from_numpy(r, y.chunks)).sum(), [tx])
    got_y, got_g = tg.compute(y, g)
    t = torch.tensor(x, requires_grad=True)
    want = t.cumsum(1)
    (want * torch.tensor(r)).sum().backward()
    tol = {"rtol": 2e-5, "atol": 2e-5 * n} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12 * n}
    np.testing.assert_allclose(got_y, want.detach().numpy(), **tol)
    np.testing.assert_allclose(got_g, t.grad.numpy(), **tol)


@pytest.mark.parametrize("dim, ntiles", [(1, 9), (1, 2), (1, 1), (0, 3)])
def test_cumsum_reads_each_tile_twice_in_a_graph_three_kernels_deep(dim, ntiles):
    x = tg.from_numpy(np.ones((6, 36)), tiles=(2, 36 // ntiles) if dim == 1 else (2, 12))
    k = x.tiling.grid[dim]
    rows = x.ntiles // k
    y = x.cumsum(dim)
    kinds = _graph_kernels(y)
    assert kinds.count("cumsum") == x.ntiles
    assert kinds.count("scan_total") == rows * (k - 1)
    assert kinds.count("scan_carries") == (rows if k > 2 else 0)

    from tilegraph._graph import topo_order

    depth = {}
    for node in topo_order(list(y.grid.flat)):
        depth[id(node)] = 1 + max((depth[id(i.node)] for i in node.inputs), default=-1)
    assert max(depth.values()) == min(k, 3)  # total, carries, cumsum (leaves at depth 0)
    np.testing.assert_array_equal(y.numpy(), np.cumsum(np.ones((6, 36)), dim))


def test_cumsum_dtypes_follow_torch():
    a16 = np.ones(4096, np.float16)  # float16 accumulates in float32, as torch's: 2049 ... not stuck at 2048
    for tiles in (None, 1000):
        got = tg.from_numpy(a16, tiles).cumsum(0).numpy()
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got, torch.tensor(a16).cumsum(0).numpy())
    for a in (np.array([True, False, True, True]), np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int8)):
        got = tg.from_numpy(a, tiles=3).cumsum(0).numpy()
        want = torch.tensor(a).cumsum(0).numpy()
        assert got.dtype == want.dtype == np.int64 and np.array_equal(got, want)
    # unsigned: NumPy's (and tg.sum's) uint64; torch's int64
    got = tg.from_numpy(np.arange(5, dtype=np.uint8), tiles=3).cumsum(0).numpy()
    assert got.dtype == np.uint64 and np.array_equal(got, np.cumsum(np.arange(5, dtype=np.uint8)))
    x = np.arange(6, dtype=np.float32)
    got = tg.cumsum(tg.from_numpy(x, tiles=4), 0, dtype=np.float64)
    assert got.dtype == np.float64 and np.array_equal(got.numpy(), torch.tensor(x).cumsum(0, dtype=torch.float64))
    scalar = tg.from_numpy(np.float64(3.0)).cumsum(-1)
    assert scalar.shape == () and scalar.numpy() == 3.0  # a 0-d tensor, as torch's


@by_mode
def test_cumsum_dtype_casts_first_and_the_gradient_comes_back_in_xs_dtype(rng, mode):
    x = randn(rng, 5, 8, dtype=np.float64)
    out = check_against_torch(lambda t: t.cumsum(1, dtype=np.float32), lambda t: t.cumsum(1, dtype=torch.float32),
                              [x], "ab", mode)
    assert out.dtype == np.float32
    # torch casts the cotangent to x's dtype before its reversed scan, tilegraph after it (the float64
    # scan is the more accurate): the gradients of a float32 x agree to float32's tolerance
    out = check_against_torch(lambda t: t.cumsum(1, dtype=np.float64), lambda t: t.cumsum(1, dtype=torch.float64),
                              [x.astype(np.float32)], "ab", mode, tol_scale=2e5)
    assert out.dtype == np.float64


@pytest.mark.parametrize("call, what", [
    (lambda x: x.cumsum(2), "[tilegraph.TileTensor.cumsum] dim out of range: expected -2 <= dim <= 1 for a tensor of "
                            "shape (3, 4); received: 2"),
    (lambda x: tg.cumsum(x, -3), "[tilegraph.cumsum] dim out of range: expected -2 <= dim <= 1 for a tensor of shape "
                                 "(3, 4); received: -3"),
    (lambda x: tg.cumsum(x.sum(), 1), "[tilegraph.cumsum] dim out of range: expected -1 <= dim <= 0 for a tensor of "
                                      "shape (); received: 1"),
    (lambda x: tg.cumsum(x, 0.5), "[tilegraph.cumsum] dim must be an int"),
    (lambda x: x.cumsum(0, dtype="complex64"), "[tilegraph.TileTensor.cumsum] expected a bool, integer or float dtype"),
    (lambda x: tg.cumsum(np.zeros(3), 0), "[tilegraph.cumsum] x must be a TileTensor; received: ndarray"),
])
def test_bad_cumsums_are_named(call, what):
    _named(call, tg.from_numpy(np.zeros((3, 4)), tiles=2), what)


# ------------------------------------------------------------------------------------ norm ----
@by_mode
@by_dtype
@pytest.mark.parametrize("p", [2, "fro", 1, math.inf], ids=str)
@pytest.mark.parametrize("dim", [None, 0, -1, (0, 2)], ids=str)
def test_norm_matches_torch(rng, mode, dtype, p, dim):
    x = randn(rng, 6, 5, 7, dtype=dtype)
    for keepdim in (False, True):
        check_against_torch(lambda t: t.norm(p, dim, keepdim), lambda t: torch.norm(t, p, dim, keepdim), [x], "abc",
                            mode)
    check_against_torch(lambda t: tg.norm(t * 2.0, p=p, dim=dim), lambda t: torch.norm(t * 2.0, p=p, dim=dim), [x],
                        "abc", mode)


@pytest.mark.parametrize("p", [2, 1, math.inf], ids=str)
def test_norm_gradients_at_zeros_and_ties_are_torchs(p):
    a = np.array([[0.0, 0.0, 0.0], [3.0, -3.0, 1.0], [2.0, 2.0, -2.0]])
    check_against_torch(lambda t: t.norm(p, 1), lambda t: t.norm(p, 1), [a], "ab", "even")
    check_against_torch(lambda t: t.norm(p), lambda t: t.norm(p), [a], "ab", "ragged")
    x = tg.from_numpy(np.zeros((2, 3)), tiles=(1, 2))
    (g,) = tg.grad(x.norm(p), [x])
    assert np.array_equal(g.numpy(), np.zeros((2, 3)))  # 0, not NaN


def test_float16_norm_is_computed_in_float32_as_torchs():
    a = np.full((4, 3), 300.0, np.float16)  # its squares overflow float16
    t = torch.tensor(a)
    for p in (2, 1, math.inf):
        got = tg.from_numpy(a, tiles=(3, 2)).norm(p, 0)
        assert got.dtype == np.float16
        np.testing.assert_array_equal(got.numpy(), torch.norm(t, p, 0).numpy())
    got = tg.norm(tg.from_numpy(np.ones(3, np.float32)), dtype=np.float64)
    assert got.dtype == np.float64 and got.numpy() == np.sqrt(3.0)


@pytest.mark.parametrize("call, what", [
    (lambda x: x.norm(3), "[tilegraph.TileTensor.norm] p must be 2 (or 'fro'), 1 or inf (float('inf')); other orders "
                          "(0, -inf, 3, 'nuc', ...) are not supported; received: p=3"),
    (lambda x: tg.norm(x, 0), "[tilegraph.norm] p must be 2 (or 'fro'), 1 or inf"),
    (lambda x: tg.norm(x, -math.inf), "received: p=-inf"),
    (lambda x: tg.norm(x, "nuc"), "received: p='nuc'"),
    (lambda x: tg.norm(x, True), "received: p=True"),
    (lambda x: x.norm(2, 2), "[tilegraph.TileTensor.norm] dim out of range for a 2-d tensor; received: 2"),
    (lambda x: x.norm(2, 0, keepdim="yes"), "[tilegraph.TileTensor.norm] keepdim must be a bool; received: 'yes'"),
    (lambda x: tg.norm(x.long()), "[tilegraph.norm] x must have a floating dtype (cast it first: x.float(), or pass "
                                  "dtype=); received: int64"),
    (lambda x: tg.norm(x, dtype=np.int32), "[tilegraph.norm] dtype must be a floating dtype"),
    (lambda x: tg.norm(x, out=np.zeros(())), "[tilegraph.norm] out= is not supported"),
])
def test_bad_norms_are_named(call, what):
    _named(call, tg.from_numpy(np.ones((3, 4)), tiles=2), what)


# ------------------------------------------------------------- sum / mean: dtype=, NumPy's out= ----
@by_mode
@by_dtype
@pytest.mark.parametrize("how", ["sum", "mean"])
def test_sum_and_mean_dtype_cast_first_as_torch(rng, mode, dtype, how):
    x = randn(rng, 6, 7, dtype=dtype)
    for to, tto in ((np.float64, torch.float64), (np.float32, torch.float32)):
        out = check_against_torch(lambda t: getattr(t, how)(1, dtype=to), lambda t: getattr(t, how)(1, dtype=tto), [x],
                                  "ab", mode)
        assert out.dtype == to
    check_against_torch(lambda t: getattr(tg, how)(t, dtype="float64"), lambda t: getattr(t, how)(dtype=torch.float64),
                        [x], "ab", mode)


@pytest.mark.parametrize("call", [
    lambda a: np.sum(a), lambda a: np.mean(a), lambda a: np.sum(a, axis=1), lambda a: np.mean(a, axis=(0, 2)),
    lambda a: np.sum(a, axis=0, keepdims=True), lambda a: np.mean(a, -1, keepdims=True),
    lambda a: np.sum(a, dtype=np.float64), lambda a: np.mean(a, axis=1, dtype=np.float64),
    lambda a: np.sum(a.astype(np.int8) if isinstance(a, np.ndarray) else a.to(np.int8), dtype=np.int8),
    lambda a: np.mean(a.astype(np.int32) if isinstance(a, np.ndarray) else a.to(np.int32)),
])
def test_numpys_sum_and_mean_call_the_tensors_own(rng, call):
    a = (rng.standard_normal((4, 5, 6)) * 3).astype(np.float32)
    got = call(tg.from_numpy(a, tiles=(3, 2, 4)))
    assert isinstance(got, tg.TileTensor)  # still symbolic: np.sum(x) records, it does not compute
    want = call(a)
    value = got.numpy()
    assert value.dtype == want.dtype and value.shape == np.shape(want)
    np.testing.assert_allclose(value, want, rtol=1e-5, atol=1e-4)


def test_a_float16_sum_with_its_own_dtype_accumulates_in_float32():
    a = np.full(4096, 30.0, np.float16)
    x = tg.from_numpy(a, tiles=1000)
    assert x.mean(dtype=np.float16).numpy() == np.float16(30.0)  # a float16 running sum would overflow
    assert np.sum(x, dtype=np.float32).numpy() == np.float32(4096 * 30)
    np.testing.assert_array_equal(x.sum(dtype=np.float16).numpy(), torch.tensor(a).sum(dtype=torch.float16).numpy())


@pytest.mark.parametrize("call, what", [
    (lambda x: np.sum(x, out=np.zeros(())), "[tilegraph.sum] out= is not supported: a TileTensor is never written in "
                                            "place; use the returned tensor (out=None, as np.sum and np.mean pass "
                                            "it, is accepted); received: out=ndarray"),
    (lambda x: np.mean(x, out=np.zeros(())), "[tilegraph.mean] out= is not supported"),
    (lambda x: x.sum(out=x), "[tilegraph.sum] out= is not supported"),
    (lambda x: x.mean(dtype=np.int64), "[tilegraph.mean] dtype must be a floating dtype (as torch requires of a mean "
                                       "or a norm); received: int64"),
    (lambda x: tg.sum(x, dtype="complex64"), "[tilegraph.sum] expected a bool, integer or float dtype; "
                                             "received: complex64"),
    (lambda x: x.sum(dtype=5), "[tilegraph.sum] expected a dtype"),
    (lambda x: x.sum(dim=0, axis=1), "[tilegraph.sum] pass dim= or axis= (the same parameter), not both"),
])
def test_bad_sums_are_named(call, what):
    _named(call, tg.from_numpy(np.ones((3, 4)), tiles=2), what)


# ------------------------------------------------------------------------ on a cluster, GPU ----
def test_the_new_ops_run_on_the_cluster_and_on_emulated_gpu_workers():
    old = tg.config.gpu_array_module, tg.config.placement
    tg.config.gpu_array_module = "numpy"
    try:
        a = np.random.default_rng(0).standard_normal((40, 1, 24))
        x = tg.from_numpy(a, tiles=(16, 1, 10))
        y = x.expand(-1, 3, -1).cumsum(2) * tg.full((40, 3, 24), 0.5, tiles=(16, None, 10), dtype=np.float64)
        loss = y.norm() + np.mean(y, dtype=np.float64) + tg.zeros_like(y).sum()
        (g,) = tg.grad(loss, [x])
        t = torch.tensor(a, requires_grad=True)
        ty = t.expand(-1, 3, -1).cumsum(2) * 0.5
        t_loss = ty.norm() + ty.mean()
        t_loss.backward()
        with tg.connect(n_workers=1, gpu=1, threads_per_worker=1, dashboard=False, quiet=True):
            for placement in ("cpu", "gpu"):
                tg.config.placement = placement
                got_loss, got_g = tg.compute(loss, g)
                np.testing.assert_allclose(got_loss, t_loss.item(), rtol=1e-12)
                np.testing.assert_allclose(got_g, t.grad.numpy(), rtol=1e-10, atol=1e-12)
    finally:
        tg.config.gpu_array_module, tg.config.placement = old


def test_numpys_initial_and_where_are_named_and_a_0d_tensor_takes_dim_minus_1():
    """``np.sum(x, initial=1)`` was Python's TypeError (an unexpected keyword argument); a sum
    over dim 0 of a 0-d tensor was an IndexError, and dim -1 refused (torch takes both)."""
    x = tg.from_numpy(np.ones((3, 4)), tiles=2)
    for call, given in ((lambda: np.sum(x, initial=1.0), "initial=1.0"),
                        (lambda: np.mean(x, where=np.ones((3, 4), bool)), "where=array(")):
        with pytest.raises(tg.TileError) as info:
            call()
        assert str(info.value).startswith("[tilegraph.TileTensor.") and "initial= and where= (not supported" in \
            str(info.value) and f"received: {given}" in str(info.value), str(info.value)
    s = tg.from_numpy(np.array(2.5))
    for dim in (0, -1):
        assert s.sum(dim).numpy() == 2.5 and s.mean(dim, keepdim=True).numpy() == 2.5
    with pytest.raises(tg.TileError, match=r"dim out of range for a 0-d tensor \(0 or -1\); received: -2"):
        s.sum(-2)


def test_a_0d_tensor_takes_dim_0_and_minus_1_as_in_torch():
    """torch reads dims 0 and -1 of a 0-d tensor as its one place: reductions, scans, squeeze and
    transpose take both (squeeze and transpose raised IndexError), other dims are refused."""
    import torch

    x = tg.from_numpy(np.array(2.5, dtype=np.float32))
    t = torch.tensor(2.5)
    for dim in (0, -1):
        for ours, theirs in ((tg.sum(x, dim=dim), t.sum(dim)), (tg.cumsum(x, dim), torch.cumsum(t, dim)),
                             (tg.squeeze(x, dim), t.squeeze(dim)), (tg.transpose(x, 0, dim), t.transpose(0, dim)),
                             (tg.max(x, dim)[0], t.max(dim)[0])):
            assert ours.shape == tuple(theirs.shape)
            np.testing.assert_allclose(ours.numpy(), theirs.numpy())
    for dim in (1, -2):
        with pytest.raises(tg.TileError, match=rf"dim out of range for a 0-d tensor.*received: {dim}"):
            tg.sum(x, dim=dim)
        with pytest.raises(tg.TileError, match=rf"dim out of range for a 0-d tensor; received: {dim}"):
            tg.squeeze(x, dim)
        with pytest.raises(IndexError):
            t.squeeze(dim)
