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
are the stable statistic); tilegraph's three graphs take turns within each round, torch's layer
runs after them. Ratios > 1 mean RunLoRA is faster. ``frozen`` times the layer without its
adapter (``X W + b``, with dX where X needs a gradient) in the same rotation: ``naive / frozen`` is
the most that any graph of the adapter can gain over the naive one at that shape.

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

Part (d), LoRA fine-tuning of GPT-2 124M against Hugging Face peft + torch eager on the same CPU
(the issue's target: tilegraph >= 1.0x peft's tokens/s). The same weights on both sides:
``tg.models.build("gpt2")`` (bench_gpt2.py's tiling for 1 worker x ``--threads``: batch tile
batch / threads, 8 vocab tiles of 6283), written with ``model.to_hf`` and loaded into
transformers' ``GPT2LMHeadModel`` (dropout 0, no KV cache). Adapters: rank 8, alpha 16 on c_attn,
no dropout; tilegraph ``peft.apply_lora(model, ["c_attn"], rank=8, alpha=16)`` (c_attn is three
layers q, k, v there, each with its own rank-8 adapter: 442k trained parameters), peft
``get_peft_model(LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True))``
(one adapter on the fused 768 x 2304 layer: 295k). The base models compute the same function and
both adapters start at zero (V, peft's B), so the first step's losses agree; the later ones differ
a little (different adapters, different random U / A). AdamW over the trained parameters
(``--d-lr``, weight decay 0), torch with ``torch.set_num_threads(--threads)``, tilegraph on an
embedded cluster of 1 worker x ``--threads`` threads (``tg.TrainStep``, one step per graph as
``tg.Trainer`` runs a model this size, step i+1 submitted before waiting for step i). Random token ids, the same ``--batch`` x ``--seq`` batches in both, mean
next-token cross-entropy (HF's ``labels=ids``).

Timing: ``--d-warmup`` steps each, then ``--d-rounds`` rounds of ``--d-steps`` steps, the
frameworks alternating round by round (the machine is shared); a tilegraph round runs from an idle
cluster until it is idle again. torch's first rounds run slower than its later ones (2-core
machine: 311-333 tok/s, rising round by round to 402-411, after 2 or 6 warmup steps alike, while
tilegraph's processes used no CPU), which the median of per-round ratios counts in tilegraph's
favour: best / best compares both at their speed. Printed per run: tokens/s (median and best round), s/step, the
first and last step's loss; for tilegraph also ``outside`` = 1 - kernel seconds / (wall x threads),
the kernel seconds per step (summed over the worker's threads) and the runner seconds per step
(the worker's task seconds outside kernels); and the ratio tilegraph / peft (median of the per-round
ratios, and best / best). ``--d-extra`` adds runs to the same rotation, for profiling:

    tg-full           tilegraph full fine-tuning (AdamW on every parameter) of the same model
    torch-full        torch eager full fine-tuning of the same model

``--kernels N`` prints each tilegraph run's N costliest kernels and model parts (per step).

    python bench/bench_peft.py --parts d                     # GPT-2 124M, batch 4 x 256, 2 threads
    python bench/bench_peft.py --parts d --d-extra tg-full torch-full --kernels 8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import tilegraph as tg
from tilegraph._autograd import vjp
from tilegraph.ops import lora as L

from _common import at_least, require


def best_of(fn, repeat: int) -> float:
    return best_of_each([fn], repeat)[0]


def best_of_each(fns, repeat: int) -> list[float]:
    """The best time of each of ``fns`` over ``repeat`` rounds, each round running every one of
    them in turn (the first of a round rotating), so that none is timed only right after another
    one's allocations or only while the machine is busy; each runs once untimed first."""
    for fn in fns:
        fn()  # warm-up (plans, BLAS)
    times = [[] for _ in fns]
    for k in range(repeat):
        for i in [(k + j) % len(fns) for j in range(len(fns))]:
            t0 = time.perf_counter()
            fns[i]()
            times[i].append(time.perf_counter() - t0)
    return [min(t) for t in times]


def tilegraph_step(arrays, needs, row_tile, build):
    x = tg.from_numpy(arrays["x"], (row_tile, None))
    w, b = tg.from_numpy(arrays["w"]), tg.from_numpy(arrays["b"])
    u, v = tg.from_numpy(arrays["u"]), tg.from_numpy(arrays["v"])
    dy = tg.from_numpy(arrays["dy"], (row_tile, None))
    y = build(x, w, u, v, b)
    wrt = [t for t, f in zip((x, u, v), needs) if f]
    # dY is the output's cotangent itself (not the gradient of a loss such as (y * dy).sum(),
    # whose expand and multiply kernels, fresh (512, 768) tiles each, cost up to 6 ms of page
    # faults in some rounds and nothing in others)
    grads = vjp([y], [dy], wrt) if wrt else []
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
        y.backward(t["dy"])
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
    from tilegraph._graph import peak_live_bytes, topo_order

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
    peak = peak_live_bytes(order, roots)
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
    ap.add_argument("--rows", type=at_least(1), default=2048, help="N, tokens per step")
    ap.add_argument("--dim", type=at_least(1), default=768, help="n = m")
    ap.add_argument("--ranks", type=at_least(1), nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--row-tile", type=at_least(1), default=512)
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--repeat", type=at_least(1), default=5)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--parts", nargs="+", choices=["a", "b", "c", "d"], default=["a", "b", "c"],
                    help="(d) is not in the default: it needs torch, transformers and peft and takes minutes")
    ap.add_argument("--steps", type=at_least(1), default=20, help="training steps of parts (b) and (c)")
    ap.add_argument("--threads", type=at_least(1), default=2,
                    help="worker threads in parts (b), (c) and (d); torch's in (d)")
    ap.add_argument("--batch", type=at_least(1), default=4, help="(d): sequences per step")
    ap.add_argument("--seq", type=at_least(2), default=256, help="(d): tokens per sequence")
    ap.add_argument("--d-flavor", choices=["gpt2", "debug"], default="gpt2", help="(d): the model (debug: smoke tests)")
    ap.add_argument("--d-warmup", type=at_least(1), default=6,
                    help="(d): untimed steps of each run first (the first records the graph)")
    ap.add_argument("--d-rounds", type=at_least(1), default=4, help="(d): timed rounds, the runs alternating")
    ap.add_argument("--d-steps", type=at_least(1), default=3, help="(d): steps per round")
    ap.add_argument("--d-lr", type=float, default=1e-3, help="(d): AdamW learning rate (weight decay 0)")
    ap.add_argument("--d-extra", nargs="*", choices=list(D_EXTRA), default=[],
                    help="(d): more runs in the rotation, for profiling (see the docstring)")
    ap.add_argument("--kernels", type=at_least(0), default=0, metavar="N",
                    help="(d): print the N costliest kernels and model parts of each tilegraph run")
    ap.add_argument("--seed", type=int, default=0, help="(d): seed of the weights and the token ids")
    args = ap.parse_args()
    if "a" in args.parts and args.row_tile > args.rows:
        ap.error(f"--row-tile {args.row_tile} is larger than --rows {args.rows}")
    if "a" in args.parts and not args.no_torch:
        require(ap, "torch", what="part (a)'s torch column (--no-torch leaves it out)")
    if "d" in args.parts:
        require(ap, "torch", "transformers", "peft", what="part (d)")
    if "a" in args.parts:
        part_a(args)
    if "b" in args.parts:
        part_b(args.steps, args.threads)
    if "c" in args.parts:
        part_c(args.steps, args.threads)
    if "d" in args.parts:
        part_d(args)


def part_a(args) -> None:
    tg.config.local_scheduler = "threads"
    N, n = args.rows, args.dim
    print(f"LoRA layer fwd+bwd, N={N}, n=m={n}, {args.dtype}, row tile {args.row_tile}, best of {args.repeat} "
          f"(ms; ratio = naive / runlora, torch / runlora; frozen: X W + b alone, naive/fz: the most any "
          f"adapter graph can gain)")
    print(f"{'r':>4} {'grads':>6} {'chosen':>8} {'naive':>8} {'runlora':>8} {'by time':>14} {'torch':>8} "
          f"{'naive/rl':>9} {'torch/rl':>9} {'frozen':>8} {'naive/fz':>9}")
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
            steps = [tilegraph_step(arrays, needs, args.row_tile, lambda x, w, u, v, b: naive(x, w, u, v, b, scale)),
                     tilegraph_step(arrays, needs, args.row_tile, lambda x, w, u, v, b: tg.ops.lora_linear(
                         x, w, u, v, b, scale=scale, requires_grad=needs)),
                     tilegraph_step(arrays, needs, args.row_tile, lambda x, w, u, v, b: tg.ops.lora_linear(
                         x, w, u, v, b, scale=scale, requires_grad=needs, variant=timed)),
                     # the frozen layer alone (X W + b, dX where X needs it): no graph of the
                     # adapter can make the step faster than this
                     tilegraph_step(arrays, (needs[0], False, False), args.row_tile,
                                    lambda x, w, u, v, b: tg.linear(x, w, b))]
            t_naive, t_rl, t_time, t_frozen = best_of_each(steps, args.repeat)
            # torch apart: interleaved with tilegraph's graphs, its idle OpenMP threads spinning
            # beside tilegraph's doubled its times
            # with --no-torch no torch run happened: its columns say "-", not a time or ratio of nan
            t_torch = None if args.no_torch else best_of(torch_step(arrays, needs, scale), args.repeat)
            torch_ms = "-" if t_torch is None else f"{t_torch * 1e3:.1f}"
            torch_ratio = "-" if t_torch is None else f"{t_torch / t_rl:.2f}"
            print(f"{r:>4} {label:>6} {'/'.join(chosen):>8} {t_naive * 1e3:8.1f} {t_rl * 1e3:8.1f} "
                  f"{'/'.join(timed) + f' {t_time * 1e3:.1f}':>14} {torch_ms:>8} "
                  f"{t_naive / t_rl:9.2f} {torch_ratio:>9} {t_frozen * 1e3:8.1f} {t_naive / t_frozen:9.2f}")


# ------------------------------------------------------------------------------- part (d) ----
#: the runs --d-extra can add to part (d)'s rotation
D_EXTRA = {"tg-full": "tg full", "torch-full": "torch full"}


def wait_idle(rt, poll: float = 0.01) -> None:
    """Wait until the cluster runs no task: a step's loss comes back before its backward pass and
    update have finished."""
    while any(rt.client.processing().values()):
        time.sleep(poll)


class TgRun:
    """One tilegraph training run of part (d): a TrainStep on the shared runtime."""

    framework = "tilegraph"

    def __init__(self, model, params, rt, args):
        self.rt = rt
        opt = tg.optim.AdamW(params, lr=args.d_lr, weight_decay=0.0)
        tiles = (model.tiling.batch, model.tiling.seq)
        self.step = tg.TrainStep(model, opt, lambda m, ids, tgt: tg.cross_entropy(m(ids), tgt),
                                 batch_tiles=[tiles, tiles], runtime=rt)
        self.trained = sum(p.size for p in params)
        self.ks = {"kernel_seconds": 0.0, "task_seconds": 0.0, "by_kernel": {}, "by_scope": {}}
        self.client_s = 0.0

    def warmup(self, data):
        from _common import timed_steps

        first = self.step(*data[0])
        if len(data) > 1:
            timed_steps(self.step, data[1:])
        wait_idle(self.rt)
        return first

    def timed(self, data):
        from _common import timed_steps

        self.rt.kernel_stats(reset=True)
        t0 = time.perf_counter()
        _, last = timed_steps(self.step, data)
        wait_idle(self.rt)  # the last step's backward and update too, not only its loss
        wall = time.perf_counter() - t0
        ks = self.rt.kernel_stats()
        for key in ("kernel_seconds", "task_seconds"):
            self.ks[key] += ks[key]
        for part in ("by_kernel", "by_scope"):
            for name, dt in ks[part].items():
                self.ks[part][name] = self.ks[part].get(name, 0.0) + dt
        return wall, last


class TorchRun:
    """One torch eager training run of part (d): HF GPT2LMHeadModel, peft-wrapped or not."""

    framework = "torch"

    def __init__(self, hf_dir, lora: bool, args):
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        model = transformers.GPT2LMHeadModel.from_pretrained(
            hf_dir, dtype=torch.float32, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, use_cache=False)
        self.attn = getattr(model.config, "_attn_implementation", "?")
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(args.seed)  # peft draws A from torch's generator
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], lora_dropout=0.0,
                                                     fan_in_fan_out=True))
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        self.model, self.trained = model, sum(p.numel() for p in params)
        self.opt = torch.optim.AdamW(params, lr=args.d_lr, weight_decay=0.0)
        self.torch = torch

    def one(self, ids) -> float:
        x = self.torch.from_numpy(ids)
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def warmup(self, data):
        losses = [self.one(ids) for ids, _ in data]
        return losses[0]

    def timed(self, data):
        t0 = time.perf_counter()
        for ids, _ in data:
            last = self.one(ids)
        return time.perf_counter() - t0, last


def part_d(args) -> None:
    import os

    import torch
    import transformers

    import peft as hf_peft
    from bench_gpt2 import batches as token_batches
    from bench_gpt2 import flavor_config, pick_tiling
    from tilegraph import models, peft

    T = args.threads
    torch.set_num_threads(T)
    cfg = flavor_config(args.d_flavor)
    batch, seq = args.batch, min(args.seq, cfg.max_seq_len)
    tiling = pick_tiling(cfg, SimpleNamespace(workers=1, threads=T, feature_tile=None, vocab_tile=None,
                                              batch_tile=None, seq_tile=None), batch, seq)
    n = args.d_warmup + args.d_rounds * args.d_steps
    data = token_batches(cfg, SimpleNamespace(seed=args.seed), batch, seq, n)
    warm, rounds = data[:args.d_warmup], [data[args.d_warmup + r * args.d_steps:][:args.d_steps]
                                          for r in range(args.d_rounds)]
    print(f"(d) LoRA r8 alpha 16 on c_attn, GPT-2 {args.d_flavor} ({cfg.n_layers} x {cfg.dim}, vocab {cfg.vocab_size}), "
          f"batch {batch} x {seq}, AdamW lr {args.d_lr:g} wd 0, fp32; tilegraph 1 worker x {T} threads, tiles "
          f"batch/seq/feature/vocab {tiling.batch}/{tiling.seq}/{tiling.feature}/{tiling.vocab}; torch {torch.__version__} "
          f"eager {torch.get_num_threads()} threads, transformers {transformers.__version__}, peft {hf_peft.__version__}; "
          f"{os.cpu_count()} cores; {args.d_warmup} warmup + {args.d_rounds} rounds x {args.d_steps} steps, alternating",
          flush=True)

    def lora_model():
        return peft.apply_lora(models.build(cfg, tiling, seed=args.seed), ["c_attn"], rank=8, alpha=16)

    with tempfile.TemporaryDirectory(prefix="bench_peft_d_") as tmp:
        base = models.build(cfg, tiling, seed=args.seed)
        base.to_hf(Path(tmp) / "hf")
        del base
        with tg.connect(n_workers=1, threads_per_worker=T, dashboard=False, quiet=True) as rt:
            runs = {}
            m = lora_model()
            runs["tg LoRA"] = TgRun(m, peft.trainable_parameters(m), rt, args)
            runs["peft+torch LoRA"] = TorchRun(Path(tmp) / "hf", True, args)
            if "tg-full" in args.d_extra:
                m = models.build(cfg, tiling, seed=args.seed)
                runs["tg full"] = TgRun(m, m.parameters(), rt, args)
            if "torch-full" in args.d_extra:
                runs["torch full"] = TorchRun(Path(tmp) / "hf", False, args)
            res = {name: {"loss0": r.warmup(warm), "walls": [], "last": None} for name, r in runs.items()}
            for chunk in rounds:
                for name, r in runs.items():
                    wall, res[name]["last"] = r.timed(chunk)
                    res[name]["walls"].append(wall)
    tokens = batch * seq * args.d_steps
    print(f"{'run':>16} {'trained':>9} {'tok/s med':>9} {'tok/s best':>10} {'s/step med':>10} "
          f"{'outside':>8} {'kernel s':>8} {'runner s':>8} {'loss first':>10} {'loss last':>10}  rounds tok/s")
    for name, r in runs.items():
        walls = res[name]["walls"]
        steps = len(walls) * args.d_steps
        extra = f"{'':>8} {'':>8} {'':>8}"
        if r.framework == "tilegraph":
            extra = (f"{1 - r.ks['kernel_seconds'] / (sum(walls) * T):8.1%} {r.ks['kernel_seconds'] / steps:8.3f} "
                     f"{(r.ks['task_seconds'] - r.ks['kernel_seconds']) / steps:8.3f}")
        print(f"{name:>16} {r.trained:>9,} {tokens / statistics.median(walls):9.0f} "
              f"{tokens / min(walls):10.0f} {statistics.median(walls) / args.d_steps:10.3f} {extra} "
              f"{res[name]['loss0']:10.5f} {res[name]['last']:10.5f}  "
              + " ".join(f"{tokens / w:.0f}" for w in walls), flush=True)
    tg_w, pt_w = res["tg LoRA"]["walls"], res["peft+torch LoRA"]["walls"]
    per_round = [p / t for t, p in zip(tg_w, pt_w)]
    l0, p0 = res["tg LoRA"]["loss0"], res["peft+torch LoRA"]["loss0"]
    print(f"ratio tg LoRA / peft+torch LoRA tok/s: median of rounds {statistics.median(per_round):.2f} "
          f"(rounds {', '.join(f'{x:.2f}' for x in per_round)}), best/best {min(pt_w) / min(tg_w):.2f}; "
          f"first losses differ by {abs(l0 - p0) / abs(p0):.1e} relative; torch attention: "
          f"{runs['peft+torch LoRA'].attn}", flush=True)
    if args.kernels:
        for name, r in runs.items():
            if r.framework != "tilegraph":
                continue
            steps = len(res[name]["walls"]) * args.d_steps
            scopes: dict[str, float] = {}
            for scope, dt in r.ks["by_scope"].items():  # the blocks' parts summed over the blocks
                key = ".".join("*" if w.isdigit() else w for w in scope.split("."))
                scopes[key] = scopes.get(key, 0.0) + dt
            for label, table in (("kernels", r.ks["by_kernel"]), ("scopes", scopes)):
                top = sorted(table.items(), key=lambda kv: -kv[1])[:args.kernels]
                print(f"   {name} {label}, s/step: " + ", ".join(f"{k} {v / steps:.3f}" for k, v in top), flush=True)


if __name__ == "__main__":
    main()
