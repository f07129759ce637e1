"""A PyTorch user writing models with tilegraph's torch-like names: what such a user ported and
found missing or wrong. Each torch-named feature is checked against torch (forward and
gradients, over single, even and ragged tilings, as tests/test_torch_names.py does)."""

import numpy as np
import pytest

import tilegraph as tg
from conftest import by_dtype, by_mode, check_against_torch, randn

torch = pytest.importorskip("torch")
F = torch.nn.functional


# ------------------------------------------------------------ cross_entropy(label_smoothing=) ----
@by_mode
@by_dtype
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.1, 0.7, 1.0])
def test_cross_entropy_label_smoothing_as_torch(rng, mode, dtype, reduction, eps):
    x = randn(rng, 3, 5, 11, dtype=dtype)
    t = rng.integers(0, 11, (3, 5))
    t[0, 1] = t[2, 4] = -100  # ignored rows count for nothing, smoothed or not
    shape = (3, 5) if reduction == "none" else ()
    check_against_torch(lambda x, t: tg.cross_entropy(x, t, reduction=reduction, label_smoothing=eps),
                        lambda x, t: F.cross_entropy(x.reshape(-1, 11), t.reshape(-1), reduction=reduction,
                                                     label_smoothing=eps).reshape(shape), [x, t], "btv,bt", mode)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.1", True, None])
def test_cross_entropy_label_smoothing_is_checked(bad):
    x = tg.from_numpy(np.zeros((2, 4)))
    t = tg.from_numpy(np.array([1, 3]))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.cross_entropy\] label_smoothing must be a number in "
                                           r"\[0, 1\]"):
        tg.cross_entropy(x, t, label_smoothing=bad)


# ------------------------------------------------------------------- dropout(training=...) ----
def test_dropout_takes_torchs_training_argument():
    a = np.ones((6, 8))
    x = tg.from_numpy(a, (4, 3))
    assert tg.dropout(x, 0.5, training=False) is x
    assert tg.dropout(x, 0.5, False) is x  # torch's order: (input, p, training, inplace)
    y = tg.dropout(x, 0.5, True, seed=3).numpy()
    np.testing.assert_array_equal(y, tg.dropout(x, 0.5, seed=3).numpy())
    assert set(np.unique(y)) <= {0.0, 2.0} and 0 < (y == 0).sum() < y.size
    assert np.unique(tg.dropout(x, training=True).numpy()).tolist() == [0.0, 2.0]  # p=0.5 as torch's default
    # and its gradient is the mask's, as torch's
    (g,) = tg.grad((tg.dropout(x, 0.5, True, seed=3) * 3.0).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), 3.0 * y)
    (g,) = tg.grad((tg.dropout(x, 0.5, False) * 3.0).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), np.full_like(a, 3.0))


def test_dropout_training_and_inplace_are_checked():
    x = tg.from_numpy(np.ones((2, 3)))
    with pytest.raises(tg.TileError, match=r"training must be a bool \(torch's third argument; pass an int seed "
                                           r"by name: seed=\.\.\.\); received: 7"):
        tg.dropout(x, 0.5, 7)
    with pytest.raises(tg.TileError, match=r"inplace=True is not supported"):
        tg.dropout(x, 0.5, True, True)


# ---------------------------------------------------------------- Embedding(padding_idx=...) ----
@by_mode
@by_dtype
@pytest.mark.parametrize("pad", [0, 4, -1])
def test_embedding_padding_idx_row_gets_no_gradient(rng, mode, dtype, pad):
    w = randn(rng, 7, 6, dtype=dtype)
    ids = rng.integers(0, 7, (3, 8))
    ids[0, :3] = [0, 4, 6]  # each padding row is looked up
    check_against_torch(lambda i, w: tg.embedding(i, w, padding_idx=pad),
                        lambda i, w: F.embedding(i, w, padding_idx=pad), [ids, w], "bt,vc", mode)


def test_embedding_module_padding_idx_as_torch(rng):
    emb = tg.nn.Embedding(7, 6, padding_idx=-2, tile=4, vocab_tile=3, dtype=np.float64, seed=0)
    assert emb.padding_idx == 5
    w = emb.weight.numpy()
    np.testing.assert_array_equal(w[5], 0.0)  # starts as zeros, as torch's
    assert np.all(w[np.arange(7) != 5] != 0)
    ref = torch.nn.Embedding(7, 6, padding_idx=-2, dtype=torch.float64)
    ref.weight.data = torch.tensor(w)
    ids = np.array([[5, 1, 5], [0, 6, 2]])
    out = emb(tg.from_numpy(ids))
    (g,) = tg.grad((out * out).sum(), [emb.weight])
    r = ref(torch.tensor(ids))
    (r * r).sum().backward()
    np.testing.assert_allclose(out.numpy(), r.detach().numpy())
    np.testing.assert_allclose(g.numpy(), ref.weight.grad.numpy())
    with tg.nn.deferred_init():
        assert tg.nn.Embedding(7, 6, padding_idx=0).padding_idx == 0


@pytest.mark.parametrize("bad", [7, -8, 1.0, "0", True])
def test_embedding_padding_idx_is_checked(bad):
    with pytest.raises(tg.TileError, match=r"\[tilegraph.nn.Embedding\] padding_idx must be None or an int in "
                                           r"\[-7, 7\)"):
        tg.nn.Embedding(7, 2, padding_idx=bad)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.embedding\] padding_idx"):
        tg.embedding(tg.from_numpy(np.array([1])), tg.from_numpy(np.zeros((7, 2))), padding_idx=bad)


# ------------------------------------------------------------------------------- x ** 2 ----
@by_mode
@by_dtype
@pytest.mark.parametrize("exponent", [2, 3, 0.5, -1.5, 0, 1, 2.0, np.float32(1.5)], ids=str)
def test_power_with_a_number_exponent_as_torch(rng, mode, dtype, exponent):
    x = np.abs(randn(rng, 5, 7, dtype=dtype)) + 0.5  # positive: fractional powers are real
    check_against_torch(lambda x: x ** exponent, lambda x: x ** exponent, [x], "ab", mode)
    check_against_torch(lambda x: tg.pow(x, exponent), lambda x: torch.pow(x, exponent), [x], "ab", mode)


@by_mode
def test_power_of_negative_values_and_zero(rng, mode):
    x = randn(rng, 4, 6)
    x[0, :2] = 0.0
    for e in (2, 3, 0, 1):
        check_against_torch(lambda x: x.pow(e) * 1.0, lambda x: x.pow(e) * 1.0, [x], "ab", mode)


def test_power_dtypes_follow_numpy_and_errors_are_named():
    ids = tg.from_numpy(np.arange(5))
    assert (ids ** 2).dtype == np.int64 and (ids ** 2).numpy().tolist() == [0, 1, 4, 9, 16]
    assert (ids ** 0.5).dtype == np.float64
    np.testing.assert_allclose((ids ** 0.5).numpy(), np.sqrt(np.arange(5)))
    assert (tg.from_numpy(np.ones(3, np.float32)) ** 2).dtype == np.float32
    x = tg.from_numpy(np.ones(3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.pow\] an integer tensor to a negative integer power"):
        ids ** -1
    with pytest.raises(tg.TileError, match=r"\[tilegraph.pow\] the exponent must be a real number"):
        x ** x
    with pytest.raises(tg.TileError, match=r"\[tilegraph.pow\] the exponent must be a real number"):
        x ** True
    np.testing.assert_allclose((2 ** x).numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(tg.TileError, match=r"\[tilegraph.pow\] the base must be a number tensor"):
        tg.from_numpy(np.ones(3, bool)) ** 2


# ------------------------------------------------------------------------ axis= beside dim= ----
@by_mode
@pytest.mark.parametrize("name", ["sum", "mean"])
@pytest.mark.parametrize("axis", [0, -1, (0, 2), None], ids=str)
def test_reductions_take_numpys_axis_alias(rng, mode, name, axis):
    x = randn(rng, 5, 7, 6)
    ref = (lambda x: getattr(torch, name)(x, axis=axis, keepdim=True)) if axis is not None else (
        lambda x: getattr(torch, name)(x, (0, 1, 2), keepdim=True))
    check_against_torch(lambda x: getattr(tg, name)(x, axis=axis, keepdims=True), ref, [x], "abc", mode)
    check_against_torch(lambda x: getattr(x, name)(axis=axis, keepdim=True), ref, [x], "abc", mode)


def test_dim_and_axis_together_is_an_error():
    t = tg.from_numpy(np.ones((2, 3)))
    for fn, where in ((tg.sum, "sum"), (tg.mean, "mean"), (tg.TileTensor.sum, "sum"), (tg.TileTensor.mean, "mean")):
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.{where}\] pass dim= or axis= \(the same parameter\), "
                                               r"not both; received: dim=0, axis=1"):
            fn(t, 0, axis=1)
        with pytest.raises(tg.TileError, match=r"pass dim= or axis="):
            fn(t, None, axis=1)  # an explicit None (all dims) conflicts too


# ---------------------------------------------------------------- model.train() / eval() ----
class _Net(tg.nn.Module):
    """A torch-style module whose forward reads self.training."""

    def __init__(self):
        self.fc = tg.nn.Linear(8, 8, tile=4, dtype=np.float64, seed=0)
        self.blocks = [tg.nn.Linear(8, 8, tile=4, dtype=np.float64, seed=1)]

    def forward(self, x):
        return tg.dropout(self.blocks[0](self.fc(x)), 0.5, training=self.training, seed=1)


def test_train_and_eval_set_the_mode_dropout_reads_and_return_the_module():
    net = _Net()
    x = tg.from_numpy(np.ones((4, 8)), (2, 4))
    # by default False; inside a step's recording (TrainStep records under tg.nn.training()) True
    assert net.training is False and net.fc.training is False
    with tg.nn.training():
        assert net.training is True and net.blocks[0].training is True
    plain = net(x).numpy()
    assert net.eval() is net
    assert not net.training and not net.fc.training and not net.blocks[0].training
    with tg.nn.training():  # a step decides its mode, as a torch loop calls model.train() itself
        assert net.blocks[0].training
    with tg.nn.training(False):
        np.testing.assert_array_equal(net(x).numpy(), plain)
    assert net.train() is net
    assert net.training and net.fc.training and net.blocks[0].training
    dropped = net(x).numpy()
    assert (dropped == 0).any() and np.allclose(dropped[dropped != 0], 2 * plain[dropped != 0])
    assert net.train(False).training is False
    assert net.train(None).training is False  # cleared: False outside a step
    assert list(net.state_dict()) == ["fc.weight", "fc.bias", "blocks.0.weight", "blocks.0.bias"]
    assert [type(m).__name__ for m in net.modules()] == ["_Net", "Linear", "Linear"]


def test_steps_decide_the_mode_whatever_train_or_eval_set():
    """A validation loss after model.train() had dropout in it (EvalStep recorded in the module's
    mode), and generate too: TrainStep records in training mode, EvalStep and generate in eval
    mode, whatever model.train() / model.eval() set, as a torch training loop calls them itself."""
    net = _Net()
    x = np.ones((4, 8))
    y = np.zeros((4, 8))

    def loss_fn(m, a, b):
        d = m(a) - b
        return (d * d).mean()

    def eval_loss():
        return float(tg.EvalStep(net, loss_fn, batch_tiles=[(2, 4), (2, 4)])(x, y))

    plain = eval_loss()
    assert net.train() is net and eval_loss() == plain        # no dropout in an evaluation
    net.eval()
    # a training step has dropout after model.eval() too (the gradient of a dropped-out forward)
    opt = tg.optim.SGD(net.parameters(), lr=0.0)
    step = tg.TrainStep(net, opt, loss_fn, batch_tiles=[(2, 4), (2, 4)])
    assert float(step(x, y)) != plain


def test_train_mode_is_checked():
    with pytest.raises(tg.TileError, match=r"\[MLP.train\] the training mode must be a bool"):
        tg.nn.MLP(4, 8).train("no")


# ------------------------------------------------------ loss.backward(), p.grad, zero_grad() ----
def test_loss_backward_accumulates_grad_on_parameters_as_torch(rng):
    """loss.backward() was an AttributeError: it now adds d loss / d p to every trainable p.grad."""
    m = tg.nn.MLP(4, 6, tile=2, dtype=np.float64, seed=0)
    m.fc2.bias.requires_grad = False
    x = randn(rng, 3, 4)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.GELU(), torch.nn.Linear(6, 4)).double()
    state = m.state_dict()
    with torch.no_grad():
        for i, lin in ((0, "fc1"), (2, "fc2")):
            ref[i].weight.copy_(torch.tensor(state[f"{lin}.weight"].T))
            ref[i].bias.copy_(torch.tensor(state[f"{lin}.bias"]))
    assert all(p.grad is None for p in m.parameters())
    loss = (m(tg.from_numpy(x, (2, 2))) ** 2).mean()
    loss.backward()
    (ref(torch.tensor(x)) ** 2).mean().backward()
    np.testing.assert_allclose(m.fc1.weight.grad.numpy(), ref[0].weight.grad.numpy().T, rtol=1e-10)
    np.testing.assert_allclose(m.fc2.weight.grad.numpy(), ref[2].weight.grad.numpy().T, rtol=1e-10)
    assert m.fc2.bias.grad is None  # requires_grad=False: none
    loss.backward()  # a second backward adds, as torch's
    np.testing.assert_allclose(m.fc1.bias.grad.numpy(), 2 * ref[0].bias.grad.numpy(), rtol=1e-10)
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())


def test_backward_errors_say_what_to_do():
    x = tg.from_numpy(np.ones((2, 3)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.backward\] nothing to differentiate: it depends "
                                           r"on no Parameter with requires_grad=True; for other tensors use "
                                           r"tg.grad\(loss, \[x\]\)"):
        (x * 2).sum().backward()
    lin = tg.nn.Linear(3, 2, dtype=np.float64)
    with tg.no_grad():
        loss = lin(x).sum()
    with pytest.raises(tg.TileError, match=r"nothing to differentiate: it has no recorded history"):
        loss.backward()
    with pytest.raises(tg.TileError, match=r"loss must be a scalar"):
        lin(x).backward()
    with pytest.raises(tg.TileError, match=r"the gradient must be None or a TileTensor of the parameter's shape"):
        lin.weight.grad = np.zeros((3, 2))


# ------------------------------------------------------------- torch's Tensor methods ----
def test_item_dim_numel_detach_and_method_forms(rng):
    a = randn(rng, 3, 4)
    x = tg.from_numpy(a, (2, 2))
    assert x.sum().item() == pytest.approx(a.sum()) and isinstance(x.sum().item(), float)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.TileTensor.item\] only a tensor of one element"):
        x.item()
    assert x.dim() == 2 and x.numel() == 12
    # detach: the same values, no gradient through it (as torch's)
    w = tg.nn.Linear(4, 4, tile=2, dtype=np.float64, seed=0).weight
    (g,) = tg.grad((x @ w * (x @ w).detach()).sum(), [w])
    np.testing.assert_allclose(g.numpy(), a.T @ (a @ w.numpy()), rtol=1e-12)
    np.testing.assert_array_equal(x.detach().numpy(), a)
    np.testing.assert_allclose((x * x).sqrt().numpy(), np.abs(a), rtol=1e-12)
    np.testing.assert_array_equal(x.relu().numpy(), tg.relu(x).numpy())
    np.testing.assert_array_equal(x.softmax(-1).numpy(), tg.softmax(x, -1).numpy())
    np.testing.assert_array_equal(x.log_softmax(0).numpy(), tg.log_softmax(x, 0).numpy())
