"""The training API as a notebook user meets it: defects found by trying it as a new user would
(re-running cells, interrupting fit, optimizer state round trips, odd plot and checkpoint settings)."""

import json

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.plotting import plot_training, read_metrics
from conftest import mse


def _data(step):
    x = np.random.default_rng([0, step]).standard_normal((32, 8)).astype(np.float32)
    return x, np.tanh(x[:, :2])


def _trainer(runtime=None, **kw):
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-2, 2, 20))
    kw = {"progress": False, "batch_tiles": [(16, 8), (16, None)], **kw}
    return model, opt, tg.Trainer(model, opt, kw.pop("data", _data), runtime, loss_fn=mse, batch_size=32, **kw)


# -- the optimizer ---------------------------------------------------------------------------------
def test_optimizer_load_state_dict_round_trips_state_dict():
    """``opt.load_state_dict(opt.state_dict())`` (torch's pair) was an AttributeError, and
    state_dict held only the step: moments and schedule could not be carried over."""
    model, opt, trainer = _trainer()
    trainer.fit(3)
    state, weights = opt.state_dict(), model.state_dict()
    assert state["step"] == 3 and state["schedule"] == opt.schedule.spec
    assert set(state["state"][0]) == {"exp_avg", "exp_avg_sq"} and np.any(state["state"][0]["exp_avg"])
    expected = trainer.fit(2).losses

    model2, opt2, trainer2 = _trainer()
    model2.load_state_dict(weights)
    opt2.schedule = tg.optim.constant(1.0)
    opt2.load_state_dict(state)
    assert opt2.step_count == 3 and opt2.schedule.spec == state["schedule"]
    assert trainer2.fit(2).losses == expected  # moments, step and schedule all came back

    before = opt2.state_dict()
    with pytest.raises(tg.TileError, match=r"load_state_dict\] optimizer state does not match.*missing exp_avg"):
        opt2.load_state_dict({"step": 1, "state": [{}] * len(opt2.params)})
    with pytest.raises(tg.TileError, match=r"load_state_dict\] state must be a mapping with 'step' and 'state'"):
        opt2.load_state_dict({"step": 1})
    after = opt2.state_dict()  # a state that did not fit changed nothing
    assert after["step"] == before["step"] == 5
    np.testing.assert_array_equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    assert tg.optim.SGD(model.parameters(), lr=0.1).state_dict()["state"] == [{}] * len(opt.params)


@pytest.mark.parametrize("step", [0, -1, "3", 1.5])
def test_lr_at_refuses_a_step_that_is_not_an_update_number(step):
    """``opt.lr_at("3")`` was a TypeError from inside the schedule, ``lr_at(-1)`` was blamed on
    the schedule ("must give a finite number >= 0") and ``lr_at(0)`` / ``lr_at(1.5)`` answered
    for updates that do not exist (they count from 1)."""
    opt = tg.optim.AdamW(tg.nn.MLP(8, 16, out_dim=2, tile=8).parameters(), lr=tg.optim.warmup_cosine(1e-2, 2, 20))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.AdamW.lr_at\] step must be an integer >= 1"):
        opt.lr_at(step)
    assert opt.lr_at(np.int64(2)) == 1e-2


# -- checkpoints -----------------------------------------------------------------------------------
def test_rerun_cell_into_the_same_checkpoint_dir_is_refused_before_training(tmp_path):
    """A notebook cell run again (a fresh model and Trainer, the same checkpoint_dir): the fit
    trained up to its first checkpoint, which ``checkpoint_keep`` pruned at once as older than the
    first run's (a path in FitResult.checkpoints that did not exist), then failed at a step the
    first run had saved ("must not exist yet"), after training up to there."""
    ck = tmp_path / "ck"
    _, _, first = _trainer(checkpoint_dir=ck, checkpoint_every=2, checkpoint_keep=2)
    first.fit(5)
    saved = sorted(p.name for p in ck.iterdir())
    assert saved == ["step-000004", "step-000005"]
    _, opt, again = _trainer(checkpoint_dir=ck, checkpoint_every=2, checkpoint_keep=2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.fit\] checkpoint_dir must hold no checkpoint of a "
                                           r"step after the optimizer's step count \(0\).*step-000004, step-000005"):
        again.fit(5)
    assert opt.step_count == 0 and sorted(p.name for p in ck.iterdir()) == saved  # nothing ran, nothing changed
    # what the message says works: continue the newest
    assert again.load_checkpoint(ck / "step-000005") == 5
    assert again.fit(1).checkpoints == [str(ck / "step-000006")]


def test_trainer_checks_its_checkpoint_settings_up_front(tmp_path):
    """``checkpoint_files={"tok.json": "text"}`` was taken and failed at the first checkpoint,
    after training up to it; a list was a bare TypeError; ``checkpoint_keep`` without a
    checkpoint_dir was silently ignored; ``checkpoint_keep=0`` was refused as the
    CheckpointManager's "keep"."""
    ck = tmp_path / "ck"
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] checkpoint_files are plain file names .* "
                                           r"received: 'tok.json': str"):
        _trainer(checkpoint_dir=ck, checkpoint_every=2, checkpoint_files={"tok.json": "text"})
    with pytest.raises(tg.TileError, match=r"checkpoint_files must be a dict \(or None\); received: list"):
        _trainer(checkpoint_dir=ck, checkpoint_files=[("tok.json", b"{}")])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] checkpoint_keep needs a checkpoint_dir"):
        _trainer(checkpoint_keep=2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] checkpoint_keep \(None: keep all\) must be an "
                                           r"integer >= 1; received: 0"):
        _trainer(checkpoint_dir=ck, checkpoint_keep=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] checkpoint_every must be an integer >= 0"):
        _trainer(checkpoint_dir=ck, checkpoint_every=2.5)
    assert not ck.exists()
    _, _, trainer = _trainer(checkpoint_dir=ck, checkpoint_every=np.int64(2), checkpoint_keep=np.int64(1),
                             checkpoint_files={"tok.json": b"{}"})
    assert trainer.fit(3).checkpoints[-1] == str(ck / "step-000003")
    assert (ck / "step-000003" / "tok.json").read_bytes() == b"{}" and len(list(ck.iterdir())) == 1


# -- interrupting fit ------------------------------------------------------------------------------
def _interrupt_at(step: int):
    armed = [True]

    def hook(trainer, stats):
        if trainer.history[-1]["step"] == step and armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
    return hook


def _check_interrupted(tmp_path, runtime=None):
    _, opt, trainer = _trainer(runtime, log_dir=tmp_path / "log", steps_per_graph=3, on_step=[_interrupt_at(4)])
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(9)
    ran = opt.step_count
    assert ran > 4  # pipelined groups of 3 steps: steps after 4 had been submitted when its hook raised
    logged = [r["step"] for r in trainer.history if "loss" in r]
    on_disk = [json.loads(line)["step"] for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert logged == on_disk == list(range(1, ran + 1))  # the steps after 4 were missing
    trainer.fit(2)  # the next fit goes on after them
    assert [r["step"] for r in trainer.history if "loss" in r] == list(range(1, ran + 3))


def test_keyboard_interrupt_in_fit_keeps_the_records_of_the_steps_that_ran(tmp_path):
    """Ctrl-C (a KeyboardInterrupt from a hook or the data) while several steps were submitted:
    their updates were in the parameters and the step count, but their losses were never
    logged (metrics.jsonl, history, the plot jumped from step 4 to 7)."""
    _check_interrupted(tmp_path)


@pytest.mark.distributed
def test_keyboard_interrupt_in_fit_on_the_cluster_keeps_the_records(embedded_runtime, tmp_path):
    """The same on the embedded cluster, whose steps run while the client waits."""
    with embedded_runtime.as_current():
        _check_interrupted(tmp_path, embedded_runtime)


def test_a_second_interrupt_while_the_steps_run_out_still_logs_them(tmp_path, monkeypatch, capsys):
    """A second Ctrl-C (the notebook's stop button pressed twice) while fit logs the steps already
    submitted: they are logged all the same, saying so (before, the records of the steps still
    waiting were lost while the next fit went on after them: a gap in metrics.jsonl); a third
    stops at once."""
    from tilegraph._train import PendingStep

    real, stops = PendingStep.result, []

    def result(self, *args, **kwargs):  # the second stop, while the first step waiting is logged
        if stops == ["hook"]:
            stops.append("second")
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    def hook(trainer, stats):
        if trainer.history[-1]["step"] == 4 and not stops:
            stops.append("hook")
            raise KeyboardInterrupt

    monkeypatch.setattr(PendingStep, "result", result)
    _, opt, trainer = _trainer(log_dir=tmp_path / "log", steps_per_graph=3, on_step=[hook], progress=True)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(9)
    assert stops == ["hook", "second"] and opt.step_count > 4
    logged = [r["step"] for r in trainer.history if "loss" in r]
    on_disk = [json.loads(line)["step"] for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert logged == on_disk == list(range(1, opt.step_count + 1))
    said = capsys.readouterr()
    assert "stopping: logging the 5 steps already run (interrupt again to stop at once" in said.out + said.err
    assert f"interrupted: stopped after step {opt.step_count}, every step run logged" in said.out + said.err


# -- plotting --------------------------------------------------------------------------------------
def test_plot_writes_the_format_its_path_names(tmp_path):
    """``trainer.plot("run/loss.pdf")`` wrote PNG bytes into loss.pdf (the temporary file's
    ".png" chose the format); an unknown suffix made a PNG under that name."""
    _, _, trainer = _trainer()
    trainer.fit(2)
    assert trainer.plot(tmp_path / "loss.pdf").read_bytes()[:5] == b"%PDF-"
    assert trainer.plot(tmp_path / "loss.svg").read_text().lstrip().startswith("<?xml")
    assert trainer.plot(tmp_path / "loss").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # no suffix: PNG
    with pytest.raises(tg.TileError, match=r"path's suffix must name an image format: .*pdf.*png"):
        trainer.plot(tmp_path / "loss.xyz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss", "loss.pdf", "loss.svg"]  # no temporary left


def test_plot_training_refuses_what_it_cannot_draw(tmp_path):
    """None, a dict or a list of numbers as records were TypeError/AttributeError from inside; a
    missing metrics.jsonl a FileNotFoundError; ``window=0``, ``-3`` or ``2.5`` were taken for
    "no smoothing" without a word."""
    recs = [{"run": "a", "step": s, "loss": 1.0 / s} for s in range(1, 9)]
    for records, received in ((None, "NoneType"), ({"step": 1}, "dict"), ([1, 2], r"records\[0\] = 1")):
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.plotting.plot_training\] .*received: {received}"):
            plot_training(records)
    for window in (0, -3, 2.5, "5"):
        with pytest.raises(tg.TileError, match=r"window must be an int >= 1"):
            plot_training(recs, window=window)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.plotting.read_metrics\] path must be a readable "
                                           r"metrics.jsonl.*No such file"):
        plot_training(tmp_path / "missing.jsonl")
    f = tmp_path / "metrics.jsonl"
    f.write_text('[1, 2]\n"text"\n' + "\n".join(json.dumps(r) for r in recs) + "\n")
    assert read_metrics(f) == recs  # lines that are not records are skipped, as a cut line is
    assert plot_training(f, window=np.int64(3), vocab_size=np.int64(5)).axes[0].get_ylabel() == "loss (nats)"


# -- changing the Trainer between fits -------------------------------------------------------------
def test_swapping_model_optimizer_or_loss_between_fits_is_refused():
    """``trainer.optimizer = AdamW(..., lr=1e-4)`` between fits was ignored (the old optimizer
    went on at its own learning rate, and the fit logged its steps from 1 again);
    ``trainer.model = other`` left ``other`` untrained; a new ``loss_fn`` was not used."""
    model, opt, trainer = _trainer()
    trainer.fit(2)
    other = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=1)
    for name, value in (("optimizer", tg.optim.AdamW(model.parameters(), lr=1e-4)), ("model", other),
                        ("loss_fn", lambda m, x, y: (m(x) - y).mean()), ("accum_steps", 2), ("batch_size", 16)):
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.Trainer\] {name} is fixed when the Trainer is built"):
            setattr(trainer, name, value)
    trainer.batch_size = 32  # the same value again is fine
    trainer.data = lambda step: _data(step + 100)  # the data may change: each step asks for its batch
    with pytest.warns(UserWarning, match="a newer AdamW was made over this step's parameters"):  # (the refused one)
        assert trainer.fit(1).steps == 1 and opt.step_count == 3 and trainer.history[-1]["step"] == 3


def test_keyboard_interrupt_while_fit_waits_for_a_loss_keeps_that_steps_record(tmp_path, monkeypatch):
    """Ctrl-C (the notebook's stop button) while fit waited for a step's loss: the step was taken
    off the queue first, so its update was applied and its loss never logged (history and
    metrics.jsonl skipped it, the progress bar ended one short)."""
    from tilegraph._train import PendingStep

    real = PendingStep.result
    calls = []

    def result(self, *args, **kwargs):
        calls.append(self.step)
        if self.step == 5 and calls.count(5) == 1:  # the first wait for step 5's loss is interrupted
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PendingStep, "result", result)
    _, opt, trainer = _trainer(log_dir=tmp_path / "log")
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(9)
    ran = opt.step_count
    logged = [r["step"] for r in trainer.history if "loss" in r]
    on_disk = [json.loads(line)["step"] for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert ran >= 5 and logged == on_disk == list(range(1, ran + 1))


def test_a_trainer_built_again_on_the_same_log_continues_its_run_or_says_it_is_another(tmp_path):
    """A notebook cell that builds the Trainer again (same model, optimizer and log_dir): its
    records go on under the run id of those before it, so history and loss.png cover the whole
    run (before: a new run id, and the plot showed only the steps since). A fresh model and
    optimizer on that log_dir get a warning: another run's records are there."""
    import warnings

    from tilegraph.plotting import plot_training

    model, opt, first = _trainer(log_dir=tmp_path / "log")
    first.fit(4)
    again = tg.Trainer(model, opt, _data, loss_fn=mse, batch_size=32, progress=False,
                       batch_tiles=[(16, 8), (16, None)], log_dir=tmp_path / "log")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again.fit(3)
    assert again.run_id == first.run_id
    assert [r["step"] for r in again.history if "loss" in r] == list(range(1, 8))
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert {r["run"] for r in records} == {first.run_id}
    fig = plot_training(records, run=first.run_id)  # the whole run, steps 1-7
    assert max(max(line.get_xdata()) for line in fig.axes[0].get_lines()) == 7

    _, _, other = _trainer(log_dir=tmp_path / "log")  # a fresh model and optimizer: another run
    with pytest.warns(UserWarning, match=r"metrics.jsonl ends with another run's records \(run \w+, up to step 7\), "
                                         r"and this trainer starts after step 0"):
        other.fit(2)
    assert other.run_id != first.run_id and [r["step"] for r in other.history if "loss" in r] == [1, 2]
