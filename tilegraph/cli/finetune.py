"""Fine-tuning in ``tilegraph train``: starting weights (``[model] init``), adapters and gradient
sketches (``[peft]``), and the record a checkpoint of such a run keeps to rebuild its model."""

from __future__ import annotations

import json
from pathlib import Path

from tilegraph.cli.config import CONFIG_CHECKS, JOB_MODEL_KEYS, PEFT_METHODS


# ----------------------------------------------------------------------------- fine-tuning ----
#: written into every checkpoint of a run started from ``[model] init`` or with adapters: how to
#: rebuild its model (the base, the adapters), for --resume, generate, eval and convert
PEFT_FILE = "tilegraph_peft.json"

#: written into every checkpoint of tilegraph train: how the run computed its weight gradients
#: ([peft] grad_sketch), which --resume keeps; the model itself does not depend on it, so
#: generate, eval and convert never read it
SKETCH_FILE = "tilegraph_sketch.json"

#: the [peft] keys of the weight-gradient sketch (tilegraph.sketch.apply_grad_sketch)
SKETCH_KEYS = ("grad_sketch", "sketch_ratio", "sketch_targets")


def given_model_keys(cfg: dict, given: dict[str, str]) -> dict:
    """The [model] keys the user gave (``given``: :func:`tilegraph.cli.runs.given_settings`, the
    config file's and the command line's) with their values in the merged ``cfg``; not the
    shipped defaults, nor init."""
    names = {name.partition(".")[2] for name in given if name.partition(".")[0] == "model"}
    return {k: cfg["model"][k] for k in sorted(names - {"init", "recompute"}) if k in cfg["model"]}


def inherited_model_keys(cfg: dict, given: dict[str, str]) -> dict:
    """The [model] keys of the merged ``cfg`` that shape the model and that the user did not give
    (``given``: :func:`tilegraph.cli.runs.given_settings`): the shipped config's ``dim``, which a
    config naming the shipped flavor keeps (:func:`tilegraph.cli.config.load_config`), so that a
    job of that config trains it; neither the flavor nor the keys that fit the job."""
    return {k: v for k, v in cfg["model"].items()
            if f"model.{k}" not in given and k != "flavor" and k not in JOB_MODEL_KEYS}


def check_used_peft_keys(p: dict, given: dict[str, str]) -> None:
    """[peft] keys given on the command line are keys the run uses: ``--set peft.rank=4`` without
    an adapter method, say, would train every weight, the rank ignored. (A config file's are not
    checked: a copy of the shipped config holds every key, whatever the method.)"""
    from tilegraph._errors import TileError
    from tilegraph.cli.runs import on_command_line

    used = {*PEFT_METHODS[p["method"]], *(("dropout",) if p["method"] == "lora" else ())}
    if p["grad_sketch"] != "none":
        used |= {"sketch_ratio", "sketch_targets"}
    unused = [given[f"peft.{k}"] for k in p if k not in {"method", "grad_sketch"} | used
              and on_command_line(given.get(f"peft.{k}", ""))]
    if unused:
        raise TileError("tilegraph train [peft]", "settings the run uses: rank, alpha, dropout and targets with "
                        "method = \"lora\"; rank, scale and targets with \"lotr\"; sketch_ratio and sketch_targets "
                        "with a grad_sketch",
                        f"{', '.join(unused)} with method = {p['method']!r}, grad_sketch = {p['grad_sketch']!r}")


def adapter_settings(p: dict) -> dict:
    """The settings that fix a run's adapters: method and, for an adapter method, its keys."""
    return {"method": p["method"], **{k: p[k] for k in PEFT_METHODS.get(p["method"], ())}}


def _describe(settings: dict) -> str:
    return ", ".join(f"{k} = {v!r}" for k, v in settings.items())


#: what _read_record returns for a checkpoint without the record (a file of JSON null is not that)
_NO_RECORD = object()


def _read_record(f: Path, where: str):
    """The JSON of a checkpoint's record file ``f`` (:data:`_NO_RECORD` when there is none)."""
    from tilegraph._errors import TileError

    if not f.is_file():
        return _NO_RECORD
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TileError(where, f"a readable {f.name} in the checkpoint", f"{f}: {e}") from None


def read_peft_record(folder: Path, where: str) -> dict | None:
    """The record :data:`PEFT_FILE` of a checkpoint (None when it has none)."""
    from tilegraph._errors import TileError

    f = folder / PEFT_FILE
    record = _read_record(f, where)
    if record is _NO_RECORD:
        return None
    if not isinstance(record, dict) or record.get("method") not in PEFT_METHODS \
            or any(k not in record for k in PEFT_METHODS[record["method"]]):
        raise TileError(where, f"a {PEFT_FILE} naming a method ({', '.join(PEFT_METHODS)}) and its settings",
                        f"{f}: {record!r}")
    return record


def sketch_settings(p: dict) -> dict:
    """The settings that fix a run's weight gradients: grad_sketch and, for a sketch, its ratio
    and targets (what :data:`SKETCH_FILE` holds)."""
    return {k: p[k] for k in SKETCH_KEYS} if p["grad_sketch"] != "none" else {"grad_sketch": "none"}


def read_sketch_record(folder: Path, where: str) -> dict | None:
    """The record :data:`SKETCH_FILE` of a checkpoint (None when it has none: written before
    tilegraph recorded it), each value checked as the config's [peft] keys are."""
    from tilegraph._errors import TileError

    f = folder / SKETCH_FILE
    record = _read_record(f, where)
    if record is _NO_RECORD:
        return None
    if not _is_sketch_record(record):
        raise TileError(where, f"a {SKETCH_FILE} holding grad_sketch and, for a sketch, sketch_ratio and "
                        "sketch_targets, as [peft] takes them", f"{f}: {record!r}")
    return record


def _is_sketch_record(record) -> bool:
    """Whether ``record`` is what :func:`sketch_settings` makes of valid [peft] settings."""
    if not isinstance(record, dict) or "grad_sketch" not in record:
        return False
    keys = SKETCH_KEYS if record["grad_sketch"] != "none" else ("grad_sketch",)
    return set(record) == set(keys) and all(CONFIG_CHECKS[f"peft.{k}"][0](record[k]) for k in keys)


def init_model(init: str, method: str, named: str = "model.init"):
    """The model of ``[model] init`` (a Hugging Face folder or a Zarr checkpoint) and whether its
    Linear weights stay quantized: a quantized checkpoint under adapters opens with
    :func:`tilegraph.peft.from_quantized` (each tile dequantized where a step uses it), else it
    loads dequantized to train every weight. Either way adapters the checkpoint holds (saved with
    the model, or a fine-tuning run's) come merged into their layers' weights (before, the quantized
    path dropped the first and dequantized every weight of the second).

    The model loads float32, whatever the dtype it was stored in (tilegraph train trains in
    float32): a float16 (or bfloat16, float64) Hugging Face folder or Zarr checkpoint is
    converted so, in one line on stderr. A quantized base stays quantized, its tiles dequantized
    to float32 (a float16 checkpoint trained, adapters included, in float16 before).

    ``named``: what gave ``init``, as the notes on stderr name it (``--init``, ``--set model.init``,
    ``[model] init (in CONFIG)``: :func:`tilegraph.cli.train.init_source`); errors and notes
    name it so (before, an error named ``model.init``, the setting, when the user typed --init)."""
    from tilegraph.io.zarr import load_checkpoint

    where = f"tilegraph train {named}"
    folder = Path(init)
    zarr = (folder / "zarr.json").is_file()
    record = read_peft_record(folder, where) if zarr else None
    # a checkpoint of tilegraph train holds its base, unless written before quantized bases were
    # stored in them (its record names the base checkpoint, which load_model reads)
    has_base = record is None or record.get("base_in_checkpoint", True)
    ck = None
    if method != "none" and zarr and has_base:
        ck = load_checkpoint(folder)
        if any(a.get("quantized") for name, a in ck.arrays.items() if name.startswith("model/")):
            from tilegraph import peft

            # adapters it holds (tilegraph.io.save_checkpoint of an adapted model) merged, as load_model
            # merges them: those layers dequantized, the others kept quantized; [peft]'s added after
            model = peft.merge_lora(peft.from_quantized(folder, runtime=None, dtype=TRAIN_DTYPE))
            _say_widened(folder, where, stored_dtype(ck.info))
            _say_quantized(folder, where, ck, kept=True)
            return model, True
    model = load_model(folder, where, zarr_dtype=TRAIN_DTYPE)
    if method == "none":  # full fine-tuning: adapters an --init holds come merged, and merge_lora leaves
        for param in model.parameters():  # their weights frozen (every weight was: "params: empty")
            param.requires_grad = True
    if zarr:  # (opened after load_model, whose errors name what is wrong with an incomplete one)
        ck = ck or load_checkpoint(folder)
        _say_widened(folder, where, stored_dtype(ck.info))
        _say_quantized(folder, where, ck, kept=False)
    elif (folder / "config.json").is_file():
        _say_widened(folder, where)
    return model, False


#: the dtype tilegraph train trains and checkpoints in, whatever its --init was stored in
TRAIN_DTYPE = "float32"


def stored_dtype(attrs: dict) -> str:
    """The dtype of the model a Zarr checkpoint stores (``attrs``: its attributes,
    :attr:`tilegraph.io.zarr.Checkpoint.info`), as ``Checkpoint.new_model`` builds it."""
    return str((attrs.get("model") or {}).get("dtype", "float32"))


def _say_widened(folder: Path, where: str, stored: str | None = None) -> None:
    """One line on stderr when the weights of ``folder``, loaded float32 for training, were stored
    in another dtype: silently, a float16 model trained and was checkpointed as float32 (twice
    the bytes). ``stored``: a Zarr checkpoint's model dtype (:func:`stored_dtype`); None for a
    Hugging Face folder, whose dtype is read here."""
    import sys

    if stored is None:
        stored = _hf_stored_dtype(folder)
    if stored in (None, TRAIN_DTYPE):
        return
    how = "rounded" if stored == "float64" else "widened"
    print(f"{where}: the {stored} weights of {folder} were {how} to float32 for training (tilegraph train "
          "trains and checkpoints in float32)", file=sys.stderr, flush=True)


def quantization_summary(ck) -> str | None:
    """How the model weights of the Zarr checkpoint ``ck`` (opened:
    :class:`tilegraph.io.zarr.Checkpoint`) are quantized, in words, as ``tilegraph info`` names a
    quantization (``int4``, ``kashin:4``): "int4: 14 of its 36 arrays" (norms and biases are never
    quantized); None where none is."""
    from collections import Counter

    model = {name: a for name, a in ck.arrays.items() if name.startswith("model/")}
    kinds = Counter(q["method"] + (f":{q['bits']}" if q.get("bits") else "")
                    for q in (a.get("quantized") for a in model.values()) if q)
    if not kinds:
        return None
    return "; ".join(f"{kind}: {n} of its {len(model)} arrays" for kind, n in kinds.most_common())


def _say_quantized(folder: Path, where: str, ck, kept: bool) -> None:
    """One note on stderr when the init checkpoint ``ck`` (of ``folder``) stores quantized
    weights: the run starts from their dequantized values, not from the float weights they were
    quantized from (silently, an int4 checkpoint was trained as if it were the model).
    ``kept``: its Linear weights stay quantized and frozen under adapters."""
    import sys

    summary = quantization_summary(ck)
    if summary is None:
        return
    how = ("its Linear weights stay quantized and frozen, each tile dequantized to float32 where a step uses it, "
           "and the adapters train in float32" if kept else
           f"every weight trains in {TRAIN_DTYPE} from those values, stored unquantized in the run's checkpoints")
    print(f"{where}: note: {folder} is a quantized checkpoint ({summary}): the run starts from its dequantized "
          f"weights, not the float weights they were quantized from; {how}", file=sys.stderr, flush=True)


def _hf_stored_dtype(folder: Path) -> str | None:
    """The dtype the weights of the Hugging Face folder ``folder`` are stored in (None: nothing says)."""
    from tilegraph.io.hf import hf_dtype

    found = hf_dtype(folder)
    stored = None if found is None else str(found)
    if stored is None:  # bfloat16, which tilegraph reads as float32, or nothing says
        try:
            cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            cfg = None
        named = {str(cfg.get(k)).removeprefix("torch.") for k in ("torch_dtype", "dtype")} \
            if isinstance(cfg, dict) else set()
        stored = "bfloat16" if "bfloat16" in named else None
    return stored


def architecture_disagreements(model, given: dict, init: str, inherited: dict | None = None) -> list[tuple[str, str]]:
    """``(key, what disagrees)`` for each [model] key of ``given`` (key -> value) that does not
    agree with the architecture of ``model``, loaded from ``init``. ``inherited``: the [model]
    keys of the job's merged config that the user did not give (:func:`inherited_model_keys`: a
    config naming the shipped flavor keeps the shipped ``dim``), which shape the model the job
    describes too; a given flavor agrees with a model of that flavor with them (the model the
    config trains) or of the flavor alone (one built from the flavor's own shape)."""
    import dataclasses

    from tilegraph import models
    from tilegraph._errors import TileError
    from tilegraph.models._common import Derived, dropout_fields

    cfg = model.config
    # (dropout leaves the weights as they are: a job sets it on any model, see apply_dropout_keys)
    drops = dropout_fields(cfg)
    have = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in drops}
    given = {k: v for k, v in given.items() if k not in drops}
    problems = []
    if "flavor" in given:
        flavor = models.config(given["flavor"])  # an unknown name: the flavor list
        if type(flavor) is not type(cfg):
            problems.append(("flavor", f"flavor = {given['flavor']!r} is a {type(flavor).__name__}, {init} a "
                             f"{type(cfg).__name__}"))
        else:  # its shape; the job's keys (vocab_size, max_seq_len) are checked against the job
            def differences(keys: dict):
                """The job's model (the flavor with the shape ``keys``, and what they derive: GPT-2's
                hidden from dim) and the fields in which it differs from ``model``."""
                shape = {k: v for k, v in keys.items() if k in have and k not in JOB_MODEL_KEYS}
                try:
                    job = dataclasses.replace(flavor, **shape)
                except TileError:  # a bad value given: named below, against the stored one
                    job = flavor
                # runs written before GPT-2's derived hidden followed dim kept the flavor's: theirs too
                differ = [k for k in have if k not in given and k not in JOB_MODEL_KEYS
                          and getattr(job, k) != have[k] and not (k == "hidden" and have[k] == flavor.hidden)]
                derived = [k for k in differ if type(getattr(job, k)) is Derived]
                if len(derived) < len(differ):  # they follow the others named (hidden follows dim)
                    differ = [k for k in differ if k not in derived]
                return job, differ

            # the config as merged first (a config naming the shipped flavor keeps the shipped dim:
            # its own run's checkpoints have it), then the flavor with the given keys alone
            merged = {k: v for k, v in (inherited or {}).items() if k in have and k not in JOB_MODEL_KEYS}
            job, differ = differences(given)
            if merged and differ and not differences({**merged, **given})[1]:
                differ = []  # the model the config trains
            if differ:
                ours = ", ".join(f"{k} {getattr(job, k)}" for k in differ)
                problems.append(("flavor", f"flavor = {given['flavor']!r} has {ours}, {init} "
                                 + ", ".join(f"{k} {have[k]}" for k in differ)))
    for key, value in given.items():
        if key == "flavor" or (key == "vocab_size" and value == "tokenizer"):
            continue
        if key not in have:  # (a misspelt field, or another section's key: named, as build_model does)
            from tilegraph.cli.config import model_key_hint

            # every field, the dropout ones too: they were left out of the list and of the hint, so
            # that Llama's attn_dropout read as no key of [model] (attention_dropout: no "did you mean")
            fields = [f.name for f in dataclasses.fields(cfg)]
            problems.append((key, f"{key} is not a field of {type(cfg).__name__} ({', '.join(fields)})"
                                  f"{model_key_hint(key, fields)}"))
        elif value != have[key]:
            problems.append((key, f"{key} = {value!r}, {init} has {have[key]!r}"))
    return problems


def apply_dropout_keys(model, given: dict, source: str) -> None:
    """The dropout keys of [model] (``given``: key -> value, the user's) set on ``model``, loaded
    from ``source`` (model.init, --resume): dropout is no part of the architecture a loaded model
    brings (a Hugging Face GPT-2 comes with its folder's 0.1), so ``--set model.attn_dropout=0``
    changes it rather than disagreeing with it."""
    from tilegraph._errors import TileError
    from tilegraph.models._common import dropout_fields

    drops = dropout_fields(model.config)
    asked = {k: v for k, v in given.items() if k in drops}
    if asked:
        try:
            model.set_dropout(**asked)
        except TileError as e:
            raise TileError("tilegraph train [model]", e.what, f"{e.received} (on {source}'s model)") from None


def keep_stored_dropout(model, ck, where: str) -> None:
    """Set on ``model``, built from elsewhere (the base checkpoint of a run on a quantized base
    written before checkpoints held that base), the dropout that the config of checkpoint ``ck``
    (opened: :class:`tilegraph.io.zarr.Checkpoint`) stores: the run's, which its base's (a Hugging
    Face GPT-2's 0.1, say) replaced without a word. Keys the stored config lacks (a checkpoint
    written before the configs had dropout) leave the model's as they are."""
    from tilegraph._errors import TileError
    from tilegraph.models._common import dropout_fields

    stored = (ck.info.get("model") or {}).get("config")
    if not isinstance(stored, dict):
        return
    asked = {k: stored[k] for k in dropout_fields(model.config) if k in stored}
    if asked:
        try:
            model.set_dropout(**asked)
        except TileError as e:  # a value edited by hand: named with the checkpoint holding it
            raise TileError(where, e.what, f"{e.received} (in the model config of {ck.path})") from None


def check_init_fits(model, given: dict, init: str, tokenizer, seq_len: int, source: str = "model.init",
                    inherited: dict | None = None) -> None:
    """The [model] keys the user gave agree with the architecture of ``model`` (loaded from
    ``init``: the ``source`` of the job's architecture, model.init or --resume), and it fits the
    job's tokenizer and windows; every disagreement in one error. ``inherited``: the shape keys
    the job's config holds without the user's giving them (:func:`inherited_model_keys`)."""
    from tilegraph._errors import TileError

    cfg = model.config
    problems = [text for _, text in architecture_disagreements(model, given, init, inherited)]
    if problems:
        raise TileError("tilegraph train [model]", f"[model] keys that agree with {source}'s {type(cfg).__name__} "
                        f"(or none: {source} brings the architecture)", "; ".join(problems))
    if cfg.vocab_size < tokenizer.vocab_size:
        raise TileError("tilegraph train [model]", f"{source}'s vocab_size to hold the tokenizer's "
                        f"{tokenizer.vocab_size} ids ([data] tokenizer)", f"{init} with vocab_size {cfg.vocab_size}")
    if cfg.max_seq_len < seq_len:
        raise TileError("tilegraph train [model]", f"{source}'s max_seq_len to be at least [data] seq_len = "
                        f"{seq_len}", f"{init} with max_seq_len {cfg.max_seq_len}")


def add_adapters(model, p: dict, seed: int, where: str = "tilegraph train [peft]"):
    """Apply the [peft] adapters (``p``: method and its keys) to ``model`` in place; a target
    matching no layer, or a rank too large for one, is an error naming the key."""
    from tilegraph import peft
    from tilegraph._errors import TileError

    try:
        if p["method"] == "lora":
            peft.apply_lora(model, p["targets"], p["rank"], p["alpha"], p.get("dropout", 0.0), seed=seed)
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


def resume_settings(resume: str, record: dict | None, p: dict, init: str) -> str:
    """The init of a resumed run (the job's, else the one its checkpoint ``resume`` records in
    ``record``, its :data:`PEFT_FILE`), after checking that the job asks for the adapters the
    checkpoint holds."""
    from tilegraph._errors import TileError

    where = "tilegraph train --resume"
    folder = Path(resume)
    job = adapter_settings(p)
    if record is None:
        if job["method"] != "none":
            raise TileError(where, "a checkpoint of a run with the [peft] adapters asked for (to fine-tune a "
                            "checkpoint with new adapters, pass it as --init)",
                            f"{resume} holds none; {_describe(job)}")
        return init
    stored = adapter_settings(record)
    base = record.get("init") or ""
    if base and not record.get("base_in_checkpoint", True) and not (Path(base) / "zarr.json").is_file():
        raise TileError(where, "the quantized base checkpoint the run was fine-tuned from, where its record names it "
                        "(checkpoints written before tilegraph stored a quantized base in them hold only the "
                        "adapters and the other weights): put it back there", f"{folder / PEFT_FILE} names "
                        f"{base!r}, which is not a checkpoint (moved or deleted?)")
    if job != stored:
        raise TileError(where, "the [peft] settings of the run that wrote the checkpoint (its adapters are "
                        "restored as they are): leave [peft] out to take them from the checkpoint, or give the run's",
                        f"{_describe(job)} here, {_describe(stored)} in {folder / PEFT_FILE}")
    if init and base and Path(init).resolve() != Path(base).resolve():
        raise TileError(where, f"model.init to be the base of the run that wrote the checkpoint ({base}), or "
                        "left out", init)
    return init or base


def resume_model(ck, record: dict | None, method: str):
    """The model to resume the run of checkpoint ``ck`` (opened: :class:`tilegraph.io.zarr.Checkpoint`;
    ``record``: its :data:`PEFT_FILE`) on, from that checkpoint alone when it holds the base
    weights (``base_in_checkpoint``; on a quantized base, its Linear weights stay quantized, as the
    run ran), and whether they are quantized; None when the model comes from ``init`` as for a new
    run (no record of a base, or a checkpoint written before quantized bases were stored in them:
    its base is where the record says)."""
    if record is None or not record.get("init") or not record.get("base_in_checkpoint", True):
        return None
    if method != "none" and any(a.get("quantized") for name, a in ck.arrays.items() if name.startswith("model/")):
        from tilegraph import peft

        return peft.from_quantized(ck.path, runtime=None, adapters=False), True  # the adapters: added after
    model = ck.new_model(values=False, adapters=False)
    ck.load_into(model, strict=False)  # its adapters, if any, come back once they are added
    return model, False


def peft_record(p: dict, init: str, quantized_base: bool) -> dict:
    """What :data:`PEFT_FILE` holds: the adapter settings, the base (its absolute path, for the
    record: ``--resume`` checks a given init against it) and whether the checkpoint holds the
    base weights: always now (a base kept quantized is stored quantized, its parts as they are);
    False in checkpoints of runs on a quantized base written before, which read it from ``init``."""
    del quantized_base  # stored either way: tilegraph.io.save_checkpoint writes QuantizedTensors
    extra = {"dropout": p["dropout"]} if p["method"] == "lora" else {}  # not the adapters' shape: --resume takes it
    return {**adapter_settings(p), **extra, "init": str(Path(init).resolve()) if init else None,
            "base_in_checkpoint": True}


def adapted_model(folder: Path, record: dict, where: str, dtype=None):
    """The model of a checkpoint written by an adapted run, its adapters merged into the weights
    (plain Linear layers): the base from the checkpoint (weights stored quantized read
    dequantized), or, for a checkpoint of a run on a quantized base written before those were
    stored in it (``base_in_checkpoint`` false), from the recorded base checkpoint; then the
    adapters and every stored weight. ``dtype``: the model's (None: the stored one)."""
    import dataclasses

    from tilegraph import models, peft
    from tilegraph._errors import TileError
    from tilegraph.io.zarr import load_checkpoint
    from tilegraph.models._common import dropout_fields

    ck = load_checkpoint(folder)
    if record.get("base_in_checkpoint", True):
        model = ck.new_model(values=False, adapters=False, dtype=dtype)
    else:
        base = record.get("init")
        if not base or not (Path(base) / "zarr.json").is_file():
            raise TileError(where, "the quantized base checkpoint the run was fine-tuned from, where its record "
                            "names it (a checkpoint written before tilegraph stored a quantized base in them holds "
                            "only the adapters and the other weights): put it back there",
                            f"{folder / PEFT_FILE} names {base!r}, which is not a checkpoint (moved or deleted?)")
        model = models.from_zarr(base, dtype=dtype)
        stored = (ck.info.get("model") or {}).get("config")
        # the architecture alone: dropout is no part of it (a run may set its own, and a checkpoint
        # written before the configs had dropout has no such keys, where the base built now has them)
        drops = dropout_fields(model.config)
        have = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(model.config))).items()  # as stored:
                if k not in drops}  # tuples are lists
        theirs = {k: v for k, v in stored.items() if k not in drops} if isinstance(stored, dict) else stored
        if have != theirs:
            raise TileError(where, f"the base checkpoint {base} to have the run's config", f"{stored}, the base {have}")
        keep_stored_dropout(model, ck, where)  # the run's, not its base's
    add_adapters(model, record, seed=0, where=where)
    named = dict(model.named_parameters())
    unexpected = [n for n in ck.parameters if n not in named]
    if unexpected:
        raise TileError(where, f"the arrays of {folder} to match its model and the adapters of {PEFT_FILE}",
                        "unexpected: " + ", ".join(unexpected))
    ck.load_into(model, strict=record.get("base_in_checkpoint", True))
    return peft.merge_lora(model)


def load_model(folder: Path, where: str, *, hf_dtype="float32", zarr_dtype=None):
    """The model of a Zarr checkpoint or of a Hugging Face folder; a checkpoint of a run with
    adapters comes with them merged into its weights. ``hf_dtype``: the dtype a Hugging Face
    folder loads in (None: the folder's own, :func:`tilegraph.io.hf.hf_dtype`, as convert keeps
    it); ``zarr_dtype``: a Zarr checkpoint's (None: its stored dtype, as generate, eval and
    convert keep it)."""
    from tilegraph._errors import TileError
    from tilegraph import models
    from tilegraph.io.zarr import is_checkpoint

    adapters = adapters_only(folder)
    if adapters:  # it would fail as a model of an unknown class '_Adapters', or as a folder of neither kind
        raise TileError(where, "a model: a checkpoint folder (tilegraph train) or a Hugging Face folder; an "
                        "adapters folder holds the adapters without the model they adapt: "
                        + adapters_hint(folder), f"{folder}, {adapters}")
    if (folder / "zarr.json").is_file() or not (folder / "config.json").is_file():
        if not folder.exists():
            raise TileError(where, "a checkpoint folder (tilegraph train) or a Hugging Face folder",
                            f"{folder} does not exist")
        record = read_peft_record(folder, where) if (folder / "zarr.json").is_file() else None
        if record is not None:  # a run from init weights or with adapters: rebuilt as it ran, merged
            return adapted_model(folder, record, where, zarr_dtype)
        from tilegraph.cli.runs import enclosing_checkpoint

        enclosing = enclosing_checkpoint(folder)
        if enclosing is not None:  # its model/ folder, say: "a Zarr group without tilegraph's attributes"
            raise TileError(where, f"a checkpoint folder (tilegraph train), not a folder inside one: pass {enclosing}",
                            f"{folder}, inside the checkpoint {enclosing}")
        if is_checkpoint(folder) or (folder / "zarr.json").is_file():
            # raises naming what is wrong with an incomplete one; adapters it holds, merged
            from tilegraph import peft

            return peft.merge_lora(models.from_zarr(folder, dtype=zarr_dtype))
        from tilegraph.cli.runs import latest_checkpoint, run_without_checkpoint, save_folder

        if not folder.is_dir():
            raise TileError(where, "a tilegraph checkpoint folder (zarr.json) or a Hugging Face folder (config.json)",
                            f"{folder} is a file, not a folder")
        refuse_weights_without_config(folder, where)
        newest = latest_checkpoint(folder)  # a run folder of tilegraph train: its checkpoints are inside
        hint = f" (a run folder of tilegraph train: its newest checkpoint is {newest})" if newest else ""
        empty, saving = run_without_checkpoint(folder), save_folder(folder)
        if saving:  # (never loaded: its save may be under way)
            hint = f" (the temporary folder of a save: {saving})"
        elif empty:  # a run that has written none yet
            hint = f" ({empty}; a run writes one every [output] checkpoint_every steps and at its end)"
        elif not newest and any((folder / part).is_dir() and any((folder / part).glob("*/zarr.json"))
                                for part in ("model", "optimizer")):  # the arrays of a checkpoint, without its index
            hint = (" (its model/ or optimizer/ folder holds a checkpoint's arrays, but zarr.json, the checkpoint's "
                    "index of them, is missing: a damaged or partly copied checkpoint)")
        raise TileError(where, "a tilegraph checkpoint (zarr.json) or a Hugging Face folder (config.json)",
                        f"{folder} holds neither{hint}")
    check_hf_weights(folder, where)
    return models.from_hf(folder, dtype=hf_dtype)


def weights_without_config(folder: Path) -> str | None:
    """What a folder of Hugging Face weights (``*.safetensors``) without the ``config.json`` that
    describes their model holds, in words that name both (it was "holds neither", as of a folder
    with nothing of a model in it); None for any other folder."""
    if not folder.is_dir() or (folder / "config.json").is_file():
        return None
    weights = sorted(p.name for p in folder.glob("*.safetensors") if p.is_file())
    if not weights:
        return None
    shown = weights[0] if len(weights) == 1 else (f"{len(weights)} weight files ({', '.join(weights[:3])}"
                                                  + (", ...)" if len(weights) > 3 else ")"))
    # another spelling of it (Config.json, CONFIG.JSON): the loaders look for config.json alone
    other = sorted(p.name for p in folder.iterdir() if p.name.lower() == "config.json")
    return (f"{folder} holds {shown} but no config.json"
            + (f" ({other[0]} is there: the name must be config.json, in lower case)" if other else ""))


def refuse_weights_without_config(folder: Path, where: str) -> None:
    """Refuse, naming the weights and the file missing, a folder of Hugging Face weights without
    their config.json (:func:`weights_without_config`) given as a model; nothing for another."""
    from tilegraph._errors import TileError

    held = weights_without_config(folder)
    if held is not None:
        raise TileError(where, "a Hugging Face folder with its config.json beside the weights: config.json "
                        "describes the model (architecture and sizes), which is built before the weights are "
                        "read; put the config.json that came with the weights into the folder", held)


def check_hf_weights(folder: Path, where: str) -> None:
    """Refuse, before any weight is read, a Hugging Face folder whose weights tilegraph cannot
    load, named by the command: a quantized one (a ``quantization_config`` in its config.json; it
    failed as the model's "missing" and "unexpected" tensors), one of PyTorch pickles only, and one
    without weights (:func:`tilegraph.io.hf.check_float_weights`, ``check_weight_files``; they
    named ``tilegraph.models.from_hf`` or the safetensors reader). A config.json that cannot be
    read is left to the loader, which names what is wrong with it."""
    from tilegraph.io.hf import check_float_weights, check_weight_files

    try:
        hf = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if isinstance(hf, dict):
        check_float_weights(hf, folder, where, "`tilegraph convert FOLDER NEW --to zarr --quantize int4`")
    check_weight_files(folder, where)


def adapters_only(folder: Path, attrs: dict | None = None) -> str | None:
    """What ``folder`` is when it holds adapters alone (``tilegraph.peft.save_adapters``' Zarr
    checkpoint, or a Hugging Face peft folder, as ``adapters/`` and ``adapters-peft/`` in the last
    checkpoint of an adapted run), in words; None for anything else. ``attrs``: the checkpoint's
    attributes where they have been read (``Checkpoint.info``), else read here."""
    if (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():  # no model beside
        return "a Hugging Face peft adapter folder (adapter_config.json)"
    if attrs is None:
        try:
            attrs = json.loads((folder / "zarr.json").read_text(encoding="utf-8"))["attributes"]["tilegraph"]
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
            return None
    if not isinstance(attrs, dict) or not isinstance(attrs.get("model"), dict):
        return None
    meta = attrs.get("metadata")
    if isinstance(meta, dict) and (meta.get("lora") or meta.get("lotr")) and attrs["model"].get("class") == "_Adapters":
        return "the adapters alone (tilegraph.peft.save_adapters)"
    return None


def adapters_hint(folder: Path) -> str:
    """Where the model of an adapters folder is: the checkpoint it lies in (that of ``tilegraph
    train``, whose model holds them), else their base, in Python."""
    parent = folder.resolve().parent
    if (parent / "zarr.json").is_file() and (parent / PEFT_FILE).is_file():
        return f"pass the checkpoint that holds it, {parent} (its model with these adapters)"
    return ("pass the checkpoint of the run that wrote it, or load them onto their base model in Python "
            "(tilegraph.peft.load_adapters)")
