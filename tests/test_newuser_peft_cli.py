"""Fine-tuning as a new user meets it: adapters loaded to train on, adapters applied twice,
adapter folders handed to the commands that want a model, and the other defects found that way.
Each test fails without its fix."""

import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._errors import TileError
from tilegraph.nn import Linear


def _trainable(model):
    return sorted(n for n, p in model.named_parameters() if p.requires_grad)


# ------------------------------------------------ load_adapters: every adapter trainable ----
@pytest.mark.parametrize("kind", ["zarr", "peft", "lotr"])
def test_loaded_adapters_are_all_trainable(tmp_path, kind):
    """load_adapters onto a plain model adds one layer's adapter at a time; each addition froze
    the adapters added before, so only the last layer's came back trainable (an optimizer built
    from trainable_parameters then trained one layer of many, silently)."""
    if kind == "lotr":
        model = peft.apply_lotr(models.build("gpt2-debug", seed=0), ["attn.q", "mlp.fc1"], rank=4)
    else:
        model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["c_attn"], rank=4, alpha=8)
    want = _trainable(model)
    peft.save_adapters(tmp_path / "ad", model, format="peft" if kind == "peft" else "zarr")
    loaded = peft.load_adapters(tmp_path / "ad", models.build("gpt2-debug", seed=0))
    assert _trainable(loaded) == want
    assert sum(p.size for p in peft.trainable_parameters(loaded)) == sum(
        p.size for p in peft.trainable_parameters(model))


def test_a_second_apply_keeps_the_first_adapters_trainable():
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
    peft.apply_lora(model, ["attn.v"], rank=2)
    peft.apply_lotr(model, ["mlp.fc1"], rank=2)
    names = _trainable(model)
    assert [n for n in names if ".attn.q." in n] == [f"blocks.{i}.attn.q.lora_{a}" for i in (0, 1) for a in "uv"]
    assert any(".attn.v.lora_u" in n for n in names) and any("lotr_core" in n for n in names)
    assert not any(n.endswith((".weight", ".bias")) for n in names)  # the base stays frozen


# ------------------------------------------- a target on layers that have an adapter already ----
def test_target_already_adapted_is_named_as_such():
    """Adapting a layer twice said the target matched no Linear layer and listed the others, as
    if the name were misspelt."""
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
    for apply in (lambda: peft.apply_lora(model, ["attn.q", "zzz"], 2),
                  lambda: peft.apply_lotr(model, ["attn.q"], 2)):
        with pytest.raises(TileError) as e:
            apply()
        msg = str(e.value)
        assert "adapter already" in msg and "blocks.0.attn.q (LoRALinear)" in msg and "merge_lora" in msg
    with pytest.raises(TileError, match="'zzz' matches nothing"):
        peft.apply_lora(model, ["attn.q", "zzz"], 2)
    # nothing changed: the first adapters are there, still trainable
    assert sorted(peft.lora_layers(model)) == ["blocks.0.attn.q", "blocks.1.attn.q"]
    assert len(peft.trainable_parameters(model)) == 4


# ------------------------------------ an adapters folder where a model or a checkpoint is asked ----
def _main(capsys, *args):
    """``tilegraph ARGS`` in this process: its exit status and its one line of error."""
    from tilegraph.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err


@pytest.fixture(scope="module")
def adapter_folders(tmp_path_factory):
    """``ck/adapters`` (Zarr) and ``ck/adapters-peft`` (Hugging Face peft) inside a folder laid out
    as a checkpoint of an adapted tilegraph train run (its zarr.json and tilegraph_peft.json), and
    a Zarr adapters folder on its own."""
    root = tmp_path_factory.mktemp("adapters")
    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["c_attn"], rank=2)
    ck = root / "ck"
    peft.save_adapters(ck / "adapters", model)
    peft.save_adapters(ck / "adapters-peft", model, format="peft")
    (ck / "zarr.json").write_text("{}")
    (ck / "tilegraph_peft.json").write_text("{}")
    peft.save_adapters(root / "alone", model)
    return root


@pytest.mark.parametrize("command", ["generate", "eval", "convert", "init", "resume"])
@pytest.mark.parametrize("which", ["adapters", "adapters-peft"])
def test_an_adapters_folder_given_as_a_model_says_where_the_model_is(adapter_folders, tmp_path, capsys,
                                                                       monkeypatch, command, which):
    """Each command named a Zarr adapters folder a model of the unknown class '_Adapters', and a
    peft one a folder that is neither a checkpoint nor a Hugging Face folder."""
    monkeypatch.chdir(tmp_path)
    folder = str(adapter_folders / "ck" / which)
    args = {"generate": ["generate", folder, "--local"], "eval": ["eval", folder, "--local"],
            "convert": ["convert", folder, str(tmp_path / "out")],
            "init": ["train", "--init", folder, "--out", str(tmp_path / "run")],
            "resume": ["train", "--resume", folder]}[command]
    err = _main(capsys, *args)
    assert "adapters folder" in err and "_Adapters" not in err, err
    assert f"pass the checkpoint that holds it, {(adapter_folders / 'ck').resolve()}" in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def test_an_adapters_folder_alone_points_to_load_adapters(adapter_folders, capsys):
    err = _main(capsys, "generate", str(adapter_folders / "alone"), "--local")
    assert "the adapters alone" in err and "tilegraph.peft.load_adapters" in err, err


def test_info_of_a_peft_adapter_folder_says_what_it_is(adapter_folders, capsys):
    err = _main(capsys, "info", str(adapter_folders / "ck" / "adapters-peft"))
    assert "Hugging Face peft adapter folder" in err, err


def test_load_adapters_of_a_train_checkpoint_points_to_its_adapters_folder(tmp_path):
    from tilegraph.io import save_checkpoint

    model = peft.apply_lora(models.build("gpt2-debug", seed=0), ["attn.q"], rank=2)
    save_checkpoint(tmp_path / "ck", model)
    peft.save_adapters(tmp_path / "ck" / "adapters", model)
    with pytest.raises(TileError, match=f"adapters of this checkpoint are in {tmp_path / 'ck' / 'adapters'}"):
        peft.load_adapters(tmp_path / "ck", models.build("gpt2-debug", seed=0))


# ------------------------------------------------ [peft] keys on the command line the run ignores ----
@pytest.mark.parametrize("args, unused", [
    (["--set", 'peft.targets=["c_attn"]', "--set", "peft.rank=4"], "--set peft.rank=4, --set peft.targets="),
    (["--set", "peft.method=lora", "--set", "peft.scale=2"], "--set peft.scale=2 with method = 'lora'"),
    (["--set", "peft.method=lotr", "--set", "peft.alpha=4"], "--set peft.alpha=4 with method = 'lotr'"),
    (["--set", "peft.sketch_ratio=0.5"], "--set peft.sketch_ratio=0.5 with method = 'none', grad_sketch = 'none'"),
], ids=["adapter keys without a method", "scale with lora", "alpha with lotr", "a ratio without a sketch"])
def test_peft_keys_the_run_would_ignore_are_refused(tmp_path, capsys, monkeypatch, args, unused):
    """`--set peft.targets=... --set peft.rank=4` without peft.method trained every weight, the
    adapter settings silently ignored (and so did alpha under LoTR, scale under LoRA)."""
    monkeypatch.chdir(tmp_path)
    err = _main(capsys, "train", "--out", "run", *args)
    assert "[tilegraph train [peft]] settings the run uses" in err and unused in err, err
    assert not (tmp_path / "run").exists()


# -------------------------------------------------- a quantized base's parameters are counted ----
@pytest.mark.distributed
def test_train_counts_the_quantized_weights_of_its_base(tmp_path, capsys, monkeypatch):
    """On a quantized base the train line said 28,224 parameters for a model of 87,616: its
    quantized Linear weights are no Parameters, and num_parameters left them out."""
    import dataclasses

    from tilegraph.cli import main
    from tilegraph.io import save_checkpoint

    monkeypatch.chdir(tmp_path)
    config = dataclasses.replace(models.config("gpt2-debug"), vocab_size=257)
    base = models.build(config, seed=0)
    save_checkpoint(tmp_path / "q8", base, quantize="int8")
    assert main(["train", "--init", "q8", "--set", "peft.method=lora", "--steps", "1", "--out", "run", "--no-progress",
                 "--set", "data.max_mb=0.05", "--set", "data.seq_len=16", "--set", "train.eval_batches=1"]) == 0
    out = capsys.readouterr().out
    quantized = sum(m.weight.size for name, m, _ in peft._named_modules(base) if isinstance(m, Linear))
    adapters = 2 * 2 * (32 * 8 + 8 * 32)  # attn.q and attn.v of 2 blocks, rank 8
    want = f"{base.num_parameters() + adapters:,} parameters ({quantized:,} of them quantized)"
    assert want in out, out


def test_an_output_folder_past_step_999999_suggests_its_newest_checkpoint(tmp_path):
    from tilegraph.cli.runs import check_output
    from tilegraph.io import save_checkpoint

    for name in ("step-999999", "step-1000000"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    # folders only (a copy that stopped, say): none is a checkpoint to name (b72c00b)
    with pytest.raises(TileError, match=r"checkpoints step-999999\.\.step-1000000\): pass --resume CHECKPOINT .*"
                       r"none of them is a complete checkpoint"):
        check_output(tmp_path, None, 10)
    for name in ("step-999999", "step-1000000"):  # complete ones: the newest by step is named
        (tmp_path / "checkpoints" / name).rmdir()
        save_checkpoint(tmp_path / "checkpoints" / name, Linear(2, 2, seed=0))
    with pytest.raises(TileError, match=r"checkpoints step-999999\.\.step-1000000\): pass --resume CHECKPOINT .*"
                       r"step-1000000 continues it"):
        check_output(tmp_path, None, 10)


def test_a_run_folder_given_as_a_model_names_its_newest_checkpoint(tmp_path):
    from tilegraph.cli.finetune import load_model

    model = tg.models.build("gpt2-debug")
    for step in (5, 10):
        tg.io.save_checkpoint(tmp_path / "run" / "checkpoints" / f"step-{step:06d}", model)
    with pytest.raises(TileError, match=r"holds neither \(a run folder of tilegraph train: its newest checkpoint "
                       r"is .*run/checkpoints/step-000010\)$"):
        load_model(tmp_path / "run", "tilegraph generate")
