"""Trainer: the loop, its logs, plot, evaluation, checkpoints/resume, accumulation and NaN stops."""

import json

import numpy as np
import pytest

import tilegraph as tg


def _data(seed):
    w = np.random.default_rng(100).standard_normal((8, 2)).astype(np.float32) / 3

    def batch(step):
        x = np.random.default_rng([seed, step]).standard_normal((32, 8)).astype(np.float32)
        return x, np.tanh(x @ w)
    return batch


def _mse(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _setup(tmp_path=None, steps=40, **kw):
    model = tg.nn.MLP(8, 32, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(2e-2, min(5, steps), steps), clip_grad_norm=1.0)
    trainer = tg.Trainer(model, opt, _data(0), loss_fn=_mse, batch_size=32, eval_data=_data(1), eval_batches=2,
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
    assert [r["loss"] for r in steps] == res.losses and all(r["tokens_per_s"] > 0 for r in steps)
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
    with pytest.raises(tg.TileError, match=r"batch_size must be a positive multiple of accum_steps"):
        _setup(accum_steps=3)


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
    trainer = tg.Trainer(model, opt, bad, loss_fn=_mse, batch_size=32, log_dir=tmp_path, progress=False)
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
    trainer = tg.Trainer(model, opt, _data(0), embedded_runtime, loss_fn=_mse, batch_size=32,
                         batch_tiles=[(16, 8), (16, None)], progress=False, steps_per_graph=1,
                         performance_report=tmp_path / "report" / "step3.html", report_step=3)
    res = trainer.fit(6)
    html = (tmp_path / "report" / "step3.html").read_text()
    assert "Dask Performance Report" in html and len(html) > 10_000
    # kernel time per part of the model, the optimizer's update among them
    assert {"fc1", "fc2", "fc1:backward", "optimizer:update"} <= set(res.kernel_seconds), res.kernel_seconds
    assert list(res.kernel_seconds.values()) == sorted(res.kernel_seconds.values(), reverse=True)
    assert 0.0 <= res.outside_kernels < 1.0
    assert res.profile().startswith("kernel time: ") and "outside kernels" in res.profile()
    with pytest.raises(tg.TileError, match=r"performance_report needs a distributed runtime"):
        tg.Trainer(model, opt, _data(0), loss_fn=_mse, performance_report=tmp_path / "r.html")
