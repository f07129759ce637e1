"""Single-thread speed of tilegraph's elementwise CPU kernels (GELU, fused AdamW) against torch.

Times the CPU tile kernels exactly as a worker calls them (output allocation included) next to
the torch equivalents on the same data:

    gelu / gelu_bwd        ops.elementwise GELU forward and backward (tanh and exact forms)
                           vs F.gelu forward and its autograd backward
    silu / silu_bwd        the same for SiLU vs F.silu
    adamw                  tilegraph.optim's fused AdamW tile update (new p, m, v arrays)
                           vs torch.optim.AdamW.step() (default and fused=True, both in place)
    gemm                   the matrix products of the CPU matmul kernels: NumPy's ``@`` (OpenBLAS)
                           and MKL as a cluster's workers call it (ops/_blas.py, where installed)
                           vs torch's (MKL), on a GPT-2 layer's shapes, in GFLOP/s

    OMP_NUM_THREADS=1 python bench/bench_kernels.py                     # float32, default sizes
    OMP_NUM_THREADS=1 python bench/bench_kernels.py --dtype float64 --repeat 50
    OMP_NUM_THREADS=1 python bench/bench_kernels.py --hold 8     # outputs in fresh memory

``--hold N`` keeps the last N results of every call alive, so outputs land in memory the process
has not touched yet (as in training, where Dask still holds the previous tiles): it shows what
page faults add to the kernels that allocate (ours, torch's GELU; torch's AdamW works in place).

Sizes: GELU and SiLU on one (1024, 3072) MLP activation tile (batch 4 x 256 tokens, width 768), AdamW on one
768 x 3072 weight. Each number is the best of ``--repeat`` timings (the machine is shared: minima
are the stable statistic). torch's backward is the autograd backward alone (forward+backward
minus forward, both best-of). Columns: ms per call, ns per element, GB/s of compulsory traffic
(inputs read + outputs written once), and ours / torch.
"""

from __future__ import annotations

import argparse
import collections
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from _common import at_least, require  # noqa: E402


HOLD = 0


def best_s(fn, repeat: int) -> float:
    """Best of ``repeat`` timings of ``fn()`` in seconds, after two warm-up calls."""
    held = collections.deque(maxlen=HOLD or None)
    fn()
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = fn()
        best = min(best, time.perf_counter() - t0)
        if HOLD:
            held.append(res)
    return best


def row(name, n, n_arrays, itemsize, ours, theirs):
    def cols(t):
        if t is None:
            return f"{'-':>9} {'-':>7} {'-':>7}"
        return f"{1e3 * t:9.3f} {1e9 * t / n:7.2f} {n * n_arrays * itemsize / t / 1e9:7.1f}"

    ratio = f"{ours / theirs:6.2f}" if theirs else f"{'-':>6}"
    print(f"{name:<22} {n:>9} {cols(ours)} | {cols(theirs)} | {ratio}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--gelu-shape", type=at_least(1), nargs="+", default=[1024, 3072])
    ap.add_argument("--adamw-shape", type=at_least(1), nargs="+", default=[768, 3072])
    ap.add_argument("--repeat", type=at_least(1), default=20)
    ap.add_argument("--only", choices=["gelu", "silu", "adamw", "gemm"], default=None)
    ap.add_argument("--hold", type=at_least(0), default=0, help="keep the last N results alive (fresh output memory)")
    args = ap.parse_args()
    require(ap, "torch", what="bench_kernels.py (it times torch's kernels beside tilegraph's)")
    global HOLD
    HOLD = args.hold

    import torch

    torch.set_num_threads(1)
    import tilegraph  # noqa: F401 - registers the kernels
    from tilegraph.ops import elementwise as ew
    from tilegraph import optim

    F = torch.nn.functional
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)
    print(f"dtype {dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"best of {args.repeat}")
    print(f"{'kernel':<22} {'elements':>9} {'ours ms':>9} {'ns/el':>7} {'GB/s':>7} | "
          f"{'torch ms':>9} {'ns/el':>7} {'GB/s':>7} | {'ratio':>6}")

    if args.only in (None, "gelu"):
        x = (rng.standard_normal(args.gelu_shape) * 2).astype(dtype)
        g = rng.standard_normal(args.gelu_shape).astype(dtype)
        n = x.size
        tx, tg_ = torch.from_numpy(x), torch.from_numpy(g)
        for approx, label in (("tanh", "gelu_tanh"), ("none", "gelu_erf")):
            ours_f = best_s(lambda: ew._gelu_cpu(x, approximate=approx), args.repeat)
            ours_b = best_s(lambda: ew._gelu_bwd_cpu(x, g, approximate=approx), args.repeat)
            with torch.no_grad():
                t_f = best_s(lambda: F.gelu(tx, approximate=approx), args.repeat)
            xr = tx.clone().requires_grad_(True)

            def fwd_bwd():
                y = F.gelu(xr, approximate=approx)
                return y, torch.autograd.grad(y, xr, tg_)

            def fwd_only():
                return F.gelu(xr, approximate=approx)

            t_fb, t_fo = best_s(fwd_bwd, args.repeat), best_s(fwd_only, args.repeat)
            row(label, n, 2, dtype.itemsize, ours_f, t_f)
            row(label + "_bwd", n, 3, dtype.itemsize, ours_b, max(t_fb - t_fo, 1e-9))

    if args.only == "silu" or args.only is None:
        x = (rng.standard_normal(args.gelu_shape) * 2).astype(dtype)
        g = rng.standard_normal(args.gelu_shape).astype(dtype)
        tx, tg_ = torch.from_numpy(x), torch.from_numpy(g)
        silu, silu_bwd = ew._silu_k.impl("cpu"), ew._silu_bwd_k.impl("cpu")
        ours_f = best_s(lambda: silu(x), args.repeat)
        ours_b = best_s(lambda: silu_bwd(x, g), args.repeat)
        with torch.no_grad():
            t_f = best_s(lambda: F.silu(tx), args.repeat)
        xr = tx.clone().requires_grad_(True)

        def silu_fb():
            y = F.silu(xr)
            return y, torch.autograd.grad(y, xr, tg_)

        t_fb, t_fo = best_s(silu_fb, args.repeat), best_s(lambda: F.silu(xr), args.repeat)
        row("silu", x.size, 2, dtype.itemsize, ours_f, t_f)
        row("silu_bwd", x.size, 3, dtype.itemsize, ours_b, max(t_fb - t_fo, 1e-9))

    if args.only in (None, "adamw"):
        shape = args.adamw_shape
        p = rng.standard_normal(shape).astype(dtype)
        g = rng.standard_normal(shape).astype(dtype)
        m = (rng.standard_normal(shape) * 0.1).astype(dtype)
        v = (rng.random(shape) * 0.01).astype(dtype)
        hyper = np.array([1e-3, 10.0], np.float64)
        kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
        ours = best_s(lambda: optim._adamw_cpu(p, g, m, v, hyper, **kw), args.repeat)
        res = {}
        for label, extra in (("default", {}), ("fused", {"fused": True})):
            tp = torch.tensor(p, requires_grad=True)
            tp.grad = torch.tensor(g)
            try:
                opt = torch.optim.AdamW([tp], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **extra)
                res[label] = best_s(opt.step, args.repeat)
            except (RuntimeError, TypeError) as e:  # fused needs a recent torch
                print(f"torch AdamW {label}: unavailable ({e})")
        # 4 arrays read, 3 written (torch writes in place, ours into new arrays: same traffic)
        row("adamw vs torch", p.size, 7, dtype.itemsize, ours, res.get("default"))
        if "fused" in res:
            row("adamw vs torch fused", p.size, 7, dtype.itemsize, ours, res["fused"])

    if args.only in (None, "gemm"):
        gemm_rows(rng, dtype, args.repeat, torch)


#: (rows, inner, cols, first operand transposed): a GPT-2 124M layer's products over a tile of 512
#: rows (batch 2 x 256): q/k/v/o, MLP up and down, and the weight gradients x^T dy
GEMM_SHAPES = [(512, 768, 768, False), (512, 768, 3072, False), (512, 3072, 768, False),
               (768, 512, 3072, True), (3072, 512, 768, True)]


def gemm_rows(rng, dtype, repeat: int, torch) -> None:
    """NumPy's and MKL's products (MKL as a cluster's workers call it, ops/_blas.py; "-" where it
    is not installed) and torch's, in GFLOP/s, and MKL's time over torch's."""
    from tilegraph.ops import _blas as blas

    gemm, why = blas._load_mkl()  # (this process imported torch first: its MKL keeps its threads)
    if gemm is None:
        print(f"gemm: MKL not measured ({why})")
    else:  # the kernels' products here take MKL, as in a worker process
        blas._state.update(gemm=gemm, backend="mkl")
    print(f"gemm (GFLOP/s)                    {'numpy @':>9} {'mkl':>10} {'torch':>8} | {'mkl/torch time':>14}")
    for m, k, n, tn in GEMM_SHAPES:
        a = rng.standard_normal((k, m) if tn else (m, k)).astype(dtype)
        b = rng.standard_normal((k, n)).astype(dtype)
        a_op = a.T if tn else a
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ta_op = ta.T if tn else ta
        flops = 2.0 * m * k * n
        t_np = best_s(lambda: a_op @ b, repeat)
        t_mkl = best_s(lambda: blas.matmul(a_op, b), repeat) if gemm else None
        t_pt = best_s(lambda: ta_op @ tb, repeat)
        name = f"{m} x {k} x {n}{' (a^T)' if tn else ''}"
        mkl = f"{flops / t_mkl / 1e9:10.0f}" if t_mkl else f"{'-':>10}"
        ratio = f"{t_mkl / t_pt:14.2f}" if t_mkl else f"{'-':>14}"
        print(f"{name:<32} {flops / t_np / 1e9:9.0f} {mkl} {flops / t_pt / 1e9:8.0f} | {ratio}")


if __name__ == "__main__":
    main()
