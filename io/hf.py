"""Hugging Face model folders (config.json + safetensors) to tilegraph models and back.

Each architecture is three declarative tables: HF config keys -> config fields, HF config values we
require (features the model code does not implement), and HF tensor names -> tilegraph parameter
paths with the layout change between them. Nothing here imports torch or transformers.

>>> from tilegraph import models
>>> model = models.from_hf("gpt2-folder")   # doctest: +SKIP
>>> model.to_hf("gpt2-copy")                # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from tilegraph._config import require_float_dtype
from tilegraph._errors import TileError

from . import safetensors as st
from ._store import user_path, write_failure

__all__ = ["Rule", "NameMap", "ConfigKey", "HFSpec", "SPECS", "load_hf", "save_hf", "load_hf_weights", "to_hf_state",
           "hf_config", "hf_dtype"]

CONFIG_NAME = "config.json"
_MAX_CONFIG_BYTES = 16 * 1024 * 1024  # real config.json files are a few kB; a larger one is not a config


# --------------------------------------------------------------------------------- name maps ----
@dataclass(frozen=True)
class Rule:
    """One HF tensor and the tilegraph parameter(s) it holds; ``{i}`` stands for a layer index.

    With several tilegraph parameters, HF concatenates them along ``split`` (a dim of the HF
    tensor); with ``transpose``, HF stores the (in, out) tilegraph matrix as (out, in).
    """

    hf: str
    tg: tuple[str, ...]
    transpose: bool = False
    split: int | None = None

    def to_hf(self, parts: list[np.ndarray]) -> np.ndarray:
        parts = [p.T if self.transpose else p for p in parts]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=self.split)

    def hf_shape(self, tg_shapes: list[tuple]) -> tuple:
        shapes = [tuple(reversed(s)) if self.transpose else tuple(s) for s in tg_shapes]
        if len(shapes) == 1:
            return shapes[0]
        out = list(shapes[0])
        out[self.split] = sum(s[self.split] for s in shapes)
        return tuple(out)

    def to_tilegraph(self, array: np.ndarray, tg_shapes: list[tuple]) -> list[np.ndarray]:
        if len(tg_shapes) == 1:
            parts = [array]
        else:
            sizes = [(tuple(reversed(s)) if self.transpose else s)[self.split] for s in tg_shapes]
            parts = np.split(array, np.cumsum(sizes)[:-1], axis=self.split)
        return [p.T if self.transpose else p for p in parts]


def rule(hf: str, *tg: str, transpose: bool = False, split: int | None = None) -> Rule:
    return Rule(hf, tuple(tg), transpose, split)


@dataclass(frozen=True)
class NameMap:
    """HF tensor names <-> tilegraph parameter paths for one architecture."""

    rules: tuple[Rule, ...]
    #: prefix that some checkpoints leave out (a base model saved without its LM head wrapper)
    bare_prefix: str = ""
    #: regular expressions of HF tensors that are buffers, not parameters; skipped on import
    ignore: tuple[str, ...] = ()
    #: the HF output weight, which a checkpoint of a model with tied embeddings may still carry
    tied_output: str = ""

    def expand(self, n_layers: int, have: Mapping[str, tuple]) -> dict[str, tuple[Rule, list[str]]]:
        """HF name -> (rule, tilegraph names) for a model whose parameters and shapes are ``have``."""
        out = {}
        for r in self.rules:
            for i in (range(n_layers) if "{i}" in r.hf else [None]):
                tg = [t.format(i=i) for t in r.tg]
                present = [t in have for t in tg]
                if any(present) and not all(present):  # pragma: no cover - a table or model bug
                    raise AssertionError(f"{r.hf}: only some of {tg} exist in the model")
                if all(present):
                    out[r.hf.format(i=i)] = (r, tg)
        return out

    def canonical(self, name: str, known) -> str:
        """``name`` as the table spells it: with the bare prefix added when only that form is ``known``."""
        if name not in known and self.bare_prefix and self.bare_prefix + name in known:
            return self.bare_prefix + name
        return name

    def find(self, name: str, present) -> str | None:
        """The name under which ``present`` holds the table's tensor ``name`` (with or without the
        bare prefix), or None."""
        if name in present:
            return name
        if self.bare_prefix and name.startswith(self.bare_prefix) and name[len(self.bare_prefix):] in present:
            return name[len(self.bare_prefix):]
        return None

    def layers_in(self, present) -> set[int]:
        """The layer indices that tensor names in ``present`` carry (``{i}`` of the table's rules)."""
        prefixes = {r.hf.split("{i}")[0] for r in self.rules if "{i}" in r.hf}
        if self.bare_prefix:
            prefixes |= {p.removeprefix(self.bare_prefix) for p in prefixes}
        pattern = re.compile("(?:" + "|".join(map(re.escape, sorted(prefixes))) + r")(\d+)\.")
        return {int(m.group(1)) for m in map(pattern.match, present) if m}

    def ignored(self, name: str, tied: bool) -> bool:
        if tied and name == self.tied_output:
            return True
        return any(re.fullmatch(p, n) for p in self.ignore for n in (name, self.bare_prefix + name))


# --------------------------------------------------------------------------------- config maps ----
_REQUIRED = object()


def _finite(v) -> float | None:
    """A JSON number as a finite float, else None (bools, strings, NaN, infinities, 1e400-sized ints)."""
    if type(v) not in (int, float):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


#: ConfigKey.kind -> (what the value must be, the test)
_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "size": ("a positive integer", lambda v: type(v) is int and v > 0),
    "eps": ("a finite number >= 0", lambda v: _finite(v) is not None and v >= 0),
    "bool": ("true or false", lambda v: type(v) is bool),
    "prob": ("a number in [0, 1)", lambda v: _finite(v) is not None and 0 <= v < 1),
}


@dataclass(frozen=True)
class ConfigKey:
    """An HF config.json key that becomes a config field (``default``: HF's value when absent;
    ``kind``: a key of ``_KINDS``, what its value must be)."""

    hf: str
    field: str
    default: Any = _REQUIRED
    kind: str = "size"


@dataclass(frozen=True)
class Extent:
    """A config size that a tensor present in the checkpoint shows: dim ``dim`` of HF tensor
    ``tensor`` must be ``size(config)``. Checked from the headers before any model is built, so
    that a config.json claiming a million layers or a 10^9 width fails fast instead of allocating."""

    key: str  # the HF config key named in errors
    field: str
    tensor: str
    dim: int
    size: Callable[[Any], int]


@dataclass(frozen=True)
class HFSpec:
    model_type: str
    architectures: tuple[str, ...]
    keys: tuple[ConfigKey, ...]
    #: HF config values the model code implements: key -> (allowed values; the first is written)
    supported: dict
    names: NameMap
    extents: tuple[Extent, ...]
    #: parameters of a model of a config, from the config alone (the memory check before building)
    n_params: Callable[[Any], int]
    #: other names HF gives a supported value: key -> {name: the supported value it names}
    aliases: Mapping[str, Mapping[Any, Any]] = dataclasses.field(default_factory=dict)


def _gpt2_spec() -> HFSpec:
    h = "transformer.h.{i}."
    b = "blocks.{i}."
    names = NameMap(
        rules=(
            rule("transformer.wte.weight", "wte.weight"),
            rule("transformer.wpe.weight", "wpe.weight"),
            rule(h + "ln_1.weight", b + "ln_1.weight"),
            rule(h + "ln_1.bias", b + "ln_1.bias"),
            # GPT-2's Conv1D stores (in, out) like tilegraph; q, k and v sit side by side in c_attn
            rule(h + "attn.c_attn.weight", b + "attn.q.weight", b + "attn.k.weight", b + "attn.v.weight", split=1),
            rule(h + "attn.c_attn.bias", b + "attn.q.bias", b + "attn.k.bias", b + "attn.v.bias", split=0),
            rule(h + "attn.c_proj.weight", b + "attn.o.weight"),
            rule(h + "attn.c_proj.bias", b + "attn.o.bias"),
            rule(h + "ln_2.weight", b + "ln_2.weight"),
            rule(h + "ln_2.bias", b + "ln_2.bias"),
            rule(h + "mlp.c_fc.weight", b + "mlp.fc1.weight"),
            rule(h + "mlp.c_fc.bias", b + "mlp.fc1.bias"),
            rule(h + "mlp.c_proj.weight", b + "mlp.fc2.weight"),
            rule(h + "mlp.c_proj.bias", b + "mlp.fc2.bias"),
            rule("transformer.ln_f.weight", "ln_f.weight"),
            rule("transformer.ln_f.bias", "ln_f.bias"),
            rule("lm_head.weight", "lm_head.weight", transpose=True),  # nn.Linear: (out, in)
        ),
        bare_prefix="transformer.",  # the original "gpt2" checkpoints name tensors "h.0...." and "wte.weight"
        ignore=(r"transformer\.h\.\d+\.attn\.(masked_)?bias",),  # causal-mask buffers of old checkpoints
        tied_output="lm_head.weight",
    )
    keys = (
        ConfigKey("vocab_size", "vocab_size", 50257),
        ConfigKey("n_positions", "max_seq_len", 1024),
        ConfigKey("n_embd", "dim", 768),
        ConfigKey("n_layer", "n_layers", 12),
        ConfigKey("n_head", "n_heads", 12),
        ConfigKey("n_inner", "hidden", None),
        ConfigKey("layer_norm_epsilon", "norm_eps", 1e-5, "eps"),
        ConfigKey("tie_word_embeddings", "tie_embeddings", True, "bool"),
        # dropout in training, HF's defaults where absent (transformers' GPT2Config: 0.1 each)
        ConfigKey("embd_pdrop", "embd_dropout", 0.1, "prob"),
        ConfigKey("attn_pdrop", "attn_dropout", 0.1, "prob"),
        ConfigKey("resid_pdrop", "resid_dropout", 0.1, "prob"),
    )
    extents = (
        Extent("vocab_size", "vocab_size", "transformer.wte.weight", 0, lambda c: c.vocab_size),
        Extent("n_embd", "dim", "transformer.wte.weight", 1, lambda c: c.dim),
        Extent("n_positions", "max_seq_len", "transformer.wpe.weight", 0, lambda c: c.max_seq_len),
        Extent("n_embd", "dim", "transformer.ln_f.weight", 0, lambda c: c.dim),
        Extent("n_inner", "hidden", "transformer.h.0.mlp.c_fc.weight", 1, lambda c: c.hidden),
    )

    def n_params(c) -> int:
        # per layer: two LayerNorms, q, k, v and o with biases, the MLP's two matrices with biases
        per_layer = 2 * 2 * c.dim + 4 * c.dim * (c.dim + 1) + 2 * c.dim * c.hidden + c.hidden + c.dim
        head = 0 if c.tie_embeddings else c.vocab_size * c.dim
        return (c.vocab_size + c.max_seq_len) * c.dim + c.n_layers * per_layer + 2 * c.dim + head

    supported = {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both are GELU's tanh form
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "add_cross_attention": (False,),
    }
    return HFSpec("gpt2", ("GPT2LMHeadModel",), keys, supported, names, extents, n_params)


def _llama_spec() -> HFSpec:
    h = "model.layers.{i}."
    b = "blocks.{i}."
    names = NameMap(
        rules=(
            rule("model.embed_tokens.weight", "embed.weight"),
            rule(h + "input_layernorm.weight", b + "attn_norm.weight"),
            # nn.Linear stores (out, in); tilegraph stores (in, out)
            rule(h + "self_attn.q_proj.weight", b + "attn.q.weight", transpose=True),
            rule(h + "self_attn.k_proj.weight", b + "attn.k.weight", transpose=True),
            rule(h + "self_attn.v_proj.weight", b + "attn.v.weight", transpose=True),
            rule(h + "self_attn.o_proj.weight", b + "attn.o.weight", transpose=True),
            rule(h + "post_attention_layernorm.weight", b + "mlp_norm.weight"),
            rule(h + "mlp.gate_proj.weight", b + "mlp.gate.weight", transpose=True),
            rule(h + "mlp.up_proj.weight", b + "mlp.up.weight", transpose=True),
            rule(h + "mlp.down_proj.weight", b + "mlp.down.weight", transpose=True),
            rule("model.norm.weight", "norm.weight"),
            rule("lm_head.weight", "lm_head.weight", transpose=True),
        ),
        bare_prefix="model.",
        ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", r"model\.rotary_emb\.inv_freq"),
        tied_output="lm_head.weight",
    )
    keys = (
        ConfigKey("vocab_size", "vocab_size", 32000),
        ConfigKey("max_position_embeddings", "max_seq_len", 2048),
        ConfigKey("hidden_size", "dim", 4096),
        ConfigKey("num_hidden_layers", "n_layers", 32),
        ConfigKey("num_attention_heads", "n_heads", 32),
        ConfigKey("num_key_value_heads", "n_kv_heads", None),
        ConfigKey("intermediate_size", "hidden", 11008),
        ConfigKey("rms_norm_eps", "norm_eps", 1e-6, "eps"),
        ConfigKey("tie_word_embeddings", "tie_embeddings", False, "bool"),
        ConfigKey("attention_dropout", "attn_dropout", 0.0, "prob"),
    )
    extents = (
        Extent("vocab_size", "vocab_size", "model.embed_tokens.weight", 0, lambda c: c.vocab_size),
        Extent("hidden_size", "dim", "model.embed_tokens.weight", 1, lambda c: c.dim),
        Extent("hidden_size", "dim", "model.norm.weight", 0, lambda c: c.dim),
        Extent("intermediate_size", "hidden", "model.layers.0.mlp.gate_proj.weight", 0, lambda c: c.hidden),
        # (out, in) = (n_kv_heads * head_dim, dim)
        Extent("num_key_value_heads", "n_kv_heads", "model.layers.0.self_attn.k_proj.weight", 0,
               lambda c: c.n_kv_heads * c.head_dim),
    )

    def n_params(c) -> int:
        kv = c.n_kv_heads * c.head_dim
        per_layer = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.hidden + 2 * c.dim
        return (2 - bool(c.tie_embeddings)) * c.vocab_size * c.dim + c.n_layers * per_layer + c.dim

    supported = {
        "hidden_act": ("silu",),
        "attention_bias": (False,),
        "mlp_bias": (False,),
    }
    # transformers' ACT2FN: "swish" is SiLU too (it was refused as a feature tilegraph lacks)
    aliases = {"hidden_act": {"swish": "silu"}}
    return HFSpec("llama", ("LlamaForCausalLM",), keys, supported, names, extents, n_params, aliases)


SPECS = {"gpt2": _gpt2_spec(), "llama": _llama_spec()}


# ------------------------------------------------------------------------------ config.json ----
def _read_config(folder: Path, where: str) -> dict:
    path = folder / CONFIG_NAME
    try:
        size = path.stat().st_size
    except OSError:
        size = 0  # reading says what is wrong
    if size > _MAX_CONFIG_BYTES:
        raise TileError(where, f"{CONFIG_NAME} must be a JSON object of at most {_MAX_CONFIG_BYTES} bytes",
                        f"{path}: {size} bytes")
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise TileError(where, f"a Hugging Face model folder needs {CONFIG_NAME}",
                        f"none in {folder}" if folder.is_dir() else "the folder does not exist") from None
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, an int of over 4300 digits
        raise TileError(where, f"{CONFIG_NAME} must be a JSON object", f"{path}: {str(e)[:200]}") from None
    except RecursionError:
        raise TileError(where, f"{CONFIG_NAME} must be a JSON object of HF settings; it nests too deeply",
                        str(path)) from None
    if not isinstance(cfg, dict):
        raise TileError(where, f"{CONFIG_NAME} must be a JSON object", f"{path}: {type(cfg).__name__}")
    return cfg


def _rope_base(hf: dict, where: str) -> float:
    """rope_theta from either config layout: top-level (older) or inside rope_parameters (newer)."""
    found = {}
    for key in ("rope_parameters", "rope_scaling"):
        p = hf.get(key)
        if p is not None and not isinstance(p, dict):
            raise TileError(where, f"{CONFIG_NAME}: {key} must be an object or null", st._brief(p))
        found[key] = p or {}
        kind = found[key].get("rope_type", found[key].get("type", "default"))
        if kind != "default":
            raise TileError(where, "only the default rotary embedding is implemented (no rope scaling)",
                            f"rope_type={st._brief(kind)} (in {CONFIG_NAME}'s {key})")
    theta = found["rope_parameters"].get("rope_theta", hf.get("rope_theta", 10000.0))
    if _finite(theta) is None or theta <= 0:
        raise TileError(where, f"{CONFIG_NAME}: rope_theta must be a finite number > 0", st._brief(theta))
    return float(theta)


def _spec_for(hf: dict, where: str) -> HFSpec:
    kind = hf.get("model_type")
    if not isinstance(kind, str) or kind not in SPECS:  # a list is not even hashable
        raise TileError(where, f"unsupported model_type; supported: {', '.join(SPECS)}", st._brief(kind))
    return SPECS[kind]


def hf_config(hf: dict, where: str = "tilegraph.io.hf"):
    """The tilegraph config of an HF config dict, and the HF keys it did not use."""
    from tilegraph.models import ARCHITECTURES

    spec = _spec_for(hf, where)
    # first the types and signs of the values, all at once: a size that is a str, a float or
    # negative would otherwise surface as a TypeError deep inside, or be multiplied out
    invalid, fields = [], {}
    for k in spec.keys:
        value = hf.get(k.hf)
        if value is None:  # absent or null: HF's default
            if k.default is _REQUIRED:  # pragma: no cover - every key has HF's default
                invalid.append(f"{k.hf} is missing")
            fields[k.field] = k.default
            continue
        what, ok = _KINDS[k.kind]
        if not ok(value):
            invalid.append(f"{k.hf}={st._brief(value)} (expected {what})")
        fields[k.field] = value
    head_dim = hf.get("head_dim") if spec.model_type == "llama" else None
    if head_dim is not None and not _KINDS["size"][1](head_dim):
        invalid.append(f"head_dim={st._brief(head_dim)} (expected {_KINDS['size'][0]})")
        head_dim = None
    if invalid:
        raise TileError(where, f"{CONFIG_NAME} has values a {spec.model_type} config cannot take",
                        "; ".join(invalid))
    problems = []
    for key, allowed in spec.supported.items():
        value = hf.get(key)
        if isinstance(value, str):  # (a list or an object from a crafted config.json is no dict key)
            value = spec.aliases.get(key, {}).get(value, value)
        if key in hf and value not in allowed:
            problems.append(f"{key}={st._brief(hf[key])} (supported: {', '.join(map(repr, allowed))})")
    if spec.model_type == "llama":
        fields["rope_base"] = _rope_base(hf, where)
        if head_dim is not None and head_dim * fields["n_heads"] != fields["dim"]:
            problems.append(f"head_dim={head_dim} (supported: hidden_size / num_attention_heads = "
                            f"{fields['dim'] // fields['n_heads']})")
    if problems:
        raise TileError(where, f"config.json asks for {spec.model_type} features tilegraph does not implement",
                        "; ".join(problems))
    config_cls = ARCHITECTURES[spec.model_type][0]
    used = {k.hf for k in spec.keys} | set(spec.supported) | {"model_type", "architectures", "rope_theta",
                                                              "rope_parameters", "rope_scaling", "head_dim"}
    try:
        config = config_cls(**fields)
    except TileError as e:  # sizes that contradict each other (heads that do not divide the width, ...)
        raise TileError(where, f"{CONFIG_NAME} describes no valid {spec.model_type} model: {e.what}",
                        e.received) from None
    return config, {k: v for k, v in hf.items() if k not in used}


def _to_hf_config(model) -> dict:
    spec = SPECS[model.arch]
    cfg = model.config
    out = dict(getattr(model, "hf_extra", None) or {})
    out.update({"model_type": spec.model_type, "architectures": list(spec.architectures)})
    out.update({k.hf: getattr(cfg, k.field) for k in spec.keys})
    out.update({key: allowed[0] for key, allowed in spec.supported.items()})
    if spec.model_type == "llama":
        out["head_dim"] = cfg.head_dim
        out["rope_theta"] = cfg.rope_base
        out["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_base}
        out.pop("rope_scaling", None)
    out["torch_dtype"] = out["dtype"] = str(np.dtype(model.dtype))
    return out


# -------------------------------------------------------------------------------- weights ----
def load_hf_weights(model, path, *, where: str | None = None, checkpoint: st.Checkpoint | None = None) -> None:
    """Load the safetensors of an HF folder (or file) into ``model``, strictly: every missing,
    unexpected and mis-shaped tensor is reported at once. ``checkpoint``: ``path`` already opened."""
    path = Path(path)
    where = where or f"tilegraph.io.hf.load_hf_weights({path})"
    ckpt = st.open_checkpoint(path) if checkpoint is None else checkpoint
    expected, present, problems = _weight_problems(model, ckpt)
    if problems:
        raise _mismatch(where, model, problems)
    params = dict(model.named_parameters())
    state = {}
    for n, (r, tg) in expected.items():
        for t, part in zip(tg, r.to_tilegraph(ckpt[present[n]], [params[t].shape for t in tg])):
            state[t] = np.asarray(part, dtype=params[t].dtype)
    model.load_state_dict(state)


def _weight_problems(model, ckpt: st.Checkpoint) -> tuple[dict, dict, list[str]]:
    """``(expected, present, problems)``: HF name -> (rule, tilegraph names) of the tensors the
    model needs, canonical HF name -> the checkpoint's name of the tensors present, and one line
    per missing, unexpected, mis-shaped (expected and received shape) or non-float tensor."""
    names = SPECS[model.arch].names
    params = dict(model.named_parameters())
    expected = names.expand(model.config.n_layers, {n: p.shape for n, p in params.items()})
    present = {names.canonical(n, expected): n for n in ckpt}
    tied = bool(model.config.tie_embeddings)
    problems = [f"missing: {n}" for n in expected if n not in present]
    problems += [f"unexpected: {present[n]}" for n in present if n not in expected and not names.ignored(n, tied)]
    for n, (r, tg) in expected.items():
        if n not in present:
            continue
        info = ckpt.info(present[n])
        want = r.hf_shape([params[t].shape for t in tg])
        if info.shape != want:
            problems.append(f"shape of {present[n]}: expected {want}, got {info.shape}")
        elif info.numpy_dtype.kind != "f":
            problems.append(f"dtype of {present[n]}: expected a float, got {info.dtype}")
    return expected, present, problems


def _mismatch(where: str, model, problems: list[str], note: str = "") -> TileError:
    """The one error of a strict load: every problem of :func:`_weight_problems`, ``note`` after them."""
    count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
    return TileError(where, f"the checkpoint does not match the {SPECS[model.arch].model_type} model ({count})",
                     "; ".join(problems) + note)


def to_hf_state(model, state: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """HF-named arrays of the model's parameters, or of ``state`` (any arrays named like the model's
    parameters, e.g. their gradients). Weights held quantized (:func:`tilegraph.peft.from_quantized`)
    are written dequantized, as :func:`tilegraph.models.from_zarr` loads them."""
    from tilegraph._lower import compute

    from .zarr import _held_quantized

    where = "tilegraph.io.to_hf_state"
    if getattr(model, "arch", None) not in SPECS:
        raise TileError(where, f"no Hugging Face export for this model; supported: {', '.join(SPECS)}",
                        f"{type(model).__name__} {model!r:.60}")
    if state is not None and not isinstance(state, Mapping):
        raise TileError(where, "state must be a mapping of parameter names to arrays (or None)",
                        f"{type(state).__name__} {state!r:.60}")
    spec = SPECS[model.arch]
    quantized = _held_quantized(model)  # not Parameters: left out, transformers drew them at random
    if state is None:
        state = model.state_dict()
        state.update(zip(quantized, compute(*[q.dequantized() for q in quantized.values()]) if quantized else ()))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    shapes.update({n: q.shape for n, q in quantized.items() if n in state})
    expected = spec.names.expand(model.config.n_layers, shapes)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise TileError("tilegraph.io.hf.to_hf_state", "state lacks model parameters", ", ".join(missing))
    return {n: np.ascontiguousarray(r.to_hf([np.asarray(state[t]) for t in tg])) for n, (r, tg) in expected.items()}


def _available_memory() -> int | None:
    """Bytes of memory this process can still take: what the OS calls available, within the
    container's (cgroup v2) limit; None when neither can be read."""
    found = []
    try:
        import psutil  # a dependency of distributed

        found.append(int(psutil.virtual_memory().available))
    except Exception:  # pragma: no cover - psutil missing or unsupported here
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def _count(n: int) -> str:
    # past 2**80 the digits say nothing more, and past 4300 digits Python refuses to print them
    return f"{n:,}" if n < 2**80 else f"about 2^{n.bit_length() - 1}"


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:,.2f} GiB)" if n < 2**80 else f"{_count(n)} bytes"


#: a model whose config describes more parameters than the weights present hold is still built
#: (without values) to name the missing and mis-shaped tensors when it has at most this many times
#: the values present plus _REPORT_SLACK: a few tensors missing from a real checkpoint. Past it
#: (a config claiming a 10^9 width the absent tensors would have shown) only the counts are reported.
_REPORT_FACTOR, _REPORT_SLACK = 2, 2**20


def _check_sizes(spec: HFSpec, config, hf: dict, ckpt: st.Checkpoint, dtype, where: str) -> TileError | None:
    """The config's sizes against the tensors present (header shapes, no data read) and the
    model's bytes against the memory available, before a model of those sizes is built: a
    config.json claiming a million layers or a 10^9 width fails here in milliseconds instead of
    building for hours or exhausting memory. Tensors that are absent are left to the strict load.

    Returns, instead of raising, the error of a model with more parameters than the weights present
    hold when that model is small enough to build without values (``_REPORT_FACTOR``): the caller
    builds it to name every missing and mis-shaped tensor, and raises the returned error only when
    none is found. None: the sizes fit."""
    names = spec.names

    def shown(key: str, field: str) -> str:
        value = hf.get(key)
        if value is None:
            return f"{key} unset ({field}={st._brief(getattr(config, field))})"
        return f"{key}={st._brief(value)}"

    problems = []
    layers = names.layers_in(ckpt)
    numbered_from_0 = not layers or max(layers) == len(layers) - 1  # (distinct ints >= 0: they are 0..n-1)
    if len(layers) != config.n_layers or not numbered_from_0:  # no range(n_layers): n_layers may be 10^12
        key = next(k.hf for k in spec.keys if k.field == "n_layers")
        numbered = "" if numbered_from_0 else f" (numbered {st._brief(sorted(layers))})"
        problems.append(f"{shown(key, 'n_layers')} but the weights hold {len(layers)} layers{numbered}")
    for e in spec.extents:
        name = names.find(e.tensor, ckpt)
        if name is None:
            continue
        shape, want = ckpt.info(name).shape, e.size(config)
        if len(shape) <= e.dim or shape[e.dim] != want:
            problems.append(f"{shown(e.key, e.field)} but {name} in {ckpt.file_of(name).name} has shape {shape} "
                            f"(dim {e.dim} should be {st._brief(want)})")
    if problems:
        raise TileError(where, f"{CONFIG_NAME} does not match the weights present", "; ".join(problems))
    # what no single tensor shows (many layers of empty tensors, say) still cannot exceed the data
    n_params = spec.n_params(config)
    present = sum(math.prod(ckpt.info(name).shape) for name in ckpt)
    if n_params > present:
        error = TileError(where, f"{CONFIG_NAME} describes a {spec.model_type} model of {_count(n_params)} "
                          "parameters, more than the weights present hold", f"{present:,} values in {ckpt.path}")
        error.n_params, error.present = n_params, present
        if n_params <= _REPORT_FACTOR * present + _REPORT_SLACK:
            return error  # the caller names the tensors (memory is not needed: the load fails)
        raise error
    need = n_params * np.dtype(dtype).itemsize
    available = _available_memory()
    if available is not None and need > available:
        raise TileError(where, f"the {spec.model_type} model of {CONFIG_NAME} needs {_count(n_params)} parameters x "
                        f"{np.dtype(dtype).itemsize} bytes = {_bytes(need)}, more than the memory available",
                        f"{_bytes(max(available, 0))} available")
    return None


# ------------------------------------------------------------------------------ dtypes ----
#: config.json's torch_dtype (transformers 5: dtype) -> the dtype tilegraph computes in; bfloat16,
#: which tilegraph stores but does not compute in, is not here
_HF_DTYPES = {"float16": np.float16, "half": np.float16, "float32": np.float32, "float": np.float32,
              "float64": np.float64, "double": np.float64}
#: safetensors dtype -> the same, for a folder whose config.json names none
_ST_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _folder_dtype(hf: dict, ckpt: st.Checkpoint | None) -> np.dtype | None:
    """The dtype of a folder's weights: config.json's ``torch_dtype`` (or ``dtype``) when it is
    float16, float32 or float64; where it names none ("auto", absent) the one float dtype every
    float tensor is stored in; None otherwise (bfloat16, mixed, unknown)."""
    for key in ("torch_dtype", "dtype"):
        named = hf.get(key)
        if isinstance(named, str) and named.removeprefix("torch.") not in ("", "auto"):
            found = _HF_DTYPES.get(named.removeprefix("torch."))
            return None if found is None else np.dtype(found)
    if ckpt is None:
        return None
    stored = {ckpt.info(name).dtype for name in ckpt} - {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64",
                                                          "BOOL"}
    return np.dtype(_ST_DTYPES[stored.pop()]) if len(stored) == 1 and stored <= set(_ST_DTYPES) else None


def hf_dtype(path) -> np.dtype | None:
    """The dtype of the weights of the Hugging Face folder ``path``, as :func:`load_hf` with
    ``dtype=None`` loads them: config.json's ``torch_dtype`` (transformers 5 writes ``dtype``) when
    it is float16, float32 or float64, else, where it names none, the float dtype the tensors are
    stored in (all of them); None where neither says one (bfloat16, mixed dtypes) or the folder
    cannot be read (loading it says what is wrong).

    >>> import numpy as np, tempfile, tilegraph as tg
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     tg.models.build("gpt2-debug", dtype=np.float16).to_hf(tmp + "/hf")
    ...     hf_dtype(tmp + "/hf")
    dtype('float16')
    """
    folder = user_path(path, "tilegraph.io.hf.hf_dtype")
    try:
        hf = _read_config(folder, "tilegraph.io.hf.hf_dtype")
    except TileError:
        return None
    try:
        ckpt = st.open_checkpoint(folder)  # headers only
    except (TileError, OSError):
        ckpt = None
    return _folder_dtype(hf, ckpt)


# ------------------------------------------------------------------------------ folders ----
def load_hf(path, tiling=None, *, dtype=None):
    """A tilegraph model from an HF folder: config.json, then the (possibly sharded) safetensors.

    ``dtype``: the dtype of the model's parameters (float16, float32 or float64; the weights are
    converted as they load). None (the default) keeps the folder's (:func:`hf_dtype`: config.json's
    ``torch_dtype``, else the tensors' own), as transformers' ``torch_dtype="auto"`` does: a float16
    folder loads float16; a bfloat16 folder, which tilegraph does not compute in, or one whose
    dtype nothing says, loads float32. Pass ``dtype=np.float32`` to train an fp16 folder in
    float32 (``tilegraph train --init`` does).

    The config is checked against the tensor shapes in the safetensors headers and the model's
    size against the memory available before anything of the model's size is allocated.
    """
    from tilegraph.models import ARCHITECTURES

    folder = user_path(path, "tilegraph.models.from_hf")
    where = f"tilegraph.models.from_hf({folder})"
    if dtype is not None:
        dtype = require_float_dtype(where, dtype)  # before any file is read ('fp16', torch.float16: NumPy's)
    if folder.is_file():  # model.safetensors itself: "config.json ... Not a directory" said little
        raise TileError(where, "path must be a Hugging Face model folder (config.json + safetensors), not a file",
                        f"{folder} (its folder: {folder.parent})")
    hf = _read_config(folder, where)
    check_float_weights(hf, folder, where)  # before its architecture: a quantized one's is a float one's
    config, extra = hf_config(hf, where)
    spec = _spec_for(hf, where)
    check_weight_files(folder, where)
    ckpt = st.open_checkpoint(folder)  # headers only; the data is mapped when loaded
    if dtype is None:
        dtype = _folder_dtype(hf, ckpt) or np.dtype(np.float32)
    too_few = _check_sizes(spec, config, hf, ckpt, dtype, where)
    from tilegraph.nn import deferred_init

    with deferred_init():  # no random weights: every parameter is loaded (strictly) below
        model = ARCHITECTURES[spec.model_type][1](config, tiling, dtype=dtype)
    if too_few is not None:  # the weights hold fewer values than the model: name the tensors that lack them
        problems = _weight_problems(model, ckpt)[2]
        if problems:
            raise _mismatch(where, model, problems, f" (in all, the weights in {folder} hold {too_few.present:,} "
                            f"values of the {too_few.n_params:,} parameters {CONFIG_NAME} describes)")
        raise too_few
    load_hf_weights(model, folder, where=where, checkpoint=ckpt)
    model.hf_extra = extra  # HF-only keys (token ids, ...) that to_hf writes back
    return model


#: how to quantize in tilegraph's own format, as a quantized folder's error says it (the CLI: its command)
QUANTIZE_HINT = 'tilegraph.io.save_checkpoint(..., quantize="int4")'


def check_float_weights(hf: dict, folder: Path, where: str, quantize_hint: str = QUANTIZE_HINT) -> None:
    """A folder whose config.json (``hf``) holds a ``quantization_config`` (GPTQ, AWQ,
    bitsandbytes: packed integer weights under other tensor names, qweight, qzeros, scales, ...)
    is named as quantized, with how to get float weights: it failed as every Linear weight
    "missing" and its integer tensors "unexpected"."""
    q = hf.get("quantization_config")
    if q is None:
        return
    keys = [k for k in ("quant_method", "bits", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type")
            if isinstance(q, dict) and k in q]
    how = ", ".join(f"{k} {q[k]!r}" for k in keys) if keys else repr(q)[:80]
    raise TileError(where, "a Hugging Face folder of float weights (float32, float16 or bfloat16): this one is "
                    "quantized, its Linear weights packed integers under other names (qweight, qzeros, scales, ...), "
                    "which tilegraph does not read; dequantize it with the tool that quantized it (GPTQ, AWQ, "
                    "bitsandbytes) and save the float weights with save_pretrained, or start from the float model it "
                    f"was quantized from ({quantize_hint} quantizes that in tilegraph's own format)",
                    f"{folder}: {CONFIG_NAME} quantization_config ({how})")


def check_weight_files(folder: Path, where: str) -> None:
    """Refuse a folder without safetensors weights before any is read: one of PyTorch pickles
    only (:func:`_check_pickled_weights`), or one of none (it was named by the reader,
    "[tilegraph.io.safetensors.open_checkpoint(PATH)] ... none found")."""
    _check_pickled_weights(folder, where)
    if not any(folder.glob("*.safetensors")) and not (folder / st.INDEX_NAME).is_file():
        raise TileError(where, f"a Hugging Face folder with its weights: {st.SINGLE_NAME}, or shards with "
                        f"{st.INDEX_NAME}, beside {CONFIG_NAME}", f"{folder} holds no safetensors file")


def _check_pickled_weights(folder: Path, where: str) -> None:
    """A folder whose weights are PyTorch pickles only (``pytorch_model.bin``, sharded or not, as
    older Hub checkpoints hold them) is named as such: it said only "expected a .safetensors
    file ...; received: none found", next to the .bin files it did not mention."""
    if any(folder.glob("*.safetensors")) or (folder / st.INDEX_NAME).is_file():
        return
    pickled = sorted(p.name for p in folder.glob("*model*.bin"))  # (not training_args.bin)
    if pickled:
        raise TileError(where, "safetensors weights (model.safetensors, or shards with their "
                        f"{st.INDEX_NAME}); PyTorch's .bin files are pickles, which tilegraph does not read: "
                        "transformers writes safetensors with AutoModelForCausalLM.from_pretrained(folder)"
                        ".save_pretrained(new_folder)",
                        ", ".join(pickled[:3]) + (f" and {len(pickled) - 3} more" if len(pickled) > 3 else "")
                        + f" in {folder}")


def save_hf(model, path, *, max_shard_bytes: int | None = None, overwrite: bool = False) -> None:
    """Write ``model`` as an HF folder (config.json + safetensors) that transformers loads.

    Everything is written into a temporary folder next to ``path`` and renamed at the end, so a
    failure leaves neither a partial folder nor a damaged previous one. A model with LoRA or LoTR
    layers is written without their adapters, with a warning: the base weights, onto which the
    folder of ``tilegraph.peft.save_adapters(..., format="peft")`` loads (``tilegraph.peft.merge_lora``
    first writes them merged).
    """
    path = user_path(path, f"tilegraph.models.{type(model).__name__}.to_hf")
    where = f"tilegraph.models.{type(model).__name__}.to_hf({path})"
    if getattr(model, "arch", None) not in SPECS:
        raise TileError(where, f"no Hugging Face export for this model; supported: {', '.join(SPECS)}",
                        type(model).__name__)
    # checked before anything is written: overwrite="no" is a true str (a folder there was
    # replaced), and a bad max_shard_bytes failed once the temporary folder was made, named by it
    if not isinstance(overwrite, (bool, np.bool_)):
        raise TileError(where, "overwrite must be True or False", st._brief(overwrite))
    st._check_shard_bytes(where, max_shard_bytes)
    if path.name in ("", ".."):  # ".", "", "/", "a/..": the folder is written beside its parent and renamed
        raise TileError(where, "the target must be a folder name to create (e.g. 'out' or 'models/gpt2'), "
                        "not '.', '..' or a root", repr(str(path)))
    if path.exists() and not overwrite and (not path.is_dir() or any(path.iterdir())):
        raise TileError(where, "the target exists and is not an empty folder (pass overwrite=True to replace it)",
                        str(path))
    config = _to_hf_config(model)
    tensors = to_hf_state(model)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    old = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.old")
    moved_aside = False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        st.save_checkpoint(tensors, tmp, max_shard_bytes=max_shard_bytes)
        if path.exists():
            os.replace(path, old)
            moved_aside = True
        os.replace(tmp, path)
    except BaseException as e:
        if moved_aside and not path.exists():
            os.replace(old, path)  # put the previous folder back
        if isinstance(e, OSError):  # a full disk, a read-only or missing folder: say where, no traceback
            raise write_failure(where, e, path, "the Hugging Face folder",
                                "a folder already there is untouched") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    _warn_adapters_left_out(model, where)


def _warn_adapters_left_out(model, where: str) -> None:
    """A warning when ``model`` has LoRA or LoTR layers, which the folder does not hold: it has the
    base weights under them (what peft's folder of the adapters loads onto). A fine-tuned model
    written with to_hf was otherwise the untrained base, without a word."""
    import warnings

    from tilegraph.peft import lora_layers, lotr_layers

    adapted = [*lora_layers(model), *lotr_layers(model)]
    if adapted:
        shown = ", ".join(adapted[:3]) + (f" and {len(adapted) - 3} more" if len(adapted) > 3 else "")
        warnings.warn(f"[{where}] the folder holds the base weights, without the model's {len(adapted)} adapted "
                      f"layers' adapters ({shown}): tilegraph.peft.save_adapters(path, model, format=\"peft\") "
                      "writes them as a peft folder that loads onto it, and tilegraph.peft.merge_lora(model) "
                      "before to_hf writes them merged into the weights", UserWarning, stacklevel=4)
