"""Fused GPU kernels: CuPy ElementwiseKernels, made on first use (CuPy is imported only then).

On a GPU each array operation of a generic kernel is a launch of its own, with some 10 us of
Python and driver time, and a pass over memory; an elementwise formula of a dozen operations
(GELU's backward, the AdamW update) costs a dozen of each. A fused kernel does the formula in one
launch and one pass. The source is compiled by CuPy (NVRTC) the first time it runs on a process;
should that fail (a CUDA toolkit without NVRTC, say), the kernel warns once and the generic
array code runs instead, so a fused kernel can only make a step faster, never stop it.
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np

from tilegraph._graph import xp_of

__all__ = ["fused"]

_KERNELS: dict[str, object] = {}
_BROKEN: set[str] = set()


def fused(name: str, in_params: str, out_params: str, body: str, fallback: Callable) -> Callable:
    """A function that runs the ElementwiseKernel ``body`` on CuPy float32/float64 arrays
    (arguments as ``in_params``, returning ``out_params``), and ``fallback`` (the same arguments)
    on NumPy arrays, on other dtypes, or where the kernel does not compile. Bodies compute in
    double and round once to ``T``."""

    def run(*args):
        xp = xp_of(args[0])  # NumPy on emulated GPU workers
        if name in _BROKEN or xp is np or args[0].dtype.char not in "fd":
            return fallback(*args)
        k = _KERNELS.get(name)
        if k is None:
            k = _KERNELS[name] = xp.ElementwiseKernel(in_params, out_params, body, f"tilegraph_{name}")
        try:
            return k(*args)
        except Exception as e:  # compile (or launch configuration) errors: the generic code
            if not _is_build_error(e):
                raise
            _BROKEN.add(name)
            warnings.warn(f"tilegraph: the fused GPU kernel {name!r} did not compile ({type(e).__name__}: "
                          f"{str(e)[:300]}); running its generic array code instead", RuntimeWarning, stacklevel=2)
            return fallback(*args)

    return run


def _is_build_error(e: Exception) -> bool:
    import cupy

    kinds = (getattr(cupy.cuda.compiler, "CompileException", None), getattr(cupy.cuda.driver, "CUDADriverError", None))
    return isinstance(e, tuple(k for k in kinds if k is not None))
