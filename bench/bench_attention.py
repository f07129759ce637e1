"""Single-thread speed of the causal attention tile kernels against torch's SDPA.

Records tilegraph's causal ``scaled_dot_product_attention`` forward and backward for one shape,
evaluates the graph once in topological order to get every kernel's real inputs and parameters,
then times each sdpa kernel on those inputs (summed over all its tiles) next to torch's
``F.scaled_dot_product_attention(is_causal=True)`` forward and backward on the same data:

    OMP_NUM_THREADS=1 python bench/bench_attention.py                 # (2, 12, 256, 64), 1 and 4 tiles
    OMP_NUM_THREADS=1 python bench/bench_attention.py --dtype float64 --tiles 1 2
    OMP_NUM_THREADS=1 python bench/bench_attention.py --dropout 0.1    # dropout on the weights, both sides

Run it with one thread (the line above) so the numbers compare kernels, not thread pools. Each
number is the best of ``--repeat`` runs; torch's backward is its forward+backward minus its
forward. tilegraph's backward is the sum of its backward kernels: with one tile along T the fused
``sdpa_bwd`` (and, for comparison, the delta, dQ and dK/dV kernels it replaces), with more tiles
the delta, dQ and dK/dV kernels. With ``--dropout P`` both drop the attention weights (torch's
``dropout_p``; tilegraph's kernels draw the factors of the mask from the step's seed themselves).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from _common import at_least, require  # noqa: E402


def best_ms(fn, repeat: int) -> float:
    """Best of ``repeat`` timings of ``fn()`` in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def kernel_calls(roots):
    """Evaluate the graph of ``roots`` on the CPU; return the sdpa kernel calls with their inputs."""
    from tilegraph._graph import topo_order

    values, calls = {}, []
    for node in topo_order(roots):
        if node.is_leaf:
            values[id(node)] = (node.cell.value,)
            continue
        args = [values[id(r.node)][r.index] for r in node.inputs]
        fn = node.kernel.impl("cpu")
        res = fn(*args, **node.params)
        res = res if isinstance(res, tuple) else (res,)
        for val, (shape, dtype) in zip(res, node.out_meta):
            assert val.shape == shape and val.dtype == dtype, (node, val.shape, val.dtype)
        values[id(node)] = res
        if node.kernel.name.startswith("sdpa"):
            calls.append((node.kernel.name, fn, args, node.params))
    return calls


def bench_tilegraph(q, k, v, do, n_tiles: int, repeat: int, fused: bool = True, dropout: float = 0.0) -> dict[str, float]:
    import tilegraph as tg
    import tilegraph.ops.attention as attention
    from tilegraph.ops.attention import scaled_dot_product_attention as sdpa

    attention._FUSED_BACKWARD = fused

    T = q.shape[2]
    chunks = tuple(np.diff(np.linspace(0, T, n_tiles + 1).round().astype(int)))
    tq, tk, tv = (tg.from_numpy(a, (None, None, chunks, None)) for a in (q, k, v))
    out = sdpa(tq, tk, tv, is_causal=True, dropout_p=dropout)
    dq, dk, dv = tg.grad((out * tg.from_numpy(do, out.chunks)).sum(), [tq, tk, tv])
    roots = [r for t in (out, dq, dk, dv) for r in t.grid.flat]
    calls = kernel_calls(roots)
    ms: dict[str, float] = {}
    for name in dict.fromkeys(n for n, *_ in calls):   # the kernels in graph order
        mine = [(fn, args, params) for n, fn, args, params in calls if n == name]

        def run(mine=mine):
            for fn, args, params in mine:
                fn(*args, **params)

        ms[name] = best_ms(run, repeat)
    return ms


def bench_torch(q, k, v, do, repeat: int, dropout: float = 0.0) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    F = torch.nn.functional
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tdo = torch.tensor(do)

    def fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, dropout_p=dropout)

    def fwd_bwd():
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, dropout_p=dropout)
        torch.autograd.grad(out, (tq, tk, tv), tdo)

    f = best_ms(fwd, repeat)
    fb = best_ms(fwd_bwd, repeat)
    return {"fwd": f, "bwd": fb - f}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=at_least(1), nargs=4, default=(2, 12, 256, 64), metavar=("B", "H", "T", "D"))
    ap.add_argument("--tiles", type=at_least(1), nargs="+", default=(1, 4), help="query/key tiles along T")
    ap.add_argument("--dtype", choices=["float16", "float32", "float64"], default="float32")
    ap.add_argument("--repeat", type=at_least(1), default=20)
    ap.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout_p of the attention weights")
    args = ap.parse_args()
    if not 0 <= args.dropout < 1:
        ap.error(f"--dropout must be in [0, 1), received {args.dropout}")
    require(ap, "torch", what="bench_attention.py (it times torch's SDPA beside the kernels)")
    if max(args.tiles) > args.shape[2]:
        ap.error(f"--tiles {max(args.tiles)}: more tiles than T = {args.shape[2]} positions")

    rng = np.random.default_rng(0)
    q, k, v, do = (rng.standard_normal(args.shape).astype(args.dtype) for _ in range(4))
    ref = bench_torch(q, k, v, do, args.repeat, args.dropout)
    print(f"shape {tuple(args.shape)} {args.dtype}, causal{f', dropout {args.dropout}' if args.dropout else ''}, "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}")
    print(f"torch SDPA: fwd {ref['fwd']:.2f} ms, bwd {ref['bwd']:.2f} ms, fwd+bwd {ref['fwd'] + ref['bwd']:.2f} ms")
    # one tile along T: the fused backward (one sdpa_bwd task), then the split kernels it replaces
    runs = [(n, fused) for n in args.tiles for fused in ((True, False) if n == 1 else (True,))]
    for n, fused in runs:
        ms = bench_tilegraph(q, k, v, do, n, args.repeat, fused, args.dropout)
        bwd = sum(t for name, t in ms.items() if name != "sdpa_fwd")
        print(f"tilegraph, {n} tile(s) along T (all tiles summed){'' if fused or n > 1 else ', split backward'}:")
        for name, t in ms.items():
            print(f"  {name:15s} {t:8.2f} ms")
        print(f"  fwd     {ms['sdpa_fwd']:8.2f} ms   {ms['sdpa_fwd'] / ref['fwd']:5.2f}x torch")
        print(f"  bwd     {bwd:8.2f} ms   {bwd / ref['bwd']:5.2f}x torch")
        tot = ms["sdpa_fwd"] + bwd
        print(f"  fwd+bwd {tot:8.2f} ms   {tot / (ref['fwd'] + ref['bwd']):5.2f}x torch")


if __name__ == "__main__":
    main()
