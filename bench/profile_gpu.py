"""Where a GPT-2 training step's GPU time goes, in tilegraph and in PyTorch, kernel by kernel.

Trains the model of ``bench_gpt2.py --device gpu`` (same weights, batches, loss and AdamW) on one
GPU worker of the embedded cluster and with Hugging Face transformers on CUDA, and records every
CUDA kernel, copy and fill of a few steps with PyTorch's profiler (CUPTI): in the GPU worker's
process for tilegraph (it sees CuPy's kernels as it sees torch's) and in this process for torch.
Prints, per step and side by side:

- the wall time of a step, the GPU's busy time (the union of its kernels' intervals) and the
  share of the step the GPU idles (waiting for Python, Dask or the runner to queue the next kernel);
- the GPU time per kind of kernel (matrix products, attention, normalisation, elementwise,
  reductions, copies...) and the number of launches (tilegraph's attention runs its products as
  cuBLAS calls, which count as matrix products; torch's fused attention kernels as attention);
- the costliest kernels of each side by name;
- with ``--python``, where the GPU worker's Python time goes, line by line in tilegraph's code
  (bench/_sampler.py): a GPU that idles waits for those lines to queue its kernels.

A GPU that is busy 95% of a step is limited by its kernels; one that idles half the step, by
what queues them. The profiler adds some microseconds per launch, so the profiled steps run a
little slower than ``bench_gpt2.py``'s timed ones; compare the shares, and tokens/s there.

    python bench/profile_gpu.py                          # GPT-2 124M, batch 8 x 512, 3 steps
    python bench/profile_gpu.py --python                 # and the GPU worker's Python, by line
    python bench/profile_gpu.py --flavor 6x768 --batch 16 --seq 256 --top 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from _common import at_least, require, timed_steps
from _sampler import holder, print_samples, start_sampling, stop_sampling

#: kinds of kernel by a piece of their name, first match wins (cuBLAS, CUTLASS, CuPy, torch and
#: tilegraph's own names); lower case
KINDS = [
    ("loss", ("nll", "cross_entropy", "log_softmax", "logsoftmax", "logsumexp")),
    ("attention", ("fmha", "attention", "flash", "attn", "softmax")),
    ("matmul", ("gemm", "gemv", "cutlass", "xmma", "cublas", "splitkreduce", "dot_kernel")),
    ("norm", ("layer_norm", "layernorm", "norm", "rms")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("embedding", ("embedding", "index", "gather", "scatter", "take")),
    ("reduce", ("reduce", "sum", "cub", "max", "min", "mean")),
    ("copy", ("memcpy", "memset", "copy", "transpose", "concatenate", "cat_", "fill")),
    ("elementwise", ("elementwise", "cupy_", "gelu", "add", "mul", "div", "exp", "where", "tanh")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def gpu_events(trace: dict) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of each kernel, copy and fill in a chrome trace of PyTorch's profiler."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((e.get("name", "?"), float(e["ts"]), float(e.get("dur", 0.0))))
    return out


def summarize(events, steps: int, wall: float) -> dict:
    """Per step: busy seconds (union of the intervals), seconds and launches per kind and per name."""
    busy, end = 0.0, float("-inf")
    for _, ts, dur in sorted(events, key=lambda e: e[1]):
        if ts >= end:
            busy += dur
        elif ts + dur > end:
            busy += ts + dur - end
        end = max(end, ts + dur)
    kinds, names = {}, {}
    for name, _, dur in events:
        for table, key in ((kinds, kind_of(name)), (names, name)):
            s, n = table.get(key, (0.0, 0))
            table[key] = (s + dur, n + 1)
    per = 1e-6 / steps
    return {"wall": wall / steps, "busy": busy * per, "launches": len(events) / steps,
            "kinds": {k: (s * per, n / steps) for k, (s, n) in kinds.items()},
            "names": {k: (s * per, n / steps) for k, (s, n) in names.items()}}


# -- the recording, in whichever process runs the kernels ------------------------------------------
def start_profiler(dask_worker=None):
    """Start PyTorch's profiler (CUDA activity) in this process; kept on the worker, or here."""
    from torch.profiler import ProfilerActivity, profile

    p = profile(activities=[ProfilerActivity.CUDA])
    p.start()
    holder(dask_worker)._tilegraph_profiler = p


def stop_profiler(dask_worker=None) -> list[tuple[str, float, float]]:
    """Stop the profiler started by :func:`start_profiler`; its GPU events."""
    keeper = holder(dask_worker)
    p = keeper._tilegraph_profiler
    del keeper._tilegraph_profiler
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the whole device (CuPy's streams too): every kernel ends inside the trace
    p.stop()
    with tempfile.TemporaryDirectory(prefix="tg_profile_") as tmp:
        path = os.path.join(tmp, "trace.json")
        p.export_chrome_trace(path)
        with open(path) as f:
            return gpu_events(json.load(f))


# -- the two sides --------------------------------------------------------------------------------
def profile_tilegraph(model, data, args, tg):
    opt = tg.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    tiles = (model.tiling.batch, model.tiling.seq)
    with tg.connect(n_workers=1, gpu=1, dashboard=False, quiet=True) as rt:
        step = tg.TrainStep(model, opt, lambda m, ids, t: tg.cross_entropy(m(ids), t), batch_tiles=[tiles, tiles],
                            runtime=rt, placement="gpu")
        for b in data[:args.warmup]:
            step(*b)
        rt.client.run(start_profiler)
        if args.python:
            rt.client.run(start_sampling)
        wall, loss = timed_steps(step, data[args.warmup:])  # step i + 1 queued before step i's loss is read
        samples = next(iter(rt.client.run(stop_sampling).values())) if args.python else None
        (events,) = rt.client.run(stop_profiler).values()
    return summarize(events, args.steps, wall), loss, samples


def profile_torch(hf_dir, data, args):
    import torch

    from bench_gpt2 import torch_training

    hf, step, ids = torch_training(hf_dir, data, args, torch, "cuda")
    for x in ids[:args.warmup]:
        step(x)
    start_profiler()
    t0 = time.perf_counter()
    for x in ids[args.warmup:]:
        loss = step(x)
    wall = time.perf_counter() - t0
    return summarize(stop_profiler(), args.steps, wall), loss, hf.config._attn_implementation


def report(tg_sum: dict, torch_sum: dict, top: int) -> None:
    def ms(s):
        return f"{s * 1e3:8.2f}"

    print(f"{'per step':34} {'tilegraph':>9} {'torch':>9}")
    for label, key in (("wall ms", "wall"), ("GPU busy ms", "busy")):
        print(f"{label:34} {ms(tg_sum[key])} {ms(torch_sum[key])}")
    print(f"{'GPU idle share of the step':34} {1 - tg_sum['busy'] / tg_sum['wall']:9.1%} "
          f"{1 - torch_sum['busy'] / torch_sum['wall']:9.1%}")
    print(f"{'launches (kernels, copies, fills)':34} {tg_sum['launches']:9.0f} {torch_sum['launches']:9.0f}")
    print(f"\nGPU ms per step by kind (launches)")
    kinds = sorted(set(tg_sum["kinds"]) | set(torch_sum["kinds"]),
                   key=lambda k: -max(tg_sum["kinds"].get(k, (0, 0))[0], torch_sum["kinds"].get(k, (0, 0))[0]))
    for k in kinds:
        (a, na), (b, nb) = tg_sum["kinds"].get(k, (0.0, 0)), torch_sum["kinds"].get(k, (0.0, 0))
        print(f"{k:34} {ms(a)} ({na:4.0f}) {ms(b)} ({nb:4.0f})")
    for side, s in (("tilegraph", tg_sum), ("torch", torch_sum)):
        print(f"\n{side}: the {top} costliest kernels, GPU ms per step (launches per step) kind: name")
        for name, (sec, n) in sorted(s["names"].items(), key=lambda kv: -kv[1][0])[:top]:
            print(f"  {ms(sec)} ({n:4.0f}) {kind_of(name)}: {name[:150]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", choices=["debug", "6x768", "gpt2"], default="gpt2")
    ap.add_argument("--batch", type=at_least(1), default=8)
    ap.add_argument("--seq", type=at_least(2), default=512)
    ap.add_argument("--steps", type=at_least(1), default=3, help="profiled steps")
    ap.add_argument("--warmup", type=at_least(1), default=2, help="steps before (the first records the graph)")
    ap.add_argument("--top", type=at_least(1), default=25, help="kernels listed per side")
    ap.add_argument("--python", action="store_true",
                    help="also sample where the GPU worker's Python time goes (tilegraph's lines, with their launches)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    require(ap, "torch", "transformers", "cupy", what="profile_gpu.py (PyTorch's profiler, CuPy on the GPU worker)")
    import torch

    if not torch.cuda.is_available():
        ap.error(f"profile_gpu.py needs torch with CUDA and a visible GPU; this torch {torch.__version__} "
                 f"has {'no CUDA' if torch.version.cuda is None else 'no GPU it can see'}")
    import tilegraph as tg
    from tilegraph import models

    from bench_gpt2 import batches, flavor_config, pick_tiling

    cfg = flavor_config(args.flavor)
    seq = min(args.seq, cfg.max_seq_len)
    tile_args = argparse.Namespace(device="gpu", feature_tile=None, vocab_tile=None, batch_tile=None, seq_tile=None)
    model = models.build(cfg, pick_tiling(cfg, tile_args, args.batch, seq), seed=args.seed)
    data = batches(cfg, args, args.batch, seq, args.warmup + args.steps)
    print(f"# {torch.cuda.get_device_name()}; GPT-2 {args.flavor}, batch {args.batch} x {seq}, fp32, AdamW; "
          f"{args.warmup} warmup + {args.steps} profiled steps; tilegraph on one GPU worker (CuPy), torch "
          f"{torch.__version__} eager", flush=True)
    with tempfile.TemporaryDirectory(prefix="profile_gpu_") as tmp:
        hf_dir = Path(tmp) / "hf"
        model.to_hf(hf_dir)
        tg_sum, tg_loss, samples = profile_tilegraph(model, data, args, tg)
        torch_sum, torch_loss, attn = profile_torch(hf_dir, data, args)
    print(f"# last loss: tilegraph {tg_loss:.5f}, torch {torch_loss:.5f} (attention: {attn})\n", flush=True)
    report(tg_sum, torch_sum, args.top)
    if samples is not None:
        print_samples(samples, args.top, "\nthe GPU worker's Python in tilegraph's code, sampled every 2 ms during the "
                                         "profiled steps (its CuPy launches count on the line that makes them): ")


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
