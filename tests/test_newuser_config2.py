"""Model configs as a new user changes them: dataclasses.replace, the CLI's [model] keys, and
resuming runs whose [model] keys derive a field (GPT-2's MLP width from dim)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import tilegraph as tg
from tilegraph import models


def _build(sets: list[str], config: str | None = None):
    """The model `tilegraph train [config] --set ...` would build (no data, no cluster)."""
    from tilegraph.cli.config import apply_overrides, build_model, check_config, load_config, make_tokenizer

    cfg, source = load_config(config)
    apply_overrides(cfg, sets)
    check_config(cfg, source)
    return build_model(cfg["model"], make_tokenizer(cfg["data"]["tokenizer"]), 0, cfg["data"]["seq_len"])


def test_replace_dim_derives_gpt2_hidden_again():
    """replace(config("gpt2"), dim=1024, n_heads=16) kept the flavor's hidden=3072, where the config
    says hidden None means 4 * dim."""
    cfg = dataclasses.replace(models.config("gpt2"), dim=1024, n_heads=16)
    assert cfg.hidden == 4096
    assert dataclasses.replace(cfg, dim=256, n_heads=4).hidden == 1024  # again from a replaced one
    # a width given stays as given, through later replaces too
    given = dataclasses.replace(models.config("gpt2"), hidden=1000)
    assert given.hidden == 1000 and dataclasses.replace(given, dim=256, n_heads=4).hidden == 1000
    assert dataclasses.replace(given, dim=256, n_heads=4, hidden=None).hidden == 1024
    # the derived width is a plain number wherever it goes: equality, hashing, JSON (checkpoints)
    assert cfg == models.GPT2Config(dim=1024, n_heads=16, hidden=4096)
    assert hash(cfg) == hash(models.GPT2Config(dim=1024, n_heads=16, hidden=4096))
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["hidden"] == 4096
    assert repr(cfg.hidden) == "4096"
    assert models.config("gpt2").hidden == 3072 and models.config("gpt2-debug").hidden == 128  # flavors unchanged


def test_replace_n_heads_derives_llama_n_kv_heads_again():
    """LlamaConfig's n_kv_heads None means n_heads; replace(cfg, n_heads=8) kept the old 4 (silently
    grouped-query attention)."""
    cfg = models.LlamaConfig(vocab_size=64, max_seq_len=16, dim=64, n_layers=1, n_heads=4, hidden=96)
    assert cfg.n_kv_heads == 4
    assert dataclasses.replace(cfg, n_heads=8).n_kv_heads == 8
    grouped = dataclasses.replace(cfg, n_kv_heads=2)  # given: kept
    assert dataclasses.replace(grouped, n_heads=8).n_kv_heads == 2
    # Llama's hidden is never derived (documented): a dim change keeps it
    assert dataclasses.replace(models.config("llama-debug"), dim=128).hidden == 176


def test_derived_width_survives_hf_and_zarr_round_trips(tmp_path):
    """A model of a replaced config writes and reads back its own width (not the flavor's)."""
    cfg = dataclasses.replace(models.config("gpt2-debug"), dim=48)
    model = models.build(cfg, seed=0)
    assert model.blocks[0].mlp.fc1.weight.shape == (48, 192)
    model.to_hf(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["n_inner"] == 192
    assert models.from_hf(tmp_path / "hf").config == cfg
    tg.io.save_checkpoint(tmp_path / "ck", model)
    assert tg.io.load_checkpoint(tmp_path / "ck").model.config == cfg


@pytest.mark.parametrize("sets, want", [
    # the shipped config's dim = 64: its MLP is 4 * 64 wide, not gpt2-debug's 128
    ([], {"dim": 64, "hidden": 256}),
    (["model.dim=128"], {"dim": 128, "hidden": 512}),
    (["model.dim=128", "model.hidden=100"], {"dim": 128, "hidden": 100}),
    (["model.flavor=gpt2", "model.dim=256", "model.n_heads=4", "model.n_layers=1"], {"dim": 256, "hidden": 1024}),
    # Llama's width is the flavor's unless given
    (["model.flavor=llama-debug", "model.dim=128"], {"dim": 128, "hidden": 176, "n_kv_heads": 2}),
])
def test_cli_set_model_dim_derives_hidden(sets, want):
    """`tilegraph train --set model.dim=128` built an MLP of the flavor's width (128), not 4 * dim."""
    built = _build(sets)
    assert {k: getattr(built.config, k) for k in want} == want
    assert built.blocks[0].mlp.parameters()[0].shape[1] == want["hidden"]


def _model(**changes):
    return models.build(dataclasses.replace(models.config("gpt2-debug"), max_seq_len=64, **changes), seed=0)


@pytest.mark.parametrize("stored, given, refused", [
    # a run of `--set model.flavor=gpt2-debug --set model.dim=64`: hidden 4 * 64, resumed with the same flags
    (dict(dim=64, hidden=256), {"flavor": "gpt2-debug", "dim": 64}, False),
    # a run written before hidden followed dim: the flavor's 128 with dim 64; it still resumes
    (dict(dim=64, hidden=128), {"flavor": "gpt2-debug", "dim": 64}, False),
    # a width neither derives: refused
    (dict(dim=64, hidden=100), {"flavor": "gpt2-debug", "dim": 64}, True),
    (dict(dim=64, hidden=100), {"flavor": "gpt2-debug", "dim": 64, "hidden": 100}, False),
    (dict(), {"flavor": "gpt2-debug"}, False),
    (dict(n_layers=3), {"flavor": "gpt2-debug"}, True),
])
def test_resume_with_flavor_and_dim_compares_the_derived_hidden(stored, given, refused):
    """--resume of a run made with --set model.flavor=gpt2-debug --set model.dim=64, given the same
    keys, was refused: 'flavor = gpt2-debug has hidden 128, ... hidden 256' (the flavor's own width
    compared, not the one its keys derive)."""
    from tilegraph.cli.finetune import architecture_disagreements

    problems = architecture_disagreements(_model(**stored), given, "ck")
    assert bool(problems) == refused, problems


def test_resume_names_dim_not_the_hidden_it_derives():
    """A flavor that disagrees with a checkpoint in dim named the hidden width derived from it too
    ('has dim 32, hidden 128, ... dim 48, hidden 192'); a width of its own is still named."""
    from tilegraph.cli.finetune import architecture_disagreements

    [(key, text)] = architecture_disagreements(_model(dim=48), {"flavor": "gpt2-debug"}, "ck")
    assert text == "flavor = 'gpt2-debug' has dim 32, ck dim 48"
    [(key, text)] = architecture_disagreements(_model(hidden=100), {"flavor": "gpt2-debug"}, "ck")
    assert text == "flavor = 'gpt2-debug' has hidden 128, ck hidden 100"


@pytest.mark.parametrize("name", [["debug"], {"debug": 1}])
def test_flavor_of_an_unhashable_name_is_a_clear_error(name):
    """GPT2Config.flavor(["debug"]) raised TypeError: unhashable type: 'list'."""
    with pytest.raises(tg.TileError, match=r"^\[tilegraph.models.GPT2Config.flavor\] unknown flavor; known: debug"):
        models.GPT2Config.flavor(name)
