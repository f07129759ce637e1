"""The logical tile graph: kernels, tile nodes and leaf cells.

Recording a model builds a DAG of :class:`Node` objects, one per tile kernel call. Nothing here
touches data: a node knows its kernel, parameters, input tile references and the shape/dtype/cost
of its outputs. Leaves point at a :class:`Cell`, a mutable slot holding the current value of one
input tile (a NumPy array, a distributed future, a dask key, ...). Because a recorded graph refers
to cells rather than values, the same graph can be lowered again with new parameter values, which
is how a training step is recorded once and replayed (see ``_lower.Executable``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from tilegraph._errors import TileError

__all__ = ["Kernel", "Node", "TileRef", "Cell", "ValueRef", "ReplicatedRef", "CopiesRef", "kernel", "get_kernel", "Cost", "xp_of"]


@dataclass(frozen=True)
class Cost:
    """Work of one tile kernel call: floating point operations and bytes moved."""

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def xp_of(x):
    """NumPy or CuPy, whichever ``x`` belongs to (CuPy is never imported otherwise)."""
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


# -- checks of values on a device, read once per task ----------------------------------------------
_DEVICE_CHECKS = threading.local()


def check_on_device(failed, error: Callable[[], Exception]) -> None:
    """Raise ``error()`` if the one-element array ``failed`` (a CuPy array, say) holds true.

    Reading a value a GPU computes makes the CPU wait for every kernel queued before it, and the
    GPU then idles while the CPU queues the next ones: GPT-2 124M's step read three such checks
    (the token ids in the embedding's forward and backward, the targets in the cross-entropy), and
    its GPU idled 35-39% of the step. Inside a task that
    :func:`deferred_device_checks` runs, the check is kept and read with the task's others, in one
    wait once all its kernels are queued; the error then names the kernel that made the check.
    Elsewhere it is read at once."""
    pending = getattr(_DEVICE_CHECKS, "pending", None)
    if pending is None:
        if bool(failed):
            raise error()
    else:
        pending.append((failed, error, getattr(_DEVICE_CHECKS, "where", None)))


@contextlib.contextmanager
def deferred_device_checks(pending: list):
    """Collect :func:`check_on_device`'s checks made in this thread into ``pending`` (a list the
    threads of one task share) until the block ends; :func:`raise_failed_checks` reads them."""
    old = getattr(_DEVICE_CHECKS, "pending", None)
    _DEVICE_CHECKS.pending = pending
    try:
        yield
    finally:
        _DEVICE_CHECKS.pending = old


def checking_in(where) -> None:
    """Say which kernel call the checks made next in this thread belong to (anything that
    :func:`raise_failed_checks`'s ``describe`` turns into the error's note)."""
    _DEVICE_CHECKS.where = where


def raise_failed_checks(pending: list, describe: Callable[[Any], str] = str) -> None:
    """Raise the error of the first check in ``pending`` that failed, with a note naming its
    kernel (``describe`` of what :func:`checking_in` was given); one wait for the device when
    none did."""
    if not pending:
        return
    flags = [f for f, _, _ in pending]
    xp = xp_of(flags[0])
    if not bool(xp.stack([xp.asarray(f).reshape(()) for f in flags]).any()):
        return
    for failed, error, where in pending:
        if bool(failed):
            e = error()
            if where is not None:
                e.add_note(describe(where))
            raise e


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array: a CuPy array is copied to the host, anything else taken as it is."""
    return x.get() if type(x).__module__.startswith("cupy") else np.asarray(x)


_KERNELS: dict[str, "Kernel"] = {}
#: how many times a kernel was registered again (a notebook cell run again): graphs recorded
#: before hold the old Kernel, so TrainStep and EvalStep record theirs again when it changes
_REDEFINED = 0


def kernels_redefined() -> int:
    """The count of kernels registered again since tilegraph was imported (see ``kernel``)."""
    return _REDEFINED


def current_kernel(k: "Kernel") -> "Kernel":
    """The kernel registered now under ``k``'s name: ``k`` itself, or its new definition where the
    name was registered again since ``k`` was (graphs recorded before hold ``k``)."""
    now = _KERNELS.get(k.name)
    return k if now is None else now


def _default_cost(in_shapes, out_shapes, in_itemsize, params) -> Cost:
    n_in = sum(int(np.prod(s)) for s in in_shapes)
    n_out = sum(int(np.prod(s)) for s in out_shapes)
    return Cost(flops=float(n_out), bytes=float((n_in + n_out) * in_itemsize))


class Kernel:
    """A named tile kernel.

    ``fn(*arrays, **params)`` is written against the array namespace of its inputs (NumPy on the
    CPU, CuPy on a GPU); ``cpu`` optionally overrides it with a faster CPU-only version (Numba),
    ``gpu`` with a version shaped for a GPU (few, large array operations: on a GPU each one is a
    kernel launch, so the CPU's cache-sized blocks would cost more launches than arithmetic).
    A ``gpu`` version is written against the array namespace too, so it also runs on NumPy
    (tests compare it there; ``config.gpu_array_module = "numpy"`` runs it on emulated GPU workers).
    ``cost(in_shapes, out_shapes, itemsize, params)`` returns a :class:`Cost`.
    Kernels pickle by name (plus the module that registers them, which a worker imports when it
    has not seen the name yet), so a task graph ships only names to the workers.
    """

    __slots__ = ("name", "fn", "cpu", "gpu", "cost", "module")

    def __init__(self, name: str, fn: Callable, cpu: Callable | None = None, cost: Callable | None = None,
                 module: str | None = None, gpu: Callable | None = None):
        self.name = name
        self.fn = fn
        self.cpu = cpu
        self.gpu = gpu
        self.cost = cost or _default_cost
        self.module = module or getattr(fn, "__module__", None)

    def impl(self, device: str) -> Callable:
        if device == "cpu" and self.cpu is not None:
            return self.cpu
        if device == "gpu" and self.gpu is not None:
            return self.gpu
        return self.fn

    def __reduce__(self):
        if self.module and self.module.split(".")[0] == "tilegraph":
            return (get_kernel, (self.name, self.module))
        # A kernel of a notebook or a script's main block: workers cannot import where it was
        # defined, so it also travels by value (cloudpickle), used when the name is new there.
        return (_kernel_by_value, (self.name, self.module, self._payload()))

    def _payload(self) -> bytes:
        cached = _PAYLOADS.get(self.name)
        if cached is None or cached[0] is not self:
            import cloudpickle

            cached = _PAYLOADS[self.name] = (self, cloudpickle.dumps((self.fn, self.cpu, self.cost, self.gpu)))
        return cached[1]

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


def kernel(name: str, *, cost: Callable | None = None, cpu: Callable | None = None, gpu: Callable | None = None):
    """Decorator registering ``fn`` as the tile kernel ``name``.

    Registering the same function again (same module and qualified name: a notebook cell run
    again, a module reloaded) replaces the old registration (TrainStep and EvalStep then record
    their graphs again, with the new kernel); another function under a name taken is refused, a
    built-in name (tilegraph's own kernels) included."""

    where = "tilegraph.kernel"
    if callable(name) and not isinstance(name, str):  # @kernel without its name: wrap() would replace the function
        raise TileError(where, "a kernel needs a name: decorate with @kernel('my_name'), not a bare @kernel",
                        f"{getattr(name, '__qualname__', type(name).__name__)} in place of the name")
    if not isinstance(name, str) or not name:
        raise TileError(where, "the kernel name must be a non-empty str", f"{name!r} ({type(name).__name__})")
    for what, f in (("cost", cost), ("cpu", cpu), ("gpu", gpu)):
        if f is not None and not callable(f):
            hint = (" (e.g. elementwise_cost(4), a function returning a Cost)" if what == "cost" else "")
            raise TileError(f"{where}({name!r})", f"{what}= must be a function or None{hint}",
                            f"{f!r} ({type(f).__name__})")

    def wrap(fn):
        if not callable(fn):
            raise TileError(f"{where}({name!r})", "@kernel decorates a function of tiles",
                            f"{fn!r} ({type(fn).__name__})")
        old = _KERNELS.get(name)
        if old is not None and not _same_function(old.fn, fn):
            raise _name_taken(name, old, fn)
        k = Kernel(name, fn, cpu=cpu, cost=cost, gpu=gpu)
        _KERNELS[name] = k
        if old is not None:
            global _REDEFINED
            _REDEFINED += 1
        return k

    return wrap


def _same_function(a: Callable, b: Callable) -> bool:
    """Whether ``a`` and ``b`` are one function defined again (same module, same qualified name)."""
    qa, qb = getattr(a, "__qualname__", None), getattr(b, "__qualname__", None)
    return qa is not None and qa == qb and getattr(a, "__module__", None) == getattr(b, "__module__", None)


def _name_taken(name: str, old: "Kernel", fn: Callable) -> Exception:
    first = old.module or getattr(old.fn, "__module__", None) or "an unknown module"
    first_fn = f"{first}.{getattr(old.fn, '__qualname__', '?')}"
    new_fn = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    if first.split(".")[0] == "tilegraph":
        what = (f"kernel name {name!r} is a built-in one, registered by {first} ({first_fn}): choose another "
                "name for your kernel")
    else:
        what = (f"kernel name {name!r} is already registered by module {first} ({first_fn}); a kernel name "
                "names one function (registering the same function again, e.g. a notebook cell run again or "
                "a module reloaded, replaces it): choose another name")
    return TileError("tilegraph.kernel", what, new_fn)


_PAYLOADS: dict[str, tuple["Kernel", bytes]] = {}


#: in a worker, the payload each kernel that arrived by value was made from
_RECEIVED: dict[str, bytes] = {}


def _kernel_by_value(name: str, module: str | None, payload: bytes) -> Kernel:
    # a kernel that came by value before is replaced when another payload comes under its name:
    # the client defined it again (a notebook cell edited and run again), and the workers ran the
    # first definition for as long as they lived
    if name in _RECEIVED and _RECEIVED[name] != payload:
        return _load_payload(name, module, payload)
    try:
        return get_kernel(name, module)
    except (KeyError, ImportError):
        return _load_payload(name, module, payload)


def _load_payload(name: str, module: str | None, payload: bytes) -> Kernel:
    import pickle

    fn, cpu, cost, gpu = pickle.loads(payload)
    with _RECEIVE_LOCK:  # (a worker's threads unpickle tasks side by side)
        if _RECEIVED.get(name) != payload:
            _KERNELS[name] = Kernel(name, fn, cpu=cpu, cost=cost, module=module, gpu=gpu)
            _RECEIVED[name] = payload
        return _KERNELS[name]


_RECEIVE_LOCK = threading.Lock()


def get_kernel(name: str, module: str | None = None) -> Kernel:
    """The kernel registered as ``name``; workers unpickling a task import ``module`` (the one that
    registered it: tilegraph.ops, tilegraph.io, or a user's module) when the name is new to them."""
    try:
        return _KERNELS[name]
    except KeyError:
        import importlib

        import tilegraph.ops  # noqa: F401 - the op library registers most kernels

        if name not in _KERNELS and module and module != "__main__":
            importlib.import_module(module)
        if name in _KERNELS:
            return _KERNELS[name]
        raise KeyError(f"[tilegraph.get_kernel] no kernel named {name!r}"
                       + (f" (module {module!r} registers none)" if module else "")) from None


class Cell:
    """A mutable slot for the value of one leaf tile.

    ``value`` is a NumPy/CuPy array, a :class:`ValueRef` to an element of a remote result, or a
    dask key reference. ``token`` identifies the value for deterministic task keys.
    """

    __slots__ = ("value", "token", "shape", "dtype", "__weakref__")
    _counter = itertools.count()
    #: this process's part of new tokens: cells travel between processes (a model pickled for
    #: a worker's task), and a counter alone made the same tokens there ("cell17" here and a
    #: worker's own KV-cache tile "cell17"), which local runs key values by
    _process = secrets.token_hex(4)

    def __init__(self, value: Any, shape: tuple[int, ...], dtype: np.dtype, token: str | None = None):
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.set(value, token)

    def set(self, value: Any, token: str | None = None) -> None:
        self.value = value
        self.token = token if token is not None else f"cell{Cell._process}-{next(Cell._counter)}"


def _new_process_tokens() -> None:
    Cell._process = secrets.token_hex(4)


if hasattr(os, "register_at_fork"):  # a forked child's cells are its own
    os.register_at_fork(after_in_child=_new_process_tokens)


@dataclass(frozen=True)
class ValueRef:
    """Element ``index`` of the tuple a lowered cluster task returns (``index is None``: whole)."""

    future: Any
    index: int | None


@dataclass(frozen=True)
class ReplicatedRef(ValueRef):
    """A value held by several worker processes (data-parallel replicas of a parameter or of
    optimizer state): ``replicas[p]`` is the copy made by process ``p`` of the plan's device class;
    as a plain :class:`ValueRef` it is replica 0. The copies are equal: every replica applies the
    same update to the same summed gradients."""

    replicas: tuple = ()

    def on(self, proc: int | None) -> ValueRef:
        """The copy of process ``proc`` (replica 0 when ``proc`` is None or has none)."""
        if proc is None or not 0 <= proc < len(self.replicas):
            return self.replicas[0]
        return self.replicas[proc]


@dataclass(frozen=True)
class CopiesRef(ValueRef):
    """One value with a copy on each of several workers (a frozen weight that tasks on several
    worker processes read): ``copies`` pairs each worker's address with the copy there; as a
    plain :class:`ValueRef` it is the first copy. Each copy is a value of its own (its own key),
    so Dask's active memory manager, which drops the extra replicas of a key no task is waiting
    for, keeps them all between steps."""

    copies: tuple = ()

    def at(self, addr: str | None) -> ValueRef:
        """The copy on worker ``addr`` (the first when it holds none)."""
        for a, ref in self.copies:
            if a == addr:
                return ref
        return self.copies[0][1]


_SCOPES: list[str] = []


@contextlib.contextmanager
def scope(name: str):
    """Record the kernels emitted inside the block under ``name`` (the part of the model, and
    the phase, that made them: ``"layers.3.attn"``, ``"layers.3.attn:backward"``); task names
    on the Dask dashboard are made from it."""
    _SCOPES.append(name)
    try:
        yield
    finally:
        _SCOPES.pop()


def current_scope() -> str:
    return _SCOPES[-1] if _SCOPES else ""


class Node:
    """One tile kernel call in the logical graph (or a leaf when ``kernel is None``)."""

    __slots__ = ("kernel", "params", "inputs", "out_meta", "cost", "cell", "device", "op", "scope", "__weakref__")

    def __init__(self, kernel: Kernel | None, params: dict, inputs: tuple["TileRef", ...],
                 out_meta: tuple[tuple[tuple[int, ...], np.dtype], ...], op: str,
                 cell: Cell | None = None):
        self.kernel = kernel
        self.params = params
        self.inputs = inputs
        self.out_meta = out_meta
        self.cell = cell
        self.op = op
        self.scope = current_scope()
        self.device: str | None = None
        if kernel is not None:
            itemsize = max((np.dtype(r.dtype).itemsize for r in inputs), default=4)
            self.cost = _kernel_cost(kernel, [r.shape for r in inputs], [m[0] for m in out_meta], itemsize, params)
        else:
            self.cost = Cost()

    @property
    def is_leaf(self) -> bool:
        return self.kernel is None

    def __repr__(self) -> str:
        what = self.kernel.name if self.kernel else "leaf"
        return f"Node({what}, op={self.op}, outs={[m[0] for m in self.out_meta]})"


def _kernel_cost(kern: Kernel, in_shapes, out_shapes, itemsize: int, params: dict) -> Cost:
    """``kern``'s cost of one call, checked: a :class:`Cost` of finite, non-negative flops and
    bytes (the planner divides them by speeds and sums them; a NaN or a negative one ordered
    and placed the kernels wrongly without a word, anything else failed deep in the planner)."""
    try:
        c = kern.cost(in_shapes, out_shapes, itemsize, params)
    except Exception as e:
        e.add_note(f"in the cost function of tile kernel {kern.name!r}: cost(in_shapes, out_shapes, itemsize, "
                   f"params) -> Cost, called with in_shapes {in_shapes}, out_shapes {out_shapes}")
        raise
    if not isinstance(c, Cost) or not (0 <= c.flops < math.inf and 0 <= c.bytes < math.inf):
        raise TileError(f"tilegraph.kernel({kern.name!r}) cost", "cost(in_shapes, out_shapes, itemsize, params) "
                        "must return a Cost(flops, bytes) of finite numbers >= 0",
                        f"{c!r} for in_shapes {in_shapes}, out_shapes {out_shapes}")
    return c


class TileRef:
    """Reference to output ``index`` of ``node``: the symbolic value of one tile."""

    __slots__ = ("node", "index", "shape", "dtype")

    def __init__(self, node: Node, index: int):
        self.node = node
        self.index = index
        self.shape, self.dtype = node.out_meta[index]

    @property
    def nbytes(self) -> int:
        return math.prod(int(n) for n in self.shape) * np.dtype(self.dtype).itemsize

    def __repr__(self) -> str:
        return f"TileRef({self.node!r}[{self.index}], shape={self.shape}, dtype={self.dtype})"


def leaf(cell: Cell) -> TileRef:
    node = Node(None, {}, (), ((cell.shape, cell.dtype),), op="leaf", cell=cell)
    return TileRef(node, 0)


def emit(kern: Kernel, inputs, out_meta, /, *, op: str, **params) -> list[TileRef]:
    """Record one kernel call; returns one :class:`TileRef` per declared output."""
    inputs = tuple(inputs)
    if type(kern) is not Kernel:
        _bad_emit(kern, inputs, op)
    for r in inputs:  # (a loop: recording calls this per tile, and all() of a generator costs more)
        if type(r) is not TileRef:
            _bad_emit(kern, inputs, op)
    try:
        out_meta = tuple((tuple(int(d) for d in s), np.dtype(dt)) for s, dt in out_meta)
    except (TypeError, ValueError) as e:
        raise TileError(f"tilegraph.emit (kernel {kern.name!r} of op {op!r})", "out_meta must be a list of "
                        "(shape, dtype) pairs, one per output (emit1: a shape tuple and a dtype)",
                        f"{out_meta!r} ({type(e).__name__}: {e})") from None
    node = Node(kern, params, inputs, out_meta, op=op)
    return [TileRef(node, i) for i in range(len(out_meta))]


def emit1(kern: Kernel, inputs, out_shape, out_dtype, /, *, op: str, **params) -> TileRef:
    """:func:`emit` of a kernel with one output (of ``out_shape`` and ``out_dtype``): its TileRef."""
    return emit(kern, inputs, [(out_shape, out_dtype)], op=op, **params)[0]


def _bad_emit(kern, inputs: tuple, op: str) -> None:
    where = f"tilegraph.emit (op {op!r})"
    if type(kern) is not Kernel:
        raise TileError(where, "the kernel must be a Kernel: a function decorated with @kernel('name')",
                        f"{getattr(kern, '__qualname__', None) or type(kern).__name__} ({type(kern).__name__})")
    for i, r in enumerate(inputs):
        if type(r) is not TileRef:
            hint = (": one tile of it, t.grid[idx]" if hasattr(r, "grid") and hasattr(r, "tiling") else
                    " (a tile of a TileTensor: t.grid[idx])")
            raise TileError(f"tilegraph.emit (kernel {kern.name!r} of op {op!r})",
                            f"inputs[{i}] must be a TileRef{hint}", type(r).__name__)


def topo_order(roots: list[TileRef]) -> list[Node]:
    """Nodes reachable from ``roots`` in a dependency-respecting order (iterative DFS)."""
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r.node, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        for inp in reversed(node.inputs):
            if id(inp.node) not in seen:
                stack.append((inp.node, False))
    return order


def peak_live_bytes(order: Sequence[Node], roots: Sequence[TileRef] = (), select=None) -> int:
    """The most bytes of kernel results alive at once when the kernels ``order`` run one after the
    other, each result freed after its last reader (``roots``, the values asked for, stay to the
    end); ``select(node)``: count only those nodes' results (default: every kernel's)."""
    last: dict[tuple[int, int], int] = {}
    for k, n in enumerate(order):
        for r in n.inputs:
            last[(id(r.node), r.index)] = k
    for r in roots:
        last[(id(r.node), r.index)] = len(order)
    freed: dict[int, int] = {}
    live = peak = 0
    for k, n in enumerate(order):
        if not n.is_leaf and (select is None or select(n)):
            for i, (shape, dtype) in enumerate(n.out_meta):
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                live += nbytes
                at = last.get((id(n), i), k)
                freed[at] = freed.get(at, 0) + nbytes
            peak = max(peak, live)
        live -= freed.pop(k, 0)
    return peak
