"""A PyTorch user writing a model with tilegraph, second pass: torch names that were an
AttributeError (tg.exp, tg.cat, x.unsqueeze, x.float(), x.max(dim), x.var, nn.Sequential,
nn.Dropout, ...) or a bare TypeError (x > 0). Each is checked against torch (forward and gradients,
float32 and float64, over single, even and ragged tilings, as tests/test_torch_names.py does)."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn

torch = pytest.importorskip("torch")


# ------------------------------------------------------------- exp / log / tanh / sigmoid ----
@by_mode
@by_dtype
@pytest.mark.parametrize("name", ["exp", "log", "tanh", "sigmoid"])
def test_exp_log_tanh_sigmoid_were_missing_now_match_torch(rng, mode, dtype, name):
    x = randn(rng, 5, 7, dtype=dtype)
    if name == "log":
        x = np.abs(x) + 0.1
    check_against_torch(lambda x: getattr(tg, name)(x), lambda x: getattr(torch, name)(x), [x], "ab", mode)
    check_against_torch(lambda x: getattr(x, name)(), lambda x: getattr(x, name)(), [x], "ab", mode)


@by_dtype
def test_sigmoid_exp_log_at_extremes_as_torch(dtype):
    a = np.array([-1000.0, -50.0, -1.0, 0.0, 1.0, 50.0, 1000.0], dtype)
    x = tg.from_numpy(a, 3)
    t = torch.tensor(a)
    np.testing.assert_allclose(tg.sigmoid(x).numpy(), torch.sigmoid(t).numpy(), rtol=1e-6, atol=0)
    np.testing.assert_array_equal(tg.exp(x).numpy()[[0, -1]], [0.0, np.inf])
    logs = tg.log(tg.from_numpy(np.array([0.0, -1.0, 1.0], dtype))).numpy()
    assert logs[0] == -np.inf and np.isnan(logs[1]) and logs[2] == 0.0


def test_unary_ops_name_a_wrong_input():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.exp\] x must be a TileTensor; received: ndarray"):
        tg.exp(np.ones(3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.relu\] x must be a TileTensor"):
        tg.relu(np.ones(3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.log\] input must have a floating dtype; received: int64"):
        tg.from_numpy(np.arange(3)).log()


# ---------------------------------------------------------------------------- cat / stack ----
@by_mode
@by_dtype
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cat_was_missing_now_matches_torch(rng, mode, dtype, dim):
    shapes = {0: [(4, 6), (3, 6), (5, 6)], 1: [(5, 4), (5, 7), (5, 1)], -1: [(5, 4), (5, 7), (5, 1)]}[dim]
    arrays = [randn(rng, *s, dtype=dtype) for s in shapes]
    labels = ["ab", "cb", "db"] if dim == 0 else ["ab", "ac", "ad"]  # the cat dim's tiles may differ
    out = check_against_torch(lambda *t: tg.cat(t, dim), lambda *t: torch.cat(t, dim), arrays, ",".join(labels),
                              mode)
    assert out.ntiles == len(arrays) or mode != "single"  # one tile per input


def test_cat_reuses_the_input_tiles_without_a_kernel(rng):
    a, b = tg.from_numpy(randn(rng, 4, 6), (3, 2)), tg.from_numpy(randn(rng, 5, 6), (2, 2))
    c = tg.cat([a, b])
    assert c.chunks == ((3, 1, 2, 2, 1), (2, 2, 2))
    assert c.grid[0, 0] is a.grid[0, 0] and c.grid[2, 1] is b.grid[0, 1]
    assert tg.compile([c]).n_nodes == 0
    assert tg.cat([a]) is a


@by_mode
@by_dtype
@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stack_was_missing_now_matches_torch(rng, mode, dtype, dim):
    arrays = [randn(rng, 5, 6, dtype=dtype) for _ in range(3)]
    check_against_torch(lambda *t: tg.stack(t, dim), lambda *t: torch.stack(t, dim), arrays, "ab,ab,ab", mode)


def test_cat_and_stack_errors_name_the_tensor_and_dim(rng):
    a = tg.from_numpy(randn(rng, 4, 6), (2, 3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cat\] tensors must have the same size in every dim but "
                                           r"dim 0; received: shapes \(4, 6\) \(tensors\[0\]\) and \(4, 5\) "
                                           r"\(tensors\[1\]\) differ in dim 1"):
        tg.cat([a, tg.from_numpy(np.zeros((4, 5)))])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cat\] tensors must have the same tiles in every dim but "
                                           r"dim 0 .*received: tiles \(3, 3\) \(tensors\[0\]\) and \(6,\)"):
        tg.cat([a, tg.from_numpy(np.zeros((4, 6)))])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cat\] tensors must share one dtype"):
        tg.cat([a, tg.from_numpy(np.zeros((4, 6), np.float32), (2, 3))])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cat\] tensors must be a non-empty list"):
        tg.cat(a)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cat\] tensors\[1\] must be a TileTensor"):
        tg.cat([a, np.zeros((4, 6))])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cat\] dim out of range for a 2-d tensor"):
        tg.cat([a, a], 2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.stack\] tensors must all have one shape"):
        tg.stack([a, tg.from_numpy(np.zeros((4, 5)))])


# ------------------------------------------------------- unsqueeze / squeeze / flatten ----
@by_mode
@by_dtype
def test_unsqueeze_squeeze_flatten_were_missing_now_match_torch(rng, mode, dtype):
    x = randn(rng, 6, 1, 5, 4, dtype=dtype)
    for fn in (lambda x: x.unsqueeze(0), lambda x: x.unsqueeze(-1), lambda x: x.unsqueeze(2),
               lambda x: x.squeeze(), lambda x: x.squeeze(1), lambda x: x.squeeze(0), lambda x: x.squeeze((1, 3)),
               lambda x: x.flatten(), lambda x: x.flatten(1), lambda x: x.flatten(0, 1), lambda x: x.flatten(2, 3)):
        check_against_torch(fn, fn, [x], "aBCD", mode)
    check_against_torch(lambda x: tg.unsqueeze(x, 1), lambda x: torch.unsqueeze(x, 1), [x], "abcd", mode)


def test_flatten_and_unsqueeze_errors_name_the_method(rng):
    t = tg.from_numpy(randn(rng, 4, 6), (2, 3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.flatten\] reshape is not tile-compatible"):
        t.flatten()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.unsqueeze\] dim out of range for a 3-d"):
        t.unsqueeze(3)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.flatten\] start_dim must not come after"):
        t.flatten(1, 0)


# ------------------------------------------------------------------------------ casts ----
@by_mode
@pytest.mark.parametrize("method", ["float", "double", "half"])
@by_dtype
def test_float_double_half_casts_were_missing_gradient_cast_back(rng, mode, method, dtype):
    x = randn(rng, 5, 7, dtype=dtype)
    # the result's dtype is torch's; the gradient arrives in x's dtype
    check_against_torch(lambda x: getattr(x, method)().double(), lambda x: getattr(x, method)().double(), [x],
                        "ab", mode)


def test_to_takes_numpy_names_and_torch_dtypes_and_refuses_a_device():
    a = np.arange(6).reshape(2, 3)
    x = tg.from_numpy(a, (1, 2))
    for dt in (np.float32, "float32", torch.float32, np.dtype("float32")):
        y = x.to(dt)
        assert y.dtype == np.float32 and y.chunks == x.chunks
        np.testing.assert_array_equal(y.numpy(), a.astype(np.float32))
    f = x.double()
    assert f.double() is f and f.long().dtype == np.int64
    w = tg.nn.Linear(3, 2, tile=2, dtype=np.float64, seed=0).weight
    (g,) = tg.grad((f @ w).float().sum(), [w])  # through the cast: float64 again
    assert g.dtype == np.float64
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.to\] expected a dtype .* a device is not given "
                                           r"here .*; received: 'cuda'"):
        x.to("cuda")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cast\] expected a dtype"):
        tg.cast(x, None)


# --------------------------------------------------------------------- max / min (dim) ----
@by_mode
@by_dtype
@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("keepdim", [False, True])
def test_max_min_along_a_dim_were_missing_now_match_torch(rng, mode, dtype, name, dim, keepdim):
    x = randn(rng, 6, 37, 5, dtype=dtype)
    check_against_torch(lambda x: getattr(x, name)(dim, keepdim).values,
                        lambda x: getattr(x, name)(dim, keepdim).values, [x], "abc", mode)
    t = tg.from_numpy(x, (2, 2, 2) if mode == "even" else None)  # 19 tiles along dim 1: a merge tree
    got = getattr(tg, name)(t, dim, keepdim=keepdim)
    want = getattr(torch, name)(torch.tensor(x), dim, keepdim=keepdim)
    np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
    assert got.indices.dtype == np.int64 and got[0] is got.values


def test_max_ties_nan_whole_tensor_and_integers_as_torch():
    a = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [np.nan, 2.0, 5.0, np.nan, 1.0]])
    x = tg.from_numpy(a, (1, 2))
    v, i = x.max(1)
    np.testing.assert_array_equal(i.numpy(), [1, 0])  # the first of equal values, NaN counts as largest
    assert v.numpy()[0] == 3.0 and np.isnan(v.numpy()[1])
    (g,) = tg.grad((x.max(1).values * tg.from_numpy(np.array([1.0, 0.0]), 1)).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0]])  # to the index, as torch
    b = np.arange(20.0).reshape(4, 5) % 7
    y = tg.from_numpy(b, (3, 2))
    assert y.max().shape == () and y.max().item() == 6.0 and y.min().item() == 0.0
    (g,) = tg.grad(y.max(), [y])
    np.testing.assert_array_equal(g.numpy(), (b == 6.0) / 2)  # 6 occurs twice: each gets half, as torch
    ids = tg.from_numpy(np.array([[3, 9, 1]]), (1, 2))
    assert ids.max(1).values.dtype == np.int64 and ids.max(1).indices.numpy().tolist() == [1]


@pytest.mark.parametrize("name", ["max", "min"])
@pytest.mark.parametrize("tiles", [None, (2, 3)])
@pytest.mark.parametrize("case", ["ties", "nan", "distinct", "all-equal", "0-d"])
def test_whole_tensor_max_min_share_the_gradient_of_ties_as_torch(name, tiles, case):
    """x.max() without a dim: torch shares the gradient evenly by the elements equal to the result
    (a NaN result: by the NaNs); it went to the first of them only."""
    a = {"ties": np.array([[1.0, 3.0, 3.0], [0.0, 0.5, 3.0], [-1.0, 0.5, 0.0]]),
         "nan": np.array([[1.0, np.nan, 3.0], [np.nan, 0.5, 2.0], [0.0, 0.0, 0.0]]),
         "distinct": np.random.default_rng(0).standard_normal((3, 3)),
         "all-equal": np.full((3, 3), 2.0), "0-d": np.array(4.0)}[case]
    x = tg.from_numpy(a, tiles if a.ndim else None)
    v = getattr(x, name)()
    (g,) = tg.grad(v * 3.0, [x])
    t = torch.tensor(a, requires_grad=True)
    want = getattr(t, name)()
    (want * 3.0).backward()
    np.testing.assert_array_equal(v.numpy(), want.detach().numpy())
    np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=1e-15)


def test_max_errors_are_named():
    x = tg.from_numpy(np.ones((2, 3)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.max\] the element-wise maximum or minimum of two tensors"):
        tg.max(x, x)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.min\] dim out of range"):
        x.min(2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.max\] keepdim must be a bool"):
        x.max(0, "yes")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.max\] the maximum or minimum of no elements"):
        tg.max(tg.from_numpy(np.ones((0, 3))), 1)


# ------------------------------------------------------------------------- var / std ----
@by_mode
@by_dtype
@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize("kw", [{}, {"dim": 1}, {"dim": (0, 2), "keepdim": True}, {"dim": -1, "unbiased": False},
                                {"dim": 0, "correction": 0}, {"dim": 1, "correction": 2}], ids=str)
def test_var_std_were_missing_now_match_torch(rng, mode, dtype, name, kw):
    x = randn(rng, 5, 7, 6, dtype=dtype)
    check_against_torch(lambda x: getattr(x, name)(**kw), lambda x: getattr(x, name)(**kw), [x], "abc", mode)
    check_against_torch(lambda x: getattr(tg, name)(x, **kw), lambda x: getattr(torch, name)(x, **kw), [x], "abc",
                        mode)


def test_var_edge_cases_and_errors():
    x = tg.from_numpy(np.ones((3, 1)))
    assert np.isnan(x.var(1).numpy()).all()  # one element, correction 1: NaN, as torch
    assert (x.var(1, unbiased=False).numpy() == 0).all()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.var\] pass unbiased= or correction=, not both"):
        x.var(0, True, correction=1)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.std\] correction must be a number >= 0"):
        tg.std(x, 0, correction=-1)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.var\] x must have a floating dtype"):
        tg.var(tg.from_numpy(np.arange(3)))


# ------------------------------------------------------- nn.Sequential and activation modules ----
def test_sequential_and_activation_modules_were_missing_now_match_torch(rng):
    acts = [(tg.nn.ReLU(), torch.nn.ReLU()), (tg.nn.GELU(), torch.nn.GELU()),
            (tg.nn.GELU("tanh"), torch.nn.GELU("tanh")), (tg.nn.Tanh(), torch.nn.Tanh()),
            (tg.nn.Sigmoid(), torch.nn.Sigmoid()), (tg.nn.SiLU(), torch.nn.SiLU()),
            (tg.nn.Identity(54, unused="x"), torch.nn.Identity(54, unused="x")),
            (tg.nn.Dropout(0.3), torch.nn.Dropout(0.3))]  # eval mode: no dropout
    x = randn(rng, 6, 6)
    for act, ref_act in acts:
        net = tg.nn.Sequential(tg.nn.Linear(6, 6, tile=3, dtype=np.float64, seed=0), act,
                               tg.nn.Linear(6, 3, tile=3, dtype=np.float64, seed=1))
        ref = torch.nn.Sequential(torch.nn.Linear(6, 6), ref_act, torch.nn.Linear(6, 3)).double().eval()
        assert list(net.state_dict()) == [k for k in ref.state_dict()]  # torch's names: 0.weight, ...
        ref.load_state_dict({k: torch.tensor(v.T if v.ndim == 2 else v) for k, v in net.state_dict().items()})
        assert net.parameters() and len(net) == 3 and net[1] is act and isinstance(net[1:], tg.nn.Sequential)
        out = net(tg.from_numpy(x, (4, 3)))
        (g,) = tg.grad((out * out).sum(), [net[0].weight])
        r = ref(torch.tensor(x))
        (r * r).sum().backward()
        np.testing.assert_allclose(out.numpy(), r.detach().numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(g.numpy(), ref[0].weight.grad.numpy().T, rtol=1e-10, atol=1e-12)


def test_sequential_and_module_arguments_are_checked():
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Sequential\] every argument must be a tilegraph.nn.Module "
                                           r"\(for the function tg.relu, a module such as tg.nn.ReLU\(\)\); "
                                           r"received: argument 1"):
        tg.nn.Sequential(tg.nn.Linear(2, 2), tg.relu)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Dropout\] p must be a number in \[0, 1\)"):
        tg.nn.Dropout(1.5)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Dropout\] inplace=True is not supported"):
        tg.nn.Dropout(0.1, True)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.GELU\] approximate must be 'none' or 'tanh'"):
        tg.nn.GELU("fast")


# ------------------------------------------------------------------------ nn.Dropout ----
def test_dropout_module_draws_a_new_mask_each_replayed_training_step():
    """nn.Dropout was missing; a step graph is recorded once and replayed, so a mask drawn while
    recording (or from a fixed int seed) would repeat every step: the module seeds each run from
    its input, so the replayed steps keep other elements."""
    lin = tg.nn.Linear(16, 16, bias=False, tile=8, dtype=np.float64, seed=0)
    lin.weight.assign(np.eye(16))
    net = tg.nn.Sequential(lin, tg.nn.Dropout(0.5))
    step = tg.TrainStep(net, tg.optim.SGD(net.parameters(), lr=0.0), lambda m, x: m(x).sum(),
                        batch_tiles=[(4, 8)])
    kept = []
    for i in range(4):  # loss / c = 2 x (elements kept): the mask's count, step by step
        c = float(i + 1)
        kept.append(round(float(step(np.full((8, 16), c))) / (2 * c)))
    assert len(set(kept)) > 1, kept
    assert all(30 < k < 98 for k in kept), kept
    # outside a step: eval mode returns the input itself; train() drops out
    x = tg.from_numpy(np.ones((8, 16)), (4, 8))
    assert net[1](x) is x
    net.train()
    y = net[1](x).numpy()
    assert set(np.unique(y)) == {0.0, 2.0}
    # two Dropouts at other places in a model (the same input) draw other masks; a place's mask
    # for a given input is the same each time, and seed= changes it
    two = _TwoDropouts().train()
    a, b = (t.numpy() for t in two(x))
    assert (a != b).any()
    np.testing.assert_array_equal(two(x)[0].numpy(), a)
    two.d1.seed = 1
    assert (two(x)[0].numpy() != a).any()


def test_dropout_module_mask_is_the_same_when_tg_checkpoint_recomputes_it(rng):
    lin = tg.nn.Linear(8, 8, tile=4, dtype=np.float64, seed=0)
    net = tg.nn.Sequential(lin, tg.nn.Dropout(0.5), tg.nn.Tanh()).train()
    x = tg.from_numpy(randn(rng, 6, 8), (3, 4))
    (plain,) = tg.grad(net(x).sum(), [lin.weight])
    (again,) = tg.grad(tg.checkpoint(net, x).sum(), [lin.weight])
    np.testing.assert_array_equal(again.numpy(), plain.numpy())


class _TwoDropouts(tg.nn.Module):
    def __init__(self):
        self.d1, self.d2 = tg.nn.Dropout(0.5), tg.nn.Dropout(0.5)

    def forward(self, x):
        return self.d1(x), self.d2(x)


# ---------------------------------------------------------------------- comparisons ----
def test_comparisons_are_bool_tensors_and_an_array_operand_is_named():
    a = np.array([[0.5, 1.0, 2.0], [1.0, -1.0, 1.5]])
    x = tg.from_numpy(a, tiles=(1, 2))
    for got, want in ((x > 1, a > 1), (1 < x, a > 1), (x <= x, a <= a), (x >= 1.5, a >= 1.5), (x.eq(1.0), a == 1),
                      (x.ne(x), a != a)):
        assert got.dtype == np.bool_ and np.array_equal(got.numpy(), want)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.__gt__\] a TileTensor or a real number to "
                                           r"compare with \(wrap a NumPy array with tg.from_numpy\)"):
        np.zeros((2, 3)) < x
    x = tg.from_numpy(np.ones((2, 3)))
    assert (x == x) is True and (x == tg.from_numpy(np.ones((2, 3)))) is False and len({x, x}) == 1
