"""The link speed the planner takes between worker processes (``config.transfer_bytes_per_second``):
measured once per runtime between workers on two hosts, the default on one host, a number where
the user sets one."""

from __future__ import annotations

import numpy as np
import pytest

import tilegraph as tg
from conftest import fake_hosts
from tilegraph import runtime as runtime_mod
from tilegraph._config import DEFAULT_TRANSFER_BYTES_PER_SECOND, transfer_speed


def test_the_setting_takes_auto_or_a_speed(monkeypatch):
    assert tg.config.transfer_bytes_per_second == "auto"
    assert transfer_speed() == DEFAULT_TRANSFER_BYTES_PER_SECOND and transfer_speed(3e8) == 3e8
    monkeypatch.setattr(tg.config, "transfer_bytes_per_second", 5e9)
    assert transfer_speed(3e8) == 5e9  # the user's number wins over a measure
    for bad in (0, -1, "fast", None, True):
        with pytest.raises(tg.TileError, match=r"transfer_bytes_per_second\] must be \"auto\" or a number > 0; received: "):
            tg.config.transfer_bytes_per_second = bad


def _plan(runtime):
    """The tiles plan of :func:`_two_stage_graph`, in tasks of one product each."""
    return tg.compile(_two_stage_graph(), runtime=runtime, parallel="tiles", target_seconds=0.004)


def _two_stage_graph():
    """One product, then eight that read it: on a second process they wait for its move."""
    rng = np.random.default_rng(0)
    y = tg.from_numpy(rng.standard_normal((512, 512), np.float32))
    y = y @ y
    return [y @ tg.from_numpy(rng.standard_normal((512, 1024), np.float32)) for _ in range(8)]


@pytest.mark.distributed
def test_one_host_plans_with_the_default_without_measuring(embedded_runtime, monkeypatch):
    monkeypatch.setattr(runtime_mod, "_measure_link", lambda *a, **k: pytest.fail("measured on one host"))
    monkeypatch.setattr(embedded_runtime, "_link", None)
    assert embedded_runtime.link_bytes_per_second() is None
    exe = _plan(embedded_runtime)
    assert exe.link_bytes_per_second == DEFAULT_TRANSFER_BYTES_PER_SECOND and not exe.link_measured
    assert "link" not in exe.parallel_summary()


@pytest.mark.distributed
def test_workers_on_two_hosts_are_measured_once_and_the_plan_follows(embedded_runtime, monkeypatch):
    fake_hosts(monkeypatch, embedded_runtime)
    monkeypatch.setattr(embedded_runtime, "_link", None)
    monkeypatch.setattr(tg.config, "min_process_seconds", 0.0)
    monkeypatch.setattr(tg.config, "hop_seconds", 0.0)
    # the real measure, over the workers' loopback TCP
    speed = embedded_runtime.link_bytes_per_second()
    assert speed is not None and 1e7 < speed < 1e12, speed
    calls = []

    def measure(client, a, b, **kw):
        calls.append((a, b))
        return measured[0]

    monkeypatch.setattr(runtime_mod, "_measure_link", measure)
    procs = {}
    for measured in ([1e3], [1e13]):  # a slow link keeps the graph in one process; a fast one spreads it
        monkeypatch.setattr(embedded_runtime, "_link", None)
        exe = _plan(embedded_runtime)
        assert exe.link_bytes_per_second == measured[0] and exe.link_measured
        assert f"(planned for a link of {measured[0] / 1e9:.2g} GB/s between hosts, measured)" in exe.parallel_summary()
        procs[measured[0]] = len({c.proc for c in exe.clusters})
        _plan(embedded_runtime)  # measured once per runtime
    assert procs == {1e3: 1, 1e13: 2}, procs
    assert len(calls) == 2 and all(a != b for a, b in calls)
    # a number set by the user: no measure
    monkeypatch.setattr(embedded_runtime, "_link", None)
    monkeypatch.setattr(tg.config, "transfer_bytes_per_second", 2e9)
    assert _plan(embedded_runtime).link_bytes_per_second == 2e9
    assert len(calls) == 2


@pytest.mark.distributed
def test_a_failed_measure_warns_and_plans_with_the_default(embedded_runtime, monkeypatch):
    fake_hosts(monkeypatch, embedded_runtime)
    monkeypatch.setattr(embedded_runtime, "_link", None)

    def broken(*a, **k):
        raise TimeoutError("no answer in 20 s")

    monkeypatch.setattr(runtime_mod, "_measure_link", broken)
    with pytest.warns(RuntimeWarning, match=r"could not measure the link between workers tcp://.* and tcp://.* "
                                            r"\(TimeoutError: no answer in 20 s\); plans take 1 GB/s"):
        exe = _plan(embedded_runtime)
    assert exe.link_bytes_per_second == DEFAULT_TRANSFER_BYTES_PER_SECOND


@pytest.mark.distributed
def test_the_measure_gives_up_within_its_deadline(embedded_runtime, monkeypatch):
    """A worker that never runs the probe (here: one that is not there) ends the measure after
    LINK_PROBE_TIMEOUT in all, not after a wait per move."""
    import time

    monkeypatch.setattr(runtime_mod, "LINK_PROBE_TIMEOUT", 1.0)
    a = sorted(embedded_runtime.workers())[0]
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        runtime_mod._measure_link(embedded_runtime.client, a, "tcp://127.0.0.1:9")
    assert time.perf_counter() - t0 < 5.0
