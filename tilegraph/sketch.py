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

from typing import Sequence

from tilegraph._errors import TileError
from tilegraph.nn import Linear, Module
from tilegraph.ops.rmm import SKETCHES, check_grad_sketch

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
    the model's Linear layers. The model must be recorded again (a new ``TrainStep``) to use it.
    """
    from tilegraph.peft import _matches, _named_modules, _patterns

    from tilegraph.peft import _check_model

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
    if unmatched:
        names = ", ".join(name for name, _ in found) or "none"
        raise TileError(where, f"targets {unmatched} match no Linear layer of the {type(model).__name__}; its "
                        f"Linear layers: {names}", f"targets={list(patterns)}")
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
