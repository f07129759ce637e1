"""Repeated calls in a long-lived process (a notebook kernel): text generation, evaluation and
the step cache. Each test is a defect found so, and fails without its fix.

- ``generate`` (and ``Decoder``) on a cluster sent every parameter of a model held here to the
  workers again at every call, under new keys: the upload's time each call (gpt2-debug: 107 ms
  a short call against 29 ms now; GPT-2 124M: 0.6-1.4 s against 0.3-0.6 s) and 37 more keys a
  gpt2-debug call in Dask's memos for good. The copy lent at the first call is used again while
  the parameter holds the same array, and sent again once it changed (``tilegraph._train.lend_cells``);
- the parts of quantized weights held here (``peft.from_quantized`` without a runtime) were never
  lent: they went inside every call's task (GPT-2 124M int8: 84 MB, Dask's "Sending large graph");
- ``EvalStep`` on a model held here sent its parameters inside every call's graph (GPT-2 124M:
  475 MB and Dask's warning a call); and after its workers were replaced between two calls
  (lost, started again by their nannies) every later call failed with Dask's CommClosedError;
- ``TrainStep`` and ``EvalStep`` kept one recorded plan per batch signature for good.
"""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph import _train
from conftest import counting_scatters
from tilegraph.models import Decoder, generate



PROMPT = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])


def _own_greedy(model, prompt: np.ndarray, n: int, runtime=None) -> np.ndarray:
    """Greedy decoding by the model's own forward over the whole sequence at each token."""
    ids = np.asarray(prompt)
    for _ in range(n):
        (logits,) = tg.compute(model(ids), runtime=runtime) if runtime is not None else (model(ids).numpy(),)
        ids = np.concatenate([ids, logits[:, -1].argmax(-1)[:, None]], axis=1)
    return ids


def _lent(rt) -> int:
    return len(_train._LENT.get(rt, {}))


@pytest.mark.distributed
def test_repeated_generate_calls_send_the_parameters_once_and_again_only_once_changed(embedded_runtime, monkeypatch):
    rt = embedded_runtime
    model = models.build("gpt2-debug", seed=3)
    n_cells = sum(p.cells.size for p in model.parameters())
    sent = counting_scatters(monkeypatch, rt)
    want = _own_greedy(model, PROMPT, 6)
    first = generate(model, PROMPT, 6, runtime=rt)
    np.testing.assert_array_equal(first, want)
    for _ in range(3):   # before: every call sent all 36 values again, under new keys
        np.testing.assert_array_equal(generate(model, PROMPT, 6, runtime=rt), want)
    with Decoder(model, runtime=rt) as dec:   # (the per-token path lends the same copies)
        dec.feed(PROMPT)
    assert sum(sent) == n_cells, sent
    # the parameters are the client's still, each as it was (only lent to the workers)
    assert all(isinstance(c.value, np.ndarray) for p in model.parameters() for c in p.cells.flat)

    # changed here (new arrays): sent again, and the new weights decode
    state = model.state_dict()
    model.load_state_dict({k: v * 1.5 if k.endswith("wte.weight") else v for k, v in state.items()})
    want = _own_greedy(model, PROMPT, 6)
    np.testing.assert_array_equal(generate(model, PROMPT, 6, runtime=rt), want)
    assert sum(sent) == 2 * n_cells, sent   # (load_state_dict gives every parameter a new array)


@pytest.mark.distributed
def test_generate_after_a_training_step_decodes_with_the_new_weights(embedded_runtime):
    rt = embedded_runtime
    model = models.build("gpt2-debug", seed=4)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (4, 9))
    before = generate(model, PROMPT, 6, runtime=rt)
    # a step here (no runtime): the parameters get new arrays, which the workers do not hold yet
    opt = tg.optim.AdamW(model.parameters(), lr=0.05)
    step = tg.TrainStep(model, opt, lambda m, x, y: tg.cross_entropy(m(x), y))
    for _ in range(3):
        step(ids[:, :-1], ids[:, 1:])
    want = _own_greedy(model, PROMPT, 6)
    assert not np.array_equal(want, before)   # (the steps changed the continuation)
    np.testing.assert_array_equal(generate(model, PROMPT, 6, runtime=rt), want)
    # a step on the cluster: the parameters live on the workers, read there as they are
    opt2 = tg.optim.AdamW(model.parameters(), lr=0.05)
    step2 = tg.TrainStep(model, opt2, lambda m, x, y: tg.cross_entropy(m(x), y), runtime=rt)
    lent = _lent(rt)
    step2(ids[:, :-1], ids[:, 1:])
    gc.collect()
    assert _lent(rt) == lent - sum(p.cells.size for p in model.parameters())   # (the copies lent are released)
    want = _own_greedy(model, PROMPT, 6, runtime=rt)
    np.testing.assert_array_equal(generate(model, PROMPT, 6, runtime=rt), want)
    np.testing.assert_array_equal(generate(model, PROMPT, 6, runtime=rt), want)


@pytest.mark.distributed
def test_lent_copies_go_with_the_model_and_are_sent_again_when_the_workers_lost_them(embedded_runtime, monkeypatch):
    rt = embedded_runtime
    gc.collect()
    base = _lent(rt)
    model = models.build("llama-debug", seed=5)
    n_cells = sum(p.cells.size for p in model.parameters())
    want = generate(model, PROMPT, 5, runtime=rt)
    assert _lent(rt) == base + n_cells
    # the workers no longer hold the copies (a lost worker's, say): sent again, the same tokens
    rt.client.cancel([ref.future for _, ref, _ in _train._LENT[rt].values()])
    sent = counting_scatters(monkeypatch, rt)
    np.testing.assert_array_equal(generate(model, PROMPT, 5, runtime=rt), want)
    assert sent == [n_cells], sent
    # a dropped model's copies are released (before: none was kept; now none may stay for good)
    del model
    gc.collect()
    assert _lent(rt) == base


@pytest.mark.distributed
def test_the_parts_of_quantized_weights_held_here_are_lent_once_too(embedded_runtime, monkeypatch, tmp_path):
    # before: they went inside every call's task (GPT-2 124M int8: 84 MB a call, with Dask's
    # "Sending large graph" warning) and, decoding from here, inside every token's graph
    from tilegraph import peft
    from tilegraph.io import save_checkpoint

    rt = embedded_runtime
    save_checkpoint(tmp_path / "q", models.build("gpt2-debug", seed=6), quantize="int8")
    model = peft.from_quantized(tmp_path / "q", runtime=None)
    quantized = sum(len(q.cells) for _, q in peft.named_quantized(model))
    assert quantized > 0
    want = _own_greedy(model, PROMPT, 5)
    sent = counting_scatters(monkeypatch, rt)
    for _ in range(2):
        np.testing.assert_array_equal(generate(model, PROMPT, 5, runtime=rt), want)
    assert sent == [sum(p.cells.size for p in model.parameters()) + quantized, 0], sent
    assert all(isinstance(c.value, np.ndarray) for _, q in peft.named_quantized(model) for c in q.cells)


@pytest.mark.distributed
def test_an_evaluation_of_a_model_held_here_sends_its_large_values_once(embedded_runtime, monkeypatch):
    # before: they went inside every call's graph (GPT-2 124M: 475 MB and 1.5-2 s a call, with
    # Dask's "Sending large graph" warning; 0.4-0.8 s now), tilegraph eval's too
    import dataclasses

    torch = pytest.importorskip("torch")
    rt = embedded_runtime
    model = models.build(dataclasses.replace(models.GPT2Config.flavor("debug"), vocab_size=512, dim=64), seed=7)
    ids = np.random.default_rng(1).integers(0, 512, (4, 13))
    x, y = ids[:, :-1], ids[:, 1:]
    want = torch.nn.functional.cross_entropy(torch.tensor(model(x).numpy()).reshape(-1, 512),
                                             torch.tensor(y).reshape(-1)).item()
    sent = counting_scatters(monkeypatch, rt)
    ev = tg.EvalStep(model, lambda m, a, b: tg.cross_entropy(m(a), b), runtime=rt)
    for _ in range(3):
        assert ev(x, y) == pytest.approx(want, rel=1e-5)
    assert sent == [1, 0, 0], sent   # (the embedding: the only value over INLINE_MAX_BYTES)
    assert ev.losses([(x, y)] * 3) == pytest.approx([want] * 3, rel=1e-5)
    assert len(sent) > 3 and not any(sent[3:]), sent
    assert all(isinstance(c.value, np.ndarray) for p in model.parameters() for c in p.cells.flat)


@pytest.mark.distributed
def test_an_eval_step_runs_again_after_its_workers_were_replaced_between_two_calls(own_runtime):
    # before: its plan sent its programs to the workers lost, and every later call failed with
    # Dask's CommClosedError ("values to send to worker ..., which left the cluster")
    import dataclasses
    import os
    import signal

    from tilegraph._train import wait_for_replacements

    rt = own_runtime
    model = models.build(dataclasses.replace(models.GPT2Config.flavor("debug"), vocab_size=512, dim=64), seed=7)
    ids = np.random.default_rng(1).integers(0, 512, (4, 13))
    ev = tg.EvalStep(model, lambda m, a, b: tg.cross_entropy(m(a), b), runtime=rt)
    want = ev(ids[:, :-1], ids[:, 1:])
    pids = rt.client.run(os.getpid)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while set(rt.workers()) & set(pids) or wait_for_replacements(rt, 2) < 2:   # (their nannies start new ones)
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert ev(ids[:, :-1], ids[:, 1:]) == want


# -- the step cache ---------------------------------------------------------------------------------
# TrainStep and EvalStep kept one recorded plan per batch signature for good: batches of varying
# length (a loader without padding to one length, evaluations at several lengths) added one each
# (gpt2-debug, 40 lengths: +12 MB traced and +32 MB RSS here, and 40 programs on the workers).

def _mse(m, x, y):
    d = m(x) - y
    return (d * d).mean()


def _batch(rows: int, seed: int = 0):
    x = np.random.default_rng([seed, rows]).standard_normal((rows, 16)).astype(np.float32)
    return x, np.tanh(x[:, :4])


def _mlp_step(**kw):
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    return tg.TrainStep(model, tg.optim.SGD(model.parameters(), lr=0.01), _mse, **kw)


def test_a_train_step_keeps_the_plans_of_the_signatures_used_last_and_frees_the_others():
    import weakref
    from tilegraph._train import PLANS_KEPT

    step, same = _mlp_step(), _mlp_step()
    same.plans_kept = 1000
    dropped = []
    for rows in range(1, PLANS_KEPT + 9):
        if rows > 1:
            dropped.append(weakref.ref(step._cache[("step", 1, step.signature(_batch(rows - 1)), None)].exe))
        assert step(*_batch(rows)) == same(*_batch(rows))
        step(*_batch(1))   # used at every step: the most recent, never dropped
        same(*_batch(1))
    assert len(step._cache) == PLANS_KEPT   # before: one per signature, 24 here
    assert len(same._cache) == PLANS_KEPT + 8
    assert ("step", 1, step.signature(_batch(1)), None) in step._cache
    gc.collect()
    assert sum(r() is None for r in dropped) == 8   # the dropped plans (and their graphs) are freed
    # one dropped comes back: recorded again, the same loss as the step that kept it, and a warning once
    with pytest.warns(UserWarning, match=r"recorded again .*plans_kept=16.*tilegraph.TrainStep.plans_kept = N"):
        assert step(*_batch(2)) == same(*_batch(2))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step(*_batch(3)) == same(*_batch(3))
    step.plans_kept = 0
    with pytest.raises(tg.TileError, match="plans_kept must be an integer >= 1"):
        step(*_batch(30))


def test_an_eval_step_keeps_the_plans_of_the_signatures_used_last():
    model = tg.nn.MLP(16, 32, out_dim=4, tile=8, seed=0)
    ev = tg.EvalStep(model, _mse)
    ev.plans_kept = 4
    want = {rows: float(_mse(model, *[tg.from_numpy(a) for a in _batch(rows)]).numpy()) for rows in range(1, 11)}
    for rows in range(1, 11):
        assert ev(*_batch(rows)) == pytest.approx(want[rows], rel=1e-6)
    assert len(ev._cache) == 4   # before: 10
    assert [sig[0][0][0] for _, sig in ev._cache] == [7, 8, 9, 10]
