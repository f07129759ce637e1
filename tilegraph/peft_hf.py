"""LoRA adapters as Hugging Face peft folders: ``adapter_config.json`` + ``adapter_model.safetensors``.

:func:`save_peft` writes a tilegraph model's LoRA layers as a folder that
``peft.PeftModel.from_pretrained(hf_model, folder)`` loads onto the Hugging Face model that
``model.to_hf(...)`` writes; :func:`load_peft` reads such a folder (written by peft's
``save_pretrained`` or by :func:`save_peft`) into a tilegraph model. Nothing here imports torch
or peft.

Layouts: tilegraph's :class:`~tilegraph.peft.LoRALinear` computes ``y = x W + b + (alpha / r) (x U) V``
with ``U`` (in, r) and ``V`` (r, out); peft computes ``y = base(x) + (lora_alpha / r) B(A(x))`` with
``lora_A.weight`` (r, in) and ``lora_B.weight`` (out, r), for GPT-2's Conv1D layers (weights stored
(in, out), peft's ``fan_in_fan_out``) as for Llama's nn.Linear ones. So ``A = U^T`` and
``B = V^T``. Module names come from the architecture's table in :mod:`tilegraph.io.hf`.

GPT-2's fused ``c_attn`` is three tilegraph layers (``attn.q``, ``attn.k``, ``attn.v``), each with
its own adapter. Adapted together they are one peft adapter on ``c_attn``: with the same U, rank
and alpha (as :func:`load_peft` makes them) ``A = U^T`` and ``B`` stacks the three ``V^T``;
otherwise the three adapters stack into one of rank ``r_q + r_k + r_v`` (``A`` stacks the
``U^T``, ``B`` is block-diagonal), exact, and the safetensors metadata records the blocks so that
:func:`load_peft` splits them again. An adapter on only some of q, k and v has no peft form.

>>> from tilegraph import models, peft
>>> from tilegraph.peft_hf import save_peft, load_peft
>>> model = peft.apply_lora(models.build("gpt2-debug"), ["c_attn", "c_proj"], rank=4, alpha=8)
>>> save_peft("adapters", model)           # doctest: +SKIP
>>> load_peft("adapters", models.build("gpt2-debug"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tilegraph._errors import TileError
from tilegraph.nn import Linear, Module

__all__ = ["save_peft", "load_peft", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: what peft puts before the base model's module names in the saved keys
KEY_PREFIX = "base_model.model."
#: safetensors metadata key of the stacked adapters' blocks (peft ignores it)
BLOCKS_KEY = "tilegraph.lora_blocks"
_MAX_CONFIG_BYTES = 16 * 1024 * 1024
_KEY = re.compile(r"(.+)\.lora_([AB])\.weight")
#: a copy of an adapted module's base weight: peft's save_pretrained writes lm_head's
#: (save_embedding_layers, "auto": on for the modules it names embeddings)
_BASE_KEY = re.compile(r"(.+)\.base_layer\.weight")
#: peft's adapter of an nn.Embedding (target_modules with embed_tokens / wte): no tilegraph form
_EMBEDDING_KEY = re.compile(r"(.+)\.lora_embedding_([AB])")

#: adapter_config.json options that change what the adapter computes or holds beyond lora_A and
#: lora_B: option -> (the values tilegraph reads, said in words)
_UNSUPPORTED = {
    "use_dora": ((None, False), "false (DoRA's magnitude vectors)"),
    "bias": ((None, "none"), '"none" (trained biases)'),
    "lora_bias": ((None, False), "false (a bias on lora_B)"),
    "modules_to_save": ((None, []), "null (fully trained modules)"),
    "trainable_token_indices": ((None, [], {}), "null (trainable tokens)"),
    "target_parameters": ((None, []), "null (adapters on parameters)"),
    "layer_replication": ((None, []), "null"),
    "alora_invocation_tokens": ((None, []), "null (activated LoRA)"),
    "use_qalora": ((None, False), "false"),
    "use_bdlora": ((None, False), "false or null"),
    "arrow_config": ((None,), "null"),
    "monteclora_config": ((None,), "null"),
    "kasa_config": ((None,), "null"),
    "velora_config": ((None,), "null"),
    # PiSSA, OLoRA, CorDA, LoftQ and LoRA-GA subtract their initial B A from the base weights (or
    # quantize them), and peft's from_pretrained redoes that: the adapter is not one of the base
    "init_lora_weights": ((None, True, False, "gaussian", "orthogonal", "mica", "eva"),
                          'true, false, "gaussian", "orthogonal", "mica" or "eva": other initializations (PiSSA, '
                          "OLoRA, CorDA, LoftQ, LoRA-GA) change the base weights, which peft redoes when it loads "
                          "the adapter, so these adapters are not adapters of the base model; peft's "
                          "save_pretrained(..., path_initial_model_for_weight_conversion=<the initial adapter>) "
                          "writes them as a LoRA adapter of the original base"),
}


# --------------------------------------------------------------------------- module map ----
@dataclass(frozen=True)
class _Target:
    """One Hugging Face linear module and the tilegraph Linear layers it holds."""

    hf: str  # module name in the HF model: "transformer.h.0.attn.c_attn"
    parts: tuple[str, ...]  # tilegraph layer names in HF's output order: ("blocks.0.attn.q", ...)
    sizes: tuple[int, ...]  # each part's output features
    in_features: int
    conv1d: bool  # HF stores the weight (in, out): GPT-2's Conv1D, peft's fan_in_fan_out

    @property
    def out_features(self) -> int:
        return sum(self.sizes)


def _layers(model: Module) -> dict[str, Module]:
    """The model's linear layers (plain, quantized, LoRA or LoTR) by name."""
    from tilegraph.peft import LoRALinear, LoTRLinear, QuantizedLinear, _named_modules

    kinds = (Linear, QuantizedLinear, LoRALinear, LoTRLinear)
    return {name: m for name, m, _ in _named_modules(model) if isinstance(m, kinds)}


def _targets(model: Module, where: str) -> dict[str, _Target]:
    """HF module name -> :class:`_Target` for every linear module of the model's HF form."""
    from tilegraph.io.hf import SPECS

    arch = getattr(model, "arch", None)
    if arch not in SPECS or not hasattr(model, "config"):
        raise TileError(where, "a model with a Hugging Face name map (tilegraph.models: "
                        f"{', '.join(SPECS)})", f"{type(model).__name__} (arch {arch!r})")
    layers = _layers(model)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    shapes.update({f"{name}.weight": m.weight.shape for name, m in layers.items()})
    out = {}
    for hf, (rule, tg) in SPECS[arch].names.expand(model.config.n_layers, shapes).items():
        parts = tuple(t.removesuffix(".weight") for t in tg)
        if not hf.endswith(".weight") or not all(t.endswith(".weight") and p in layers for t, p in zip(tg, parts)):
            continue
        out_dim = 0 if rule.transpose else 1  # the output dim of the HF tensor
        if len(parts) > 1 and rule.split != out_dim:  # pragma: no cover - no such table entry
            continue
        ins = {layers[p].weight.shape[0] for p in parts}
        if len(ins) != 1:  # pragma: no cover - a table bug
            continue
        out[hf.removesuffix(".weight")] = _Target(hf.removesuffix(".weight"), parts,
                                                  tuple(layers[p].weight.shape[1] for p in parts), ins.pop(),
                                                  not rule.transpose)
    return out


# ------------------------------------------------------------------------------- saving ----
def save_peft(path, model: Module, *, base_model_name_or_path: str | None = None) -> None:
    """Write the LoRA layers of ``model`` as a peft LoRA folder ``path``: ``adapter_config.json``
    and ``adapter_model.safetensors`` (created, or replaced in an existing folder).

    ``base_model_name_or_path`` goes into the config as peft's hint of the base model (e.g. the
    folder that ``model.to_hf`` wrote). The most common rank and alpha become ``r`` and
    ``lora_alpha``; layers that differ get entries in ``rank_pattern`` / ``alpha_pattern`` (full
    module names). ``target_modules`` names the adapted HF modules by the shortest name suffixes
    that match no module left without an adapter. Errors: a model without an HF name map or
    without LoRA layers, LoTR layers (no peft equivalent), an adapter on part of a fused HF module,
    a folder holding a Zarr checkpoint (``save_adapters``' own format). The config is written
    last, so a failure leaves the folder as it was.
    """
    from tilegraph._lower import compute
    from tilegraph.io import safetensors as st
    from tilegraph.peft import lora_layers, lotr_layers

    path = Path(path)
    where = f"tilegraph.peft_hf.save_peft({path})"
    lotr = lotr_layers(model)
    if lotr:
        raise TileError(where, "LoRA layers only: peft has no LoTR adapter (tilegraph.peft.save_adapters writes "
                        "LoTR layers as a Zarr checkpoint)", "LoTR layers " + ", ".join(lotr))
    lora = lora_layers(model)
    if not lora:
        raise TileError(where, "a model with LoRA layers (tilegraph.peft.apply_lora)",
                        f"{type(model).__name__} has none")
    targets = _targets(model, where)
    adapted = _adapted_targets(targets, lora, where)
    names = [f"{p}.{a}" for t in adapted for p in t.parts for a in ("lora_u", "lora_v")]
    layer_of = {n: lora[n.rsplit(".", 1)[0]] for n in names}
    values = dict(zip(names, compute(*[getattr(layer_of[n], n.rsplit(".", 1)[1]) for n in names])))
    tensors, ranks, alphas, blocks = {}, {}, {}, {}
    for t in adapted:
        a, b, rank, alpha, block = _to_peft(t, [lora[p] for p in t.parts], values)
        tensors[f"{KEY_PREFIX}{t.hf}.lora_A.weight"] = a
        tensors[f"{KEY_PREFIX}{t.hf}.lora_B.weight"] = b
        ranks[t.hf], alphas[t.hf] = rank, alpha
        if block is not None:
            blocks[t.hf] = block
    rates = sorted({lora[p].dropout for t in adapted for p in t.parts})
    if len(rates) > 1:  # peft's config has one lora_dropout, and no pattern for it
        raise TileError(where, "one dropout for every LoRA layer (peft's lora_dropout has no per-layer form)",
                        ", ".join(f"{n}: {m.dropout:g}" for n, m in lora.items()))
    config = _peft_config(model, targets, ranks, alphas, base_model_name_or_path)
    config["lora_dropout"] = rates[0]
    if path.exists() and not path.is_dir():
        raise TileError(where, "a folder to write the adapters into", f"{path} is a file")
    if (path / "zarr.json").is_file():  # load_adapters would then read the peft files, not the checkpoint
        raise TileError(where, "a folder that is not a tilegraph checkpoint (a peft folder beside a Zarr "
                        "checkpoint's files would hide the checkpoint from load_adapters, which reads the peft "
                        "files of a folder holding adapter_config.json): another path",
                        f"{path} holds a Zarr checkpoint (zarr.json)")
    path.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt"}
    if blocks:
        metadata[BLOCKS_KEY] = json.dumps(blocks, sort_keys=True)
    # the config under a temporary name until the weights are written: a failure leaves the folder as it was
    tmp = path / f".{ADAPTER_CONFIG}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        st.save_file(tensors, path / ADAPTER_WEIGHTS, metadata=metadata)
        os.replace(tmp, path / ADAPTER_CONFIG)
    finally:
        tmp.unlink(missing_ok=True)


def _adapted_targets(targets: dict[str, _Target], lora: dict, where: str) -> list[_Target]:
    """The HF modules whose every part has a LoRA layer; an adapter on only some parts of a fused
    module, or on a layer no HF module holds, is an error naming them all."""
    problems, out, covered = [], [], set()
    for t in targets.values():
        have = [p for p in t.parts if p in lora]
        covered.update(t.parts)
        if have and len(have) < len(t.parts):
            problems.append(f"{', '.join(have)} (part of HF {t.hf}, which also holds "
                            f"{', '.join(p for p in t.parts if p not in lora)})")
        elif have:
            out.append(t)
    if problems:
        raise TileError(where, "LoRA on every tilegraph layer of a fused Hugging Face module or on none: a peft "
                        "adapter covers the whole module (apply_lora with the HF name, e.g. 'c_attn')",
                        "; ".join(problems))
    stray = [name for name in lora if name not in covered]
    if stray:
        raise TileError(where, "LoRA layers on modules of the Hugging Face model",
                        "no HF module for " + ", ".join(stray))
    return out


def _to_peft(t: _Target, layers: list, values: dict) -> tuple[np.ndarray, np.ndarray, int, float, dict | None]:
    """(lora_A (r, in), lora_B (out, r), r, lora_alpha, blocks or None) of one HF module."""
    us = [values[f"{p}.lora_u"] for p in t.parts]
    vs = [values[f"{p}.lora_v"] for p in t.parts]
    first = layers[0]
    alike = all(m.rank == first.rank and m.alpha == first.alpha for m in layers)
    if alike and all(np.array_equal(u, us[0]) for u in us[1:]):  # one adapter (one part, or one U)
        return (np.ascontiguousarray(us[0].T), np.ascontiguousarray(np.concatenate([v.T for v in vs])),
                first.rank, first.alpha, None)
    # stacked: A = [U_1^T; U_2^T; ...], B block-diagonal, each block scaled by its layer's scale / S
    rank, scale = sum(m.rank for m in layers), first.scale
    a = np.concatenate([u.T for u in us])
    b = np.zeros((t.out_features, rank), dtype=a.dtype)
    row = col = 0
    for m, v in zip(layers, vs):
        b[row:row + v.shape[1], col:col + m.rank] = v.T * (m.scale / scale)
        row, col = row + v.shape[1], col + m.rank
    block = {"ranks": [m.rank for m in layers], "alphas": [m.alpha for m in layers]}
    return np.ascontiguousarray(a), b, rank, scale * rank, block


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def _peft_config(model, targets: dict[str, _Target], ranks: dict, alphas: dict, base) -> dict[str, Any]:
    """adapter_config.json of peft's LoraConfig for these modules' ranks and alphas."""
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = Counter(alphas.values()).most_common(1)[0][0]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None if base is None else str(base),
        "revision": None,
        "inference_mode": True,
        "r": int(r),
        "lora_alpha": _number(alpha),
        "target_modules": _target_modules(set(ranks), set(targets)),
        "exclude_modules": None,
        "lora_dropout": 0.0,
        "fan_in_fan_out": any(targets[n].conv1d for n in ranks),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {n: int(v) for n, v in sorted(ranks.items()) if v != r},
        "alpha_pattern": {n: _number(v) for n, v in sorted(alphas.items()) if v != alpha},
        "auto_mapping": None,
    }


def _peft_matches(name: str, target: str) -> bool:
    """Whether peft's list form of ``target_modules`` picks module ``name`` with ``target``."""
    return name == target or name.endswith("." + target)


def _target_modules(adapted: set[str], known: set[str]) -> list[str]:
    """The shortest name suffixes (``c_attn``, ``mlp.c_proj``, ``transformer.h.1.attn.c_attn``) that
    together pick exactly the ``adapted`` modules among the ``known`` ones."""
    out: list[str] = []
    for name in sorted(adapted):
        if any(_peft_matches(name, s) for s in out):
            continue
        parts = name.split(".")
        suffixes = [".".join(parts[-k:]) for k in range(1, len(parts) + 1) if not parts[-k].isdigit()]
        out.append(next(s for s in suffixes if all(n in adapted for n in known if _peft_matches(n, s))))
    return sorted(out)


# ------------------------------------------------------------------------------ loading ----
def load_peft(path, model: Module) -> Module:
    """Read a peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) into
    ``model`` and return it. A model without LoRA layers gets them first
    (:func:`tilegraph.peft.apply_lora`) on the layers the folder has adapters for; a model with
    LoRA layers must have exactly those, of the folder's ranks. GPT-2's ``c_attn`` adapter
    becomes one adapter on each of ``attn.q``, ``attn.k`` and ``attn.v`` (the same U, the rows of
    B each layer's outputs), or the original three when :func:`save_peft` stacked them.

    ``lora_alpha`` / ``alpha_pattern`` / ``rank_pattern`` and ``use_rslora`` (scale
    ``alpha / sqrt(r)``) give each layer's alpha. ``lora_dropout`` becomes the dropout of the LoRA
    layers this call adds (layers the model already has keep theirs). Errors, each listing every
    problem found: a missing folder or file, ``peft_type`` other than LORA, options that change the
    adapter beyond lora_A and lora_B (DoRA, biases, modules_to_save ...) or its base (an
    ``init_lora_weights`` such as PiSSA's, which changed the base weights: peft's
    ``path_initial_model_for_weight_conversion`` converts such adapters), keys for modules the
    model lacks or of other kinds (an ``lm_head`` adapter where the model ties its output layer to
    the embedding, as GPT-2 does), shapes of another model's size, ranks that the config or the
    model's LoRA layers contradict, and a copy of a base weight that is not the model's (peft's
    save_pretrained writes lm_head's when it is a target, and its from_pretrained loads it over the
    model's; tilegraph keeps the model's).
    """
    from tilegraph.peft import LoTRLinear, lora_layers

    folder = Path(path)
    where = f"tilegraph.peft_hf.load_peft({folder})"
    config = _read_adapter_config(folder, where)
    _check_config(config, where)
    weights = _open_weights(folder, where)
    targets = _targets(model, where)
    pairs, bases = _pairs(weights, targets, model.arch, where,
                          tied=bool(getattr(getattr(model, "config", None), "tie_embeddings", False)))
    plan = _plan(pairs, targets, config, weights, where)
    _check_base_copies(bases, targets, model, weights, where)
    layers = _layers(model)
    problems = [f"{name} is a LoTR layer" for t, _ in plan for name in t.parts if isinstance(layers[name], LoTRLinear)]
    lora = lora_layers(model)
    wanted = {name: u.shape[1] for t, entries in plan for name, (u, _, _) in zip(t.parts, entries)}
    if lora:
        problems += [f"{n}: the model's LoRA layer has rank {lora[n].rank}, the adapter {r}" if n in lora
                     else f"{n} has no LoRA layer in the model" for n, r in wanted.items()
                     if n not in lora or lora[n].rank != r]
        problems += [f"the model's LoRA layer {n} has no adapter in the folder" for n in lora if n not in wanted]
    else:
        problems += [f"{n}: rank {r} exceeds min(in, out) = {min(layers[n].weight.shape)} of a "
                     f"{tuple(layers[n].weight.shape)} layer" for n, r in wanted.items()
                     if r > min(layers[n].weight.shape)]
    if problems:
        raise TileError(where, "adapters that fit the model's layers", "; ".join(problems))
    if not lora:
        _apply(model, plan, config.get("lora_dropout") or 0.0)
        lora = lora_layers(model)
    for t, entries in plan:
        for name, (u, v, alpha) in zip(t.parts, entries):
            layer = lora[name]
            layer.lora_u.assign(np.asarray(u, dtype=layer.lora_u.dtype))
            layer.lora_v.assign(np.asarray(v, dtype=layer.lora_v.dtype))
            layer.alpha = float(alpha)
    return model


def _apply(model: Module, plan, dropout: float) -> None:
    """LoRA layers of the plan's ranks and alphas on a model that has none."""
    from tilegraph.peft import apply_lora

    for t, entries in plan:
        for name, (u, _, alpha) in zip(t.parts, entries):
            apply_lora(model, [name], rank=u.shape[1], alpha=alpha, dropout=dropout)


def _read_adapter_config(folder: Path, where: str) -> dict:
    if not folder.is_dir():
        raise TileError(where, f"a peft adapter folder ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})",
                        "no such folder" if not folder.exists() else f"{folder} is not a folder")
    file = folder / ADAPTER_CONFIG
    if not file.is_file():
        held = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        named = named_adapter_folders(folder)
        said = (f"; peft's save_pretrained wrote its adapters named other than 'default' into subfolders: load one of "
                f"{', '.join(str(folder / n) for n in named)}" if named else "")
        raise TileError(where, f"a peft adapter folder holds {ADAPTER_CONFIG}",
                        f"none in {folder} (holds: {held}){said}")
    if file.stat().st_size > _MAX_CONFIG_BYTES:
        raise TileError(where, f"{ADAPTER_CONFIG} of at most {_MAX_CONFIG_BYTES} bytes", f"{file.stat().st_size} bytes")
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise TileError(where, f"{ADAPTER_CONFIG} must be a JSON object", f"{file}: {str(e)[:200]}") from None
    if not isinstance(config, dict):
        raise TileError(where, f"{ADAPTER_CONFIG} must be a JSON object", f"{type(config).__name__}")
    return config


def named_adapter_folders(folder) -> list[str]:
    """The subfolders of ``folder`` holding an ``adapter_config.json``: peft's ``save_pretrained``
    writes each adapter not named "default" into one named after it."""
    folder = Path(folder)
    try:
        return sorted(p.name for p in folder.iterdir() if (p / ADAPTER_CONFIG).is_file())
    except OSError:
        return []


def _positive(v) -> bool:
    return (not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(v) and v > 0)


def _check_config(config: dict, where: str) -> None:
    """peft_type LORA, r and lora_alpha > 0, patterns as peft writes them, no unsupported option."""
    if config.get("peft_type") != "LORA":
        raise TileError(where, 'a LoRA adapter: peft_type "LORA" in ' + ADAPTER_CONFIG,
                        f"peft_type {config.get('peft_type')!r}")
    problems = [f"{key}={json.dumps(config[key])[:80]} (tilegraph reads {ok_words})"
                for key, (ok, ok_words) in _UNSUPPORTED.items()
                if key in config and not any(config[key] == v and type(config[key]) is type(v) for v in ok)]
    if problems:
        raise TileError(where, "a plain LoRA adapter (lora_A and lora_B only); unsupported options set",
                        "; ".join(problems))
    bad = []
    if isinstance(config.get("r"), bool) or not isinstance(config.get("r"), int) or config["r"] < 1:
        bad.append(f"r={config.get('r')!r} (an int >= 1)")
    if not _positive(config.get("lora_alpha")):
        bad.append(f"lora_alpha={config.get('lora_alpha')!r} (a number > 0)")
    for key, test in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                      ("alpha_pattern", _positive)):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict):
            bad.append(f"{key}={pattern!r} (an object)")
            continue
        for k, v in pattern.items():
            if not test(v):
                bad.append(f"{key}[{k!r}]={v!r}")
            try:
                re.compile(k)
            except re.error as e:
                bad.append(f"{key} key {k!r} is not a regular expression ({e})")
    if bad:
        raise TileError(where, f"{ADAPTER_CONFIG} values as peft's LoraConfig takes them", "; ".join(bad))


def _open_weights(folder: Path, where: str):
    from tilegraph.io import safetensors as st

    file = folder / ADAPTER_WEIGHTS
    if not file.is_file():
        held = ", ".join(sorted(p.name for p in folder.iterdir()))
        extra = " (adapter_model.bin is a pickle, which tilegraph does not read)" if "adapter_model.bin" in held else ""
        raise TileError(where, f"a peft adapter folder holds {ADAPTER_WEIGHTS}{extra}", f"{folder} holds: {held}")
    return st.SafetensorsFile(file)


def _pairs(weights, targets: dict[str, _Target], arch: str, where: str,
           tied: bool = False) -> tuple[dict[str, tuple[str, str]], dict[str, str]]:
    """HF module name -> (lora_A key, lora_B key), and HF module name -> the key of the copy of its
    base weight (``base_layer.weight``) of the adapted modules that have one; every other key, a
    module the model lacks and a half pair are errors, all named at once. ``tied``: the model
    ties its output layer to the embedding (then HF's ``lm_head`` is no Linear of its own)."""
    found: dict[str, dict[str, str]] = {}
    bases: dict[str, str] = {}
    embeddings: dict[str, None] = {}  # modules with peft's Embedding adapter (whose base_layer copy is not named)
    problems = []
    for key in weights:
        m = _KEY.fullmatch(key)
        base = _BASE_KEY.fullmatch(key)
        embedding = _EMBEDDING_KEY.fullmatch(key)
        if base is not None and key.startswith(KEY_PREFIX):
            bases[base.group(1)[len(KEY_PREFIX):]] = key
            continue
        if embedding is not None and key.startswith(KEY_PREFIX):
            embeddings.setdefault(embedding.group(1)[len(KEY_PREFIX):], None)
            problems.append(f"unexpected key {key} (peft's adapter of an nn.Embedding, "
                            f"{embedding.group(1)[len(KEY_PREFIX):]}: tilegraph's LoRA adapts Linear layers only)")
            continue
        if m is None or not key.startswith(KEY_PREFIX):
            problems.append(f"unexpected key {key} (tilegraph reads {KEY_PREFIX}<module>.lora_A.weight and "
                            ".lora_B.weight only)")
            continue
        found.setdefault(m.group(1)[len(KEY_PREFIX):], {})[m.group(2)] = key
    for module, ab in sorted(found.items()):
        if module not in targets and tied and module == "lm_head":
            problems.append(f"lm_head has an adapter, and the {arch} model ties its output layer to the embedding "
                            "(tie_embeddings=True: the logits use the embedding's weight, no Linear layer to adapt; "
                            "peft's LoRA on a tied lm_head has no tilegraph form)")
        elif module not in targets:
            problems.append(f"no linear module {module} in the {arch} model")
        elif set(ab) != {"A", "B"}:
            problems.append(f"{module} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
    problems += [f"unexpected key {key} (a base weight of a module without lora_A and lora_B)"
                 for module, key in sorted(bases.items()) if module not in found and module not in embeddings]
    if not found and not problems:
        problems.append("no lora_A / lora_B tensors")
    if problems:
        raise TileError(where, f"{ADAPTER_WEIGHTS} to hold LoRA adapters for modules of the model "
                        f"({len(problems)} problem{'s' if len(problems) != 1 else ''})", "; ".join(problems))
    return {m: (ab["A"], ab["B"]) for m, ab in found.items()}, bases


def _check_base_copies(bases: dict[str, str], targets: dict[str, _Target], model: Module, weights,
                       where: str) -> None:
    """The copies of base weights in the folder (peft's save_pretrained writes lm_head's when it is
    a target) equal the model's: peft's from_pretrained loads them over its base model's weights,
    and tilegraph keeps the model's."""
    from tilegraph._lower import compute
    from tilegraph.peft import QuantizedTensor

    layers = _layers(model)
    problems = []
    for module, key in sorted(bases.items()):
        t = targets[module]
        held = [layers[p].weight for p in t.parts]
        parts = compute(*[w.dequantized() if isinstance(w, QuantizedTensor) else w for w in held])
        ours = np.concatenate(parts, axis=1)  # (in, out): a Conv1D's layout, nn.Linear's transposed
        ours = ours if t.conv1d else ours.T
        theirs = np.asarray(weights[key], dtype=np.float64)
        if theirs.shape != ours.shape:
            problems.append(f"{key}: shape {theirs.shape}, the model's {ours.shape}")
        elif not np.allclose(theirs, ours, rtol=1e-5, atol=1e-6):
            problems.append(f"{key} differs from the model's {module}.weight by up to "
                            f"{np.abs(theirs - ours).max():.3g}")
    if problems:
        raise TileError(where, "copies of base weights (base_layer.weight: peft's save_pretrained writes "
                        "lm_head's, which its from_pretrained loads over the model's) equal to the model's "
                        "weights, which tilegraph keeps: load the adapters onto the model they were trained "
                        "on (peft's save_pretrained(..., save_embedding_layers=False) leaves the copy out)",
                        "; ".join(problems))


def _pattern_value(patterns: dict, module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key matching a dotted suffix of the name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _plan(pairs: dict, targets: dict[str, _Target], config: dict, weights, where: str) -> list:
    """Per adapted HF module: (target, [(U, V, alpha) per tilegraph part]); shapes checked first."""
    problems = []
    for module, (ka, kb) in sorted(pairs.items()):
        t = targets[module]
        sa, sb = weights.infos[ka].shape, weights.infos[kb].shape
        rank = sa[0] if len(sa) == 2 else None
        expected = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if len(sa) != 2 or sa[1] != t.in_features or sb != (t.out_features, rank):
            problems.append(f"{module}: lora_A {sa}, lora_B {sb}; the model's ({t.out_features} x "
                            f"{t.in_features}) layer takes lora_A (r, {t.in_features}), lora_B ({t.out_features}, r)")
        elif rank != expected:
            problems.append(f"{module}: rank {rank} in the weights, {expected} in {ADAPTER_CONFIG}")
        elif weights.infos[ka].numpy_dtype.kind != "f" or weights.infos[kb].numpy_dtype.kind != "f":
            problems.append(f"{module}: dtypes {weights.infos[ka].dtype}, {weights.infos[kb].dtype} (floats)")
    if problems:
        raise TileError(where, "adapters of the model's shapes", "; ".join(problems))
    blocks = _blocks(weights, where)
    plan = []
    for module, (ka, kb) in sorted(pairs.items()):
        a, b = np.asarray(weights[ka]), np.asarray(weights[kb])
        rank = a.shape[0]
        alpha = _pattern_value(config.get("alpha_pattern"), module, config["lora_alpha"])
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        plan.append((targets[module], _from_peft(targets[module], a, b, scale, blocks.get(module))))
    return plan


def _blocks(weights, where: str) -> dict:
    raw = (weights.metadata or {}).get(BLOCKS_KEY)
    if raw is None:
        return {}
    try:
        blocks = json.loads(raw)
        ok = isinstance(blocks, dict) and all(
            isinstance(b, dict) and isinstance(b.get("ranks"), list) and isinstance(b.get("alphas"), list)
            and len(b["ranks"]) == len(b["alphas"]) and all(isinstance(r, int) and r > 0 for r in b["ranks"])
            and all(_positive(x) for x in b["alphas"]) for b in blocks.values())
    except ValueError:
        ok = False
    if not ok:
        raise TileError(where, f"the {BLOCKS_KEY} metadata as save_peft writes it: module -> "
                        "{ranks: [...], alphas: [...]}", raw[:200])
    return blocks


def _from_peft(t: _Target, a: np.ndarray, b: np.ndarray, scale: float, block: dict | None) -> list:
    """[(U (in, r), V (r, out), alpha) per part] of one HF module's lora_A, lora_B and scale."""
    bounds = np.cumsum((0,) + t.sizes)
    rows = [slice(bounds[i], bounds[i + 1]) for i in range(len(t.sizes))]
    if block is not None and len(block["ranks"]) == len(t.parts) and sum(block["ranks"]) == a.shape[0]:
        edges = np.cumsum([0] + block["ranks"])
        cols = [slice(edges[i], edges[i + 1]) for i in range(len(t.parts))]
        mask = np.zeros(b.shape, bool)
        for r, c in zip(rows, cols):
            mask[r, c] = True
        if not np.any(b[~mask]):  # still block-diagonal (not trained on as one adapter in peft)
            out = []
            for r, c, rank, alpha in zip(rows, cols, block["ranks"], block["alphas"]):
                out.append((a[c].T, b[r, c].T * (scale * rank / alpha), alpha))
            return out
    rank = a.shape[0]
    return [(a.T, b[r].T, scale * rank) for r in rows]
