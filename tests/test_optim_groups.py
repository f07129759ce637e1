"""torch's parameter groups: AdamW groups with their own weight_decay, betas and eps, SGD groups
with their own weight_decay, each against torch.optim over a few steps; a checkpoint records each
parameter's settings; what groups cannot set (SGD's momentum per group) is named."""

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")


def _model():
    return tg.nn.Sequential(tg.nn.Linear(6, 5, dtype=np.float64, seed=0), tg.nn.LayerNorm(5, dtype=np.float64),
                            tg.nn.Linear(5, 3, dtype=np.float64, seed=1))


def _split(named):
    decay = [p for _, p in named if p.ndim >= 2]
    rest = [p for _, p in named if p.ndim < 2]
    return decay, rest


def _loss(m, x, y):
    return ((m(x) - y) ** 2).mean()


def _against_torch(make_tg, make_torch, steps=4):
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((8, 6)) for _ in range(steps)]
    ys = [rng.standard_normal((8, 3)) for _ in range(steps)]
    model = _model()
    named = list(model.named_parameters())
    t_params = {n: torch.tensor(p.numpy(), requires_grad=True) for n, p in named}
    opt = make_tg(named)
    t_opt = make_torch({n: t_params[n] for n, _ in named})
    step = tg.TrainStep(model, opt, _loss)
    for x, y in zip(xs, ys):
        step(x, y)
        t_opt.zero_grad()
        h = torch.tensor(x) @ t_params["0.weight"] + t_params["0.bias"]
        h = torch.nn.functional.layer_norm(h, (5,), t_params["1.weight"], t_params["1.bias"])
        out = h @ t_params["2.weight"] + t_params["2.bias"]
        ((out - torch.tensor(y)) ** 2).mean().backward()
        t_opt.step()
    got = model.state_dict()
    for n, _ in named:
        np.testing.assert_allclose(got[n], t_params[n].detach().numpy(), rtol=1e-10, atol=1e-12, err_msg=n)
    return model, opt


def test_adamw_groups_match_torch():
    def ours(named):
        decay, rest = _split(named)
        return tg.optim.AdamW([{"params": decay, "weight_decay": 0.3}, {"params": rest, "weight_decay": 0.0,
                                                                      "betas": (0.8, 0.99), "eps": 1e-6}], lr=0.05)

    def theirs(t):
        decay, rest = _split([(n, v) for n, v in t.items()])
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.3},
                                  {"params": rest, "weight_decay": 0.0, "betas": (0.8, 0.99), "eps": 1e-6}], lr=0.05)

    model, opt = _against_torch(ours, theirs)
    assert opt.param_options[0] == {"weight_decay": 0.3} and opt.weight_decay == 0.01  # the rest: the defaults


def test_sgd_groups_match_torch():
    def ours(named):
        decay, rest = _split(named)
        return tg.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=0.1, momentum=0.9)

    def theirs(t):
        decay, rest = _split([(n, v) for n, v in t.items()])
        return torch.optim.SGD([{"params": decay, "weight_decay": 0.1}, {"params": rest}], lr=0.1, momentum=0.9)

    _against_torch(ours, theirs)


def test_a_checkpoint_records_each_parameters_settings(tmp_path):
    model = _model()
    decay, rest = _split(list(model.named_parameters()))
    opt = tg.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    tg.io.save_checkpoint(tmp_path / "ck", model, opt, step=0)
    options = tg.io.load_checkpoint(tmp_path / "ck").optimizer_info["hyper"]["param_options"]
    # in the order of optimizer.params: the groups' order
    assert [p.name for p in opt.params] == ["weight", "weight", "bias", "weight", "bias", "bias"]
    assert options == [{"weight_decay": 0.1}] * 2 + [{"weight_decay": 0.0}] * 4


def test_what_groups_cannot_set_is_named():
    model = _model()
    decay, rest = _split(list(model.named_parameters()))
    cases = [
        (lambda: tg.optim.AdamW([{"params": decay, "momentum": 0.9}]), r"parameter groups may set lr, weight_decay, "
         r"betas, eps only; received: param_groups\[0\] sets momentum"),
        (lambda: tg.optim.SGD([{"params": decay, "momentum": 0.5}]), r"may set lr, weight_decay only"),
        (lambda: tg.optim.AdamW([{"weight_decay": 0.1}]), r"each parameter group a dict with 'params'"),
        (lambda: tg.optim.AdamW([{"params": decay, "weight_decay": -1}]),
         r"\[tilegraph.optim.AdamW param_groups\[0\]\] weight_decay"),
        (lambda: tg.optim.AdamW([{"params": decay, "betas": (0.9,)}]), r"betas must be two numbers"),
        (lambda: tg.optim.AdamW([{"params": decay}, {"params": decay[:1]}]), r"each Parameter once"),
    ]
    for make, what in cases:
        with pytest.raises(tg.TileError, match=what):
            make()
    opt = tg.optim.AdamW(p for p in model.parameters())  # a generator of Parameters, as before
    assert len(opt.params) == 6
