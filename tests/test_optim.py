"""Optimizers, schedules and clipping against torch.optim on the same gradients."""

import math

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")


def _problem(seed, dtype=np.float64, tile=3):
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal((7, 5)).astype(dtype)
    b0 = rng.standard_normal(5).astype(dtype)
    x = rng.standard_normal((11, 7)).astype(dtype)
    y = rng.standard_normal((11, 5)).astype(dtype)
    return w0, b0, x, y


class _Lin(tg.nn.Module):
    def __init__(self, w0, b0, tile):
        self.weight = tg.nn.Parameter(w0, (tile, tile))
        self.bias = tg.nn.Parameter(b0, (tile,))

    def forward(self, x):
        return tg.matmul(x, self.weight, bias=self.bias)


def _loss(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _run_both(make_tg, make_torch, steps=5, dtype=np.float64, tile=3, clip=None):
    w0, b0, x, y = _problem(0, dtype, tile)
    model = _Lin(w0, b0, tile)
    opt = make_tg(model.parameters())
    step = tg.TrainStep(model, opt, _loss, batch_tiles=[(4, tile), (4, tile)])
    tw = torch.tensor(w0, requires_grad=True)
    tb = torch.tensor(b0, requires_grad=True)
    topt = make_torch([tw, tb])
    losses, tlosses = [], []
    for _ in range(steps):
        losses.append(step(x, y))
        topt.zero_grad()
        tl = ((torch.tensor(x) @ tw + tb - torch.tensor(y)) ** 2).mean()
        tl.backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_([tw, tb], clip)
            assert step.last.grad_norm == pytest.approx(float(norm), rel=1e-6)
        topt.step()
        tlosses.append(float(tl.detach()))
    np.testing.assert_allclose(losses, tlosses, rtol=1e-6 if dtype == np.float32 else 1e-10)
    state = model.state_dict()
    tol = 2e-5 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(state["weight"], tw.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(state["bias"], tb.detach().numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_adamw_matches_torch(dtype):
    _run_both(lambda p: tg.optim.AdamW(p, lr=0.05, betas=(0.8, 0.95), weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=0.05, betas=(0.8, 0.95), weight_decay=0.1), dtype=dtype)


def test_adamw_with_schedule_and_clipping_matches_torch():
    sched = tg.optim.warmup_cosine(0.1, warmup=2, total=6)
    _run_both(lambda p: tg.optim.AdamW(p, lr=sched, clip_grad_norm=0.5),
              lambda p: _scheduled(torch.optim.AdamW(p, lr=0.1), sched), steps=6, clip=0.5)


def _scheduled(opt, sched):
    class Wrapped:
        n = 0

        def zero_grad(self):
            opt.zero_grad()

        def step(self):
            Wrapped.n += 1
            for g in opt.param_groups:
                g["lr"] = sched(Wrapped.n)
            opt.step()

    return Wrapped()


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_matches_torch(momentum):
    _run_both(lambda p: tg.optim.SGD(p, lr=0.1, momentum=momentum, weight_decay=0.01),
              lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum, weight_decay=0.01))


def test_warmup_cosine_values():
    f = tg.optim.warmup_cosine(1.0, warmup=10, total=110, min_lr=0.1)
    assert f(1) == pytest.approx(0.1)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)
    with pytest.raises(tg.TileError, match="warmup"):
        tg.optim.warmup_cosine(1.0, warmup=20, total=10)


def test_optimizer_rejects_non_parameters():
    with pytest.raises(tg.TileError, match=r"params\[0\] is not a Parameter"):
        tg.optim.AdamW([tg.from_numpy(np.ones(3))])


def test_frozen_parameters_are_left_out_of_the_optimizer():
    model = tg.nn.MLP(4, 8, out_dim=2, seed=0)
    params = model.parameters()
    params[0].requires_grad = False
    opt = tg.optim.AdamW(params, lr=1e-2)
    assert opt.params == params[1:] and len(opt.state) == len(params) - 1
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    before = params[0].numpy().copy()
    step = tg.TrainStep(model, opt, lambda m, x: (m(x) * m(x)).mean())
    step(x)
    np.testing.assert_array_equal(params[0].numpy(), before)  # frozen: no update
    for p in params:
        p.requires_grad = False
    with pytest.raises(tg.TileError, match="all frozen"):
        tg.optim.SGD(params, lr=0.1)
