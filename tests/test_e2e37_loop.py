"""A torch user's own training loop, without the Trainer: a TrainStep per batch, the learning
rate changed by hand, parameter groups, evaluation between steps, a last smaller batch, layers
frozen and unfrozen between steps, state dicts round-tripped mid-run, a model deep-copied, a
notebook cell run again. Each is compared with the same loop in PyTorch (the same initial
weights, the same batches). The tests after the first each failed on the code before (noted)."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")

F64 = np.float64


def _model(seed: int = 0):
    return tg.nn.MLP(16, 24, act="relu", out_dim=4, tile=8, seed=seed, dtype=F64)


def _torch_model(model):
    """torch's Sequential with ``model``'s weights (tilegraph stores a Linear's weight (in, out))."""
    sd = model.state_dict()
    net = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4)).double()
    with torch.no_grad():
        for i, name in ((0, "fc1"), (2, "fc2")):
            net[i].weight.copy_(torch.from_numpy(sd[f"{name}.weight"].T.copy()))
            net[i].bias.copy_(torch.from_numpy(sd[f"{name}.bias"]))
    return net


def _as_ours(net) -> dict:
    return {f"{name}.{k}": getattr(net[i], k).detach().numpy().T if k == "weight" else net[i].bias.detach().numpy()
            for i, name in ((0, "fc1"), (2, "fc2")) for k in ("weight", "bias")}


def _batch(i: int, rows: int = 20):
    x = np.random.default_rng([7, i]).standard_normal((rows, 16))
    return x, np.tanh(x[:, :4])


def _mse(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _torch_mse(net, x, y):
    return ((net(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()


def _same_weights(model, net, rtol=1e-10):
    got, want = model.state_dict(), _as_ours(net)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=rtol * float(np.abs(want[k]).max()), err_msg=k)


#: (ours, torch's) optimizers of a model, the weight matrices decaying, the biases not
OPTIMIZERS = {
    "sgd-momentum": (lambda g: tg.optim.SGD(g, lr=0.05, momentum=0.9),
                     lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9)),
    "sgd-nesterov": (lambda g: tg.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True),
                     lambda g: torch.optim.SGD(g, lr=0.05, momentum=0.9, nesterov=True)),
    "adam": (lambda g: tg.optim.Adam(g, lr=1e-2), lambda g: torch.optim.Adam(g, lr=1e-2)),
    "adamw": (lambda g: tg.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.99)),
              lambda g: torch.optim.AdamW(g, lr=1e-2, betas=(0.8, 0.99))),
}


def _groups(weights, biases):
    return [{"params": weights, "weight_decay": 0.05}, {"params": biases, "weight_decay": 0.0}]


def _pair(kind: str, seed: int = 0):
    """A model, its torch twin and each one's optimizer (groups: weights decay, biases not)."""
    model = _model(seed)
    net = _torch_model(model)
    ours, theirs = OPTIMIZERS[kind]
    opt = ours(_groups([model.fc1.weight, model.fc2.weight], [model.fc1.bias, model.fc2.bias]))
    topt = theirs(_groups([net[0].weight, net[2].weight], [net[0].bias, net[2].bias]))
    return model, net, opt, topt


def _torch_step(net, topt, x, y, clip=None) -> float:
    topt.zero_grad()
    loss = _torch_mse(net, x, y)
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    topt.step()
    return loss.item()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_a_loop_of_our_own_trains_as_torch(kind):
    """Parameter groups with their own weight decay, the learning rate set by hand between
    steps (torch: each group's ``lr``), an evaluation of a held-out batch after each step: the
    losses and weights are torch's (float64)."""
    model, net, opt, topt = _pair(kind)
    step, ev = tg.TrainStep(model, opt, _mse), tg.EvalStep(model, _mse)
    xv, yv = _batch(99)
    base = opt.lr
    for i in range(5):
        scale = 0.5 ** (i // 2)
        opt.schedule = tg.optim.constant(base * scale)
        for g in topt.param_groups:
            g["lr"] = base * scale
        x, y = _batch(i)
        assert step(x, y) == pytest.approx(_torch_step(net, topt, x, y), rel=1e-12)
        with torch.no_grad():
            assert ev(xv, yv) == pytest.approx(_torch_mse(net, xv, yv).item(), rel=1e-12)
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in topt.param_groups]
    _same_weights(model, net)


def test_a_row_tile_larger_than_the_last_batch_is_one_tile():
    """``batch_tiles`` given for a full batch of 20 rows (tiles of 8), then the epoch's last
    batch of 6 rows, and micro-batches of 3 rows (accum_steps=2): each was refused, "tile size
    of dim 0 is larger than the dimension (6)". The rows there are now one tile; torch's numbers."""
    model, net, opt, topt = _pair("adamw")
    tiles = [(8, None), (8, None)]
    plain, accum = tg.TrainStep(model, opt, _mse, batch_tiles=tiles), None
    for i, rows in enumerate([20, 20, 6]):
        x, y = _batch(i, rows)
        assert plain(x, y) == pytest.approx(_torch_step(net, topt, x, y), rel=1e-12)
    _same_weights(model, net)

    model, net, opt, topt = _pair("sgd-momentum")
    accum = tg.TrainStep(model, opt, _mse, batch_tiles=tiles, accum_steps=2)
    for i, rows in enumerate([20, 6]):
        x, y = _batch(i, rows)
        want = _torch_step(net, topt, x, y)  # (the mean of the two halves' means: equal halves)
        assert accum(x, y) == pytest.approx(want, rel=1e-12)
    _same_weights(model, net)
    # an explicit tiling of another dim is checked as given
    with pytest.raises(tg.TileError, match=r"tile size of dim 1 is larger than the dimension \(16\)"):
        tg.TrainStep(model, opt, _mse, batch_tiles=[(8, 32), (8, None)])(*_batch(0))


@pytest.mark.parametrize("kind", ["adamw", "sgd-nesterov"])
def test_freezing_and_unfreezing_a_layer_between_steps_trains_as_torch(kind):
    """``requires_grad_(False)`` on the first layer after two steps, ``True`` two steps later,
    with gradient clipping and accumulation: torch's optimizer skips the frozen layer (no update,
    no weight decay, its state and step count kept) and trains it on once unfrozen. The step
    refused the frozen layer ("every optimizer parameter to require a gradient"), and the way it
    named, a new optimizer, lost the other parameters' moments."""
    model, net, opt, topt = _pair(kind)
    opt.clip_grad_norm = 0.5
    step = tg.TrainStep(model, opt, _mse, accum_steps=2)
    for i in range(7):
        if i in (2, 4):
            model.fc1.requires_grad_(i == 4)
            net[0].requires_grad_(i == 4)
        if i == 2:
            frozen = model.fc1.weight.numpy()
        x, y = _batch(i)
        assert step(x, y) == pytest.approx(_torch_step(net, topt, x, y, clip=0.5), rel=1e-12)
        if i == 3:  # frozen: as it was
            np.testing.assert_array_equal(model.fc1.weight.numpy(), frozen)
    _same_weights(model, net)
    steps = dict(zip(map(id, opt.params), opt.param_steps))
    assert steps[id(model.fc1.weight)] == 5 and steps[id(model.fc2.weight)] == 7


def test_an_optimizer_whose_parameters_are_all_frozen_is_named():
    model = _model()
    opt = tg.optim.AdamW(model.fc1.parameters(), lr=1e-2)
    model.fc1.requires_grad_(False)
    with pytest.raises(tg.TileError, match=r"an optimizer parameter that requires a gradient.*received: "
                                           r"optimizer.params\[0\] \(fc1.weight\) has requires_grad=False, and so "
                                           r"have the 1 others"):
        tg.TrainStep(model, opt, _mse)(*_batch(0))


@pytest.mark.distributed
def test_a_deep_copy_of_a_model_on_the_workers_is_its_own(embedded_runtime):
    """``copy.deepcopy(model)`` (an EMA or teacher model, a snapshot) of a model trained on a
    cluster: every use of the copy failed, "the graph to run on the runtime holding its values
    ... held by another runtime" (deepcopy made Dask futures of another client). Now the copy
    holds the same values, and each model trains on its own."""
    with embedded_runtime.as_current():
        model, net, opt, topt = _pair("adam")
        step = tg.TrainStep(model, opt, _mse)
        for i in range(2):
            step(*_batch(i))
            _torch_step(net, topt, *_batch(i))
        twin = copy.deepcopy(model)
        snapshot = model.state_dict()
        assert all(np.array_equal(v, snapshot[k]) for k, v in twin.state_dict().items())
        assert not any(p is q for p, q in zip(model.parameters(), twin.parameters()))
        for i in range(2, 4):
            step(*_batch(i))
            _torch_step(net, topt, *_batch(i))
        _same_weights(model, net)
        assert all(np.array_equal(v, snapshot[k]) for k, v in twin.state_dict().items())  # the copy as it was
        other = tg.TrainStep(twin, tg.optim.SGD(twin.parameters(), lr=0.1), _mse)
        net2 = _torch_model(twin)
        topt2 = torch.optim.SGD(net2.parameters(), lr=0.1)
        x, y = _batch(9)
        assert other(x, y) == pytest.approx(_torch_step(net2, topt2, x, y), rel=1e-12)
        _same_weights(twin, net2)
        _same_weights(model, net)  # the original untouched by the copy's step


def _resume(kind, make_again, steps=6, stop=3):
    """An uninterrupted run's losses, and a run stopped after ``stop`` steps whose model and
    optimizer state dicts are loaded into a fresh model (another seed) and the optimizer
    ``make_again(model)`` gives, then run on; returns both loss lists."""
    model, _, opt, _ = _pair(kind)
    step = tg.TrainStep(model, opt, _mse)
    want = [step(*_batch(i)) for i in range(steps)]
    model, _, opt, _ = _pair(kind)
    step = tg.TrainStep(model, opt, _mse)
    got = [step(*_batch(i)) for i in range(stop)]
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    fresh = _model(seed=5)
    again = make_again(fresh)
    fresh.load_state_dict(saved_model)
    again.load_state_dict(saved_opt)
    step = tg.TrainStep(fresh, again, _mse)
    return want, got + [step(*_batch(i)) for i in range(stop, steps)]


def test_an_optimizer_state_dict_loads_only_into_the_settings_it_was_saved_with():
    """torch's ``load_state_dict`` restores each group's betas, eps, weight_decay, momentum ...;
    here they are parameters of the recorded update. A fresh AdamW left at its default weight
    decay (0.01, the saved run's 0.1) took the state silently and trained on with the other
    decay (an Adam took an AdamW's, an SGD without momentum dropped the buffers). Now each
    difference is named, and the saved settings resume the run exactly."""
    def groups(m):
        return _groups([m.fc1.weight, m.fc2.weight], [m.fc1.bias, m.fc2.bias])

    want, got = _resume("adamw", lambda m: tg.optim.AdamW(groups(m), lr=1e-2, betas=(0.8, 0.99)))
    assert got == want
    want, got = _resume("sgd-nesterov", lambda m: tg.optim.SGD(groups(m), lr=0.05, momentum=0.9, nesterov=True))
    assert got == want

    model, _, opt, _ = _pair("adamw")
    tg.TrainStep(model, opt, _mse)(*_batch(0))
    state = opt.state_dict()
    assert state["settings"] == {"kind": "AdamW", "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.01}
    cases = [
        (lambda: tg.optim.AdamW([{"params": [model.fc1.weight, model.fc2.weight]},
                                 {"params": [model.fc1.bias, model.fc2.bias]}], lr=1e-2, betas=(0.8, 0.99)),
         # a line per group (the weights' saved with 0.05, the biases' with 0.0; session 39: the
         # lines were per parameter, 8 at most, so a model's no-decay group went unnamed)
         "param_groups[0] (2 parameters: weight, weight): weight_decay=0.01 here, 0.05 saved; "
         "param_groups[1] (2 parameters: bias, bias): weight_decay=0.01 here, 0.0 saved"),
        (lambda: tg.optim.Adam(groups(model), lr=1e-2, betas=(0.8, 0.99)), "kind Adam here, AdamW saved"),
        (lambda: tg.optim.AdamW(groups(model), lr=1e-2), "betas=(0.9, 0.999) here, (0.8, 0.99) saved"),
    ]
    for make, received in cases:
        other = make()
        with pytest.raises(tg.TileError) as e:
            other.load_state_dict(state)
        assert "make the optimizer with the saved settings" in e.value.what
        assert e.value.received == received
        assert other.step_count == 0  # nothing changed
    sgd = tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain = tg.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tg.TileError, match=r"received: momentum=0.0 here, 0.9 saved"):
        plain.load_state_dict(sgd.state_dict())
    # left out, this optimizer's own settings are kept (a state_dict of before has none)
    mine = tg.optim.AdamW([{"params": [model.fc1.weight, model.fc2.weight]},
                           {"params": [model.fc1.bias, model.fc2.bias]}], lr=1e-2)
    mine.load_state_dict({k: v for k, v in state.items() if k != "settings"})
    assert mine.step_count == 1 and mine.weight_decay == 0.01


def test_a_step_says_when_its_optimizer_was_made_again():
    """A notebook: the optimizer's cell run again with a lower learning rate, the loop's cell
    again. torch's loop calls the new optimizer; the TrainStep made before went on with the old
    one, silently. Now it warns, once, naming the parameters and what to do."""
    model = _model()
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, _mse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*_batch(0))
        tg.TrainStep(model, opt, _mse)(*_batch(1))  # the step's cell run again: the same optimizer
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)  # the optimizer's cell run again
    with pytest.warns(UserWarning, match=r"a newer AdamW was made over this step's parameters \(fc1.weight, "
                                         r"fc1.bias, fc2.weight, fc2.bias\) since the AdamW the step was made "
                                         r"with.*make the step \(or Trainer\) again with it: "
                                         r"step = tg.TrainStep\(model, opt, loss_fn\)") as record:
        step(*_batch(2))
    assert record[0].filename == __file__  # the user's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(*_batch(3))  # said once
        tg.TrainStep(model, opt, _mse)(*_batch(4))


@pytest.mark.parametrize("kind", ["adamw", "sgd-momentum"])
def test_settings_changed_between_steps_take_effect_as_torchs(kind):
    """``opt.weight_decay = ...`` (torch: each group's ``weight_decay``), ``opt.betas`` /
    ``opt.momentum`` and ``opt.clip_grad_norm`` set between steps: the step went on with the
    values it was recorded with, silently (the loss of the next step was torch's with the old
    settings). Now the next step is recorded with the new ones, the optimizer's state kept."""
    model = _model()
    net = _torch_model(model)
    ours, theirs = OPTIMIZERS[kind]
    opt, topt = ours(model.parameters()), theirs(net.parameters())
    step = tg.TrainStep(model, opt, _mse)
    clip = None
    for i in range(5):
        if i == 2:
            opt.weight_decay = 0.2
            opt.clip_grad_norm = clip = 0.3
            for g in topt.param_groups:
                g["weight_decay"] = 0.2
        if i == 3:
            if kind == "adamw":
                opt.betas = (0.5, 0.9)
            else:
                opt.momentum, opt.nesterov = 0.5, True
            for g in topt.param_groups:
                g.update(betas=(0.5, 0.9)) if kind == "adamw" else g.update(momentum=0.5, nesterov=True)
        x, y = _batch(i)
        assert step(x, y) == pytest.approx(_torch_step(net, topt, x, y, clip=clip), rel=1e-12)
    _same_weights(model, net)
    assert opt.param_groups[0]["weight_decay"] == 0.2


def test_a_setting_is_checked_when_set():
    model = _model()
    adam, sgd, plain = (tg.optim.AdamW(model.parameters()), tg.optim.SGD(model.parameters(), 0.1, 0.9),
                        tg.optim.SGD(model.parameters(), 0.1))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.AdamW.weight_decay\] weight_decay must be a finite "
                                           r"number >= 0; received: weight_decay=-1"):
        adam.weight_decay = -1
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.AdamW.betas\] betas must be two numbers"):
        adam.betas = 0.9
    with pytest.raises(tg.TileError, match=r"\[tilegraph.optim.AdamW.clip_grad_norm\]"):
        adam.clip_grad_norm = 0
    with pytest.raises(tg.TileError, match=r"momentum may change between values above 0 only"):
        plain.momentum = 0.9  # (no buffers)
    with pytest.raises(tg.TileError, match=r"momentum may change between values above 0 only"):
        sgd.momentum = 0.0
    sgd.dampening = 0.1
    with pytest.raises(tg.TileError, match=r"nesterov=True needs a momentum > 0 and dampening=0"):
        sgd.nesterov = True
    assert (adam.weight_decay, adam.betas, adam.clip_grad_norm, sgd.momentum) == (0.01, (0.9, 0.999), None, 0.9)


def test_a_parameter_attribute_replaced_by_a_plain_tensor_is_named_as_torch_refuses_it():
    # `m.weight = m.weight * 0.5` made the attribute a plain tensor: the module silently lost its
    # weight (state_dict ['bias'], not trained, not saved). torch raises a TypeError; so does this.
    lin = tg.nn.Linear(4, 3, seed=0)
    with pytest.raises(tg.TileError, match=r"tilegraph\.nn\.Linear\.weight\] a Parameter or None.*"
                                           r"module\.weight\.assign\(array\)"):
        lin.weight = lin.weight * 0.5
    assert isinstance(lin.weight, tg.nn.Parameter) and set(lin.state_dict()) == {"weight", "bias"}
    w = lin.weight.numpy() * 0.5
    lin.weight.assign(w)  # the way to set values
    np.testing.assert_array_equal(lin.weight.numpy(), w)
    lin.weight = tg.nn.Parameter(w, tiles=(4, 3))  # a Parameter, or None, is taken
    lin.bias = None
    assert set(lin.state_dict()) == {"weight"}


def test_a_parameter_has_torchs_requires_grad_():
    # The README's "requires_grad_(False) between steps" on a parameter was an AttributeError
    # (only Module.requires_grad_ existed).
    lin = tg.nn.Linear(4, 3, seed=0)
    assert lin.weight.requires_grad_(False) is lin.weight and not lin.weight.requires_grad
    assert lin.weight.requires_grad_() is lin.weight and lin.weight.requires_grad
    with pytest.raises(tg.TileError, match="requires_grad must be a bool"):
        lin.bias.requires_grad_("no")
    ids = tg.nn.Parameter(np.arange(4), requires_grad=False)
    with pytest.raises(tg.TileError, match="only floating-point parameters"):
        ids.requires_grad_(True)
