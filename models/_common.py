"""Pieces every causal language model shares: config checks, flavor lookup, the model base class."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from tilegraph import nn
from tilegraph._config import is_int, require_float_dtype
from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor, from_numpy
from tilegraph.ops.dropout import check_dropout
from tilegraph.recompute import checkpoint

from .tiling import ModelTiling


class Derived(int):
    """A config field's value derived from others (GPT-2's ``hidden`` from ``dim``, Llama's
    ``n_kv_heads`` from ``n_heads``) where it was left out or None: an int like any other, marked
    so that a config made from it by ``dataclasses.replace`` derives it again from the new values
    (replace passes every field on, a derived one included), where a value given stays as given."""

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)

    @staticmethod
    def wanted(value) -> bool:
        """Whether a field holding ``value`` is to be derived: None, or derived before."""
        return value is None or type(value) is Derived


def check_config(config, where: str, sizes: tuple[str, ...]) -> None:
    """The checks both architectures share: positive sizes (the fields named in ``sizes``), whole heads."""
    for name in sizes:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise TileError(where, f"{name} must be a positive int", repr(v)[:100])
    if config.dim % config.n_heads:
        raise TileError(where, "n_heads must divide dim", f"dim={config.dim}, n_heads={config.n_heads}")
    # the type before the comparison: a str from a crafted config.json would make it a TypeError
    if not (_is_number(config.norm_eps) and config.norm_eps >= 0):
        raise TileError(where, "norm_eps must be a finite non-negative number", repr(config.norm_eps)[:100])
    rope_base = getattr(config, "rope_base", None)  # Llama's only
    if rope_base is not None and not (_is_number(rope_base) and rope_base > 0):
        raise TileError(where, "rope_base must be a finite positive number", repr(rope_base)[:100])
    for name in dropout_fields(config):  # the dropout probabilities (attn_dropout, ...), as floats
        # (0 from a TOML file: 0.0, as HF writes it)
        object.__setattr__(config, name, check_dropout(getattr(config, name), where, name))
    # the switches (tie_embeddings): "no" from a crafted config.json is a non-empty str, so true
    for f in dataclasses.fields(config):
        if isinstance(f.default, bool) and not isinstance(getattr(config, f.name), bool):
            raise TileError(where, f"{f.name} must be true or false", repr(getattr(config, f.name))[:100])


def dropout_fields(config) -> tuple[str, ...]:
    """The fields of a model config that are dropout probabilities (``attn_dropout``, ...): they
    apply in training only and leave the weights as they are, so a loaded model may change them
    (:meth:`CausalLM.set_dropout`)."""
    return tuple(f.name for f in dataclasses.fields(config) if f.name.endswith("_dropout"))


def _is_number(v) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return False
    return not isinstance(v, (float, np.floating)) or math.isfinite(v)  # (an int may exceed any float)


def lookup_flavor(cls, flavors: dict, name: str):
    if not isinstance(name, str) or name not in flavors:  # (a list: "unhashable type" from the dict)
        raise TileError(f"tilegraph.models.{cls.__name__}.flavor", f"unknown flavor; known: {', '.join(flavors)}",
                        repr(name))
    return flavors[name]


class CausalLM(nn.Module):
    """A decoder-only language model: ``model(ids)`` maps token ids (B, T) to logits (B, T, V);
    ``model(ids, cache=model.new_cache())`` also appends the keys and values to the cache, as
    graph nodes (:class:`tilegraph.models.Decoder` computes them into it)."""

    #: the architecture's name in :data:`tilegraph.models.ARCHITECTURES` (and HF's ``model_type``)
    arch = ""
    #: activation recompute: each block's backward re-runs the block's forward from its input
    #: (:func:`tilegraph.checkpoint`), so a training step keeps one activation per block (its input)
    #: instead of all of them, for one more forward pass of compute; settable on any model
    #: (``model.recompute = True``, also after ``models.from_hf``)
    _recompute: bool = False

    @property
    def recompute(self) -> bool:
        return self._recompute

    @recompute.setter
    def recompute(self, value) -> None:
        # "yes", 1 or None were kept as given (or made bools by truth value): only a bool says it
        if not isinstance(value, (bool, np.bool_)):
            raise TileError(f"tilegraph.models.{type(self).__name__}.recompute", "recompute must be True or False",
                            f"{value!r:.100}")
        self._recompute = bool(value)

    def set_dropout(self, **probs) -> "CausalLM":
        """Change the dropout probabilities of the config (``attn_dropout=0.0``, ...: the config's
        fields named ``*_dropout``) and of the layers that apply them (a ``TrainStep``, and the
        Trainer's, already recorded records its step again at its next call). A model from
        ``models.from_hf`` takes its folder's dropout (HF's 0.1 for GPT-2); this turns it off or
        changes it. Returns the model.

        >>> from tilegraph import models
        >>> models.build("gpt2-debug").set_dropout(attn_dropout=0.1).config.attn_dropout
        0.1
        """
        import dataclasses

        where = f"tilegraph.models.{type(self).__name__}.set_dropout"
        known = dropout_fields(self.config)
        unknown = [k for k in probs if k not in known]
        if unknown:
            raise TileError(where, f"only dropout fields of {type(self.config).__name__} ({', '.join(known)})",
                            ", ".join(f"{k}={probs[k]!r:.40}" for k in unknown))
        try:
            config = dataclasses.replace(self.config, **probs)
        except TileError as e:  # a value out of [0, 1): named as the config names it
            raise TileError(where, e.what, e.received) from None
        self.config = config
        self._apply_dropout()
        return self

    def _apply_dropout(self) -> None:
        """Set the layers' dropout from ``self.config`` (each architecture its own)."""
        raise NotImplementedError

    def _setup(self, config, tiling: ModelTiling | None, dtype) -> ModelTiling:
        tiling = ModelTiling.default(config) if tiling is None else tiling
        if not isinstance(tiling, ModelTiling):
            raise TileError(f"tilegraph.models.{type(self).__name__}", "tiling must be a ModelTiling or None",
                            type(tiling).__name__)
        tiling.check(config, where=f"tilegraph.models.{type(self).__name__}")
        dt = require_float_dtype(f"tilegraph.models.{type(self).__name__}", dtype)
        self.config, self.tiling, self.dtype = config, tiling, dt
        return tiling

    def _rng(self, seed) -> np.random.Generator:
        """The generator of the initial weights: ``seed`` an int >= 0, or a Generator itself
        (NumPy's own errors for -1 or 1.5 named neither the model nor the argument)."""
        if isinstance(seed, np.random.Generator):
            return seed
        if not is_int(seed, 0):
            raise TileError(f"tilegraph.models.{type(self).__name__}", "seed must be an int >= 0 (or a "
                            "numpy.random.Generator)", repr(seed))
        return np.random.default_rng(seed)

    def _block(self, block: nn.Module, x: TileTensor, cache: nn.KVCache | None) -> TileTensor:
        """One transformer block, recorded for recompute when the model trains with it (decoding
        with a cache never recomputes: it has no backward, and the cache must grow once)."""
        if self.recompute and cache is None:
            return checkpoint(block, x)
        return block(x, cache)

    def new_cache(self, block: int = 64) -> list[nn.KVCache]:
        """One empty :class:`tilegraph.nn.KVCache` per layer, for ``model(ids, cache=...)``: each
        call appends the keys and values of ``ids`` and computes only their positions, attending
        to everything cached before, as :class:`tilegraph.models.Decoder` uses it
        (``dec.feed(ids)``), which computes each call's keys and values into the cache. In a loop
        of your own (``model(ids, cache=cache).numpy()``) the cache holds the earlier calls'
        graphs, not their values: each call recomputes every earlier position, and warns so."""
        return [nn.KVCache(block) for _ in range(self.config.n_layers)]

    def _start(self, cache) -> int:
        """Positions already in ``cache`` (0 without one): where the new ids start."""
        if cache is None:
            return 0
        where = f"tilegraph.models.{type(self).__name__}"
        if (not isinstance(cache, (list, tuple)) or len(cache) != self.config.n_layers
                or not all(isinstance(c, nn.KVCache) for c in cache)):
            raise TileError(where, f"cache must be a list of {self.config.n_layers} KVCache (model.new_cache())",
                            type(cache).__name__)
        lengths = {c.length for c in cache}
        if len(lengths) != 1:
            raise TileError(where, "the layers of the cache hold different numbers of positions", str(sorted(lengths)))
        if any(c.pending() for c in cache):
            # a loop of model(ids, cache=cache).numpy() took 1 ms a token at position 3 and 0.7-1.4 s
            # at positions 80-200 (gpt2-debug): each graph held every earlier step's
            import warnings

            warnings.warn(f"[{where}] the cache holds keys and values of an earlier call that were never computed "
                          "into it (graph nodes, not values): this call recomputes every earlier position, and each "
                          "step takes longer than the last; decode with tilegraph.models.Decoder (dec.feed(ids) "
                          "returns the next token's logits and keeps the cache computed) or tilegraph.models.generate",
                          stacklevel=4)
        return lengths.pop()

    def _ids(self, ids, start: int = 0) -> TileTensor:
        """Token ids as a TileTensor (a NumPy array gets the tiling's batch and seq tiles)."""
        where = f"tilegraph.models.{type(self).__name__}"
        if not isinstance(ids, TileTensor):
            shape = np.shape(ids)
            if len(shape) == 2 and 0 in shape:  # before tiling it: no tile fits an empty dim
                raise TileError(where, "ids of shape (batch, seq) holding at least one token", f"shape {shape}")
            ids = self.tiling.tile_ids(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu" or 0 in ids.shape:
            raise TileError(where, "ids must be an integer TileTensor of shape (batch, seq), at least one token",
                            f"{ids.dtype} of shape {ids.shape}")
        if start + ids.shape[1] > self.config.max_seq_len:
            got = f"seq={start + ids.shape[1]}" + (f" ({start} cached + {ids.shape[1]} new)" if start else "")
            raise TileError(where, f"sequences may hold at most max_seq_len={self.config.max_seq_len} tokens", got)
        return ids

    @staticmethod
    def _positions(ids: TileTensor, start: int = 0, cache=None) -> TileTensor:
        """Positions start..start+T-1, tiled like the sequence dim of ``ids`` (the cache's position
        tile where it has one: a decoding step recorded to run again for the next positions)."""
        if cache is not None and cache[0].position is not None:
            return cache[0].position
        return from_numpy(np.arange(start, start + ids.shape[1], dtype=np.int64), (ids.chunks[1],))

    def to_hf(self, path, *, max_shard_bytes: int | None = None, overwrite: bool = False) -> None:
        """Write a Hugging Face model folder (config.json + safetensors) that transformers loads."""
        from tilegraph.io.hf import save_hf

        save_hf(self, path, max_shard_bytes=max_shard_bytes, overwrite=overwrite)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.config}, {self.tiling}, {self.num_parameters():,} parameters)")
