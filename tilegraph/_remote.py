"""A model's work on the workers outside a training step: its values lent to the workers and put
back, its parameters checked before anything is submitted, a function over it run as one task on
a worker, and values a task left on the workers given futures of their own.

Decoding (:mod:`tilegraph.models.generate`) runs on these, so that the models package reads as
models and sampling, without cells, :class:`~tilegraph._graph.ValueRef` or Dask futures."""

from __future__ import annotations

import io
import operator
import pickle
import uuid
from collections.abc import Callable, Sequence

from tilegraph._graph import ValueRef
from tilegraph._lower import Fetching, check_values_reachable, gather
from tilegraph._train import lend_cells, put_back

__all__ = ["model_cells", "lend_model", "put_back", "check_model_reachable", "own_futures", "run_on_a_worker",
           "NotPicklable"]


def model_cells(model) -> list:
    """The cells of ``model``'s parameters and of the parts of its quantized weights
    (:func:`tilegraph.peft.from_quantized`; no Parameters): every graph of the model reads them."""
    from tilegraph.peft import named_quantized

    return ([c for p in model.parameters() for c in p.cells.flat]
            + [c for _, q in named_quantized(model) for c in q.cells])


def lend_model(model, runtime) -> list:
    """Lend the values of ``model``'s parameters (and quantized weights' parts) still on the
    client to ``runtime``'s workers: the copy lent at an earlier call where the workers still hold
    it, else sent now and kept for the next call (:func:`tilegraph._train.lend_cells`); returns
    what :func:`put_back` restores."""
    return lend_cells(runtime, [c for c in model_cells(model) if not isinstance(c.value, ValueRef)])


def lent_all(model, restore: list) -> bool:
    """Whether ``restore`` (:func:`lend_model`'s) holds every value of ``model``: all of them are
    this process's own, only lent, and survive a lost worker."""
    return len(restore) == len(model_cells(model))


def check_model_reachable(where: str, model, runtime) -> None:
    """Fail before anything is submitted where ``model``'s parameters (and quantized weights'
    parts) hold no values, or values on the workers of a closed runtime or of another runtime
    than ``runtime`` (None: this process), with :func:`tilegraph.compute`'s messages."""
    from tilegraph.peft import named_quantized

    check_values_reachable(where, [ref.node for p in model.parameters() for ref in p.grid.flat]
                           + [n for _, q in named_quantized(model) for n in q.nodes], runtime)


def own_futures(runtime, cells: Sequence) -> None:
    """Give each of ``cells`` whose value is an element of a task's result tuple a future of its
    own (taken on the worker that holds the tuple), so that the tuple, and the task's other
    outputs it keeps alive, can go."""
    client = runtime.client
    for cell in cells:
        v = cell.value
        if isinstance(v, ValueRef) and v.index is not None:
            cell.set(ValueRef(client.submit(operator.getitem, v.future, v.index), None), cell.token)


class NotPicklable(Exception):
    """What :func:`run_on_a_worker` was given does not pickle: the caller runs it here instead."""


def run_on_a_worker(runtime, fn: Callable, args: tuple, *, what: str, where: str, hint: str,
                    cpu_resource: bool = False, key: str = "tg-remote"):
    """``fn(*args, stopped=...)`` as one task on a worker of ``runtime``; returns its result.

    ``fn`` travels pickled by value (cloudpickle), ``args`` pickled with every
    :class:`ValueRef` in them as a reference: the task receives those values from the workers
    that hold them (lend the client's values first, :func:`lend_model`). ``stopped()``, called
    in the task, is True once the client has let go of it (a Ctrl-C here: Dask does not stop a
    running task). A worker lost meanwhile is a WorkerLostError naming ``what``, with ``where``
    and ``hint``; the task is cancelled however this returns. Raises :class:`NotPicklable` where
    ``fn`` or ``args`` do not pickle (before anything is submitted)."""
    import cloudpickle

    try:
        code = cloudpickle.dumps(fn)
        refs: list[ValueRef] = []
        blob = io.BytesIO()
        _ref_pickler(blob, refs).dump(args)
    except Exception as e:
        raise NotPicklable(str(e)) from e
    future = runtime.client.submit(_task, code, blob.getvalue(), [r.future for r in refs], [r.index for r in refs],
                                   key=f"{key}-{uuid.uuid4().hex[:12]}", pure=False,
                                   resources={"CPU": 1} if cpu_resource else None)
    try:  # watched: a worker lost meanwhile is a WorkerLostError naming it, not Dask's CancelledError
        return gather(runtime, [Fetching(future, None)], what, where=where, hint=hint)[0]
    finally:
        future.cancel()  # (a Ctrl-C: the task stops where fn next asks stopped())


def _ref_pickler(file, refs: list):
    import cloudpickle

    class RefPickler(cloudpickle.CloudPickler):
        """Pickles every :class:`ValueRef` as its place in ``refs`` (the task gets their values)."""

        def __init__(self, file, refs: list):
            super().__init__(file)
            self.refs = refs

        def persistent_id(self, obj):
            if isinstance(obj, ValueRef):
                self.refs.append(obj)
                return len(self.refs) - 1
            return None

    return RefPickler(file, refs)


def _task(code: bytes, blob: bytes, results: list, indexes: list):
    """The worker's side of :func:`run_on_a_worker`."""
    from tilegraph.exec.program import realigned

    values = [realigned(v if i is None else v[i]) for v, i in zip(results, indexes)]

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            return values[pid]

    fn = pickle.loads(code)
    args = Unpickler(io.BytesIO(blob)).load()
    return fn(*args, stopped=_task_cancelled())


def _task_cancelled() -> Callable[[], bool]:
    """On a worker, in a task: whether the client has let go of this task (cancelled). Dask does
    not stop a running task; without this a decoding task ran on to its last token, holding a
    thread the next call waited for."""
    from distributed import get_worker
    from distributed.worker import thread_state

    worker, key = get_worker(), getattr(thread_state, "key", None)

    def cancelled() -> bool:
        ts = worker.state.tasks.get(key)
        return ts is None or ts.state in ("cancelled", "released", "forgotten")

    return cancelled
