"""Command line: ``tilegraph train``, ``tilegraph info``.

``tilegraph train`` trains a small byte-level transformer language model on the Python standard
library's own ``.py`` files (found at run time, so nothing is downloaded) on the embedded Dask
cluster, showing the loss fall.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np


# ------------------------------------------------------------------------------------ data ----
def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's .py files (sorted paths, so runs are reproducible)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise SystemExit(f"tilegraph train: no .py files found under {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def batches(tokens: np.ndarray, batch: int, seq: int, seed: int):
    """Random windows (inputs, next-byte targets), deterministic given the seed."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - seq - 1, size=batch)
        x = np.stack([tokens[s:s + seq] for s in starts]).astype(np.int64)
        y = np.stack([tokens[s + 1:s + seq + 1] for s in starts]).astype(np.int64)
        yield x, y


# ----------------------------------------------------------------------------------- model ----
def byte_lm(dim: int, layers: int, heads: int, seed: int, tile=None):
    """A small pre-norm transformer over bytes (vocabulary 256) with rotary attention."""
    import tilegraph as tg

    nn = tg.nn

    class Block(nn.Module):
        def __init__(self, rng):
            self.ln1 = nn.LayerNorm(dim, tile=tile)
            self.attn = nn.CausalSelfAttention(dim, heads, rope=True, tile=tile, seed=rng)
            self.ln2 = nn.LayerNorm(dim, tile=tile)
            self.mlp = nn.MLP(dim, 4 * dim, act="gelu_tanh", tile=tile, seed=rng)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))

    class ByteLM(nn.Module):
        def __init__(self):
            rng = np.random.default_rng(seed)
            self.embed = nn.Embedding(256, dim, tile=tile, seed=rng, init_std=0.02)
            self.blocks = nn.ModuleList(Block(rng) for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim, tile=tile)
            self.head = nn.Linear(dim, 256, bias=False, tile=tile, seed=rng, init_std=0.02)

        def forward(self, ids):
            x = self.embed(ids)  # (B, T, C)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))  # (B, T, 256)

    return ByteLM()


def lm_loss(model, ids, targets):
    import tilegraph as tg

    return tg.cross_entropy(model(ids), targets)


# -------------------------------------------------------------------------------- commands ----
def cmd_train(args) -> int:
    import tilegraph as tg
    from tqdm import tqdm

    tokens = stdlib_corpus(args.corpus_mb * 1_000_000)
    split = int(len(tokens) * 0.95)
    train, val = tokens[:split], tokens[split:]
    model = byte_lm(args.dim, args.layers, args.heads, args.seed)
    sched = tg.optim.warmup_cosine(args.lr, warmup=max(1, args.steps // 20), total=args.steps,
                                   min_lr=args.lr / 10)
    opt = tg.optim.AdamW(model.parameters(), lr=sched, weight_decay=0.1, clip_grad_norm=1.0)
    with tg.connect(n_workers=args.workers, quiet=True) as rt:
        streams = max(1, rt.processors()["cpu"])  # one batch tile per worker thread
        bt = max(1, args.batch // streams)
        step = tg.TrainStep(model, opt, lm_loss, batch_tiles=[(bt, None), (bt, None)], runtime=rt)
        print(f"tilegraph train: byte-level LM, {model.num_parameters():,} parameters, "
              f"{len(tokens):,} bytes of stdlib source, batch {args.batch} x {args.seq}", flush=True)
        data = batches(train, args.batch, args.seq, args.seed)
        first = None
        t0 = time.perf_counter()
        bar = tqdm(range(1, args.steps + 1), desc="train", unit="step", disable=args.no_progress,
                   dynamic_ncols=True)
        for i in bar:
            loss = step(*next(data))
            first = loss if first is None else first
            tok_s = args.batch * args.seq * i / (time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
            if args.no_progress and (i % args.log_every == 0 or i == 1):
                print(f"step {i:5d}  loss {loss:.4f}  lr {opt.lr:.2e}  {tok_s:,.0f} tok/s", flush=True)
        bar.close()
        val_losses = []
        vdata = batches(val, args.batch, args.seq, args.seed + 1)
        for _ in range(4):
            ids, tgt = next(vdata)
            val_losses.append(float(tg.compute(lm_loss(model, tg.from_numpy(ids, (bt, None)),
                                                       tg.from_numpy(tgt, (bt, None))))[0]))
    print(f"loss {first:.3f} -> {loss:.3f} (validation {np.mean(val_losses):.3f}; uniform guess "
          f"{np.log(256):.3f}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def cmd_info(args) -> int:
    import dask
    import distributed
    import numba

    import tilegraph as tg

    print(f"tilegraph {tg.__version__}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, dask {dask.__version__}, "
          f"distributed {distributed.__version__}, numba {numba.__version__}")
    try:
        import cupy

        print(f"cupy {cupy.__version__}, {cupy.cuda.runtime.getDeviceCount()} CUDA device(s)")
    except Exception as e:  # the GPU extra is optional
        print(f"cupy: not available ({type(e).__name__})")
    print(f"cpu cores: {os.cpu_count()}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tilegraph", description="Train neural networks as tile graphs on Dask.")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a small byte-level LM on the stdlib sources (embedded cluster)")
    tr.add_argument("--steps", type=int, default=300)
    tr.add_argument("--batch", type=int, default=8)
    tr.add_argument("--seq", type=int, default=64)
    tr.add_argument("--dim", type=int, default=64)
    tr.add_argument("--layers", type=int, default=2)
    tr.add_argument("--heads", type=int, default=4)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--workers", type=int, default=None, help="embedded cluster worker processes (default 1)")
    tr.add_argument("--corpus-mb", type=int, default=4)
    tr.add_argument("--log-every", type=int, default=50)
    tr.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    tr.set_defaults(func=cmd_train)
    info = sub.add_parser("info", help="versions and devices")
    info.set_defaults(func=cmd_info)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
