"""A training step recorded once and replayed: forward, backward and update in one Dask graph."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tilegraph._autograd import grad
from tilegraph._errors import TileError
from tilegraph._graph import Cell
from tilegraph._lower import Executable
from tilegraph._tensor import TileTensor, Tiling, tensor_from_cells
from tilegraph.nn import Module
from tilegraph.optim import Optimizer

__all__ = ["TrainStep", "StepStats"]


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None
    lr: float
    seconds: float          # wall time of the step as seen by the client
    record_seconds: float   # time spent recording/planning (0 when the plan was cached)
    tasks: int              # Dask tasks submitted
    nodes: int              # tile kernels in the logical graph


class _Recorded:
    def __init__(self, exe: Executable, inputs: list[tuple[Tiling, np.ndarray]], assignments, n_fetch):
        self.exe, self.inputs, self.assignments, self.n_fetch = exe, inputs, assignments, n_fetch


class TrainStep:
    """``loss = step(*batch)`` runs one optimizer step of ``loss_fn(model, *inputs)``.

    The graph is recorded, placed and clustered once per distinct batch signature (shapes, dtypes,
    tiles); later steps only bind the new batch and re-lower with fresh keys. Parameters and
    optimizer state stay where the step left them (on the workers when a runtime is connected);
    only the loss (and the gradient norm when clipping) come back.

    ``batch_tiles`` gives tile sizes for each batch input (one tuple per input; None: one tile).
    """

    def __init__(self, model: Module, optimizer: Optimizer, loss_fn: Callable[..., TileTensor], *,
                 batch_tiles: Sequence | None = None, runtime=None, **compile_options):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.batch_tiles = batch_tiles
        self.runtime = runtime
        self.compile_options = compile_options
        self._cache: dict[tuple, _Recorded] = {}
        self.last: StepStats | None = None

    def _record(self, batch: Sequence[np.ndarray]) -> _Recorded:
        inputs, tensors = [], []
        for i, a in enumerate(batch):
            tiling = Tiling.from_sizes(a.shape, None if self.batch_tiles is None else self.batch_tiles[i], where=f"tilegraph.TrainStep batch[{i}]")
            cells = np.empty(tiling.grid, dtype=object)
            for idx in np.ndindex(*tiling.grid):
                shape = tiling.tile_shape(idx)
                cells[idx] = Cell(None, shape, a.dtype, token="unbound")
            inputs.append((tiling, cells))
            tensors.append(tensor_from_cells(tiling, a.dtype, cells, name=f"batch{i}"))
        loss = self.loss_fn(self.model, *tensors)
        if not isinstance(loss, TileTensor) or loss.size != 1:
            raise TileError("tilegraph.TrainStep", "loss_fn must return a scalar TileTensor",
                            repr(loss))
        params = self.optimizer.params
        grads = grad(loss, params, allow_unused=False)
        assignments, norm = self.optimizer.record(grads)
        roots = [loss.grid.flat[0]] + ([norm] if norm is not None else []) + [r for _, r in assignments]
        exe = Executable(roots, runtime=self.runtime, **self.compile_options)
        return _Recorded(exe, inputs, [c for c, _ in assignments], 1 + (norm is not None))

    def signature(self, batch) -> tuple:
        return tuple((a.shape, str(a.dtype)) for a in batch)

    def _lookup(self, batch) -> tuple[_Recorded, bool]:
        """The recorded step for this batch signature, and whether it was recorded just now."""
        key = self.signature(batch)
        rec = self._cache.get(key)
        if rec is not None:
            return rec, False
        rec = self._cache[key] = self._record(batch)
        return rec, True

    def plan(self, *batch) -> Executable:
        """The cached executable for this batch signature (recorded on first use)."""
        return self._lookup([np.asarray(a) for a in batch])[0].exe

    def __call__(self, *batch) -> float:
        t0 = time.perf_counter()
        batch = [np.asarray(a) for a in batch]
        rec, recorded = self._lookup(batch)
        t1 = time.perf_counter()
        for i, (a, (tiling, cells)) in enumerate(zip(batch, rec.inputs)):
            # The step number makes keys unique; hashing the batch would cost ~1 ms per MB, every step.
            token = f"batch{i}-{id(self):x}-step{self.optimizer.step_count + 1}"
            for idx in np.ndindex(*tiling.grid):
                cells[idx].set(np.array(a[tiling.slices(idx)], order="C"), token=f"{token}-{idx}")
        if rec.exe.runtime is not None:  # parameters and state still on the client move to the workers
            rec.exe.runtime.scatter_cells(rec.assignments)
        self.optimizer.next_hyper()
        values = rec.exe.run(fetch=range(rec.n_fetch))
        loss = float(np.asarray(values[0]).reshape(()))
        norm = float(values[1][3]) if rec.n_fetch > 1 else None
        for cell, v in zip(rec.assignments, values[rec.n_fetch:]):
            cell.set(v)
        self.last = StepStats(loss, norm, self.optimizer.schedule(self.optimizer.step_count),
                              time.perf_counter() - t0, t1 - t0 if recorded else 0.0,
                              rec.exe.n_tasks, rec.exe.n_nodes)
        if not np.isfinite(loss):
            raise FloatingPointError(f"[tilegraph.TrainStep] loss became {loss} at step {self.optimizer.step_count}")
        return loss
