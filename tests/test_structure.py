"""Graph structure: deterministic keys, fusion task counts, declared metas and input errors."""

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import _config
from tilegraph._graph import kernel, emit1
from tilegraph.ops._common import new_tensor


def _mlp_graph(rng, tiles=4):
    x = tg.from_numpy(rng.standard_normal((16, 8)).astype(np.float32), (tiles, tiles))
    w1 = tg.from_numpy(rng.standard_normal((8, 12)).astype(np.float32), (tiles, tiles))
    w2 = tg.from_numpy(rng.standard_normal((12, 8)).astype(np.float32), (tiles, tiles))
    loss = (tg.gelu(x @ w1) @ w2).mean()
    return loss, tg.grad(loss, [w1, w2])


def test_same_graph_gives_same_keys(rng):
    loss, grads = _mlp_graph(np.random.default_rng(1))
    again, grads2 = _mlp_graph(np.random.default_rng(1))
    exe1, exe2 = tg.compile([loss, *grads]), tg.compile([again, *grads2])
    assert exe1.lower()[1] == exe1.lower()[1]
    assert exe1.lower()[1] == exe2.lower()[1]
    other, g3 = _mlp_graph(np.random.default_rng(2))  # other values -> other keys
    assert set(tg.compile([other, *g3]).lower()[1]).isdisjoint(exe1.lower()[1])


def test_fusion_reduces_tasks_and_keeps_results(rng):
    loss, grads = _mlp_graph(rng)
    unfused = tg.compile([loss, *grads], fuse=False)
    fused = tg.compile([loss, *grads])
    assert unfused.n_tasks == unfused.n_nodes > 50
    assert fused.n_nodes == unfused.n_nodes
    assert fused.n_tasks <= 2  # a few ms of work: one or two coarse tasks
    a = tg.compute(loss, *grads, fuse=False)
    b = tg.compute(loss, *grads)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_target_seconds_bounds_cluster_size(rng):
    loss, grads = _mlp_graph(rng, tiles=2)
    tiny = tg.compile([loss, *grads], target_seconds=1e-5)
    big = tg.compile([loss, *grads], target_seconds=10.0)
    assert big.n_tasks < tiny.n_tasks
    np.testing.assert_allclose(tg.compute(loss, target_seconds=1e-5)[0], tg.compute(loss)[0], rtol=1e-6)


def test_cluster_graph_is_acyclic_with_parallel_streams(rng):
    # wide graph, small target: several streams with cross edges; dask raises on a cycle
    x = tg.from_numpy(rng.standard_normal((64, 64)), 8)
    y = x
    for _ in range(4):
        y = tg.gelu(y @ x) * 0.1
    exe = tg.compile([y.sum()], target_seconds=1e-4)
    assert exe.n_tasks > 4
    np.testing.assert_allclose(tg.compute(y.sum(), target_seconds=1e-4)[0], tg.compute(y.sum(), fuse=False)[0],
                               rtol=1e-10)


@kernel("test_wrong_shape")
def _wrong(x):
    return x[:1]


def test_computed_tile_must_match_declared_meta(rng):
    x = tg.from_numpy(rng.standard_normal((4, 3)), (2, 3))
    bad = new_tensor(x.tiling, x.dtype, lambda idx: emit1(_wrong, [x.grid[idx]], x.grid[idx].shape, x.dtype,
                                                           op="bad_op"))
    with pytest.raises(tg.TileError, match=r"\[tile kernel test_wrong_shape of op bad_op\] computed tile does "
                                           r"not match its declared meta \(2, 3\) float64; received: \(1, 3\)"):
        bad.numpy()


def test_every_tile_shape_matches_tiling(rng):
    x = tg.from_numpy(rng.standard_normal((7, 5)), (3, 2))
    y = tg.gelu(x) + 1.0
    exe = tg.compile([y])
    vals = exe.run()
    for idx, v in zip(np.ndindex(*y.tiling.grid), vals):
        assert v.shape == y.tiling.tile_shape(idx)
        assert v.dtype == y.dtype


def test_from_numpy_copies_and_roundtrips(rng):
    a = rng.standard_normal((5, 4))
    t = tg.from_numpy(a, (2, 3))
    assert t.chunks == ((2, 2, 1), (3, 1))
    a[:] = 0  # later changes to the caller's array do not reach the graph
    assert np.abs(t.numpy()).sum() > 0


def test_dask_array_roundtrip(rng):
    da = pytest.importorskip("dask.array")
    a = rng.standard_normal((6, 5))
    x = tg.from_dask_array(da.from_array(a, chunks=(4, 5)))
    assert x.chunks == ((4, 2), (5,))
    y = (x * 2.0).to_dask_array()
    assert y.chunks == ((4, 2), (5,))
    np.testing.assert_allclose(y.compute(), 2 * a)


def test_tiling_errors(rng):
    a = rng.standard_normal((4, 6))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.from_numpy\] tile size of dim 1 is larger than the "
                                           r"dimension \(6\).*received: tile size 8 for shape \(4, 6\)"):
        tg.from_numpy(a, (2, 8))
    with pytest.raises(tg.TileError, match=r"one tile size per dimension"):
        tg.from_numpy(a, (2, 2, 2))
    with pytest.raises(tg.TileError, match=r"must be positive"):
        tg.from_numpy(a, (0, 2))


def test_op_input_errors(rng):
    a = tg.from_numpy(rng.standard_normal((4, 6)), (2, 3))
    b = tg.from_numpy(rng.standard_normal((6, 5)), (2, 5))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.matmul\] contraction dim .* must have the same tiles; "
                                           r"received: \(3, 3\) vs \(2, 2, 2\)"):
        a @ b
    with pytest.raises(tg.TileError, match=r"\[tilegraph.matmul\] contraction dims differ"):
        a @ tg.from_numpy(rng.standard_normal((5, 5)))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.add\] shapes do not broadcast; received: \(4, 6\) and \(5,\)"):
        a + tg.from_numpy(rng.standard_normal(5))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.mul\] inputs must share one dtype.*a=float64, b=float32"):
        a * tg.from_numpy(rng.standard_normal((4, 6)).astype(np.float32), (2, 3))
    with pytest.raises(tg.TileError, match=r"\[tilegraph.add\] dim 1 must have the same tiles"):
        a + tg.from_numpy(rng.standard_normal((4, 6)), (2, 2))


_ACTIVE = {"now": 0, "max": 0, "threads": set()}
_ACTIVE_LOCK = __import__("threading").Lock()


def _slow_cost(in_shapes, out_shapes, itemsize, params):
    from tilegraph._graph import Cost

    return Cost(6e9, 0.0)  # ~0.1 s at the cost model's CPU speed


@kernel("test_sleepy", cost=_slow_cost)
def _sleepy(x, *, fail=False):
    import threading
    import time

    with _ACTIVE_LOCK:
        _ACTIVE["now"] += 1
        _ACTIVE["max"] = max(_ACTIVE["max"], _ACTIVE["now"])
        _ACTIVE["threads"].add(threading.get_ident())
    try:
        time.sleep(0.3)  # long enough that a thread woken late under load still finds kernels left
        if fail:
            raise ValueError("boom")
        return x + 1.0
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE["now"] -= 1


def _sleepy_graph(rng, fail_at=None):
    x = tg.from_numpy(rng.standard_normal((8, 3)), (1, 3))  # 8 independent tiles
    return x, new_tensor(x.tiling, x.dtype, lambda idx: emit1(
        _sleepy, [x.grid[idx]], x.grid[idx].shape, x.dtype, op="sleepy", fail=idx[0] == fail_at))


def test_one_task_runs_independent_kernels_on_the_process_threads(rng, monkeypatch):
    monkeypatch.setattr(_config, "usable_cores", lambda: 3)  # the local scheduler's process: 3 threads
    _ACTIVE.update(now=0, max=0, threads=set())
    x, y = _sleepy_graph(rng)
    exe = tg.compile([y], target_seconds=10.0)
    assert exe.n_tasks == 1 and exe.plans[0].prog.threads == 3
    got = tg.compute(y, target_seconds=10.0)[0]
    assert _ACTIVE["max"] == 3 and len(_ACTIVE["threads"]) == 3  # never more kernels than threads
    np.testing.assert_array_equal(got, x.numpy() + 1.0)


_BLAS_SEEN: list = []


def _blas_threads() -> int:
    """The threads of the BLAS libraries tilegraph's kernels call (NumPy's: those loaded when
    tilegraph first limited them; a test loads SciPy's too, which no kernel calls)."""
    from tilegraph.exec.program import blas_controller

    return max(lc.num_threads for lc in blas_controller().lib_controllers if lc.user_api == "blas")


@kernel("test_blas_threads", cost=_slow_cost)
def _record_blas_threads(x):
    _BLAS_SEEN.append(_blas_threads())
    return x + 1.0


def test_kernels_on_several_threads_of_this_process_call_blas_on_one(rng, monkeypatch):
    """A process running a graph itself: where kernels run side by side, each BLAS call keeps to
    one thread (not BLAS's own threads on top of the kernels'); a graph of one kernel at a time
    leaves BLAS its threads; the process's setting comes back after the run."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=2, user_api="blas"):  # as on a 2-core machine, whatever this one has
        monkeypatch.setattr(_config, "usable_cores", lambda: 2)
        before = _blas_threads()
        for n, want in ((4, 1), (1, before)):  # four independent tiles on 2 threads; one tile
            x = tg.from_numpy(rng.standard_normal((n, 3)), (1, 3))
            y = new_tensor(x.tiling, x.dtype, lambda idx: emit1(_record_blas_threads, [x.grid[idx]],
                                                                 x.grid[idx].shape, x.dtype, op="blas"))
            exe = tg.compile([y], target_seconds=10.0)
            assert exe._local_threads() == min(n, 2)
            _BLAS_SEEN.clear()
            np.testing.assert_array_equal(np.concatenate(exe.run()), x.numpy() + 1.0)
            assert _BLAS_SEEN == [want] * n, (n, _BLAS_SEEN)
            assert _blas_threads() == before  # given back


def test_a_failing_kernel_in_a_parallel_task_names_its_op(rng, monkeypatch):
    monkeypatch.setattr(_config, "usable_cores", lambda: 2)
    _, y = _sleepy_graph(rng, fail_at=5)
    with pytest.raises(ValueError, match="boom") as info:
        tg.compute(y, target_seconds=10.0)
    assert any("in tile kernel 'test_sleepy' of op 'sleepy'" in n for n in info.value.__notes__)


def test_weight_gradients_are_per_row_tile_products_plus_a_sum(rng, monkeypatch):
    x = tg.from_numpy(rng.standard_normal((3, 8, 6)), (1, 8, 6))   # three row tiles
    w = tg.from_numpy(rng.standard_normal((6, 5)), (6, 5))
    (gw,) = tg.grad((x @ w).sum(), [w])
    kinds = sorted(n.kernel.name for n in tg.compile([gw]).clusters[0].nodes if n.kernel.name != "expand")
    assert kinds.count("matmul_tn") == 3 and "reduce_sum" in kinds
    monkeypatch.setattr(tg.config, "split_weight_grads", False)
    (gw1,) = tg.grad((x @ w).sum(), [w])
    assert [n.kernel.name for n in tg.compile([gw1]).clusters[0].nodes].count("matmul_tn") == 1
    np.testing.assert_allclose(gw.numpy(), gw1.numpy(), rtol=1e-12)


def test_small_leaf_values_travel_inside_their_tasks(rng):
    from tilegraph._lower import INLINE_MAX_BYTES

    small = tg.from_numpy(rng.standard_normal((4, 4)).astype(np.float32))
    big = tg.from_numpy(rng.standard_normal((INLINE_MAX_BYTES // 4 + 1,)).astype(np.float32))
    exe = tg.compile([(small * 2.0).sum(), (big * 2.0).sum()])
    layers, _ = exe.lower()
    assert [v.nbytes for v in layers["data"].values()] == [big.size * 4]  # a data task only for the big one
    args = [a for task in layers["cpu"].values() for a in task[3:]]
    assert any(a is small.grid[0, 0].node.cell.value for a in args)  # the small array is in its task
    got = tg.compute((small * 2.0).sum(), (big * 2.0).sum())
    np.testing.assert_allclose(got[0], 2 * small.numpy().sum(), rtol=1e-5)
    np.testing.assert_allclose(got[1], 2 * big.numpy().sum(), rtol=1e-5)


def test_tasks_of_tiny_kernels_run_on_one_thread(rng, monkeypatch):
    monkeypatch.setattr(_config, "usable_cores", lambda: 3)
    x = tg.from_numpy(rng.standard_normal((8, 3)), (1, 3))  # 8 independent tiles of 3 numbers
    y = x * 2.0 + 1.0
    exe = tg.compile([y])
    assert exe.n_tasks == 1 and exe.plans[0].prog.threads == 1  # handing them between threads costs more
    monkeypatch.setattr(tg.config, "thread_handoff_seconds", 0.0)
    assert tg.compile([y]).plans[0].prog.threads == 1  # their time is all Python, which one thread runs at a time
    monkeypatch.setattr(tg.config, "kernel_gil_seconds", 0.0)
    assert tg.compile([y]).plans[0].prog.threads == 3
    np.testing.assert_allclose(tg.compute(y)[0], x.numpy() * 2 + 1)


def test_a_task_of_millisecond_kernels_keeps_all_the_threads_of_a_16_core_process(rng, monkeypatch):
    """What one process's threads cannot do at once is hold the GIL: a kernel of a few ms holds it
    for a small part of its time, so 16 threads do not wait for each other, however many
    kernels (the block stack's step: 5,231 kernels on 16 threads, where a cost of 20 us per
    kernel and per extra thread had kept 8 and left half of the cores idle). Kernels of 10 us
    are all Python: one thread."""
    from tilegraph.plan import cluster

    x = tg.from_numpy(rng.standard_normal((640, 3)), (1, 3))  # 640 independent tiles
    exe = tg.compile([x * 2.0], target_seconds=1e3)
    nodes = exe.clusters[0].nodes
    assert len(nodes) == 640
    for seconds, threads in ((2e-3, 16), (1e-5, 1)):
        monkeypatch.setattr(cluster, "est_seconds", lambda n, s=seconds: s)
        assert cluster.threads_worth_using(nodes, 16) == threads
    # the GIL's share decides: kernels of 2 ms that held it 1 ms each would keep 2 threads busy
    monkeypatch.setattr(cluster, "est_seconds", lambda n: 2e-3)
    monkeypatch.setattr(tg.config, "kernel_gil_seconds", 1e-3)
    assert cluster.threads_worth_using(nodes, 16) == 2


def test_a_task_keeps_no_more_threads_than_its_kernels_can_use(rng, monkeypatch):
    """On a process of 16 threads: tiny kernels run on one thread (handing them between threads
    costs more than it gains, and more with every thread); 3 slow kernels that can run at once
    hold at most the 4 threads of the next power of two, not 16; 8 of them, all 16 would wait."""
    from tilegraph.plan.cluster import list_span, threads_worth_using

    monkeypatch.setattr(_config, "usable_cores", lambda: 16)
    x = tg.from_numpy(rng.standard_normal((8, 3)), (1, 3))
    assert tg.compile([x * 2.0 + 1.0]).plans[0].prog.threads == 1
    for n, most in ((3, 4), (8, 8)):
        x = tg.from_numpy(rng.standard_normal((n, 3)), (1, 3))
        slow = new_tensor(x.tiling, x.dtype, lambda idx: emit1(_sleepy, [x.grid[idx]], x.grid[idx].shape, x.dtype,
                                                                op="sleepy"))
        exe = tg.compile([slow], target_seconds=10.0)
        assert exe.n_tasks == 1 and exe.plans[0].prog.threads == most
        nodes = exe.clusters[0].nodes
        times = [0.1] * len(nodes)
        assert list_span(nodes, times, 1) == pytest.approx(0.1 * n)
        assert list_span(nodes, times, 2) == pytest.approx(0.1 * -(-n // 2))
        assert threads_worth_using(nodes, 2) == 2 and threads_worth_using(nodes, 1) == 1


def test_work_spreads_over_processes_only_when_each_gets_enough(rng):
    from tilegraph._lower import by_upward_rank, cluster_nodes, place
    from tilegraph._graph import topo_order

    _, y = _sleepy_graph(rng)  # 8 independent kernels of ~0.05 s each (estimated)
    nodes = [n for n in topo_order(list(y.grid.flat)) if not n.is_leaf]
    place(nodes, "cpu", False)
    total = sum(n.cost.flops for n in nodes) / tg.config.speeds["cpu"][0]

    def procs(min_seconds):
        tg.config.min_process_seconds, old = min_seconds, tg.config.min_process_seconds
        try:
            clusters, _, _ = cluster_nodes(by_upward_rank(nodes), {"cpu": [1, 1, 1, 1]}, 10.0, True)
        finally:
            tg.config.min_process_seconds = old
        return {c.proc for c in clusters}

    assert procs(0.99 * total / 4) == {0, 1, 2, 3}  # a quarter each: all four processes
    assert procs(0.99 * total / 2) == {0, 1}        # a half each: two
    assert procs(total * 2) == {0}                  # not enough for two: one process, no hops


def test_task_names_say_which_part_of_the_model_and_which_phase():
    """Dask names tasks by the alphabetic words at the start of their keys: a step's tasks read as
    the module path and phase of most of their work (``tg-blocks-attn-fwd``), the layer index
    follows, and the optimizer's tasks read as updates."""
    from dask.utils import key_split

    from tilegraph import models

    model = models.build("gpt2-debug", seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    ids = np.zeros((2, 16), np.int64)
    step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(1, 8)] * 2,
                        fuse=False)  # one task per kernel: every kernel's own name
    exe = step.plan(ids, ids)
    _, keys = exe.lower()
    prefixes = {key_split(k) for k in keys}
    assert {"tg-blocks-attn-fwd", "tg-blocks-attn-bwd", "tg-blocks-ln-fwd", "tg-optimizer-update"} <= prefixes, prefixes
    assert {"tg-blocks-mlp-fc-fwd", "tg-blocks-mlp-fc-bwd"} <= prefixes  # blocks.0.mlp.fc1, fc2
    # the layer index stays in the key
    assert any(k.startswith("tg-blocks-attn-fwd-1-") for k in keys)
    # and a fused task is named after the largest part of its work
    fused = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(1, 8)] * 2)
    assert all(key_split(k).startswith("tg-") and len(key_split(k)) > 3 for k in fused.plan(ids, ids).lower()[1])


@pytest.mark.parametrize("kwargs, received", [({"fuse": "all"}, "'all'"), ({"fuse": 1}, "1"),
                                              ({"target_seconds": 0}, "0"), ({"target_seconds": "1"}, "'1'"),
                                              ({"target_seconds": float("nan")}, "nan")])
def test_compile_refuses_options_of_the_wrong_kind(kwargs, received):
    # a string fuse was truthy (fused) and a non-positive target cut every kernel into a task of its own
    a = tg.from_numpy(np.ones((4, 6), np.float32), tiles=(2, 3))
    with pytest.raises(tg.TileError) as e:
        tg.compile([a * 2], **kwargs)
    assert str(e.value).startswith("[tilegraph.compile] ") and str(e.value).endswith(f"received: {received}")


def _new_token(_=None) -> str:
    from tilegraph._graph import Cell

    return Cell(None, (1,), np.float32).token


def test_cells_made_in_other_processes_get_other_tokens():
    """A cell's token was "cell<counter>", and each process counts from 0: a model pickled for a
    worker's task (generate on a cluster) kept its client tokens beside the worker's own cells of
    the same tokens, and the worker's local run, which keys values by token, fed a KV-cache tile
    where a weight was due (GPT-2 124M: a matmul of 64 rows against 768)."""
    import multiprocessing

    here = _new_token()
    for method in ("spawn", "fork"):
        with multiprocessing.get_context(method).Pool(1) as pool:
            there = pool.map(_new_token, [0])[0]
        assert there.split("-")[0] != here.split("-")[0], (method, here, there)
    assert _new_token() != here and _new_token().split("-")[0] == here.split("-")[0]


def test_arrays_dask_delivers_at_odd_addresses_are_realigned_before_kernels_read_them():
    """Dask packs a message's small frames into one buffer: an array a worker receives can start
    at any byte (a scattered GPT-2 embedding tile started at byte 42 of 64), and NumPy's matmul
    on it ran 3x slower (decoding on a cluster: 25% slower per token than here)."""
    from tilegraph.exec.program import _to_device, realigned

    raw = np.zeros(4 * 12 + 1, np.uint8)
    odd = np.frombuffer(raw[1:].data, dtype=np.float32).reshape(3, 4)
    assert not odd.flags.aligned
    fixed = realigned(odd)
    assert fixed.flags.aligned and fixed is not odd and np.array_equal(fixed, odd)
    even = np.ones((3, 4), np.float32)
    assert realigned(even) is even and _to_device(even, "cpu", "numpy") is even
    assert _to_device(odd, "cpu", "numpy").flags.aligned
    assert realigned((1, 2)) == (1, 2)  # (not an array: as it is)
