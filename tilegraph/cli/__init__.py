"""Command line: ``tilegraph train``, ``tilegraph eval``, ``tilegraph generate``, ``tilegraph info``.

``tilegraph train [CONFIG.toml]`` trains a model from a TOML config; with none, the shipped
``examples/configs/default.toml`` trains the debug GPT-2 on the Python standard library's own
``.py`` files (found at run time, so nothing is downloaded) on the embedded Dask cluster, shows
the loss fall and writes a checkpoint.
"""


from __future__ import annotations

import argparse
import errno
import os
import sys

# what the commands and tests use, importable from tilegraph.cli as before the package split
from tilegraph.cli.commands import (EVAL_DEFAULT_CORPUS, cmd_convert, cmd_eval, cmd_generate, cmd_info,
                                    load_tokenizer, stopped_text, unescape)
from tilegraph.cli.config import (CONFIG_CHECKS, DEFAULT_CONFIG, JOB_MODEL_KEYS, PEFT_METHODS, apply_overrides,
                                  build_model, check_config, load_config, make_tokenizer, refuse_split_set_pair)
from tilegraph.cli.finetune import (PEFT_FILE, add_adapters, add_grad_sketch, adapted_model, init_model, load_model,
                                    read_peft_record)
from tilegraph.cli.runs import LOCK_NAME, check_output, lock_output
from tilegraph.cli.train import EXIT_INTERRUPTED, EXIT_TERMINATED, cmd_train, tokenizer_files  # 130, 143
from tilegraph.io.data import stdlib_files

__all__ = ["main", "cmd_train", "cmd_generate", "cmd_eval", "cmd_convert", "cmd_info", "load_config", "check_config",
           "apply_overrides", "build_model", "make_tokenizer", "add_adapters", "add_grad_sketch", "adapted_model",
           "init_model", "load_model", "read_peft_record", "load_tokenizer", "stopped_text", "unescape",
           "tokenizer_files", "lock_output", "check_output", "stdlib_files", "CONFIG_CHECKS", "DEFAULT_CONFIG",
           "JOB_MODEL_KEYS", "PEFT_METHODS", "PEFT_FILE", "LOCK_NAME", "EVAL_DEFAULT_CORPUS"]


#: the exit status of a command whose reader went away (``tilegraph info | head -1``): a shell's
#: 128 + SIGPIPE, what it reports for a tool the signal ended
EXIT_BROKEN_PIPE = 141

#: the exit statuses of ``tilegraph train``, as its --help lists them
TRAIN_EXIT_STATUSES = {
    0: "the run finished (its last checkpoint written)",
    1: "an unexpected error (Python's traceback above it)",
    2: "a usage or settings error, or a failure it names (a worker lost, a loss that became NaN): one line "
       "\"tilegraph train: error: ...\"",
    EXIT_INTERRUPTED: "stopped by Ctrl-C (SIGINT): after the steps under way, with a checkpoint (a second Ctrl-C: "
                      "at once)",
    EXIT_BROKEN_PIPE: "the reader of its output went away (tilegraph train | head)",
    EXIT_TERMINATED: "stopped by SIGTERM (a batch scheduler's cancel): after the steps under way, with a checkpoint",
}


#: the flags whose value "" was taken for the flag left out (and what each wants): --resume "$CK"
#: with CK unset started a new run, --init a fresh model, --tokenizer the checkpoint's, a TLS file
#: the config's (none: plain tcp://)
EMPTY_FLAGS = {
    "--init": "a path: a checkpoint folder or a Hugging Face folder (for a fresh model, leave --init out)",
    "--resume": "a path: a checkpoint folder (RUN/checkpoints/step-N)",
    "--tls-ca-file": "a path: a PEM file", "--tls-cert": "a path: a PEM file", "--tls-key": "a path: a PEM file",
    "--tokenizer": "'byte' or the path of a BPE tokenizer JSON (for the checkpoint's own, leave --tokenizer out)",
}


#: what a path whose name is longer than the file system takes is refused as (each command
#: stat()ed it somewhere first: "OSError: [Errno 36] File name too long", a traceback)
LONG_NAME = "a path whose every name fits the file system (at most {most} bytes a name)"


def _name_max() -> int:
    try:
        return os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _shown(path) -> str:
    """``path`` for an error line: its first 40 characters, and its length."""
    text = os.fsdecode(path) if path is not None else "?"
    return (repr(text) if len(text) <= 40 else f"{text[:40]!r}... ({len(text)} characters)")


def _up_to_long(path):
    """``path`` up to its first name longer than the file system takes (the path the user gave,
    not a file looked for in it: "LONG", not "LONG/adapter_config.json"); as it is without one."""
    from pathlib import Path

    if path is None:
        return None
    parts = Path(os.fsdecode(path)).parts
    long = [i for i, part in enumerate(parts) if len(os.fsencode(part)) > _name_max()]
    return str(Path(*parts[:long[0] + 1])) if long else path


def refuse_overlong_paths(args) -> None:
    """Refuse, naming the argument, a path argument with a name longer than the file system
    takes (a prompt given as generate's CHECKPOINT, say)."""
    from pathlib import Path

    from tilegraph._errors import TileError

    most = _name_max()
    named = [(f"tilegraph {args.command}", f"{n.upper()}, ", getattr(args, n, None))
             for n in ("checkpoint", "src", "dst", "config")]
    named += [(f"tilegraph {args.command} {flag}", "", getattr(args, flag[2:].replace("-", "_"), None))
              for flag in (*EMPTY_FLAGS, "--out")]
    named += [(f"tilegraph {args.command} --data", "", d) for d in getattr(args, "data", None) or []]
    for where, label, value in named:
        if isinstance(value, str) and any(len(os.fsencode(part)) > most for part in Path(value).parts):
            raise TileError(where, label + LONG_NAME.format(most=most), _shown(value))


def _exit_statuses(statuses: dict[int, str]) -> str:
    """A --help epilog listing ``statuses`` (status -> what it means), one a line."""
    import textwrap

    return "exit status:\n" + "\n".join(textwrap.fill(what, 79, initial_indent=f"  {code:<4} ",
                                                       subsequent_indent=" " * 7)
                                         for code, what in sorted(statuses.items()))


def main(argv=None) -> int:
    """Run one ``tilegraph`` command; returns its exit status."""
    try:
        try:
            return _run(argv)
        finally:
            sys.stdout.flush()  # here, not at exit: a reader gone shows as a BrokenPipeError caught below
    except BrokenPipeError:
        # Python's "Note on SIGPIPE" (signal module docs): what is left to print goes to devnull,
        # else the flush at exit fails again; SIGPIPE stays ignored, so Dask's sockets still raise
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _run(argv) -> int:
    ap = argparse.ArgumentParser(prog="tilegraph", description="Train neural networks as tile graphs on Dask.")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a TOML config (default: the debug GPT-2 on the stdlib "
                                      "sources, embedded cluster)",
                        epilog=_exit_statuses(TRAIN_EXIT_STATUSES), formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("config", nargs="?", default=None,
                    help="TOML config; its keys override the shipped examples/configs/default.toml")
    tr.add_argument("--steps", type=int, default=None,
                    help="optimizer steps to run (overrides [train] steps); with --resume, the steps added after "
                         "the checkpoint's step (without --steps a resumed run finishes the step budget it "
                         "started with)")
    tr.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (overrides [train] lr); a resumed run keeps its checkpoint's schedule, "
                         "and another --lr is refused")
    tr.add_argument("--batch-size", type=int, default=None,
                    help="sequences per optimizer step ([train] batch_size; a resumed run keeps its checkpoint's)")
    tr.add_argument("--seed", type=int, default=None,
                    help="seed of the weights and the batch order ([train] seed; a resumed run keeps its "
                         "checkpoint's)")
    tr.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                    help="override any config key, e.g. --set model.n_layers=4 --set data.seq_len=128 (repeatable, "
                         "each key once; KEY=VALUE as one word, no spaces around '=', or the pair in quotes)")
    tr.add_argument("--init", default=None, metavar="PATH",
                    help="start from pretrained weights: a Hugging Face folder (config.json + safetensors) or a "
                         "Zarr checkpoint, quantized ones too; the architecture comes from it (overrides [model] init; "
                         "not with --resume)")
    tr.add_argument("--out", default=None,
                    help="output folder (overrides [output] dir); with --resume, default: the checkpoint's run "
                         "folder (RUN for RUN/checkpoints/step-N; a config file's [output] dir is not used)")
    tr.add_argument("--resume", default=None,
                    help="a checkpoint folder (RUN/checkpoints/step-N) to continue from: its weights, optimizer "
                         "state, LR schedule (with its total step budget), data position, [peft] adapters and "
                         "gradient sketch; the run goes on in "
                         "the checkpoint's run folder (see --out) up to its step budget (see --steps); its later "
                         "checkpoints, which this run abandons, move to checkpoints/abandoned-DATE-TIME/")
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
    gen.add_argument("--prompt", default="def ",
                     help="text to continue (default: %(default)r); \\n and \\t are a newline and a tab, as in "
                          "--stop (\\\\ for a backslash)")
    gen.add_argument("--max-new-tokens", type=int, default=None, help="default: up to 64, within max_seq_len")
    gen.add_argument("--strategy", choices=["greedy", "sample", "top_k", "top_p"], default=None,
                     help="default: greedy, or what --top-k/--top-p imply")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens")
    gen.add_argument("--top-p", type=float, default=None,
                     help="sample among the most likely tokens that together hold P of the probability")
    gen.add_argument("--temperature", type=float, default=None,
                     help="sampling: divide the logits by it (default: 1); greedy decoding takes none")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X",
                     help="divide the positive logits of tokens already in the text by X, multiply the negative "
                          "ones (Hugging Face's repetition_penalty; > 1 discourages repeats; default: 1, none)")
    gen.add_argument("--stop", action="append", metavar="STR",
                     help="stop once the new text contains STR; the text printed ends with it (repeatable; "
                          "\\n and \\t are a newline and a tab, \\\\ a backslash, as in --prompt)")
    gen.add_argument("--seed", type=int, default=None,
                     help="sampling: the seed of the draws (default: 0); greedy decoding takes none")
    gen.add_argument("--tokenizer", default=None, help="'byte' or a BPE tokenizer JSON (default: the checkpoint's)")
    gen.add_argument("--local", action="store_true", help="run in this process instead of the embedded cluster")
    gen.add_argument("--ids", action="store_true", help="also print the token ids")
    gen.set_defaults(func=cmd_generate)
    ev = sub.add_parser("eval", help="loss and perplexity of a checkpoint on a corpus (windows spread evenly "
                                     "over it)")
    ev.add_argument("checkpoint", help="a checkpoint folder (tilegraph train) or a Hugging Face GPT-2/Llama folder")
    # (extend: "--data a.txt --data b.txt" evaluated b.txt alone, a.txt dropped without a word)
    ev.add_argument("--data", nargs="+", action="extend", metavar="FILES_OR_DIRS",
                    help="text files, or folders (their *.txt, *.md, *.rst and *.py files), to evaluate on, all "
                         "of it (repeatable: --data a.txt --data b.txt reads both; default: "
                         f"{EVAL_DEFAULT_CORPUS}, the held-out text `tilegraph train` validates on)")
    ev.add_argument("--batches", type=int, default=64,
                    help="batches to evaluate, their windows spread evenly over the corpus; more than it holds "
                         "reads all of it (default: %(default)s)")
    ev.add_argument("--batch-size", type=int, default=8, help="windows per batch (default: %(default)s)")
    ev.add_argument("--seq-len", type=int, default=None,
                    help="tokens per window (default: the run's [data] seq_len its checkpoint records, else the "
                         "shipped config's; at most the model's max_seq_len)")
    ev.add_argument("--text-field", default=None, metavar="FIELD",
                    help="the field of JSON Lines / .json records that holds their text (default: the run's [data] "
                         "text_field, else 'text')")
    ev.add_argument("--tokenizer", default=None, help="'byte' or a BPE tokenizer JSON (default: the checkpoint's)")
    ev.add_argument("--local", action="store_true", help="run in this process instead of the embedded cluster")
    ev.set_defaults(func=cmd_eval)
    info = sub.add_parser("info", help="versions, devices and the model flavors; or a checkpoint's arrays, sizes, "
                                       "quantization and metadata")
    info.add_argument("checkpoint", nargs="?", default=None, help="a Zarr checkpoint folder to describe")
    info.add_argument("--verify", action="store_true",
                      help="also read every chunk and check it against its CRC32C (without it: every chunk file is "
                           "checked to be there with its size, no data read)")
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
    words = sys.argv[1:] if argv is None else list(argv)
    args, extras = ap.parse_known_args(words)
    from tilegraph._errors import TileError

    if args.command == "train":
        try:  # a --set pair split at spaces: said so before argparse's "unrecognized arguments"
            refuse_split_set_pair(words, extras)
        except TileError as e:
            print(f"tilegraph train: error: {e}", file=sys.stderr)
            return 2
    if extras:  # what parse_args says of them
        ap.error(f"unrecognized arguments: {' '.join(extras)}")
    try:
        for name in ("checkpoint", "src", "dst", "config"):  # "" is the current folder to Path: named as what it is
            if getattr(args, name, None) == "":
                raise TileError(f"tilegraph {args.command}", f"{name.upper()}, a path",
                                "'' (an empty string: an unset shell variable?)")
        for flag, what in EMPTY_FLAGS.items():  # "" was taken for the flag left out: a fresh run
            if getattr(args, flag[2:].replace("-", "_"), None) == "":  # for --resume "$CK", say
                raise TileError(f"tilegraph {args.command} {flag}", what,
                                "'' (an empty string: an unset shell variable?)")
        refuse_overlong_paths(args)
        return args.func(args)
    except TileError as e:  # bad input: one clear line, no traceback
        print(f"tilegraph {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a name too long in a path of a config or --set (the flags': refused above)
        if e.errno != errno.ENAMETOOLONG:
            raise
        error = TileError(f"tilegraph {args.command}", LONG_NAME.format(most=_name_max()),
                          _shown(_up_to_long(e.filename)))
        print(f"tilegraph {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line and a shell's 128 + SIGINT, not a traceback
        print(f"tilegraph {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
