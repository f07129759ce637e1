"""LoRA layer step time (forward + backward): RunLoRA's chosen graphs vs the naive LoRA graph, and
vs a plain torch LoRA layer, all measured in the same run (issue 13, bench part (a)).

    python bench/bench_peft.py                       # N=2048 tokens, n=m=768, r = 8, 16, 32, 64
    python bench/bench_peft.py --rows 8192 --ranks 8 --dtype float64 --repeat 7

Per rank, one layer ``Y = X W + b + s (X U) V`` with W frozen, the gradients of X, U and V (a
middle layer) and of U and V only (the first adapted layer, whose input needs none):

    naive      tilegraph ops as peft writes it: X W + b + ((X U) V) s, autograd of each matmul
               (f1, with X U kept for the backward and dV = (X U)^T dY, dU from dY V^T)
    runlora    tilegraph.ops.lora_linear with the variant chosen by FLOPs (and by time)
    torch      the same naive layer in torch eager (W.requires_grad False)

Each number is the best of ``--repeat`` runs of one compiled graph (the machine is shared: minima
are the stable statistic). Ratios > 1 mean RunLoRA is faster.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tilegraph as tg
from tilegraph.ops import lora as L


def best_of(fn, repeat: int) -> float:
    fn()  # warm-up (plans, BLAS)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def tilegraph_step(arrays, needs, row_tile, build):
    x = tg.from_numpy(arrays["x"], (row_tile, None))
    w, b = tg.from_numpy(arrays["w"]), tg.from_numpy(arrays["b"])
    u, v = tg.from_numpy(arrays["u"]), tg.from_numpy(arrays["v"])
    dy = tg.from_numpy(arrays["dy"], (row_tile, None))
    y = build(x, w, u, v, b)
    wrt = [t for t, f in zip((x, u, v), needs) if f]
    grads = tg.grad((y * dy).sum(), wrt)
    exe = tg.compile([y, *grads])
    return lambda: exe.run()


def naive(x, w, u, v, b, scale):
    return tg.linear(x, w, b) + tg.matmul(tg.matmul(x, u), v) * scale


def torch_step(arrays, needs, scale):
    import torch

    t = {k: torch.tensor(a) for k, a in arrays.items()}
    for k, f in zip("xuv", needs):
        t[k].requires_grad_(f)

    def step():
        for k in "xuv":
            t[k].grad = None
        y = t["x"] @ t["w"] + t["b"] + (t["x"] @ t["u"]) @ t["v"] * scale
        (y * t["dy"]).sum().backward()
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048, help="N, tokens per step")
    ap.add_argument("--dim", type=int, default=768, help="n = m")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--row-tile", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    tg.config.local_scheduler = "threads"
    N, n = args.rows, args.dim
    print(f"LoRA layer fwd+bwd, N={N}, n=m={n}, {args.dtype}, row tile {args.row_tile}, best of {args.repeat} "
          f"(ms; ratio = naive / runlora, torch / runlora)")
    print(f"{'r':>4} {'grads':>6} {'chosen':>8} {'naive':>8} {'runlora':>8} {'by time':>14} {'torch':>8} "
          f"{'naive/rl':>9} {'torch/rl':>9}")
    for r in args.ranks:
        rng = np.random.default_rng(r)
        scale = 2.0
        arrays = {"x": rng.standard_normal((N, n)), "w": rng.standard_normal((n, n)) / n ** 0.5,
                  "u": rng.standard_normal((n, r)) / n ** 0.5, "v": rng.standard_normal((r, n)) / r ** 0.5,
                  "b": rng.standard_normal(n), "dy": rng.standard_normal((N, n))}
        arrays = {k: a.astype(args.dtype) for k, a in arrays.items()}
        for needs in ((True, True, True), (False, True, True)):
            label = "xuv" if needs[0] else "uv"
            chosen = L.choose_variant(N, n, n, r, needs=needs)
            timed = L.choose_variant(N, n, n, r, needs=needs, by="time", dtype=args.dtype)
            t_naive = best_of(tilegraph_step(arrays, needs, args.row_tile,
                                             lambda x, w, u, v, b: naive(x, w, u, v, b, scale)), args.repeat)
            t_rl = best_of(tilegraph_step(arrays, needs, args.row_tile, lambda x, w, u, v, b: tg.ops.lora_linear(
                x, w, u, v, b, scale=scale, requires_grad=needs)), args.repeat)
            t_time = best_of(tilegraph_step(arrays, needs, args.row_tile, lambda x, w, u, v, b: tg.ops.lora_linear(
                x, w, u, v, b, scale=scale, requires_grad=needs, variant=timed)), args.repeat)
            t_torch = float("nan") if args.no_torch else best_of(torch_step(arrays, needs, scale), args.repeat)
            print(f"{r:>4} {label:>6} {'/'.join(chosen):>8} {t_naive * 1e3:8.1f} {t_rl * 1e3:8.1f} "
                  f"{'/'.join(timed) + f' {t_time * 1e3:.1f}':>14} {t_torch * 1e3:8.1f} "
                  f"{t_naive / t_rl:9.2f} {t_torch / t_rl:9.2f}")


if __name__ == "__main__":
    main()
