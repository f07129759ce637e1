"""Two leads earlier audits left: ``Trainer(progress=False)`` printed its evaluation lines (now
documented: it leaves out the bar, not the results); ``opt.state[p]`` for a parameter the
optimizer does not train named it by its bare own name ("weight"), read as its name in the model."""

import numpy as np
import pytest

import tilegraph as tg


# ----------------------------------------------------------------------- Trainer(progress=False) ----
def _fit(progress: bool):
    def data(seed):
        def batch(step):
            x = np.random.default_rng([seed, step]).standard_normal((16, 8)).astype(np.float32)
            return x, np.tanh(x[:, :2])
        return batch

    def mse(m, x, y):
        d = m(x) - y
        return (d * d).mean()

    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    trainer = tg.Trainer(model, tg.optim.AdamW(model.parameters(), lr=1e-2), data(0), loss_fn=mse, batch_size=16,
                         eval_data=data(1), eval_every=2, eval_batches=1, progress=progress)
    return trainer, trainer.fit(4)


def test_progress_false_records_the_evaluations():
    trainer, res = _fit(False)
    assert [s for s, _ in res.val_losses] == [2, 4]
    assert [(r["step"], r["val_loss"]) for r in trainer.history if "val_loss" in r] == res.val_losses


def test_progress_false_leaves_out_the_bar_not_the_evaluation_lines(capfd):
    """As the Trainer's docstring says now: the evaluations are results, printed either way (the
    tilegraph command's --no-progress runs print them too)."""
    _, res = _fit(False)
    said = capfd.readouterr()
    for step, val in res.val_losses:
        assert f"step {step}: loss " in said.out and f"validation loss {val:.4f}" in said.out
    assert "it/s" not in said.err and "tok_s" not in said.err


def test_progress_true_prints_the_evaluation_lines(capfd):
    _, res = _fit(True)
    out = capfd.readouterr().out
    for step, val in res.val_losses:
        assert f"step {step}: loss " in out and f"validation loss {val:.4f}" in out


# --------------------------------------------------------------- opt.state of a frozen parameter ----
class _Block(tg.nn.Module):
    def __init__(self):
        super().__init__()
        self.q = tg.nn.Linear(4, 4, seed=0)
        self.k = tg.nn.Linear(4, 4, seed=1)


def test_state_of_a_parameter_not_trained_does_not_pass_its_own_name_for_its_name_in_the_model():
    """``opt.state[model.blocks[0].k.weight]`` of a frozen parameter said "received: a parameter
    (weight, shape (4, 4))": "weight", read as its name in the model, fits every Linear's. An
    optimizer is given parameters, not the model, so it cannot know "blocks.0.k.weight"; the
    message says what it received (shape, own name), and where the dotted name is."""
    model = tg.nn.Module()
    model.blocks = tg.nn.ModuleList([_Block(), _Block()])
    frozen = model.blocks[0].k.weight
    frozen.requires_grad = False
    assert dict(model.named_parameters())["blocks.0.k.weight"] is frozen
    opt = tg.optim.AdamW(model.parameters())
    honest = (r"received: a Parameter of shape \(4, 4\), its own name 'weight'{} \(an optimizer is given parameters, "
              r"not the model: its dotted name is model.named_parameters\(\)'s\)$")
    with pytest.raises(tg.optim.StateKeyError, match=r"^\[tilegraph.optim.AdamW.state\] a parameter the optimizer "
                       r"trains: this one was frozen \(requires_grad=False\) .*; " + honest.format("")):
        opt.state[frozen]
    # one it was not given: the same, and said so
    only_q = tg.optim.SGD(model.blocks[1].q.parameters(), lr=0.1)
    with pytest.raises(tg.optim.StateKeyError, match=r"^\[tilegraph.optim.SGD.state\] one of the optimizer's 2 "
                       r"parameters \(opt.params\), the parameters it was made with; "
                       + honest.format(", which is not among them")):
        only_q.state[model.blocks[1].k.weight]
    # the parameters it trains are named by their index in opt.params (the frozen one left out), as its
    # other errors do
    with pytest.raises(tg.TileError, match=r"opt.state\[params\[3\] \(weight, shape \(4, 4\)\)\] = dict"):
        opt.state[model.blocks[1].q.weight] = {}
    with pytest.raises(tg.optim.StateKeyError, match=r"^\[tilegraph.optim.AdamW.state\[params\[0\] \(weight, shape "
                       r"\(4, 4\)\)\]\] a key of AdamW's state"):
        opt.state[model.blocks[0].q.weight]["momentum_buffer"]


def test_state_of_an_unnamed_parameter_says_it_has_no_name():
    p = tg.nn.Parameter(np.zeros((3, 2), np.float32))
    opt = tg.optim.SGD([tg.nn.Parameter(np.zeros(2, np.float32), name="b")], lr=0.1)
    with pytest.raises(tg.optim.StateKeyError, match=r"received: a Parameter of shape \(3, 2\), no name of its own, "
                       r"which is not among them \(an optimizer is given parameters"):
        opt.state[p]
    assert opt.state.get(p) is None and p not in opt.state
