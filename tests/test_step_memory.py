"""How a training step's tasks hold memory: the optimizer's update runs as several tasks, each
writing a bounded part of the new state, so each part of the old state is freed as its own is
written; and the backward pass hands the updates gradients, not the activations they are made of.
Both only regroup kernels into tasks: the losses are the same, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models
from tilegraph.models import GPT2Config, ModelTiling
from tilegraph.plan import cluster

CFG = GPT2Config(vocab_size=128, max_seq_len=16, dim=64, n_layers=2, n_heads=4)


def _batch(seed=0, batch=4, seq=16):
    ids = np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(batch, seq))
    return ids, np.roll(ids, -1, 1)


def _step(runtime=None, **options):
    model = models.build(CFG, ModelTiling(feature=32), seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    return tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None)] * 2,
                        runtime=runtime, **options)


def _plan(state_task_bytes, monkeypatch, tasks=1 << 20, **options):
    """The plan of one step, with at most ``state_task_bytes`` of state written per task (or a
    ``tasks``-th of all of it, where that is more), and the ids of the nodes writing that state
    (every root after the loss: parameters and moments)."""
    monkeypatch.setattr(cluster, "STATE_TASK_BYTES", state_task_bytes)
    monkeypatch.setattr(cluster, "STATE_TASKS", tasks)
    exe = _step(**options).plan(*_batch())
    writers = {id(r.node) for refs in exe.replicas[1:] for r in refs if not r.node.is_leaf}
    return exe, writers


def _state_bytes(c, writers):
    return sum(cluster.out_bytes(n) for n in c.nodes if id(n) in writers)


def test_no_task_writes_more_than_its_share_of_the_state(monkeypatch):
    whole, writers = _plan(float("inf"), monkeypatch, target_seconds=100.0)
    total = sum(_state_bytes(c, writers) for c in whole.clusters)
    assert total == sum(r.nbytes for refs in whole.replicas[1:] for r in refs)  # every state value, once
    assert sum(_state_bytes(c, writers) > 0 for c in whole.clusters) == 1  # no bound: one task updates all
    cap = total // 10
    parts, writers = _plan(cap, monkeypatch, target_seconds=100.0)
    updating = [c for c in parts.clusters if _state_bytes(c, writers) > 0]
    assert len(updating) >= 10
    for c in updating:  # a task of one update kernel may write more; else at most the cap
        assert _state_bytes(c, writers) <= cap or sum(id(n) in writers for n in c.nodes) == 1, c.id
    assert sum(_state_bytes(c, writers) for c in updating) == total
    # however small the bound, about STATE_TASKS tasks (each at most its share, a kernel or more)
    few, writers = _plan(1, monkeypatch, tasks=4, target_seconds=100.0)
    updating = [c for c in few.clusters if _state_bytes(c, writers) > 0]
    assert 4 <= len(updating) <= 8, len(updating)
    assert all(_state_bytes(c, writers) <= total / 4 or sum(id(n) in writers for n in c.nodes) == 1 for c in updating)


def test_the_backward_hands_the_updates_gradients_not_activations(monkeypatch):
    """Two row tiles per weight: each weight gradient is a sum of two products of activations
    and output gradients. All of them run in the backward's task, so what the other tasks (the
    updates) read from it are summed gradients, each read by an update kernel itself, at most one
    per parameter tile; no activation leaves it."""
    exe, writers = _plan(1 << 10, monkeypatch, target_seconds=100.0)
    of = {id(n): c for c in exe.clusters for n in c.nodes}
    compute = of[id(exe.replicas[0][0].node)]  # the loss's task: forward and backward
    assert len(compute.nodes) > len(exe.clusters[-1].nodes) and len(exe.clusters) > 2
    handed: dict[tuple[int, int], int] = {}
    for c in exe.clusters:
        for n in c.nodes:
            for i in n.inputs:
                if c is not compute and of.get(id(i.node)) is compute:
                    assert id(n) in writers, (n.op, i.node.op)  # read by an update, not by a product
                    handed[(id(i.node), i.index)] = i.nbytes
    params = sum(r.nbytes for refs in exe.replicas[1:] for r in refs if id(r.node) in writers) // 3
    assert 0 < sum(handed.values()) <= params  # AdamW: one third of the state is parameters


@pytest.mark.parametrize("workers", [1, 2])
def test_updates_in_parts_train_to_the_same_losses(workers, monkeypatch):
    """The same three steps with the state updated by one task and by many: equal losses and
    parameters, bit for bit (on 2 workers: the sharded plan as Dask tasks)."""
    tg.config.exchange, old = "tasks", tg.config.exchange
    try:
        with tg.connect(n_workers=workers, threads_per_worker=1, dashboard=False, quiet=True) as rt:
            runs = []
            for cap in (float("inf"), 4 << 10):
                monkeypatch.setattr(cluster, "STATE_TASK_BYTES", cap)
                step = _step(rt)
                exe = step.plan(*_batch())
                runs.append(([float(step(*_batch(s))) for s in range(3)],
                             [np.asarray(v) for v in step.model.state_dict().values()], exe.n_tasks))
    finally:
        tg.config.exchange = old
    (loss_a, params_a, tasks_a), (loss_b, params_b, tasks_b) = runs
    assert tasks_b > tasks_a
    assert loss_a == loss_b
    for a, b in zip(params_a, params_b):
        np.testing.assert_array_equal(a, b)
