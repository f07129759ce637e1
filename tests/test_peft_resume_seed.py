"""A LoRA run with dropout resumes bit-exactly through the Python checkpoint API: the checkpoint
records each adapted layer's dropout seed (LoRALinear.dropout_seed, a hash of its *initial* U,
which a model rebuilt from the checkpoint cannot recompute) and the adapters rebuilt from it
(``load_checkpoint(...).model``, ``.new_model(...)`` + ``restore``) get it back; a checkpoint
written before the seed was recorded still loads, as it did."""

import json

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft

from test_zarr_checkpoint import _assert_same, _lm_trainer

TARGETS, RANK, ALPHA, DROPOUT = ["attn.q", "attn.v", "mlp.fc1"], 4, 8, 0.2


def _lora_model():
    return peft.apply_lora(models.build("gpt2-debug", seed=0), TARGETS, RANK, ALPHA, dropout=DROPOUT, seed=3)


def _opt(model, total=4):
    return tg.optim.AdamW(peft.trainable_parameters(model), lr=tg.optim.warmup_cosine(3e-3, 1, total))


def _adapters(model) -> dict:
    return {name: p.numpy() for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] in ("lora_u", "lora_v")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 steps straight, and 2 steps saved to a checkpoint (its dropout seeds, for the checks)."""
    path = tmp_path_factory.mktemp("lora-seed") / "ck"
    straight = _lora_model()
    losses = _lm_trainer(straight, _opt(straight)).fit(4).losses
    first = _lora_model()
    opt = _opt(first)
    first_losses = _lm_trainer(first, opt).fit(2).losses
    assert first_losses == losses[:2]
    tg.io.save_checkpoint(path, first, opt)
    seeds = {name: m.dropout_seed for name, m in peft.lora_layers(first).items()}
    return path, straight, losses, seeds


def _resume(model, ck) -> list[float]:
    opt = _opt(model, total=99)  # the checkpoint's schedule wins
    ck.restore_optimizer(opt, model)
    return _lm_trainer(model, opt).fit(2).losses


def test_the_checkpoint_records_each_layers_dropout_seed(runs):
    path, _, _, seeds = runs
    settings = tg.io.load_checkpoint(path).info["model"]["adapters"]["lora"]
    assert {name: info["dropout_seed"] for name, info in settings.items()} == seeds
    assert len(set(seeds.values())) == len(seeds)  # each layer has its own masks


@pytest.mark.parametrize("how", ["model", "new_model"])
def test_a_lora_run_with_dropout_resumes_bit_exactly_from_the_checkpoint(runs, how):
    path, straight, losses, seeds = runs
    ck = tg.io.load_checkpoint(path)
    if how == "model":  # the model as stored, then the optimizer
        second = ck.model
        assert {n: m.dropout_seed for n, m in peft.lora_layers(second).items()} == seeds
        resumed = _resume(second, ck)
    else:  # a model of fresh values, then weights and optimizer restored (as tilegraph train --resume)
        second = ck.new_model(seed=7)
        assert {n: m.dropout_seed for n, m in peft.lora_layers(second).items()} == seeds
        opt = _opt(second, total=99)
        ck.restore(second, opt)
        resumed = _lm_trainer(second, opt).fit(2).losses
    assert resumed == losses[2:]
    _assert_same(_adapters(second), _adapters(straight))


def test_adapters_applied_anew_take_the_seeds_of_the_checkpoint_they_load(runs):
    # tilegraph train --resume's way: the base, adapters added with [peft]'s settings (any seed),
    # then Trainer.load_checkpoint
    path, straight, losses, seeds = runs
    ck = tg.io.load_checkpoint(path)
    second = peft.apply_lora(ck.new_model(values=False, adapters=False), TARGETS, RANK, ALPHA, dropout=DROPOUT, seed=11)
    trainer = _lm_trainer(second, _opt(second, total=99))
    assert trainer.load_checkpoint(path) == 2
    assert {n: m.dropout_seed for n, m in peft.lora_layers(second).items()} == seeds
    assert trainer.fit(2).losses == losses[2:]
    _assert_same(_adapters(second), _adapters(straight))


def test_save_and_load_adapters_keep_the_seeds(runs, tmp_path):
    path, _, _, seeds = runs
    model = tg.io.load_checkpoint(path).model
    peft.save_adapters(tmp_path / "adapters", model)
    back = peft.load_adapters(tmp_path / "adapters", models.build("gpt2-debug", seed=0))
    assert {n: m.dropout_seed for n, m in peft.lora_layers(back).items()} == seeds


def _edit_seeds(path, folder, edit):
    """A copy of checkpoint ``path`` at ``folder`` whose recorded LoRA settings ``edit`` changed."""
    tg.io.save_checkpoint(folder, tg.io.load_checkpoint(path).model)
    meta = json.loads((folder / "zarr.json").read_text())
    for info in meta["attributes"]["tilegraph"]["model"]["adapters"]["lora"].values():
        edit(info)
    (folder / "zarr.json").write_text(json.dumps(meta))
    return folder


def test_a_checkpoint_without_the_seeds_still_loads_and_trains(runs, tmp_path):
    path, straight, _, seeds = runs
    old = _edit_seeds(path, tmp_path / "old", lambda info: info.pop("dropout_seed"))  # as written before
    ck = tg.io.load_checkpoint(old)
    model = ck.model  # today's behaviour: the seeds of adapters added afresh
    layers = peft.lora_layers(model)
    assert sorted(layers) == sorted(seeds) and all(isinstance(m.dropout_seed, int) for m in layers.values())
    _assert_same(_adapters(model), _adapters(tg.io.load_checkpoint(path).model))
    losses = _lm_trainer(model, _opt(model)).fit(1).losses
    assert np.isfinite(losses).all()


def test_a_bad_recorded_seed_is_one_error_naming_the_layer(runs, tmp_path):
    path = _edit_seeds(runs[0], tmp_path / "bad", lambda info: info.update(dropout_seed="x"))
    ck = tg.io.load_checkpoint(path)
    with pytest.raises(tg.TileError, match=r"dropout_seed to be an int in \[0, 2\*\*63\).*blocks\.0\.attn\.q: 'x'"):
        ck.model
    model = peft.apply_lora(ck.new_model(values=False, adapters=False), TARGETS, RANK, ALPHA, dropout=DROPOUT)
    before = {n: m.dropout_seed for n, m in peft.lora_layers(model).items()}
    with pytest.raises(tg.io.CheckpointError, match=r"load_checkpoint\(.*bad\).*'x'"):
        ck.load_into(model)
    assert {n: m.dropout_seed for n, m in peft.lora_layers(model).items()} == before
    assert all(c.value is None for c in model.blocks[0].attn.q.weight.cells.flat)  # nothing read
