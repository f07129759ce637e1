"""Training knobs against torch's (a new-user audit): nested activation checkpoints, parameters
frozen when the optimizer was made, empty parameter groups, opt.param_groups, and float16
parameters with AdamW."""

import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph._errors import TileError
from tilegraph._lower import compute
from test_optim_fp16 import _run_torch_rounded  # torch's optimizer on float16-rounded values
from conftest import mse

torch = pytest.importorskip("torch")
tc = pytest.importorskip("torch.utils.checkpoint")


def _ckpt(fn, *args):
    return tc.checkpoint(fn, *args, use_reentrant=False)


# ----------------------------------------------------------------- nested tg.checkpoint ----
def _nested_problem():
    r = np.random.default_rng(0)
    return r.standard_normal((4, 3)), r.standard_normal((3, 3)), r.standard_normal((3, 3))


@pytest.mark.parametrize("outside", [False, True], ids=["inside-only", "also-outside"])
def test_two_level_nested_checkpoint_gradients_match_torch(outside):
    """A parameter used inside a checkpoint nested in another gets the inner part of its gradient
    (it got none: "inputs[0] does not affect the loss" when used only there, silently wrong
    when also used outside), as torch's nested non-reentrant checkpoints."""
    X, W, V = _nested_problem()
    w, v, x = tg.nn.Parameter(W), tg.nn.Parameter(V), tg.from_numpy(X)
    outer = lambda h: tg.checkpoint(lambda h: tg.tanh(h @ w), h) * 2.0 + h @ v
    y = tg.checkpoint(outer, x)
    loss = ((y + x @ w) if outside else y).sum()
    got = compute(*tg.grad(loss, [w, v, x]))

    tw, tv = torch.tensor(W, requires_grad=True), torch.tensor(V, requires_grad=True)
    tx = torch.tensor(X, requires_grad=True)
    t_outer = lambda h: _ckpt(lambda h: torch.tanh(h @ tw), h) * 2.0 + h @ tv
    ty = _ckpt(t_outer, tx)
    ((ty + tx @ tw) if outside else ty).sum().backward()
    for g, t, name in zip(got, (tw, tv, tx), "wvx"):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)


def test_three_level_nested_checkpoint_gradients_match_torch():
    """Three checkpoints deep, a parameter in each level (the innermost one's also outside all)."""
    X, W, V = _nested_problem()
    U = np.random.default_rng(1).standard_normal((3, 3))
    w, v, u, x = tg.nn.Parameter(W), tg.nn.Parameter(V), tg.nn.Parameter(U), tg.from_numpy(X)
    level3 = lambda h: tg.tanh(h @ w)
    level2 = lambda h: tg.checkpoint(level3, h) @ v
    level1 = lambda h: tg.tanh(tg.checkpoint(level2, h) + h @ u)
    loss = (tg.checkpoint(level1, x) * (x @ w)).sum()
    got = compute(*tg.grad(loss, [w, v, u, x]))
    plain = compute(*tg.grad((level1(x) * (x @ w)).sum(), [w, v, u, x]))

    tw, tv, tu = (torch.tensor(a, requires_grad=True) for a in (W, V, U))
    tx = torch.tensor(X, requires_grad=True)
    t3 = lambda h: torch.tanh(h @ tw)
    t2 = lambda h: _ckpt(t3, h) @ tv
    t1 = lambda h: torch.tanh(_ckpt(t2, h) + h @ tu)
    (_ckpt(t1, tx) * (tx @ tw)).sum().backward()
    for g, p, t, name in zip(got, plain, (tw, tv, tu, tx), "wvux"):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=name)
        np.testing.assert_allclose(g, p, rtol=1e-12, atol=1e-12, err_msg=name)


def test_checkpointed_call_of_a_recompute_model_has_every_gradient():
    """GPT-2 built with recompute=True (a checkpoint per block) called under tg.checkpoint: the
    same gradients as called directly (it failed: inputs[2] does not affect the loss), and a
    TrainStep over it trains."""
    warnings.filterwarnings("ignore")
    ids = np.random.default_rng(0).integers(0, 96, (2, 9))
    model = models.build("gpt2-debug", seed=0, recompute=True, dtype=np.float64)
    params = list(model.parameters())
    x, y = tg.from_numpy(ids[:, :-1]), tg.from_numpy(ids[:, 1:])
    nested = compute(*tg.grad(tg.cross_entropy(tg.checkpoint(model, x), y), params))
    direct = compute(*tg.grad(tg.cross_entropy(model(x), y), params))
    for (name, _), a, b in zip(model.named_parameters(), nested, direct):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)
    step = tg.TrainStep(model, tg.optim.AdamW(params, lr=1e-2),
                        lambda m, a, b: tg.cross_entropy(tg.checkpoint(m, a), b))
    assert np.isfinite(step(ids[:, :-1], ids[:, 1:]))


# ------------------------------------------------- parameters frozen when the optimizer was made ----
def _linear_problem():
    r = np.random.default_rng(0)
    return r.standard_normal((8, 4)), r.standard_normal((8, 2))


def test_unfreezing_a_parameter_the_optimizer_left_out_is_an_error_naming_it():
    """A parameter frozen when the optimizer was made is left out of it; unfrozen later it
    never trained, silently. Now the first step after unfreezing says so, naming it, and says to
    make a new optimizer."""
    X, Y = _linear_problem()
    lin = tg.nn.Linear(4, 2, seed=0, dtype=np.float64)
    lin.weight.requires_grad = False
    opt = tg.optim.SGD(lin.parameters(), lr=0.1)
    assert opt.params == [lin.bias] and opt.frozen_params == [lin.weight]
    step = tg.TrainStep(lin, opt, mse)
    step(X, Y)
    step(X, Y)  # still frozen: fine (a LoRA base)
    lin.weight.requires_grad = True
    with pytest.raises(TileError, match="new optimizer") as e:
        step(X, Y)
    assert "weight has requires_grad=True now, False when SGD was made" in e.value.received
    assert opt.step_count == 2


def test_gradual_unfreezing_with_a_new_optimizer_equals_torch():
    """Gradual unfreezing the tilegraph way (a new optimizer and TrainStep once the weight
    trains) equals torch's (one optimizer over all parameters), float64, plain SGD (no state)."""
    X, Y = _linear_problem()
    lin = tg.nn.Linear(4, 2, seed=0, dtype=np.float64)
    W0, b0 = lin.weight.numpy().copy(), lin.bias.numpy().copy()
    lin.weight.requires_grad = False
    step = tg.TrainStep(lin, tg.optim.SGD(lin.parameters(), lr=0.1), mse)
    step(X, Y)
    lin.weight.requires_grad = True
    step = tg.TrainStep(lin, tg.optim.SGD(lin.parameters(), lr=0.1), mse)
    for _ in range(3):
        step(X, Y)

    tl = torch.nn.Linear(4, 2).double()
    with torch.no_grad():
        tl.weight.copy_(torch.tensor(W0.T))
        tl.bias.copy_(torch.tensor(b0))
    tl.weight.requires_grad_(False)
    topt = torch.optim.SGD(tl.parameters(), lr=0.1)
    for i in range(4):
        if i == 1:
            tl.weight.requires_grad_(True)
        topt.zero_grad()
        ((tl(torch.tensor(X)) - torch.tensor(Y)) ** 2).mean().backward()
        topt.step()
    np.testing.assert_allclose(lin.weight.numpy(), tl.weight.detach().numpy().T, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lin.bias.numpy(), tl.bias.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert not np.array_equal(lin.weight.numpy(), W0)


# ------------------------------------------------------------------ empty parameter groups ----
def _no_bias_model():
    return tg.nn.Sequential(tg.nn.Linear(8, 8, bias=False, seed=0, dtype=np.float64), tg.nn.ReLU(),
                            tg.nn.Linear(8, 2, bias=False, seed=1, dtype=np.float64))


def test_empty_parameter_group_is_accepted_and_trains_as_torch():
    """The AdamW docstring's GPT-2 recipe on a model without biases or norms: its "no decay"
    group is empty (refused before: params must hold at least one Parameter); as torch's, it
    updates nothing and the rest train as torch's AdamW with the same groups."""
    model = _no_bias_model()
    W = [p.numpy().copy() for p in model.parameters()]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    assert rest == []
    opt = tg.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.01)
    assert opt.params == decay and [len(g["params"]) for g in opt.param_groups] == [2, 0]
    r = np.random.default_rng(3)
    X, Y = r.standard_normal((6, 8)), r.standard_normal((6, 2))
    step = tg.TrainStep(model, opt, mse)
    for _ in range(3):
        step(X, Y)

    tws = [torch.tensor(w, requires_grad=True) for w in W]
    topt = torch.optim.AdamW([{"params": tws, "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}], lr=0.01)
    for _ in range(3):
        topt.zero_grad()
        ((torch.relu(torch.tensor(X) @ tws[0]) @ tws[1] - torch.tensor(Y)) ** 2).mean().backward()
        topt.step()
    for p, t in zip(model.parameters(), tws):
        np.testing.assert_allclose(p.numpy(), t.detach().numpy(), rtol=1e-10, atol=1e-12)


def test_other_bad_parameter_groups_are_still_refused():
    model = _no_bias_model()
    ps = list(model.parameters())
    with pytest.raises(TileError, match="at least one Parameter among the parameter groups") as e:
        tg.optim.AdamW([{"params": []}, {"params": []}])
    assert e.value.received == "2 parameter groups, all empty"
    with pytest.raises(TileError, match=r"param_groups\[1\].*params\[0\] is not a Parameter"):
        tg.optim.AdamW([{"params": ps}, {"params": [np.zeros(3)]}])
    with pytest.raises(TileError, match="'params'"):
        tg.optim.AdamW([{"params": ps}, {"weight_decay": 0.0}])
    with pytest.raises(TileError, match="each Parameter once"):
        tg.optim.AdamW([{"params": ps}, {"params": ps[:1]}])
    with pytest.raises(TileError, match="at least one Parameter"):
        tg.optim.AdamW([])


# ------------------------------------------------------------------------ opt.param_groups ----
def test_param_groups_reads_as_torchs_and_refuses_changes_naming_the_schedule():
    """opt.param_groups was a bare AttributeError. It reads as torch's (params, the group's lr
    now, its settings); the groups are fixed (recorded into the update kernels, the rate from the
    schedule), so setting an entry is a TileError naming opt.schedule, not a change that does
    nothing."""
    lin = tg.nn.Linear(4, 3, seed=0)
    opt = tg.optim.AdamW([{"params": [lin.weight], "lr": 1e-4, "weight_decay": 0.1}, {"params": [lin.bias]}],
                         lr=1e-3)
    groups = opt.param_groups
    assert [g["params"] for g in groups] == [[lin.weight], [lin.bias]]
    assert groups[0]["lr"] == pytest.approx(1e-4) and groups[1]["lr"] == pytest.approx(1e-3)
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.01
    assert groups[1]["betas"] == (0.9, 0.999) and dict(groups[1])["eps"] == 1e-8
    for g in opt.param_groups:
        with pytest.raises(TileError, match=r"opt\.schedule = tg\.optim\.constant") as e:
            g["lr"] = 1e-5
        assert "param_groups[" in str(e.value) and "['lr'] = 1e-05" in e.value.received
    with pytest.raises(TileError, match=r"opt\.schedule"):
        opt.param_groups[0].update(lr=1e-5)
    with pytest.raises(TileError, match=r"opt\.schedule"):
        opt.param_groups = []
    opt.schedule = tg.optim.constant(5e-4)  # the way: each group keeps its multiple
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([5e-5, 5e-4])


# --------------------------------------------------------------- float16 parameters, AdamW ----
class _Scale(tg.nn.Module):
    """loss = sum(w * x): the gradient is x itself."""

    def __init__(self, w0):
        self.weight = tg.nn.Parameter(w0, (3, 3))


def _small_gradient_problem():
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((7, 5)).astype(np.float16)
    xs = [(rng.standard_normal((7, 5)) * 1e-3).astype(np.float16) for _ in range(4)]
    return w0, xs


def test_adamw_keeps_the_moments_of_float16_parameters_in_float32():
    """Small float16 gradients (~1e-3): (1 - beta2) * g**2 underflowed to 0 in a float16
    exp_avg_sq while exp_avg did not, so the update was lr * m / eps (thousands of times lr;
    GPT-2 went to NaN in 4 steps). The moments are float32 now: the update equals torch's AdamW
    in float32 on the float16-rounded parameter, to a float16 ulp."""
    w0, xs = _small_gradient_problem()
    model = _Scale(w0)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    opt = tg.optim.AdamW(model.parameters(), **kw)
    step = tg.TrainStep(model, opt, lambda m, x: (m.weight * x).sum(), batch_tiles=[(3, 3)])
    for x in xs:
        step(x)
    rw, rstate, _ = _run_torch_rounded(lambda p: torch.optim.AdamW(p, **kw), w0, xs, round_state=False)
    state = opt.state_dict()["state"][0]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == np.float32
    assert (state["exp_avg_sq"] > 0).all()
    w = model.state_dict()["weight"]
    assert w.dtype == np.float16
    # each step moves a weight by about lr (Adam's normalised step), not by lr * m / eps
    assert np.abs(w.astype(np.float32) - w0.astype(np.float32)).max() < 4 * 1e-2 * 1.1
    np.testing.assert_allclose(w.astype(np.float32), rw.astype(np.float32), rtol=2.0 ** -10, atol=2.0 ** -24)
    for name in ("exp_avg", "exp_avg_sq"):
        ref = rstate[name]  # float32 rounding, cancellation in m's sums included
        np.testing.assert_allclose(state[name], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_float16_adamw_state_round_trips_through_state_dict_and_zarr(tmp_path):
    """The float32 moments of a float16 parameter round-trip through state_dict/load_state_dict
    and a Zarr checkpoint's restore_optimizer (stored as float32); a float16 state (saved before)
    loads widened."""
    w0, xs = _small_gradient_problem()
    model = _Scale(w0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    step = tg.TrainStep(model, opt, lambda m, x: (m.weight * x).sum(), batch_tiles=[(3, 3)])
    for x in xs[:2]:
        step(x)
    saved = opt.state_dict()

    again = tg.optim.AdamW(_Scale(w0).parameters(), lr=1e-2)
    again.load_state_dict(saved)
    back = again.state_dict()
    assert back["step"] == 2
    for name in ("exp_avg", "exp_avg_sq"):
        assert back["state"][0][name].dtype == np.float32
        np.testing.assert_array_equal(back["state"][0][name], saved["state"][0][name])

    old = {**saved, "state": [{k: v.astype(np.float16) for k, v in saved["state"][0].items()}]}
    again.load_state_dict(old)
    assert again.state_dict()["state"][0]["exp_avg_sq"].dtype == np.float32

    tg.io.save_checkpoint(tmp_path / "ck", model, opt)
    ck = tg.io.load_checkpoint(tmp_path / "ck")
    assert ck.arrays["optimizer/exp_avg_sq/weight"]["dtype"] == "float32"
    third_model = _Scale(w0)
    third = tg.optim.AdamW(third_model.parameters(), lr=1e-2)
    ck.restore_optimizer(third, third_model)
    restored = third.state_dict()
    assert restored["step"] == 2
    for name in ("exp_avg", "exp_avg_sq"):
        assert restored["state"][0][name].dtype == np.float32
        np.testing.assert_array_equal(restored["state"][0][name], saved["state"][0][name])
