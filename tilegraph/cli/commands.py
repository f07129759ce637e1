"""``tilegraph generate``, ``eval``, ``convert`` and ``info``: the commands that read checkpoints."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from tilegraph._config import number_check, require_arg
from tilegraph.io.data import JSONL_SUFFIXES, stdlib_files  # stdlib_files: the train corpus "stdlib"; public there
from tilegraph.cli.config import load_config, make_tokenizer
from tilegraph.cli.finetune import (PEFT_FILE, SKETCH_FILE, _describe, adapter_settings, adapters_only, load_model,
                                    read_peft_record, read_sketch_record)


def load_tokenizer(folder: Path, override: str | None, where: str = "tilegraph generate", *,
                   eos_from_config: bool = False):
    """The tokenizer of a checkpoint: ``override`` (byte, or a BPE JSON path), else what
    ``tilegraph train`` recorded in the folder, else an HF ``tokenizer.json`` there; with
    ``eos_from_config`` (generate: a row ends at it) that one's end-of-text token is the
    ``eos_token_id`` of the folder's ``generation_config.json`` or ``config.json``."""
    from tilegraph._errors import TileError
    from tilegraph.io import BPETokenizer, tokenizer_from_description

    if override:
        return make_tokenizer(override, f"{where} --tokenizer")
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
        tokenizer = BPETokenizer.load(folder / "tokenizer.json", eos=None)
        eos = _config_eos(folder, tokenizer) if eos_from_config else None
        return tokenizer if eos is None else BPETokenizer(tokenizer._tok, eos=eos)  # the file read once
    raise TileError(where, "a tokenizer: tilegraph_tokenizer.json or tokenizer.json in the "
                    "checkpoint folder, or --tokenizer byte|PATH", str(folder))


def _config_eos(folder: Path, tokenizer) -> str | None:
    """The end-of-text token of a Hugging Face folder, as ``transformers``' generate finds it:
    ``eos_token_id`` in ``generation_config.json``, else in ``config.json`` (the first of a list),
    else the ``eos_token`` of ``tokenizer_config.json`` (a Zarr checkpoint converted from a Hub
    folder holds only that one); None when none names one the tokenizer knows. Without it,
    generation ran past a GPT-2's ``<|endoftext|>`` (or a Llama's ``</s>``) into the next,
    unrelated document (the token itself decodes to nothing)."""
    from tilegraph.io.tokenizers import tokenizer_config_eos

    ids = config_eos_ids(folder, tokenizer.vocab_size)
    if ids:
        return tokenizer._tok.id_to_token(ids[0])
    named = tokenizer_config_eos(folder / "tokenizer_config.json")
    return named if named is not None and tokenizer._tok.token_to_id(named) is not None else None


def config_eos_ids(folder: Path, vocab_size: int) -> list[int]:
    """Every ``eos_token_id`` of a Hugging Face folder's ``generation_config.json``, else of its
    ``config.json`` (an id or a list of them), that lies in [0, vocab_size); [] where none does."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text(encoding="utf-8")).get("eos_token_id")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            continue  # absent or unreadable: the model's loader names a bad config.json
        ids = [i for i in (eos if isinstance(eos, list) else [eos])
               if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size]
        if ids:
            return ids
    return []


def unescape(text: str) -> str:
    r"""``\n``, ``\t`` and ``\\`` in a command-line argument as the characters they name (a
    shell passes ``--stop '\n'`` as a backslash and an n): generate's --prompt and --stop alike,
    so a stop string can be the prompt's own text."""
    import re

    return re.sub(r"\\([nt\\])", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def stopped_text(tokenizer, new_ids, stops, prompt_ids=()) -> tuple[str, int]:
    """The text of ``new_ids`` (after ``prompt_ids``, as generate decodes it) cut right after the
    first stop string completed in it (as :func:`tilegraph.models.generate.find_stop`), and how
    many ids made it; all of them when no stop string occurs."""
    from tilegraph.models.generate import _continuation, find_stop

    prompt_ids = np.asarray(prompt_ids, dtype=np.int64)
    prompt_text = tokenizer.decode(prompt_ids)
    for k in range(1, len(new_ids) + 1) if stops else ():
        text = _continuation(tokenizer, prompt_ids, new_ids[:k], prompt_text)
        end = find_stop(text, stops)
        if end is not None:
            return text[:end], k
    return _continuation(tokenizer, prompt_ids, new_ids, prompt_text), len(new_ids)


def check_vocabulary(model, tokenizer, folder: Path, where: str) -> None:
    """The tokenizer fits the model of ``folder``: none of its ids past the model's vocab_size
    (the embedding has no row for them). A model of more ids than the tokenizer's (a padded
    vocabulary, an --init model trained on a smaller tokenizer) is fine: generate() given the
    tokenizer picks only ids it decodes."""
    from tilegraph._errors import TileError

    have, want = tokenizer.vocab_size, model.config.vocab_size
    if have > want:
        raise TileError(where, f"a tokenizer whose ids fit the model's vocab_size={want} (--tokenizer: the one "
                        "the model was trained with)", f"{tokenizer!r} with {have} ids, {folder} with vocab_size {want}")


def other_tokenizer_warning(folder: Path, override: str | None, tokenizer, where: str) -> None:
    """A warning on stderr where ``--tokenizer`` (``override``, loaded as ``tokenizer``) is not the
    tokenizer that ``folder`` holds (its ``tilegraph_tokenizer.json``, else its ``tokenizer.json``):
    its ids are other tokens to the model (a byte tokenizer's 101 is "e", a BPE id 101 another
    piece), so a loss or a text of it means nothing, and nothing else says so. None where the folder
    holds no tokenizer, or one that cannot be read (--tokenizer is then the way round it)."""
    from tilegraph._errors import TileError

    if not override or not any((folder / n).is_file() for n in ("tilegraph_tokenizer.json", "tokenizer.json")):
        return
    try:
        own = load_tokenizer(folder, None, where)
    except (TileError, OSError, ValueError):  # (a TileError is a ValueError)
        return

    def identity(tok) -> dict:  # (a BPE tokenizer's sha256 is its JSON's, eos aside)
        return {k: v for k, v in tok.describe().items() if k in ("kind", "vocab_size", "sha256")}

    if identity(own) != identity(tokenizer):
        print(f"{where}: warning: --tokenizer {override} ({tokenizer!r}) is not the tokenizer {folder} holds "
              f"({own!r}): its ids are other tokens to that model (leave --tokenizer out to use the model's)",
              file=sys.stderr, flush=True)


def run_data(folder: Path) -> dict:
    """The settings of ``tilegraph eval`` that a checkpoint of tilegraph train records of its run's
    [data] (``tilegraph_data.json``): ``seq_len``, the length of the windows its validation loss
    was measured on; ``text_field``, its JSON Lines records' field; ``text``, the [data] keys that
    name its text (``sources``, ``patterns``, ``max_mb``, ``val_fraction``: the held-out part it
    validated on); ``tokens``, the count it read. Those it holds, checked (a record written by hand
    or damaged: none of its bad values; :func:`_checked_run_data` says what they are)."""
    return _checked_run_data(folder)[0]


def _checked_run_data(folder: Path) -> tuple[dict, str | None, dict[str, str]]:
    """The ``tilegraph_data.json`` of ``folder`` read once: (:func:`run_data`; what is wrong with
    the file, in words with its path, where it cannot be read as a JSON object, else None; key ->
    its value and what it must be, for each value that :func:`run_data` leaves out, a seq_len
    "16" say: :func:`checked_data_record`)."""
    from tilegraph.cli.runs import read_data_file

    record, unreadable = read_data_file(folder)
    out, bad = checked_data_record(record or {})
    return out, unreadable, bad


def _whole(v, low: int = 1) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _strings(v) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, str) and x for x in v)


def _fraction(v, high: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= high


#: the values of a ``tilegraph_data.json`` (tilegraph train's record of its run's [data]) -> (whether
#: one is as a run writes it, what it must be): tilegraph eval, tilegraph info and train --resume
#: check a record with them (:func:`checked_data_record`)
DATA_RECORD_CHECKS = {
    "seq_len": (_whole, "an integer >= 1"), "text_field": (lambda v: isinstance(v, str) and bool(v),
                                                           "a non-empty string"),
    "tokens": (lambda v: _whole(v, 0), "an integer >= 0"),
    "sources": (_strings, "a non-empty list of paths"), "patterns": (_strings, "a non-empty list of globs"),
    "max_mb": (lambda v: _fraction(v, float("inf")), "a number > 0"),
    "val_fraction": (lambda v: _fraction(v, 1) and v < 1, "a number > 0 and < 1"),
    "tokenizer": (lambda v: isinstance(v, str) and bool(v), 'a non-empty string: "byte" or a path')}


def checked_data_record(record: dict) -> tuple[dict, dict[str, str]]:
    """A ``tilegraph_data.json`` record (a JSON object) checked: (its values that :func:`run_data`
    returns, those of them that are as a run writes them; key -> ``"key = value (not what it must
    be)"`` for each value that is not: :data:`DATA_RECORD_CHECKS`). A key it lacks is no problem
    (an older record); one that holds what no run writes is."""
    bad = {key: f"{key} = {record[key]!r:.60} (not {want})" for key, (ok, want) in DATA_RECORD_CHECKS.items()
           if key in record and not ok(record[key])}
    out = {k: record[k] for k in ("seq_len", "text_field", "tokens") if k in record and k not in bad}
    text = {k: record.get(k) for k in ("sources", "patterns", "max_mb", "val_fraction")}
    if all(k in record and k not in bad for k in text):
        out["text"] = text
    return out, bad


#: generate()'s options that shape sampling -> the flags that set them
SAMPLING_FLAGS = {"top_k": "--top-k", "top_p": "--top-p", "temperature": "--temperature"}
_FINITE_POSITIVE = number_check(strict=True, finite=True)


def generate_options(args) -> dict:
    """generate()'s strategy, sampling options and seed from the flags of ``tilegraph generate``,
    checked before the model loads and named as flags: --strategy defaults to what --top-k and
    --top-p imply, and greedy decoding refuses the three sampling flags and --seed (it would
    ignore them); sampling without --seed draws with seed 0."""
    from tilegraph._errors import TileError

    where = "tilegraph generate"
    if args.temperature == 0:  # (an OpenAI-style "temperature 0") named as what it means
        raise TileError(where, "--temperature > 0 (for the most likely token at each step, greedy decoding: the "
                        "default, without --strategy, --top-k, --top-p, --temperature and --seed)", "--temperature=0.0")
    for flag, value, check in (("--top-k", args.top_k, number_check(1, whole=True)),
                               ("--top-p", args.top_p, number_check(strict=True, high=1)),
                               ("--temperature", args.temperature, _FINITE_POSITIVE),
                               ("--repetition-penalty", args.repetition_penalty, _FINITE_POSITIVE),
                               ("--max-new-tokens", args.max_new_tokens, number_check(whole=True)),
                               ("--seed", args.seed, number_check(whole=True))):
        if value is not None:
            require_arg(where, flag, value, check)
    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    said = " ".join(f"{SAMPLING_FLAGS[name]} {value}" for name, value in given.items())
    strategy = args.strategy or ("sample" if {"top_k", "top_p"} <= given.keys() else "top_k" if "top_k" in given
                                 else "top_p" if "top_p" in given else "greedy")
    if strategy == "greedy" and (given or args.seed is not None):  # a seed draws nothing there either
        said = " ".join([said] * bool(said) + [f"--seed {args.seed}"] * (args.seed is not None))
        raise TileError(where, "greedy decoding (the most likely token, whatever the temperature; it draws nothing, "
                        "so no --seed either) takes no --top-k, --top-p or --temperature (to sample: --strategy "
                        "sample, top_k or top_p)",
                        said + (" with --strategy greedy" if args.strategy else " (greedy: the default strategy "
                                                                                  "without --top-k or --top-p)"))
    if strategy in ("top_k", "top_p"):  # named as the option it needs
        other = "top_p" if strategy == "top_k" else "top_k"
        if strategy not in given or other in given:
            raise TileError(where, f"--strategy {strategy} needs {SAMPLING_FLAGS[strategy]} and no "
                            f"{SAMPLING_FLAGS[other]} (--strategy sample combines both)",
                            f"--strategy {strategy} {said}".rstrip())
    seed = 0 if args.seed is None else args.seed
    return {"strategy": strategy, "temperature": 1.0, **given, "repetition_penalty": args.repetition_penalty,
            "seed": seed}


def sampling_note(folder: Path, args) -> str | None:
    """A note for stderr where ``folder``'s ``generation_config.json`` asks for sampling
    (``do_sample``: a chat model's, ``temperature`` 0.6 and ``top_p`` 0.9 say), which
    transformers' ``generate`` then does by default, and ``tilegraph generate`` was given no flag
    of its own strategy: it decodes greedily, and the note names the flags that sample as
    transformers would (its ``top_k`` 50 where the file sets none). None otherwise."""
    if args.strategy is not None or args.seed is not None or any(getattr(args, n) is not None for n in SAMPLING_FLAGS):
        return None
    try:
        cfg = json.loads((folder / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(cfg, dict) or cfg.get("do_sample") is not True:
        return None

    def number(name, ok):
        v = cfg.get(name)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) and ok(v) else None

    top_k = number("top_k", lambda v: v >= 0) if "top_k" in cfg else 50   # (transformers' default; 0: none)
    top_p = number("top_p", lambda v: 0 < v < 1)
    temperature = number("temperature", lambda v: 0 < v < float("inf") and v != 1)
    flags = ([f"--top-k {int(top_k)}"] if top_k else []) + ([f"--top-p {top_p}"] if top_p else []) \
        + ([f"--temperature {temperature}"] if temperature else [])
    said = ", ".join(["do_sample=true"] + [f"{n}={cfg[n]}" for n in ("temperature", "top_k", "top_p") if n in cfg])
    return (f"tilegraph generate: note: {folder / 'generation_config.json'} samples ({said}), as transformers' "
            f"generate does by default; this decodes greedily (the most likely tokens): "
            f"{' '.join(flags or ['--strategy sample'])} samples as transformers would")


def cmd_generate(args) -> int:
    from tilegraph.cli.signals import run_stoppable

    return run_stoppable("tilegraph generate", lambda: _generate(args))


def _generate(args) -> int:
    import tilegraph as tg
    from tilegraph.models.generate import generate

    options = generate_options(args)  # first: wrong flags are named before any work
    where = "tilegraph generate"
    stops = [unescape(s) for s in args.stop or []]
    if "" in stops:  # named as the flag (generate() would name its own argument, a list)
        raise tg.TileError(where, "--stop strings of at least one character", "--stop ''")
    from tilegraph.io.tokenizers import as_text

    for stop in stops:  # non-UTF-8 bytes (a Latin-1 terminal): a stop that no text can hold went unsaid
        as_text(stop, f"{where} --stop")
    folder = Path(args.checkpoint)
    model = load_model(folder, where)  # first: a wrong path is named as one, not as a missing tokenizer
    tokenizer = load_tokenizer(folder, args.tokenizer, where, eos_from_config=True)
    text = unescape(args.prompt)  # as --stop's: "a\nb" is two lines in both
    prompt = np.asarray(tokenizer.encode(text), dtype=np.int64)
    if prompt.size == 0:
        raise tg.TileError(where, "a non-empty --prompt", repr(args.prompt))
    check_vocabulary(model, tokenizer, folder, where)
    other_tokenizer_warning(folder, args.tokenizer, tokenizer, where)
    note = sampling_note(folder, args)
    if note:
        print(note, file=sys.stderr, flush=True)
    n, limit = args.max_new_tokens, model.config.max_seq_len
    room = limit - prompt.size
    # named as the flags, before any work (generate() would name its own arguments)
    no_room = tg.TileError(where, f"a --prompt of fewer tokens than the model's max_seq_len={limit} (room for new "
                           "ones)", f"{prompt.size} tokens")
    if n is None:
        n = min(64, room)
        if n < 1:
            raise no_room
    elif n > room:
        if room < 1:
            raise no_room
        raise tg.TileError(where, f"--max-new-tokens of at most {room}: the model's max_seq_len={limit} less the "
                           f"--prompt's {prompt.size} tokens", f"--max-new-tokens={n}")
    eos = getattr(tokenizer, "eos_id", None)
    # every end-of-text id the folder's config lists (a Llama 3 chat model's <|eot_id|> beside
    # <|end_of_text|>), as transformers' generate stops at any of them
    eos_ids = ([] if eos is None else [eos]) + [i for i in config_eos_ids(folder, tokenizer.vocab_size) if i != eos]
    with (contextlib.nullcontext() if args.local else tg.connect(quiet=True, dashboard=False)) as rt:
        # the ids after a stop string are cut off below: any pad id will do
        ids = generate(model, prompt[None, :], n, eos_id=eos_ids or None, stop=stops or None, tokenizer=tokenizer,
                       pad_id=0 if stops and not eos_ids else None, runtime=rt, **options)
    new = ids[0, prompt.size:]
    ended = np.isin(new, eos_ids)
    if ended.any():  # the ids after the end of text are padding (eos again)
        new = new[:int(np.argmax(ended)) + 1]
    text, kept = stopped_text(tokenizer, new, stops, prompt)
    print(tokenizer.decode(prompt) + text)
    if args.ids:
        print(" ".join(map(str, ids[0, :prompt.size + kept].tolist())))
    return 0


#: the default corpus of `tilegraph eval`: a run's own (its checkpoint's tilegraph_data.json), else
#: as `tilegraph train` builds it with the shipped config
EVAL_DEFAULT_CORPUS = ("the validation split of the text the checkpoint's run trained on (its tilegraph_data.json), "
                       "else of the shipped config's corpus (the standard library's sources)")


def cmd_eval(args) -> int:
    """Loss and perplexity of a checkpoint on a corpus, over windows spread evenly across it."""
    from tilegraph.cli.signals import run_stoppable

    return run_stoppable("tilegraph eval", lambda: _eval(args))


def _eval(args) -> int:
    import tempfile

    import tilegraph as tg
    from tilegraph._errors import TileError
    from tilegraph.io import TokenDataset, build_token_file
    from tilegraph.io.data import DEFAULT_PATTERNS, find_sources
    from tilegraph.cli.runs import DATA_FILE
    from tilegraph.trainer import _default_row_tile, lm_loss, perplexity

    where = "tilegraph eval"
    for flag, value in (("--batches", args.batches), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise TileError(where, f"{flag} must be an integer >= 1", str(value))
    if getattr(args, "text_field", None) == "":  # (it fell back to the run's field, or "text", unsaid)
        raise TileError(where, "--text-field, the name of the field of JSON records that holds their text", "''")
    folder = Path(args.checkpoint)
    model = load_model(folder, where)
    tokenizer = load_tokenizer(folder, args.tokenizer, where)
    cfg = model.config
    check_vocabulary(model, tokenizer, folder, where)
    other_tokenizer_warning(folder, args.tokenizer, tokenizer, where)
    job, _ = load_config(None)
    d = job["data"]
    # a tilegraph train checkpoint's [data] (its windows' seq_len, its text's field) and what is wrong with it
    run, unreadable, bad = _checked_run_data(folder)
    bad.pop("tokenizer", None)  # (not eval's: it reads the tokenizer files of the checkpoint)
    # what a damaged record would have given, unless the flags name it: it measured the default
    # corpus (without --data) or windows of the shipped config's seq_len (without --seq-len), unsaid
    text_keys = ("sources", "patterns", "max_mb", "val_fraction", "tokens")
    needed = []
    if (unreadable or any(k in bad for k in text_keys)) and not args.data:
        needed.append("without --data, eval reads the held-out part of the text the run trained on, which it records "
                      "(or name text to evaluate on with --data)")
    if (unreadable or "seq_len" in bad) and args.seq_len is None:
        needed.append("without --seq-len, eval's windows are as long as the run's, its [data] seq_len, which it "
                      "records (or give --seq-len)")
    if "text_field" in bad and not (args.data or args.text_field):
        needed.append("without --text-field, eval reads the run's records by the field it records, its [data] "
                      "text_field (or give --text-field)")
    damaged = unreadable or (f"{folder / DATA_FILE}: " + ", ".join(bad.values()) if bad else None)
    if needed:
        raise TileError(where, f"a readable {DATA_FILE} in the checkpoint: " + "; ".join(needed), damaged)
    if damaged:  # the flags given replace what it would give: one line of what is not used
        print(f"{where}: warning: {damaged}: " + ("not read" if unreadable else "not used")
              + " (the flags given replace it)", file=sys.stderr, flush=True)
    seq_len = args.seq_len if args.seq_len is not None else min(run.get("seq_len", int(d["seq_len"])),
                                                                cfg.max_seq_len)
    text_field = getattr(args, "text_field", None) or run.get("text_field", "text")
    if seq_len > cfg.max_seq_len:
        raise TileError(where, f"--seq-len of at most the model's max_seq_len={cfg.max_seq_len}", str(seq_len))
    if args.data:  # the whole of the user's corpus
        sources, split, val_fraction, what = list(args.data), "train", 0.0, "the corpus"
        patterns = DEFAULT_PATTERNS
    elif "text" in run:  # the text the run trained on; only its held-out part, as its validation loss
        sources, val_fraction, split = run["text"]["sources"], run["text"]["val_fraction"], "val"
        what = f"the validation split (last {val_fraction:.0%}) of the run's text ({DATA_FILE})"
        patterns = run["text"]["patterns"]
    else:  # what `tilegraph train` trains on by default; only its held-out part
        sources, split, val_fraction = stdlib_files(d["patterns"], int(d["max_mb"] * 1e6)), "val", d["val_fraction"]
        what = f"the validation split (last {val_fraction:.0%}) of the default training corpus"
        patterns = d["patterns"]
    batch_size = args.batch_size
    if args.text_field and args.data:  # refused before the text is read: a field of records a text file has not
        try:
            found = find_sources(sources, patterns)
        except TileError:  # (build_token_file names what is wrong with the sources, below)
            found = None
        if found is not None and not any(Path(f).suffix.lower() in RECORD_SUFFIXES for f in found):
            raise _text_field_unused(args.text_field, found, "")
    with tempfile.TemporaryDirectory(prefix="tilegraph-eval-") as tmp:
        try:
            if "text" in run and not args.data:  # read as the run read it (its max_mb, its globs)
                from tilegraph.cli.train import build_corpus

                meta, _ = build_corpus({**run["text"], "text_field": text_field}, Path(tmp) / "tokens.bin", tokenizer)
            else:
                meta = build_token_file(sources, Path(tmp) / "tokens.bin", tokenizer, patterns=patterns,
                                        text_field=text_field)
        except TileError as e:  # a missing path, a binary or non-UTF-8 file, nothing found: named as --data's
            from tilegraph.cli.train import binary_token_file

            if "text" in run and not args.data:  # the run's sources, moved or changed since
                raise TileError(where, f"{e.what}: without --data, eval reads the held-out part of the text the run "
                                f"trained on, the [data] sources that {folder / DATA_FILE} records "
                                f"({', '.join(map(str, sources))}); put them back, or name text to evaluate on with "
                                "--data", e.received) from None
            what, token_file = e.what, binary_token_file(e.what, e.received)
            if token_file:  # a run's tokens.bin: "contains NUL bytes (binary?)" said no more
                what += (f": {token_file} is a token file of tilegraph (a run's tokens.bin), ids of its tokenizer; "
                         "--data takes text: the files it was made from (a run's checkpoints name them in "
                         f"{DATA_FILE})")
            elif what.startswith("each record to hold its text in the field") and "text_field" in run \
                    and not getattr(args, "text_field", None):  # where the field came from
                what += f" (the run's [data] text_field, which {folder / DATA_FILE} records)"
            elif what.startswith("no files found") and args.data:  # a folder of .jsonl, say: how to name them
                what += _other_files_hint(args.data)
            raise TileError(f"{where} --data" if args.data else where, what, e.received) from None
        if args.text_field and "text_field" not in meta:  # the run's text: text files alone (none of records)
            raise _text_field_unused(args.text_field, [src["path"] for src in meta["sources"]],
                                     f"the run's text ({folder / DATA_FILE}): ")
        if meta["count"] < seq_len + 1 or (meta["count"] - 1) // seq_len < batch_size:
            raise TileError(where, f"a corpus of at least --batch-size={batch_size} windows of --seq-len + 1 = "
                            f"{seq_len + 1} tokens", f"{meta['count']:,} tokens from {len(sources)} source(s)")
        recorded = run.get("tokens")
        if "text" in run and not args.data and recorded is not None and recorded != meta["count"] \
                and not args.tokenizer:  # (another tokenizer: other counts, and its own warning)
            print(f"{where}: warning: the run's text is not what it trained on: {meta['count']:,} tokens now, "
                  f"{recorded:,} then ({folder / DATA_FILE}); its validation split holds other windows",
                  file=sys.stderr, flush=True)
        ds = TokenDataset(Path(tmp) / "tokens.bin", seq_len, split=split, val_fraction=val_fraction)
        # the default corpus is read in its validation part only (5% of it), which may hold fewer
        # windows (eval_offsets' error named the temporary token file and batch_size, no flag)
        if ds.num_eval_windows < batch_size:
            raise TileError(where, f"{what} to hold --batch-size={batch_size} windows of --seq-len={seq_len} "
                            f"tokens ({batch_size} x {seq_len} + 1 = {batch_size * seq_len + 1:,} tokens; or a "
                            "smaller --batch-size or --seq-len)",
                            f"{ds.hi - ds.lo:,} tokens, {ds.num_eval_windows:,} window(s), from {len(sources)} "
                            "source(s)")
        batches = ds.eval_offsets(batch_size, args.batches)
        seq_from = " (the run's [data] seq_len)" if args.seq_len is None and "seq_len" in run else ""
        windows = len(batches) * batch_size
        # the settings that make two evals (and the run's val_loss) comparable, named as the flags
        asked = "" if len(batches) == args.batches else f" (--batches {args.batches}: the text holds {len(batches)})"
        print(f"tilegraph eval: {type(model).__name__} ({model.num_parameters():,} parameters) from {folder}; "
              f"{what}: {ds.hi - ds.lo:,} tokens, {windows:,} windows of {seq_len}{seq_from} spread over "
              f"{'all of it' if windows == ds.num_eval_windows else 'it'} "
              f"({windows * seq_len / (ds.hi - ds.lo):.1%} of its tokens); {len(batches):,} "
              f"batch{'es' if len(batches) != 1 else ''} of {batch_size}{asked}", flush=True)
        if "text" in run and not args.data and not args.tokenizer:  # the run's own validation text
            note = _run_validation_note(folder, args.batches, batch_size, seq_len)
            if note:
                print(note, flush=True)
        with (contextlib.nullcontext() if args.local else tg.connect(quiet=True, dashboard=False)) as rt:
            rows = getattr(model.tiling, "batch", None) or _default_row_tile(rt, batch_size, seq_len * cfg.dim)
            seq_tile = getattr(model.tiling, "seq", None)
            ev = tg.EvalStep(model, lambda m, offsets: lm_loss(m, *ds.tensors(offsets, seq_tile=seq_tile)),
                             batch_tiles=[(min(rows, batch_size),)], runtime=rt)
            loss = float(np.mean(ev.losses([(b,) for b in batches])))
    print(f"loss {loss:.4f}, perplexity {perplexity(loss):.3f}")
    return 0


#: the files whose records --text-field names a field of (the others are text, read whole)
RECORD_SUFFIXES = (*JSONL_SUFFIXES, ".json")


def _text_field_unused(field: str, files: list, whose: str, where: str = "tilegraph eval --text-field",
                       given: str | None = None):
    """The error of a text field ``field`` given for ``files`` that are text files alone (``whose``:
    what they are, before the count): a text file has no fields, and the setting was ignored
    without a word. ``where`` names the setting: eval's --text-field, or (``given``: where the
    user set it, a config file or ``--set``) train's [data] text_field."""
    from tilegraph._errors import TileError

    shown = ", ".join(str(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    named = f"--text-field {field!r}" if given is None else f"text_field = {field!r} ({given})"
    setting = "--text-field" if given is None else "[data] text_field"
    return TileError(where, "files of records among the sources (JSON Lines: "
                     f"{', '.join(JSONL_SUFFIXES)}; or .json): it names the field of their records that holds the "
                     f"text; a text file is read whole and has no fields (leave {setting} out)",
                     f"{named} with {whose}{len(files)} text file{'s' if len(files) != 1 else ''} ({shown})")


def _other_files_hint(sources: list[str]) -> str:
    """For --data folders in which no file matched the patterns eval reads: the kinds of file
    they hold, and the glob that names them ('' where they hold none): a folder of JSON Lines was
    "no files found" alone, and eval has no flag of [data] patterns."""
    from collections import Counter

    kinds = Counter()
    for source in sources:
        folder = Path(source)
        if folder.is_dir():
            for f in folder.rglob("*"):
                if f.is_file() and not f.name.startswith(".") and f.suffix:
                    kinds[(source, f.suffix)] += 1
    if not kinds:
        return ""
    shown = ", ".join(f"{n} {suffix} file{'s' if n != 1 else ''} in {source}" for (source, suffix), n in
                      kinds.most_common(4))
    (source, suffix), _ = kinds.most_common(1)[0]
    glob = f"{source.rstrip('/')}/**/*{suffix}"
    return f"; they hold {shown}: name them with a glob, e.g. --data '{glob}'"


def _run_validation_note(folder: Path, n_batches: int, batch_size: int, seq_len: int) -> str | None:
    """How an eval of a run's checkpoint ``folder`` on the run's validation text, in windows of
    ``seq_len`` (the run's) with ``n_batches`` (--batches) of ``batch_size`` (--batch-size), stands
    to the run's own validation loss: the same (its metrics.jsonl's val_loss at that step, where
    it evaluated there) or, with other settings, not comparable, naming the flags that give it.
    None where the checkpoint does not record the run's validation settings (a converted one, a
    Hugging Face folder) or they differ in seq_len."""
    from tilegraph.io.zarr import load_checkpoint

    if not (folder / "zarr.json").is_file():
        return None
    try:
        ck = load_checkpoint(folder)
        trainer, step = ck.info.get("trainer") or {}, ck.step
    except ValueError:  # (a TileError: load_model read it; a damaged one is named there)
        return None

    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    run_batches, rows, accum = (trainer.get(k) for k in ("eval_batches", "batch_size", "accum_steps"))
    run_seq_len = run_data(folder).get("seq_len")
    if not (whole(run_batches) and whole(rows) and whole(accum) and rows % accum == 0) or run_seq_len != seq_len:
        return None
    flags = f"--batches {run_batches} --batch-size {rows // accum}"
    if (n_batches, batch_size) == (run_batches, rows // accum):
        return (f"the run's own validation settings ({flags}: its eval_batches, batch_size / accum_steps): the loss "
                f"below is its val_loss at step {step} (metrics.jsonl, where it evaluated at that step)")
    return (f"the run validated with {flags} (its eval_batches, batch_size / accum_steps), not these settings: the "
            f"loss below is not comparable with its val_loss at step {step} (metrics.jsonl); {flags} gives that one")


def cmd_convert(args) -> int:
    """HF folder <-> Zarr checkpoint, optionally quantized, in the source's dtype (a float16 HF
    folder's weights stay float16, its norms and biases too; a bfloat16 one becomes float32, which
    tilegraph computes in); the line it prints names that dtype."""
    from tilegraph._errors import TileError
    from tilegraph.io.zarr import save_checkpoint

    src, dst = Path(args.src), Path(args.dst)
    where = "tilegraph convert"
    if dst.exists():
        raise TileError(where, "a destination that does not exist yet (nothing is overwritten)", f"{dst} exists")
    a, b = src.resolve(), dst.resolve()
    if a == b or a in b.parents or b in a.parents:  # the new folder would be written into the source
        raise TileError(where, "a destination outside the source folder (and not holding it)",
                        f"{dst}, " + ("the source itself" if a == b else f"inside {src}" if a in b.parents
                                      else f"which holds {src}"))
    from tilegraph.io._store import file_in_the_way

    in_the_way = file_in_the_way(dst.parent)  # (else "could not write the Hugging Face folder (File exists)")
    if in_the_way is not None:
        raise TileError(where, "a destination that can be made: a file stands where a folder above it must be "
                        "(nothing was written)", f"{dst}: {in_the_way} is a file")
    model = load_model(src, where, hf_dtype=None)  # a Hugging Face folder's own dtype: float16 stays float16
    requantized = _quantized_source_note(src, dst, args.quantize, where)
    files = {}
    # (generate's end-of-text token, and its other defaults; eval's text and seq_len: the run's
    # tilegraph_data.json, so that a quantized copy is measured on what the checkpoint is)
    for name in ("tilegraph_tokenizer.json", "bpe_tokenizer.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "tilegraph_data.json"):
        if (src / name).is_file():
            files[name] = (src / name).read_bytes()
    damaged = _damaged_files(src, files)
    if damaged:  # (they were copied as they were: the destination as damaged as the source, unsaid)
        them = "it" if len(damaged) == 1 else "them"
        raise TileError(where, "readable files beside the model (JSON objects; tilegraph_tokenizer.json describing "
                        f"a tokenizer): convert copies them into the destination as they are; restore {them} (from "
                        f"another checkpoint of the run, or where the model came from), or remove {them} to convert "
                        f"the model without {them} (nothing was written)", "; ".join(damaged))
    files.update(_hf_tokenizer_files(src, files, where))  # a checkpoint written before it held tokenizer.json
    to_zarr = args.to == "zarr" if args.to else (src / "config.json").is_file() and not (src / "zarr.json").is_file()
    if to_zarr:
        if args.quantize is not None:  # named as the flag (save_checkpoint names itself and the destination)
            from tilegraph.io.zarr import quantize_rule

            quantize_rule(args.quantize, f"{where} --quantize")
        with _named_by(where, dst):
            save_checkpoint(dst, model, quantize=args.quantize, files=files, metadata={"converted_from": str(src)})
    else:
        if args.quantize is not None:
            raise TileError(where, "--quantize applies to a Zarr destination (a Hugging Face folder holds the "
                            "dequantized weights; --to zarr writes a quantized Zarr checkpoint)",
                            f"--quantize {args.quantize or repr(args.quantize)} with " + (
                                "--to hf" if args.to else f"a Hugging Face destination, inferred from the source "
                                f"(convert writes the other format, and {src} is a Zarr checkpoint)"))
        with _named_by(where, dst):
            model.to_hf(dst)
        for name, data in files.items():
            (dst / name).write_bytes(data)
    if requantized:
        print(requantized, file=sys.stderr, flush=True)
    print(f"{src} -> {dst} ({'Zarr checkpoint' if to_zarr else 'Hugging Face folder'}, {np.dtype(model.dtype)}"
          + (f", quantized {args.quantize}" if args.quantize is not None else "") + ")")
    return 0


#: what the writers of the Python API say was kept by a failed write: earlier checkpoints, a folder
#: already at the path; a convert's destination did not exist, and nothing of it is left
_KEPT = ("; earlier checkpoints are untouched", "; a folder already there is untouched")


@contextlib.contextmanager
def _named_by(where: str, dst: Path):
    """The errors of the Python API's writers (``tilegraph.io.save_checkpoint``,
    ``tilegraph.models.X.to_hf``) of convert's destination ``dst``, named by the command as its
    other errors are (they named the function, "[tilegraph.io.save_checkpoint(DST)]", and said
    "earlier checkpoints are untouched", of a folder made new): what was wrong and the path, as
    they say it; nothing was written."""
    from tilegraph._errors import TileError

    try:
        yield
    except TileError as e:
        if not e.where.startswith(("tilegraph.io.save_checkpoint", "tilegraph.models.")):
            raise
        what = e.what
        for kept in _KEPT:
            what = what.removesuffix(kept)
        if what.startswith("could not write"):
            what += f"; nothing was written ({dst} was not made)"
        raise TileError(where, what, e.received) from None


def _quantized_source_note(src: Path, dst: Path, quantize: str | None, where: str) -> str | None:
    """The note of a convert whose source ``src`` is a quantized Zarr checkpoint: the destination
    holds its dequantized weights (in float, or quantized again by ``quantize``: that error on
    top of the source's), not the float weights it was quantized from; silently, an int4 copy
    converted to int8 read as an int8 quantization of the model. None for any other source."""
    from tilegraph.cli.finetune import quantization_summary
    from tilegraph.io.zarr import load_checkpoint

    if not (src / "zarr.json").is_file():
        return None
    summary = quantization_summary(load_checkpoint(src))  # (load_model has read it: no error here)
    if summary is None:
        return None
    how = f"quantized again as {quantize}: its error on top of theirs" if quantize is not None else "unquantized"
    return (f"{where}: note: {src} is a quantized checkpoint ({summary}): {dst} holds its dequantized weights "
            f"({how}), not the float weights they were quantized from")


def _damaged_files(src: Path, files: dict[str, bytes]) -> list[str]:
    """What is wrong with each of the JSON files convert copies from ``src`` (``files``: name ->
    bytes) that cannot be read as the commands read it, ``PATH: what`` each: not a JSON object, and
    ``tilegraph_tokenizer.json`` that describes no tokenizer (with ``bpe_tokenizer.json``) one can
    build; [] where all are readable."""
    from tilegraph._errors import TileError
    from tilegraph.io import tokenizer_from_description

    problems, read = [], {}
    for name, data in files.items():
        try:
            read[name] = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            problems.append(f"{src / name}: {type(e).__name__}: {e}")
            continue
        if not isinstance(read[name], dict):
            problems.append(f"{src / name}: {type(read[name]).__name__}, not a JSON object")
            del read[name]
    bpe_damaged = "bpe_tokenizer.json" in files and "bpe_tokenizer.json" not in read  # (said above)
    if "tilegraph_tokenizer.json" in read and not bpe_damaged:
        bpe = src / "bpe_tokenizer.json"
        if read["tilegraph_tokenizer.json"].get("kind") == "bpe" and "bpe_tokenizer.json" not in read:
            return problems + [f"{src / 'tilegraph_tokenizer.json'}: the record of a BPE tokenizer without its "
                               f"vocabulary, {bpe}"]
        try:
            tokenizer_from_description(read["tilegraph_tokenizer.json"], bpe if bpe.is_file() else None)
        except TileError as e:  # an unknown kind, a BPE record without its file or of another file
            problems.append(f"{src / 'tilegraph_tokenizer.json'}: {e.what} ({e.received})")
    return problems


def _hf_tokenizer_files(src: Path, files: dict[str, bytes], where: str) -> dict[str, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (which Hugging Face's AutoTokenizer loads)
    made from the tokenizer that ``tilegraph_tokenizer.json`` of ``src`` records, for a folder
    that has that record but no ``tokenizer.json`` (checkpoints of tilegraph train written before
    they held one); none otherwise, or, said in a line, where the record cannot be read."""
    from tilegraph._errors import TileError
    from tilegraph.io.tokenizers import hf_tokenizer_files

    if "tokenizer.json" in files or "tilegraph_tokenizer.json" not in files:
        return {}
    try:
        try:
            desc = json.loads(files["tilegraph_tokenizer.json"].decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            raise TileError(where, "a readable tokenizer description (JSON)", f"{src / 'tilegraph_tokenizer.json'}: "
                            f"{e}") from None
        made = hf_tokenizer_files(desc, files.get("bpe_tokenizer.json"))
    except TileError as e:
        print(f"{where}: no tokenizer.json written (Hugging Face's form of the tokenizer): {e.what}; received: "
              f"{e.received}", file=sys.stderr)
        return {}
    return {k: v for k, v in made.items() if k not in files}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _print_checkpoint(folder: Path, verify: bool = False) -> int:
    """Describe the checkpoint ``folder``; returns the exit status: 1 where its files are damaged
    (a chunk file missing or of the wrong size; with ``verify``, a chunk failing its CRC32C)."""
    from tilegraph._errors import TileError
    from tilegraph.cli.runs import check_checkpoint_folder
    from tilegraph.io.zarr import load_checkpoint

    if (folder / "adapter_config.json").is_file() and not (folder / "zarr.json").is_file():
        raise TileError("tilegraph info", "a Zarr checkpoint folder (a Hugging Face peft adapter folder is described "
                        "by its own adapter_config.json)", f"{folder}, {adapters_only(folder)}")
    _check_hf_config(folder)
    check_checkpoint_folder(folder, "tilegraph info", f"its config.json describes it, and `tilegraph convert "
                            f"{folder} NEW` writes it as a Zarr checkpoint")
    ck = load_checkpoint(folder)
    info = ck.info
    model = info.get("model") or {}
    print(f"checkpoint {folder}: step {ck.step}, format {info['format']} v{info['version']}, created "
          f"{info.get('created')}, {_size(folder) / 1e6:,.2f} MB on disk")
    if model.get("architecture"):
        tiling = model.get("tiling")
        print(f"model: {model['architecture']} {model.get('config')} tiling {tiling}"
              + (" (None: the dim in one tile)" if isinstance(tiling, dict) and None in tiling.values() else ""))
    stored = model.get("adapters")
    if isinstance(stored, dict) and not (folder / PEFT_FILE).is_file():  # (a run's: its fine-tuning line)
        for line in _adapter_lines(stored.get("lora"), stored.get("lotr"),
                                   " (saved with the model; generate, eval and convert merge them)"):
            print(line)
    opt = ck.optimizer_info
    if opt:
        from tilegraph.io.zarr import optimizer_array

        states = opt.get("state_names") or []
        print(f"optimizer: {opt['type']} step {opt['step_count']} lr {opt['lr']:.3g} schedule {opt.get('schedule')}"
              + (f"; its state ({', '.join(states)}) in {optimizer_array('<parameter>', '<state>', info['version'])}"
                 if states else ""))
    for line in _metadata_lines(folder, ck):
        print(line)
    record = read_peft_record(folder, "tilegraph info")
    if record is not None:
        kept = record.get("base_in_checkpoint", True)
        settings = {**adapter_settings(record), **({"dropout": record["dropout"]} if "dropout" in record else {})}
        print(f"fine-tuning ({PEFT_FILE}): {_describe(settings)}; from "
              + (f"{record['init']}" if record.get("init") else "freshly initialised weights")
              + ("" if kept else " (its quantized Linear weights are not in this checkpoint: keep it there)")
              + (f"; the adapters alone in {folder / 'adapters'}" if (folder / "adapters").is_dir() else ""))
        if record["method"] != "none":  # tilegraph train's adapters choose their graphs by FLOPs, per call
            print("  RunLoRA graphs: chosen per layer and call for the fewest FLOPs (choose = 'flops'); the "
                  "choice is not recorded in the checkpoint")
    _print_sketch(folder, ck)
    for line in _data_lines(folder):
        print(line)
    print(f"{len(ck.arrays)} arrays:")
    for name in _by_group(ck.arrays):
        a = ck.arrays[name]
        q = a.get("quantized")
        how = f"{q['method']}" + (f":{q['bits']}" if q.get("bits") else "") if q else a["dtype"]
        size = _size(folder / name)
        print(f"  {name:48} {'x'.join(map(str, a['shape'])):>14} {how:>9} {size / 1e6:9.3f} MB  tiles "
              f"{'x'.join(str(len(c)) for c in a['tiles'])}")
    problems = ck.check(read=verify)
    if problems:
        print(f"DAMAGED: {len(problems)} problem{'s' if len(problems) > 1 else ''} (loading it fails):", file=sys.stderr)
        for line in problems[:20]:
            print(f"  {line}", file=sys.stderr)
        if len(problems) > 20:
            print(f"  ... and {len(problems) - 20} more", file=sys.stderr)
        if any(line.startswith("missing:") for line in problems):  # why a chunk can be missing, once
            from tilegraph.io._store import MISSING_CHUNK_WHY

            print(f"  (a missing chunk: {MISSING_CHUNK_WHY.lstrip('; ')})", file=sys.stderr)
        return 1
    print("chunks: every chunk " + ("read, each matching its CRC32C" if verify else
                                    "file there, of its size (--verify reads them against their CRC32C)"))
    return 0


def _by_group(names) -> list[str]:
    """The array paths ``names`` with each group's together (``model``, ``optimizer/exp_avg``, ...),
    the groups in the order of their first array: a checkpoint lists a parameter's optimizer states
    one after the other, which format 3 stores in a group per state (printed in that order, the
    list went to and fro between optimizer/exp_avg/ and optimizer/exp_avg_sq/)."""
    first: dict[str, int] = {}
    for name in names:
        first.setdefault(name.rpartition("/")[0], len(first))
    return sorted(names, key=lambda name: first[name.rpartition("/")[0]])  # (stable: stored order within)


def _metadata_lines(folder: Path, ck) -> list[str]:
    """A checkpoint's metadata, in words: the adapters a ``save_adapters`` folder (or a model saved
    with them) records and the fingerprint of their base, summarised (its numbers, 16 a layer,
    stay in zarr.json: printed whole they buried the rest); any other keys as JSON."""
    from tilegraph.peft import BASE_PROBE

    meta = dict(ck.metadata or {})
    lora, lotr, probe = meta.pop("lora", None), meta.pop("lotr", None), meta.pop(BASE_PROBE, None)
    lines = []
    alone = adapters_only(folder, ck.info)
    if alone:
        lines.append(f"{alone}: no model (tilegraph.peft.load_adapters loads them onto their base)")
    lines += _adapter_lines(lora, lotr)
    if isinstance(probe, dict) and probe:
        lines.append(f"base fingerprint ({BASE_PROBE}): {_base_summary(folder, lora, lotr, len(probe))}; digest "
                     f"{_digest(probe)} (of its 16 numbers a layer, in {folder / 'zarr.json'}, which "
                     "tilegraph.peft.load_adapters checks the base it loads onto against)")
    elif probe is not None:
        meta[BASE_PROBE] = probe  # not what save_adapters writes: shown as it is
    if meta:
        lines.append(f"metadata: {json.dumps(meta)}")
    return lines


def _adapter_lines(lora, lotr, how: str = "") -> list[str]:
    """The adapters that :func:`tilegraph.peft.adapter_settings` records (``lora``: layer ->
    settings; ``lotr``: its groups), a line a kind, layers grouped by their settings; ``how``
    follows the kind's name."""
    lines = []
    if isinstance(lora, dict) and lora:
        lines.append(f"LoRA adapters{how}: " + _adapter_groups(
            {name: ("rank", s.get("rank"), "alpha", s.get("alpha"), "dropout", s.get("dropout"))
             for name, s in lora.items() if isinstance(s, dict)}))
    if isinstance(lotr, list) and lotr:
        lines.append(f"LoTR adapters{how}: " + "; ".join(
            _adapter_groups({name: ("rank", g.get("rank"), "scale", g.get("scale")) for name in g.get("layers") or []})
            + ", sharing one R and L" for g in lotr if isinstance(g, dict)))
    return lines


def _digest(value) -> str:
    """The first 12 hex digits of the SHA-256 of ``value`` as canonical JSON."""
    import hashlib

    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


def _layer_names(names: list[str]) -> str:
    """Layer names, short: ``attn.q, attn.v of blocks 0-11`` for the same layers of consecutive
    blocks, else the names (the first 8 and how many)."""
    import re

    parts = [re.fullmatch(r"(.*?blocks)\.(\d+)\.(.+)", n) for n in names]
    if names and all(parts) and len({m.group(1) for m in parts}) == 1:
        blocks = sorted({int(m.group(2)) for m in parts})
        suffixes = sorted({m.group(3) for m in parts})
        if len(names) == len(blocks) * len(suffixes):  # every suffix in every block
            span = (f"{blocks[0]}-{blocks[-1]}" if len(blocks) > 1 and blocks == list(range(blocks[0], blocks[-1] + 1))
                    else ", ".join(map(str, blocks)))
            return (f"{', '.join(suffixes)} of {parts[0].group(1)} {span} ({len(names)} layer"
                    f"{'s' if len(names) != 1 else ''})")
    return ", ".join(names[:8]) + (f", ... ({len(names)} in all)" if len(names) > 8 else "")


def _adapter_groups(settings: dict[str, tuple]) -> str:
    """Layers grouped by their settings (name -> (key, value, key, value, ...)), in words."""
    groups: dict[tuple, list[str]] = {}
    for name, values in settings.items():
        groups.setdefault(values, []).append(name)
    return "; ".join(f"{_layer_names(names)}: " + ", ".join(f"{values[i]} {values[i + 1]:g}"
                                                            if isinstance(values[i + 1], (int, float))
                                                            else f"{values[i]} {values[i + 1]!r}"
                                                            for i in range(0, len(values), 2))
                     for values, names in groups.items())


def _base_summary(folder: Path, lora, lotr, layers: int) -> str:
    """The base an adapters folder was saved on, as far as it is known: the model of the
    checkpoint it lies in (a tilegraph train run's), and the shapes of the adapted weights."""
    from collections import Counter

    shapes = Counter()
    for s in (lora or {}).values() if isinstance(lora, dict) else ():
        if isinstance(s, dict) and isinstance(s.get("shape"), list):
            shapes["x".join(map(str, s["shape"]))] += 1
    for g in lotr or [] if isinstance(lotr, list) else ():
        if isinstance(g, dict) and isinstance(g.get("shape"), list):
            shapes["x".join(map(str, g["shape"]))] += len(g.get("layers") or [])
    said = f"{layers} layer{'s' if layers != 1 else ''}"
    if shapes:
        said += " of weights " + ", ".join(f"{shape} ({n})" for shape, n in shapes.most_common())
    parent = folder.parent if folder.name not in ("", "..") else folder.resolve().parent
    if not (parent / PEFT_FILE).is_file():  # not in the checkpoint of a tilegraph train run: its base unknown
        return said
    try:
        model = json.loads((parent / "zarr.json").read_text(encoding="utf-8"))["attributes"]["tilegraph"]["model"]
        config = model["config"]
        said += (f", on the {model['architecture']} model of {parent} ({config['n_layers']} layers x {config['dim']} "
                 "wide)")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        pass
    return said


def _check_hf_config(folder: Path) -> None:
    """Refuse a Hugging Face folder (config.json, no zarr.json) whose config.json is no JSON
    object, naming what is wrong with it: check_checkpoint_folder would suggest converting it,
    which fails on the same file."""
    from tilegraph._errors import TileError

    config = folder / "config.json"
    if (folder / "zarr.json").is_file() or not config.is_file() or (folder / "adapter_config.json").is_file():
        return
    try:
        problem = None if isinstance(json.loads(config.read_text(encoding="utf-8")), dict) else "not a JSON object"
    except (OSError, UnicodeDecodeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
    if problem is not None:
        raise TileError("tilegraph info", "a checkpoint folder (RUN/checkpoints/step-N of tilegraph train); this is a "
                        "Hugging Face folder whose config.json, which describes its model, must be a JSON object (no "
                        "tilegraph command can read the folder until it is)", f"{config}: {problem}")


def _print_sketch(folder: Path, ck) -> None:
    """The weight-gradient sketch a checkpoint of tilegraph train records (:data:`SKETCH_FILE`), and
    the Linear layers it applies to in the stored model; nothing for a checkpoint without it."""
    sketch = read_sketch_record(folder, "tilegraph info")
    if sketch is None:
        return
    if sketch["grad_sketch"] == "none":
        print(f"weight gradients ({SKETCH_FILE}): exact (grad_sketch = 'none')")
        return
    layers = ""
    try:  # the layers the targets match, as the run matched them (no weights read)
        from tilegraph.sketch import apply_grad_sketch, sketched_layers

        names = list(sketched_layers(apply_grad_sketch(ck.new_model(values=False, adapters=False), sketch["sketch_targets"],
                                                       sketch["grad_sketch"], sketch["sketch_ratio"])))
        layers = f": {len(names)} Linear layer{'s' if len(names) != 1 else ''} ({', '.join(names)})"
    except ValueError:  # a TileError: a model tilegraph cannot build, targets it lacks: the record alone
        pass
    print(f"weight gradients ({SKETCH_FILE}): {_describe(sketch)}{layers}")


def _data_lines(folder: Path) -> list[str]:
    """What a checkpoint of tilegraph train records of its text (``tilegraph_data.json``) and its
    tokenizer (``tilegraph_tokenizer.json``), in words; none for a checkpoint without them."""
    from tilegraph.cli.runs import DATA_FILE, read_data_file

    lines = []
    data, damaged = read_data_file(folder)
    if damaged:  # (it was left out without a word; eval and --resume read it)
        lines.append(f"data ({DATA_FILE}): unreadable, {damaged}")
    if data is not None:
        tokens = data.get("tokens")
        shown = {k: v for k, v in data.items()
                 if k != "tokens" and not (k == "text_field" and v == "text")}  # (JSON Lines' default field: said when other)
        lines.append(f"data ({DATA_FILE}): " + ", ".join(f"{k} = {v!r}" for k, v in shown.items())
                     + (f"; {tokens:,} tokens" if isinstance(tokens, int) and not isinstance(tokens, bool) else ""))
        _, bad = checked_data_record(data)
        if bad:  # values no run writes (edited by hand, damaged): shown above without a word
            lines.append(f"data ({DATA_FILE}): bad values, {folder / DATA_FILE}: {', '.join(bad.values())} (values no "
                         "run writes: edited or damaged; tilegraph eval and train --resume refuse them where they read "
                         "them)")
    recorded = folder / "tilegraph_tokenizer.json"
    if not recorded.exists():
        return lines
    try:
        desc = json.loads(recorded.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:  # (left out without a word: generate and eval refuse it)
        desc = f"{type(e).__name__}: {e}" if isinstance(e, OSError) else str(e)
    if isinstance(desc, dict):
        lines.append("tokenizer (tilegraph_tokenizer.json): " + ", ".join(f"{k} = {v!r}" for k, v in desc.items()))
    else:
        lines.append(f"tokenizer (tilegraph_tokenizer.json): unreadable, {recorded}: "
                     + (desc if isinstance(desc, str) else f"{type(desc).__name__}, not a JSON object"))
    return lines


def cmd_info(args) -> int:
    if args.checkpoint:
        return _print_checkpoint(Path(args.checkpoint), verify=args.verify)
    if args.verify:
        from tilegraph._errors import TileError

        raise TileError("tilegraph info", "--verify with a checkpoint folder to verify", "no CHECKPOINT")
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
    from tilegraph._config import usable_cores

    usable = usable_cores()
    print(f"cpu cores: {os.cpu_count()}" + (f" ({usable} usable by this process: its CPU affinity or quota)"
                                             if usable != os.cpu_count() else ""))
    from tilegraph import models

    print("model flavors ([model] flavor = ...):")
    for name in models.FLAVORS:
        c = models.config(name)
        print(f"  {name:15} {type(c).__name__:12} {c.n_layers} layers x {c.dim} wide, {c.n_heads} heads, "
              f"vocab {c.vocab_size:,}, max_seq_len {c.max_seq_len}")
    return 0
