"""Llama: RMSNorm pre-norm blocks, rotary positions, SwiGLU MLP, grouped-query attention.

>>> import numpy as np
>>> from tilegraph.models import Llama, LlamaConfig
>>> model = Llama(LlamaConfig.flavor("debug"), seed=0)
>>> model(np.zeros((2, 5), np.int64)).shape
(2, 5, 128)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tilegraph import nn
from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor

from ._common import CausalLM, Derived, check_config, lookup_flavor
from .tiling import ModelTiling

__all__ = ["LlamaConfig", "Llama"]


@dataclass(frozen=True)
class LlamaConfig:
    """Llama's architecture. ``hidden`` (the SwiGLU width) is always a number of its own, as in
    Hugging Face's ``intermediate_size``: no rule derives it from ``dim`` (the flavors take 2 to
    2.75 times dim), so ``dataclasses.replace(cfg, dim=...)`` (or ``tilegraph train --set
    model.dim=...``) keeps it; give both to change the width too. ``n_kv_heads`` left out or None
    is ``n_heads`` (no grouping), and stays so after a replace of ``n_heads``."""

    vocab_size: int = 32000
    max_seq_len: int = 2048  # longest sequence trained on (RoPE itself has no table)
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # grouped-query attention: heads share k/v in groups; None means n_heads
    hidden: int = 11008  # SwiGLU width, usually about 8/3 * dim rounded up
    norm_eps: float = 1e-5
    rope_base: float = 10000.0  # "rope_theta": the longest rotary wavelength is 2 pi * rope_base
    tie_embeddings: bool = False
    attn_dropout: float = 0.0  # dropout on the attention weights in training (HF's attention_dropout)

    def __post_init__(self):
        if Derived.wanted(self.n_kv_heads) and isinstance(self.n_heads, (int, np.integer)) \
                and not isinstance(self.n_heads, bool):
            object.__setattr__(self, "n_kv_heads", Derived(self.n_heads))
        where = "tilegraph.models.LlamaConfig"
        check_config(self, where, ("vocab_size", "max_seq_len", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden"))
        if self.n_heads % self.n_kv_heads:
            raise TileError(where, "n_kv_heads must divide n_heads",
                            f"n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise TileError(where, "head_dim (dim / n_heads) must be even: RoPE rotates channel pairs",
                            f"dim={self.dim}, n_heads={self.n_heads}")
        if not self.rope_base > 0:
            raise TileError(where, "rope_base must be positive", repr(self.rope_base))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def flavor(cls, name: str) -> "LlamaConfig":
        """A named configuration: "debug", "llama-110m" or "tinyllama-1.1b"."""
        return lookup_flavor(cls, FLAVORS, name)


FLAVORS = {
    "debug": LlamaConfig(vocab_size=128, max_seq_len=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=176),
    # 110M parameters with untied embeddings (the 32k vocabulary accounts for 49M of them)
    "llama-110m": LlamaConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden=1536),
    # TinyLlama-1.1B's shape: 22 layers, 32 query heads sharing 4 k/v heads
    "tinyllama-1.1b": LlamaConfig(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, hidden=5632),
}


class Block(nn.Module):
    """A pre-norm block; its layers take their tile, dtype, seed and init from the model's
    :func:`tilegraph.nn.defaults` block."""

    def __init__(self, cfg: LlamaConfig):
        self.attn_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = nn.CausalSelfAttention(cfg.dim, cfg.n_heads, cfg.n_kv_heads, bias=False, rope=True,
                                           rope_base=cfg.rope_base, dropout=cfg.attn_dropout)
        self.mlp_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = nn.SwiGLU(cfg.dim, cfg.hidden)

    def forward(self, x: TileTensor, cache: nn.KVCache | None = None) -> TileTensor:
        x = x + self.attn(self.attn_norm(x), cache)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class Llama(CausalLM):
    """Llama language model; ``model(ids)`` returns logits (B, T, vocab_size) (``cache``: see
    :meth:`CausalLM.new_cache`)."""

    arch = "llama"

    def __init__(self, config: LlamaConfig, tiling: ModelTiling | None = None, *, dtype=np.float32, seed=0,
                 recompute: bool = False):
        t = self._setup(config, tiling, dtype)
        dtype = self.dtype  # as a NumPy dtype (it may be given as 'fp16' or torch.float16)
        self.recompute = recompute  # see CausalLM.recompute (a bool, checked)
        # every layer's settings from this block alone (inherit=False: none from a block the model is built in)
        with nn.defaults(tile=t.feature, dtype=dtype, seed=self._rng(seed), init_std=0.02,
                         inherit=False):
            self.embed = nn.Embedding(config.vocab_size, config.dim, vocab_tile=t.vocab)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.norm = nn.RMSNorm(config.dim, config.norm_eps)
            self.lm_head = None
            if not config.tie_embeddings:
                self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False, out_tile=t.vocab)

    def _apply_dropout(self) -> None:
        for block in self.blocks:
            block.attn.dropout = self.config.attn_dropout

    def forward(self, ids, cache: list[nn.KVCache] | None = None) -> TileTensor:
        x = self.embed(self._ids(ids, self._start(cache)))   # (B, T, C); RoPE takes positions from the cache
        for i, block in enumerate(self.blocks):
            x = self._block(block, x, None if cache is None else cache[i])
        x = self.norm(x)
        if self.lm_head is None:
            return self.embed.unembed(x)  # (B, T, V)
        return self.lm_head(x)
