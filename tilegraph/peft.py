"""Parameter-efficient fine-tuning: LoRA adapters on a frozen model.

:func:`apply_lora` replaces the model's :class:`~tilegraph.nn.Linear` layers whose names match
``targets`` by :class:`LoRALinear` layers (``y = x W + b + (alpha / r) (x U) V``, W and b
frozen) and freezes every other parameter, so only the adapters get gradients and optimizer
state: build the optimizer from :func:`trainable_parameters`. Each layer's forward and backward
graphs are RunLoRA's cheapest for its shapes (:mod:`tilegraph.ops.lora`). :func:`merge_lora` folds
the adapters into the weights; :func:`save_adapters` / :func:`load_adapters` write and read only
the adapter tensors (a Zarr checkpoint). :func:`apply_lotr` adds LoTR adapters instead (left and
right factors shared by a group of same-shape layers, an r x r core per layer), and
:func:`from_quantized` opens a quantized checkpoint whose Linear weights stay quantized, each tile
dequantized inside the step graph where it is used (a QLoRA-style frozen base for either).

>>> import numpy as np, tilegraph as tg
>>> from tilegraph import models, peft
>>> model = peft.apply_lora(models.build("gpt2-debug", seed=0), targets=["attn.q", "attn.v"], rank=4, alpha=8)
>>> sorted(peft.lora_layers(model))
['blocks.0.attn.q', 'blocks.0.attn.v', 'blocks.1.attn.q', 'blocks.1.attn.v']
>>> sum(p.size for p in peft.trainable_parameters(model))  # 4 layers x (32 x 4 + 4 x 32)
1024
>>> opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-3)
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import numbers
from pathlib import Path
from collections.abc import Mapping
from typing import Callable, Iterator, Sequence

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cell, emit1, kernel, leaf
from tilegraph._tensor import TileTensor, Tiling
from tilegraph.nn import PARAMETER_CELLS, Linear, Module, ModuleList, Parameter, _default

__all__ = ["LoRALinear", "LoTRLinear", "apply_lora", "apply_lotr", "merge_lora", "lora_layers", "lotr_layers",
           "trainable_parameters", "save_adapters", "load_adapters", "QuantizedTensor", "QuantizedLinear",
           "from_quantized", "named_quantized", "apply_grad_sketch"]

#: Hugging Face module names accepted as targets, per architecture: tilegraph keeps GPT-2's fused
#: c_attn as separate q, k and v layers (each then gets its own rank-r adapter)
HF_TARGETS = {
    "gpt2": {"c_attn": ("attn.q", "attn.k", "attn.v"), "c_proj": ("attn.o", "mlp.fc2"), "c_fc": ("mlp.fc1",)},
    "llama": {"q_proj": ("attn.q",), "k_proj": ("attn.k",), "v_proj": ("attn.v",), "o_proj": ("attn.o",),
              "gate_proj": ("mlp.gate",), "up_proj": ("mlp.up",), "down_proj": ("mlp.down",)},
}


def _check_rank_alpha(where: str, rank, alpha, dropout) -> None:
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
        raise TileError(where, "rank must be an int >= 1", repr(rank))
    if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha)
            or alpha <= 0):
        raise TileError(where, "alpha must be a finite number > 0 (the update is scaled by alpha / rank)",
                        repr(alpha))
    from tilegraph.ops.dropout import check_dropout

    check_dropout(dropout, where)


def _check_model(where: str, model) -> None:
    """``model`` is a tilegraph Module (a torch model, a path or None would fail later with a bare
    TypeError from the module walk)."""
    if not isinstance(model, Module):
        raise TileError(where, "model must be a tilegraph.nn.Module (e.g. tilegraph.models.build(...))",
                        type(model).__name__)


def _rng(where: str, seed) -> np.random.Generator:
    """NumPy's generator of ``seed`` (an int >= 0, a Generator or None), refused in tilegraph's words."""
    if isinstance(seed, np.random.Generator):
        return seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0):
        raise TileError(where, "seed must be an int >= 0, a numpy Generator or None", repr(seed)[:200])
    return np.random.default_rng(seed)


def _check_choice_dropout(where: str, variant, choose, dropout: float):
    """:func:`_check_choice`, and a forced variant that dropout allows (f1 with b1, b2 or b3)."""
    from tilegraph.ops.lora import check_dropout_variant

    pair, choose = _check_choice(where, variant, choose)
    check_dropout_variant(pair, dropout, where)
    return pair, choose


def _check_choice(where: str, variant, choose):
    from tilegraph.ops.lora import CRITERIA, _resolve_variant_name

    if choose not in CRITERIA:
        raise TileError(where, f"choose must be one of {', '.join(CRITERIA)}", repr(choose))
    return _resolve_variant_name(variant, where), choose


class LoRALinear(Module):
    """A frozen :class:`~tilegraph.nn.Linear` plus a low-rank update:
    ``y = x @ weight + bias + (alpha / rank) * (dropout(x) @ lora_u) @ lora_v``.

    ``weight`` and ``bias`` are the base layer's parameters (same objects, so the model's parameter
    names do not change), frozen. ``lora_u`` (in, rank) starts uniform in +-1/sqrt(in) and
    ``lora_v`` (rank, out) at zero (peft's A and B, transposed), so the layer starts equal to its
    base; ``seed`` None draws from the :func:`tilegraph.nn.defaults` block's seed, else fresh
    (:meth:`reset_parameters` starts the adapter again). ``variant``/``choose``: see :func:`tilegraph.ops.lora.lora_linear` (default: the graphs
    with the fewest FLOPs for each call's shapes).

    ``dropout`` (peft's ``lora_dropout``): in a training step's graph (recorded under
    :func:`tilegraph.nn.training`, as ``TrainStep`` does) each element of the adapter's input is
    zeroed with this probability and the others scaled by 1 / (1 - dropout), a new mask every
    optimizer step and every micro-batch of an accumulated one (each row block of x seeds its mask
    from U, V and its own first tile, :func:`tilegraph.ops.dropout.row_seed_tensor`); the base
    product reads x as it is. Evaluation, generation and a plain forward have no dropout. The
    masks' base seed (``dropout_seed``) is a hash of the initial ``lora_u``, so the draws of
    ``seed`` are those of a layer without dropout. Checkpoints record it (:func:`adapter_settings`),
    and a layer rebuilt from one or loaded from one takes it back, so a resumed run draws the
    masks of the run it continues.

    >>> import numpy as np, tilegraph as tg
    >>> layer = tg.nn.LoRALinear(tg.nn.Linear(6, 5, seed=0), rank=2, alpha=4, seed=0)
    >>> layer.lora_u.shape, layer.lora_v.shape, layer.scale, layer.weight.requires_grad
    ((6, 2), (2, 5), 2.0, False)
    """

    def __init__(self, base: Linear, rank: int, alpha: float | None = None, *, dropout: float = 0.0,
                 variant=None, choose: str = "flops", seed=None):
        where = "tilegraph.nn.LoRALinear"
        if not isinstance(base, (Linear, QuantizedLinear)):
            raise TileError(where, "base must be a tilegraph.nn.Linear (or a peft.QuantizedLinear)",
                            type(base).__name__)
        alpha = rank if alpha is None else alpha
        _check_rank_alpha(where, rank, alpha, dropout)
        n, m = base.weight.shape
        if rank > min(n, m):
            raise TileError(where, f"rank must be at most min(in, out) = {min(n, m)} of the layer",
                            f"rank={rank} for a ({n}, {m}) weight")
        self.variant, self.choose = _check_choice_dropout(where, variant, choose, dropout)
        self.rank, self.alpha, self.dropout = int(rank), float(alpha), float(dropout)
        self.weight, self.bias = base.weight, base.bias
        self.base_sketch = _sketch_of(base)
        for p in (self.weight, self.bias):
            if isinstance(p, Parameter):  # a QuantizedTensor has no gradient at all
                p.requires_grad = False
        u, v = self._draw(where, seed)
        self.lora_u = Parameter(u, (self.weight.chunks[0], None), name="lora_u")
        self.lora_v = Parameter(v, (None, self.weight.chunks[1]), name="lora_v")
        # each layer's own masks, drawing nothing from rng (the adapters' initial values stay those
        # of a layer without dropout); every step's seed also hashes the current U and V
        self.dropout_seed = _hash_seed(u)

    def _draw(self, where: str, seed) -> tuple[np.ndarray, np.ndarray]:
        """Initial (U, V): U uniform in +-1/sqrt(in) (torch's kaiming_uniform_(a=sqrt(5)), as peft
        initialises A), V zeros; from ``seed``, else the :func:`tilegraph.nn.defaults` block's."""
        rng = _rng(where, _default("seed", seed))
        n, m = self.weight.shape
        bound = 1.0 / math.sqrt(n)
        u = rng.uniform(-bound, bound, (n, self.rank)).astype(self.weight.dtype)
        return u, np.zeros((self.rank, m), self.weight.dtype)

    def reset_parameters(self, *, seed=None) -> None:
        """Start the adapter again: U drawn anew as the constructor draws it, V zeros (so the layer
        equals its base), on the same tiles; the dropout masks' base seed follows the new U.
        ``seed``: an int >= 0, a numpy Generator, or None (the :func:`tilegraph.nn.defaults`
        block's, else fresh). The base weight and bias are not touched."""
        u, v = self._draw("tilegraph.nn.LoRALinear.reset_parameters", seed)
        self.lora_u.assign(u)
        self.lora_v.assign(v)
        self.dropout_seed = _hash_seed(u)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: TileTensor) -> TileTensor:
        dropout = self.dropout if self.training else 0.0
        return _adapted_linear(x, self.weight, self.lora_u, self.lora_v, self.bias, self.scale, self.variant,
                               self.choose, dropout, self.dropout_seed)

    def merged(self) -> Linear:
        """A plain Linear whose weight is ``weight + scale * lora_u @ lora_v`` (computed where the
        tiles are, fetched here), on the same tiles; the bias is the same Parameter."""
        return _merged_linear(self, self.lora_u, self.lora_v, self.scale)

    def __repr__(self) -> str:
        n, m = self.weight.shape
        drop = f", dropout={self.dropout:g}" if self.dropout else ""
        return f"LoRALinear({n}, {m}, rank={self.rank}, alpha={self.alpha:g}{drop}, bias={self.bias is not None})"


def _hash_seed(array: np.ndarray) -> int:
    """A 63-bit seed from an array's bytes."""
    import hashlib

    digest = hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class LoTRLinear(Module):
    """A frozen :class:`~tilegraph.nn.Linear` plus LoTR's update (arXiv:2402.01376):
    ``y = x @ weight + bias + (scale / rank) * ((x @ lotr_left) @ lotr_core) @ lotr_right``.

    ``lotr_left`` (in, rank) and ``lotr_right`` (rank, out) are the paper's R and L, *shared*: every
    layer of a group holds the same two Parameter objects (one storage, gradients summed over the
    group); ``lotr_core`` (rank, rank) is this layer's own M_l, zero at init so the layer starts
    equal to its base. Build groups with :func:`apply_lotr`.

    The update runs as a LoRA layer with ``U = lotr_left @ lotr_core`` (an n x r x r product per
    layer and step), so RunLoRA's graph choice applies: ``X (R M) L`` costs 2Nr(n + m) + 2nr^2
    against 2Nr(n + m + r) for ``((X R) M) L``, less whenever N > n, and the same gradients.

    >>> import numpy as np, tilegraph as tg
    >>> from tilegraph import peft
    >>> left, right = tg.nn.Parameter(np.ones((6, 2))), tg.nn.Parameter(np.ones((2, 5)))
    >>> layer = peft.LoTRLinear(tg.nn.Linear(6, 5, seed=0), left, right)
    >>> layer.lotr_core.shape, float(np.abs(layer.lotr_core.numpy()).max()), layer.weight.requires_grad
    ((2, 2), 0.0, False)
    """

    def __init__(self, base: Linear, left: Parameter, right: Parameter, scale: float = 1.0, *, variant=None,
                 choose: str = "flops"):
        where = "tilegraph.peft.LoTRLinear"
        if not isinstance(base, (Linear, QuantizedLinear)):
            raise TileError(where, "base must be a tilegraph.nn.Linear (or a peft.QuantizedLinear)",
                            type(base).__name__)
        _check_scale(where, scale)
        n, m = base.weight.shape
        rank = left.shape[1] if left.ndim == 2 else -1
        if left.shape != (n, rank) or right.shape != (rank, m):
            raise TileError(where, f"left (in, rank) and right (rank, out) factors for a ({n}, {m}) weight",
                            f"left {left.shape}, right {right.shape}")
        if left.chunks[0] != base.weight.chunks[0] or right.chunks[1] != base.weight.chunks[1]:
            raise TileError(where, "the shared factors' tiles to match the weight's: left's rows its rows, right's "
                            "columns its columns", f"weight {base.weight.chunks}, left {left.chunks}, "
                            f"right {right.chunks}")
        self.variant, self.choose = _check_choice(where, variant, choose)
        self.rank, self.scale = int(rank), float(scale)
        self.weight, self.bias = base.weight, base.bias
        self.base_sketch = _sketch_of(base)
        for p in (self.weight, self.bias):
            if isinstance(p, Parameter):
                p.requires_grad = False
        self.lotr_left, self.lotr_right = left, right
        self.lotr_core = Parameter(np.zeros((rank, rank), left.dtype), (None, None), name="lotr_core")

    def forward(self, x: TileTensor) -> TileTensor:
        from tilegraph import ops

        u = ops.matmul(self.lotr_left, self.lotr_core)  # (n, r): R M_l, on R's tiles
        return _adapted_linear(x, self.weight, u, self.lotr_right, self.bias, self.scale / self.rank,
                               self.variant, self.choose)

    def merged(self) -> Linear:
        """A plain Linear whose weight is ``weight + scale / rank * lotr_left @ lotr_core @ lotr_right``."""
        from tilegraph import ops

        return _merged_linear(self, ops.matmul(self.lotr_left, self.lotr_core), self.lotr_right,
                              self.scale / self.rank)

    def __repr__(self) -> str:
        n, m = self.weight.shape
        return f"LoTRLinear({n}, {m}, rank={self.rank}, scale={self.scale:g}, bias={self.bias is not None})"


def _check_scale(where: str, scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        raise TileError(where, "scale must be a finite number > 0 (the update is scaled by scale / rank)",
                        repr(scale))


def _adapted_linear(x, weight, u, v, bias, scale, variant, choose, dropout=0.0, seed=0):
    """The LoRA graph over a frozen weight: a Parameter, or a :class:`QuantizedTensor` whose tiles
    are dequantized where they are used (:class:`_QuantizedBaseLoRA`). ``dropout`` > 0 drops out
    the adapter's input (the caller passes it in training only), its masks seeded by ``seed``."""
    from tilegraph._config import config
    from tilegraph.ops.lora import lora_linear

    device = "gpu" if config.placement == "gpu" else "cpu"
    drop = {"dropout": dropout, "seed": seed} if dropout else {}  # none: the graph of a layer without dropout
    if isinstance(weight, QuantizedTensor):
        return _quantized_base_lora(x, weight, u, v, bias, scale=scale, variant=variant, choose=choose,
                                    device=device, **drop)
    return lora_linear(x, weight, u, v, bias, scale=scale, variant=variant, choose=choose, device=device, **drop)


def _sketch_of(base) -> tuple:
    """The weight-gradient sketch settings of an adapter's base layer (grad_sketch, sketch_ratio,
    sketch_seed), which :func:`merge_lora` gives the merged Linear back: a frozen weight has no
    gradient to sketch while the adapter trains, but the merged layer trains it again."""
    return (getattr(base, "grad_sketch", None), getattr(base, "sketch_ratio", Linear.sketch_ratio),
            getattr(base, "sketch_seed", Linear.sketch_seed))


def _merged_linear(layer, u, v, scale) -> Linear:
    """A plain Linear of ``layer.weight + scale * u @ v`` (computed where the tiles are, fetched
    here) on the weight's tiles, with the base layer's weight-gradient sketch; the bias is the
    same Parameter."""
    from tilegraph._lower import compute
    from tilegraph.ops.lora import merged_weight

    w = layer.weight
    dense = w.dequantized() if isinstance(w, QuantizedTensor) else w
    (value,) = compute(merged_weight(dense, u, v, scale))
    lin = Linear.__new__(Linear)  # no init draw: the weight is given
    lin.weight = Parameter(value, w.chunks, name="weight", requires_grad=getattr(w, "requires_grad", False))
    lin.bias = layer.bias
    lin.grad_sketch, lin.sketch_ratio, lin.sketch_seed = getattr(layer, "base_sketch", _sketch_of(None))
    return lin


# ---------------------------------------------------------------------------- module walk ----
def _require_model(where: str, model) -> None:
    """A tilegraph module, before its submodules are walked (an int failed in ``vars()``)."""
    if not isinstance(model, Module):
        raise TileError(where, "model must be a tilegraph.nn.Module", f"{type(model).__name__} {model!r:.60}")


def _named_modules(module: Module, prefix: str = "") -> Iterator[tuple[str, Module, Callable[[Module], None]]]:
    """(dotted name, module, setter that replaces it in its parent) for every submodule, named as
    ``named_parameters`` names them (``blocks.0.attn.q``)."""
    if isinstance(module, ModuleList):
        children = [(str(i), m, _item_setter(module.layers, i)) for i, m in enumerate(module.layers)]
    else:
        children = []
        for key, value in vars(module).items():
            if key != "_scope_name":
                children += _in_value(key, value, _attr_setter(module, key))
    for name, child, setter in children:
        full = f"{prefix}{name}"
        yield full, child, setter
        yield from _named_modules(child, f"{full}.")


def _in_value(name: str, value, setter) -> list:
    if isinstance(value, Module):
        return [(name, value, setter)]
    out = []
    if isinstance(value, list):
        for i, v in enumerate(value):
            out += _in_value(f"{name}.{i}", v, _item_setter(value, i))
    elif isinstance(value, dict):
        for k, v in value.items():
            out += _in_value(f"{name}.{k}", v, _item_setter(value, k))
    return out


def _attr_setter(obj, key):
    return lambda new: setattr(obj, key, new)


def _item_setter(container, key):
    def put(new):
        container[key] = new
    return put


def _replace(setter, old: Module, new: Module) -> None:
    # the kernels the new layer records keep the old one's scope name (task names on the dashboard)
    if getattr(old, "_scope_name", None) is not None:
        object.__setattr__(new, "_scope_name", old._scope_name)
    setter(new)


def _linear_names(model: Module) -> list[str]:
    return [name for name, m, _ in _named_modules(model) if isinstance(m, Linear)]


def _patterns(model: Module, targets, where: str) -> dict[str, list[str]]:
    """Each target -> the patterns it stands for (itself, or the tilegraph names of an HF name)."""
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, (list, tuple)) or not targets or not all(isinstance(t, str) for t in targets):
        raise TileError(where, "targets must be a non-empty list of module name patterns", repr(targets))
    aliases = HF_TARGETS.get(getattr(model, "arch", ""), {})
    return {t: list(aliases.get(t, (t,))) for t in targets}


def _matches(name: str, pattern: str) -> bool:
    """A pattern matches a module's dotted name or a dotted suffix of it (``attn.q`` matches
    ``blocks.0.attn.q``), with fnmatch's wildcards (``blocks.1.*``; ``mlp.*`` matches
    ``blocks.0.mlp.fc1`` as ``attn.q`` does, where it matched nothing)."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[i:]), pattern) for i in range(len(parts)))


# ------------------------------------------------------------------------------------- API ----
def apply_lora(model: Module, targets: Sequence[str] | str, rank: int, alpha: float | None = None,
               dropout: float = 0.0, *, variant=None, choose: str = "flops", seed=0) -> Module:
    """Replace, in place, every Linear of ``model`` whose name matches one of ``targets`` by a
    :class:`LoRALinear` of ``rank`` and ``alpha`` (default: ``rank``, a scale of 1), freeze every
    other parameter (but adapters the model already has, which stay as they are), and return
    ``model``.

    ``targets``: module names (``"attn.q"`` matches ``blocks.0.attn.q``, ``blocks.1.attn.q``,
    ...), fnmatch patterns, of the whole name or a dotted end of it (``"blocks.1.mlp.*"``;
    ``"mlp.*"``: every block's), or Hugging Face names of the architecture
    (:data:`HF_TARGETS`: GPT-2's ``c_attn``, ``c_proj``, ``c_fc``; Llama's ``q_proj`` ...
    ``down_proj``). A target matching no Linear is an error naming every Linear of the model.
    ``dropout``: the probability of zeroing an element of each adapter's input in training
    (inverted dropout, a new mask every step; none in evaluation or generation): see
    :class:`LoRALinear`.
    """
    where = "tilegraph.peft.apply_lora"
    _check_model(where, model)
    alpha = rank if alpha is None else alpha
    _check_rank_alpha(where, rank, alpha, dropout)
    _check_choice_dropout(where, variant, choose, dropout)  # every check before the model changes
    chosen = _chosen_linears(model, targets, where)
    _check_rank_fits(where, chosen, rank)
    rng = _rng(where, seed)
    _warn_kept_adapters(model, targets, where)
    return _put_lora(model, chosen, rank, alpha, dropout, variant, choose, rng)


def _put_lora(model: Module, chosen: dict, rank, alpha, dropout, variant, choose, rng) -> Module:
    """LoRA layers on the ``chosen`` Linear layers (name -> (layer, setter), all checked), the rest frozen."""
    _freeze_base(model)
    for name, (m, setter) in chosen.items():
        _replace(setter, m, LoRALinear(m, rank, alpha, dropout=dropout, variant=variant, choose=choose, seed=rng))
    return model


def _named_linears(model: Module, names, kind: str, where: str) -> dict[str, tuple[Module, Callable]]:
    """The Linear layers (plain or quantized) named exactly ``names`` (no pattern, no dotted end:
    a checkpoint's adapter on ``fc1`` is not one on ``mlp.fc1`` too), with their setters; a name
    that is no such layer is an error naming the model's Linear layers."""
    found = {name: (m, setter) for name, m, setter in _named_modules(model) if isinstance(m, (Linear, QuantizedLinear))}
    missing = [name for name in names if name not in found]
    if missing:
        raise TileError(where, f"the layers of the {kind} adapters to be Linear layers of the {type(model).__name__} "
                        f"without an adapter; its Linear layers: {', '.join(found) or 'none'}",
                        f"{', '.join(missing)}")
    return {name: found[name] for name in names}


def _freeze_base(model: Module) -> None:
    """Freeze every parameter of ``model`` but the adapters it already has: adapting more layers
    (a second :func:`apply_lora`, or :func:`load_adapters` adding one layer at a time) must not
    freeze the adapters added before, which would silently leave them out of
    :func:`trainable_parameters`. Those keep their ``requires_grad`` as it is."""
    adapters = {id(p) for p in _Adapters(model).named.values()}
    for p in model.parameters():
        if id(p) not in adapters:
            p.requires_grad = False


def _check_rank_fits(where: str, chosen: dict, rank: int) -> None:
    """A rank no larger than min(in, out) of every chosen layer (all the others named at once)."""
    too_small = [f"{name} ({m.weight.shape[0]}, {m.weight.shape[1]})" for name, (m, _) in chosen.items()
                 if rank > min(m.weight.shape)]
    if too_small:
        raise TileError(where, "rank must be at most min(in, out) of every targeted layer; too small: "
                        + ", ".join(too_small), f"rank={rank}")


def apply_lotr(model: Module, targets: Sequence[str] | str, rank: int, scale: float = 1.0, *, variant=None,
               choose: str = "flops", seed=0) -> Module:
    """Replace, in place, every Linear of ``model`` whose name matches one of ``targets`` (as in
    :func:`apply_lora`) by a :class:`LoTRLinear`, freeze every other parameter (but adapters the
    model already has), and return ``model``.

    The matched layers are grouped by weight shape: each group of L layers of shape (n, m) shares
    one left factor R (n, rank) and one right factor L (rank, m), both drawn from N(0, 1), and each
    layer has its own core M_l (rank, rank), zero, so the model starts equal to its base. A group
    has ``n r + r m + L r^2`` trainable values (``2 d r + L r^2`` for square d x d layers; LoRA's
    rank-r adapters on the same layers: ``L 2 d r``). The update is scaled by ``scale / rank``.

    >>> from tilegraph import models, peft
    >>> model = peft.apply_lotr(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v"], rank=4)
    >>> sum(p.size for p in peft.trainable_parameters(model))  # 2 x 32 x 4 + 4 cores x 4 x 4
    320
    """
    where = "tilegraph.peft.apply_lotr"
    _check_model(where, model)
    _check_lotr_args(where, rank, scale, variant, choose)  # every check before the model changes
    chosen = _chosen_linears(model, targets, where)
    groups = _lotr_groups_of(chosen, rank, where)
    rng = _rng(where, seed)
    _warn_kept_adapters(model, targets, where)
    return _put_lotr(model, chosen, groups, rank, scale, variant, choose, rng)


def _check_lotr_args(where: str, rank, scale, variant, choose) -> None:
    _check_rank_alpha(where, rank, 1.0, 0.0)
    _check_scale(where, scale)
    _check_choice(where, variant, choose)


def _lotr_groups_of(chosen: dict, rank: int, where: str) -> dict[tuple, list[str]]:
    """The ``chosen`` Linear layers (name -> (layer, setter)) grouped by weight shape, the rank and
    each group's tiles checked."""
    _check_rank_fits(where, chosen, rank)
    groups: dict[tuple, list[str]] = {}
    for name, (m, _) in chosen.items():
        groups.setdefault(tuple(m.weight.shape), []).append(name)
    for shape, names in groups.items():  # one R and L per group: every layer must tile them alike
        tilings = {tuple(map(tuple, chosen[n][0].weight.chunks)) for n in names}
        if len(tilings) > 1:
            raise TileError(where, f"the ({shape[0]}, {shape[1]}) layers of a group share R and L, so their weights "
                            "must have the same tiles", ", ".join(f"{n} {chosen[n][0].weight.chunks}" for n in names))
    return groups


def _put_lotr(model: Module, chosen: dict, groups: dict, rank, scale, variant, choose, rng) -> Module:
    """A LoTR group (shared R and L) on each of ``groups`` (:func:`_lotr_groups_of`), the rest frozen."""
    _freeze_base(model)
    for (n, m), names in groups.items():
        w = chosen[names[0]][0].weight
        left = Parameter(rng.standard_normal((n, rank)).astype(w.dtype), (w.chunks[0], None), name="lotr_left")
        right = Parameter(rng.standard_normal((rank, m)).astype(w.dtype), (None, w.chunks[1]), name="lotr_right")
        for name in names:
            layer, setter = chosen[name]
            _replace(setter, layer, LoTRLinear(layer, left, right, scale, variant=variant, choose=choose))
    return model


def _chosen_linears(model: Module, targets, where: str) -> dict[str, tuple[Module, Callable]]:
    """The Linear layers (plain or quantized) that ``targets`` match, by name, with their setters;
    a target matching none is an error naming every Linear of the model."""
    patterns = _patterns(model, targets, where)
    found = [(name, m, setter) for name, m, setter in _named_modules(model) if isinstance(m, (Linear, QuantizedLinear))]
    chosen, unmatched = {}, []
    for target, pats in patterns.items():
        hits = [(name, m, s) for name, m, s in found if any(_matches(name, p) for p in pats)]
        if not hits:
            unmatched.append(target)
        chosen.update((name, (m, s)) for name, m, s in hits)
    # a target naming layers that have an adapter already: said so, not as a name that matches nothing
    adapted = {name: type(m).__name__ for name, m, _ in _named_modules(model)
               if isinstance(m, (LoRALinear, LoTRLinear))}
    taken = {t: [f"{name} ({kind})" for name, kind in adapted.items() if any(_matches(name, p) for p in patterns[t])]
             for t in unmatched}
    if any(taken.values()):
        names = ", ".join(name for name, _, _ in found) or "none"
        said = [f"{t!r} matches only layers with an adapter already: {', '.join(hits)}" if hits
                else f"{t!r} matches nothing" for t, hits in taken.items()]
        raise TileError(where, f"targets that match Linear layers of the {type(model).__name__} without an adapter "
                        "(a layer takes one: tilegraph.peft.merge_lora folds the adapters into the weights first); "
                        f"its Linear layers: {names}", "; ".join(said))
    if unmatched:
        names = ", ".join(name for name, _, _ in found) or "none"
        said = other_modules_matched(model, patterns, unmatched)
        raise TileError(where, f"targets {unmatched} match no Linear layer of the {type(model).__name__}; its "
                        f"Linear layers: {names}", f"targets={list(patterns)}" + (f" ({said})" if said else ""))
    return chosen


def _warn_kept_adapters(model: Module, targets, where: str) -> None:
    """Warn where ``targets`` also match layers that have an adapter already (``"attn.*"`` after an
    adapter on ``attn.q``): those keep theirs, of their own rank, and get no second one."""
    import warnings

    patterns = [p for pats in _patterns(model, targets, where).values() for p in pats]
    kept = [f"{name} ({type(m).__name__}, rank {m.rank})" for name, m, _ in _named_modules(model)
            if isinstance(m, (LoRALinear, LoTRLinear)) and any(_matches(name, p) for p in patterns)]
    if kept:
        warnings.warn(f"[{where}] the targets also match {len(kept)} layers with an adapter already, which keep it as "
                      f"it is (no second adapter on a layer; merge_lora folds them in first): {', '.join(kept[:6])}"
                      f"{' ...' if len(kept) > 6 else ''}", UserWarning, stacklevel=3)


def other_modules_matched(model: Module, patterns: dict[str, list[str]], unmatched: list[str]) -> str:
    """What the ``unmatched`` targets (matching no Linear layer) match instead, by kind: an
    embedding or a norm (adapters and gradient sketches take Linear layers only), or a module
    holding Linear layers (``attn``: ``attn.*`` names those in it); "" where none matches anything."""
    modules = list(_named_modules(model))
    said = []
    for t in unmatched:
        hits = [(name, m) for name, m, _ in modules if any(_matches(name, p) for p in patterns[t])]
        if not hits:
            said.append(_hf_name_matched(model, t, patterns[t], {name: m for name, m, _ in modules}))
            continue
        kinds = ", ".join(f"{name} ({type(m).__name__})" for name, m in hits[:4]) + (" ..." if len(hits) > 4 else "")
        holds = any(isinstance(c, (Linear, QuantizedLinear)) for _, m in hits for _, c, _ in _named_modules(m))
        said.append(f"{t!r} matches {kinds}, " + (f"which hold Linear layers: {t + '.*'!r} names them" if holds
                                                   else "no Linear layer (only Linear layers are taken)"))
    return "; ".join(line for line in said if line)


def _hf_name_matched(model: Module, target: str, patterns: list[str], modules: dict[str, Module]) -> str:
    """What a target matching no tilegraph module stands for in the model's Hugging Face form: an
    output layer tied to the embedding (GPT-2's ``lm_head``, peft's usual target), or the HF name
    of an embedding or a norm (Llama's ``embed_tokens``); "" for none of these."""
    from tilegraph.io.hf import SPECS
    from tilegraph.nn import Embedding

    config = getattr(model, "config", None)
    if getattr(config, "tie_embeddings", False) and any(_matches("lm_head", p) for p in patterns):
        embedding = next((name for name, m in modules.items() if isinstance(m, Embedding)), "the embedding")
        return (f"{target!r} is the output layer, which this {type(model).__name__} ties to its embedding "
                f"{embedding} (tie_embeddings=True): the logits use {embedding}'s weight, not a Linear layer's "
                "(peft's LoRA on a tied lm_head has no tilegraph form)")
    arch = getattr(model, "arch", None)
    others = [other for other, names in HF_TARGETS.items() if other != arch and target in names]
    if others and arch in HF_TARGETS:  # another architecture's Hugging Face name (q_proj on GPT-2)
        return (f"{target!r} is a Hugging Face module name of {others[0]}, not of {arch}, whose Hugging Face "
                f"module names are {', '.join(HF_TARGETS[arch])}")
    spec = SPECS.get(arch)
    if spec is None or config is None:
        return ""
    shapes = {n: p.shape for n, p in model.named_parameters()}
    shapes.update({f"{name}.weight": m.weight.shape for name, m in modules.items() if hasattr(m, "weight")})
    held = [name.removesuffix(".weight") for hf, (_, names) in spec.names.expand(config.n_layers, shapes).items()
            if hf.endswith(".weight") and any(_matches(hf.removesuffix(".weight"), p) for p in patterns)
            for name in names]
    held = [name for name in dict.fromkeys(held) if name in modules]
    if not held:
        return ""
    kinds = ", ".join(f"{name} ({type(modules[name]).__name__})" for name in held[:4])
    kinds += " ..." if len(held) > 4 else ""
    if any(isinstance(modules[name], (Linear, QuantizedLinear)) for name in held):
        known = ", ".join(HF_TARGETS.get(model.arch, ()))
        return (f"{target!r} is the Hugging Face name of {kinds}: name them as tilegraph does"
                + (f", or by the Hugging Face module names {known}" if known else ""))
    return f"{target!r} is the Hugging Face name of {kinds}: no Linear layer (only Linear layers are taken)"


def lotr_layers(model: Module) -> dict[str, LoTRLinear]:
    """The model's LoTR layers by name."""
    _require_model("tilegraph.peft.lotr_layers", model)
    return {name: m for name, m, _ in _named_modules(model) if isinstance(m, LoTRLinear)}


def _lotr_groups(model: Module) -> list[list[str]]:
    """The model's LoTR layer names, one list per shared (R, L) pair, in model order."""
    groups: dict[int, list[str]] = {}
    for name, m in lotr_layers(model).items():
        groups.setdefault(id(m.lotr_left), []).append(name)
    return list(groups.values())


def lora_layers(model: Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by name."""
    _require_model("tilegraph.peft.lora_layers", model)
    return {name: m for name, m, _ in _named_modules(model) if isinstance(m, LoRALinear)}


def trainable_parameters(model: Module) -> list[Parameter]:
    """The parameters with ``requires_grad`` set: after :func:`apply_lora`, the adapters only.
    Build the optimizer from these (an optimizer given frozen parameters would ask for their
    gradients)."""
    _check_model("tilegraph.peft.trainable_parameters", model)
    return [p for p in model.parameters() if p.requires_grad]


def merge_lora(model: Module) -> Module:
    """Fold every adapter into its base weight (LoRA: ``W + alpha / r * U V``; LoTR:
    ``W + scale / r * R M_l L``) and put plain Linear layers back, in place; returns ``model``.
    Every parameter keeps its ``requires_grad``, and a layer its base's weight-gradient sketch
    (:func:`tilegraph.sketch.apply_grad_sketch`); a quantized base comes back dequantized."""
    _check_model("tilegraph.peft.merge_lora", model)
    for name, m, setter in list(_named_modules(model)):
        if isinstance(m, (LoRALinear, LoTRLinear)):
            _replace(setter, m, m.merged())
    return model


class _Adapters(Module):
    """The adapter parameters of a model under their names in it, as one module (what
    :func:`save_adapters` writes with the Zarr checkpoint writer). A LoTR group's shared R and L
    are named after its first layer, as ``model.named_parameters()`` names them."""

    def __init__(self, model: Module):
        self.named = {}
        for name, layer in lora_layers(model).items():
            self.named[f"{name}.lora_u"] = layer.lora_u
            self.named[f"{name}.lora_v"] = layer.lora_v
        for name, layer in lotr_layers(model).items():
            for attr in ("lotr_left", "lotr_core", "lotr_right"):
                self.named[f"{name}.{attr}"] = getattr(layer, attr)

    def _walk(self, prefix: str, seen: set):
        for name, p in self.named.items():
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{prefix}{name}", p


ADAPTER_FORMATS = ("zarr", "peft")


def _check_format(where: str, format) -> str:
    if format not in ADAPTER_FORMATS:
        raise TileError(where, f"format must be one of {', '.join(map(repr, ADAPTER_FORMATS))}", repr(format))
    return format


def save_adapters(path, model: Module, format: str = "zarr") -> None:
    """Write only the adapter tensors of ``model`` into the folder ``path``.

    ``format="zarr"``: a Zarr checkpoint (:func:`tilegraph.io.save_checkpoint`) with each LoRA
    layer's rank, alpha and dropout and each LoTR group's layers, rank and scale, and a
    fingerprint of each adapted layer's base weight (:func:`base_probes`: 16 numbers a layer),
    which :func:`load_adapters` checks.
    ``format="peft"``: Hugging Face peft's folder (``adapter_config.json`` +
    ``adapter_model.safetensors``, :func:`tilegraph.peft_hf.save_peft`), which
    ``peft.PeftModel.from_pretrained`` loads onto the model that ``model.to_hf`` writes (LoRA
    only)."""
    where = "tilegraph.peft.save_adapters"
    _check_model(where, model)
    if _check_format(where, format) == "peft":
        from tilegraph.peft_hf import save_peft

        return save_peft(path, model)
    from tilegraph.io.zarr import save_checkpoint

    layers, lotr = lora_layers(model), lotr_layers(model)
    if not layers and not lotr:
        raise TileError(where, "a model with LoRA layers (tilegraph.peft.apply_lora) or "
                        "LoTR layers (apply_lotr)", f"{type(model).__name__} has none")
    from tilegraph.io._store import CheckpointError

    metadata = {**adapter_settings(model), BASE_PROBE: base_probes(model)}
    try:
        save_checkpoint(path, _Adapters(model), metadata=metadata)
    except (TileError, CheckpointError) as e:
        if type(e) not in (TileError, CheckpointError):
            raise
        raise type(e)(where, e.what, e.received) from None  # named as the call the user made


#: the metadata key of the base weights' fingerprint that :func:`save_adapters` records
BASE_PROBE = "base_probe"
_PROBES = 4  # p_i^T W q_j for 4 x 4 fixed random vectors: 16 numbers a layer


def _adapted_bases(model: Module) -> dict:
    """Each adapted layer's frozen base weight (a Parameter or a :class:`QuantizedTensor`) by name."""
    return {name: m.weight for name, m in {**lora_layers(model), **lotr_layers(model)}.items()}


def base_probes(model: Module, names=None) -> dict:
    """A fingerprint of the base weight of each adapted layer of ``model`` (those in ``names``;
    None: all): ``P^T W Q`` for fixed random ``P`` (in, 4) and ``Q`` (out, 4), 16 numbers, as
    lists of floats by layer name. Computed where the weight's tiles are (a quantized one
    dequantized per tile), so only these numbers come back. :func:`save_adapters` records it and
    :func:`load_adapters` compares it with the base it loads onto: a base other than the one the
    adapters were trained on (another checkpoint, one with other adapters merged in, or the float
    weights of a quantized base) gives other numbers."""
    _require_model("tilegraph.peft.base_probes", model)
    from tilegraph import ops
    from tilegraph._lower import compute
    from tilegraph._tensor import from_numpy

    bases = _adapted_bases(model)
    names = sorted(bases) if names is None else [n for n in names if n in bases]
    outs = []
    for name in names:
        w = bases[name]
        dense = w.dequantized() if isinstance(w, QuantizedTensor) else w
        n, m = w.shape
        rng = np.random.default_rng([n, m])  # the same vectors for the same shape, whatever the model
        left = from_numpy(rng.standard_normal((_PROBES, n)).astype(w.dtype), ((_PROBES,), w.chunks[0]))
        right = from_numpy(rng.standard_normal((m, _PROBES)).astype(w.dtype), (w.chunks[1], (_PROBES,)))
        outs.append(ops.matmul(ops.matmul(left, dense), right))
    values = compute(*outs) if outs else []
    return {name: [float(x) for x in np.asarray(v, dtype=np.float64).ravel()] for name, v in zip(names, values)}


def _check_base(path, model: Module, stored, where: str, saved_itemsize: int | None = None) -> None:
    """Warn where the base weights of ``model``'s adapted layers are not those the adapters in
    ``path`` were saved on (their :func:`base_probes` recorded there differ). ``saved_itemsize``:
    the bytes of the floats the adapters were saved in; a half-precision side (a float16 run's
    adapters onto its float32 base) is compared to its rounding, not as another base."""
    import warnings

    if not isinstance(stored, dict) or not stored:
        return  # adapters saved before the fingerprint was recorded
    bases = _adapted_bases(model)
    now = base_probes(model, [n for n in stored if n in bases])
    differ = []
    for name, got in now.items():
        want = np.asarray(stored[name], dtype=np.float64)
        if want.shape != (len(got),):
            continue
        got = np.asarray(got)
        size = min(np.dtype(bases[name].dtype).itemsize, saved_itemsize or 8)
        tol = 1e-4 if size >= 4 else 1e-2  # sums in another order, other tiles; a half-precision side's rounding
        rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
        if rel > tol:
            differ.append((rel, name))
    if differ:
        differ.sort(key=lambda d: -d[0])  # the most different first
        shown = ", ".join(f"{name} ({rel:.2g})" for rel, name in differ[:4]) + (" ..." if len(differ) > 4 else "")
        warnings.warn(f"[{where}] the base weights of {len(differ)} of the {len(now)} adapted layers are not the "
                      f"ones the adapters in {path} were trained on (relative difference of their fingerprint: "
                      f"{shown}): they were saved on another base (another checkpoint; a base with other adapters "
                      "merged in, as a tilegraph train run started from an adapted checkpoint has; or a quantized "
                      "base, here loaded onto float weights, or the other way round), so the model is not the one "
                      "that was trained. Load them onto that base (a tilegraph train run's own: "
                      "tilegraph.io.load_checkpoint(run).model)", UserWarning, stacklevel=3)


def adapter_settings(model: Module) -> dict:
    """What rebuilds the adapters of ``model`` on its base (:func:`add_adapters`), as JSON:
    ``{"lora": {layer: {rank, alpha, dropout, shape, variant, choose, dropout_seed}}, "lotr":
    [{layers, rank, scale, shape, variant, choose}]}``, each kind only where the model has some
    ({} for none). :func:`save_adapters` and :func:`tilegraph.io.save_checkpoint` record it;
    ``dropout_seed`` (:attr:`LoRALinear.dropout_seed`) makes a resumed run draw the masks of the
    run it continues."""
    _require_model("tilegraph.peft.adapter_settings", model)
    layers, lotr = lora_layers(model), lotr_layers(model)
    out: dict = {}

    def graph(m) -> dict:
        return {"variant": list(m.variant) if isinstance(m.variant, tuple) else m.variant, "choose": m.choose}

    if layers:  # dropout_seed: the base of the masks, a hash of the *initial* U that no rebuilt layer can redo
        out["lora"] = {name: {"rank": m.rank, "alpha": m.alpha, "dropout": m.dropout,
                              "shape": list(m.weight.shape), **graph(m), "dropout_seed": int(m.dropout_seed)}
                       for name, m in layers.items()}
    if lotr:
        out["lotr"] = [{"layers": names, "rank": lotr[names[0]].rank, "scale": lotr[names[0]].scale,
                        "shape": list(lotr[names[0]].weight.shape), **graph(lotr[names[0]])}
                       for names in _lotr_groups(model)]
    return out


def _graph_choice(info: dict) -> dict:
    """The ``variant`` / ``choose`` an :func:`adapter_settings` entry records (none in adapters
    saved before they were recorded: the defaults)."""
    variant = info.get("variant")
    out = {"variant": tuple(variant) if isinstance(variant, list) else variant}
    if info.get("choose") is not None:
        out["choose"] = info["choose"]
    return out


def add_adapters(model: Module, settings: dict) -> Module:
    """Put the adapters that :func:`adapter_settings` describes on the very layers they name
    (LoRA where the model has no LoRA layers, LoTR where it has no LoTR layers), with fresh
    values (under :func:`tilegraph.nn.deferred_init`: none) for a checkpoint to fill; returns
    ``model``."""
    where = "tilegraph.peft.add_adapters"
    _require_model(where, model)
    if not isinstance(settings, Mapping):
        raise TileError(where, "settings must be a dict (as adapter_settings gives)",
                        f"{type(settings).__name__} {settings!r:.60}")
    stored, groups = settings.get("lora") or {}, settings.get("lotr") or []
    # each adapter on the very layer it names: as a target, "fc1" would also match a module's "mlp.fc1"
    if stored and not lora_layers(model):
        for name, info in stored.items():
            choice = {"variant": None, "choose": "flops", **_graph_choice(info)}
            dropout = info.get("dropout", 0.0)
            _check_rank_alpha(where, info["rank"], info["alpha"], dropout)
            _check_choice_dropout(where, choice["variant"], choice["choose"], dropout)
            chosen = _named_linears(model, [name], "LoRA", where)
            _check_rank_fits(where, chosen, info["rank"])
            _put_lora(model, chosen, info["rank"], info["alpha"], dropout, choice["variant"], choice["choose"],
                      _rng(where, 0))
        restore_dropout_seeds(model, stored)
    if groups and not lotr_layers(model):
        for g in groups:
            choice = {"variant": None, "choose": "flops", **_graph_choice(g)}
            _check_lotr_args(where, g["rank"], g["scale"], choice["variant"], choice["choose"])
            chosen = _named_linears(model, g["layers"], "LoTR", where)
            _put_lotr(model, chosen, _lotr_groups_of(chosen, g["rank"], where), g["rank"], g["scale"],
                      choice["variant"], choice["choose"], _rng(where, 0))
    return model


def restore_dropout_seeds(model: Module, stored: dict, loaded=None,
                          where: str = "tilegraph.peft.restore_dropout_seeds") -> None:
    """Give each LoRA layer of ``model`` the ``dropout_seed`` that ``stored`` (the ``"lora"`` part
    of :func:`adapter_settings`, as a checkpoint records it) holds for its name: the masks of a
    resumed run are then those of the run that saved it. ``loaded``: the names of the layers
    whose adapter values were read from that checkpoint (None: all); the others, and layers of
    settings written before the seeds were recorded, keep their own seed (that of their initial
    U, as before). A recorded seed that is not an int in [0, 2**63) is an error naming the layer,
    raised before any layer changes."""
    for layer, seed in recorded_dropout_seeds(model, stored, loaded, where):
        layer.dropout_seed = seed


def recorded_dropout_seeds(model: Module, stored: dict, loaded=None,
                           where: str = "tilegraph.peft.restore_dropout_seeds") -> list:
    """``(layer, seed)`` for what :func:`restore_dropout_seeds` sets, every seed checked; sets nothing."""
    layers = lora_layers(model)
    out, bad = [], []
    for name, info in (stored or {}).items() if isinstance(stored, dict) else ():
        seed = info.get("dropout_seed") if isinstance(info, dict) else None
        if seed is None or name not in layers or (loaded is not None and name not in loaded):
            continue
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2 ** 63:
            bad.append(f"{name}: {seed!r}"[:200])
        else:
            out.append((layers[name], int(seed)))
    if bad:
        raise TileError(where, "each LoRA layer's recorded dropout_seed to be an int in [0, 2**63)", "; ".join(bad))
    return out


def load_adapters(path, model: Module, format: str | None = None) -> Module:
    """Read adapters written by :func:`save_adapters` into ``model``: into its LoRA and LoTR layers,
    or, when it has none, into new ones on the layers named in the checkpoint (as
    :func:`apply_lora` and :func:`apply_lotr`). Every missing, unexpected and mis-shaped adapter is
    reported at once. Returns ``model``. A warning names the adapted layers whose base weights are
    not those the adapters were saved on (:func:`base_probes`): another checkpoint of the same
    shapes, a base with other adapters merged in (a ``tilegraph train`` run started from an
    adapted checkpoint), or a quantized base's float weights.

    ``format``: ``"zarr"`` or ``"peft"`` (a folder of Hugging Face peft, written by peft's
    ``save_pretrained`` or by ``save_adapters(..., format="peft")``:
    :func:`tilegraph.peft_hf.load_peft`); by default, ``"peft"`` where the folder holds an
    ``adapter_config.json``."""
    from tilegraph.io.zarr import load_checkpoint

    where = "tilegraph.peft.load_adapters"
    _check_model(where, model)
    if format is None:
        from tilegraph.peft_hf import named_adapter_folders

        # peft's save_pretrained puts an adapter not named "default" in a subfolder: load_peft names them
        peft_folder = (Path(path) / "adapter_config.json").is_file() or (
            not (Path(path) / "zarr.json").is_file() and bool(named_adapter_folders(path)))
        format = "peft" if peft_folder else "zarr"
    if _check_format(where, format) == "peft":
        from tilegraph.peft_hf import load_peft

        return load_peft(path, model)
    from tilegraph.io._store import CheckpointError

    try:
        ck = load_checkpoint(path)
    except CheckpointError as e:
        if type(e) is not CheckpointError:
            raise
        raise CheckpointError(where, e.what, f"{e.received} (a folder of save_adapters, format 'zarr'; a Hugging Face "
                              "peft folder holds adapter_config.json)") from None
    stored = (ck.metadata or {}).get("lora") or {}
    groups = (ck.metadata or {}).get("lotr") or []
    if not isinstance(stored, dict) or not isinstance(groups, list) or not (stored or groups):
        inside = Path(path) / "adapters"  # a checkpoint of tilegraph train: its last one holds them there
        held = _stored_adapters(ck)  # a checkpoint of the whole model, adapters included (Trainer, save_checkpoint)
        if (inside / "zarr.json").is_file():
            said = f"{path} holds no LoRA or LoTR metadata (the adapters of this checkpoint are in {inside})"
        elif held:
            said = (f"{path} is a checkpoint of a whole model with adapters on {len(held)} layers "
                    f"({', '.join(held[:4])}{' ...' if len(held) > 4 else ''}), not of the adapters alone: "
                    "tilegraph.io.load_checkpoint(path).model (or tilegraph.models.from_zarr(path)) builds that model "
                    "with its adapters, and Trainer.load_checkpoint(path) restores them and the optimizer's state "
                    "into a model with the same adapters")
        else:
            said = f"{path} holds no LoRA or LoTR metadata"
        raise TileError(where, "a folder written by tilegraph.peft.save_adapters", said)
    convert = _conversion_problems(model, stored, groups)
    if convert:
        raise TileError(where, f"the layers that the adapters in {path} were saved for, in the model",
                        "; ".join(convert))
    with _unchanged_on_failure(model):  # a failure below leaves the model as it was given
        _load_adapters(path, ck, model, stored, groups, where)
    saved = [np.dtype(info["dtype"]).itemsize for info in ck.arrays.values()
             if isinstance(info, dict) and isinstance(info.get("dtype"), str) and info["dtype"].startswith("float")]
    _check_base(path, model, (ck.metadata or {}).get(BASE_PROBE), where, min(saved, default=None))
    return model


def _load_adapters(path, ck, model: Module, stored: dict, groups: list, where: str) -> None:
    add_adapters(model, {"lora": stored, "lotr": groups})
    problems = []
    layers = lora_layers(model)
    for name, info in stored.items():
        m = layers.get(name)
        if m is None:
            problems.append(f"no LoRA layer {name} in the model")
        elif (list(m.weight.shape) != list(info["shape"])) or m.rank != info["rank"]:
            problems.append(f"{name}: model ({m.weight.shape[0]}, {m.weight.shape[1]}) rank {m.rank}, "
                            f"adapters for ({info['shape'][0]}, {info['shape'][1]}) rank {info['rank']}")
    problems += [f"LoRA layer {name} has no stored adapter" for name in layers if name not in stored]
    problems += _lotr_problems(model, groups)
    if problems:
        kinds = " and ".join(k for k, present in (("LoRA", stored or layers), ("LoTR", groups or lotr_layers(model)))
                             if present)
        raise TileError(where, f"the adapters in {path} to match the model's {kinds} layers", "; ".join(problems))
    seeds = recorded_dropout_seeds(model, stored, where=where)  # checked before any value changes
    ck.load_into(_Adapters(model))
    for layer, seed in seeds:
        layer.dropout_seed = seed
    for name, info in stored.items():
        layers[name].alpha = float(info["alpha"])
    lotr = lotr_layers(model)
    for g in groups:
        for name in g["layers"]:
            lotr[name].scale = float(g["scale"])


def _conversion_problems(model: Module, stored: dict, groups: list) -> list[str]:
    """Where ``model`` has no adapters of a kind that the checkpoint holds, what keeps them from
    being added to the very layers they were saved for (a missing layer, another shape)."""
    linears = {name: m for name, m, _ in _named_modules(model) if isinstance(m, (Linear, QuantizedLinear))}
    # a layer holding the other kind of adapter is there, not missing: said so
    adapted = {name: m for name, m, _ in _named_modules(model) if isinstance(m, (LoRALinear, LoTRLinear))}
    wanted = []
    if stored and not lora_layers(model):
        wanted += [("LoRA", name, info["shape"]) for name, info in stored.items()]
    if groups and not lotr_layers(model):
        wanted += [("LoTR", name, g["shape"]) for g in groups for name in g["layers"]]
    problems = []
    for kind, name, shape in wanted:
        m = linears.get(name)
        if m is None and name in adapted:
            problems.append(f"{name} has a {'LoTR' if isinstance(adapted[name], LoTRLinear) else 'LoRA'} adapter "
                            f"({type(adapted[name]).__name__}), the checkpoint a {kind} adapter for it (one adapter "
                            "a layer: load them into a model without the other kind there, or merge_lora first)")
        elif m is None:
            problems.append(f"no Linear layer {name} (of its {kind} adapter) in the {type(model).__name__}")
        elif list(m.weight.shape) != list(shape):
            problems.append(f"{name}: model ({m.weight.shape[0]}, {m.weight.shape[1]}), {kind} adapter for "
                            f"({shape[0]}, {shape[1]})")
    return problems


@contextlib.contextmanager
def _unchanged_on_failure(model: Module):
    """Put back every submodule of ``model`` and every parameter's ``requires_grad`` if the block
    raises (a failed load then leaves no adapter and no frozen weight behind)."""
    modules = [(setter, m) for _, m, setter in _named_modules(model)]
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        yield
    except BaseException:
        for setter, m in modules:
            setter(m)
        for p, flag in flags:
            p.requires_grad = flag
        raise


def _lotr_problems(model: Module, groups: list) -> list[str]:
    """How the model's LoTR groups differ from the stored ones (layers, shapes, ranks)."""
    problems = []
    have = {tuple(names) for names in _lotr_groups(model)}
    lotr = lotr_layers(model)
    for g in groups:
        names = tuple(g["layers"])
        missing = [n for n in names if n not in lotr]
        if missing:
            problems.append(f"no LoTR layer {', '.join(missing)} in the model")
            continue
        m = lotr[names[0]]
        if list(m.weight.shape) != list(g["shape"]) or m.rank != g["rank"]:
            problems.append(f"{names[0]}: model ({m.weight.shape[0]}, {m.weight.shape[1]}) rank {m.rank}, adapters "
                            f"for ({g['shape'][0]}, {g['shape'][1]}) rank {g['rank']}")
        elif names not in have:
            problems.append(f"LoTR group {', '.join(names)} shares its factors differently in the model")
    stored = {n for g in groups for n in g["layers"]}
    problems += [f"LoTR layer {name} has no stored adapter" for name in lotr if name not in stored]
    return problems


# ------------------------------------------------------------------------- quantized base ----
# QLoRA-style fine-tuning: the frozen weights stay quantized (each tile's parts are leaf cells)
# and a kernel dequantizes one tile inside the step graph, right where a matmul reads it. The
# backward dequantizes again instead of keeping the forward's tile, so a dequantized tile lives
# only between its dequantize kernel and the products that read it (one task when the planner
# fuses them): the full float weights are never all resident, on the workers or here.

@kernel("dequantize_tile")
def _dequantize_tile(*parts, names, attrs, dtype):
    from tilegraph._graph import xp_of
    from tilegraph.io.quantize import QuantizedArray

    xp = xp_of(parts[0]) if parts else np
    host = [p if xp is np else xp.asnumpy(p) for p in parts]  # the decoders are NumPy code
    out = QuantizedArray.from_parts(dict(zip(names, host)), json.loads(attrs)).dequantize()
    out = out.astype(dtype, copy=False)
    return out if xp is np else xp.asarray(out)


class QuantizedTensor:
    """A frozen weight whose tiles are held quantized: per tile, the parts of a
    :class:`tilegraph.io.quantize.QuantizedArray` (codes, scales, codebook) as leaf cells.
    :meth:`dequantized` records one ``dequantize_tile`` kernel per tile and returns the float
    TileTensor they make; each call records new kernels (so a backward recomputes its tiles rather
    than keeping the forward's). Not a Parameter: it has no gradient and no optimizer state, and
    ``model.named_parameters()`` leaves it out.

    >>> import numpy as np
    >>> w = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    >>> q = QuantizedTensor.from_array(w, (32, 48), "int8")
    >>> q.shape, q.chunks, q.nbytes < w.nbytes / 3
    ((64, 48), ((32, 32), (48,)), True)
    >>> bool(np.abs(q.dequantized().numpy() - w).max() < 0.05)
    True
    """

    requires_grad = False

    def __init__(self, tiling: Tiling, dtype, tiles: dict, name: str | None = None):
        """``tiles``: grid index -> :class:`~tilegraph.io.quantize.QuantizedArray` of that tile."""
        where = f"tilegraph.peft.QuantizedTensor({name or ''})"
        self.tiling, self.dtype, self.name = tiling, np.dtype(dtype), name
        problems = [f"tile {idx}: {tiles[idx].shape if idx in tiles else 'missing'}, expected {tiling.tile_shape(idx)}"
                    for idx in np.ndindex(*tiling.grid)
                    if idx not in tiles or tuple(tiles[idx].shape) != tuple(tiling.tile_shape(idx))]
        if problems:
            raise TileError(where, "one quantized array of the tile's shape per tile", "; ".join(problems))
        self._tiles = {}  # idx -> (part names, leaf refs, attrs as JSON): recorded once, like a Parameter's
        for idx in np.ndindex(*tiling.grid):
            arrays, attrs = tiles[idx].to_parts()
            names = tuple(sorted(arrays))
            refs = tuple(leaf(Cell(np.ascontiguousarray(arrays[k]), arrays[k].shape, arrays[k].dtype))
                         for k in names)
            self._tiles[idx] = (names, refs, json.dumps(attrs, sort_keys=True, separators=(",", ":")))
        PARAMETER_CELLS.update(self.cells)  # tg.compute sends them to the workers once, as a Parameter's tiles

    def __setstate__(self, state) -> None:
        """Unpickled or deep-copied: its new cells are a weight's too (:data:`tilegraph.nn.PARAMETER_CELLS`)."""
        self.__dict__.update(state)
        PARAMETER_CELLS.update(self.cells)

    @classmethod
    def from_array(cls, array, tiles, method: str = "int4", bits: int | None = None, *, name=None):
        """Quantize ``array`` tile by tile (``tiles`` as :class:`~tilegraph.nn.Parameter` takes
        them) with :func:`tilegraph.io.quantize.quantize`, as a checkpoint stores it."""
        from tilegraph.io.quantize import quantize

        array = np.asarray(array)
        tiling = Tiling.from_sizes(array.shape, tiles, where="tilegraph.peft.QuantizedTensor.from_array")
        quantized = {idx: quantize(np.ascontiguousarray(array[_region(tiling, idx)], dtype=np.float32), method, bits)
                     for idx in np.ndindex(*tiling.grid)}
        return cls(tiling, array.dtype, quantized, name)

    shape = property(lambda self: self.tiling.shape)
    chunks = property(lambda self: self.tiling.chunks)
    ndim = property(lambda self: len(self.tiling.shape))
    size = property(lambda self: math.prod(self.tiling.shape))

    @property
    def cells(self) -> list[Cell]:
        """Every part's leaf cell (to move them to the workers once: ``runtime.scatter_cells``)."""
        return [n.cell for n in self.nodes]

    @property
    def nodes(self) -> list:
        """Every part's leaf node: what a graph reading the weight reads (checked to hold a value
        it can have before the graph runs, as a Parameter's tiles are)."""
        return [r.node for _, refs, _ in self._tiles.values() for r in refs]

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized parts held (the float weight would take ``size * itemsize``)."""
        return sum(r.nbytes for _, refs, _ in self._tiles.values() for r in refs)

    def dequantized(self) -> TileTensor:
        """The weight as a float TileTensor of ``dtype``, one new dequantize kernel per tile."""
        from tilegraph.ops._common import new_tensor

        def fill(idx):
            names, refs, attrs = self._tiles[idx]
            return emit1(_dequantize_tile, refs, self.tiling.tile_shape(idx), self.dtype, op="dequantize",
                         names=names, attrs=attrs, dtype=self.dtype.str)

        return new_tensor(self.tiling, self.dtype, fill)

    def __repr__(self) -> str:
        method = json.loads(next(iter(self._tiles.values()))[2]).get("method") if self._tiles else "?"
        return f"QuantizedTensor({self.name}, shape={self.shape}, {method}, tiles={self.chunks})"


def named_quantized(model: Module) -> list[tuple[str, QuantizedTensor]]:
    """``(name, tensor)`` of every :class:`QuantizedTensor` ``model`` holds, named as
    ``named_parameters`` would name a Parameter there (``blocks.0.attn.q.weight``): what
    :func:`tilegraph.io.save_checkpoint` stores quantized, as they are, and ``load_into``
    restores."""
    out, seen = [], set()
    for prefix, module in [("", model), *((f"{n}.", m) for n, m, _ in _named_modules(model))]:
        if isinstance(module, ModuleList):
            continue
        for key, value in vars(module).items():
            if isinstance(value, QuantizedTensor) and id(value) not in seen:
                seen.add(id(value))
                out.append((f"{prefix}{key}", value))
    return out


def _region(tiling: Tiling, idx) -> tuple[slice, ...]:
    out = []
    for sizes, i in zip(tiling.chunks, idx):
        lo = sum(sizes[:i])
        out.append(slice(lo, lo + sizes[i]))
    return tuple(out)


class QuantizedLinear(Module):
    """A frozen Linear over a :class:`QuantizedTensor` weight: ``y = x @ dequantize(weight) + bias``,
    each tile dequantized where it is used (forward and, for the input's gradient, again in the
    backward). :func:`apply_lora` and :func:`apply_lotr` adapt it like a Linear."""

    def __init__(self, weight: QuantizedTensor, bias: Parameter | None = None):
        if not isinstance(weight, QuantizedTensor):
            raise TileError("tilegraph.peft.QuantizedLinear", "weight must be a QuantizedTensor", type(weight).__name__)
        self.weight, self.bias = weight, bias
        if isinstance(bias, Parameter):
            bias.requires_grad = False

    def forward(self, x: TileTensor) -> TileTensor:
        return _quantized_linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        n, m = self.weight.shape
        return f"QuantizedLinear({n}, {m}, bias={self.bias is not None})"


def _check_quantized_inputs(where, x, w: QuantizedTensor, bias) -> None:
    from tilegraph.ops._common import require_same_chunks, require_same_dtype, require_tensor

    require_tensor(x, where, "x")
    require_same_dtype(where, x=x, w=w, bias=bias)
    if x.ndim < 2 or x.shape[-1] != w.shape[0] or (bias is not None and bias.shape != (w.shape[1],)):
        raise TileError(where, "shapes x (..., n), w (n, m), bias (m,)",
                        f"x {x.shape}, w {w.shape}" + (f", bias {bias.shape}" if bias is not None else ""))
    require_same_chunks(where, "x's last dim and w's rows (n)", x.chunks[-1], w.chunks[0])
    if bias is not None:
        require_same_chunks(where, "bias and w's columns (m)", bias.chunks[0], w.chunks[1])


def _ops_lora():
    # the LoRA op's step lists and tile graph are reused as they are (frozen W, no W gradient);
    # imported late so that importing tilegraph.peft stays light
    from tilegraph.ops import lora

    return lora


class _QuantizedLinearOp(Op):
    """``y = x @ W + b`` over a quantized W: dX = dY W^T with W dequantized again, no dW."""

    name = "quantized_linear"

    def forward(self, x, w: QuantizedTensor, bias=None):
        L = _ops_lora()
        _check_quantized_inputs(f"tilegraph.{self.name}", x, w, bias)
        step = L.Step("y", (L._nn("x", "w"),), "b")
        y = L._run_tiles((step,), {"x": x, "w": w.dequantized(), "b": bias}, ("y",))["y"]
        return y, (w, bias is not None)

    def backward(self, ctx, dy):
        L = _ops_lora()
        w, has_bias = ctx
        step = L.Step("dx", (L._nt("dy", "w"),))
        dx = L._run_tiles((step,), {"dy": dy, "w": w.dequantized()}, ("dx",))["dx"]
        db = None
        if has_bias:
            from tilegraph.ops.reduce import sum_dims

            db = sum_dims(dy, tuple(range(dy.ndim - 1)), (False,) * (dy.ndim - 1))
        return dx, None, db


def _quantized_linear(x, w, bias=None):
    return _QUANTIZED_LINEAR(x, w, bias)


_QUANTIZED_LINEAR = _QuantizedLinearOp()


def _quantized_base_lora(x, w, u, v, bias=None, **params):
    """:func:`tilegraph.ops.lora_linear` over a :class:`QuantizedTensor` base (same variants and
    choice): the forward reads freshly dequantized tiles, and so does the backward."""
    global _QUANTIZED_LORA
    if _QUANTIZED_LORA is None:
        L = _ops_lora()

        class _QuantizedBaseLoRAOp(L.LoRALinearOp):
            name = "lora_linear_quantized_base"

            def forward(self, x, w, u, v, bias=None, **params):
                y, ctx = super().forward(x, w.dequantized(), u, v, bias, **params)
                return y, (ctx, w)  # the quantized weight, not the forward's dequantized tiles

            def backward(self, ctx, dy):
                ctx, w = ctx
                return super().backward(ctx._replace(w=w.dequantized()), dy)

        _QUANTIZED_LORA = _QuantizedBaseLoRAOp()
    return _QUANTIZED_LORA(x, w, u, v, bias, **params)


_QUANTIZED_LORA = None


def _stored_adapters(ck) -> list[str]:
    """The layers whose adapter arrays a model checkpoint ``ck`` holds (a LoRA layer's U and V, a
    LoTR layer's core), in stored order."""
    out = {}
    for name in ck.parameters:
        layer, _, part = name.rpartition(".")
        if part in ("lora_u", "lotr_core"):
            out.setdefault(layer, None)
    return list(out)


def _recorded_adapters(ck, stored: list[str], where: str) -> dict | None:
    """The adapters of checkpoint ``ck`` as :func:`adapter_settings` describes them: recorded with
    its model (:func:`tilegraph.io.save_checkpoint`), else in the ``tilegraph_peft.json`` of a
    ``tilegraph train`` checkpoint written before (method, rank, targets: applied by pattern here);
    None where neither records them."""
    from tilegraph.cli.finetune import read_peft_record
    from tilegraph.nn import deferred_init

    settings = (ck.info.get("model") or {}).get("adapters")
    if settings:
        return settings
    record = read_peft_record(Path(ck.path), where)
    if record is None or record["method"] not in ("lora", "lotr"):
        return None
    with deferred_init():  # which layers the patterns match, on a model of the checkpoint's shape
        probe = ck.new_model(values=False, adapters=False)
    if record["method"] == "lora":
        apply_lora(probe, record["targets"], record["rank"], record["alpha"], record.get("dropout", 0.0))
    else:
        apply_lotr(probe, record["targets"], record["rank"], record["scale"])
    settings = adapter_settings(probe)
    for info in (settings.get("lora") or {}).values():  # the probe's seeds are not the run's: not recorded
        info.pop("dropout_seed", None)
    made = sorted(set(lora_layers(probe)) | set(lotr_layers(probe)))
    if made != sorted(stored):
        raise TileError(where, "the adapters that tilegraph_peft.json makes to be the ones the checkpoint holds",
                        f"tilegraph_peft.json makes {', '.join(made)}; stored: {', '.join(stored)}")
    return settings


def from_quantized(path, tiling=None, *, runtime=None, adapters: bool = True, dtype=None):
    """The model of a quantized Zarr checkpoint (``tilegraph.io.save_checkpoint(path, model,
    quantize="int4" | "int8" | "kashin" ...)``, or a checkpoint of a model holding quantized
    weights, which stores their parts as they are) whose Linear layers stay quantized: each becomes
    a :class:`QuantizedLinear` holding the stored parts of every tile (read here; a fraction of
    the float bytes), dequantized per tile inside each step graph. Parameters stored exact, and
    quantized ones that are not Linear weights (embeddings), load as :func:`tilegraph.models.from_zarr`
    loads them. With a runtime (``runtime`` or the current one) the parts move to its workers
    once. Then adapt and train as usual::

        model = peft.apply_lora(peft.from_quantized("ck-int4"), ["attn.q", "attn.v"], rank=8)
        opt = tg.optim.AdamW(peft.trainable_parameters(model), lr=1e-3)

    The model's tiling must be the stored one for the quantized weights (their tiles were
    quantized one by one); ``tiling`` may only change what loads dequantized.

    ``adapters``: a checkpoint of a model with LoRA or LoTR adapters (saved with them, or a
    fine-tuning run's) comes back with them on its quantized base (``adapters=False``: the base
    alone), as :func:`tilegraph.io.save_checkpoint` recorded them. A checkpoint holding adapter
    arrays without their settings (none is written so now) loads as the base alone, with a
    warning; add them with the rank and alpha they were trained with, then
    ``tilegraph.io.load_checkpoint(ck).load_into(model, strict=False)``.

    ``dtype``: the model's float dtype (default: the stored model's). The quantized weights stay
    quantized, their tiles dequantized to it; every other weight, and the adapters, load cast to
    it (``tilegraph train --init`` of a float16 checkpoint trains in float32 so).
    """
    import warnings

    from tilegraph._config import require_float_dtype
    from tilegraph.runtime import current_runtime
    from tilegraph.io._store import quantized_parts, tile_label
    from tilegraph.io.quantize import QuantizedArray
    from tilegraph.io.zarr import load_checkpoint
    from tilegraph.models import ARCHITECTURES
    from tilegraph.nn import deferred_init

    where = f"tilegraph.peft.from_quantized({path})"
    if not isinstance(adapters, (bool, np.bool_)):
        raise TileError(where, "adapters must be True (restore the checkpoint's adapters) or False (the base alone)",
                        repr(adapters)[:200])
    if dtype is not None:
        dtype = require_float_dtype(where, dtype)
    ck = load_checkpoint(path, tiling=tiling, runtime=runtime)
    m = ck.info.get("model") or {}
    if m.get("architecture") not in ARCHITECTURES:
        raise TileError(where, f"a checkpoint of a known architecture; known: {', '.join(ARCHITECTURES)}",
                        repr(m.get("architecture") or m.get("class")))
    # no random draw for weights about to be read; each QuantizedTensor takes its layer's dtype
    model = ck.new_model(values=False, adapters=False, dtype=dtype)

    replace, problems = [], []
    for name, layer, setter in _named_modules(model):
        info = ck.arrays.get(f"model/{name}.weight")
        if not isinstance(layer, Linear) or info is None or not info.get("quantized"):
            continue
        stored = tuple(tuple(c) for c in info["tiles"])
        if stored != tuple(map(tuple, layer.weight.chunks)):
            problems.append(f"{name}.weight: model tiles {layer.weight.chunks}, stored {stored}")
        else:
            replace.append((name, layer, setter))
    if problems:
        raise TileError(where, "the model's tiling to be the stored one for every quantized weight (each tile was "
                        "quantized on its own; load with tilegraph.models.from_zarr to retile dequantized)",
                        "; ".join(problems))
    if not replace:
        raise TileError(where, "a checkpoint with quantized Linear weights (save_checkpoint(..., quantize='int4'))",
                        "none is stored quantized")
    root = str(ck.path)
    for name, layer, setter in replace:
        w = layer.weight
        tiles = {idx: QuantizedArray.from_parts(*quantized_parts(root, f"model/{name}.weight/{tile_label(idx)}"))
                 for idx in np.ndindex(*w.tiling.grid)}
        _replace(setter, layer, QuantizedLinear(QuantizedTensor(w.tiling, w.dtype, tiles, f"{name}.weight"),
                                                layer.bias))
    stored = _stored_adapters(ck)
    settings = _recorded_adapters(ck, stored, where) if stored and adapters else None
    if settings:
        with deferred_init():  # their values are read below
            add_adapters(model, settings)
    elif stored and adapters:
        warnings.warn(f"[{where}] the checkpoint holds adapters on {len(stored)} layers "
                      f"({', '.join(stored[:4])}{' ...' if len(stored) > 4 else ''}) without their settings: the "
                      "model is the base alone. Add them with apply_lora / apply_lotr and the rank and alpha they "
                      "were trained with, then tilegraph.io.load_checkpoint(path).load_into(model, strict=False)",
                      UserWarning, stacklevel=2)
    named = dict(model.named_parameters())
    missing = [n for n in named if n not in set(ck.parameters)]
    if missing:
        raise TileError(where, "every parameter of the model in the checkpoint", "missing: " + ", ".join(missing))
    ck._load_into(model, strict=False, quantized=False)  # the rest: exact, or dequantized (embeddings) where read
    rt = runtime if runtime is not None else current_runtime()
    if rt is not None:
        rt.scatter_cells([c for _, layer, _ in _named_modules(model) if isinstance(layer, QuantizedLinear)
                          for c in layer.weight.cells])
    return model


def apply_grad_sketch(model, targets, kind="gaussian", ratio=0.2, *, seed=0):
    """Randomized-matmul weight gradients for the Linear layers of ``model`` matching ``targets``
    (the same patterns as :func:`apply_lora`): :func:`tilegraph.sketch.apply_grad_sketch`."""
    from tilegraph.sketch import apply_grad_sketch as apply

    return apply(model, targets, kind, ratio, seed=seed)
