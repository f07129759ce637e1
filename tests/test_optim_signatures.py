"""tg.optim.SGD, Adam and AdamW take torch.optim's positional parameters in torch's order with
torch's defaults, so a ported call means the same thing: the same positional calls made of both
train to the same parameters and state over a few steps. torch's arguments that are not
implemented are accepted at torch's default and refused otherwise, naming them; tilegraph's own
extras (clip_grad_norm) are keyword-only."""

import inspect

import numpy as np
import pytest

import tilegraph as tg

torch = pytest.importorskip("torch")

KINDS = {"SGD": (tg.optim.SGD, torch.optim.SGD), "Adam": (tg.optim.Adam, torch.optim.Adam),
         "AdamW": (tg.optim.AdamW, torch.optim.AdamW)}


class _Lin(tg.nn.Module):
    def __init__(self, w0, b0):
        self.weight = tg.nn.Parameter(w0, (3, 3), name="weight")  # ragged tiles: 7 = 3 + 3 + 1, 5 = 3 + 2
        self.bias = tg.nn.Parameter(b0, (3,), name="bias")

    def forward(self, x):
        return tg.matmul(x, self.weight, bias=self.bias)


def _loss(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _against_torch(kind: str, args: tuple, steps: int = 4):
    """``steps`` updates of tilegraph's and torch's ``kind`` made with the same positional
    ``args`` (after the parameters): parameters and optimizer state compared (float64)."""
    ours, theirs = KINDS[kind]
    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((7, 5)), rng.standard_normal(5)
    batches = [(rng.standard_normal((11, 7)), rng.standard_normal((11, 5))) for _ in range(steps)]
    model = _Lin(w0, b0)
    opt = ours([model.weight, model.bias], *args)
    step = tg.TrainStep(model, opt, _loss, batch_tiles=[(4, 3), (4, 3)])
    tw, tb = (torch.tensor(a, requires_grad=True) for a in (w0, b0))
    topt = theirs([tw, tb], *args)
    for x, y in batches:
        step(x, y)
        topt.zero_grad()
        ((torch.tensor(x) @ tw + tb - torch.tensor(y)) ** 2).mean().backward()
        topt.step()
    state = model.state_dict()
    np.testing.assert_allclose(state["weight"], tw.detach().numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(state["bias"], tb.detach().numpy(), rtol=1e-10, atol=1e-10)
    for mine, t in zip(opt.state_dict()["state"], (tw, tb)):
        assert set(mine) == {k for k in topt.state[t] if k != "step"}
        for name, value in mine.items():
            np.testing.assert_allclose(value, topt.state[t][name].numpy(), rtol=1e-10, atol=1e-10, err_msg=name)
    return opt, topt


# ------------------------------------------------------------------------- positional calls ----
@pytest.mark.parametrize("args", [(0.1, 0.9, 0.5), (0.1, 0.9, 0.5, 0.01), (0.1, 0.9, 0.0, 0.01, True)],
                         ids=["lr-momentum-dampening", "and-weight_decay", "and-nesterov"])
def test_sgd_positional_arguments_mean_torchs(args):
    """SGD(p, 0.1, 0.9, 0.5): dampening 0.5 as torch's (it set weight_decay=0.5 before)."""
    opt, topt = _against_torch("SGD", args)
    group = topt.param_groups[0]
    assert (opt.momentum, opt.dampening, opt.weight_decay, opt.nesterov) == tuple(
        group[k] for k in ("momentum", "dampening", "weight_decay", "nesterov"))


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_adam_positional_arguments_mean_torchs(kind):
    opt, topt = _against_torch(kind, (0.05, (0.8, 0.95), 1e-6, 0.1, False))
    group = topt.param_groups[0]
    assert (opt.betas, opt.eps, opt.weight_decay) == (group["betas"], group["eps"], group["weight_decay"])


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_defaults_are_torchs(kind):
    """SGD's default lr is torch's 0.001 (it was 0.01): the defaults train alike."""
    opt, topt = _against_torch(kind, ())
    assert opt.lr == topt.param_groups[0]["lr"] == 1e-3


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_signature_is_torchs_then_keyword_only_extras(kind):
    """torch's parameters by name, kind (positional or keyword-only) and default, in torch's
    order; tilegraph's own (clip_grad_norm) keyword-only, after them."""
    ours, theirs = (inspect.signature(c).parameters for c in KINDS[kind])
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    assert [(n, p.default) for n, p in ours.items() if p.kind is positional] == [
        (n, p.default) for n, p in theirs.items() if p.kind is positional]
    for name in _DEFAULTS[kind]:  # torch 2.x's keyword-only ones (a later torch may add more)
        if theirs[name].kind is inspect.Parameter.KEYWORD_ONLY:
            assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY and ours[name].default == theirs[name].default
    extras = [n for n in ours if n not in theirs]
    assert extras == ["clip_grad_norm"]
    assert ours["clip_grad_norm"].kind is inspect.Parameter.KEYWORD_ONLY


def _params():
    return _Lin(np.zeros((7, 5)), np.zeros(5)).parameters()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_positional_extra_is_refused_as_torchs(kind):
    """Past torch's positional parameters there are none (clip_grad_norm was AdamW's 6th and
    SGD's 5th, where torch's are amsgrad and nesterov)."""
    signature = inspect.signature(KINDS[kind][0]).parameters.values()
    n = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in signature)
    with pytest.raises(TypeError):
        KINDS[kind][0](_params(), *[None] * n)


# ----------------------------------------------------------------- torch's unimplemented ones ----
_DEFAULTS = {  # torch's arguments tilegraph does not implement, at torch's defaults
    "SGD": dict(maximize=False, foreach=None, differentiable=False, fused=None),
    "Adam": dict(amsgrad=False, foreach=None, maximize=False, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay=False),
    "AdamW": dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False, fused=None),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_torchs_unimplemented_arguments_are_accepted_at_their_defaults(kind):
    KINDS[kind][0](_params(), **_DEFAULTS[kind])
    KINDS[kind][0](_params(), foreach=False, fused=False)  # torch's explicit "not that implementation"


@pytest.mark.parametrize("kind", list(KINDS))
def test_how_torch_computes_the_update_is_taken_and_changes_nothing(kind):
    """foreach, fused (and capturable) choose torch's implementation of the same update; here
    it is one fused kernel per parameter tile whatever they say: the steps are the same."""
    cls = KINDS[kind][0]
    extra = dict(foreach=True, fused=True, **({"capturable": True} if kind != "SGD" else {}))
    results = []
    for options in ({}, extra):
        model = _Lin(np.full((7, 5), 0.5), np.zeros(5))
        opt = cls(model.parameters(), lr=0.1, **options)
        step = tg.TrainStep(model, opt, lambda m, x: (m(x) * m(x)).mean(), batch_tiles=[(3, 3)])
        results.append([step(np.ones((3, 7))) for _ in range(3)])
    assert results[0] == results[1]


@pytest.mark.parametrize("kind, name, value, what", [
    ("SGD", "maximize", True, "maximize is not implemented"),
    ("SGD", "differentiable", True, "differentiable=True (autograd through the update) is not implemented"),
    ("Adam", "amsgrad", True, "amsgrad is not implemented (Adam here keeps torch's default, amsgrad=False)"),
    ("Adam", "decoupled_weight_decay", True, "decoupled_weight_decay=True is not implemented on Adam: use "
     "tg.optim.AdamW"),
    ("AdamW", "amsgrad", True, "amsgrad is not implemented (AdamW here keeps torch's default, amsgrad=False)"),
    ("AdamW", "maximize", True, "maximize is not implemented"),
])
def test_torchs_unimplemented_arguments_are_refused_otherwise(kind, name, value, what):
    with pytest.raises(tg.TileError) as e:
        KINDS[kind][0](_params(), **{name: value})
    assert e.value.where == f"tilegraph.optim.{kind}"
    assert e.value.what.startswith(what)
    assert e.value.received == f"{name}={value!r}"


def test_adamws_sixth_positional_is_amsgrad():
    """torch.optim.AdamW(p, 1e-3, (0.9, 0.999), 1e-8, 0.01, True) asks for amsgrad: refused by
    that name (it was taken as clip_grad_norm=True)."""
    with pytest.raises(tg.TileError, match=r"amsgrad is not implemented.*received: amsgrad=True$"):
        tg.optim.AdamW(_params(), 1e-3, (0.9, 0.999), 1e-8, 0.01, True)


def test_clip_grad_norm_by_keyword_still_clips():
    for kind in KINDS:
        assert KINDS[kind][0](_params(), clip_grad_norm=1.0).clip_grad_norm == 1.0
