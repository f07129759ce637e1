"""Data parallelism: the graph rewrite, and training on worker processes that each hold a replica."""

import uuid

import numpy as np
import pytest

import tilegraph as tg
from conftest import fresh_transfer_logs
from tilegraph._graph import ReplicatedRef, topo_order
from tilegraph._train import _batch_inputs
from tilegraph.parallel import batch_groups, split_replicas


from conftest import mse
from test_train import _data as _regression  # the MLP regression task of the training tests


def _data(n=40, seed=0):
    return _regression(seed=seed, n=n)


def _step(runtime=None, clip=1.0, row_tile=8, **options):
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-2, 3, 50), weight_decay=0.1,
                         clip_grad_norm=clip)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(row_tile, 8), (row_tile, None)], runtime=runtime, **options)
    return model, step


# ------------------------------------------------------------------------------ the rewrite ----
@pytest.mark.parametrize("replicas, rows", [(2, 4), (2, 5), (3, 5)])  # even and ragged shares
def test_rewrite_keeps_each_share_on_its_replica_and_moves_only_partial_sums(replicas, rows):
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0)
    params = model.parameters()
    x, y = _data(n=8 * rows)
    inputs, (xt, yt) = _batch_inputs([x, y], [(8, 8), (8, None)], "test")
    loss = mse(model, xt, yt)
    grads = tg.grad(loss, params)
    roots = [loss.grid.flat[0]] + [r for g in grads for r in g.grid.flat]
    cells = [c for _, c in inputs]
    groups = batch_groups(cells, replicas)
    assert sorted(set(groups.values())) == list(range(replicas))
    dp = split_replicas(roots, replicated=range(1, len(roots)), groups=groups, replicas=replicas)

    assert len(dp.roots[0]) == 1 and all(len(refs) == replicas for refs in dp.roots[1:])
    for refs in dp.roots[1:]:  # every replica makes each gradient tile itself
        assert [dp.replica[id(r.node)] for r in refs] == list(range(replicas))
    moved = 0
    for n in dp.nodes:
        p = dp.replica[id(n)]
        for i in n.inputs:
            if i.node.is_leaf:  # a batch tile is read only by its own replica
                assert groups.get(id(i.node.cell), p) == p
            elif dp.replica[id(i.node)] != p:
                assert id(n) in dp.exchange  # values cross replicas only into the exchange phase
                moved += i.nbytes
    # each replica fetches one partial per gradient tile from each other replica, plus a partial
    # loss for replica 0
    grad_bytes = sum(r.nbytes for r in roots[1:])
    assert grad_bytes * replicas * (replicas - 1) <= moved <= grad_bytes * replicas * (replicas - 1) + 64 * replicas
    # and nothing in the compute phase depends on the exchange (one step: it all comes after)
    assert not any(id(i.node) in dp.exchange for n in dp.nodes if id(n) not in dp.exchange for i in n.inputs)


def test_rewrite_reuses_nodes_that_need_no_copy():
    """Nodes of one replica's share are not duplicated: only what several replicas need is."""
    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0)
    x, y = _data(n=32)
    inputs, (xt, yt) = _batch_inputs([x, y], [(8, 8), (8, None)], "test")
    loss = mse(model, xt, yt)
    grads = tg.grad(loss, model.parameters())
    roots = [loss.grid.flat[0]] + [r for g in grads for r in g.grid.flat]
    before = [n for n in topo_order(roots) if not n.is_leaf]
    dp = split_replicas(roots, replicated=range(1, len(roots)), groups=batch_groups([c for _, c in inputs], 2),
                        replicas=2)

    def count(nodes):
        out = {}
        for n in nodes:
            out[n.kernel.name] = out.get(n.kernel.name, 0) + 1
        return out

    # the forward and backward kernels exist once; the added nodes are sums: per gradient tile a
    # partial sum on each replica (2 x 2 row tiles here) and a second copy of the final sum
    added = {k: v - count(before).get(k, 0) for k, v in count(dp.nodes).items()}
    assert {k for k, v in added.items() if v} == {"reduce_sum"}
    assert added["reduce_sum"] <= 3 * (len(roots) - 1) + 3


# ------------------------------------------------------------------------ on the cluster ----
pytestmark_dist = pytest.mark.distributed


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
@pytest.mark.parametrize("rows, clip", [(40, 1.0), (36, None)])  # 5 row tiles (3 + 2), and a ragged last tile
def test_data_parallel_training_matches_one_process(embedded_runtime, rows, clip, strategy):
    x, y = _data(n=rows)
    local_model, local_step = _step(clip=clip)
    local = [local_step(x, y) for _ in range(6)]
    model, step = _step(runtime=embedded_runtime, clip=clip, parallel=strategy)
    losses = [step(x, y) for _ in range(6)]
    exe = step.plan(x, y)
    assert exe.strategy == strategy and exe.n_replicas == 2
    # the summation order of the gradients differs (each replica sums its share first)
    np.testing.assert_allclose(losses, local, rtol=2e-5)
    for p, lp in zip(model.parameters(), local_model.parameters()):
        for c, lc in zip(p.cells.flat, lp.cells.flat):
            if strategy == "zero3":  # one value, on its owner only
                assert not isinstance(c.value, ReplicatedRef) or len({r.future.key for r in c.value.replicas}) == 1
                np.testing.assert_allclose(c.value.future.result()[c.value.index], lc.value, rtol=1e-4, atol=1e-6)
                continue
            assert isinstance(c.value, ReplicatedRef) and len(c.value.replicas) == 2
            copies = embedded_runtime.client.gather([r.future for r in c.value.replicas])
            a, b = (v[r.index] for v, r in zip(copies, c.value.replicas))
            np.testing.assert_array_equal(a, b)  # the replicas stay bitwise equal
            np.testing.assert_allclose(a, lc.value, rtol=1e-4, atol=1e-6)
    state = [c.value for grids in step.optimizer.state_cells for g in grids for c in g.flat]
    if strategy in ("sharded", "zero3"):
        # each parameter updated by its owner, and ("sharded") sent to the other process as soon
        # as it is (a copy per process, bitwise equal: checked above); the optimizer state only
        # on its owner, and each worker owns about half of it
        if strategy == "sharded":
            assert all(len({r.future.key for r in c.value.replicas}) == 2
                       for p in model.parameters() for c in p.cells.flat)
        assert not any(isinstance(v, ReplicatedRef) for v in state)
        who = embedded_runtime.client.who_has([v.future for v in state])
        held = {}
        for v in state:
            [w] = who[v.future.key]
            held[w] = held.get(w, 0) + 1
        assert len(held) == 2 and min(held.values()) >= 0.3 * len(state)
    else:
        assert all(isinstance(v, ReplicatedRef) for v in state)
    with embedded_runtime.as_current():  # reading parameters (checkpoints, state_dict) takes replica 0
        state = model.state_dict()
    for k, v in local_model.state_dict().items():
        np.testing.assert_allclose(state[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.distributed
def test_each_replica_runs_its_tasks_on_its_own_worker(embedded_runtime, monkeypatch):
    """(Written as Dask tasks: a gang runs them all in one task per process, tests/test_gang.py.)"""
    from distributed import get_task_stream

    monkeypatch.setattr(tg.config, "exchange", "tasks")

    x, y = _data()
    _, step = _step(runtime=embedded_runtime, parallel="data")
    step(x, y)
    exe = step.plan(x, y)
    workers = sorted(embedded_runtime.workers())
    assert sorted(set(exe.worker_of.values())) == workers and len(exe.worker_of) == exe.n_tasks
    # the compute lane of each replica (its forward and backward) and its exchange lane
    assert {exe.process_of(c) for c in exe.clusters} == {0, 1}
    assert {c.proc for c in exe.clusters} == {0, 1, 2, 3}
    from distributed import wait

    with get_task_stream(embedded_runtime.client) as ts:
        step(x, y)  # returns with the loss: other replicas' updates may still run
        wait([r.future for p in step.optimizer.params for c in p.cells.flat for r in c.value.replicas])
    layers, keys = exe.lower()
    ran = {t["key"]: t["worker"] for t in ts.data}
    for c, key in zip(exe.clusters, keys):
        prefix = key.rsplit("-", 1)[0]  # keys get a fresh token every call
        [worker] = {w for k, w in ran.items() if isinstance(k, str) and k.rsplit("-", 1)[0] == prefix}
        assert worker == exe.worker_of[c.id]


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded"])
def test_data_parallel_groups_accumulation_and_evaluation(embedded_runtime, strategy):
    x, y = _data(n=32)
    batches = [_data(n=32, seed=s) for s in range(4)]
    # several steps in one graph are exactly those steps one at a time
    _, one = _step(runtime=embedded_runtime, parallel=strategy)
    singles = [one(*b) for b in batches]
    model, grouped = _step(runtime=embedded_runtime, parallel=strategy)
    pending = grouped.submit_steps(batches)
    assert grouped.plan(*batches[0]).strategy == strategy
    np.testing.assert_array_equal([p.result() for p in pending], singles)
    # gradient accumulation over replicated (or sharded) accumulators matches one big batch
    _, big = _step(runtime=embedded_runtime, parallel=strategy, row_tile=4)
    _, acc = _step(runtime=embedded_runtime, parallel=strategy, row_tile=4, accum_steps=2)
    np.testing.assert_allclose([acc(x, y) for _ in range(3)], [big(x, y) for _ in range(3)], rtol=2e-5)
    # evaluation reads the replicas where they are
    ev = tg.EvalStep(model, mse, batch_tiles=[(8, 8), (8, None)], runtime=embedded_runtime)
    local_model, local_step = _step()
    for b in batches:
        local_step(*b)
    want = tg.EvalStep(local_model, mse, batch_tiles=[(8, 8), (8, None)])(x, y)
    np.testing.assert_allclose(ev(x, y), want, rtol=1e-5)


def _stack(d: int = 256):
    """A block-stack-like model (LayerNorm + GELU MLP, twice) and its AdamW."""

    class Stack(tg.nn.Module):
        def __init__(self):
            self.norms = [tg.nn.LayerNorm(d) for _ in range(2)]
            self.mlps = [tg.nn.MLP(d, 4 * d, act="gelu_tanh", seed=i) for i in range(2)]

        def forward(self, x):
            for norm, mlp in zip(self.norms, self.mlps):
                x = x + mlp(norm(x))
            return x

    model = Stack()
    return model, tg.optim.AdamW(model.parameters(), lr=1e-4)


@pytest.mark.distributed
def test_auto_takes_sharded_data_parallelism_for_a_large_enough_step(embedded_runtime):
    """The block stack of the benchmark: "auto" plans both and keeps data parallelism with
    sharded state (measured there at 0.84-0.99 of one process with 2 threads, the tiles plan at
    0.83)."""
    model, opt = _stack()
    x = np.zeros((4, 256, 256), np.float32)
    step = tg.TrainStep(model, opt, mse, batch_tiles=[(2, None, None)] * 2, runtime=embedded_runtime)
    assert step.plan(x, x).strategy == "sharded"
    tiles = tg.TrainStep(model, opt, mse, batch_tiles=[(2, None, None)] * 2, runtime=embedded_runtime,
                         parallel="tiles")
    assert tiles.plan(x, x).strategy == "tiles" and tiles.plan(x, x).n_replicas == 1


@pytest.mark.distributed
def test_auto_takes_sharded_where_the_tiles_plan_spans_processes():
    """2 processes x 8 threads (declared: the plans are made, not run): the tiles plan spans both
    processes, and the simulation leaves out what a tiles plan costs across processes; measured
    on 16 cores, sharded beat it at 2 x 8, 4 x 4 and 8 x 2 (config.parallel), so "auto" keeps
    sharded. (Its simulation finished first until the data-parallel plans ran each replica's
    weight-gradient products during its backward, and the replicas' work side by side.)"""
    model, opt = _stack()
    x = np.zeros((16, 256, 256), np.float32)
    with tg.connect(n_workers=2, threads_per_worker=8, dashboard=False, quiet=True) as rt:
        plans = {p: tg.TrainStep(model, opt, mse, batch_tiles=[(1, None, None)] * 2, runtime=rt,
                                 parallel=p).plan(x, x) for p in ("tiles", "sharded", "auto")}
    assert len({c.proc for c in plans["tiles"].clusters}) == 2
    assert plans["auto"].strategy == "sharded"


def test_strategy_names_and_where_data_parallelism_does_not_apply():
    x, y = _data()
    with pytest.raises(tg.TileError, match=r"parallel must be one of 'auto', 'tiles', 'data', 'sharded', 'zero3'.*received: 'ddp'"):
        _step(parallel="ddp")[1](x, y)
    # one process (the local scheduler): nothing to split over, and a warning says so (an explicit
    # strategy that did nothing was silent)
    _, step = _step(parallel="data")
    with pytest.warns(UserWarning, match=r"parallel='data' shares the batch among worker processes.*runs as "
                                         r"parallel='tiles'") as caught:
        step(x, y)
    assert [w.filename for w in caught] == [__file__]  # the user's line (it named tilegraph's _lower.py)
    assert step.plan(x, y).strategy == "tiles"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded"])
def test_a_data_parallel_step_asked_for_on_a_batch_of_one_row_tile_is_refused(embedded_runtime, strategy):
    """Two worker processes and parallel="data"/"sharded", but one row tile to share: a clear
    error, not a quiet single-process plan; "auto" plans one."""
    x, y = _data(n=8)
    _, step = _step(runtime=embedded_runtime, parallel=strategy)
    with pytest.raises(tg.TileError, match=rf"parallel='{strategy}' gives each of the 2 worker processes a share of "
                                           r"the batch's row tiles.*at least 2 row tiles.*received: a batch of 1 row tile"):
        step.plan(x, y)
    # (what to give: row tiles of at most 4 of its 8 rows, or none)
    with pytest.raises(tg.TileError, match=r"at most 4 rows, the first size of each array's tiling; or no batch_tiles"):
        step.plan(x, y)
    _, step = _step(runtime=embedded_runtime, parallel="auto")
    assert step.plan(x, y).n_replicas == 1


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded", "zero3"])
def test_a_data_parallel_step_without_batch_tiles_gives_each_process_a_row_tile(embedded_runtime, strategy):
    """Asked for by name with no batch_tiles (one tile per array before, so refused): each
    batch array's rows are cut in a tile per process (7 rows: 4 + 3), and it trains as one
    process does on the same batch. "auto" and "tiles" keep one tile."""
    x, y = _data(n=7)
    local_model = tg.nn.MLP(16, 24, out_dim=4, seed=0)
    local = tg.TrainStep(local_model, tg.optim.AdamW(local_model.parameters(), lr=3e-2), mse)
    want = [local(x, y) for _ in range(3)]
    model = tg.nn.MLP(16, 24, out_dim=4, seed=0)
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=3e-2), mse, runtime=embedded_runtime,
                        parallel=strategy)
    got = [step(x, y) for _ in range(3)]
    exe = step.plan(x, y)
    assert exe.strategy == strategy and exe.n_replicas == 2
    np.testing.assert_allclose(got, want, rtol=2e-5)
    evaluate = tg.EvalStep(model, mse, runtime=embedded_runtime, parallel=strategy)
    np.testing.assert_allclose(evaluate(x, y), tg.EvalStep(local_model, mse)(x, y), rtol=2e-5)
    for other in ("auto", "tiles"):
        step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=3e-2), mse, runtime=embedded_runtime,
                            parallel=other)
        assert step.plan(x, y).n_replicas == 1


@pytest.mark.distributed
def test_buckets_cut_the_backward_without_changing_a_bit(embedded_runtime, monkeypatch):
    """Smaller buckets make more, smaller tasks (each bucket's gradients leave while the backward
    goes on); the arithmetic is the same, so the losses are bitwise equal."""
    x, y = _data()
    results = []
    for bucket in (float("inf"), 1.0):
        monkeypatch.setattr(tg.config, "bucket_bytes", bucket)
        _, step = _step(runtime=embedded_runtime, parallel="data")
        results.append(([step(x, y) for _ in range(4)], step.plan(x, y).n_tasks))
    (one, tasks_one), (many, tasks_many) = results
    assert tasks_many > tasks_one
    assert one == many


@pytest.mark.distributed
def test_gradients_go_in_buckets_by_default_only_where_the_workers_span_hosts(embedded_runtime, monkeypatch):
    """bucket_bytes="auto": one exchange after the backward on one host (a transfer there takes
    the CPU from the kernels it overlaps), buckets of AUTO_BUCKET_BYTES between hosts (the link is
    the bottleneck); a number set by the user holds everywhere."""
    from conftest import fake_hosts
    from tilegraph import _config

    monkeypatch.setattr(tg.config, "transfer_bytes_per_second", 1e9)  # the same plan costs on both layouts
    monkeypatch.setattr(_config, "AUTO_BUCKET_BYTES", 1.0)  # this small model's gradients: one bucket each
    x, y = _data()

    def plan():
        _, step = _step(runtime=embedded_runtime, parallel="data")
        return step.plan(x, y)

    assert tg.config.bucket_bytes == "auto"
    one = plan()
    assert not one.across_hosts and one.bucket_bytes == float("inf")
    fake_hosts(monkeypatch, embedded_runtime)
    apart = plan()
    assert apart.across_hosts and apart.bucket_bytes == 1.0
    assert apart.n_tasks > one.n_tasks  # the backward cut at each bucket
    assert "buckets" not in one.parallel_summary()
    assert "gradients sent in buckets of 1e-06 MB during the backward" in apart.parallel_summary()
    monkeypatch.setattr(tg.config, "bucket_bytes", float("inf"))
    assert plan().n_tasks == one.n_tasks


@pytest.mark.distributed
def test_a_sharded_step_moves_as_many_bytes_as_a_data_parallel_one_on_two_processes(embedded_runtime):
    """What a step moves between processes (bench_scale's MB/step, the gang's room in /dev/shm):
    on 2 processes each sends the other its gradients (data: all of them; sharded: those the
    other owns) and, sharded, the parameters it updated, so both move the same bytes; zero3's
    tasks fetch each parameter for the forward and again for the backward. bench_scale showed
    sharded at half data's: the parameters sent after the update were not counted."""
    model, opt = _stack()
    x = np.zeros((4, 64, 256), np.float32)
    plans = {p: tg.TrainStep(model, opt, mse, batch_tiles=[(2, None, None)] * 2, runtime=embedded_runtime,
                             parallel=p).plan(x, x) for p in ("data", "sharded", "zero3")}
    params = sum(c.value.nbytes for p in model.parameters() for c in p.cells.flat)
    assert plans["data"].strategy == "data" and plans["sharded"].strategy == "sharded"
    assert plans["data"].step_bytes() == plans["data"].cross_bytes()
    assert plans["sharded"].step_bytes() == plans["sharded"].cross_bytes() + params  # each owner's half, to the other
    assert abs(plans["sharded"].step_bytes() - plans["data"].step_bytes()) < 0.02 * plans["data"].step_bytes()
    assert plans["zero3"].step_bytes() > plans["sharded"].step_bytes()


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", ["data", "sharded"])
def test_between_hosts_each_replica_sends_its_gradients_in_buckets_during_its_backward(embedded_runtime,
                                                                                       monkeypatch, parallel):
    """Between hosts, each replica's weight-gradient products run during its backward and its
    gradients leave in several buckets. (The order of the plan had
    run the weight-gradient products after the whole backward, and one replica's before the
    other's: the first replica's task held all its gradients, which left in one message after
    the backward, over a 1 Gbit/s link 1.8 s of a 4 s step; only the second's went in buckets.)"""
    from conftest import fake_hosts

    monkeypatch.setattr(tg.config, "bucket_bytes", 300e3)  # a layer of this model: about 1 MB of gradients
    fake_hosts(monkeypatch, embedded_runtime)
    model, opt = _stack()
    x = np.zeros((4, 64, 256), np.float32)
    plan = tg.TrainStep(model, opt, mse, batch_tiles=[(2, None, None)] * 2, runtime=embedded_runtime,
                        parallel=parallel).plan(x, x)
    assert plan.n_replicas == 2 and plan.across_hosts
    procs = plan.n_replicas
    where = {id(n): c for c in plan.clusters for n in c.nodes}
    sending: dict[int, set[int]] = {0: set(), 1: set()}  # replica -> its compute tasks the other replica reads
    products: dict[int, set[int]] = {0: set(), 1: set()}  # replica -> its tasks running weight-gradient products
    for c in plan.clusters:
        for n in c.nodes:
            if c.proc < procs and "matmul_tn" in str(n.kernel):
                products[c.proc].add(c.id)
            for i in n.inputs:
                src = where.get(id(i.node))
                if src is not None and src.proc < procs and src.proc != c.proc % procs:
                    sending[src.proc].add(src.id)
    assert min(map(len, sending.values())) >= 3, sending  # (sharded: each sends the gradients the other owns)
    assert parallel == "sharded" or len(sending[0]) == len(sending[1]), sending
    assert len(products[0]) == len(products[1]) >= 3, products


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt2_debug_trains_alike_on_one_and_two_workers_with_each_strategy(tmp_path):
    """20 steps of the debug GPT-2 through the Trainer (several steps per graph): one worker, and
    two workers with the tiles plan, data parallelism and sharded state (with and without the
    parameters sharded), give the same losses
    (the README's float32 tolerances: the tiles plan 1e-6, data parallelism and sharded state,
    which sum each replica's gradients first, 1e-4)."""
    import dataclasses

    from tilegraph import models
    from tilegraph.io import ByteTokenizer, TokenDataset, build_token_file

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))
    tok = tmp_path / "tokens.bin"
    build_token_file([corpus], tok, ByteTokenizer(eos=True))
    runs = {}
    for workers, parallel in ((1, "tiles"), (2, "tiles"), (2, "data"), (2, "sharded"), (2, "zero3")):
        model = models.build(dataclasses.replace(models.config("gpt2-debug"), vocab_size=257), seed=0)
        opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(3e-3, 5, 20), weight_decay=0.1,
                             clip_grad_norm=1.0)
        data = TokenDataset(tok, model.config.max_seq_len, split="train", seed=0)
        with tg.connect(n_workers=workers, threads_per_worker=1, dashboard=False, quiet=True) as rt:
            trainer = tg.Trainer(model, opt, data, rt, batch_size=8, batch_tiles=[(4,)], progress=False,
                                 parallel=parallel)
            runs[(workers, parallel)] = trainer.fit(20).losses
            plan = trainer.step.plan(trainer._batch(1)[0])
            assert plan.strategy == (parallel if workers == 2 else "tiles")
    base = runs[(1, "tiles")]
    assert base[-1] < base[0]
    np.testing.assert_allclose(runs[(2, "tiles")], base, rtol=1e-6)
    np.testing.assert_allclose(runs[(2, "data")], base, rtol=1e-4)
    np.testing.assert_allclose(runs[(2, "sharded")], base, rtol=1e-4)
    assert runs[(2, "zero3")] == runs[(2, "sharded")]  # the same sums, as Dask tasks instead of gangs


@pytest.mark.distributed
def test_data_parallel_over_gpu_workers(monkeypatch):
    """Replicas on GPU workers (emulated: their tasks run the NumPy kernels), every task asking
    for the GPU resource."""
    monkeypatch.setattr(tg.config, "gpu_array_module", "numpy")
    x, y = _data()
    _, local_step = _step()
    local = [local_step(x, y) for _ in range(3)]
    with tg.connect(n_workers=2, gpu=2, threads_per_worker=1, dashboard=False, quiet=True) as rt:
        _, step = _step(runtime=rt, parallel="data", placement="gpu")
        losses = [step(x, y) for _ in range(3)]
        exe = step.plan(x, y)
        assert exe.strategy == "data" and {c.device for c in exe.clusters} == {"gpu"}
        assert sorted(set(exe.worker_of.values())) == sorted(rt.workers())
    np.testing.assert_allclose(losses, local, rtol=2e-5)


def _nbytes(model) -> int:
    """Bytes of the model's parameters."""
    return sum(int(np.prod(p.shape)) * p.dtype.itemsize for p in model.parameters())


def _incoming_bytes(dask_worker) -> int:
    return sum(t["total"] for t in dask_worker.transfer_incoming_log)


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded"])
def test_a_process_fetches_only_the_values_it_reads(embedded_runtime, strategy, monkeypatch):
    """Dask moves a task's value whole: a replica reading another's partial loss would fetch all
    of that forward task's activations. Send tasks pick out what each process reads, so a step's
    transfers are what the plan reads across processes (plus a sharded plan's parameters).
    (Over Dask's TCP, as Dask tasks: the shared-memory path is tests/test_shm.py's, the gang's
    tests/test_gang.py's.)"""
    from distributed import wait

    monkeypatch.setattr(tg.config, "shm_transfers", False)
    monkeypatch.setattr(tg.config, "exchange", "tasks")

    from tilegraph import models

    model = models.build("gpt2-debug", seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 32))
    x, y = ids, np.roll(ids, -1, axis=1)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None), (2, None)],
                        runtime=embedded_runtime, parallel=strategy)
    step(x, y)
    exe = step.plan(x, y)
    assert exe.sends, "the forward tasks' activations are not what the other replica reads"
    read = {}  # (value, reading process) -> bytes, as the plan reads across processes
    for c, plan in zip(exe.clusters, exe.plans):
        for ref in plan.ext:
            if not ref.node.is_leaf:
                cid, k = exe.where[(id(ref.node), ref.index)]
                if exe.process_of(exe.clusters[cid]) != exe.process_of(c):
                    read[(cid, k, exe.process_of(c))] = ref.nbytes
    whole = sum(sum(o.nbytes for o in exe.plans[cid].outputs) for cid, _ in {(cid, p) for cid, _, p in read})
    params = _nbytes(model) if strategy == "sharded" else 0
    client = embedded_runtime.client
    step(x, y)  # the second call sends the programs
    wait([r.future for p in opt.params for c in p.cells.flat for r in c.value.replicas])
    before = sum(client.run(_incoming_bytes).values())
    from distributed import get_task_stream

    with get_task_stream(client) as ts:
        for _ in range(3):
            step(x, y)
        wait([r.future for p in opt.params for c in p.cells.flat for r in c.value.replicas])
    # each send ran next to its producer, each receive next to its readers
    addr = {p: next(a for c, a in exe.worker_of.items() if exe.process_of(exe.clusters[c]) == p) for p in (0, 1)}
    ran = [(t["key"], t["worker"]) for t in ts.data if t["key"].startswith(("tg-send-", "tg-receive-"))]
    assert {k.split("-")[1] for k, _ in ran} == {"send", "receive"}
    for key, worker in ran:
        reader = int(key.split("-")[2][3:])  # tg-send-cpu1-...: read by process 1
        assert worker == (addr[reader] if key.startswith("tg-receive-") else addr[1 - reader]), (key, worker)
    per_step = (sum(client.run(_incoming_bytes).values()) - before) / 3
    assert per_step <= 1.05 * sum(read.values()) + params + 64 * 1024, (per_step, sum(read.values()), whole)
    assert per_step < 0.5 * whole + params  # what fetching whole results would move


@pytest.mark.distributed
@pytest.mark.parametrize("shm", [False, True])
def test_sharded_parameters_reach_every_process_when_they_are_updated(embedded_runtime, shm, monkeypatch):
    """A sharded plan's parameters go to the other processes right after their owner updates
    them (push tasks), so the next step's first task on each process finds them there: no task
    fetches a parameter when it may start, and each process's copy is its own. (As Dask tasks;
    a gang sends them through its channels, tests/test_gang.py.)"""
    from distributed import wait

    from tilegraph import models
    from tilegraph._graph import ReplicatedRef

    monkeypatch.setattr(tg.config, "exchange", "tasks")
    monkeypatch.setattr(tg.config, "shm_transfers", shm)
    monkeypatch.setattr(tg.config, "shm_min_bytes", 1024)
    model = models.build("gpt2-debug", seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 32))
    x, y = ids, np.roll(ids, -1, axis=1)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None), (2, None)],
                        runtime=embedded_runtime, parallel="sharded")
    losses = [step(x, y) for _ in range(2)]
    client = embedded_runtime.client
    cells = [c for p in model.parameters() for c in p.cells.flat]
    wait([r.future for c in cells for r in c.value.replicas])
    fresh_transfer_logs(client)
    losses += [step(x, y) for _ in range(2)]
    wait([r.future for c in cells for r in c.value.replicas])
    assert all(isinstance(c.value, ReplicatedRef) and len(c.value.replicas) == 2 for c in cells)
    who = client.who_has([r.future for c in cells for r in c.value.replicas])
    exe = step.plan(x, y)
    addr = {exe.process_of(exe.clusters[cid]): a for cid, a in exe.worker_of.items()}
    for c in cells:  # copy p on process p's worker
        for p, r in enumerate(c.value.replicas):
            assert addr[p] in who[r.future.key], (p, r.future.key, who[r.future.key])
    fetched = [kn for log in client.run(lambda dask_worker: [kn for t in dask_worker.transfer_incoming_log
                                                             for kn in t["keys"].items()]).values() for kn in log]
    assert not [k for k, _ in fetched if k.startswith(("tg-params-", "tg-keep-"))], fetched
    pushed = sum(n for k, n in fetched if k.startswith("tg-push-")) / 2  # per step
    params = _nbytes(model)
    if shm:  # handles, and the parameters under shm_min_bytes
        assert pushed < 0.2 * params, (pushed, params)
    else:  # each process receives the parameters the other owns: all of them, once per step
        assert 0.9 * params <= pushed <= 1.1 * params, (pushed, params)
    model2 = models.build("gpt2-debug", seed=0)
    opt2 = tg.optim.AdamW(model2.parameters(), lr=1e-3)
    local = tg.TrainStep(model2, opt2, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None), (2, None)])
    np.testing.assert_allclose(losses, [local(x, y) for _ in range(4)], rtol=2e-5)


@pytest.mark.distributed
def test_min_process_seconds_zero_uses_every_process(embedded_runtime, monkeypatch):
    # 0 (allowed: a number >= 0) means "every process", not a division by zero
    monkeypatch.setattr(tg.config, "min_process_seconds", 0.0)
    x = tg.from_numpy(np.ones((8, 8), np.float32), 4)
    exe = tg.compile([x @ x], runtime=embedded_runtime, parallel="tiles")
    assert len({c.proc for c in exe.clusters}) == 2


def _held_by_worker(client, futures) -> dict[str, int]:
    """Bytes of the values behind ``futures`` on each worker (each key counted where it is)."""
    from distributed import wait

    wait(futures)
    keys = list({f.key: f for f in futures}.values())
    who, size = client.who_has(keys), client.nbytes([f.key for f in keys], summary=False)
    out: dict[str, int] = {}
    for k, addrs in who.items():
        for a in addrs:
            out[a] = out.get(a, 0) + size[k]
    return out


@pytest.fixture(autouse=True)
def _small_zero3_tasks(monkeypatch):
    """The debug GPT-2's "zero3" steps in tasks each under a process's share of its parameters,
    as a large model's are: the mechanism (drops, prefetch, fetches) at a test's size. By default
    no zero3 task is bounded under ``ZERO3_MIN_TASK_BYTES`` (64 MiB): see the test below."""
    from tilegraph.parallel import data_parallel

    monkeypatch.setattr(data_parallel, "ZERO3_MIN_TASK_BYTES", 0)


@pytest.mark.distributed
def test_a_small_model_s_zero3_step_runs_in_as_few_tasks_as_sharded(embedded_runtime, monkeypatch):
    """Bounding a "zero3" task by a process's share of the parameters cut the debug GPT-2's step
    (58 KiB a process) into 257 tasks instead of 11, each a Dask round trip: 10-20 times slower
    than "sharded", for a few kilobytes saved. No zero3 bound is under 64 MiB now."""
    from tilegraph.parallel import data_parallel

    monkeypatch.setattr(data_parallel, "ZERO3_MIN_TASK_BYTES", 64 << 20)
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    tasks, bound = {}, {}
    for strategy in ("sharded", "zero3"):
        _, step, batch = _debug_gpt2_step(embedded_runtime, strategy)
        exe = step.plan(*batch)
        tasks[strategy], bound[strategy] = exe.n_tasks, exe.max_task_bytes
    assert bound["zero3"] == 64 << 20 and tasks["zero3"] <= tasks["sharded"] + 2, (tasks, bound)


def _debug_gpt2_step(runtime, parallel: str):
    """The debug GPT-2, a TrainStep of it on ``runtime`` with ``parallel`` (2 row tiles a
    process on 2 workers), and a batch: ``(model, step, batch)``."""
    from tilegraph import models

    model = models.build("gpt2-debug", seed=0)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 32))
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None)] * 2,
                        runtime=runtime, parallel=parallel)
    return model, step, (ids, np.roll(ids, -1, 1))


def _parameter_futures(model) -> list:
    return [c.value.future for p in model.parameters() for c in p.cells.flat]


@pytest.mark.distributed
def test_zero3_tasks_read_at_most_a_process_share_of_the_parameters(embedded_runtime, monkeypatch):
    """parallel="zero3" gathers a parameter only for the tasks that use it: no task reads more
    than a process's share of the parameters (half of them on 2 workers), so a process never
    holds every parameter at once; "sharded" runs a process's forward pass in one task that
    reads every parameter."""
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    most = {}
    for strategy in ("sharded", "zero3"):
        model, step, batch = _debug_gpt2_step(embedded_runtime, strategy)
        n_bytes = _nbytes(model)
        cells = {id(c) for p in model.parameters() for c in p.cells.flat}
        exe = step.plan(*batch)
        assert exe.strategy == strategy
        read = [sum(r.nbytes for r in {(id(r.node), r.index): r for r in plan.ext
                                       if r.node.is_leaf and id(r.node.cell) in cells}.values())
                for plan in exe.plans]
        most[strategy] = max(read) / n_bytes
    assert most["sharded"] >= 0.99, most      # one task reads every parameter
    assert most["zero3"] <= 0.55, most        # none reads more than about half of them


def _held_once_the_step_is_done(client, model, params, expected: float) -> dict[str, int]:
    """Bytes of ``params`` (the futures a step read) on each worker once the step of ``model``
    is done and its last drops have come (they follow its last tasks): waits up to 10 s for
    them to total ``expected`` bytes or less."""
    import time

    _held_by_worker(client, _parameter_futures(model))  # the step is done
    deadline = time.monotonic() + 10
    while True:
        held = _held_by_worker(client, params)
        if sum(held.values()) <= expected or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def _plugin_count(client, counter: str) -> int:
    """A count kept by tilegraph's scheduler plugin so far: "dropped" (copies of fetched values
    dropped) or "prefetched" (values workers were asked to fetch ahead)."""
    return client.run_on_scheduler(
        lambda dask_scheduler: getattr(dask_scheduler.plugins["tilegraph-drop-fetched"], counter))


@pytest.mark.distributed
def test_zero3_drops_the_copies_a_process_fetched_once_its_tasks_have_read_them(embedded_runtime, monkeypatch):
    """The copies of parameters a "zero3" process fetched from their owners are dropped once the
    tasks there that read them have run (tilegraph's scheduler plugin), not left to Dask's active
    memory manager (stopped here): the parameters a step read (kept alive by the test after it)
    are each held once, by their owner, as soon as the step is done. The plugin counts what it
    dropped."""
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    client = embedded_runtime.client
    client.amm.stop()
    try:
        model, step, batch = _debug_gpt2_step(embedded_runtime, "zero3")
        n_bytes = _nbytes(model)
        step(*batch)
        params = _parameter_futures(model)  # what the next step reads
        before = _plugin_count(client, "dropped")
        step(*batch)
        held = _held_once_the_step_is_done(client, model, params, 1.01 * n_bytes)
        assert sum(held.values()) <= 1.01 * n_bytes, (held, n_bytes)
        assert len(held) == 2 and all(v <= 0.65 * n_bytes for v in held.values()), held
        assert _plugin_count(client, "dropped") > before
    finally:
        client.amm.start()


@pytest.mark.distributed
def test_a_sharded_step_under_a_memory_bound_drops_fetched_copies_and_fetches_nothing_ahead(embedded_runtime,
                                                                                           monkeypatch):
    """The capacity path: a "sharded" step whose values outgrow the workers' memory limit runs as
    "zero3" in small tasks, and its fetched parameter copies are dropped once read there, as a
    "zero3" step's are (before, Dask kept them, spilled to disk, until the parameter was
    replaced). Nothing is fetched ahead there: what arrives early would push out to disk what
    the worker needs sooner. The losses are those of the same step without a bound. (Under a bound
    each task result reports its exact size, a few bytes over its arrays': 1.05.)"""
    from tilegraph import _lower

    monkeypatch.setattr(tg.config, "exchange", "tasks")
    client = embedded_runtime.client
    model, step, batch = _debug_gpt2_step(embedded_runtime, "sharded")
    free = [step(*batch) for _ in range(2)]
    n_bytes = _nbytes(model)
    monkeypatch.setattr(_lower, "_memory_limit", lambda workers: 16 * n_bytes)  # state over half of it
    client.amm.stop()
    try:
        model, step, batch = _debug_gpt2_step(embedded_runtime, "sharded")
        exe = step.plan(*batch)
        assert (exe.strategy, exe.memory_bound, exe.prefetch) == ("zero3", True, False)
        dropped, ahead = _plugin_count(client, "dropped"), _plugin_count(client, "prefetched")
        bounded = [step(*batch)]
        params = _parameter_futures(model)  # what the next step reads
        bounded.append(step(*batch))
        held = _held_once_the_step_is_done(client, model, params, 1.05 * n_bytes)
        assert sum(held.values()) <= 1.05 * n_bytes, (held, n_bytes)
        assert _plugin_count(client, "dropped") > dropped
        assert _plugin_count(client, "prefetched") == ahead
    finally:
        client.amm.start()
    np.testing.assert_allclose(bounded, free, rtol=1e-5)


def _fetched(dask_worker) -> dict:
    """Bytes of each key this worker fetched since :func:`conftest.fresh_transfer_logs`, summed."""
    out: dict = {}
    for entry in dask_worker.transfer_incoming_log:
        for key, nbytes in entry["keys"].items():
            out[str(key)] = out.get(str(key), 0) + nbytes
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("reshard", [True, False])
def test_zero3_fetches_a_parameter_again_for_the_backward(embedded_runtime, monkeypatch, reshard):
    """As FSDP gathers a layer's parameters again for its backward: a "zero3" process drops the
    parameters it fetched for the forward once the forward's tasks there have read them, and
    fetches them again for the backward, so in one step each process fetches the other's half
    of the parameters about twice; with ``zero3_reshard_after_forward=False`` a copy stays from
    the forward to the backward: once."""
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    monkeypatch.setattr(tg.config, "zero3_reshard_after_forward", reshard)
    client = embedded_runtime.client
    model, step, batch = _debug_gpt2_step(embedded_runtime, "zero3")
    n_bytes = _nbytes(model)
    step(*batch)
    params = _parameter_futures(model)  # what the next step reads
    _held_by_worker(client, params)
    fresh_transfer_logs(client)
    step(*batch)
    _held_by_worker(client, _parameter_futures(model))  # the step is done
    keys = {str(f.key) for f in params}
    fetched = sum(n for per_worker in client.run(_fetched).values() for k, n in per_worker.items() if k in keys)
    low, high = (1.6, 2.4) if reshard else (0.8, 1.4)
    assert low * n_bytes <= fetched <= high * n_bytes, (fetched, n_bytes)


def _sees_key_while_running(key: str, seconds: float) -> bool:
    """A task: whether the value of ``key`` reaches this worker while the task runs (``seconds``)."""
    import time

    from distributed import get_worker

    worker, deadline = get_worker(), time.monotonic() + seconds
    while time.monotonic() < deadline:
        if key in worker.data:
            return True
        time.sleep(0.02)
    return False


def _reads_after(previous, value):
    return previous, value.nbytes




@pytest.mark.distributed
@pytest.mark.parametrize("prefetch", [True, False])
def test_a_worker_fetches_its_next_task_s_inputs_while_the_task_before_runs(embedded_runtime, prefetch):
    """The scheduler plugin's prefetch (FSDP's, for "zero3" steps): once task T is sent to worker
    B, B fetches what its next task D (pinned there, reading T's result, annotated to prefetch)
    reads from worker A, while T runs. Without the annotation Dask fetches D's inputs only once
    D may start, after T: T never sees the value arrive."""
    client = embedded_runtime.client
    a, b = sorted(embedded_runtime.workers())
    value = client.scatter(np.ones(1 << 16), workers=[a])
    token = uuid.uuid4().hex
    first, then = f"tg-first-{token}", f"tg-then-{token}"
    layers = {"cpu": {first: (_sees_key_while_running, value.key, 3.0), then: (_reads_after, first, value)}}
    before = _plugin_count(client, "prefetched")
    got = embedded_runtime.submit_layers(layers, [then], workers={first: b, then: b},
                                         drop_fetched={first: "forward", then: "forward"}, prefetch=prefetch)[0]
    seen, nbytes = got.result(timeout=30)
    assert nbytes == value.result().nbytes
    assert seen is prefetch
    assert (_plugin_count(client, "prefetched") > before) is prefetch


@pytest.mark.distributed
def test_zero3_prefetch_changes_no_loss(embedded_runtime, monkeypatch):
    """A "zero3" step with the parameters fetched ahead (the default) gives the losses of one
    without, bit for bit; the scheduler's plugin fetched ahead in the first, not the second."""
    monkeypatch.setattr(tg.config, "exchange", "tasks")
    client = embedded_runtime.client
    losses, ahead = {}, {}
    for prefetch in (True, False):
        monkeypatch.setattr(tg.config, "zero3_prefetch", prefetch)
        model, step, batch = _debug_gpt2_step(embedded_runtime, "zero3")
        before = _plugin_count(client, "prefetched")
        losses[prefetch] = [step(*batch) for _ in range(3)]
        _held_by_worker(client, _parameter_futures(model))  # the last step is done
        ahead[prefetch] = _plugin_count(client, "prefetched") - before
    assert losses[True] == losses[False]
    assert ahead[True] > 0 and ahead[False] == 0, ahead


@pytest.mark.distributed
def test_zero3_leaves_each_parameter_with_its_owner_alone(embedded_runtime, monkeypatch):
    """parallel="zero3": each process fetches the parameters it reads from their owner, and the
    copies go once read, so between steps each worker holds its share of the parameters and of
    the AdamW moments (half of each on 2 workers), where "sharded" keeps every parameter on every
    worker. The losses are "sharded"'s, bit for bit (the same sums in the same order)."""
    import time

    from tilegraph import models

    monkeypatch.setattr(tg.config, "exchange", "tasks")  # "sharded" then pushes its parameters as Dask tasks
    client = embedded_runtime.client
    held, losses = {}, {}
    for strategy in ("sharded", "zero3"):
        model = models.build("gpt2-debug", seed=0)
        n_bytes = _nbytes(model)
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 32))
        opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
        step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t), batch_tiles=[(2, None)] * 2,
                            runtime=embedded_runtime, parallel=strategy)
        losses[strategy] = [step(ids, np.roll(ids, -1, 1)) for _ in range(3)]
        assert step.plan(ids, np.roll(ids, -1, 1)).strategy == strategy
        params = [r.future for p in model.parameters() for c in p.cells.flat
                  for r in getattr(c.value, "replicas", (c.value,))]
        moments = [c.value.future for per_param in opt.state_cells for cells in per_param for c in cells.flat]
        for _ in range(50):  # Dask's active memory manager drops the copies no task waits for
            client.amm.run_once()
            held[strategy] = (_held_by_worker(client, params), _held_by_worker(client, moments))
            if strategy == "sharded" or sum(held[strategy][0].values()) <= 1.01 * n_bytes:
                break
            time.sleep(0.1)
    assert losses["zero3"] == losses["sharded"]
    for strategy, (p, m) in held.items():
        assert len(p) == len(m) == 2, (strategy, p, m)
        # the two AdamW moments: about half of them on each worker
        assert all(0.35 * 2 * n_bytes <= v <= 0.65 * 2 * n_bytes for v in m.values()), (strategy, m)
    sharded, zero3 = held["sharded"][0], held["zero3"][0]
    assert all(v >= 0.99 * n_bytes for v in sharded.values()), sharded  # every parameter on every worker
    assert sum(zero3.values()) <= 1.01 * n_bytes, zero3                   # each parameter once
    assert all(v <= 0.65 * n_bytes for v in zero3.values()), zero3        # about half on each worker
