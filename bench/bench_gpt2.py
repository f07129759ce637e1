"""GPT-2 training tokens/s of tilegraph against PyTorch eager, measured in the same run.

Trains GPT-2 language models with tilegraph (``tg.TrainStep`` on the embedded Dask cluster, or on
Dask's local threaded scheduler) and with Hugging Face transformers' ``GPT2LMHeadModel`` in
PyTorch eager on the same machine, from the same weights, on the same token batches, with the
same loss and optimizer, then prints tokens/s of both, their ratio (tilegraph / torch, above 1
means tilegraph is faster) and the share of tilegraph's step time spent outside kernels:

    outside = 1 - (seconds inside tile kernels, summed over workers) / (wall seconds x worker threads)

so idle workers, Dask scheduling, transfers and the Python runner all count as "outside".

What both sides do:

- weights: the tilegraph model is built from a seed, written with ``model.to_hf`` and loaded
  with ``GPT2LMHeadModel.from_pretrained`` (dropout set to 0, as tilegraph has none; KV cache off);
- data: random token ids from a fixed seed, one distinct (batch, seq) batch per step, the same
  sequence of batches in both;
- loss: mean cross-entropy of next-token prediction: tilegraph's ``cross_entropy`` on the logits
  against the ids shifted left by one (last position ignored with -100), torch the loss HF
  computes from ``labels=ids`` (it shifts the same way). "loss0" is the first step's loss of
  each; they must agree to about 1e-5 (fp32), and "lossN" (the last step's) to a little less;
- AdamW in both (``tilegraph.optim.AdamW``, ``torch.optim.AdamW`` with torch's defaults otherwise),
  fp32, torch threads = tilegraph worker processes x threads.

Steps per graph: ``TrainStep.auto_steps_per_graph`` as the Trainer uses it (``--steps-per-graph``
overrides): the debug flavor's steps run 32 to a graph (one Dask task), the larger flavors' one
by one. The first step runs alone; warmup and timed steps are rounded up to whole groups, and
torch runs the same batches.

Flavors: "debug" (the tiny test model: vocab 96, width 32, 2 layers; sequence 32 by default;
measures overheads only), "6x768" (GPT2Config(dim=768, n_layers=6, n_heads=12), GPT-2's vocab of
50257, sequence 256 by default), "gpt2" (the 124M model, 12 layers); "all" runs debug and 6x768.

Default tilings (each can be overridden; 0 keeps a dim whole):

- batch tile: as the Trainer cuts a batch (``tilegraph.trainer.row_tile_for``), a tile per worker
  thread, so that every thread has a tile of tokens to work on in every layer; one 4 x 256 tile
  would leave the second thread of the development machine idle in all the matmuls that are not
  split otherwise. Fewer tiles where a tile would hold fewer than
  ``tilegraph.trainer.MIN_ROW_TILE_ELEMENTS`` (tokens x width): the debug flavor's kernels are so
  small that the extra calls cost more than a second thread gains (its tasks run on one thread
  anyway, ``config.thread_handoff_seconds``);
- vocab tile: GPT-2's 50257 columns are cut into tiles of at most 8192 (``ModelTiling.default``),
  their number rounded up to a multiple of the worker threads when there are fewer threads than
  tiles (8 tiles of 6283 on 2 threads rather than 7 of 7180), so the tied unembedding, the
  cross-entropy and the embedding gradient split evenly over the threads. A whole-vocab logits
  tile would be one 2 x 256 x 50257 fp32 array (100 MB, and as much again for its gradient)
  computed and reduced by a single kernel;
- feature and sequence tiles: ``ModelTiling.default`` (the whole width of 768 and the whole
  sequence of 256: one 512-token x 768 x 3072 matmul is already ~2.4 GFLOP, about 20 ms).

GPU (``--device gpu``): tilegraph on one GPU worker with every kernel placed on the GPU (CuPy),
in whole tiles (a GPU runs a few large kernels best), against torch on CUDA. Kernels on a GPU are
only queued, so the kernel seconds and the "outside" share then measure the queueing; with
``--sync-kernels`` the worker waits for the GPU after each kernel, and ``--kernels`` shows GPU
seconds per kernel (the steps run slower by the waits).

    python bench/bench_gpt2.py                                   # debug and 6x768, batch 4
    python bench/bench_gpt2.py --flavor 6x768 --steps 5 --kernels
    python bench/bench_gpt2.py --flavor debug --steps 64 --steps-per-graph 1    # one graph per step
    python bench/bench_gpt2.py --device gpu --flavor gpt2 --batch 8 --seq 512 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import at_least, require, setup_threads, timed_steps

FLAVOR_CHOICES = ["debug", "6x768", "gpt2", "all"]
DEFAULT_SEQ = 256
MAX_VOCAB_TILE = 8192  # as ModelTiling.default


def flavor_config(name: str):
    from tilegraph.models import GPT2Config

    if name == "6x768":
        return GPT2Config(dim=768, n_layers=6, n_heads=12)  # vocab 50257, 1024 positions
    return GPT2Config.flavor(name)


def _cpu_tiles(cfg, args, batch: int, seq: int) -> dict:
    from tilegraph.models import ModelTiling
    from tilegraph.trainer import row_tile_for

    threads = args.workers * args.threads
    base = ModelTiling.default(cfg, batch=batch, seq=seq)
    batch_tile = row_tile_for(batch, seq * cfg.dim, threads)   # as the Trainer cuts a batch
    if base.batch is not None:
        batch_tile = min(batch_tile, base.batch)
    parts = math.ceil(cfg.vocab_size / MAX_VOCAB_TILE)
    if parts > 1:
        m = min(threads, parts)
        parts = math.ceil(parts / m) * m
    vocab = None if parts == 1 else math.ceil(cfg.vocab_size / parts)
    return {"feature": base.feature, "vocab": vocab, "batch": batch_tile, "seq": base.seq}


def pick_tiling(cfg, args, batch: int, seq: int):
    """The default tiling described in the module docstring, with the command line's overrides."""
    from tilegraph.models import ModelTiling

    if getattr(args, "device", "cpu") == "gpu":
        # one GPU stream: whole tiles, each kernel as large as it gets (fewer launches); the
        # whole-vocab logits of 8 x 512 tokens take 0.8 GB, no matter on a GPU of 80
        tiles = {"feature": None, "vocab": None, "batch": None, "seq": None}
    else:
        tiles = _cpu_tiles(cfg, args, batch, seq)
    for dim in tiles:
        v = getattr(args, f"{dim}_tile")
        if v is not None:
            tiles[dim] = v or None  # 0: one tile
    full = {"feature": cfg.dim, "vocab": cfg.vocab_size, "batch": batch, "seq": seq}
    tiles = {k: None if v is not None and v >= full[k] else v for k, v in tiles.items()}
    return ModelTiling(**tiles)


def batches(cfg, args, batch: int, seq: int, n: int):
    """(ids, targets) for ``n`` steps: random token ids; targets are the ids shifted left, -100 at the end."""
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, cfg.vocab_size, size=(batch, seq), dtype=np.int64)
        tgt = np.full_like(ids, -100)
        tgt[:, :-1] = ids[:, 1:]
        out.append((ids, tgt))
    return out


def time_tilegraph(model, make_data, args, tg):
    """Train on the embedded cluster (or the local scheduler) in groups of ``steps per graph``
    optimizer steps; returns the timings and the batches used (warmup and timed steps rounded up
    to whole groups), for torch to run the same ones."""
    from tilegraph._lower import kernel_stats

    opt = tg.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def loss_fn(m, ids, targets):
        return tg.cross_entropy(m(ids), targets)

    tiles = (model.tiling.batch, model.tiling.seq)
    local = args.runtime == "local"
    gpu = args.device == "gpu"
    options = {} if args.target is None else {"target_seconds": args.target}
    if gpu:
        options["placement"] = "gpu"
    with contextlib.nullcontext() if local else tg.connect(n_workers=args.workers, threads_per_worker=args.threads,
                                                           gpu=int(gpu), dashboard=False, quiet=True) as rt:
        step = tg.TrainStep(model, opt, loss_fn, batch_tiles=[tiles, tiles], runtime=rt, parallel=args.parallel,
                            **options)
        stats = kernel_stats if local else rt.kernel_stats
        first_batch = make_data(1)[0]
        k = step.auto_steps_per_graph(*first_batch) if args.steps_per_graph == "auto" else int(args.steps_per_graph)
        # the first step alone (it records the one-step graph), then whole groups; the warmup
        # groups record the k-step graph
        warmup = 1 + math.ceil((args.warmup - 1) / k) * k
        steps = math.ceil(args.steps / k) * k
        data = make_data(warmup + steps)
        t0 = time.perf_counter()
        first = step(*data[0])
        first_s = time.perf_counter() - t0
        if warmup > 1:
            timed_steps(step, data[1:warmup], k)
        stats(reset=True)
        wall, last = timed_steps(step, data[warmup:], k)
        ks = stats()
    threads = args.workers * args.threads
    return data, warmup, {
        "loss0": first, "lossN": last, "step_s": wall / steps, "first_s": first_s, "k": k,
        "nodes": step.last.nodes, "tasks": step.last.tasks, "kernel_s": ks["kernel_seconds"] / steps,
        "strategy": step.plan(*first_batch).strategy,
        "runner_s": (ks["task_seconds"] - ks["kernel_seconds"]) / steps,
        "outside": 1.0 - ks["kernel_seconds"] / (wall * threads),
        "top": sorted(ks["by_kernel"].items(), key=lambda kv: -kv[1]), "steps": steps}


def torch_training(hf_dir, data, args, torch, device: str):
    """HF's GPT2LMHeadModel from ``hf_dir`` on ``device`` with torch's AdamW: the model, a function
    running one training step on a batch of ids (returns its loss, which waits for the device)
    and the batches' ids on the device."""
    import transformers

    transformers.logging.set_verbosity_error()  # config notes (GPT-2's token ids outside a small vocab)
    transformers.logging.disable_progress_bar()
    hf = transformers.GPT2LMHeadModel.from_pretrained(
        hf_dir, dtype=torch.float32, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, use_cache=False)
    hf.train()
    hf.to(device)
    opt = torch.optim.AdamW(hf.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    ids = [torch.from_numpy(b[0]).to(device) for b in data]

    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        return float(loss.detach())

    return hf, step, ids


def time_torch(hf_dir, data, warmup, args, torch):
    hf, step, ids = torch_training(hf_dir, data, args, torch, "cuda" if args.device == "gpu" else "cpu")
    first = step(ids[0])
    for x in ids[1:warmup]:
        step(x)
    t0 = time.perf_counter()
    for x in ids[warmup:]:
        last = step(x)  # float(loss) waits for the GPU
    return {"loss0": first, "lossN": last, "step_s": (time.perf_counter() - t0) / len(ids[warmup:]),
            "attn": getattr(hf.config, "_attn_implementation", "?")}


def count_str(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def tiles_str(t) -> str:
    return "/".join("-" if v is None else str(v) for v in (t.batch, t.seq, t.feature, t.vocab))


def main():
    from tilegraph._config import PARALLEL_STRATEGIES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", choices=FLAVOR_CHOICES, default="all", help="all: debug and 6x768")
    ap.add_argument("--batch", type=at_least(1), default=4)
    ap.add_argument("--seq", type=at_least(2), default=None,
                    help=f"tokens per sequence (default {DEFAULT_SEQ}, at most the flavor's max_seq_len)")
    ap.add_argument("--feature-tile", type=at_least(0), default=None, help="width tile, whole heads (0: whole width)")
    ap.add_argument("--vocab-tile", type=at_least(0), default=None, help="vocab tile (0: whole vocab)")
    ap.add_argument("--batch-tile", type=at_least(1), default=None, help="rows per tile (default: batch / worker threads)")
    ap.add_argument("--seq-tile", type=at_least(0), default=None, help="positions per tile (0: whole sequence)")
    ap.add_argument("--runtime", choices=["embedded", "local"], default="embedded",
                    help="embedded Dask cluster (default) or Dask's local threaded scheduler in-process")
    ap.add_argument("--workers", type=at_least(1), default=1, help="embedded cluster worker processes")
    ap.add_argument("--threads", type=at_least(1), default=None, help="threads per worker (default: cores / workers)")
    ap.add_argument("--target", type=float, default=None, help="fused task target seconds (TrainStep target_seconds)")
    ap.add_argument("--parallel", choices=PARALLEL_STRATEGIES, default="auto",
                    help="how a step spreads over worker processes (tilegraph.config.parallel)")
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="gpu: tilegraph on one GPU worker (every kernel placed on the GPU, CuPy), torch on CUDA")
    ap.add_argument("--sync-kernels", action="store_true",
                    help="wait for the GPU after each kernel, so that --kernels shows GPU time (slower steps)")
    ap.add_argument("--steps-per-graph", default="auto",
                    help="optimizer steps recorded and run as one graph (TrainStep.submit_steps); 'auto' (default): "
                         "TrainStep.auto_steps_per_graph, several for a small model's short steps, else 1")
    ap.add_argument("--steps", type=int, default=5, help="timed steps")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one records the graph)")
    ap.add_argument("--kernels", type=at_least(0), nargs="?", const=8, default=0, metavar="N",
                    help="also print the N costliest kernels (default N: 8)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights and the token ids")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    if args.steps_per_graph != "auto" and not (args.steps_per_graph.isdigit() and int(args.steps_per_graph) >= 1):
        ap.error(f"--steps-per-graph must be 'auto' or an int >= 1, not {args.steps_per_graph!r}")
    if args.device == "gpu" and args.workers != 1:
        ap.error("--device gpu runs one GPU worker (--workers 1)")
    require(ap, "torch", "transformers", what="bench_gpt2.py (its ratios are against HF transformers on PyTorch)")
    if args.device == "gpu":
        require(ap, "cupy", what="--device gpu (tilegraph's GPU kernels)")
        import torch

        if not torch.cuda.is_available():  # a CPU build of torch, or no GPU: no torch run to compare with
            ap.error(f"--device gpu needs torch with CUDA and a visible GPU; this torch {torch.__version__} "
                     f"has {'no CUDA' if torch.version.cuda is None else 'no GPU it can see'}")
    if args.sync_kernels:
        os.environ["TILEGRAPH_SYNC_KERNELS"] = "1"  # read by the worker processes, which inherit it
    setup_threads(args)  # (torch gets its threads below)

    import torch
    import transformers

    import tilegraph as tg
    from tilegraph import models

    torch.set_num_threads(args.workers * args.threads)
    flavors = ["debug", "6x768"] if args.flavor == "all" else [args.flavor]
    target = tg.config.target_seconds if args.target is None else args.target
    on = f"; {torch.cuda.get_device_name()}, tilegraph on CuPy, torch on CUDA" if args.device == "gpu" else ""
    print(f"# {os.cpu_count()} cores{on}; tilegraph on the {args.runtime} runtime: {args.workers} workers x {args.threads} threads, "
          f"fused task target {target:g} s; torch {torch.__version__} eager, transformers {transformers.__version__} "
          f"GPT2LMHeadModel, {torch.get_num_threads()} threads; batch {args.batch}, fp32, AdamW lr {args.lr:g} "
          f"wd {args.weight_decay:g}, random token ids (seed {args.seed}), {args.warmup} warmup + {args.steps} "
          f"timed steps (after the first, rounded up to whole graphs of k steps); tiles = batch/seq/feature/vocab "
          f"('-': whole); ratio = tg tok/s / torch tok/s", flush=True)
    print(f"{'flavor':7} {'params':>7} {'seq':>4} {'tiles':>14} {'k':>3} {'tg tok/s':>9} {'torch tok/s':>11} "
          f"{'ratio':>6} {'outside':>8} {'kernel s':>8} {'runner s':>8} {'step s':>7} {'first s':>7} {'nodes':>6} "
          f"{'tasks':>6} {'plan':>7} {'loss0 tg/torch':>19} {'lossN tg/torch':>19}", flush=True)
    for name in flavors:
        cfg = flavor_config(name)
        seq = min(args.seq or DEFAULT_SEQ, cfg.max_seq_len)
        tiling = pick_tiling(cfg, args, args.batch, seq)
        model = models.build(cfg, tiling, seed=args.seed)
        with tempfile.TemporaryDirectory(prefix="bench_gpt2_") as tmp:
            hf_dir = Path(tmp) / "hf"
            model.to_hf(hf_dir)  # before training: the initial weights, still on the client
            data, warmup, r = time_tilegraph(model, lambda n: batches(cfg, args, args.batch, seq, n), args, tg)
            t = time_torch(hf_dir, data, warmup, args, torch)
        tokens = args.batch * seq
        print(f"{name:7} {count_str(model.num_parameters()):>7} {seq:4d} {tiles_str(tiling):>14} {r['k']:3d} "
              f"{tokens / r['step_s']:9.0f} {tokens / t['step_s']:11.0f} {t['step_s'] / r['step_s']:6.2f} "
              f"{r['outside']:8.1%} {r['kernel_s']:8.3f} {r['runner_s']:8.3f} {r['step_s']:7.3f} {r['first_s']:7.1f} "
              f"{r['nodes']:6d} {r['tasks']:6d} {r['strategy']:>7} {r['loss0']:9.5f}/{t['loss0']:<9.5f} "
              f"{r['lossN']:9.5f}/{t['lossN']:<9.5f}", flush=True)
        if args.kernels:
            print("   kernel seconds per step: " + ", ".join(
                f"{k} {v / r['steps']:.3f}" for k, v in r["top"][:args.kernels]), flush=True)
        del model


if __name__ == "__main__":
    main()
