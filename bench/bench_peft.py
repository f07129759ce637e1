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

Part (b), memory-saving backprop on a GPT-2 a little larger than gpt2-debug (so that activations
dominate: dim 256, 4 layers, 4 heads, vocab 512, batch 8 x 256 tokens), ``--steps`` AdamW steps each:

    exact      plain backprop
    rmm 0.5    randomized-matmul weight gradients (tilegraph.peft.apply_grad_sketch, gaussian) on
    rmm 0.2    every Linear of the blocks, keeping 0.5 / 0.2 of each layer's input rows
    recompute  activation recompute per block (model.recompute = True, tilegraph.checkpoint)

Part (c), a bigger-weight, smaller-batch shape (dim 512, 6 layers, batch 2 x 128): full
fine-tuning (AdamW on every parameter) vs LoRA (rank 8 on c_attn, attn.o, mlp) on the same model
saved as an int4 Zarr checkpoint and loaded with tilegraph.peft.from_quantized.

Memory columns, each configuration on a fresh single-worker cluster (1 process x 2 threads):
    stored     bytes of the forward values the backward kernels read (what a step must keep from
               its forward pass to its backward), counted on the recorded graph: exact, no sampling
    plan peak  the most bytes of values alive at once along the planned kernel order of one
               step's forward and backward (each value freed after its last reader)
    held       Dask managed bytes on the worker after the steps (parameters, optimizer state,
               quantized parts, programs): what stays between steps
    peak RSS   the worker process's peak resident set during the steps, sampled every 5 ms in the
               worker (psutil), and its rise over the worker's RSS before the first step
Loss: the mean of the last 5 steps' losses on a synthetic bigram language (4 successors per
token, entropy ln 4 = 1.39 nats).

    python bench/bench_peft.py --parts b c --steps 20
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

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


# --------------------------------------------------------------------- parts (b) and (c) ----
def bigram_batches(vocab: int, batch: int, seq: int, n: int, seed: int = 0) -> list[np.ndarray]:
    """``n`` batches of (batch, seq + 1) ids from a random bigram language: every token has 4
    equally likely successors (a loss floor of ln 4 nats)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, (vocab, 4))
    out = []
    for _ in range(n):
        ids = np.empty((batch, seq + 1), np.int64)
        ids[:, 0] = rng.integers(0, vocab, batch)
        for t in range(seq):
            ids[:, t + 1] = successors[ids[:, t], rng.integers(0, 4, batch)]
        out.append(ids)
    return out


def lm_loss(model, ids, targets):
    return tg.cross_entropy(model(ids), targets)


def graph_bytes(model, ids: np.ndarray, params) -> tuple[int, int]:
    """``(stored, planned peak)`` of one step's forward and backward (no optimizer), from its graph.

    stored: bytes of the values recorded by the forward pass (kernels with no phase in their
    scope: activations, a sketch and its seed; not parameters or other leaves) that the backward
    kernels (``...:backward``, ``...:recompute``) read: what a step keeps from forward to backward.
    planned peak: the most bytes of computed values alive at once when the kernels run in the
    order of the plan (``tg.compile``: the scheduler's order), each freed after its last reader."""
    from tilegraph._graph import topo_order

    loss = lm_loss(model, model.tiling.tile_ids(ids[:, :-1]), model.tiling.tile_ids(ids[:, 1:]))
    grads = tg.grad(loss, params)
    roots = [loss.grid.flat[0]] + [r for g in grads for r in g.grid.flat]
    read = {}
    for n in topo_order(roots):
        if ":" not in n.scope:
            continue
        for r in n.inputs:
            if not r.node.is_leaf and ":" not in r.node.scope:
                read[(id(r.node), r.index)] = r.nbytes
    order = [n for c in tg.compile(roots, runtime=None).clusters for n in c.nodes]
    last = {}
    for k, n in enumerate(order):
        for r in n.inputs:
            last[(id(r.node), r.index)] = k
    for r in roots:
        last[(id(r.node), r.index)] = len(order)
    freed: dict[int, list[int]] = {}
    live = peak = 0
    for k, n in enumerate(order):
        for i, (shape, dtype) in enumerate(n.out_meta):
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            live += nbytes
            freed.setdefault(last.get((id(n), i), k), []).append(nbytes)
        peak = max(peak, live)
        live -= sum(freed.pop(k, ()))
    return sum(read.values()), peak


# Run in the worker (client.run): a thread keeps the peak RSS of the worker process. The state
# hangs on the worker object: each call unpickles this script's functions (and globals) anew.
def _sampler_start(dask_worker=None):
    import psutil

    proc = psutil.Process()
    rss = proc.memory_info().rss
    state = dask_worker._bench_rss = {"stop": False, "peak": rss, "before": rss}

    def loop():
        while not state["stop"]:
            state["peak"] = max(state["peak"], proc.memory_info().rss)
            time.sleep(0.005)

    threading.Thread(target=loop, daemon=True).start()
    return state["before"]


def _sampler_stop(dask_worker=None):
    state = dask_worker._bench_rss
    state["stop"] = True
    return state["before"], state["peak"], int(dask_worker.state.nbytes)  # managed bytes of the values it holds


#: the warm-up model of every measured run: the same kinds of layers, tiny, so that the worker has
#: compiled (Numba) and loaded everything before its RSS is sampled
WARMUP = dict(vocab_size=64, max_seq_len=16, dim=32, n_layers=1, n_heads=4)


def train_measured(make_model, config, tiling, params_of, batches, steps: int, threads: int) -> dict:
    """Train ``make_model(config, tiling)`` for ``steps`` AdamW steps on a fresh one-worker cluster,
    after one step of ``make_model(WARMUP config)``; the losses and the memory figures (see the
    module docstring)."""
    from tilegraph import models

    rt = tg.connect(n_workers=1, threads_per_worker=threads, dashboard=False, quiet=True)
    try:
        def trainer(model):
            params = params_of(model)
            return params, tg.TrainStep(model, tg.optim.AdamW(params, lr=3e-3, weight_decay=0.0), lm_loss,
                                        batch_tiles=[(model.tiling.batch, model.tiling.seq)] * 2)

        _, warm = trainer(make_model(models.GPT2Config(**WARMUP), models.ModelTiling(batch=1)))
        ids = bigram_batches(WARMUP["vocab_size"], 2, WARMUP["max_seq_len"], 1)[0]
        warm(ids[:, :-1], ids[:, 1:])
        model = make_model(config, tiling)
        params, step = trainer(model)
        stored, planned = graph_bytes(model, batches[0], params)
        rt.client.run(_sampler_start)
        t0 = time.perf_counter()
        losses = [step(b[:, :-1], b[:, 1:]) for b in (batches[k % len(batches)] for k in range(steps))]
        seconds = time.perf_counter() - t0
        (before, peak, held), = rt.client.run(_sampler_stop).values()
    finally:
        rt.close()
    return {"losses": losses, "stored": stored, "planned": planned, "held": held, "before": before, "peak": peak, "seconds": seconds,
            "params": sum(p.size for p in params)}


def print_memory_table(title: str, rows: dict) -> None:
    mb = 1 << 20
    print(title)
    print(f"{'config':>18} {'trained':>10} {'stored MB':>10} {'plan peak MB':>12} {'held MB':>8} {'peak RSS MB':>12} {'rise MB':>8} "
          f"{'loss first':>10} {'loss last5':>10} {'s/step':>7}")
    for name, r in rows.items():
        print(f"{name:>18} {r['params']:>10,} {r['stored'] / mb:10.1f} {r['planned'] / mb:12.1f} {r['held'] / mb:8.1f} {r['peak'] / mb:12.1f} "
              f"{(r['peak'] - r['before']) / mb:8.1f} {r['losses'][0]:10.3f} {np.mean(r['losses'][-5:]):10.3f} "
              f"{r['seconds'] / len(r['losses']):7.2f}")


def part_b(steps: int, threads: int) -> None:
    from tilegraph import models
    from tilegraph.peft import apply_grad_sketch

    cfg = models.GPT2Config(vocab_size=512, max_seq_len=256, dim=256, n_layers=4, n_heads=4)
    tiling = models.ModelTiling(batch=4)
    batches = bigram_batches(cfg.vocab_size, 8, 256, 4)
    linears = ["c_attn", "attn.o", "*.mlp.*"]

    def build(kind=None, ratio=1.0, recompute=False):
        def make(config, tiling):
            model = models.GPT2(config, tiling, seed=0, recompute=recompute)
            return apply_grad_sketch(model, linears, kind, ratio) if kind else model
        return make

    configs = {"exact": build(), "rmm 0.5": build("gaussian", 0.5), "rmm 0.2": build("gaussian", 0.2),
               "recompute": build(recompute=True)}
    rows = {name: train_measured(make, cfg, tiling, lambda m: m.parameters(), batches, steps, threads)
            for name, make in configs.items()}
    print_memory_table(f"(b) GPT-2 dim {cfg.dim} x {cfg.n_layers} layers, batch 8 x 256, {steps} AdamW steps, "
                       f"1 worker x {threads} threads", rows)


def part_c(steps: int, threads: int) -> None:
    from tilegraph import io, models, peft

    cfg = models.GPT2Config(vocab_size=512, max_seq_len=128, dim=512, n_layers=6, n_heads=8)
    tiling = models.ModelTiling(batch=1)
    batches = bigram_batches(cfg.vocab_size, 2, 128, 4, seed=1)
    targets = ["c_attn", "attn.o", "*.mlp.*"]
    with tempfile.TemporaryDirectory() as tmp:
        saved = iter(range(1000))

        def lora_int4(config, tiling):
            path = Path(tmp) / f"base-int4-{next(saved)}"
            io.save_checkpoint(path, models.GPT2(config, tiling, seed=0), quantize="int4")
            return peft.apply_lora(peft.from_quantized(path), targets, rank=8)

        rows = {
            "full fine-tune": train_measured(lambda config, tiling: models.GPT2(config, tiling, seed=0), cfg, tiling,
                                             lambda m: m.parameters(), batches, steps, threads),
            "LoRA r8 int4 base": train_measured(lora_int4, cfg, tiling, peft.trainable_parameters, batches, steps,
                                                threads),
        }
    print_memory_table(f"(c) GPT-2 dim {cfg.dim} x {cfg.n_layers} layers, batch 2 x 128, {steps} AdamW steps, "
                       f"1 worker x {threads} threads", rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2048, help="N, tokens per step")
    ap.add_argument("--dim", type=int, default=768, help="n = m")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--row-tile", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--parts", nargs="+", choices=["a", "b", "c"], default=["a", "b", "c"])
    ap.add_argument("--steps", type=int, default=20, help="training steps of parts (b) and (c)")
    ap.add_argument("--threads", type=int, default=2, help="worker threads in parts (b) and (c)")
    args = ap.parse_args()
    if "a" in args.parts:
        part_a(args)
    if "b" in args.parts:
        part_b(args.steps, args.threads)
    if "c" in args.parts:
        part_c(args.steps, args.threads)


def part_a(args) -> None:
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
