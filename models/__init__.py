"""Model definitions (GPT-2, Llama) written on tilegraph.nn, forward only.

Architecture configs are frozen dataclasses with named flavors; how tensors are tiled is a
separate :class:`ModelTiling`. A model maps token ids (B, T) to logits (B, T, V)::

    >>> import numpy as np, tilegraph as tg
    >>> from tilegraph import models
    >>> model = models.build("gpt2-debug", seed=0)
    >>> ids = np.zeros((2, 8), np.int64)
    >>> loss = tg.cross_entropy(model(ids), model.tiling.tile_ids(ids))
    >>> model = models.from_hf("path/to/hf-folder")  # doctest: +SKIP
    >>> model.to_hf("path/to/out")                   # doctest: +SKIP
    >>> models.generate(model, ids, 4).shape         # greedy, with a KV cache
    (2, 12)
"""

from __future__ import annotations

import numpy as np

from tilegraph import nn
from tilegraph._errors import TileError

from ._common import CausalLM
from .generate import Decoder, generate, next_tokens
from .gpt2 import GPT2, GPT2Config
from .llama import Llama, LlamaConfig
from .tiling import ModelTiling

__all__ = ["ARCHITECTURES", "FLAVORS", "CausalLM", "Decoder", "GPT2", "GPT2Config", "Llama", "LlamaConfig",
           "ModelTiling", "build", "config", "from_hf", "from_zarr", "generate", "next_tokens"]

#: architecture name -> (config class, model class)
ARCHITECTURES = {
    "gpt2": (GPT2Config, GPT2),
    "llama": (LlamaConfig, Llama),
}

#: flavor name -> config; each config class also knows its own flavors by short name ("debug")
FLAVORS = {
    "gpt2-debug": GPT2Config.flavor("debug"),
    "gpt2": GPT2Config.flavor("gpt2"),
    "gpt2-medium": GPT2Config.flavor("gpt2-medium"),
    "llama-debug": LlamaConfig.flavor("debug"),
    "llama-110m": LlamaConfig.flavor("llama-110m"),
    "tinyllama-1.1b": LlamaConfig.flavor("tinyllama-1.1b"),
}


def config(flavor: str):
    """The config of a named flavor (see :data:`FLAVORS`)."""
    if not isinstance(flavor, str) or flavor not in FLAVORS:
        raise TileError("tilegraph.models.config", f"unknown flavor; known: {', '.join(FLAVORS)}", repr(flavor))
    return FLAVORS[flavor]


def _model_class(cfg, where: str):
    for config_cls, model_cls in ARCHITECTURES.values():
        if isinstance(cfg, config_cls):
            return model_cls
    raise TileError(where, "expected a flavor name or a model config ("
                    + ", ".join(c.__name__ for c, _ in ARCHITECTURES.values()) + ")", repr(cfg))


def build(flavor_or_config, tiling: ModelTiling | None = None, *, seed=0, dtype=np.float32,
          recompute: bool = False) -> CausalLM:
    """A randomly initialised model of a flavor name or a config; ``tiling`` defaults to
    :meth:`ModelTiling.default`; ``recompute``: each block's activations recomputed in the
    backward (:func:`tilegraph.checkpoint`)."""
    cfg = config(flavor_or_config) if isinstance(flavor_or_config, str) else flavor_or_config
    cls = _model_class(cfg, "tilegraph.models.build")
    if not nn._DEFERRED:  # the weights are drawn here: refuse a model this process cannot hold first
        with nn.deferred_init():
            empty = cls(cfg, tiling, dtype=dtype, seed=seed)  # its dtype checked (a TileError naming the model)
            shapes = [p.shape for p in empty.parameters()]
        _check_memory("tilegraph.models.build", cfg, shapes, empty.dtype)
    return cls(cfg, tiling, dtype=dtype, seed=seed, recompute=recompute)


def _check_memory(where: str, cfg, shapes: list, dtype: np.dtype) -> None:
    """A TileError, before any weight is drawn, when the parameters of ``shapes`` in ``dtype`` (and
    the float64 draw of the largest, converted from) exceed the memory this process may still take
    (a dim or max_seq_len mistyped by a few zeros otherwise ended in a MemoryError traceback, or in
    the machine swapping or the process killed)."""
    import math

    import psutil

    sizes = [math.prod(s) for s in shapes]
    need = sum(sizes) * dtype.itemsize + max(sizes, default=0) * 8
    free = psutil.virtual_memory().available
    if need > free:
        gb = 2.0 ** 30
        raise TileError(where, f"a model whose weights fit this process's memory ({free / gb:.1f} GiB available); "
                        "build a larger one under tilegraph.nn.deferred_init() and load its weights (from_hf, "
                        "from_zarr), or make it smaller", f"{type(cfg).__name__}(dim={cfg.dim}, n_layers={cfg.n_layers}, "
                        f"vocab_size={cfg.vocab_size}, max_seq_len={cfg.max_seq_len}): {sum(sizes):,} parameters, "
                        f"{need / gb:.1f} GiB to draw as {dtype}")


def from_hf(path, tiling: ModelTiling | None = None, *, dtype=None) -> CausalLM:
    """Load a Hugging Face model folder (config.json + safetensors, sharded or not).

    ``dtype``: None (default) keeps the folder's (config.json's ``torch_dtype``, else its
    tensors'), float32 where that is unknown or bfloat16, as transformers' ``torch_dtype="auto"``;
    pass ``np.float32`` to train a float16 folder in float32. Every missing, unexpected and
    mis-shaped tensor is reported at once in one TileError.
    """
    from tilegraph._config import require_float_dtype
    from tilegraph.io.hf import load_hf

    if dtype is not None:
        try:  # 'fp16' or torch.float16 as the NumPy dtype load_hf reads; a refused one it names, with the folder
            dtype = require_float_dtype("tilegraph.models.from_hf", dtype)
        except TileError:
            pass
    return load_hf(path, tiling, dtype=dtype)


def from_zarr(path, tiling: ModelTiling | None = None, *, runtime=None, dtype=None) -> CausalLM:
    """The model of a Zarr checkpoint (:func:`tilegraph.io.save_checkpoint`), on ``tiling``
    (default: the stored one); a quantized checkpoint loads dequantized, tile by tile, where the
    tiles are read (the runtime's workers, or here). ``dtype``: the model's float dtype (default:
    the stored one; the stored weights are cast to it where they are read)."""
    from tilegraph.io.zarr import _check_runtime, load_checkpoint

    _check_runtime("tilegraph.models.from_zarr", runtime)  # "x", a closed one: named here, not as 'workers'
    ck = load_checkpoint(path, tiling=tiling, runtime=runtime)
    return ck.model if dtype is None else ck._build_model(dtype)
