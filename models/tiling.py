"""How a model's tensors are cut into tiles, kept apart from the architecture config.

One :class:`ModelTiling` serves every layer of a model: the feature tile cuts the width, the MLP
hidden dim and the attention projections (always whole heads, so that splitting the width into
heads moves no data between tiles), the vocab tile cuts the embedding rows and the logits, and the
batch and sequence tiles cut the token ids (and with them every activation).

>>> from tilegraph.models import GPT2Config, ModelTiling
>>> t = ModelTiling.default(GPT2Config.flavor("gpt2"), batch=8, seq=1024)
>>> t.feature, t.vocab, t.batch, t.seq   # whole width (768), 7 vocab tiles, 2 x 1024 tokens per tile
(None, 7180, 2, None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tilegraph._config import is_int
from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor, from_numpy

__all__ = ["ModelTiling"]

# Tasks must be coarse (tens of milliseconds of kernel time, see DESIGN.md), so the defaults pick
# large tiles: one (batch x seq) tile of ~2k tokens times a 1024-wide feature tile is a ~4 GFLOP
# matmul, and a vocab tile of ~8k columns keeps one logits tile near 64 MB.
_MAX_FEATURE = 1024
_MAX_VOCAB = 8192
_MAX_SEQ = 1024
_TOKENS_PER_TILE = 2048


@dataclass(frozen=True)
class ModelTiling:
    """Tile sizes of a model; ``None`` keeps a dim whole (one tile).

    ``feature`` must hold whole attention heads (a multiple of ``config.head_dim``); the last tile
    of any dim may be smaller (ragged).
    """

    feature: int | None = None  # width, MLP hidden dim and head projections; whole heads per tile
    vocab: int | None = None    # embedding rows and logits columns
    batch: int | None = None    # rows of the token ids
    seq: int | None = None      # positions of the token ids; attention runs across seq tiles

    def __post_init__(self):
        # checked when made, not only when a model is built: tile_ids(ids) met seq="4" as a raw TypeError
        self._check_sizes("tilegraph.models.ModelTiling")

    def _check_sizes(self, where: str) -> None:
        for name in ("feature", "vocab", "batch", "seq"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0):
                raise TileError(where, f"{name} tile must be a positive int or None", repr(v))

    @classmethod
    def default(cls, config, batch: int | None = None, seq: int | None = None) -> "ModelTiling":
        """Coarse tiles for ``config`` and, when given, a batch of ``batch`` sequences of ``seq`` tokens."""
        where = "tilegraph.models.ModelTiling.default"
        # a flavor name gave AttributeError('head_dim'), seq="8" a TypeError, and batch=0 or seq=-3
        # were taken as no batch or sequence at all
        if not hasattr(config, "head_dim") or not hasattr(config, "vocab_size"):
            raise TileError(where, "config must be a model config (GPT2Config, LlamaConfig; "
                            "tilegraph.models.config(name) for a flavor)", f"{config!r:.100}")
        for name, value in (("batch", batch), ("seq", seq)):
            if value is not None and not is_int(value, 1):
                raise TileError(where, f"{name} must be a positive int or None", f"{value!r:.100}")
        hd = config.head_dim
        # the largest whole number of heads that divides the width and stays under _MAX_FEATURE
        heads = max((h for h in range(1, config.n_heads + 1)
                     if config.n_heads % h == 0 and h * hd <= _MAX_FEATURE), default=1)
        feature = None if heads == config.n_heads else heads * hd
        parts = math.ceil(config.vocab_size / _MAX_VOCAB)
        vocab = None if parts == 1 else math.ceil(config.vocab_size / parts)  # balanced, last one ragged
        seq_tile = None if seq is None or seq <= _MAX_SEQ else _MAX_SEQ
        batch_tile = None
        if batch is not None:
            rows = max(1, _TOKENS_PER_TILE // min(seq or _MAX_SEQ, _MAX_SEQ))
            batch_tile = None if rows >= batch else rows
        return cls(feature=feature, vocab=vocab, batch=batch_tile, seq=seq_tile)

    def heads_per_tile(self, config) -> int:
        """Attention heads in one feature tile (the head groups that attention kernels see)."""
        return config.n_heads if self.feature is None else max(1, self.feature // config.head_dim)

    def check(self, config, where: str = "tilegraph.models.ModelTiling") -> None:
        """Raise a TileError when these tiles do not fit ``config``."""
        self._check_sizes(where)  # again: a tiling changed with object.__setattr__ or unpickled skips __post_init__
        if self.feature is not None:
            if self.feature % config.head_dim:
                raise TileError(where, f"the feature tile must hold whole heads (a multiple of head_dim "
                                f"{config.head_dim} = dim {config.dim} / n_heads {config.n_heads})",
                                f"feature={self.feature}")
            if self.feature > config.dim:
                raise TileError(where, f"the feature tile must not exceed the width dim={config.dim} "
                                "(use None for one tile)", f"feature={self.feature}")
        if self.vocab is not None and self.vocab > config.vocab_size:
            raise TileError(where, f"the vocab tile must not exceed vocab_size={config.vocab_size} "
                            "(use None for one tile)", f"vocab={self.vocab}")
        if self.seq is not None and self.seq > config.max_seq_len:
            raise TileError(where, f"the seq tile must not exceed max_seq_len={config.max_seq_len}",
                            f"seq={self.seq}")

    def tile_ids(self, ids) -> TileTensor:
        """Token ids (batch, seq) as a TileTensor with this tiling's batch and seq tiles."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise TileError("tilegraph.models.ModelTiling.tile_ids", "ids must be integers of shape (batch, seq)",
                            f"{ids.dtype} array of shape {ids.shape}")
        b, t = ids.shape
        return from_numpy(ids, (_clip(self.batch, b), _clip(self.seq, t)))


def _clip(tile, n):
    return None if tile is None or tile >= n else tile
