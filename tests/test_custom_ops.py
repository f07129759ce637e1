"""The extension API (a user's tile kernels and Ops): its contract is checked, with errors that
name the op or kernel, what was wrong and what was received; a correct Op matches torch."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import Op, TileError
from tilegraph._graph import _KERNELS, emit, emit1, kernel
from tilegraph.ops._common import new_tensor


# ----------------------------------------------------------------------------- kernels and ops --
@kernel("test_custom_ops_double")
def _double(x):
    return 2 * x


@kernel("test_custom_ops_list")
def _returns_list(x):
    return (2 * x).tolist()


@kernel("test_custom_ops_pyfloat")
def _returns_pyfloat(x):
    return float(x.sum())


@kernel("test_custom_ops_one_of_two")
def _one_of_two(x):
    return 2 * x  # declared with two outputs below


@kernel("test_custom_ops_stw")
def _stw(x, w, *, scale):
    return (scale * np.tanh(x) * w).astype(x.dtype)


@kernel("test_custom_ops_stw_dx")
def _stw_dx(g, x, w, *, scale):
    return (g * scale * (1 - np.tanh(x) ** 2) * w).astype(x.dtype)


@kernel("test_custom_ops_stw_dw")
def _stw_dw(g, x, *, scale):
    return (g * scale * np.tanh(x)).astype(x.dtype)


def _map(kern, x, name="test_map", **params):
    return new_tensor(x.tiling, x.dtype,
                      lambda i: emit1(kern, [x.grid[i]], x.tiling.tile_shape(i), x.dtype, op=name, **params))


class ScaledTanhW(Op):
    """``scale * tanh(x) * w`` (``w`` of ``x``'s shape and tiles; ``scale`` a float, positional)."""

    name = "scaled_tanh_w"

    def forward(self, x, w, scale):
        def fill(i):
            return emit1(_stw, [x.grid[i], w.grid[i]], x.tiling.tile_shape(i), x.dtype, op=self.name, scale=scale)

        return new_tensor(x.tiling, x.dtype, fill), (x, w, scale)

    def backward(self, ctx, g):
        x, w, scale = ctx
        shape = x.tiling.tile_shape
        dx = new_tensor(x.tiling, x.dtype, lambda i: emit1(_stw_dx, [g.grid[i], x.grid[i], w.grid[i]], shape(i),
                                                           x.dtype, op="scaled_tanh_w_dx", scale=scale))
        dw = new_tensor(x.tiling, x.dtype, lambda i: emit1(_stw_dw, [g.grid[i], x.grid[i]], shape(i), x.dtype,
                                                           op="scaled_tanh_w_dw", scale=scale))
        return dx, dw, None


class GradScale(Op):
    """Identity forward, gradient times ``scale`` (gradient reversal with ``scale=-1``)."""

    name = "grad_scale"

    def forward(self, x, scale):
        return x, scale

    def backward(self, scale, g):
        return g * scale, None


X = np.arange(24, dtype=np.float32).reshape(6, 4) / 10


# ------------------------------------------------------------------ 1. forward returning an input --
def test_identity_forward_on_a_parameter_scales_its_gradient_and_leaves_it_alone():
    w = tg.nn.Parameter(np.ones((4,), np.float32), name="w")
    x = tg.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4))
    ws = GradScale()(w, 0.0)
    assert ws is not w and w._record is None  # the parameter is not the op's result
    assert ws.chunks == w.chunks and ws.dtype == w.dtype and ws.grid is w.grid  # same tiles, nothing copied
    (g,) = tg.grad((x * ws).sum(), [w])
    np.testing.assert_array_equal(g.numpy(), np.zeros(4, np.float32))
    (g2,) = tg.grad((w * 1.0).sum(), [w])  # a later graph on the parameter is not scaled
    np.testing.assert_array_equal(g2.numpy(), np.ones(4, np.float32))


def test_identity_forward_keeps_the_history_of_an_activation():
    x = tg.from_numpy(X, tiles=(2, 2))
    a = x * 2.0
    rec = a._record
    y = GradScale()(a, -1.0)  # gradient reversal
    assert a._record is rec
    (gx,) = tg.grad((y * y).sum(), [x])
    np.testing.assert_allclose(gx.numpy(), -8 * X, rtol=1e-6)


def test_forward_returning_a_tensor_made_elsewhere_leaves_its_record():
    z = tg.from_numpy(X, tiles=(3, 2))
    other = z * 3.0
    rec = other._record

    class ReturnsOther(Op):
        name = "returns_other"

        def forward(self, x):
            return other, None

        def backward(self, ctx, g):
            return (g,)

    x = tg.from_numpy(X, tiles=(3, 2))
    y = ReturnsOther()(x)
    assert other._record is rec and y is not other
    gz, gx = tg.grad((y + other).sum(), [z, x])
    np.testing.assert_allclose(gz.numpy(), np.full(X.shape, 3.0))  # through `other` only
    np.testing.assert_allclose(gx.numpy(), np.ones(X.shape))  # the op's backward


# ----------------------------------------------------------------- 2. count of backward's results --
class _Mul(Op):
    name = "my_mul"

    def __init__(self, n):
        self.n = n

    def forward(self, a, b):
        return a * b, (a, b)

    def backward(self, ctx, g):
        a, b = ctx
        return (g * b, g * a, g, None)[:self.n] if self.n != 4 else (g * b, g * a, None)


@pytest.mark.parametrize("n", [1, 3])
def test_backward_must_return_one_gradient_per_positional_input(n):
    x = tg.from_numpy(X, tiles=(2, 2))
    with pytest.raises(TileError, match=rf"my_mul.*expected 2.*received: {n} gradients? for 2 inputs") as e:
        tg.grad(_Mul(n)(x, x).sum(), [x])
    assert e.value.where.startswith("tilegraph.my_mul")
    w = tg.nn.Parameter(X, (2, 2), name="w")
    with pytest.raises(TileError, match="my_mul"):
        _Mul(n)(x, w).sum().backward()
    assert w.grad is None


def test_a_none_gradient_for_an_optional_argument_left_out_is_accepted():
    """An op whose backward returns a None for an optional argument the call left out (matmul's
    bias) has one gradient more than the call's inputs: accepted, as built-in matmul needs."""
    x = tg.from_numpy(X, tiles=(2, 2))
    (gx,) = tg.grad(_Mul(4)(x, x).sum(), [x])
    np.testing.assert_allclose(gx.numpy(), 2 * X)
    v = tg.from_numpy(np.arange(3.0), tiles=2)
    m = tg.from_numpy(np.arange(6.0).reshape(3, 2), tiles=(2, 2))
    (gm,) = tg.grad(tg.matmul(v, m).sum(), [m])  # a vector @ a matrix: the bias's None past its 2 inputs
    np.testing.assert_allclose(gm.numpy(), np.outer(np.arange(3.0), np.ones(2)))


# ---------------------------------------------------------------------- 3. forward's (out, ctx) --
class _BadForward(Op):
    name = "bad_forward"

    def __init__(self, how):
        self.how = how

    def forward(self, x):
        out = _map(_double, x)
        return {"bare": out, "numpy": (np.ones(x.shape, x.dtype), None), "triple": (out, None, None)}[self.how]

    def backward(self, ctx, g):
        return (_map(_double, g),)


@pytest.mark.parametrize("how, rows", [("bare", 2), ("bare", 6), ("numpy", 6), ("triple", 6)])
def test_forward_must_return_an_output_tensor_and_ctx(how, rows):
    x = tg.from_numpy(X[:rows], tiles=(1, 2))
    with pytest.raises(TileError, match=r"bad_forward.*forward must return a pair \(output TileTensor, ctx\)") as e:
        _BadForward(how)(x)
    assert e.value.received


# ------------------------------------------------------------------- 4. backward's gradients --
class _BadBackward(Op):
    name = "bad_backward"

    def __init__(self, how):
        self.how = how

    def forward(self, x):
        return _map(_double, x), x

    def backward(self, x, g):
        if self.how == "tiling":
            return (tg.from_numpy(2 * np.ones(x.shape, x.dtype), tiles=(3, 3)),)
        if self.how == "dtype":
            return (tg.from_numpy(2 * np.ones(x.shape, np.float64), tiles=x.tiles),)
        if self.how == "numpy":
            return (2 * np.ones(x.shape, x.dtype),)
        if self.how == "shape":
            return (tg.from_numpy(np.ones((x.shape[0] + 1,) + x.shape[1:], x.dtype)),)
        return _map(_double, g)  # "bare": not a tuple


@pytest.mark.parametrize("how, what", [("tiling", "tiles"), ("dtype", "dtype"), ("numpy", "must be a TileTensor"),
                                       ("shape", "shape"), ("bare", "not a bare tensor")])
def test_backward_gradients_must_match_their_inputs(how, what):
    x = tg.from_numpy(X, tiles=(2, 2))
    with pytest.raises(TileError, match=what) as e:
        tg.grad(_BadBackward(how)(x).sum(), [x])
    assert e.value.where.startswith("tilegraph.bad_backward") and e.value.received


@pytest.mark.parametrize("how", ["tiling", "dtype"])
def test_bad_gradient_of_a_parameter_names_it_and_the_op(how):
    class M(tg.nn.Module):
        def __init__(self):
            self.w = tg.nn.Parameter(np.ones((4, 4), np.float32), (2, 2), name="w")
            self.op = _BadBackward(how)

        def forward(self, x):
            return (x @ self.op(self.w)).sum()

    m = M()
    step = tg.TrainStep(m, tg.optim.SGD(m.parameters(), lr=0.1), lambda mm, x: mm(x), batch_tiles=[(3, 2)])
    with pytest.raises(TileError, match=r"parameter 'w'") as e:
        step(np.ones((3, 4), np.float32))
    assert "bad_backward" in e.value.where
    np.testing.assert_array_equal(m.w.numpy(), np.ones((4, 4), np.float32))


# ------------------------------------------------------------------ 5. a kernel's return value --
def _two_outputs(x):
    def fill(i):
        return emit(_one_of_two, [x.grid[i]], [(x.tiling.tile_shape(i), x.dtype)] * 2, op="two_outs")[0]

    return new_tensor(x.tiling, x.dtype, fill)


@pytest.mark.parametrize("make, received", [
    (lambda x: _map(_returns_list, x, "list_op"), "list"),
    (lambda x: _map(_returns_pyfloat, x, "float_op"), "float"),
    (_two_outputs, "ndarray"),
])
def test_kernel_must_return_arrays(make, received):
    x = tg.from_numpy(X, tiles=(2, 2))
    with pytest.raises(TileError, match=r"must return (an array|a tuple of 2 arrays)") as e:
        make(x).numpy()
    assert e.value.where.startswith("tile kernel test_custom_ops_") and " of op " in e.value.where
    assert e.value.received.startswith(received)


# ------------------------------------------------------------------ 6. registering a kernel name --
def _define(src: str, module: str):
    ns = {"__name__": module, "kernel": kernel, "np": np}
    exec(src, ns)
    return ns


def test_registering_the_same_function_again_replaces_it():
    name = "test_custom_ops_rerun"
    src = f"@kernel({name!r})\ndef triple(x):\n    return {{k}} * x\n"
    try:
        first = _define(src.replace("{k}", "3"), "notebook_cell")["triple"]
        second = _define(src.replace("{k}", "4"), "notebook_cell")["triple"]  # the cell edited and run again
        assert _KERNELS[name] is second and second is not first
        np.testing.assert_array_equal(_KERNELS[name].fn(np.ones(2)), [4.0, 4.0])
    finally:
        _KERNELS.pop(name, None)


def test_another_function_under_a_taken_name_is_refused():
    name = "test_custom_ops_taken"
    try:
        _define(f"@kernel({name!r})\ndef mine(x):\n    return x\n", "first_module")
        with pytest.raises(TileError, match=r"already registered by module first_module.*choose another name") as e:
            _define(f"@kernel({name!r})\ndef other(x):\n    return x\n", "second_module")
        assert e.value.where == "tilegraph.kernel" and e.value.received == "second_module.other"
        assert _KERNELS[name].module == "first_module"
    finally:
        _KERNELS.pop(name, None)
    with pytest.raises(TileError, match=r"'matmul' is a built-in one, registered by tilegraph\.ops.*choose another name"):
        _define("@kernel('matmul')\ndef matmul(a, b):\n    return a @ b\n", "my_module")
    assert _KERNELS["matmul"].module.startswith("tilegraph.ops")


# ----------------------------------------------------------------------- a correct custom op --
@pytest.mark.parametrize("tiles", [(None, None), (3, 2), (4, 3)], ids=["one_tile", "even", "ragged"])
def test_custom_op_matches_torch(rng, tiles):
    torch = pytest.importorskip("torch")
    x0, w0, c0 = (rng.standard_normal((6, 4)) for _ in range(3))
    op = ScaledTanhW()
    x, w, c = (tg.from_numpy(a, tiles) for a in (x0, w0, c0))
    y = op(x, w, 0.7)
    gx, gw = tg.grad((y * c).sum(), [x, w])
    assert gx.chunks == x.chunks and gw.chunks == w.chunks

    xt, wt = (torch.tensor(a, requires_grad=True) for a in (x0, w0))
    yt = 0.7 * torch.tanh(xt) * wt
    (yt * torch.tensor(c0)).sum().backward()
    np.testing.assert_allclose(y.numpy(), yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx.numpy(), xt.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gw.numpy(), wt.grad.numpy(), rtol=1e-12, atol=1e-12)
