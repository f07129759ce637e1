"""The command line as a newcomer uses it, second pass: what it did wrong, each test one defect.

- generate: --prompt "a\\nb" was sent as a backslash and an n while --stop unescaped it;
- info: a checkpoint's gradient sketch, [data] record and tokenizer were not shown, a fine-tuned
  run from fresh weights said "from None", and a run folder was named by the checkpoint loader;
- train --resume: a run folder (or a missing path) was named by the checkpoint loader; a config
  file's [output] dir (the one the printed "continue with" command repeats) sent the resumed run
  into another folder; --out into another run's folder mixed its metrics and pruned its
  checkpoints; the token count was read from the repr of the trainer state (a regex);
- eval --data and convert --quantize named library functions, not the flags.

Two 2-step runs (one with a gradient sketch) serve the tests that need a run of tilegraph train."""

import dataclasses
import json
import shutil

import pytest

from test_cli import SMALL, _cli  # the small job, and `python -m tilegraph.cli` in a subprocess


def _main(capsys, *args, code=2):
    """``tilegraph ARGS`` in this process: its exit status checked, its stdout and stderr."""
    from tilegraph.cli import main

    got = main(list(args))
    out, err = capsys.readouterr()
    assert got == code, (got, out, err)
    return out, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Hugging Face folder and a Zarr checkpoint of a debug GPT-2 (the byte tokenizer's 257 ids)."""
    from tilegraph import models
    from tilegraph.io.zarr import save_checkpoint

    root = tmp_path_factory.mktemp("saved")
    model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
    model.to_hf(root / "hf")
    save_checkpoint(root / "zarr", model)
    return root


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``sketched``: 2 steps with a gaussian gradient sketch; ``plain``: 2 steps started from
    ``own.toml`` (whose [output] dir is ``elsewhere``) with --out plain."""
    root = tmp_path_factory.mktemp("runs")
    (root / "small.toml").write_text(SMALL.replace("eval_every = 12", "eval_every = 0"))
    (root / "own.toml").write_text(SMALL.replace("eval_every = 12", "eval_every = 0") + '[output]\ndir = "elsewhere"\n')
    for args in (["small.toml", "--out", "sketched", "--set", "peft.grad_sketch=gaussian"],
                 ["own.toml", "--out", "plain"]):
        run = _cli("train", *args, "--steps", "2", "--no-progress", cwd=root)
        assert run.returncode == 0, run.stderr[-3000:]
    assert not (root / "elsewhere").exists()
    return root


# ------------------------------------------------------------------------------------ generate ----
def test_prompt_unescapes_backslash_sequences_as_stop_does(saved, capsys):
    out, _ = _main(capsys, "generate", str(saved / "zarr"), "--tokenizer", "byte", "--local", "--prompt", r"a\nb\\t",
                   "--max-new-tokens", "1", "--ids", code=0)
    text, ids = out.rstrip("\n").rsplit("\n", 1)
    assert ids.split()[:5] == ["97", "10", "98", "92", "116"], ids  # a, newline, b, backslash, t
    assert text.startswith("a\nb\\t")
    from tilegraph.cli import main

    assert "--stop" in _help(main, "generate", "--prompt")


def _help(main, command: str, flag: str) -> str:
    """The --help text of ``flag``."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(buf.getvalue().split())
    return text[text.index(f"{flag} "):][:300]


# ---------------------------------------------------------------------------------------- info ----
@pytest.mark.distributed
def test_info_shows_the_gradient_sketch_data_and_tokenizer_a_checkpoint_records(runs, capsys):
    out, _ = _main(capsys, "info", str(runs / "sketched" / "checkpoints" / "step-000002"), code=0)
    assert ("weight gradients (tilegraph_sketch.json): grad_sketch = 'gaussian', sketch_ratio = 0.2, "
            "sketch_targets = ['*.mlp.*']: 4 Linear layers (blocks.0.mlp.fc1, blocks.0.mlp.fc2, blocks.1.mlp.fc1, "
            "blocks.1.mlp.fc2)") in out, out
    tokens = json.loads((runs / "sketched" / "tokens.bin.json").read_text())["count"]
    assert f"seq_len = 32, val_fraction = 0.05; {tokens:,} tokens" in out, out
    assert "tokenizer (tilegraph_tokenizer.json): kind = 'byte', vocab_size = 257" in out, out
    out, _ = _main(capsys, "info", str(runs / "plain" / "checkpoints" / "step-000002"), code=0)
    assert "weight gradients (tilegraph_sketch.json): exact (grad_sketch = 'none')" in out, out


@pytest.mark.distributed
def test_info_of_a_lora_run_from_fresh_weights_says_so_and_what_picks_its_graphs(runs, tmp_path, capsys):
    ck = tmp_path / "lora"
    shutil.copytree(runs / "plain" / "checkpoints" / "step-000002", ck)
    (ck / "tilegraph_peft.json").write_text(json.dumps({  # as a LoRA run without --init records it
        "method": "lora", "rank": 8, "alpha": 16, "targets": ["attn.q"], "dropout": 0.1, "init": None,
        "base_in_checkpoint": True}))
    out, _ = _main(capsys, "info", str(ck), code=0)
    assert "from None" not in out and "targets = ['attn.q'], dropout = 0.1; from freshly initialised weights" in out
    assert "RunLoRA graphs: chosen per layer and call for the fewest FLOPs" in out, out


@pytest.mark.distributed
@pytest.mark.parametrize("command", [["info"], ["train", "--steps", "1", "--resume"]])
def test_a_run_folder_is_named_with_its_newest_checkpoint(runs, capsys, command):
    where = "tilegraph info" if command == ["info"] else "tilegraph train --resume"
    newest = runs / "plain" / "checkpoints" / "step-000002"
    _, err = _main(capsys, *command, str(runs / "plain"))
    assert f"[{where}] a checkpoint folder (RUN/checkpoints/step-N of tilegraph train), not the folder that holds " \
           f"them: its newest is {newest}; received: {runs / 'plain'}, a run folder" in err, err
    _, err = _main(capsys, *command, str(runs / "nowhere"))
    assert f"[{where}] a checkpoint folder" in err and "does not exist" in err, err


# ---------------------------------------------------------------------------------- train --resume ----
@pytest.mark.distributed
def test_new_checkpoints_record_their_token_count_read_without_the_trainer_state(runs):
    from tilegraph.cli.runs import read_data_record, stored_data

    record = read_data_record(runs / "sketched" / "checkpoints" / "step-000002")
    assert record["tokens"] == json.loads((runs / "sketched" / "tokens.bin.json").read_text())["count"]
    assert stored_data({}, record) == (32, record["tokens"])  # no trainer state needed
    old = "TokenDataset('t.bin', seq_len=16, split='train', tokens [0, 90) of 100)"  # before the record held it
    assert stored_data({"data": old}, {k: v for k, v in record.items() if k != "tokens"}) == (32, 100)
    assert stored_data({"data": old}) == (16, 100)


@pytest.mark.distributed
def test_a_config_files_output_dir_does_not_take_a_resumed_run_elsewhere(runs):
    # the command a stopped run prints, "tilegraph train own.toml --resume plain/checkpoints/...",
    # went on in own.toml's [output] dir, not the run's folder (--out plain)
    more = _cli("train", "own.toml", "--resume", "plain/checkpoints/step-000002", "--steps", "1", "--no-progress",
                cwd=runs)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "dir = 'elsewhere' in own.toml not used: the resumed run goes on in its checkpoint's run folder" \
           in more.stderr, more.stderr[-3000:]
    assert (runs / "plain" / "checkpoints" / "step-000003").is_dir() and not (runs / "elsewhere").exists()


@pytest.mark.distributed
def test_a_resume_into_another_runs_folder_is_refused_and_prunes_nothing(runs, capsys):
    before = sorted(p.name for p in (runs / "plain" / "checkpoints").iterdir())
    metrics = (runs / "plain" / "metrics.jsonl").read_bytes()
    _, err = _main(capsys, "train", "--resume", str(runs / "sketched" / "checkpoints" / "step-000002"),
                   "--out", str(runs / "plain"), "--steps", "1")
    assert "[tilegraph train --resume] an output folder without another run's files" in err, err
    assert "holds metrics.jsonl records and checkpoints step-" in err, err
    assert sorted(p.name for p in (runs / "plain" / "checkpoints").iterdir()) == before
    assert (runs / "plain" / "metrics.jsonl").read_bytes() == metrics


# ------------------------------------------------------------------------------ eval, convert ----
def test_eval_data_and_convert_quantize_errors_name_the_flags(saved, tmp_path, capsys):
    _, err = _main(capsys, "eval", str(saved / "zarr"), "--tokenizer", "byte", "--local", "--data",
                   str(tmp_path / "missing"))
    assert "[tilegraph eval --data] " in err and "missing" in err, err
    _, err = _main(capsys, "convert", str(saved / "hf"), str(tmp_path / "q"), "--quantize", "int3")
    assert "[tilegraph convert --quantize] unknown quantization method" in err and not (tmp_path / "q").exists()
