"""Leads of session 51. ``model.set_dropout(...)`` on a model whose TrainStep had recorded its
step changed nothing for that step: it went on dropping with the recorded values, unsaid (the
docstring said so; a new user turning dropout off for a last phase of training did not see it)."""

import numpy as np

import tilegraph as tg
from tilegraph import models


def _step(model):
    opt = tg.optim.AdamW(model.parameters(), lr=0.0)  # (lr 0: the weights stay, the losses compare)
    return tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))


def test_set_dropout_between_steps_records_the_step_again():
    ids = np.random.default_rng(0).integers(0, 96, (4, 17))
    x, y = ids[:, :-1], ids[:, 1:]
    undropped = _step(models.build("gpt2-debug"))(x, y)
    model = models.build("gpt2-debug").set_dropout(attn_dropout=0.5, resid_dropout=0.5, embd_dropout=0.5)
    step = _step(model)
    dropped = step(x, y)
    assert abs(dropped - undropped) > 1e-3
    model.set_dropout(attn_dropout=0.0, resid_dropout=0.0, embd_dropout=0.0)
    assert step(x, y) == undropped  # (it was the dropped loss again)
    model.set_dropout(attn_dropout=0.5, resid_dropout=0.5, embd_dropout=0.5)
    assert step(x, y) == dropped


def test_a_layer_s_dropout_set_by_hand_is_recorded_too():
    layer = tg.nn.CausalSelfAttention(16, 2, dropout=0.0)
    x = np.random.default_rng(1).standard_normal((2, 5, 16)).astype(np.float32)
    opt = tg.optim.SGD(layer.parameters(), lr=0.0)
    step = tg.TrainStep(layer, opt, lambda m, x: (m(x) * m(x)).mean())
    first = step(x)
    layer.dropout = 0.5
    assert step(x) != first
    layer.dropout = 0.0
    assert step(x) == first


def test_a_dropout_of_minus_zero_is_zero():
    import math

    from tilegraph.ops.dropout import check_dropout

    assert math.copysign(1.0, check_dropout(-0.0)) == 1.0
    assert math.copysign(1.0, models.GPT2Config(attn_dropout=-0.0).attn_dropout) == 1.0


def test_an_int_past_any_float_is_refused_as_a_dropout_by_name():
    # (nn.Dropout and SDPA raised Python's OverflowError: math.isfinite of the int; the model
    # configs had their own copy of the check, which refused it)
    import pytest

    from tilegraph.ops.dropout import check_dropout

    for make in (check_dropout, tg.nn.Dropout, lambda p: models.GPT2Config(attn_dropout=p)):
        with pytest.raises(tg.TileError, match=r"must be a number in \[0, 1\)"):
            make(10**400)
