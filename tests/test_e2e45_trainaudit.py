"""An audit of the training API as a torch user porting a loop uses it, checked against torch in
float64: a NaN gradient under clipping, torch's ``add_param_group``, an in-place rollback of the
model and optimizer through their state dicts under the same TrainStep, and a Trainer on a
callable whose last batch of an epoch is smaller, with a schedule, clipping and evaluations.
The first two failed on the code before (noted); the others guard what already matched."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.optim import HYPER, _clip_hyper

torch = pytest.importorskip("torch")

# the MLP and its torch twin of the loop audit (an MLP 16 -> 24 -> 4 in float64, its batches, the MSE)
from test_e2e37_loop import F64, _as_ours, _batch, _model, _mse, _same_weights, _torch_model, _torch_mse  # noqa: E402


# ----------------------------------------------------------------- a NaN gradient clipped ----
def _nan_grad_loss(m, x, y):
    """The MSE plus 0 * sqrt(0 * b): the loss is finite, fc2.bias's gradient NaN (0 * inf)."""
    b = m.fc2.bias
    return _mse(m, x, y) + 0.0 * (b * 0.0).sqrt().sum()


def _torch_nan_grad_loss(net, x, y):
    b = net[2].bias
    return _torch_mse(net, x, y) + 0.0 * (b * 0.0).sqrt().sum()


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_a_nan_gradient_under_clipping_makes_every_parameter_nan_as_torch(kind):
    """torch's clip_grad_norm_ (error_if_nonfinite=False) scales every gradient by
    ``clamp(max_norm / (nan + 1e-6), max=1) = nan``: each parameter becomes NaN, and the next loss
    says so. The CPU clip kernel took ``min(1.0, nan)``, which is 1.0 in Python: the other
    parameters took their gradients unclipped (a step up to max_norm / norm times too long), with
    a finite loss, and only the NaN gradient's parameter went NaN (the GPU kernel's
    ``xp.minimum`` kept the NaN: the two disagreed)."""
    model = _model()
    net = _torch_model(model)
    if kind == "sgd":
        opt = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, clip_grad_norm=0.05)
        topt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=0.05)
        topt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, _nan_grad_loss)
    x, y = _batch(0)
    loss = step(x, y)
    topt.zero_grad()
    tloss = _torch_nan_grad_loss(net, x, y)
    tloss.backward()
    tnorm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05).item()
    topt.step()
    assert loss == pytest.approx(tloss.item(), rel=1e-12)  # (the loss before the update is finite)
    assert math.isnan(tnorm) and math.isnan(step.last.grad_norm)
    got, want = model.state_dict(), _as_ours(net)
    for k in want:
        assert np.isnan(want[k]).all(), k  # torch: every parameter
        np.testing.assert_array_equal(np.isnan(got[k]), np.isnan(want[k]), err_msg=k)
    # the next step's loss is NaN, as torch's, and the step says so (before, it went on finite)
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 2"):
        step(*_batch(1))


def test_the_clip_kernel_keeps_torchs_scale_for_nan_inf_and_finite_norms():
    """The clip scale is torch's ``clamp(max_norm / (norm + 1e-6), max=1)``: nan for a NaN norm
    (1.0 before), 0 for an infinite one, 1 below max_norm, and the norm is reported as it is."""
    hyper = np.array([0.1, 1.0, 1.0, 0.0, 1.0])

    def scale(sumsq, max_norm=1.0):
        out = _clip_hyper.impl("cpu")(hyper, np.array([sumsq]), max_norm=max_norm)
        return float(out[HYPER["clip"]]), float(out[HYPER["norm"]])

    s, n = scale(np.nan)
    assert math.isnan(s) and math.isnan(n)
    assert scale(np.inf) == (0.0, math.inf)
    assert scale(0.25) == (1.0, 0.5)
    s, n = scale(16.0)
    assert n == 4.0 and s == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-15)


# ------------------------------------------------------------------------ add_param_group ----
def test_add_param_group_names_the_ways():
    """torch's ``opt.add_param_group({...})`` (gradual unfreezing, a head added later) was a bare
    AttributeError; it is a TileError naming freezing and a new optimizer, and changes nothing."""
    model = _model()
    opt = tg.optim.AdamW([{"params": [model.fc1.weight, model.fc1.bias]}], lr=1e-2)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.AdamW.add_param_group\] the parameter groups are "
                                           r"fixed when the optimizer is made .*requires_grad_\(False\).*new "
                                           r"optimizer and TrainStep.*received: opt.add_param_group\(\['lr', "
                                           r"'params'\]\)"):
        opt.add_param_group({"params": [model.fc2.weight, model.fc2.bias], "lr": 1e-3})
    assert len(opt.params) == 2 and len(opt.param_groups) == 1
    with pytest.raises(tg.TileError, match=r"received: opt.add_param_group\(list\)"):
        tg.optim.SGD(model.parameters(), lr=0.1).add_param_group([model.fc2.weight])


# ------------------------------------------------------------ what already matched torch ----
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_rollback_through_state_dicts_under_the_same_step_replays_the_run(kind):
    """A torch loop's rollback: save the model's and the optimizer's state dicts, train on, load
    both back in place and train again with the same TrainStep: the same losses and weights to the
    bit as the first time from there (Adam's bias corrections, SGD's Nesterov buffers, the
    schedule's step and clipping included)."""
    model = _model()
    if kind == "adamw":
        opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-2, 2, 10), clip_grad_norm=0.3)
    else:
        opt = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    step = tg.TrainStep(model, opt, _mse)
    for i in range(3):
        step(*_batch(i))
    saved_opt, saved_model = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    first = [step(*_batch(i)) for i in range(3, 6)]
    weights = model.state_dict()
    for i in range(6, 8):
        step(*_batch(i))
    model.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    assert opt.step_count == 3
    assert [step(*_batch(i)) for i in range(3, 6)] == first
    again = model.state_dict()
    for k in weights:
        np.testing.assert_array_equal(again[k], weights[k], err_msg=k)


def test_a_trainer_with_a_smaller_last_batch_schedule_clipping_and_evaluations_is_torchs():
    """A Trainer over a callable whose epoch ends in a batch of 2 rows (50 rows, batches of 16),
    a warmup-cosine schedule, clipping and an evaluation every 3 steps, against torch's loop with
    LambdaLR: each step's loss, learning rate and gradient norm (before clipping, as torch's
    clip_grad_norm_ returns it), the validation losses and the weights."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((50, 16))
    Y = np.tanh(X[:, :4])

    def data(step):
        k = (step - 1) % 4
        return X[k * 16:(k + 1) * 16], Y[k * 16:(k + 1) * 16]

    model = _model()
    net = _torch_model(model)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-2, 2, 10), clip_grad_norm=0.3)
    topt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    curve = tg.optim.warmup_cosine(1e-2, 2, 10)
    sched = torch.optim.lr_scheduler.LambdaLR(topt, lambda t: curve(t + 1) / 1e-2)
    seen = []
    trainer = tg.Trainer(model, opt, data, loss_fn=_mse, batch_size=16, eval_data=lambda i: (X[:10], Y[:10]),
                         eval_every=3, eval_batches=1, progress=False,
                         on_step=[lambda t, s: seen.append((s.loss, s.lr, s.grad_norm))])
    result = trainer.fit(9)
    want, val = [], []
    for step in range(1, 10):
        x, y = data(step)
        topt.zero_grad()
        loss = _torch_mse(net, x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.3).item()
        want.append((loss.item(), topt.param_groups[0]["lr"], norm))
        topt.step()
        sched.step()
        if step % 3 == 0:
            with torch.no_grad():
                val.append((step, _torch_mse(net, X[:10], Y[:10]).item()))
    assert len(seen) == 9 and data(4)[0].shape == (2, 16)
    for (loss, lr, norm), (tloss, tlr, tnorm) in zip(seen, want):
        assert loss == pytest.approx(tloss, rel=1e-12)
        assert lr == pytest.approx(tlr, rel=1e-15)
        assert norm == pytest.approx(tnorm, rel=1e-12)
    assert result.losses == pytest.approx([w[0] for w in want], rel=1e-12)
    assert [s for s, _ in result.val_losses] == [s for s, _ in val]
    assert [v for _, v in result.val_losses] == pytest.approx([v for _, v in val], rel=1e-12)
    _same_weights(model, net)


def test_a_dataloader_or_a_list_as_data_names_the_callable_that_wraps_it():
    """A torch loop's ``for x, y in loader``: the Trainer takes a callable ``data(step)``; a
    DataLoader or a list given as ``data`` was refused without saying how to wrap it. The error
    now names both wrappers, and the iterator one trains on the loader's batches in order."""
    X = torch.from_numpy(np.random.default_rng(1).standard_normal((48, 16)))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, torch.tanh(X[:, :4])), batch_size=16)
    model = _model()
    opt = tg.optim.SGD(model.parameters(), lr=0.1)
    for data, kind in ((loader, "DataLoader"), ([_batch(0), _batch(1)], "list")):
        with pytest.raises(tg.TileError, match=r"data=lambda step: batches\[step - 1\]; for an iterator or a "
                                               rf"DataLoader, it = iter\(loader\) and data=lambda step: next\(it\) "
                                               rf".*received: {kind}"):
            tg.Trainer(model, opt, data, loss_fn=_mse, progress=False)
    net = _torch_model(model)
    topt = torch.optim.SGD(net.parameters(), lr=0.1)
    it = iter(loader)
    losses = tg.Trainer(model, opt, lambda step: next(it), loss_fn=_mse, progress=False).fit(3).losses
    want = []
    for x, y in loader:
        topt.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        loss.backward()
        topt.step()
        want.append(loss.item())
    assert losses == pytest.approx(want, rel=1e-12)
    _same_weights(model, net)


@pytest.mark.parametrize("affine", [True, False])
def test_rmsnorm_takes_torchs_eps_none_and_elementwise_affine_and_trains_as_torch(affine):
    """torch's ``nn.RMSNorm(dim, eps=None, elementwise_affine=...)``: ``eps=None`` (torch's
    default, the dtype's machine epsilon) was refused at the first forward and
    ``elementwise_affine`` was a TypeError. With small activations (1e-4), where the eps shows,
    a model through it trains as torch's (the default eps, Llama's 1e-6, stays tilegraph's)."""

    class Net(tg.nn.Module):
        def __init__(self):
            self.fc1 = tg.nn.Linear(16, 8, seed=0, dtype=F64, tile=4)
            self.norm = tg.nn.RMSNorm(8, eps=None, elementwise_affine=affine, dtype=F64, tile=4)
            self.fc2 = tg.nn.Linear(8, 4, seed=1, dtype=F64, tile=4)

        def forward(self, x):
            return self.fc2(self.norm(self.fc1(x)))

    model = Net()
    assert sorted(model.state_dict()) == sorted(["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
                                                + ["norm.weight"] * affine)
    sd = model.state_dict()
    fc1, fc2 = torch.nn.Linear(16, 8).double(), torch.nn.Linear(8, 4).double()
    norm = torch.nn.RMSNorm(8, elementwise_affine=affine, dtype=torch.float64)
    with torch.no_grad():
        for mod, name in ((fc1, "fc1"), (fc2, "fc2")):
            mod.weight.copy_(torch.from_numpy(sd[f"{name}.weight"].T.copy()))
            mod.bias.copy_(torch.from_numpy(sd[f"{name}.bias"]))
    net = torch.nn.Sequential(fc1, norm, fc2)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, _mse)
    for i in range(3):
        x, y = _batch(i)
        x = x * 1e-6  # small inputs: the norm's eps shows (with eps=1e-6 here the losses differ)
        loss = step(x, y)
        topt.zero_grad()
        tloss = _torch_mse(net, x, y)
        tloss.backward()
        topt.step()
        assert loss == pytest.approx(tloss.item(), rel=1e-10)
    got = model.state_dict()
    for name, mod in (("fc1", fc1), ("fc2", fc2)):
        np.testing.assert_allclose(got[f"{name}.weight"], mod.weight.detach().numpy().T, rtol=1e-9, atol=1e-12)
    if affine:
        np.testing.assert_allclose(got["norm.weight"], norm.weight.detach().numpy(), rtol=1e-9, atol=1e-12)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.RMSNorm\] elementwise_affine must be a bool"):
        tg.nn.RMSNorm(8, elementwise_affine="no")


def test_a_hook_acts_after_the_step_it_saw_with_one_step_per_graph_and_no_pipeline():
    """A torch loop's callback: at step 3 a hook lowers the learning rate to 0 and asks for an
    early stop. With ``steps_per_graph=1, pipeline=False`` (as the Trainer's docstring says)
    the fit ends after step 3, and the next fit runs at the new rate (the weights stay)."""
    X = np.random.default_rng(2).standard_normal((64, 16))
    Y = np.tanh(X[:, :4])

    def data(step):
        k = (step - 1) % 4
        return X[k * 16:(k + 1) * 16], Y[k * 16:(k + 1) * 16]

    model = _model()
    opt = tg.optim.SGD(model.parameters(), lr=0.1)
    lrs = []

    def hook(trainer, stats):
        lrs.append(stats.lr)
        if len(lrs) == 3:
            trainer.optimizer.schedule = tg.optim.constant(0.0)
            trainer.request_stop()

    trainer = tg.Trainer(model, opt, data, loss_fn=_mse, batch_size=16, progress=False, on_step=[hook],
                         steps_per_graph=1, pipeline=False)
    result = trainer.fit(10)
    assert result.steps == 3 and opt.step_count == 3 and lrs == [0.1] * 3
    weights = model.state_dict()
    trainer.fit(2)
    assert lrs[3:] == [0.0, 0.0]
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, weights[k], err_msg=k)
