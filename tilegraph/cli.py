"""Command line: ``tilegraph train``, ``tilegraph eval``, ``tilegraph generate``, ``tilegraph info``.

``tilegraph train [CONFIG.toml]`` trains a model from a TOML config; with none, the shipped
``examples/configs/default.toml`` trains the debug GPT-2 on the Python standard library's own
``.py`` files (found at run time, so nothing is downloaded) on the embedded Dask cluster, shows
the loss fall and writes a checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from tilegraph._runtime import _plural
from tilegraph.io.data import stdlib_files  # the train corpus "stdlib"; public there
from tilegraph.ops.rmm import SKETCHES
from tilegraph.plotting import TENSORBOARD_INSTALL, has_tensorboard


# ---------------------------------------------------------------------------------- config ----
DEFAULT_CONFIG = "default.toml"

#: [model] keys of the shipped config that a config naming another flavor still inherits: they
#: fit the model to the job's tokenizer and windows, or name its starting weights; the others
#: shape the default flavor's model
JOB_MODEL_KEYS = ("vocab_size", "max_seq_len", "init", "recompute")

#: [peft] method -> the keys that fix its adapters (what a resumed run must repeat)
PEFT_METHODS = {"none": (), "lora": ("rank", "alpha", "targets"), "lotr": ("rank", "scale", "targets")}


def load_config(path: str | None) -> tuple[dict, str]:
    """The job's settings: the shipped default config updated with the file at ``path``."""
    import importlib.resources
    import tomllib

    from tilegraph._errors import TileError

    text = (importlib.resources.files("tilegraph.configs") / DEFAULT_CONFIG).read_text()
    cfg = tomllib.loads(text)
    source = f"shipped {DEFAULT_CONFIG} (examples/configs/)"
    if path is not None:
        try:
            user = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise TileError("tilegraph train", "an existing TOML config file", path) from None
        except tomllib.TOMLDecodeError as e:
            raise TileError("tilegraph train", "a valid TOML config file", f"{path}: {e}") from None
        unknown = [f"[{k}]" for k in user if k not in cfg]
        unknown += [f"{k}.{f}" for k, v in user.items() if k in cfg and k != "model" and isinstance(v, dict)
                    for f in v if f not in cfg[k]]
        if unknown:
            raise TileError("tilegraph train", f"only known sections and keys ({', '.join(f'[{k}]' for k in cfg)})",
                            f"unknown {', '.join(unknown)} in {path}")
        model = user.get("model", {})
        if model.get("flavor", cfg["model"]["flavor"]) != cfg["model"]["flavor"]:
            # another flavor: the default's shape keys (dim, ...) describe the default flavor's
            # model, not this one; only the keys that describe the job carry over
            cfg["model"] = {k: v for k, v in cfg["model"].items() if k in JOB_MODEL_KEYS}
        for k, v in user.items():
            cfg[k] = {**cfg[k], **v}
        source = path
    return cfg, source


def _int(low: int):
    return (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low, f"an integer >= {low}")


def _number(low: float, strict: bool = False, high: float | None = None):
    def ok(v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
            return False
        return (v > low if strict else v >= low) and (high is None or v < high)
    bounds = f"{'>' if strict else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")
    return ok, f"a number {bounds}"


def _text():
    return (lambda v: isinstance(v, str), "a string")


def _texts():
    return (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v),
            "a non-empty list of strings")


def _one_of(*names: str):
    return (lambda v: isinstance(v, str) and v in names, f"one of {', '.join(map(repr, names))}")


#: what each key of the job config must hold (checked after merging and --set, before any work)
CONFIG_CHECKS = {
    "data.sources": _texts(), "data.patterns": _texts(), "data.max_mb": _number(0, strict=True),
    "data.tokenizer": _text(), "data.seq_len": _int(1), "data.val_fraction": _number(0, high=1),
    "train.steps": _int(1), "train.batch_size": _int(1), "train.accum_steps": _int(1),
    "train.steps_per_graph": (lambda v: v == "auto" or _int(1)[0](v), '"auto" or an integer >= 1'),
    "train.lr": _number(0, strict=True), "train.warmup": _int(0), "train.min_lr": _number(0),
    "train.weight_decay": _number(0), "train.clip_grad_norm": _number(0), "train.eval_every": _int(0),
    "train.eval_batches": _int(1), "train.seed": _int(0),
    "output.dir": _text(), "output.checkpoint_every": _int(0),
    "output.checkpoint_keep": _int(0),
    "output.tensorboard": (lambda v: v is False or (v is True and has_tensorboard()),
                           f"false, or true with TensorBoard installed ({TENSORBOARD_INSTALL})"),
    "runtime.address": _text(), "runtime.workers": _int(0), "runtime.scheduler_file": _text(),
    "runtime.mpi": (lambda v: isinstance(v, bool), "true or false"), "runtime.interface": _text(),
    "runtime.tls_ca_file": _text(), "runtime.tls_cert": _text(), "runtime.tls_key": _text(),
    "model.init": _text(), "model.recompute": (lambda v: isinstance(v, bool), "true or false"),
    "peft.method": _one_of(*PEFT_METHODS), "peft.rank": _int(1), "peft.alpha": _number(0, strict=True),
    "peft.scale": _number(0, strict=True), "peft.targets": _texts(),
    "peft.grad_sketch": _one_of("none", *SKETCHES),
    "peft.sketch_ratio": (lambda v: _number(0, strict=True)[0](v) and v <= 1, "a number > 0 and <= 1"),
    "peft.sketch_targets": _texts(),
}


def check_config(cfg: dict, source: str) -> None:
    """Every known key holds what it must; all problems in one error."""
    from tilegraph._errors import TileError

    problems = []
    for name, (ok, want) in CONFIG_CHECKS.items():
        section, key = name.split(".")
        if key in cfg.get(section, {}) and not ok(cfg[section][key]):
            problems.append(f"{name} must be {want}, not {cfg[section][key]!r}")
    t, p = cfg["train"], cfg.get("peft", {})
    if not problems and t["batch_size"] % t["accum_steps"]:
        problems.append(f"train.batch_size ({t['batch_size']}) must be a multiple of train.accum_steps "
                        f"({t['accum_steps']})")
    if not problems and p.get("method", "none") != "none" and p.get("grad_sketch", "none") != "none":
        # a sketch replaces the weight gradient of a trained Linear; adapters freeze every base weight
        problems.append(f"peft.grad_sketch must be \"none\" with peft.method = {p['method']!r} (it sketches the "
                        f"weight gradients of trained Linear layers, and the adapters freeze them), not "
                        f"{p['grad_sketch']!r}")
    if problems:
        raise TileError("tilegraph train", "valid settings", f"{'; '.join(problems)} (in {source})")


def apply_overrides(cfg: dict, pairs: list[str]) -> None:
    """``--set section.key=value`` (the value as TOML: 1e-3, 4, true, "text"; a bare word is a
    string)."""
    import tomllib

    from tilegraph._errors import TileError

    # a flavor first: switching it drops the default flavor's shape keys, never the ones given here
    for pair in sorted(pairs, key=lambda p: p.partition("=")[0].strip() != "model.flavor"):
        name, eq, text = pair.partition("=")
        section, dot, key = name.strip().partition(".")
        if not eq or not dot or section not in cfg or (key not in cfg[section] and section != "model"):
            known = ", ".join(f"{s}.{k}" for s, keys in cfg.items() for k in keys)
            raise TileError("tilegraph train --set", f"section.key=value with a known key ({known})", repr(pair))
        try:
            value = tomllib.loads(f"v = {text.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = text.strip()
        if (section, key) == ("model", "flavor") and value != cfg["model"].get("flavor"):
            # as in a config file: another flavor keeps only the keys that fit the job
            cfg["model"] = {k: v for k, v in cfg["model"].items() if k in JOB_MODEL_KEYS}
        cfg[section][key] = value


def build_model(model_cfg: dict, tokenizer, seed: int, seq_len: int | None = None):
    import dataclasses

    from tilegraph import models
    from tilegraph._errors import TileError

    fields = dict(model_cfg)
    fields.pop("init", None)  # where the weights come from, not a field: see init_model
    fields.pop("recompute", None)  # how the backward runs, not a field
    flavor = fields.pop("flavor", "gpt2-debug")
    base = models.config(flavor)
    if fields.get("vocab_size") == "tokenizer":
        fields["vocab_size"] = tokenizer.vocab_size
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TileError("tilegraph train [model]", f"fields of {type(base).__name__}: {', '.join(sorted(known))}",
                        f"unknown {', '.join(unknown)}")
    cfg = dataclasses.replace(base, **fields)
    if cfg.vocab_size < tokenizer.vocab_size:  # else training dies at the first batch holding a large id
        raise TileError("tilegraph train [model]", f"vocab_size of at least the tokenizer's {tokenizer.vocab_size} "
                        "(or vocab_size = \"tokenizer\")", f"{flavor} with vocab_size {cfg.vocab_size}")
    if seq_len is not None and cfg.max_seq_len < seq_len:
        raise TileError("tilegraph train [model]", f"max_seq_len of at least [data] seq_len = {seq_len}",
                        f"{flavor} with max_seq_len {cfg.max_seq_len}")
    return models.build(cfg, seed=seed)


def make_tokenizer(name: str):
    from tilegraph.io import BPETokenizer, ByteTokenizer

    return ByteTokenizer(eos=True) if name == "byte" else BPETokenizer.load(name)


# ----------------------------------------------------------------------------- fine-tuning ----
#: written into every checkpoint of a run started from ``[model] init`` or with adapters: how to
#: rebuild its model (the base, the adapters), for --resume, generate, eval and convert
PEFT_FILE = "tilegraph_peft.json"


def given_model_keys(cfg: dict, path: str | None, pairs: list[str]) -> dict:
    """The [model] keys the user gave (in the config file at ``path`` or as ``--set
    model.KEY=...``) with their values in the merged ``cfg``; not the shipped defaults, nor init."""
    import tomllib

    names = set(tomllib.loads(Path(path).read_text()).get("model", {})) if path is not None else set()
    names |= {pair.partition("=")[0].strip().partition(".")[2] for pair in pairs
              if pair.partition("=")[0].strip().partition(".")[0] == "model"}
    return {k: cfg["model"][k] for k in sorted(names - {"init", "recompute"}) if k in cfg["model"]}


def adapter_settings(p: dict) -> dict:
    """The settings that fix a run's adapters: method and, for an adapter method, its keys."""
    return {"method": p["method"], **{k: p[k] for k in PEFT_METHODS.get(p["method"], ())}}


def _describe(settings: dict) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in settings.items())


def read_peft_record(folder: Path, where: str) -> dict | None:
    """The record :data:`PEFT_FILE` of a checkpoint (None when it has none)."""
    from tilegraph._errors import TileError

    f = folder / PEFT_FILE
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TileError(where, f"a readable {PEFT_FILE} in the checkpoint", f"{f}: {e}") from None
    if not isinstance(record, dict) or record.get("method") not in PEFT_METHODS \
            or any(k not in record for k in PEFT_METHODS[record["method"]]):
        raise TileError(where, f"a {PEFT_FILE} naming a method ({', '.join(PEFT_METHODS)}) and its settings",
                        f"{f}: {record!r}")
    return record


def init_model(init: str, method: str):
    """The model of ``[model] init`` (a Hugging Face folder or a Zarr checkpoint) and whether its
    Linear weights stay quantized: a quantized checkpoint under adapters opens with
    :func:`tilegraph.peft.from_quantized` (each tile dequantized where a step uses it), else it
    loads dequantized to train every weight."""
    from tilegraph.io.zarr import load_checkpoint

    where = "tilegraph train model.init"
    folder = Path(init)
    if method != "none" and (folder / "zarr.json").is_file() and read_peft_record(folder, where) is None:
        ck = load_checkpoint(folder)
        if any(a.get("quantized") for name, a in ck.arrays.items() if name.startswith("model/")):
            from tilegraph import peft

            return peft.from_quantized(folder, runtime=None), True
    return load_model(folder, where), False


def check_init_fits(model, given: dict, init: str, tokenizer, seq_len: int) -> None:
    """The [model] keys the user gave agree with the architecture of ``model`` (loaded from
    ``init``), and it fits the job's tokenizer and windows; every disagreement in one error."""
    import dataclasses

    from tilegraph import models
    from tilegraph._errors import TileError

    cfg = model.config
    have = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    problems = []
    if "flavor" in given:
        flavor = models.config(given["flavor"])  # an unknown name: the flavor list
        if type(flavor) is not type(cfg):
            problems.append(f"flavor = {given['flavor']!r} is a {type(flavor).__name__}, {init} a {type(cfg).__name__}")
        else:  # its shape; the job's keys (vocab_size, max_seq_len) are checked against the job below
            differ = [k for k in have if k not in given and k not in JOB_MODEL_KEYS and getattr(flavor, k) != have[k]]
            if differ:
                ours = ", ".join(f"{k} {getattr(flavor, k)}" for k in differ)
                problems.append(f"flavor = {given['flavor']!r} has {ours}, {init} "
                                + ", ".join(f"{k} {have[k]}" for k in differ))
    for key, value in given.items():
        if key == "flavor" or (key == "vocab_size" and value == "tokenizer"):
            continue
        if key not in have:
            problems.append(f"{key} is not a field of {type(cfg).__name__} ({', '.join(have)})")
        elif value != have[key]:
            problems.append(f"{key} = {value!r}, {init} has {have[key]!r}")
    if problems:
        raise TileError("tilegraph train [model]", f"[model] keys that agree with model.init's {type(cfg).__name__} "
                        "(or none: the architecture comes from the init weights)", "; ".join(problems))
    if cfg.vocab_size < tokenizer.vocab_size:
        raise TileError("tilegraph train [model]", f"model.init's vocab_size to hold the tokenizer's "
                        f"{tokenizer.vocab_size} ids ([data] tokenizer)", f"{init} with vocab_size {cfg.vocab_size}")
    if cfg.max_seq_len < seq_len:
        raise TileError("tilegraph train [model]", "model.init's max_seq_len to be at least [data] seq_len = "
                        f"{seq_len}", f"{init} with max_seq_len {cfg.max_seq_len}")


def add_adapters(model, p: dict, seed: int, where: str = "tilegraph train [peft]"):
    """Apply the [peft] adapters (``p``: method and its keys) to ``model`` in place; a target
    matching no layer, or a rank too large for one, is an error naming the key."""
    from tilegraph import peft
    from tilegraph._errors import TileError

    try:
        if p["method"] == "lora":
            peft.apply_lora(model, p["targets"], p["rank"], p["alpha"], seed=seed)
        elif p["method"] == "lotr":
            peft.apply_lotr(model, p["targets"], p["rank"], p["scale"], seed=seed)
    except TileError as e:  # the message names targets or rank; only where it comes from changes
        raise TileError(where, e.what, e.received) from None
    return model


def add_grad_sketch(model, p: dict, seed: int):
    from tilegraph._errors import TileError
    from tilegraph.sketch import apply_grad_sketch

    if p["grad_sketch"] != "none":
        try:
            apply_grad_sketch(model, p["sketch_targets"], p["grad_sketch"], p["sketch_ratio"], seed=seed)
        except TileError as e:
            raise TileError("tilegraph train [peft] sketch_targets", e.what, e.received) from None
    return model


def resume_settings(resume: str, p: dict, init: str) -> str:
    """The init of a resumed run (the job's, else the one its checkpoint records), after checking
    that the job asks for the adapters the checkpoint holds."""
    from tilegraph._errors import TileError

    where = "tilegraph train --resume"
    folder = Path(resume)
    if not folder.is_dir():
        return init  # check_output names the missing checkpoint
    record = read_peft_record(folder, where)
    job = adapter_settings(p)
    if record is None:
        if job["method"] != "none":
            raise TileError(where, "a checkpoint of a run with the [peft] adapters asked for (to fine-tune a "
                            "checkpoint with new adapters, pass it as --init)",
                            f"{resume} holds none; {_describe(job)}")
        return init
    stored = adapter_settings(record)
    if job != stored:
        raise TileError(where, "the [peft] settings of the run that wrote the checkpoint (its adapters are "
                        "restored as they are): pass that run's config", f"{_describe(job)} here, "
                        f"{_describe(stored)} in {folder / PEFT_FILE}")
    base = record.get("init") or ""
    if init and base and Path(init).resolve() != Path(base).resolve():
        raise TileError(where, f"model.init to be the base of the run that wrote the checkpoint ({base}), or "
                        "left out", init)
    return init or base


def peft_record(p: dict, init: str, quantized_base: bool) -> dict:
    """What :data:`PEFT_FILE` holds: the adapter settings, the base (its absolute path) and
    whether the checkpoint holds the base weights (not when they stayed quantized: then the base
    checkpoint must stay where it is)."""
    return {**adapter_settings(p), "init": str(Path(init).resolve()) if init else None,
            "base_in_checkpoint": not quantized_base}


def _unloaded_model(ck, where: str):
    """The model of a checkpoint's stored architecture, config and tiling, its weights not read."""
    from tilegraph._errors import TileError
    from tilegraph.models import ARCHITECTURES, ModelTiling
    from tilegraph.nn import deferred_init

    m = ck.info.get("model") or {}
    if m.get("architecture") not in ARCHITECTURES:
        raise TileError(where, f"a checkpoint of a known architecture ({', '.join(ARCHITECTURES)})",
                        repr(m.get("architecture") or m.get("class")))
    config_cls, model_cls = ARCHITECTURES[m["architecture"]]
    with deferred_init():  # no random draw for weights about to be read
        model = model_cls(config_cls(**m.get("config", {})), ModelTiling(**m["tiling"]) if m.get("tiling") else None,
                          dtype=np.dtype(m.get("dtype", "float32")))
    if m.get("hf_extra"):
        model.hf_extra = dict(m["hf_extra"])
    return model


def adapted_model(folder: Path, record: dict, where: str):
    """The model of a checkpoint written by an adapted run, its adapters merged into the weights
    (plain Linear layers): the base from the checkpoint, or from the recorded base checkpoint when
    the run kept it quantized (read dequantized), then the adapters and every stored weight."""
    import dataclasses

    from tilegraph import models, peft
    from tilegraph._errors import TileError
    from tilegraph.io.zarr import load_checkpoint

    ck = load_checkpoint(folder)
    if record.get("base_in_checkpoint", True):
        model = _unloaded_model(ck, where)
    else:
        base = record.get("init")
        if not base or not (Path(base) / "zarr.json").is_file():
            raise TileError(where, "the quantized base checkpoint the run was fine-tuned from (its Linear weights "
                            "are not copied into the run's checkpoints)", f"{folder / PEFT_FILE} names {base!r}, "
                            "which is not a checkpoint (moved or deleted?)")
        model = models.from_zarr(base)
        stored = (ck.info.get("model") or {}).get("config")
        have = json.loads(json.dumps(dataclasses.asdict(model.config)))  # as stored: tuples are lists
        if have != stored:
            raise TileError(where, f"the base checkpoint {base} to have the run's config", f"{stored}, the base {have}")
    add_adapters(model, record, seed=0, where=where)
    named = dict(model.named_parameters())
    unexpected = [n for n in ck.parameters if n not in named]
    if unexpected:
        raise TileError(where, f"the arrays of {folder} to match its model and the adapters of {PEFT_FILE}",
                        "unexpected: " + ", ".join(unexpected))
    ck.load_into(model, strict=record.get("base_in_checkpoint", True))
    return peft.merge_lora(model)


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


def check_output(out: Path, resume: str | None, steps: int) -> int | None:
    """Refuse, before any work, a run whose output would mix with or overwrite an earlier run's;
    returns the step of the ``resume`` checkpoint (None without one)."""
    from tilegraph._errors import TileError
    from tilegraph.io.zarr import load_checkpoint

    ckdir = out / "checkpoints"
    found = sorted(p.name for p in ckdir.iterdir() if p.name.startswith("step-")) if ckdir.is_dir() else []
    if resume is None:
        if found or (out / "metrics.jsonl").exists():
            what = ", ".join(x for x in ["metrics.jsonl" if (out / "metrics.jsonl").exists() else "",
                                         f"checkpoints {found[0]}..{found[-1]}" if found else ""] if x)
            hint = f" (--resume {ckdir / found[-1]} continues it)" if found else ""
            raise TileError("tilegraph train", f"an output folder without an earlier run; {out} holds one ({what}): "
                            f"pass --resume CHECKPOINT to continue it{hint}, or another --out", str(out))
        return None
    step = load_checkpoint(resume).step
    clash = [n for n in found if n.split("-", 1)[1].isdigit() and step < int(n.split("-", 1)[1]) <= step + steps]
    if clash:
        raise TileError("tilegraph train", f"checkpoint names free for steps {step + 1}..{step + steps}; {ckdir} "
                        f"already holds {', '.join(clash)} (from a run that went past step {step}): pass another --out",
                        f"--resume {resume} --steps {steps}")
    return step


def cmd_train(args) -> int:
    held: list = []  # release functions (the output lock)
    try:
        return _train(args, held)
    finally:
        for release in held:
            release()


def _train(args, held: list) -> int:
    import signal

    import tilegraph as tg
    from tilegraph.io import TokenDataset, build_token_file

    cfg, source = load_config(args.config)
    flags = {"train.steps": args.steps, "train.lr": args.lr, "train.batch_size": args.batch_size,
             "train.seed": args.seed, "model.init": args.init}
    apply_overrides(cfg, list(args.set or []))
    for name, value in flags.items():
        if value is not None:
            section, key = name.split(".")
            cfg[section][key] = value
    if args.set or any(v is not None for v in flags.values()):
        source += " and the command line"
    check_config(cfg, source)
    d, t, o, r = cfg["data"], cfg["train"], cfg["output"], cfg["runtime"]
    rt = None
    # TLS files: the flags override [runtime]; "" is off (connect checks them before connecting)
    tls = {k: getattr(args, k) or r.get(k) or None for k in ("tls_ca_file", "tls_cert", "tls_key")}
    from tilegraph._runtime import _tls_files

    _tls_files("tilegraph train [runtime]", *tls.values())  # wrong files stop before the data is read
    if args.mpi or r["mpi"]:
        # First of all: dask-mpi turns rank 0 into the scheduler and ranks >= 2 into workers, and
        # returns only on rank 1, which runs the rest (so only it reads data and writes files).
        rt = tg.connect(mpi=True, interface=r["interface"] or None, quiet=True, **tls)
    steps = int(t["steps"])
    out = Path(args.out or o["dir"])
    tokenizer = make_tokenizer(d["tokenizer"])
    # bad model and adapter settings fail before any work
    p, init, quantized_base = cfg["peft"], cfg["model"].get("init", ""), False
    if args.resume:  # the adapters of the checkpoint; its base when the job names none
        init = resume_settings(args.resume, p, init)
    if init:
        model, quantized_base = init_model(init, p["method"])
        check_init_fits(model, given_model_keys(cfg, args.config, list(args.set or [])), init, tokenizer, d["seq_len"])
    else:
        model = build_model(cfg["model"], tokenizer, t["seed"], d["seq_len"])
    add_grad_sketch(add_adapters(model, p, t["seed"]), p, t["seed"])
    model.recompute = bool(cfg["model"].get("recompute", False))  # each block's activations recomputed in the backward
    files = tokenizer_files(tokenizer)
    if init or p["method"] != "none":
        files[PEFT_FILE] = json.dumps(peft_record(p, init, quantized_base), indent=1).encode()
    held.append(lock_output(out))  # then the output folder: ours alone, and no earlier run in it
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
                             tensorboard=o.get("tensorboard", False))
        if args.resume:
            print(f"resumed from {args.resume} at step {trainer.load_checkpoint(args.resume)}", flush=True)

        def stop(signum, frame):  # Ctrl-C / SIGTERM: finish the steps under way, checkpoint, exit
            trainer.request_stop()
            signal.signal(signum, signal.SIG_DFL if signum == signal.SIGTERM else signal.default_int_handler)
            print(f"tilegraph train: {signal.Signals(signum).name}: stopping after the steps under way and writing "
                  "a checkpoint (again to stop at once)", file=sys.stderr, flush=True)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            res = trainer.fit(steps)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        adapters = save_final_adapters(trainer, res, p)
        if adapters:
            print(f"adapters: {adapters}", flush=True)
        sample = ""
        if res.stopped:
            last = res.checkpoints[-1] if res.checkpoints else None
            print(f"stopped at step {opt.step_count}" + (f"; checkpoint: {last} (continue with --resume {last})"
                                                         if last else ""), flush=True)
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


def save_final_adapters(trainer, res, p: dict) -> Path | None:
    """Write the adapters alone (:func:`tilegraph.peft.save_adapters`) into the run's last
    checkpoint, as ``adapters/``, when that checkpoint is of the model's current step (the earlier
    ones are written while training goes on, so the model has moved past them)."""
    from tilegraph import peft

    if p["method"] == "none" or not res.checkpoints or trainer.checkpoints is None:
        return None
    last = Path(res.checkpoints[-1])
    if last != trainer.checkpoints.path(trainer.optimizer.step_count) or not last.is_dir():
        return None
    peft.save_adapters(last / "adapters", trainer.model)
    return last / "adapters"


def tokenizer_files(tokenizer) -> dict[str, bytes]:
    """The files that let `tilegraph generate CHECKPOINT` find the tokenizer (written into every
    checkpoint before its commit): its description, and a BPE tokenizer's vocabulary and merges
    as an HF tokenizers JSON."""
    files = {"tilegraph_tokenizer.json": json.dumps(tokenizer.describe()).encode()}
    if hasattr(tokenizer, "to_str"):
        files["bpe_tokenizer.json"] = tokenizer.to_str().encode("utf-8")
    return files


def load_tokenizer(folder: Path, override: str | None, where: str = "tilegraph generate"):
    """The tokenizer of a checkpoint: ``override`` (byte, or a BPE JSON path), else what
    ``tilegraph train`` recorded in the folder, else an HF ``tokenizer.json`` there."""
    from tilegraph._errors import TileError
    from tilegraph.io import BPETokenizer, tokenizer_from_description

    if override:
        return make_tokenizer(override)
    recorded = folder / "tilegraph_tokenizer.json"
    if recorded.is_file():
        try:
            desc = json.loads(recorded.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise TileError(where, "a readable tokenizer description (JSON) in the checkpoint",
                            f"{recorded}: {e}") from None
        bpe = folder / "bpe_tokenizer.json"
        return tokenizer_from_description(desc, bpe if bpe.is_file() else None)
    if (folder / "tokenizer.json").is_file():
        return BPETokenizer.load(folder / "tokenizer.json", eos=None)
    raise TileError(where, "a tokenizer: tilegraph_tokenizer.json or tokenizer.json in the "
                    "checkpoint folder, or --tokenizer byte|PATH", str(folder))


def unescape(text: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` in a command-line argument as the characters they name (a
    shell passes ``--stop '\n'`` as a backslash and an n)."""
    import re

    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def stopped_text(tokenizer, new_ids, stops) -> tuple[str, int]:
    """The text of ``new_ids`` cut right after the first stop string completed in it (as
    :func:`tilegraph.models.generate.find_stop`), and how many ids made it; all of them when no
    stop string occurs."""
    from tilegraph.models.generate import find_stop

    for k in range(1, len(new_ids) + 1) if stops else ():
        text = tokenizer.decode(new_ids[:k])
        end = find_stop(text, stops)
        if end is not None:
            return text[:end], k
    return tokenizer.decode(new_ids), len(new_ids)


def cmd_generate(args) -> int:
    import tilegraph as tg
    from tilegraph.models.generate import generate

    folder = Path(args.checkpoint)
    tokenizer = load_tokenizer(folder, args.tokenizer)
    model = load_model(folder, "tilegraph generate")
    prompt = np.asarray(tokenizer.encode(args.prompt), dtype=np.int64)
    if prompt.size == 0:
        raise tg.TileError("tilegraph generate", "a non-empty prompt", repr(args.prompt))
    n = args.max_new_tokens
    if n is None:
        n = min(64, model.config.max_seq_len - prompt.size)
    strategy = args.strategy or ("top_k" if args.top_k and not args.top_p else "top_p" if args.top_p and not args.top_k
                                 else "sample" if args.top_k and args.top_p else "greedy")
    stops = [unescape(s) for s in args.stop or []]
    eos = getattr(tokenizer, "eos_id", None)
    with (contextlib.nullcontext() if args.local else tg.connect(quiet=True, dashboard=False)) as rt:
        # the ids after a stop string are cut off below: any pad id will do
        ids = generate(model, prompt[None, :], n, strategy=strategy, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, repetition_penalty=args.repetition_penalty, seed=args.seed, eos_id=eos,
                       stop=stops or None, tokenizer=tokenizer, pad_id=0 if stops and eos is None else None,
                       runtime=rt)
    text, kept = stopped_text(tokenizer, ids[0, prompt.size:], stops)
    print(tokenizer.decode(prompt) + text)
    if args.ids:
        print(" ".join(map(str, ids[0, :prompt.size + kept].tolist())))
    return 0


#: the default corpus of `tilegraph eval`, as `tilegraph train` builds it with the shipped config
EVAL_DEFAULT_CORPUS = "the shipped config's corpus (the standard library's sources), its validation split"


def cmd_eval(args) -> int:
    """Loss and perplexity of a checkpoint on a corpus, over windows spread evenly across it."""
    import tempfile

    import tilegraph as tg
    from tilegraph._errors import TileError
    from tilegraph.io import TokenDataset, build_token_file
    from tilegraph.io.data import DEFAULT_PATTERNS
    from tilegraph.trainer import _default_row_tile, lm_loss, perplexity

    where = "tilegraph eval"
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise TileError(where, f"{flag} must be an integer >= 1", str(value))
    folder = Path(args.checkpoint)
    model = load_model(folder, where)
    tokenizer = load_tokenizer(folder, args.tokenizer, where)
    cfg = model.config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise TileError(where, f"a tokenizer whose ids fit the model's vocab_size={cfg.vocab_size}",
                        f"{tokenizer!r} with {tokenizer.vocab_size} ids")
    job, _ = load_config(None)
    d = job["data"]
    seq_len = args.seq_len if args.seq_len is not None else min(int(d["seq_len"]), cfg.max_seq_len)
    if seq_len > cfg.max_seq_len:
        raise TileError(where, f"--seq-len of at most the model's max_seq_len={cfg.max_seq_len}", str(seq_len))
    if args.data:  # the whole of the user's corpus
        sources, split, val_fraction, what = list(args.data), "train", 0.0, "the corpus"
        patterns = DEFAULT_PATTERNS
    else:  # what `tilegraph train` trains on by default; only its held-out part
        sources, split, val_fraction = stdlib_files(d["patterns"], int(d["max_mb"] * 1e6)), "val", d["val_fraction"]
        what = f"the validation split (last {val_fraction:.0%}) of the default training corpus"
        patterns = d["patterns"]
    batch_size = args.batch_size
    with tempfile.TemporaryDirectory(prefix="tilegraph-eval-") as tmp:
        meta = build_token_file(sources, Path(tmp) / "tokens.bin", tokenizer, patterns=patterns)
        if meta["count"] < seq_len + 1 or (meta["count"] - 1) // seq_len < batch_size:
            raise TileError(where, f"a corpus of at least --batch-size={batch_size} windows of --seq-len + 1 = "
                            f"{seq_len + 1} tokens", f"{meta['count']:,} tokens from {len(sources)} source(s)")
        ds = TokenDataset(Path(tmp) / "tokens.bin", seq_len, split=split, val_fraction=val_fraction)
        batches = ds.eval_offsets(batch_size, args.batches)
        windows = len(batches) * batch_size
        print(f"tilegraph eval: {type(model).__name__} ({model.num_parameters():,} parameters) from {folder}; "
              f"{what}: {ds.hi - ds.lo:,} tokens, {windows:,} windows of {seq_len} spread over "
              f"{'all of it' if windows == ds.num_eval_windows else 'it'} "
              f"({windows * seq_len / (ds.hi - ds.lo):.1%} of its tokens)", flush=True)
        with (contextlib.nullcontext() if args.local else tg.connect(quiet=True, dashboard=False)) as rt:
            rows = getattr(model.tiling, "batch", None) or _default_row_tile(rt, batch_size, seq_len * cfg.dim)
            seq_tile = getattr(model.tiling, "seq", None)
            ev = tg.EvalStep(model, lambda m, offsets: lm_loss(m, *ds.tensors(offsets, seq_tile=seq_tile)),
                             batch_tiles=[(min(rows, batch_size),)], runtime=rt)
            loss = float(np.mean(ev.losses([(b,) for b in batches])))
    print(f"loss {loss:.4f}, perplexity {perplexity(loss):.3f}")
    return 0


def load_model(folder: Path, where: str):
    """The model of a Zarr checkpoint or of a Hugging Face folder; a checkpoint of a run with
    adapters comes with them merged into its weights."""
    from tilegraph._errors import TileError
    from tilegraph import models
    from tilegraph.io.zarr import is_checkpoint

    if (folder / "zarr.json").is_file() or not (folder / "config.json").is_file():
        if not folder.exists():
            raise TileError(where, "a checkpoint folder (tilegraph train) or a Hugging Face folder",
                            f"{folder} does not exist")
        record = read_peft_record(folder, where) if (folder / "zarr.json").is_file() else None
        if record is not None:  # a run from init weights or with adapters: rebuilt as it ran, merged
            return adapted_model(folder, record, where)
        if is_checkpoint(folder) or (folder / "zarr.json").is_file():
            return models.from_zarr(folder)  # raises naming what is wrong with an incomplete one
        raise TileError(where, "a tilegraph checkpoint (zarr.json) or a Hugging Face folder (config.json)",
                        f"{folder} holds neither")
    return models.from_hf(folder)


def cmd_convert(args) -> int:
    """HF folder <-> Zarr checkpoint, optionally quantized."""
    from tilegraph._errors import TileError
    from tilegraph.io.zarr import save_checkpoint

    src, dst = Path(args.src), Path(args.dst)
    where = "tilegraph convert"
    if dst.exists():
        raise TileError(where, "a destination that does not exist yet (nothing is overwritten)", f"{dst} exists")
    model = load_model(src, where)
    files = {}
    for name in ("tilegraph_tokenizer.json", "bpe_tokenizer.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            files[name] = (src / name).read_bytes()
    to_zarr = args.to == "zarr" if args.to else (src / "config.json").is_file() and not (src / "zarr.json").is_file()
    if to_zarr:
        save_checkpoint(dst, model, quantize=args.quantize, files=files, metadata={"converted_from": str(src)})
    else:
        if args.quantize:
            raise TileError(where, "--quantize applies to a Zarr destination (a Hugging Face folder holds the "
                            "dequantized weights)", f"--quantize {args.quantize} with --to hf")
        model.to_hf(dst)
        for name, data in files.items():
            (dst / name).write_bytes(data)
    print(f"{src} -> {dst} ({'Zarr checkpoint' if to_zarr else 'Hugging Face folder'}"
          + (f", quantized {args.quantize}" if args.quantize else "") + ")")
    return 0


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _print_checkpoint(folder: Path) -> None:
    from tilegraph.io.zarr import load_checkpoint

    ck = load_checkpoint(folder)
    info = ck.info
    model = info.get("model") or {}
    print(f"checkpoint {folder}: step {ck.step}, format {info['format']} v{info['version']}, created "
          f"{info.get('created')}, {_size(folder) / 1e6:,.2f} MB on disk")
    if model.get("architecture"):
        print(f"model: {model['architecture']} {model.get('config')} tiling {model.get('tiling')}")
    opt = ck.optimizer_info
    if opt:
        print(f"optimizer: {opt['type']} step {opt['step_count']} lr {opt['lr']:.3g} schedule {opt.get('schedule')}")
    if ck.metadata:
        print(f"metadata: {json.dumps(ck.metadata)}")
    record = read_peft_record(folder, "tilegraph info")
    if record is not None:
        kept = record.get("base_in_checkpoint", True)
        print(f"fine-tuning ({PEFT_FILE}): {_describe(adapter_settings(record))}; from {record.get('init')}"
              + ("" if kept else " (its quantized Linear weights are not in this checkpoint: keep it there)")
              + (f"; the adapters alone in {folder / 'adapters'}" if (folder / "adapters").is_dir() else ""))
    print(f"{len(ck.arrays)} arrays:")
    for name, a in ck.arrays.items():
        q = a.get("quantized")
        how = f"{q['method']}" + (f":{q['bits']}" if q.get("bits") else "") if q else a["dtype"]
        size = _size(folder / name)
        print(f"  {name:48} {'x'.join(map(str, a['shape'])):>14} {how:>9} {size / 1e6:9.3f} MB  tiles "
              f"{'x'.join(str(len(c)) for c in a['tiles'])}")


def cmd_info(args) -> int:
    if args.checkpoint:
        _print_checkpoint(Path(args.checkpoint))
        return 0
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
    from tilegraph import models

    print("model flavors ([model] flavor = ...):")
    for name in models.FLAVORS:
        c = models.config(name)
        print(f"  {name:15} {type(c).__name__:12} {c.n_layers} layers x {c.dim} wide, {c.n_heads} heads, "
              f"vocab {c.vocab_size:,}, max_seq_len {c.max_seq_len}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tilegraph", description="Train neural networks as tile graphs on Dask.")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a TOML config (default: the debug GPT-2 on the stdlib "
                                      "sources, embedded cluster)")
    tr.add_argument("config", nargs="?", default=None,
                    help="TOML config; its keys override the shipped examples/configs/default.toml")
    tr.add_argument("--steps", type=int, default=None,
                    help="optimizer steps to run (overrides [train] steps); with --resume, steps added after "
                         "the checkpoint's")
    tr.add_argument("--lr", type=float, default=None, help="peak learning rate (overrides [train] lr)")
    tr.add_argument("--batch-size", type=int, default=None, help="sequences per optimizer step ([train] batch_size)")
    tr.add_argument("--seed", type=int, default=None, help="seed of the weights and the batch order ([train] seed)")
    tr.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                    help="override any config key, e.g. --set model.n_layers=4 --set data.seq_len=128 (repeatable)")
    tr.add_argument("--init", default=None, metavar="PATH",
                    help="start from pretrained weights: a Hugging Face folder (config.json + safetensors) or a "
                         "Zarr checkpoint, quantized ones too; the architecture comes from it (overrides [model] init)")
    tr.add_argument("--out", default=None, help="output folder (overrides [output] dir)")
    tr.add_argument("--resume", default=None,
                    help="a checkpoint folder to continue from: its weights, optimizer state, LR schedule (with its "
                         "total step budget) and data position; --steps then counts the steps added")
    tr.add_argument("--no-progress", action="store_true", help="no progress bar")
    tr.add_argument("--mpi", action="store_true",
                    help="run under mpiexec -n N (N >= 3) on a dask-mpi cluster: rank 0 the scheduler, rank 1 "
                         "this command, ranks >= 2 workers (overrides [runtime] mpi)")
    for flag, what in (("--tls-ca-file", "the cluster's CA certificate"), ("--tls-cert", "this end's certificate"),
                       ("--tls-key", "this end's private key")):
        tr.add_argument(flag, default=None, help=f"TLS: {what}, a PEM file; with all three the connection "
                                                 f"(and an embedded or MPI cluster) uses tls:// "
                                                 f"(overrides [runtime] {flag[2:].replace('-', '_')})")
    tr.set_defaults(func=cmd_train)
    gen = sub.add_parser("generate", help="continue a prompt with a trained model (greedy, top-k, top-p; KV cache)")
    gen.add_argument("checkpoint", help="a checkpoint folder (tilegraph train) or a Hugging Face GPT-2/Llama folder")
    gen.add_argument("--prompt", default="def ", help="text to continue (default: %(default)r)")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="default: up to 64, within max_seq_len")
    gen.add_argument("--strategy", choices=["greedy", "sample", "top_k", "top_p"], default=None,
                     help="default: greedy, or what --top-k/--top-p imply")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                     help="divide the positive logits of tokens already in the text by X, multiply the negative "
                          "ones (Hugging Face's repetition_penalty; > 1 discourages repeats; default: 1, none)")
    gen.add_argument("--stop", action="append", metavar="STR",
                     help="stop once the new text contains STR; the text printed ends with it (repeatable; "
                          "\\n and \\t are a newline and a tab)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--tokenizer", default=None, help="'byte' or a BPE tokenizer JSON (default: the checkpoint's)")
    gen.add_argument("--local", action="store_true", help="run in this process instead of the embedded cluster")
    gen.add_argument("--ids", action="store_true", help="also print the token ids")
    gen.set_defaults(func=cmd_generate)
    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a corpus (windows spread evenly "
                                     "over it)")
    ev.add_argument("checkpoint", help="a checkpoint folder (tilegraph train) or a Hugging Face GPT-2/Llama folder")
    ev.add_argument("--data", nargs="+", metavar="FILES_OR_DIRS",
                    help="text files, or folders (their *.txt, *.md, *.rst and *.py files), to evaluate on, all "
                         "of it (default: "
                         f"{EVAL_DEFAULT_CORPUS}, the held-out text `tilegraph train` validates on)")
    ev.add_argument("--batches", type=int, default=64,
                    help="batches to evaluate, their windows spread evenly over the corpus; more than it holds "
                         "reads all of it (default: %(default)s)")
    ev.add_argument("--batch-size", type=int, default=8, help="windows per batch (default: %(default)s)")
    ev.add_argument("--seq-len", type=int, default=None,
                    help="tokens per window (default: the shipped config's seq_len, at most the model's max_seq_len)")
    ev.add_argument("--tokenizer", default=None, help="'byte' or a BPE tokenizer JSON (default: the checkpoint's)")
    ev.add_argument("--local", action="store_true", help="run in this process instead of the embedded cluster")
    ev.set_defaults(func=cmd_eval)
    info = sub.add_parser("info", help="versions, devices and the model flavors; or a checkpoint's arrays, sizes, "
                                       "quantization and metadata")
    info.add_argument("checkpoint", nargs="?", default=None, help="a Zarr checkpoint folder to describe")
    info.set_defaults(func=cmd_info)
    conv = sub.add_parser("convert", help="convert between a Hugging Face folder and a Zarr checkpoint (both ways)")
    conv.add_argument("src", help="a Hugging Face folder (config.json) or a Zarr checkpoint")
    conv.add_argument("dst", help="the folder to write (must not exist)")
    conv.add_argument("--to", choices=["zarr", "hf"], default=None,
                      help="the destination format (default: the other one)")
    conv.add_argument("--quantize", default=None, metavar="METHOD[:BITS]",
                      help="store weight matrices quantized (fp16, bf16, int8, int4, kashin:4, auto:4, ...); "
                           "norms and biases stay exact")
    conv.set_defaults(func=cmd_convert)
    args = ap.parse_args(argv)
    from tilegraph._errors import TileError

    try:
        return args.func(args)
    except TileError as e:  # bad input: one clear line, no traceback
        print(f"tilegraph {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
