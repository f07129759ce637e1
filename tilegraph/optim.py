"""Optimizers that record one fused update kernel per parameter tile, plus LR schedules and
global-norm gradient clipping.

Per step, the varying scalars (learning rate, step number, each parameter's own update count)
travel as one tiny "hyper" tile (:data:`HYPER`), so a recorded training step is replayed
unchanged; clipping adds a tree of per-tile squared norms whose result scales the gradients inside
the update kernels. A parameter group's own ``lr`` is a fixed
multiple of that rate, a parameter of its update kernels. State (Adam's and AdamW's m and v, SGD's
momentum buffer) lives in cells next to the parameters: on the workers when a runtime is connected.
"""

from __future__ import annotations

import itertools
import math
import numbers
import warnings
import weakref
from typing import Callable, Mapping, Sequence

import numba
import numpy as np

from tilegraph._config import is_int, number_check, require_arg, require_int
from tilegraph._errors import TileError
from tilegraph._graph import Cell, Cost, TileRef, emit, emit1, kernel, leaf, scope, xp_of
from tilegraph._tensor import TileTensor, assign_cells, tensor_from_cells
from tilegraph.nn import Module, Parameter
from tilegraph.ops._gpu import fused

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "StateKeyError", "warmup_cosine", "constant", "schedule_from_spec"]


# ------------------------------------------------------------------------ argument checks ----
# (check, what it wants) of the hyperparameters: the ranges torch.optim checks, except where
# torch's range lets a run produce NaN or diverge (noted).
#: a learning rate or weight decay
_NON_NEGATIVE = number_check(finite=True)
#: AdamW's eps; torch allows 0, which makes the update 0/0 = NaN wherever a gradient and its
#: moments are 0
_EPS = number_check(strict=True, finite=True)
_BETA = number_check(0.0, high=1.0, below=True)
#: SGD's momentum; torch allows more than 1, which grows the momentum buffer geometrically
#: until it overflows to inf and NaN
_MOMENTUM = number_check(0.0, high=1.0)
#: SGD's dampening; torch takes any number, but past 1 the gradient enters the momentum buffer
#: with its sign flipped (a step uphill), and below 0 amplified
_DAMPENING = number_check(0.0, high=1.0)
_STEPS = number_check(whole=True)


def _param_groups(where: str, params, keys: tuple, check: dict) -> tuple[list, list]:
    """torch's parameter groups: ``params`` as a list of dicts, each ``{"params": [...], key:
    value}`` with ``key`` among ``keys`` (checked with ``check[key]``), as a flat list of
    Parameters and, for each, the options of its group; a plain iterable of Parameters is one
    group without options. Other keys (SGD's momentum per group, say) are a TileError naming
    them. Third: the groups as given, ``(members, options)`` each (empty ones included)."""
    try:
        items = list(params) if not isinstance(params, (Module, TileTensor)) else None
    except TypeError:
        items = None
    if not items or not all(isinstance(g, Mapping) for g in items):
        flat = _parameter_list(where, params if items is None else items)
        return flat, [{}] * len(flat), [(flat, {})]
    flat, options, groups = [], [], []
    for i, group in enumerate(items):
        if "params" not in group:
            raise TileError(where, f"each parameter group a dict with 'params' (param_groups[{i}] has none)",
                            f"keys {sorted(group)}")
        other = sorted(k for k in group if k != "params" and k not in keys)
        if other:
            raise TileError(where, f"parameter groups may set {', '.join(keys)} only",
                            f"param_groups[{i}] sets {', '.join(other)}")
        for k in keys:
            if k in group:
                check[k](f"{where} param_groups[{i}]", group[k])
        # an empty group is accepted, as torch's (a recipe's "no decay" group on a model without biases)
        members = _parameter_list(f"{where} param_groups[{i}]", group["params"], empty=True)
        flat += members
        groups.append((members, {k: group[k] for k in keys if k in group}))
        options += [groups[-1][1]] * len(members)
    if not flat:
        raise TileError(where, "at least one Parameter among the parameter groups",
                        f"{len(items)} parameter groups, all empty")
    _parameter_list(where, flat)  # each Parameter in one group only
    return flat, options, groups


def _parameter_list(where: str, params, empty: bool = False) -> list:
    """``params`` as a list of Parameters (frozen ones included), or a TileError; ``empty``:
    an empty list is one too (a parameter group's)."""
    if isinstance(params, Module):
        raise TileError(where, "params must be an iterable of Parameters: pass model.parameters(), not the model",
                        f"params={type(params).__name__} (a Module)")
    wanted = "params must be an iterable of Parameters (such as model.parameters())"
    if isinstance(params, TileTensor):
        raise TileError(where, wanted + "; for one Parameter p, pass [p]", f"params={type(params).__name__}")
    try:
        params = list(params)
    except TypeError:
        raise TileError(where, wanted, f"params={params!r}") from None
    if not params and not empty:
        raise TileError(where, "params must hold at least one Parameter", "params: empty")
    for i, p in enumerate(params):
        if not isinstance(p, Parameter):
            raise TileError(where, f"params[{i}] is not a Parameter", type(p).__name__)
    # the same Parameter twice would get two updates per step, each from its own copy of the
    # state, the second overwriting the first (torch warns and will refuse it)
    first: dict[int, int] = {}
    for i, p in enumerate(params):
        if id(p) in first:
            raise TileError(where, "params must name each Parameter once (it would be updated twice per step)",
                            f"params[{first[id(p)]}] and params[{i}] are the same Parameter ({p.name!r}, shape "
                            f"{tuple(p.shape)})")
        first[id(p)] = i
    return params


# ------------------------------------------------------------------------------- schedules ----
def steps_past_schedule(spec, start: int, end: int) -> range:
    """The steps of ``start + 1 .. end`` past the total of the schedule whose ``spec`` is given
    (:func:`warmup_cosine`'s), which run at its floor (``min_lr``); empty when none are, or when
    the schedule has no total."""
    total = spec.get("total") if isinstance(spec, dict) else None
    if not is_int(total) or end <= total:
        return range(0)
    return range(max(start, total) + 1, end + 1)


def warmup_cosine(base_lr: float, warmup: int, total: int, min_lr: float = 0.0, *,
                  count_from: int = 1) -> Callable[[int], float]:
    """Linear warmup over ``warmup`` steps to ``base_lr``, then cosine decay to ``min_lr`` at ``total``.

    Steps count from 1 (the first update uses ``schedule(1)``). With the default ``count_from=1``
    update ``t`` runs at the curve's step ``t``: update 1 at ``base_lr / warmup``, update
    ``warmup`` at ``base_lr`` and update ``total`` at ``min_lr``. torch's ``LambdaLR`` and so
    transformers' ``get_cosine_schedule_with_warmup(opt, warmup, total)`` (and
    ``get_cosine_with_min_lr_schedule_with_warmup``) read the same curve one step later: their
    update ``t`` runs at step ``t - 1``: the first at lr 0 (with a warmup), ``base_lr`` at update
    ``warmup + 1``. ``count_from=0`` counts as they do, update for update, so a ported run has
    their learning rates (and losses). Past ``total`` either stays at ``min_lr`` (transformers'
    cosine rises again there):

    >>> f = warmup_cosine(1.0, warmup=2, total=4)
    >>> [f(t) for t in range(1, 6)]
    [0.5, 1.0, 0.5, 0.0, 0.0]
    >>> g = warmup_cosine(1.0, warmup=2, total=4, count_from=0)   # as get_cosine_schedule_with_warmup
    >>> [g(t) for t in range(1, 6)]
    [0.0, 0.5, 1.0, 0.5, 0.0]

    The schedule's ``spec`` (a dict) is saved in checkpoints and rebuilt by :func:`schedule_from_spec`.
    """
    where = "tilegraph.optim.warmup_cosine"
    require_arg(where, "base_lr", base_lr, _NON_NEGATIVE)
    require_arg(where, "min_lr", min_lr, (number_check(high=base_lr)[0], f"a number >= 0 and <= base_lr ({base_lr:g})"))
    require_arg(where, "warmup", warmup, _STEPS)
    require_arg(where, "total", total, number_check(1, whole=True))
    if warmup > total:
        raise TileError(where, "warmup must be <= total", f"warmup={warmup}, total={total}")
    if isinstance(count_from, bool) or count_from not in (0, 1):
        raise TileError(where, "count_from must be 1 (update t at the curve's step t) or 0 (at step t - 1, as torch's "
                        "LambdaLR and transformers' get_cosine_schedule_with_warmup count)",
                        f"count_from={count_from!r}")
    shift = 1 - int(count_from)

    def lr(step: int) -> float:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TileError("tilegraph.optim.warmup_cosine", "the schedule is called with a step number (an int)",
                            f"step={step!r:.60}")
        step -= shift  # the curve's step of update ``step``
        if warmup and step <= warmup:
            return base_lr * step / warmup
        if step >= total:
            return min_lr
        frac = (step - warmup) / max(1, total - warmup)
        return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * frac))

    lr.spec = {"name": "warmup_cosine", "base_lr": float(base_lr), "warmup": int(warmup), "total": int(total),
               "min_lr": float(min_lr)}
    if shift:  # (only then: the specs of checkpoints saved before count_from read as they did)
        lr.spec["count_from"] = 0
    return lr


def constant(base_lr: float) -> Callable[[int], float]:
    require_arg("tilegraph.optim.constant", "base_lr", base_lr, _NON_NEGATIVE)

    def lr(step: int) -> float:
        return base_lr

    lr.spec = {"name": "constant", "base_lr": float(base_lr)}
    return lr


def schedule_from_spec(spec: dict) -> Callable[[int], float]:
    """The schedule a ``spec`` (as a checkpoint stores it) describes."""
    where = "tilegraph.optim.schedule_from_spec"
    if not isinstance(spec, dict) or spec.get("name") not in ("warmup_cosine", "constant"):
        raise TileError(where, "a schedule spec naming warmup_cosine or constant", repr(spec))
    args = {k: v for k, v in spec.items() if k != "name"}
    try:
        return (warmup_cosine if spec["name"] == "warmup_cosine" else constant)(**args)
    except TypeError as e:
        raise TileError(where, f"the arguments of {spec['name']}", f"{args} ({e})") from None


# --------------------------------------------------------------------------------- kernels ----
def _sumsq_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n = sum(int(np.prod(s)) for s in in_shapes)
    return Cost(2.0 * n, float(n * itemsize))


# No fastmath: the additions keep the order written here (8 float64 lanes, then the lanes in
# order), so equal tiles give bitwise equal sums wherever they lie in memory. Data-parallel
# replicas each compute the clipping norm from their own copy of the gradients and must agree
# to the last bit (BLAS's sdot, used before, rounds differently with the array's alignment).
@numba.njit(cache=True, nogil=True)
def _nb_sumsq(x):
    lanes = np.zeros(8, np.float64)
    n8 = x.size // 8 * 8
    for i in range(0, n8, 8):
        for j in range(8):
            v = np.float64(x[i + j])
            lanes[j] += v * v
    total = 0.0
    for j in range(8):
        total += lanes[j]
    for i in range(n8, x.size):
        v = np.float64(x[i])
        total += v * v
    return total


def _sumsq_cpu(*tiles):
    total = 0.0
    for t in tiles:
        if t.dtype.char == "e":  # Numba has no float16; float32 holds each float16 value exactly
            t = t.astype(np.float32)
        total += _nb_sumsq(np.ascontiguousarray(t).reshape(-1))
    return np.array([total], dtype=np.float64)


def _sumsq_gpu(*tiles):
    """The squared norm left on the device (the generic kernel's ``float`` would wait for the GPU
    after every tile)."""
    xp = xp_of(tiles[0])
    total = xp.zeros(1, dtype=np.float64)
    for t in tiles:
        t = t.astype(np.float64, copy=False).ravel()  # summed in float64, as on the CPU
        total += xp.vdot(t, t).real
    return total


@kernel("sumsq", cost=_sumsq_cost, cpu=_sumsq_cpu, gpu=_sumsq_gpu)
def _sumsq(*tiles):
    xp = xp_of(tiles[0])
    total = 0.0
    for t in tiles:
        if t.dtype.char == "e":  # a float16 sum of squares overflows past 65504
            t = t.astype(np.float32)
        total += float(xp.vdot(t.ravel(), t.ravel()).real)
    return np.array([total], dtype=np.float64)


def _clip_hyper_gpu(hyper, *partials, max_norm):
    """_clip_hyper on the device: no value goes to the host (there, ``float`` of a CuPy value
    waits for the GPU, and NumPy refuses to take one in)."""
    xp = next((xp_of(a) for a in (hyper, *partials) if xp_of(a) is not np), np)
    parts = xp.concatenate([xp.asarray(p, dtype=np.float64).reshape(-1)[:1] for p in partials])
    total = xp.sqrt(parts.sum())
    scale = xp.minimum(1.0, max_norm / (total + 1e-6))
    h = xp.asarray(hyper, dtype=np.float64).reshape(-1)
    return xp.concatenate([h[:HYPER["clip"]], xp.stack([scale, total]), h[HYPER["norm"] + 1:]])


@kernel("clip_hyper", cost=_sumsq_cost, gpu=_clip_hyper_gpu)
def _clip_hyper(hyper, *partials, max_norm):
    """A hyper tile (:data:`HYPER`) + squared-norm partials -> the same with its clip scale and
    total norm set. A NaN norm (a NaN gradient) gives a NaN scale, as torch's clip_grad_norm_
    (``clamp(max=1)`` keeps a NaN) and the GPU kernel's ``minimum``: every gradient is then NaN.
    Python's ``min(1.0, nan)`` is 1.0, which applied the other parameters' gradients unclipped."""
    total = math.sqrt(sum(float(p[0]) for p in partials))
    out = np.array(hyper, dtype=np.float64).reshape(-1)
    out[HYPER["clip"]], out[HYPER["norm"]] = np.minimum(1.0, max_norm / (total + 1e-6)), total
    return out


# Adam and AdamW, one kernel: they differ only in where the weight decay acts, ``l2`` (Adam's, added
# to the gradient before the moments) or ``decay`` (AdamW's, 1 - lr * weight_decay scaling the
# parameter); the other is 0 (1). An AdamW update's extra ``+ 0 * p`` changes no finite result.
# One pass, every operand streamed once: (param, grad, m, v) in, (param, m, v) out. The scalars come
# in the parameters' precision, derived once per tile (float32 math vectorises twice as wide as
# float64, and a float64 literal such as ``1.0 - b1`` would promote the whole loop to float64).
# error_model="numpy" drops the ZeroDivisionError check of the division, the branch that kept the
# loop scalar (3.4 -> ~1 ns/element in float32).
# No fastmath: with it the division and square root were approximated in the vector loop but not
# in the scalar one, and LLVM picks the loop at run time from how far apart the arrays lie in
# memory, so the same inputs gave results 1 ulp apart (22 of 300 small tiles). Data-parallel
# replicas must apply bitwise equal updates; IEEE arithmetic here is as fast (0.76 vs 0.75 ns
# per element on 4M elements).
@numba.njit(cache=True, nogil=True, error_model="numpy")
def _nb_adamw(p, g, m, v, po, mo, vo, decay, step, b1, one_b1, b2, one_b2, inv_sqrt_bc2, eps, clip, l2):
    for i in range(p.size):
        gi = g[i] * clip + l2 * p[i]
        mi = b1 * m[i] + one_b1 * gi
        vi = b2 * v[i] + one_b2 * (gi * gi)
        mo[i] = mi
        vo[i] = vi
        po[i] = p[i] * decay - step * mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)


#: where a hyper tile holds what: the learning rate, the step number, the clip scale and the
#: gradients' total norm (1 and 0 without clipping), then from ``"counts"`` on each parameter's own
#: update count, its ``t``, which falls behind the step number while the parameter gets no gradient
#: (torch's optimizers count each parameter's steps). An update reads its ``t`` at ``t_at`` (a
#: kernel parameter); a tile of [lr, step] or [lr, step, clip scale, norm] alone serves as well
#: (``t_at`` 1: the step number).
HYPER = {"lr": 0, "step": 1, "clip": 2, "norm": 3, "counts": 4}


def _hyper(hyper, lr_scale=1.0, t_at=1):
    """(lr, t, clip scale) of a hyper tile (:data:`HYPER`), ``t`` read at ``t_at``; the lr times
    ``lr_scale``, the parameter group's (see Optimizer)."""
    lr, t = float(hyper[0]) * lr_scale, float(hyper[t_at])
    clip = float(hyper[2]) if len(hyper) > 2 else 1.0
    return lr, t, clip


def _adamw_xp(p, g, m, v, hyper, *, beta1, beta2, eps, weight_decay, l2=0.0, lr_scale=1.0, t_at=1):
    if p.dtype.char == "e":
        return _in_float32(_adamw_xp, p, g, m, v, hyper, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, l2=l2, lr_scale=lr_scale, t_at=t_at)
    lr, t, clip = _hyper(hyper, lr_scale, t_at)
    if clip != 1.0:
        g = g * clip
    if l2:
        g = g + l2 * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
    denom = (v ** 0.5) / math.sqrt(bc2) + eps
    p = p * (1 - lr * weight_decay) - (lr / bc1) * m / denom
    return p.astype(m.dtype, copy=False), m, v


def _in_float32(update, p, g, m, v, hyper, **params):
    """``update`` of a float16 parameter tile computed in float32: the parameter stored back in
    float16, the moments (m, v) kept in float32 (:meth:`Adam.state_dtype`).

    Numba has no float16 (the CPU kernel failed with NotImplementedError), the fused GPU kernel
    takes float32/float64 only, and in float16 arithmetic eps=1e-8 is 0: an element whose gradient
    and moments are 0 would get 0/0 = NaN. Unlike torch, the moments are not stored in float16:
    there (1 - beta2) * g**2 underflows to 0 for gradients below about 2e-3 where m does not, and
    the next update is lr * m / eps (GPT-2 went to NaN in 4 steps)."""
    outs = update(*(a.astype(np.float32, copy=False) for a in (p, g, m, v)), hyper, **params)
    return (outs[0].astype(np.float16), *(o.astype(np.float32, copy=False) for o in outs[1:]))


def _adamw_cpu(p, g, m, v, hyper, *, beta1, beta2, eps, weight_decay, l2=0.0, lr_scale=1.0, t_at=1):
    if p.dtype.char == "e":
        return _in_float32(_adamw_cpu, p, g, m, v, hyper, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, l2=l2, lr_scale=lr_scale, t_at=t_at)
    lr, t, clip = _hyper(hyper, lr_scale, t_at)
    arrs = [np.ascontiguousarray(a) for a in (p, g, m, v)]  # no copy when already C-contiguous
    # new output arrays: the inputs may be held by Dask under other keys and are never written
    po, mo, vo = (np.empty_like(a) for a in arrs[:3])
    bc1, bc2 = 1 - beta1 ** t, 1 - beta2 ** t
    c = [p.dtype.type(x) for x in (1 - lr * weight_decay, lr / bc1, beta1, 1 - beta1, beta2, 1 - beta2,
                                   1 / math.sqrt(bc2), eps, clip, l2)]
    _nb_adamw(*(a.reshape(-1) for a in arrs), po.reshape(-1), mo.reshape(-1), vo.reshape(-1), *c)
    return po, mo, vo


# On a GPU the update is one fused kernel (tilegraph.ops._gpu) instead of a dozen array operations
# and three reads of ``hyper`` back to the host (each a wait for the GPU): ``hyper`` stays on the
# device and each element reads it. Arithmetic in double, rounded once to the parameters' dtype.
_adamw_fused = fused(
    "adamw", "T p, T g, T m, T v, raw float64 hyper, int32 n_hyper, float64 b1, float64 b2, float64 eps, float64 wd, "
    "float64 l2, float64 lr_scale, int32 t_at", "T po, T mo, T vo", """
    double lr = hyper[0] * lr_scale, t = hyper[t_at], clip = n_hyper > 2 ? hyper[2] : 1.0;
    double gi = (double)g * clip + l2 * (double)p;
    double mi = b1 * (double)m + (1.0 - b1) * gi;
    double vi = b2 * (double)v + (1.0 - b2) * gi * gi;
    double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    mo = (T)mi;
    vo = (T)vi;
    po = (T)((double)p * (1.0 - lr * wd) - (lr / bc1) * mi / (sqrt(vi) / sqrt(bc2) + eps));
    """, lambda p, g, m, v, hyper, n, b1, b2, eps, wd, l2, lr_scale, t_at: _adamw_xp(
        p, g, m, v, hyper, beta1=b1, beta2=b2, eps=eps, weight_decay=wd, l2=l2, lr_scale=lr_scale, t_at=int(t_at)))


def _adamw_gpu(p, g, m, v, hyper, *, beta1, beta2, eps, weight_decay, l2=0.0, lr_scale=1.0, t_at=1):
    if p.dtype.char == "e":  # the fused kernel takes float32/float64 only
        return _in_float32(_adamw_gpu, p, g, m, v, hyper, beta1=beta1, beta2=beta2, eps=eps,
                           weight_decay=weight_decay, l2=l2, lr_scale=lr_scale, t_at=t_at)
    hyper = xp_of(p).asarray(hyper, dtype=np.float64)  # on the parameters' device (no copy when there)
    return _adamw_fused(p, g, m, v, hyper, np.int32(hyper.size), float(beta1), float(beta2), float(eps),
                        float(weight_decay), float(l2), float(lr_scale), np.int32(t_at))


def _update_cost(n_state):
    def cost(in_shapes, out_shapes, itemsize, params) -> Cost:
        n = int(np.prod(in_shapes[0]))
        return Cost(12.0 * n, float((2 + 2 * n_state) * n * itemsize))

    return cost


_adamw_k = kernel("adamw", cost=_update_cost(2), cpu=_adamw_cpu, gpu=_adamw_gpu)(_adamw_xp)
#: Adam's tasks: the same code, named for what they do (weight decay as ``l2``)
_adam_k = kernel("adam", cost=_update_cost(2), cpu=_adamw_cpu, gpu=_adamw_gpu)(_adamw_xp)


@kernel("sgd", cost=_update_cost(0))
def _sgd(p, g, hyper, *, weight_decay, lr_scale=1.0):
    lr, _, clip = _hyper(hyper, lr_scale)
    d = g * clip if clip != 1.0 else g
    if weight_decay:
        d = d + weight_decay * p
    return (p - lr * d).astype(p.dtype, copy=False)


@kernel("sgd_momentum", cost=_update_cost(1))
def _sgd_momentum(p, g, buf, hyper, *, momentum, weight_decay, dampening=0.0, nesterov=False, lr_scale=1.0,
                  t_at=1):
    """torch.optim.SGD's momentum step: the first buffer is the gradient itself (undampened),
    then momentum * buf + (1 - dampening) * d; Nesterov's step is d + momentum * buf."""
    lr, t, clip = _hyper(hyper, lr_scale, t_at)
    d = g * clip if clip != 1.0 else g
    if weight_decay:
        d = d + weight_decay * p
    if t <= 1:
        buf = d.copy()
    else:
        buf = momentum * buf + ((1 - dampening) * d if dampening else d)
    step = d + momentum * buf if nesterov else buf
    return (p - lr * step).astype(p.dtype, copy=False), buf.astype(p.dtype, copy=False)


# ------------------------------------------------------------------------------ optimizers ----
class _Setting:
    """A setting of an optimizer's update (``opt.weight_decay``, ``opt.clip_grad_norm``, ...),
    a parameter of its recorded kernels: checked when set (by the optimizer's ``_checked``),
    and a TrainStep records its step again after a change (:meth:`Optimizer.recorded_settings`),
    as torch's next ``step()`` reads a changed ``param_groups`` entry. Set between steps, one
    went on with the value it was recorded with, silently (set before the first, it counted)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        try:
            return obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = obj._checked(self.name, value)


def _set_settings(opt, where: str, **values) -> None:
    """Set an optimizer's own settings as its constructor takes them, in the order given, each
    through the one check a later ``opt.NAME = value`` passes (``_checked``), its error named by
    the constructor (``where``). The constructors checked each setting once themselves and again
    as they set it: two checks of one rule, which had drifted apart (``nesterov=np.True_`` was
    refused by SGD's constructor, taken by ``opt.nesterov = np.True_``)."""
    for name, value in values.items():
        opt.__dict__[name] = opt._checked(name, value, where)


#: the optimizers' serial numbers, in the order they are made
_SERIALS = itertools.count(1)
#: per parameter (by id), the newest optimizer made over it: (a weak reference to the parameter,
#: that optimizer's serial, its kind); an entry goes with its parameter
_NEWEST: dict[int, tuple[weakref.ref, int, str]] = {}


def _mark_newest(p: Parameter, serial: int, kind: str) -> None:
    key = id(p)

    def forget(ref, key=key):
        entry = _NEWEST.get(key)
        if entry is not None and entry[0] is ref:  # (not a later parameter's, of the same id)
            del _NEWEST[key]

    _NEWEST[key] = (weakref.ref(p, forget), serial, kind)


class Optimizer:
    """Base class. ``schedule(step) -> lr`` gives the learning rate of update ``step`` (from 1).

    Parameters with ``requires_grad=False`` (frozen: a LoRA base, say) are left out, as torch's
    optimizers skip parameters without gradients: they get no gradient, no update and no state.
    Unlike torch's, the optimizer does not take one up once it is unfrozen (``frozen_params``
    lists them): a :class:`~tilegraph.TrainStep` refuses to run then, naming it. One of its
    parameters frozen later (``requires_grad`` set to False between steps) is skipped as torch
    skips it: no update, no weight decay, its state and update count kept, and it trains on from
    there once unfrozen. So for gradual unfreezing make the optimizer while every parameter
    trains, then freeze the ones to hold (or make a new optimizer over those that train).

    A parameter group may set its own ``lr``, as torch's: the schedule scales it as torch's
    schedulers (LambdaLR and the like) scale each group's initial lr, by the same factor for every
    group. Update ``t`` of a group with ``lr`` runs at ``lr * schedule(t) / base_lr``, where
    ``base_lr`` is the optimizer's ``lr``: the number, or the ``base_lr`` of
    :func:`warmup_cosine` or :func:`constant` (their peak). Updates count from 1 here, where
    torch's LambdaLR hands its ``lr_lambda`` the updates made before (update ``t`` runs at
    ``lr * lr_lambda(t - 1)``): a torch schedule ported as a callable is ``lambda t: lr *
    lr_lambda(t - 1)``, and ``warmup_cosine(..., count_from=0)`` is transformers'
    ``get_cosine_schedule_with_warmup``. A schedule of your own (a bare
    callable) has no known base rate, so groups with an ``lr`` are refused with one rather than
    scaled by a guess (schedule(1) is a warmup's smallest rate). Each group's multiple
    (``lr_scales``) is fixed when the optimizer is made: setting ``opt.schedule`` later (a lower
    rate after a divergence, any callable) scales every group alike:

    >>> import tilegraph as tg
    >>> layer = tg.nn.Linear(4, 2, seed=0)
    >>> opt = tg.optim.AdamW([{"params": [layer.weight], "lr": 1e-4}, {"params": [layer.bias]}],
    ...                      lr=tg.optim.warmup_cosine(1e-3, warmup=100, total=5000))
    >>> opt.lr_scales  # the weight at a tenth of the schedule's rate (1e-4 at its peak), the bias at it
    [0.1, 1.0]
    """

    n_state = 0
    #: the global gradient norm is clipped to it (None: no clipping); may change between steps
    clip_grad_norm = _Setting()

    #: the settings a parameter group may give its parameters (torch's param_groups) besides its
    #: ``lr``, which every optimizer takes, and how each is checked (_group_checks)
    group_keys: tuple = ()

    def __init__(self, params: Sequence[Parameter], lr: float | Callable[[int], float],
                 clip_grad_norm: float | None = None):
        where = f"tilegraph.optim.{type(self).__name__}"
        checks = {"lr": lambda where, v: require_arg(where, "lr", v, _NON_NEGATIVE), **self._group_checks()}
        params, options, self._groups = _param_groups(where, params, ("lr", *self.group_keys), checks)
        if not callable(lr):
            require_arg(where, "lr", lr, _NON_NEGATIVE)
        _set_settings(self, where, clip_grad_norm=clip_grad_norm)
        frozen = [p for p in params if not p.requires_grad]
        options = [o for p, o in zip(params, options) if p.requires_grad]
        #: the parameters given that were frozen then, left out (a TrainStep refuses to run once one
        #: of them trains: this optimizer has no state and no update for it)
        self.frozen_params = frozen
        params = [p for p in params if p.requires_grad]
        if not params:
            raise TileError(where, "at least one parameter that requires a gradient",
                            f"{len(frozen)} parameters, all frozen (requires_grad=False)")
        self.params = params
        #: this optimizer's place among those made in this process: a TrainStep whose optimizer is no
        #: longer the newest over its parameters says so (:meth:`newer_optimizers`)
        self.serial = next(_SERIALS)
        for p in params:
            _mark_newest(p, self.serial, type(self).__name__)
        #: per parameter, the settings its group gave it over the optimizer's own (param groups)
        self.param_options = options
        self.schedule = lr if callable(lr) else constant(float(lr))
        # whether the schedule is one given (lr= a schedule, or opt.schedule = ... since), not a number's
        # constant rate or a restored one: a saved schedule that replaces it says so (restore_schedule)
        self._schedule_given = callable(lr)
        self.lr_at(1)  # a schedule that gives no learning rate fails here, not at the first step
        #: the rate a group's ``lr`` is relative to: the optimizer's lr, or its schedule's base_lr
        #: (None: a schedule of your own)
        self.base_lr = _base_lr(self.schedule)
        _check_group_lrs(where, options, self.base_lr, lr)
        self.step_count = 0
        #: per parameter, the updates it got: the step count, less the steps whose loss did not
        #: depend on it (those leave it and its state as they were, as torch's, and its Adam bias
        #: corrections count its own updates, as torch's ``state["step"]``)
        self.param_steps = [0] * len(params)
        self.hyper = self.hyper_cell("hyper")
        #: state_cells[i][k] is the cell grid of state k (``state_names[k]``) of parameter i (zeros,
        #: the parameter's tiles); :attr:`state` reads it as torch's ``opt.state[p]``
        self.state_cells = [[_zeros_cells(p, self.state_dtype(p)) for _ in range(self.n_state)] for p in params]

    @property
    def state(self) -> "_ParamStates":
        """torch's ``opt.state``: ``opt.state[p]`` is parameter ``p``'s state, a read-only mapping
        with torch's keys (Adam and AdamW: ``step``, ``exp_avg``, ``exp_avg_sq``; SGD with momentum:
        ``momentum_buffer``; without: none, as torch's), each value a TileTensor over the state's
        tiles, as a Parameter is (``.numpy()`` fetches it from wherever it lives; one kept reads
        the state as it is when computed, as torch's tensors updated in place do), ``step`` an
        int (the updates ``p`` got; torch's is a 0-d float tensor). ``opt.state.items()`` gives
        ``(p, state)`` for each parameter. Unlike torch's, every parameter has its state (zeros,
        step 0) before the first step. The cells themselves are :attr:`state_cells`.

        >>> import numpy as np, tilegraph as tg
        >>> layer = tg.nn.Linear(4, 2, seed=0)
        >>> opt = tg.optim.AdamW(layer.parameters())
        >>> s = opt.state[layer.weight]
        >>> list(s), s["step"], float(np.abs(s["exp_avg"].numpy()).max())
        (['step', 'exp_avg', 'exp_avg_sq'], 0, 0.0)
        """
        return _ParamStates(self)

    def _checked(self, name: str, value, where: str | None = None):
        """``value`` checked (and as stored) for the setting ``name`` (see :class:`_Setting`);
        ``where``: what an error names (default: ``tilegraph.optim.KIND.NAME``, the attribute)."""
        where = where or f"tilegraph.optim.{type(self).__name__}.{name}"
        if name == "clip_grad_norm":
            if value is None:
                return None
            require_arg(where, name, value, number_check(strict=True))
            return float(value)
        raise AttributeError(name)

    def recorded_settings(self) -> tuple:
        """The settings the update kernels are recorded with: a TrainStep whose optimizer's
        settings changed since it recorded its step (``opt.weight_decay = 0.1`` between steps)
        records it again."""
        return (self.clip_grad_norm, *(getattr(self, k) for k in self.setting_keys))

    def newer_optimizers(self) -> list[tuple[Parameter, str]]:
        """This optimizer's parameters over which another optimizer was made since, each with
        that one's kind. A TrainStep (or Trainer) holds the optimizer it was made with: a notebook
        cell that makes the optimizer again (another learning rate, say) changes nothing of a step
        made before, where torch's loop would call the new one (TrainStep warns)."""
        newer = []
        for p in self.params:
            entry = _NEWEST.get(id(p))
            if entry is not None and entry[0]() is p and entry[1] > self.serial:
                newer.append((p, entry[2]))
        return newer

    def state_dtype(self, p: Parameter) -> np.dtype:
        """The dtype of ``p``'s state tensors: its own (Adam's, AdamW's: float32 for float16)."""
        return np.dtype(p.dtype)

    @property
    def schedule(self) -> Callable[[int], float]:
        """The learning-rate schedule, ``schedule(step) -> lr`` of update ``step`` (from 1); set it
        to change the learning rate between fits (``opt.schedule = tg.optim.constant(1e-4)``).
        Parameter groups with an ``lr`` keep their multiple of it (``lr_scales``)."""
        return self._schedule

    @schedule.setter
    def schedule(self, schedule: Callable[[int], float]) -> None:
        # a number (or anything not callable) failed at the next step as "'float' object is not callable"
        if not callable(schedule):
            hint = f" (for a constant one: tg.optim.constant({schedule!r}))" if _NON_NEGATIVE[0](schedule) else ""
            raise TileError(f"tilegraph.optim.{type(self).__name__}.schedule", "the schedule must be a callable "
                            f"schedule(step) -> learning rate, such as tg.optim.warmup_cosine(...){hint}",
                            f"schedule={schedule!r}"[:120])
        self._schedule = schedule
        self._schedule_given = True

    @property
    def lr(self) -> float:
        """The learning rate of the last update made (of the first before any); a parameter
        group with an ``lr`` of its own runs at this times its ``lr_scales`` entry."""
        return self.schedule(max(self.step_count, 1))

    @lr.setter
    def lr(self, value) -> None:
        # torch's param_groups[i]["lr"] = x; here the schedule gives every update's rate
        raise TileError(f"tilegraph.optim.{type(self).__name__}.lr", "the learning rate comes from the schedule: "
                        "set opt.schedule = tg.optim.constant(lr) (or another schedule) to change it",
                        f"opt.lr = {value!r}"[:120])

    @property
    def param_groups(self) -> list[Mapping]:
        """torch's ``opt.param_groups``, to read: per group as given (one for a plain list of
        parameters), a mapping of its ``params`` (frozen ones included), its ``lr`` now (the
        schedule's rate of the last update, as :attr:`lr`, times the group's multiple of it,
        :attr:`lr_scales`) and its other settings (the group's own, else the optimizer's).

        The groups are fixed when the optimizer is made: their settings are parameters of the
        recorded update kernels, and every update's rate comes from the schedule. So setting an
        entry (torch's ``g["lr"] = x``) raises a TileError naming the way instead of changing
        nothing: ``opt.schedule = tg.optim.constant(x)`` (each group keeps its multiple of it).

        >>> import tilegraph as tg
        >>> layer = tg.nn.Linear(4, 2, seed=0)
        >>> opt = tg.optim.SGD([{"params": [layer.weight], "lr": 0.01}, {"params": [layer.bias]}], lr=0.1)
        >>> [(len(g["params"]), g["lr"]) for g in opt.param_groups]
        [(1, 0.01), (1, 0.1)]
        """
        where = f"tilegraph.optim.{type(self).__name__}.param_groups"
        return [_GroupView(where, i, {"params": list(members), "lr": self.lr * self._lr_scale(options),
                                             **{k: self._setting(options, k) for k in self.group_keys}})
                for i, (members, options) in enumerate(self._groups)]

    @param_groups.setter
    def param_groups(self, value) -> None:
        raise TileError(f"tilegraph.optim.{type(self).__name__}.param_groups", _GROUPS_FIXED,
                        f"opt.param_groups = {value!r}"[:120])

    @property
    def lr_scales(self) -> list[float]:
        """Per parameter (as ``params``), its learning rate over the schedule's: its group's
        ``lr`` / ``base_lr``, 1.0 where the group sets none."""
        return [self._lr_scale(o) for o in self.param_options]

    def _lr_scale(self, options: dict) -> float:
        return float(options["lr"]) / self.base_lr if "lr" in options else 1.0

    def _lr_kw(self, options: dict) -> dict:
        """The update kernel's ``lr_scale`` of a parameter: only where its group sets an lr, so
        that other updates record the very tasks (and keys) they did before groups had one."""
        scale = self._lr_scale(options)
        return {"lr_scale": scale} if scale != 1.0 else {}

    def lr_scale_mismatches(self, param_options, base_lr) -> list[str]:
        """Where the learning rates of this optimizer's parameters relative to the schedule's
        (``lr_scales``) differ from those of a saved optimizer whose per-parameter options and
        ``base_lr`` are given (``param_options`` None: no groups): one line per parameter. A
        restored schedule would otherwise drive the groups at other rates than the saved run's.
        Equal to 12 digits matches (lr 0.2 of 1.0 as 0.02 of 0.1); a run resumes to the bit when
        its optimizer is made with the saved numbers themselves (the ratio rounds the same)."""
        saved = [{}] * len(self.params) if param_options is None else list(param_options)
        if len(saved) != len(self.params):
            return [f"saved settings for {len(saved)} parameters, this optimizer has {len(self.params)}"]
        problems = []
        for i, (p, mine, theirs) in enumerate(zip(self.params, self.param_options, saved)):
            lr = theirs.get("lr") if isinstance(theirs, Mapping) else None
            scale = float(lr) / base_lr if lr is not None and base_lr else 1.0
            if not math.isclose(scale, self._lr_scale(mine), rel_tol=1e-12):
                here = f"lr {mine['lr']!r} / base_lr {self.base_lr!r}" if "lr" in mine else "no group lr"
                there = f"lr {lr!r} / base_lr {base_lr!r}" if lr is not None else "no group lr"
                name = p.name or f"shape {tuple(p.shape)}"
                problems.append(f"parameter {i} ({name}): {self._lr_scale(mine):g} times the schedule's rate here "
                                f"({here}), {scale:g} saved ({there})")
        return problems

    def refuse_other_lr_scales(self, where: str, param_options, base_lr, error: type = TileError) -> None:
        """Raise ``error`` (a TileError class) naming the parameters whose groups run at another
        multiple of the schedule's rate than a saved optimizer's (:meth:`lr_scale_mismatches`)."""
        problems = self.lr_scale_mismatches(param_options, base_lr)
        if problems:
            raise error(where, "the parameter groups' learning rates relative to the schedule (group lr / "
                        "base_lr) as saved: make the optimizer with the saved groups' lr",
                        "; ".join(problems[:8]) + (f"; {len(problems) - 8} more" if len(problems) > 8 else ""))

    def lr_at(self, step: int) -> float:
        """The schedule's learning rate of update ``step``, checked: a schedule of the user's own
        (a lambda decaying linearly, run past its end) may give a negative or NaN rate, which the
        update would apply silently (a NaN loss one step later, named as the loss's fault).
        Updates count from 1: a step of 0, a negative one or a float is refused (it was blamed on
        the schedule, or failed inside it)."""
        require_int(f"tilegraph.optim.{type(self).__name__}.lr_at", "step", step, 1)
        try:
            lr = self.schedule(step)
        except Exception as e:  # lr=lambda: 1e-3 (no step), a schedule's own error: say what called it
            raise TileError(f"tilegraph.optim.{type(self).__name__}", "the learning-rate schedule (lr=) is called as "
                            "schedule(step) with the update's step (from 1) and returns its learning rate; it raised",
                            f"schedule({step}): {type(e).__name__}: {e}"[:300]) from e
        if not _NON_NEGATIVE[0](lr):
            raise TileError(f"tilegraph.optim.{type(self).__name__}", "the learning-rate schedule (lr=) must give a "
                            "finite number >= 0 at every step", f"lr({step}) = {lr!r}")
        return float(lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``opt.zero_grad()``: clear the ``grad`` that ``loss.backward()`` accumulated on
        this optimizer's parameters (None; with ``set_to_none=False`` zeros, where one was set).
        Cheap either way: the gradients are symbolic, nothing has been computed."""
        from tilegraph._autograd import no_grad
        from tilegraph.ops import zeros_like

        for p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                with no_grad():
                    p.grad = zeros_like(p)  # from the parameter's tiles, not the gradient's (no backward)

    def step(self, closure=None):
        """torch's ``opt.step()`` has no counterpart here: the update of every parameter tile is
        recorded with the forward and backward as one graph by :class:`tilegraph.TrainStep` (or
        :class:`tilegraph.Trainer`), which replays it per batch. Raises a TileError naming the
        replacement (a bare AttributeError before)."""
        name = type(self).__name__
        with_grad = sum(p.grad is not None for p in self.params)
        raise TileError(f"tilegraph.optim.{name}.step", f"{name} updates its parameters inside tg.TrainStep, which "
                        "runs the forward, backward and update of a batch as one graph: replace "
                        "loss.backward(); opt.step(); opt.zero_grad() by step = tg.TrainStep(model, opt, loss_fn) "
                        "made once and loss = step(x, y) per batch, where loss_fn(model, x, y) returns the loss "
                        "(or tg.Trainer for whole runs)",
                        f"opt.step(){' with a closure' if closure is not None else ''} ({with_grad} of "
                        f"{len(self.params)} parameters hold a .grad from loss.backward())")

    def add_param_group(self, param_group) -> None:
        """torch's ``opt.add_param_group({...})`` (gradual unfreezing, a head added later) has no
        counterpart: the groups are fixed when the optimizer is made (:attr:`param_groups`).
        Raises a TileError naming the ways (a bare AttributeError before): make the optimizer over
        every parameter while all train and freeze those to hold (they train on once unfrozen,
        their state kept), or make a new optimizer and TrainStep with the groups wanted."""
        name = type(self).__name__
        given = sorted(param_group) if isinstance(param_group, Mapping) else type(param_group).__name__
        raise TileError(f"tilegraph.optim.{name}.add_param_group", "the parameter groups are fixed when the "
                        "optimizer is made (they are parameters of the recorded update kernels): for gradual "
                        "unfreezing make the optimizer over every parameter while all train, then freeze the ones "
                        "to hold (requires_grad_(False); each trains on once unfrozen); otherwise make a new "
                        "optimizer and TrainStep with all the groups wanted", f"opt.add_param_group({given})"[:120])

    def hyper_cell(self, token: str) -> Cell:
        """A cell for one step's scalars (:data:`HYPER`)."""
        n = HYPER["counts"] + len(self.params)
        return Cell(np.zeros(n, np.float64), (n,), np.float64, token=token)

    def next_hyper(self, cell: Cell | None = None, updated: Sequence[int] | None = None) -> None:
        """Advance the step counter and publish this step's scalars to the hyper cell (or to
        ``cell``: the hyper cell of one step of several recorded in one graph). ``updated``: the
        indices of the parameters the step updates (default: all); the others' counts stay."""
        lr = self.lr_at(self.step_count + 1)  # checked before the step is counted
        self.step_count += 1
        for i in range(len(self.params)) if updated is None else updated:
            self.param_steps[i] += 1
        behind = sum(self.step_count - c for c in self.param_steps)  # (0 unless a step left a parameter out)
        (cell or self.hyper).set(np.array([lr, self.step_count, 1.0, 0.0, *self.param_steps], np.float64),
                                 token=f"hyper-{self.step_count}-{lr!r}" + (f"-{hash(tuple(self.param_steps)):x}"
                                                                            if behind else ""))

    def record(self, grads: Sequence[TileTensor], *, hyper: Cell | None = None,
               current: dict[int, TileRef] | None = None) -> tuple[list[tuple[Cell, TileRef]], TileRef | None]:
        """Record the update of every parameter tile from ``grads`` (None: a parameter the loss
        does not depend on, left as it is with its state, as torch skips one without a gradient).

        Returns ``(assignments, norm)``: each assignment pairs a parameter/state cell with the tile
        ref holding its next value; ``norm`` is the step's hyper tile with its clip scale and grad
        norm (:data:`HYPER`) when clipping is on. Parameters are read from their tensors' tiles;
        the state from its cells, or from ``current[id(cell)]`` when an update recorded earlier in
        the same graph produced it (several steps in one graph), as are the scalars from ``hyper``
        (default: the optimizer's own hyper cell).
        """
        if len(grads) != len(self.params):
            raise TileError("tilegraph.optim.record", f"expected {len(self.params)} gradients", str(len(grads)))
        with scope("optimizer:update"):
            return self._record(grads, hyper, current)

    def _record(self, grads, hyper, current):
        current = current or {}
        hyper = leaf(hyper or self.hyper)
        norm = None
        if self.clip_grad_norm is not None:
            from tilegraph.ops.reduce import FAN_IN

            tiles = [r for g in grads if g is not None for r in g.grid.flat]
            parts = [emit1(_sumsq, tiles[i:i + FAN_IN], (1,), np.float64, op="clip_norm")
                     for i in range(0, len(tiles), FAN_IN)]
            size = (HYPER["counts"] + len(self.params),)
            hyper = norm = emit1(_clip_hyper, [hyper, *parts], size, np.float64, op="clip_norm",
                                 max_norm=float(self.clip_grad_norm))
        assignments = []
        for i, (p, g, state, options) in enumerate(zip(self.params, grads, self.state_cells, self.param_options)):
            if g is None:
                continue
            if g.chunks != p.chunks:
                raise AssertionError(f"gradient tiles {g.chunks} differ from parameter tiles {p.chunks}")
            for idx in np.ndindex(*p.tiling.grid):
                outs = self._update(p.grid[idx], g.grid[idx], [current.get(id(s[idx])) or leaf(s[idx]) for s in state],
                                    hyper, options, HYPER["counts"] + i)
                assignments.append((p.cells[idx], outs[0]))
                assignments.extend((s[idx], o) for s, o in zip(state, outs[1:]))
        return assignments, norm

    def _update(self, p: TileRef, g: TileRef, state: list[TileRef], hyper: TileRef, options: dict,
                t_at: int) -> list[TileRef]:
        """The update of one parameter tile; ``options``: its group's settings (see group_keys);
        ``t_at``: where ``hyper`` holds its parameter's update count (:data:`HYPER`)."""
        raise NotImplementedError

    def _group_checks(self) -> dict:
        return {}

    def _setting(self, options: dict, key: str):
        """``key`` of a parameter: its group's, else the optimizer's."""
        return options.get(key, getattr(self, key))

    def state_dict(self) -> dict:
        """The optimizer's state as NumPy arrays, for :meth:`load_state_dict`: ``step`` (updates
        made), ``param_steps`` (per parameter, the updates it got: fewer than ``step`` where a
        step's loss did not depend on it), ``state`` (per parameter, its state arrays by name:
        computed/fetched from wherever they live), ``schedule`` (the learning-rate schedule's
        spec; None for a schedule of your own), ``param_options`` (per parameter, its group's
        settings), ``base_lr`` (the rate a group's lr is relative to) and ``settings`` (the
        optimizer's kind and its own settings: betas, eps, weight_decay; SGD's momentum,
        dampening, nesterov and weight_decay)."""
        from tilegraph._lower import compute

        tensors = self.state_tensors()
        flat = [t for per in tensors for t in per.values()]
        values = iter(compute(*flat) if flat else [])
        return {"step": self.step_count, "param_steps": list(self.param_steps),
                "state": [{name: next(values) for name in per} for per in tensors],
                "schedule": getattr(self.schedule, "spec", None),
                "param_options": [dict(o) for o in self.param_options], "base_lr": self.base_lr,
                "settings": self._settings()}

    #: the settings of the update that :meth:`state_dict` records and :meth:`load_state_dict`
    #: checks (those of torch's param_groups; the learning rate is the schedule's)
    setting_keys: tuple[str, ...] = ()

    def _settings(self) -> dict:
        return {"kind": type(self).__name__, **{k: getattr(self, k) for k in self.setting_keys}}

    def setting_mismatches(self, state: Mapping) -> list[str]:
        """Where this optimizer's update differs from that of the optimizer whose
        :meth:`state_dict` ``state`` is: its kind, or a setting (:meth:`setting_differences`),
        one line each; none for a state without ``settings`` (a state_dict of before)."""
        saved = state.get("settings")
        if not isinstance(saved, Mapping):
            return []
        problems = []
        if saved.get("kind") != type(self).__name__:
            problems.append(f"kind {type(self).__name__} here, {saved.get('kind')} saved")
        return problems + self.setting_differences(saved, state.get("param_options"))

    def setting_differences(self, saved: Mapping, options: Sequence | None = None,
                            names: Sequence[str] | None = None, show: Callable = repr) -> list[str]:
        """Where this optimizer's settings differ from a saved optimizer's, one line each: its own
        (``saved``, by key: ``weight_decay=0.01 here, 0.1 saved``) and those of its parameter
        groups (``options``: per parameter, in this optimizer's order, the settings its saved
        group gave it; None: no groups), a line per group and setting, naming the group as
        :attr:`param_groups` does, and its parameters (``names``, in this optimizer's order;
        default: their own names)::

            param_groups[1] (22 parameters: ln_1.weight, ln_1.bias, ...): weight_decay=0.05 here, 0.0 saved

        A setting every group sets, here and saved, is not the optimizer's own, and is not
        compared as one; a setting the saved optimizer did not record is not compared.
        ``show``: how a value is written."""
        n = len(self.params)
        if options is None or isinstance(options, (str, bytes)) or not isinstance(options, Sequence) \
                or len(options) != n:
            options = [{}] * n
        options = [o if isinstance(o, Mapping) else {} for o in options]
        if names is None or len(names) != n:
            names = [p.name or f"shape {tuple(p.shape)}" for p in self.params]
        index = {id(p): i for i, p in enumerate(self.params)}
        groups = [(j, [index[id(p)] for p in members if id(p) in index], given)
                  for j, (members, given) in enumerate(self._groups)]
        problems = []
        for k in self.setting_keys:
            mine, theirs = getattr(self, k), saved.get(k)
            own, lines = k not in self.group_keys, []
            for j, members, given in groups if k in self.group_keys else ():
                if not members:
                    continue
                if k not in given and all(k not in options[i] for i in members):
                    own = True  # the group follows the optimizer's own setting, here and saved
                    continue
                here = given.get(k, mine)
                differ: dict[str, list[int]] = {}  # the saved value -> the group's parameters with it
                for i in members:
                    if k in options[i] or k in saved:
                        value = options[i].get(k, theirs)
                        if not _same_setting(here, value):
                            differ.setdefault(show(value), []).append(i)
                label = f"param_groups[{j}] ({_some_names([names[i] for i in members])})"
                for value, which in differ.items():
                    listed = _some_names([names[i] for i in which], count=False)
                    part = "" if len(which) == len(members) else \
                        f" for {len(which)} of its {len(members)} parameters ({listed})"
                    lines.append(f"{label}: {k}={show(here)} here, {value} saved{part}")
            if own and k in saved and not _same_setting(mine, theirs):
                problems.append(f"{k}={show(mine)} here, {show(theirs)} saved")
            problems += lines
        return problems

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` gave: the step count, the state arrays and the schedule
        (where one was saved). Everything is checked first: a state that does not fit changes
        nothing. The settings are this optimizer's own, so they must be the saved ones (torch's
        load_state_dict restores them; here they are parameters of the recorded update): its kind,
        betas, eps, weight_decay, SGD's momentum, dampening and nesterov, each parameter's from
        its group (a state without ``settings``, of before, is not checked), and the groups'
        learning rates relative to the schedule: the restored schedule would drive the groups at
        other rates than the saved run's. A difference is a TileError naming each. The saved
        schedule replaces this optimizer's, with a warning naming both where it was made with
        another schedule (torch's scheduler is apart from its optimizer's state;
        :meth:`restore_schedule`): set ``opt.schedule`` after loading to go on with another."""
        where = f"tilegraph.optim.{type(self).__name__}.load_state_dict"
        if not isinstance(state, Mapping) or not {"step", "state"} <= set(state):
            raise TileError(where, "state must be a mapping with 'step' and 'state' (as optimizer.state_dict() "
                            "gives)", type(state).__name__ if not isinstance(state, Mapping) else f"keys {sorted(state)}")
        require_int(where, "state['step']", state["step"], 0)
        arrays = state["state"]
        if not isinstance(arrays, Sequence) or not all(isinstance(a, Mapping) for a in arrays):
            raise TileError(where, "state['state'] must be a list with one mapping (state name -> array) per "
                            "parameter", type(arrays).__name__)
        spec = state.get("schedule")
        schedule = schedule_from_spec(spec) if spec is not None else None
        problems = []
        if len(arrays) == len(self.params):  # (load_state names a count that differs)
            self.refuse_other_lr_scales(where, state.get("param_options"), state.get("base_lr"))
            problems = self.setting_mismatches(state)
        if problems:  # (torch's load_state_dict restores them; here they are the recorded update's)
            raise TileError(where, "the optimizer the state was saved from: its kind and settings (torch's "
                            "load_state_dict restores a group's betas, eps, weight_decay, momentum ...; here they "
                            "are the optimizer's own, given when it is made): make the "
                            "optimizer with the saved settings (state['settings'], state['param_options']; change "
                            "them after loading, opt.weight_decay = ..., to go on with others), or leave 'settings' "
                            "out of the state to keep this optimizer's own",
                            "; ".join(problems[:8]) + (f"; {len(problems) - 8} more" if len(problems) > 8 else ""))
        # checks every array and count before it sets one
        self.load_state(arrays, state["step"], where=where, param_steps=state.get("param_steps"))
        if schedule is not None:
            self.restore_schedule(schedule, where, stacklevel=2)

    def restore_schedule(self, schedule: Callable[[int], float], where: str, stacklevel: int = 1) -> None:
        """Set a saved ``schedule`` (one :func:`schedule_from_spec` rebuilt from a state_dict or a
        checkpoint) in place of this optimizer's, warning where it replaces another schedule given
        (``lr=`` a schedule, or ``opt.schedule = ...`` since). torch's ``load_state_dict`` leaves
        the scheduler alone, so a schedule made anew (a longer ``total`` to extend a run, another
        peak) goes on there; here the saved one replaced it without a word, and a run meant to go on
        for more steps ran them at ``min_lr``. An optimizer made with a number for ``lr`` takes the
        saved rates silently, as torch's ``load_state_dict`` restores each group's ``lr``.
        ``stacklevel``: the warning names the line that many calls above this one's caller."""
        mine, saved = getattr(self.schedule, "spec", None), getattr(schedule, "spec", None)
        if getattr(self, "_schedule_given", True) and not _same_spec(mine, saved):
            here = _describe_spec(mine) if isinstance(mine, Mapping) else "a schedule of your own (a callable)"
            warnings.warn(f"[{where}] the saved learning-rate schedule, {_describe_spec(saved)}, replaces this "
                          f"optimizer's, {here}: the run goes on with the saved one, as it was saved (the same step "
                          "budget). To go on with another, set opt.schedule = ... after loading (parameter groups "
                          "keep their multiple of it)", stacklevel=stacklevel + 1)
        self.schedule = schedule
        self._schedule_given = False  # (the saved one: a later restore of another replaces no schedule of the user's)

    #: names of the per-parameter state tensors, as torch.optim calls them
    state_names: tuple[str, ...] = ()
    #: whether torch's state of a parameter holds its update count, ``step`` (Adam's does, SGD's not)
    state_step: bool = False

    def state_tensors(self) -> list[dict[str, TileTensor]]:
        """Per parameter, its state tensors by name (TileTensors over the state cells; compute
        them to fetch the values from wherever they live)."""
        return [{name: tensor_from_cells(p.tiling, self.state_dtype(p), grid, name=f"{p.name}.{name}")
                 for name, grid in zip(self.state_names, state)} for p, state in zip(self.params, self.state_cells)]

    def load_state(self, arrays: Sequence[dict[str, np.ndarray]], step: int, *, where: str | None = None,
                   param_steps: Sequence[int] | None = None) -> None:
        """Restore per-parameter state (as from :meth:`state_tensors`) and the step counter, and
        each parameter's update count (``param_steps``; default: ``step`` each, the count of a
        parameter every step updated); every mismatch is reported at once and nothing is changed
        when there is one."""
        where = where or f"tilegraph.optim.{type(self).__name__}.load_state"
        param_steps = self.checked_param_steps(where, param_steps, step)
        problems = []
        if len(arrays) != len(self.params):
            problems.append(f"expected state for {len(self.params)} parameters, got {len(arrays)}")
        for i, (p, a) in enumerate(zip(self.params, arrays)):
            for name in self.state_names:
                if name not in a:
                    problems.append(f"parameter {i} ({p.name}): missing {name}")
                elif tuple(np.shape(a[name])) != p.shape:
                    problems.append(f"parameter {i} ({p.name}): {name} has shape {tuple(np.shape(a[name]))}, "
                                    f"expected {p.shape}")
        if problems:
            raise TileError(where, "optimizer state does not match the parameters", "; ".join(problems))
        for p, a, state in zip(self.params, arrays, self.state_cells):
            for name, grid in zip(self.state_names, state):
                assign_cells(grid, p.tiling, np.asarray(a[name], dtype=self.state_dtype(p)))
        self.step_count = int(step)
        self.param_steps = param_steps

    def checked_param_steps(self, where: str, param_steps: Sequence[int] | None, step: int) -> list[int]:
        """Each parameter's update count to restore: ``param_steps`` checked (one count per
        parameter, each from 0 to ``step``), or ``step`` for each."""
        if param_steps is None:
            return [int(step)] * len(self.params)
        if isinstance(param_steps, (str, bytes)) or not isinstance(param_steps, Sequence) \
                or len(param_steps) != len(self.params):
            raise TileError(where, f"param_steps to be a list of {len(self.params)} update counts, one per parameter",
                            repr(param_steps)[:200])
        for i, c in enumerate(param_steps):  # (a parameter's updates are some of the steps)
            require_int(where, f"param_steps[{i}]", c, 0, int(step))
        return [int(c) for c in param_steps]


_GROUPS_FIXED = ("the parameter groups and their settings are fixed when the optimizer is made (they are "
                 "parameters of the recorded update kernels; every update's rate comes from the schedule): to "
                 "change the learning rate set opt.schedule = tg.optim.constant(lr) or another schedule (each "
                 "group keeps its multiple of it, opt.lr_scales); for other settings make a new optimizer and "
                 "TrainStep with the groups you want, or set the optimizer's own (opt.weight_decay = ..., which "
                 "the groups that set none follow from the next step)")


class _GroupView(Mapping):
    """One entry of :attr:`Optimizer.param_groups`: read-only; setting a key raises a TileError
    naming the way (torch's param_groups are dicts whose changes take effect)."""

    def __init__(self, where: str, index: int, values: dict):
        self._where, self._name, self._values = f"{where}[{index}]", f"param_groups[{index}]", values

    def __getitem__(self, key):
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(self._values)

    def _refuse(self, what: str):
        raise TileError(self._where, _GROUPS_FIXED, what[:120])

    def __setitem__(self, key, value) -> None:
        self._refuse(f"{self._name}[{key!r}] = {value!r}")

    def __delitem__(self, key) -> None:
        self._refuse(f"del {self._name}[{key!r}]")

    def update(self, *args, **kwargs) -> None:
        given = [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]
        self._refuse(f"{self._name}.update({', '.join(given)})")

    def setdefault(self, key, default=None):
        self._refuse(f"{self._name}.setdefault({key!r}, {default!r})")

    def pop(self, key, *default):
        self._refuse(f"{self._name}.pop({key!r})")


class StateKeyError(TileError, KeyError):
    """A key that ``opt.state`` or ``opt.state[p]`` does not hold (a parameter of another
    optimizer, a state name the optimizer does not keep): a KeyError too, as a dict's, so that
    ``.get`` and ``in`` answer as they do for torch's ``opt.state``."""

    def __str__(self) -> str:  # (KeyError's would show the message quoted, as a repr)
        return BaseException.__str__(self)


def _param_name(p, i: int | None = None) -> str:
    """``params[i] (name, shape (4, 2))``: a parameter as an error names it. One that is not among
    the optimizer's (no ``i``): see :func:`_unknown_param`."""
    if i is None:
        return _unknown_param(p)
    said = ", ".join(x for x in (getattr(p, "name", None), f"shape {tuple(p.shape)}") if x)
    return f"params[{i}] ({said})"


def _unknown_param(p, then: str = "") -> str:
    """A parameter that is not among the optimizer's, as an error names it: its shape and its own
    name, said to be only that. An optimizer is given parameters, not the model, so it cannot
    tell their dotted names in it ("blocks.0.attn.q.weight"); "a parameter (weight, shape (8, 8))"
    read as if "weight" were that name, which matches every Linear of the model. ``then``: words
    said of it before the note."""
    own = getattr(p, "name", None)
    own = f"its own name {own!r}" if own else "no name of its own"
    return (f"a Parameter of shape {tuple(p.shape)}, {own}{then} (an optimizer is given parameters, not the "
            "model: its dotted name is model.named_parameters()'s)")


class _ParamStates(Mapping):
    """:attr:`Optimizer.state`: torch's ``opt.state``, keyed by parameter (``state[p]``, a
    :class:`_ParamState`; ``len``, iteration, ``items``, ``keys``, ``values``, ``get`` and
    ``p in state`` as a dict's), read-only. The state's cells are :attr:`Optimizer.state_cells`."""

    def __init__(self, opt: Optimizer):
        self._opt = opt
        self._where = f"tilegraph.optim.{type(opt).__name__}.state"

    def _index(self, p) -> int:
        """The index of parameter ``p`` in the optimizer; a StateKeyError naming it otherwise."""
        opt = self._opt
        for i, q in enumerate(opt.params):
            if q is p:
                return i
        if not isinstance(p, TileTensor):
            raise StateKeyError(self._where, "a key that is one of the optimizer's parameters (opt.state[p], p in "
                                f"opt.params: {len(opt.params)} of them), as torch's opt.state (the cell grids of "
                                "parameter i are opt.state_cells[i])", f"{type(p).__name__} {p!r:.60}")
        if any(q is p for q in opt.frozen_params):
            raise StateKeyError(self._where, "a parameter the optimizer trains: this one was frozen (requires_grad="
                                "False) when the optimizer was made, which left it out (no state, no update); make "
                                "the optimizer while it trains to keep its state", _param_name(p))
        raise StateKeyError(self._where, f"one of the optimizer's {len(opt.params)} parameters (opt.params), "
                            "the parameters it was made with", _unknown_param(p, ", which is not among them"))

    def __getitem__(self, key) -> "_ParamState":
        return _ParamState(self._opt, self._index(key))

    def __iter__(self):
        return iter(list(self._opt.params))

    def __len__(self) -> int:
        return len(self._opt.params)

    def __contains__(self, key) -> bool:
        return any(q is key for q in self._opt.params)

    def __setitem__(self, key, value) -> None:
        index = next((i for i, q in enumerate(self._opt.params) if q is key), None)
        said = _param_name(key, index) if isinstance(key, TileTensor) else repr(key)
        raise TileError(self._where, "opt.state is read-only here: the state lives in the update's cells; "
                        "restore it with opt.load_state_dict(saved) (a state_dict()) or a checkpoint",
                        f"opt.state[{said}] = {type(value).__name__}")

    def __repr__(self) -> str:
        return f"<{type(self._opt).__name__}.state of {len(self)} parameters>"


class _ParamState(Mapping):
    """``opt.state[p]``: parameter ``p``'s state with torch's keys, read each time from the
    optimizer (its state cells and update counts): see :attr:`Optimizer.state`."""

    def __init__(self, opt: Optimizer, index: int):
        self._opt, self._i = opt, index
        p = opt.params[index]
        self._where = f"tilegraph.optim.{type(opt).__name__}.state[{_param_name(p, index)}]"

    def _keys(self) -> tuple[str, ...]:
        return (("step",) if self._opt.state_step else ()) + tuple(self._opt.state_names)

    def __getitem__(self, key):
        opt, i = self._opt, self._i
        if isinstance(key, str) and key == "step" and opt.state_step:
            return int(opt.param_steps[i])
        if isinstance(key, str) and key in opt.state_names:
            p = opt.params[i]
            grid = opt.state_cells[i][opt.state_names.index(key)]
            return tensor_from_cells(p.tiling, opt.state_dtype(p), grid, name=f"{p.name}.{key}")
        kind = type(opt).__name__
        why = ""
        if key == "momentum_buffer" and isinstance(opt, SGD):
            why = " (SGD keeps a momentum_buffer only with momentum > 0, as torch's)"
        elif key == "max_exp_avg_sq":
            why = " (amsgrad, whose state it is, is not implemented)"
        raise StateKeyError(self._where, f"a key of {kind}'s state of a parameter: "
                            f"{', '.join(map(repr, self._keys())) or 'none (it keeps no state)'}{why}", repr(key))

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __setitem__(self, key, value) -> None:
        raise TileError(self._where, "opt.state[p] is read-only here: the state lives in the update's cells; "
                        "restore it with opt.load_state_dict(saved) (a state_dict()) or a checkpoint",
                        f"[{key!r}] = {type(value).__name__}")

    def __repr__(self) -> str:
        shown = {k: (self[k] if k == "step" else f"TileTensor(shape={self._opt.params[self._i].shape}, "
                     f"dtype={self._opt.state_dtype(self._opt.params[self._i])})") for k in self._keys()}
        return "{" + ", ".join(f"{k!r}: {v}" for k, v in shown.items()) + "}"


def _some_names(names: Sequence[str], count: bool = True, shown: int = 3) -> str:
    """``22 parameters: a, b, c, ...``: how many (with ``count``), and the first few by name."""
    listed = ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
    return f"{len(names)} parameter{'s' if len(names) != 1 else ''}: {listed}" if count else listed


def _same_setting(a, b) -> bool:
    """Whether two values of a setting are the same (betas as a tuple or a list, numbers as
    written or rounded through JSON)."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_setting(x, y) for x, y in zip(a, b))
    flags = (bool, np.bool_)
    if isinstance(a, flags) or isinstance(b, flags):  # (True is no 1.0 here)
        return isinstance(a, flags) and isinstance(b, flags) and bool(a) == bool(b)
    if isinstance(a, (int, float, np.number)) and isinstance(b, (int, float, np.number)):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return a == b


def _same_spec(a, b) -> bool:
    """Whether two schedule specs (:func:`warmup_cosine`'s, :func:`constant`'s) describe the same
    schedule (numbers as written or rounded through JSON)."""
    if not (isinstance(a, Mapping) and isinstance(b, Mapping)) or set(a) != set(b):
        return False
    return all(_same_setting(a[k], b[k]) for k in a)


def _describe_spec(spec) -> str:
    """A schedule spec as the call that makes it: ``warmup_cosine(base_lr=0.003, warmup=100, ...)``."""
    if not isinstance(spec, Mapping):
        return repr(spec)
    args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v!r}" for k, v in spec.items() if k != "name")
    return f"{spec.get('name', 'schedule')}({args})"


def _base_lr(schedule) -> float | None:
    """The base rate of ``schedule``: its spec's ``base_lr`` (:func:`warmup_cosine`'s peak,
    :func:`constant`'s rate), None for a schedule of your own."""
    spec = getattr(schedule, "spec", None)
    base = spec.get("base_lr") if isinstance(spec, dict) else None
    return float(base) if _NON_NEGATIVE[0](base) else None


def _check_group_lrs(where: str, options: list, base_lr: float | None, lr) -> None:
    """A TileError where a parameter group sets an lr that no base rate can scale: a schedule of
    your own (its factor at step t would be schedule(t) / an unknown base) or a base of 0."""
    if not any("lr" in o for o in options) or (base_lr is not None and base_lr > 0):
        return
    if base_lr is None:
        raise TileError(where, "a parameter group's lr is scaled by the schedule relative to its base rate, which a "
                        "schedule of your own does not give: pass lr as a number or as tg.optim.warmup_cosine(...) "
                        "or tg.optim.constant(...), or leave lr out of the groups",
                        f"lr={lr!r}"[:120] + " with groups that set lr")
    raise TileError(where, "a parameter group's lr is a multiple of the optimizer's lr (its schedule's base_lr), "
                    "which must then be > 0", f"base_lr={base_lr!r} with groups that set lr")


def _zeros_cells(p: Parameter, dtype=None) -> np.ndarray:
    dtype = np.dtype(p.dtype if dtype is None else dtype)
    cells = np.empty(p.tiling.grid, dtype=object)
    for idx in np.ndindex(*p.tiling.grid):
        shape = p.tiling.tile_shape(idx)
        cells[idx] = Cell(np.zeros(shape, dtype), shape, dtype, token=f"zeros-{shape}-{dtype}")
    return cells


def _check_betas(where: str, betas) -> None:
    if isinstance(betas, str) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise TileError(where, "betas must be two numbers (beta1, beta2), each >= 0 and < 1", f"betas={betas!r}")
    for i, beta in enumerate(betas):
        require_arg(where, f"betas[{i}]", beta, _BETA)


#: torch's arguments that tilegraph does not implement: (the value(s) accepted, what to say
#: when another is given). Each is accepted at torch's default, so a ported call that spells it
#: out works, and refused otherwise (it would change what the call means). torch's ``foreach``,
#: ``fused`` and ``capturable`` choose how torch computes the same update: any value is taken,
#: and changes nothing here (the update is one fused kernel per parameter tile, recorded once
#: with the step and replayed).
_UNSUPPORTED = {
    "amsgrad": ((False,), "amsgrad is not implemented ({name} here keeps torch's default, amsgrad=False)"),
    "maximize": ((False,), "maximize is not implemented: let the loss function return the negated objective and "
                 "minimise that"),
    "differentiable": ((False,), "differentiable=True (autograd through the update) is not implemented (leave "
                       "differentiable out, or False as torch's default)"),
    "decoupled_weight_decay": ((False,), "decoupled_weight_decay=True is not implemented on Adam: use "
                               "tg.optim.AdamW, which is Adam with decoupled weight decay (as torch's)"),
}


def _refuse_unsupported(where: str, name: str, **given) -> None:
    """A TileError for the first of torch's unimplemented arguments (``_UNSUPPORTED``) given at
    another value than torch's default; ``name``: the optimizer's class name."""
    for key, value in given.items():
        accepted, what = _UNSUPPORTED[key]
        if value is None:
            ok = None in accepted
        else:  # False, or an equal 0 (torch takes any falsy value)
            ok = False in accepted and isinstance(value, (bool, np.bool_, int, np.integer)) and not value
        if not ok:
            raise TileError(where, what.format(name=name), f"{key}={value!r}"[:120])


class Adam(Optimizer):
    """Adam as in ``torch.optim.Adam``: bias-corrected moments, and ``weight_decay`` as an L2
    penalty, ``weight_decay * param`` added to the gradient before the moments (so the moments
    carry it and Adam's scaling shrinks it). :class:`AdamW` decouples the decay from the moments,
    which is what most recipes mean by weight decay. One fused kernel per parameter tile:
    (param, grad, m, v) in, (param, m, v) out; the state is named as torch's (``exp_avg``,
    ``exp_avg_sq``).

    ``params`` may be torch's parameter groups, each setting its own ``lr`` (see
    :class:`Optimizer`), ``weight_decay``, ``betas`` or ``eps``::

        opt = tg.optim.Adam([{"params": body, "lr": 1e-4}, {"params": head, "weight_decay": 1e-4}], lr=1e-3)

    The signature is torch's: the same positional parameters in the same order (``params, lr,
    betas, eps, weight_decay, amsgrad``) with the same defaults, so a ported call means the same
    thing. torch's arguments that are not implemented (``amsgrad``, ``maximize``,
    ``differentiable``, ``decoupled_weight_decay``) are accepted at torch's default and refused
    with a TileError otherwise; ``foreach``, ``fused`` and ``capturable`` (how torch computes the
    same update) are taken and change nothing (for ``maximize``, return the negated
    objective from the loss function; for ``decoupled_weight_decay=True``, use :class:`AdamW`).
    tilegraph's own ``clip_grad_norm`` (the global gradient norm clipped to it) is keyword-only;
    ``lr`` may also be a schedule (:func:`warmup_cosine`, :func:`constant`, or a callable).
    """

    n_state = 2
    state_names = ("exp_avg", "exp_avg_sq")
    state_step = True
    group_keys = ("weight_decay", "betas", "eps")
    setting_keys = ("betas", "eps", "weight_decay")
    #: the optimizer's own settings (those of the parameters whose group sets none); each may
    #: change between steps (the next step records its update again)
    betas, eps, weight_decay = _Setting(), _Setting(), _Setting()
    _kernel = _adam_k

    # torch.optim.Adam's signature (torch 2.x), then tilegraph's own keyword-only clip_grad_norm
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad: bool = False, *,
                 foreach: bool | None = None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None, decoupled_weight_decay: bool = False,
                 clip_grad_norm: float | None = None):
        where = f"tilegraph.optim.{type(self).__name__}"
        _refuse_unsupported(where, type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                            differentiable=differentiable, decoupled_weight_decay=decoupled_weight_decay)
        self._init(where, params, lr, betas, eps, weight_decay, clip_grad_norm)

    def _init(self, where, params, lr, betas, eps, weight_decay, clip_grad_norm) -> None:
        _set_settings(self, where, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, lr, clip_grad_norm)

    def _group_checks(self) -> dict:
        return {"weight_decay": lambda where, v: require_arg(where, "weight_decay", v, _NON_NEGATIVE),
                "eps": lambda where, v: require_arg(where, "eps", v, _EPS), "betas": _check_betas}

    def _checked(self, name: str, value, where: str | None = None):
        if name not in self.setting_keys:
            return super()._checked(name, value, where)
        self._group_checks()[name](where or f"tilegraph.optim.{type(self).__name__}.{name}", value)
        return tuple(float(b) for b in value) if name == "betas" else float(value)

    def _update(self, p, g, state, hyper, options, t_at):
        m, v = state
        beta1, beta2 = self._setting(options, "betas")
        moments = (p.shape, self._moment_dtype(p.dtype))  # float32 for a float16 parameter
        return emit(self._kernel, [p, g, m, v, hyper], [(p.shape, p.dtype), moments, moments], op=self._kernel.name,
                    beta1=float(beta1), beta2=float(beta2), eps=float(self._setting(options, "eps")),
                    **self._decay_kw(float(self._setting(options, "weight_decay"))), **self._lr_kw(options), t_at=t_at)

    def state_dtype(self, p: Parameter) -> np.dtype:
        """The dtype of ``p``'s moments: its own, float32 for a float16 parameter (in float16,
        exp_avg_sq = (1 - beta2) * g**2 underflows to 0 where exp_avg does not: an update of lr * m /
        eps). Checkpoints store them so; a float16 state loaded is widened."""
        return self._moment_dtype(p.dtype)

    @staticmethod
    def _moment_dtype(dtype) -> np.dtype:
        return np.dtype(np.float32) if np.dtype(dtype) == np.float16 else np.dtype(dtype)

    @staticmethod
    def _decay_kw(weight_decay: float) -> dict:
        """The update kernel's weight decay: Adam's L2 term, added to the gradient."""
        return {"weight_decay": 0.0, "l2": weight_decay}


class AdamW(Adam):
    """AdamW as in ``torch.optim.AdamW`` (decoupled weight decay, bias correction), one fused
    kernel per parameter tile: (param, grad, m, v) in, (param, m, v) out. As torch's, a subclass
    of :class:`Adam` that differs in where the weight decay acts (and its default, 0.01); a
    checkpoint of one restores into that kind only.

    ``params`` may be torch's parameter groups, each setting its own ``lr`` (see
    :class:`Optimizer`), ``weight_decay``, ``betas`` or ``eps`` (GPT-2's recipe: no decay for
    biases and norms)::

        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        rest = [p for n, p in model.named_parameters() if p.ndim < 2]
        opt = tg.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])

    The signature is torch's: ``params, lr, betas, eps, weight_decay, amsgrad`` positional, in
    torch's order with torch's defaults. ``amsgrad``, ``maximize`` and ``differentiable`` are
    accepted at torch's default and refused with a TileError otherwise; ``foreach``, ``fused``
    and ``capturable`` are taken and change nothing; tilegraph's own ``clip_grad_norm`` is
    keyword-only.
    """

    _kernel = _adamw_k

    # torch.optim.AdamW's signature (torch 2.x), then tilegraph's own keyword-only clip_grad_norm
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, fused: bool | None = None, clip_grad_norm: float | None = None):
        where = f"tilegraph.optim.{type(self).__name__}"
        _refuse_unsupported(where, type(self).__name__, amsgrad=amsgrad, maximize=maximize,
                            differentiable=differentiable)
        self._init(where, params, lr, betas, eps, weight_decay, clip_grad_norm)

    @staticmethod
    def _decay_kw(weight_decay: float) -> dict:
        """Decoupled: the parameter scaled by 1 - lr * weight_decay (the kernel's l2 stays 0, and
        out of the task's parameters, so AdamW records the tasks it did before Adam shared it)."""
        return {"weight_decay": weight_decay}


class SGD(Optimizer):
    """SGD with optional momentum, dampening, Nesterov momentum and (coupled) weight decay, as
    ``torch.optim.SGD``; parameter groups may set their own ``lr`` (see :class:`Optimizer`) and
    ``weight_decay``.

    The signature is torch's: ``params, lr, momentum, dampening, weight_decay, nesterov``
    positional, in torch's order with torch's defaults (``lr=1e-3``), so ``SGD(p, 0.1, 0.9, 0.5)``
    sets dampening 0.5 here as there. As torch's, Nesterov momentum needs a ``momentum`` above 0
    and no ``dampening``::

        opt = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4, nesterov=True)

    torch's ``maximize`` and ``differentiable`` are accepted at torch's default and refused with a
    TileError otherwise; ``foreach`` and ``fused`` are taken and change nothing; tilegraph's own
    ``clip_grad_norm`` is keyword-only.
    """

    group_keys = ("weight_decay",)
    setting_keys = ("momentum", "dampening", "nesterov", "weight_decay")
    #: the optimizer's own settings; each may change between steps (the next step records its
    #: update again), momentum only between values above 0 (the buffer is kept where there is one)
    momentum, dampening, nesterov, weight_decay = _Setting(), _Setting(), _Setting(), _Setting()

    # torch.optim.SGD's signature (torch 2.x), then tilegraph's own keyword-only clip_grad_norm
    def __init__(self, params, lr=1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, fused: bool | None = None, clip_grad_norm: float | None = None):
        where = f"tilegraph.optim.{type(self).__name__}"
        _refuse_unsupported(where, type(self).__name__, maximize=maximize, differentiable=differentiable)
        # (a momentum that is no number fails its check below, before n_state is used)
        self.n_state = 1 if _MOMENTUM[0](momentum) and momentum else 0
        self.state_names = ("momentum_buffer",) if self.n_state else ()
        # nesterov last: its check reads the momentum and dampening set
        _set_settings(self, where, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                      nesterov=nesterov)
        super().__init__(params, lr, clip_grad_norm)

    def _group_checks(self) -> dict:
        return {"weight_decay": lambda where, v: require_arg(where, "weight_decay", v, _NON_NEGATIVE)}

    def _checked(self, name: str, value, where: str | None = None):
        where = where or f"tilegraph.optim.{type(self).__name__}.{name}"
        if name == "weight_decay":
            require_arg(where, name, value, _NON_NEGATIVE)
        elif name == "momentum":
            require_arg(where, name, value, _MOMENTUM)
            if (value > 0) != (self.n_state > 0):  # (SGD's state is a buffer with momentum, none without)
                what = ("momentum above 0: this SGD was made with momentum (its buffers are its state)" if self.n_state
                        else "momentum 0: this SGD was made without momentum (it has no buffers)")
                raise TileError(where, f"{what}; momentum may change between values above 0 only: for the other "
                                "kind make a new SGD (and TrainStep)", f"momentum={value!r}"[:120])
        elif name == "dampening":
            require_arg(where, name, value, _DAMPENING)
            if value and self.__dict__.get("nesterov"):
                raise TileError(where, "dampening=0 while nesterov=True (as torch.optim.SGD)", f"dampening={value!r}")
        elif name == "nesterov":
            if not isinstance(value, (bool, np.bool_)):
                raise TileError(where, "nesterov must be True or False", f"nesterov={value!r}"[:120])
            if value and (not self.n_state or self.__dict__.get("dampening")):
                raise TileError(where, "nesterov=True needs a momentum > 0 and dampening=0 (as torch.optim.SGD)",
                                f"nesterov=True with momentum={self.__dict__.get('momentum')!r}, "
                                f"dampening={self.__dict__.get('dampening')!r}")
            return bool(value)
        else:
            return super()._checked(name, value, where)
        return float(value)

    def _update(self, p, g, state, hyper, options, t_at):
        weight_decay = float(self._setting(options, "weight_decay"))
        if self.momentum:
            # dampening and nesterov only where set: plain momentum records the tasks (keys) it did before them
            extra = {**({"dampening": self.dampening} if self.dampening else {}),
                     **({"nesterov": True} if self.nesterov else {})}
            return emit(_sgd_momentum, [p, g, state[0], hyper], [(p.shape, p.dtype)] * 2, op="sgd",
                        momentum=self.momentum, weight_decay=weight_decay, **extra, **self._lr_kw(options), t_at=t_at)
        return [emit1(_sgd, [p, g, hyper], p.shape, p.dtype, op="sgd", weight_decay=weight_decay,
                      **self._lr_kw(options))]
