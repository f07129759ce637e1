"""Writing your own op as a newcomer meets it (README "Your own ops", ``tilegraph.ext``): the
mistakes of a first kernel and Op are named where they are made (the kernel's registration, its
cost, ``emit1``, ``new_tensor``), a failing kernel says which kernel, op and tiles and keeps the
user's own line, on the in-process path and on two worker processes, a kernel defined again in a
notebook runs in its new form on the workers, and a correct op trains as torch does.
(tests/test_custom_ops.py covers forward's (out, ctx), backward's gradients, a kernel returning
no array, and kernel names taken; this file extends it.)"""

import traceback

import numpy as np
import pytest

import tilegraph as tg
from conftest import MODES, check_against_torch, tiles_for
from tilegraph import TileError
from tilegraph._graph import _KERNELS
from tilegraph.ext import Cost, elementwise_cost, emit1, kernel, new_tensor, xp_of


# ----------------------------------------------------------------------- the README's softplus --
@kernel("e2e47_softplus", cost=elementwise_cost(4))
def _softplus(x):
    return xp_of(x).logaddexp(0, x).astype(x.dtype)


@kernel("e2e47_softplus_bwd", cost=elementwise_cost(4))
def _softplus_bwd(g, x):
    return (g / (1 + xp_of(x).exp(-x))).astype(x.dtype)


def per_tile(k, inputs, like, op, **params):
    return new_tensor(like.tiling, like.dtype, lambda i: emit1(
        k, [t.grid[i] for t in inputs], like.tiling.tile_shape(i), like.dtype, op=op, **params))


class Softplus(tg.Op):
    name = "e2e47_softplus"

    def forward(self, x):
        return per_tile(_softplus, [x], x, self.name), x

    def backward(self, x, g):
        return (per_tile(_softplus_bwd, [g, x], x, "e2e47_softplus_bwd"),)


softplus = Softplus()


@kernel("e2e47_fails_on_short_tiles")
def _fails_on_short_tiles(x):
    if x.shape[0] < 4:
        raise ValueError("e2e47: a short tile")  # the user's own line, kept in the traceback
    return x * 2


@kernel("e2e47_drops_a_row")
def _drops_a_row(x):
    return x[:-1]


@kernel("e2e47_sum")
def _sum(x):
    return x.sum()


@kernel("e2e47_to_float32")
def _to_float32(x):
    return x.astype(np.float32)


@kernel("e2e47_nan")
def _nan(x):
    return x * np.nan


W = np.linspace(-3, 3, 10)  # in tiles of 4: 4 + 4 + 2


def _frames(e: BaseException) -> list[str]:
    return [f"{fr.name}:{fr.line}" for fr in traceback.extract_tb(e.__traceback__)]


# --------------------------------------------------------------------- registering a kernel --
@pytest.mark.parametrize("register, what, received", [
    (lambda: kernel(lambda x: x), r"needs a name: decorate with @kernel\('my_name'\), not a bare @kernel",
     "<lambda> in place of the name"),
    (lambda: kernel(3)(lambda x: x), "name must be a non-empty str", "3 (int)"),
    (lambda: kernel("")(lambda x: x), "name must be a non-empty str", "'' (str)"),
    (lambda: kernel("e2e47_c", cost=4.0)(lambda x: x), r"cost= must be a function or None \(e\.g\. elementwise_cost",
     "4.0 (float)"),
    (lambda: kernel("e2e47_c", cpu="numba")(lambda x: x), "cpu= must be a function or None", "'numba' (str)"),
    (lambda: kernel("e2e47_c")(np.exp(1.0)), "@kernel decorates a function of tiles", "(float64)"),
])
def test_a_kernel_is_registered_with_a_name_and_functions_or_refused(register, what, received):
    """Before, a bare ``@kernel`` (no name) silently turned the user's function into the
    decorator's inner ``wrap`` (an AttributeError 'no attribute cost' far away, at ``emit1``), any
    name was taken (3, ''), and ``cost=4.0`` was accepted and failed at the first emit with
    "'float' object is not callable". Now each is a TileError at the decorator, registering
    nothing."""
    before = dict(_KERNELS)
    with pytest.raises(TileError, match=what) as e:
        register()
    assert e.value.where.startswith("tilegraph.kernel") and e.value.received.endswith(received)
    assert _KERNELS == before


# ----------------------------------------------------------------------------- a kernel's cost --
@pytest.mark.parametrize("cost", [Cost(-1.0, 8.0), Cost(float("nan"), 8.0), Cost(1.0, float("inf")), 12.0,
                                  (1.0, 2.0), None],
                         ids=["negative", "nan", "inf", "float", "tuple", "none"])
def test_a_cost_that_is_no_finite_nonnegative_cost_is_named_at_emit(cost):
    """Before, a cost function returning a float, a tuple or None failed inside the planner
    (AttributeError 'no attribute flops' in plan/cluster.py), a NaN with "cannot convert float NaN
    to integer" there, and a negative or infinite one was used as it came (the kernels ordered and
    placed by it). Now ``emit1`` refuses it, naming the kernel, the rule and the shapes."""
    k = kernel(f"e2e47_cost_{type(cost).__name__}")(lambda x: x)
    k.cost = lambda *a: cost  # (what kernel(cost=...) stores: the one kernel, not one per case)
    x = tg.from_numpy(W, tiles=4)
    with pytest.raises(TileError, match=r"must return a Cost\(flops, bytes\) of finite numbers >= 0") as e:
        per_tile(k, [x], x, "costly")
    assert e.value.where == f"tilegraph.kernel({k.name!r}) cost"
    assert e.value.received.startswith(repr(cost)) and "in_shapes [(4,)]" in e.value.received


def test_a_cost_function_of_the_wrong_form_is_named_in_a_note():
    """``cost=elementwise_cost`` (the factory, not called) raised a bare TypeError 'takes 1
    positional argument but 4 were given' from the graph's internals; it now carries a note naming
    the kernel and the form a cost function has."""
    k = kernel("e2e47_uncalled_factory", cost=elementwise_cost)(lambda x: x)
    x = tg.from_numpy(W, tiles=4)
    with pytest.raises(TypeError, match="positional argument") as e:
        per_tile(k, [x], x, "costly")
    assert any("cost function of tile kernel 'e2e47_uncalled_factory': cost(in_shapes, out_shapes, itemsize, params)"
               in n for n in e.value.__notes__)


# ----------------------------------------------------------- emit1 and new_tensor, as recorded --
def test_emit_refuses_a_plain_function_a_tensor_for_a_tile_and_a_bad_meta():
    """Before: emit1 of an undecorated function -> AttributeError 'function' object has no
    attribute 'cost'; a TileTensor where a tile goes (``[x]`` for ``[x.grid[i]]``) -> an
    AttributeError 'no attribute node' at compute; a shape 4 for (4,) -> "'int' object is not
    iterable". Now each is a TileError of ``tilegraph.emit`` naming the op, and what to pass."""
    x = tg.from_numpy(W, tiles=4)
    with pytest.raises(TileError, match=r"must be a Kernel: a function decorated with @kernel\('name'\)") as e:
        emit1(lambda t: t, [x.grid[0]], (4,), x.dtype, op="mine")
    assert e.value.where == "tilegraph.emit (op 'mine')" and e.value.received.endswith("(function)")
    with pytest.raises(TileError, match=r"inputs\[0\] must be a TileRef: one tile of it, t.grid\[idx\]") as e:
        emit1(_softplus, [x], (4,), x.dtype, op="mine")
    assert e.value.where == "tilegraph.emit (kernel 'e2e47_softplus' of op 'mine')" and e.value.received == "TileTensor"
    with pytest.raises(TileError, match=r"out_meta must be a list of \(shape, dtype\) pairs") as e:
        emit1(_softplus, [x.grid[0]], 4, x.dtype, op="mine")
    assert "not iterable" in e.value.received


@pytest.mark.parametrize("how", ["shape", "dtype", "array"])
def test_a_forward_whose_tiles_are_not_those_of_its_tensor_is_refused_as_recorded(how):
    """A forward that declares its tiles unlike the tensor it builds: before, a float32 tile in a
    float64 tensor computed without a word (the tensor's dtype a lie); the full-size (4,) tile
    declared for the ragged last tile of 2 failed only at compute, blaming the kernel ("does not
    match its declared meta (4,)") whose output was right; a NumPy array from ``fill`` failed at
    compute with "no attribute node". Now ``new_tensor`` names the tile, what its tiling wants and
    what came, with the kernel and op that made it."""
    k = _to_float32 if how == "dtype" else _softplus

    class Declares(tg.Op):
        name = "e2e47_declares"

        def forward(self, x):
            def fill(i):
                if how == "array":
                    return np.zeros(x.tiling.tile_shape(i))
                shape = (4,) if how == "shape" else x.tiling.tile_shape(i)
                return emit1(k, [x.grid[i]], shape, np.float32 if how == "dtype" else x.dtype, op=self.name)

            return new_tensor(x.tiling, x.dtype, fill), None

    x = tg.from_numpy(W, tiles=4)
    with pytest.raises(TileError) as e:
        Declares()(x)
    assert e.value.where == "tilegraph.new_tensor"
    tile, received = {"shape": ("(2,)", "a tile of shape (4,), dtype float64 by kernel 'e2e47_softplus'"),
                      "dtype": ("(0,)", "a tile of shape (4,), dtype float32 by kernel 'e2e47_to_float32'"),
                      "array": ("(0,)", "ndarray of shape (4,)")}[how]
    assert f"tile {tile}" in e.value.what and "dtype float64" in e.value.what
    assert e.value.received.startswith(received)


# ------------------------------------------------------------------- a kernel's failures, local --
def test_a_failing_kernel_names_its_kernel_op_and_tiles_and_keeps_the_users_line():
    """Before, the note said the kernel and op only: on a ragged tiling it did not say which
    tile failed. Now it also gives the call's input tiles and the tile it was to make; the
    traceback still ends in the user's own line."""
    x = tg.from_numpy(W, tiles=4)
    with pytest.raises(ValueError, match="e2e47: a short tile") as e:
        per_tile(_fails_on_short_tiles, [x], x, "doubler").numpy()
    assert ("in tile kernel 'e2e47_fails_on_short_tiles' of op 'doubler', on input tiles (2,) float64 making (2,) "
            "float64") in e.value.__notes__
    assert _frames(e.value)[-1] == '_fails_on_short_tiles:raise ValueError("e2e47: a short tile")  # the user\'s own line, kept in the traceback'


@pytest.mark.parametrize("k, received", [(_drops_a_row, "(1,) float64"), (_sum, "() float64"),
                                         (_to_float32, "(2,) float32")])
def test_a_kernel_returning_another_tile_names_the_tile_it_declared(k, received):
    """Wrong shape, a 0-d value, wrong dtype: a TileError naming kernel and op, the ragged last
    tile's declared meta (2,) and what came (this held before; pinned for the ragged tile)."""
    x = tg.from_numpy(W[:6], tiles=4)  # tiles (4, 2); each case fails on the ragged tile or first
    with pytest.raises(TileError, match="does not match its declared meta") as e:
        per_tile(k, [x], x, "wrong_tile").numpy()
    assert e.value.where == f"tile kernel {k.name} of op wrong_tile"
    assert e.value.received in (received, received.replace("(2,)", "(4,)").replace("(1,)", "(3,)"))


def test_nan_from_a_kernel_comes_out_as_nan_and_a_0d_tile_may_be_a_numpy_scalar():
    """As in torch, a NaN a kernel computes is a value, not an error; a kernel of a 0-d tile may
    return NumPy's scalar (``x.sum()`` of a 0-d array): it has the declared shape () and dtype."""
    x = tg.from_numpy(W, tiles=4)
    assert np.isnan(per_tile(_nan, [x], x, "nan").numpy()).all()
    s = tg.from_numpy(np.array(2.5))
    assert per_tile(_sum, [s], s, "scalar").numpy() == np.array(2.5)


# ------------------------------------------------------------------------ a correct op vs torch --
@pytest.mark.parametrize("mode", MODES)
def test_the_readme_op_matches_torch_forward_and_gradient(mode):
    """The README's op over single, even and ragged tilings: forward and gradient are torch's."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal((7, 5)) * 3
    check_against_torch(softplus, torch.nn.functional.softplus, [x], "ij", mode)


class _Head(tg.nn.Module):
    def __init__(self, w0, tiles):
        self.w = tg.nn.Parameter(w0, tiles, name="w")

    def forward(self, x):
        return tg.mean(softplus(x @ self.w))


def _train(tiles, x_tiles, runtime=None, steps=3):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 7))
    xs = [rng.standard_normal((6, 5)) for _ in range(steps)]
    m = _Head(w0, tiles)
    step = tg.TrainStep(m, tg.optim.SGD(m.parameters(), lr=0.5), lambda mm, x: mm(x), batch_tiles=[x_tiles],
                        runtime=runtime)
    losses = [float(step(x)) for x in xs]
    return w0, xs, losses, m.w.numpy()


def _torch_train(w0, xs):
    torch = pytest.importorskip("torch")
    w = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.5)
    losses = []
    for x in xs:
        opt.zero_grad()
        loss = torch.nn.functional.softplus(torch.tensor(x) @ w).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, w.detach().numpy()


@pytest.mark.parametrize("mode", MODES)
def test_the_readme_op_in_a_train_step_trains_as_torch(mode):
    """The op inside a TrainStep (SGD, three steps): losses and the trained weight are torch's,
    with single, even and ragged tiles of the weight and the batch."""
    sizes: dict = {}
    x_tiles, w_tiles = tiles_for((6, 5), "bk", mode, sizes), tiles_for((5, 7), "kn", mode, sizes)
    w0, xs, losses, w = _train(w_tiles, x_tiles)
    want_losses, want_w = _torch_train(w0, xs)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    np.testing.assert_allclose(w, want_w, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------- on two worker processes --
NOTEBOOK_CELL = '''
@kernel("e2e47_cell")
def cell_kernel(x):
    if x.shape[0] < 4:
        raise ValueError("e2e47 cell: a short tile")
    return x * {factor}
'''


def _run_cell(factor: int):
    """A notebook cell defining a kernel (module ``__main__``: the workers cannot import it)."""
    ns = {"kernel": kernel, "__name__": "__main__"}
    exec(compile(NOTEBOOK_CELL.format(factor=factor), "<notebook cell>", "exec"), ns)
    return ns["cell_kernel"]


@pytest.mark.distributed
def test_on_two_workers_a_notebook_kernel_runs_fails_clearly_and_runs_again_as_redefined(embedded_runtime):
    """A kernel of ``__main__`` travels to the workers by value. Before, a cell defining it again
    (edited: ``x * 3`` for ``x * 2``) was replaced on the client only: the workers, which had the
    name already, kept running the first definition for as long as they lived. Now a new
    definition replaces the old on the workers too. A failure there comes back as the kernel's
    own error, with the note naming kernel, op and tiles, and the cell's line last in the
    traceback."""
    try:
        with embedded_runtime.as_current():
            x = tg.from_numpy(np.ones(8), tiles=4)
            np.testing.assert_array_equal(per_tile(_run_cell(2), [x], x, "cell").numpy(), np.full(8, 2.0))
            np.testing.assert_array_equal(per_tile(_run_cell(3), [x], x, "cell").numpy(), np.full(8, 3.0))
            ragged = tg.from_numpy(np.ones(6), tiles=4)
            with pytest.raises(ValueError, match="e2e47 cell: a short tile") as e:
                per_tile(_run_cell(3), [ragged], ragged, "cell").numpy()
    finally:
        _KERNELS.pop("e2e47_cell", None)
    assert "in tile kernel 'e2e47_cell' of op 'cell', on input tiles (2,) float64 making (2,) float64" in e.value.__notes__
    last = traceback.extract_tb(e.value.__traceback__)[-1]  # the cell's raise (its file named as tblib can)
    assert (last.name, last.lineno) == ("cell_kernel", 5)


@pytest.mark.distributed
def test_on_two_workers_a_closure_kernel_trains_as_torch_and_a_wrong_tile_is_named(embedded_runtime):
    """A kernel made from a closure (a lambda reading a variable of the session) runs on the
    workers; the README's op trains there as torch does (ragged tiles); a kernel returning the
    wrong tile is named as on the in-process path."""
    scale = 3.0
    k = kernel("e2e47_closure")(lambda t: t * scale)
    try:
        with embedded_runtime.as_current():
            x = tg.from_numpy(W, tiles=4)
            np.testing.assert_array_equal(per_tile(k, [x], x, "closure").numpy(), W * 3.0)
            w0, xs, losses, w = _train((3, 4), (4, 3), runtime=embedded_runtime)
            with pytest.raises(TileError, match="does not match its declared meta") as e:
                per_tile(_drops_a_row, [x], x, "wrong_tile").numpy()
    finally:
        _KERNELS.pop("e2e47_closure", None)
    want_losses, want_w = _torch_train(w0, xs)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)
    np.testing.assert_allclose(w, want_w, rtol=1e-12, atol=1e-14)
    assert e.value.where == "tile kernel e2e47_drops_a_row of op wrong_tile"
