"""A kernel defined again (a notebook cell edited and run again) after a TrainStep or EvalStep
recorded its graph: the next step records again and runs the new definition. Before, the step kept
the Kernel object it recorded and ran the first definition until a new step was built."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph._graph import _KERNELS, kernels_redefined
from tilegraph.ext import elementwise_cost, emit1, kernel, new_tensor

CELL = '''
@kernel("{name}", cost=elementwise_cost(1))
def scaled(x):
    return x * {factor}
'''


def _run_cell(factor, name="e2e48_scaled"):
    """The notebook cell (module ``__main__``), run with ``factor`` in its kernel ``name``."""
    ns = {"kernel": kernel, "elementwise_cost": elementwise_cost, "__name__": "__main__"}
    exec(compile(CELL.format(factor=factor, name=name), "<notebook cell>", "exec"), ns)
    return ns["scaled"]


CELLS = {}  # the op reads the kernel by name at record time, as a notebook's op reads its global


class Scaled(tg.Op):
    name = "e2e48_scaled"

    def forward(self, x):
        k = CELLS["scaled"]
        return new_tensor(x.tiling, x.dtype, lambda i: emit1(k, [x.grid[i]], x.tiling.tile_shape(i), x.dtype,
                                                             op=self.name)), None

    def backward(self, ctx, g):
        return (g,)  # (the gradient does not matter here)


class Model(tg.nn.Module):
    def __init__(self):
        self.w = tg.nn.Parameter(np.ones((4, 3)), tiles=(2, 3))

    def forward(self, x):
        return Scaled()(tg.matmul(x, self.w)).sum()


@pytest.fixture
def cell():
    yield lambda factor: CELLS.__setitem__("scaled", _run_cell(factor))
    _KERNELS.pop("e2e48_scaled", None)
    CELLS.clear()


def test_a_train_step_and_an_eval_step_run_a_kernel_defined_again(cell):
    x = np.ones((2, 4))
    cell(2)
    m = Model()
    step = tg.TrainStep(m, tg.optim.SGD(m.parameters(), lr=0.0), lambda mm, x: mm(x), batch_tiles=[(2, 2)])
    ev = tg.EvalStep(m, lambda mm, x: mm(x), batch_tiles=[(2, 2)])
    assert float(step(x)) == 2 * 24.0 and ev(x) == 2 * 24.0
    assert float(step(x)) == 2 * 24.0  # (the recorded graph, reused)
    before = kernels_redefined()
    cell(3)                            # the cell edited and run again
    assert kernels_redefined() == before + 1
    assert float(step(x)) == 3 * 24.0  # it was 48.0: the first definition
    assert ev(x) == 3 * 24.0
    # a kernel registered for the first time changes nothing: the steps keep their graphs
    k = kernel("e2e48_unrelated")(lambda t: t)
    try:
        assert kernels_redefined() == before + 1
        recorded = len(step.executables)
        assert float(step(x)) == 3 * 24.0 and len(step.executables) == recorded
    finally:
        _KERNELS.pop("e2e48_unrelated", None)
    del k
