"""Reverse-mode autodiff over recorded tensor ops.

Every op call records ``Record(op, args, ctx)`` on its output. :func:`grad` walks those records
backwards from a scalar loss and calls each op's ``backward``, which itself records ordinary tile
ops, so the backward pass is a tile graph like the forward one (and is placed, fused and lowered
with it). Contributions to a tensor used several times are summed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Sequence

from tilegraph._errors import TileError
from tilegraph._graph import current_scope, scope
from tilegraph._tensor import TileTensor

__all__ = ["Op", "Record", "grad", "backward", "no_grad", "grad_enabled"]

#: one list per :func:`tilegraph.checkpoint` region being recorded: the tensors its ops make
_REGIONS: list[list[TileTensor]] = []


_STATE = threading.local()  # .off: how many no_grad() blocks this thread is in


def grad_enabled() -> bool:
    """Whether ops called now record what :func:`grad` needs (outside :func:`no_grad`)."""
    return not getattr(_STATE, "off", 0)


@contextmanager
def no_grad():
    """Ops called inside record no autograd history: their outputs cannot be differentiated,
    and recording them takes less time and memory (inference: generation, evaluation).

    Each op's history holds its inputs and what its backward needs: recorded, every call's
    graph is kept while its result lives (decoding GPT-2 124M on 2 cores paid ~3-5 ms per token
    for histories, when they were still reference cycles that Python's cyclic collector freed).

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(3.0))
    >>> with tg.no_grad():
    ...     y = (x * x).sum()
    >>> y.numpy(), y._record is None
    (array(5.), True)
    """
    _STATE.off = getattr(_STATE, "off", 0) + 1
    try:
        yield
    finally:
        _STATE.off -= 1


class Record:
    __slots__ = ("op", "args", "ctx", "scope")

    def __init__(self, op: "Op", args: tuple, ctx: Any):
        self.op, self.args, self.ctx = op, args, ctx
        self.scope = current_scope()  # where the forward ran: its backward is named after it


def _saved_output(ctx: Any, out: TileTensor) -> Any:
    """``ctx`` with ``out``, where its backward saved it (in tuples, lists and dicts of it), as a
    tensor over the same tiles without ``out``'s history. Kept as it was, ``out`` -> its record ->
    ctx -> ``out`` was a reference cycle: the graph of every step (and the parameters it reads)
    lived until Python's cyclic collector ran, and so did the values of a deleted model on the
    workers (GPT-2 6 x 768 sharded over 2 workers: 626 MiB each, until a collection)."""
    return _swap(ctx, out, [], 3)


def _swap(x: Any, out: TileTensor, twin: list, left: int) -> Any:
    # (a function of the module, not a closure: a recursive closure is itself a reference cycle)
    if x is out:
        if not twin:
            twin.append(TileTensor(out.tiling, out.dtype, out.grid))
        return twin[0]
    if left and type(x) in (tuple, list):
        items = [_swap(v, out, twin, left - 1) for v in x]
        return type(x)(items) if any(a is not b for a, b in zip(items, x)) else x
    if left and type(x) is dict:
        items = {k: _swap(v, out, twin, left - 1) for k, v in x.items()}
        return items if any(items[k] is not x[k] for k in x) else x
    return x


class Op:
    """A tensor-level operation: ``forward`` records tile kernels, ``backward`` is its vjp.

    ``forward(*args, **params) -> (output TileTensor, ctx)`` validates inputs (output meta), emits
    the tile kernels and returns whatever the vjp needs as ``ctx``; a forward that returns one of
    its inputs (an identity: gradient reversal, scaling) or another op's result gets a new tensor
    over the same tiles as the op's result, and the tensor it returned is left as it was.
    ``backward(ctx, dout)`` returns a tuple of one cotangent per positional argument (``None``
    where there is none: a non-tensor argument, or no gradient), each a TileTensor of its
    input's shape, tiles and dtype; both are checked. The cost of an op is the sum of its tile
    kernels' costs, declared with each kernel.
    """

    name = "op"

    def __call__(self, *args, **params) -> TileTensor:
        res = self.forward(*args, **params)
        if not isinstance(res, tuple) or len(res) != 2 or not isinstance(res[0], TileTensor):
            _bad_forward(self, res)
        out, ctx = res
        if out._record is not None or type(out) is not TileTensor or any(out is a for a in args):
            # forward handed back a tensor it did not make (one of its inputs: gradient reversal,
            # a scaling whose forward is the identity; a Parameter; another op's result): the
            # op's result is a new tensor over the same tiles, and that one keeps its own history
            out = TileTensor(out.tiling, out.dtype, out.grid)
        if grad_enabled():
            out._record = Record(self, args, _saved_output(ctx, out))
        if _REGIONS:
            _REGIONS[-1].append(out)
        return out

    def forward(self, *args, **params):  # pragma: no cover - interface
        raise NotImplementedError

    def backward(self, ctx, dout: TileTensor) -> Sequence[TileTensor | None]:
        raise TileError(f"tilegraph.{self.name}", "this op has no gradient")

    def vjp(self, ctx, dout: TileTensor, needed: Sequence[bool]) -> Sequence[TileTensor | None]:
        """:meth:`backward`, told which positional arguments need a cotangent (``needed``); an op
        whose backward can skip work for the others overrides this (a recomputed block)."""
        return self.backward(ctx, dout)

    def __repr__(self) -> str:
        return f"<op {self.name}>"


def _op_where(op: Op) -> str:
    """``tilegraph.<name>`` of an op, its class name when it set none."""
    name = getattr(op, "name", None)
    if not isinstance(name, str) or name in ("", "op"):
        name = type(op).__qualname__
    return f"tilegraph.{name}"


def _describe(x) -> str:
    if isinstance(x, TileTensor):
        return f"TileTensor of shape {x.shape}, tiles {x.chunks}, dtype {x.dtype}"
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} of {len(x)}: ({', '.join(type(v).__name__ for v in x[:4])}{', ...' if len(x) > 4 else ''})"
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(x).__name__} of shape {tuple(shape)}, dtype {dtype}"
    return type(x).__name__


def _bad_forward(op: Op, res) -> None:
    where = f"{_op_where(op)} ({type(op).__name__}.forward)"
    if isinstance(res, TileTensor):
        raise TileError(where, "forward must return a pair (output TileTensor, ctx), ctx being what backward "
                        "needs (None if nothing): return (out, ctx), not out alone", _describe(res))
    if isinstance(res, tuple) and len(res) == 2:
        raise TileError(where, "forward must return a pair (output TileTensor, ctx) whose first element is "
                        "a TileTensor (made by its tile kernels, e.g. with new_tensor)",
                        f"({_describe(res[0])}, ...)")
    raise TileError(where, "forward must return a pair (output TileTensor, ctx)", _describe(res))


def _check_grads(rec: Record, grads, needed) -> None:
    """``grads``, what ``rec.op``'s backward (vjp) returned: one cotangent per positional argument
    of its forward, each None or a TileTensor of its input's shape, tiles and dtype."""
    op, args = rec.op, rec.args
    where = f"{_op_where(op)} ({type(op).__name__}.backward)"
    if isinstance(grads, TileTensor):
        raise TileError(where, f"backward must return a tuple of gradients, one per positional argument of "
                        f"forward ({len(args)}; None where there is none), not a bare tensor: return (g,)",
                        _describe(grads))
    if not isinstance(grads, (tuple, list)):
        raise TileError(where, f"backward must return a tuple of gradients, one per positional argument of "
                        f"forward ({len(args)}; None where there is none)", _describe(grads))
    if len(grads) > len(args) and all(g is None for g in grads[len(args):]):
        grads = grads[:len(args)]  # (an optional argument left out: its gradient None, as the op's own)
    if len(grads) != len(args):
        raise TileError(where, f"backward must return one gradient per positional argument of forward "
                        f"(None where there is none): expected {len(args)}",
                        f"{len(grads)} gradient{'s' if len(grads) != 1 else ''} for {len(args)} "
                        f"input{'s' if len(args) != 1 else ''}")
    for i, (a, ga, need) in enumerate(zip(args, grads, needed)):
        if ga is None or not need:
            continue
        if type(ga) is TileTensor and ga.tiling == a.tiling and ga.dtype == a.dtype:
            continue  # the common case, checked cheaply
        from tilegraph.nn import Parameter

        what = f"gradient {i}"
        pname = getattr(a, "name", None)
        if isinstance(a, Parameter):
            what += f" (for parameter {pname!r})" if pname else " (for a parameter)"
        if not isinstance(ga, TileTensor):
            raise TileError(where, f"{what} must be a TileTensor (or None) of its input's shape {a.shape}, "
                            f"tiles {a.chunks} and dtype {a.dtype}", _describe(ga))
        if ga.shape != a.shape or ga.chunks != a.chunks or ga.dtype != a.dtype:
            diff = [k for k, ok in (("shape", ga.shape == a.shape), ("tiles", ga.chunks == a.chunks),
                                    ("dtype", ga.dtype == a.dtype)) if not ok]
            raise TileError(where, f"{what} must have its input's {' and '.join(diff)}: shape {a.shape}, "
                            f"tiles {a.chunks}, dtype {a.dtype}", _describe(ga))


def _walk(roots: Sequence[TileTensor], stop: set[int] = frozenset()) -> list[TileTensor]:
    """Tensors reachable from ``roots`` through records (not past those in ``stop``), inputs
    before outputs."""
    order: list[TileTensor] = []
    seen: set[int] = set()
    stack: list[tuple[TileTensor, bool]] = [(t, False) for t in reversed(roots)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            order.append(t)
            continue
        if id(t) in seen:
            continue
        seen.add(id(t))
        stack.append((t, True))
        if t._record is not None and id(t) not in stop:
            for a in t._record.args:
                if isinstance(a, TileTensor) and id(a) not in seen:
                    stack.append((a, False))
    return order


def grad(loss: TileTensor, inputs: Sequence[TileTensor], *, allow_unused: bool = False) -> list[TileTensor]:
    """Gradients of a scalar ``loss`` with respect to ``inputs`` (symbolic TileTensors).

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(3.0))
    >>> (gx,) = tg.grad((x * x).sum(), [x])
    >>> gx.numpy()
    array([0., 2., 4.])
    """
    where = "tilegraph.grad"
    if not isinstance(loss, TileTensor):
        raise TileError(where, "loss must be a TileTensor", type(loss).__name__)
    if loss.size != 1:
        raise TileError(where, "loss must be a scalar (one element); reduce it with sum() or mean()",
                        f"loss of shape {loss.shape}")
    single = isinstance(inputs, TileTensor)
    inputs = [inputs] if single else list(inputs)
    for i, x in enumerate(inputs):
        if not isinstance(x, TileTensor):
            raise TileError(where, f"inputs[{i}] must be a TileTensor", type(x).__name__)
    if loss._record is None and not allow_unused:
        # it may well depend on the inputs, but nothing recorded how: say why
        for i, x in enumerate(inputs):
            if x is not loss:
                raise TileError(where, f"inputs[{i}] does not affect the loss as recorded: the loss has no "
                                "recorded history (it was computed inside tg.no_grad(): record the forward "
                                "outside it; or it is no op's result)", f"loss {loss!r}")

    return vjp([loss], [None], inputs, allow_unused=allow_unused, where=where, single=single)


def backward(loss: TileTensor, where: str = "tilegraph.TileTensor.backward") -> None:
    """torch's ``loss.backward()``: the gradient of a scalar ``loss`` with respect to every
    trainable :class:`~tilegraph.nn.Parameter` it depends on (``requires_grad``), added to the
    parameter's ``grad`` (set where it is None), as torch accumulates; ``module.zero_grad()``
    clears them. The gradients are symbolic TileTensors like any other (``p.grad.numpy()``
    computes one); a training loop takes them from :class:`~tilegraph.TrainStep` instead.

    >>> import numpy as np, tilegraph as tg
    >>> lin = tg.nn.Linear(2, 1, bias=False, dtype=np.float64, seed=0)
    >>> lin(tg.from_numpy(np.ones((3, 2)))).sum().backward()
    >>> lin.weight.grad.numpy()
    array([[3.],
           [3.]])
    """
    from tilegraph.nn import Parameter
    from tilegraph import ops

    if not isinstance(loss, TileTensor):  # pragma: no cover - only reached as a method
        raise TileError(where, "loss must be a TileTensor", type(loss).__name__)
    if loss.size != 1:
        raise TileError(where, "loss must be a scalar (one element); reduce it with sum() or mean()",
                        f"loss of shape {loss.shape}")
    params = [t for t in _walk([loss]) if isinstance(t, Parameter) and t.requires_grad]
    if not params:
        why = ("it has no recorded history (it was computed inside tg.no_grad(), or it is no op's result)"
               if loss._record is None else "it depends on no Parameter with requires_grad=True")
        raise TileError(where, f"nothing to differentiate: {why}; for other tensors use tg.grad(loss, [x])",
                        f"loss {loss!r}")
    grads = vjp([loss], [None], params, allow_unused=True, where=where)
    for p, g in zip(params, grads):
        if g is not None:
            p.grad = g if p.grad is None else ops.add(p.grad, g)


def vjp(outputs: Sequence[TileTensor], cotangents: Sequence[TileTensor | None], inputs: Sequence[TileTensor], *,
        leaves: Sequence[TileTensor] = (), allow_unused: bool = False, where: str = "tilegraph.grad",
        single: bool = False):
    """Cotangents of ``inputs`` given those of ``outputs`` (None: ones, for a scalar loss).

    ``leaves`` are taken as given: the walk does not go past them into the ops that made them (a
    recomputed block differentiates its own graph only, down to the values it was given)."""
    stop = {id(t) for t in leaves}
    order = _walk(outputs, stop)
    wanted = {id(x) for x in inputs}
    # Which tensors lie on a path from an input to the outputs.
    needs: dict[int, bool] = {}
    for t in order:
        n = id(t) in wanted
        if not n and t._record is not None and id(t) not in stop:
            n = any(isinstance(a, TileTensor) and needs.get(id(a), False) for a in t._record.args)
        needs[id(t)] = n

    from tilegraph import ops

    cot: dict[int, TileTensor] = {}
    for t, g in zip(outputs, cotangents):
        g = ops.ones_like(t) if g is None else g
        cot[id(t)] = g if id(t) not in cot else ops.add(cot[id(t)], g)
    for t in reversed(order):
        g = cot.get(id(t))
        if g is None or t._record is None or id(t) in stop or not needs[id(t)]:
            continue
        rec = t._record
        needed = [isinstance(a, TileTensor) and needs.get(id(a), False) for a in rec.args]
        if not any(needed):
            continue
        with scope(f"{rec.scope.split(':')[0]}:backward"):
            grads = rec.op.vjp(rec.ctx, g, needed)
        _check_grads(rec, grads, needed)
        for a, ga, need in zip(rec.args, grads, needed):
            if ga is None or not need:
                continue
            prev = cot.get(id(a))
            cot[id(a)] = ga if prev is None else ops.add(prev, ga)

    out = []
    for i, x in enumerate(inputs):
        g = cot.get(id(x))
        if g is None:
            if not allow_unused:
                raise TileError(where, f"inputs[{i}] does not affect the loss (pass allow_unused=True "
                                "to get None for it)", repr(x))
        out.append(g)
    return out[0] if single else out
