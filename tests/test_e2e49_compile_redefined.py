"""A kernel defined again (a notebook cell edited and run again) after ``tg.compile`` made a graph
that calls it: the compiled graph runs the new definition, in this process and on the workers
alike. Before, this process ran the first definition for good, and the workers ran it until
another graph brought them the new one, after which every graph, old ones included, ran that:
the same compiled graph gave 2x in one place and 3x in the other."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph._graph import _KERNELS, kernels_redefined
from tilegraph.ext import emit1, kernel, new_tensor

from test_e2e48_kernel_redefined import _run_cell as _cell_of


def _run_cell(factor):
    """The notebook cell (module ``__main__``), run with ``factor`` in its kernel."""
    return _cell_of(factor, "e2e49_scaled")


def _scaled(x, k):
    return new_tensor(x.tiling, x.dtype, lambda i: emit1(k, [x.grid[i]], x.tiling.tile_shape(i), x.dtype,
                                                         op="e2e49_scaled"))


@pytest.fixture
def cell():
    yield _run_cell
    _KERNELS.pop("e2e49_scaled", None)


def _value(exe) -> float:
    out = exe.run()[0]
    assert np.all(out == out.flat[0])
    return float(out.flat[0])


def _check(cell):
    x = tg.from_numpy(np.ones((4, 6)), (2, 3))
    first = cell(2)
    y = _scaled(x, first)
    old = tg.compile(y)
    assert _value(old) == 2.0
    token = old.values_token()
    assert old.values_token() == token  # (the same keys twice, while nothing changes)
    before = kernels_redefined()
    second = cell(3)  # the cell edited and run again
    assert kernels_redefined() == before + 1
    assert _value(old) == 3.0  # it was 2.0 (in this process: for good)
    assert old.values_token() != token  # other tasks: their programs call another function
    # a graph recorded before the new definition and compiled after it runs it as well
    assert _value(tg.compile(y)) == 3.0
    new = tg.compile(_scaled(x, second))
    assert _value(new) == 3.0
    assert _value(old) == 3.0 and _value(new) == 3.0
    cell(5)
    assert _value(new) == 5.0 and _value(old) == 5.0  # (on a cluster: new went first this time)


def test_a_compiled_graph_runs_a_kernel_defined_again_in_process(cell):
    _check(cell)


@pytest.mark.distributed
def test_a_compiled_graph_runs_a_kernel_defined_again_on_workers(cell, embedded_runtime):
    with embedded_runtime.as_current():
        _check(cell)


def test_compiled_graphs_keep_their_programs_while_no_kernel_is_defined_again(cell):
    """A kernel registered for the first time redefines nothing: the programs stay as they were."""
    x = tg.from_numpy(np.ones((4, 6)), (2, 3))
    exe = tg.compile(_scaled(x, cell(2)))
    assert _value(exe) == 2.0
    ops = [p.prog.ops for p in exe.plans]
    k = kernel("e2e49_unrelated")(lambda t: t)
    try:
        assert _value(exe) == 2.0
        assert [p.prog.ops for p in exe.plans] == ops
        assert all(a is b for a, b in zip([p.prog.ops for p in exe.plans], ops))
    finally:
        _KERNELS.pop("e2e49_unrelated", None)
    del k
