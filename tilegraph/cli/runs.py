"""The run folder of ``tilegraph train``: one run per output folder (a lock, and no earlier
run's files overwritten), and what a resumed run takes from its checkpoint (its run folder, step
budget, learning-rate schedule and adapters), keeps (the checkpoint it branches from) and says
when it stops."""

from __future__ import annotations

import json
import math
import operator
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tilegraph._errors import TileError
from tilegraph._lock import LOCK_NAME, Holder, hold_folder
from tilegraph.cli.config import check_config
from tilegraph.cli.finetune import (SKETCH_FILE, SKETCH_KEYS, _describe, adapter_settings, adapters_hint,
                                    adapters_only, read_peft_record, read_sketch_record, sketch_settings,
                                    weights_without_config)


# ---------------------------------------------------------------------------- the folder ----
def lock_output(out: Path):
    """Take ``out`` for this process (a lock file naming it: :func:`tilegraph._lock.hold_folder`,
    which a Trainer's fit takes too); returns the release function. A folder locked by a live
    process is refused, naming it; a lock whose process is gone is taken over. The job's own
    Trainer holds it inside the job's hold (the lock is the process's)."""
    def refuse(holder: Holder) -> TileError:
        return TileError("tilegraph train", f"an output folder no other run is using; {out} is in use by "
                         f"{holder.by} (pid {holder.pid} on {holder.host}): wait for it, or pass another --out",
                         str(holder.lock))

    return hold_folder(out, "tilegraph train", refuse, where="tilegraph train", name="the output folder")


def take_output(out: Path, where: str):
    """:func:`lock_output` ``out``, a path that cannot be a folder (a file in the way, a file
    system that is missing or read-only) refused in one error naming it, as ``tilegraph convert``
    names its destination (``where``: what named the folder). Returns the release function."""
    from tilegraph.io._store import file_in_the_way, write_failure

    in_the_way = file_in_the_way(out)
    if in_the_way is not None:
        raise TileError(where, "an output folder, or a path where one can be made (nothing was written)",
                        f"{out} is not a folder" if in_the_way == out else f"{out}: {in_the_way} is not a folder")
    try:
        return lock_output(out)
    except OSError as e:
        raise write_failure(where, e, out, "the output folder", "nothing was written") from None


def check_output(out: Path, resume: Resume | None, steps: int) -> int | None:
    """Refuse, before any work, a run whose output would mix with or overwrite an earlier run's;
    returns the step of the ``resume`` checkpoint (None without one)."""
    from tilegraph.io.zarr import checkpoint_step, complete_checkpoints

    ckdir = out / "checkpoints"
    at = {p.name: checkpoint_step(p.name) for p in ckdir.iterdir() if p.name.startswith("step-")} \
        if ckdir.is_dir() else {}
    # by step, not by name: past step 999999 the names grow a digit ("step-1000000" < "step-999999")
    found = sorted(at, key=lambda n: (at[n] is None, at[n] or 0, n))
    if resume is None:
        if found:
            what = ", ".join(x for x in ["metrics.jsonl" if (out / "metrics.jsonl").exists() else "",
                                         f"checkpoints {found[0]}..{found[-1]}"] if x)
            # the newest complete one: a save that did not finish (step-N.tmp-...) sorts last, and
            # was named as the one to resume, which --resume then refused as no checkpoint
            complete = complete_checkpoints(ckdir)
            which = f"--resume {quote(complete[-1])} continues it" if complete else \
                "none of them is a complete checkpoint to continue from"
            raise TileError("tilegraph train", f"an output folder without an earlier run; {out} holds one ({what}): "
                            f"pass --resume CHECKPOINT to continue it ({which}), "
                            "or another --out", str(out))
        if (out / "metrics.jsonl").exists():  # a run that stopped (an error, a kill) before its first checkpoint
            raise TileError("tilegraph train", f"an output folder without an earlier run; {out} holds the "
                            "metrics.jsonl of one that wrote no checkpoint, so nothing there can be resumed: pass "
                            f"another --out, or delete {quote(out)} (or its metrics.jsonl) to start over in it",
                            str(out))
        return None
    step = resume.checkpoint.step
    if in_folder(resume.path, ckdir) or set_aside_in(resume.path, ckdir):
        return step  # the run's own checkpoints of other branches: set aside when it starts (keep_branch_point)
    others = other_runs(out, [ckdir / n for n in found], (resume.checkpoint.trainer_state or {}).get("run_id"))
    if others:  # its metrics.jsonl would mix two runs, and its checkpoints be pruned as this run's older ones
        raise TileError("tilegraph train --resume", f"an output folder without another run's files; {out} holds "
                        f"{others} of a run other than the one {resume.path} continues: pass another --out (or none: "
                        "the checkpoint's own run folder)", str(out))
    clash = [n for n in found if at[n] is not None and step < at[n] <= step + steps]
    if clash:
        raise TileError("tilegraph train", f"checkpoint names free for steps {step + 1}..{step + steps}; {ckdir} "
                        f"already holds {', '.join(clash)} (from a run that went past step {step}): pass another --out",
                        f"--resume {quote(resume.path)} --steps {steps}")
    return step


def other_runs(out: Path, checkpoints: list[Path], run: str | None) -> str:
    """What of ``out`` belongs to a run other than ``run`` (a checkpoint's ``run_id``, which a
    resumed run keeps; None: not recorded, so any run's files), in words: its metrics.jsonl's
    records and its checkpoints; "" for none."""
    from tilegraph.io.zarr import load_checkpoint

    def other(found) -> bool:
        return run is None or found != run

    found = []
    try:
        with open(out / "metrics.jsonl", encoding="utf-8") as f:
            if any(other(_record_run(line)) for line in f if line.strip()):
                found.append("metrics.jsonl records")
    except (OSError, UnicodeDecodeError):
        pass
    theirs = []
    for p in checkpoints:
        try:
            state = load_checkpoint(p).trainer_state or {}
        except (OSError, TileError):  # incomplete or not one: another run's all the same
            state = {}
        if other(state.get("run_id")):
            theirs.append(p.name)
    if theirs:
        found.append(f"checkpoints {', '.join(theirs)}")
    return " and ".join(found)


def _record_run(line: str) -> str | None:
    """The run id of a metrics.jsonl line (None where it names none)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record.get("run") if isinstance(record, dict) else None


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
    where the command line gave it (--set); else, resuming, the run folder of the checkpoint (so
    the run's metrics.jsonl and loss.png go on; a config file's other ``[output] dir``, such as
    that of the config the run started from with --out, is named in a warning and not used);
    else ``[output] dir``."""
    named = given.get("output.dir")
    if out is None and not (named and on_command_line(named)) and resume \
            and (run := run_folder(resume)) is not None:
        if named is not None and Path(configured).resolve() != run.resolve():
            refuse_or_warn([(named, f"dir = {configured!r}")], "",
                           f"the resumed run goes on in its checkpoint's run folder, {run} (--out: another)")
        return run, f"tilegraph train --resume (its run folder, {run})"
    text, where = (out, "--out") if out is not None else (configured, "tilegraph train [output] dir")
    if not text.strip():
        raise TileError(where, "an output folder (a path; nothing was written)", repr(text))
    inside = inside_checkpoints(Path(text))
    if inside:
        raise TileError(where, "an output folder outside every checkpoint and every run's checkpoints folder (a run "
                        "writes its own checkpoints/ in it; nothing was written): pass another", f"{text}: {inside}")
    if resume and out is None and not (named and on_command_line(named)):  # a checkpoint outside a run folder
        print(f"tilegraph train: writing to {text} ([output] dir): {resume} is not in a run's checkpoints folder "
              "(RUN/checkpoints/step-N), whose run would go on; --out names another", file=sys.stderr, flush=True)
    return Path(text), where


def inside_checkpoints(out: Path) -> str:
    """Where ``out`` is, or lies inside, a checkpoint (a folder with a Zarr checkpoint's
    ``zarr.json``) or a run's checkpoints folder (``RUN/checkpoints``: a checkpoint in it or a run
    beside it), in words; "" where it is neither."""
    path = Path(os.path.abspath(os.path.expanduser(out)))
    for p in (path, *path.parents):
        if (p / "zarr.json").is_file():
            return "it is a checkpoint" if p == path else f"inside the checkpoint {p}"
        if p.name == "checkpoints" and p.is_dir() and (latest_checkpoint(p.parent) is not None or any(
                (p.parent / name).exists() for name in ("metrics.jsonl", LOCK_NAME))):
            return (f"the checkpoints folder of the run {p.parent}" if p == path else
                    f"inside {p}, the checkpoints folder of the run {p.parent}")
    return ""


# -------------------------------------------------------------------------------- resuming ----
#: [train] keys of the learning-rate schedule -> the keys of its spec, which checkpoints hold and
#: a resumed run keeps (tilegraph.optim.warmup_cosine)
SCHEDULE_KEYS = {"lr": "base_lr", "warmup": "warmup", "min_lr": "min_lr"}


@dataclass
class Resume:
    """The checkpoint a ``--resume`` job continues from, read once (its attributes and records)
    and handed to every step of the job that needs them."""
    path: str  # as given (the messages name it so)
    checkpoint: object  # the opened tilegraph.io.zarr.Checkpoint (its attributes read)
    peft: dict | None  # its PEFT_FILE: the adapters and the base (None: none)
    sketch: dict | None  # its SKETCH_FILE: the weight-gradient sketch (None: written before it was recorded)
    data: dict | None = None  # its DATA_FILE: the run's [data] and token count (None: written before either)
    data_problem: str | None = None  # what is wrong with its DATA_FILE, where it cannot be read (data then None)


def open_resume(resume: str) -> Resume:
    """The checkpoint of ``--resume``, its attributes and records read (a path that is not a
    complete checkpoint is named)."""
    from tilegraph.io.zarr import load_checkpoint

    where = "tilegraph train --resume"
    folder = Path(resume)
    if (folder / "trainer_state.json").is_file() and not (folder / "zarr.json").is_file():
        raise TileError(where, "a Zarr checkpoint: tilegraph train resumes those; a checkpoint of the earlier "
                        f"format resumes in Python (tilegraph.Trainer.load_checkpoint), or `tilegraph convert "
                        f"{quote(resume)} NEW` writes its weights as one to start a new run from (--init NEW)",
                        f"{resume}: a Hugging Face folder with trainer_state.json (the earlier format)")
    check_checkpoint_folder(folder, where, "--init starts a new run from its weights (with another --out)")
    ck = None if (folder / "adapter_config.json").is_file() else load_checkpoint(resume)  # its metadata read once
    adapters = adapters_only(folder, ck.info if ck is not None else None)
    if adapters:  # else named as a model of an unknown class '_Adapters', or as no checkpoint at all
        raise TileError(where, "a checkpoint of tilegraph train (its model, optimizer state and step); an adapters "
                        "folder holds the adapters alone: " + adapters_hint(folder), f"{resume}, {adapters}")
    if ck is None:  # a peft folder with a model beside it (config.json): named as no checkpoint
        ck = load_checkpoint(resume)
    data, data_problem = read_data_file(ck.path)
    return Resume(resume, ck, read_peft_record(ck.path, where), read_sketch_record(ck.path, where), data, data_problem)


def plan_resume(resume: str, cfg: dict, given: dict[str, str], source: str) -> tuple[Resume, int]:
    """Check a ``--resume`` job against its checkpoint and complete it from there (the [peft]
    adapters the job leaves out, the gradient sketch); returns the checkpoint, read once
    (:func:`open_resume`), and the steps to run (:func:`steps_to_run`)."""
    init_from = given.get("model.init", "")
    if on_command_line(init_from) and cfg["model"].get("init"):
        raise TileError("tilegraph train", "--init or --resume, not both: --init starts a new run from a "
                        "checkpoint's weights, --resume continues the run that wrote it (with the weights it "
                        "started from)", f"{init_from} --resume {quote(resume)}")
    opened = open_resume(resume)
    check_recorded_values(opened)  # before any of them is taken
    ck, record = opened.checkpoint, opened.peft
    if record is not None:  # its adapters, unless the job gives them (resume_settings checks they agree)
        cfg["peft"].update({k: v for k, v in adapter_settings(record).items() if f"peft.{k}" not in given})
        if "dropout" in record and "peft.dropout" not in given:  # recorded since LoRA runs resume without [peft]
            cfg["peft"]["dropout"] = record["dropout"]
        check_config(cfg, source)
    keep_sketch(opened, cfg["peft"], given)
    spec = (ck.optimizer_info or {}).get("schedule") or {}
    check_schedule(resume, spec, cfg["train"], given)
    keep_data_order(resume, ck.trainer_state or {}, cfg["train"], given)
    keep_update_settings(resume, (ck.optimizer_info or {}).get("hyper") or {}, cfg["train"], given)
    keep_eval_settings(ck.trainer_state or {}, ck.step, cfg["train"], given)
    check_data_record(opened, given)
    keep_data(opened.data, cfg["data"], given)
    keep_window(resume, ck.trainer_state or {}, opened.data, cfg["data"], given)
    # the settings as the checkpoint completed them: its batch_size and accum_steps against [runtime]
    # workers and parallel (checked with the config's alone, they failed inside the first step)
    check_config(cfg, f"{source}, with the batch settings of --resume {quote(resume)}")
    return opened, steps_to_run(resume, ck.step, spec, cfg["train"], given)


#: the values a resumed run takes from its checkpoint's zarr.json (the tilegraph attributes: the
#: Trainer's state, the optimizer's settings and learning-rate schedule), by their path there ->
#: the [train] key they stand for, whose check (:data:`tilegraph.cli.config.CONFIG_CHECKS`) they pass
RECORDED_TRAIN_KEYS = {
    ("trainer", "batch_size"): "train.batch_size", ("trainer", "accum_steps"): "train.accum_steps",
    ("trainer", "rng", "data_seed"): "train.seed", ("trainer", "eval_every"): "train.eval_every",
    ("trainer", "eval_batches"): "train.eval_batches",
    ("optimizer", "hyper", "weight_decay"): "train.weight_decay",
    ("optimizer", "hyper", "clip_grad_norm"): "train.clip_grad_norm",
    ("optimizer", "schedule", "base_lr"): "train.lr", ("optimizer", "schedule", "warmup"): "train.warmup",
    ("optimizer", "schedule", "total"): "train.steps", ("optimizer", "schedule", "min_lr"): "train.min_lr"}


def recorded_value_problems(resume: Resume) -> list[str]:
    """The values of ``resume``'s records that a resumed run takes and that no run writes (edited
    by hand, damaged), each as ``"FILE: key = value (not what it must be)"``: its :data:`DATA_FILE`
    (checked as tilegraph eval and info check it,
    :func:`tilegraph.cli.commands.checked_data_record`), the Trainer's and the optimizer's values
    in its zarr.json (:data:`RECORDED_TRAIN_KEYS`, checked as the [train] keys they stand for) and
    the adapters' settings in its PEFT_FILE (as the [peft] keys). A key a record lacks is no
    problem (a checkpoint written before it was recorded)."""
    from tilegraph.cli.commands import checked_data_record
    from tilegraph.cli.config import CONFIG_CHECKS
    from tilegraph.cli.finetune import PEFT_FILE

    folder = Path(resume.checkpoint.path)
    problems = []
    if resume.data is not None:
        _, bad = checked_data_record(resume.data)
        problems += [f"{folder / DATA_FILE}: {text}" for text in bad.values()]
    attributes = {"trainer": resume.checkpoint.trainer_state, "optimizer": resume.checkpoint.optimizer_info}
    for path, name in RECORDED_TRAIN_KEYS.items():
        value = attributes
        for i, part in enumerate(path):
            if value is not None and not isinstance(value, dict):  # no JSON object: named once
                problem = f"{folder / 'zarr.json'}: {'.'.join(path[:i])} = {value!r:.60} (not a JSON object)"
                problems += [problem] * (problem not in problems)
                value = None
            if value is None:
                break
            value = value.get(part)
        if value is None:  # not recorded (a run writes null where it knows none; clip_grad_norm: no clipping)
            continue
        ok, want = CONFIG_CHECKS[name]
        if not ok(value):
            section, key = name.split(".")
            problems.append(f"{folder / 'zarr.json'}: {'.'.join(path)} = {value!r:.60} (not {want}, as [{section}] "
                            f"{key})")
    if resume.peft is not None:
        settings = {**adapter_settings(resume.peft), **({"dropout": resume.peft["dropout"]}
                                                        if "dropout" in resume.peft else {})}
        for key, value in settings.items():
            ok, want = CONFIG_CHECKS[f"peft.{key}"]
            if not ok(value):
                problems.append(f"{folder / PEFT_FILE}: {key} = {value!r:.60} (not {want}, as [peft] {key})")
    return problems


def check_recorded_values(resume: Resume) -> None:
    """Refuse, before any of them is taken and before anything is read or written, a resumed
    run whose checkpoint records values no run writes (:func:`recorded_value_problems`): they
    were passed over without a word (a seq_len of -3, a weight_decay "x": the run went on with
    other values), failed inside the first step (a batch_size "2") or on the schedule (a total
    "x"), or were refused as the job's settings ("in default.toml and the command line"), not
    the file's."""
    problems = recorded_value_problems(resume)
    if problems:
        raise TileError("tilegraph train --resume", "a checkpoint whose records hold values as tilegraph train writes "
                        f"them: a resumed run takes the run's settings from them ({DATA_FILE}: its [data] and token "
                        "count; zarr.json: its batches, evaluations, optimizer and learning-rate schedule; the "
                        "adapters' record: its [peft]); put the run's files back (the same file of another of its "
                        f"checkpoints), or start a new run from its weights (--init {quote(resume.path)} and "
                        "another --out)", "; ".join(problems))


def keep_architecture(model, resume: Path, keys: dict, given: dict[str, str], tokenizer, seq_len: int,
                      inherited: dict | None = None) -> None:
    """A resumed run keeps the architecture its checkpoint stores (``model``, built from it): [model]
    ``keys`` given on the command line must agree with it (an error naming each that does not); a
    config file's that do not (the run's own config, say, where --set changed the model) are named
    in a warning and not used (:func:`refuse_or_warn`). ``inherited``: the shape keys the job's
    config holds without the user's giving them (the shipped dim under a config naming the shipped
    flavor: :func:`tilegraph.cli.finetune.inherited_model_keys`), which the run the config started
    has too."""
    from tilegraph.cli.finetune import architecture_disagreements, check_init_fits

    # the keys together (a flavor on the command line, dim in the config file: the flavor with
    # that dim), each disagreement then refused or named by where its key was given
    problems = architecture_disagreements(model, keys, str(resume), inherited)
    flagged = [text for k, text in problems if on_command_line(given[f"model.{k}"])]
    if flagged:
        raise TileError("tilegraph train [model]", f"[model] keys that agree with --resume's "
                        f"{type(model.config).__name__} (or none: --resume brings the architecture)", "; ".join(flagged))
    check_init_fits(model, {}, str(resume), tokenizer, seq_len, "--resume")  # the tokenizer and the windows
    other = [(given[f"model.{k}"], text) for k, text in problems if not on_command_line(given[f"model.{k}"])]
    refuse_or_warn(other, "", f"the resumed run keeps its checkpoint's {type(model.config).__name__}")


def keep_sketch(resume: Resume, p: dict, given: dict[str, str]) -> None:
    """A resumed run computes its weight gradients as the run it continues did: the sketch its
    checkpoint records (exact ones too) replaces [peft]'s; other values given are refused or named
    (:func:`refuse_or_warn`). A checkpoint written before tilegraph recorded it leaves [peft] as
    the job gives it."""
    stored = resume.sketch
    if stored is None:
        return
    other = []
    if sketch_settings(p) != stored:  # keys that make no difference (a ratio without a sketch) are not named
        other = [(given[f"peft.{k}"], f"{k} = {p[k]!r}") for k in SKETCH_KEYS
                 if f"peft.{k}" in given and p[k] != stored.get(k)]
    kept = _describe(stored)
    refuse_or_warn(other, f"the weight gradients of the run it continues ({kept}, from its checkpoint's "
                   f"{SKETCH_FILE}): leave them out, or start a new run from the checkpoint's weights "
                   f"(--init {quote(resume.path)} and another --out)",
                   f"the resumed run computes its weight gradients as its checkpoint's run did ({kept})")
    p.update(stored)


def keep_data_order(resume: str, state: dict, t: dict, given: dict[str, str]) -> None:
    """A resumed run draws the batches the run would have drawn: the seed, batch size and
    accumulation of its checkpoint's ``trainer_state`` replace [train]'s; other values given are
    refused or named (:func:`refuse_or_warn`)."""
    stored = {"seed": (state.get("rng") or {}).get("data_seed"), "batch_size": state.get("batch_size"),
              "accum_steps": state.get("accum_steps")}
    other = take_stored({k: v for k, v in stored.items() if isinstance(v, int) and not isinstance(v, bool)}, t, given)
    kept = ", ".join(f"{k} {v}" for k, v in stored.items() if v is not None)
    refuse_or_warn(other, f"the batches of the run it continues ({kept}, from its checkpoint): leave them out, or "
                   f"start a new run from the checkpoint's weights (--init {quote(resume)} and another --out)",
                   f"the resumed run draws its checkpoint's batches ({kept})")


def take_stored(stored: dict, t: dict, given: dict[str, str], same=operator.eq) -> list[tuple[str, str]]:
    """Put the values ``stored`` (a checkpoint's, of [train] keys) into [train] ``t`` where they
    differ (not ``same``); returns where the job gave the other values, ``(where, "key = value")``
    for :func:`refuse_or_warn`."""
    other = []
    for key, value in stored.items():
        if same(t[key], value):
            continue
        where = given.get(f"train.{key}")
        if where is not None:
            other.append((where, f"{key} = {t[key]!r}"))
        t[key] = value
    return other


def _batches(n: int) -> str:
    return f"{n} batch" + ("es" if n != 1 else "")


def keep_update_settings(resume: str, hyper: dict, t: dict, given: dict[str, str]) -> None:
    """A resumed run updates the weights as the run it continues did: the weight decay and
    gradient clipping its checkpoint's optimizer records replace [train]'s (a resume without the
    run's config took the shipped config's weight_decay 0.1 and clip_grad_norm 1.0, and its losses
    left the uninterrupted run's); other values given are refused or named (:func:`refuse_or_warn`)."""
    stored = {}
    if isinstance(hyper.get("weight_decay"), (int, float)):
        stored["weight_decay"] = hyper["weight_decay"]
    clip = hyper.get("clip_grad_norm", False)  # (missing in a checkpoint that does not record it)
    if clip is None or (isinstance(clip, (int, float)) and not isinstance(clip, bool)):
        stored["clip_grad_norm"] = clip or 0  # [train]'s 0: no clipping
    other = take_stored(stored, t, given, same=lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0))
    kept = ", ".join(f"{k} {v:g}" for k, v in stored.items())
    refuse_or_warn(other, f"the weight decay and gradient clipping of the run it continues ({kept}, from its "
                   f"checkpoint): leave them out, or start a new run from the checkpoint's weights (--init "
                   f"{quote(resume)} and another --out)",
                   f"the resumed run updates the weights as its checkpoint's run did ({kept})")


def keep_eval_settings(state: dict, step: int, t: dict, given: dict[str, str]) -> None:
    """A resumed run evaluates as the run it continues did: the eval_every and eval_batches its
    checkpoint's ``trainer_state`` records replace [train]'s where the job does not give them (a
    resume without the run's config took the shipped config's eval_batches, and its validation
    losses covered another number of batches: the curve jumped at the step it resumed from). A
    config file's other value is named in a warning and not used, as the neighbouring settings'
    are (it may be the config the run started from, with --set over it). One given on the
    command line is used, where theirs are refused: these settings change no weight and no
    batch, only when and over how much the run measures its validation loss, so another one is
    a choice the user may make (fewer batches for a quick look, evaluations more often);
    another eval_batches gets a warning line, as its losses no longer compare with the run's
    earlier ones. A checkpoint written before they were recorded: the job's, as before."""
    stored = {k: state[k] for k, low in (("eval_every", 0), ("eval_batches", 1))
              if isinstance(state.get(k), int) and not isinstance(state[k], bool) and state[k] >= low}
    kept = ", ".join(f"{k} {v}" for k, v in stored.items())
    for key, value in list(stored.items()):
        where = given.get(f"train.{key}")
        if t[key] != value and where is not None and on_command_line(where):  # used: not taken from it
            del stored[key]
            if key == "eval_batches":
                print(f"tilegraph train: warning: {where}: the validation losses after step {step} cover "
                      f"{_batches(t[key])}, the run's up to it {_batches(value)} (its checkpoint's eval_batches): "
                      f"the validation curve may jump at step {step}", file=sys.stderr, flush=True)
    other = take_stored(stored, t, given)
    refuse_or_warn(other, "", f"the resumed run evaluates as its checkpoint's run did ({kept}; --set "
                   "train.KEY=VALUE on the command line sets another)")


#: in every checkpoint of tilegraph train: the run's [data] settings (paths made absolute), which
#: --resume takes where the job gives none, so a run on one's own text resumes without its config
DATA_FILE = "tilegraph_data.json"
DATA_KEYS = ("sources", "patterns", "max_mb", "tokenizer", "seq_len", "val_fraction", "text_field")


def data_record(d: dict, tokens: int | None = None) -> dict:
    """What :data:`DATA_FILE` holds: the [data] settings, their paths absolute (a resume may run
    in another folder); "stdlib" and "byte" as they are; and ``tokens``, the count of the token
    file the run read (a resume checks that it reads as many)."""
    def where(path: str) -> str:
        return path if path in ("stdlib", "byte") else os.path.abspath(os.path.expanduser(path))

    record = {k: d[k] for k in DATA_KEYS}
    record["sources"] = [where(str(x)) for x in d["sources"]]
    record["tokenizer"] = where(str(d["tokenizer"]))
    if tokens is not None:
        record["tokens"] = int(tokens)
    return record


def read_data_file(folder: Path) -> tuple[dict | None, str | None]:
    """The record :data:`DATA_FILE` of a checkpoint, read once, and what is wrong with it where it
    cannot be read (damaged, edited by hand: in words with its path): ``(record, None)``;
    ``(None, problem)``; ``(None, None)`` for a checkpoint without one."""
    f = Path(folder) / DATA_FILE
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return None, f"{f}: " + (f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e))
    if not isinstance(record, dict):
        return None, f"{f}: {type(record).__name__}, not a JSON object"
    return record, None


def read_data_record(folder: Path) -> dict | None:
    """The record :data:`DATA_FILE` of a checkpoint (None when it has none, or not a readable
    JSON object: :func:`data_record_problem` says what is wrong)."""
    return read_data_file(folder)[0]


def data_record_problem(folder: Path) -> str | None:
    """What is wrong with the :data:`DATA_FILE` of a checkpoint that has one which
    :func:`read_data_record` cannot read (damaged, edited by hand), in words with its path; None
    for a readable one or none at all."""
    return read_data_file(folder)[1]


def recorded_sources_gone(error: TileError, resume: Resume, given: dict[str, str]) -> TileError:
    """The error ``error`` of reading the text of a resumed run, where its [data] sources are the
    ones its checkpoint's :data:`DATA_FILE` records (the job gives none) and one of them is gone
    (moved, deleted): it named the path alone, not where it came from nor how to name its new
    place. Other errors as they are."""
    recorded = (resume.data or {}).get("sources")
    if "data.sources" in given or not recorded or not error.what.startswith(("each source must be an existing",
                                                                              "a glob that matches")):
        return error
    record = Path(resume.checkpoint.path) / DATA_FILE
    return TileError(error.where, f"{error.what}: the resumed run reads the text of the run it continues, from the "
                     f"[data] sources {record} records ({', '.join(map(str, recorded))}); put them back, or name "
                     "where they are now: --set 'data.sources=[\"PATH\"]' (the same text: its tokens are checked "
                     "against the run's)", error.received)


def check_data_record(resume: Resume, given: dict[str, str]) -> None:
    """A checkpoint whose :data:`DATA_FILE` cannot be read (damaged, edited by hand): the resumed
    run would read the job's own [data] in place of the run's text, which the record names. Where
    the job names no [data] sources, that is the shipped default corpus (the standard library),
    which the user did not choose: refused, naming the file and what is wrong with it, before any
    text is read (it was read in full, then refused as the run's sources having "other text now").
    Where the job names its sources (a config file, --set), the user chose the text: one warning
    line names the record not read, and :func:`check_resumed_text` still checks that text's tokens
    against the run's."""
    damaged = resume.data_problem
    if damaged is None:
        return
    named = given.get("data.sources")
    if named is None:
        raise TileError("tilegraph train --resume", f"a readable {DATA_FILE} in the checkpoint: a resumed run reads "
                        "the text of the run it continues, which it records; put the run's record back (the same "
                        "file of another of its checkpoints), or name that text: [data] sources in the job's config, "
                        "or --set 'data.sources=[\"PATH\"]' (its tokens are checked against the run's)", damaged)
    shown = named if on_command_line(named) else f"in {named}"
    print(f"tilegraph train: warning: {damaged}: not read; the resumed run reads the [data] sources the job names "
          f"({shown}), checked against the run's tokens", file=sys.stderr, flush=True)


def keep_data(record: dict | None, d: dict, given: dict[str, str]) -> None:
    """The [data] settings of the run a checkpoint continues (``record``: its :data:`DATA_FILE`),
    where the job gives none (its own config file or flags win, and :func:`check_resumed_text`
    checks they make the same text). None recorded (a checkpoint written before the record): the
    job's own."""
    if record is not None:
        d.update({k: record[k] for k in DATA_KEYS if k in record and f"data.{k}" not in given})


def _whole(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def stored_data(state: dict, record: dict | None = None) -> tuple[int | None, int | None]:
    """(seq_len, token count) of the token data a checkpoint's run read: from its :data:`DATA_FILE`
    ``record`` (``seq_len`` and ``tokens``), else, for checkpoints written before it held the
    count, from its ``trainer_state`` (``repr`` of its TokenDataset); None where neither says."""
    record = record or {}
    seq_len, count = _whole(record.get("seq_len")), _whole(record.get("tokens"))
    if seq_len is not None and count is not None:
        return seq_len, count
    from tilegraph.io.data import described_windows

    found = described_windows(str(state.get("data") or ""))
    if found:
        return seq_len or found[0], count or found[3]
    return seq_len, count


def keep_window(resume: str, state: dict, record: dict | None, d: dict, given: dict[str, str]) -> None:
    """A resumed run reads windows of its checkpoint's ``seq_len`` (other windows are other
    batches, another validation split): [data] seq_len given otherwise is refused or named
    (:func:`refuse_or_warn`), and the checkpoint's kept (``record``: its :data:`DATA_FILE`)."""
    seq_len, _ = stored_data(state, record)
    if seq_len is None or d["seq_len"] == seq_len:
        return
    where = given.get("data.seq_len")
    other = [(where, f"seq_len = {d['seq_len']!r}")] if where is not None else []
    d["seq_len"] = seq_len
    refuse_or_warn(other, f"the windows of the run it continues (seq_len {seq_len}, from its checkpoint): leave "
                   f"[data] seq_len out, or start a new run from the checkpoint's weights (--init {quote(resume)} and "
                   "another --out)", f"the resumed run reads windows of its checkpoint's seq_len {seq_len}")


def check_resumed_text(resume: str, state: dict, record: dict | None, meta: dict, earlier: dict | None,
                       given: dict[str, str]) -> None:
    """A resumed run reads the text of the run it continues: the token file just built (its
    sidecar ``meta``) must hold the tokens of the run folder's earlier one (``earlier``, its
    sidecar; else the count its checkpoint recorded: ``record``, its :data:`DATA_FILE`, or its
    ``state``). Other [data] sources, patterns, max_mb or
    tokenizer would draw other batches and another validation split, and would have replaced
    the run's token file."""
    if earlier is not None:
        same = meta.get("tokens_sha256") == earlier.get("tokens_sha256")
        had = f"{earlier.get('count', 0):,} tokens (sha256 {str(earlier.get('tokens_sha256'))[:12]})"
        got = f"{meta['count']:,} tokens (sha256 {str(meta.get('tokens_sha256'))[:12]})"
    else:
        _, count = stored_data(state, record)
        same = count is None or meta["count"] == count
        had, got = f"{count or 0:,} tokens", f"{meta['count']:,} tokens"
    if same:
        return
    keys = [f"{given[f'data.{k}']}" for k in ("sources", "patterns", "max_mb", "tokenizer") if f"data.{k}" in given]
    if not keys:  # the job gave none: the run's own sources, whose files changed (it told them to leave the keys)
        changed = changed_files(meta, earlier)
        raise TileError("tilegraph train --resume", f"the text of the run it continues ({had}), from the [data] "
                        "sources its checkpoint records (tilegraph_data.json), which the job reads: they hold other "
                        "text now than when the run read them (a file edited, added or removed; for \"stdlib\", "
                        "another Python's standard library): put the run's text back, or start a new run from the "
                        f"checkpoint's weights (--init {quote(resume)} and another --out)",
                        f"{got}" + (f"; {changed}" if changed else ""))
    raise TileError("tilegraph train --resume", f"the text of the run it continues ({had}): leave [data] sources, "
                    "patterns, max_mb and tokenizer as that run had them, or start a new run from the checkpoint's "
                    f"weights (--init {quote(resume)} and another --out)",
                    f"{got}" + (f" from {'; '.join(keys)}" if keys else ""))


def changed_files(meta: dict, earlier: dict | None) -> str:
    """What differs between the files a token file was read from (``meta``: its sidecar) and those
    of the run's earlier one (``earlier``: its sidecar; None: not known), in words: files of
    another size, files read only then, files read only now; "" where neither lists other files
    or sizes."""
    if earlier is None:
        return ""
    then = {e.get("path"): e for e in earlier.get("sources") or [] if isinstance(e, dict)}
    now = {e.get("path"): e for e in meta.get("sources") or [] if isinstance(e, dict)}

    def listed(paths) -> str:
        paths = sorted(map(str, paths))
        return ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")

    other = [p for p in then.keys() & now.keys() if then[p].get("bytes") != now[p].get("bytes")]
    parts = [f"other size now: {listed(other)}" if other else "",
             f"read then, not now: {listed(then.keys() - now.keys())}" if then.keys() - now.keys() else "",
             f"read now, not then: {listed(now.keys() - then.keys())}" if now.keys() - then.keys() else ""]
    return "; ".join(x for x in parts if x)


def refuse_or_warn(other: list[tuple[str, str]], expected: str, kept: str) -> None:
    """Settings a resumed run keeps from its checkpoint, given otherwise (``other``: ``(where,
    "key = value")``): an error (``expected``) where the command line gives them, and one warning
    line per config file that does (it may be the one the run started from, with flags over it),
    saying what the run keeps (``kept``)."""
    refused = [where for where, _ in other if on_command_line(where)]
    if refused:
        raise TileError("tilegraph train --resume", expected, "; ".join(refused))
    for config in dict.fromkeys(where for where, _ in other):
        print(f"tilegraph train: warning: {', '.join(x for where, x in other if where == config)} in {config} not "
              f"used: {kept}", file=sys.stderr, flush=True)


def check_schedule(resume: str, spec: dict, t: dict, given: dict[str, str]) -> None:
    """A resumed run keeps its checkpoint's learning-rate schedule ``spec``: other values of its
    [train] keys are refused or named (:func:`refuse_or_warn`)."""
    other = schedule_changes(spec, t, given)
    if not on_command_line(given.get("train.steps", "")) and "train.steps" in given \
            and spec.get("total", t["steps"]) != t["steps"]:  # the budget, which the schedule spans
        other.append((given["train.steps"], f"steps = {t['steps']!r}"))
    refuse_or_warn(other, "no learning-rate settings other than its checkpoint's schedule, which the resumed run "
                   f"keeps ({describe_schedule(spec)}): leave them out, or start a new run from the checkpoint's "
                   f"weights (--init {quote(resume)} and another --out)",
                   f"the resumed run keeps its checkpoint's learning-rate schedule ({describe_schedule(spec)})")


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


def keep_branch_point(manager, resume: str, step: int, lineage: list) -> None:
    """A resumed run never prunes the checkpoint it resumed from, and moves the checkpoints of
    its run folder that do not lead to it (the branch of an earlier run that this one abandons,
    which would otherwise rank as the newest, be kept over this run's own and collide with their
    names) into ``checkpoints/abandoned-DATE-TIME/``, saying so. Nothing is deleted.

    Resumed from the folder's own ``step-N``, those are the ones after N. Resumed from a branch
    set aside before (``checkpoints/abandoned-*/step-N``), they are the ones after the step where
    the folder's branch left it: found from the ``lineage`` of the resumed checkpoint (the
    trainer's, loaded from it) and of the folder's newest (the steps after N where either was
    written before lineages were recorded)."""
    manager.protect(resume)
    if in_folder(resume, manager.dir):
        after = step
    elif set_aside_in(resume, manager.dir):
        after = step
        newest = manager.latest()
        if newest is not None and lineage:
            from tilegraph.io.zarr import load_checkpoint
            from tilegraph.plotting import record_lineage

            try:
                theirs = record_lineage(load_checkpoint(newest).trainer_state.get("lineage"))
            except (OSError, TileError):
                theirs = None
            if theirs:
                after = min(step, branch_point(lineage, theirs))
    else:
        return
    moved = manager.set_aside(after, time.strftime("abandoned-%Y%m%d-%H%M%S"))
    if moved:
        print(f"set aside the checkpoints after step {after}, of the branch this run abandons: "
              f"{', '.join(p.name for p in moved)} -> {moved[0].parent}", flush=True)


def branch_point(a: list, b: list) -> int:
    """The last step that two lineages (``[segment, last_step]`` paths) share: 0 for none."""
    shared = 0
    for (seg_a, end_a), (seg_b, end_b) in zip(a, b):
        if seg_a != seg_b:
            break
        shared = min(end_a, end_b)
        if end_a != end_b:
            break
    return shared


def in_folder(checkpoint: str, folder: Path) -> bool:
    """Whether ``checkpoint`` is one of the checkpoints of ``folder``."""
    return Path(checkpoint).resolve().parent == folder.resolve()


def set_aside_in(checkpoint: str, folder: Path) -> bool:
    """Whether ``checkpoint`` is in a branch set aside in the checkpoints ``folder``
    (``folder/abandoned-*/step-N``, :func:`keep_branch_point`)."""
    parent = Path(checkpoint).resolve().parent
    return parent.parent == folder.resolve() and parent.name.startswith("abandoned")


def resume_command(config: str | None, checkpoint, sets=()) -> str:
    """The command that continues a run from ``checkpoint``: the run's config and its ``--set``
    pairs, whose settings no checkpoint records (model.recompute, [runtime]'s, [output]'s: without
    them the resumed run took the config's without a word); all but model.init, which --resume
    refuses (it brings the run's base)."""
    kept = [word for pair in sets if pair.partition("=")[0].strip() != "model.init"
            for word in ("--set", quote(pair.strip()))]
    return " ".join(["tilegraph train", *([quote(config)] if config else []), *kept, "--resume", quote(checkpoint)])


def quote(path) -> str:
    """``path`` as a shell word, for the commands the messages suggest (a path with a space: in
    quotes, which a shell reads back as the one path)."""
    import shlex

    return shlex.quote(str(path))


def check_checkpoint_folder(folder: Path, where: str, hf_hint: str) -> None:
    """Refuse, naming ``where`` (the command and flag), a path that is no checkpoint folder: one
    that does not exist, a run folder of tilegraph train (or its checkpoints/ folder: the newest
    checkpoint in it named), a Hugging Face folder (``hf_hint``: what to do with one), a file and a
    folder without zarr.json (a damaged checkpoint, its arrays without it, named so). A folder with
    zarr.json is left to the checkpoint's loader, which names what is wrong with it, and a peft
    adapters folder (adapter_config.json) to the command, which names it as one; the temporary
    folder of a save (``.step-N.tmp-...``: being written, or left by an interrupted save) is refused
    here, naming the checkpoint it is for and the newest complete one (it was "not a tilegraph
    checkpoint folder" from the loader, or, its zarr.json written, loaded while it was renamed)."""
    want = "a checkpoint folder (RUN/checkpoints/step-N of tilegraph train)"
    saving = save_folder(folder)
    if saving:
        raise TileError(where, f"{want}, not the temporary folder of a save: {saving}", f"{folder}, a save's "
                        "temporary folder")
    enclosing = enclosing_checkpoint(folder)
    if enclosing is not None:  # (it was "a Zarr group without tilegraph's attributes is not one")
        raise TileError(where, f"{want}, not a folder inside one: pass {enclosing}", f"{folder}, inside the "
                        f"checkpoint {enclosing}")
    if (folder / "zarr.json").is_file():
        return
    if not folder.exists():
        raise TileError(where, want, f"{folder} does not exist{checkpoints_beside(folder)}")
    newest, kind = latest_checkpoint(folder), "a run folder"
    if newest is None and folder.name == "checkpoints":
        newest, kind = latest_checkpoint(folder.parent), "the checkpoints folder of a run"
    if newest is not None:
        raise TileError(where, f"{want}, not the folder that holds them: its newest is {newest}", f"{folder}, {kind}")
    empty = run_without_checkpoint(folder)
    if empty:  # (it was "a tilegraph checkpoint folder (a Zarr group with zarr.json)" from the loader)
        raise TileError(where, f"{want}; a run writes one every [output] checkpoint_every steps and at its end",
                        f"{folder}, {empty}")
    if (folder / "config.json").is_file() and not (folder / "adapter_config.json").is_file():
        raise TileError(where, f"{want}; a Hugging Face folder holds a model alone: {hf_hint}",
                        f"{folder}, a Hugging Face folder")
    if (folder / "adapter_config.json").is_file():  # a peft adapters folder: each command names it as one
        return
    # named by the command (the loader named itself, tilegraph.io.load_checkpoint(...), and "is not one")
    if not folder.is_dir():
        raise TileError(where, want, f"{folder} is a file, not a folder")
    held = weights_without_config(folder)
    if held is not None:  # (a Hugging Face model's weights: "holds none (no zarr.json)" said nothing of them)
        raise TileError(where, want, f"{held}, the weights of a Hugging Face model without the file that describes "
                        f"it, and no zarr.json")
    if any((folder / part).is_dir() and any((folder / part).glob("*/zarr.json")) for part in ("model", "optimizer")):
        raise TileError(where, want, f"{folder}, whose model/ or optimizer/ folder holds a checkpoint's arrays but "
                        "whose zarr.json, the checkpoint's index of them, is missing: a damaged or partly copied "
                        "checkpoint")
    raise TileError(where, want, f"{folder} holds none (no zarr.json)")


#: how many folders up from a folder inside a checkpoint its root can be: the deepest folder a
#: checkpoint holds is an array of the adapters checkpoint in an adapted run's (``adapters/``, then
#: ``optimizer/<state>/<parameter>``, or a quantized parameter's tile ``model/<parameter>/<tile>``:
#: 4), and in one of format 1 (chunk keys ``c/i/j``) the chunk folders of its 2-D tiles below that
#: (``c/<i>``: 2 more). Each level costs a stat; a zarr.json is read only where one is found.
CHECKPOINT_DEPTH = 6


def enclosing_checkpoint(folder: Path) -> Path | None:
    """The checkpoint that ``folder`` lies inside (its ``model/`` or ``optimizer/`` folder, an
    array's, or one of the adapters checkpoint in it), as the path to pass (the outermost: a run's
    checkpoint, not the adapters checkpoint in it); None where it lies in none, or is a checkpoint
    or an adapter folder itself (named as such by the commands). A relative ``folder`` is looked at
    from the working directory up (``model/wte.weight`` given inside a checkpoint's ``adapters/``
    names the checkpoint, not ``.``), the checkpoint then named relative to it where it lies in it."""
    from tilegraph.io.zarr import is_checkpoint

    given = Path(os.path.expanduser(folder))
    path = Path(os.path.abspath(given))
    # the parents first: a checkpoint elsewhere has none (its zarr.json is read once, by the command)
    found = [parent for parent in path.parents[:CHECKPOINT_DEPTH]
             if (parent / "zarr.json").is_file() and is_checkpoint(parent)]
    if not found or not folder.is_dir() or (folder / "adapter_config.json").is_file() or is_checkpoint(folder):
        return None
    outermost = found[-1]
    if given.is_absolute():
        return outermost
    named = Path(os.path.relpath(outermost))  # as the user gave the folder: relative, where it is below here
    return outermost if named.parts[:1] in ((os.pardir,), ()) else named


def save_folder(folder: Path) -> str:
    """Where ``folder`` is the temporary folder of a checkpoint's save (``.step-N.tmp-PID-HEX-HOST``),
    what it becomes and the newest complete checkpoint beside it, in words; "" otherwise."""
    from tilegraph.io._store import TMP_MARK, temp_writer

    if temp_writer(folder.name) is None or not folder.is_dir():
        return ""
    final = folder.parent / folder.name[1:].split(TMP_MARK, 1)[0]
    newest = latest_checkpoint(folder.parent.parent) if folder.parent.name == "checkpoints" else None
    return (f"it becomes {final} once its save completes; a save under way, or one that was interrupted, leaves it, "
            "and it is never loaded" + (f"; the newest complete checkpoint is {newest}" if newest is not None else ""))


def run_without_checkpoint(folder: Path) -> str:
    """Where ``folder`` is the run folder of tilegraph train (or its ``checkpoints/``) that holds no
    complete checkpoint (a run under way before its first, one stopped before it, a save under way
    or interrupted), in words; "" otherwise."""
    from tilegraph.io._store import temp_writer

    run = folder.parent if folder.name == "checkpoints" else folder
    if not folder.is_dir() or (run / "zarr.json").exists() or latest_checkpoint(run) is not None:
        return ""
    ckdir = run / "checkpoints"
    if not (ckdir.is_dir() or any((run / name).exists() for name in ("metrics.jsonl", "tokens.bin.json", LOCK_NAME))):
        return ""
    kind = "the checkpoints folder of a run" if folder.name == "checkpoints" else "a run folder of tilegraph train"
    saves = sorted(p.name for p in ckdir.iterdir() if temp_writer(p.name) is not None) if ckdir.is_dir() else []
    return (f"{kind} without a complete checkpoint yet"
            + (f"; the temporary folder of a save under way or interrupted: {', '.join(saves)}" if saves else ""))


def checkpoints_beside(missing: Path) -> str:
    """For a checkpoint path ``missing`` that does not exist in a run's checkpoints folder (pruned
    by [output] checkpoint_keep, deleted, mistyped): the complete checkpoints there, in words ("":
    no such folder, or none in it)."""
    from tilegraph.io.zarr import complete_checkpoints

    folder = missing.parent
    if folder.name != "checkpoints" or not folder.is_dir():
        return ""
    found = complete_checkpoints(folder)
    if not found:
        return f" ({folder} holds no complete checkpoint)"
    names = ", ".join(p.name for p in found) if len(found) <= 4 else f"{found[0].name} .. {found[-1].name}"
    return (f" ({folder} holds {names}, the newest {found[-1]}; [output] checkpoint_keep keeps the newest "
            "checkpoints of a run, deleting older ones)")


def latest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint in ``out/checkpoints`` (None: none)."""
    from tilegraph.io.zarr import complete_checkpoints

    found = complete_checkpoints(out / "checkpoints")
    return found[-1] if found else None


def lost_worker(error, config: str | None, out: Path, sets=()) -> TileError:
    """The error of a worker lost while training (``error``, a WorkerLostError naming it and the
    steps) in the command's words: the --resume command of the newest checkpoint and [train]
    restart_on_failure, where the Trainer's told a command-line user to call
    ``Trainer.load_checkpoint`` or build ``Trainer(restart_on_failure=True)``."""
    from tilegraph._health import LOST_STATE

    # (what happened, then what is gone and the Trainer's advice: tilegraph._health.lost_worker_error)
    happened, found, rest = error.what.partition(f"; {LOST_STATE}")
    if not found:  # not the error of lost state: as it is
        return error
    gave_up = re.search(r"; (restart_on_failure (gave up|has no checkpoint).*)$", rest)
    last = latest_checkpoint(out)
    how = (f"continue from the newest checkpoint, {last}, with {resume_command(config, last, sets)} (the steps "
           "after it run again)" if last else "no checkpoint was written yet: train again, with another --out")
    auto = (f"[train] {gave_up.group(1)}" if gave_up else
            "or set [train] restart_on_failure (--set train.restart_on_failure=2) to resume from the last checkpoint "
            "([output] checkpoint_every) by itself")
    return TileError("tilegraph train", f"{happened}: what it held of the parameters and optimizer state is gone; "
                     f"{how}; {auto}", error.received)


def diverged(error: FloatingPointError, optimizer, out: Path) -> TileError:
    """The error of a loss that became NaN or inf (``error`` names the step): what to try (a
    folder holding checkpoints is never the one to delete)."""
    lr = (getattr(optimizer.schedule, "spec", None) or {}).get("base_lr")
    last = latest_checkpoint(out)
    return TileError("tilegraph train", "a finite loss: train again with a lower learning rate (--lr"
                     + (f"; this run's peak was {lr:g}" if lr is not None else "") + "), in another --out"
                     + (f" (from the weights of its last checkpoint: --init {quote(last)})" if last else
                        f" or after deleting {quote(out)}"),
                     getattr(error, "received", None) or re.sub(r"^\[[^]]*\] *", "", str(error)))
