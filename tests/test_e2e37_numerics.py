"""End-to-end audit of the tensor ops a PyTorch user relies on, at their edges: each test is a
defect found by using tilegraph as a torch user would, checked against torch (forward and
gradients, over single, even and ragged tilings where tiles matter)."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for

torch = pytest.importorskip("torch")
F = torch.nn.functional


# ---------------------------------------------------------- cross_entropy with masked classes ----
@by_mode
@by_dtype
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_with_a_vocab_tile_all_minus_inf_is_torchs(rng, mode, dtype, reduction):
    """Logits of padded (or banned) classes set to -inf: where a row's vocab tile held nothing
    else, its statistics were exp(-inf - -inf) = NaN, and the loss and every gradient were NaN
    (torch's are finite). Classes 22.. are masked: the last vocab tile of the even (11) and
    ragged (14) tilings is all -inf."""
    x = randn(rng, 6, 33, dtype=dtype)
    x[:, 22:] = -np.inf
    t = rng.integers(0, 22, 6)
    t[2] = -100
    check_against_torch(lambda x, t: tg.cross_entropy(x, t, reduction=reduction),
                        lambda x, t: F.cross_entropy(x, t, reduction=reduction), [x, t], "bv,b", mode, grad_of=[0])


def test_cross_entropy_of_a_row_all_minus_inf_is_nan_as_torchs():
    x = np.zeros((2, 8))
    x[1] = -np.inf
    logits = tg.from_numpy(x, (1, 3))
    got = tg.cross_entropy(logits, np.array([1, 2]), reduction="none").numpy()
    want = F.cross_entropy(torch.tensor(x), torch.tensor([1, 2]), reduction="none").numpy()
    np.testing.assert_allclose(got, want)  # [log 8, nan]
    assert np.isnan(got[1])


# ------------------------------------------------------------------------------- std / var ----
@by_mode
@by_dtype
def test_std_gradient_where_the_variance_is_zero_is_torchs(rng, mode, dtype):
    """std of a constant row: the gradient of sqrt at 0 (inf) times deviations of 0 was NaN, and
    it reached the gradient of everything before it; torch's is 0."""
    x = randn(rng, 4, 7, dtype=dtype)
    x[1] = 2.5
    check_against_torch(lambda t: t.std(1), lambda t: t.std(1), [x], "ab", mode)
    check_against_torch(lambda t: tg.std(t, 1, keepdim=True) * 2.0, lambda t: t.std(1, keepdim=True) * 2.0, [x],
                        "ab", mode)
    check_against_torch(lambda t: t.std(0, correction=0), lambda t: t.std(0, correction=0), [x[[1, 1, 1]]], "ab",
                        mode)
    # one element with correction 1: NaN forward, as torch's (the NaN is kept)
    one = tg.from_numpy(x[:, :1])
    assert np.isnan(one.std(1).numpy()).all()


@by_mode
@pytest.mark.parametrize("name", ["var", "std"])
def test_float16_variance_of_values_far_from_zero_is_torchs(mode, name):
    """A float16 variance took deviations from the mean rounded to float16: values near 300 (a
    float16 step of 0.25) with a spread of 1 gave a variance 0.5% too large; torch computes it in
    float32 and rounds once."""
    h = (300.0 + np.random.default_rng(0).standard_normal((3, 1000))).astype(np.float16)
    x = tg.from_numpy(h, tiles_for(h.shape, "ab", mode))
    for kw in ({}, {"dim": 1}):
        got = getattr(x, name)(**kw)
        want = getattr(torch.tensor(h), name)(**kw)
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.double().numpy(), rtol=1e-3)
    (g,) = tg.grad(getattr(x, name)(1).sum(), [x])  # the gradient comes back as float16
    assert g.dtype == np.float16 and np.isfinite(g.numpy()).all()


# ------------------------------------------------------------------ where / masked_fill dtypes ----
def test_where_of_an_integer_tensor_and_a_fraction_is_float_as_numpys():
    """tg.where(ids > 1, ids, 0.5) cut 0.5 to 0 in the integer dtype (NumPy and torch give floats)."""
    a = np.array([1, 2, 3])
    i = tg.from_numpy(a, 2)
    for got, want in ((tg.where(i > 1, i, 0.5), np.where(a > 1, a, 0.5)),
                      (tg.where(i > 1, 2.0, i), np.where(a > 1, 2.0, a)),
                      (tg.where(i > 1, i, -7), np.where(a > 1, a, -7)),
                      (tg.where(i > 1, i > 2, 5), np.where(a > 1, a > 2, 5))):
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        np.testing.assert_array_equal(got.numpy(), want)
    # the float result differentiates; the integer branch takes no gradient
    x = tg.from_numpy(np.array([0.3, 1.7, 2.2]))
    y = tg.where(x.long() > 1, x.long(), 0.5) * x
    (g,) = tg.grad(y.sum(), [x])
    np.testing.assert_array_equal(g.numpy(), [0.5, 0.5, 2.0])  # where(long(x) > 1, long(x), 0.5)
    # masked_fill keeps x's dtype, as torch's (the fraction is cut there too)
    np.testing.assert_array_equal(i.masked_fill(i > 1, 0.5).numpy(),
                                  torch.tensor(a).masked_fill(torch.tensor(a > 1), 0.5).numpy())


def test_a_number_an_integer_tensor_cannot_hold_is_named_at_the_call():
    """It was NumPy's OverflowError from inside the 'where' kernel, when the graph ran."""
    mask = tg.from_numpy(np.array([True, False]))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.where\] a number that the int8 tensor holds "
                                           r"\(\[-128, 127\].*received: 300"):
        tg.where(mask, tg.from_numpy(np.ones(2, np.int8)), 300)
    u8 = tg.from_numpy(np.ones(2, np.uint8))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.masked_fill\] a number that the uint8 "
                                           r"tensor holds .*received: -1"):
        u8.masked_fill(mask, -1)
    with pytest.raises(tg.TileError, match=r"received: nan"):
        tg.masked_fill(u8, mask, float("nan"))
    np.testing.assert_array_equal(u8.masked_fill(mask, 255).numpy(), [255, 1])


# ------------------------------------------------------------------------- functional dropout ----
class _FunctionalDropout(tg.nn.Module):
    def __init__(self, seed=None):
        self.lin = tg.nn.Linear(16, 16, bias=False, tile=8, dtype=np.float64, seed=0)
        self.lin.weight.assign(np.eye(16))
        self.seed = seed

    def forward(self, x):
        kw = {} if self.seed is None else {"seed": self.seed}
        return tg.dropout(self.lin(x), 0.5, self.training, **kw)


def _kept_per_step(net) -> list:
    step = tg.TrainStep(net, tg.optim.SGD(net.parameters(), lr=0.0), lambda m, x: m(x).sum(), batch_tiles=[(4, 8)])
    return [round(float(step(np.full((8, 16), float(c)))) / (2 * c)) for c in (1, 2, 3, 4)]


def test_functional_dropout_draws_a_new_mask_each_replayed_step():
    """tg.dropout(x, p, self.training), as a torch module calls F.dropout, had a fixed seed of 0:
    every replayed step (and every call on a tensor of that shape) dropped the same elements."""
    kept = _kept_per_step(_FunctionalDropout())
    assert len(set(kept)) > 1, kept
    assert all(30 < k < 98 for k in kept), kept
    fixed = _kept_per_step(_FunctionalDropout(seed=0))  # an int seed still gives one mask, as documented
    assert len(set(fixed)) == 1, fixed
    # outside a step: the same input gives the same mask, another input another one
    x = tg.from_numpy(np.ones((8, 16)), (4, 8))
    a = tg.dropout(x, 0.5).numpy()
    np.testing.assert_array_equal(tg.dropout(x, 0.5).numpy(), a)
    assert ((tg.dropout(x * 3.0, 0.5).numpy() == 0) != (a == 0)).any()


class _DropoutThenTanh(tg.nn.Module):
    def __init__(self):
        self.lin = tg.nn.Linear(8, 8, tile=4, dtype=np.float64, seed=0)

    def forward(self, x):
        return tg.dropout(self.lin(x), 0.5, self.training).tanh()


def test_functional_dropout_mask_is_the_same_when_tg_checkpoint_recomputes_it(rng):
    net = _DropoutThenTanh().train()
    x = tg.from_numpy(randn(rng, 6, 8), (3, 4))
    (plain,) = tg.grad(net(x).sum(), [net.lin.weight])
    (again,) = tg.grad(tg.checkpoint(net, x).sum(), [net.lin.weight])
    np.testing.assert_array_equal(again.numpy(), plain.numpy())


# ------------------------------------------------------------------ in-place forms a torch user writes ----
def test_augmented_assignment_to_a_parameter_is_named_not_a_silent_loss_of_the_parameter():
    """model.fc.weight *= 0.5 (torch scales a weight in place) rebound the module's attribute to
    a plain tensor: the module lost its weight (not trained, not in state_dict) without a word."""
    lin = tg.nn.Linear(3, 2, dtype=np.float64, seed=0)
    w = lin.weight
    for op in ("lin.weight *= 0.5", "lin.weight += 1", "lin.weight -= 1", "lin.weight /= 2"):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Parameter.__i\w+__\] p .= \.\.\. would replace the "
                                               r"Parameter .*p.assign\(array\)"):
            exec(op, {"lin": lin})
    assert lin.weight is w and sorted(lin.state_dict()) == ["bias", "weight"]
    # a plain tensor: x += y is x = x + y (a new tensor; another name for the old x keeps its value)
    x = tg.from_numpy(np.arange(4.0), 3)
    y = x
    x += 1
    x *= 2
    assert x is not y
    np.testing.assert_array_equal(x.numpy(), [2.0, 4.0, 6.0, 8.0])
    np.testing.assert_array_equal(y.numpy(), [0.0, 1.0, 2.0, 3.0])


def test_item_assignment_is_a_tile_error_naming_where_and_masked_fill():
    x = tg.from_numpy(np.zeros((2, 3)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.__setitem__\] .*never changed in place.*"
                                           r"tg.where\(mask, value, x\)"):
        x[0, 1] = 5.0


# ------------------------------------------------------------------- float64 activations and NaN ----
@pytest.mark.parametrize("name", ["gelu_tanh", "gelu", "silu"])
def test_float64_activations_of_nan_are_nan_as_torchs(name):
    """A NaN (a diverged step) in a float64 tanh-GELU or SiLU raised ZeroDivisionError in the
    Numba kernel (fastmath assumed no NaN) instead of giving NaN."""
    fn, tfn = {"gelu_tanh": (lambda t: tg.gelu(t, "tanh"), lambda t: F.gelu(t, approximate="tanh")),
               "gelu": (tg.gelu, F.gelu), "silu": (tg.silu, F.silu)}[name]
    a = np.array([np.nan, -np.inf, -3.0, 0.0, 2.0, np.inf])
    x = tg.from_numpy(a, 4)
    y = fn(x)
    (g,) = tg.grad((y * tg.from_numpy(np.array([1.0, 0.0, 1.0, 1.0, 1.0, 0.0]), 4)).sum(), [x])
    t = torch.tensor(a, requires_grad=True)
    ty = tfn(t)
    (ty * torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)).sum().backward()
    got_y, got_g = tg.compute(y, g)
    np.testing.assert_allclose(got_y[:5], ty.detach().numpy()[:5], rtol=1e-12)  # (torch: GELU(inf) is NaN)
    np.testing.assert_allclose(got_g[[0, 2, 3, 4]], t.grad.numpy()[[0, 2, 3, 4]], rtol=1e-12)
    assert np.isnan(got_y[0]) and np.isnan(got_g[0])


# -------------------------------------------------------------------------- softmax, empty dim ----
@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
def test_softmax_over_an_empty_dim_is_empty_as_torchs(fn):
    """Attention over no keys: NumPy's ValueError (zero-size array to reduction operation
    maximum) from the kernel, where torch returns the empty tensor."""
    x = tg.from_numpy(np.zeros((4, 0, 3)), (2, None, 2))
    y = getattr(tg, fn)(x, 1)
    (g,) = tg.grad(y.sum(), [x])
    got, gg = tg.compute(y, g)
    assert got.shape == gg.shape == tuple(getattr(torch, fn)(torch.zeros(4, 0, 3), 1).shape)


# ------------------------------------------------------------------------------ logical ops ----
@by_mode
def test_masks_combine_with_and_or_xor_not_as_torchs(rng, mode):
    """(x > 0) & (x < 1), a causal mask & a padding mask: TypeError (unsupported operand) before."""
    a, b = randn(rng, 5, 7), randn(rng, 7)
    sizes: dict = {}
    x = tg.from_numpy(a, tiles_for(a.shape, "ab", mode, sizes))
    y = tg.from_numpy(b, tiles_for(b.shape, "b", mode, sizes))
    ta, tb = torch.tensor(a), torch.tensor(b)
    cases = [((x > 0) & (x < 1), (ta > 0) & (ta < 1)), ((x > 0) | (y > 0), (ta > 0) | (tb > 0)),
             ((x > 0) ^ (y > 0), (ta > 0) ^ (tb > 0)), (~(x > 0), ~(ta > 0)), ((x > 0) & True, (ta > 0) & True),
             (False | (y > 0), False | (tb > 0)), ((x > 0).logical_not(), (ta > 0).logical_not()),
             ((x > 0).logical_and(y < 0), (ta > 0).logical_and(tb < 0)),
             ((x > 0).logical_or(y < 0), (ta > 0).logical_or(tb < 0)),
             ((x > 0).logical_xor(y < 0), (ta > 0).logical_xor(tb < 0)),
             (tg.logical_and(x > 0, y < 0), torch.logical_and(ta > 0, tb < 0)),
             (tg.logical_or(x > 0, True), torch.logical_or(ta > 0, torch.tensor(True))),
             (tg.logical_xor(y > 0, x < 0), torch.logical_xor(tb > 0, ta < 0)), (tg.logical_not(y > 0), tb <= 0)]
    for got, want in cases:
        assert got.dtype == np.bool_ and got.shape == tuple(want.shape)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    # a combined mask selects, and the gradient goes where it holds
    check_against_torch(lambda t: tg.where((t > 0) & (t < 1), t, 0.0), lambda t: torch.where((t > 0) & (t < 1), t, 0.0),
                        [a], "ab", mode)


def test_logical_ops_on_numbers_or_arrays_are_named():
    i = tg.from_numpy(np.arange(3))
    m = i > 0
    for call, got in ((lambda: i & i, "a: a int64 tensor"), (lambda: ~tg.from_numpy(np.ones(2)), "a: a float64 tensor"),
                      (lambda: m & 1, "b: int 1"), (lambda: m | np.ones(3, bool), "with tg.from_numpy")):
        with pytest.raises(tg.TileError, match=r"takes bool tensors \(masks.*bitwise ops on integers are not "
                                               r"supported") as e:
            call()
        assert got in str(e.value)


# --------------------------------------------------------------------------------- t and mT ----
@by_mode
def test_t_and_mT_as_torchs(rng, mode):
    check_against_torch(lambda t: t.t() * 2.0, lambda t: t.t() * 2.0, [randn(rng, 5, 7)], "ab", mode)
    check_against_torch(lambda t: t.mT, lambda t: t.mT, [randn(rng, 2, 5, 7)], "abc", mode)
    check_against_torch(lambda a, b: a @ b.mT, lambda a, b: a @ b.mT, [randn(rng, 2, 5, 7), randn(rng, 2, 3, 7)],
                        "bmk,bnk", mode)
    v = tg.from_numpy(np.arange(3.0))
    assert v.t() is v
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.t\] a tensor of at most 2 dims"):
        tg.from_numpy(np.ones((2, 3, 4))).t()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.mT\] a tensor of at least 2 dims"):
        v.mT  # noqa: B018


def test_matmul_of_a_0d_tensor_says_1_dim_as_torch():
    """The message said 'at least 2 dims', though a 1-d operand is a row or a column."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.matmul\] both operands need at least 1 dim"):
        tg.from_numpy(np.array(2.0)) @ tg.from_numpy(np.ones(3))


# ------------------------------------------------------------------- integer ** float exponent ----
def test_an_integer_tensor_to_a_float_power_is_float64_as_numpys():
    """ids ** 2.0 stayed int64 (NumPy and torch give floats; ids * 2.0 was float64 already), so
    ids ** 3.0 wrapped around past 2**63 and ids ** -1.0 failed inside the kernel (NumPy's
    'Integers to negative integer powers are not allowed')."""
    a = np.array([1, 2, 3_000_000])
    ids = tg.from_numpy(a, 2)
    for e in (2.0, 3.0, -1.0, 1.0, 0.0, np.float32(0.5), 2, 1, 0):
        got, want = ids ** e, a ** e
        assert got.dtype == want.dtype, (e, got.dtype, want.dtype)
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-15)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.pow\] an integer tensor to a negative integer power"):
        ids ** -1


# ---------------------------------------------------------------- cross_entropy class weights ----
def test_cross_entropy_class_weights_are_named_with_the_weighted_mean_to_write(rng):
    """torch's F.cross_entropy(x, t, w) bound w to ignore_index ('ignore_index must be an int'), and
    weight=w was Python's TypeError; the error now shows the weighted mean, which is torch's."""
    x, t, w = randn(rng, 6, 5), rng.integers(0, 5, 6), rng.random(5) + 0.5
    t[1] = -100
    logits = tg.from_numpy(x, (3, 2))
    for call in (lambda: tg.cross_entropy(logits, t, weight=w), lambda: tg.cross_entropy(logits, t, torch.tensor(w)),
                 lambda: tg.cross_entropy(logits, t, [1.0] * 5)):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.cross_entropy\] class weights \(torch's weight=.*not "
                                               r"supported: weight each row's loss instead"):
            call()
    w_rows = np.where(t == -100, 0.0, w[np.where(t == -100, 0, t)])  # the error's recipe
    got = (tg.cross_entropy(logits, t, reduction="none")
           * tg.from_numpy(w_rows.astype(logits.dtype), logits.chunks[:-1])).sum() / w_rows.sum()
    want = F.cross_entropy(torch.tensor(x), torch.tensor(t), weight=torch.tensor(w))
    np.testing.assert_allclose(float(got), want.item(), rtol=1e-12)


# ------------------------------------------------------------------------- softmax(dtype=) ----
@by_mode
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_softmax_takes_torchs_dtype(mode, name):
    """F.softmax(scores, dim=-1, dtype=torch.float32), as Hugging Face attention writes it: a
    TypeError (unexpected keyword 'dtype') before."""
    h = (np.random.default_rng(0).standard_normal((4, 33)) * 4).astype(np.float16)
    x = tg.from_numpy(h, tiles_for(h.shape, "ab", mode))
    for got in (getattr(tg, name)(x, dim=-1, dtype=torch.float32), getattr(x, name)(-1, dtype=np.float32)):
        want = getattr(F, name)(torch.tensor(h), dim=-1, dtype=torch.float32)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    (g,) = tg.grad((getattr(tg, name)(x, -1, dtype=np.float32) * np.float32(1.5)).sum(), [x])
    assert g.dtype == np.float16
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.{name}\] dtype must be a floating dtype"):
        getattr(tg, name)(x, -1, dtype=np.int64)


def test_rms_norm_called_in_torchs_order_says_which_order_is_tilegraphs():
    """tg.rms_norm(x, (C,)) as torch's F.rms_norm(x, normalized_shape): 'weight must be a
    TileTensor; received: tuple', which did not say what to write."""
    x = tg.from_numpy(np.ones((2, 8)), (1, 4))
    for shape in ((8,), 8, [8]):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.rms_norm\] the second argument is the weight: .*"
                                               r"F.rms_norm\(x, normalized_shape, weight, eps\) is "
                                               r"tg.rms_norm\(x, weight, eps\)"):
            tg.rms_norm(x, shape)


@by_dtype
@pytest.mark.parametrize("tiles", [None, (1, 2)], ids=["one-tile", "tiled"])
def test_norms_with_eps_0_of_a_constant_row_are_nan_as_torchs(dtype, tiles):
    """The fused (one tile) layer and RMS norm kernels raised Python's ZeroDivisionError where the
    variance plus eps was 0; the tiled path and torch give NaN."""
    x = tg.from_numpy(np.ones((2, 4), dtype), tiles)
    z = tg.from_numpy(np.zeros((2, 4), dtype), tiles)
    got_ln, got_rms = tg.compute(tg.layer_norm(x, (4,), eps=0.0), tg.rms_norm(z, eps=0.0))
    np.testing.assert_array_equal(got_ln, F.layer_norm(torch.ones(2, 4), (4,), eps=0.0).numpy())
    np.testing.assert_array_equal(got_rms, F.rms_norm(torch.zeros(2, 4), (4,), eps=0.0).numpy())
