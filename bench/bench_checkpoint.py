"""Checkpoints: Zarr save/load throughput against numpy.save and safetensors, and what each
quantization method costs in size, error and perplexity. One run prints three tables:

1. ``throughput``: the full training state of a GPT-2 (default the 124M flavor: weights and both
   AdamW moments, ~1.5 GB fp32) held by the workers of an embedded cluster (1, then 2 worker
   processes), saved with ``tilegraph.io.save_checkpoint`` (each tile written by its worker) and
   loaded back onto the workers (``load_checkpoint(...).load_into`` + ``restore_optimizer``, until
   every tile is in worker memory); beside it ``numpy.save`` (one .npy per array) and
   safetensors (``safetensors.numpy.save_file``) of the same arrays from this process, and their
   loads. MB/s = state bytes / seconds; ``vs numpy`` = Zarr MB/s / numpy.save MB/s of the same
   bytes in the same round (``--repeat`` rounds per worker count after ``--warmup`` untimed ones,
   medians shown; ``os.sync()`` before each timing, untimed; each format's files deleted once
   loaded). The page cache is not dropped (no root needed): loads read warm
   files.
2. ``quantization``: per method, on the GPT-2 weight matrices (``--quant-flavor``'s random init
   unless ``--hf FOLDER`` gives real weights) and on Student-t(3) 768 x 768 matrices: the
   checkpoint's size (model only, all files, metadata included) over the fp32 checkpoint's, and
   the mean relative Frobenius error ||W - Q(W)|| / ||W|| of the quantized matrices.
3. ``perplexity``: the debug GPT-2 trained on the Python standard library for ``--train-steps``,
   its validation perplexity exp(loss) in fp32 and after each method (saved quantized, loaded
   dequantized).

    python bench/bench_checkpoint.py                        # everything (a few minutes on 2 cores)
    python bench/bench_checkpoint.py --flavor gpt2-debug --quant-flavor gpt2-debug --train-steps 60 \
        --methods int8,kashin:4 --repeat 1                  # a quick smoke run (~20 s on 2 cores)
    python bench/bench_checkpoint.py --only throughput --repeat 5             # the throughput table only
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from _common import at_least, require

PARTS = ("throughput", "quantization", "perplexity")
METHODS = ["fp16", "bf16", "int8", "int4", "kmeans:4", "kashin:4", "auto:4", "kashin:3", "kashin:2"]


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _state_arrays(model, opt) -> dict[str, np.ndarray]:
    """The arrays of the training state, gathered here (for the numpy/safetensors baselines)."""
    import tilegraph as tg

    out = dict(model.state_dict())
    for p, st in zip(opt.params, opt.state_tensors()):
        names = {id(q): n for n, q in model.named_parameters()}
        values = tg.compute(*st.values())
        out.update({f"{names[id(p)]}.{k}": v for k, v in zip(st, values)})
    return out


def _timed(fn) -> float:
    """Seconds ``fn()`` takes, after ``os.sync()`` (untimed): the dirty pages an earlier write left
    are flushed first, so no run pays for another's writeback (the kernel throttles a writer once
    dirty pages pass a share of memory, and a 1.5 GB state is most of that share)."""
    os.sync()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def throughput(args, tmp: Path) -> list[dict]:
    """Per worker count, ``--repeat`` rounds of: Zarr save and load, numpy.save and np.load,
    safetensors save and load, each timed after an untimed ``os.sync()``; each format's files are
    deleted once it is loaded, so every save starts from the same page cache (the one before
    holding nothing more), as a checkpoint rotation that keeps the last few would. The formats take
    turns going first. ``--warmup`` rounds go first, untimed: the first save of a process (into
    memory the OS has not handed out before) ran 2-3x slower for every format. A round's ratios are against that round's numpy figures; the table shows
    the medians over the rounds (seconds and ratios)."""
    import statistics

    import tilegraph as tg
    from safetensors.numpy import load_file, save_file
    from tilegraph import models

    rows = []
    for workers in args.workers:
        rt = tg.connect(n_workers=workers, threads_per_worker=max(1, (os.cpu_count() or 2) // workers), quiet=True,
                        dashboard=False, make_current=False)
        with rt.as_current():
            model = models.build(args.flavor, seed=0)
            opt = tg.optim.AdamW(model.parameters(), lr=1e-4)
            rng = np.random.default_rng(0)
            for grid in (g for st in opt.state_cells for g in st):  # moments of a trained model, not zeros
                for cell in grid.flat:
                    cell.set(rng.standard_normal(cell.shape).astype(np.float32) * 1e-3)
            cells = [c for p in model.parameters() for c in p.cells.flat]
            cells += [c for st in opt.state_cells for g in st for c in g.flat]
            rt.scatter_cells(cells)  # the state lives on the workers, spread over them
            nbytes = sum(int(np.prod(c.shape)) * 4 for c in cells)
            arrays = _state_arrays(model, opt)  # the same bytes, here, for the baselines
            model2 = models.build(args.flavor, seed=1)
            opt2 = tg.optim.AdamW(model2.parameters(), lr=1e-4)
            times: dict[str, list[float]] = {}
            for r in range(-args.warmup, args.repeat):
                ck, folder, st_file = tmp / f"zarr-{workers}-{r}", tmp / f"npy-{r}", tmp / f"state-{r}.safetensors"

                def zarr_run():
                    times.setdefault("zarr save", []).append(_timed(lambda: tg.io.save_checkpoint(ck, model, opt)))

                    def load():
                        c = tg.io.load_checkpoint(ck)
                        c.load_into(model2)
                        c.restore_optimizer(opt2, model2)  # returns once every tile is in a worker's memory
                    times.setdefault("zarr load", []).append(_timed(load))
                    shutil.rmtree(ck)

                def numpy_run():
                    folder.mkdir()

                    def np_save():
                        for k, v in arrays.items():
                            np.save(folder / f"{k}.npy", v)
                    times.setdefault("numpy save", []).append(_timed(np_save))
                    back = {}
                    times.setdefault("numpy load", []).append(
                        _timed(lambda: back.update({k: np.load(folder / f"{k}.npy") for k in arrays})))
                    back.clear()
                    shutil.rmtree(folder)

                def st_run():
                    back = {}
                    times.setdefault("st save", []).append(_timed(lambda: save_file(arrays, str(st_file))))
                    times.setdefault("st load", []).append(_timed(lambda: back.update(load_file(str(st_file)))))
                    back.clear()
                    st_file.unlink()

                runs = [zarr_run, numpy_run, st_run]
                for run in runs[r % 3:] + runs[:r % 3]:  # each goes first, second and third in turn
                    run()
            times = {k: v[args.warmup:] for k, v in times.items()}  # the warm-up rounds are not shown
            arrays.clear()
        rt.close()
        for what, key in ((f"zarr, {workers} worker{'s' if workers > 1 else ''}", "zarr"),
                          ("numpy.save / np.load", "numpy"), ("safetensors", "st")):
            rows.append({"what": what, "workers": workers, "bytes": nbytes,
                         "save": statistics.median(times[f"{key} save"]),
                         "load": statistics.median(times[f"{key} load"]),
                         "save_ratio": statistics.median(n / z for z, n in zip(times[f"{key} save"],
                                                                                times["numpy save"])),
                         "load_ratio": statistics.median(n / z for z, n in zip(times[f"{key} load"],
                                                                                times["numpy load"])),
                         "save_all": times[f"{key} save"], "load_all": times[f"{key} load"]})
    mb = rows[0]["bytes"] / 1e6
    print(f"\n1. throughput: {args.flavor} training state, {mb:,.{0 if mb >= 10 else 2}f} MB (weights + AdamW moments, fp32); "
          f"medians of {args.repeat} round{'s' if args.repeat > 1 else ''}, each against the numpy figures "
          "of its own round")
    print(f"{'':28} {'save MB/s':>10} {'load MB/s':>10} {'save vs numpy':>14} {'load vs numpy':>14}")
    for r in rows:
        label = r["what"] if len(args.workers) < 2 or r["what"].startswith("zarr") else \
            f"{r['what']} ({r['workers']}w run)"
        print(f"{label:28} {mb / r['save']:10,.0f} {mb / r['load']:10,.0f} {r['save_ratio']:14.2f} {r['load_ratio']:14.2f}")
    if args.verbose:
        for r in rows:
            print(f"  {r['what'] + ' (' + str(r['workers']) + 'w)':32} save s: {' '.join(f'{t:.2f}' for t in r['save_all'])}   "
                  f"load s: {' '.join(f'{t:.2f}' for t in r['load_all'])}")
    return rows


def _quant_errors(model, method: str, tmp: Path, tag: str) -> tuple[float, float]:
    """(size ratio against fp32, mean relative error of the quantized matrices) of ``model`` saved
    with ``method``."""
    import tilegraph as tg

    exact = tmp / f"{tag}-fp32"
    if not exact.exists():
        tg.io.save_checkpoint(exact, model)
    path = tmp / f"{tag}-{method.replace(':', '-')}"
    tg.io.save_checkpoint(path, model, quantize=method)
    ck = tg.io.load_checkpoint(path)
    want = model.state_dict()
    errs = []
    for name, info in ck.arrays.items():
        if info.get("quantized") and name.startswith("model/"):
            w = want[name[len("model/"):]]
            errs.append(float(np.linalg.norm(ck.array(name) - w) / max(np.linalg.norm(w), 1e-30)))
    ratio = _folder_bytes(path) / _folder_bytes(exact)
    shutil.rmtree(path)
    return ratio, float(np.mean(errs)) if errs else float("nan")


class _Matrices:
    """Student-t(3) matrices as a minimal 'model' for save_checkpoint."""

    def __init__(self, n: int, count: int, seed: int = 0):
        from tilegraph.nn import Module, Parameter

        rng = np.random.default_rng(seed)

        class M(Module):
            pass

        self.module = M()
        for i in range(count):
            w = (rng.standard_t(3, (n, n)) / math.sqrt(n)).astype(np.float32)
            setattr(self.module, f"w{i}", Parameter(w, (n // 2, n // 2), name=f"w{i}"))


def quantization(args, tmp: Path) -> None:
    from tilegraph import models

    if args.hf:
        gpt = models.from_hf(args.hf)
        what = f"weights of {args.hf}"
    elif args.quant_flavor == "gpt2-2x768":  # GPT-2's layer sizes, two layers, a 4,096-id vocabulary
        gpt = models.build(models.GPT2Config(vocab_size=4096, max_seq_len=256, n_layers=2), seed=0)
        what = "GPT-2 2 x 768, vocabulary 4,096 (random init)"
    else:
        gpt = models.build(args.quant_flavor, seed=0)
        what = f"{args.quant_flavor} (random init)"
    student = _Matrices(768, 2).module
    print(f"\n2. quantization: size of the checkpoint (model only, metadata included) / fp32, and the mean "
          f"relative error of the quantized matrices;\n   GPT-2: {what}; Student-t(3): two 768 x 768 matrices, "
          f"tiles 384 x 384")
    print(f"{'method':10} {'GPT-2 size':>11} {'GPT-2 err':>10} {'t(3) size':>10} {'t(3) err':>10}")
    for method in args.methods:
        g = _quant_errors(gpt, method, tmp, "gpt2")
        s = _quant_errors(student, method, tmp, "t3")
        print(f"{method:10} {g[0]:11.3f} {g[1]:10.4f} {s[0]:10.3f} {s[1]:10.4f}", flush=True)


def perplexity(args, tmp: Path) -> None:
    import tilegraph as tg
    from tilegraph import models
    from tilegraph.io.data import stdlib_files
    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    tok = ByteTokenizer(eos=True)
    sources = stdlib_files(["*.py"], 4_000_000)
    build_token_file(sources, tmp / "tokens.bin", tok)
    train = TokenDataset(tmp / "tokens.bin", 64, split="train", seed=0)
    val = TokenDataset(tmp / "tokens.bin", 64, split="val", seed=0)
    cfg = models.GPT2Config(vocab_size=tok.vocab_size, max_seq_len=64, dim=64, n_layers=2, n_heads=4)
    model = models.build(cfg, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-3, min(20, args.train_steps), args.train_steps, 3e-4))
    tg.Trainer(model, opt, train, batch_size=16, progress=False).fit(args.train_steps)
    tg.io.save_checkpoint(tmp / "ppl-fp32", model)

    def ppl(m) -> float:
        ev = tg.Trainer(m, tg.optim.SGD(m.parameters(), lr=0.0), train, batch_size=16, eval_data=val,
                        eval_batches=args.eval_batches, progress=False)
        return math.exp(ev.evaluate())

    base = ppl(model)
    print(f"\n3. perplexity: GPT-2 {cfg.n_layers} x {cfg.dim} trained {args.train_steps} steps on the standard "
          f"library (bytes), validation over {args.eval_batches} batches of 16 x 64")
    print(f"{'method':10} {'perplexity':>11} {'vs fp32':>8} {'size':>7}")
    print(f"{'fp32':10} {base:11.3f} {1.0:8.3f} {1.0:7.3f}")
    for method in args.methods:
        path = tmp / f"ppl-{method.replace(':', '-')}"
        tg.io.save_checkpoint(path, model, quantize=method)
        p = ppl(models.from_zarr(path))
        print(f"{method:10} {p:11.3f} {p / base:8.3f} {_folder_bytes(path) / _folder_bytes(tmp / 'ppl-fp32'):7.3f}",
              flush=True)


def main() -> int:
    # the whole docstring: its first line stopped mid-sentence, and the examples are in the rest
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="gpt2", help="model of the throughput table (default: GPT-2 124M)")
    ap.add_argument("--workers", default="1,2", help="worker processes of the throughput runs")
    ap.add_argument("--quant-flavor", default="gpt2-2x768",
                    help="model of the quantization table (default: GPT-2's layer sizes, 2 layers; Kashin "
                         "quantizes a 768 x 768 tile in 1-3 s)")
    ap.add_argument("--hf", default=None, help="an HF GPT-2/Llama folder: quantize its real weights")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--train-steps", type=at_least(1), default=300)
    ap.add_argument("--eval-batches", type=at_least(1), default=32)
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma separated: {', '.join(PARTS)}")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--repeat", type=at_least(1), default=3,
                    help="rounds of the throughput table (medians shown; the formats take turns going first)")
    ap.add_argument("--warmup", type=at_least(0), default=1, help="untimed rounds before those of the throughput table")
    ap.add_argument("--verbose", action="store_true", help="the throughput table's seconds of every round")
    args = ap.parse_args()
    # everything checked before the first table: a bad value for the last one would otherwise
    # stop the run after minutes of the others
    parts = {p.strip() for p in args.only.split(",") if p.strip()}
    if not parts or parts - set(PARTS):  # an unknown part ran nothing and exited 0
        ap.error(f"--only: a comma separated list of {', '.join(PARTS)}, not {args.only!r}")
    text = args.workers
    try:
        args.workers = [int(w) for w in text.split(",")]
    except ValueError:
        args.workers = []
    if not args.workers or min(args.workers) < 1:
        ap.error(f"--workers: comma separated worker counts, each at least 1, not {text!r}")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if args.dir is not None and not Path(args.dir).is_dir():
        ap.error(f"--dir {args.dir}: not a folder")
    if "throughput" in parts:
        require(ap, "safetensors", what="the throughput table (--only leaves it out)")
    from tilegraph import models
    from tilegraph.io.zarr import quantize_rule

    if args.flavor not in models.FLAVORS:
        ap.error(f"--flavor: one of {', '.join(models.FLAVORS)}, not {args.flavor!r}")
    if args.quant_flavor != "gpt2-2x768" and args.quant_flavor not in models.FLAVORS:
        ap.error(f"--quant-flavor: gpt2-2x768 or one of {', '.join(models.FLAVORS)}, not {args.quant_flavor!r}")
    if args.hf is not None and not Path(args.hf).is_dir():
        ap.error(f"--hf {args.hf}: not a folder")
    if not args.methods and parts & {"quantization", "perplexity"}:
        ap.error("--methods: at least one quantization method")
    for method in args.methods:
        try:
            quantize_rule(method, "--methods")("w", (64, 64))
        except ValueError as e:  # CheckpointError, naming the methods known
            ap.error(str(e))
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-ck-", dir=args.dir))
    try:
        if "throughput" in parts:
            throughput(args, tmp)
        if "quantization" in parts:
            quantization(args, tmp)
        if "perplexity" in parts:
            perplexity(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
