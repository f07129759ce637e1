"""Two torch habits, checked against torch.

A. Gradient accumulation over a batch whose rows do not divide by ``accum_steps`` (10 rows, k=4;
   a callable data's short last batch of an epoch): split as ``torch.tensor_split`` splits it
   (3, 3, 2, 2), each micro-batch weighted by its share of the rows (a cross_entropy mean: of the
   targets it counts), the step is the whole batch's. Such a batch was refused, the last one of
   an epoch after every step before it had run.
B. ``opt.state[p]``: a parameter's optimizer state with torch's keys (``step``, ``exp_avg``,
   ``exp_avg_sq``; SGD's ``momentum_buffer``), as torch's after the same steps. It raised
   "list indices must be integers or slices, not Parameter".
"""

import numpy as np
import pytest

import tilegraph as tg

IGNORE = -100


# -- A. accumulation over micro-batches of unequal rows -------------------------------------------
def _mlp(dtype=np.float64):
    return tg.nn.MLP(16, 32, out_dim=8, tile=8, seed=3, dtype=dtype)


def _ce(m, x, y):
    return tg.cross_entropy(m(x), y, ignore_index=IGNORE)


def _mse(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _batch(rng, rows: int, kind: str, ignored: float = 0.3, seq: int | None = None):
    """Inputs (rows, 16) or token-like (rows, seq, 16), and targets: class ids with a share
    ``ignored`` of padding (IGNORE) for "ce", float (rows, 8) for "mse"."""
    lead = (rows,) if seq is None else (rows, seq)
    x = rng.standard_normal((*lead, 16))
    if kind == "mse":
        return x, rng.standard_normal((*lead, 8))
    y = rng.integers(0, 8, lead)
    y[rng.random(lead) < ignored] = IGNORE
    y.flat[0] = 1  # (a counted target in each batch: an all-ignored batch is nan, as torch's)
    return x, y


def _train(k, batches, loss_fn, **options):
    model = _mlp()
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, clip_grad_norm=1.0)
    step = tg.TrainStep(model, opt, loss_fn, accum_steps=k, **options)
    losses = [step(*b) for b in batches]
    return losses, model.state_dict(), step


def _same(got, want, rtol=1e-10, atol=1e-12):
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for name, v in want[1].items():
        np.testing.assert_allclose(got[1][name], v, rtol=rtol, atol=atol, err_msg=name)


@pytest.mark.parametrize("kind", ["ce", "mse"])
@pytest.mark.parametrize("k, rows", [(4, [10, 10, 11]), (3, [7, 12, 5]), (4, [3, 2, 1]), (5, [33, 31, 32])])
def test_uneven_micro_batches_give_the_whole_batch_step(kind, k, rows):
    """Loss and update equal the step without accumulation on the same batches (float64)."""
    rng = np.random.default_rng(k)
    batches = [_batch(rng, n, kind) for n in rows]
    loss_fn = _ce if kind == "ce" else _mse
    _same(_train(k, batches, loss_fn)[:2], _train(1, batches, loss_fn)[:2])


def test_padding_tokens_in_uneven_micro_batches_are_normalised_over_the_batch():
    """Token sequences (B, T) whose padding (ignore_index) differs between the micro-batches, the
    smallest ones all padding: the mean over the batch's counted tokens, as one batch."""
    rng = np.random.default_rng(5)
    batches = []
    for rows in (10, 9, 6):
        x, y = _batch(rng, rows, "ce", ignored=0.5, seq=4)
        y[-2:] = IGNORE  # the last micro-batch (2 rows of 10 or 9, 1 of 6 with k=4) counts nothing
        batches.append((x, y))
    _same(_train(4, batches, _ce)[:2], _train(1, batches, _ce)[:2])


def _torch_accumulated(batches, k):
    """torch's loop: each micro-batch of ``torch.tensor_split`` scaled by its counted targets over
    the batch's (the whole batch's mean), gradients summed, one clipped AdamW step per batch."""
    torch = pytest.importorskip("torch")
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    params = {n: torch.tensor(np.asarray(v), requires_grad=True) for n, v in _mlp().state_dict().items()}
    opt = torch.optim.AdamW([params[n] for n in names], lr=1e-2, weight_decay=0.1)
    losses = []
    for x, y in batches:
        x, y = torch.tensor(x), torch.tensor(y)
        counted = int((y != IGNORE).sum())
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(torch.tensor_split(x, k), torch.tensor_split(y, k)):
            h = torch.nn.functional.gelu(xs @ params["fc1.weight"] + params["fc1.bias"], approximate="none")
            logits = h @ params["fc2.weight"] + params["fc2.bias"]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), ys.reshape(-1), ignore_index=IGNORE,
                                                     reduction="sum") / counted
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([params[n] for n in names], 1.0)
        opt.step()
        losses.append(total)
    return losses, {n: p.detach().numpy() for n, p in params.items()}


def test_uneven_accumulation_matches_torchs_loop():
    rng = np.random.default_rng(7)
    batches = [_batch(rng, n, "ce") for n in (10, 13, 6)]
    got = _train(4, batches, _ce)
    _same(got[:2], _torch_accumulated(batches, 4), rtol=1e-9, atol=1e-11)


def test_uneven_micro_batches_are_graphs_of_two_shapes():
    """10 rows, k=4: micro-batches of 3, 3, 2, 2 rows, one recorded graph each (first, add at 3
    rows, add, last at 2), replayed by the next batches of 10 rows; 12 rows: 3 graphs of 3 rows."""
    rng = np.random.default_rng(0)
    _, _, step = _train(4, [_batch(rng, 10, "ce") for _ in range(3)], _ce)
    recs = list(step._cache.values())
    assert [(kind, share.rows, share.total) for kind, _, _, share in step._cache] == \
        [("first", 3, 10), ("add", 3, 10), ("add", 2, 10), ("last", 2, 10)]
    assert [[t.shape for t, _ in rec.inputs[0]] for rec in recs] == \
        [[(3, 16), (3,)], [(3, 16), (3,)], [(2, 16), (2,)], [(2, 16), (2,)]]
    # the later micro-batches are normalised by the first one's counted targets (3)
    assert [rec.count_rows for rec in recs] == [3, 3, 3, 3]
    _, _, even = _train(4, [_batch(rng, 12, "ce")], _ce)
    assert [(kind, share.rows) for kind, _, _, share in even._cache] == [("first", 3), ("add", 3), ("last", 3)]


def test_uneven_micro_batches_with_row_tiles():
    """A batch_tiles row tile of the full batch is cut to each micro-batch's rows."""
    rng = np.random.default_rng(2)
    batches = [_batch(rng, n, "mse") for n in (10, 7)]
    _same(_train(4, batches, _mse, batch_tiles=[(2, 8), (2, None)])[:2],
          _train(1, batches, _mse, batch_tiles=[(2, 8), (2, None)])[:2])


@pytest.mark.distributed
def test_uneven_micro_batches_on_the_embedded_cluster(embedded_runtime):
    """The same on two worker processes, the rows shared among them ("data"); and opt.state[p]
    reads the moments where they live, on the workers."""
    rng = np.random.default_rng(4)
    batches = [_batch(rng, n, "ce") for n in (10, 9)]  # (3, 3, 2, 2 and 3, 2, 2, 2: a row for each process)
    want = _train(1, batches, _ce)
    with embedded_runtime.as_current():
        got = _train(4, batches, _ce, runtime=embedded_runtime, parallel="data")
        step = got[2]
        moments = step.optimizer.state[step.optimizer.params[0]]["exp_avg"].numpy()
        assert moments.shape == step.optimizer.params[0].shape
        np.testing.assert_array_equal(moments, step.optimizer.state_dict()["state"][0]["exp_avg"])
    _same(got[:2], want[:2], rtol=1e-9, atol=1e-11)


def _data(rows_at):
    """A callable data of ``rows_at(step)`` rows, the same arrays for every trainer."""
    def data(step):
        rng = np.random.default_rng(step)
        return _batch(rng, rows_at(step), "ce")
    return data


def _fit(k, data, steps=5, **kw):
    model = _mlp()
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2, clip_grad_norm=1.0)
    trainer = tg.Trainer(model, opt, data, loss_fn=_ce, accum_steps=k, progress=False, **kw)
    return trainer.fit(steps).losses, model.state_dict(), trainer


@pytest.mark.parametrize("rows_at", [lambda s: 10, lambda s: 12 if s < 4 else 10, lambda s: 12 if s < 5 else 3],
                         ids=["first-batch-10-rows", "short-batch-from-step-4", "last-batch-3-rows"])
def test_trainer_trains_batches_that_do_not_divide_by_accum_steps(rows_at):
    """A callable data's batch of rows not divisible by accum_steps, first or later (the short
    last batch of an epoch), was refused, the later one after the steps before it had run."""
    got = _fit(4, _data(rows_at))
    want = _fit(1, _data(rows_at))
    assert len(got[0]) == 5
    _same(got[:2], want[:2])


def test_trainer_takes_a_batch_size_that_does_not_divide_by_accum_steps():
    got = _fit(4, _data(lambda s: 10), steps=2, batch_size=10)
    assert got[2].batch_size == 10
    _same(got[:2], _fit(1, _data(lambda s: 10), steps=2)[:2])


def test_trainer_refuses_a_token_dataset_batch_size_that_does_not_divide(tmp_path):
    """A token dataset's micro-batches and evaluation batches are of batch_size / accum_steps
    windows: refused when the Trainer is made, naming the nearest batch sizes that divide."""
    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    (tmp_path / "a.txt").write_text("def f(x):\n    return x + 1\n" * 100)
    build_token_file([tmp_path / "a.txt"], tmp_path / "t.bin", ByteTokenizer(eos=True))
    data = TokenDataset(tmp_path / "t.bin", 16, split="train", seed=0)
    import dataclasses

    model = tg.models.build(dataclasses.replace(tg.models.config("gpt2-debug"), vocab_size=257), seed=0)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] batch_size must be a multiple of accum_steps for "
                       r"a token dataset .*: batch_size=8 or 12, or another accum_steps; received: batch_size=10, "
                       r"accum_steps=4"):
        tg.Trainer(model, tg.optim.AdamW(model.parameters()), data, batch_size=10, accum_steps=4, progress=False)
    with pytest.raises(tg.TileError, match=r"batch_size=4, or another accum_steps; received: batch_size=3"):
        tg.Trainer(model, tg.optim.AdamW(model.parameters()), data, batch_size=3, accum_steps=4, progress=False)


def test_a_batch_size_that_is_no_positive_int_is_refused():
    model = _mlp()
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] batch_size must be an int >= 1 \(the rows of a "
                       r"step's batch\); received: batch_size=0"):
        tg.Trainer(model, tg.optim.AdamW(model.parameters()), _data(lambda s: 4), loss_fn=_ce, batch_size=0,
                   progress=False)


# -- B. opt.state[p] as torch's ------------------------------------------------------------------
class _Lin(tg.nn.Module):
    def __init__(self, w0, b0):
        self.weight = tg.nn.Parameter(w0, (3, 3), name="weight")  # ragged tiles: 7 = 3 + 3 + 1
        self.bias = tg.nn.Parameter(b0, (3,), name="bias")

    def forward(self, x):
        return tg.matmul(x, self.weight, bias=self.bias)


TILES = [(4, 3), (4, 3)]  # (the inputs' dims as the weight's tiles)
KINDS = {"Adam": ({"lr": 1e-2, "weight_decay": 0.1}, "Adam"),
         "AdamW": ({"lr": 1e-2, "weight_decay": 0.1}, "AdamW"),
         "SGD-momentum": ({"lr": 0.1, "momentum": 0.9, "nesterov": True}, "SGD"),
         "SGD": ({"lr": 0.1}, "SGD")}


def _stepped(kind: str, steps: int = 3):
    """tilegraph's and torch's optimizer of ``kind`` after ``steps`` identical steps (float64)."""
    torch = pytest.importorskip("torch")
    args, name = KINDS[kind]
    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((7, 5)), rng.standard_normal(5)
    model = _Lin(w0, b0)
    opt = getattr(tg.optim, name)([model.weight, model.bias], **args)
    step = tg.TrainStep(model, opt, _mse, batch_tiles=TILES)
    tw, tb = (torch.tensor(a, requires_grad=True) for a in (w0, b0))
    topt = getattr(torch.optim, name)([tw, tb], **args)
    for _ in range(steps):
        x, y = rng.standard_normal((11, 7)), rng.standard_normal((11, 5))
        step(x, y)
        topt.zero_grad()
        ((torch.tensor(x) @ tw + tb - torch.tensor(y)) ** 2).mean().backward()
        topt.step()
    return model, opt, (tw, tb), topt


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_of_a_parameter_is_torchs(kind):
    model, opt, tparams, topt = _stepped(kind)
    for p, t in zip((model.weight, model.bias), tparams):
        mine, theirs = opt.state[p], topt.state[t]
        assert list(mine) == list(theirs) and len(mine) == len(theirs)  # the same keys, in torch's order
        for key, want in theirs.items():
            if key == "step":
                assert mine[key] == 3 and float(want) == 3.0
                continue
            got = mine[key]
            assert isinstance(got, tg.TileTensor) and got.shape == tuple(want.shape)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
    # as torch's: items() pairs each parameter with its state
    assert [p for p, _ in opt.state.items()] == [model.weight, model.bias]
    assert model.weight in opt.state


def test_a_state_tensor_kept_reads_the_state_as_it_is_then():
    """torch updates its state tensors in place: one kept shows the next step's; so does this."""
    torch = pytest.importorskip("torch")  # noqa: F841 (_stepped needs it)
    model, opt, _, _ = _stepped("AdamW", steps=1)
    state = opt.state[model.weight]
    kept, before = state["exp_avg"], state["exp_avg"].numpy()
    tg.TrainStep(model, opt, _mse, batch_tiles=TILES)(np.ones((4, 7)), np.zeros((4, 5)))
    assert state["step"] == 2 and not np.allclose(kept.numpy(), before)
    np.testing.assert_array_equal(kept.numpy(), opt.state_dict()["state"][0]["exp_avg"])


def test_state_before_the_first_step_is_zeros():
    model, opt, _, _ = _stepped("Adam", steps=0)
    state = opt.state[model.bias]
    assert state["step"] == 0 and not state["exp_avg"].numpy().any()
    assert dict(tg.optim.SGD(model.parameters(), lr=0.1).state[model.bias]) == {}  # torch's is {} too


def test_state_keys_that_are_not_there_are_named():
    model, opt, _, _ = _stepped("AdamW", steps=1)
    with pytest.raises(tg.optim.StateKeyError, match=r"^\[tilegraph.optim.AdamW.state\[params\[0\] \(weight, shape "
                       r"\(7, 5\)\)\]\] a key of AdamW's state of a parameter: 'step', 'exp_avg', 'exp_avg_sq'; "
                       r"received: 'momentum_buffer'$"):
        opt.state[model.weight]["momentum_buffer"]
    with pytest.raises(KeyError, match=r"amsgrad, whose state it is, is not implemented"):
        opt.state[model.weight]["max_exp_avg_sq"]
    sgd = tg.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(tg.TileError, match=r"a key of SGD's state of a parameter: none \(it keeps no state\) \(SGD "
                       r"keeps a momentum_buffer only with momentum > 0, as torch's\); received: 'momentum_buffer'"):
        sgd.state[model.weight]["momentum_buffer"]
    # KeyErrors, as a dict's: get and in answer
    assert opt.state[model.weight].get("momentum_buffer") is None and "exp_avg" in opt.state[model.weight]
    assert "momentum_buffer" not in sgd.state[model.weight]


def test_parameters_not_in_the_optimizer_are_named():
    model, opt, _, _ = _stepped("AdamW", steps=0)
    other = _Lin(np.zeros((7, 5)), np.zeros(5))
    with pytest.raises(tg.optim.StateKeyError, match=r"^\[tilegraph.optim.AdamW.state\] one of the optimizer's 2 "
                       r"parameters \(opt.params\), the parameters it was made with; received: a Parameter of shape "
                       r"\(7, 5\), its own name 'weight', which is not among them \(an optimizer is given "
                       r"parameters, not the model: its dotted name is model.named_parameters\(\)'s\)$"):
        opt.state[other.weight]
    assert opt.state.get(other.weight) is None and other.weight not in opt.state
    with pytest.raises(tg.TileError, match=r"a key that is one of the optimizer's parameters .*; received: str "
                       r"'exp_avg'"):
        opt.state["exp_avg"]
    other.bias.requires_grad = False
    frozen = tg.optim.AdamW(other.parameters())
    with pytest.raises(tg.TileError, match=r"this one was frozen \(requires_grad=False\) when the optimizer was made.*"
                       r"received: a Parameter of shape \(5,\), its own name 'bias'"):
        frozen.state[other.bias]


def test_state_is_read_only_with_a_pointer_to_load_state_dict():
    model, opt, _, _ = _stepped("AdamW", steps=0)
    with pytest.raises(tg.TileError, match=r"opt.state\[p\] is read-only here: .* opt.load_state_dict\(saved\)"):
        opt.state[model.weight]["exp_avg"] = np.zeros((7, 5))
    with pytest.raises(tg.TileError, match=r"opt.state is read-only here"):
        opt.state[model.weight] = {}


def test_state_iterates_as_torchs_and_the_cells_are_state_cells():
    """``opt.state`` is keyed by parameter as torch's: ``len`` counts the parameters, iteration
    gives them, ``dict(opt.state)`` maps each to its state; an int index is refused, naming
    ``opt.state_cells``, where the per-parameter cell grids are (tilegraph.io's checkpoints read
    them there)."""
    model, opt, _, _ = _stepped("AdamW", steps=0)
    assert len(opt.state) == 2 and list(opt.state) == [model.weight, model.bias]
    assert {k: list(v) for k, v in dict(opt.state).items()} == {model.weight: ["step", "exp_avg", "exp_avg_sq"],
                                                                 model.bias: ["step", "exp_avg", "exp_avg_sq"]}
    assert [len(grids) for grids in opt.state_cells] == [2, 2] and opt.state_cells[0][0].shape == (3, 2)
    with pytest.raises(tg.TileError, match=r"a key that is one of the optimizer's parameters .*opt.state_cells\[i\]"
                                           r"\); received: int 0"):
        opt.state[0]
    sgd = tg.optim.SGD(model.parameters(), lr=0.1)
    assert sgd.state_cells == [[], []] and [dict(v) for v in sgd.state.values()] == [{}, {}]