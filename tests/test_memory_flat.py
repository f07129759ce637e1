"""Long runs: client and worker memory stay flat over thousands of small steps.

Each step here is a graph of its own (its task and the pick of its loss), so 2,500 steps are as
many graphs as a far longer run whose steps are grouped several to a graph. Measured on the
2-core development machine from step 250 to step 2,500 of this test. Before the fix the worker
kept a record of every released task (2,525 at the end; +35 MB, +261,000 Python blocks; with the
debug GPT-2's larger tasks, 41 KB per step) and the client, which also runs the scheduler, grew
by 14 MB and 125,000 blocks while Dask's logs filled (1,000 entries each, whole messages among
them). After it the worker holds 3-5 task records and grows by 1 MB and 11,000 blocks, the
client by 4.6 MB and 34,000 blocks: its metrics records (``Trainer.history``, one per step on
purpose, ~0.4 KB each) and Dask's cache of key names (``dask.utils.key_split``, bounded at
100,000 keys), of which the worker has its own.
"""

import sys

import numpy as np
import psutil
import pytest

import tilegraph as tg
from tilegraph.runtime.worker_setup import LOG_LENGTH_DASK_CONFIG
from conftest import mse

STEPS = 2500
EVERY = 250  # steps between samples; the first sample is the baseline (the kernels compiled by then)
LOG_LENGTH = LOG_LENGTH_DASK_CONFIG["distributed.admin.low-level-log-length"]
#: growth allowed from the baseline to the last step, in bytes of resident memory and in Python
#: objects' blocks per step (sys.getallocatedblocks, blind to the allocator's own noise)
CLIENT_GROWTH_BYTES = 8 << 20
#: ... or this share of the client's resident memory at the baseline, where that is more: in the
#: whole suite the client is the pytest process, near 1 GB, whose allocator once took 15.7 MB more
#: between the last two samples (988.7 -> 1,004.4 MB) while its blocks grew as in every interval
#: before (about 4,600 per 250 steps): a heap that size grows in larger pieces, not per step
CLIENT_GROWTH_SHARE = 0.02
WORKER_GROWTH_BYTES = 8 << 20
GROWTH_BLOCKS_PER_STEP = 25
#: task records a worker may hold: this graph's few, not one per step run
WORKER_TASKS = 20


def _data(step):
    x = np.random.default_rng(step).standard_normal((8, 8)).astype(np.float32)
    return x, np.tanh(x[:, :2])


def _worker_sample(dask_worker) -> dict:
    import sys

    import psutil

    state = dask_worker.state
    return {"rss": psutil.Process().memory_info().rss, "blocks": sys.getallocatedblocks(), "tasks": len(state.tasks),
            "logs": max(len(state.log), len(state.stimulus_log), len(dask_worker.transfer_outgoing_log),
                        len(dask_worker.batched_stream.recent_message_log))}


def _scheduler_sample(dask_scheduler) -> dict:
    streams = [*dask_scheduler.stream_comms.values(), *dask_scheduler.client_comms.values()]
    events = [len(topic.events) for topic in dask_scheduler._broker._topics.values()]
    return {"tasks": len(dask_scheduler.tasks), "groups": len(dask_scheduler.task_groups),
            "logs": max([len(dask_scheduler.transition_log), *events,
                         *(len(s.recent_message_log) for s in streams)])}


@pytest.fixture
def runtime():
    rt = tg.connect(n_workers=1, threads_per_worker=2, dashboard=False, quiet=True)
    yield rt
    rt.close()


@pytest.mark.slow
@pytest.mark.distributed
def test_client_and_worker_memory_stay_flat_over_thousands_of_steps(runtime):
    client = runtime.client
    samples = []

    def sample(trainer, stats):
        step = len(trainer.history)  # this step's metrics record is the last one
        if step % EVERY == 0:
            (worker,) = client.run(_worker_sample).values()
            samples.append({"step": step, "client_rss": psutil.Process().memory_info().rss,
                            "client_blocks": sys.getallocatedblocks(), "worker": worker,
                            "client_logs": len(client.scheduler_comm.recent_message_log),
                            "scheduler": client.run_on_scheduler(_scheduler_sample), "futures": len(client.futures),
                            "history": len(trainer.history)})

    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
    trainer = tg.Trainer(model, opt, _data, runtime, loss_fn=mse, batch_size=8, progress=False,
                         steps_per_graph=1, on_step=[sample])
    res = trainer.fit(STEPS)
    assert res.steps == STEPS and np.isfinite(res.losses).all()
    assert [s["step"] for s in samples] == list(range(EVERY, STEPS + 1, EVERY))
    first, last = samples[0], samples[-1]
    report = "\n".join(f"step {s['step']}: client {s['client_rss'] / 2**20:.1f} MB, {s['client_blocks']} blocks; "
                       f"worker {s['worker']['rss'] / 2**20:.1f} MB, {s['worker']['blocks']} blocks, "
                       f"{s['worker']['tasks']} task records; scheduler {s['scheduler']}" for s in samples)

    # what grew before: one task record per step on the worker, Dask's logs up to 1,000 entries
    assert max(s["worker"]["tasks"] for s in samples) <= WORKER_TASKS, report
    assert max(s["worker"]["logs"] for s in samples) <= LOG_LENGTH, report
    assert max(s["scheduler"]["logs"] for s in samples) <= LOG_LENGTH, report
    assert max(s["client_logs"] for s in samples) <= LOG_LENGTH, report
    # nothing else that counts per step grows: the scheduler's tasks and task groups, the futures
    assert max(s["scheduler"]["tasks"] for s in samples) <= WORKER_TASKS, report
    assert last["scheduler"]["groups"] == first["scheduler"]["groups"], report
    assert max(s["futures"] for s in samples) <= WORKER_TASKS, report
    assert last["history"] == STEPS  # one metrics record per step, kept on purpose (the loss curve)

    steps = last["step"] - first["step"]
    assert last["worker"]["rss"] - first["worker"]["rss"] <= WORKER_GROWTH_BYTES, report
    assert last["worker"]["blocks"] - first["worker"]["blocks"] <= GROWTH_BLOCKS_PER_STEP * steps, report
    assert last["client_rss"] - first["client_rss"] <= max(CLIENT_GROWTH_BYTES,
                                                           CLIENT_GROWTH_SHARE * first["client_rss"]), report
    assert last["client_blocks"] - first["client_blocks"] <= GROWTH_BLOCKS_PER_STEP * steps, report
