"""An audit of the models' dropout (GPT2Config's embd_/attn_/resid_dropout, LlamaConfig's
attn_dropout, ``set_dropout``, the HF keys, Zarr checkpoints and ``tilegraph train --set
model.*_dropout``) as a new user tries it. What it found:

- ``tilegraph train --init FOLDER --set model.KEY=...`` with a key no field of the config named
  the config's fields without the dropout ones (Llama's list had no attn_dropout at all), and
  ``attention_dropout`` / ``attn_pdrop`` (HF's names) got no "did you mean attn_dropout?", as they
  do without --init;
- a checkpoint whose stored config holds a value its config refuses (attn_dropout 1.5, edited)
  failed as ``[tilegraph.models.GPT2Config] ...``, naming neither the checkpoint nor its
  zarr.json;
- a load whose arrays do not match the model blamed the config's dropout ("the checkpoint holds
  another model: its config has attn_dropout 0.1, the model's 0.0") although dropout is no part of
  the architecture and the restore itself ignores it;
- a checkpoint of a run on a quantized base written before checkpoints held that base (its record
  says base_in_checkpoint false) was refused by eval, generate and convert once the configs had
  dropout fields (the run's stored config has none, the base built now has them: "the base
  checkpoint to have the run's config"), and where both have them, a run that set its own dropout
  loaded, and resumed, with its base's instead.
"""

import dataclasses
import json
import shutil

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft

DROPS = ("embd_dropout", "attn_dropout", "resid_dropout")


def _edit_config(folder, **changes):
    """Change (a value) or remove (None) keys of the model config stored in ``folder``'s zarr.json."""
    path = folder / "zarr.json"
    doc = json.loads(path.read_text())
    config = doc["attributes"]["tilegraph"]["model"]["config"]
    for k, v in changes.items():
        if v is None:
            config.pop(k, None)
        else:
            config[k] = v
    path.write_text(json.dumps(doc))


# ------------------------------------------------------------- tilegraph train --init [model] ----
def test_a_key_no_field_of_an_init_model_names_its_dropout_fields_and_hints_at_them():
    from tilegraph.cli.finetune import architecture_disagreements

    llama, gpt2 = models.build("llama-debug"), models.build("gpt2-debug")
    (key, text), = architecture_disagreements(llama, {"attention_dropout": 0.0}, "llama")
    assert key == "attention_dropout"
    assert text.startswith("attention_dropout is not a field of LlamaConfig (vocab_size, ")
    assert "tie_embeddings, attn_dropout)" in text and text.endswith("(did you mean attn_dropout?)")
    (_, text), = architecture_disagreements(llama, {"resid_dropout": 0.0}, "llama")  # GPT-2's key on a Llama
    assert "attn_dropout" in text
    (_, text), = architecture_disagreements(gpt2, {"attn_pdrop": 0.0}, "hf")
    assert "embd_dropout, attn_dropout, resid_dropout)" in text and text.endswith("(did you mean attn_dropout?)")
    # the dropout keys themselves still agree with any init model (set_dropout applies them)
    assert architecture_disagreements(llama, {"attn_dropout": 0.5}, "llama") == []


def test_the_cli_names_llama_s_attn_dropout_for_an_hf_key(tmp_path):
    from test_cli import _cli

    models.build("llama-debug").to_hf(tmp_path / "llama")
    (tmp_path / "text.txt").write_text("the cat sat on a mat " * 50)
    (tmp_path / "job.toml").write_text('[data]\nsources = ["text.txt"]\nseq_len = 8\ntokenizer = "byte"\n')
    run = _cli("train", "job.toml", "--init", "llama", "--set", "model.attention_dropout=0", "--out", "r",
               "--no-progress", cwd=tmp_path)
    assert run.returncode == 2 and not (tmp_path / "r").exists()
    assert ("attention_dropout is not a field of LlamaConfig (vocab_size, max_seq_len, dim, n_layers, n_heads, "
            "n_kv_heads, hidden, norm_eps, rope_base, tie_embeddings, attn_dropout) (did you mean attn_dropout?)"
            in run.stderr), run.stderr


# ------------------------------------------------------------------------ Zarr checkpoints ----
def test_a_stored_dropout_out_of_range_is_named_with_the_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    tg.io.save_checkpoint(ck, models.build("gpt2-debug"))
    for value, shown in ((1.5, "1.5"), ("0.1", "'0.1'"), (-1, "-1")):
        _edit_config(ck, attn_dropout=value)
        for load in (lambda: models.from_zarr(ck), lambda: tg.io.load_checkpoint(ck).new_model()):
            with pytest.raises(tg.io.CheckpointError) as e:
                load()
            assert e.value.where == f"tilegraph.io.load_checkpoint({ck})"
            assert e.value.what.startswith("a stored config that GPT2Config accepts: attn_dropout must be a number "
                                           "in [0, 1)")
            assert e.value.received == f"{shown} (its model config in zarr.json)"
    _edit_config(ck, attn_dropout=None)  # a checkpoint written before the configs had dropout: none
    assert models.from_zarr(ck).config.attn_dropout == 0.0


def test_a_mismatch_of_arrays_does_not_blame_the_dropout(tmp_path):
    cfg = dataclasses.replace(models.config("gpt2-debug"), attn_dropout=0.1, resid_dropout=0.2)
    tg.io.save_checkpoint(tmp_path / "ck", models.build(cfg))
    ck = tg.io.load_checkpoint(tmp_path / "ck")
    adapted = peft.apply_lora(models.build("gpt2-debug"), ["attn.q"], rank=2)  # the same architecture
    with pytest.raises(tg.io.CheckpointError) as e:
        ck.load_into(adapted)
    assert e.value.what == "the checkpoint's arrays to match the model", e.value  # not "holds another model"
    assert "missing: blocks.0.attn.q.lora_u" in e.value.received
    wider = models.build(dataclasses.replace(models.config("gpt2-debug"), dim=64))  # another model: named
    with pytest.raises(tg.io.CheckpointError) as e:
        ck.load_into(wider)
    assert "its config has dim 32, the model's 64; hidden 128, the model's 256;" in e.value.what
    assert "dropout" not in e.value.what


# ------------------------------------------- a run on a quantized base, checkpoints of before ----
def _old_style(ck, base):
    """``ck`` as tilegraph wrote checkpoints of a run on a quantized base before they held that
    base: without its quantized weights, the record naming ``base`` with base_in_checkpoint false."""
    doc = json.loads((ck / "zarr.json").read_text())
    attrs = doc["attributes"]["tilegraph"]
    for name in [n for n in attrs["parameters"] if attrs["arrays"][f"model/{n}"].get("quantized")]:
        attrs["parameters"].remove(name)
        del attrs["arrays"][f"model/{name}"]
        shutil.rmtree(ck / "model" / name)
    (ck / "zarr.json").write_text(json.dumps(doc))
    record = json.loads((ck / "tilegraph_peft.json").read_text()) if (ck / "tilegraph_peft.json").is_file() else \
        {"method": "lora", "rank": 2, "alpha": 4.0, "targets": ["attn.q"], "dropout": 0.0}
    (ck / "tilegraph_peft.json").write_text(json.dumps({**record, "init": str(base.resolve()),
                                                         "base_in_checkpoint": False}))


@pytest.mark.parametrize("case", ["written before dropout", "dropout set by the run"])
def test_an_old_checkpoint_of_a_run_on_a_quantized_base_loads_with_the_run_s_dropout(tmp_path, case):
    from tilegraph.cli import load_model

    base_cfg = models.config("gpt2-debug")
    if case == "dropout set by the run":  # the base (a Hugging Face GPT-2's 0.1, say); the run set 0
        base_cfg = dataclasses.replace(base_cfg, attn_dropout=0.1, resid_dropout=0.1)
    base, ck = tmp_path / "q4", tmp_path / "run"
    tg.io.save_checkpoint(base, models.build(base_cfg, seed=0), quantize="int4")
    model = peft.apply_lora(peft.from_quantized(base), ["attn.q"], rank=2, alpha=4.0)
    model.set_dropout(attn_dropout=0.0, resid_dropout=0.05)
    tg.io.save_checkpoint(ck, model)
    _old_style(ck, base)
    if case == "written before dropout":  # neither config has the keys: built now, the base's has 0.0
        for folder in (base, ck):
            _edit_config(folder, **dict.fromkeys(DROPS))
    loaded = load_model(ck, "test")
    want = (0.0, 0.0, 0.0) if case == "written before dropout" else (0.0, 0.0, 0.05)
    assert tuple(getattr(loaded.config, k) for k in DROPS) == want
    assert all(b.attn.dropout == want[1] and b.mlp_drop.p == want[2] for b in loaded.blocks)
    # the weights as the run left them: the base's quantized ones, dequantized, plus the adapters
    ids = np.arange(12).reshape(2, 6) % 96
    np.testing.assert_allclose(loaded(ids).numpy(), peft.merge_lora(model)(ids).numpy(), rtol=1e-5, atol=1e-6)
    # another architecture is still refused
    _edit_config(ck, n_heads=2)
    with pytest.raises(tg.TileError, match="the base checkpoint .* to have the run's config"):
        load_model(ck, "test")


@pytest.mark.distributed
def test_resuming_an_old_checkpoint_of_a_run_on_a_quantized_base_keeps_the_run_s_dropout(tmp_path):
    """--resume of such a checkpoint builds the model from its base: it took the base's dropout
    (0.1) where the run had set 0, silently."""
    from test_cli import _cli

    base_cfg = dataclasses.replace(models.config("gpt2-debug"), vocab_size=300, attn_dropout=0.1)
    tg.io.save_checkpoint(tmp_path / "q4", models.build(base_cfg, seed=0), quantize="int8")
    (tmp_path / "text.txt").write_text("the cat sat on a mat and a dog ran " * 200)
    (tmp_path / "job.toml").write_text(
        '[data]\nsources = ["text.txt"]\nseq_len = 8\ntokenizer = "byte"\n'
        "[train]\nsteps = 2\nbatch_size = 2\nwarmup = 1\neval_every = 0\n"
        '[peft]\nmethod = "lora"\nrank = 2\nalpha = 4\ntargets = ["attn.q"]\n')
    run = _cli("train", "job.toml", "--init", "q4", "--set", "model.attn_dropout=0", "--out", "run",
               "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    ck = tmp_path / "run" / "checkpoints" / "step-000002"
    assert models.from_zarr(ck).config.attn_dropout == 0.0
    _old_style(ck, tmp_path / "q4")
    run = _cli("train", "job.toml", "--resume", str(ck), "--steps", "1", "--no-progress", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "dropout attn_dropout" not in run.stdout, run.stdout  # the train line: none
    resumed = tmp_path / "run" / "checkpoints" / "step-000003"
    assert tg.io.load_checkpoint(resumed).info["model"]["config"]["attn_dropout"] == 0.0
