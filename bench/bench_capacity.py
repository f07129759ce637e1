"""Capacity: train a model whose training state is several times one worker's memory limit.

A GPT-2-shaped model (``--dim``, ``--layers``, ``--vocab``) trains on the embedded Dask cluster
of ``--workers`` processes x 1 thread, each under ``--memory-limit``, with the sharded strategy
(``TrainStep(parallel="sharded")``: each parameter tile's gradient sum, update and AdamW state on
one owner worker, the others fetching the parameter when they use it). The planner keeps every
task's inputs and outputs under ``tilegraph.config.task_memory_fraction`` of the limit and Dask
spills the rest of what the workers hold to disk (their local directory). The model is tiled as
``ModelTiling.default`` tiles it (the Trainer's and ``tilegraph train``'s tiles: the whole width
up to 1024), with ``--batch-tile`` sequences per worker; ``--feature`` cuts the width finer.

It prints:

- ``state``: parameters + gradients + AdamW moments (16 bytes per fp32 parameter) and its ratio
  to one worker's limit (the issue's capacity figure);
- per step: the loss and the wall seconds;
- per worker: its peak resident memory (``VmHWM``) against the limit, what Dask holds on disk
  after the steps, and over the steps what it wrote to disk, read back and fetched from the
  other workers; then how many fetched copies tilegraph's scheduler plugin dropped and how many
  values it had fetched ahead;
- ``torch``: the same model (transformers' ``GPT2LMHeadModel``, same sizes) trained by PyTorch
  in one process under the same budget: the child imports torch, then limits its address space
  to what it has mapped plus the budget less what it already holds (``RLIMIT_AS``), so the
  budget counts the same bytes a Dask worker's limit does (its resident memory); it prints how
  far it got, or the error that stopped it. ``--torch-budget 0`` gives it no limit (its peak
  resident memory is then printed). Its run without a limit follows, for its speed and peak.

    python bench/bench_capacity.py                                   # 4.1x: 4.1 GB of state, 2 x 0.93 GiB
    python bench/bench_capacity.py --layers 40 --steps 2             # 8.1x: 8.1 GB of state (about 4 minutes)
    python bench/bench_capacity.py --layers 4 --memory-limit 1GB     # a smaller model, ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from _common import at_least, require


def tilegraph_run(args) -> dict:
    import tilegraph as tg
    from tilegraph import models
    from tilegraph.models import GPT2Config, ModelTiling

    cfg = GPT2Config(vocab_size=args.vocab, max_seq_len=args.seq, dim=args.dim, n_layers=args.layers,
                     n_heads=args.dim // 64)
    rt = tg.connect(n_workers=args.workers, threads_per_worker=1, memory_limit=args.memory_limit, quiet=True)
    try:
        limit = rt.snapshot().memory_limit
        default = ModelTiling.default(cfg)
        feature = default.feature if args.feature is None else args.feature
        model = models.build(cfg, ModelTiling(feature=feature, vocab=default.vocab, batch=args.batch_tile), seed=0)
        n_params = sum(p.size for p in model.parameters())
        print(f"model: GPT-2 {args.layers} x {args.dim}, vocab {args.vocab}: {n_params / 1e6:.1f}M parameters; "
              f"state (params + grads + AdamW) {16 * n_params / 1e9:.2f} GB = "
              f"{16 * n_params / limit:.2f}x one worker's limit ({limit / 2**30:.2f} GiB), "
              f"{args.workers} workers x 1 thread; feature tile {feature or 'whole'}", flush=True)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-4)
        tiles = [(args.batch_tile, None)] * 2
        step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=tiles, parallel="sharded")
        ids, tgt = batch(args, cfg)
        exe = step.plan(ids, tgt)
        bound = "no bound: the state is under half the limit" if exe.max_task_bytes == float("inf") else \
            f"bound {exe.max_task_bytes / 2**20:.0f} MiB"
        print(f"plan: {exe.strategy}, {exe.n_tasks} tasks, largest task "
              f"{max(c.bytes for c in exe.clusters) / 2**20:.0f} MiB ({bound})", flush=True)
        rt.client.run(_long_transfer_log)
        losses, seconds = [], []
        for s in range(args.steps):
            t0 = time.perf_counter()
            losses.append(step(ids, tgt))
            seconds.append(time.perf_counter() - t0)
            print(f"step {s + 1}: loss {losses[-1]:.4f}, {seconds[-1]:.1f} s", flush=True)
        peaks = rt.client.run(_worker_memory)
        moved = rt.client.run(_worker_moved)
        for addr, (peak, spilled, spilled_bytes) in sorted(peaks.items()):
            print(f"worker {addr}: peak resident {peak / 2**20:,.0f} MiB of {limit / 2**20:,.0f} MiB "
                  f"({peak / limit:.0%}); spilled to disk now: {spilled} values, {spilled_bytes / 2**20:,.0f} MiB; "
                  f"over the run: {moved[addr]['disk-write'] / 2**30:.1f} GiB written to disk, "
                  f"{moved[addr]['disk-read'] / 2**30:.1f} GiB read back, "
                  f"{moved[addr]['fetched'] / 2**30:.1f} GiB fetched from the other workers", flush=True)
        counts = rt.client.run_on_scheduler(_plugin_counts)
        if counts:
            print(f"fetched copies dropped after use: {counts[0]}; values fetched ahead: {counts[1]}", flush=True)
        return {"params": n_params, "limit": limit, "losses": losses, "seconds": seconds,
                "peak": max(p for p, _, _ in peaks.values())}
    finally:
        rt.close()


def _worker_memory(dask_worker) -> tuple[int, int, int]:
    from tilegraph.runtime.worker_setup import peak_resident_bytes

    peak = peak_resident_bytes()
    spilled = getattr(dask_worker.data, "spilled_total", None)  # (bytes in memory, bytes on disk)
    return peak, len(getattr(dask_worker.data, "slow", ())), int(getattr(spilled, "disk", 0) or 0)


def _long_transfer_log(dask_worker) -> None:
    """Keep every transfer of the run in the worker's log (Dask keeps its last 1,000 only)."""
    from collections import deque

    dask_worker.transfer_incoming_log = deque(maxlen=1_000_000)


def _worker_moved(dask_worker) -> dict[str, int]:
    """Bytes this worker wrote to and read back from its spill directory since it started
    (Dask's own metrics), and fetched from other workers during the steps."""
    out = {"disk-write": 0, "disk-read": 0}
    for key, value in dask_worker.digests_total.items():
        if isinstance(key, tuple) and len(key) >= 2 and key[-1] == "bytes" and key[-2] in out:
            out[key[-2]] += int(value)
    out["fetched"] = sum(int(t["total"]) for t in dask_worker.transfer_incoming_log)
    return out


def _plugin_counts(dask_scheduler) -> tuple[int, int] | None:
    """tilegraph's scheduler plugin's counts: fetched copies dropped, values fetched ahead."""
    plugin = dask_scheduler.plugins.get("tilegraph-drop-fetched")
    return None if plugin is None else (plugin.dropped, plugin.prefetched)


def batch(args, cfg):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(args.workers * args.batch_tile, args.seq), dtype=np.int64)
    tgt = np.full_like(ids, -100)
    tgt[:, :-1] = ids[:, 1:]
    return ids, tgt


_TORCH_CHILD = r"""
import json, resource, sys, time
args = json.loads(sys.argv[1])
phase = "import"
out = {}
try:
    import numpy as np, torch, transformers
    torch.set_num_threads(args["threads"])
    phase = "limit"
    if args["budget"]:
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        mapped, resident = status("VmSize:"), status("VmRSS:")
        room = args["budget"] - resident
        if room <= 0:
            raise MemoryError(f"{resident} bytes resident after import, over the budget")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + room, mapped + room))
    phase = "build"
    cfg = transformers.GPT2Config(vocab_size=args["vocab"], n_positions=args["seq"], n_embd=args["dim"],
                                  n_layer=args["layers"], n_head=args["dim"] // 64, attn_pdrop=0.0,
                                  embd_pdrop=0.0, resid_pdrop=0.0, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(0, args["vocab"], size=(args["batch"], args["seq"])))
    for s in range(args["steps"]):
        phase = f"step {s + 1}"
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        out.setdefault("seconds", []).append(time.perf_counter() - t0)
    out["ok"] = True
except BaseException as e:
    out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
out["phase"] = phase
out["peak"] = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps(out))
"""


def torch_run(args, budget: int) -> dict:
    params = {"vocab": args.vocab, "seq": args.seq, "dim": args.dim, "layers": args.layers, "steps": args.steps,
              "batch": args.workers * args.batch_tile, "threads": args.workers, "budget": budget}
    proc = subprocess.run([sys.executable, "-c", _TORCH_CHILD, json.dumps(params)], capture_output=True, text=True,
                          timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}", "phase": "?", "peak": 0}
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=at_least(64), default=1024, help="width (dim // 64 heads)")
    ap.add_argument("--layers", type=at_least(1), default=20)
    ap.add_argument("--vocab", type=at_least(1), default=4096)
    ap.add_argument("--seq", type=at_least(2), default=64)
    ap.add_argument("--feature", type=at_least(1), default=None,
                    help="feature tile (whole heads; default: ModelTiling.default's, the whole width up to 1024)")
    ap.add_argument("--batch-tile", type=at_least(1), default=2, help="sequences per worker")
    ap.add_argument("--workers", type=at_least(1), default=2)
    ap.add_argument("--memory-limit", default="1GB", help="per worker, as tg.connect(memory_limit=...)")
    ap.add_argument("--steps", type=at_least(1), default=3)
    ap.add_argument("--torch-budget", default=None,
                    help="PyTorch's budget in bytes or with a unit (default: one worker's limit; 0: none)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    from dask.utils import parse_bytes

    try:  # checked before the tilegraph run (minutes), not after it
        budget = None if args.torch_budget is None else parse_bytes(args.torch_budget)
    except ValueError as e:
        ap.error(f"--torch-budget: bytes or a size such as 1GB, not {args.torch_budget!r} ({e})")
    if not args.no_torch:
        require(ap, "torch", "transformers", what="the PyTorch runs (--no-torch skips them)")
    print(f"machine: {os.cpu_count()} cores", flush=True)
    tg_result = tilegraph_run(args)
    if args.no_torch:
        return
    budget = tg_result["limit"] if budget is None else budget
    for limit in dict.fromkeys([budget, 0]):  # under the budget, then (for its speed) without one
        r = torch_run(args, limit)
        where = f"under {limit / 2**20:,.0f} MiB" if limit else "with no limit"
        if r.get("ok"):
            print(f"torch, one process with {args.workers} threads ({where}): trained {args.steps} steps, "
                  f"{np.median(r['seconds']):.1f} s/step (median), peak resident {r['peak'] / 2**20:,.0f} MiB", flush=True)
        else:
            print(f"torch, one process ({where}): stopped at {r['phase']}: {r['error']} "
                  f"(peak resident {r['peak'] / 2**20:,.0f} MiB)", flush=True)


if __name__ == "__main__":
    main()
