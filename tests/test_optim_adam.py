"""torch.optim.Adam (L2 weight decay), SGD's Nesterov momentum and dampening, and a parameter
group's own lr scaled by the schedule as torch's LambdaLR scales each group's: each against
torch.optim on the same parameters and batches over several steps, float32 and float64, one tile
and ragged tiles; the arguments torch refuses (and those not implemented) named; an Adam
checkpoint resumed exactly and refused by another kind of optimizer."""

import math

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")

#: (weight tiles, bias tiles, batch tiles): the (7, 5) weight in one tile, or in 3 x 3 tiles with
#: ragged last ones (7 = 3 + 3 + 1, 5 = 3 + 2)
TILINGS = {"single": ((7, 5), (5,), [(11, 7), (11, 5)]),
           "ragged": ((3, 3), (3,), [(4, 3), (4, 3)])}
DTYPES = [np.float32, np.float64]
by_mode = pytest.mark.parametrize("mode", list(TILINGS))
by_dtype = pytest.mark.parametrize("dtype", DTYPES)


class _Lin(tg.nn.Module):
    def __init__(self, w0, b0, mode):
        w_tiles, b_tiles, _ = TILINGS[mode]
        self.weight = tg.nn.Parameter(w0, w_tiles, name="weight")
        self.bias = tg.nn.Parameter(b0, b_tiles, name="bias")

    def forward(self, x):
        return tg.matmul(x, self.weight, bias=self.bias)


def _loss(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _data(dtype, steps):
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((7, 5)).astype(dtype)
    b0 = rng.standard_normal(5).astype(dtype)
    batches = [(rng.standard_normal((11, 7)).astype(dtype), rng.standard_normal((11, 5)).astype(dtype))
               for _ in range(steps)]
    return w0, b0, batches


def _tol(dtype):
    return dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)


def _against_torch(make_tg, make_torch, *, dtype=np.float64, mode="single", steps=5, clip=None):
    """``steps`` updates of ``make_tg([weight, bias])`` through TrainStep and of
    ``make_torch([tw, tb]) -> (optimizer, scheduler or None)`` on the same batches: losses,
    parameters and the optimizer state (by torch's names) compared. Returns the tilegraph
    optimizer."""
    w0, b0, batches = _data(dtype, steps)
    model = _Lin(w0, b0, mode)
    opt = make_tg([model.weight, model.bias])
    step = tg.TrainStep(model, opt, _loss, batch_tiles=TILINGS[mode][2])
    tw, tb = (torch.tensor(a, requires_grad=True) for a in (w0, b0))
    topt, sched = make_torch([tw, tb])
    losses, tlosses = [], []
    for x, y in batches:
        losses.append(step(x, y))
        topt.zero_grad()
        tl = ((torch.tensor(x) @ tw + tb - torch.tensor(y)) ** 2).mean()
        tl.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([tw, tb], clip)
        topt.step()
        if sched is not None:
            sched.step()
        tlosses.append(float(tl.detach()))
    tol = _tol(dtype)
    np.testing.assert_allclose(losses, tlosses, rtol=1e-6 if dtype == np.float32 else 1e-10)
    state = model.state_dict()
    np.testing.assert_allclose(state["weight"], tw.detach().numpy(), **tol, err_msg="weight")
    np.testing.assert_allclose(state["bias"], tb.detach().numpy(), **tol, err_msg="bias")
    for ours, t in zip(opt.state_dict()["state"], (tw, tb)):
        assert set(ours) == {k for k, v in topt.state[t].items() if k != "step"}
        for name, value in ours.items():
            assert value.dtype == dtype
            np.testing.assert_allclose(value, topt.state[t][name].numpy(), **tol, err_msg=name)
    return opt


def _groups(params, first: dict, second: dict) -> list:
    """torch's two parameter groups: the weight with ``first``'s settings, the bias with ``second``'s."""
    return [{"params": [params[0]], **first}, {"params": [params[1]], **second}]


# ------------------------------------------------------------------------------------- Adam ----
@by_mode
@by_dtype
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_torch(dtype, mode, weight_decay):
    kw = dict(lr=0.05, betas=(0.8, 0.95), weight_decay=weight_decay)
    _against_torch(lambda p: tg.optim.Adam(p, **kw), lambda p: (torch.optim.Adam(p, **kw), None), dtype=dtype,
                   mode=mode)


def test_adam_weight_decay_is_l2_not_adamw_decay():
    """The same run under AdamW's decoupled decay ends elsewhere: the decay went into the moments."""
    kw = dict(lr=0.05, weight_decay=0.5)
    adam = _against_torch(lambda p: tg.optim.Adam(p, **kw), lambda p: (torch.optim.Adam(p, **kw), None))
    adamw = _against_torch(lambda p: tg.optim.AdamW(p, **kw), lambda p: (torch.optim.AdamW(p, **kw), None))
    assert type(adam) is tg.optim.Adam and isinstance(adamw, tg.optim.Adam)  # as torch's, AdamW(Adam)
    assert not np.allclose(adam.params[0].numpy(), adamw.params[0].numpy(), rtol=1e-3)


def test_adam_with_clipping_matches_torch():
    """Clipping scales the gradient before the L2 term joins it (torch: clip_grad_norm_, then step)."""
    kw = dict(lr=0.05, weight_decay=0.1)
    _against_torch(lambda p: tg.optim.Adam(p, clip_grad_norm=0.5, **kw), lambda p: (torch.optim.Adam(p, **kw), None),
                   mode="ragged", clip=0.5)


@by_mode
@by_dtype
def test_adam_groups_match_torch(dtype, mode):
    first, second = {"weight_decay": 0.2, "betas": (0.8, 0.99)}, {"eps": 1e-6}
    opt = _against_torch(lambda p: tg.optim.Adam(_groups(p, first, second), lr=0.05),
                         lambda p: (torch.optim.Adam(_groups(p, first, second), lr=0.05), None), dtype=dtype, mode=mode)
    assert opt.param_options == [first, second] and opt.weight_decay == 0.0  # the rest: Adam's defaults


def test_adam_float16_computes_in_float32():
    """float16 parameters (their update in float32, stored in float16, as AdamW's) against
    torch's Adam in float32 on the float16-rounded values, the L2 term included."""
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((7, 5)).astype(np.float16)
    xs = [rng.standard_normal((7, 5)).astype(np.float16) for _ in range(4)]
    xs[0][2, 3] = 0  # a zero gradient: 0/0 = NaN if eps=1e-8 were rounded to float16

    class Scale(tg.nn.Module):  # loss = sum(w * x): the gradient is x, exact in float16
        def __init__(self):
            self.weight = tg.nn.Parameter(w0, (3, 3))

    model = Scale()
    kw = dict(lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    step = tg.TrainStep(model, tg.optim.Adam(model.parameters(), **kw), lambda m, x: (m.weight * x).sum(),
                        batch_tiles=[(3, 3)])
    tw = torch.tensor(w0.astype(np.float32), requires_grad=True)
    topt = torch.optim.Adam([tw], **kw)
    for x in xs:
        step(x)
        tw.grad = torch.tensor(x.astype(np.float32))
        topt.step()
        with torch.no_grad():
            tw.copy_(tw.half().float())  # the moments of a float16 parameter are kept in float32
    w = model.state_dict()["weight"]
    assert w.dtype == np.float16 and np.isfinite(w).all()
    np.testing.assert_allclose(w.astype(np.float32), tw.detach().numpy(), rtol=2.0 ** -10, atol=2.0 ** -24)


@by_dtype
def test_adam_kernels_match_torch_and_each_other(dtype):
    """One update of a tile by each version of the kernel (Numba's, the array code, the GPU
    version run on NumPy: its fused kernel's array code) with Adam's L2 term and a group's lr
    scale, against torch.optim.Adam at step 7; the inputs are left as they were."""
    from tilegraph.optim import _adamw_cpu, _adamw_gpu, _adamw_xp

    rng = np.random.default_rng(1)
    shape = (37, 29)
    p, g, m = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    v = (rng.random(shape) * 0.1).astype(dtype)
    g[0, :3] = m[0, :3] = v[0, :5] = 0.0
    before = [a.copy() for a in (p, g, m, v)]
    lr, scale, betas, eps, wd, t = 3e-3, 0.25, (0.8, 0.95), 1e-8, 0.1, 7
    tp = torch.tensor(p, requires_grad=True)
    tp.grad = torch.tensor(g)
    topt = torch.optim.Adam([tp], lr=lr * scale, betas=betas, eps=eps, weight_decay=wd)
    topt.state[tp] = {"step": torch.tensor(float(t - 1)), "exp_avg": torch.tensor(m), "exp_avg_sq": torch.tensor(v)}
    topt.step()
    want = (tp.detach().numpy(), topt.state[tp]["exp_avg"].numpy(), topt.state[tp]["exp_avg_sq"].numpy())
    tol = 2e-6 if dtype == np.float32 else 1e-13
    for fn in (_adamw_cpu, _adamw_xp, _adamw_gpu):
        got = fn(p, g, m, v, np.array([lr, t], np.float64), beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=0.0,
                 l2=wd, lr_scale=scale)
        for a, a0 in zip((p, g, m, v), before):
            np.testing.assert_array_equal(a, a0)
        for o, w, name in zip(got, want, ("param", "exp_avg", "exp_avg_sq")):
            assert o.dtype == dtype and o.shape == shape
            np.testing.assert_allclose(o, w, rtol=tol, atol=tol, err_msg=f"{fn.__name__}: {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_adam_kernel_matches_its_array_code(dtype):
    """The CUDA kernel with Adam's L2 term and a group's lr scale against the array code it
    replaces, on the same CuPy arrays, with and without clipping."""
    import cupy

    from tilegraph.optim import _adamw_gpu, _adamw_xp

    rng = np.random.default_rng(2)
    p, g, m = (cupy.asarray(rng.standard_normal((33, 31)).astype(dtype)) for _ in range(3))
    v = cupy.asarray((rng.random((33, 31)) * 0.1).astype(dtype))
    for hyper in ([3e-3, 7.0], [3e-3, 7.0, 0.5, 4.0]):
        h = cupy.asarray(np.array(hyper, np.float64))
        kw = dict(beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.0, l2=0.1, lr_scale=0.25)
        for got, want in zip(_adamw_gpu(p, g, m, v, h, **kw), _adamw_xp(p, g, m, v, h, **kw)):
            tol = 1e-6 if dtype == np.float32 else 1e-13
            np.testing.assert_allclose(cupy.asnumpy(got), cupy.asnumpy(want), rtol=tol, atol=tol)


# -------------------------------------------------------------------------------------- SGD ----
@by_mode
@by_dtype
def test_sgd_nesterov_matches_torch(dtype, mode):
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    _against_torch(lambda p: tg.optim.SGD(p, **kw), lambda p: (torch.optim.SGD(p, **kw), None), dtype=dtype,
                   mode=mode)


@by_mode
@by_dtype
def test_sgd_dampening_matches_torch(dtype, mode):
    kw = dict(lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01)
    _against_torch(lambda p: tg.optim.SGD(p, **kw), lambda p: (torch.optim.SGD(p, **kw), None), dtype=dtype,
                   mode=mode)


def test_sgd_dampening_without_momentum_changes_nothing():
    """As torch's: no momentum buffer, so nothing to dampen (and no state)."""
    opt = _against_torch(lambda p: tg.optim.SGD(p, lr=0.1, dampening=0.5),
                         lambda p: (torch.optim.SGD(p, lr=0.1, dampening=0.5), None))
    assert opt.state_names == () and opt.state_cells == [[], []]


def _update_tasks(opt) -> list:
    """(kernel, op, parameters) of each parameter tile's update task: what its task key is made of
    (with its inputs)."""
    grads = [tg.from_numpy(np.ones(p.shape, p.dtype), p.chunks) for p in opt.params]
    nodes = {id(ref.node): ref.node for _, ref in opt.record(grads)[0]}
    return [(n.kernel.name, n.op, n.params) for n in nodes.values()]


def test_updates_without_the_new_settings_record_the_tasks_they_did_before():
    """dampening=0, nesterov=False and groups without an lr leave the update tasks' parameters as
    they were (the same task keys); AdamW's tasks keep theirs though it shares Adam's kernel code.
    Each task reads its parameter's update count at ``t_at`` of the hyper tile (the weight's: 4,
    the bias's: 5)."""
    w0, b0, _ = _data(np.float64, 1)
    model = _Lin(w0, b0, "ragged")
    at = [{"t_at": 4}] * 6 + [{"t_at": 5}] * 2  # 3 x 2 weight tiles, 2 bias tiles
    sgd = _update_tasks(tg.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    assert sgd == _update_tasks(tg.optim.SGD([{"params": model.parameters()}], lr=0.1, momentum=0.9, dampening=0.0,
                                             nesterov=False))
    assert sgd == [("sgd_momentum", "sgd", {"momentum": 0.9, "weight_decay": 0.0, **t}) for t in at]
    assert _update_tasks(tg.optim.AdamW(model.parameters(), weight_decay=0.1)) == [
        ("adamw", "adamw", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.1, **t}) for t in at]
    assert _update_tasks(tg.optim.Adam(_groups(model.parameters(), {"lr": 0.01}, {}), weight_decay=0.1)) == [
        ("adam", "adam", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "l2": 0.1,
                          "lr_scale": 10.0, **t}) for t in at[:6]] + [
        ("adam", "adam", {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0, "l2": 0.1, **t})
        for t in at[6:]]


# --------------------------------------------------------------------------- per-group lr ----
_SCHED = dict(base_lr=0.1, warmup=2, total=6, min_lr=0.01)
_KINDS = {  # (tilegraph optimizer, torch's, their shared settings)
    "Adam": (tg.optim.Adam, torch.optim.Adam, dict(weight_decay=0.05)),
    "AdamW": (tg.optim.AdamW, torch.optim.AdamW, dict(weight_decay=0.05)),
    "SGD": (tg.optim.SGD, torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01, nesterov=True)),
}


@by_mode
@by_dtype
@pytest.mark.parametrize("kind", list(_KINDS))
def test_a_groups_lr_follows_the_schedule_as_torchs_lambdalr(kind, dtype, mode):
    """The weight's group at lr 0.02, the bias's at the schedule's own rate (warmup over 2
    steps to 0.1, cosine to 0.01 at step 6, then 0.01: 8 steps cover all three) against torch's
    LambdaLR giving each group's initial lr the schedule's factor schedule(t) / 0.1. (LambdaLR's
    epoch e, from 0, is our update e + 1.)"""
    ours, theirs, kw = _KINDS[kind]
    sched = tg.optim.warmup_cosine(**_SCHED)

    def make_torch(p):
        opt = theirs(_groups(p, {"lr": 0.02}, {}), lr=_SCHED["base_lr"], **kw)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda e: sched(e + 1) / _SCHED["base_lr"])

    opt = _against_torch(lambda p: ours(_groups(p, {"lr": 0.02}, {}), lr=sched, **kw), make_torch, dtype=dtype,
                         mode=mode, steps=8)
    assert opt.base_lr == 0.1 and opt.lr_scales == pytest.approx([0.2, 1.0], rel=1e-15)


@pytest.mark.parametrize("kind", list(_KINDS))
def test_a_groups_lr_with_a_constant_rate_matches_torch(kind):
    """lr a number: each group at its own lr, as torch without a scheduler (the bias's group at
    a rate above the optimizer's)."""
    ours, theirs, kw = _KINDS[kind]
    opt = _against_torch(lambda p: ours(_groups(p, {"lr": 0.01}, {"lr": 0.08}), lr=0.04, **kw),
                         lambda p: (theirs(_groups(p, {"lr": 0.01}, {"lr": 0.08}), lr=0.04, **kw), None), mode="ragged")
    assert opt.lr_scales == pytest.approx([0.25, 2.0], rel=1e-15)


def test_setting_the_schedule_scales_every_group_alike():
    """A group's lr is a fixed multiple of the optimizer's rate: a new schedule (a lower one
    after a divergence, even a callable of your own) keeps the groups' ratios."""
    w0, b0, _ = _data(np.float64, 1)
    model = _Lin(w0, b0, "single")
    opt = tg.optim.AdamW(_groups(model.parameters(), {"lr": 0.02}, {}), lr=tg.optim.warmup_cosine(**_SCHED))
    opt.schedule = lambda step: 1e-3
    assert opt.lr_scales == pytest.approx([0.2, 1.0]) and opt.lr_at(3) == 1e-3


def test_a_state_dict_keeps_each_groups_lr():
    """state_dict records each parameter's settings and the base rate; loading into an
    optimizer whose groups run at other multiples of the schedule is refused, naming each."""
    w0, b0, batches = _data(np.float64, 2)
    model = _Lin(w0, b0, "ragged")
    opt = tg.optim.Adam(_groups(model.parameters(), {"lr": 0.02}, {}), lr=tg.optim.warmup_cosine(**_SCHED))
    step = tg.TrainStep(model, opt, _loss, batch_tiles=TILINGS["ragged"][2])
    for x, y in batches:
        step(x, y)
    state = opt.state_dict()
    assert state["param_options"] == [{"lr": 0.02}, {}] and state["base_lr"] == 0.1
    same = tg.optim.Adam(_groups(model.parameters(), {"lr": 0.2}, {}), lr=1.0)  # the same multiples
    same.load_state_dict(state)
    assert same.step_count == 2 and same.lr_scales == pytest.approx([0.2, 1.0]) and same.schedule(3) == opt.schedule(3)
    other = tg.optim.Adam(_groups(model.parameters(), {"lr": 0.02}, {}), lr=1.0)
    with pytest.raises(tg.TileError) as e:
        other.load_state_dict(state)
    assert e.value.where == "tilegraph.optim.Adam.load_state_dict"
    assert "relative to the schedule (group lr / base_lr) as saved" in e.value.what
    assert e.value.received == ("parameter 0 (weight): 0.02 times the schedule's rate here (lr 0.02 / base_lr 1.0), "
                                "0.2 saved (lr 0.02 / base_lr 0.1)")
    assert other.step_count == 0  # nothing changed
    plain = tg.optim.Adam(model.parameters())
    with pytest.raises(tg.TileError, match=r"parameter 0 \(weight\): 1 times the schedule's rate here \(no group lr\)"):
        plain.load_state_dict(state)


# ------------------------------------------------------------------------------ bad input ----
def _error(make) -> tg.TileError:
    with pytest.raises(tg.TileError) as e:
        make()
    return e.value


def _params():
    w0, b0, _ = _data(np.float64, 1)
    return _Lin(w0, b0, "single").parameters()


@pytest.mark.parametrize("make, where, what, received", [
    (lambda p: tg.optim.SGD(p, lr=0.1, nesterov=True), "tilegraph.optim.SGD",
     "nesterov=True needs a momentum > 0 and dampening=0 (as torch.optim.SGD)",
     "nesterov=True with momentum=0.0, dampening=0.0"),
    (lambda p: tg.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "tilegraph.optim.SGD",
     "nesterov=True needs a momentum > 0 and dampening=0 (as torch.optim.SGD)",
     "nesterov=True with momentum=0.9, dampening=0.1"),
    (lambda p: tg.optim.SGD(p, momentum=0.9, nesterov=1), "tilegraph.optim.SGD", "nesterov must be True or False",
     "nesterov=1"),
    (lambda p: tg.optim.SGD(p, momentum=0.9, dampening=1.5), "tilegraph.optim.SGD",
     "dampening must be a number >= 0 and <= 1", "dampening=1.5"),
    (lambda p: tg.optim.Adam(p, amsgrad=True), "tilegraph.optim.Adam",
     "amsgrad is not implemented (Adam here keeps torch's default, amsgrad=False)", "amsgrad=True"),
    (lambda p: tg.optim.Adam(p, maximize=True), "tilegraph.optim.Adam",
     "maximize is not implemented: let the loss function return the negated objective and minimise that",
     "maximize=True"),
    (lambda p: tg.optim.Adam(p, eps=0.0), "tilegraph.optim.Adam", "eps must be a finite number > 0", "eps=0.0"),
    (lambda p: tg.optim.Adam(_groups(p, {"lr": -0.1}, {})), "tilegraph.optim.Adam param_groups[0]",
     "lr must be a finite number >= 0", "lr=-0.1"),
    (lambda p: tg.optim.SGD(_groups(p, {}, {"lr": "0.1"})), "tilegraph.optim.SGD param_groups[1]",
     "lr must be a finite number >= 0", "lr='0.1'"),
    (lambda p: tg.optim.AdamW(_groups(p, {"lr": None}, {})), "tilegraph.optim.AdamW param_groups[0]",
     "lr must be a finite number >= 0", "lr=None"),
    (lambda p: tg.optim.AdamW(_groups(p, {"lr": math.inf}, {})), "tilegraph.optim.AdamW param_groups[0]",
     "lr must be a finite number >= 0", "lr=inf"),
    (lambda p: tg.optim.SGD(_groups(p, {"momentum": 0.5}, {})), "tilegraph.optim.SGD",
     "parameter groups may set lr, weight_decay only", "param_groups[0] sets momentum"),
    (lambda p: tg.optim.Adam(_groups(p, {"lr": 0.1}, {}), lr=0.0), "tilegraph.optim.Adam",
     "a parameter group's lr is a multiple of the optimizer's lr (its schedule's base_lr), which must then be > 0",
     "base_lr=0.0 with groups that set lr"),
], ids=["nesterov-without-momentum", "nesterov-with-dampening", "nesterov-not-bool", "dampening-above-1",
        "amsgrad", "maximize", "eps-0", "group-lr-negative", "group-lr-string", "group-lr-none", "group-lr-inf",
        "sgd-group-momentum", "group-lr-over-a-zero-base"])
def test_bad_arguments_are_named(make, where, what, received):
    e = _error(lambda: make(_params()))
    assert (e.where, e.what, e.received) == (where, what, received)
    assert str(e) == f"[{where}] {what}; received: {received}"


def test_a_groups_lr_under_a_schedule_of_your_own_is_refused():
    """A bare callable has no known base rate to scale a group's lr by: say what to pass."""
    e = _error(lambda: tg.optim.AdamW(_groups(_params(), {"lr": 0.01}, {}), lr=lambda step: 1e-3))
    assert e.where == "tilegraph.optim.AdamW"
    assert e.what.startswith("a parameter group's lr is scaled by the schedule relative to its base rate, which a "
                             "schedule of your own does not give: pass lr as a number or as "
                             "tg.optim.warmup_cosine(...) or tg.optim.constant(...)")
    assert e.received.startswith("lr=<function ") and e.received.endswith(" with groups that set lr")
    tg.optim.AdamW(_groups(_params(), {"weight_decay": 0.0}, {}), lr=lambda step: 1e-3)  # no group lr: as before


def test_adam_accepts_torchs_defaults_spelled_out():
    opt = tg.optim.Adam(_params(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False,
                        maximize=False)
    assert (opt.betas, opt.eps, opt.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)
    assert opt.state_names == ("exp_avg", "exp_avg_sq")


# ----------------------------------------------------------------------------- checkpoints ----
def _adam_run(path=None, steps=6, save_at=None, opt=None, model=None):
    """Adam with groups (the weight at lr 0.02 with L2 decay) under the warmup-cosine schedule,
    ``steps`` steps on ragged tiles; saved after ``save_at`` of them at ``path``."""
    w0, b0, batches = _data(np.float64, 6)
    model = model or _Lin(w0, b0, "ragged")
    opt = opt or tg.optim.Adam(_groups(model.parameters(), {"lr": 0.02, "weight_decay": 0.1}, {}),
                               lr=tg.optim.warmup_cosine(**_SCHED), clip_grad_norm=1.0)
    step = tg.TrainStep(model, opt, _loss, batch_tiles=TILINGS["ragged"][2])
    for i in range(opt.step_count, steps):
        step(*batches[i])
        if save_at == i + 1:
            tg.io.save_checkpoint(path, model, opt, step=i + 1)
    return model, opt


def test_an_adam_checkpoint_resumes_exactly(tmp_path):
    straight, _ = _adam_run()
    _adam_run(tmp_path / "ck", steps=3, save_at=3)
    ck = tg.io.load_checkpoint(tmp_path / "ck")
    info = ck.optimizer_info
    assert info["type"] == "Adam" and info["state_names"] == ["exp_avg", "exp_avg_sq"]
    assert info["hyper"]["param_options"] == [{"lr": 0.02, "weight_decay": 0.1}, {}]  # each group's lr recorded
    w0, b0, _ = _data(np.float64, 1)
    model = _Lin(np.zeros_like(w0), np.zeros_like(b0), "ragged")
    # made as the saved run's optimizer was, but for the schedule: the checkpoint's wins (with the
    # same base rate, each group's multiple is the same number, to the bit)
    opt = tg.optim.Adam(_groups(model.parameters(), {"lr": 0.02, "weight_decay": 0.1}, {}), lr=0.1, clip_grad_norm=1.0)
    ck.restore(model, opt)
    assert opt.step_count == 3 and opt.schedule.spec == tg.optim.warmup_cosine(**_SCHED).spec
    _adam_run(model=model, opt=opt)
    for name, value in straight.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[name], value, err_msg=name)


def test_a_checkpoint_restores_into_its_own_kind_of_optimizer_only(tmp_path):
    _adam_run(tmp_path / "adam", steps=1, save_at=1)
    w0, b0, _ = _data(np.float64, 1)
    model = _Lin(w0, b0, "ragged")
    adamw = tg.io.save_checkpoint(tmp_path / "adamw", model, tg.optim.AdamW(model.parameters()), step=0)
    cases = [("adam", tg.optim.AdamW(model.parameters()), "AdamW", "Adam"),
             ("adam", tg.optim.SGD(model.parameters(), momentum=0.9), "SGD", "Adam"),
             (adamw, tg.optim.Adam(model.parameters()), "Adam", "AdamW")]
    for path, opt, mine, theirs in cases:
        with pytest.raises(tg.io.CheckpointError) as e:
            tg.io.load_checkpoint(tmp_path / path).restore_optimizer(opt, model)
        # (session 39: "optimizer state of a AdamW; received: state of a Adam", without what to do)
        assert e.value.what.startswith(f"an optimizer of the kind whose state the checkpoint holds, {theirs}: make "
                                       f"a tg.optim.{theirs} with the run's settings")
        assert e.value.received == f"the state of an {theirs} for an {mine}"
        assert opt.step_count == 0


def test_a_checkpoint_refuses_an_optimizer_whose_groups_run_at_other_rates(tmp_path):
    """Restoring a checkpoint's schedule into an optimizer made with other group lrs drove the
    groups at other rates than the saved run's, without a word; the groups are matched by name."""
    _adam_run(tmp_path / "ck", steps=2, save_at=2)
    ck = tg.io.load_checkpoint(tmp_path / "ck")
    assert ck.optimizer_info["hyper"]["param_names"] == ["weight", "bias"] and ck.optimizer_info["hyper"]["base_lr"] == 0.1
    w0, b0, _ = _data(np.float64, 1)
    model = _Lin(np.zeros_like(w0), np.zeros_like(b0), "ragged")
    other = tg.optim.Adam(_groups(model.parameters(), {"lr": 0.05, "weight_decay": 0.1}, {}), lr=0.1,
                          clip_grad_norm=1.0)
    with pytest.raises(tg.io.CheckpointError) as e:
        ck.restore(model, other)
    assert "the parameter groups' learning rates relative to the schedule (group lr / base_lr) as saved" in e.value.what
    assert e.value.received.startswith("parameter 0 (weight): 0.5 times the schedule's rate here (lr 0.05 / base_lr 0.1), "
                                       "0.2 saved (lr 0.02 / base_lr 0.1)"), e.value.received
    assert other.step_count == 0 and not model.state_dict()["weight"].any()  # nothing changed
    ck.restore(model, other, schedule=False)  # keeping this optimizer's own schedule: its rates are its own
    assert other.step_count == 2
