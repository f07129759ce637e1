"""GPT-2: learned positions, pre-norm blocks with LayerNorm, GELU (tanh) MLP, tied embeddings.

>>> import numpy as np
>>> from tilegraph.models import GPT2, GPT2Config
>>> model = GPT2(GPT2Config.flavor("debug"), seed=0)
>>> model(np.zeros((2, 5), np.int64)).shape
(2, 5, 96)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tilegraph import nn
from tilegraph._tensor import TileTensor

from ._common import CausalLM, Derived, check_config, lookup_flavor
from .tiling import ModelTiling

__all__ = ["GPT2Config", "GPT2"]


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2's architecture. ``hidden`` (the MLP width) left out or None is 4 * dim, and stays
    so: ``dataclasses.replace(cfg, dim=1024)`` (or ``tilegraph train --set model.dim=1024``) makes
    it 4096 where it was derived, and keeps a width given as a number. ``cfg.hidden`` is always the
    width, an int; a config read from a checkpoint or a Hugging Face folder with ``n_inner`` holds
    it as a number (given, so kept)."""

    vocab_size: int = 50257  # 50,000 BPE merges + 256 bytes + <|endoftext|>
    max_seq_len: int = 1024  # rows of the learned position table
    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    hidden: int | None = None  # MLP width; None means 4 * dim (also after replace(cfg, dim=...))
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the output projection reuses the token embedding
    # dropout in training (HF's embd_pdrop, attn_pdrop, resid_pdrop): on the embeddings' sum, on the
    # attention weights, on each block's attention and MLP outputs before the residual add
    embd_dropout: float = 0.0
    attn_dropout: float = 0.0
    resid_dropout: float = 0.0

    def __post_init__(self):
        if Derived.wanted(self.hidden) and isinstance(self.dim, (int, np.integer)) and not isinstance(self.dim, bool):
            object.__setattr__(self, "hidden", Derived(4 * int(self.dim)))
        check_config(self, "tilegraph.models.GPT2Config",
                     ("vocab_size", "max_seq_len", "dim", "n_layers", "n_heads", "hidden"))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def flavor(cls, name: str) -> "GPT2Config":
        """A named configuration: "debug", "gpt2" (124M) or "gpt2-medium" (350M)."""
        return lookup_flavor(cls, FLAVORS, name)


FLAVORS = {
    # small enough for unit tests; odd-ish sizes so that tilings get ragged tiles
    "debug": GPT2Config(vocab_size=96, max_seq_len=32, dim=32, n_layers=2, n_heads=4),
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(dim=1024, n_layers=24, n_heads=16),
}


INIT_STD = 0.02  # of every weight, but the position table's (0.01) and the residual projections' (below)


class Block(nn.Module):
    """A pre-norm block; its layers take their tile, dtype, seed and init from the model's
    :func:`tilegraph.nn.defaults` block."""

    def __init__(self, cfg: GPT2Config):
        self.ln_1 = nn.LayerNorm(cfg.dim, cfg.norm_eps)
        self.attn = nn.CausalSelfAttention(cfg.dim, cfg.n_heads, bias=True, dropout=cfg.attn_dropout)
        self.ln_2 = nn.LayerNorm(cfg.dim, cfg.norm_eps)
        self.mlp = nn.MLP(cfg.dim, cfg.hidden, act="gelu_tanh")
        self.attn_drop = nn.Dropout(cfg.resid_dropout)  # HF's attn.resid_dropout
        self.mlp_drop = nn.Dropout(cfg.resid_dropout)   # HF's mlp.dropout
        # GPT-2 scales the init of the projections back into the residual stream by 1/sqrt(2 * layers)
        for proj in (self.attn.o, self.mlp.fc2):
            proj.reset_parameters(init_std=INIT_STD / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: TileTensor, cache: nn.KVCache | None = None) -> TileTensor:
        x = x + self.attn_drop(self.attn(self.ln_1(x), cache))
        x = x + self.mlp_drop(self.mlp(self.ln_2(x)))
        return x


class GPT2(CausalLM):
    """GPT-2 language model; ``model(ids)`` returns logits (B, T, vocab_size) (``cache``: see
    :meth:`CausalLM.new_cache`)."""

    arch = "gpt2"

    def __init__(self, config: GPT2Config, tiling: ModelTiling | None = None, *, dtype=np.float32, seed=0,
                 recompute: bool = False):
        t = self._setup(config, tiling, dtype)
        dtype = self.dtype  # as a NumPy dtype (it may be given as 'fp16' or torch.float16)
        self.recompute = recompute  # see CausalLM.recompute (a bool, checked)
        # every layer's settings from this block alone (inherit=False: none from a block the model is built in)
        with nn.defaults(tile=t.feature, dtype=dtype, seed=self._rng(seed), init_std=INIT_STD,
                         inherit=False):
            self.wte = nn.Embedding(config.vocab_size, config.dim, vocab_tile=t.vocab)
            self.wpe = nn.Embedding(config.max_seq_len, config.dim, init_std=0.01)
            self.drop = nn.Dropout(config.embd_dropout)  # HF's transformer.drop
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
            self.ln_f = nn.LayerNorm(config.dim, config.norm_eps)
            self.lm_head = None
            if not config.tie_embeddings:
                self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False, out_tile=t.vocab)

    def _apply_dropout(self) -> None:
        cfg = self.config
        self.drop.p = cfg.embd_dropout
        for block in self.blocks:
            block.attn.dropout = cfg.attn_dropout
            block.attn_drop.p = block.mlp_drop.p = cfg.resid_dropout

    def forward(self, ids, cache: list[nn.KVCache] | None = None) -> TileTensor:
        start = self._start(cache)                                 # positions already cached
        ids = self._ids(ids, start)                                # (B, T)
        x = self.drop(self.wte(ids) + self.wpe(self._positions(ids, start, cache)))  # (B, T, C) + (T, C)
        for i, block in enumerate(self.blocks):
            x = self._block(block, x, None if cache is None else cache[i])
        x = self.ln_f(x)
        if self.lm_head is None:
            return self.wte.unembed(x)                      # (B, T, V)
        return self.lm_head(x)
