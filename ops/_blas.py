"""Matrix products of the CPU kernels through Intel MKL, where installed and asked for (``TILEGRAPH_BLAS``).

NumPy's wheels multiply with OpenBLAS; PyTorch's CPU wheels with MKL, which runs the GEMM shapes of
a transformer's layers 12-21% faster on one core of an Intel Xeon (Sapphire Rapids, float32, a
GPT-2 layer's products over 512 rows: NumPy 142-153 GFLOP/s, MKL 163-172, torch 162-174;
``OMP_NUM_THREADS=1 python bench/bench_kernels.py --only gemm``). Those products are most of a
training step (GPT-2 124M LoRA: matmul kernel seconds 3.68 -> 3.30 per step), so with
``pip install "tilegraph[mkl]"`` (the ``mkl`` wheel, Intel's runtime library) and
``TILEGRAPH_BLAS=auto`` the CPU kernels' 2-D float32/float64 products go to MKL's
``cblas_?gemm``: one thread per call (MKL's sequential layer: the kernels' parallelism is the
worker's threads, as with OpenBLAS at one thread), conditional numerical reproducibility set
strict (the same inputs give the same bits whatever their alignment), called through ctypes,
which lets go of the GIL for the call as NumPy does.

``TILEGRAPH_BLAS`` chooses, in every process that runs kernels (the workers inherit it from the
process that starts them): ``numpy`` (the default), ``auto`` or ``mkl`` (MKL, or an error saying
why it cannot load). ``auto`` takes MKL in a Dask worker process (where a cluster's kernels run)
on a GenuineIntel CPU where the library is installed and torch is not loaded, and NumPy
elsewhere: on other CPUs MKL may take slower code paths, and MKL loaded into a process before
torch is imported there takes over torch's own MKL, which then runs its products on one thread
(torch's matmuls 2x slower on 2 cores), so under ``auto`` a user's own process (a notebook's, a
script's: where torch may come later, and where kernels run only without a cluster) never loads
it. The default stays NumPy: MKL's products differ from OpenBLAS's in the last bits, so with
``auto`` a graph computed on a cluster and the same graph computed in-process no longer agree
bit for bit. :func:`backend` says which one this process uses.

Products MKL cannot take as they are (other dtypes, strides that are not a row-major matrix or its
transpose, empty dims, CuPy arrays) go to NumPy, so a kernel never copies an operand to reach MKL.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

import numpy as np

from tilegraph._errors import TileError

__all__ = ["backend", "matmul", "BLAS_ENV"]

#: the environment variable that chooses the library
BLAS_ENV = "TILEGRAPH_BLAS"
_CHOICES = ("numpy", "auto", "mkl")

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_THREADING_SEQUENTIAL = 1
_MKL_CBWR_AUTO, _MKL_CBWR_STRICT = 2, 0x10000

_state: dict = {}  # "backend": "mkl" | "numpy"; "gemm": {dtype: cblas function}


def _intel_cpu() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return "GenuineIntel" in line
    except OSError:
        pass
    return False


def _mkl_paths() -> list[str]:
    """Where the ``mkl`` wheel puts its runtime library (the environment's ``lib``), then the
    system's search path."""
    found = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        lib = Path(prefix) / "lib"
        found += sorted(str(p) for p in lib.glob("libmkl_rt.so*"))
    system = ctypes.util.find_library("mkl_rt")
    if system:
        found.append(system)
    return found


def _load_mkl() -> tuple[dict | None, str]:
    """MKL's sgemm and dgemm, set to one thread per call and strict reproducibility; or None and
    why not."""
    paths = _mkl_paths()
    if not paths:
        return None, 'no MKL runtime library (libmkl_rt) in this environment: pip install "tilegraph[mkl]"'
    errors = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)  # (RTLD_LOCAL: its symbols stay its own, beside torch's MKL)
        except OSError as e:
            errors.append(f"{path}: {e}")
            continue
        # both before any other MKL call: one thread per call, the same bits for the same inputs
        lib.MKL_Set_Threading_Layer(_MKL_THREADING_SEQUENTIAL)
        lib.MKL_CBWR_Set(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT)
        gemm = {}
        for dtype, name, scalar in ((np.dtype(np.float32), "cblas_sgemm", ctypes.c_float),
                                    (np.dtype(np.float64), "cblas_dgemm", ctypes.c_double)):
            fn = getattr(lib, name)
            c_int, ptr = ctypes.c_int, ctypes.c_void_p
            fn.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, scalar, ptr, c_int, ptr, c_int, scalar,
                           ptr, c_int]
            fn.restype = None
            gemm[dtype] = fn
        return gemm, ""
    return None, "; ".join(errors)


def _in_worker() -> bool:
    """Whether this process is a Dask worker's (a Worker lives in it)."""
    module = sys.modules.get("distributed.worker")
    return bool(module is not None and getattr(module.Worker, "_instances", None))


def _torch_loaded() -> bool:
    return "torch" in sys.modules


def backend() -> str:
    """``"mkl"`` or ``"numpy"``: the library this process's CPU kernels multiply with (decided
    at the first product, from ``TILEGRAPH_BLAS``; the module docstring says what ``auto`` takes)."""
    if "backend" not in _state:
        choice = os.environ.get(BLAS_ENV, "numpy").strip().lower() or "numpy"
        if choice not in _CHOICES:
            raise TileError(f"the {BLAS_ENV} environment variable", f"one of {', '.join(_CHOICES)}",
                            repr(os.environ[BLAS_ENV]))
        wanted = choice == "mkl" or (choice == "auto" and _in_worker() and _intel_cpu() and not _torch_loaded())
        gemm, why = _load_mkl() if wanted else (None, "")  # (loaded only to be used: see above)
        if choice == "mkl" and gemm is None:
            raise TileError(f"{BLAS_ENV}=mkl", "MKL's runtime library, loadable here", why)
        _state["gemm"] = gemm or {}
        _state["backend"] = "mkl" if gemm else "numpy"
    return _state["backend"]


def _layout(x: np.ndarray) -> tuple[int, int] | None:
    """``(trans, ld)`` of a 2-D array as a row-major BLAS operand: rows with unit stride
    (``_NO_TRANS``), or the transpose of such (``_TRANS``); None for any other strides."""
    size = x.itemsize
    s0, s1 = x.strides
    rows, cols = x.shape
    if (s1 == size or cols == 1) and s0 % size == 0 and s0 // size >= max(1, cols):
        return _NO_TRANS, s0 // size
    if (s0 == size or rows == 1) and s1 % size == 0 and s1 // size >= max(1, rows):
        return _TRANS, s1 // size
    return None


def matmul(a, b, out=None):
    """``a @ b`` of two 2-D arrays, or with ``out`` (a C-contiguous array of the product's shape and
    dtype) ``out += a @ b`` in place; returns the product (``out`` when given)."""
    gemm = _state.get("gemm")
    if gemm is None:
        backend()
        gemm = _state["gemm"]
    fn = gemm.get(a.dtype) if gemm else None
    if (fn is None or type(a) is not np.ndarray or type(b) is not np.ndarray or a.ndim != 2 or b.ndim != 2
            or b.dtype != a.dtype or 0 in a.shape or 0 in b.shape or a.shape[1] != b.shape[0]):
        return _numpy(a, b, out)
    la, lb = _layout(a), _layout(b)
    m, k = a.shape
    n = b.shape[1]
    if out is not None and (type(out) is not np.ndarray or out.dtype != a.dtype or out.shape != (m, n)
                            or not out.flags.c_contiguous or not out.flags.writeable):
        return _numpy(a, b, out)
    if la is None or lb is None or out is not None and (np.may_share_memory(out, a) or np.may_share_memory(out, b)):
        return _numpy(a, b, out)
    beta = 0.0
    if out is None:
        out = np.empty((m, n), dtype=a.dtype)
    else:
        beta = 1.0
    fn(_ROW_MAJOR, la[0], lb[0], m, n, k, 1.0, a.ctypes.data, la[1], b.ctypes.data, lb[1], beta,
       out.ctypes.data, n)
    return out


def _numpy(a, b, out):
    if out is None:
        return a @ b
    out += a @ b
    return out
