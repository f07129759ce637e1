"""The softmax passes of the CPU attention kernels, fused into one Numba loop each.

Between its two matrix products a score block goes through a causal mask, a row max, a shift, an
exponential, a row sum and (in the backward) ``dS = P * (dP - delta)``: with NumPy that is a pass
over the block per operation, each about as slow as the products themselves when heads are small
(the debug GPT-2's heads, 8 x 4 x 64 x 16, one thread: forward, dQ and dK/dV took 2.4 ms with
NumPy's passes and 1.4 with these; 33 and 26 ms on the block stack's 2 x 12 x 256 x 64). Each
function here makes that one pass, in place, row by row, over the columns a row may see; masked
columns become 0, which is what the products after them need.

A causal mask is one number per block, ``lim``: in a (queries x keys) block, row ``r`` sees the
keys ``j <= r + lim``; in a (keys x queries) block, key row ``r`` is seen by the queries
``j >= r + lim``. ``NO_MASK`` lets every column through (``lim`` is an int64 either way, so one
compiled loop serves both).

float32 uses the vectorised ``exp`` of :mod:`tilegraph.ops.elementwise` (3 ulp, arithmetic only),
float64 ``np.exp``. float16 tiles never reach these passes: the attention kernels widen them to
float32 first (``ops/attention.py``'s ``_in_f32``).
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types as nb_types
from numba.extending import overload

from .elementwise import _EXP_MIN_F, _FAST32, _exp_f32

__all__ = ["NO_MASK", "one_pass", "softmax_rows", "probs_rows", "probs_cols"]

#: ``lim`` of a block without a mask: row r sees every key (r + lim >= any column)
NO_MASK = 1 << 40
_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def one_pass(xp, dtype) -> bool:
    """Whether the fused passes apply: NumPy arrays of float32 or float64."""
    return xp is np and np.dtype(dtype) in _DTYPES


def _exp(x):  # pragma: no cover - replaced by the overload inside Numba
    return np.exp(x)


@overload(_exp, inline="always")
def _exp_overload(x):
    if x == nb_types.float32:
        return lambda x: _exp_f32(max(x, _EXP_MIN_F))
    return lambda x: np.exp(x)


# Loops index from 0 over slices: a loop from a variable start gives Numba's negative-index
# wraparound a case to check, and it then stays scalar (5x slower here).
@numba.njit(cache=True, nogil=True, inline="always", fastmath=_FAST32, error_model="numpy")
def _max(x, mx):
    """max(mx, x.max()) in four running maxima: one chain would wait on every compare."""
    a0 = a1 = a2 = a3 = mx
    n = x.size - x.size % 4
    for j in range(0, n, 4):
        a0, a1, a2, a3 = max(a0, x[j]), max(a1, x[j + 1]), max(a2, x[j + 2]), max(a3, x[j + 3])
    for j in range(n, x.size):
        a0 = max(a0, x[j])
    return max(max(a0, a1), max(a2, a3))


@numba.njit(cache=True, nogil=True, inline="always", fastmath=_FAST32, error_model="numpy")
def _sum(x):
    """x.sum() in four partial sums."""
    a0 = a1 = a2 = a3 = x.dtype.type(0.0)
    n = x.size - x.size % 4
    for j in range(0, n, 4):
        a0, a1, a2, a3 = a0 + x[j], a1 + x[j + 1], a2 + x[j + 2], a3 + x[j + 3]
    for j in range(n, x.size):
        a0 += x[j]
    return (a0 + a1) + (a2 + a3)


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def softmax_rows(s, starts, widths, lims, m, l):
    """Scores ``s`` (g, rows, cols) to ``exp(s - m)`` in place, row by row.

    Entry ``e`` of ``starts``/``widths``/``lims`` is one key tile's columns
    ``[starts[e], starts[e] + widths[e])``, where row r sees column ``starts[e] + j`` for
    ``j <= r + lims[e]``. ``m[h, r]`` gets the row's max over the columns it sees (-inf when it
    sees none; the row is then all 0) and ``l[h, r]`` the sum of its exponentials."""
    g, rows, cols = s.shape
    zero, ninf = s.dtype.type(0.0), s.dtype.type(-np.inf)
    for h in range(g):
        for r in range(rows):
            row = s[h, r]
            mx = ninf
            for e in range(starts.size):
                c0 = starts[e]
                mx = _max(row[c0:c0 + min(widths[e], max(0, r + lims[e] + 1))], mx)
            if mx == ninf:
                row[:] = zero
            else:
                for e in range(starts.size):
                    c0 = starts[e]
                    w = min(widths[e], max(0, r + lims[e] + 1))
                    seen = row[c0:c0 + w]
                    for j in range(seen.size):
                        seen[j] = _exp(seen[j] - mx)
                    row[c0 + w:c0 + widths[e]] = zero
            m[h, r] = mx
            l[h, r] = _sum(row)


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def probs_rows(s, dp, lse, delta, lim):
    """A (queries x keys) block of the backward: ``dp`` (g, rows, cols) becomes
    ``dS = P * (dP - delta)`` with ``P = exp(s - lse)`` per row, in place; masked columns (row r
    sees ``j <= r + lim``) give 0."""
    g, rows, cols = s.shape
    zero = s.dtype.type(0.0)
    for h in range(g):
        for r in range(rows):
            w = min(cols, max(0, r + lim + 1))
            top, d = lse[h, r], delta[h, r]
            sr, dr = s[h, r, :w], dp[h, r, :w]
            for j in range(w):
                dr[j] = _exp(sr[j] - top) * (dr[j] - d)
            dp[h, r, w:] = zero


@numba.njit(cache=True, nogil=True, fastmath=_FAST32, error_model="numpy")
def probs_cols(s, dp, lse, delta, lim):
    """The transposed block, (keys x queries), of the dK/dV kernel: ``s`` becomes
    ``P = exp(s - lse)`` and ``dp`` becomes ``dS = P * (dP - delta)``, with ``lse`` and ``delta``
    (g, cols) per query column, in place; key row r is seen by the queries ``j >= r + lim`` (the
    others give 0)."""
    g, rows, cols = s.shape
    zero = s.dtype.type(0.0)
    for h in range(g):
        for r in range(rows):
            j0 = 0 if lim >= NO_MASK else min(cols, max(0, r + lim))
            s[h, r, :j0] = zero
            dp[h, r, :j0] = zero
            sr, dr, lr, er = s[h, r, j0:], dp[h, r, j0:], lse[h, j0:], delta[h, j0:]
            for j in range(sr.size):
                p = _exp(sr[j] - lr[j])
                sr[j] = p
                dr[j] = p * (dr[j] - er[j])
