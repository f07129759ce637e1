"""A training step recorded once and replayed: forward, backward and update in one Dask graph."""

from __future__ import annotations

import inspect
import logging
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import numpy as np

from tilegraph._autograd import grad, no_grad
from tilegraph._config import _CHECKS as _CONFIG_CHECKS, BATCH_SPLITTING_STRATEGIES, is_int, require_int
from tilegraph._errors import TileError
from tilegraph._graph import Cell, TileRef, ValueRef, kernels_redefined, leaf, to_host
from tilegraph import _health  # (its time constants are read there: a test may change them)
from tilegraph._health import (EVAL_LENT_HINT, LOST_STATE_HINT, StepTimeoutError, WorkerLostError, _futures,
                               _lost_errors, _short, _steps_text, end_calls, lost_worker_error, on_workers,
                               translate_worker_failure, why_removed, worker_health, workers_left)
from tilegraph._lower import (EXECUTABLE_OPTIONS, Executable, Fetching, call_failure, calls_of, check_runtime,
                              check_values_reachable, config, first_failure, forget_frames, gather, raising_copies,
                              with_calls)
from tilegraph.exec.gang import PeerFailedError
from tilegraph._tensor import TileTensor, Tiling, assign_cells, tensor_from_cells
from tilegraph.nn import Dropout, Module, training
from tilegraph.optim import Optimizer

__all__ = ["TrainStep", "PendingStep", "StepStats", "EvalStep", "WorkerLostError", "StepTimeoutError"]


@dataclass
class StepStats:
    loss: float
    grad_norm: float | None
    lr: float
    seconds: float          # wall time of the step as seen by the client (a share of its group's)
    record_seconds: float   # time spent recording/planning (0 when the plan was cached)
    tasks: int              # Dask tasks of the step's graph (of its group's, see TrainStep.submit_steps),
                            # with those moving values between worker processes and fetching results
    nodes: int              # tile kernels in that graph


def _signature(batch) -> tuple:
    return tuple((a.shape, str(a.dtype)) for a in batch)


def _unbound_cells(tiling: Tiling, dtype, token: str) -> np.ndarray:
    """One value-less leaf cell per tile, bound later (batches, gradient accumulators)."""
    cells = np.empty(tiling.grid, dtype=object)
    for idx in np.ndindex(*tiling.grid):
        cells[idx] = Cell(None, tiling.tile_shape(idx), dtype, token=f"{token}-{idx}")
    return cells


def _batch_inputs(batch: Sequence[np.ndarray], batch_tiles, where: str, step=None):
    """Leaf cells (unbound) and TileTensors for the arrays of a batch signature; no ``batch_tiles``:
    :func:`split_rows` for ``step`` (a TrainStep or EvalStep: its runtime and strategy), which
    also gives the per-process row tile of a smaller batch that ``batch_tiles`` would leave whole
    (:func:`_rows_fit`)."""
    shares = split_rows(batch, step.runtime, step.compile_options.get("parallel")) if step is not None else None
    if batch_tiles is None:
        batch_tiles, shares = shares, None
    if batch_tiles is not None and len(batch_tiles) != len(batch):
        raise TileError(where, f"batch_tiles must hold one tiling per batch array ({len(batch)} here)",
                        f"batch_tiles={list(batch_tiles)!r} for {len(batch)} arrays of shapes "
                        f"{', '.join(str(np.shape(a)) for a in batch)}")
    inputs, tensors = [], []
    for i, a in enumerate(batch):
        if a.size == 0:  # it would record a step of NaN loss and still apply the weight decay
            raise TileError(f"{where} batch[{i}]", "a batch array with at least one element (no dim of size 0)",
                            f"shape {a.shape}")
        share = shares[i][0] if shares and shares[i] else None
        tiles = None if batch_tiles is None else _rows_fit(batch_tiles[i], a.shape, share)
        tiling = Tiling.from_sizes(a.shape, tiles, where=f"{where} batch[{i}]")
        cells = _unbound_cells(tiling, a.dtype, "unbound")
        inputs.append((tiling, cells))
        tensors.append(tensor_from_cells(tiling, a.dtype, cells, name=f"batch{i}"))
    return inputs, tensors


def _rows_fit(tiles, shape: tuple, share: int | None = None):
    """A batch array's ``batch_tiles`` entry for an array of ``shape``: a row tile (an integer,
    the first dim's) larger than the rows there are is one tile of them, or, where worker
    processes share the rows (``share``: each one's row tile, :func:`split_rows`), a tile per
    process. The rows are what changes from batch to batch (the last, smaller batch of an epoch;
    a micro-batch of ``accum_steps``), and a tile size given for the full batch was refused on
    those ("tile size of dim 0 is larger than the dimension"; under "data" a batch of one row tile
    has nothing to share). The other dims are checked as given."""
    if not shape or shape[0] == 0:
        return tiles
    rows = shape[0] if share is None or share >= shape[0] else share
    if isinstance(tiles, (tuple, list)) and tiles:
        first = tiles[0]
        if is_int(first) and first > shape[0]:
            return (rows, *tiles[1:])
        return tiles
    if is_int(tiles) and tiles > shape[0]:  # one size for every dim
        return (rows, *(tiles,) * (len(shape) - 1))
    return tiles


def split_rows(batch: Sequence[np.ndarray], runtime, parallel: str | None) -> list | None:
    """The tiling of a batch given no ``batch_tiles``: one tile per array (None), except where a
    step asked by name for a strategy that shares the batch among worker processes ("data",
    "sharded", "zero3") runs on several: then each array's rows in a tile per process, so that
    each process has a share (one tile would have been refused: nothing to share). Only the
    arrays of the batch's rows (the first array's first dim) are cut: an input of another length
    (per-class weights, a 0-d scale) is one tile, which every process reads whole."""
    if (parallel or config.parallel) not in BATCH_SPLITTING_STRATEGIES:
        return None
    from tilegraph.runtime import current_runtime

    rt = runtime if runtime is not None else current_runtime()
    procs = 0 if rt is None or rt.closed else len(rt.worker_threads().get("cpu") or ())
    if procs < 2:
        return None
    rows = next((a.shape[0] for a in batch if a.ndim), None)
    return [(-(-a.shape[0] // procs),) + (None,) * (a.ndim - 1) if a.ndim and a.shape[0] == rows
            else (None,) * a.ndim for a in batch]


def _bind_batch(inputs, batch: Sequence[np.ndarray], token: str) -> None:
    """Put this call's arrays into the batch cells. A per-call token makes keys unique; hashing
    the batch would cost ~1 ms per MB, every step."""
    for i, (a, (tiling, cells)) in enumerate(zip(batch, inputs)):
        assign_cells(cells, tiling, a, token=f"batch{i}-{token}")


def _check_one_signature(batches, where: str) -> None:
    """Several batches recorded into one graph must share their shapes and dtypes."""
    sig = _signature(batches[0])
    for i, b in enumerate(batches[1:], 1):
        if _signature(b) != sig:
            raise TileError(where, "batches with one signature (shapes and dtypes)",
                            f"batch {i}: {_signature(b)}, batch 0: {sig}")


def _per_graph(est_seconds: float) -> int:
    """Steps (or evaluation batches) per graph for one whose estimated time is ``est_seconds``:
    enough for ``config.graph_seconds`` of work, at most ``config.max_steps_per_graph``."""
    return max(1, min(config.max_steps_per_graph, int(config.graph_seconds / max(est_seconds, 1e-9))))


# -- argument checks (shared with tilegraph.Trainer and the checkpoint loader) ---------------------
#: the keyword arguments a step forwards to :class:`Executable` (those it sets itself left out)
COMPILE_OPTIONS = tuple(n for n in EXECUTABLE_OPTIONS if n not in ("runtime", "state_groups", "batch_cells"))


def _follows_current(plans, runtime) -> bool:
    """Whether plans recorded for a step built with ``runtime`` (None: the current runtime) may
    still run. A plan keeps the runtime that was current when it was recorded: one recorded
    before ``tg.connect()`` would go on running on Dask's local scheduler (the cluster unused),
    and one recorded on a runtime since closed cannot run; those are recorded again. A plan on a
    runtime still open keeps it, as the values it updated live there."""
    if runtime is not None:
        return True
    from tilegraph.runtime import current_runtime

    now = current_runtime()
    return not any((exe.runtime is None and now is not None) or (exe.runtime is not None and exe.runtime.closed)
                   for exe in plans)


def _replan_for_workers(plans, runtime) -> bool:
    """Whether ``plans`` were made for other workers than the cluster's now (a worker joined, or a
    lost one's nanny started it again, at another address): planned again, the steps use every
    worker there is. One scheduler call; False without a cluster."""
    made = [exe for exe in plans if exe.workers is not None and exe.runtime is not None and not exe.runtime.closed]
    if not made:
        return False
    now = set(made[0].runtime.workers())
    return any(set(exe.workers.memory_limits) != now for exe in made)


#: seconds a restart waits for the nannies of lost workers to start their processes again (the
#: embedded cluster's take 1-3 s), so that training goes on with as many workers as before
REPLACEMENT_WAIT_SECONDS = 20.0


def wait_for_replacements(runtime, count: int, seconds: float = REPLACEMENT_WAIT_SECONDS) -> int:
    """Wait up to ``seconds`` until the cluster has ``count`` workers again, where its workers have
    nannies (which start a lost worker's process again; dask-mpi's ranks have none: not waited
    for); returns how many it has then."""
    deadline = time.perf_counter() + seconds
    while True:
        info = runtime.workers()
        if len(info) >= count or not any(w.get("nanny") for w in info.values()) or time.perf_counter() > deadline:
            return len(info)
        time.sleep(0.25)


def check_compile_options(where: str, options: dict) -> None:
    """The keyword arguments forwarded to :class:`Executable`: known names (:data:`COMPILE_OPTIONS`),
    each None (the ``tilegraph.config`` setting of that name) or a value that setting accepts."""
    unknown = [k for k in options if k not in COMPILE_OPTIONS]
    if unknown:
        raise TileError(where, f"keyword arguments it forwards to compile are {', '.join(COMPILE_OPTIONS)}",
                        ", ".join(f"{k}={options[k]!r}" for k in unknown))
    for name, value in options.items():
        check = _CONFIG_CHECKS.get(name)
        if value is not None and check is not None and not check[0](value):
            raise TileError(where, f"{name} must be {check[1]} (or None: tilegraph.config.{name})", repr(value))


def optimizer_param_names(optimizer, model, where: str, error: type[TileError] = TileError) -> dict[int, str]:
    """The name in ``model`` of each of ``optimizer``'s parameters (by ``id``); raises ``error``
    naming the first parameter that is not among ``model.named_parameters()``."""
    names = {id(p): n for n, p in model.named_parameters()}
    for i, p in enumerate(optimizer.params):
        if id(p) not in names:
            raise error(where, "every optimizer parameter must belong to the model",
                        f"optimizer.params[{i}] ({p.name}) is not among model.named_parameters()")
    return names


def check_step_arguments(where: str, model, optimizer, loss_fn, batch_tiles, runtime, compile_options,
                         *, eval_only: bool = False) -> None:
    """What :class:`TrainStep` (and :class:`tilegraph.Trainer`) check when built; with
    ``eval_only`` (:class:`EvalStep`), all but the optimizer."""
    if not isinstance(model, Module):
        raise TileError(where, "model must be a tilegraph.nn.Module", f"{type(model).__name__} {model!r:.60}")
    if not eval_only:
        if not isinstance(optimizer, Optimizer):
            raise TileError(where, "optimizer must be a tilegraph.optim optimizer (e.g. "
                            "tg.optim.AdamW(model.parameters()))", f"optimizer={optimizer!r}")
        optimizer_param_names(optimizer, model, where)
    if not callable(loss_fn):
        raise TileError(where, "loss_fn must be callable: loss_fn(model, *tensors) -> scalar TileTensor",
                        f"loss_fn={loss_fn!r}")
    if batch_tiles is not None and not isinstance(batch_tiles, (list, tuple)):
        raise TileError(where, "batch_tiles must be None or a list of tilings, one per batch array "
                        "(e.g. [(8, None), (8, None)])", f"batch_tiles={batch_tiles!r}")
    check_runtime(where, runtime)
    check_compile_options(where, compile_options)


def _structure(model: Module) -> tuple:
    """What a recorded step of ``model`` depends on besides the batch: its parameters (which
    objects, in which order) and which of them are frozen. ``peft.apply_lora`` and
    ``peft.merge_lora`` change a model in place; a step recorded before would go on training the
    graph of before (the detached adapters, or weights since frozen)."""
    return tuple((id(p), p.requires_grad) for p in model.parameters())


def _dropouts(model: Module) -> tuple:
    """The dropout probabilities of ``model``'s layers (``nn.Dropout``'s ``p``, an attention
    layer's or a LoRA adapter's ``dropout``), in module order: a recorded step drops with the
    values of its recording, so ``model.set_dropout(...)`` (or ``layer.dropout = ...``) between
    steps records again. Before, the step went on dropping with the old values, unsaid."""
    return tuple(m.p if isinstance(m, Dropout) else m.dropout for m in model.modules()
                 if isinstance(m, Dropout) or isinstance(getattr(m, "dropout", None), float))


def _loss_of(loss_fn, model, tensors, where: str):
    """``loss_fn(model, *tensors)``; where the batch does not fit loss_fn's parameters (one array
    for a loss_fn of two, say) this says so, naming both, instead of Python's TypeError from inside
    the recording."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call says what it says
        signature = None
    if signature is not None:
        try:
            signature.bind(model, *tensors)
        except TypeError as e:
            name = getattr(loss_fn, "__name__", type(loss_fn).__name__)
            raise TileError(where, f"loss_fn(model, *batch) to take the model and the batch's {len(tensors)} "
                            f"array{'s' * (len(tensors) != 1)} (one argument per array the data gives)",
                            f"{name}{signature}: {e}") from None
    return loss_fn(model, *tensors)


def _check_loss(loss, where: str) -> None:
    if not isinstance(loss, TileTensor) or loss.size != 1:
        raise TileError(where, "loss_fn must return a scalar TileTensor", repr(loss))


def _targets_input(loss: TileTensor, tensors: Sequence[TileTensor]) -> tuple[int, int] | None:
    """Where ``loss`` is a :func:`cross_entropy` of targets that are one of a step's batch
    ``tensors`` as given (not sliced inside ``loss_fn``): that one's index and the loss's
    ``ignore_index``; None otherwise."""
    from tilegraph.ops.loss import _ce_op

    rec = getattr(loss, "_record", None)
    if rec is None or rec.op is not _ce_op:
        return None
    at = next((i for i, t in enumerate(tensors) if t is rec.ctx["targets"]), None)
    return None if at is None else (at, int(rec.ctx["ignore_index"]))


def _unshifted_targets(batch: Sequence[np.ndarray], targets_at: tuple[int, int] | None) -> int | None:
    """The index of another integer batch array equal to the cross-entropy targets that
    ``targets_at`` names (:func:`_targets_input`), where they count (not ``ignore_index``), for
    token sequences (two dims or more); None where there is none."""
    if targets_at is None:
        return None
    at, ignore_index = targets_at
    targets = batch[at]
    if targets.ndim < 2 or targets.dtype.kind not in "iu":
        return None
    counted = targets != ignore_index
    if not counted.any():
        return None
    for i, a in enumerate(batch):
        if i != at and a.shape == targets.shape and a.dtype.kind in "iu" and np.array_equal(a[counted],
                                                                                             targets[counted]):
            return i
    return None


class _Share(NamedTuple):
    """Where a micro-batch's graph stands in its batch (``accum_steps`` > 1): its rows of the
    batch's ``total``, and ``count_rows``, the normaliser of a counted mean's accumulation that
    the batch's first micro-batch set (:meth:`TrainStep._record_micro_batch`; None for that one
    and for other losses). Part of the graph's key: the weight ``rows / total`` and the
    normaliser are recorded into it."""

    rows: int
    total: int
    count_rows: int | None = None


class _Recorded:
    """A recorded graph of ``k`` optimizer steps (or one micro-batch of one): the batch input cells
    of each step, the parameter/state cells its final values go to, and how many values come back
    (the ``k`` losses, then the ``k`` clipping norms when clipping is on)."""

    def __init__(self, exe: Executable, inputs: list[list[tuple[Tiling, np.ndarray]]], assignments, n_fetch, hypers):
        self.exe, self.inputs, self.assignments, self.n_fetch = exe, inputs, assignments, n_fetch
        self.hypers = hypers  # step j's scalar cell (k > 1)
        #: a micro-batch of a counted mean (see TrainStep._record_micro_batch): its loss's dtype
        self.counted: np.dtype | None = None
        #: a micro-batch of a counted mean: the count its accumulation is normalised by (the first
        #: micro-batch's targets, which every later micro-batch of the batch is recorded with)
        self.count_rows: int | None = None
        #: the indices of the optimizer's parameters whose update the graph records (None: no update)
        self.updated: list[int] | None = None
        #: the batch input a cross_entropy loss takes as its targets as given, and its ignore_index
        #: (None: another loss)
        self.targets_at: tuple[int, int] | None = None
        self.fixed = self._fixed_leaves()

    def _fixed_leaves(self) -> tuple[list[Cell], list]:
        """The leaf values every run reads as they are (frozen weights: an adapter's base; no
        batch input, nothing the step updates, nothing small enough to travel inside its task),
        with the workers of the tasks reading each (a tuple; None: unknown). Left on the client,
        they would travel inside every step's graph: 475 MB per step for LoRA on GPT-2 124M."""
        from tilegraph._lower import INLINE_MAX_BYTES

        skip = {id(c) for step in self.inputs for _, cells in step for c in cells.flat}
        skip |= {id(c) for c in self.assignments}
        cells: dict[int, Cell] = {}
        readers: dict[int, set] = {}
        for c, plan in zip(self.exe.clusters, self.exe.plans):
            for ref in plan.ext:
                cell = ref.node.cell if ref.node.is_leaf else None
                if cell is None or id(cell) in skip or getattr(cell.value, "nbytes", 0) <= INLINE_MAX_BYTES:
                    continue
                cells[id(cell)] = cell
                readers.setdefault(id(cell), set()).add(self.exe.worker_of.get(c.id))
        return list(cells.values()), [None if None in r else tuple(sorted(r)) for r in readers.values()]


def _refs_of(cells: np.ndarray, current: dict[int, TileRef]) -> np.ndarray:
    grid = np.empty(cells.shape, dtype=object)
    for idx in np.ndindex(*cells.shape):
        grid[idx] = current[id(cells[idx])]
    return grid


#: the copies of values held here that graphs read again and again (a model's parameters, which
#: :func:`tilegraph.models.generate`, its ``Decoder`` and :class:`EvalStep` lend to the workers,
#: putting the client's values back after each call), kept on each runtime's workers for the
#: next call while the value is unchanged: by the id of the client's array, its weak reference,
#: the copy's :class:`ValueRef` and the finalizer that forgets the copy once the array is gone. A
#: parameter changes by being given a new array (an optimizer step run here, ``load_state_dict``,
#: ``copy_``; trained on the workers, it holds a reference there and is not lent at all), so an
#: array still alive is still the value that was sent. Each call sent every value again: under
#: new keys for generate (the time of the upload, GPT-2 124M's 500 MB, and 37 more keys a
#: gpt2-debug call in the memos of Dask's scheduler, for good: its ``key_split`` cache alone
#: holds up to 100,000), inside the graph for an evaluation (GPT-2 124M: 475 MB a call, with
#: Dask's "Sending large graph" warning). A closed or dropped runtime's copies go with it, and a
#: dropped model's with its arrays; so do those of a model trained since on the workers, once
#: its first step has run (its parameters then hold references there, and their arrays here go).
_LENT: "weakref.WeakKeyDictionary[object, dict[int, tuple]]" = weakref.WeakKeyDictionary()


def lend_cells(runtime, cells: Sequence[Cell]) -> list:
    """Give ``cells`` (holding values here) references to copies of their values on ``runtime``'s
    workers: the copies lent at an earlier call where the workers still hold them, else sent now
    (``runtime.scatter_cells``) and kept for the next calls (:data:`_LENT`). Returns what
    :func:`put_back` restores (each cell's value and token here)."""
    restore = [(c, c.value, c.token) for c in cells]
    lent = _lent_copies(runtime)
    reused, fresh = [], []
    for c in cells:
        ref = _copy_on_workers(lent, c.value, runtime)
        if ref is None:
            fresh.append(c)
        else:
            reused.append((c, ref))
    try:
        runtime.scatter_cells(fresh)
        for c, ref in reused:
            c.set(ref)
    except BaseException:  # (a Ctrl-C while they are sent: the cells hold their values here again)
        put_back(restore)
        raise
    for c, value, _ in restore:
        if type(c.value) is ValueRef and c.value.index is None and id(value) not in lent:
            _keep_lent(lent, value, c.value, runtime)
    return restore


def put_back(restore: list) -> None:
    """The values :func:`lend_cells` lent, in their cells here again (with their tokens)."""
    for cell, value, token in restore:
        cell.set(value, token)


def _lent_copies(runtime) -> dict[int, tuple]:
    """``runtime``'s entries of :data:`_LENT` (those of closed runtimes forgotten first)."""
    for rt in [rt for rt in list(_LENT.keys()) if rt.closed]:
        for _, _, finalizer in _LENT.pop(rt).values():
            finalizer.detach()
    return _LENT.setdefault(runtime, {})


def _copy_on_workers(lent: dict[int, tuple], value, runtime) -> ValueRef | None:
    """The copy of ``value`` lent before that ``runtime``'s workers still hold, else None."""
    entry = lent.get(id(value))
    if entry is None:
        return None
    array, ref, finalizer = entry
    if array() is value and ref.future.status == "finished" and ref.future.client is runtime.client:
        return ref
    finalizer.detach()   # (its worker lost, say: sent again)
    del lent[id(value)]
    return None


def _keep_lent(lent: dict[int, tuple], value, ref: ValueRef, runtime) -> None:
    try:
        array = weakref.ref(value)
    except TypeError:   # (a value that takes no weak reference is sent at every call, as before)
        return
    finalizer = weakref.finalize(value, _forget_lent, weakref.ref(runtime), id(value))
    finalizer.atexit = False   # (at the exit the runtime closes, and its futures with it)
    lent[id(value)] = (array, ref, finalizer)


def _forget_lent(runtime: "weakref.ref", key: int) -> None:
    """A lent array's finalizer: its copy on the workers is released."""
    rt = runtime()
    if rt is not None:
        _LENT.get(rt, {}).pop(key, None)


#: how many recorded plans a :class:`TrainStep` or :class:`EvalStep` keeps (``plans_kept``): those
#: of the batch signatures (and, for a TrainStep, steps per graph and accumulation phases) used
#: most recently. Every plan was kept for good: batches of varying length (a loader that does not
#: pad to one length, an evaluation at several lengths) added one each, with its graph, its
#: programs on the workers and its last batch (gpt2-debug: about 0.8 MB a plan in this process).
#: A plan dropped is recorded again (seconds for a large model) when its signature comes back.
PLANS_KEPT = 16


class _Plans(OrderedDict):
    """Recorded plans by key, the ``kept`` most recently used (:data:`PLANS_KEPT`); a key recorded
    again after it was dropped warns once per owner: each step with it then records its graph
    again, which a larger ``plans_kept`` (or fewer batch lengths) avoids."""

    def __init__(self, owner: str):
        super().__init__()
        self.owner = owner
        self.dropped: set = set()  # the keys dropped (forgotten past 1,024 of them: bounded too)
        self.said = False

    def lookup(self, key):
        plan = self.get(key)
        if plan is not None:
            self.move_to_end(key)
        return plan

    def keep(self, key, plan, kept) -> None:
        if key in self.dropped and not self.said:
            self.said = True
            warnings.warn(f"[tilegraph.{self.owner}] a batch signature whose plan was dropped comes back and is "
                          f"recorded again (a {self.owner} keeps the plans of the {kept} signatures used last, "
                          f"plans_kept={kept}): batches of more shapes than that record a graph at almost every "
                          f"step; pad them to fewer lengths, or keep more plans (tilegraph.{self.owner}.plans_kept = "
                          "N for every one, or on one: step.plans_kept = N, a Trainer's trainer.step.plans_kept)",
                          stacklevel=_outside_tilegraph())
        self[key] = plan
        while len(self) > kept:
            old, _ = self.popitem(last=False)
            if len(self.dropped) >= 1024:
                self.dropped.clear()
            self.dropped.add(old)

    def clear(self) -> None:
        super().clear()
        self.dropped.clear()


class TrainStep:
    """``loss = step(*batch)`` runs one optimizer step of ``loss_fn(model, *inputs)``.

    The graph is recorded, placed and clustered once per distinct batch signature (shapes, dtypes,
    tiles); later steps only bind the new batch and re-lower with fresh keys. Parameters and
    optimizer state stay where the step left them (on the workers when a runtime is connected);
    only the loss (and the gradient norm when clipping) come back.

    ``batch_tiles`` gives tile sizes for each batch input (one tuple per input; None: one tile,
    or with ``parallel`` "data", "sharded" or "zero3" on several worker processes, each input's
    rows in a tile per process).

    :meth:`submit_steps` runs several optimizer steps recorded as one graph (each step's update
    feeding the next step's forward), so a small model pays Dask's per-task latency once per group
    of steps instead of once per step.

    With ``accum_steps=k`` each batch input of the batch's rows (whose first dim is that of the
    first input with one) is split along it into k micro-batches (the other inputs, per-class
    weights or a 0-d scale, go whole to each, as the data-parallel strategies keep them whole) that
    run one after another as separate graphs (k-1 that add their gradients into accumulators kept
    next to the parameters, then one that adds the last and updates), so activations of only one
    micro-batch exist at a time. When ``loss_fn`` returns a :func:`cross_entropy` mean, the
    micro-batches are weighted by the targets each one counts (those not ``ignore_index``): the
    loss and gradient are those of one batch's mean over all its counted targets, as with one large
    batch, and a micro-batch whose targets are all ignored adds nothing. Any other loss is the mean
    over the micro-batches, each weighted by its share of the rows (1/k). Rows that do not divide
    by k are split as ``numpy.array_split`` splits them (10 rows, k=4: 3, 3, 2, 2; fewer rows than
    k: one each), weighted as said: the step is that of the whole batch (a torch loop scales each
    micro-batch's loss by its rows over the batch's), at the cost of graphs of a second shape. All
    k graphs are submitted without waiting; the client waits once per optimizer step.

    The arguments are checked when the step is built (:func:`check_step_arguments`): the
    optimizer's parameters must belong to ``model``, ``runtime`` is None or a Runtime, and the
    other keyword arguments go to :class:`Executable` (``COMPILE_OPTIONS``); the number of
    ``batch_tiles`` is checked against the first batch.

    The recorded plans of the ``plans_kept`` signatures used last are kept (default
    :data:`PLANS_KEPT`; ``step.plans_kept = N`` changes it for one step): one of a signature
    dropped is recorded again when it comes back.
    """

    #: how many recorded plans are kept (see :data:`PLANS_KEPT`)
    plans_kept: int = PLANS_KEPT

    def __init__(self, model: Module, optimizer: Optimizer, loss_fn: Callable[..., TileTensor], *,
                 batch_tiles: Sequence | None = None, runtime=None, accum_steps: int = 1, **compile_options):
        where = "tilegraph.TrainStep"
        check_step_arguments(where, model, optimizer, loss_fn, batch_tiles, runtime, compile_options)
        require_int(where, "accum_steps", accum_steps, 1)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.batch_tiles = batch_tiles
        self.runtime = runtime
        self.accum_steps = accum_steps
        self.compile_options = compile_options
        self._cache: _Plans = _Plans("TrainStep")  # key -> _Recorded, the most recently used last
        self._acc_cells: list[np.ndarray] | None = None  # gradient accumulators, one cell per tile
        self._acc_tot: np.ndarray | None = None
        self._weighted: bool | None = None  # whether the micro-batches' losses are counted means
        self.last: StepStats | None = None
        self._structure = _structure(model)  # what the recorded graphs were recorded for
        self._settings = optimizer.recorded_settings()  # (and with which optimizer settings)
        self._dropouts = _dropouts(model)  # (and dropout probabilities)
        self._kernels = kernels_redefined()  # (and kernels)
        #: counts the failed steps rolled back: a step submitted before the last one of them
        #: does not roll back again (it read the failed step's values)
        self._rollbacks = 0
        self._last_undo = None  # a weak reference to the last step's _Undo
        #: a step was sent as a worker its plans name left (:meth:`_sent_as_workers_left`): the
        #: next one plans again (kept till then: the Trainer reads the plans' workers to undo it)
        self._plans_off_cluster = False
        self._said_superseded = False  # (a newer optimizer over the parameters is said once)
        self._said_unshifted = False  # (targets equal to the inputs are said once: _warn_unshifted)

    def _record(self, batch: Sequence[np.ndarray], kind: str, k: int = 1, share: _Share | None = None) -> _Recorded:
        """Record the step for one (micro-)batch. ``kind``: "step" (``k`` whole steps, each one's
        parameters and state the previous one's update), or with accumulation (``share``: the
        micro-batch's place in its batch) "first" (acc = w g), "add" (acc += w g), "last" (update
        with acc + w g), where ``w`` is the micro-batch's share of the batch (its rows / the
        batch's, 1/k for equal ones; a counted mean's: :meth:`_record_micro_batch`)."""
        where = "tilegraph.TrainStep"
        if share is not None:  # the arrays here are micro-batches: say so where their shapes show
            part = (f"1/{self.accum_steps} of the batch" if share.rows * self.accum_steps == share.total
                    else f"{share.rows} of the batch's {share.total} rows")
            where = f"tilegraph.TrainStep (a micro-batch: {part}, accum_steps={self.accum_steps})"
        params = self.optimizer.params
        # an optimizer parameter frozen since (requires_grad=False) gets no gradient and no update, and
        # keeps its state and update count, as torch's optimizers skip a parameter without a gradient;
        # unfrozen, it trains on from there (it was refused before, and a new optimizer lost every
        # other parameter's state)
        frozen = {i for i, p in enumerate(params) if not p.requires_grad}
        if len(frozen) == len(params):  # (apply_lora freezes the weights of an optimizer made before)
            i = min(frozen)
            name = optimizer_param_names(self.optimizer, self.model, where).get(id(params[i]), params[i].name)
            raise TileError(where, "an optimizer parameter that requires a gradient (each one frozen now gets no "
                            "update): build the optimizer from the parameters that train ([p for p in "
                            "model.parameters() if p.requires_grad]; LoRA: peft.trainable_parameters(model)) and a "
                            "new TrainStep", f"optimizer.params[{i}] ({name}) has requires_grad=False"
                            + (f", and so have the {len(frozen) - 1} others" if len(frozen) > 1 else ""))
        unfrozen = [p for p in getattr(self.optimizer, "frozen_params", ()) if p.requires_grad]
        if unfrozen:  # (torch's optimizer would update it; this one left it out, frozen when it was made)
            names = {id(p): n for n, p in self.model.named_parameters()}
            listed = ", ".join(names.get(id(p), p.name or f"shape {tuple(p.shape)}") for p in unfrozen[:4])
            raise TileError(where, "every parameter given to the optimizer that trains now to have been trainable "
                            "when the optimizer was made: it leaves out the ones frozen then (no state, no update), "
                            "so an unfrozen one would silently never train; for gradual unfreezing make the "
                            "optimizer over every parameter while they all train and freeze some after (a frozen "
                            "one is skipped and keeps its state until unfrozen, as in torch), or make a new "
                            "optimizer over the parameters that train now (and a new TrainStep)",
                            f"{listed}{f' and {len(unfrozen) - 4} more' if len(unfrozen) > 4 else ''} "
                            f"{'has' if len(unfrozen) == 1 else 'have'} requires_grad=True now, False when "
                            f"{type(self.optimizer).__name__} was made")
        # k > 1: step j's scalars come from a hyper cell of its own
        hypers = [None] if k == 1 else [self.optimizer.hyper_cell(f"hyper{j}") for j in range(k)]
        saved = [p.grid for p in params]
        current: dict[int, TileRef] = {}  # cell -> the ref of its value after the steps recorded so far
        inputs, losses, norms = [], [], []
        try:
            for j in range(k):
                ins, tensors = _batch_inputs(batch, self.batch_tiles, where, self)
                with training():  # train-only behaviour (LoRA dropout), also in a recomputed block's backward
                    loss = _loss_of(self.loss_fn, self.model, tensors, where)
                    _check_loss(loss, where)
                    trained = iter(grad(loss, [p for i, p in enumerate(params) if i not in frozen],
                                        allow_unused=True))
                    grads = [None if i in frozen else next(trained) for i in range(len(params))]
                if j == 0:
                    self._check_unused(grads, where, frozen)
                norm = None
                if kind == "step":
                    assignments, norm = self.optimizer.record(grads, hyper=hypers[j], current=current)
                else:
                    assignments, norm, loss_ref, count_rows = self._record_micro_batch(loss, grads, kind, where,
                                                                                        share)
                inputs.append(ins)
                losses.append(loss.grid.flat[0] if kind == "step" else loss_ref)
                norms += [norm] if norm is not None else []
                if j + 1 < k:  # the next step reads this step's update
                    current.update((id(c), r) for c, r in assignments)
                    for p in params:
                        if id(p.cells.flat[0]) in current:  # (one the loss does not depend on: as it was)
                            p.grid = _refs_of(p.cells, current)
        finally:
            for p, g in zip(params, saved):
                p.grid = g
        roots = losses + norms + [r for _, r in assignments]
        # the state a data-parallel plan keeps on every replica (or shards): each parameter tile
        # with its optimizer state (or its accumulator); the batch inputs' row tiles are split
        # among the replicas
        first, per = len(losses) + len(norms), (1 + self.optimizer.n_state if kind in ("step", "last") else 1)
        state_groups = [list(range(k, k + per)) for k in range(first, len(roots), per)]
        batch_cells = [cells for ins in inputs for _, cells in ins]
        exe = Executable(roots, runtime=self.runtime, state_groups=state_groups, batch_cells=batch_cells,
                         **self.compile_options)
        rec = _Recorded(exe, inputs, [c for c, _ in assignments], k + len(norms), hypers)
        assigned = {id(c) for c, _ in assignments}  # (a parameter the loss does not depend on: none)
        rec.updated = [i for i, p in enumerate(params) if id(p.cells.flat[0]) in assigned]
        if kind != "step" and self._weighted:  # what comes back is [loss sum, rows counted]
            rec.counted, rec.count_rows = loss.dtype, count_rows
        rec.targets_at = _targets_input(loss, tensors)
        return rec

    def _check_unused(self, grads: list[TileTensor | None], where: str, frozen: set[int] = frozenset()) -> None:
        """Parameters the loss does not depend on get no update, as torch's optimizers skip one
        whose ``grad`` is None (no weight decay, no change of its state): said once per recorded
        graph, a warning (a layer left out of the forward by mistake shows there); none at all
        used is an error. The ``frozen`` ones (indices) get none either, and are not named."""
        unused = [i for i, g in enumerate(grads) if g is None and i not in frozen]
        if not unused:
            return
        names = optimizer_param_names(self.optimizer, self.model, where)
        params = self.optimizer.params
        listed = ", ".join(names.get(id(params[i]), params[i].name or f"params[{i}]") for i in unused[:6])
        listed += f" and {len(unused) - 6} more" if len(unused) > 6 else ""
        if len(unused) + len(frozen) == len(grads):
            raise TileError(where, "a loss that depends on the parameters the optimizer trains, through recorded "
                            "ops (not computed inside tg.no_grad(), not an integer or a constant)",
                            f"no parameter affects the loss: {listed}")
        warnings.warn(f"[{where}] {listed} {'does' if len(unused) == 1 else 'do'} not affect the loss: not updated "
                      "(no weight decay, no change of the optimizer's state), as torch's optimizers skip a parameter "
                      "without a gradient; freeze it (requires_grad=False) or leave it out of the optimizer to "
                      "silence this", stacklevel=4)

    def _warn_unshifted(self, batch: Sequence[np.ndarray], rec: _Recorded) -> None:
        """Warn, once, where a cross-entropy's targets are the very token ids of another input:
        transformers' ``labels=input_ids`` are shifted inside the model, and a loop ported with them
        here trained the model to copy its input, without a word, as :func:`cross_entropy` compares
        each position's logits with its target as given (random ids, whose loss stays at ln 96 for a
        model that predicts the next one, fell from 4.6 to 2.3 in 30 steps of the debug GPT-2).
        Looked at on the first batch of each recorded graph."""
        if self._said_unshifted:
            return
        same = _unshifted_targets(batch, rec.targets_at)
        if same is None:
            return
        self._said_unshifted = True
        at = rec.targets_at[0]
        warnings.warn(f"[tilegraph.TrainStep] the cross_entropy targets, batch[{at}], are the token ids of "
                      f"batch[{same}] itself: each position's logits are compared with the target given at that "
                      "position, so the model learns to copy its input. transformers' labels=input_ids are shifted "
                      "inside the model; here give the next tokens as the targets, step(ids[:, :-1], ids[:, 1:]) (a "
                      "copying task meant: ignore this)", stacklevel=_outside_tilegraph())

    def _record_micro_batch(self, loss: TileTensor, grads: list[TileTensor], kind: str, where: str, share: _Share):
        """The assignments (accumulators, or on the last micro-batch the update), the clipping
        norm, the value that comes back as this micro-batch's loss and, for a counted mean, the
        count its accumulation is normalised by.

        A :func:`cross_entropy` mean is weighted by the rows each micro-batch counts (not ignored),
        so the k micro-batches give the gradient and loss of one batch's mean over all its counted
        rows, as one large batch would (each micro-batch's own mean, weighted 1/k, is not that
        when they count different rows, and a micro-batch whose rows are all ignored made the
        loss nan). What comes back is then its ``[loss sum, rows counted]``. The accumulators
        hold each micro-batch's gradient of its sum over one count for the whole batch, the
        first micro-batch's targets (``count_rows``; its own each, where they were equal): with
        micro-batches of unequal rows (a batch whose rows do not divide by ``accum_steps``) each
        one's own count gave the smaller ones too much weight. Any other loss is the mean of the
        micro-batches' losses, each weighted by its share of the batch's rows (1/k for equal ones),
        as torch users scale each micro-batch's loss by its rows over the batch's."""
        from tilegraph.ops.loss import add_totals, count_weighted, mean_parts

        acc = self._accumulators()
        parts = mean_parts(loss)
        weighted = parts is not None
        if self._weighted is None:
            self._weighted = weighted
        elif self._weighted != weighted:
            raise TileError(where, "loss_fn to return the same kind of loss for every micro-batch (a cross_entropy "
                            "mean for all, or for none)", "a cross_entropy mean for this micro-batch, another loss "
                            "for another" if weighted else "a cross_entropy mean for another micro-batch, another "
                            "loss for this one")
        norm = count_rows = None
        if weighted:
            tot, rows = parts
            count_rows = rows if kind == "first" else share.count_rows
            acc_tot = self._acc_tot.flat[0]
            new = [None if g is None else count_weighted(g, tot, count_rows, kind, a, leaf(acc_tot))
                   for g, a in zip(grads, acc)]
            totals = [(acc_tot, tot if kind == "first" else add_totals(leaf(acc_tot), tot))]
        else:
            # (share.rows / share.total is 1.0 / k, correctly rounded alike, for equal micro-batches)
            scaled = [None if g is None else g * (share.rows / share.total) for g in grads]
            new = scaled if kind == "first" else [g if g is None else a + g for a, g in zip(acc, scaled)]
            totals = []
        if kind == "last":
            assignments, norm = self.optimizer.record(new)
        else:
            assignments = [(c, r) for a, t in zip(self._acc_cells, new) if t is not None
                           for c, r in zip(a.flat, t.grid.flat)] + totals
        return assignments, norm, tot if weighted else loss.grid.flat[0], count_rows

    def _accumulators(self) -> list[TileTensor]:
        if self._acc_cells is None:
            self._acc_cells = [_unbound_cells(p.tiling, p.dtype, f"acc-{id(self):x}-{p.name}")
                               for p in self.optimizer.params]
            # a cross_entropy mean's [loss sum, rows counted] over the micro-batches so far
            self._acc_tot = _unbound_cells(Tiling(((2,),)), np.float64, f"acc-{id(self):x}-rows")
        return [tensor_from_cells(p.tiling, p.dtype, cells, name=f"acc.{p.name}")
                for p, cells in zip(self.optimizer.params, self._acc_cells)]

    def signature(self, batch) -> tuple:
        return _signature(batch)

    def reset_plans(self) -> None:
        """Forget the recorded graphs: their plans pin tasks and programs to the workers there were
        then. The next step records and plans again on the runtime's workers of that moment."""
        self._cache.clear()
        self._acc_cells = self._acc_tot = self._weighted = None
        self._plans_off_cluster = False

    def follow_workers(self) -> bool:
        """Plan again where the cluster's workers are no longer those the recorded graphs were
        planned for (a worker that joined, a lost one started again by its nanny after a restart
        planned for those left); returns whether it did. The Trainer asks at each ``fit``."""
        if _replan_for_workers(self.executables, self.runtime):
            self.reset_plans()
            return True
        return False

    def _lookup(self, batch, kind: str = "step", k: int = 1, share: _Share | None = None) -> tuple[_Recorded, bool]:
        """The recorded step for this batch signature, kind and number of steps (and a
        micro-batch's ``share`` of its batch), and whether it was recorded just now."""
        if self._plans_off_cluster or not _follows_current(self.executables, self.runtime):
            self.reset_plans()
        structure = _structure(self.model)
        if structure != self._structure:  # the model changed in place (LoRA applied or merged)
            try:
                optimizer_param_names(self.optimizer, self.model, "tilegraph.TrainStep")
            except TileError as e:
                raise TileError("tilegraph.TrainStep", "every optimizer parameter to belong to the model: the model "
                                "changed since this step was made (peft.merge_lora or apply_lora change it in "
                                "place); make a new optimizer and TrainStep over its parameters (LoRA: "
                                "peft.trainable_parameters(model))", e.received) from None
            self.reset_plans()
            self._structure = structure
        settings = self.optimizer.recorded_settings()
        if settings != self._settings:  # opt.weight_decay = ... between steps: recorded with the new value
            self.reset_plans()
            self._settings = settings
        dropouts = _dropouts(self.model)
        if dropouts != self._dropouts:  # model.set_dropout(...) between steps: recorded with the new values
            self.reset_plans()
            self._dropouts = dropouts
        if kernels_redefined() != self._kernels:  # a kernel defined again (a notebook cell): its new form
            self.reset_plans()
            self._kernels = kernels_redefined()
        key = (kind, k, self.signature(batch), share)
        rec = self._cache.lookup(key)
        if rec is not None:
            return rec, False
        require_int("tilegraph.TrainStep", "plans_kept", self.plans_kept, 1)
        rec = self._record(batch, kind, k, share)
        self._cache.keep(key, rec, self.plans_kept)
        return rec, True

    def _micro_batches(self, batch: list[np.ndarray]) -> tuple[list[list[np.ndarray]], list[_Share | None]]:
        """The ``accum_steps`` micro-batches of ``batch`` and each one's :class:`_Share` of it
        (None: the batch whole, one plain step): the arrays of the batch's rows (those whose
        first dim is the first array's that has one) cut along it, the others (per-class weights,
        a 0-d scale) whole in each, as :func:`split_rows` keeps them whole for data parallelism.
        Cut as well, a weight vector of another length went to each micro-batch in parts
        ("shapes do not broadcast" from inside the loss) and a 0-d array was refused, where the
        same step without accumulation ran.

        Rows that do not divide by k are cut as ``numpy.array_split`` and ``torch.tensor_split``
        cut them, the first ``rows % k`` parts one row longer (10 rows, k=4: 3, 3, 2, 2), each
        weighted by its rows (:meth:`_record_micro_batch`): the step is the one of the whole
        batch. A batch of fewer rows than k runs as one micro-batch per row (one row: one plain
        step). They were refused, a callable ``data``'s short last batch of an epoch after every
        step before it had run. The parts of unequal rows are graphs of two shapes (4 recorded
        graphs at most, 3 for equal ones)."""
        k = self.accum_steps
        if k == 1:
            return [batch], [None]
        rows = next((a.shape[0] for a in batch if a.ndim), None)
        if rows is None:
            raise TileError("tilegraph.TrainStep", f"a batch array with rows to split into accum_steps={k} "
                            "micro-batches (its first dim)", f"{len(batch)} arrays, all 0-d")
        cut = [a.ndim > 0 and a.shape[0] == rows for a in batch]
        n = min(k, rows)
        if n <= 1:  # (no rows: refused, naming the array, by _batch_inputs)
            return [batch], [None]
        sizes = [rows // n + (j < rows % n) for j in range(n)]
        ends = np.cumsum([0, *sizes]).tolist()
        micro = [[a[ends[j]:ends[j + 1]] if c else a for a, c in zip(batch, cut)] for j in range(n)]
        return micro, [_Share(size, rows) for size in sizes]

    @staticmethod
    def _kinds(n: int) -> list[str]:
        """The kinds of the graphs of ``n`` micro-batches (:meth:`_record`)."""
        return ["step"] if n == 1 else ["first"] + ["add"] * (n - 2) + ["last"]

    def _micro_plans(self, micro: list, shares: list, upto: Sequence[int] | None = None):
        """Each micro-batch's recorded graph (only those at ``upto``, besides the first) with
        whether it was recorded just now and the seconds that took, in order: the later ones
        are recorded with the normaliser the first one's counted mean set (:class:`_Share`)."""
        count_rows = None
        for j, (mb, kind, share) in enumerate(zip(micro, self._kinds(len(micro)), shares)):
            if j and upto is not None and j not in upto:
                continue
            t0 = time.perf_counter()
            rec, recorded = self._lookup(mb, kind, share=share if j == 0 else share._replace(count_rows=count_rows))
            if j == 0:
                count_rows = rec.count_rows
            yield j, mb, kind, rec, recorded, time.perf_counter() - t0

    @property
    def executables(self) -> list[Executable]:
        """The executables of the graphs recorded so far (one per batch signature, steps per
        graph and accumulation phase)."""
        return [r.exe for r in self._cache.values()]

    def plan(self, *batch) -> Executable:
        """The cached executable of the update for this batch signature (recorded on first use)."""
        micro, shares = self._micro_batches([np.asarray(a) for a in batch])
        *_, (_, _, _, rec, _, _) = self._micro_plans(micro, shares, upto=[len(micro) - 1])
        return rec.exe

    def auto_steps_per_graph(self, *batch) -> int:
        """How many steps :meth:`submit_steps` should take at once for batches like ``batch``:
        enough that one graph holds ``config.graph_seconds`` of estimated work (at most
        ``config.max_steps_per_graph``); 1 for steps that long already, or with accumulation."""
        if self.accum_steps != 1:
            return 1
        return _per_graph(self.plan(*batch).est_seconds())

    def __call__(self, *batch) -> float:
        """Run one optimizer step on ``batch`` and return its loss. A worker retired while it ran
        (``client.retire_workers``, a cluster scaling down) whose values Dask moved to the
        workers left: the step is undone, planned again for those and run again (see
        :meth:`PendingStep.result`); one retired as the step was sent (its plan names it): the
        step, not counted, is planned again for the workers left and sent again."""
        while True:
            try:
                pending = self.submit(*batch)
            except (WorkerLostError, *_lost_errors()):  # a worker left as the step was sent: not counted
                if self._drop_plans_off_cluster():
                    continue
                raise
            try:
                return pending.result()
            except WorkerLostError:
                if pending.undone_on_workers_left is None:
                    raise
                left, why = pending.undone_on_workers_left
                logging.getLogger("tilegraph").warning("tilegraph.TrainStep: worker(s) %s %s while %s ran; the "
                                                       "model's values are on the workers left (Dask moved them), so "
                                                       "the step runs again, planned for the workers "
                                                       "there are now", ", ".join(left), why,
                                                       _steps_text(pending.steps))

    def _sent_as_workers_left(self, runtime, e: BaseException, steps: range) -> BaseException:
        """What to raise for Dask's lost-worker error ``e``, met as ``steps`` were sent to the
        workers (their values scattered, their graph submitted) and taken back (not counted).

        Where a worker the plans name left the cluster or is leaving it (retired: Dask moved what
        it held to the workers left) and every value the steps read is on the workers staying (or
        here): a :class:`WorkerLostError` naming the worker and the steps that says to submit them
        again, and the next step is planned for the workers there are. Before, ``step.submit``
        raised Dask's bare ``CommClosedError`` ("values to send to worker ..., which left the
        cluster"), and so did every later submit (the plans still named the worker). Otherwise a
        worker was lost: the WorkerLostError of :func:`translate_worker_failure` (``e`` where
        the scheduler names no cause)."""
        where = "tilegraph.TrainStep"
        if runtime is None:
            return e
        try:
            info = runtime.workers()
            staying, left = workers_left(info, self.executables)
            kept = [c.value for p in self.optimizer.params for c in p.cells.flat]
            kept += [c.value for state in self.optimizer.state_cells for grid in state for c in grid.flat]
            recoverable = bool(staying and left) and self.optimizer.step_count == steps[0] - 1 \
                and on_workers(runtime, kept, staying)
            why = why_removed(runtime, sorted(left)) if recoverable else ""
        except Exception:  # (the scheduler gone too): said as a lost worker, or e
            recoverable = False
        if not recoverable:
            return translate_worker_failure(runtime, e, _steps_text(steps), steps=steps, where=where) or e
        self._plans_off_cluster = True  # (not dropped now: the Trainer reads their workers to undo the steps)
        left = sorted(left)
        one = len(steps) == 1
        held = ("the workers left hold the model's values (Dask moved them)" if _futures(kept)
                else "the model's values are this process's own (none was sent yet)")
        return WorkerLostError(where, f"worker{'' if len(left) == 1 else 's'} {', '.join(left)} {why} as "
                               f"{_steps_text(steps)} {'was' if one else 'were'} sent to the workers; {held}: "
                               f"the failed step{'' if one else 's'} changed nothing (the model's parameters and "
                               f"optimizer state are those after step {steps[0] - 1}), and "
                               f"{'it is' if one else 'they are'} planned again for the workers left: submit "
                               f"{'it' if one else 'them'} again (step(*batch) does so by itself)",
                               _short(e, 200), workers=left, steps=steps)

    def _drop_plans_off_cluster(self) -> bool:
        """Where a recorded plan names a worker no longer in the cluster, or leaving it (retired),
        forget the plans (the next step plans for the workers staying) and return True."""
        made = [exe for exe in self.executables
                if exe.workers is not None and exe.runtime is not None and not exe.runtime.closed]
        if not made:
            return False
        try:
            staying, left = workers_left(made[0].runtime.workers(), made)
        except Exception:  # (the scheduler gone too: the caller's error stands)
            return False
        if not staying or not left:
            return False
        self.reset_plans()
        return True

    def submit(self, *batch) -> "PendingStep":
        """Submit one optimizer step without waiting for it; ``.result()`` waits and returns the
        loss. The next step may be submitted before this one finished: its graph starts from this
        step's parameters (futures), so consecutive steps overlap Dask's round-trip latency.

        A worker that leaves as the step is sent (retired: ``client.retire_workers``, a cluster
        scaling down) raises a :class:`WorkerLostError` naming it and the step, which changed
        nothing: submitted again, the step is planned for the workers left (see
        :meth:`_sent_as_workers_left`)."""
        t0 = time.perf_counter()
        self._require_open()
        micro, shares = self._micro_batches([np.asarray(a) for a in batch])
        record_seconds = 0.0
        losses = []
        step_no = self.optimizer.step_count + 1
        self.optimizer.lr_at(step_no)  # before any micro-batch runs
        undo = _Undo(self, step_no - 1)
        for j, mb, kind, rec, recorded, seconds in self._micro_plans(micro, shares):
            if recorded:
                record_seconds += seconds
                self._warn_unshifted(mb, rec)
            # (a step again after a failed one rolled back: other keys than those of the failed one)
            _bind_batch(rec.inputs[0], mb, f"{id(self):x}-step{step_no}.{j}-{self._rollbacks}")
            try:
                if j == 0:  # before the step is counted (every micro-batch's graph reads the same parameters)
                    check_values_reachable("tilegraph.TrainStep", rec.exe.leaves, rec.exe.runtime)
                if kind in ("step", "last"):
                    self.optimizer.next_hyper(updated=rec.updated)
                    values = self._run(rec, range(rec.n_fetch), undo)
                else:  # the loss comes back later: the next micro-batch's graph follows at once
                    values = self._run(rec, (0,), undo)
            except _lost_errors() as e:
                undo.abandon()  # (the earlier micro-batches' cells too)
                raise self._sent_as_workers_left(rec.exe.runtime, e, range(step_no, step_no + 1)) from None
            losses.append(values[0])
        norm = values[1] if rec.n_fetch > 1 else None
        undo.until_done(losses)
        # (another loss than a counted mean: the micro-batches' mean weighted by their rows, where unequal)
        rows = [s.rows for s in shares] if len(set(shares)) > 1 else None
        return PendingStep(self, step_no, losses, norm, self.optimizer.schedule(step_no), t0, record_seconds, rec,
                           undo=undo, weights=rows)

    def submit_steps(self, batches: Sequence[Sequence[np.ndarray]]) -> list["PendingStep"]:
        """Submit ``len(batches)`` consecutive optimizer steps as one graph (recorded once per
        number of steps and batch signature); returns one :class:`PendingStep` per step.

        The steps are exactly those of calling :meth:`submit` on each batch in turn, but the graph
        runs as one task (or a few) instead of one per step: for models whose step takes a few
        milliseconds, Dask's latency per dependent task would otherwise dominate. Losses come back
        together when the group has run. Not combined with ``accum_steps`` (a model big enough
        to need accumulation has steps long enough to run one at a time).
        """
        where = "tilegraph.TrainStep.submit_steps"
        batches = [[np.asarray(a) for a in b] for b in batches]
        if not batches:
            raise TileError(where, "at least one batch", "an empty list")
        if len(batches) == 1:
            return [self.submit(*batches[0])]
        if self.accum_steps != 1:
            raise TileError(where, "accum_steps=1 (several steps per graph do not combine with accumulation)",
                            f"accum_steps={self.accum_steps}")
        _check_one_signature(batches, where)
        t0 = time.perf_counter()
        k = len(batches)
        self._require_open()
        rec, recorded = self._lookup(batches[0], "step", k)
        record_seconds = time.perf_counter() - t0 if recorded else 0.0
        if recorded:
            self._warn_unshifted(batches[0], rec)
        first = self.optimizer.step_count + 1
        for j, b in enumerate(batches):
            _bind_batch(rec.inputs[j], b, f"{id(self):x}-step{first + j}-{self._rollbacks}")
        # every value and every step's learning rate checked before the first step is counted
        try:
            check_values_reachable(where, rec.exe.leaves, rec.exe.runtime)
        except _lost_errors() as e:
            raise self._sent_as_workers_left(rec.exe.runtime, e, range(first, first + k)) from None
        for j in range(k):
            self.optimizer.lr_at(first + j)
        undo = _Undo(self, first - 1)
        for j in range(k):
            self.optimizer.next_hyper(rec.hypers[j], rec.updated)
        try:
            values = self._run(rec, range(rec.n_fetch), undo)
        except _lost_errors() as e:  # (_run put the cells and counts back)
            raise self._sent_as_workers_left(rec.exe.runtime, e, range(first, first + k)) from None
        norms = values[k:rec.n_fetch]
        undo.until_done(values[:k])
        return [PendingStep(self, first + j, [values[j]], norms[j] if norms else None, self.optimizer.schedule(first + j),
                            t0, record_seconds if j == 0 else 0.0, rec, group=k, first=first, undo=undo)
                for j in range(k)]

    def _require_open(self) -> None:
        """A step given a runtime that was closed since says so before it counts a step; and one
        whose optimizer is no longer the newest over its parameters warns, once."""
        if self.runtime is not None:
            self.runtime.require_open("tilegraph.TrainStep")
        if not self._said_superseded:
            self._warn_superseded()

    def _warn_superseded(self) -> None:
        """Warn where another optimizer was made over this step's parameters since its own: a
        notebook cell making the optimizer run again (a new learning rate, say) changed nothing,
        as the step goes on with the optimizer it was made with, where torch's loop calls the
        new one's ``step()``."""
        newer = self.optimizer.newer_optimizers()
        if not newer:
            return
        self._said_superseded = True
        names = {id(p): n for n, p in self.model.named_parameters()}
        listed = ", ".join(names.get(id(p), p.name or f"shape {tuple(p.shape)}") for p, _ in newer[:4])
        listed += f" and {len(newer) - 4} more" if len(newer) > 4 else ""
        kinds = " / ".join(sorted({kind for _, kind in newer}))
        mine = type(self.optimizer).__name__
        warnings.warn(f"[tilegraph.TrainStep] a newer {kinds} was made over this step's parameters ({listed}) "
                      f"since the {mine} the step was made with: the step goes on with its own {mine} (its learning "
                      "rate, settings and state) and the new one changes nothing; after running the optimizer's "
                      "cell again, make the step (or Trainer) again with it: step = tg.TrainStep(model, opt, loss_fn)",
                      stacklevel=_outside_tilegraph())

    def _run(self, rec: _Recorded, fetch, undo: "_Undo | None" = None) -> list:
        """Run a recorded graph; its parameter/state cells then hold the new values (futures)
        (``undo`` keeps what they held before, see :class:`_Undo`)."""
        try:
            if rec.exe.runtime is not None:  # parameters and state still on the client move to the workers
                rec.exe.runtime.scatter_cells(rec.assignments, rec.exe.root_workers()[-len(rec.assignments):])
                rec.exe.runtime.scatter_cells(*rec.fixed)  # and frozen weights, to each worker reading them
            values = rec.exe.run(fetch=fetch, wait=False)
        except BaseException:  # (a Ctrl-C while the parameters are sent, or while this process computes the step)
            if undo is not None:
                undo.abandon()
            raise
        for cell, v in zip(rec.assignments, values[rec.n_fetch:]):
            if undo is not None:
                undo.keep(cell)
            cell.set(v)
        return values


def _outside_tilegraph() -> int:
    """The ``stacklevel`` of a warning issued by the caller that names the first frame outside
    tilegraph's package (the user's line: ``step(x, y)`` in a loop, ``trainer.fit()``)."""
    import os
    import sys

    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2  # (level 1: the caller itself)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


class _Undo:
    """What a submitted step's cells (parameters, optimizer state, gradient accumulators) held
    before it, to put back when it fails: a step whose task failed (a token id out of range, say)
    left every parameter pointing at its failed update, and every later step, forward and save of
    the model failed with that first error. Kept only until the step's losses are computed
    (:func:`_watch_losses` looks): the errors of the data come before them, and after them the
    step's update tasks hold what they read anyway (holding it longer would keep the old state
    beside the new)."""

    def __init__(self, owner: "TrainStep", count: int):
        self.owner, self.count, self.rollbacks = owner, count, owner._rollbacks
        self.param_steps = list(owner.optimizer.param_steps)  # (each parameter's update count before it)
        self.before: dict[int, tuple[Cell, object, str]] | None = {}
        self.losses: list = []
        self.failed = False  # seen failed by the watcher (which then lets go of its futures)
        #: the step count put back by a rollback that took this step with it (a later step's, whose
        #: result was waited for first)
        self.undone: int | None = None
        # the step submitted before this one (weak: a chain of them would keep every step's futures)
        self.prev = owner._last_undo or (lambda: None)
        owner._last_undo = weakref.ref(self)

    def abandon(self) -> None:
        """A step stopped before it was sent whole (a KeyboardInterrupt while its parameters were
        scattered or its graph submitted, or, without a runtime, while this process computed it):
        the cells its earlier micro-batches set are put back, and the step and update counts that
        ``next_hyper`` had advanced. Before, the step counted without its update: a fit after
        the stop said "stopped after step 4" with none logged, and went on with other losses
        than an uninterrupted run's."""
        for cell, value, token in (self.before or {}).values():
            cell.set(value, token)
        self.before = None
        self.owner.optimizer.step_count = self.count
        self.owner.optimizer.param_steps = list(self.param_steps)

    def keep(self, cell: Cell) -> None:
        if self.before is not None and id(cell) not in self.before:
            self.before[id(cell)] = (cell, cell.value, cell.token)

    def until_done(self, losses: list) -> None:
        """Let go of what was kept once every one of ``losses`` is computed (and every task of a
        gang call: one process's task may fail after the one that computed the loss)."""
        self.losses = with_calls([v.future for v in losses if isinstance(v, Fetching)], calls_of(losses))
        if not self.losses:  # computed here already (no runtime): nothing to undo
            self.before = None
            return
        with _WATCH:
            _WATCHED.append(self)
            if not _WATCHER:
                _WATCHER.append(threading.Thread(target=_watch_losses, name="tilegraph-step-undo", daemon=True))
                _WATCHER[0].start()
            _WATCH.notify()

    def _has_failed(self) -> bool:
        return self.failed or any(f.status in ("error", "cancelled") for f in self.losses)

    def __call__(self) -> str | None:
        """After this step failed: put the cells back as they were before it (and the optimizer's
        step count), or before the earliest step submitted before it that failed too and whose
        values it read (its result not waited for yet); returns what its error's note says, None
        where nothing can be said (what it kept was let go)."""
        after = "the model's parameters and optimizer state are those after step"
        if self.undone is not None:
            return f"the failed step changed nothing: {after} {self.undone}"
        if self.before is None:
            return None
        if self.rollbacks != self.owner._rollbacks:  # an earlier step was put back since this one was submitted
            self.before = None
            return (f"this step, submitted before an earlier one failed, read that one's values and changed nothing: "
                    f"{after} {self.owner.optimizer.step_count}")
        chain = [self]
        while (p := chain[-1].prev()) is not None and p.before is not None and p.undone is None \
                and p.rollbacks == self.rollbacks and p._has_failed():
            chain.append(p)
        for undo in chain:  # the earliest last: what it kept is what the cells held before it
            for cell, value, token in undo.before.values():
                cell.set(value, token)
            undo.before, undo.undone = None, chain[-1].count
        self.owner.optimizer.step_count = chain[-1].count
        self.owner.optimizer.param_steps = list(chain[-1].param_steps)
        self.owner._rollbacks += 1
        if len(chain) == 1:
            return f"the failed step changed nothing: {after} {self.count}"
        return (f"step {chain[-1].count + 1} failed, and this step read its values: neither changed anything: "
                f"{after} {chain[-1].count}")


#: the steps whose losses are not all computed yet, looked at by :func:`_watch_losses`
_WATCHED: list[_Undo] = []
_WATCH = threading.Condition()
_WATCHER: list[threading.Thread] = []
#: how often the watching thread looks at the losses' futures
UNDO_WATCH_SECONDS = 0.05


def _watch_losses() -> None:
    """Let go of what each step in :data:`_WATCHED` kept (:class:`_Undo`) once its losses are
    computed; stop looking at one whose losses failed (it is put back if its result says so).
    It reads the futures' status, a plain attribute: Dask's ``add_done_callback`` waits on the
    future in its client's event loop, which made a later wait on it in another test's client
    fail ("bound to a different event loop")."""
    while True:
        with _WATCH:
            while not _WATCHED:
                _WATCH.wait()
            for undo in list(_WATCHED):
                states = {f.status for f in undo.losses}
                if undo.before is None or "pending" not in states:
                    if states == {"finished"}:
                        undo.before = None
                    else:
                        undo.failed = True
                    undo.losses = []  # (a loss's future holds its whole task's result)
                    _WATCHED.remove(undo)
            undo = None  # nothing held while waiting
        time.sleep(UNDO_WATCH_SECONDS)


class PendingStep:
    """A submitted training step; :meth:`result` waits for its loss (and gradient norm).

    ``steps``: the steps of the graph it belongs to (one, or a group from
    :meth:`TrainStep.submit_steps`); ``submitted``: ``time.perf_counter()`` at submission;
    ``fresh``: whether the graph was recorded and planned for it (its first run also compiles the
    kernels on the workers).
    """

    def __init__(self, owner: TrainStep, step: int, losses: list, norm, lr: float, t0: float,
                 record_seconds: float, rec: _Recorded, group: int = 1, first: int | None = None,
                 undo: _Undo | None = None, weights: list[int] | None = None):
        self.owner, self.step, self._losses, self._norm, self.lr = owner, step, losses, norm, lr
        self._weights = weights  # the micro-batches' rows, where unequal (None: a plain mean of the losses)
        self._undo = undo
        self._t0, self._record_seconds, self._rec, self._group = t0, record_seconds, rec, group
        self.steps = range(first if first is not None else step, (first if first is not None else step) + group)
        self.submitted, self.fresh = t0, record_seconds > 0
        self._since = time.time()  # workers removed from here on are suspects when it fails
        self.stats: StepStats | None = None
        #: (the workers, how they left) where the step failed as workers left whose values Dask
        #: moved to the workers left, and was undone (see :meth:`result`); else None
        self.undone_on_workers_left: tuple[list[str], str] | None = None

    def result(self, timeout: float | None = None, *, patient: bool = False, undo_retired: bool = True) -> float:
        """Wait for the step and return its loss.

        A worker lost while the step's graph runs ends the wait with a :class:`WorkerLostError`
        naming it and the steps, instead of Dask's error. ``timeout`` (seconds; default: no
        limit) bounds the wait; then the workers are checked: one silent for ``STALL_SECONDS``
        (stopped, hung) is named in a WorkerLostError. When every worker answers, the wait ends
        with a :class:`StepTimeoutError`, or with ``patient=True`` goes on, checking the workers
        again every ``timeout`` seconds. Without a limit the workers are checked every
        ``WATCH_SECONDS`` (2 s) all the same: a lost or stalled one ends the wait as above, and
        a step never waits on a stopped worker (Dask alone would, for its worker-ttl: a minute
        on the embedded cluster, 5 minutes by default).

        A worker that left as a retired one does (``client.retire_workers``, a cluster scaling
        down or ``adapt``: Dask moves what it holds to the workers left first) is no loss: when
        every value the step read is held by a worker left, the step is undone (the model's
        parameters and optimizer state, and the step count, as before it), the step's plans are
        dropped (the next step is planned for the workers there are) and the WorkerLostError says
        to submit the step again (:attr:`undone_on_workers_left`); ``step(x, y)`` does so by
        itself. Before, every later step failed with Dask's "lost dependencies", though no value
        was lost. ``undo_retired=False``: left to the caller (:meth:`tilegraph.Trainer.fit`).
        """
        if self.stats is None:
            runtime = self._rec.exe.runtime
            values = self._losses + ([self._norm] if self._norm is not None else [])
            if runtime is not None:
                runtime.require_open("tilegraph.PendingStep.result")  # (else Dask's "No clients found")
                try:
                    values = self._gather(runtime, values, timeout, patient)
                except Exception as e:  # a task failed (not a worker: what it held is gone, not undone)
                    if isinstance(e, WorkerLostError) and undo_retired:
                        undone = self._undone_on_workers_left(runtime, e)
                        if undone is not None:
                            raise undone from None
                    if isinstance(e, (StepTimeoutError, WorkerLostError, *_lost_errors())):
                        raise
                    if self._undo is not None:  # (e is a copy: both waits raise copies, not the future's own)
                        note = self._undo()
                        if note is not None:
                            e.add_note(f"[tilegraph.TrainStep] {note}")
                    raise
                if self._undo is not None:
                    self._undo.before = None
            n = len(self._losses)
            if self._rec.counted is not None:  # the batch's mean over its counted rows (nan if none)
                total, count = np.sum([to_host(v) for v in values[:n]], axis=0)
                loss = float(np.asarray(total / count if count else np.nan, self._rec.counted))
            else:
                loss = float(np.average([to_host(v).reshape(()) for v in values[:n]], weights=self._weights))
            norm = float(to_host(values[n])[3]) if self._norm is not None else None
            seconds = (time.perf_counter() - self._t0) / self._group  # a group's steps share its time
            self.stats = StepStats(loss, norm, self.lr, seconds, self._record_seconds,
                                   self._rec.exe.tasks_per_call, self._rec.exe.n_nodes)
            self.owner.last = self.stats
        loss = self.stats.loss
        if not np.isfinite(loss):
            raise FloatingPointError(f"[tilegraph.TrainStep] loss became {loss} at step {self.step}")
        return loss

    def _undone_on_workers_left(self, runtime, e: WorkerLostError) -> WorkerLostError | None:
        """After worker loss ``e``: where the workers left the cluster (none of them still there,
        stalled) and every value the step read is held by a worker left, undo the step, drop the
        owner's plans and return the error that says so. None where that cannot be done (a
        worker that died took values with it): ``e`` stands."""
        undo, owner = self._undo, self.owner
        if undo is None or e.stalled or e.during is not None or e.steps is None or self.steps[0] not in e.steps:
            return None
        try:
            info = runtime.workers()
            staying, gone = workers_left(info, owner.executables)
            left = sorted(gone)
            if not staying or not left or set(e.workers) & set(info):
                return None
            if undo.before is None or undo.undone is not None or undo.rollbacks != owner._rollbacks \
                    or not on_workers(runtime, [v for _, v, _ in undo.before.values()], staying):
                return None
            end_calls(runtime, [self])  # (a gang task left waits for its peer; the next one would wait for it)
            why = why_removed(runtime, left)
        except Exception:  # (the scheduler gone meanwhile): e stands
            return None
        first = self.steps[0]
        note = undo()
        if undo.undone != first - 1 or owner.optimizer.step_count != first - 1:
            return None  # (a rollback that took earlier failed steps too: e stands, with its note)
        owner.reset_plans()  # planned again for the workers there are now
        self.undone_on_workers_left = (left, why)
        again = ("the step is planned again for the workers left: submit it again (step(*batch) does so by itself)"
                 if len(self.steps) == 1 else "the steps are planned again for the workers left: submit them again")
        return WorkerLostError("tilegraph.TrainStep", f"worker{'s' if len(left) > 1 else ''} {', '.join(left)} {why} "
                               f"while {_steps_text(self.steps)} ran; the workers left hold the model's values (Dask "
                               f"moved them): {note}, and {again}", _short(e, 200), workers=left, steps=self.steps)

    def _gather(self, runtime, values: list, timeout: float | None, patient: bool) -> list:
        since = getattr(self.owner, "_healthy_since", self._since)
        try:
            if timeout is None:  # no time limit, but a lost or stalled worker ends the wait
                values = gather(runtime, values, _steps_text(self.steps), where="tilegraph.TrainStep",
                                steps=self.steps, since=since)
            else:
                values = self._gather_within(runtime, values, timeout, patient)
        except _lost_errors() as e:
            raise translate_worker_failure(runtime, e, _steps_text(self.steps), steps=self.steps, since=since) from None
        self.owner._healthy_since = time.time()
        return values

    @raising_copies
    def _gather_within(self, runtime, values: list, timeout: float, patient: bool) -> list:
        """:func:`gather`, checking the workers after each ``timeout`` seconds without the values
        (a value already computed but held by a stalled worker never arrives either)."""
        futures = {id(v.future): v.future for v in values if isinstance(v, Fetching)}
        calls = calls_of(values)
        got: dict[int, object] = {}
        t0, period = time.perf_counter(), timeout
        checking = None  # when the time limit passed and the workers began to be checked
        try:
            for future in with_calls(list(futures.values()), calls):  # and a gang call's every task
                key = id(future)
                while key not in got:
                    try:
                        if key in futures:  # (the transfer too: data held by a stalled worker never comes)
                            got[key] = future.result(timeout=max(period, 0.01))
                        else:  # a task of the call whose value is not asked for: waited for, not fetched
                            got[key] = future.exception(timeout=max(period, 0.01))
                    except TimeoutError as e:
                        forget_frames(e)  # (a cycle with this frame, which holds the step's values)
                        failed = call_failure(runtime, calls)  # (a peer waiting for a failed task)
                        if failed is not None:
                            raise failed from None
                        now = time.perf_counter()
                        checking = checking or now
                        period = self._check_workers(runtime, timeout, patient, now - t0, now - checking)
                        if period == timeout:  # patient, and every worker answered: a new time limit
                            checking = None
            failed = call_failure(runtime, calls)
            if failed is not None:
                raise failed
        except PeerFailedError as e:
            raise first_failure(e) from None
        except (StepTimeoutError, WorkerLostError):
            raise
        except Exception:
            failed = call_failure(runtime, calls)
            if failed is None:
                raise
            raise failed from None
        return [(got[id(v.future)] if v.index is None else got[id(v.future)][v.index]) if isinstance(v, Fetching)
                else v for v in values]

    def _check_workers(self, runtime, timeout: float, patient: bool, waited: float, checked: float) -> float:
        """After ``waited`` seconds without the step, the last ``checked`` of them spent checking
        the workers: raise for a lost or stalled worker, or (unless ``patient``) once every worker
        has answered since the checks began; else return how long to wait before looking again."""
        health = worker_health(runtime)
        received = f"no result after {waited:.1f} s (time limit {timeout:.1f} s)"
        if health.failing:
            raise lost_worker_error(health, _steps_text(self.steps), received, steps=self.steps)
        if any(s >= checked for s in health.silence.values()):  # not heard from since: look again soon
            return _health.RECHECK_SECONDS
        if not patient:
            raise StepTimeoutError("tilegraph.TrainStep", f"{_steps_text(self.steps)} did not finish in time, and "
                                   "every worker answers (busy, or waiting for something that never comes)", received)
        logging.getLogger("tilegraph").warning("%s still running after %.0f s (time limit %.0f s); every worker "
                                               "answers, waiting on: the step goes on (the workers are checked again "
                                               "in %.0f s)", _steps_text(self.steps), waited, timeout, timeout)
        return timeout


def _held_here(exe: Executable, inputs: list) -> list[Cell]:
    """The cells of ``exe``'s leaves, batch ``inputs`` aside, that hold arrays here too large to
    travel inside a task (a model's parameters held here: :func:`lend_cells` lends them)."""
    from tilegraph._lower import INLINE_MAX_BYTES

    batch = {id(c) for ins in inputs for _, cells in ins for c in cells.flat}
    return list({id(n.cell): n.cell for n in exe.leaves
                 if id(n.cell) not in batch and isinstance(n.cell.value, np.ndarray)
                 and n.cell.value.nbytes > INLINE_MAX_BYTES}.values())


class EvalStep:
    """``loss = ev(*batch)``: ``loss_fn(model, *inputs)`` without gradients or updates, recorded
    once per batch signature and replayed like :class:`TrainStep` (parameters are read where they
    live; only the loss comes back). :meth:`losses` evaluates several batches per graph."""

    #: how many recorded plans are kept (see :data:`PLANS_KEPT`)
    plans_kept: int = PLANS_KEPT

    def __init__(self, model: Module, loss_fn: Callable[..., TileTensor], *, batch_tiles: Sequence | None = None,
                 runtime=None, **compile_options):
        check_step_arguments("tilegraph.EvalStep", model, None, loss_fn, batch_tiles, runtime, compile_options,
                             eval_only=True)
        self.model, self.loss_fn, self.batch_tiles = model, loss_fn, batch_tiles
        self.runtime, self.compile_options = runtime, compile_options
        self._cache: _Plans = _Plans("EvalStep")  # key -> (Executable, inputs), the most recently used last
        self._calls = 0
        self._structure = _structure(model)
        self._kernels = kernels_redefined()

    def reset_plans(self) -> None:
        """Forget the recorded graphs (planned for the workers there were then)."""
        self._cache.clear()

    def follow_workers(self) -> bool:
        """:meth:`TrainStep.follow_workers`."""
        if _replan_for_workers([exe for exe, _ in self._cache.values()], self.runtime):
            self.reset_plans()
            return True
        return False

    def _lookup(self, batch, n: int) -> tuple[Executable, list]:
        """The graph of ``n`` losses for batches like ``batch``, and each one's input cells."""
        structure = _structure(self.model)
        if (structure != self._structure or kernels_redefined() != self._kernels
                or not _follows_current([exe for exe, _ in self._cache.values()], self.runtime)):
            self.reset_plans()
            self._structure, self._kernels = structure, kernels_redefined()
        key = (n, _signature(batch))
        plan = self._cache.lookup(key)
        if plan is None:
            require_int("tilegraph.EvalStep", "plans_kept", self.plans_kept, 1)
            inputs, losses = [], []
            for _ in range(n):
                ins, tensors = _batch_inputs(batch, self.batch_tiles, "tilegraph.EvalStep", self)
                with no_grad(), training(False):  # no backward; eval mode, whatever model.train() set
                    loss = _loss_of(self.loss_fn, self.model, tensors, "tilegraph.EvalStep")
                _check_loss(loss, "tilegraph.EvalStep")
                inputs.append(ins)
                losses.append(loss.grid.flat[0])
            plan = (Executable(losses, runtime=self.runtime, **self.compile_options), inputs)
            self._cache.keep(key, plan, self.plans_kept)
        return plan

    def __call__(self, *batch) -> float:
        return self.losses([batch])[0]

    def losses(self, batches: Sequence[Sequence[np.ndarray]]) -> list[float]:
        """The loss of each batch (all of one signature). Batches are evaluated several to a graph
        when a graph of one is short (as :meth:`TrainStep.auto_steps_per_graph`), so that many
        small evaluation batches do not pay Dask's round trip each."""
        batches = [[np.asarray(a) for a in b] for b in batches]
        if not batches:
            return []
        _check_one_signature(batches, "tilegraph.EvalStep.losses")
        per_graph = 1
        if len(batches) > 1:
            per_graph = min(len(batches), _per_graph(self._lookup(batches[0], 1)[0].est_seconds()))
        out: list[float] = []
        lost = {"where": "tilegraph.EvalStep", "hint": self._lost_hint()}
        for i in range(0, len(batches), per_graph):
            chunk = batches[i:i + per_graph]
            for again in (False, True):
                exe, inputs = self._lookup(chunk[0], len(chunk))
                for ins, b in zip(inputs, chunk):
                    self._calls += 1
                    _bind_batch(ins, b, f"eval-{id(self):x}-{self._calls}")
                # the model's values held here are lent to the workers (sent once while unchanged);
                # in the graph, they were sent with each call (GPT-2 124M: 475 MB a graph)
                restore = [] if exe.runtime is None else lend_cells(exe.runtime, _held_here(exe, inputs))
                try:
                    values = exe.run(during="the evaluation", lost=lost)
                    break
                except WorkerLostError:
                    self.reset_plans()  # planned for the workers there were: the next call plans for those left
                    raise
                except Exception:
                    # workers lost between two calls, their nannies' new ones at other addresses:
                    # the plan sent its programs to the old ones, and every later call failed with
                    # Dask's CommClosedError ("values to send to worker ..., which left the
                    # cluster"); planned again for the workers there are, the chunk runs once more
                    if again or not self.follow_workers():
                        raise
                finally:
                    put_back(restore)
            out += [float(to_host(v).reshape(())) for v in values]
        return out

    def _lost_hint(self) -> str:
        """What a worker lost during an evaluation took with it: nothing of a model whose
        parameters this process holds (``tilegraph eval``'s: it lends them to the workers for each
        graph), else the parameters and state that lived there (a model trained on the workers)."""
        if all(not isinstance(c.value, ValueRef) for p in self.model.parameters() for c in p.cells.flat):
            return EVAL_LENT_HINT
        return LOST_STATE_HINT
