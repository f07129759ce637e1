"""Each parameter counts its own updates, as torch's optimizers do (``state["step"]``): a step whose
loss does not depend on a parameter leaves it, its state and its count as they were, and Adam's
bias corrections use that count. A model whose batches of one shape use one head and of another
shape the other (a multi-task model alternating its tasks) trains as torch trains it. Before,
every update used the optimizer's step number: a head first used at step 3 took an update of
0.64 lr instead of torch's lr, and SGD's momentum buffer was not started from its first gradient.
"""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")

#: batch rows -> the head it trains (batches of 4 rows: head "b"; of 6: head "a")
HEADS = {6: "a", 4: "b"}
ROWS = [6, 6, 4, 6, 4, 4, 6]


class _TwoTasks(tg.nn.Module):
    def __init__(self):
        self.emb = tg.nn.Embedding(10, 6, tile=4, seed=0, dtype=np.float64)
        self.body = tg.nn.Linear(6, 8, tile=4, seed=1, dtype=np.float64)
        self.a = tg.nn.Linear(8, 3, tile=4, seed=2, dtype=np.float64)
        self.b = tg.nn.Linear(8, 3, tile=4, seed=3, dtype=np.float64)

    def forward(self, ids):
        h = tg.relu(self.body(self.emb(ids)))  # (B, 8)
        return getattr(self, HEADS[ids.shape[0]])(h)  # (B, 3)


def _loss(model, ids, y):
    d = model(ids) - y
    return (d * d).mean()


def _batch(i: int, rows: int | None = None):
    rows = ROWS[i % len(ROWS)] if rows is None else rows
    rng = np.random.default_rng(i)
    return rng.integers(0, 10, rows), rng.standard_normal((rows, 3))


def _torch_run(make_opt, steps: int, state=None):
    """torch's losses and parameters after ``steps`` steps of the same model."""
    params = {n: torch.tensor(v, requires_grad=True) for n, v in (state or _TwoTasks().state_dict()).items()}
    opt = make_opt(list(params.values()))
    losses = []
    for i in range(steps):
        ids, y = _batch(i)
        h = torch.relu(params["emb.weight"][torch.tensor(ids)] @ params["body.weight"] + params["body.bias"])
        head = HEADS[len(ids)]
        loss = ((h @ params[f"{head}.weight"] + params[f"{head}.bias"] - torch.tensor(y)) ** 2).mean()
        opt.zero_grad(set_to_none=True)  # (torch's default: a head without a gradient is skipped)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in params.items()}


def _check(got_losses, got_state, want):
    np.testing.assert_allclose(got_losses, want[0], rtol=1e-10)
    for name, v in want[1].items():
        np.testing.assert_allclose(got_state[name], v, rtol=1e-9, atol=1e-12, err_msg=name)


OPTIMIZERS = {
    "adamw": (lambda p: tg.optim.AdamW(p, lr=0.05, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)),
    "adam-l2": (lambda p: tg.optim.Adam(p, lr=0.05, weight_decay=0.1),
                lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1)),
    "adamw-clipped": (lambda p: tg.optim.AdamW(p, lr=0.05, weight_decay=0.1, clip_grad_norm=0.5), None),
    "sgd-momentum": (lambda p: tg.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01)),
}


def _torch_clipped(p):
    """torch's AdamW with clip_grad_norm_ over the gradients of the step (those that have one)."""
    opt = torch.optim.AdamW(p, lr=0.05, weight_decay=0.1)
    step = opt.step

    def clipped_step():
        torch.nn.utils.clip_grad_norm_([q for q in p if q.grad is not None], 0.5)
        return step()

    opt.step = clipped_step
    return opt


@pytest.mark.filterwarnings("ignore:.*do not affect the loss")
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_head_some_steps_leave_out_trains_as_torchs(kind):
    make, make_torch = OPTIMIZERS[kind]
    model = _TwoTasks()
    opt = make(model.parameters())
    step = tg.TrainStep(model, opt, _loss)
    losses = [step(*_batch(i)) for i in range(len(ROWS))]
    _check(losses, model.state_dict(), _torch_run(make_torch or _torch_clipped, len(ROWS)))
    names = [n for n, _ in model.named_parameters()]
    counts = dict(zip(names, opt.param_steps))
    assert opt.step_count == 7
    assert counts == {"emb.weight": 7, "body.weight": 7, "body.bias": 7, "a.weight": 4, "a.bias": 4,
                      "b.weight": 3, "b.bias": 3}


@pytest.mark.filterwarnings("ignore:.*do not affect the loss")
def test_steps_in_one_graph_count_as_steps_one_at_a_time():
    """submit_steps (several steps of one shape in one graph), between single steps of the other."""
    make, make_torch = OPTIMIZERS["adamw"]
    model = _TwoTasks()
    step = tg.TrainStep(model, make(model.parameters()), _loss)
    losses = []
    for group in ([0, 1], [2], [3], [4, 5], [6]):
        if len(group) == 1:
            losses.append(step(*_batch(group[0])))
        else:
            losses += [p.result() for p in step.submit_steps([_batch(i) for i in group])]
    _check(losses, model.state_dict(), _torch_run(make_torch, len(ROWS)))


@pytest.mark.filterwarnings("ignore:.*do not affect the loss")
def test_the_counts_survive_state_dict_and_a_zarr_checkpoint(tmp_path):
    """A run stopped after 4 steps and resumed (from the optimizer's state_dict, and from a Zarr
    checkpoint) goes on as the uninterrupted run: the heads' counts come back with it."""
    make, make_torch = OPTIMIZERS["adamw"]
    want = _torch_run(make_torch, len(ROWS))
    model = _TwoTasks()
    opt = make(model.parameters())
    step = tg.TrainStep(model, opt, _loss)
    first = [step(*_batch(i)) for i in range(4)]
    state = opt.state_dict()
    assert state["step"] == 4 and state["param_steps"] == [4, 4, 4, 3, 3, 1, 1]
    tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    info = tg.io.load_checkpoint(tmp_path / "ck").optimizer_info
    assert info["param_steps"] == {"a.weight": 3, "a.bias": 3, "b.weight": 1, "b.bias": 1}

    for how in ("state_dict", "zarr"):
        resumed = _TwoTasks()
        opt2 = make(resumed.parameters())
        if how == "state_dict":
            resumed.load_state_dict(model.state_dict())
            opt2.load_state_dict(state)
        else:
            ck = tg.io.load_checkpoint(tmp_path / "ck")
            ck.load_into(resumed)
            ck.restore_optimizer(opt2, resumed)
        assert opt2.param_steps == [4, 4, 4, 3, 3, 1, 1], how
        step2 = tg.TrainStep(resumed, opt2, _loss)
        rest = [step2(*_batch(i)) for i in range(4, len(ROWS))]
        _check(first + rest, resumed.state_dict(), want)


def test_a_checkpoint_of_a_model_every_step_trains_keeps_no_counts(tmp_path):
    """Counts are stored only where they fall behind the step count: as before, otherwise."""
    model = tg.nn.Linear(6, 3, tile=4, seed=0, dtype=np.float64)
    opt = tg.optim.AdamW(model.parameters(), lr=0.05)
    step = tg.TrainStep(model, opt, lambda m, x, y: ((m(x) - y) ** 2).mean())
    rng = np.random.default_rng(0)
    for _ in range(2):
        step(rng.standard_normal((4, 6)), rng.standard_normal((4, 3)))
    assert opt.param_steps == [2, 2]
    tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    assert "param_steps" not in tg.io.load_checkpoint(tmp_path / "ck").optimizer_info


@pytest.mark.parametrize("bad, match", [
    ([4, 4], "list of 7 update counts"),
    ("4444444", "list of 7 update counts"),
    ([4, 4, 4, 3, 3, 1, 5], r"param_steps\[6\] must be an integer in \[0, 4\]"),
    ([4, 4, 4, 3, 3, 1, -1], r"param_steps\[6\] must be an integer in \[0, 4\]"),
    ([4, 4, 4, 3, 3, 1, 1.5], r"param_steps\[6\] must be an integer in \[0, 4\]"),
])
def test_bad_counts_in_a_state_dict_are_refused_and_change_nothing(bad, match):
    model = _TwoTasks()
    opt = tg.optim.AdamW(model.parameters(), lr=0.05)
    state = opt.state_dict()
    state["step"], state["param_steps"] = 4, bad
    with pytest.raises(tg.TileError, match=match):
        opt.load_state_dict(state)
    assert opt.step_count == 0 and opt.param_steps == [0] * 7


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:.*do not affect the loss")
@pytest.mark.parametrize("parallel", ["tiles", "sharded"])
def test_a_failed_step_puts_the_counts_back(embedded_runtime, parallel):
    """A step that fails on the workers (a token id out of range) counts no update for any
    parameter: the run then goes on as torch's without that step."""
    make, make_torch = OPTIMIZERS["adamw"]
    want = _torch_run(make_torch, len(ROWS))
    model = _TwoTasks()
    opt = make(model.parameters())
    step = tg.TrainStep(model, opt, _loss, runtime=embedded_runtime, parallel=parallel,
                        batch_tiles=None if parallel == "tiles" else [(2,), (2, None)])
    losses = [step(*_batch(i)) for i in range(3)]
    ids, y = _batch(3)
    with pytest.raises(tg.TileError, match="must lie in"):
        step(ids + 10, y)
    assert opt.step_count == 3 and opt.param_steps == [3, 3, 3, 2, 2, 1, 1]
    losses += [step(*_batch(i)) for i in range(3, len(ROWS))]
    with embedded_runtime.as_current():
        _check(losses, model.state_dict(), want)


def test_every_update_kernel_reads_its_count_where_told():
    """The CPU kernel, the array code and the GPU entry point (its array code on NumPy arrays)
    read ``t`` at ``t_at`` of a hyper tile with counts, and the clipping kernels keep the counts."""
    from tilegraph.optim import HYPER, _adamw_cpu, _adamw_gpu, _adamw_xp, _clip_hyper, _clip_hyper_gpu

    rng = np.random.default_rng(0)
    p, g, m = (rng.standard_normal((5, 3)) for _ in range(3))
    v = rng.random((5, 3))
    kw = dict(beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)
    hyper = np.array([0.01, 9.0, 1.0, 0.0, 9.0, 2.0])  # parameter 1 updated twice in 9 steps
    want = [_adamw_cpu(p, g, m, v, np.array([0.01, t]), **kw) for t in (9.0, 2.0)]
    for fn in (_adamw_cpu, _adamw_xp, _adamw_gpu):
        for t_at, w in zip((HYPER["counts"], HYPER["counts"] + 1), want):
            for got, expected in zip(fn(p, g, m, v, hyper, **kw, t_at=t_at), w):
                np.testing.assert_allclose(got, expected, rtol=1e-13, err_msg=f"{fn.__name__}, t_at={t_at}")
    parts = [np.array([4.0]), np.array([5.0])]
    for fn in (_clip_hyper.fn, _clip_hyper_gpu):
        out = fn(hyper, *parts, max_norm=1.0)
        np.testing.assert_allclose(out, [0.01, 9.0, 1 / (3 + 1e-6), 3.0, 9.0, 2.0], err_msg=fn.__name__)
