"""``tilegraph train``: one run per output folder, the training job itself, what a resumed run
takes from its checkpoint, what its checkpoints carry (the tokenizer, the adapters)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from tilegraph._errors import TileError
from tilegraph.runtime import _plural
from tilegraph.io.data import stdlib_files  # the train corpus "stdlib"; public there
from tilegraph.cli.config import apply_overrides, build_model, check_config, load_config, make_tokenizer
from tilegraph.cli.finetune import (PEFT_FILE, add_adapters, add_grad_sketch, adapter_settings, check_init_fits,
                                    given_model_keys, init_model, peft_record, read_peft_record, resume_model,
                                    resume_settings)


# -------------------------------------------------------------------------------- commands ----
LOCK_NAME = ".tilegraph.lock"


def lock_output(out: Path):
    """Take ``out`` for this process (a lock file naming it); returns the release function. A
    folder locked by a live process is refused, naming it; a lock whose process is gone is taken
    over."""
    import socket

    from tilegraph._errors import TileError
    from tilegraph.io.zarr import process_alive

    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                held = json.loads(lock.read_text())
                pid, host = int(held["pid"]), str(held["host"])
            except (OSError, ValueError, KeyError, TypeError):
                pid, host = None, me["host"]
            if pid is not None and (host != me["host"] or process_alive(pid)):
                raise TileError("tilegraph train", f"an output folder no other run is using; {out} is in use by "
                                f"tilegraph train (pid {pid} on {host}): wait for it, or pass another --out",
                                str(lock)) from None
            lock.unlink(missing_ok=True)  # its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return lambda: lock.unlink(missing_ok=True)
    raise TileError("tilegraph train", "a lock on the output folder", f"{lock} could not be taken")


def take_output(out: Path, where: str):
    """:func:`lock_output` ``out``, a path that cannot be a folder (a file in the way, a file
    system that is missing or read-only) refused in one error naming it, as ``tilegraph convert``
    names its destination (``where``: what named the folder). Returns the release function."""
    from tilegraph.io._store import write_failure

    in_the_way = next((p for p in (out, *out.parents) if os.path.lexists(p)), None)
    if in_the_way is not None and not in_the_way.is_dir():
        raise TileError(where, "an output folder, or a path where one can be made (nothing was written)",
                        f"{out} is not a folder" if in_the_way == out else f"{out}: {in_the_way} is not a folder")
    try:
        return lock_output(out)
    except OSError as e:
        raise write_failure(where, e, out, "the output folder", "nothing was written") from None


def check_output(out: Path, resume: str | None, steps: int) -> int | None:
    """Refuse, before any work, a run whose output would mix with or overwrite an earlier run's;
    returns the step of the ``resume`` checkpoint (None without one)."""
    from tilegraph._errors import TileError
    from tilegraph.io.zarr import load_checkpoint

    ckdir = out / "checkpoints"
    found = sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step-")) if ckdir.is_dir() else []
    if resume is None:
        if found:
            what = ", ".join(x for x in ["metrics.jsonl" if (out / "metrics.jsonl").exists() else "",
                                         f"checkpoints {found[0]}..{found[-1]}"] if x)
            raise TileError("tilegraph train", f"an output folder without an earlier run; {out} holds one ({what}): "
                            f"pass --resume CHECKPOINT to continue it (--resume {ckdir / found[-1]} continues it), "
                            "or another --out", str(out))
        if (out / "metrics.jsonl").exists():  # a run that stopped (an error, a kill) before its first checkpoint
            raise TileError("tilegraph train", f"an output folder without an earlier run; {out} holds the "
                            "metrics.jsonl of one that wrote no checkpoint, so nothing there can be resumed: pass "
                            f"another --out, or delete {out} (or its metrics.jsonl) to start over in it", str(out))
        return None
    step = load_checkpoint(resume).step
    if in_folder(resume, ckdir):
        return step  # the run's own later checkpoints: set aside when it starts (keep_branch_point)
    clash = [n for n in found if n.split("-", 1)[1].isdigit() and step < int(n.split("-", 1)[1]) <= step + steps]
    if clash:
        raise TileError("tilegraph train", f"checkpoint names free for steps {step + 1}..{step + steps}; {ckdir} "
                        f"already holds {', '.join(clash)} (from a run that went past step {step}): pass another --out",
                        f"--resume {resume} --steps {steps}")
    return step


# ------------------------------------------------------------------------------ the settings ----
def given_settings(config: str | None, pairs: list[str], flags: dict[str, tuple[str, object]]) -> dict[str, str]:
    """The settings the user gave, not the shipped defaults: ``section.key`` -> where (the config
    file's path, or on the command line ``--set KEY=VALUE`` or the flag and its value, which win)."""
    import tomllib

    given = {}
    if config is not None:
        user = tomllib.loads(Path(config).read_text(encoding="utf-8"))  # load_config has read it
        given = {f"{s}.{k}": config for s, keys in user.items() if isinstance(keys, dict) for k in keys}
    given.update({pair.partition("=")[0].strip(): f"--set {pair.strip()}" for pair in pairs})
    given.update({name: f"{flag} {value}" for name, (flag, value) in flags.items() if value is not None})
    return given


def on_command_line(where: str) -> bool:
    """Whether a :func:`given_settings` source is the command line (else a config file)."""
    return where.startswith("--")


def run_folder(checkpoint: str) -> Path | None:
    """The run folder holding ``checkpoint``: RUN for ``RUN/checkpoints/step-N`` (and for a branch
    set aside, ``RUN/checkpoints/abandoned-*/step-N``); None for a checkpoint elsewhere."""
    path = Path(checkpoint)
    for p in (path, path.resolve()):  # resolved for paths like "step-000020" or "."
        run = next((a.parent for a in p.parents[:2] if a.name == "checkpoints"), None)
        if run is not None:
            return run
    return None


def output_folder(out: str | None, configured: str, given: dict[str, str], resume: str | None) -> tuple[Path, str]:
    """The run's output folder and what named it (for errors): ``--out``; else ``[output] dir``
    where the user gave it; else, resuming, the run folder of the checkpoint (so the run's
    metrics.jsonl and loss.png go on); else the shipped ``[output] dir``."""
    if out is None and "output.dir" not in given and resume and (run := run_folder(resume)) is not None:
        return run, f"tilegraph train --resume (its run folder, {run})"
    text, where = (out, "--out") if out is not None else (configured, "tilegraph train [output] dir")
    if not text.strip():
        raise TileError(where, "an output folder (a path; nothing was written)", repr(text))
    return Path(text), where


# -------------------------------------------------------------------------------- resuming ----
#: [train] keys of the learning-rate schedule -> the keys of its spec, which checkpoints hold and
#: a resumed run keeps (tilegraph.optim.warmup_cosine)
SCHEDULE_KEYS = {"lr": "base_lr", "warmup": "warmup", "min_lr": "min_lr"}


def plan_resume(resume: str, cfg: dict, given: dict[str, str], source: str) -> int:
    """Check a ``--resume`` job against its checkpoint and complete it from there (the [peft]
    adapters the job leaves out); returns the steps to run (:func:`steps_to_run`)."""
    from tilegraph.io.zarr import load_checkpoint

    init_from = given.get("model.init", "")
    if on_command_line(init_from) and cfg["model"].get("init"):
        raise TileError("tilegraph train", "--init or --resume, not both: --init starts a new run from a "
                        "checkpoint's weights, --resume continues the run that wrote it (with the weights it "
                        "started from)", f"{init_from} --resume {resume}")
    ck = load_checkpoint(resume)
    record = read_peft_record(Path(resume), "tilegraph train --resume")
    if record is not None:  # its adapters, unless the job gives them (resume_settings checks they agree)
        cfg["peft"].update({k: v for k, v in adapter_settings(record).items() if f"peft.{k}" not in given})
        check_config(cfg, source)
    spec = (ck.optimizer_info or {}).get("schedule") or {}
    check_schedule(resume, spec, cfg["train"], given)
    return steps_to_run(resume, ck.step, spec, cfg["train"], given)


def check_schedule(resume: str, spec: dict, t: dict, given: dict[str, str]) -> None:
    """A resumed run keeps its checkpoint's learning-rate schedule ``spec``: other values of its
    [train] keys are an error when the command line gives them, and one warning line per config
    file that does (it may be the one the run started from, with flags over it)."""
    other = schedule_changes(spec, t, given)
    if not on_command_line(given.get("train.steps", "")) and "train.steps" in given \
            and spec.get("total", t["steps"]) != t["steps"]:  # the budget, which the schedule spans
        other.append((given["train.steps"], f"steps = {t['steps']!r}"))
    refused = [where for where, _ in other if on_command_line(where)]
    if refused:
        raise TileError("tilegraph train --resume", "no learning-rate settings other than its checkpoint's schedule, "
                        f"which the resumed run keeps ({describe_schedule(spec)}): leave them out, or start a new "
                        f"run from the checkpoint's weights (--init {resume} and another --out)", "; ".join(refused))
    for config in dict.fromkeys(where for where, _ in other):
        print(f"tilegraph train: warning: {', '.join(x for where, x in other if where == config)} in {config} not "
              f"used: the resumed run keeps its checkpoint's learning-rate schedule ({describe_schedule(spec)})",
              file=sys.stderr, flush=True)


def steps_to_run(resume: str, step: int, spec: dict, t: dict, given: dict[str, str]) -> int:
    """The steps a resumed run takes: ``--steps N`` (or ``--set train.steps=N``) more; else up to
    the step budget its schedule ``spec`` spans (one without a budget: [train] steps more)."""
    total = spec.get("total")
    if on_command_line(given.get("train.steps", "")) or total is None:
        return int(t["steps"])
    if total <= step:
        raise TileError("tilegraph train --resume", f"--steps N, the steps to add: {resume} ends its run (step {step} "
                        f"of the {total} steps its learning-rate schedule spans; steps past them run at its min_lr)",
                        "no --steps")
    return total - step


def schedule_changes(spec: dict, t: dict, given: dict[str, str]) -> list[tuple[str, str]]:
    """The schedule keys the user gave with values other than the checkpoint's schedule ``spec``:
    ``(where, "key = value")``."""
    changed = []
    for key, name in SCHEDULE_KEYS.items():
        if f"train.{key}" not in given or name not in spec:
            continue
        value = min(int(t[key]), spec.get("total", t[key])) if key == "warmup" else t[key]  # as the run built it
        if not math.isclose(value, spec[name], rel_tol=1e-9):
            changed.append((given[f"train.{key}"], f"{key} = {t[key]!r}"))
    return changed


def describe_schedule(spec: dict) -> str:
    """``lr 0.003, warmup 15, steps 300, min_lr 0.0003``: a schedule spec in [train]'s names."""
    names = {v: k for k, v in SCHEDULE_KEYS.items()} | {"total": "steps"}
    return ", ".join(f"{names.get(k, k)} {v:g}" for k, v in spec.items() if k != "name") or "none saved"


def keep_branch_point(manager, resume: str, step: int) -> None:
    """A resumed run never prunes the checkpoint it resumed from, and moves the later checkpoints
    of that folder (the branch of an earlier run that this one abandons, which would otherwise
    rank as the newest, be kept over this run's own and collide with their names) into
    ``checkpoints/abandoned-DATE-TIME/``, saying so. Nothing is deleted."""
    manager.protect(resume)
    if not in_folder(resume, manager.dir):
        return
    moved = manager.set_aside(step, time.strftime("abandoned-%Y%m%d-%H%M%S"))
    if moved:
        print(f"set aside the checkpoints after step {step}, of the branch this run abandons: "
              f"{', '.join(p.name for p in moved)} -> {moved[0].parent}", flush=True)


def in_folder(checkpoint: str, folder: Path) -> bool:
    """Whether ``checkpoint`` is one of the checkpoints of ``folder``."""
    return Path(checkpoint).resolve().parent == folder.resolve()


def resume_command(config: str | None, checkpoint) -> str:
    """The command that continues a run from ``checkpoint``."""
    return " ".join(["tilegraph train", *([config] if config else []), "--resume", str(checkpoint)])


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint in ``out/checkpoints`` (None: none)."""
    from tilegraph.io.zarr import is_checkpoint

    ckdir = out / "checkpoints"
    found = sorted(p for p in ckdir.iterdir() if p.name.startswith("step-") and is_checkpoint(p)) \
        if ckdir.is_dir() else []
    return found[-1] if found else None


def diverged(error: FloatingPointError, optimizer, out: Path) -> TileError:
    """The error of a loss that became NaN or inf (``error`` names the step): what to try (a
    folder holding checkpoints is never the one to delete)."""
    lr = (getattr(optimizer.schedule, "spec", None) or {}).get("base_lr")
    last = latest_checkpoint(out)
    return TileError("tilegraph train", "a finite loss: train again with a lower learning rate (--lr"
                     + (f"; this run's peak was {lr:g}" if lr is not None else "") + "), in another --out"
                     + (f" (from the weights of its last checkpoint: --init {last})" if last else
                        f" or after deleting {out}"), re.sub(r"^\[[^]]*\] *", "", str(error)))


# -------------------------------------------------------------------------------- the job ----
@dataclass
class Job:
    """What :func:`cmd_train` releases after the job (the output lock, the job's settings) and
    names when it stops at once (the output folder, the config)."""
    release: list = field(default_factory=list)
    out: Path | None = None
    config: str | None = None


def cmd_train(args) -> int:
    job = Job(config=args.config)
    try:
        return _train(args, job)
    except KeyboardInterrupt:  # a second Ctrl-C ("again to stop at once"), or one before training
        last = latest_checkpoint(job.out) if job.out is not None else None
        print("tilegraph train: stopped at once; " + (f"last checkpoint: {last} (continue with "
                                                      f"{resume_command(job.config, last)})" if last else
                                                      "no checkpoint written"), file=sys.stderr, flush=True)
        return 130
    finally:
        for release in job.release:
            release()


def _train(args, job: Job) -> int:
    import signal

    import tilegraph as tg
    from tilegraph.io import TokenDataset, build_token_file

    cfg, source = load_config(args.config)
    flags = {"train.steps": ("--steps", args.steps), "train.lr": ("--lr", args.lr),
             "train.batch_size": ("--batch-size", args.batch_size), "train.seed": ("--seed", args.seed),
             "model.init": ("--init", args.init)}
    apply_overrides(cfg, list(args.set or []))
    for name, (_, value) in flags.items():
        if value is not None:
            section, key = name.split(".")
            cfg[section][key] = value
    if args.set or any(v is not None for _, v in flags.values()):
        source += " and the command line"
    check_config(cfg, source)
    given = given_settings(args.config, list(args.set or []), flags)
    d, t, o, r = cfg["data"], cfg["train"], cfg["output"], cfg["runtime"]
    rt = None
    # TLS files: the flags override [runtime]; "" is off (connect checks them before connecting)
    tls = {k: getattr(args, k) or r.get(k) or None for k in ("tls_ca_file", "tls_cert", "tls_key")}
    from tilegraph.runtime.connection import _tls_files

    _tls_files("tilegraph train [runtime]", *tls.values())  # wrong files stop before the data is read
    launches = [k for k, on in (("address", r["address"]), ("scheduler_file", r["scheduler_file"]),
                                ("mpi", args.mpi or r["mpi"])) if on]
    if len(launches) > 1 or (launches and r["workers"]):
        raise TileError("tilegraph train [runtime]", "at most one of address, scheduler_file and mpi (--mpi), and "
                        "workers only for the embedded cluster (the others bring their own workers)",
                        ", ".join(f"{k} = {r[k]!r}" if k != "mpi" else "mpi = true" for k in
                                  launches + (["workers"] if r["workers"] else [])) + f" (in {source})")
    if args.mpi or r["mpi"]:
        # First of all: dask-mpi turns rank 0 into the scheduler and ranks >= 2 into workers, and
        # returns only on rank 1, which runs the rest (so only it reads data and writes files).
        rt = tg.connect(mpi=True, interface=r["interface"] or None, quiet=True, **tls)
    steps = plan_resume(args.resume, cfg, given, source) if args.resume else int(t["steps"])
    out, out_named_by = output_folder(args.out, o["dir"], given, args.resume)
    tokenizer = make_tokenizer(d["tokenizer"])
    # bad model and adapter settings fail before any work
    p, init, quantized_base = cfg["peft"], cfg["model"].get("init", ""), False
    if args.resume:  # the adapters of the checkpoint; its base when the job names none
        init = resume_settings(args.resume, p, init)
    # resumed: the base as the run's checkpoint holds it (quantized, if it ran so), else from init
    resumed = resume_model(args.resume, p["method"]) if args.resume and init else None
    if init:
        model, quantized_base = resumed if resumed is not None else init_model(init, p["method"])
        check_init_fits(model, given_model_keys(cfg, args.config, list(args.set or [])), init, tokenizer, d["seq_len"])
    else:
        model = build_model(cfg["model"], tokenizer, t["seed"], d["seq_len"])
    add_grad_sketch(add_adapters(model, p, t["seed"]), p, t["seed"])
    model.recompute = bool(cfg["model"].get("recompute", False))  # each block's activations recomputed in the backward
    files = tokenizer_files(tokenizer)
    if init or p["method"] != "none":
        files[PEFT_FILE] = json.dumps(peft_record(p, init, quantized_base), indent=1).encode()
    job.release.append(take_output(out, out_named_by))  # then the output folder: ours alone, no earlier run in it
    job.out = out  # where a Ctrl-C's message looks for the last checkpoint
    check_output(out, args.resume, steps)
    if tokenizer.eos_id is not None:  # checkpoints name the tokenizer's end-of-text id (not GPT-2's 50256)
        model.hf_extra = {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id}
    out.mkdir(parents=True, exist_ok=True)
    sources = []
    for s in d["sources"]:
        sources += stdlib_files(d["patterns"], int(d["max_mb"] * 1e6)) if s == "stdlib" else [s]
    tok_file = out / "tokens.bin"
    meta = build_token_file(sources, tok_file, tokenizer, patterns=d["patterns"])
    train = TokenDataset(tok_file, d["seq_len"], split="train", val_fraction=d["val_fraction"], seed=t["seed"])
    val = TokenDataset(tok_file, d["seq_len"], split="val", val_fraction=d["val_fraction"], seed=t["seed"])
    sched = tg.optim.warmup_cosine(t["lr"], warmup=min(int(t["warmup"]), steps), total=steps, min_lr=t["min_lr"])
    opt = tg.optim.AdamW(tg.peft.trainable_parameters(model), lr=sched, weight_decay=t["weight_decay"],
                         clip_grad_norm=t["clip_grad_norm"] or None)  # with adapters: only theirs
    if rt is None:
        rt = tg.connect(r["address"] or None, scheduler_file=r["scheduler_file"] or None,
                        n_workers=r["workers"] or None, quiet=True, **tls)
    job.release.append(partial(setattr, tg.config, "exchange", tg.config.exchange))  # the caller's, back after the job
    tg.config.exchange = r["exchange"]
    with rt:
        if quantized_base:  # the quantized tiles' parts move to the workers once, as parameters do
            rt.scatter_cells([c for _, m, _ in tg.peft._named_modules(model)
                              if isinstance(getattr(m, "weight", None), tg.peft.QuantizedTensor)
                              for c in m.weight.cells])
        print(f"tilegraph train: {type(model).__name__} ({source}), {model.num_parameters():,} parameters"
              f"{describe_start(model, p, init, quantized_base)}; {meta['count']:,} tokens from "
              f"{_plural(len(sources), 'source')}; batch {t['batch_size']} x {d['seq_len']}, {_plural(steps, 'step')}",
              flush=True)

        trainer = tg.Trainer(model, opt, train, rt, batch_size=t["batch_size"], accum_steps=t["accum_steps"],
                             steps_per_graph=t["steps_per_graph"],
                             eval_data=val, eval_every=t["eval_every"], eval_batches=t["eval_batches"],
                             log_dir=out, checkpoint_every=o["checkpoint_every"], checkpoint_dir=out / "checkpoints",
                             checkpoint_keep=o["checkpoint_keep"] or None,
                             checkpoint_files=files, progress=not args.no_progress,
                             tensorboard=o.get("tensorboard", False), parallel=r["parallel"],
                             restart_on_failure=t["restart_on_failure"], step_timeout=t["step_timeout"] or None)
        if args.resume:
            start = trainer.load_checkpoint(args.resume)
            print(f"resumed from {args.resume} at step {start}, to step {start + steps}", flush=True)
            keep_branch_point(trainer.checkpoints, args.resume, start)

        def stop(signum, frame):  # Ctrl-C / SIGTERM: finish the steps under way, checkpoint, exit
            trainer.request_stop()
            signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
            print(f"tilegraph train: {signal.Signals(signum).name}: stopping after the steps under way and writing "
                  "a checkpoint (again to stop at once)", file=sys.stderr, flush=True)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            res = trainer.fit(steps)
        except FloatingPointError as e:  # a NaN/inf loss, naming the step
            raise diverged(e, opt, out) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for line in save_final_adapters(trainer, res, p):
            print(line, flush=True)
        sample = ""
        if res.stopped:
            last = res.checkpoints[-1] if res.checkpoints else None
            print(f"stopped at step {opt.step_count}" + (f"; checkpoint: {last} (continue with "
                                                         f"{resume_command(args.config, last)})" if last else ""),
                  flush=True)
            return 130
        try:
            from tilegraph.models.generate import generate

            prompt = tokenizer.encode("def ")[None, :]
            ids = generate(model, prompt, min(48, model.config.max_seq_len - prompt.shape[1]), strategy="top_k",
                           top_k=10, temperature=0.8, seed=t["seed"], runtime=rt)
            sample = tokenizer.decode(ids[0])
        except ImportError:  # generation ships with the models package
            pass
    val_loss = res.val_losses[-1][1] if res.val_losses else float("nan")
    print(f"loss {res.losses[0]:.3f} -> {res.losses[-1]:.3f} (validation {val_loss:.3f}; uniform guess "
          f"{np.log(tokenizer.vocab_size):.3f}) in {res.seconds:.1f} s, {res.tokens_per_s:,.0f} tokens/s", flush=True)
    print(res.profile(top=5))
    plans = list(dict.fromkeys(exe.parallel_summary() for exe in trainer.step.executables))
    print(f"parallel: {'; '.join(plans)}")
    print(f"checkpoint: {res.checkpoints[-1]}\nmetrics: {out / 'metrics.jsonl'}, loss curve: {out / 'loss.png'}")
    if sample:
        print(f"sample (top-k 10, temperature 0.8): {sample!r}")
    return 0


def describe_start(model, p: dict, init: str, quantized_base: bool) -> str:
    """What the train line says about the starting weights and the adapters ('' for neither)."""
    from tilegraph import peft

    parts = [f"from {init}" + (" (its Linear weights kept quantized)" if quantized_base else "")] if init else []
    if p["method"] != "none":
        trained = sum(x.size for x in peft.trainable_parameters(model))
        parts.append(f"{p['method']} rank {p['rank']} on {', '.join(p['targets'])}: {trained:,} trained")
    if p["grad_sketch"] != "none":
        parts.append(f"{p['grad_sketch']} weight-gradient sketch {p['sketch_ratio']:g} on "
                     f"{', '.join(p['sketch_targets'])}")
    return "".join(f", {x}" for x in parts)


def save_final_adapters(trainer, res, p: dict) -> list[str]:
    """Write the adapters alone (:func:`tilegraph.peft.save_adapters`) into the run's last
    checkpoint, as ``adapters/`` (Zarr) and, for LoRA on layers that Hugging Face names, as
    ``adapters-peft/`` (peft's folder, which ``peft.PeftModel.from_pretrained`` loads onto the
    model ``tilegraph convert`` writes), when that checkpoint is of the model's current step (the
    earlier ones are written while training goes on, so the model has moved past them). Returns
    the lines to print."""
    from tilegraph import peft
    from tilegraph._errors import TileError

    if p["method"] == "none" or not res.checkpoints or trainer.checkpoints is None:
        return []
    last = Path(res.checkpoints[-1])
    if last != trainer.checkpoints.path(trainer.optimizer.step_count) or not last.is_dir():
        return []
    peft.save_adapters(last / "adapters", trainer.model)
    lines = [f"adapters: {last / 'adapters'}"]
    if p["method"] == "lora":
        try:
            peft.save_adapters(last / "adapters-peft", trainer.model, format="peft")
            lines.append(f"adapters (peft layout): {last / 'adapters-peft'}")
        except TileError as e:  # e.g. an adapter on only q of GPT-2's fused c_attn
            lines.append(f"adapters (peft layout): not written: {e}")
    return lines


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files that let `tilegraph generate CHECKPOINT` find the tokenizer (written into every
    checkpoint before its commit): its description, and a BPE tokenizer's vocabulary and merges
    as an HF tokenizers JSON."""
    files = {"tilegraph_tokenizer.json": json.dumps(tokenizer.describe()).encode()}
    if hasattr(tokenizer, "to_str"):
        files["bpe_tokenizer.json"] = tokenizer.to_str().encode("utf-8")
    return files
