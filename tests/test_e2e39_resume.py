"""Resuming training from checkpoints, as a user meets it (an end-to-end audit): the learning-rate
schedule a restore replaces, the optimizer settings it keeps (parameter groups included), the
checks of an optimizer's settings, a checkpoint restored into another kind of optimizer or into a
model of another config, and a restart after a lost worker. Resumed losses are compared with an
uninterrupted run's: equal to the bit, the plan being the same."""

from __future__ import annotations

import dataclasses
import os
import signal
import warnings

import numpy as np
import pytest
from conftest import lm_loss, mse, regression_data

import tilegraph as tg
from tilegraph import models


def _model():
    return tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)


def _groups(model, decay=0.1, no_decay=0.0, **rest):
    """``tilegraph train``'s groups: weight decay on the matrices, none on the biases."""
    params = model.parameters()
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": decay, **rest},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": no_decay}]


def _trainer(model, opt, **kw):
    return tg.Trainer(model, opt, regression_data(0, 16), batch_size=16, loss_fn=mse, progress=False, **kw)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An uninterrupted run of 8 steps (AdamW in two groups, warmup_cosine over the 8) with
    checkpoints every 4: (its losses, its checkpoint folder)."""
    folder = tmp_path_factory.mktemp("run") / "ck"
    model = _model()
    opt = tg.optim.AdamW(_groups(model), lr=tg.optim.warmup_cosine(3e-2, 2, 8), clip_grad_norm=1.0)
    res = _trainer(model, opt, checkpoint_dir=folder, checkpoint_every=4).fit(8)
    return res.losses, folder


def _resumed(folder, step, make_opt, steps):
    """A new model and optimizer (``make_opt(model)``) resumed from ``folder``'s checkpoint of
    ``step`` through a Trainer and trained ``steps`` more: (its losses, the optimizer)."""
    model = _model()
    opt = make_opt(model)
    trainer = _trainer(model, opt)
    assert trainer.load_checkpoint(folder / f"step-{step:06d}") == step
    return trainer.fit(steps).losses, opt


# -- the schedule a restore replaces ----------------------------------------------------------------
def test_resuming_with_the_runs_own_settings_says_nothing_and_gives_its_losses(run):
    """The run's optimizer made again as it was (its schedule given): nothing to warn about, and the
    losses of the uninterrupted run to the bit."""
    losses, folder = run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, opt = _resumed(folder, 4, lambda m: tg.optim.AdamW(_groups(m), lr=tg.optim.warmup_cosine(3e-2, 2, 8),
                                                                 clip_grad_norm=1.0), 4)
    assert got == losses[4:]
    # made with a number, as torch's load_state_dict restores a group's lr: the saved schedule, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, opt = _resumed(folder, 4, lambda m: tg.optim.AdamW(_groups(m), lr=3e-2, clip_grad_norm=1.0), 4)
    assert got == losses[4:] and opt.schedule.spec == tg.optim.warmup_cosine(3e-2, 2, 8).spec


def test_a_restore_names_the_schedule_it_replaces(run):
    """An optimizer made with a longer schedule (to train on further) and restored from a
    checkpoint: the saved schedule replaced it without a word (Checkpoint.restore_optimizer and
    Trainer.load_checkpoint; load_state_dict warned), and the extra steps ran at min_lr. Now
    both warn, naming both schedules, from the user's line."""
    _, folder = run
    ck = tg.io.load_checkpoint(folder / "step-000004")
    model = _model()
    ck.load_into(model)
    longer = tg.optim.AdamW(_groups(model), lr=tg.optim.warmup_cosine(3e-2, 2, 40), clip_grad_norm=1.0)
    with pytest.warns(UserWarning, match=r"the saved learning-rate schedule, warmup_cosine\(base_lr=0.03, warmup=2, "
                      r"total=8, min_lr=0\), replaces this optimizer's, warmup_cosine\(.*total=40.*set opt.schedule = "
                      r"\.\.\. after loading") as caught:
        ck.restore_optimizer(longer, model)
    assert [w.filename for w in caught] == [__file__]
    assert longer.schedule.spec["total"] == 8 and longer.step_count == 4
    with warnings.catch_warnings():  # the restored one is no schedule of the user's: again, nothing to say
        warnings.simplefilter("error")
        ck.restore_optimizer(longer, model)

    trainer = _trainer(m := _model(), tg.optim.AdamW(_groups(m), lr=tg.optim.warmup_cosine(3e-2, 2, 40),
                                                     clip_grad_norm=1.0))
    with pytest.warns(UserWarning, match="replaces this optimizer's") as caught:
        trainer.load_checkpoint(folder / "step-000004")
    assert [w.filename for w in caught] == [__file__]
    assert trainer.optimizer.schedule.spec["total"] == 8


# -- the settings a restore keeps -------------------------------------------------------------------
def test_a_restore_names_each_parameter_groups_setting_that_differs(run):
    """``tilegraph train``'s groups (no weight decay on biases): an optimizer whose no-decay group
    decays, or whose decay group has other betas, took the checkpoint's moments without a word
    (only the optimizer's own settings were compared). Now the warning names the group, its
    parameters and the setting."""
    _, folder = run
    ck = tg.io.load_checkpoint(folder / "step-000004")
    model = _model()
    ck.load_into(model)
    opt = tg.optim.AdamW(_groups(model, no_decay=0.05, betas=(0.9, 0.95)), lr=3e-2, clip_grad_norm=1.0)
    with pytest.warns(UserWarning) as caught:
        ck.restore_optimizer(opt, model)
    assert [w.filename for w in caught] == [__file__]
    assert str(caught[0].message).startswith(
        f"[tilegraph.io.load_checkpoint({folder / 'step-000004'})] the optimizer's settings differ from the "
        "checkpoint's: param_groups[0] (2 parameters: fc1.weight, fc2.weight): betas=[0.9, 0.95] here, "
        "[0.9, 0.999] saved; param_groups[1] (2 parameters: fc1.bias, fc2.bias): weight_decay=0.05 here, 0.0 saved; "
        "training goes on with this optimizer's")
    assert opt.step_count == 4  # restored all the same, with its own settings
    # one group here, two saved: the parameters whose saved group had other settings
    flat = tg.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1, clip_grad_norm=1.0)
    with pytest.warns(UserWarning, match=r"differ from the checkpoint's: param_groups\[0\] \(4 parameters: fc1.weight, "
                      r"fc1.bias, fc2.weight, \.\.\.\): weight_decay=0.1 here, 0.0 saved for 2 of its 4 parameters "
                      r"\(fc1.bias, fc2.bias\); training goes on"):
        ck.restore_optimizer(flat, model)
    # the same groups as saved: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ck.restore_optimizer(tg.optim.AdamW(_groups(model), lr=3e-2, clip_grad_norm=1.0), model)


def test_a_state_dict_of_other_group_settings_is_refused_naming_every_group():
    """load_state_dict named the parameters one by one, the first 8: a model of 9 layers, whose
    weights came first, never had its biases' group named. Now a line per group."""
    layers = [tg.nn.Linear(4, 4, seed=i) for i in range(9)]
    weights, biases = [layer.weight for layer in layers], [layer.bias for layer in layers]

    def make(decay, no_decay):
        return tg.optim.AdamW([{"params": weights, "weight_decay": decay},
                               {"params": biases, "weight_decay": no_decay}], lr=1e-3)

    state = make(0.1, 0.0).state_dict()
    with pytest.raises(tg.TileError) as e:
        make(0.01, 0.01).load_state_dict(state)
    assert e.value.received == ("param_groups[0] (9 parameters: weight, weight, weight, ...): weight_decay=0.01 here, "
                                "0.1 saved; param_groups[1] (9 parameters: bias, bias, bias, ...): weight_decay=0.01 "
                                "here, 0.0 saved")
    make(0.1, 0.0).load_state_dict(state)  # its own: taken


def test_an_optimizers_settings_are_checked_by_one_rule():
    """SGD and Adam/AdamW checked each setting in their constructor and again as they set it, two
    copies of each rule that had drifted: ``SGD(..., nesterov=np.True_)`` was refused where
    ``opt.nesterov = np.True_`` was taken. One check now, named by the constructor."""
    params = tg.nn.Linear(4, 2, seed=0).parameters()
    sgd = tg.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=np.True_)
    assert sgd.nesterov is True
    sgd.nesterov = np.False_
    assert sgd.nesterov is False
    for make, attribute, value in [
        (lambda: tg.optim.Adam(params, betas=(0.9, 1.0)), "betas", (0.9, 1.0)),
        (lambda: tg.optim.AdamW(params, eps=0.0), "eps", 0.0),
        (lambda: tg.optim.SGD(params, momentum=0.9, dampening=2.0), "dampening", 2.0),
        (lambda: tg.optim.SGD(params, momentum=0.9, weight_decay=-1.0), "weight_decay", -1.0),
        (lambda: tg.optim.AdamW(params, clip_grad_norm=0.0), "clip_grad_norm", 0.0),
    ]:
        with pytest.raises(tg.TileError) as made:
            make()
        kind = made.value.where.rsplit(".", 1)[-1]
        assert made.value.where == f"tilegraph.optim.{kind}"  # the constructor's
        opt = getattr(tg.optim, kind)(params, momentum=0.9) if kind == "SGD" else getattr(tg.optim, kind)(params)
        with pytest.raises(tg.TileError) as set_later:
            setattr(opt, attribute, value)
        assert set_later.value.where == f"tilegraph.optim.{kind}.{attribute}"
        assert (made.value.what, made.value.received) == (set_later.value.what, set_later.value.received)


# -- another optimizer, another model -------------------------------------------------------------
def test_a_checkpoint_of_another_kind_of_optimizer_says_what_to_do(run):
    """An AdamW run's checkpoint restored into SGD: "optimizer state of a SGD; received: state of
    a AdamW", without a way on. Now it names the kind to make, and how to keep the weights alone."""
    _, folder = run
    ck = tg.io.load_checkpoint(folder / "step-000004")
    model = _model()
    ck.load_into(model)
    sgd = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(tg.io.CheckpointError) as e:
        ck.restore_optimizer(sgd, model)
    assert e.value.what.startswith("an optimizer of the kind whose state the checkpoint holds, AdamW: make a "
                                   "tg.optim.AdamW with the run's settings to continue it; to train on from its "
                                   "weights with another optimizer, load the model alone (load_into")
    assert e.value.received == "the state of an AdamW for an SGD"
    assert sgd.step_count == 0
    ck.load_into(model)  # the weights alone, as it says
    trainer = _trainer(model, sgd)
    assert len(trainer.fit(2).losses) == 2


def test_an_sgd_checkpoint_without_momentum_into_an_sgd_with_it_names_the_settings(tmp_path):
    """A run's SGD without momentum, restored into one with: the error listed the momentum
    buffers missing, one per parameter, without why. Now it names the run's settings."""
    model = _model()
    plain = tg.optim.SGD(model.parameters(), lr=0.1)
    tg.TrainStep(model, plain, mse)(*regression_data(0, 16)(1))
    ck = tg.io.load_checkpoint(tg.io.save_checkpoint(tmp_path / "ck", model, plain))
    heavy = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(tg.io.CheckpointError) as e:
        ck.restore_optimizer(heavy, model)
    assert e.value.what == ("an optimizer that keeps the state the checkpoint's SGD kept per parameter (none): make it "
                            "with the run's settings (momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0), "
                            "or load the model alone (load_into) to train on from its weights with these")
    assert e.value.received == "this SGD keeps momentum_buffer, momentum=0.9"
    assert heavy.step_count == 0
    ck.restore_optimizer(tg.optim.SGD(model.parameters(), lr=0.1), model)  # the run's own: taken


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    """A debug GPT-2 with its AdamW state, 2 steps in."""
    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 9))
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))
    for _ in range(2):
        step(ids[:, :-1], ids[:, 1:])
    return tg.io.save_checkpoint(tmp_path_factory.mktemp("gpt") / "ck", model, opt), model.config


def test_resuming_into_a_model_of_another_config_is_refused_naming_the_key(gpt_checkpoint):
    """A notebook's model rebuilt with another n_heads (or norm_eps): the same weight shapes, so
    Trainer.load_checkpoint restored them and trained on as another model, silently. Now the
    differences are named, and nothing changes; a config that differs only where it changes
    nothing (GPT-2's hidden left to its default 4 * dim) is taken."""
    path, config = gpt_checkpoint
    for change, named in [(dict(n_heads=2), "n_heads 4, the model's 2"),
                          (dict(n_heads=8, norm_eps=1e-6), "n_heads 4, the model's 8; norm_eps 1e-05, the model's 1e-06")]:
        model = models.build(dataclasses.replace(config, **change), seed=1)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
        before = tg.compute(model.parameters()[0])[0]
        ids = np.zeros((2, 9), np.int64)
        trainer = tg.Trainer(model, opt, lambda step: (ids[:, :-1], ids[:, 1:]), loss_fn=lm_loss, progress=False)
        with pytest.raises(tg.io.CheckpointError) as e:
            trainer.load_checkpoint(path)
        assert e.value.what.startswith("a model of the checkpoint's config to restore into (its weights fit this one's "
                                       "shapes, but it computes another function)")
        assert e.value.received == named
        assert opt.step_count == 0 and np.array_equal(tg.compute(model.parameters()[0])[0], before)
    same = models.build(dataclasses.replace(config, hidden=4 * config.dim), seed=1)
    if config.hidden is None:  # (the flavor leaves it to the default)
        tg.io.load_checkpoint(path).restore(same, tg.optim.AdamW(same.parameters(), lr=1e-3))


def test_a_llama_resumed_with_a_longer_max_seq_len_is_taken(tmp_path):
    """max_seq_len sizes no Llama weight (RoPE has no table): a resumed run may read longer
    sequences. A shorter one is refused with the other keys."""
    config = models.LlamaConfig.flavor("debug")
    model = models.build(config, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    path = tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    longer = models.build(dataclasses.replace(config, max_seq_len=2 * config.max_seq_len), seed=1)
    tg.io.load_checkpoint(path).restore(longer, tg.optim.AdamW(longer.parameters(), lr=1e-3))
    shorter = models.build(dataclasses.replace(config, max_seq_len=config.max_seq_len // 2), seed=1)
    with pytest.raises(tg.io.CheckpointError, match=rf"received: max_seq_len {config.max_seq_len}, the model's "
                                                    rf"{config.max_seq_len // 2}$"):
        tg.io.load_checkpoint(path).restore(shorter, tg.optim.AdamW(shorter.parameters(), lr=1e-3))


# -- tilegraph train --resume ----------------------------------------------------------------------
@pytest.mark.distributed
def test_cli_resume_warns_about_no_schedule_and_gives_the_runs_losses(tmp_path):
    """``tilegraph train --resume`` made its optimizer with a schedule over the steps it adds,
    which the checkpoint's replaced. Now that a restore warns where it replaces a schedule given,
    the command makes it with the checkpoint's own: no warning, and the uninterrupted run's losses."""
    import json

    from test_cli import SMALL, _cli

    (tmp_path / "small.toml").write_text(SMALL.replace("eval_every = 12", "eval_every = 0"))
    full = _cli("train", "small.toml", "--out", "run", "--steps", "6", "--set", "output.checkpoint_every=3",
                "--no-progress", cwd=tmp_path)
    assert full.returncode == 0, full.stderr[-3000:]
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    resumed = _cli("train", "small.toml", "--resume", "run/checkpoints/step-000003", "--out", "again",
                   "--no-progress", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # (the command's own lines name the config file's keys it does not use: steps = 24, ...)
    assert "replaces this optimizer's" not in resumed.stderr and "UserWarning" not in resumed.stderr, resumed.stderr
    again = [r["loss"] for r in map(json.loads, (tmp_path / "again" / "metrics.jsonl").read_text().splitlines())
             if "loss" in r and r["step"] > 3]
    assert again == losses[3:]


# -- a restart after a lost worker ------------------------------------------------------------------
@pytest.mark.distributed
def test_a_restart_keeps_the_schedule_set_after_loading(run, own_runtime, tmp_path):
    """The recipe after a divergence: load the checkpoint before it, set a lower rate
    (``opt.schedule = constant(...)``), fit again. A worker lost then restarted the fit from that
    checkpoint with its saved schedule back in place (the high rate the run diverged at). Now a
    restart keeps the schedule the fit runs with: the losses of a run without the loss."""
    from distributed import wait

    _, folder = run
    rt = own_runtime
    pids = rt.client.run(os.getpid)

    def lower(**kw):
        model = _model()
        opt = tg.optim.AdamW(_groups(model), lr=3e-2, clip_grad_norm=1.0)
        trainer = _trainer(model, opt, runtime=rt, steps_per_graph=1, **kw)
        trainer.load_checkpoint(folder / "step-000004")
        opt.schedule = tg.optim.constant(1e-3)
        return trainer

    want = lower().fit(4).losses
    killed = []

    def kill(trainer, stats):
        if not killed and trainer.optimizer.step_count >= 6:
            futures = [c.value.future for p in trainer.optimizer.params for c in p.cells.flat
                       if hasattr(c.value, "future")]
            wait(futures)
            held = sorted({w for ws in rt.client.who_has(futures).values() for w in ws})
            killed.append(held[0])
            os.kill(pids[held[0]], signal.SIGKILL)

    trainer = lower(checkpoint_dir=tmp_path / "ck", restart_on_failure=True, on_step=[kill])
    res = trainer.fit(4)
    assert killed and len(res.restarts) == 1 and res.restarts[0]["step"] == 4, res.restarts
    assert trainer.optimizer.schedule.spec == tg.optim.constant(1e-3).spec
    np.testing.assert_allclose(res.losses, want, rtol=1e-6)
