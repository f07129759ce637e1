"""Decoding speed: milliseconds per generated token of tilegraph's KV-cache decoding against
Hugging Face transformers' ``generate`` with torch eager, the same weights, in one run.

    python bench/bench_generate.py                          # GPT-2 124M, prompt 8, 32 new tokens
    python bench/bench_generate.py --flavor debug           # the quick start's model size, 24 new tokens

The model is ``tg.models.build(flavor)`` written with ``model.to_hf`` and loaded into
transformers' ``GPT2LMHeadModel`` (torch with ``--threads`` threads, ``generate(do_sample=False,
use_cache=True)``). Greedy decoding of one prompt (batch ``--batch``) on both sides; the tokens
must agree (checked on every run). Per token, the median over the new tokens after the first two
of each round, best round of ``--rounds`` (the runs take turns within each round):

    replay          tilegraph.models.generate, one-position steps run the graph recorded for the
                    position before again (the default)
    record          the same, each step recorded and planned anew (``Decoder(replay=False)``)
    cluster replay  the Decoder on an embedded cluster (1 worker x --threads), with the cache on
    cluster record  the worker and only the logits coming back: a Dask round trip per token
    torch           transformers' generate

and, for the whole call of ``generate`` (the prompt's prefill included; on the cluster also the
model's trip to the worker), its time divided by the new tokens, best of the rounds:

    generate          tilegraph.models.generate here
    cluster generate  the same on the embedded cluster: one task decoding on the worker
    cluster per token the same with a round trip per token (the path before the one task)
    torch generate    transformers' generate

The cluster rows decode a twin of the model (the same weights) whose parameters were moved to
the worker once, as a model loaded on a cluster (``from_zarr(..., runtime=rt)``) has them.

``--no-cluster`` leaves the cluster rows out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import at_least, require  # noqa: E402

FLAVORS = {"gpt2": "gpt2", "debug": "gpt2-debug"}


def tilegraph_run(model, prompt, new: int, replay: bool, runtime=None) -> tuple[np.ndarray, list[float]]:
    """Greedy decoding as tilegraph.models.generate does it, timing each new token's step."""
    from tilegraph.models import Decoder

    out, times = [], []
    with Decoder(model, replay=replay, runtime=runtime) as dec:
        logits = dec.feed(prompt)
        for i in range(new):
            tok = np.argmax(logits, axis=-1)[:, None]
            out.append(tok)
            if i + 1 < new:
                t0 = time.perf_counter()
                logits = dec.feed(tok)
                times.append(time.perf_counter() - t0)
    return np.concatenate(out, axis=1), times


def torch_run(hf, prompt, new: int) -> tuple[np.ndarray, list[float]]:
    """transformers' generate, each token's time taken by a logits processor (called once per step)."""
    import torch

    stamps = []

    def stamp(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    ids = torch.tensor(prompt)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                          min_new_tokens=new, pad_token_id=0, logits_processor=[stamp])
    return out[:, prompt.shape[1]:].numpy(), list(np.diff(stamps))


def whole_call(run, new: int):
    """``run()`` (tokens) timed as one call: its seconds per new token, as a run's times."""
    t0 = time.perf_counter()
    tokens = run()
    return tokens, [(time.perf_counter() - t0) / new] * new


def per_token(times: list[float]) -> float:
    return float(np.median(times[2:] if len(times) > 4 else times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", choices=list(FLAVORS), default="gpt2")
    ap.add_argument("--prompt", type=at_least(1), default=8, help="prompt tokens")
    ap.add_argument("--new", type=at_least(3), default=None,
                    help="new tokens per run (default 32, or what the model's max_seq_len leaves after the prompt)")
    ap.add_argument("--batch", type=at_least(1), default=1)
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--threads", type=at_least(1), default=os.cpu_count() or 1)
    ap.add_argument("--no-cluster", action="store_true", help="leave out the embedded cluster's rows")
    args = ap.parse_args()
    require(ap, "torch", "transformers")
    import torch
    import transformers

    import tilegraph as tg
    from tilegraph import models

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model = models.build(FLAVORS[args.flavor], seed=0)
    cfg = model.config
    if args.new is None:
        args.new = max(3, min(32, cfg.max_seq_len - args.prompt))
    if args.prompt + args.new > cfg.max_seq_len:
        ap.error(f"--prompt + --new must be at most the model's max_seq_len {cfg.max_seq_len}")
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.prompt))
    with tempfile.TemporaryDirectory() as folder:
        model.to_hf(folder)
        hf = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    runs = {"replay": lambda: tilegraph_run(model, prompt, args.new, True),
            "record": lambda: tilegraph_run(model, prompt, args.new, False)}
    rt = None
    if not args.no_cluster:
        rt = tg.connect(n_workers=1, threads_per_worker=args.threads, quiet=True, make_current=False)
        runs["cluster replay"] = lambda: tilegraph_run(model, prompt, args.new, True, rt)
        runs["cluster record"] = lambda: tilegraph_run(model, prompt, args.new, False, rt)
    runs["torch"] = lambda: torch_run(hf, prompt, args.new)
    p = args.prompt
    runs["generate"] = lambda: whole_call(lambda: models.generate(model, prompt, args.new, runtime=None)[:, p:],
                                          args.new)
    if rt is not None:
        import importlib

        on_worker = importlib.import_module("tilegraph.models.generate")  # (the package's `generate` is the function)
        twin = models.build(FLAVORS[args.flavor], seed=0)
        rt.scatter_cells([c for q in twin.parameters() for c in q.cells.flat])

        def per_token_path():
            share = on_worker.ONE_WORKER_MEMORY_SHARE
            on_worker.ONE_WORKER_MEMORY_SHARE = 0.0  # "too large for one worker": a round trip per token
            try:
                return models.generate(twin, prompt, args.new, runtime=rt)[:, p:]
            finally:
                on_worker.ONE_WORKER_MEMORY_SHARE = share

        runs["cluster generate"] = lambda: whole_call(
            lambda: models.generate(twin, prompt, args.new, runtime=rt)[:, p:], args.new)
        runs["cluster per token"] = lambda: whole_call(per_token_path, args.new)
    runs["torch generate"] = lambda: whole_call(lambda: torch_run(hf, prompt, args.new)[0], args.new)
    try:
        for fn in runs.values():
            fn()  # warm-up: plans, BLAS, workers
        best = {name: float("inf") for name in runs}
        reference = None
        for r in range(args.rounds):
            names = list(runs)
            for name in names[r % len(names):] + names[:r % len(names)]:
                tokens, times = runs[name]()
                if reference is None:
                    reference = tokens
                elif not np.array_equal(tokens, reference):
                    sys.exit(f"bench_generate: {name} generated other tokens than the first run: {tokens} vs {reference}")
                best[name] = min(best[name], per_token(times))
    finally:
        if rt is not None:
            rt.close()
    print(f"{args.flavor} ({model.num_parameters():,} parameters), batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens, {args.threads} threads; ms per token (median of a run, best of {args.rounds} "
          f"rounds); torch / x: > 1 means faster than transformers' generate")
    for name, ms in best.items():
        torch_ms = best["torch generate" if name.endswith(("generate", "per token")) else "torch"]
        print(f"  {name:<16} {ms:8.2f} ms   torch / x {torch_ms / ms:5.2f}")


if __name__ == "__main__":
    main()
