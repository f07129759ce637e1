"""float16 parameters: AdamW and gradient clipping against torch.optim; torch's step/zero_grad
calls on a tilegraph optimizer."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import optim

torch = pytest.importorskip("torch")

#: one float16 ulp relative (2**-10 at most) or absolute at the subnormals (2**-24)
_ULP16 = dict(rtol=2.0 ** -10, atol=2.0 ** -24)


class _Scale(tg.nn.Module):
    """loss = sum(w * x): the gradient is the batch x itself, exact in float16, so both sides
    update from the same gradients and the comparison tests the optimizer alone."""

    def __init__(self, w0):
        self.weight = tg.nn.Parameter(w0, (3, 3))


def _loss(m, x):
    return (m.weight * x).sum()


def _problem(steps=4):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((7, 5)).astype(np.float16)
    xs = [rng.standard_normal((7, 5)).astype(np.float16) for _ in range(steps)]
    xs[0][2, 3] = 0  # a zero gradient, first moments 0: 0/0 = NaN where eps=1e-8 is rounded to float16
    return w0, xs


def _run_tg(make_opt, w0, xs):
    model = _Scale(w0)
    opt = make_opt(model.parameters())
    step = tg.TrainStep(model, opt, _loss, batch_tiles=[(3, 3)])
    norms = []
    for x in xs:
        step(x)
        norms.append(step.last.grad_norm)
    return model.state_dict()["weight"], opt.state_dict()["state"][0], norms


def _run_torch_rounded(make_opt, w0, xs, clip=None, round_state=True):
    """torch.optim in float32 on the float16 values, the parameter and (``round_state``) the
    state rounded to float16 after each step: the update computed in float32 and stored in
    float16 (Adam's moments stay float32 here: round_state=False)."""
    tw = torch.tensor(w0.astype(np.float32), requires_grad=True)
    opt = make_opt([tw])
    norms = []
    for x in xs:
        tw.grad = torch.tensor(x.astype(np.float32))
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_([tw], clip)))
        opt.step()
        with torch.no_grad():
            for t in [tw, *(s for s in opt.state[tw].values() if s.dim() and round_state)]:
                t.copy_(t.half().float())
    state = {k: s.numpy().astype(np.float16 if round_state else np.float32) for k, s in opt.state[tw].items()
             if s.dim()}
    return tw.detach().numpy().astype(np.float16), state, norms


@pytest.mark.parametrize("weight_decay, clip", [(0.0, None), (0.1, None), (0.1, 2.0)])
def test_adamw_float16_matches_torch(weight_decay, clip):
    """AdamW on float16 parameters (it failed in Numba with NotImplementedError: float16) equals
    torch.optim.AdamW run in float32 on the float16-rounded values to one float16 ulp; torch's own
    float16 AdamW (arithmetic in float16) agrees to float16 precision only. clip=2.0 is below
    the gradient norm (about 6), so clipping scales every step."""
    w0, xs = _problem()
    kw = dict(lr=0.05, betas=(0.8, 0.95), weight_decay=weight_decay)
    w, state, norms = _run_tg(lambda p: tg.optim.AdamW(p, clip_grad_norm=clip, **kw), w0, xs)
    rw, rstate, rnorms = _run_torch_rounded(lambda p: torch.optim.AdamW(p, **kw), w0, xs, clip, round_state=False)
    # the moments of a float16 parameter are kept in float32 (in float16 exp_avg_sq underflows)
    assert w.dtype == np.float16 and state["exp_avg"].dtype == state["exp_avg_sq"].dtype == np.float32
    assert np.isfinite(w).all()
    np.testing.assert_allclose(w.astype(np.float32), rw.astype(np.float32), **_ULP16)
    for name in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_allclose(state[name].astype(np.float32), rstate[name].astype(np.float32), **_ULP16)
    assert not np.array_equal(w, w0)
    if clip is not None:
        assert min(rnorms) > clip
        np.testing.assert_allclose(norms, rnorms, rtol=1e-6)
    # torch's float16 AdamW on the same float16 values, but for the element of gradient 0, where
    # its float16 arithmetic gives NaN (torch 2.x: 0 / (0 + eps) with eps 0 in float16)
    tw = torch.tensor(w0, requires_grad=True)
    topt = torch.optim.AdamW([tw], **kw)
    for x in xs:
        tw.grad = torch.tensor(x)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([tw], clip)
        topt.step()
    keep = np.ones(w.shape, bool)
    keep[2, 3] = False
    np.testing.assert_allclose(w[keep].astype(np.float32), tw.detach().numpy()[keep].astype(np.float32),
                               rtol=1e-2, atol=2e-3)


def test_sgd_float16_with_clipping_matches_torch():
    """The clipping norm of float16 gradients (it failed in Numba as AdamW did) is their exact
    norm; SGD's update itself stays float16 arithmetic (it always worked), so a few ulps."""
    w0, xs = _problem()
    w, _, norms = _run_tg(lambda p: tg.optim.SGD(p, lr=0.05, momentum=0.9, clip_grad_norm=2.0), w0, xs)
    rw, _, rnorms = _run_torch_rounded(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), w0, xs, 2.0)
    assert w.dtype == np.float16 and min(rnorms) > 2.0
    exact = [float(np.sqrt((x.astype(np.float64) ** 2).sum())) for x in xs]
    np.testing.assert_allclose(norms, exact, rtol=1e-12)
    np.testing.assert_allclose(norms, rnorms, rtol=1e-6)
    np.testing.assert_allclose(w.astype(np.float32), rw.astype(np.float32), rtol=4 * 2.0 ** -10, atol=1e-3)


def test_linear_float16_trains_with_adamw_and_clipping():
    """The audit's case: a float16 Linear with AdamW (and SGD with clip_grad_norm) under an MSE loss."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 8)).astype(np.float16)
    y = rng.standard_normal((16, 2)).astype(np.float16)
    for make in (lambda p: tg.optim.AdamW(p, lr=1e-2, clip_grad_norm=1.0),
                 lambda p: tg.optim.SGD(p, lr=0.1, clip_grad_norm=1.0)):
        m = tg.nn.Linear(8, 2, dtype=np.float16, seed=0)
        step = tg.TrainStep(m, make(m.parameters()), lambda m, x, y: ((m(x) - y) ** 2).mean())
        losses = [step(x, y) for _ in range(5)]
        assert np.isfinite(losses).all() and losses[-1] < losses[0]
        assert all(v.dtype == np.float16 for v in m.state_dict().values())


@pytest.mark.parametrize("name", ["cpu", "gpu-on-numpy", "generic"])  # "gpu" alone: conftest skips it
def test_adamw_float16_kernels_agree(name):
    """The CPU (Numba), GPU (run here with NumPy standing in for CuPy) and generic kernels take
    float16 tiles, compute in float32 (as the float32 kernels on the same values) and return the
    parameter in float16 (rounded once), the moments in float32 (float16 moments underflow)."""
    rng = np.random.default_rng(2)
    p, g, m = (rng.standard_normal((5, 6)).astype(np.float16) for _ in range(3))
    v = np.abs(rng.standard_normal((5, 6))).astype(np.float16)
    g[0, 0] = m[0, 0] = v[0, 0] = 0
    hyper = np.array([0.01, 3.0, 0.5])
    kw = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
    fn = {"cpu": optim._adamw_cpu, "gpu-on-numpy": optim._adamw_gpu, "generic": optim._adamw_xp}[name]
    outs = fn(p, g, m, v, hyper, **kw)
    ref = optim._adamw_cpu(*(a.astype(np.float32) for a in (p, g, m, v)), hyper, **kw)
    assert [o.dtype for o in outs] == [np.float16, np.float32, np.float32]
    np.testing.assert_allclose(outs[0].astype(np.float32), ref[0].astype(np.float16).astype(np.float32), **_ULP16)
    for o, r in zip(outs[1:], ref[1:]):
        assert np.isfinite(o).all()
        np.testing.assert_allclose(o, r, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("fn", [optim._sumsq_cpu, optim._sumsq_gpu, optim._sumsq.fn])
def test_sumsq_float16_is_exact(fn):
    """Squared norms of float16 tiles: exact (float64 from float32) where a float16 sum would
    overflow (300 * 200**2 > 65504)."""
    tiles = [np.full((10, 10), 200, np.float16), np.full((2, 100), -200, np.float16)]
    np.testing.assert_array_equal(np.asarray(fn(*tiles)), [300 * 200.0 ** 2])


def test_step_says_to_use_trainstep_and_zero_grad_clears():
    """torch's loop, loss.backward(); opt.step(); opt.zero_grad(): step names TrainStep (it was a
    bare AttributeError), zero_grad clears the gradients backward accumulated."""
    m = tg.nn.Linear(3, 2, dtype=np.float64, seed=0)
    opt = tg.optim.AdamW(m.parameters(), lr=0.1)
    before = m.state_dict()
    m(tg.from_numpy(np.ones((4, 3)))).sum().backward()
    with pytest.raises(tg.TileError, match=r"\[tilegraph\.optim\.AdamW\.step\].*tg\.TrainStep\(model, opt, "
                                           r"loss_fn\).*2 of 2 parameters hold a \.grad"):
        opt.step()
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    opt.zero_grad(set_to_none=False)
    np.testing.assert_array_equal(m.weight.grad.numpy(), np.zeros((3, 2)))
    np.testing.assert_array_equal(m.bias.grad.numpy(), np.zeros(2))
    m(tg.from_numpy(np.ones((4, 3)))).sum().backward()  # adds onto the zeros
    np.testing.assert_array_equal(m.bias.grad.numpy(), [4.0, 4.0])
    opt.zero_grad()
    assert m.weight.grad is None and m.bias.grad is None
    with pytest.raises(tg.TileError, match=r"SGD\.step.*0 of 2 parameters"):
        tg.optim.SGD(m.parameters(), lr=0.1).step()
