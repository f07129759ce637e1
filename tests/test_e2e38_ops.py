"""Porting torch code, the tensor API (an end-to-end audit, round 3): ``//`` and ``%`` with torch's
signs, integer ``abs`` / ``clamp``, torch's method forms (``x.add(y, alpha=)``, ``x.rsqrt()``, ...),
its in-place methods (a TileError naming the out-of-place form; ``zero_`` / ``fill_`` / ``copy_``
set a Parameter's values), NumPy's functions and ufuncs called on a TileTensor (NumPy's meaning, or
a TileError naming the function), ``x == number`` refused as ``x == array`` is, and small torch
snippets (an MLP, a causal attention, a masked loss, a hand-written layer norm) against torch
autograd over single, even and ragged tilings. Each test fails on the code before it."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_mode, check_against_torch, randn

torch = pytest.importorskip("torch")


def _named(call, *patterns):
    with pytest.raises(tg.TileError) as info:
        call()
    for p in patterns:
        assert p in str(info.value), str(info.value)
    return str(info.value)


# ----------------------------------------------------------------------------- // and % ----
def test_floor_division_and_remainder_of_integers_follow_torchs_signs():
    a = np.array([[-7, 7, -7, 7, 0, 5], [13, -13, 1, -1, 9, -9]])
    b = np.array([[2, 2, -2, -2, 3, -4], [5, 5, -5, -5, 4, 4]])
    x, y = tg.from_numpy(a, tiles=(1, 4)), tg.from_numpy(b, tiles=(1, 4))
    ta, tb = torch.tensor(a), torch.tensor(b)
    for got, want in ((x // y, ta // tb), (x % y, ta % tb), (x // 3, ta // 3), (x % -3, ta % -3),
                      (17 // y, 17 // tb), (-17 % y, -17 % tb), (x.floor_divide(y), ta.floor_divide(tb)),
                      (x.remainder(y), ta.remainder(tb)),
                      (x.div(y, rounding_mode="floor"), ta.div(tb, rounding_mode="floor"))):
        value = got.numpy()
        assert value.dtype == np.int64
        np.testing.assert_array_equal(value, want.numpy())
    np.testing.assert_array_equal((x // y[:1]).numpy(), (ta // tb[:1]).numpy())  # broadcast


def test_floor_division_and_remainder_of_floats_as_torch():
    a = np.array([-3.5, -2.0, 1.0, 2.5, 7.0, 0.5, -0.5, 5.0, -5.0])
    x = tg.from_numpy(a, tiles=4)
    t = torch.tensor(a)
    for got, want in ((x // 2, t // 2), (x % 2, t % 2), (x // -1.5, t // -1.5), (x % -1.5, t % -1.5),
                      (x // 0.1, t // 0.1), (7.0 // x, 7.0 // t), (7.0 % x, 7.0 % t),
                      (x // 0.0, t // 0.0), (x % 0.0, t % 0.0), (x % math.inf, t % math.inf)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-15, atol=1e-15)
    y = tg.from_numpy(a.astype(np.float32), tiles=4)
    assert (y // 2).dtype == np.float32 and (y % 2).numpy().dtype == np.float32


@by_mode
def test_remainder_gradient_as_torch(rng, mode):
    a, b, row = randn(rng, 6, 7) * 5, randn(rng, 6, 7) * 2 + 0.3, randn(rng, 1, 7) * 2
    check_against_torch(lambda x, y: x % y, lambda x, y: x % y, [a, b], "ij,ij", mode)
    check_against_torch(lambda x, y: x % y, lambda x, y: x % y, [a, row], "ij,kj", mode)
    check_against_torch(lambda x: x % 1.5, lambda x: x % 1.5, [a], "ij", mode)
    check_against_torch(lambda x: 2.5 % x, lambda x: torch.remainder(torch.tensor(2.5, dtype=x.dtype), x), [b], "ij",
                        mode)
    # floor division passes no gradient (its derivative is 0 wherever it is defined)
    check_against_torch(lambda x: (x // 1.5) * x, lambda x: torch.floor_divide(x.detach(), 1.5) * x, [a], "ij", mode)


def test_integer_operands_of_divmod_and_abs_pass_no_gradient_as_torch():
    a = np.array([1.5, -2.5, 3.0, 7.25])
    x, t = tg.from_numpy(a, tiles=3), torch.tensor(a, requires_grad=True)

    def loss(v, float64):
        ids = v.long()
        return (((ids % 2.5) * v).sum() + (float64(ids // 2) * v).sum() + (ids.abs().clamp(0.5, 2) * v).sum()
                + (float64(7 % (ids.abs() + 1)) * v).sum())

    (g,) = tg.grad(loss(x, lambda v: v.to(np.float64)), [x])
    loss(t, lambda v: v.double()).backward()
    np.testing.assert_allclose(g.numpy(), t.grad.numpy(), rtol=1e-15)


def test_integer_division_by_zero_and_bad_operands_are_named():
    ids = tg.from_numpy(np.array([3, 0, -2]), tiles=2)
    _named(lambda: ids // 0, "[tilegraph.floor_divide] integer // by zero", "received: int64 tensor // 0")
    _named(lambda: ids % 0, "[tilegraph.remainder] integer % by zero")
    with pytest.raises(ZeroDivisionError, match="integer // by zero") as info:
        (7 // ids).numpy()  # a zero inside the divisor: found where the tile runs, as torch's RuntimeError
    assert "in tile kernel 'divmod' of op 'floor_divide'" in str(getattr(info.value, "__notes__", ""))
    _named(lambda: tg.from_numpy(np.array([1, 2], np.int8)) // 300, "a number that a int8 tensor holds",
           "received: 300")
    _named(lambda: tg.from_numpy(np.ones(2, bool)) % 2, "[tilegraph.remainder] number tensors")
    _named(lambda: ids // np.ones(3), "wrap a NumPy array with tg.from_numpy")
    # a float beside an integer tensor: NumPy's float64, as other numbers beside one
    assert (ids // 2.5).dtype == np.float64 and (ids % 2.5).numpy().tolist() == [0.5, 0.0, 0.5]


def test_augmented_floor_division_and_remainder():
    x = tg.from_numpy(np.array([-7, 8]))
    y = x
    x //= 3
    x %= 2
    assert x.numpy().tolist() == [1, 0] and y.numpy().tolist() == [-7, 8]  # rebinds, as += does
    p = tg.nn.Parameter(np.ones(2), name="w")
    with pytest.raises(tg.TileError, match=r"p //= \.\.\. would replace the Parameter"):
        p //= 2


# -------------------------------------------------------------------- integer abs / clamp ----
def test_integer_abs_and_clamp_keep_their_dtype_as_torch():
    a = np.array([-7, -2, 3, 5, 7, 0])
    x, t = tg.from_numpy(a, tiles=4), torch.tensor(a)
    for got, want in ((x.abs(), t.abs()), (abs(x), abs(t)), (tg.abs(x), torch.abs(t)), (x.clamp(-3, 4), t.clamp(-3, 4)),
                      (x.clamp(min=0), t.clamp(min=0)), (x.clamp(max=2), t.clamp(max=2)), (x.clip(5, 1), t.clip(5, 1))):
        value = got.numpy()
        assert value.dtype == np.int64
        np.testing.assert_array_equal(value, want.numpy())
    # a fractional bound: float64 (np.clip's promotion, as numbers beside an integer tensor)
    got = x.clamp(-2.5, 4)
    assert got.dtype == np.float64 and got.numpy().tolist() == [-2.5, -2.0, 3.0, 4.0, 4.0, 0.0]
    u = tg.from_numpy(np.array([0, 3, 250], np.uint8))
    assert u.clamp(-1, 5).numpy().tolist() == [0, 3, 5] and u.abs().numpy().dtype == np.uint8
    _named(lambda: u.clamp(min=300), "[tilegraph.clamp] bounds that a uint8 tensor holds")
    _named(lambda: tg.from_numpy(np.ones(2, bool)).clamp(0, 1), "[tilegraph.clamp] x must have a float or integer")


def test_integer_abs_and_clamp_in_a_graph_with_gradients():
    """An integer abs beside float math: the float input still gets its gradient, as torch's."""
    rng = np.random.default_rng(3)
    a, ids = rng.standard_normal((4, 5)), rng.integers(-4, 4, (4, 5))
    x = tg.from_numpy(a, tiles=(2, 3))
    loss = (x * _tiled_ids(ids).abs().clamp(max=2).to(np.float64)).sum()
    (g,) = tg.grad(loss, [x])
    np.testing.assert_array_equal(g.numpy(), np.minimum(np.abs(ids), 2).astype(np.float64))


def _tiled_ids(ids):
    return tg.from_numpy(ids, tiles=(2, 3))


# -------------------------------------------------------------- torch's method forms ----
@by_mode
def test_torch_method_forms_as_torch(rng, mode):
    a, b = randn(rng, 5, 6), randn(rng, 5, 6)
    pos = np.abs(a) + 0.5
    check_against_torch(lambda x, y: x.add(y, alpha=2.5) - x.sub(y, alpha=-1) + x.mul(y) + x.div(y.abs() + 1),
                        lambda x, y: x.add(y, alpha=2.5) - x.sub(y, alpha=-1) + x.mul(y) + x.div(y.abs() + 1),
                        [a, b], "ij,ij", mode)
    check_against_torch(lambda x: x.rsqrt() + x.square() + x.reciprocal() + x.neg() + x.add(1.0),
                        lambda x: x.rsqrt() + x.square() + x.reciprocal() + x.neg() + x.add(1.0), [pos], "ij", mode)
    check_against_torch(lambda x, w: x.matmul(w), lambda x, w: x.matmul(w), [a, randn(rng, 6, 3)], "ik,kj", mode)


def test_a_rounding_mode_other_than_floor_is_named():
    x = tg.from_numpy(np.array([-3.5, 3.5]))
    _named(lambda: x.div(2, rounding_mode="trunc"), "[tilegraph.TileTensor.div] rounding_mode None", "'trunc'")
    _named(lambda: x.add(x, alpha=x), "[tilegraph.TileTensor.add] alpha must be a real number")


# ---------------------------------------------------------------------- in-place methods ----
@pytest.mark.parametrize("call, form", [
    (lambda x: x.add_(1), "x = x + y (x.add(y))"), (lambda x: x.mul_(2), "x = x * y"),
    (lambda x: x.sub_(x), "x = x - y"), (lambda x: x.div_(2), "x = x / y"),
    (lambda x: x.clamp_(0, 1), "x = x.clamp(min, max)"), (lambda x: x.zero_(), "x = tg.zeros_like(x)"),
    (lambda x: x.fill_(3.0), "x = tg.full_like(x, value)"), (lambda x: x.copy_(x), "x = src"),
    (lambda x: x.masked_fill_(x > 0, 0.0), "x = x.masked_fill(mask, value)"), (lambda x: x.relu_(), "x = x.relu()"),
    (lambda x: x.exp_(), "x = x.exp()"), (lambda x: x.pow_(2), "x = x ** y"), (lambda x: x.abs_(), "x = x.abs()"),
])
def test_in_place_methods_name_the_out_of_place_form(call, form):
    x = tg.from_numpy(np.ones((2, 3)), tiles=2)
    name = _named(lambda: call(x), "would change x in place, and a TileTensor never changes", form)
    assert name.startswith("[tilegraph.TileTensor.") and "received: TileTensor(shape=(2, 3)" in name


def test_a_parameter_takes_zero_fill_and_copy_as_torchs_init_code_writes_them():
    lin = tg.nn.Linear(4, 3, dtype=np.float32, seed=0)
    assert lin.bias.zero_() is lin.bias and not lin.bias.numpy().any()
    lin.weight.fill_(0.5)
    assert (lin.weight.numpy() == 0.5).all() and lin.weight.dtype == np.float32
    lin.bias.copy_(torch.arange(3.0))  # a torch tensor, cast to the parameter's dtype
    assert lin.bias.numpy().tolist() == [0.0, 1.0, 2.0] and lin.bias.numpy().dtype == np.float32
    lin.weight.copy_(np.arange(3.0))  # broadcast to (4, 3), as torch's copy_
    np.testing.assert_array_equal(lin.weight.numpy(), np.tile(np.arange(3.0, dtype=np.float32), (4, 1)))
    other = tg.nn.Linear(4, 3, dtype=np.float32, seed=7)
    lin.weight.copy_(other.weight)  # a TileTensor's values
    np.testing.assert_array_equal(lin.weight.numpy(), other.weight.numpy())
    out = lin(np.ones((2, 4), np.float32)).numpy()  # the model computes with the values set
    np.testing.assert_allclose(out, np.ones((2, 4)) @ other.weight.numpy() + np.arange(3.0), rtol=1e-6)
    _named(lambda: lin.weight.copy_(np.ones(5)), "[tilegraph.nn.Parameter(", ".copy_] src must broadcast to the "
           "parameter's shape (4, 3); received: shape (5,)")
    _named(lambda: lin.weight.mul_(0.5), ".mul_] p.mul_(...) would change the parameter in place: set its new "
           "values with p.assign(array)")
    _named(lambda: lin.weight.fill_("a"), "fill_] value must be a real number")


# ------------------------------------------------------------------- NumPy's protocols ----
@pytest.mark.parametrize("call", [
    lambda a: np.var(a), lambda a: np.var(a, axis=1), lambda a: np.var(a, axis=(0, 2), ddof=1, keepdims=True),
    lambda a: np.std(a), lambda a: np.std(a, 0, correction=1), lambda a: np.var(a, dtype=np.float64),
    lambda a: np.max(a), lambda a: np.max(a, axis=1), lambda a: np.amin(a, axis=(0, 2), keepdims=True),
    lambda a: np.min(a, -1), lambda a: np.max(a, keepdims=True), lambda a: np.argmax(a, axis=2),
    lambda a: np.argmin(a, 0, keepdims=True), lambda a: np.transpose(a), lambda a: np.transpose(a, (1, 0, 2)),
    lambda a: np.reshape(a, (4, 5, 1, 6)), lambda a: np.clip(a, -1, 0.5), lambda a: np.cumsum(a, axis=1),
    lambda a: np.concatenate([a, a], axis=1), lambda a: np.stack([a, a], 0), lambda a: np.where(a > 0, a, 0.0),
    lambda a: np.expand_dims(a, 1), lambda a: np.squeeze(a[:, :1], 1), lambda a: np.exp(a), lambda a: np.sqrt(a * a),
    lambda a: np.abs(a), lambda a: np.maximum(a, 0), lambda a: np.minimum(0.5, a), lambda a: np.square(a),
    lambda a: np.log(np.abs(a) + 1), lambda a: np.negative(a), lambda a: np.float64(2.0) * a,
    lambda a: np.power(a, 2), lambda a: np.tanh(a), lambda a: np.floor_divide(a, 0.5), lambda a: np.mod(a, 0.7),
    lambda a: np.any(a > 1.5, axis=1), lambda a: np.all(a > -3, axis=(0, 2), keepdims=True), lambda a: np.any(a > 9),
])
def test_numpy_functions_on_a_tensor_record_numpys_meaning(rng, call):
    """``np.var(x)`` was Python's TypeError (an unexpected dtype=), ``np.max(x, axis=1)`` too
    (axis=), ``np.transpose(x)`` an error about dims (None,), ``np.exp(x)`` an error asking to
    compute first. Each now records tilegraph's op with NumPy's meaning (np.var divides by N,
    np.max gives values, not torch's (values, indices))."""
    a = rng.standard_normal((4, 5, 6))
    got = call(tg.from_numpy(a, tiles=(3, 2, 4)))
    assert isinstance(got, tg.TileTensor)  # recorded, not computed
    want = call(a)
    value = got.numpy()
    assert value.shape == np.shape(want) and value.dtype == np.asarray(want).dtype
    np.testing.assert_allclose(value, want, rtol=1e-12, atol=1e-12)


def test_numpy_var_gradient_as_torchs_population_variance(rng):
    a = rng.standard_normal((6, 5))
    check_against_torch(lambda x: np.var(x, axis=0) + np.std(x), lambda x: x.var(0, correction=0) +
                        x.std(correction=0), [a], "ij", "ragged")


@pytest.mark.parametrize("call, what", [
    (lambda x: np.median(x), "[tilegraph.TileTensor (np.median)] np.median of a TileTensor is not supported"),
    (lambda x: np.allclose(x, 1.0), "np.allclose of a TileTensor is not supported"),
    (lambda x: np.isnan(x), "np.isnan of a TileTensor is not supported: use tilegraph's op where there is one"),
    (lambda x: np.linalg.norm(x), "np.linalg.norm of a TileTensor is not supported"),
    (lambda x: np.add.reduce(x), "np.add.reduce of a TileTensor is not supported"),
    (lambda x: np.exp(x, out=np.zeros((3, 4))), "[tilegraph.TileTensor (np.exp)] np.exp of a TileTensor takes no out="),
    (lambda x: np.maximum(x, x), "np.maximum of a TileTensor is not supported of two tensors (tg.where(a > b, a, b))"),
    (lambda x: np.var(x, out=np.zeros(())), "np.var of a TileTensor takes no out="),
    (lambda x: np.max(x, initial=3.0), "np.max of a TileTensor takes no initial="),
    (lambda x: np.where(x > 0), "np.where(condition, x, y)"),
    (lambda x: np.reshape(x, (4, 3), order="F"), "order='C'"),
    (lambda x: np.dot(x, np.ones(4)), "[tilegraph.TileTensor (np.dot)] two TileTensors of 1 or 2 dims"),
    (lambda x: np.asarray(x), "[tilegraph.TileTensor.__array__] a TileTensor is symbolic"),
])
def test_numpy_functions_without_an_op_are_named(call, what):
    x = tg.from_numpy(np.ones((3, 4)), tiles=2)
    message = _named(lambda: call(x), what)
    assert "received:" in message


def test_numpys_sum_and_shape_and_array_operands_as_before():
    x = tg.from_numpy(np.arange(12.0).reshape(3, 4), tiles=2)
    assert np.shape(x) == (3, 4) and np.ndim(x) == 2 and np.size(x) == 12
    assert np.sum(x).numpy() == 66.0 and np.mean(x, axis=0).numpy().tolist() == [4.0, 5.0, 6.0, 7.0]
    _named(lambda: np.ones((3, 4)) + x, "[tilegraph.add] a must be a TileTensor or a real number",
           "wrap a NumPy array with tg.from_numpy")
    _named(lambda: np.zeros((3, 4)) < x, "[tilegraph.TileTensor.__gt__] a TileTensor or a real number to compare")
    _named(lambda: np.zeros((3, 4)) == x, "[tilegraph.TileTensor.__eq__] == of a TileTensor is Python's identity")


# ------------------------------------------------------------------ == with a number ----
def test_equality_with_a_number_is_refused_not_a_python_bool():
    """torch's ``labels != -100`` / ``mask == 0`` gave Python's True / False (identity), which an
    ``if`` took silently and ``.float()`` failed on far away ('bool' object has no attribute)."""
    ids = tg.from_numpy(np.array([3, -100, 5]))
    _named(lambda: ids != -100, "[tilegraph.TileTensor.__ne__] != of a TileTensor is Python's identity",
           "x.ne(y)", "received: int -100")
    _named(lambda: ids == 0, "[tilegraph.TileTensor.__eq__]", "x.eq(y)", "received: int 0")
    _named(lambda: ids == np.int64(3), "x.eq(y)")
    _named(lambda: 0.5 == ids, "x.eq(y)")
    assert ids.ne(-100).numpy().tolist() == [True, False, True]
    other = tg.from_numpy(np.array([3, -100, 5]))
    assert ids == ids and ids != other and ids is not None and ids != "ids" and ids in [other, ids]


# ------------------------------------------------------------------ torch snippets, ported ----
def _mlp(x, w1, b1, w2, b2):
    h = x.matmul(w1).add(b1).relu()  # (B, H)
    return (h @ w2 + b2).tanh()  # (B, O)


def _hand_layer_norm(x, w, b):
    mu = x.mean(-1, keepdim=True)
    var = x.var(-1, keepdim=True, unbiased=False)
    return (x - mu) * (var + 1e-5).rsqrt() * w + b


def _causal_attention(q, k, v, mask):
    att = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, T, T)
    att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
    return att @ v  # (B, H, T, D)


def _masked_nll(logits, onehot, ids):
    mask = ids.ne(-100).to(logits.dtype)  # torch's (ids != -100): a TileTensor's != is identity
    nll = -(logits.log_softmax(-1) * onehot).sum(-1)  # (B, T)
    return (nll * mask).sum() / mask.sum()


@by_mode
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_ported_torch_snippets_match_torch_autograd(rng, mode, dtype):
    x, w1, b1 = randn(rng, 9, 12, dtype=dtype), randn(rng, 12, 16, dtype=dtype), randn(rng, 16, dtype=dtype)
    w2, b2 = randn(rng, 16, 5, dtype=dtype), randn(rng, 5, dtype=dtype)
    check_against_torch(_mlp, _mlp, [x, w1, b1, w2, b2], "bi,ih,h,ho,o", mode)

    h, w, b = randn(rng, 6, 7, 10, dtype=dtype), randn(rng, 10, dtype=dtype), randn(rng, 10, dtype=dtype)
    check_against_torch(_hand_layer_norm, _hand_layer_norm, [h, w, b], "btc,c,c", mode)

    T = 7
    q, k, v = (randn(rng, 2, 3, T, 8, dtype=dtype) for _ in range(3))
    causal = np.triu(np.ones((T, T), bool), 1)
    check_against_torch(_causal_attention, _causal_attention, [q, k, v, causal], "bhtd,bhsd,bhsd,ts", mode)

    logits = randn(rng, 5, 6, 11, dtype=dtype)
    ids = rng.integers(0, 11, (5, 6))
    ids[rng.random((5, 6)) < 0.3] = -100
    onehot = np.eye(11, dtype=dtype)[np.where(ids < 0, 0, ids)]
    check_against_torch(_masked_nll, _masked_nll, [logits, onehot, ids], "btv,btv,bt", mode, grad_of=[0])


# ------------------------------------------------------- to(device), type_as, bool, any / all ----
def test_devices_in_torch_code_are_named_not_type_errors():
    """``x.to(device=d)`` and ``x.to(d, dtype)`` were Python's TypeError, ``x.cuda()`` /
    ``x.cpu()`` AttributeError: each is a TileError saying the planner places every tile."""
    x = tg.from_numpy(np.ones((2, 3)), tiles=2)
    for call in (lambda: x.to(device="cuda"), lambda: x.to("cuda", torch.float32), lambda: x.cuda(), lambda: x.cpu(),
                 lambda: x.to(torch.device("cpu"), dtype=torch.float32)):
        _named(call, "there is no device to move a TileTensor to: the planner places every tile")
    _named(lambda: x.to(), "[tilegraph.TileTensor.to] one dtype")
    y = tg.from_numpy(np.ones((2, 3), np.float32), tiles=2)
    assert x.to(y).dtype == np.float32 and x.to(dtype=torch.float16).dtype == np.float16
    assert x.type_as(y).dtype == np.float32 and x.bool().dtype == np.bool_ and x.int().dtype == np.int32


def test_a_torch_tensor_operand_gets_the_hint():
    x = tg.from_numpy(np.ones(3))
    _named(lambda: x + torch.tensor(1.0), "[tilegraph.add] b must be a TileTensor or a real number",
           "wrap a torch tensor with tg.from_numpy; a number as a float: t.item()")


@pytest.mark.parametrize("call", [
    lambda x: x.any(), lambda x: x.all(), lambda x: x.gt(0.5).any(1), lambda x: x.gt(-2).all(dim=0, keepdim=True),
    lambda x: x.gt(0).any((0, 2)), lambda x: (x * 0).any(-1), lambda x: x.lt(5).all(),
])
def test_any_and_all_as_torch(rng, call):
    a = np.round(rng.standard_normal((3, 4, 5)), 1)
    a[0, 0] = 0.0
    got = call(tg.from_numpy(a, tiles=(2, 3, 2)))
    want = call(torch.tensor(a))
    assert got.dtype == np.bool_
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_requires_grad_on_a_plain_tensor_names_tg_grad():
    """``x.requires_grad_()`` (input gradients, ported) was AttributeError; a Parameter's still sets its flag."""
    x = tg.from_numpy(np.ones(3))
    _named(lambda: x.requires_grad_(), "[tilegraph.TileTensor.requires_grad_] a TileTensor needs no flag",
           "tg.grad(loss, [x])")
    p = tg.nn.Parameter(np.ones(3), name="p")
    assert p.requires_grad_(False) is p and p.requires_grad is False


def test_floor_divide_and_remainder_as_functions_as_torch():
    """``tg.floor_divide`` / ``tg.remainder``, as ``torch.floor_divide`` / ``torch.remainder``."""
    import torch

    import tilegraph as tg

    a = np.array([-7, 7, 5, -3, 0], dtype=np.int64)
    x = tg.from_numpy(a, tiles=(2,))
    np.testing.assert_array_equal(tg.floor_divide(x, 2).numpy(), torch.floor_divide(torch.from_numpy(a), 2).numpy())
    np.testing.assert_array_equal(tg.remainder(x, -3).numpy(), torch.remainder(torch.from_numpy(a), -3).numpy())
