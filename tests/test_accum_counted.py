"""Gradient accumulation of a cross-entropy mean with ignored targets: k micro-batches give the
loss and gradient of one batch's mean over all its counted rows, as torch's one large batch does.

Each micro-batch's own mean weighted 1/k (what accumulation did before) is not that mean when the
micro-batches count different rows, and a micro-batch whose rows were all ignored made the step's
loss nan (a FloatingPointError) though its gradient was fine."""

import numpy as np
import pytest

import tilegraph as tg

IGNORE = -100


def _batch(seed=0, n=32, classes=8, ignored=(0.1, 0.6, 1.0, 0.0)):
    """Inputs and targets whose micro-batches (of n / len(ignored) rows) ignore the given shares."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    part = n // len(ignored)
    for j, share in enumerate(ignored):
        rows = np.arange(j * part, (j + 1) * part)
        y[rows[rng.permutation(part)[:round(share * part)]]] = IGNORE
    return x, y


def _ce(m, x, y):
    return tg.cross_entropy(m(x), y, ignore_index=IGNORE)


def _run(k, batches, runtime=None, loss_fn=_ce, dtype=np.float32, **options):
    model = tg.nn.MLP(16, 32, out_dim=8, tile=8, seed=3, dtype=dtype)
    batches = [(x.astype(dtype), y) for x, y in batches]
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, clip_grad_norm=1.0)
    step = tg.TrainStep(model, opt, loss_fn, batch_tiles=[(8, 8), (8,)], accum_steps=k, runtime=runtime, **options)
    losses = [step(x, y) for x, y in batches]
    with (runtime.as_current() if runtime else __import__("contextlib").nullcontext()):
        return losses, model.state_dict()


def _torch_run(batches):
    """The same model and steps in torch, one large batch per step (float64)."""
    torch = pytest.importorskip("torch")
    model = tg.nn.MLP(16, 32, out_dim=8, tile=8, seed=3, dtype=np.float64)
    names = [n for n, _ in model.named_parameters()]
    params = {n: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for n, v in model.state_dict().items()}
    opt = torch.optim.AdamW([params[n] for n in names], lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches:
        h = torch.tensor(x, dtype=torch.float64)
        h = torch.nn.functional.gelu(h @ params["fc1.weight"] + params["fc1.bias"], approximate="none")
        logits = h @ params["fc2.weight"] + params["fc2.bias"]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(y), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([params[n] for n in names], 1.0)
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().numpy() for n, p in params.items()}


def _check(got, want, rtol=1e-5, atol=1e-6):
    (got_losses, got_state), (want_losses, want_state) = got, want
    np.testing.assert_allclose(got_losses, want_losses, rtol=rtol)
    for name, v in want_state.items():
        np.testing.assert_allclose(got_state[name], v, rtol=rtol, atol=atol, err_msg=name)


def test_the_model_matches_torch_one_large_batch():
    batches = [_batch(s) for s in range(3)]
    _check(_run(1, batches, dtype=np.float64), _torch_run(batches), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k", [2, 4])
def test_micro_batches_counting_different_rows_give_one_batch_mean(k):
    batches = [_batch(s) for s in range(3)]
    want = _run(1, batches)
    got = _run(k, batches)
    _check(got, want)
    # the mean of the micro-batches' own means is another number (what accumulation gave before)
    model = tg.nn.MLP(16, 32, out_dim=8, tile=8, seed=3)
    x, y = batches[0]
    rows = len(y) // k
    means = [float(_ce(model, tg.from_numpy(x[j * rows:(j + 1) * rows], tiles=(8, 8)),
                       tg.from_numpy(y[j * rows:(j + 1) * rows], tiles=8)).numpy()) for j in range(k)]
    assert np.isnan(means).any() or abs(np.mean(means) - want[0][0]) > 1e-3


def test_a_micro_batch_with_every_target_ignored_adds_nothing():
    """Its own mean is nan; the step's loss and update are those of the other rows."""
    batches = [_batch(s, ignored=(0.0, 1.0)) for s in range(3)]
    got = _run(2, batches)
    assert np.isfinite(got[0]).all()
    _check(got, _run(1, batches))


def test_every_target_ignored_is_a_nan_loss_as_torch():
    x, y = _batch(0)
    y[:] = IGNORE
    with pytest.raises(FloatingPointError, match=r"loss became nan at step 1"):
        _run(2, [(x, y)])


def test_float16_parameters_accumulate_in_range():
    """The accumulator holds each micro-batch's gradient times its counted share of its rows
    (at most 1), never the gradient of a sum over the batch: no float16 overflow."""
    batches = [_batch(s, n=64, ignored=(0.5, 0.0, 0.25, 0.75)) for s in range(2)]
    got = _run(4, batches, dtype=np.float16)
    want = _run(1, batches, dtype=np.float16)
    assert np.isfinite(got[0]).all()
    _check(got, want, rtol=2e-2, atol=2e-3)


def test_other_losses_are_the_mean_of_the_micro_batches():
    """A loss that is not a cross_entropy mean (here a sum, halved) weights each micro-batch 1/k."""
    batches = [_batch(s) for s in range(2)]

    def half_sum(m, x, y):
        return tg.cross_entropy(m(x), y, ignore_index=IGNORE, reduction="sum") * 0.5

    got = _run(2, batches, loss_fn=half_sum)
    want = _run(1, batches, loss_fn=half_sum)
    np.testing.assert_allclose(got[0], np.asarray(want[0]) / 2, rtol=1e-5)  # the mean of two half batches' sums


def test_a_loss_that_changes_kind_between_micro_batches_is_refused():
    calls = []

    def sometimes(m, x, y):
        calls.append(1)
        loss = tg.cross_entropy(m(x), y, ignore_index=IGNORE)
        return loss if len(calls) == 1 else loss * 1.0

    with pytest.raises(tg.TileError, match=r"loss_fn to return the same kind of loss for every micro-batch \(a "
                                           r"cross_entropy mean for all, or for none\); received: a cross_entropy "
                                           r"mean for another micro-batch, another loss for this one"):
        _run(2, [_batch(0)], loss_fn=sometimes)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["tiles", "data", "sharded", "zero3"])
def test_on_two_workers_each_strategy(embedded_runtime, strategy):
    batches = [_batch(s) for s in range(3)]
    got = _run(2, batches, runtime=embedded_runtime, parallel=strategy)
    _check(got, _run(1, batches))
