"""Rotary position embedding (RoPE), Hugging Face Llama convention (``rotate_half``).

``rope(x) = x * cos + rotate_half(x) * sin`` where ``rotate_half([x1, x2]) = [-x2, x1]`` splits the
head dim D in halves, and the angle of position p and channel c is
``p * inv_freq[c mod D/2]`` with ``inv_freq = 1 / base ** (arange(0, D, 2) / D)``.
Each tile computes its own positions from its offset along the sequence dim, so T may be tiled.
The map is a rotation per channel pair, so its gradient is the inverse rotation (``sin -> -sin``).
"""

from __future__ import annotations

import numbers

import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import emit1, kernel, to_host
from tilegraph._tensor import TileTensor

from ._common import elementwise_cost, new_tensor, require_float, require_tensor, xp_of

__all__ = ["rope", "rope_at"]

WHERE = "tilegraph.rope"


@kernel("rope", cost=elementwise_cost(6))
def _rope(x, pos0, base, sign):
    """Rotate one (b, h, t, D) tile whose first row has position ``pos0``; ``sign=-1`` undoes it."""
    xp = xp_of(x)
    t, d = x.shape[-2], x.shape[-1]
    # Angles in float64 whatever the tile dtype: positions times frequencies lose digits in float32.
    inv_freq = 1.0 / (base ** (xp.arange(0, d, 2, dtype=xp.float64) / d))   # (D/2,)
    pos = xp.arange(pos0, pos0 + t, dtype=xp.float64)                       # (t,)
    freqs = pos[:, None] * inv_freq[None, :]                                # (t, D/2)
    cos = xp.cos(freqs).astype(x.dtype)
    sin = xp.sin(freqs).astype(x.dtype)
    if sign < 0:
        sin = -sin
    half = d // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = xp.empty_like(x)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out


class Rope(Op):
    name = "rope"

    def forward(self, x, base=10000.0, position_offset=0):
        return _apply(x, base, position_offset, 1.0, self.name), (x, base, position_offset)

    def backward(self, ctx, g):
        x, base, position_offset = ctx
        if g.chunks != x.chunks:
            raise TileError(WHERE, "the output gradient must have the tiles of the output",
                            f"{g.chunks} vs {x.chunks}")
        return (_apply(g, base, position_offset, -1.0, f"{self.name}_bwd"),)


def _apply(x: TileTensor, base: float, position_offset: int, sign: float, op: str) -> TileTensor:
    t_offs = x.tiling.offsets(2)

    def fill(idx):
        r = x.grid[idx]
        return emit1(_rope, [r], r.shape, x.dtype, op=op, pos0=position_offset + t_offs[idx[2]],
                     base=base, sign=sign)

    return new_tensor(x.tiling, x.dtype, fill)


_rope_op = Rope()


def rope(x: TileTensor, base: float = 10000.0, position_offset: int = 0) -> TileTensor:
    """Rotary embedding of x (B, H, T, D) at positions ``position_offset + t`` (HF Llama layout).

    D must be even and a single tile; B, H and T may be tiled.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.ones((1, 1, 3, 2)), tiles=(1, 1, 2, 2))
    >>> np.round(rope(x).numpy()[0, 0, 1], 4)   # position 1: rotate (1, 1) by 1 radian
    array([-0.3012,  1.3818])
    """
    require_tensor(x, WHERE, "x")
    require_float(x, WHERE, "x")
    if x.ndim != 4:
        raise TileError(WHERE, "x must have 4 dims (B, H, T, D)", f"shape {x.shape}")
    d = x.shape[3]
    if d % 2:
        raise TileError(WHERE, "the head dim D must be even (channels rotate in pairs)", f"D={d}")
    if len(x.chunks[3]) != 1:
        raise TileError(WHERE, "the head dim D must be a single tile", f"tiles {x.chunks[3]}")
    if isinstance(base, bool) or not isinstance(base, (int, float, np.integer, np.floating)) or not 0 < base < np.inf:
        raise TileError(WHERE, "base must be a finite number > 0 (the frequencies are base ** (-2i / D))",
                        repr(base))
    if (isinstance(position_offset, bool) or not isinstance(position_offset, numbers.Real)
            or not np.isfinite(position_offset) or int(position_offset) != position_offset or position_offset < 0):
        raise TileError(WHERE, "position_offset must be a non-negative integer", repr(position_offset))
    return _rope_op(x, base=float(base), position_offset=int(position_offset))


@kernel("rope_at", cost=elementwise_cost(6))
def _rope_at(x, position, base):
    """_rope of a tile whose first row sits at the position the (1,) int tile ``position`` holds."""
    return _rope.fn(x, int(to_host(position).reshape(-1)[0]), base, 1.0)


def rope_at(x: TileTensor, position: TileTensor, base: float = 10000.0) -> TileTensor:
    """:func:`rope` of x (B, H, T, D), one sequence tile, at positions ``p + t`` where p is the value
    of ``position``, a one-tile (1,) int64 TileTensor: the recorded graph holds no position, so it
    runs again for the next position with only that tile's value changed (a decoding step against
    a KV cache, :class:`tilegraph.models.Decoder`). Inference only: no gradient flows through.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.ones((1, 1, 1, 2)))
    >>> np.round(rope_at(x, tg.from_numpy(np.array([1]))).numpy()[0, 0, 0], 4)
    array([-0.3012,  1.3818])
    """
    require_tensor(x, WHERE, "x")
    require_tensor(position, WHERE, "position")
    if x.ndim != 4 or len(x.chunks[2]) != 1 or len(x.chunks[3]) != 1 or x.shape[3] % 2:
        raise TileError(WHERE, "x (B, H, T, D) with one tile along T and D, D even", f"shape {x.shape}, tiles {x.chunks}")
    if position.shape != (1,) or position.dtype.kind not in "iu":
        raise TileError(WHERE, "position must be an int TileTensor of shape (1,)", f"{position.dtype} {position.shape}")
    pos = position.grid[0]
    return new_tensor(x.tiling, x.dtype, lambda idx: emit1(_rope_at, [x.grid[idx], pos], x.grid[idx].shape, x.dtype,
                                                           op="rope", base=float(base)))
