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

__all__ = ["fused", "on_gpu"]

_KERNELS: dict[str, object] = {}
_BROKEN: set[str] = set()


def on_gpu(x) -> bool:
    """Whether ``x`` is a CuPy array (a GPU worker's value; NumPy on emulated GPU workers)."""
    return type(x).__module__.startswith("cupy")


def fused(name: str, in_params: str, out_params: str, body: str, fallback: Callable) -> Callable:
    """A function that runs the ElementwiseKernel ``body`` on CuPy float32/float64 arrays
    (arguments as ``in_params``, returning ``out_params``), and ``fallback`` (the same arguments)
    on NumPy arrays, on other dtypes, or where the kernel does not compile. Bodies compute in
    double and round once to ``T``."""

    def run(*args):
        if name in _BROKEN or not on_gpu(args[0]) or args[0].dtype.char not in "fd":
            return fallback(*args)
        k = _KERNELS.get(name)
        if k is None:
            import cupy

            k = _KERNELS[name] = cupy.ElementwiseKernel(in_params, out_params, body, f"tilegraph_{name}")
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
