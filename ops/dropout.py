"""Inverted dropout whose mask changes every training step of a recorded, replayed step graph.

``dropout(x, p, seed)`` zeroes each element with probability ``p`` and scales the kept ones by
1 / (1 - p) (torch's ``F.dropout`` in training). A step graph is recorded once and replayed
(``TrainStep``), so the mask cannot be drawn while recording; it comes from a counter-based
generator instead:

- **the step's seed** is a (1,) uint64 tile made by one tiny kernel (:func:`seed_tensor`) that
  hashes a base seed with a strided sample of the first tile of some tensors, as
  :mod:`tilegraph.ops.rmm` seeds its sketches. Seeded from trainable parameters (a LoRA layer's U
  and V: every optimizer step changes them), each replay gets a new seed without help from the
  training loop; data-parallel replicas, whose parameters are bitwise equal, get the same one.
- **a seed per row block** (:func:`row_seed_tensor`, what LoRA's dropout uses): one seed tile
  per row block of the dropped-out tensor (its tiles along every dim but the last), each a hash
  of the base seed, the parameters' first tiles *and that row block's first tile*. So the
  micro-batches of one optimizer step (``accum_steps``), which share the parameters, draw masks
  of their own from their own rows, as torch draws a new mask at every forward call (one seed
  for the whole step gave every micro-batch the same mask, element for element); a resumed run
  reads the same rows and draws the same masks; and a data-parallel replica seeds its rows from
  its own tiles (no seed crosses processes).
- **the mask** of element i (its row-major index in the whole tensor) keeps it when the top 53
  bits of splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15) are at least p * 2^53. Each tile
  computes its elements' bits from its offset, with array ops that run alike on NumPy and CuPy
  (the same mask on either device). So every tile gets its own mask, and the mask does not depend
  on the tiling at all: an element keeps its fate however the tensor is cut.
- **the backward** applies the same mask to the cotangent, regenerated from the same seed tile:
  no mask is stored (a bit mask would be 1/32 of a float32 activation, regenerating it is a few
  integer ops per element, and the seed tile is 8 bytes).

:func:`keep_mask` returns the mask for given seed values (for tests and references), and
:func:`step_seed` the seed that :func:`seed_tensor`'s kernel computes from tile values.

Limits: the seed hashes the *first tile* of each tensor (of each row block), so the same values
tiled with another first tile give another seed, hence other masks (given the seed, the mask is
the same for every tiling); a row-block seed also depends on where the row tiles are cut, and
on the rows' values to the bit (rows computed with other rounding, on another device or with
other sums, give other seeds). A mask repeats when those tiles do not change between steps
(learning rate 0, zero gradients, and for a row-block seed the same rows again).

>>> import numpy as np, tilegraph as tg
>>> x = tg.from_numpy(np.ones((4, 6)), tiles=(2, 3))
>>> y = tg.ops.dropout(x, 0.5, seed=7).numpy()
>>> sorted(set(y.ravel().tolist())), bool((y == 2 * keep_mask(7, (4, 6), 0.5)).all())
([0.0, 2.0], True)
"""

from __future__ import annotations

import hashlib
import numbers

import numba
import numpy as np

from tilegraph._autograd import Op
from tilegraph._errors import TileError
from tilegraph._graph import Cost, emit1, kernel, xp_of
from tilegraph._tensor import TileTensor, Tiling

from ._common import new_tensor, numel, require_float, require_tensor

__all__ = ["dropout", "seed_tensor", "row_seed_tensor", "step_seed", "keep_mask", "check_dropout"]

WHERE = "tilegraph.dropout"
#: elements of each tile hashed into a step's seed (a strided sample, as ops.rmm's)
_SEED_SAMPLE = 16384
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def check_dropout(p, where: str = WHERE, name: str = "dropout") -> float:
    """``p`` as a float, or a TileError naming ``name`` unless it is a real number in [0, 1) (the
    one check of a dropout probability: the layers', the ops' and the model configs')."""
    # (the range alone refuses NaN and inf; math.isfinite gave OverflowError on an int past any float)
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= p < 1:
        raise TileError(where, f"{name} must be a number in [0, 1) (the probability of zeroing an element)",
                        repr(p)[:100])
    return float(p) + 0.0  # (-0.0 as 0.0: a config read with attn_pdrop -0.0 wrote it back so)


# ------------------------------------------------------------------------------- the seed ----
def _sample(flat):
    return flat[::max(1, flat.size // _SEED_SAMPLE)]


def _hash(base: int, samples) -> int:
    h = hashlib.blake2b(int(base).to_bytes(8, "little"), digest_size=8)
    for s in samples:
        h.update(np.ascontiguousarray(s).tobytes())
    return int(np.frombuffer(h.digest(), dtype=np.uint64)[0])


def step_seed(base: int, *tiles: np.ndarray) -> int:
    """The seed :func:`seed_tensor` computes from the values of its tensors' first tiles."""
    return _hash(base, [_sample(np.asarray(t).reshape(-1)) for t in tiles])


def _seed_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n = sum(min(numel(s), _SEED_SAMPLE) for s in in_shapes)
    return Cost(float(n), float(n * itemsize))


@kernel("dropout_seed", cost=_seed_cost)
def _seed_k(*tiles, base, ndim=1):
    """This step's seed: a hash of the base seed and a sample of each tile (moved to the host), as
    a tile of ``ndim`` dims of one element."""
    xp = xp_of(tiles[0])
    samples = [_sample(t.reshape(-1)) for t in tiles]
    if xp is not np:
        samples = [xp.asnumpy(s) for s in samples]
    return xp.asarray(np.array([_hash(base, samples)], dtype=np.uint64).reshape((1,) * ndim))


def _check_base(base) -> int:
    if isinstance(base, bool) or not isinstance(base, numbers.Integral) or not 0 <= base < 2 ** 64:
        raise TileError(WHERE, "the base seed must be an int in [0, 2**64)", repr(base))
    return int(base)


def seed_tensor(*tensors: TileTensor, base: int = 0) -> TileTensor:
    """A (1,) uint64 seed that changes whenever the first tile of one of ``tensors`` does (every
    optimizer step, for trainable parameters). It has no autograd record: no gradient flows
    through a seed, and the tensors it hashes need none for it."""
    base = _check_base(base)
    refs = [t.grid[(0,) * t.ndim] for t in tensors]
    return new_tensor(Tiling(((1,),)), np.uint64,
                      lambda idx: emit1(_seed_k, refs, (1,), np.uint64, op="dropout", base=base))


def row_seed_tensor(x: TileTensor, *tensors: TileTensor, base: int = 0) -> TileTensor:
    """One uint64 seed per row block of ``x`` (its tiles along every dim but the last): a tensor of
    shape ``x.tiling.grid[:-1]``, one element per tile, whose element ``i`` is
    ``step_seed(base, *first tiles of tensors, x's tile (*i, 0))``. It changes whenever the first
    tile of one of ``tensors`` does (every optimizer step, for trainable parameters) and differs
    between inputs (each micro-batch of an accumulated step its own). :func:`dropout` given it
    drops out each row block of a tensor tiled as ``x`` with that block's seed. No autograd record.

    >>> import numpy as np, tilegraph as tg
    >>> x = tg.from_numpy(np.arange(12.0).reshape(4, 3), tiles=(2, 3))
    >>> s = row_seed_tensor(x, base=1).numpy()
    >>> s.shape, int(s[1]) == step_seed(1, np.arange(6.0, 12.0))
    ((2,), True)
    """
    base = _check_base(base)
    require_tensor(x, WHERE, "x")
    if x.ndim < 1:
        raise TileError(WHERE, "x needs at least 1 dim (its last is the row's)", f"shape {x.shape}")
    refs = [t.grid[(0,) * t.ndim] for t in tensors]
    lead = x.tiling.grid[:-1]
    if not lead:  # a vector: one row
        return seed_tensor(*tensors, x, base=base)
    return new_tensor(Tiling(tuple((1,) * g for g in lead)), np.uint64,
                      lambda idx: emit1(_seed_k, refs + [x.grid[idx + (0,)]], (1,) * len(lead), np.uint64,
                                        op="dropout", base=base, ndim=len(lead)))


# ------------------------------------------------------------------------------- the mask ----
def _keep(xp, key, shape, offset, tile_shape, p: float):
    """Boolean keep-mask of the tile at ``offset`` (``tile_shape``) of a tensor of ``shape``."""
    z = xp.zeros(tuple(tile_shape), dtype=np.uint64)
    stride = 1
    for d in reversed(range(len(shape))):  # row-major index of each element in the whole tensor
        r = xp.arange(offset[d], offset[d] + tile_shape[d], dtype=np.uint64) * np.uint64(stride)
        z += r.reshape([-1 if e == d else 1 for e in range(len(shape))])
        stride *= int(shape[d])
    return _keep_of_index(z, key, p)


def _keep_of_index(z, key, p: float):
    """The keep-mask of the elements whose row-major indices in the whole tensor are ``z`` (a
    uint64 array, overwritten)."""
    z += np.uint64(1)
    z *= _GOLDEN
    z += key  # splitmix64's state for draw i of a generator seeded with key; then its output mix
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)) >= _threshold(p)


def keep_mask(seed: int, shape, p: float, offset=None, tile_shape=None) -> np.ndarray:
    """The keep-mask (bool, True = kept) that :func:`dropout` with step seed ``seed`` applies to a
    tensor of ``shape`` (or to its region at ``offset`` of ``tile_shape``), on the host."""
    shape = tuple(int(s) for s in shape)
    offset = (0,) * len(shape) if offset is None else tuple(offset)
    tile_shape = shape if tile_shape is None else tuple(tile_shape)
    return _keep(np, np.array(int(seed), dtype=np.uint64), shape, offset, tile_shape, float(p))


def _dropout_cost(in_shapes, out_shapes, itemsize, params) -> Cost:
    n = numel(out_shapes[0])
    return Cost(15.0 * n, float(2 * n * params["itemsize"]))  # ~15 integer ops per element's bits


def _threshold(p: float) -> np.uint64:
    return np.uint64(round(p * 2.0 ** 53))


@numba.njit(cache=True, nogil=True, inline="always")
def _nb_bits(i1, key, k):
    """The top 53 bits that decide element ``i1 - 1`` (``i1``: its row-major index plus one, uint64),
    as ``_keep_of_index`` computes them: splitmix64's draw for the seed ``key``."""
    z = i1 * k[0] + key
    z = (z ^ (z >> np.uint64(30))) * k[1]
    z = (z ^ (z >> np.uint64(27))) * k[2]
    return (z ^ (z >> np.uint64(31))) >> np.uint64(11)


@numba.njit(cache=True, nogil=True)
def _nb_dropout(a, out, base, key, threshold, scale, k):
    """The CPU kernel: ``_keep``'s bits element by element, without its ~10 temporaries."""
    zero = scale * 0
    for r in range(a.shape[0]):
        b0 = base[r] + np.uint64(1)
        for j in range(a.shape[1]):
            y = a[r, j] * scale
            out[r, j] = y if _nb_bits(b0 + np.uint64(j), key, k) >= threshold else y * zero  # NaN stays NaN


_CONSTS = np.array([_GOLDEN, _MIX1, _MIX2], dtype=np.uint64)


@numba.njit(cache=True, nogil=True)
def _nb_scale_mask(out, base, key, threshold, scale, k, transposed):
    """``scale`` where the element is kept, 0 where dropped: element ``[n, a, j]`` of ``out`` (or
    ``[n, j, a]`` when ``transposed``) has the index ``base[n, a] + j`` in the whole tensor."""
    zero = scale * 0
    if transposed:  # (j outer: out written in its own order)
        for n in range(base.shape[0]):
            for j in range(out.shape[1]):
                for a in range(base.shape[1]):
                    kept = _nb_bits(base[n, a] + np.uint64(1) + np.uint64(j), key, k) >= threshold
                    out[n, j, a] = scale if kept else zero
        return
    for n in range(base.shape[0]):
        for a in range(base.shape[1]):
            b0 = base[n, a] + np.uint64(1)
            for j in range(out.shape[2]):
                out[n, a, j] = scale if _nb_bits(b0 + np.uint64(j), key, k) >= threshold else zero


def scale_mask(xp, seed, p: float, base, cols: int, dtype, transposed: bool = False):
    """The dropout factors ``keep / (1 - p)`` (0 where dropped) of a block of a tensor: element
    ``[n, a, j]`` (``[n, j, a]`` when ``transposed``) is the element of row-major index
    ``base[n, a] + j`` in the whole tensor, and keeps as :func:`keep_mask` says for the step seed
    in the (1,) tile ``seed``. ``base``: a NumPy uint64 array (n, A). For the kernels that apply
    dropout inside (the attention kernels: ``tilegraph.ops.attention``)."""
    dtype = np.dtype(dtype)
    key = np.uint64(int(seed.reshape(-1)[0]))
    scale = dtype.type(1.0 / (1.0 - p))
    n, rows = base.shape
    shape = (n, cols, rows) if transposed else (n, rows, cols)
    if xp is np and dtype in (np.float32, np.float64):
        out = np.empty(shape, dtype=dtype)
        _nb_scale_mask(out, base, key, _threshold(p), scale, _CONSTS, transposed)
        return out
    z = xp.asarray(base)[..., None] + xp.arange(cols, dtype=np.uint64)
    out = xp.where(_keep_of_index(z, key, p), scale, dtype.type(0)).astype(dtype)
    return out.swapaxes(-1, -2) if transposed else out


def _dropout_cpu(seed, a, *, p, shape, offset, itemsize):
    if a.ndim == 0 or a.size == 0 or a.dtype == np.float16:  # (Numba compiles no float16 kernel)
        return _dropout_k.fn(seed, a, p=p, shape=shape, offset=offset, itemsize=itemsize)
    a2 = np.ascontiguousarray(a).reshape(-1, a.shape[-1])
    base = np.full(a.shape[:-1], offset[-1], dtype=np.uint64)  # each row's first element's index
    stride = int(shape[-1])
    for d in reversed(range(a.ndim - 1)):
        rows = np.arange(offset[d], offset[d] + a.shape[d], dtype=np.uint64) * np.uint64(stride)
        base += rows.reshape([-1 if e == d else 1 for e in range(a.ndim - 1)])
        stride *= int(shape[d])
    out = np.empty_like(a2)
    _nb_dropout(a2, out, base.reshape(-1), np.uint64(seed.reshape(-1)[0]), _threshold(p),
                a.dtype.type(1.0 / (1.0 - p)), _CONSTS)
    return out.reshape(a.shape)


@kernel("dropout", cost=_dropout_cost, cpu=_dropout_cpu)
def _dropout_k(seed, a, *, p, shape, offset, itemsize):
    """``a * keep / (1 - p)`` for the tile of a tensor of ``shape`` at ``offset``."""
    xp = xp_of(a)
    keep = _keep(xp, seed.reshape(()), shape, offset, a.shape, p)
    out = a * a.dtype.type(1.0 / (1.0 - p))  # as torch: x times the mask's 1 / (1 - p)
    out *= keep
    return out


def _seed_of_tile(a: TileTensor, seed: TileTensor):
    """``idx -> the seed ref of a's tile idx``: the one seed of a (1,) seed, else the seed of the
    tile's row block (a :func:`row_seed_tensor` of a tensor tiled as ``a``)."""
    lead = a.tiling.grid[:-1]
    if seed.ndim == len(lead) and seed.shape == lead and all(set(c) <= {1} for c in seed.chunks):
        return lambda idx: seed.grid[idx[:-1]]
    if seed.shape == (1,) and seed.chunks == ((1,),):
        return lambda idx: seed.grid[(0,)]
    raise TileError(WHERE, "a (1,) seed or one seed per row block of the tensor dropped out (row_seed_tensor of "
                    "a tensor tiled as it)", f"seed of shape {seed.shape} for a tensor of tile grid {a.tiling.grid}")


def _dropout_tiles(a: TileTensor, seed: TileTensor, p: float) -> TileTensor:
    """The dropout kernels over every tile of ``a`` (no autograd record: ops that use it give
    their own backward, and :class:`Dropout` its own)."""
    offs = [a.tiling.offsets(d) for d in range(a.ndim)]
    seed_of = _seed_of_tile(a, seed)

    def fill(idx):
        offset = tuple(int(offs[d][i]) for d, i in enumerate(idx))
        return emit1(_dropout_k, [seed_of(idx), a.grid[idx]], a.tiling.tile_shape(idx), a.dtype, op="dropout",
                     p=p, shape=a.shape, offset=offset, itemsize=a.dtype.itemsize)

    return new_tensor(a.tiling, a.dtype, fill)


# ---------------------------------------------------------------------------------- the op ----
class Dropout(Op):
    """``y = x * keep / (1 - p)``; ``dx = dy * keep / (1 - p)``, the mask regenerated from the seed."""

    name = "dropout"

    def forward(self, x, seed, *, p):
        require_tensor(x, WHERE, "x")
        require_float(x, WHERE, "x")
        _check_seed_tensor(seed, x)
        return _dropout_tiles(x, seed, p), (seed, p)

    def backward(self, ctx, dy):
        seed, p = ctx
        return _dropout_tiles(dy, seed, p), None


def _check_seed_tensor(seed, x: TileTensor | None = None) -> None:
    """A (1,) uint64 seed, or (given ``x``) one seed per row block of ``x`` (:func:`row_seed_tensor`)."""
    if isinstance(seed, TileTensor) and seed.dtype == np.uint64:
        if seed.shape == (1,) and seed.chunks == ((1,),):
            return
        if (x is not None and x.ndim >= 2 and seed.shape == x.tiling.grid[:-1]
                and all(set(c) <= {1} for c in seed.chunks)):
            return
    raise TileError(WHERE, "seed must be an int, a (1,) uint64 TileTensor (ops.dropout.seed_tensor) or one seed per "
                    "row block of x (ops.dropout.row_seed_tensor(x, ...))",
                    repr(seed) + ("" if x is None else f" for x of tile grid {x.tiling.grid}"))


_DROPOUT = Dropout()


def dropout(x: TileTensor, p: float = 0.5, training: bool = True, inplace: bool = False, *,
            seed=None) -> TileTensor:
    """Inverted dropout of ``x``: each element zeroed with probability ``p``, the others scaled by
    1 / (1 - p); ``p = 0`` or ``training=False`` returns ``x`` itself (torch's ``F.dropout``, its
    arguments in its order; ``inplace=True`` is not supported: tensors are never changed in place).
    ``seed`` (by name): None (the default) seeds each run's mask as :class:`tilegraph.nn.Dropout`
    does, from the values of ``x``'s first tile and the module the call is recorded in, so a
    replayed step draws a new mask as its input changes; an int gives the same mask every time the
    graph runs; a (1,) uint64 TileTensor such as :func:`seed_tensor` makes from trainable
    parameters, a new mask every optimizer step, or :func:`row_seed_tensor` of ``x`` (one seed
    per row block: a new mask for every input too). Apply it only to a training step's graph: pass
    ``training=self.training`` in a module (True under :func:`tilegraph.nn.training`, as
    ``TrainStep`` records, or after ``model.train()``). See the module doc."""
    p = check_dropout(p, WHERE, "p")
    if not isinstance(training, (bool, np.bool_)):
        raise TileError(WHERE, "training must be a bool (torch's third argument; pass an int seed by name: "
                        "seed=...)", f"{training!r:.60}")
    if inplace is not False:
        raise TileError(WHERE, "inplace=True is not supported (a TileTensor is never changed in place: use the "
                        "result)", f"inplace={inplace!r:.60}")
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
        if not 0 <= seed < 2 ** 64:
            raise TileError(WHERE, "an int seed must be in [0, 2**64)", repr(seed))
        from tilegraph._tensor import from_numpy

        seed = from_numpy(np.array([int(seed)], dtype=np.uint64))
    require_tensor(x, WHERE, "x")
    if seed is not None:
        _check_seed_tensor(seed, x)
    if p == 0 or not training:
        return x
    if seed is None:
        # (a fixed seed of 0 was the default: every step of a replayed graph, and every call on a
        # tensor of one shape, dropped the same elements, a fixed pruning rather than dropout)
        seed = seed_tensor(x, base=_scope_seed())
    return _DROPOUT(x, seed, p=p)


def _scope_seed(kind: str = "dropout") -> int:
    """A base seed for the module a call is recorded in (its scope: the attribute path), so that
    dropout calls of two modules on equal inputs draw different masks (``kind``: which use of
    dropout, so that two in one module differ too)."""
    from tilegraph._graph import current_scope

    digest = hashlib.blake2b(f"{kind}/{current_scope()}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
