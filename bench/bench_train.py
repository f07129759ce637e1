"""Training throughput of tilegraph against PyTorch eager, measured in the same run.

Trains (1) an MLP and (2) a stack of GPT-2 style transformer blocks with tilegraph on the
embedded Dask cluster and with PyTorch eager on the same machine, then prints tokens/s of both,
their ratio, and the share of tilegraph's step time spent outside kernels:

    outside = 1 - (seconds inside tile kernels, summed over workers) / (wall seconds x worker threads)

so idle workers, Dask scheduling, transfers and the Python runner all count as "outside".

    python bench/bench_train.py                      # both models, width 768, 6 blocks
    python bench/bench_train.py --model blocks --width 256 --layers 2 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import numpy as np

from _common import at_least, require, setup_threads, timed_steps


def build_tilegraph(kind, args, tg):
    d, tile = args.width, args.tile

    class Block(tg.nn.Module):
        def __init__(self, rng):
            self.ln1 = tg.nn.LayerNorm(d, tile=tile)
            self.attn = tg.nn.CausalSelfAttention(d, args.heads, tile=tile, seed=rng)
            self.ln2 = tg.nn.LayerNorm(d, tile=tile)
            self.mlp = tg.nn.MLP(d, 4 * d, act="gelu_tanh", tile=tile, seed=rng)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class Stack(tg.nn.Module):
        def __init__(self):
            rng = np.random.default_rng(0)
            if kind == "mlp":
                self.layers = [tg.nn.MLP(d, 4 * d, act="gelu_tanh", tile=tile, seed=rng) for _ in range(args.layers)]
            else:
                self.layers = [Block(rng) for _ in range(args.layers)]

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Stack()


def build_torch(kind, state, args, torch):
    F = torch.nn.functional
    params = {k: torch.tensor(v, requires_grad=True) for k, v in state.items()}
    d, h = args.width, args.heads

    def lin(x, p):
        y = x @ params[p + ".weight"]
        b = params.get(p + ".bias")
        return y + b if b is not None else y

    def mlp(x, p):
        return lin(F.gelu(lin(x, p + "fc1"), approximate="tanh"), p + "fc2")

    def attn(x, p):
        B, T, _ = x.shape
        q, k, v = (lin(x, p + n).view(B, T, h, d // h).transpose(1, 2) for n in ("q", "k", "v"))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return lin(y.transpose(1, 2).reshape(B, T, d), p + "o")

    def ln(x, p):
        return F.layer_norm(x, (d,), params[p + ".weight"], params[p + ".bias"], eps=1e-5)

    def forward(x):
        for i in range(args.layers):
            p = f"layers.{i}."
            if kind == "mlp":
                x = mlp(x, p)
            else:
                x = x + attn(ln(x, p + "ln1"), p + "attn.")
                x = x + mlp(ln(x, p + "ln2"), p + "mlp.")
        return x

    return forward, list(params.values())


def _rss() -> int:
    """Resident memory of this process (bytes): run on each worker."""
    import psutil

    return psutil.Process().memory_info().rss


def time_tilegraph(kind, args, x, y, tg):
    from tilegraph._lower import kernel_stats

    model = build_tilegraph(kind, args, tg)
    state = model.state_dict()
    opt = tg.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

    def loss_fn(m, x, y):
        diff = m(x) - y
        return (diff * diff).mean()

    tiles = (args.batch_tile, args.seq_tile, args.tile)  # the features in the layers' tiles (--tile)
    local = args.runtime == "local"
    with contextlib.nullcontext() if local else tg.connect(n_workers=args.workers, threads_per_worker=args.threads,
                                                           dashboard=False, quiet=True) as rt:
        step = tg.TrainStep(model, opt, loss_fn, batch_tiles=[tiles, tiles], runtime=rt,
                            target_seconds=args.target, parallel=args.parallel)
        stats = kernel_stats if local else rt.kernel_stats
        t0 = time.perf_counter()
        first = step(x, y)
        first_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step(x, y)
        stats(reset=True)
        wall, _ = timed_steps(step, [(x, y)] * args.steps)
        ks = stats()
        rss = max(rt.client.run(_rss).values()) if rt is not None else _rss()
        threads = args.workers * args.threads
    return {"loss0": first, "step_s": wall / args.steps, "first_s": first_s, "nodes": step.last.nodes,
            "strategy": step.plan(x, y).strategy, "rss": rss,
            "tasks": step.last.tasks, "kernel_s": ks["kernel_seconds"] / args.steps,
            "runner_s": (ks["task_seconds"] - ks["kernel_seconds"]) / args.steps,
            "outside": 1.0 - ks["kernel_seconds"] / (wall * threads), "state": state,
            "top": sorted(ks["by_kernel"].items(), key=lambda kv: -kv[1])[:6]}


def time_torch(kind, args, x, y, state, torch):
    forward, params = build_torch(kind, state, args, torch)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    xt, yt = torch.tensor(x), torch.tensor(y)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = ((forward(xt) - yt) ** 2).mean()
        loss.backward()
        opt.step()
        return float(loss.detach())

    first = step()
    for _ in range(args.warmup - 1):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    return {"loss0": first, "step_s": (time.perf_counter() - t0) / args.steps}


def main():
    from tilegraph._config import PARALLEL_STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["mlp", "blocks", "all"], default="all")
    ap.add_argument("--width", type=at_least(1), default=768)
    ap.add_argument("--heads", type=at_least(1), default=12)
    ap.add_argument("--layers", type=at_least(1), default=6)
    ap.add_argument("--batch", type=at_least(1), default=4)
    ap.add_argument("--seq", type=at_least(1), default=256)
    ap.add_argument("--tile", type=at_least(1), default=None,
                    help="feature tile (default: whole width; blocks: whole heads)")
    ap.add_argument("--batch-tile", type=at_least(1), default=None, help="default: batch / workers")
    ap.add_argument("--seq-tile", type=at_least(1), default=None)
    ap.add_argument("--runtime", choices=["embedded", "local"], default="embedded",
                    help="embedded Dask cluster (default) or Dask's local threaded scheduler in-process")
    ap.add_argument("--workers", type=at_least(1), default=1, help="embedded cluster worker processes")
    ap.add_argument("--threads", type=at_least(1), default=None, help="threads per worker (default: cores / workers)")
    ap.add_argument("--target", type=float, default=None, help="fused task target seconds")
    ap.add_argument("--parallel", choices=PARALLEL_STRATEGIES, default="auto",
                    help="how a step spreads over worker processes (tilegraph.config.parallel)")
    ap.add_argument("--steps", type=at_least(1), default=5)
    ap.add_argument("--kernels", action="store_true", help="also print the costliest kernels")
    ap.add_argument("--warmup", type=at_least(1), default=2, help="untimed steps first (the first one records the graph)")
    ap.add_argument("--repeat", type=at_least(1), default=1,
                    help="alternate tilegraph and torch runs this many times; print each and the median ratio")
    args = ap.parse_args()
    require(ap, "torch", what="bench_train.py (its ratios are against PyTorch eager)")
    if args.model != "mlp" and args.width % args.heads:
        ap.error(f"--heads {args.heads} must divide --width {args.width}")
    if args.tile is not None and args.model != "mlp" and args.tile % (args.width // args.heads):
        ap.error(f"--tile {args.tile} must hold whole heads of the blocks (a multiple of width / heads = "
                 f"{args.width // args.heads})")
    if args.batch_tile is not None and args.batch_tile > args.batch:
        ap.error(f"--batch-tile {args.batch_tile} is larger than --batch {args.batch}")
    if args.seq_tile is not None and args.seq_tile > args.seq:
        ap.error(f"--seq-tile {args.seq_tile} is larger than --seq {args.seq}")
    setup_threads(args)

    import torch

    import tilegraph as tg

    ncpu = os.cpu_count() or 1
    args.batch_tile = args.batch_tile or max(1, args.batch // (args.workers * args.threads))
    torch.set_num_threads(args.workers * args.threads)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    y = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    tokens = args.batch * args.seq
    kinds = ["mlp", "blocks"] if args.model == "all" else [args.model]
    print(f"# {ncpu} cores; tilegraph on the {args.runtime} runtime: {args.workers} workers x {args.threads} threads, batch tile "
          f"{args.batch_tile}, seq tile {args.seq_tile}, feature tile {args.tile}; torch {torch.__version__} "
          f"eager, {torch.get_num_threads()} threads; batch {args.batch} x seq {args.seq}, width {args.width}, "
          f"{args.layers} layers, fp32")
    print(f"{'model':8} {'tg tok/s':>9} {'torch tok/s':>11} {'ratio':>6} {'outside':>8} {'kernels':>8} "
          f"{'runner':>7} {'step s':>7} {'nodes':>6} {'tasks':>6} {'plan':>7} {'worker MB':>9} {'loss0 tg/torch':>18}")
    for kind in kinds:
        ratios, outside = [], []
        for _ in range(args.repeat):  # alternating runs: machine noise hits both sides alike
            r = time_tilegraph(kind, args, x, y, tg)
            t = time_torch(kind, args, x, y, r["state"], torch)
            ratios.append(t["step_s"] / r["step_s"])
            outside.append(r["outside"])
            print(f"{kind:8} {tokens / r['step_s']:9.0f} {tokens / t['step_s']:11.0f} "
                  f"{t['step_s'] / r['step_s']:6.2f} {r['outside']:8.1%} {r['kernel_s']:8.3f} {r['runner_s']:7.3f} "
                  f"{r['step_s']:7.3f} {r['nodes']:6d} {r['tasks']:6d} {r['strategy']:>7} {r['rss'] / 1e6:9.0f} "
                  f"{r['loss0']:9.5f}/{t['loss0']:.5f}",
                  flush=True)
            if args.kernels:
                print("   kernel seconds per step: " + ", ".join(f"{k} {v / args.steps:.3f}" for k, v in r["top"]))
        if args.repeat > 1:
            print(f"{kind:8} median ratio {np.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}), "
                  f"median outside {np.median(outside):.1%} over {args.repeat} alternating runs", flush=True)


if __name__ == "__main__":
    main()
