"""``tilegraph train``: the training job itself and what its checkpoints carry (the tokenizer, the
adapters); the run folder and resuming are in :mod:`tilegraph.cli.runs`."""

from __future__ import annotations

import glob
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

from tilegraph._errors import TileError
from tilegraph.runtime import _plural
from tilegraph.io.data import stdlib_files  # the train corpus "stdlib"; public there
from tilegraph.cli.config import (apply_overrides, build_model, check_config, load_config, make_tokenizer,
                                  value_problems)
from tilegraph.cli.finetune import (PEFT_FILE, SKETCH_FILE, add_adapters, add_grad_sketch, apply_dropout_keys,
                                    check_init_fits, check_used_peft_keys, given_model_keys, inherited_model_keys,
                                    init_model, keep_stored_dropout, peft_record, resume_model, resume_settings,
                                    sketch_settings)
from tilegraph.cli.runs import (DATA_FILE, check_output, check_resumed_text, data_record, describe_schedule, diverged,
                                given_settings, keep_branch_point, lost_worker, on_command_line, recorded_sources_gone,
                                latest_checkpoint, keep_architecture, output_folder, plan_resume, quote, resume_command,
                                take_output)


# -------------------------------------------------------------------------------- the job ----
#: the exit status of a run that Ctrl-C stopped: a shell's 128 + SIGINT (one that SIGTERM stopped
#: exits 128 + SIGTERM, 143)
EXIT_INTERRUPTED = 128 + 2
#: the exit status of a run that SIGTERM stopped (a batch scheduler's cancel): a shell's 128 + SIGTERM
EXIT_TERMINATED = 128 + 15

@dataclass
class Job:
    """What :func:`cmd_train` releases after the job (the output lock, the job's settings) and
    names when it stops at once (the output folder, the config)."""
    release: list = field(default_factory=list)
    out: Path | None = None
    config: str | None = None
    sets: tuple = ()  # its --set pairs, which the command to resume it repeats
    training: bool = False  # set as training starts: what the job wrote from then on stays


def undo_output(job: Job, out: Path) -> Callable[[], None]:
    """What removes, when the job ends before training starts (refused for its data or batch,
    interrupted), what it made in ``out``: the folder itself when the job made it, else the
    entries the job added (a tokenized corpus of hundreds of MB, say). Nothing that was there
    before is touched; the job holds the folder's lock, so what is new is its own."""
    import shutil

    made = not os.path.lexists(out)
    before = {p.name for p in out.iterdir()} if out.is_dir() else set()  # (a file there: refused next)

    def undo() -> None:
        if job.training or not out.is_dir():
            return
        if made:
            shutil.rmtree(out, ignore_errors=True)
            return
        for p in out.iterdir():
            if p.name in before:
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    return undo


def say_now(text: str) -> None:
    """Write ``text`` to stderr from a signal handler: straight to its file descriptor, one
    write. Python runs a handler between two steps of the main thread, which may be inside a
    write to ``sys.stderr`` (a warning, the progress line): writing through ``sys.stderr`` there
    raised "reentrant call inside <_io.BufferedWriter name='<stderr>'>" in place of the stop.
    Where stderr has no descriptor (replaced in-process), through ``sys.stderr``."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        sys.stderr.write(text)
        sys.stderr.flush()
        return
    data = text.encode(getattr(sys.stderr, "encoding", None) or "utf-8", "replace")
    try:
        while data:  # (os.write retries a write a signal interrupts: PEP 475)
            data = data[os.write(fd, data):]
    except OSError:  # stderr closed: nothing to tell
        pass


def connect_cluster(r: dict, tls: dict):
    """The runtime of the cluster at [runtime] address or scheduler_file, waited for up to
    [runtime] connect_timeout seconds (for the file to appear, then for the scheduler to answer).
    An error after the whole wait names the setting that sets it."""
    import time

    import tilegraph as tg

    timeout, start = r["connect_timeout"], time.monotonic()
    try:
        return tg.connect(r["address"] or None, scheduler_file=r["scheduler_file"] or None, timeout=timeout,
                          quiet=True, **tls)
    except TileError as e:
        if time.monotonic() - start < timeout:  # failed before the wait ran out: not the wait's fault
            raise
        received = f"{e.received}; " if e.received is not None else ""
        raise TileError(e.where, e.what, f"{received}[runtime] connect_timeout = {timeout:g} sets the wait") from None


def connect_timeout_note(r: dict, given: dict[str, str], mpi: bool) -> str:
    """The warning line of a [runtime] connect_timeout the user chose where nothing waits for a
    cluster (the embedded one, an MPI launch, which waits for its ranks itself): it had no effect
    without a word. A warning, not an error: one config may serve a cluster run (address given
    with --set) and a local one. The shipped config's value, which every copy of it holds, is no
    choice of the user's: only another value, or one given on the command line. "" otherwise."""
    name = "runtime.connect_timeout"
    if r["address"] or r["scheduler_file"] or name not in given:
        return ""
    if not on_command_line(given[name]) and r["connect_timeout"] == load_config(None)[0]["runtime"]["connect_timeout"]:
        return ""
    cluster = "--mpi (an MPI launch waits for its worker ranks itself)" if mpi else \
        "the embedded cluster (no address or scheduler_file: it starts here, nothing to wait for)"
    shown = given[name] if on_command_line(given[name]) else f"in {given[name]}"
    return (f"tilegraph train: warning: [runtime] connect_timeout = {r['connect_timeout']:g} ({shown}) has no effect "
            f"with {cluster}: it is the wait for the cluster at address or scheduler_file")


def exchange_note(exchange: str, rt) -> str:
    """The warning line of a [runtime] exchange other than "auto" on a cluster of one worker
    process, where it has nothing to exchange (with workers = 1 the config is refused; the
    embedded cluster's default count, or another cluster's, is known only once it is there);
    "" otherwise, or where the workers are not known yet (a cluster's still joining)."""
    workers = len(rt.last_workers.addrs.get("cpu", ()))
    if exchange == "auto" or workers != 1:
        return ""
    return (f"tilegraph train: warning: [runtime] exchange = {exchange!r} has no effect: the cluster has one worker "
            "process (it sets how the processes of a \"data\" or \"sharded\" step exchange values)")


def cmd_train(args) -> int:
    job = Job(config=args.config, sets=tuple(args.set or ()))
    try:
        return _train(args, job)
    except KeyboardInterrupt:  # a second Ctrl-C ("again to stop at once"), or one before training
        last = latest_checkpoint(job.out) if job.out is not None else None
        print("tilegraph train: stopped at once; " + (f"last checkpoint: {last} (continue with "
                                                      f"{resume_command(job.config, last, job.sets)})" if last else
                                                      "no checkpoint written"), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    finally:
        for release in job.release:
            release()


def _train(args, job: Job) -> int:
    import signal

    import tilegraph as tg

    cfg, source = load_config(args.config)
    flags = {"train.steps": ("--steps", args.steps), "train.lr": ("--lr", args.lr),
             "train.batch_size": ("--batch-size", args.batch_size), "train.seed": ("--seed", args.seed),
             "model.init": ("--init", args.init)}
    apply_overrides(cfg, list(args.set or []))
    check_overridden(cfg, list(args.set or []), flags)
    for name, (_, value) in flags.items():
        if value is not None:
            section, key = name.split(".")
            cfg[section][key] = value
    if args.set or any(v is not None for _, v in flags.values()):
        source += " and the command line"
    check_config(cfg, source, mpi=args.mpi, flags={name: flag for name, (flag, v) in flags.items() if v is not None})
    given = given_settings(args.config, list(args.set or []), flags)
    d, t, o, r = cfg["data"], cfg["train"], cfg["output"], cfg["runtime"]
    rt = None
    # TLS files: the flags override [runtime]; "" is off (connect checks them before connecting)
    tls = {k: getattr(args, k) or r.get(k) or None for k in ("tls_ca_file", "tls_cert", "tls_key")}
    from tilegraph.runtime.connection import _tls_files

    if not (args.mpi or r["mpi"]):  # wrong files stop before the data is read (under MPI, connect checks
        _tls_files("tilegraph train [runtime]", *tls.values())  # them on every rank, which must all hear of it)
    launches = [k for k, on in (("address", r["address"]), ("scheduler_file", r["scheduler_file"]),
                                ("mpi", args.mpi or r["mpi"])) if on]
    if len(launches) > 1 or (launches and r["workers"]):
        raise TileError("tilegraph train [runtime]", "at most one of address, scheduler_file and mpi (--mpi), and "
                        "workers only for the embedded cluster (the others bring their own workers)",
                        ", ".join(f"{k} = {r[k]!r}" if k != "mpi" else "mpi = true" for k in
                                  launches + (["workers"] if r["workers"] else [])) + f" (in {source})")
    if not launches:  # the embedded cluster: in a rank of a several-rank launch, say so before any work
        from tilegraph.runtime.connection import _refuse_mpi_rank

        _refuse_mpi_rank("tilegraph train (no --mpi)")
    note = connect_timeout_note(r, given, bool(args.mpi or r["mpi"]))
    if note:
        print(note, file=sys.stderr, flush=True)
    if r["interface"] and not (args.mpi or r["mpi"]):  # (it was ignored without a word)
        raise TileError("tilegraph train [runtime]", "interface only with mpi (--mpi): the network interface the "
                        "MPI ranks listen on; the embedded cluster listens on 127.0.0.1, another cluster on what it "
                        "was started with", f"interface = {r['interface']!r} (in {source})")
    if args.mpi or r["mpi"]:
        # First of all: dask-mpi turns rank 0 into the scheduler and ranks >= 2 into workers, and
        # returns only on rank 1, which runs the rest (so only it reads data and writes files).
        rt = tg.connect(mpi=True, interface=r["interface"] or None, quiet=True, **tls)
    elif r["address"] or r["scheduler_file"]:  # a cluster of the user's: reached (or not) before any data is read
        rt = connect_cluster(r, tls)
    if rt is not None:
        job.release.append(rt.close)  # (closed by the job's end as well; this covers a failure before it)
    # the checkpoint to resume from, read once here and handed on
    resume, steps = plan_resume(args.resume, cfg, given, source) if args.resume else (None, int(t["steps"]))
    check_used_peft_keys(cfg["peft"], given)  # after --resume has brought the run's method
    out, out_named_by = output_folder(args.out, o["dir"], given, args.resume)
    # bad model and adapter settings fail before any work
    p, init, quantized_base = cfg["peft"], cfg["model"].get("init", ""), False
    if resume:  # the adapters of the checkpoint; its base when the job names none
        init = resume_settings(resume.path, resume.peft, p, init)
    if resume and "data.tokenizer" not in given:
        tokenizer = resumed_tokenizer(resume, d, given)
    else:
        tokenizer = make_tokenizer(d["tokenizer"], "tilegraph train [data] tokenizer") \
            if resume or not init or "data.tokenizer" in given else None
        if init and not resume:  # the model's own tokenizer, as its architecture comes from it
            tokenizer = init_tokenizer(init, tokenizer, d, given)
    # resumed: the base as the run's checkpoint holds it (quantized, if it ran so), else from init
    resumed = resume_model(resume.checkpoint, resume.peft, p["method"]) if resume and init else None
    if init:
        model, quantized_base = resumed if resumed is not None else \
            init_model(init, p["method"], init_source(given))
        if resume and resumed is None:  # built from the base (an old run on a quantized base): the run's dropout
            keep_stored_dropout(model, resume.checkpoint, "tilegraph train --resume")
        check_init_fits(model, given_model_keys(cfg, given), init, tokenizer, d["seq_len"],
                        inherited=inherited_model_keys(cfg, given))
        apply_dropout_keys(model, given_model_keys(cfg, given), init)
    elif resume:  # the run's own architecture, as its checkpoint stores it (the weights: restored below)
        model = resume.checkpoint.new_model(values=False, adapters=False)  # [peft]'s: added below
        keep_architecture(model, resume.path, given_model_keys(cfg, given), given, tokenizer, d["seq_len"],
                          inherited_model_keys(cfg, given))
        apply_dropout_keys(model, given_model_keys(cfg, given), "--resume")
    else:
        try:
            model = build_model(cfg["model"], tokenizer, t["seed"], d["seq_len"])
        except TileError as e:  # which file or flag set the [model] value
            raise TileError(e.where, e.what, f"{e.received} ([model] of {source})") from None
    add_grad_sketch(add_adapters(model, p, t["seed"]), p, t["seed"])
    model.recompute = bool(cfg["model"].get("recompute", False))  # each block's activations recomputed in the backward
    files = tokenizer_files(tokenizer)
    files[SKETCH_FILE] = json.dumps(sketch_settings(p)).encode()  # exact gradients too: --resume keeps them
    if init or p["method"] != "none":
        files[PEFT_FILE] = json.dumps(peft_record(p, init, quantized_base), indent=1).encode()
    undo = undo_output(job, out)  # (looked at before take_output makes the folder)
    job.release.append(take_output(out, out_named_by))  # then the output folder: ours alone, no earlier run in it
    job.release.append(undo)  # after the lock's release: a job refused before training leaves nothing behind
    job.out = out  # where a Ctrl-C's message looks for the last checkpoint
    check_output(out, resume, steps)
    if tokenizer.eos_id is not None:  # checkpoints name the tokenizer's end-of-text id (not GPT-2's 50256)
        bos = getattr(tokenizer, "bos_id", None)  # a Llama tokenizer's <s>; GPT-2's begins with its end-of-text
        model.hf_extra = {"bos_token_id": tokenizer.eos_id if bos is None else bos, "eos_token_id": tokenizer.eos_id}
    out.mkdir(parents=True, exist_ok=True)
    tok_file = out / "tokens.bin"
    if resume:  # built apart first: a resumed run reads its run's text (check_resumed_text), never replaces it
        try:
            meta, corpus = build_corpus(d, tok_file.with_name(".tokens.resumed.bin"), tokenizer,
                                        text_field_choice(d, given))
        except TileError as e:  # the sources its checkpoint records, moved or deleted: said so
            raise recorded_sources_gone(e, resume, given) from None
        take_resumed_text(tok_file, resume, meta, given)
    else:
        meta, corpus = build_corpus(d, tok_file, tokenizer, text_field_choice(d, given))
    # --resume reads the same text, config or not, and checks its token count
    files[DATA_FILE] = json.dumps(data_record(d, meta["count"])).encode()
    train, val = open_splits(tok_file, d, t, meta["count"], meta.get("sources"))
    if not resume and int(t["warmup"]) > steps:  # (a resumed run keeps its checkpoint's schedule)
        print(f"tilegraph train: [train] warmup = {t['warmup']} is more than the run's {_plural(steps, 'step')}: the "
              f"learning rate rises over all {steps} to lr = {t['lr']:g} (no decay to min_lr)", file=sys.stderr,
              flush=True)
    saved_spec = (resume.checkpoint.optimizer_info or {}).get("schedule") if resume else None
    if saved_spec:  # a resumed run's own schedule (which the restore keeps: one made here over `steps` it replaced)
        sched = tg.optim.schedule_from_spec(saved_spec)
    else:
        sched = tg.optim.warmup_cosine(t["lr"], warmup=min(int(t["warmup"]), steps), total=steps, min_lr=t["min_lr"])
    trainable = tg.peft.trainable_parameters(model)  # with adapters: only theirs
    # weight decay on the matrices (and embeddings) alone, not on biases and norm gains, as GPT-2's
    # and transformers' Trainer's recipes (it pulled every LayerNorm gain toward 0)
    groups = [{"params": [p for p in trainable if p.ndim >= 2]},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    opt = tg.optim.AdamW(groups, lr=sched, weight_decay=t["weight_decay"], clip_grad_norm=t["clip_grad_norm"] or None)
    if rt is None:  # the embedded cluster, started once the job's settings and data have passed
        rt = tg.connect(n_workers=r["workers"] or None, quiet=True, **tls)
    job.release.append(partial(setattr, tg.config, "exchange", tg.config.exchange))  # the caller's, back after the job
    tg.config.exchange = r["exchange"]
    note = exchange_note(r["exchange"], rt)
    if note:
        print(note, file=sys.stderr, flush=True)
    with rt:
        if quantized_base:  # the quantized tiles' parts move to the workers once, as parameters do
            rt.scatter_cells([c for _, m, _ in tg.peft._named_modules(model)
                              if isinstance(getattr(m, "weight", None), tg.peft.QuantizedTensor)
                              for c in m.weight.cells])
        print(f"tilegraph train: {type(model).__name__} ({source}), {count_parameters(model)}"
              f"{describe_start(model, p, init, quantized_base)}; {corpus}; batch {t['batch_size']} x {d['seq_len']}, "
              f"{_plural(steps, 'step')}", flush=True)

        trainer = tg.Trainer(model, opt, train, rt, batch_size=t["batch_size"], accum_steps=t["accum_steps"],
                             steps_per_graph=t["steps_per_graph"],
                             eval_data=val, eval_every=t["eval_every"], eval_batches=t["eval_batches"],
                             log_dir=out, checkpoint_every=o["checkpoint_every"], checkpoint_dir=out / "checkpoints",
                             checkpoint_keep=o["checkpoint_keep"] or None,
                             checkpoint_files=files, progress=not args.no_progress,
                             tensorboard=o.get("tensorboard", False), parallel=r["parallel"],
                             restart_on_failure=t["restart_on_failure"], step_timeout=t["step_timeout"] or None)
        if resume:
            start = trainer.load_checkpoint(resume.checkpoint)
            print(f"resumed from {args.resume} at step {start}, to step {start + steps}", flush=True)
            note = past_schedule_note(resume, start, start + steps)
            if note:
                print(note, flush=True)
            keep_branch_point(trainer.checkpoints, args.resume, start, trainer.lineage)

        signals = []  # the signal that stopped the run: its exit status is a shell's 128 + it
        from tilegraph.cli.signals import InterruptAgain

        again = InterruptAgain()  # the second Ctrl-C: KeyboardInterrupt, not lost in a finalizer

        def stop(signum, frame):  # Ctrl-C / SIGTERM: finish the steps under way, checkpoint, exit
            signals.append(signum)
            trainer.request_stop()
            signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else again)
            # one write, the line end included: a second Ctrl-C that comes while print() writes its
            # line end separately left "stopped at once" on the same line
            say_now(f"tilegraph train: {signal.Signals(signum).name}: stopping after the steps under way "
                    "and writing a checkpoint (again to stop at once)\n")

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            with warnings.catch_warnings(), again.catching():  # (warnings: said above, past_schedule_note)
                warnings.filterwarnings("ignore", message=r"tilegraph\.Trainer\.fit: .* go past the total of the "
                                        "learning-rate schedule", category=UserWarning)
                job.training = True
                res = trainer.fit(steps)
        except FloatingPointError as e:  # a NaN/inf loss, naming the step
            raise diverged(e, opt, out) from None
        except tg.WorkerLostError as e:  # the Trainer's advice in the command's words
            raise lost_worker(e, args.config, out, args.set or ()) from None
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for line in save_final_adapters(trainer, res, p):
            print(line, file=sys.stderr if line.startswith("tilegraph train: warning") else sys.stdout, flush=True)
        sample = ""
        if res.stopped:
            last = res.checkpoints[-1] if res.checkpoints else None
            where = (f"; checkpoint: {last} (continue with {resume_command(args.config, last, args.set or ())})"
                     if last else "")
            print(f"stopped at step {opt.step_count}{where}", flush=True)
            return 128 + int(signals[0]) if signals else EXIT_INTERRUPTED  # 130 for SIGINT, 143 for SIGTERM
        prompt = tokenizer.encode("def ")[None, :]
        room = min(48, model.config.max_seq_len - prompt.shape[1])  # a short max_seq_len leaves none
        no_sample = ""  # why there is no sample, when a worker lost while drawing it is the reason
        try:
            from tilegraph.models.generate import generate

            if room > 0:
                ids = generate(model, prompt, room, strategy="top_k", top_k=10, temperature=0.8, seed=t["seed"],
                               tokenizer=tokenizer, runtime=rt)  # (only ids the tokenizer decodes)
                sample = tokenizer.decode(ids[0])
        except ImportError:  # generation ships with the models package
            pass
        except tg.WorkerLostError as e:  # training and its checkpoints are done: not the run's failure
            no_sample = lost_sample_warning(e, res.checkpoints[-1] if res.checkpoints else latest_checkpoint(out))
    val_loss = res.val_losses[-1][1] if res.val_losses else float("nan")
    print(f"loss {res.losses[0]:.3f} -> {res.losses[-1]:.3f} (validation {val_loss:.3f}; uniform guess "
          f"{np.log(tokenizer.vocab_size):.3f}) in {res.seconds:.1f} s, {res.tokens_per_s:,.0f} tokens/s", flush=True)
    print(res.profile(top=5))
    plans = list(dict.fromkeys(exe.parallel_summary() for exe in trainer.step.executables))
    print(f"parallel: {'; '.join(plans)}")
    print(f"checkpoint: {res.checkpoints[-1]}\nmetrics: {out / 'metrics.jsonl'}, loss curve: {out / 'loss.png'}")
    if sample:
        print(f"sample (top-k 10, temperature 0.8): {sample!r}")
    elif no_sample:  # a warning, exit status 0: a batch script read the finished run as failed (exit 2)
        print(no_sample, file=sys.stderr, flush=True)
    elif room <= 0:  # it was an error after training, the run's summary unprinted
        print(f"no sample: max_seq_len {model.config.max_seq_len} leaves no room after the prompt 'def ' "
              f"({_plural(prompt.shape[1], 'token')})")
    return 0


def lost_sample_warning(error, last) -> str:
    """The warning line for a worker lost (``error``, a WorkerLostError) while the sample after
    training was drawn: the run and its last checkpoint ``last`` are complete, and ``tilegraph
    generate`` samples it (generate's own advice, to load the model again, is no step of the
    command's user)."""
    workers = list(getattr(error, "workers", None) or [])
    lost = (f"lost worker{'s' if len(workers) > 1 else ''} {', '.join(workers)}" if workers
            else "the cluster lost its tasks")
    done = (f"the run and its checkpoint {last} are complete: sample it with tilegraph generate {quote(last)}"
            if last else "the run is complete")
    return f"tilegraph train: warning: no sample: {lost} while the sample after training was drawn; {done}"


def resumed_tokenizer(resume, d: dict, given: dict[str, str]):
    """The tokenizer of a resumed run that names none: the one its checkpoint holds
    (``tilegraph_tokenizer.json``, and a BPE tokenizer's ``bpe_tokenizer.json``, as ``tilegraph
    generate`` reads it), so the file the run started with may have moved; a checkpoint written
    before it held one: the path its :data:`DATA_FILE` records, named as from there. A run that
    its :data:`DATA_FILE` records as on the byte tokenizer (no file to move) gets it as it did."""
    from tilegraph.io import tokenizer_from_description

    if d["tokenizer"] == "byte" and (resume.data or {}).get("tokenizer") == "byte":
        return make_tokenizer("byte", "tilegraph train [data] tokenizer")
    folder = Path(resume.checkpoint.path)
    recorded, bpe = folder / "tilegraph_tokenizer.json", folder / "bpe_tokenizer.json"
    if not recorded.is_file():
        where = (f"tilegraph train --resume: [data] tokenizer, as {folder / DATA_FILE} records it (--set "
                 "data.tokenizer=PATH names another)") if "tokenizer" in (resume.data or {}) else \
            "tilegraph train [data] tokenizer"
        return make_tokenizer(d["tokenizer"], where)
    try:
        desc = json.loads(recorded.read_text(encoding="utf-8"))
        return tokenizer_from_description(desc, bpe if bpe.is_file() else None)
    except (OSError, UnicodeDecodeError, ValueError) as e:  # TileError too: a missing or changed bpe_tokenizer.json
        received = e.received if isinstance(e, TileError) else str(e)
        raise TileError("tilegraph train --resume", "the tokenizer its checkpoint holds (tilegraph_tokenizer.json, "
                        "and bpe_tokenizer.json for a BPE one), or --set data.tokenizer=PATH naming the run's "
                        f"tokenizer: {e.what if isinstance(e, TileError) else 'a readable JSON description'}",
                        f"{folder}: {received}") from None


def init_tokenizer(init: str, named, d: dict, given: dict[str, str]):
    """The tokenizer of a new run from ``init`` (--init or [model] init): ``named`` when [data]
    names one (``given``), with a warning where the folder holds another; else the one the folder
    holds, as ``tilegraph generate`` reads it (a tilegraph checkpoint's own; a Hugging Face
    folder's ``tokenizer.json``, with its end-of-text token), its file then recorded as the run's
    ``d["tokenizer"]`` (a --resume reads it from the checkpoint); else the default byte tokenizer.
    The default byte ids are other tokens to a model trained on another tokenizer (a Hub GPT-2's
    or Llama's): such a run trained on them without a word, its loss falling as from a random
    start."""
    from tilegraph.cli.commands import load_tokenizer

    folder = Path(init)
    byte = make_tokenizer("byte", "tilegraph train [data] tokenizer")
    if not any((folder / name).is_file() for name in ("tilegraph_tokenizer.json", "tokenizer.json")):
        return named if named is not None else byte
    own = load_tokenizer(folder, None, f"tilegraph train: the tokenizer of [model] init {init}", eos_from_config=True)

    def identity(tok) -> dict:  # (its end-of-text token aside: documents end as the job says)
        return {k: v for k, v in tok.describe().items() if k in ("kind", "vocab_size", "sha256")}

    if named is None:
        if identity(own) == identity(byte):  # a tilegraph run's on the default: as before, without a line
            return byte
        d["tokenizer"] = str(folder / ("bpe_tokenizer.json" if (folder / "bpe_tokenizer.json").is_file()
                                       else "tokenizer.json"))
        print(f"tilegraph train: tokenizer: the one of {init} ({own!r}; [data] tokenizer names another)",
              file=sys.stderr, flush=True)
        return own
    if identity(own) != identity(named):
        shown = given["data.tokenizer"] if on_command_line(given["data.tokenizer"]) else f"in {given['data.tokenizer']}"
        print(f"tilegraph train: warning: [data] tokenizer ({named!r}, {shown}) is not the one {init} holds "
              f"({own!r}): its ids are other tokens to that model (leave [data] tokenizer out to use the model's)",
              file=sys.stderr, flush=True)
    return named


def check_overridden(cfg: dict, pairs: list[str], flags: dict[str, tuple[str, object]]) -> None:
    """Refuse a bad ``--set`` value of a key that a flag then overrides (``--set 'train.steps=[1,2]'
    --steps 2``): check_config sees only the flag's value, and the --set one went through unread."""
    named = {pair.partition("=")[0].strip(): pair.strip() for pair in pairs}  # the last of a key's wins
    over = [name for name, (_, value) in flags.items() if value is not None and name in named]
    if not over:
        return
    bad = value_problems({s: {k: cfg[s][k] for k in cfg[s] if f"{s}.{k}" in over} for s in cfg})
    if bad:
        raise TileError("tilegraph train --set", "valid values, for the keys a flag then overrides too",
                        "; ".join(f"{text} (--set {named[name]}, which {flags[name][0]} {flags[name][1]} overrides)"
                                  for name, text in bad.items()))
    # both given, as two values: one of them is a slip, and which the user meant is theirs to say
    # (the flag won without a word: --set train.steps=500 --steps 5 ran 5 steps)
    differ = [name for name in over if cfg[name.split(".")[0]][name.split(".")[1]] != flags[name][1]]
    if differ:
        raise TileError("tilegraph train --set", "one value per key: a --set and the flag that sets the same key "
                        "agree, or only one of them is given",
                        "; ".join(f"--set {named[name]} and {flags[name][0]} {flags[name][1]}" for name in differ))


def past_schedule_note(resume, start: int, end: int) -> str:
    """The line a resumed run prints when steps ``start + 1 .. end`` go past the total of its
    checkpoint's learning-rate schedule: they run at the schedule's floor (its min_lr), as the
    schedule continues exactly; "" when they do not."""
    from tilegraph.optim import steps_past_schedule

    spec = (resume.checkpoint.optimizer_info or {}).get("schedule") or {}
    past = steps_past_schedule(spec, start, end)
    if not past:
        return ""
    return (f"note: steps {past[0]}-{end} go past the {spec['total']} steps of the run's learning-rate schedule "
            f"({describe_schedule(spec)}) and run at its floor, lr {spec.get('min_lr', 0.0):g} (train.min_lr); "
            "for a new schedule over more steps, start a run from these weights: "
            f"--init {quote(resume.path)} --out NEW")


def take_resumed_text(tok_file: Path, resume, meta: dict, given: dict[str, str]) -> None:
    """Put the token file a resumed run built (``.tokens.resumed.bin`` beside ``tok_file``, its
    sidecar ``meta``) in place of ``tok_file`` once it holds the text of the run it continues
    (``resume``: its :class:`tilegraph.cli.runs.Resume`); else
    remove it and refuse (:func:`check_resumed_text`), the run's own token file untouched."""
    import os

    built = tok_file.with_name(".tokens.resumed.bin")
    sidecars = (Path(f"{built}.json"), Path(f"{tok_file}.json"))
    try:
        earlier = json.loads(sidecars[1].read_text(encoding="utf-8")) if sidecars[1].is_file() else None
    except (OSError, ValueError):  # unreadable: compared with the checkpoint's count instead
        earlier = None
    try:
        check_resumed_text(resume.path, resume.checkpoint.trainer_state or {}, resume.data, meta, earlier, given)
    except TileError:
        built.unlink(missing_ok=True)
        sidecars[0].unlink(missing_ok=True)
        raise
    os.replace(built, tok_file)
    os.replace(sidecars[0], sidecars[1])


def text_field_choice(d: dict, given: dict[str, str]) -> str | None:
    """Where the user chose [data] text_field (a :func:`given_settings` source, in words: ``--set
    data.text_field=body``, ``in c.toml``); None where the job's is not the user's choice: not
    given (the shipped config's, or the one a resumed run's record holds), or the shipped
    config's value in a config file (every copy of the shipped config holds it)."""
    where = given.get("data.text_field")
    if where is None:
        return None
    if on_command_line(where):
        return where
    return None if d["text_field"] == load_config(None)[0]["data"]["text_field"] else f"in {where}"


def build_corpus(d: dict, tok_file: Path, tokenizer, text_field_given: str | None = None) -> tuple[dict, str]:
    """Tokenize the [data] ``sources`` into ``tok_file``, at most ``max_mb`` of their text (files in
    sorted order, the one that reaches it cut there); returns the token file's sidecar and what
    the train line says of it (the files read, and those that max_mb left out). A [data]
    text_field the user chose (``text_field_given``: where, :func:`text_field_choice`) for
    sources that hold no file of records is refused before any is read (it was ignored without
    a word, as eval's --text-field was)."""
    from tilegraph.io import build_token_file

    where = "tilegraph train [data] sources"
    limit = max(1, int(d["max_mb"] * 1e6))
    files = []
    for s in d["sources"]:
        if s == "stdlib":
            files += stdlib_files(d["patterns"], limit)
        elif glob.has_magic(s) and not Path(s).expanduser().exists():  # "data/*.txt": what it matches
            matched = sorted(glob.glob(os.path.expanduser(s), recursive=True))  # ("~/data/*.txt" too)
            if not matched:
                raise TileError(where, "a glob that matches files or folders",
                                f"{s!r} matches nothing{relative_path_note(s)}")
            files += matched
        else:
            files.append(s)
    if not files:  # "stdlib" alone, and none of its files matches patterns
        raise TileError(where, "text files: none of the standard library's files matches [data] patterns",
                        f"sources = {d['sources']!r}, patterns = {d['patterns']!r}")
    # the standard library's files come whole (stdlib_files stops at the one that reaches max_mb),
    # as tilegraph eval reads them for its default corpus; other sources are cut at max_mb, so
    # that one large file is not read in full
    whole = all(s == "stdlib" for s in d["sources"])
    if text_field_given is not None:
        check_text_field_used(d, files, text_field_given)
    try:
        meta = build_token_file(files, tok_file, tokenizer, patterns=d["patterns"],
                                max_bytes=None if whole else limit, text_field=d.get("text_field", "text"))
    except TileError as e:  # a missing path, a binary or non-UTF-8 file, nothing found: named as [data]'s
        received = e.received
        # only a source not found gets the note on relative paths (it was added to any received that
        # was no existing path: "received: ['/abs/*.txt'] (looked for /cwd/['/abs/*.txt']: ...)")
        if e.what.startswith("each source must be an existing") and received:
            received += relative_path_note(received)
        what = e.what
        if what.startswith("no files found"):  # a folder of other files than [data] patterns names
            what += (f": [data] patterns = {list(d['patterns'])!r} names the files read from folders (the shipped "
                     "config's reads Python sources); for text, e.g. patterns = [\"*.txt\", \"*.md\"], for JSON Lines "
                     "patterns = [\"*.jsonl\"], for .json records patterns = [\"*.json\"]")
        token_file = binary_token_file(what, received)
        if token_file:  # (it said "contains NUL bytes (binary?)")
            what += (f": {token_file} is a token file of tilegraph (a run's tokens.bin, build_token_file), ids of its "
                     "tokenizer; [data] sources takes text: the files it was made from (a run's checkpoints name "
                     "them in tilegraph_data.json)")
        for key in ("patterns", "text_field"):  # named by the key that holds the bad value
            if what.startswith(f"{key} must"):
                where = f"tilegraph train [data] {key}"
        raise TileError(where, what, received) from None
    corpus = f"{meta['count']:,} tokens from {_plural(len(meta['sources']), 'file')}"
    left_out = meta.get("files_left_out", 0)
    if left_out or any(entry.get("cut") for entry in meta["sources"]):
        corpus += (f" (the first {d['max_mb']:g} MB of text, [data] max_mb"
                   + (f"; {_plural(left_out, 'file')} after it not read)" if left_out else ")"))
    return meta, corpus


def check_text_field_used(d: dict, files: list, given: str) -> None:
    """Refuse a [data] text_field the user set (``given``: where) for ``files`` (the sources, their
    globs and "stdlib" expanded) that hold no file of records (JSON Lines, .json), as eval refuses
    its --text-field: a text file is read whole and has no fields. Sources that cannot be listed
    are left to :func:`tilegraph.io.build_token_file`, which names what is wrong with them."""
    from tilegraph.cli.commands import RECORD_SUFFIXES, _text_field_unused
    from tilegraph.io.data import find_sources

    try:
        found = find_sources(files, d["patterns"])
    except TileError:
        return
    if not any(Path(f).suffix.lower() in RECORD_SUFFIXES for f in found):
        raise _text_field_unused(d["text_field"], found, "", "tilegraph train [data] text_field", given)


def binary_token_file(what: str, received: str | None) -> str:
    """The path of a token file (:func:`tilegraph.io.build_token_file`'s, with its sidecar) that a
    text reader refused as binary (``what`` and ``received``: its error's); "" for anything else."""
    from tilegraph.io.data import read_token_meta

    if not what.startswith("expected a UTF-8 text file") or not received:
        return ""
    path = received.rsplit(" (", 1)[0]
    try:
        read_token_meta(path)
    except (TileError, OSError, ValueError):
        return ""
    return path


def relative_path_note(path: str) -> str:
    """For a relative ``path`` of [data] sources that was not found: where it was looked for, and
    why there (a config's relative paths are the working folder's, not the config's); "" for an
    absolute one (or one under ``~``), and for one that is there (a FIFO, say: no text file)."""
    if os.path.isabs(os.path.expanduser(path)) or os.path.lexists(path):
        return ""
    return (f" (looked for {Path(path).resolve()}: a config's relative paths are taken from the folder "
            "the command runs in, not the config's)")


def open_splits(tok_file: Path, d: dict, t: dict, count: int, read: list[dict] | None = None):
    """The train and validation windows of the token file (``count`` tokens, from the files
    ``read``: the ``sources`` of its sidecar). A corpus too small for a training window, or for
    one evaluation batch of validation windows (which the job runs at the end, after training),
    is named here with the user's sources, the keys that size the windows and the largest
    seq_len that fits, before any work (it named the job's own tokens.bin, which the refused job
    then removes)."""
    from tilegraph.io import TokenDataset

    where = "tilegraph train [data]"
    micro = t["batch_size"] // t["accum_steps"]  # the windows of one evaluation batch (Trainer.evaluate)
    splits = []
    for split in ("train", "val"):
        try:
            splits.append(TokenDataset(tok_file, d["seq_len"], split=split, val_fraction=d["val_fraction"],
                                       seed=t["seed"]))
        except TileError as e:
            if not e.what.startswith(f"the {split} split must hold"):  # not the corpus's size: as it is
                raise
            other = "smaller" if split == "train" else "larger"
            val = int(count * d["val_fraction"])  # (as TokenDataset splits them)
            raise TileError(where, f"{e.what}: give more text in sources, a smaller seq_len or a {other} "
                            "val_fraction", f"{count - val if split == 'train' else val:,} tokens in the {split} "
                            f"split of the {count:,} tokens from {describe_read(d, read)} (val_fraction = "
                            f"{d['val_fraction']:g}); {what_fits(count, d['val_fraction'], micro)}") from None
    train, val = splits
    if val.num_eval_windows < micro:
        raise TileError(where, f"a validation split (val_fraction = {d['val_fraction']:g} of the {count:,} tokens) "
                        f"holding one evaluation batch: train.batch_size / train.accum_steps = {micro} windows of "
                        f"seq_len + 1 = {d['seq_len'] + 1} tokens; give more text in sources, a larger "
                        "val_fraction, a smaller seq_len, or a smaller batch_size (or a larger accum_steps)",
                        f"{val.hi - val.lo:,} tokens, {_plural(val.num_eval_windows, 'window')}")
    return train, val


def what_fits(count: int, val_fraction: float, micro: int) -> str:
    """The largest [data] seq_len whose windows ``count`` tokens hold as the job needs them (as
    :class:`tilegraph.io.TokenDataset` splits them: one window of seq_len + 1 tokens in the train
    split, and ``micro``, one evaluation batch, of seq_len in the validation split), in words; or
    why none does."""
    val = int(count * val_fraction)
    fits = min(count - val - 1, (val - 1) // micro if val >= 1 else 0)
    if fits >= 1:
        return f"seq_len = {fits} at most fits them"
    if val - 1 < micro:
        return (f"no seq_len fits them: the validation split holds {_plural(val, 'token')}, too few for an evaluation "
                f"batch of {micro} windows (train.batch_size / train.accum_steps): give more text, or a larger "
                "val_fraction")
    return "no seq_len fits them: give more text"


def describe_read(d: dict, read: list[dict] | None) -> str:
    """The files a token file was read from (``read``: its sidecar's ``sources``), in words: a
    file's path, as short as it is from here; else their count and [data] sources."""
    if read and len(read) == 1:
        path = str(read[0].get("path", ""))
        try:
            rel = os.path.relpath(path)
        except ValueError:  # another drive
            rel = path
        return rel if not rel.startswith("..") else path
    n = f"{_plural(len(read), 'file')} of " if read else ""
    return f"{n}[data] sources = {list(d['sources'])!r}"


def count_parameters(model) -> str:
    """The model's parameter count, in words: its quantized Linear weights (a quantized base) are
    no Parameters, so ``num_parameters`` leaves them out, and are counted here, named as such."""
    from tilegraph import peft

    quantized = sum(q.size for _, q in peft.named_quantized(model))
    total = f"{model.num_parameters() + quantized:,} parameters"
    return f"{total} ({quantized:,} of them quantized)" if quantized else total


def init_source(given: dict[str, str]) -> str:
    """What gave the run's init, as its notes name it (a :func:`given_settings` source): the flag
    (``--init``, ``--set model.init``) or the config file's ``[model] init``; where the job gave
    none, the run that --resume continues, whose checkpoint records its base."""
    where = given.get("model.init")
    if where is None:
        return "--resume (the base its run recorded)"
    if on_command_line(where):
        return "--init" if where.startswith("--init ") else "--set model.init"
    return f"[model] init (in {where})"


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
    from tilegraph.models._common import dropout_fields

    drops = [f"{name} {getattr(model.config, name):g}" for name in dropout_fields(model.config)
             if getattr(model.config, name)]
    if drops:  # (a Hugging Face init brings its folder's: GPT-2's 0.1, which [model] keys may change)
        parts.append("dropout " + ", ".join(drops))
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
        partial_note = partly_fused(trainer.model, p["targets"])
        if partial_note:  # expected (the default targets on GPT-2): no peft form, said as such
            lines.append(f"adapters (peft layout): none, {partial_note}")
            return lines
        try:
            peft.save_adapters(last / "adapters-peft", trainer.model, format="peft")
            lines.append(f"adapters (peft layout): {last / 'adapters-peft'}")
        except TileError as e:  # a real failure: said as one, on stderr
            lines.append(f"tilegraph train: warning: adapters (peft layout) not written: {e}")
    return lines


def partly_fused(model, targets: list[str]) -> str:
    """What the run says where its LoRA layers cover only some of the tilegraph layers of a fused
    Hugging Face module (the default targets attn.q and attn.v of GPT-2, whose c_attn holds q, k
    and v), which a peft adapter cannot (it covers the whole module): which, and the targets that
    give one; "" where every fused module is covered whole or not at all (or the model has no
    Hugging Face form: save_adapters then says so)."""
    import shlex

    from tilegraph import peft
    from tilegraph.peft_hf import _targets

    lora = peft.lora_layers(model)
    try:
        fused = _targets(model, "tilegraph train")
    except TileError:
        return ""
    partial = [t for t in fused.values() if len(t.parts) > 1 and 0 < sum(x in lora for x in t.parts) < len(t.parts)]
    if not partial:
        return ""

    def short(name: str) -> str:  # "blocks.0.attn.k" -> "attn.k", as targets name it
        return ".".join(name.split(".")[-2:])

    modules = {t.hf.rsplit(".", 1)[-1]: [short(x) for x in t.parts] for t in partial}
    missing = list(dict.fromkeys(short(x) for t in partial for x in t.parts if x not in lora))
    wanted = json.dumps(list(dict.fromkeys([*targets, *missing])))
    arch = getattr(model, "arch", None) or type(model).__name__
    held = "; ".join(f"{name} holds {', '.join(parts)}" for name, parts in modules.items())
    return (f"as peft's adapter covers a whole fused module and the targets {', '.join(targets)} adapt only part "
            f"of {arch}'s ({held}): for a peft layout, adapt all of them: "
            f"--set {shlex.quote('peft.targets=' + wanted)}")


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files that let `tilegraph generate CHECKPOINT` find the tokenizer (written into every
    checkpoint before its commit): its description, a BPE tokenizer's vocabulary and merges as an
    HF tokenizers JSON, and the ``tokenizer.json`` + ``tokenizer_config.json`` that
    ``transformers.AutoTokenizer.from_pretrained(CHECKPOINT)`` loads, to the same ids
    (:func:`tilegraph.io.tokenizers.hf_tokenizer_files`; ``tilegraph convert`` copies them)."""
    from tilegraph.io import ByteTokenizer, BPETokenizer
    from tilegraph.io.tokenizers import hf_tokenizer_files

    files = {"tilegraph_tokenizer.json": json.dumps(tokenizer.describe()).encode()}
    if hasattr(tokenizer, "to_str"):
        files["bpe_tokenizer.json"] = tokenizer.to_str().encode("utf-8")
    if isinstance(tokenizer, (ByteTokenizer, BPETokenizer)):  # (another kind has no HF form here)
        files.update(hf_tokenizer_files(tokenizer))
    return files
