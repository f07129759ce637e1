"""The training API's rough edges, found by using it as a new user would: a NaN loss and how to go
on, CheckpointManager's and the Trainer's argument checks, checkpoints after the runtime was
closed, an optimizer given a parameter twice, a checkpoint loaded under other batch settings."""

import re
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.io.zarr import CheckpointError, CheckpointManager


from conftest import mse  # noqa: E402 - the same loss as test_newuser_trainer
from test_newuser_trainer import _data  # noqa: E402 - the same toy data


def _trainer(runtime=None, data=_data, lr=1e-2, **kw):
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.SGD(model.parameters(), lr=lr)
    kw = {"progress": False, "batch_tiles": [(16, 8), (16, None)], "batch_size": 32, **kw}
    return model, opt, tg.Trainer(model, opt, data, runtime, loss_fn=mse, **kw)


# -- 1. a NaN/inf loss -------------------------------------------------------------------------------
def _bad_at(bad_step):
    def data(step):
        x = np.ones((32, 8), np.float32) * (np.nan if step == bad_step else 1.0)
        return x, np.zeros((32, 2), np.float32)

    return data


def test_nan_loss_says_the_update_was_applied_and_names_the_checkpoint_to_reload(tmp_path):
    """A NaN loss said only "loss became nan at step 7": not that the step's update was already in
    the weights (so every later step is NaN too), nor how to go on. It now names the newest
    checkpoint from before the loss went bad (step 6's checkpoint holds the weights that gave
    it), the set_aside the next fit needs, and that the schedule is set after the load (which
    restores the checkpoint's); doing what it says trains on."""
    model, opt, trainer = _trainer(data=_bad_at(7), checkpoint_dir=tmp_path / "ck", checkpoint_every=2,
                                   steps_per_graph=1)
    with pytest.raises(FloatingPointError) as info:  # still a FloatingPointError (the CLI catches it)
        trainer.fit(10)
    e = info.value
    assert isinstance(e, tg.TileError) and e.where == "tilegraph.Trainer.fit"
    assert e.received == "loss became nan at step 7"
    text = str(e)
    assert "were already applied: the weights are now NaN/inf, so every later step's loss would be too" in text
    good = str(tmp_path / "ck" / "step-000004")
    assert f"trainer.load_checkpoint({good!r})" in text, text
    assert "trainer.checkpoints.set_aside(4)" in text and "below this run's 0.01" in text, text

    assert trainer.load_checkpoint(good) == 4
    trainer.checkpoints.set_aside(4)
    opt.schedule = tg.optim.constant(1e-3)
    assert all(np.isfinite(trainer.fit(2).losses)) and opt.lr == 1e-3


def test_nan_loss_without_a_checkpoint_says_to_build_again_with_a_lower_lr():
    """Diverging at once (lr 1e9, no checkpoint_dir): the error says no checkpoint is there to
    reload and what to do instead."""
    _, _, trainer = _trainer(lr=1e9)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.fit\] a finite loss; the loss of step \d+ is "
                       r"(nan|inf).*this trainer has no checkpoint from before it.*build the model, optimizer and "
                       r"Trainer again with a lower learning rate .*below this run's 1e\+09"):
        trainer.fit(20)


# -- 2. CheckpointManager's checks -----------------------------------------------------------------
@pytest.mark.parametrize("step", ["4", 4.0, -4, None])
def test_checkpoint_manager_due_refuses_a_step_that_is_not_one(tmp_path, step):
    """``mgr.due("4")`` was a TypeError of '%' ("not all arguments converted during string
    formatting"), ``due(4.0)`` and ``due(-4)`` answered True."""
    mgr = CheckpointManager(tmp_path / "ck", every=4)
    with pytest.raises(CheckpointError, match=r"CheckpointManager\(.*\)\.due\] step must be an int >= 0"):
        mgr.due(step)
    assert mgr.due(np.int64(8)) and not mgr.due(6) and mgr.due(0)


def test_checkpoint_manager_refuses_a_file_for_its_folder(tmp_path):
    """``CheckpointManager("a_file")`` was accepted and failed only when it first saved (after
    training up to there)."""
    (tmp_path / "a_file").write_text("x")
    for path in (tmp_path / "a_file", tmp_path / "a_file" / "ck"):
        with pytest.raises(CheckpointError, match=r"\[tilegraph.io.CheckpointManager\] dir must be a folder "
                           r"\(made when missing\); received: .*a_file.*(an existing file|is a file)"):
            CheckpointManager(path)


def test_checkpoint_manager_checks_keep_every_and_async_save(tmp_path):
    """NumPy integers for keep / every were refused ("must be an int", which they are), and
    ``async_save="no"`` counted as True."""
    mgr = CheckpointManager(tmp_path, keep=np.int64(2), every=np.int32(3))
    assert (mgr.keep, mgr.every) == (2, 3) and type(mgr.keep) is int and type(mgr.every) is int
    with pytest.raises(CheckpointError, match=r"async_save must be True or False; received: async_save='no'"):
        CheckpointManager(tmp_path, async_save="no")
    for kw in (dict(keep=0), dict(keep=2.0), dict(keep=True)):
        with pytest.raises(CheckpointError, match=r"keep must be None \(keep all\) or an int >= 1; received: keep="):
            CheckpointManager(tmp_path, **kw)
    with pytest.raises(CheckpointError, match=r"every must be an int >= 0 .*; received: every='2'"):
        CheckpointManager(tmp_path, every="2")


# -- 3. checkpoints and a runtime that is not one, or was closed -------------------------------------
def test_checkpoint_functions_refuse_a_runtime_that_is_not_one(tmp_path):
    """``runtime="x"``: save_checkpoint and CheckpointManager.save ignored it (a local model),
    load_checkpoint(...).model and models.from_zarr failed with AttributeError 'workers'."""
    model = tg.models.build("gpt2-debug", seed=0)
    tg.io.save_checkpoint(tmp_path / "ck", model)
    want = r"runtime must be None or a tilegraph Runtime .*; received: runtime='x'"
    with pytest.raises(CheckpointError, match=r"\[tilegraph.io.save_checkpoint\(.*a\)\] " + want):
        tg.io.save_checkpoint(tmp_path / "a", model, runtime="x")
    with pytest.raises(CheckpointError, match=r"\[tilegraph.io.save_checkpoint\(.*step-000001\)\] " + want):
        CheckpointManager(tmp_path / "m", async_save=False).save(1, model, runtime="x")
    with pytest.raises(CheckpointError, match=r"\[tilegraph.io.load_checkpoint\(.*ck\)\] " + want):
        tg.io.load_checkpoint(tmp_path / "ck", runtime="x")
    with pytest.raises(CheckpointError, match=r"\[tilegraph.models.from_zarr\] " + want):
        tg.models.from_zarr(tmp_path / "ck", runtime="x")
    assert not (tmp_path / "a").exists() and not (tmp_path / "m" / "step-000001").exists()


@pytest.mark.distributed
def test_checkpoints_after_the_runtime_was_closed_say_so(own_runtime, tmp_path):
    """After ``rt.close()``, saving a model trained there said "pass runtime=..." (without one)
    or Dask's "No clients found" (with it); loading named "tilegraph.Runtime.workers". Each now
    says the runtime was closed (and that the values went with it)."""
    rt = own_runtime
    model, opt, trainer = _trainer(rt)
    trainer.fit(2)
    tg.io.save_checkpoint(tmp_path / "ck", model, opt, runtime=rt)
    rt.close()
    gone = r"the parameters \(and optimizer state\) lived on the workers of a runtime that was closed, and went with it"
    for kw in ({}, {"runtime": rt}):
        with pytest.raises(CheckpointError, match=r"\[tilegraph.io.save_checkpoint\(.*\)\] " + gone):
            tg.io.save_checkpoint(tmp_path / "after", model, opt, **kw)
        with pytest.raises(CheckpointError, match=r"\[tilegraph.io.save_checkpoint\(.*step-000002\)\] " + gone):
            CheckpointManager(tmp_path / "m").save(2, model, opt, **kw)
    closed = r"an open runtime: this one was closed"
    with pytest.raises(CheckpointError, match=r"\[tilegraph.io.load_checkpoint\(.*ck\)\] " + closed):
        tg.io.load_checkpoint(tmp_path / "ck", runtime=rt)
    with pytest.raises(CheckpointError, match=r"\[tilegraph.models.from_zarr\] " + closed):
        tg.models.from_zarr(tmp_path / "ck", runtime=rt)
    assert not (tmp_path / "after").exists() and not (tmp_path / "m" / "step-000002").exists()
    assert tg.io.load_checkpoint(tmp_path / "ck").step == 2  # here, without the runtime


# -- 4. the Trainer's other arguments ----------------------------------------------------------------
@pytest.mark.parametrize("name, value", [("pipeline", "no"), ("progress", "False"), ("async_checkpoint", 0),
                                         ("pipeline", None)])
def test_trainer_flags_must_be_bools(tmp_path, name, value):
    """``Trainer(pipeline="no")`` counted as True (as did progress="False",
    async_checkpoint=0 as False)."""
    with pytest.raises(tg.TileError, match=rf"\[tilegraph.Trainer\] {name} must be True or False; received: {name}="):
        _trainer(checkpoint_dir=tmp_path, **{name: value})
    assert _trainer(pipeline=np.bool_(False))[2].pipeline is False


def test_trainer_checks_report_step_and_performance_report(tmp_path):
    """``report_step=-1`` was accepted (no report was ever written), a report_step without a
    performance_report ignored, a performance_report of 3 accepted."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] report_step .* must be an integer >= 1; "
                       r"received: -1"):
        _trainer(report_step=-1, performance_report=tmp_path / "r.html")
    with pytest.raises(tg.TileError, match=r"report_step picks the step of performance_report: give a "
                       r"performance_report path too; received: report_step=3, performance_report=None"):
        _trainer(report_step=3)
    with pytest.raises(tg.TileError, match=r"performance_report must be a file path .*; received: "
                       r"performance_report=3"):
        _trainer(performance_report=3)


def test_trainer_takes_a_numpy_batch_size():
    """``batch_size=np.int64(32)`` was refused as "must be a positive multiple of accum_steps"
    (it is one), where accum_steps, steps and the others take NumPy integers."""
    _, _, trainer = _trainer(batch_size=np.int64(32), accum_steps=np.int64(2))
    assert trainer.batch_size == 32 and type(trainer.batch_size) is int
    assert len(trainer.fit(1).losses) == 1


# -- 5. an optimizer given a parameter twice --------------------------------------------------------
@pytest.mark.parametrize("opt", [tg.optim.AdamW, tg.optim.SGD])
def test_optimizer_refuses_a_parameter_given_twice(opt):
    """``AdamW(list(model.parameters()) * 2)`` was accepted: each step updated every parameter
    twice, from two copies of its state, the second write replacing the first."""
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    params = list(model.parameters())
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.\w+\] params must name each Parameter once .*; "
                       r"received: params\[1\] and params\[4\] are the same Parameter \('bias', shape \(16,\)\)"):
        opt([*params, params[1]], lr=0.1)


# -- 6. a checkpoint loaded under other batch settings ----------------------------------------------
def _token_trainer(tmp_path, batch_size, accum_steps=1, seed=0):
    import dataclasses

    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    text = tmp_path / "a.txt"
    if not text.exists():
        text.write_text("hello tilegraph " * 400)
        build_token_file([text], tmp_path / "t.bin", ByteTokenizer(eos=True))
    data = TokenDataset(tmp_path / "t.bin", 16, split="train", seed=seed)
    cfg = dataclasses.replace(tg.models.GPT2Config.flavor("debug"), vocab_size=data.vocab_size, max_seq_len=16)
    model = tg.models.build(cfg, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.Trainer(model, opt, data, batch_size=batch_size, accum_steps=accum_steps, progress=False)


def test_loading_a_checkpoint_of_other_batch_settings_warns(tmp_path):
    """A checkpoint loaded into a Trainer of another batch_size (or accum_steps, or data seed)
    than the run that wrote it was taken without a word, although its data position (the next
    step) then means other windows than that run's."""
    plain = _token_trainer(tmp_path, 8)
    tg.io.save_checkpoint(tmp_path / "ck", plain.model, plain.optimizer)  # (no trainer state: no warning)
    first = _token_trainer(tmp_path, 8, accum_steps=2)
    first.save_checkpoint(tmp_path / "ck8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _token_trainer(tmp_path, 8, accum_steps=2).load_checkpoint(tmp_path / "ck8")  # the same settings
        _token_trainer(tmp_path, 4).load_checkpoint(tmp_path / "ck")
    with pytest.warns(UserWarning, match=r"tilegraph.Trainer.load_checkpoint: .*ck8 was written by a run with "
                      r"batch_size 8, accum_steps 2; this trainer has batch_size 4, accum_steps 1: from step 1 on, "
                      r"the next batches are other windows than that run's"):
        _token_trainer(tmp_path, 4).load_checkpoint(tmp_path / "ck8")
    with pytest.warns(UserWarning, match=r"with accum_steps 2; this trainer has accum_steps 4: .*the same windows, "
                      r"averaged in micro-batches of another size"):
        _token_trainer(tmp_path, 8, accum_steps=4).load_checkpoint(tmp_path / "ck8")
    with pytest.warns(UserWarning, match=re.escape("with data seed 0; this trainer has data seed 5")):
        _token_trainer(tmp_path, 8, accum_steps=2, seed=5).load_checkpoint(tmp_path / "ck8")


# -- further: changing the learning rate, set_aside, load_checkpoint's path -------------------------
def test_changing_the_learning_rate_between_fits_says_how():
    """``opt.lr = 1e-4`` (torch's param_groups habit) was "AttributeError: property 'lr' of
    'AdamW' object has no setter"; ``opt.schedule = 1e-4`` was taken and the next fit failed with
    "TypeError: 'float' object is not callable"; ``lr=lambda: 1e-3`` a TypeError from inside
    the optimizer. ``opt.schedule = tg.optim.constant(...)`` works between fits."""
    model, opt, trainer = _trainer()
    trainer.fit(1)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.SGD.lr\] the learning rate comes from the schedule: "
                       r"set opt.schedule = tg.optim.constant\(lr\)"):
        opt.lr = 1e-4
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.SGD.schedule\] the schedule must be a callable .*"
                       r"\(for a constant one: tg.optim.constant\(0.0001\)\); received: schedule=0.0001"):
        opt.schedule = 1e-4
    assert opt.lr == 1e-2  # unchanged
    opt.schedule = tg.optim.constant(1e-4)
    trainer.fit(1)
    assert opt.lr == 1e-4 and trainer.history[-1]["lr"] == 1e-4
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.AdamW\] the learning-rate schedule \(lr=\) is called "
                       r"as schedule\(step\) .*; received: schedule\(1\): TypeError: "):
        tg.optim.AdamW(model.parameters(), lr=lambda: 1e-3)


@pytest.mark.parametrize("after", ["1", 1.5, -1])
def test_set_aside_refuses_a_step_that_is_not_one(tmp_path, after):
    """``mgr.set_aside("1")`` was a TypeError of '>', ``set_aside(1.5)`` moved step 2 on."""
    mgr = CheckpointManager(tmp_path / "ck", async_save=False)
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    for step in (1, 2):
        mgr.save(step, model)
    with pytest.raises(CheckpointError, match=r"set_aside\] after must be a step, an int >= 0"):
        mgr.set_aside(after)
    assert [p.name for p in mgr.checkpoints()] == ["step-000001", "step-000002"]


@pytest.mark.parametrize("path", [None, 42, ""])
def test_trainer_load_checkpoint_refuses_what_is_not_a_path(path):
    """``trainer.load_checkpoint(None)`` was "TypeError: expected str, bytes or os.PathLike
    object, not NoneType" (a variable holding no checkpoint yet)."""
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.load_checkpoint\] a path"):
        _trainer()[2].load_checkpoint(path)


def test_checkpoint_switches_must_be_bools(tmp_path):
    """restore(strict="no") and restore_optimizer(schedule="no") counted as True (a strict load,
    the schedule restored) without a word."""
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    ck = tg.io.load_checkpoint(tg.io.save_checkpoint(tmp_path / "ck", model, opt))
    with pytest.raises(CheckpointError, match=r"restore\] strict must be True or False; received: 'no'"):
        ck.restore(model, opt, strict="no")
    with pytest.raises(CheckpointError, match=r"restore_optimizer\] schedule must be True or False"):
        ck.restore_optimizer(opt, model, schedule="no")
    with pytest.raises(CheckpointError, match=r"load_into\] strict must be True or False"):
        ck.load_into(model, strict=1)
    ck.restore(model, opt, strict=True, schedule=False)


@pytest.mark.distributed
def test_saving_values_held_by_another_runtime_names_it(tmp_path, embedded_runtime):
    """After tg.connect() was run again (a second runtime current), saving a model whose values
    live on the first one failed inside Dask ("Only use allow_other_workers= if using workers=")."""
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(16, 8), (16, None)], runtime=embedded_runtime)
    step(*_data(0))
    with tg.connect(n_workers=1, threads_per_worker=1, quiet=True, dashboard=False, make_current=False) as other:
        with pytest.raises(CheckpointError, match=r"the runtime holding the model's values.*held by another runtime"):
            tg.io.save_checkpoint(tmp_path / "ck", model, opt, runtime=other)
    assert not (tmp_path / "ck").exists()
    tg.io.save_checkpoint(tmp_path / "ck", model, opt, runtime=embedded_runtime)
