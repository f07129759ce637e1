"""Fit the coefficients of the float32 GELU/SiLU kernels in ``ops/elementwise.py``.

Numba on the development machines has no SVML, so ``math.exp``/``math.erf`` inside a loop are
scalar libm calls that keep LLVM from vectorising it. The float32 kernels therefore build their
transcendental parts from arithmetic alone, from two fits made here (NumPy, float64):

1. ``exp(r)`` on ``|r| <= ln2/2`` (the remainder after ``z = n ln2 + r``) as
   ``1 + r (c1 + c2 r + ... + c6 r^5)``: minimax relative error, found with Lawson's algorithm
   (iteratively reweighted least squares: each round multiplies the weights by the current
   absolute errors, which drives the L2 fit to the equioscillating minimax one).
2. ``R(a) = Phi(-a) exp(a^2 / 2)`` (``Phi`` the standard normal CDF; ``R = erfcx(a / sqrt2) / 2``)
   on ``0 <= a <= 14`` as ``P4(a) / Q5(a)`` with ``Q(0) = 1``: minimax relative error by the
   Sanathanan-Koerner iteration (linearise ``P - R Q`` weighted by the previous ``Q``) with
   Lawson weights on top. Degree 5 over 4 gives the ``1 / (a sqrt(2 pi))`` decay of ``R``, so
   the fit has no trouble at the far end, and all coefficients come out positive (no cancellation
   in Horner's scheme for ``a >= 0``). Then ``Phi(-a) = exp(-a^2/2) R(a)``, which keeps GELU
   relatively accurate in its left tail too.

The coefficients are rounded to float32 (what the kernels use); the script prints them in the
form pasted into ``ops/elementwise.py`` and the maximum relative errors of the rounded fits. The
iterations are deterministic, so rerunning reproduces the numbers:

    python bench/fit_kernel_coeffs.py
"""

from __future__ import annotations

import argparse
import math

import numpy as np

LN2 = math.log(2.0)
R_MAX = 14.0  # beyond, exp(-a^2/2) is below float32's smallest normal number


def lawson_poly_exp(degree: int = 6, iters: int = 300, grid: int = 20001):
    """Coefficients c1..c_degree of exp(r) ~ 1 + sum c_k r^k, minimax relative error."""
    h = LN2 / 2
    r = np.linspace(-h, h, grid)
    f = np.exp(r)
    basis = np.stack([r ** k for k in range(1, degree + 1)], 1) / f[:, None]
    target = (f - 1.0) / f  # relative residual: (1 + sum c_k r^k - f) / f
    w = np.full(r.size, 1.0 / r.size)
    for _ in range(iters):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(basis * sw[:, None], target * sw, rcond=None)
        err = np.abs(basis @ c - target)
        w = w * err
        w /= w.sum()
    return c


def mills_ratio(a: np.ndarray) -> np.ndarray:
    """R(a) = Phi(-a) exp(a^2/2) in float64 (math.erfc is accurate to a few ulp here)."""
    return np.array([0.5 * math.erfc(x / math.sqrt(2.0)) * math.exp(0.5 * x * x) for x in a])


def sk_lawson_rational(n: int = 4, m: int = 5, iters: int = 60, grid: int = 8001):
    """P (degree n) and Q (degree m, Q(0) = 1) with P/Q ~ R on [0, R_MAX], minimax relative error."""
    a = np.linspace(0.0, R_MAX, grid)
    f = mills_ratio(a)
    q_prev = np.ones_like(a)
    w = np.full(a.size, 1.0 / a.size)
    best = None
    for _ in range(iters):
        cols = [a ** k for k in range(n + 1)] + [-f * a ** k for k in range(1, m + 1)]
        scale = f * q_prev  # relative error, linearised around the previous denominator
        mat = np.stack(cols, 1) / scale[:, None]
        rhs = f / scale
        sw = np.sqrt(w)
        sol, *_ = np.linalg.lstsq(mat * sw[:, None], rhs * sw, rcond=None)
        p, q = sol[:n + 1], np.concatenate([[1.0], sol[n + 1:]])
        qa = np.polyval(q[::-1], a)
        err = np.abs(np.polyval(p[::-1], a) / qa - f) / f
        if best is None or err.max() < best[0]:
            best = (err.max(), p, q)
        q_prev = qa
        w = w * (err + 1e-300)
        w /= w.sum()
    return best[1], best[2]


def f32(c) -> list[float]:
    return [float(np.float32(x)) for x in c]


def main():
    # no options: --help shows this docstring (it ran the fits), and a flag is refused, not ignored
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    c = f32(lawson_poly_exp())
    h = LN2 / 2
    r = np.linspace(-h, h, 200001)
    approx = 1.0 + r * np.polyval(c[::-1], r)
    print("exp(r), |r| <= ln2/2: 1 + r * (c1 + c2 r + ... + c6 r^5)")
    print("  coefficients (float32):", ", ".join(repr(x) for x in c))
    print(f"  max relative error of the rounded fit: {np.max(np.abs(approx / np.exp(r) - 1)):.3g}")

    p, q = sk_lawson_rational()
    p, q = f32(p), f32(q)
    a = np.linspace(0.0, R_MAX, 20001)
    ra = np.polyval(np.array(p)[::-1], a) / np.polyval(np.array(q)[::-1], a)
    print(f"R(a) = Phi(-a) exp(a^2/2), 0 <= a <= {R_MAX}: P4(a) / Q5(a)")
    print("  P (float32):", ", ".join(repr(x) for x in p))
    print("  Q (float32):", ", ".join(repr(x) for x in q))
    print(f"  max relative error of the rounded fit: {np.max(np.abs(ra / mills_ratio(a) - 1)):.3g}")
    # Cody-Waite split of ln2 for the range reduction: ln2_hi has 12 significant bits, so
    # n * ln2_hi is exact for |n| <= 2^11 and r = (z - n ln2_hi) - n ln2_lo loses nothing.
    hi = math.ldexp(round(math.ldexp(LN2, 12)), -12)
    print(f"ln2 = {hi!r} + {float(np.float32(LN2 - hi))!r}")


if __name__ == "__main__":
    main()
