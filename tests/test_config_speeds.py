"""tg.config.speeds: the assignment requires what the planner reads ("cpu", and "gpu" or its
default; three numbers > 0 each), and the value stored cannot be changed in place, which skipped that check:
``tg.config.speeds = {}`` was accepted and the next step failed with a bare KeyError 'cpu' in
tilegraph/plan/cluster.py, ``tg.config.speeds["cpu"] = "fast"`` with a bare ValueError there."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import tilegraph as tg
from tilegraph._errors import TileError
from tilegraph._graph import topo_order
from tilegraph.plan.cluster import est_seconds, place

DEFAULT = {"cpu": (1.2e11, 1e10, 1e-5), "gpu": (2e13, 2e12, 1e-4)}


@pytest.fixture(autouse=True)
def speeds_restored():
    before = tg.config.speeds
    yield
    tg.config.speeds = before


def _computes() -> None:
    """A small graph planned and run on the local scheduler (the planner reads config.speeds)."""
    a = np.arange(12.0).reshape(3, 4)
    x = tg.from_numpy(a, tiles=(2, 2))
    np.testing.assert_allclose(tg.compute((x @ x.T).sum())[0], (a @ a.T).sum())


@pytest.mark.parametrize("value", [
    {},                                                               # KeyError 'cpu' at the next step
    {"gpu": DEFAULT["gpu"]},
    {**DEFAULT, "GPU": (1.0, 1.0, 1.0)},                              # a misspelt device, read by nothing
    {"cpu": (1e11, 1e10), "gpu": DEFAULT["gpu"]},
    {"cpu": (1e11, 1e10, 0), "gpu": DEFAULT["gpu"]},
    {"cpu": "fast", "gpu": DEFAULT["gpu"]},
    [("cpu", DEFAULT["cpu"]), ("gpu", DEFAULT["gpu"])],
])
def test_assignment_requires_the_cpu_s_speeds(value):
    before = tg.config.speeds
    with pytest.raises(TileError, match=r'^\[tilegraph\.config\.speeds\] must be a dict of device \("cpu", and '
                                        r'"gpu" or its default; no other\) -> \(flop/s, byte/s, seconds per kernel '
                                        r'call\), each a finite number > 0; received: ') as e:
        tg.config.speeds = value
    assert e.value.received == repr(value)
    assert tg.config.speeds is before and dict(tg.config.speeds) == DEFAULT
    _computes()


@pytest.mark.parametrize("change, shown", [
    (lambda s: s.__setitem__("cpu", "fast"), "tilegraph.config.speeds['cpu'] = 'fast'"),
    (lambda s: s.__setitem__("cpu", (1.0, 1.0, 1.0)), "tilegraph.config.speeds['cpu'] = (1.0, 1.0, 1.0)"),
    (lambda s: s.__delitem__("gpu"), "del tilegraph.config.speeds['gpu']"),
    (lambda s: s.update(cpu=(1.0, 1.0, 1.0)), "tilegraph.config.speeds.update(cpu=(1.0, 1.0, 1.0))"),
    (lambda s: s.pop("cpu"), "tilegraph.config.speeds.pop('cpu')"),
    (lambda s: s.clear(), "tilegraph.config.speeds.clear()"),
    (lambda s: s.setdefault("tpu", (1, 1, 1)), "tilegraph.config.speeds.setdefault('tpu', (1, 1, 1))"),
])
def test_in_place_change_is_refused(change, shown):
    with pytest.raises(TypeError, match=r"^\[tilegraph\.config\.speeds\] an assignment of the whole setting .*"
                                        r"tilegraph\.config\.speeds = \{\*\*tilegraph\.config\.speeds, ") as e:
        change(tg.config.speeds)
    assert isinstance(e.value, TileError) and e.value.received == shown
    assert dict(tg.config.speeds) == DEFAULT
    _computes()


def test_stored_copy_is_detached_from_what_was_assigned():
    mine = {"cpu": [1e11, 1e10, 2e-5], "gpu": [2e13, 2e12, 1e-4]}
    tg.config.speeds = mine
    mine["cpu"][0] = "fast"   # the caller's own dict and lists, changed afterwards
    mine["cpu"] = "slow"
    assert tg.config.speeds["cpu"] == (1e11, 1e10, 2e-5) and isinstance(tg.config.speeds["cpu"], tuple)
    _computes()


def test_whole_assignment_changes_the_plans_estimate():
    x = tg.from_numpy(np.ones((4, 4)), tiles=(2, 2))
    nodes = [n for n in topo_order(list((x @ x).grid.flat)) if not n.is_leaf]
    place(nodes, "cpu", False)
    before = sum(est_seconds(n) for n in nodes)
    tg.config.speeds = {**tg.config.speeds, "cpu": (1.2e11, 1e10, 1.0)}   # one second per kernel call
    assert sum(est_seconds(n) for n in nodes) == pytest.approx(before + len(nodes) * (1.0 - 1e-5))
    assert dict(tg.config.speeds) == {"cpu": (1.2e11, 1e10, 1.0), "gpu": DEFAULT["gpu"]}
    _computes()


def test_stored_value_reads_as_a_mapping():
    s = tg.config.speeds
    assert s == DEFAULT and dict(s) == DEFAULT and {**s} == DEFAULT and sorted(s) == ["cpu", "gpu"]
    assert len(s) == 2 and "gpu" in s and s.get("tpu") is None and repr(s) == repr(DEFAULT)
    for again in (pickle.loads(pickle.dumps(s)), copy.deepcopy(s), copy.copy(s)):
        assert again == s
    tg.config.speeds = s   # the stored value assigned back
    assert tg.config.speeds == DEFAULT


def test_a_device_left_out_keeps_its_default_speeds():
    """Only the CPU's speeds given (a CPU-only cluster): the GPU's stay the default ones, which
    the planner reads wherever GPU workers exist."""
    try:
        tg.config.speeds = {"cpu": (1e11, 1e10, 2e-5)}
        assert dict(tg.config.speeds) == {"cpu": (1e11, 1e10, 2e-5), "gpu": DEFAULT["gpu"]}
        _computes()
    finally:
        tg.config.speeds = DEFAULT
