"""Parameter-efficient fine-tuning: LoRA adapters on a frozen model.

:func:`apply_lora` replaces the model's :class:`~tilegraph.nn.Linear` layers whose names match
``targets`` by :class:`LoRALinear` layers (``y = x W + b + (alpha / r) (x U) V``, W and b
frozen) and freezes every other parameter, so only the adapters get gradients and optimizer
state: build the optimizer from :func:`trainable_parameters`. Each layer's forward and backward
graphs are RunLoRA's cheapest for its shapes (:mod:`tilegraph.ops.lora`). :func:`merge_lora` folds
the adapters into the weights; :func:`save_adapters` / :func:`load_adapters` write and read only
the adapter tensors (a Zarr checkpoint).

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

import fnmatch
import math
import numbers
from typing import Callable, Iterator, Sequence

import numpy as np

from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor
from tilegraph.nn import Linear, Module, ModuleList, Parameter

__all__ = ["LoRALinear", "apply_lora", "merge_lora", "lora_layers", "trainable_parameters", "save_adapters",
           "load_adapters"]

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
    if dropout != 0:
        # a dropout mask must change every step while the recorded step graph is replayed as is
        raise TileError(where, "dropout is not supported: only 0 (no dropout on the adapter's input)", repr(dropout))


def _check_choice(where: str, variant, choose):
    from tilegraph.ops.lora import CRITERIA, _resolve_variant_name

    if choose not in CRITERIA:
        raise TileError(where, f"choose must be one of {', '.join(CRITERIA)}", repr(choose))
    return _resolve_variant_name(variant, where), choose


class LoRALinear(Module):
    """A frozen :class:`~tilegraph.nn.Linear` plus a low-rank update:
    ``y = x @ weight + bias + (alpha / rank) * (x @ lora_u) @ lora_v``.

    ``weight`` and ``bias`` are the base layer's parameters (same objects, so the model's parameter
    names do not change), frozen. ``lora_u`` (in, rank) starts uniform in +-1/sqrt(in) and
    ``lora_v`` (rank, out) at zero (peft's A and B, transposed), so the layer starts equal to its
    base. ``variant``/``choose``: see :func:`tilegraph.ops.lora.lora_linear` (default: the graphs
    with the fewest FLOPs for each call's shapes).

    >>> import numpy as np, tilegraph as tg
    >>> layer = tg.nn.LoRALinear(tg.nn.Linear(6, 5, seed=0), rank=2, alpha=4, seed=0)
    >>> layer.lora_u.shape, layer.lora_v.shape, layer.scale, layer.weight.requires_grad
    ((6, 2), (2, 5), 2.0, False)
    """

    def __init__(self, base: Linear, rank: int, alpha: float | None = None, *, dropout: float = 0.0,
                 variant=None, choose: str = "flops", seed=None):
        where = "tilegraph.nn.LoRALinear"
        if not isinstance(base, Linear):
            raise TileError(where, "base must be a tilegraph.nn.Linear", type(base).__name__)
        alpha = rank if alpha is None else alpha
        _check_rank_alpha(where, rank, alpha, dropout)
        n, m = base.weight.shape
        if rank > min(n, m):
            raise TileError(where, f"rank must be at most min(in, out) = {min(n, m)} of the layer",
                            f"rank={rank} for a ({n}, {m}) weight")
        self.variant, self.choose = _check_choice(where, variant, choose)
        self.rank, self.alpha = int(rank), float(alpha)
        self.weight, self.bias = base.weight, base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad = False
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        dtype = self.weight.dtype
        bound = 1.0 / math.sqrt(n)  # torch's kaiming_uniform_(a=sqrt(5)), as peft initialises A
        self.lora_u = Parameter(rng.uniform(-bound, bound, (n, rank)).astype(dtype),
                                (self.weight.chunks[0], None), name="lora_u")
        self.lora_v = Parameter(np.zeros((rank, m), dtype), (None, self.weight.chunks[1]), name="lora_v")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def forward(self, x: TileTensor) -> TileTensor:
        from tilegraph._config import config
        from tilegraph.ops.lora import lora_linear

        return lora_linear(x, self.weight, self.lora_u, self.lora_v, self.bias, scale=self.scale,
                           variant=self.variant, choose=self.choose,
                           device="gpu" if config.placement == "gpu" else "cpu")

    def merged(self) -> Linear:
        """A plain Linear whose weight is ``weight + scale * lora_u @ lora_v`` (computed where the
        tiles are, fetched here), on the same tiles; the bias is the same Parameter."""
        from tilegraph._lower import compute
        from tilegraph.ops.lora import merged_weight

        (w,) = compute(merged_weight(self.weight, self.lora_u, self.lora_v, self.scale))
        lin = Linear.__new__(Linear)  # no init draw: the weight is given
        lin.weight = Parameter(w, self.weight.chunks, name="weight", requires_grad=self.weight.requires_grad)
        lin.bias = self.bias
        return lin

    def __repr__(self) -> str:
        n, m = self.weight.shape
        return f"LoRALinear({n}, {m}, rank={self.rank}, alpha={self.alpha:g}, bias={self.bias is not None})"


# ---------------------------------------------------------------------------- module walk ----
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
    """A pattern matches a module's dotted name, a dotted suffix of it (``attn.q`` matches
    ``blocks.0.attn.q``) or, with wildcards, as fnmatch does (``blocks.1.*``)."""
    return name == pattern or name.endswith("." + pattern) or fnmatch.fnmatchcase(name, pattern)


# ------------------------------------------------------------------------------------- API ----
def apply_lora(model: Module, targets: Sequence[str] | str, rank: int, alpha: float | None = None,
               dropout: float = 0.0, *, variant=None, choose: str = "flops", seed=0) -> Module:
    """Replace, in place, every Linear of ``model`` whose name matches one of ``targets`` by a
    :class:`LoRALinear` of ``rank`` and ``alpha`` (default: ``rank``, a scale of 1), freeze every
    other parameter, and return ``model``.

    ``targets``: module names (``"attn.q"`` matches ``blocks.0.attn.q``, ``blocks.1.attn.q``,
    ...), fnmatch patterns (``"blocks.1.mlp.*"``), or Hugging Face names of the architecture
    (:data:`HF_TARGETS`: GPT-2's ``c_attn``, ``c_proj``, ``c_fc``; Llama's ``q_proj`` ...
    ``down_proj``). A target matching no Linear is an error naming every Linear of the model.
    """
    where = "tilegraph.peft.apply_lora"
    alpha = rank if alpha is None else alpha
    _check_rank_alpha(where, rank, alpha, dropout)
    _check_choice(where, variant, choose)  # every check before the model changes
    patterns = _patterns(model, targets, where)
    found = [(name, m, setter) for name, m, setter in _named_modules(model) if isinstance(m, Linear)]
    chosen, unmatched = {}, []
    for target, pats in patterns.items():
        hits = [(name, m, s) for name, m, s in found if any(_matches(name, p) for p in pats)]
        if not hits:
            unmatched.append(target)
        chosen.update((name, (m, s)) for name, m, s in hits)
    if unmatched:
        names = ", ".join(name for name, _, _ in found) or "none"
        raise TileError(where, f"targets {unmatched} match no Linear layer of the {type(model).__name__}; its "
                        f"Linear layers: {names}", f"targets={list(patterns)}")
    too_small = [f"{name} ({m.weight.shape[0]}, {m.weight.shape[1]})" for name, (m, _) in chosen.items()
                 if rank > min(m.weight.shape)]
    if too_small:
        raise TileError(where, "rank must be at most min(in, out) of every targeted layer; too small: "
                        + ", ".join(too_small), f"rank={rank}")
    rng = np.random.default_rng(seed)
    for p in model.parameters():
        p.requires_grad = False
    for name, (m, setter) in chosen.items():
        _replace(setter, m, LoRALinear(m, rank, alpha, variant=variant, choose=choose, seed=rng))
    return model


def lora_layers(model: Module) -> dict[str, LoRALinear]:
    """The model's LoRA layers by name."""
    return {name: m for name, m, _ in _named_modules(model) if isinstance(m, LoRALinear)}


def trainable_parameters(model: Module) -> list[Parameter]:
    """The parameters with ``requires_grad`` set: after :func:`apply_lora`, the adapters only.
    Build the optimizer from these (an optimizer given frozen parameters would ask for their
    gradients)."""
    return [p for p in model.parameters() if p.requires_grad]


def merge_lora(model: Module) -> Module:
    """Fold every adapter into its base weight (``W + alpha / r * U V``) and put plain Linear
    layers back, in place; returns ``model``. Every parameter keeps its ``requires_grad``."""
    for name, m, setter in list(_named_modules(model)):
        if isinstance(m, LoRALinear):
            _replace(setter, m, m.merged())
    return model


class _Adapters(Module):
    """The adapter parameters of a model under their names in it, as one module (what
    :func:`save_adapters` writes with the Zarr checkpoint writer)."""

    def __init__(self, model: Module):
        self.named = {}
        for name, layer in lora_layers(model).items():
            self.named[f"{name}.lora_u"] = layer.lora_u
            self.named[f"{name}.lora_v"] = layer.lora_v

    def _walk(self, prefix: str, seen: set):
        for name, p in self.named.items():
            if id(p) not in seen:
                seen.add(id(p))
                yield f"{prefix}{name}", p


def save_adapters(path, model: Module) -> None:
    """Write only the adapter tensors of ``model`` (and each layer's rank and alpha) as a Zarr
    checkpoint folder ``path`` (:func:`tilegraph.io.save_checkpoint`)."""
    from tilegraph.io.zarr import save_checkpoint

    layers = lora_layers(model)
    if not layers:
        raise TileError("tilegraph.peft.save_adapters", "a model with LoRA layers (tilegraph.peft.apply_lora)",
                        f"{type(model).__name__} has none")
    meta = {"lora": {name: {"rank": m.rank, "alpha": m.alpha, "shape": list(m.weight.shape)}
                     for name, m in layers.items()}}
    save_checkpoint(path, _Adapters(model), metadata=meta)


def load_adapters(path, model: Module) -> Module:
    """Read adapters written by :func:`save_adapters` into ``model``: into its LoRA layers, or, when
    it has none, into new ones on the layers named in the checkpoint (as :func:`apply_lora`).
    Every missing, unexpected and mis-shaped adapter is reported at once. Returns ``model``."""
    from tilegraph.io.zarr import load_checkpoint

    where = "tilegraph.peft.load_adapters"
    ck = load_checkpoint(path)
    stored = (ck.metadata or {}).get("lora")
    if not isinstance(stored, dict) or not stored:
        raise TileError(where, "a folder written by tilegraph.peft.save_adapters", f"{path} holds no LoRA metadata")
    if not lora_layers(model):
        for name, info in stored.items():
            apply_lora(model, [name], info["rank"], info["alpha"])
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
    if problems:
        raise TileError(where, f"the adapters in {path} to match the model's LoRA layers", "; ".join(problems))
    ck.load_into(_Adapters(model))
    for name, info in stored.items():
        layers[name].alpha = float(info["alpha"])
    return model

