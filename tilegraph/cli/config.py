"""The job config of ``tilegraph train``: the shipped default, a user's TOML merged key by key,
``--set`` overrides, the checks of every key, and the model and tokenizer it describes."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from tilegraph._config import (BATCH_SPLITTING_STRATEGIES, EXCHANGES, MAX_WORKERS_VARIABLE, PARALLEL_STRATEGIES,
                               ZERO3_TASKS_WHY, is_int, number_check, one_of_check, over_worker_limit)
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
            text = Path(path).read_text(encoding="utf-8")  # TOML is UTF-8 whatever the locale
            if text.startswith("\ufeff"):  # tomllib's "Invalid statement (at line 1, column 1)" hid it
                raise TileError("tilegraph train", "a TOML config file in UTF-8 without a byte-order mark (an "
                                "editor's \"UTF-8 with BOM\": save it as plain UTF-8)", f"{path} (begins with a BOM)")
            user = tomllib.loads(text)
        except FileNotFoundError:
            # "--set train.lr= 1e-3": the space made the value the command's config file
            stray = ("" if isinstance(override_value(path), str) else
                     " (no such file: a value of --set after a space? write --set SECTION.KEY=VALUE as one word)")
            raise TileError("tilegraph train", "an existing TOML config file", f"{path}{stray}") from None
        except IsADirectoryError:
            raise TileError("tilegraph train", "a TOML config file, not a folder", f"{path} (a folder)") from None
        except OSError as e:
            raise TileError("tilegraph train", "a readable TOML config file", f"{path}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise TileError("tilegraph train", "a TOML config file in UTF-8", f"{path}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            # tomllib's words for a key or section given twice name neither
            twice = (" (a key given twice in one section, or a section twice: keep one)"
                     if "Cannot overwrite" in str(e) or "twice" in str(e) else "")
            raise TileError("tilegraph train", "a valid TOML config file" + other_format(path),
                            f"{path}: {e}{twice}") from None
        not_tables = [f"{k} = {v!r}" for k, v in user.items() if k in cfg and not isinstance(v, dict)]
        if not_tables:
            raise TileError("tilegraph train", "sections ([train], ...) that are tables of settings",
                            f"{', '.join(not_tables)} in {path}")
        # a key outside any section ("steps = 5" above the first [train]) reads as a section of its own
        unknown = [f"{k} = {v!r} outside any section{key_hint('', k, cfg)}" if not isinstance(v, dict) else
                   f"[{k}]{did_you_mean(k, cfg, '[{}]')}" for k, v in user.items() if k not in cfg]
        # each with its hint, else the keys its section has (the message lists only the sections)
        unknown += [f"{k}.{f}{key_hint(k, f, cfg) or ' ([{}] has {})'.format(k, ', '.join(cfg[k]))}"
                    for k, v in user.items() if k in cfg and k != "model" for f in v if f not in cfg[k]]
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


def other_format(path: str) -> str:
    """What to say of a config that is no TOML but another format's (JSON; YAML, or INI-style
    ``key: value`` lines), by its text, else its name's suffix; "" when it looks like neither."""
    import re

    suffix = Path(path).suffix.lower()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        text = ""
    try:
        json.loads(text)
        looks = "JSON"
    except ValueError:
        # "key: value" (YAML's mapping, "- item" its list) where TOML has "key = value"
        looks = "YAML" if text.lstrip().startswith("---") or re.search(r"(?m)^\s*(- )?[\w.-]+\s*:(\s|$)", text) else ""
    looks = looks or {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}.get(suffix, "")
    if not looks:
        return ""
    return (f" (it reads as {looks}: tilegraph train reads TOML only, [section] headers and key = value lines, "
            'e.g. [train] then steps = 100 and lr = 3e-3; see examples/configs/default.toml)')


def key_hint(section: str, key: str, cfg: dict, form: str = "{}") -> str:
    """`` (did you mean ...?)`` for an unknown ``key`` of ``[section]`` ("": outside any section):
    the section that holds a key of that name (``lr`` under [model]: [train]'s), else a close
    name in ``[section]``, else in any section; "" when none fits."""
    from tilegraph.models import FLAVORS, config

    homes = [s for s, keys in cfg.items() if key in keys and s != section]
    if not homes and section != "model" and key in model_fields(FLAVORS, config):  # [model] takes the flavor's fields
        homes = ["model"]
    if homes:
        return f" (a key of [{homes[0]}]: {homes[0]}.{key})"
    near = did_you_mean(key, cfg.get(section, {}), form)
    if near:
        return near
    return did_you_mean(key, {f"{s}.{k}": None for s, keys in cfg.items() for k in keys})


def model_fields(flavors, config) -> frozenset[str]:
    """The fields of every flavor's model config (what [model] may set)."""
    import dataclasses

    return frozenset(f.name for name in flavors for f in dataclasses.fields(config(name)))


def model_key_hint(key: str, fields) -> str:
    """The hint for ``key``, no field of the model config whose ``fields`` [model] may set: a close
    field (`` (did you mean n_layers?)``), else the section that holds it (`` (a key of [train]:
    train.lr)``); "" when neither."""
    sections = {s: keys for s, keys in load_config(None)[0].items() if s != "model"}
    return did_you_mean(key, fields) or key_hint("model", key, sections)


def did_you_mean(name: str, known, form: str = "{}") -> str:
    """`` (did you mean steps?)`` for a misspelt key among ``known`` (written as ``form``, e.g.
    "[{}]" for a section); "" when none is close."""
    import difflib

    near = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {form.format(near[0])}?)" if near else ""


def _int(low: int):
    return number_check(low, whole=True)


def _number(low: float, strict: bool = False, high: float | None = None):
    return number_check(low, strict, high, below=True)


def _text():
    return (lambda v: isinstance(v, str), "a string")


def _texts():
    return (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) for x in v),
            "a non-empty list of strings")


def _patterns():
    """File name patterns, each relative to the folders of [data] sources (``"/abs/*.txt"`` and
    ``""`` failed once the job read its data, named as [data] sources)."""
    return (lambda v: isinstance(v, list) and bool(v) and all(isinstance(x, str) and x and not os.path.isabs(x)
                                                              for x in v),
            'a non-empty list of file name patterns, each relative to the folders of sources (e.g. ["*.txt"])')


#: the largest [train] seed (--seed): a TOML integer is a signed 64-bit one, so a config cannot hold
#: more, and a seed past it failed mid-run in a kernel (a gradient sketch hashes seed + layer as 8
#: bytes: "OverflowError: int too big to convert" from 2**64 - layers on) instead of being refused
SEED_MAX = 2 ** 63 - 1

#: what each key of the job config must hold (checked after merging and --set, before any work);
#: val_fraction > 0: the job always validates (at the end, even with eval_every = 0), on at least one window
CONFIG_CHECKS = {
    "data.sources": _texts(), "data.patterns": _patterns(), "data.max_mb": _number(0, strict=True),
    "data.tokenizer": _text(), "data.text_field": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "data.seq_len": _int(1), "data.val_fraction": _number(0, strict=True, high=1),
    "train.steps": _int(1), "train.batch_size": _int(1), "train.accum_steps": _int(1),
    "train.steps_per_graph": (lambda v: v == "auto" or _int(1)[0](v), '"auto" or an integer >= 1'),
    "train.lr": _number(0, strict=True), "train.warmup": _int(0), "train.min_lr": _number(0),
    "train.weight_decay": _number(0), "train.clip_grad_norm": _number(0), "train.eval_every": _int(0),
    "train.eval_batches": _int(1),
    "train.seed": (lambda v: is_int(v, 0, SEED_MAX), "an integer in [0, 2**63 - 1]"),
    "output.dir": _text(), "output.checkpoint_every": _int(0),
    "output.checkpoint_keep": _int(0),
    "output.tensorboard": (lambda v: v is False or (v is True and has_tensorboard()),
                           f"false, or true with TensorBoard installed ({TENSORBOARD_INSTALL})"),
    "runtime.address": _text(), "runtime.workers": _int(0), "runtime.scheduler_file": _text(),
    "runtime.connect_timeout": _number(0, strict=True),
    "runtime.mpi": (lambda v: isinstance(v, bool), "true or false"), "runtime.interface": _text(),
    "runtime.tls_ca_file": _text(), "runtime.tls_cert": _text(), "runtime.tls_key": _text(),
    "runtime.parallel": one_of_check(*PARALLEL_STRATEGIES), "runtime.exchange": one_of_check(*EXCHANGES),
    "train.restart_on_failure": _int(0),
    "train.step_timeout": (lambda v: v == "auto" or _number(0)[0](v), '"auto", 0 (no limit) or seconds > 0'),
    "model.init": _text(), "model.recompute": (lambda v: isinstance(v, bool), "true or false"),
    "peft.method": one_of_check(*PEFT_METHODS), "peft.rank": _int(1), "peft.alpha": _number(0, strict=True),
    "peft.scale": _number(0, strict=True), "peft.targets": _texts(), "peft.dropout": _number(0, high=1),
    "peft.grad_sketch": one_of_check("none", *SKETCHES),
    "peft.sketch_ratio": number_check(0, strict=True, high=1),
    "peft.sketch_targets": _texts(),
}


#: spellings of a yes or no that TOML does not read as a boolean (it writes only true and false)
BOOL_SPELLINGS = ("true", "false", "yes", "no", "on", "off", "y", "n", "1", "0")


def value_hint(want: str, value) -> str:
    """`` (TOML writes ...)`` where a setting wants true or false and ``value`` is one spelt another
    way ("True", "yes", 1); `` (a string: ...)`` where it wants a list and ``value`` is one string, or
    a number and ``value`` is one in quotes ("1e-3"); "" otherwise."""
    if "true" in want and ((isinstance(value, str) and value.strip().lower() in BOOL_SPELLINGS) or
                           (not isinstance(value, bool) and isinstance(value, int) and value in (0, 1))):
        return " (TOML writes a boolean as true or false, lowercase and unquoted)"
    if "list" in want and isinstance(value, str) and value:  # sources = "data/*.txt"
        return f" (a string: write a list, {json.dumps([value])})"
    if "number" in want or "integer" in want or "seconds" in want:
        try:
            number = float(value) if isinstance(value, str) and value.strip() else None
        except ValueError:
            number = None
        if number is not None and math.isfinite(number):
            return f" (a string: write the number without quotes, {value.strip()})"
    return ""


def value_problems(cfg: dict) -> dict[str, str]:
    """``section.key`` -> what is wrong with its value, for each key of ``cfg`` that holds a value
    it must not (each key alone: :data:`CONFIG_CHECKS`, and no inf or nan anywhere)."""
    bad = {}  # setting -> what is wrong with it
    for name, (ok, want) in CONFIG_CHECKS.items():
        section, key = name.split(".")
        if key in cfg.get(section, {}) and not ok(cfg[section][key]):
            bad[name] = f"{name} must be {want}, not {cfg[section][key]!r}" + value_hint(want, cfg[section][key])
    # no setting takes inf or nan ([model] ones included): TOML and float() read both, number_check
    # lets inf through, and the job would fail on it (int(max_mb * 1e6), a time limit of inf s)
    for section, settings in cfg.items():
        for key, value in settings.items():
            if isinstance(value, float) and not math.isfinite(value):
                bad.setdefault(f"{section}.{key}", f"{section}.{key} must be a finite number, not {value!r}")
    return bad


def check_config(cfg: dict, source: str, mpi: bool = False, flags: dict[str, str] | None = None) -> None:
    """Every known key holds what it must; all problems in one error. ``mpi``: ``--mpi`` was
    given (as [runtime] mpi = true): [runtime] workers is then no count of this machine's
    processes, and ``tilegraph train`` refuses it apart, naming the launch it goes with.
    ``flags``: ``section.key`` -> the flag that set its value (``--seed``), named beside it (the
    key alone left a user of the flag looking for it in the config)."""
    from tilegraph._errors import TileError

    flags = flags or {}
    problems = [text + (f" (set by {flags[name]})" if name in flags else "")
                for name, text in value_problems(cfg).items()]
    t, p = cfg["train"], cfg.get("peft", {})
    if not problems and t["min_lr"] > t["lr"]:  # the cosine would rise from lr to min_lr: warmup_cosine refuses it
        problems.append(f"train.min_lr ({t['min_lr']!r}) must be at most train.lr ({t['lr']!r}): the learning rate "
                        "decays from lr to min_lr")
    if not problems and t["batch_size"] % t["accum_steps"]:
        problems.append(f"train.batch_size ({t['batch_size']}) must be a multiple of train.accum_steps "
                        f"({t['accum_steps']})")
    r = cfg.get("runtime", {})
    # workers is the embedded cluster's: with a cluster of another launch it is refused apart
    # (tilegraph train: "workers only for the embedded cluster"), which no check of it here precedes
    embedded = not (mpi or r.get("mpi") or r.get("address") or r.get("scheduler_file"))
    if not problems and embedded and r.get("parallel") in BATCH_SPLITTING_STRATEGIES and r.get("workers", 0) > 1 \
            and t["batch_size"] // t["accum_steps"] < r["workers"]:  # a share of each (micro-)batch per process
        problems.append(f"train.batch_size / train.accum_steps ({t['batch_size']} / {t['accum_steps']}) must give "
                        f"each of the runtime.workers ({r['workers']}) worker processes a sequence with "
                        f"runtime.parallel = {r['parallel']!r} (or runtime.parallel = \"auto\" or \"tiles\")")
    if not problems and embedded:
        problems += worker_count_problems(r)
    if not problems and r.get("parallel") == "zero3" and r.get("exchange") == "gang":
        problems.append("runtime.exchange must be \"auto\" or \"tasks\" with runtime.parallel = \"zero3\" (its "
                        f"parameters stay with their owners: {ZERO3_TASKS_WHY}), not \"gang\"")
    one_worker = embedded and r.get("workers") == 1
    if not problems and r.get("exchange", "auto") != "auto" and (r.get("parallel") == "tiles" or one_worker):
        # how the processes of a "data" or "sharded" step exchange values: neither has any here
        why = ("runtime.parallel = \"tiles\" (no process exchanges a share of the batch)" if r["parallel"] == "tiles"
               else "runtime.workers = 1 (one worker process, nothing to exchange)")
        problems.append(f"runtime.exchange must be \"auto\" with {why}: it sets how the worker processes of a "
                        f"\"data\" or \"sharded\" step exchange values, not {r['exchange']!r}")
    if not problems and p.get("method", "none") != "none" and p.get("grad_sketch", "none") != "none":
        # a sketch replaces the weight gradient of a trained Linear; adapters freeze every base weight
        problems.append(f"peft.grad_sketch must be \"none\" with peft.method = {p['method']!r} (it sketches the "
                        f"weight gradients of trained Linear layers, and the adapters freeze them), not "
                        f"{p['grad_sketch']!r}")
    if not problems and p.get("dropout", 0) and p.get("method", "none") != "lora":
        problems.append(f"peft.dropout must be 0 with peft.method = {p['method']!r} (LoRA's dropout on the "
                        f"adapters' input), not {p['dropout']!r}")
    if problems:
        raise TileError("tilegraph train", "valid settings", f"{'; '.join(problems)} (in {source})")


def worker_count_problems(runtime: dict) -> list[str]:
    """What is wrong with [runtime] workers as the number of worker processes the embedded cluster
    starts on this machine (:func:`tilegraph._config.over_worker_limit`): [] where it is within
    the limit, or where address, scheduler_file or mpi names a cluster of its own (whose workers
    it does not start; workers there is refused apart, with the launch it goes with)."""
    workers = runtime.get("workers", 0)
    if runtime.get("address") or runtime.get("scheduler_file") or runtime.get("mpi"):
        return []
    over = over_worker_limit("tilegraph train", workers)  # (None for 0: tilegraph's default count)
    if over is None:
        return []
    most, why = over
    return [f"runtime.workers must be at most {most} ({why}): the embedded cluster starts that many worker "
            f"processes on this machine, not {workers} (to start more on purpose: {MAX_WORKERS_VARIABLE}={workers} "
            "tilegraph train ...; under --mpi, runtime.address or runtime.scheduler_file the cluster brings its "
            "own workers: leave runtime.workers = 0)"]


def apply_overrides(cfg: dict, pairs: list[str]) -> None:
    """``--set section.key=value`` (the value as TOML: 1e-3, 4, true, "text"; a bare word is a
    string: :func:`override_value`)."""
    from tilegraph._errors import TileError

    refuse_repeated_keys(pairs)
    # a flavor first: switching it drops the default flavor's shape keys, never the ones given here
    for pair in sorted(pairs, key=lambda p: p.partition("=")[0].strip() != "model.flavor"):
        name, eq, text = pair.partition("=")
        section, dot, key = name.strip().partition(".")
        if not eq:  # "--set train.steps": the key may be right, the value is missing
            raise TileError("tilegraph train --set", f"section.key=value: an '=' and the value after the key "
                            f"({name.strip() or 'section.key'}=VALUE)", f"{pair!r} (no '=')")
        if not name.strip():  # "--set =2": it listed every known key as if one were misspelt
            raise TileError("tilegraph train --set", "section.key=value: the key before '=' (e.g. "
                            f"runtime.workers{pair.strip() if text.strip() else '=2'})", f"{pair!r} (no key)")
        if not dot or section not in cfg or (key not in cfg[section] and section != "model"):
            keys = [f"{s}.{k}" for s, ks in cfg.items() for k in ks]
            # "lr=1e-3" or "model.lr=1e-3": the section that has the key; else a close name
            near = key_hint(section, key, cfg, f"{section}.{{}}") if dot and section in cfg else \
                key_hint("", name.strip(), cfg) if not dot else did_you_mean(name.strip(), keys)
            what = (f"section.key=value with a known key{near}" if near else
                    f"section.key=value with a known key ({', '.join(keys)})")
            raise TileError("tilegraph train --set", what, repr(pair))
        check = CONFIG_CHECKS.get(f"{section}.{key}")
        if not text.strip() and (check is None or not check[0]("")):  # "--set runtime.workers=" (or "= 2")
            want = f": {name.strip()} must be {check[1]}" if check else ""
            raise TileError("tilegraph train --set", f"section.key=value with a value after '='{want} (no spaces "
                            f"around '=', or the pair quoted: --set '{name.strip()}=VALUE')",
                            f"{pair!r} (an empty value)")
        value = override_value(text.strip())
        if "list" in CONFIG_CHECKS.get(f"{section}.{key}", (None, ""))[1] and not isinstance(value, list):
            # "data.sources=a.txt,b.txt" or "[a.txt]": TOML's list needs each string quoted, and the
            # shell takes off quotes not inside others; one bare word read as a string is no list either
            items = [i.strip().strip("'\"") for i in text.strip().strip("[]").split(",")]
            raise TileError("tilegraph train --set", f"{name.strip()}=LIST: a TOML list of strings, each in double "
                            "quotes, the whole in single quotes for the shell, e.g. "
                            f"--set '{name.strip()}={json.dumps([i for i in items if i] or ['...'])}'", repr(pair))
        if (section, key) == ("model", "flavor") and value != cfg["model"].get("flavor"):
            # as in a config file: another flavor keeps only the keys that fit the job
            cfg["model"] = {k: v for k, v in cfg["model"].items() if k in JOB_MODEL_KEYS}
        cfg[section][key] = value


def refuse_split_set_pair(words: list[str], extras: list[str] = ()) -> None:
    """Refuse, naming --set and its form, a ``--set`` pair that the shell split at spaces around
    its '=' (``--set runtime.workers = 2``, ``--set runtime.workers =2``), or whose value after a
    space argparse could not place (``extras``: the words it did not recognise; ``my.toml --set
    train.lr= 1e-3``, ``my.toml --set train.lr 1e-3``). ``words``: the command line after
    ``tilegraph``. Argparse took the words after the key for the config file and ended in
    "unrecognized arguments: 2", or the config file in "an existing TOML config file; received: =2"."""
    import shlex

    from tilegraph._errors import TileError

    for i, word in enumerate(words):
        if word == "--set" and i + 1 < len(words):
            pair, rest, flag = words[i + 1], words[i + 2:], ["--set", words[i + 1]]
        elif word.startswith("--set="):
            pair, rest, flag = word[len("--set="):], words[i + 1:], [word]
        else:
            continue
        if not rest or rest[0].startswith("-"):
            continue
        if "=" not in pair and rest[0].startswith("="):  # "KEY = 2", "KEY =2", "KEY ="
            apart = rest[:2] if rest[0] == "=" and len(rest) > 1 and not rest[1].startswith("-") else rest[:1]
        elif rest[0] in extras and ("=" not in pair or pair.endswith("=")):  # "KEY= 2", "KEY 2" after a config
            apart = rest[:1]
        else:
            continue
        joined = (pair + "".join(apart)) if "=" in pair + apart[0] else f"{pair}={apart[0]}"
        joined += "VALUE" if joined.endswith("=") else ""  # "--set KEY =": the value is still to come
        raise TileError("tilegraph train --set", "SECTION.KEY=VALUE as one word: no spaces around '=' (or the pair "
                        "in quotes: --set 'SECTION.KEY=VALUE')",
                        f"{shlex.join(flag + apart)} (did you mean --set {shlex.quote(joined)}?)")


def refuse_repeated_keys(pairs: list[str]) -> None:
    """Refuse ``--set`` pairs that give one key two values (``--set train.steps=10 --set
    train.steps=20``): the last won without a word, and in a long command line one of the two is
    a slip, which the user is to say. The same value twice passes (nothing to choose)."""
    from tilegraph._errors import TileError

    first, clashes = {}, []  # key -> its first pair
    for pair in pairs:
        name, eq, text = pair.partition("=")
        if not eq or not name.strip():
            continue  # refused by apply_overrides, naming the pair
        earlier = first.setdefault(name.strip(), pair)
        if earlier is not pair:
            a, b = override_value(earlier.partition("=")[2].strip()), override_value(text.strip())
            if type(a) is not type(b) or a != b:
                clashes.append(f"--set {earlier.strip()} and --set {pair.strip()}")
    if clashes:
        raise TileError("tilegraph train --set", "one value per key: each key given once (a later --set does not "
                        "override an earlier one: keep the one you mean)", "; ".join(clashes))


def override_value(text: str):
    """The value of ``--set KEY=text``: TOML's (1e-3, 4, true, "text", [...]); a number that TOML
    does not read and Python does (".5", "5.") as that number; else the text itself, as a string."""
    import re
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    if re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?", text):  # ".001", "5.": TOML wants digits both sides
        return float(text)
    return text


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
    elif isinstance(fields.get("vocab_size"), str):  # "Tokenizer", "auto", "50257": the config's only word is one
        raise TileError("tilegraph train [model]", f"vocab_size: an integer >= the tokenizer's {tokenizer.vocab_size}, "
                        'or "tokenizer" (the tokenizer\'s own)', f"vocab_size = {fields['vocab_size']!r}")
    known = {f.name for f in dataclasses.fields(base)}
    unknown = sorted(set(fields) - known)
    if unknown:
        named = [u + model_key_hint(u, known) for u in unknown]
        raise TileError("tilegraph train [model]", f"fields of {type(base).__name__}: {', '.join(sorted(known))}",
                        f"unknown {', '.join(named)}")
    # a field derived from others and not given (GPT-2's hidden: 4 * dim) is derived from the given ones
    cfg = dataclasses.replace(base, **fields)
    if cfg.vocab_size < tokenizer.vocab_size:  # else training dies at the first batch holding a large id
        raise TileError("tilegraph train [model]", f"vocab_size of at least the tokenizer's {tokenizer.vocab_size} "
                        "(or vocab_size = \"tokenizer\")", f"{flavor} with vocab_size {cfg.vocab_size}")
    if seq_len is not None and cfg.max_seq_len < seq_len:
        raise TileError("tilegraph train [model]", f"max_seq_len of at least [data] seq_len = {seq_len}",
                        f"{flavor} with max_seq_len {cfg.max_seq_len}")
    return models.build(cfg, seed=seed)


def make_tokenizer(name: str, where: str = "--tokenizer"):
    """The byte tokenizer for "byte", else the BPE tokenizer of the JSON file ``name`` (``where``:
    the setting that named it, for errors)."""
    from tilegraph._errors import TileError
    from tilegraph.io import BPETokenizer, ByteTokenizer

    if name == "byte":
        return ByteTokenizer(eos=True)
    want = '"byte", or the path of a BPE tokenizer JSON file (tilegraph.io.BPETokenizer.save)'
    path = Path(name)
    if not name or not path.is_file():  # "bytes" said only "expected a tokenizer JSON file"
        if not name:
            found = "empty"
        elif not path.exists():
            found = "no such file"
        elif not path.is_dir():  # /dev/null, a pipe: there, but no file to read a tokenizer from
            found = "not a regular file"
        elif (path / "tokenizer.json").is_file():  # a Hub model's folder: the file it holds is the one
            found = f"a folder; give the file in it: {path / 'tokenizer.json'}"
        else:
            found = "a folder"
        raise TileError(where, want, f"{name!r} ({found})")
    try:
        return BPETokenizer.load(name)
    except TileError as e:  # not tokenizer JSON, not UTF-8, the tokenizers package missing
        raise TileError(where, f"{want}: {e.what}", e.received) from None
