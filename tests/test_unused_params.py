"""A model with a layer its loss does not use trains as torch's: that layer's parameters get no
update (no weight decay, no change of the optimizer's state), with one warning naming them. Before,
TrainStep refused the model with grad's "inputs[2] does not affect the loss (pass
allow_unused=True)", an argument TrainStep does not have, naming the parameter 'weight' alone."""

import numpy as np
import pytest

import tilegraph as tg


class _TwoHeads(tg.nn.Module):
    def __init__(self, dtype=np.float64):
        self.body = tg.nn.Linear(6, 8, tile=4, seed=0, dtype=dtype)
        self.head = tg.nn.Linear(8, 3, tile=4, seed=1, dtype=dtype)
        self.unused_head = tg.nn.Linear(8, 5, tile=4, seed=2, dtype=dtype)

    def forward(self, x):
        return self.head(tg.relu(self.body(x)))


def _loss(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((8, 6)), rng.standard_normal((8, 3))


def _run(steps=3, runtime=None, accum_steps=1, **options):
    model = _TwoHeads()
    opt = tg.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    step = tg.TrainStep(model, opt, _loss, batch_tiles=[(4, 4), (4, None)], runtime=runtime,
                        accum_steps=accum_steps, **options)
    with pytest.warns(UserWarning, match=r"unused_head\.weight, unused_head\.bias do not affect the loss: not "
                                         r"updated \(no weight decay, no change of the optimizer's state\), as "
                                         r"torch's optimizers skip a parameter without a gradient"):
        losses = [step(*_data(i)) for i in range(steps)]
    with (runtime.as_current() if runtime else __import__("contextlib").nullcontext()):
        return losses, model.state_dict()


def _torch_run(steps=3):
    torch = pytest.importorskip("torch")
    model = _TwoHeads()
    params = {n: torch.tensor(v, requires_grad=True) for n, v in model.state_dict().items()}
    opt = torch.optim.AdamW(list(params.values()), lr=0.05, weight_decay=0.1)
    losses = []
    for i in range(steps):
        x, y = (torch.tensor(a) for a in _data(i))
        h = torch.relu(x @ params["body.weight"] + params["body.bias"])
        loss = ((h @ params["head.weight"] + params["head.bias"] - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in params.items()}


def _check(got, want):
    np.testing.assert_allclose(got[0], want[0], rtol=1e-10)
    for name, v in want[1].items():
        np.testing.assert_allclose(got[1][name], v, rtol=1e-10, atol=1e-12, err_msg=name)


def test_an_unused_layer_is_left_as_torch_leaves_it():
    got, want = _run(), _torch_run()
    _check(got, want)
    np.testing.assert_array_equal(got[1]["unused_head.weight"], _TwoHeads().state_dict()["unused_head.weight"])


def test_with_accumulation_too():
    _check(_run(accum_steps=2), _torch_run())


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["data", "sharded"])
def test_on_two_workers(embedded_runtime, parallel):
    _check(_run(runtime=embedded_runtime, parallel=parallel), _torch_run())


def test_a_loss_that_depends_on_no_trained_parameter_is_refused():
    model = _TwoHeads()
    opt = tg.optim.AdamW(model.parameters())
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.from_numpy(np.array(1.0)), batch_tiles=[(4, 4), (4, None)])
    with pytest.raises(tg.TileError, match=r"a loss that depends on the parameters the optimizer trains.*received: "
                                           r"no parameter affects the loss: body\.weight, body\.bias, head\.weight"):
        step(*_data())
