"""Activation recompute: a block's backward re-runs its forward instead of keeping its activations.

``checkpoint(fn, *args)`` (torch's ``torch.utils.checkpoint.checkpoint``) records ``fn(*args)``
once, for its output, and hides that forward graph from autograd: the output's record is one
:class:`Checkpoint` op whose arguments are the tensors ``fn`` read from outside (``args`` and
what it closes over: parameters, rope tables, ...). Its backward records ``fn`` again on *gated*
copies of ``args`` (a gate tile is its input tile, but waits for the output's cotangent tile, so
the scheduler cannot run the recompute during the forward pass), then differentiates that fresh
graph. So the backward reads, of the block's forward, only its inputs and parameters; its
intermediate values (norms, attention, MLP hidden) live from the recompute to their use in the
same block's backward. The price: each block's forward runs twice.

>>> import numpy as np, tilegraph as tg
>>> blocks = [tg.nn.MLP(4, 8, seed=i, dtype=np.float64) for i in range(3)]
>>> x = h = tg.from_numpy(np.ones((2, 4)))
>>> for block in blocks:
...     h = h + tg.checkpoint(block, h)   # the residual stream is what the backward keeps
>>> gx, gw = tg.grad(h.sum(), [x, blocks[0].fc1.weight])
>>> gx.shape, gw.shape
((2, 4), (4, 8))
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from tilegraph import _autograd
from tilegraph._autograd import Op, Record
from tilegraph._errors import TileError
from tilegraph._graph import Cost, Node, current_scope, emit1, kernel, scope
from tilegraph._tensor import TileTensor

__all__ = ["checkpoint", "Checkpoint"]


def _gate_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    return Cost(0.0, 0.0)  # hands its first input on: no work, no copy


@kernel("recompute_gate", cost=_gate_cost)
def _gate(x, after):
    """``x`` itself, once ``after`` exists: orders the recompute after the output's cotangent."""
    return x


class _Ctx(NamedTuple):
    fn: Callable
    args: tuple         # checkpoint's arguments as given (TileTensors and anything else)
    inputs: tuple       # the TileTensors among them (each once): gated in the recompute
    captured: tuple     # the tensors fn read from its closure (parameters, ...): read as they are
    kwargs: dict        # checkpoint's keyword arguments for fn, as given
    mode: tuple         # the training mode fn was recorded in (:func:`_recording_mode`): the recompute's
    scope: str          # the scope fn was recorded in: the recompute's (seeds of ops.dropout, sdpa's dropout_p)
    meta: tuple         # the output's (shape, dtype, tiles): the recompute's must be the same


class Checkpoint(Op):
    """The op of :func:`checkpoint`. Its record's arguments are ``inputs + captured`` (see
    :class:`_Ctx`); its forward ran ``fn`` once, its vjp records ``fn`` again and differentiates it."""

    name = "checkpoint"

    def backward(self, ctx: _Ctx, dout: TileTensor):
        return self.vjp(ctx, dout, [True] * (len(ctx.inputs) + len(ctx.captured)))

    def vjp(self, ctx: _Ctx, dout: TileTensor, needed: Sequence[bool]):
        with scope(f"{_label(ctx.fn)}:recompute"):
            gated = {id(a): _gated(a, dout) for a in ctx.inputs}
        args = tuple(gated[id(a)] if isinstance(a, TileTensor) else a for a in ctx.args)
        kwargs = {k: gated[id(a)] if isinstance(a, TileTensor) else a for k, a in ctx.kwargs.items()}
        # the forward's dropout masks, wherever the backward is recorded: its training mode, and its
        # scope, which seeds the masks of dropout called outside a module (ops.dropout, sdpa's
        # dropout_p: ops.dropout._scope_seed); recorded in the backward's ("...:backward") a plain
        # function's recompute drew other masks than its forward, and its gradients were wrong
        with _as_recorded(ctx.mode), scope(ctx.scope):
            out, made = _record(ctx.fn, args, "tilegraph.checkpoint (the recompute)", kwargs)
        _check_same(ctx.fn, out, made, ctx.meta)
        leaves = [gated[id(a)] for a in ctx.inputs] + list(ctx.captured)
        # the recomputed kernels are named as what they are on the dashboard and in kernel_stats
        _relabel(out, {id(r.node) for t in leaves for r in t.grid.flat}, "recompute")
        # differentiate the fresh graph down to the gated inputs and the closure's tensors, no further
        wrt = [t for t, need in zip(leaves, needed) if need]
        grads = iter(_autograd.vjp([out], [dout], wrt, leaves=leaves, allow_unused=True,
                                   where="tilegraph.checkpoint"))
        return [next(grads) if need else None for need in needed]


_CHECKPOINT = Checkpoint()


def checkpoint(fn: Callable[..., TileTensor], *args: Any, use_reentrant: bool = False,
               preserve_rng_state: bool = True, **kwargs: Any) -> TileTensor:
    """``fn(*args)``, whose backward recomputes ``fn``'s forward from ``args`` instead of reading
    the activations of its first run (activation recompute, gradient checkpointing).

    ``fn`` returns one TileTensor; it may close over parameters and other tensors (a module's
    weights): they get their gradients as if ``fn`` had been called directly. ``fn`` must record
    the same graph when called again: no state that changes between calls (a KV cache, a Python
    counter feeding a random seed). Arguments that are not TileTensors are passed on as they are;
    other keyword arguments go to ``fn``, as torch passes them (TileTensors among them are inputs
    like ``args``). ``use_reentrant``: torch's keyword, for code written for it; the recompute is
    always what torch calls non-reentrant (False, torch's recommendation), and True is refused.
    ``preserve_rng_state``: torch's keyword too; tilegraph's random masks (LoRA dropout) are
    hashes of their seeds, so the recompute draws the same ones either way. The recompute records
    ``fn`` in the training mode of its first call (:func:`tilegraph.nn.training`, and the
    ``train()`` / ``eval()`` flags of ``fn``'s modules where ``fn`` is a module or its method), so
    ``loss.backward()`` after the ``with tg.nn.training():`` block of the forward recomputes it
    with the forward's dropout.

    >>> import numpy as np, tilegraph as tg
    >>> block = tg.nn.MLP(4, 8, seed=0, dtype=np.float64)
    >>> x = tg.from_numpy(np.ones((2, 4)))
    >>> (gx,) = tg.grad(tg.checkpoint(block, x).sum(), [x])
    >>> bool(np.allclose(gx.numpy(), tg.grad(block(x).sum(), [x])[0].numpy()))
    True
    """
    where = "tilegraph.checkpoint"
    if use_reentrant is not False:
        raise TileError(where, "use_reentrant=False (torch's keyword: the recompute here is always the "
                        "non-reentrant kind)", f"use_reentrant={use_reentrant!r}")
    if not isinstance(preserve_rng_state, (bool, np.bool_)):
        raise TileError(where, "preserve_rng_state must be a bool (torch's keyword; the recompute draws the same "
                        "masks either way)", repr(preserve_rng_state))
    if not callable(fn):
        raise TileError(where, "fn must be callable (a module, or a function of TileTensors)", type(fn).__name__)
    if not _autograd.grad_enabled():  # no backward to recompute for (tilegraph.no_grad: inference)
        return fn(*args, **kwargs)
    mode, recorded_in = _recording_mode(fn), current_scope()
    out, made = _record(fn, args, where, kwargs)
    inside = {id(t) for t in made}
    if id(out) not in inside:  # fn handed on a tensor it was given: nothing of its own to recompute
        return out
    given = [*args, *kwargs.values()]
    inputs = tuple({id(a): a for a in given if isinstance(a, TileTensor)}.values())
    outside = {id(a) for a in inputs} | inside
    captured: dict[int, TileTensor] = {}
    for t in made:
        for a in t._record.args:
            if isinstance(a, TileTensor) and id(a) not in outside:
                captured.setdefault(id(a), a)
    # the output's tiles as recorded; for autograd, one op over everything fn read from outside
    result = TileTensor(out.tiling, out.dtype, out.grid, name=out.name)
    ctx = _Ctx(fn, tuple(args), inputs, tuple(captured.values()), dict(kwargs), mode, recorded_in,
               (out.shape, np.dtype(out.dtype), out.chunks))
    result._record = Record(_CHECKPOINT, inputs + ctx.captured, ctx)
    if _autograd._REGIONS:  # nested in an outer checkpoint: its op, like any other, is one the outer
        _autograd._REGIONS[-1].append(result)  # made (so what this fn read counts as the outer's read)
    return result


def _record(fn: Callable, args: tuple, where: str, kwargs: dict | None = None) -> tuple[TileTensor, list[TileTensor]]:
    """``fn(*args, **kwargs)`` and the tensors its ops made."""
    made: list[TileTensor] = []
    _autograd._REGIONS.append(made)
    try:
        out = fn(*args, **(kwargs or {}))
    finally:
        _autograd._REGIONS.pop()
    if not isinstance(out, TileTensor):
        raise TileError(where, "fn must return one TileTensor", type(out).__name__)
    return out, made


def _check_same(fn: Callable, out: TileTensor, made: list, want: tuple) -> None:
    """The recompute's output must be what the forward's was (``want``: its shape, dtype and tiles)
    and made by ``fn``: a ``fn`` that records another graph when called again (state that
    changes between calls) gave gradients of that other graph, silently (an output cut to fewer
    rows, or an input handed on, differentiated as if it were the forward's)."""
    got = (out.shape, np.dtype(out.dtype), out.chunks)
    handed_on = all(out is not t for t in made)
    if got != want or handed_on:
        name = getattr(fn, "_scope_name", None) or getattr(fn, "__qualname__", None) or type(fn).__name__
        said = "an input handed on as it is" if handed_on else f"shape {got[0]}, dtype {got[1]}, tiles {got[2]}"
        raise TileError("tilegraph.checkpoint (the recompute)",
                        f"fn ({name}) to record the same graph when called again for the backward: its first "
                        f"call returned shape {want[0]}, dtype {want[1]}, tiles {want[2]} made by its own ops (no "
                        "state that changes between calls: a counter, a KV cache)", f"the second call returned {said}")


def _recording_mode(fn: Callable) -> tuple:
    """The training mode ``fn`` records in now: :func:`tilegraph.nn.training`'s (None outside one)
    and the ``train()`` / ``eval()`` flag of each module of ``fn`` (a Module, or a method of one).
    The recompute records in it again: a backward recorded outside the forward's
    ``tg.nn.training()`` block (``loss.backward()`` after it, as in a torch loop), or after
    ``model.eval()``, recomputed the block without its dropout, and the gradients were not those
    of the forward's masks."""
    from tilegraph.nn import _TRAINING, Module

    owner = fn if isinstance(fn, Module) else getattr(fn, "__self__", None)
    modules = tuple(owner.modules()) if isinstance(owner, Module) else ()
    return _TRAINING.get(), tuple((m, m.__dict__.get("_training")) for m in modules)


@contextlib.contextmanager
def _as_recorded(mode: tuple):
    """Record inside the block in the training mode of :func:`_recording_mode`, then put back the
    mode of now."""
    from tilegraph.nn import _TRAINING

    step, flags = mode
    now = [(m, m.__dict__.get("_training")) for m, _ in flags]
    token = _TRAINING.set(step)
    try:
        for m, flag in flags:
            m._training = flag
        yield
    finally:
        for m, flag in now:
            m._training = flag
        _TRAINING.reset(token)


def _label(fn: Callable) -> str:
    """The scope a checkpointed call's own kernels (its gates) are recorded under: the module's
    name in the model (``blocks.3``), else the scope it was called in."""
    from tilegraph._graph import current_scope

    return getattr(fn, "_scope_name", None) or current_scope().split(":")[0] or "checkpoint"


def _gated(x: TileTensor, dout: TileTensor) -> TileTensor:
    """``x`` as a new leaf for autograd whose tiles wait for ``dout``'s: tile ``idx`` for the tile
    of ``dout`` at the same grid index (clipped to its grid), so a batch row's recompute waits for
    that row's cotangent only (and stays on its data-parallel replica)."""
    grid = np.empty(x.tiling.grid, dtype=object)
    dgrid = dout.grid
    for idx in np.ndindex(*x.tiling.grid):
        if len(idx) == dgrid.ndim:
            after = dgrid[tuple(min(i, g - 1) for i, g in zip(idx, dgrid.shape))]
        else:
            after = dgrid.flat[0]
        ref = x.grid[idx]
        grid[idx] = emit1(_gate, [ref, after], ref.shape, ref.dtype, op="recompute")
    return TileTensor(x.tiling, x.dtype, grid, name=x.name)


def _relabel(out: TileTensor, boundary: set[int], phase: str) -> None:
    """Mark the kernels behind ``out`` (down to the nodes in ``boundary`` and leaves) as ``phase``
    of their module (``blocks.3.attn:recompute``)."""
    stack: list[Node] = [r.node for r in out.grid.flat]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) in seen or id(n) in boundary or n.is_leaf:
            continue
        seen.add(id(n))
        n.scope = f"{n.scope.split(':')[0]}:{phase}"
        stack.extend(i.node for i in n.inputs)
