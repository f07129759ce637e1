"""Fused GPU kernels, made on first use (CuPy is imported only then): CuPy ElementwiseKernels
(``fused``) and row kernels (``row_kernel``: one CUDA block per row of a matrix, for the passes
that reduce each row, layer norm's statistics and softmax's max and sum, then write it).

On a GPU each array operation of a generic kernel is a launch of its own, with some 10 us of
Python and driver time, and a pass over memory; an elementwise formula of a dozen operations
(GELU's backward, the AdamW update) costs a dozen of each. A fused kernel does the formula in one
launch and one pass. The source is compiled by CuPy (NVRTC) the first time it runs on a process;
should that fail (a CUDA toolkit without NVRTC, say), the kernel warns once and the generic
array code runs instead, so a fused kernel can only make a step faster, never stop it.
"""

from __future__ import annotations

import math
import warnings
from typing import Callable

import numpy as np

from tilegraph._graph import xp_of

__all__ = ["fused", "gpu_or_generic", "row_kernel", "ROW_THREADS", "sum_keepdims"]

_KERNELS: dict[str, object] = {}
_BROKEN: set[str] = set()


def gpu_or_generic(name: str, gpu: Callable, generic: Callable) -> Callable:
    """A function that runs ``gpu`` (which launches fused kernels) on CuPy float32/float64 arrays,
    and ``generic`` (the same arguments) on NumPy arrays (emulated GPU workers), on other dtypes,
    or once a kernel of ``gpu`` did not compile (with one warning)."""

    def run(*args, **kwargs):
        if name in _BROKEN or xp_of(args[0]) is np or args[0].dtype.char not in "fd":
            return generic(*args, **kwargs)
        try:
            return gpu(*args, **kwargs)
        except Exception as e:  # compile (or launch configuration) errors: the generic code
            if not _is_build_error(e):
                raise
            _BROKEN.add(name)
            warnings.warn(f"tilegraph: the fused GPU kernel {name!r} did not compile ({type(e).__name__}: "
                          f"{str(e)[:300]}); running its generic array code instead", RuntimeWarning, stacklevel=2)
            return generic(*args, **kwargs)

    return run


def fused(name: str, in_params: str, out_params: str, body: str, fallback: Callable) -> Callable:
    """A function that runs the ElementwiseKernel ``body`` on CuPy float32/float64 arrays
    (arguments as ``in_params``, returning ``out_params``; inputs broadcast against each other),
    and ``fallback`` (the same arguments) where :func:`gpu_or_generic` says."""

    def gpu(*args):
        k = _KERNELS.get(name)
        if k is None:
            k = _KERNELS[name] = xp_of(args[0]).ElementwiseKernel(in_params, out_params, body, f"tilegraph_{name}")
        return k(*args)

    return gpu_or_generic(name, gpu, fallback)


#: threads of a row kernel's block (a multiple of 32: whole warps)
ROW_THREADS = 256

# Sums and maxima over a block: within each warp by shuffles, then over the warps' results
# (at most 32) through shared memory; every thread gets the result. ``red`` is a
# ``__shared__ double[32]`` of the calling kernel, and every thread of the block must call.
_BLOCK_REDUCE = r"""
__device__ double tilegraph_max_nan(double a, double b) {  // NaN wins, as NumPy's max
    return (a != a || b != b) ? (a + b) : (a > b ? a : b);
}
__device__ double tilegraph_block_reduce(double v, double* red, int is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        double u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? tilegraph_max_nan(v, u) : v + u;
    }
    __syncthreads();  // red may still be read by the last call
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[0];
    for (int i = 1; i < (blockDim.x + 31) >> 5; ++i) v = is_max ? tilegraph_max_nan(v, red[i]) : v + red[i];
    return v;
}
"""
_RAW: dict[tuple[str, str], object] = {}


def row_kernel(name: str, source: str, dtype):
    """The CuPy RawKernel ``tilegraph_<name>`` of ``source`` for ``dtype`` (float32 or float64,
    the type ``T`` in the source, which may call ``tilegraph_block_reduce``), compiled once per
    process; launch it with a grid of one block per row and :data:`ROW_THREADS` threads."""
    key = (name, np.dtype(dtype).char)
    k = _RAW.get(key)
    if k is None:
        import cupy

        t = {"f": "float", "d": "double"}[key[1]]
        k = _RAW[key] = cupy.RawKernel(f"typedef {t} T;\n{_BLOCK_REDUCE}\n{source}", f"tilegraph_{name}")
    return k


def _is_build_error(e: Exception) -> bool:
    import cupy

    kinds = (getattr(cupy.cuda.compiler, "CompileException", None), getattr(cupy.cuda.driver, "CUDADriverError", None))
    return isinstance(e, tuple(k for k in kinds if k is not None))


def sum_keepdims(x, axes: tuple):
    """``x.sum(axis=axes, keepdims=True)``. On a GPU, a sum over the leading axes of a C-contiguous
    float array (a bias gradient: (batch, seq, C) summed to (C,)) is the product of a ones vector
    with the (rows x C) matrix, which cuBLAS reads row after row; CuPy's reduction reads each
    column with a row's stride (GPT-2 124M on an H200: its 73 such sums took 11 ms of a step)."""
    k = len(axes)
    if (xp_of(x) is np or k == 0 or k == x.ndim or tuple(sorted(axes)) != tuple(range(k)) or x.dtype.char not in "fd"
            or not x.flags.c_contiguous or x.size == 0):
        return x.sum(axis=axes, keepdims=True)
    xp = xp_of(x)
    rows = x.size // math.prod(x.shape[k:])
    return (xp.ones(rows, x.dtype) @ x.reshape(rows, -1)).reshape((1,) * k + x.shape[k:])
