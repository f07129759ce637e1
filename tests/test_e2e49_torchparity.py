"""torch names a porting audit found missing: ``tg.nn.Flatten``, ``Softmax``, ``LogSoftmax``,
``LeakyReLU`` (and ``tg.leaky_relu``), ``CrossEntropyLoss``, ``MSELoss`` and ``tg.arange``. Each is
measured against torch (forward and gradients) over single, even and ragged tilings, and each bad
argument is a TileError that names the call, what was wrong and what was received."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn, tiles_for
from tilegraph import nn

torch = pytest.importorskip("torch")
tnn = torch.nn

NEW_MODULES = ["Flatten", "Softmax", "LogSoftmax", "LeakyReLU", "CrossEntropyLoss", "MSELoss"]


def test_the_new_names_are_exported():
    assert set(NEW_MODULES) <= set(nn.__all__)
    assert all(issubclass(getattr(nn, n), nn.Module) for n in NEW_MODULES)
    assert "leaky_relu" in tg.ops.__all__ and "leaky_relu" in tg.__all__ and tg.leaky_relu is tg.ops.leaky_relu
    assert "arange" in tg.__all__ and callable(tg.arange)


def test_modules_print_as_torch():
    pairs = [(nn.Flatten(), tnn.Flatten()), (nn.Flatten(0, 2), tnn.Flatten(0, 2)), (nn.Softmax(1), tnn.Softmax(1)),
             (nn.LogSoftmax(dim=-1), tnn.LogSoftmax(dim=-1)), (nn.LeakyReLU(), tnn.LeakyReLU()),
             (nn.LeakyReLU(0.2, True), tnn.LeakyReLU(0.2, True)), (nn.CrossEntropyLoss(label_smoothing=0.1),
                                                                    tnn.CrossEntropyLoss(label_smoothing=0.1)),
             (nn.MSELoss(reduction="sum"), tnn.MSELoss(reduction="sum"))]
    for ours, theirs in pairs:
        assert repr(ours) == repr(theirs)
    assert repr(nn.Sequential(nn.Flatten(), nn.LeakyReLU(0.1))) == \
        repr(tnn.Sequential(tnn.Flatten(), tnn.LeakyReLU(0.1)))


# ------------------------------------------------------------------------------- Flatten ----
@by_mode
@pytest.mark.parametrize("dims,args", [("bcHW", ()), ("bcHW", (1, 2)), ("bCHw", (0, -2)), ("bcHW", (-3, -1))],
                         ids=["default", "1-2", "0-(-2)", "negative"])
def test_flatten_as_torch(rng, mode, dims, args):
    check_against_torch(lambda x: nn.Flatten(*args)(x), lambda x: tnn.Flatten(*args)(x),
                        [randn(rng, 4, 6, 3, 5)], dims, mode)


def test_flatten_errors():
    x = tg.from_numpy(np.zeros((4, 6, 3)), tiles=(2, 3, 2))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Flatten\] start_dim must be an int .*received: 'a'"):
        nn.Flatten("a")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Flatten\] end_dim must be an int .*True"):
        nn.Flatten(0, True)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Flatten\] dim out of range for a 1-d tensor"):
        nn.Flatten()(tg.from_numpy(np.zeros(3)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Flatten\] start_dim must not come after end_dim"):
        nn.Flatten(2, 1)(x)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Flatten\]"):  # a tiled dim after the first merged one
        nn.Flatten()(x)


# ----------------------------------------------------------------------- Softmax modules ----
@by_mode
@pytest.mark.parametrize("cls", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("dim", [-1, 1, 0])
def test_softmax_modules_as_torch(rng, mode, cls, dim):
    check_against_torch(lambda x: getattr(nn, cls)(dim)(x), lambda x: getattr(tnn, cls)(dim)(x),
                        [randn(rng, 3, 5, 7)], "btv", mode)


def test_softmax_modules_float32(rng):
    check_against_torch(lambda x: nn.LogSoftmax(dim=-1)(x), lambda x: tnn.LogSoftmax(dim=-1)(x),
                        [randn(rng, 4, 9, dtype=np.float32)], "nv", "ragged")


@pytest.mark.parametrize("cls", ["Softmax", "LogSoftmax"])
def test_softmax_modules_errors(cls):
    module = getattr(nn, cls)
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.nn.{cls}\] dim must be given, e.g. {cls}\(dim=-1\) "
                       r"\(torch's implicit choice .* deprecated.*received: dim=None"):
        module()
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.nn.{cls}\] dim must be an int .*1.5"):
        module(1.5)
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.nn.{cls}\] dim out of range for a 2-d tensor"):
        module(2)(tg.from_numpy(np.zeros((2, 3))))
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.nn.{cls}\] x must have a floating dtype"):
        module(0)(tg.from_numpy(np.arange(3)))


# ----------------------------------------------------------------------------- LeakyReLU ----
def _with_zeros(rng, *shape, dtype=np.float64):
    a = randn(rng, *shape, dtype=dtype)
    a.flat[::4] = 0  # exact zeros: torch's gradient there is the slope
    return a


@by_mode
@by_dtype
@pytest.mark.parametrize("slope", [None, 0.2, -0.5, 0.0])
def test_leaky_relu_as_torch(rng, mode, dtype, slope):
    kw = {} if slope is None else {"negative_slope": slope}
    a = _with_zeros(rng, 4, 7, dtype=dtype)
    check_against_torch(lambda x: tg.leaky_relu(x, **kw), lambda x: torch.nn.functional.leaky_relu(x, **kw),
                        [a], "nd", mode)
    check_against_torch(lambda x: nn.LeakyReLU(**kw)(x), lambda x: tnn.LeakyReLU(**kw)(x), [a], "nd", mode)


def test_leaky_relu_gradient_at_zero_is_the_slope_as_torch():
    a = np.array([-1.0, 0.0, -0.0, 2.0])
    x = tg.from_numpy(a, tiles=2)
    (g,) = tg.compute(tg.grad(tg.leaky_relu(x, 0.1).sum(), [x])[0])
    t = torch.tensor(a, requires_grad=True)
    torch.nn.functional.leaky_relu(t, 0.1).sum().backward()
    np.testing.assert_array_equal(g, t.grad.numpy())
    np.testing.assert_array_equal(g, [0.1, 0.1, 0.1, 1.0])


def test_leaky_relu_float16_and_special_values_as_torch():
    a = np.array([-3.0, -1e-3, 0.0, 1.5, 6e4, -6e4, np.nan, np.inf, -np.inf], np.float16)
    x = tg.from_numpy(a, tiles=4)
    y = tg.leaky_relu(x, 0.01)
    r = np.linspace(-2, 2, a.size).astype(np.float16)
    got_y, got_g = tg.compute(y, tg.grad((y * tg.from_numpy(r, tiles=4)).sum(), [x])[0])
    t = torch.tensor(a, requires_grad=True)
    ty = torch.nn.functional.leaky_relu(t, 0.01)
    (ty * torch.tensor(r)).sum().backward()
    assert got_y.dtype == np.float16 and got_g.dtype == np.float16
    np.testing.assert_array_equal(got_y, ty.detach().numpy())  # the float32-scaled product, rounded once
    np.testing.assert_array_equal(got_g, t.grad.numpy())


def test_leaky_relu_errors():
    x = tg.from_numpy(np.zeros(3))
    with pytest.raises(tg.TileError) as e:
        nn.LeakyReLU("a")
    assert str(e.value) == ("[tilegraph.nn.LeakyReLU] negative_slope must be a real number (finite; torch's "
                            "default is 0.01); received: 'a'")
    for bad in (True, float("nan"), float("inf"), None):
        with pytest.raises(tg.TileError, match=r"\[tilegraph.leaky_relu\] negative_slope must be a real number"):
            tg.leaky_relu(x, bad)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.LeakyReLU\] inplace must be a bool"):
        nn.LeakyReLU(0.1, "yes")
    with pytest.raises(tg.TileError, match=r"\[tilegraph.leaky_relu\] x must be a TileTensor; received: ndarray"):
        tg.leaky_relu(np.zeros(3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.leaky_relu\] input must have a floating dtype"):
        nn.LeakyReLU()(tg.from_numpy(np.arange(3)))  # torch's leaky_relu refuses integers too


# ------------------------------------------------------------------------- loss modules ----
@by_mode
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_loss_as_torch(rng, mode, reduction, smoothing):
    B, T, V = 2, 5, 11
    targets = rng.integers(0, V, (B, T))
    targets[0, 1] = targets[1, 3] = 7  # the ignored class
    kw = {"ignore_index": 7, "reduction": reduction, "label_smoothing": smoothing}
    # the classes are the logits' last dim (tilegraph's layout): torch takes them flattened
    check_against_torch(lambda x, t: nn.CrossEntropyLoss(**kw)(x, t),
                        lambda x, t: tnn.CrossEntropyLoss(**kw)(x.reshape(-1, V), t.reshape(-1)).reshape(
                            (B, T) if reduction == "none" else ()),
                        [randn(rng, B, T, V), targets], "btv,bt", mode)


def test_cross_entropy_loss_takes_numpy_targets_and_defaults(rng):
    logits, targets = randn(rng, 6, 5, dtype=np.float32), rng.integers(0, 5, 6)
    got = float(nn.CrossEntropyLoss()(tg.from_numpy(logits, tiles=(4, 2)), targets))
    want = float(tnn.CrossEntropyLoss()(torch.tensor(logits), torch.tensor(targets)))
    assert got == pytest.approx(want, rel=1e-5)


@by_mode
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_as_torch(rng, mode, reduction):
    check_against_torch(lambda x, y: nn.MSELoss(reduction=reduction)(x, y),
                        lambda x, y: tnn.MSELoss(reduction=reduction)(x, y),
                        [randn(rng, 4, 6), randn(rng, 4, 6)], "nd,nd", mode)


def test_loss_module_errors():
    logits = tg.from_numpy(np.zeros((2, 4)), tiles=(1, 3))
    targets = tg.from_numpy(np.array([1, 3]), tiles=1)
    # class weights: the op's own TileError, by keyword or torch's first positional argument
    with pytest.raises(tg.TileError) as op_error:
        tg.cross_entropy(logits, targets, weight=np.ones(4))
    for make in (lambda: nn.CrossEntropyLoss(weight=np.ones(4)), lambda: nn.CrossEntropyLoss(torch.ones(4))):
        with pytest.raises(tg.TileError) as e:
            make()
        assert (e.value.where, e.value.what) == (op_error.value.where, op_error.value.what)
        assert e.value.received.endswith("of shape (4,)")
    assert "class weights" in str(op_error.value) and "received: weight: ndarray of shape (4,)" in str(op_error.value)
    cases = [
        (lambda: nn.CrossEntropyLoss(size_average=True), "CrossEntropyLoss", "size_average and reduce are not supported"),
        (lambda: nn.CrossEntropyLoss(reduce=False), "CrossEntropyLoss", "size_average and reduce are not supported"),
        (lambda: nn.CrossEntropyLoss(reduction="avg"), "CrossEntropyLoss", "reduction must be one of"),
        (lambda: nn.CrossEntropyLoss(ignore_index=1.5), "CrossEntropyLoss", "ignore_index must be an int"),
        (lambda: nn.CrossEntropyLoss(ignore_index=True), "CrossEntropyLoss", "ignore_index must be an int"),
        (lambda: nn.CrossEntropyLoss(label_smoothing=1.5), "CrossEntropyLoss", "label_smoothing must be a number in"),
        (lambda: nn.CrossEntropyLoss(label_smoothing="a"), "CrossEntropyLoss", "label_smoothing must be a number in"),
        (lambda: nn.MSELoss(size_average=False), "MSELoss", "size_average and reduce are not supported"),
        (lambda: nn.MSELoss(reduction=None), "MSELoss", "reduction must be one of"),
    ]
    for make, cls, what in cases:
        with pytest.raises(tg.TileError, match=rf"^\[tilegraph.nn.{cls}\] {what}"):
            make()
    # the ops check the inputs when the module is called
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cross_entropy\] targets must have the shape"):
        nn.CrossEntropyLoss()(logits, np.array([1, 2, 3]))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.mse_loss\] target must have the shape of input"):
        nn.MSELoss()(logits, np.zeros((4, 2)))


# --------------------------------------------------------------------------------- arange ----
ARANGE = [((5,), {}), ((0,), {}), ((2, 9), {}), ((2, 9, 3), {}), ((9, 2, -2), {}), ((3, 3), {}),
          ((1, 2.5, 0.5), {}), ((0, 1, 0.1), {}), ((-3.7, 12.2, 0.37), {}), ((5.0,), {}),
          ((7,), {"dtype": np.float64}), ((0, 1, 0.3), {"dtype": "float64"}), ((6,), {"dtype": torch.float16}),
          ((0, 5, 1.5), {"dtype": np.int64}), ((0.5, 5.2, 1), {"dtype": np.int64}), ((5, 0, -1.5), {"dtype": np.int64}),
          ((-0.5, 3), {"dtype": np.int64}), ((10,), {"dtype": np.int32}), ((300,), {"dtype": np.uint8}),
          ((2**40, 2**40 + 3), {})]


@pytest.mark.parametrize("args,kw", ARANGE, ids=[f"{a}{k.get('dtype', '')}" for a, k in ARANGE])
def test_arange_as_torch(args, kw):
    tkw = {k: v if isinstance(v, torch.dtype) else getattr(torch, np.dtype(v).name) for k, v in kw.items()}
    want = torch.arange(*args, **tkw).numpy()
    got = tg.arange(*args, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    values = got.numpy()
    if want.dtype.kind == "f":  # torch's CPU kernel fills float32 lanes from a rounded base: within an ulp
        np.testing.assert_allclose(values, want, rtol=1e-6, atol=1e-6 * max(1.0, float(np.abs(want).max(initial=0))))
    else:
        np.testing.assert_array_equal(values, want)


@by_mode
def test_arange_tiles_and_gradient_through_it(rng, mode):
    n = 11
    tiles = tiles_for((n,), "n", mode)
    x = tg.arange(n, tiles=tiles)
    assert x.chunks == tg.from_numpy(np.zeros(n), tiles).chunks and x.dtype == np.int64
    np.testing.assert_array_equal(x.numpy(), np.arange(n))
    # a float arange as the weights of a product: the gradient of the other operand is it
    check_against_torch(lambda a: a * tg.arange(0.5, n, dtype=np.float64, tiles=tiles),
                        lambda a: a * torch.arange(0.5, n, dtype=torch.float64), [randn(rng, 3, n)], "Mn", mode)


def test_arange_errors():
    cases = [
        (lambda: tg.arange(0, 5, 0), "step must be nonzero", "start=0, end=5, step=0"),
        (lambda: tg.arange(0, 5, 0.5, dtype=np.int64), "step must be nonzero", "step=0.5"),  # truncated to 0
        (lambda: tg.arange(0, -3, 1), "step must lead from start to end", "start=0, end=-3, step=1"),
        (lambda: tg.arange(5, 0), "step must lead from start to end", "start=5, end=0, step=1"),
        (lambda: tg.arange(float("inf")), "start, end and step must be finite", "end=inf"),
        (lambda: tg.arange(0, 1, float("nan")), "start, end and step must be finite", "step=nan"),
        (lambda: tg.arange(True), "end must be a real number", "bool True"),
        (lambda: tg.arange("a"), "end must be a real number", "str 'a'"),
        (lambda: tg.arange(0, [3]), "end must be a real number", "list [3]"),
        (lambda: tg.arange(3, dtype=bool), "dtype must be an integer or float dtype", "bool"),
        (lambda: tg.arange(3, dtype="cuda"), "expected a dtype", "'cuda'"),
        (lambda: tg.arange(2**63), "start, end and step must fit int64", "end=9223372036854775808"),
        (lambda: tg.arange(0, 1e30, 1e-30), "a shape of at most", "shape"),
        (lambda: tg.arange(5, tiles=(2, 2)), "", ""),
    ]
    for make, what, received in cases:
        with pytest.raises(tg.TileError) as e:
            make()
        assert str(e.value).startswith(f"[tilegraph.arange] {what}"), str(e.value)
        assert received in (e.value.received or ""), str(e.value)
