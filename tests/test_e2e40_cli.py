"""`tilegraph train --init`, `eval` and `info` as a user meets them (session 40's command-line
leftovers):

- a run started from a quantized Zarr checkpoint (`tilegraph convert ... --quantize int4`), by
  --init or by a config's [model] init, says once, at its start, that its weights come
  dequantized from that quantization (naming it) and what trains in float32; a float checkpoint
  says nothing of the kind;
- `tilegraph eval` of a run's checkpoint names its batches and batch size beside the windows and
  seq_len, and whether these are the run's validation settings (its loss then the run's
  val_loss, which the test compares) or which flags give that; the run's metrics.jsonl is left as
  it was (eval writes nothing into a run);
- `tilegraph info` of an adapters folder (`adapters/` of a run, `save_adapters`) summarises the
  adapters and their base's fingerprint (a 12-digit digest, the shapes, the run's model) instead
  of printing its 16 numbers a layer; a model saved with adapters names them;
- wrong inputs, each one clear line or note: a damaged tilegraph_data.json (eval measured the
  default corpus instead, unsaid) or tilegraph_tokenizer.json (info left it out), an empty path
  (info printed the versions), a file or a folder without zarr.json given to info, a quantized
  checkpoint converted (dequantized, or quantized again), `--text-field ""`, and a --data folder
  of files eval does not read by default (the glob that reads them).

One 2-step run, its int4 copy and a 1-step LoRA run from that copy serve the tests."""

import contextlib
import hashlib
import io
import json
import os
import re
from pathlib import Path

import pytest

from tilegraph import cli

from test_e2e39_cli import SMALL  # the debug GPT-2 on a little of the stdlib, one worker process

pytestmark = pytest.mark.distributed


def _main(root: Path, *args) -> tuple[int, str, str]:
    """``tilegraph ARGS`` run in ``root``: exit status, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    here = Path.cwd()
    try:
        os.chdir(root)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main([str(a) for a in args])
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A folder holding ``small.toml``, ``run`` (a 2-step run of it), ``q4`` (its last checkpoint
    converted to int4) and ``lora``, a 1-step LoRA run from ``q4`` named by a config's [model]
    init (``lora.toml``), whose stderr is in ``lora.err``."""
    root = tmp_path_factory.mktemp("e2e40cli")
    (root / "small.toml").write_text(SMALL)
    code, _, err = _main(root, "train", "small.toml", "--out", "run", "--no-progress")
    assert code == 0, err
    code, _, err = _main(root, "convert", "run/checkpoints/step-000002", "q4", "--to", "zarr",
                      "--quantize", "int4")
    assert code == 0, err
    (root / "lora.toml").write_text(SMALL.replace('vocab_size = "tokenizer"\n', 'init = "q4"\n')
                                    + '[peft]\nmethod = "lora"\ntargets = ["attn.q", "attn.v"]\n')
    code, _, err = _main(root, "train", "lora.toml", "--out", "lora", "--steps", "1", "--no-progress")
    assert code == 0, err
    (root / "lora.err").write_text(err)
    return root


def _notes(err: str) -> list[str]:
    return [line for line in err.splitlines() if "is a quantized checkpoint" in line]


# ------------------------------------------------------------ --init of a quantized checkpoint ----
def test_init_from_a_quantized_checkpoint_says_it_trains_its_dequantized_weights(root):
    """`tilegraph train --init q4` (q4: `tilegraph convert RUN q4 --quantize int4`) trained every
    weight from its int4 values, dequantized, and said only "from q4"."""
    code, out, err = _main(root, "train", "small.toml", "--init", "q4", "--out", "full", "--steps", "1",
                           "--no-progress")
    assert code == 0, err
    notes = _notes(err)
    assert len(notes) == 1, err
    assert notes[0].startswith("tilegraph train --init: note: q4 is a quantized checkpoint (int4: 14 of its 36 "
                               "arrays)"), notes
    assert "dequantized" in notes[0] and "every weight trains in float32" in notes[0]
    # what it says of the run's checkpoints: no quantized array in them
    attrs = json.loads((root / "full" / "checkpoints" / "step-000001" / "zarr.json").read_text())
    assert not any(a.get("quantized") for a in attrs["attributes"]["tilegraph"]["arrays"].values())


def test_a_configs_init_of_a_quantized_checkpoint_under_adapters_says_so_too(root):
    """[model] init = "q4" with [peft] method = "lora": the base stays int4 and frozen, said once
    at the start (before the cluster's line)."""
    err = (root / "lora.err").read_text()
    notes = _notes(err)
    assert len(notes) == 1, err
    assert "q4 is a quantized checkpoint (int4: 14 of its 36 arrays)" in notes[0]
    assert "Linear weights stay quantized and frozen" in notes[0] and "adapters train in float32" in notes[0]
    assert err.splitlines()[0] == notes[0], err


def test_init_from_a_float_checkpoint_has_no_quantization_note(root, capsys):
    from tilegraph.cli.finetune import init_model

    for method in ("none", "lora"):
        init_model(str(root / "run" / "checkpoints" / "step-000002"), method)
        assert "quantized" not in capsys.readouterr().err


# ---------------------------------------------------------------------------- eval's settings ----
def _loss(out: str) -> float:
    return float(re.search(r"^loss ([\d.]+), perplexity ([\d.]+)$", out, re.M).group(1))


def test_eval_names_its_batches_and_the_runs_validation_settings(root):
    """`tilegraph eval RUN/checkpoints/step-N` named its windows and seq_len, not its batches and
    batch size, nor whether its loss can be compared with the run's val_loss. It still writes
    nothing into the run: its metrics.jsonl is the training's log."""
    ck = "run/checkpoints/step-000002"
    metrics = (root / "run" / "metrics.jsonl").read_bytes()
    val_loss = [json.loads(x)["val_loss"] for x in metrics.decode().splitlines() if "val_loss" in x][-1]
    code, out, err = _main(root, "eval", ck, "--batches", 1, "--batch-size", 4, "--local")
    assert code == 0, err
    assert "4 windows of 32 (the run's [data] seq_len) spread over it (5.1% of its tokens); 1 batch of 4\n" in out
    assert ("the run's own validation settings (--batches 1 --batch-size 4: its eval_batches, batch_size / "
            "accum_steps): the loss below is its val_loss at step 2") in out
    assert _loss(out) == pytest.approx(val_loss, abs=1e-4)
    # the defaults (64 batches of 8): as many batches as the validation split holds, said so
    code, out, err = _main(root, "eval", ck, "--local")
    assert code == 0, err
    n = int(re.search(r"; (\d+) batches of 8 \(--batches 64: the text holds (\d+)\)\n", out).group(1))
    assert f"{n * 8} windows of 32" in out and n < 64
    assert ("the run validated with --batches 1 --batch-size 4 (its eval_batches, batch_size / accum_steps), not "
            "these settings: the loss below is not comparable with its val_loss at step 2") in out
    assert (root / "run" / "metrics.jsonl").read_bytes() == metrics
    # a converted copy records no validation settings: nothing said of them
    code, out, err = _main(root, "eval", "q4", "--batches", 1, "--batch-size", 4, "--local")
    assert code == 0, err
    assert "1 batch of 4" in out and "val_loss" not in out


# --------------------------------------------------------------------- info of an adapters folder ----
def test_info_of_a_runs_adapters_summarises_their_base_fingerprint(root):
    """`tilegraph info RUN/checkpoints/step-N/adapters` printed "metadata: {...}" with each layer's
    16-number fingerprint of its base (base_probe) and every dropout seed: one line of 2,000+
    characters."""
    folder = root / "lora" / "checkpoints" / "step-000001" / "adapters"
    code, out, err = _main(root, "info", "lora/checkpoints/step-000001/adapters")
    assert code == 0, err
    probe = json.loads((folder / "zarr.json").read_text())["attributes"]["tilegraph"]["metadata"]["base_probe"]
    digest = hashlib.sha256(json.dumps(probe, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    assert "metadata:" not in out and "dropout_seed" not in out
    assert all(len(line) < 400 for line in out.splitlines()), out
    assert not any(repr(v) in out for v in probe["blocks.0.attn.q"])  # the numbers stay in zarr.json
    assert "the adapters alone (tilegraph.peft.save_adapters): no model" in out
    assert "LoRA adapters: attn.q, attn.v of blocks 0-1 (4 layers): rank 8, alpha 16, dropout 0\n" in out
    assert (f"base fingerprint (base_probe): 4 layers of weights 64x64 (4), on the gpt2 model of "
            f"lora/checkpoints/step-000001 (2 layers x 64 wide); digest {digest} (of its 16 numbers a layer, in "
            f"lora/checkpoints/step-000001/adapters/zarr.json") in out


def test_info_of_saved_adapters_outside_a_run(tmp_path, capsys):
    """LoTR and LoRA adapters saved from Python: grouped by settings, their shapes, no base model
    to name; a model saved with adapters names them; a checkpoint's other metadata is still shown
    as JSON."""
    from tilegraph import models, peft
    from tilegraph.io import save_checkpoint

    model = peft.apply_lotr(models.build("gpt2-debug", seed=0), ["attn.q", "attn.v"], rank=4, scale=1.0)
    peft.apply_lora(model, ["mlp.fc1"], rank=2, alpha=4)
    peft.save_adapters(tmp_path / "ad", model)
    assert cli.main(["info", str(tmp_path / "ad")]) == 0
    out = capsys.readouterr().out
    assert "LoRA adapters: mlp.fc1 of blocks 0-1 (2 layers): rank 2, alpha 4, dropout 0\n" in out
    assert "LoTR adapters: attn.q, attn.v of blocks 0-1 (4 layers): rank 4, scale 1, sharing one R and L\n" in out
    assert re.search(r"base fingerprint \(base_probe\): 6 layers of weights 32x32 \(4\), 32x128 \(2\); digest "
                     r"[0-9a-f]{12} \(", out), out
    # the model saved with them: info named no adapters (only their arrays, lora_u ...)
    save_checkpoint(tmp_path / "whole", model)
    assert cli.main(["info", str(tmp_path / "whole")]) == 0
    out = capsys.readouterr().out
    assert ("LoRA adapters (saved with the model; generate, eval and convert merge them): mlp.fc1 of blocks 0-1 "
            "(2 layers): rank 2, alpha 4, dropout 0\n") in out
    assert "LoTR adapters (saved with the model; generate, eval and convert merge them): attn.q, attn.v" in out
    save_checkpoint(tmp_path / "meta", models.build("gpt2-debug", seed=0), metadata={"note": "hello"})
    assert cli.main(["info", str(tmp_path / "meta")]) == 0
    out = capsys.readouterr().out
    assert 'metadata: {"note": "hello"}\n' in out and "adapters:" not in out and "base_probe" not in out


# ------------------------------------------------ info / eval / convert / generate on wrong inputs ----
def _error(root: Path, *args) -> str:
    """The one line of error of ``tilegraph ARGS`` run in ``root`` (exit status 2)."""
    code, _, err = _main(root, *args)
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err.strip()


def test_a_damaged_data_record_is_named_not_replaced_by_the_default_corpus(root, tmp_path):
    """A checkpoint whose tilegraph_data.json cannot be read: eval measured the standard library's
    sources in windows of 64 instead of the run's text, without a word, and info left it out."""
    import shutil

    for text, problem in (("{bad", "Expecting property name"), ('"x"', "str, not a JSON object")):
        ck = tmp_path / f"ck{len(text)}"
        shutil.copytree(root / "run" / "checkpoints" / "step-000002", ck)
        (ck / "tilegraph_data.json").write_text(text)
        err = _error(root, "eval", ck, "--local")
        assert err.startswith("tilegraph eval: error: [tilegraph eval] a readable tilegraph_data.json in the "
                              "checkpoint: without --data, eval reads the held-out part of the text the run trained "
                              "on, which it records (or name text to evaluate on with --data); without --seq-len, "
                              "eval's windows are as long as the run's, its [data] seq_len, which it records (or give "
                              f"--seq-len); received: {ck}/tilegraph_data.json: "), err
        assert problem in err
        code, out, err = _main(root, "info", ck)
        assert code == 0, err
        assert f"data (tilegraph_data.json): unreadable, {ck}/tilegraph_data.json: " in out and problem in out
        # with --data the record is not needed
        code, out, err = _main(root, "eval", ck, "--data", "small.toml", "--batches", 1, "--batch-size", 2,
                               "--seq-len", 16, "--local")
        assert code == 0, err


@pytest.mark.parametrize("args, name", [(["info", ""], "CHECKPOINT"), (["eval", "", "--local"], "CHECKPOINT"),
                                        (["generate", "", "--local"], "CHECKPOINT"), (["convert", "", "x"], "SRC"),
                                        (["convert", "run/checkpoints/step-000002", ""], "DST")])
def test_an_empty_path_is_named_as_one(root, args, name):
    """`tilegraph info ""` (an unset shell variable) printed the versions, as `tilegraph info`;
    eval, generate and convert took "" for the current folder ("received: . exists")."""
    command = args[0]
    assert _error(root, *args) == (f"tilegraph {command}: error: [tilegraph {command}] {name}, a path; received: '' "
                                   "(an empty string: an unset shell variable?)")


def test_info_of_what_is_no_checkpoint_is_named_by_the_command(root, tmp_path):
    """A file, an empty folder and a checkpoint without its zarr.json were named by the loader
    ("[tilegraph.io.load_checkpoint(PATH)] ... received: PATH is not one"), the last without
    saying what is missing."""
    import shutil

    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "empty").mkdir()
    shutil.copytree(root / "run" / "checkpoints" / "step-000002", tmp_path / "half")
    (tmp_path / "half" / "zarr.json").unlink()
    want = "tilegraph info: error: [tilegraph info] a checkpoint folder (RUN/checkpoints/step-N of tilegraph train); "
    assert _error(root, "info", tmp_path / "notes.txt") == (
        want + f"received: {tmp_path}/notes.txt is a file, not a folder")
    assert _error(root, "info", tmp_path / "empty") == want + f"received: {tmp_path}/empty holds none (no zarr.json)"
    assert _error(root, "info", tmp_path / "half") == want + (
        f"received: {tmp_path}/half, whose model/ or optimizer/ folder holds a checkpoint's arrays but whose "
        "zarr.json, the checkpoint's index of them, is missing: a damaged or partly copied checkpoint")


def test_convert_of_a_quantized_checkpoint_says_it_writes_its_dequantized_weights(root, tmp_path):
    """`tilegraph convert q4 q8 --quantize int8` (q4 an int4 copy) wrote an int8 quantization of the
    int4 values and said "quantized int8" alone; to a Hugging Face folder, the dequantized weights."""
    code, out, err = _main(root, "convert", "q4", tmp_path / "q8", "--to", "zarr", "--quantize", "int8")
    assert code == 0, err
    assert err.strip() == (f"tilegraph convert: note: q4 is a quantized checkpoint (int4: 14 of its 36 "
                           f"arrays): {tmp_path}/q8 holds its dequantized weights (quantized again as int8: its error "
                           "on top of theirs), not the float weights they were quantized from"), err
    code, out, err = _main(root, "convert", "q4", tmp_path / "hf")
    assert code == 0, err
    assert "holds its dequantized weights (unquantized), not the float weights" in err
    code, out, err = _main(root, "convert", "run/checkpoints/step-000002", tmp_path / "z", "--to", "zarr",
                           "--quantize", "int8")
    assert code == 0 and err == "", err


def test_eval_refuses_an_empty_text_field(root):
    """`--text-field ""` fell back to the run's field (or "text") without a word."""
    assert _error(root, "eval", "run/checkpoints/step-000002", "--text-field", "", "--local").endswith(
        "[tilegraph eval] --text-field, the name of the field of JSON records that holds their text; received: ''")


def test_eval_of_a_folder_of_json_lines_names_the_glob_that_reads_them(root, tmp_path):
    """`--data FOLDER` of .jsonl files was "no files found (folders are searched for *.txt, *.md,
    *.rst, *.py)" alone, and eval has no flag for [data] patterns: a glob names them."""
    folder = tmp_path / "jl"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": f"hello world {i} " * 5}) + "\n" for i in range(50)))
    err = _error(root, "eval", "run/checkpoints/step-000002", "--data", folder, "--local")
    glob = f"{folder}/**/*.jsonl"
    assert err.endswith(f"no files found (folders are searched for *.txt, *.md, *.rst, *.py); they hold 1 .jsonl file "
                        f"in {folder}: name them with a glob, e.g. --data '{glob}'; received: {folder}"), err
    code, out, err = _main(root, "eval", "run/checkpoints/step-000002", "--data", glob, "--batches", 1,
                           "--batch-size", 2, "--local")
    assert code == 0, err
    assert re.search(r"^loss [\d.]+, perplexity [\d.]+$", out, re.M)


def test_info_names_an_unreadable_tokenizer_record(root, tmp_path):
    """info left a damaged tilegraph_tokenizer.json out without a word (generate and eval refuse it)."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(root / "run" / "checkpoints" / "step-000002", ck)
    for text, problem in (("{bad", "Expecting property name"), ("[1]", "list, not a JSON object")):
        (ck / "tilegraph_tokenizer.json").write_text(text)
        code, out, err = _main(root, "info", ck)
        assert code == 0, err
        assert f"tokenizer (tilegraph_tokenizer.json): unreadable, {ck}/tilegraph_tokenizer.json: {problem}" in out, out
