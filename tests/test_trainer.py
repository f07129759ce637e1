"""Trainer: the loop, its logs, plot, evaluation, checkpoints/resume, accumulation and NaN stops."""

import json
import sys

import numpy as np
import pytest

import tilegraph as tg
from conftest import mse


def _data(seed):
    w = np.random.default_rng(100).standard_normal((8, 2)).astype(np.float32) / 3

    def batch(step):
        x = np.random.default_rng([seed, step]).standard_normal((32, 8)).astype(np.float32)
        return x, np.tanh(x @ w)
    return batch


def _setup(tmp_path=None, steps=40, **kw):
    model = tg.nn.MLP(8, 32, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(2e-2, min(5, steps), steps), clip_grad_norm=1.0)
    trainer = tg.Trainer(model, opt, _data(0), loss_fn=mse, batch_size=32, eval_data=_data(1), eval_batches=2,
                         batch_tiles=[(16, 8), (16, None)], progress=False, **kw)
    return model, opt, trainer


def test_fit_logs_metrics_plots_and_evaluates(tmp_path):
    seen = []
    _, _, trainer = _setup(log_dir=tmp_path / "run", eval_every=10, on_step=[lambda t, s: seen.append(s.loss)])
    res = trainer.fit(40)
    assert res.steps == 40 and seen == res.losses
    assert res.losses[-1] < 0.3 * res.losses[0]
    assert [s for s, _ in res.val_losses] == [10, 20, 30, 40]
    assert res.val_losses[-1][1] < 0.6 * res.val_losses[0][1] and res.val_losses[-1][1] < 0.2 * res.losses[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 41))
    # an MLP on float features: rows per second (its (B, D) batches are no tokens)
    assert [r["loss"] for r in steps] == res.losses and all(r["samples_per_s"] > 0 for r in steps)
    assert not any("tokens_per_s" in r for r in steps)
    assert [(r["step"], r["val_loss"]) for r in records if "val_loss" in r] == res.val_losses
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000


def test_checkpoint_resume_continues_exactly(tmp_path):
    model, _, trainer = _setup(steps=8, checkpoint_dir=tmp_path / "ck", checkpoint_every=4)
    trainer.fit(8)
    want = model.state_dict()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000004", "step-000008"]
    model2, opt2, trainer2 = _setup(steps=8)
    assert trainer2.load_checkpoint(tmp_path / "ck" / "step-000004") == 4 and opt2.step_count == 4
    res = trainer2.fit(4)
    assert res.steps == 4
    for k, v in model2.state_dict().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)  # bit-exact
    # an existing checkpoint is never overwritten
    with pytest.raises(tg.TileError, match="must not exist yet"):
        trainer2.save_checkpoint(tmp_path / "ck" / "step-000008")


def test_checkpoint_hooks_and_bad_folders(tmp_path):
    called = []
    _, _, trainer = _setup(steps=2, checkpoint_dir=tmp_path / "ck", on_checkpoint=[lambda t, p: called.append(p)])
    trainer.fit(2)
    assert [p.name for p in called] == ["step-000002"]
    with pytest.raises(tg.TileError, match=r"tilegraph checkpoint folder .* is not one"):
        trainer.load_checkpoint(tmp_path)
    with pytest.raises(tg.TileError, match=r"checkpoint_every needs a checkpoint_dir"):
        _setup(checkpoint_every=2)
    # a callable data's 32 rows that do not divide by accum_steps run as 11, 11, 10 (tests/test_e2e47_accum.py)
    assert _setup(accum_steps=3)[2].batch_size == 32


def test_accumulation_in_the_trainer_matches_one_batch():
    m1, _, t1 = _setup(steps=5)
    t1.fit(5)
    m2, _, t2 = _setup(steps=5, accum_steps=2)
    t2.fit(5)
    for k, v in m1.state_dict().items():
        np.testing.assert_allclose(m2.state_dict()[k], v, rtol=2e-5, atol=1e-6, err_msg=k)


def test_nan_loss_stops_and_keeps_the_log(tmp_path):
    def bad(step):
        x = np.ones((32, 8), np.float32) * (np.nan if step == 3 else 1.0)
        return x, np.zeros((32, 2), np.float32)

    model = tg.nn.MLP(8, 32, out_dim=2, tile=8, seed=0)
    opt = tg.optim.SGD(model.parameters(), lr=0.01)
    trainer = tg.Trainer(model, opt, bad, loss_fn=mse, batch_size=32, log_dir=tmp_path, progress=False)
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 3"):
        trainer.fit(5)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


@pytest.mark.distributed
def test_pipelined_steps_equal_one_at_a_time_on_the_cluster(embedded_runtime):
    results = []
    for pipeline in (True, False):
        model, _, trainer = _setup(steps=6, pipeline=pipeline, runtime=embedded_runtime)
        res = trainer.fit(6)
        with embedded_runtime.as_current():
            results.append((res.losses, model.state_dict()))
    (l1, s1), (l2, s2) = results
    assert l1 == l2
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k])


def test_steps_per_graph_gives_the_same_run_and_stops_at_evaluations(tmp_path):
    runs = {}
    for per_graph in (1, 4, "auto"):
        sizes = []
        model, _, trainer = _setup(steps=11, steps_per_graph=per_graph, eval_every=5, checkpoint_every=5,
                                   checkpoint_dir=tmp_path / str(per_graph), on_step=[lambda t, s: sizes.append(s.nodes)])
        res = trainer.fit(11)
        runs[per_graph] = (res, model.state_dict(), sizes)
    one, _, one_sizes = runs[1]
    for per_graph in (4, "auto"):
        res, state, sizes = runs[per_graph]
        assert res.losses == one.losses and res.val_losses == one.val_losses
        assert [s for s, _ in res.val_losses] == [5, 10, 11]
        assert [p.rsplit("-", 1)[1] for p in res.checkpoints] == ["000005", "000010", "000011"]
        for k, v in runs[1][1].items():
            np.testing.assert_array_equal(state[k], v, err_msg=k)
    # groups end at the evaluation/checkpoint steps 5 and 10 and are cut evenly: 3+2, 3+2, 1
    n1 = one_sizes[0]
    assert runs[4][2] == [3 * n1] * 3 + [2 * n1] * 2 + [3 * n1] * 3 + [2 * n1] * 2 + [n1]
    assert runs["auto"][2] == [5 * n1] * 10 + [n1]  # a tiny MLP: as many steps per graph as the run allows


def test_steps_per_graph_is_checked():
    with pytest.raises(tg.TileError, match=r"steps_per_graph must be 'auto' or an int >= 1; received: 0"):
        _setup(steps_per_graph=0)
    with pytest.raises(tg.TileError, match=r"does not combine with accum_steps > 1; received: steps_per_graph=2, "
                                           r"accum_steps=2"):
        _setup(steps_per_graph=2, accum_steps=2)


@pytest.mark.distributed
def test_fit_reports_time_per_model_part_and_writes_a_dask_performance_report(embedded_runtime, tmp_path):
    model, opt, _ = _setup(steps=6)
    trainer = tg.Trainer(model, opt, _data(0), embedded_runtime, loss_fn=mse, batch_size=32,
                         batch_tiles=[(16, 8), (16, None)], progress=False, steps_per_graph=1,
                         performance_report=tmp_path / "report" / "step3.html", report_step=3)
    res = trainer.fit(6)
    html = (tmp_path / "report" / "step3.html").read_text()
    assert "Dask Performance Report" in html and len(html) > 10_000
    # kernel time per part of the model, the optimizer's update among them
    assert {"fc1", "fc2", "fc1:backward", "optimizer:update"} <= set(res.kernel_seconds), res.kernel_seconds
    assert list(res.kernel_seconds.values()) == sorted(res.kernel_seconds.values(), reverse=True)
    assert 0.0 <= res.outside_kernels < 1.0
    # the time with no tile task running is part of it (the rest: the runner inside tasks)
    assert 0.0 < res.no_task <= res.outside_kernels
    assert res.profile().startswith("kernel time: ") and "outside kernels" in res.profile()
    assert f"{res.no_task:.0%} in no task" in res.profile()
    with pytest.raises(tg.TileError, match=r"performance_report needs a distributed runtime"):
        tg.Trainer(model, opt, _data(0), loss_fn=mse, performance_report=tmp_path / "r.html")


# -- TensorBoard, progress lines, the plot ---------------------------------------------------------
class _FakeWriter:
    """tensorboardX.SummaryWriter as the trainer uses it: the scalars, by tag."""
    opened: list = []

    def __init__(self, logdir, flush_secs=120):
        self.logdir, self.scalars, self.closed = logdir, {}, False
        _FakeWriter.opened.append(self)

    def add_scalar(self, tag, value, step, walltime=None):
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and walltime > 0
        self.scalars.setdefault(tag, []).append((step, value))

    def close(self):
        self.closed = True


@pytest.fixture
def fake_tensorboardx(monkeypatch):
    import types

    _FakeWriter.opened = []
    monkeypatch.setitem(sys.modules, "tensorboardX", types.SimpleNamespace(SummaryWriter=_FakeWriter))
    return _FakeWriter


def test_fit_writes_every_metric_to_tensorboard(tmp_path, fake_tensorboardx):
    _, _, trainer = _setup(steps=10, log_dir=tmp_path, tensorboard=True, eval_every=5)
    res = trainer.fit(10)
    (writer,) = fake_tensorboardx.opened
    assert writer.logdir == str(tmp_path / "tensorboard") and writer.closed  # closed (flushed) when fit ends
    assert writer.scalars["train/loss"] == list(zip(range(1, 11), res.losses))
    assert [s for s, _ in writer.scalars["train/lr"]] == list(range(1, 11))
    assert {"train/grad_norm", "train/samples_per_s", "train/step_seconds"} <= set(writer.scalars)
    assert writer.scalars["val/loss"] == res.val_losses
    assert not [tag for tag in writer.scalars if tag.endswith(("run", "time", "step"))]
    _, _, trainer = _setup(steps=2, tensorboard=tmp_path / "tb")  # a folder of its own, no log_dir needed
    trainer.fit(2)
    assert fake_tensorboardx.opened[-1].logdir == str(tmp_path / "tb")


def test_tensorboard_missing_or_misplaced_is_refused_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # neither writer imports
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] TensorBoard logging needs a SummaryWriter: "
                                           r"pip install tensorboardX"):
        _setup(log_dir=tmp_path, tensorboard=True)
    with pytest.raises(tg.TileError, match=r"tensorboard=True writes under log_dir"):
        _setup(tensorboard=True)
    with pytest.raises(tg.TileError, match=r"tensorboard must be True, False or a folder; received: 1"):
        _setup(tensorboard=1)
    assert list(tmp_path.iterdir()) == []


def test_cli_config_tensorboard_key(monkeypatch):
    from tilegraph import cli
    from tilegraph.cli import config as cli_config

    cfg, source = cli.load_config(None)
    assert cfg["output"]["tensorboard"] is False
    cli.check_config(cfg, source)
    cfg["output"]["tensorboard"] = True
    monkeypatch.setattr(cli_config, "has_tensorboard", lambda: False)
    with pytest.raises(tg.TileError, match=r"output.tensorboard must be false, or true with TensorBoard installed "
                                           r"\(pip install tensorboardX.*\), not True"):
        cli.check_config(cfg, source)
    monkeypatch.setattr(cli_config, "has_tensorboard", lambda: True)
    cli.check_config(cfg, source)
    cfg["output"]["tensorboard"] = "yes"
    with pytest.raises(tg.TileError, match=r"output.tensorboard must be .*, not 'yes'"):
        cli.check_config(cfg, source)


def test_progress_to_a_file_prints_plain_lines_with_the_recent_rate(monkeypatch):
    import io

    from tilegraph import _progress as progress  # (the Trainer's progress display)

    clock = [0.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    lines = progress._ProgressLines(100, every=10.0, file=out)
    for _ in range(20):  # 20 steps at 1 step/s: a line at 10 s and at 20 s
        clock[0] += 1.0
        lines.set_postfix(loss="2.5000", refresh=False)
        lines.update(1)
    for _ in range(40):  # 40 steps at 4 steps/s: a line at 30 s with that rate, not the one before
        clock[0] += 0.25
        lines.update(1)
    clock[0] += 5.0  # the end, 5 s after the last line: the mean rate, no ETA
    lines.close()
    assert out.getvalue().splitlines() == [
        "train: step 10/100, 10.0 s, 1 steps/s, ETA 90.0 s, loss=2.5000",
        "train: step 20/100, 20.0 s, 1 steps/s, ETA 80.0 s, loss=2.5000",
        "train: step 60/100, 30.0 s, 4 steps/s, ETA 10.0 s, loss=2.5000",
        "train: step 60/100, 35.0 s, 1.71 steps/s on average, loss=2.5000"]


def test_fit_progress_into_a_log_has_no_bar_redraws(capsys):
    _, _, trainer = _setup(steps=5)
    trainer.progress = True
    trainer.fit(5)
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    assert "\r" not in err and err.startswith("train: step 5/5, ") and "steps/s on average, loss=" in err


def test_plot_of_a_language_model_draws_the_uniform_guess(tmp_path, monkeypatch):
    import dataclasses

    import matplotlib.image

    from tilegraph import plotting
    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    drawn = []

    def spy(records, **kw):
        drawn.append(kw)
        return plot_training(records, **kw)

    plot_training = plotting.plot_training
    monkeypatch.setattr(plotting, "plot_training", spy)
    tok = ByteTokenizer(eos=True)
    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    build_token_file([tmp_path / "a.txt"], tmp_path / "t.bin", tok)
    data = TokenDataset(tmp_path / "t.bin", 16, split="train", seed=0)
    config = dataclasses.replace(tg.models.config("gpt2-debug"), vocab_size=tok.vocab_size, max_seq_len=16, dim=32)
    model = tg.models.build(config, seed=0)
    trainer = tg.Trainer(model, tg.optim.AdamW(model.parameters(), lr=1e-3), data, batch_size=2, progress=False,
                         log_dir=tmp_path / "run")
    trainer.fit(3)
    assert drawn == [{"vocab_size": 257, "path": tmp_path / "run" / "loss.png", "run": trainer.run_id}]
    assert matplotlib.image.imread(tmp_path / "run" / "loss.png").shape[:2] == (500, 700)


def test_default_row_tiles_one_per_cpu_thread_or_per_gpu():
    from tilegraph.trainer import MIN_ROW_TILE_ELEMENTS, _default_row_tile

    class Rt:  # the two things the choice reads of a runtime
        def __init__(self, cpu, gpu):
            self.p = {"cpu": cpu, "gpu": gpu}

        def processors(self):
            return self.p

    big = MIN_ROW_TILE_ELEMENTS  # a row this large pays for a kernel call of its own
    assert _default_row_tile(Rt(16, 0), 32, big) == 2  # a tile per CPU thread
    assert _default_row_tile(Rt(16, 1), 32, big) == 32  # one GPU: whole tiles, the largest kernels
    assert _default_row_tile(Rt(16, 2), 32, big) == 16  # a tile per GPU
    assert _default_row_tile(Rt(16, 0), 32, 1) == 32  # tiny rows: one tile
    # rows too small for a tile per thread: as many tiles as reach the minimum, evenly
    assert _default_row_tile(Rt(16, 0), 16, big // 4) == 4   # 4 tiles of 4 rows, not 16 of 1
    assert _default_row_tile(Rt(2, 0), 4, big // 2) == 2     # 2 tiles of 2 rows: each reaches it
    assert _default_row_tile(Rt(2, 0), 4, big // 3) == 4     # 2 rows would not: one tile
    assert _default_row_tile(Rt(16, 0), 3, big * 8) == 1     # never more tiles than rows


@pytest.mark.parametrize("factor, drawings", [(0.0, 6), (1e9, 1)])
def test_loss_png_is_redrawn_at_evaluations_only_when_drawing_stays_a_small_share_of_the_fit(
        tmp_path, monkeypatch, factor, drawings):
    # evaluations after steps 1-6: the one after the last step is left to the fit's final drawing;
    # the others draw when PLOT_INTERVAL_FACTOR x the last drawing's seconds have passed since it
    from tilegraph import plotting
    import tilegraph.trainer as trainer_module

    drawn = []  # (the last step drawn, the steps submitted by then)
    plot_training = plotting.plot_training

    def draw(records, **kw):
        drawn.append((max(r["step"] for r in records), trainer.optimizer.step_count))
        return plot_training(records, **kw)

    monkeypatch.setattr(plotting, "plot_training", draw)
    monkeypatch.setattr(trainer_module, "PLOT_INTERVAL_FACTOR", factor)
    _, _, trainer = _setup(steps=6, log_dir=tmp_path / "run", eval_every=1)
    trainer.fit(6)
    assert len(drawn) == drawings
    # a drawing during the fit waits until the next step runs (the workers do not wait for it)
    assert [submitted > last for last, submitted in drawn] == [True] * (drawings - 1) + [False]
    assert (tmp_path / "run" / "loss.png").stat().st_size > 1000
