"""Long runs and repeated use in one process: what a notebook kernel that lives for days keeps.

1. Every ``connect()`` / ``close()`` of the embedded cluster kept its scheduler and nannies alive
   for good: Dask memoizes per comm handler (a bound method) whether it takes a comm
   (``distributed.core._expects_comm``), so every closed scheduler stayed, with its task groups,
   spans, log of up to 10,000 records and one more handler on the ``distributed.scheduler``
   logger (+15,800 Python blocks and +1.4 MB per cycle of a 200-step fit and 100 computes).
2. Every graph run on an idle cluster (``tg.compute``, ``generate``, a checkpoint's save and load,
   a ``Decoder``'s token) left a Dask span on the scheduler, with its task groups, for the life
   of the cluster, and ~8 metric entries on the worker that ran it (3,000 computes: 3,000 spans,
   +87 blocks and +6.5 KB per call in the scheduler's process, +28 blocks and +2.7 KB per call on
   the worker). The scheduler now keeps the first and the newest ``SPANS_KEPT`` finished spans
   (the metrics of the others added to the first, so the dashboard's totals stay whole) and a
   worker folds its span metrics into span-less ones past ``WORKER_DIGESTS_KEPT`` entries.
"""

import gc
import logging
import time
import weakref
from collections import defaultdict

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.runtime import worker_setup
from tilegraph.runtime.worker_setup import SPANS_KEPT, WORKER_DIGESTS_KEPT, fold_span_digests

pytestmark = pytest.mark.distributed


def _deque_handlers() -> int:
    from distributed.utils import DequeHandler

    return sum(isinstance(h, DequeHandler) for h in logging.getLogger("distributed.scheduler").handlers)


def _one_worker():
    return tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)


def test_a_closed_embedded_cluster_leaves_nothing_of_its_scheduler_in_this_process():
    handlers = _deque_handlers()
    schedulers, nannies = [], []
    for _ in range(2):
        rt = _one_worker()
        try:
            with rt.as_current():
                x = tg.from_numpy(np.arange(16.0).reshape(4, 4), (2, 2))
                (total,) = tg.compute((x * 2).sum())
            assert total == 240.0
            schedulers.append(weakref.ref(rt.cluster.scheduler))
            nannies += [weakref.ref(n) for n in rt.cluster.workers.values()]
        finally:
            rt.close()
        del rt
    gc.collect()
    # before: both schedulers (and their nannies) alive, one more log handler each
    assert [s() for s in schedulers] == [None, None]
    assert nannies[0]() is None  # (the last cycle's nanny may wait for its event loop's next turn)
    assert _deque_handlers() <= handlers


@pytest.fixture(scope="module")
def one_worker():
    rt = _one_worker()
    yield rt
    rt.close()


def _spans(dask_scheduler) -> dict:
    ext = dask_scheduler.extensions["spans"]
    merged = ext.merge_all().cumulative_worker_metrics
    by_span = sum(v for k, v in merged.items() if k[0] == "execute" and k[-1] == "seconds" and k[1] != "N/A")
    total = sum(v for k, v in dask_scheduler.cumulative_worker_metrics.items()
                if isinstance(k, tuple) and k[0] == "execute" and k[-1] == "seconds")
    return {"spans": len(ext.spans), "roots": len(ext.root_spans), "by_span": by_span, "total": total,
            "groups": sum(len(s.groups) for s in ext.spans.values())}


def _digests(dask_worker) -> int:
    return len(dask_worker.digests_total)


def _forget_but_newest(dask_scheduler) -> int:
    return worker_setup.forget_spans(dask_scheduler, keep=1)


async def _heartbeat(dask_worker) -> None:
    await dask_worker.heartbeat()


def test_spans_and_worker_metrics_stay_bounded_over_many_small_graphs(one_worker):
    """300 computes on an idle cluster (a span each): the scheduler keeps at most the first and
    the newest SPANS_KEPT finished spans (it forgets in passes, one per SPANS_KEPT graphs), and
    their metrics sum to all of the run's, as Dask's own cluster-wide totals count them."""
    client = one_worker.client
    x = tg.from_numpy(np.arange(64.0).reshape(8, 8), (4, 4))
    with one_worker.as_current():
        for i in range(3 * SPANS_KEPT):
            (v,) = tg.compute((x * float(i)).sum())
            assert v == 2016.0 * i
    client.run(_heartbeat)  # the last tasks' metrics reach the scheduler
    state = client.run_on_scheduler(_spans)
    assert state["roots"] <= 2 * SPANS_KEPT + 1, state  # before: 300 and more
    assert state["groups"] <= 2 * (2 * SPANS_KEPT + 1), state
    assert state["by_span"] == pytest.approx(state["total"], rel=1e-9), state
    (digests,) = client.run(_digests).values()
    assert digests <= WORKER_DIGESTS_KEPT + 50, digests  # before: ~8 more per compute, for good

    # spans forgotten before their worker reported their last metrics: those still count
    def roots_left() -> int:
        client.run_on_scheduler(_forget_but_newest)
        return client.run_on_scheduler(_spans)["roots"]

    with one_worker.as_current():
        for i in range(5):
            tg.compute((x * float(i)).sum())
            roots_left()
    client.run(_heartbeat)
    deadline = time.monotonic() + 10
    while roots_left() > 2:  # (the release of the last tasks may still be on its way)
        assert time.monotonic() < deadline, client.run_on_scheduler(_spans)
        time.sleep(0.05)
    state = client.run_on_scheduler(_spans)
    assert state["by_span"] == pytest.approx(state["total"], rel=1e-9), state


def test_a_span_whose_task_group_is_alive_is_kept():
    """A future held from the first graphs keeps its span: a later task of its group looks it up."""
    rt = _one_worker()
    try:
        client = rt.client
        held = client.submit(lambda: 1, key="leaks-held-1")
        assert held.result() == 1
        for i in range(SPANS_KEPT + 3):
            assert client.submit(lambda i=i: i, key=f"leaks-other-{i}", pure=False).result() == i
        ext = rt.cluster.scheduler.extensions["spans"]
        worker_setup.forget_spans(rt.cluster.scheduler, keep=1)
        assert len(ext.root_spans) <= 3  # the first, the held group's, the newest
        # a task of the held task group: its span must still be there
        assert client.submit(lambda: 2, key="leaks-held-2").result() == 2
        del held
    finally:
        rt.close()


def test_a_worker_folds_its_span_metrics_keeping_their_sums():
    class Worker:
        digests_total = defaultdict(int)
        digests_max = defaultdict(int)

    w = Worker()
    for span in range(30):
        for activity in ("thread-cpu", "kernel:matmul"):
            key = ("execute", f"span-{span}", "tg-step", activity, "seconds")
            w.digests_total[key] += 0.5 + span
            w.digests_max[key] = 0.5 + span
    w.digests_total["tick-duration"] += 1.0
    w.digests_total[("gather-dep", "busy", "seconds")] += 2.0
    assert not fold_span_digests(w, limit=100)  # under the limit: left as it is
    assert fold_span_digests(w, limit=10)
    assert dict(w.digests_total) == {
        ("execute", None, "tg-step", "thread-cpu", "seconds"): sum(0.5 + s for s in range(30)),
        ("execute", None, "tg-step", "kernel:matmul", "seconds"): sum(0.5 + s for s in range(30)),
        "tick-duration": 1.0, ("gather-dep", "busy", "seconds"): 2.0}
    assert dict(w.digests_max) == {("execute", None, "tg-step", a, "seconds"): 29.5
                                   for a in ("thread-cpu", "kernel:matmul")}


@pytest.mark.distributed
def test_the_embedded_cluster_scales_up_with_workers_like_its_own():
    """``rt.cluster.scale(n)`` on the embedded cluster: before, Dask logged "TypeError: 'NoneType'
    object is not subscriptable" (the cluster had no worker template), no worker came, and
    ``wait_for_workers`` waited without end. The new worker listens on 127.0.0.1 as the others,
    with their threads, and computes."""
    import numpy as np

    with tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False) as rt:
        rt.cluster.scale(2)
        rt.client.wait_for_workers(2, timeout=60)
        workers = rt.client.scheduler_info()["workers"]
        assert len(workers) == 2 and all(a.startswith("tcp://127.0.0.1:") for a in workers), workers
        assert {w["nthreads"] for w in workers.values()} == {1}
        with rt.as_current():
            x = tg.from_numpy(np.arange(8.0), tiles=(4,))
            np.testing.assert_array_equal((x * 2).numpy(), np.arange(8.0) * 2)
