"""Randomized weight gradients for a model's Linear layers (RMM, arXiv:2201.13195; WTA-CRS, arXiv:2305.15265).

:func:`apply_grad_sketch` turns on, by module name, the sketched weight gradient of
:class:`tilegraph.nn.Linear` (``grad_sketch=``, see :mod:`tilegraph.ops.rmm`): the layers keep
``ratio * N`` sketched rows of their input for the backward instead of all N rows.

>>> import numpy as np, tilegraph as tg
>>> mlp = tg.nn.MLP(8, 16, seed=0)
>>> apply_grad_sketch(mlp, ["fc1"], "rademacher", 0.5) is mlp
True
>>> sketched_layers(mlp)
{'fc1': ('rademacher', 0.5)}
"""

from __future__ import annotations

import warnings
from typing import Sequence

from tilegraph._errors import TileError
from tilegraph.nn import Linear, Module
from tilegraph.ops.rmm import SEED_MAX, SKETCHES, check_grad_sketch

__all__ = ["apply_grad_sketch", "sketched_layers", "SKETCHES"]


def apply_grad_sketch(model: Module, targets: Sequence[str] | str, kind: str | None = "gaussian",
                      ratio: float = 0.2, *, seed: int = 0) -> Module:
    """Set, in place, the weight-gradient sketch of every Linear of ``model`` whose name matches one
    of ``targets``, and return ``model``. ``kind`` is one of :data:`SKETCHES`, or None for exact
    gradients again; ``ratio`` in (0, 1] is the share of rows kept; the model's i-th Linear (in model
    order) gets base seed ``seed + i``.

    Targets are matched as :func:`tilegraph.peft.apply_lora` matches them: a dotted module name
    (``blocks.0.attn.q``), a dotted suffix (``attn.q``), an fnmatch pattern of either (``blocks.*.mlp.*``, ``mlp.*``)
    or a Hugging Face name of the architecture (GPT-2's ``c_fc``, Llama's ``q_proj`` ...). Every
    input is checked before any layer changes; a target that matches no Linear is an error listing
    the model's Linear layers (one matching only layers with an adapter says so: their base weight
    is frozen). A frozen weight (``requires_grad=False``, as :func:`tilegraph.peft.apply_lora`
    leaves every base weight) has no weight gradient to sketch: such layers are named in a
    warning. The model must be recorded again (a new ``TrainStep``) to use it.
    """
    from tilegraph.peft import (LoRALinear, LoTRLinear, QuantizedLinear, _check_model, _matches, _named_modules,
                                _patterns, other_modules_matched)

    where = "tilegraph.sketch.apply_grad_sketch"
    _check_model(where, model)
    kind, ratio, seed = check_grad_sketch(kind, ratio, seed, where)
    patterns = _patterns(model, targets, where)
    found = [(name, m) for name, m, _ in _named_modules(model) if isinstance(m, Linear)]
    chosen: dict[str, Linear] = {}
    unmatched = []
    for target, pats in patterns.items():
        hits = [(name, m) for name, m in found if any(_matches(name, p) for p in pats)]
        if not hits:
            unmatched.append(target)
        chosen.update(hits)
    # layers with an adapter (or a quantized base): their base weight is frozen, it has no gradient to sketch
    frozen_kinds = {name: type(m).__name__ for name, m, _ in _named_modules(model)
                    if isinstance(m, (LoRALinear, LoTRLinear, QuantizedLinear))}
    if unmatched:
        names = ", ".join(name for name, _ in found) or "none"
        taken = {t: [f"{name} ({cls})" for name, cls in frozen_kinds.items()
                     if any(_matches(name, p) for p in patterns[t])] for t in unmatched}
        if any(taken.values()):  # said so, not as a name that matches nothing
            said = [f"{t!r} matches only layers whose base weight is frozen: {', '.join(hits)}" if hits
                    else f"{t!r} matches nothing" for t, hits in taken.items()]
            raise TileError(where, "targets that match Linear layers with a weight to train: an adapter's (LoRA, LoTR) "
                            "or a quantized base weight has no weight gradient to sketch, and the adapters' own "
                            f"gradients are exact; the {type(model).__name__}'s Linear layers: {names}",
                            "; ".join(said))
        said = other_modules_matched(model, patterns, unmatched)
        raise TileError(where, f"targets {unmatched} match no Linear layer of the {type(model).__name__}; its "
                        f"Linear layers: {names}", f"targets={list(patterns)}" + (f" ({said})" if said else ""))
    frozen = [name if name in chosen else f"{name} ({frozen_kinds[name]})" for name, _, _ in _named_modules(model)
              if (name in chosen and not chosen[name].weight.requires_grad)
              or (name in frozen_kinds and any(_matches(name, p) for pats in patterns.values() for p in pats))]
    if kind is not None and frozen:  # their backward computes no weight gradient: the sketch would do nothing
        warnings.warn(f"[{where}] {len(frozen)} of the layers that {list(patterns)} match have a frozen weight "
                      f"(requires_grad=False: {', '.join(frozen[:6])}{' ...' if len(frozen) > 6 else ''}), "
                      "whose backward computes no weight gradient: the sketch changes nothing there (and saves no "
                      "memory) while they stay frozen. peft.apply_lora / apply_lotr freeze every base weight, and "
                      "the adapters' own gradients are exact", UserWarning, stacklevel=2)
    last = max(i for i, (name, _) in enumerate(found) if name in chosen)
    if seed + last > SEED_MAX:  # (layer i gets seed + i)
        raise TileError(where, f"seed + i <= 2**64 - 1 for every chosen layer (the i-th Linear layer gets seed + i; "
                        f"the last chosen is layer {last}, {found[last][0]}): seed <= 2**64 - 1 - {last}", repr(seed))
    for i, (name, _) in enumerate(found):
        if name in chosen:
            layer = chosen[name]
            layer.grad_sketch, layer.sketch_ratio, layer.sketch_seed = kind, ratio, seed + i
    return model


def sketched_layers(model: Module) -> dict[str, tuple[str, float]]:
    """``{name: (sketch, ratio)}`` of the model's Linear layers with a sketched weight gradient."""
    from tilegraph.peft import _check_model, _named_modules

    _check_model("tilegraph.sketch.sketched_layers", model)
    return {name: (m.grad_sketch, m.sketch_ratio) for name, m, _ in _named_modules(model)
            if isinstance(m, Linear) and m.grad_sketch is not None}
