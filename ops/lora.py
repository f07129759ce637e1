"""LoRA linear layer ``Y = b + X W + (X U) V`` whose forward and backward graphs are chosen among
RunLoRA's variants (arXiv:2312.03415).

Shapes: X (..., n) with N rows in all, W (n, m) frozen, U (n, r), V (r, m), b (m,). ``scale``
(LoRA's alpha / r) multiplies U wherever it is used, so the trainable U keeps peft's meaning.

Each variant is written once, as a list of :class:`Step` (a sum of matrix products plus an
optional addend). The same list gives the variant's FLOPs (counting only the steps the wanted
outputs depend on, so a gradient nobody needs costs nothing), its tile graph, and the NumPy/CuPy
evaluation that the ``"time"`` criterion measures. ``X U`` is never kept for the backward: the
variants that need it (b1, b5) recompute it. The backward reads X only in the products that make
dU or dV, and W only in those that make dX; the graph is lazy, so a gradient that is not asked
for is never computed, and the tiles only it would read are not kept for the backward: X is kept
only when U or V need a gradient, W only when X does. W gets no gradient at all.

With ``dropout=p > 0`` (LoRA's dropout on the adapter's input, as Hugging Face peft's) the layer
is ``Y = b + X W + scale * (D(X) U) V`` with D the inverted dropout of :mod:`tilegraph.ops.dropout`,
a new mask every optimizer step and every micro-batch (each row block's seed hashes a base seed
with U's and V's first tiles and the block's first tile of X), no mask stored: the backward
regenerates D(X) from X and applies the same mask to dX's adapter part (dX = dY W^T + D(Z U^T)).
Only the variants that keep the adapter branch apart are valid then: forward f1, backward b1,
b2, b3 (f2, b4 and b5 multiply by W + U V, one X for both branches).

>>> import numpy as np, tilegraph as tg
>>> from tilegraph.ops.lora import choose_variant
>>> choose_variant(512, 1024, 1024, 8), choose_variant(8192, 1024, 1024, 8)
(('f1', 'b1'), ('f2', 'b5'))
>>> x, w = tg.from_numpy(np.ones((3, 4))), tg.from_numpy(np.ones((4, 5)))
>>> u, v = tg.from_numpy(np.ones((4, 2))), tg.from_numpy(np.ones((2, 5)))
>>> lora_linear(x, w, u, v, scale=0.5).numpy()[0]
array([8., 8., 8., 8., 8.])
"""

from __future__ import annotations

import math
import time
import weakref
from typing import NamedTuple

import numpy as np

from tilegraph._autograd import Op, grad_enabled
from tilegraph._errors import TileError
from tilegraph._graph import emit1
from tilegraph._tensor import TileTensor, Tiling

from ._common import new_tensor, require_float, require_same_chunks, require_same_dtype, require_tensor
from .dropout import _dropout_tiles, check_dropout, row_seed_tensor
from . import _blas as blas
from .matmul import _matmul, _matmul_tn_op

__all__ = ["lora_linear", "choose_variant", "variant_flops", "requires_grad", "merged_weight", "FORWARD", "BACKWARD",
           "CRITERIA", "DROPOUT_FORWARD", "DROPOUT_BACKWARD"]

WHERE = "tilegraph.lora_linear"


class Term(NamedTuple):
    """One matrix product: ``a @ b`` ("nn"), ``a @ b^T`` ("nt") or ``a^T @ b`` over all leading
    dims ("tn"). Operands are named: x, w, u, v, b (bias), dy, or an earlier step's output.
    ("drop": not a product but the dropout of ``a`` under the seed ``b``, in the steps of
    :func:`_with_dropout` only.)"""

    kind: str
    a: str
    b: str


class Step(NamedTuple):
    """``out = sum(terms) + add``: the terms of one step share their kind and are fused into one
    kernel per output tile ("tn" steps have one term)."""

    out: str
    terms: tuple[Term, ...]
    add: str | None = None


def _nn(a, b):
    return Term("nn", a, b)


def _nt(a, b):
    return Term("nt", a, b)


def _tn(a, b):
    return Term("tn", a, b)


# Forward variants: f1 X W + (X U) V; f2 X (W + U V) (an n x m temporary).
_FORWARD = {
    "f1": (Step("xu", (_nn("x", "u"),)),
           Step("y", (_nn("x", "w"), _nn("xu", "v")), "b")),
    "f2": (Step("weff", (_nn("u", "v"),), "w"),
           Step("y", (_nn("x", "weff"),), "b")),
}

# Backward variants (outputs dx, du, dv; db = sum of dy is the same in all). The step names say
# what each product is: z = dY V^T, g = X^T dY, xu = X U (recomputed), weff = W + U V (recomputed).
_Z = Step("z", (_nt("dy", "v"),))
_XU = Step("xu", (_nn("x", "u"),))
_G = Step("g", (_tn("x", "dy"),))
_WEFF = Step("weff", (_nn("u", "v"),), "w")
_DX_SPLIT = Step("dx", (_nt("dy", "w"), _nt("z", "u")))
_DX_MERGED = Step("dx", (_nt("dy", "weff"),))
_BACKWARD = {
    "b1": (_Z, Step("du", (_tn("x", "z"),)), _XU, Step("dv", (_tn("xu", "dy"),)), _DX_SPLIT),
    "b2": (_Z, Step("du", (_tn("x", "z"),)), _G, Step("dv", (_tn("u", "g"),)), _DX_SPLIT),
    "b3": (_G, Step("du", (_nt("g", "v"),)), Step("dv", (_tn("u", "g"),)), _Z, _DX_SPLIT),
    "b4": (_G, Step("du", (_nt("g", "v"),)), Step("dv", (_tn("u", "g"),)), _WEFF, _DX_MERGED),
    "b5": (_Z, Step("du", (_tn("x", "z"),)), _XU, Step("dv", (_tn("xu", "dy"),)), _WEFF, _DX_MERGED),
}

FORWARD = tuple(_FORWARD)
BACKWARD = tuple(_BACKWARD)
#: the variants valid with dropout on the adapter's input: those that keep X W and (X U) V apart
DROPOUT_FORWARD = ("f1",)
DROPOUT_BACKWARD = ("b1", "b2", "b3")


def _with_dropout(steps) -> tuple[Step, ...]:
    """A variant's steps with dropout on the adapter branch: the products of X with anything but W
    read XD = D(X) (recomputed from X and the seed in the backward, never kept), and the split
    ``dX = dY W^T + Z U^T`` becomes ``dY W^T + D(Z U^T)`` (the same mask, from the same seed)."""
    out = [Step("xd", (Term("drop", "x", "seed"),))]
    for s in steps:
        if s.out == "dx":
            base = tuple(t for t in s.terms if t.b == "w")
            adapter = tuple(t for t in s.terms if t.b != "w")
            assert len(base) == len(adapter) == 1, s  # the merged dX (W + U V) has no adapter part
            out += [Step("dxa", adapter), Step("dxd", (Term("drop", "dxa", "seed"),)), Step("dx", base, "dxd")]
            continue
        assert s.out != "weff", s
        out.append(s._replace(terms=tuple(t if "w" in (t.a, t.b) else
                                          t._replace(a="xd" if t.a == "x" else t.a, b="xd" if t.b == "x" else t.b)
                                          for t in s.terms)))
    return tuple(out)


_FORWARD_DROPOUT = {f: _with_dropout(_FORWARD[f]) for f in DROPOUT_FORWARD}
_BACKWARD_DROPOUT = {b: _with_dropout(_BACKWARD[b]) for b in DROPOUT_BACKWARD}

#: how a variant is chosen: "flops" (RunLoRA's operation counts) or "time" (measured, then cached)
CRITERIA = ("flops", "time")


# ---------------------------------------------------------------------------------- counting ----
def _shape_of(term: Term, shapes: dict) -> tuple[int, int, float]:
    """(rows, cols, flops) of one product of 2-D operands."""
    (ar, ac), (br, bc) = shapes[term.a], shapes[term.b]
    if term.kind == "nn":
        return ar, bc, 2.0 * ar * ac * bc
    if term.kind == "nt":
        return ar, br, 2.0 * ar * ac * br
    return ac, bc, 2.0 * ar * ac * bc  # tn: contracts the rows


def _needed(steps, wanted) -> list[Step]:
    """The steps ``wanted`` outputs depend on, in order."""
    need = set(wanted)
    keep = []
    for s in reversed(steps):
        if s.out in need:
            keep.append(s)
            need.update(n for t in s.terms for n in (t.a, t.b))
            if s.add:
                need.add(s.add)
    return keep[::-1]


def _outputs(needs) -> tuple[str, ...]:
    return tuple(name for name, need in zip(("dx", "du", "dv"), needs) if need)


def _check_variant_name(name, known, what: str, where: str = WHERE) -> str:
    if name not in known:
        raise TileError(where, f"unknown {what} variant; known: {', '.join(known)}", repr(name))
    return name


def variant_flops(variant: str, N: int, n: int, m: int, r: int, needs=(True, True, True)) -> float:
    """FLOPs of forward variant ``"f1"``/``"f2"`` or backward variant ``"b1"``..``"b5"`` for
    N rows, W (n, m) and rank r; a backward counts only the products that the gradients in
    ``needs`` (of X, U, V) depend on.

    >>> variant_flops("b4", 10, 4, 6, 2) == 4 * 10 * 4 * 6 + 6 * 4 * 6 * 2
    True
    >>> variant_flops("b1", 10, 4, 6, 2, needs=(True, False, False)) == 2 * 10 * (4 * 6 + 6 * 2 + 4 * 2)
    True
    """
    shapes = {"x": (N, n), "w": (n, m), "u": (n, r), "v": (r, m), "dy": (N, m)}
    if variant in _FORWARD:
        steps, wanted = _FORWARD[variant], ("y",)
    else:
        steps, wanted = _BACKWARD[_check_variant_name(variant, FORWARD + BACKWARD, "LoRA")], _outputs(needs)
    total = 0.0
    for s in steps:  # shapes of every step (cheap), flops of the needed ones
        rows, cols, _ = _shape_of(s.terms[0], shapes)
        shapes[s.out] = (rows, cols)
    for s in _needed(steps, wanted):
        total += sum(_shape_of(t, shapes)[2] for t in s.terms)
    return total


_TIMED: dict[tuple, tuple[str, str]] = {}  # key -> (forward, backward) chosen by measurement


def choose_variant(N: int, n: int, m: int, r: int, *, needs=(True, True, True), by: str = "flops",
                   dtype=np.float32, device: str = "cpu", bias: bool = False, dropout: bool = False) -> tuple[str, str]:
    """The (forward, backward) pair for these shapes and the gradients in ``needs`` (of X, U, V);
    with ``dropout``, among :data:`DROPOUT_FORWARD` and :data:`DROPOUT_BACKWARD` only (their
    products and FLOPs are those without dropout; the masks cost the same in each).

    ``by="flops"``: the variants with the fewest FLOPs (ties: the lowest index). ``by="time"``:
    each candidate is run once on ``device`` ("cpu": NumPy; "gpu": CuPy) on random data of these
    shapes and ``dtype``, and the fastest kept; the result is cached per (shapes, dtype, device,
    needs, bias), so each layer shape is measured once per process.
    """
    needs = tuple(bool(f) for f in needs)
    forward, backward = (DROPOUT_FORWARD, DROPOUT_BACKWARD) if dropout else (FORWARD, BACKWARD)
    if by == "flops":
        fwd = min(forward, key=lambda f: (variant_flops(f, N, n, m, r), FORWARD.index(f)))
        bwd = min(backward, key=lambda b: (variant_flops(b, N, n, m, r, needs), BACKWARD.index(b)))
        return fwd, bwd
    if by != "time":
        raise TileError(WHERE, f"choose must be one of {', '.join(CRITERIA)}", repr(by))
    if device not in ("cpu", "gpu"):
        raise TileError(WHERE, "device must be 'cpu' or 'gpu'", repr(device))
    key = (int(N), int(n), int(m), int(r), np.dtype(dtype).str, device, needs, bool(bias))
    if dropout:
        key += ("dropout",)
    if key not in _TIMED:
        _TIMED[key] = _measure(*key[:8], forward, backward)
    return _TIMED[key]


def _evaluate(steps, env: dict, wanted, xp) -> dict:
    """Run the needed steps of a variant on whole arrays (what the "time" criterion measures)."""
    for s in _needed(steps, wanted):
        acc = None
        for t in s.terms:
            a, b = env[t.a], env[t.b]
            if t.kind == "nn":   # (through the kernels' BLAS: the times the choice compares are theirs)
                p = blas.matmul(a, b)
            elif t.kind == "nt":
                p = blas.matmul(a, b.T)
            else:
                p = blas.matmul(a.T, b)
            acc = p if acc is None else acc + p
        if s.add is not None and env.get(s.add) is not None:
            acc = acc + env[s.add]
        env[s.out] = acc
    return env


def _measure(N, n, m, r, dtype, device, needs, bias, forward=FORWARD, backward=BACKWARD) -> tuple[str, str]:
    """Time each forward and each backward candidate once (after one warm-up call)."""
    if device == "gpu":
        import cupy as xp

        sync = xp.cuda.Device().synchronize
    else:
        xp, sync = np, (lambda: None)
    rng = np.random.default_rng(0)

    def arr(*shape):
        return xp.asarray(rng.standard_normal(shape).astype(dtype))

    env = {"x": arr(N, n), "w": arr(n, m), "u": arr(n, r), "v": arr(r, m), "dy": arr(N, m),
           "b": arr(m) if bias else None}

    def run(steps, wanted) -> float:
        sync()
        t0 = time.perf_counter()
        _evaluate(steps, dict(env), wanted, xp)
        sync()
        return time.perf_counter() - t0

    run(_FORWARD["f1"], ("y",))  # warm-up: BLAS threads, CuPy kernels, caches
    fwd = min(forward, key=lambda f: run(_FORWARD[f], ("y",)))
    wanted = _outputs(needs)
    bwd = min(backward, key=lambda b: run(_BACKWARD[b], wanted)) if wanted else backward[0]
    return fwd, bwd


# --------------------------------------------------------------------------- requires grad ----
_INFERRED: "weakref.WeakKeyDictionary[TileTensor, bool]" = weakref.WeakKeyDictionary()


def requires_grad(t: TileTensor) -> bool:
    """Whether a gradient may flow into ``t``: a Parameter's own ``requires_grad``; for a leaf
    that is not a Parameter, True when it is floating (``tilegraph.grad`` may ask for it); for a
    computed tensor, whether any of its op's inputs requires one. Used to pick the variant: a
    wrong guess only costs speed, never correctness (every gradient stays available). Inside
    :func:`tilegraph.no_grad`, nothing does."""
    if not grad_enabled():
        return False
    order, stack = [], [t]
    while stack:  # inputs before outputs, stopping at tensors already known
        s = stack.pop()
        if s._record is None or s in _INFERRED:
            continue
        order.append(s)
        stack.extend(a for a in s._record.args if isinstance(a, TileTensor))
    for s in reversed(order):
        if s not in _INFERRED:
            _INFERRED[s] = any(_leaf_or_known(a) for a in s._record.args if isinstance(a, TileTensor))
    return _leaf_or_known(t)


def _leaf_or_known(t: TileTensor) -> bool:
    if t._record is not None:
        return _INFERRED[t]
    flag = getattr(t, "requires_grad", None)  # a Parameter's (set False for frozen weights)
    return bool(flag) if flag is not None else t.dtype.kind == "f"


# ----------------------------------------------------------------------------- tile graph ----
def _tile_step(step: Step, env: dict) -> TileTensor:
    """Record one step over tiles: a "tn" product through the weight-gradient op (one product
    per row tile plus a sum tree), the others as one fused kernel per output tile that sums every
    term's K tiles and adds the addend (a bias vector or a full tile)."""
    if step.terms[0].kind == "drop":
        (t,) = step.terms
        return _dropout_tiles(env[t.a], env[t.b], env["p"])
    if step.terms[0].kind == "tn":
        (t,) = step.terms
        return _matmul_tn_op(env[t.a], env[t.b])
    trans = step.terms[0].kind == "nt"
    first_a, first_b = env[step.terms[0].a], env[step.terms[0].b]
    tiling = Tiling(first_a.chunks[:-1] + ((first_b.chunks[0] if trans else first_b.chunks[-1]),))
    addend = env.get(step.add) if step.add else None

    def fill(idx):
        lead, j = idx[:-1], idx[-1]
        lhs, rhs = [], []
        for t in step.terms:
            a, b = env[t.a], env[t.b]
            for k in range(a.tiling.grid[-1]):
                lhs.append(a.grid[lead + (k,)])
                rhs.append(b.grid[(j, k) if trans else (k, j)])
        ins = lhs + rhs
        if addend is not None:
            ins.append(addend.grid[j] if addend.ndim == 1 else addend.grid[idx])
        return emit1(_matmul, ins, tiling.tile_shape(idx), first_a.dtype, op="lora", nk=len(lhs),
                     trans_b=trans, bias=addend is not None)

    return new_tensor(tiling, first_a.dtype, fill)


def _run_tiles(steps, env: dict, wanted) -> dict:
    for s in _needed(steps, wanted):
        env[s.out] = _tile_step(s, env)
    return env


class LoRAContext(NamedTuple):
    """What the backward needs: the inputs (references, not copies; the workers keep only the
    tiles that the kernels of the gradients actually asked for read), the scale, the chosen
    backward variant and, with dropout, its probability and the step's seed tiles, one per row
    block of x (the mask is regenerated from them, never stored)."""

    x: TileTensor
    w: TileTensor
    u: TileTensor
    v: TileTensor
    has_bias: bool
    scale: float
    backward: str
    dropout: float = 0.0
    seed: TileTensor | None = None


class LoRALinearOp(Op):
    """``Y = b + X W + scale * (D(X) U) V`` with RunLoRA's variants (D: dropout, the identity
    when ``dropout=0``); W gets no gradient."""

    name = "lora_linear"

    def forward(self, x, w, u, v, bias=None, *, scale=1.0, variant=None, choose="flops", needs=None,
                device="cpu", dropout=0.0, seed=0):
        _check_inputs(x, w, u, v, bias)
        p = check_dropout(dropout, WHERE)
        if needs is None:
            needs = (requires_grad(x), requires_grad(u), requires_grad(v))
        fwd, bwd = _resolve_variant(variant, choose, x, w, u, needs, bias is not None, device, p)
        env = {"x": x, "w": w, "u": _scaled(u, scale), "v": v, "b": bias}
        steps, step_seed = _FORWARD[fwd], None
        if p > 0:
            # one seed tile per row block of X, hashed from the trainable U and V (new values every
            # optimizer step, so a replayed step graph draws a new mask) and that block's first tile
            # of X (each micro-batch of an accumulated step, which shares U and V, draws its own
            # mask, as torch draws one per forward call); the backward reuses them
            step_seed = row_seed_tensor(x, u, v, base=seed)
            env.update(seed=step_seed, p=p)
            steps = _FORWARD_DROPOUT[fwd]
        y = _run_tiles(steps, env, ("y",))["y"]
        return y, LoRAContext(x, w, u, v, bias is not None, float(scale), bwd, p, step_seed)

    def backward(self, ctx: LoRAContext, dy):
        env = {"x": ctx.x, "w": ctx.w, "u": _scaled(ctx.u, ctx.scale), "v": ctx.v, "dy": dy}
        steps = _BACKWARD[ctx.backward]
        if ctx.dropout > 0:
            env.update(seed=ctx.seed, p=ctx.dropout)
            steps = _BACKWARD_DROPOUT[ctx.backward]
        # all three gradients are recorded, by the chosen variant; the graph is lazy, so the ones
        # tilegraph.grad does not ask for are never computed (a wrong guess of which are needed
        # costs speed, never correctness)
        env = _run_tiles(steps, env, ("dx", "du", "dv"))
        du = env["du"]
        if ctx.scale != 1.0:
            du = du * ctx.scale  # d/dU of (X (scale U)) V
        db = None
        if ctx.has_bias:
            from .reduce import sum_dims

            db = sum_dims(dy, tuple(range(dy.ndim - 1)), (False,) * (dy.ndim - 1))
        return env["dx"], None, du, env["dv"], db


def _scaled(u: TileTensor, scale: float) -> TileTensor:
    return u if scale == 1.0 else u * float(scale)


def _check_inputs(x, w, u, v, bias) -> None:
    for name, t in (("x", x), ("w", w), ("u", u), ("v", v)):
        require_tensor(t, WHERE, name)
    if bias is not None:
        require_tensor(bias, WHERE, "bias")
    require_same_dtype(WHERE, x=x, w=w, u=u, v=v, bias=bias)
    require_float(x, WHERE, "x")
    if x.ndim < 2 or w.ndim != 2 or u.ndim != 2 or v.ndim != 2:
        raise TileError(WHERE, "x needs at least 2 dims and w, u, v exactly 2",
                        f"x {x.shape}, w {w.shape}, u {u.shape}, v {v.shape}")
    n, m = w.shape
    r = u.shape[1]
    if x.shape[-1] != n or u.shape[0] != n or v.shape != (r, m) or (bias is not None and bias.shape != (m,)):
        raise TileError(WHERE, "shapes x (..., n), w (n, m), u (n, r), v (r, m), bias (m,)",
                        f"x {x.shape}, w {w.shape}, u {u.shape}, v {v.shape}"
                        + (f", bias {bias.shape}" if bias is not None else ""))
    require_same_chunks(WHERE, "x's last dim, w's and u's rows (n)", x.chunks[-1], w.chunks[0])
    require_same_chunks(WHERE, "u's rows and w's rows (n)", u.chunks[0], w.chunks[0])
    require_same_chunks(WHERE, "v's columns and w's columns (m)", v.chunks[1], w.chunks[1])
    require_same_chunks(WHERE, "u's columns and v's rows (r)", u.chunks[1], v.chunks[0])
    if bias is not None:
        require_same_chunks(WHERE, "bias and w's columns (m)", bias.chunks[0], w.chunks[1])
    if getattr(w, "requires_grad", False):
        raise TileError(WHERE, "w is the frozen base weight and gets no gradient: set its requires_grad "
                        "to False (tilegraph.peft.apply_lora freezes it)", repr(w))


def _resolve_variant_name(variant, where: str = WHERE):
    """None (choose per call) or a checked (forward, backward) pair."""
    if variant is None or variant == "auto":
        return None
    if not (isinstance(variant, (tuple, list)) and len(variant) == 2):
        raise TileError(where, "variant must be None/'auto' or a pair such as ('f1', 'b1')", repr(variant))
    return (_check_variant_name(variant[0], FORWARD, "forward", where),
            _check_variant_name(variant[1], BACKWARD, "backward", where))


def check_dropout_variant(pair, dropout: float, where: str = WHERE) -> None:
    """With dropout, a forced (forward, backward) pair must keep the adapter branch apart."""
    if dropout > 0 and pair is not None and (pair[0] not in DROPOUT_FORWARD or pair[1] not in DROPOUT_BACKWARD):
        raise TileError(where, f"with dropout > 0 a variant whose adapter branch reads the dropped-out X apart "
                        f"from X W: forward {', '.join(DROPOUT_FORWARD)} and backward {', '.join(DROPOUT_BACKWARD)} "
                        f"(f2, b4, b5 multiply by W + U V)", f"{tuple(pair)!r} with dropout={dropout:g}")


def _resolve_variant(variant, choose, x, w, u, needs, bias: bool, device: str, dropout: float = 0.0) -> tuple[str, str]:
    if choose not in CRITERIA:
        raise TileError(WHERE, f"choose must be one of {', '.join(CRITERIA)}", repr(choose))
    pair = _resolve_variant_name(variant)
    if pair is None:
        n, m = w.shape
        return choose_variant(math.prod(x.shape[:-1]), n, m, u.shape[1], needs=needs, by=choose, dtype=x.dtype,
                              device=device, bias=bias, dropout=dropout > 0)
    check_dropout_variant(pair, dropout)
    return pair


def merged_weight(w: TileTensor, u: TileTensor, v: TileTensor, scale: float = 1.0) -> TileTensor:
    """``w + scale * u @ v`` on w's tiles (what LoRA merging and the f2/b4/b5 variants compute)."""
    return _run_tiles((_WEFF,), {"w": w, "u": _scaled(u, scale), "v": v}, ("weff",))["weff"]


_lora_op = LoRALinearOp()


def lora_linear(x: TileTensor, w: TileTensor, u: TileTensor, v: TileTensor, bias: TileTensor | None = None, *,
                scale: float = 1.0, variant=None, choose: str = "flops", requires_grad=None,
                device: str = "cpu", dropout: float = 0.0, seed: int = 0) -> TileTensor:
    """``bias + x @ w + scale * (dropout(x) @ u) @ v``: a LoRA linear layer over a frozen ``w``
    (n, m) with adapter factors ``u`` (n, r) and ``v`` (r, m).

    - ``variant``: None or "auto" picks the forward ("f1", "f2") and backward ("b1".."b5")
      graphs by ``choose`` ("flops" or "time", see :func:`choose_variant`); a pair such as
      ``("f2", "b5")`` forces them.
    - ``requires_grad``: which of (x, u, v) will get gradients, for the choice; by default
      inferred from the graph (:func:`requires_grad`). Every gradient stays available either way.
    - ``device``: where the "time" criterion measures ("cpu" or "gpu").
    - ``dropout``: the probability of zeroing an element of the adapter's input (the base product
      reads x as it is), 0 for none; the kept ones are scaled by 1 / (1 - dropout). Each row block
      of x (its tiles along the leading dims) draws its mask from ``seed`` and a hash of the first
      tiles of ``u`` and ``v`` and of the block's first tile of ``x``
      (:func:`tilegraph.ops.dropout.row_seed_tensor`), so it changes whenever they do: every
      optimizer step of a replayed step graph, and every micro-batch of an accumulated one. It
      applies whenever given: :class:`tilegraph.nn.LoRALinear` passes it in training only.
      Restricts the variants to :data:`DROPOUT_FORWARD` and :data:`DROPOUT_BACKWARD`.

    Tiles: x's last dim, w's and u's rows share tiles (n); w's, v's and bias' columns (m); u's
    columns and v's rows (r, usually one tile).
    """
    if requires_grad is not None:
        if not (isinstance(requires_grad, (tuple, list)) and len(requires_grad) == 3):
            raise TileError(WHERE, "requires_grad must be three bools, for x, u and v", repr(requires_grad))
        requires_grad = tuple(bool(f) for f in requires_grad)
    return _lora_op(x, w, u, v, bias, scale=scale, variant=variant, choose=choose, needs=requires_grad,
                    device=device, dropout=dropout, seed=seed)
