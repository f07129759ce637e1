"""``tg.compute(...)`` / ``.numpy()`` of a model's outputs on a cluster, again and again, as a
notebook's cell does (an end-to-end audit). Each test is a defect found in that audit and fixed
(see its docstring)."""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch

import tilegraph as tg
from conftest import counting_scatters


def _model():
    return tg.nn.Linear(1024, 3072, tile=512, out_tile=1024, seed=0)   # a 12 MiB weight in 6 tiles


def _torch(model, x: np.ndarray) -> np.ndarray:
    lin = torch.nn.Linear(1024, 3072)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(model.weight.numpy().T.copy()))
        lin.bias.copy_(torch.from_numpy(model.bias.numpy()))
        return lin(torch.from_numpy(x)).numpy()


def _no_grad_compute(model, x: np.ndarray) -> tuple[np.ndarray, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tg.no_grad():
            got = tg.compute(model(tg.from_numpy(x, tiles=(32, 512))))[0]
    return got, [str(w.message) for w in caught if "large graph" in str(w.message)]


@pytest.mark.distributed
def test_repeated_no_grad_compute_sends_the_parameters_once(embedded_runtime, monkeypatch):
    """``with tg.no_grad(): tg.compute(model(x))`` on a cluster, again and again: without autograd
    records nothing led from the output to the model's parameters, so each call sent the 12 MiB
    weight inside its graph ("Sending large graph of size 12.03 MiB" at every call, as with
    gradients enabled before). Now the parameters held here are lent to the workers once, and sent
    again once assigned a new value, which the next call uses; the user's input (128 KiB tiles,
    larger than a task carries too) still travels with the graph, and the values are this
    process's and torch's."""
    rt = embedded_runtime
    model = _model()
    x = np.random.default_rng(0).standard_normal((32, 1024)).astype(np.float32)
    want, _ = _no_grad_compute(model, x)   # (in this process)
    np.testing.assert_allclose(want, _torch(model, x), rtol=1e-4, atol=1e-4)
    sent = counting_scatters(monkeypatch, rt)
    with rt.as_current():
        for i in range(3):
            got, large = _no_grad_compute(model, x)
            np.testing.assert_array_equal(got, want)
            assert not large, large
        assert sent == [6, 0, 0], sent   # (the weight's tiles only: the bias travels inside the task)
        assert all(isinstance(c.value, np.ndarray) for p in model.parameters() for c in p.cells.flat)
        new = np.random.default_rng(1).standard_normal((1024, 3072)).astype(np.float32)
        model.weight.assign(new)   # changed here: sent again, and computed with
        got, large = _no_grad_compute(model, x)
    assert sent[3:] == [6] and not large, (sent, large)
    np.testing.assert_array_equal(got, _no_grad_compute(model, x)[0])
    np.testing.assert_allclose(got, _torch(model, x), rtol=1e-4, atol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_or_unpickled_model_is_lent_too(embedded_runtime, monkeypatch, how):
    """A model from ``copy.deepcopy`` (an EMA or teacher copy) or loaded with ``pickle`` has cells
    of its own: they are lent as the original's are (no "Sending large graph" after the first
    call), and give the original's values."""
    rt = embedded_runtime
    model = _model()
    other = copy.deepcopy(model) if how == "deepcopy" else pickle.loads(pickle.dumps(model))
    x = np.random.default_rng(0).standard_normal((32, 1024)).astype(np.float32)
    want, _ = _no_grad_compute(model, x)
    sent = counting_scatters(monkeypatch, rt)
    with rt.as_current():
        results = [_no_grad_compute(other, x) for _ in range(2)]
    assert sent == [6, 0], sent
    for got, large in results:
        np.testing.assert_array_equal(got, want)
        assert not large, large


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:Sending large graph")
def test_a_parameter_asked_for_itself_is_not_sent_to_the_workers(embedded_runtime, monkeypatch):
    """``model.weight.numpy()`` with a cluster current (looking at a weight in a notebook): the
    weight was lent to the workers (12 MiB sent) and fetched back from them, where its value is
    the array here. Now nothing is sent and the array is this process's value."""
    rt = embedded_runtime
    model = _model()
    want = model.weight.numpy()
    sent = counting_scatters(monkeypatch, rt)
    with rt.as_current():
        got = model.weight.numpy()
        with tg.no_grad():
            got2 = model.weight.numpy()
        assert sum(sent) == 0, sent
        x = np.random.default_rng(0).standard_normal((32, 1024)).astype(np.float32)
        with tg.no_grad():   # asked for and read by a task: it travels with the graph, as before
            both = tg.compute(model.weight, model(tg.from_numpy(x, tiles=(32, 512))))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got2, want)
    np.testing.assert_array_equal(both[0], want)
    np.testing.assert_allclose(both[1], _torch(model, x), rtol=1e-4, atol=1e-4)


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["made", "deepcopy", "pickle"])
def test_the_parts_of_a_quantized_weight_are_lent_once_too(embedded_runtime, monkeypatch, how):
    """A quantized weight's parts (codes, scales) are not Parameters: each tg.compute of a
    QuantizedLinear sent them inside its graph ("Sending large graph" at every call, int8 codes of
    a 1024 x 3072 weight: 3 MiB). Now they are lent to the workers once, as a Parameter's tiles,
    also those of a deep-copied or unpickled weight; the values are those computed here."""
    from tilegraph import peft

    w = np.random.default_rng(0).standard_normal((1024, 3072)).astype(np.float32)
    q = peft.QuantizedTensor.from_array(w, (512, 1024), "int8")
    q = {"made": q, "deepcopy": copy.deepcopy(q), "pickle": pickle.loads(pickle.dumps(q))}[how]
    lin = peft.QuantizedLinear(q)
    x = np.random.default_rng(1).standard_normal((32, 1024)).astype(np.float32)
    want, _ = _no_grad_compute(lin, x)   # (in this process)
    sent = counting_scatters(monkeypatch, embedded_runtime)
    with embedded_runtime.as_current():
        for _ in range(2):
            got, large = _no_grad_compute(lin, x)
            np.testing.assert_array_equal(got, want)
            assert not large, large
    assert sent[0] > 0 and sent[1:] == [0], sent
