"""Workers retired while steps are sent, and what a run leaves on the console and in /dev/shm (an
end-to-end audit, round 4: leftovers of round 3). Each test is a defect found and fixed (see its
docstring)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import tilegraph as tg
from tilegraph import _health
from conftest import mse, regression_data, retire_as_values_are_sent
from test_cli import semaphore_group
from tilegraph.runtime import worker_setup

pytestmark = pytest.mark.distributed


def _step(rt):
    """The README's first MLP and AdamW as a data-parallel TrainStep on ``rt``'s workers (None:
    this process, the reference)."""
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=1e-2)
    if rt is None:
        return tg.TrainStep(model, opt, mse)
    return tg.TrainStep(model, opt, mse, runtime=rt, parallel="data")


# -- a worker retired as a submitted step is sent --------------------------------------------------

def _batches(steps: int, rows_from: int):
    """Regression batches of 64 rows, and of 32 from step ``rows_from`` on (a step of another
    signature: recorded and planned anew, on the workers there are as it is sent)."""
    big, small = regression_data(0, 64), regression_data(1, 32)
    return [big(i) if i < rows_from else small(i) for i in range(1, steps + 1)]


def _reference(batches) -> list[float]:
    step = _step(None)
    return [step(*b) for b in batches]


@pytest.mark.filterwarnings("ignore:parallel='(data|tiles)'")
@pytest.mark.parametrize("at", [1, 3])
def test_a_step_submitted_as_a_worker_retires_says_to_submit_it_again(own_runtime, monkeypatch, at):
    """``step.submit(x, y)`` (no Trainer) as ``client.retire_workers([one])`` came while the step's
    values were sent (an adaptive cluster scaling an idle worker down): Dask's bare
    ``CommClosedError: tilegraph: values to send to worker ..., which left the cluster``, and the
    same at every later submit (the plans still named the worker). Now a WorkerLostError names
    the worker as retired and the step, which changed nothing; submitted again, it runs on the
    worker left with the losses of a run that never lost a worker. (``at``: the step sent as it
    retires, planned anew: the first sends the parameters held here, the third, of a new batch
    shape, reads the workers' values.)"""
    rt = own_runtime
    batches = _batches(at + 1, rows_from=at)
    step = _step(rt)
    got = [step.submit(*b).result() for b in batches[:at - 1]]
    victim = retire_as_values_are_sent(monkeypatch, rt)
    with pytest.raises(tg.WorkerLostError, match="submit it again") as info:
        step.submit(*batches[at - 1])
    text = str(info.value)
    assert victim in text and "retired from the cluster" in text and f"as step {at} was sent" in text, text
    assert f"those after step {at - 1}" in text and "CommClosedError" in text, text
    assert info.value.workers == [victim] and list(info.value.steps) == [at]
    assert step.optimizer.step_count == at - 1
    got += [step.submit(*b).result() for b in batches[at - 1:]]
    assert victim not in rt.workers() and step.optimizer.step_count == at + 1
    np.testing.assert_allclose(got, _reference(batches), rtol=1e-5)


@pytest.mark.filterwarnings("ignore:parallel='(data|tiles)'")
def test_steps_submitted_together_as_a_worker_retires_say_to_submit_them_again(own_runtime, monkeypatch):
    """``step.submit_steps([...])`` as a worker retired while they were sent: Dask's bare
    CommClosedError. Now a WorkerLostError names the worker and the steps, none counted, and
    they run again when submitted again."""
    rt, batches = own_runtime, _batches(4, rows_from=3)
    step = _step(rt)
    got = [p.result() for p in step.submit_steps(batches[:2])]
    victim = retire_as_values_are_sent(monkeypatch, rt)
    with pytest.raises(tg.WorkerLostError, match="submit them again") as info:
        step.submit_steps(batches[2:])
    text = str(info.value)
    assert victim in text and "retired from the cluster" in text and "as steps 3-4 were sent" in text, text
    assert "those after step 2" in text and step.optimizer.step_count == 2
    got += [p.result() for p in step.submit_steps(batches[2:])]
    np.testing.assert_allclose(got, _reference(batches), rtol=1e-5)


# -- Dask's false "Worker process died unexpectedly" as a retired worker's process ends -----------

def _closed_stop_queue_read():
    """The exc_info of what the nanny's stop-queue thread meets in a retired worker's process: a
    ``multiprocessing`` connection read after the connection was closed in the same process."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.close()
    reader.close()
    try:
        reader._recv(4)  # (what recv_bytes reads with, past its closed check: the thread was inside)
    except TypeError:
        return sys.exc_info()
    raise AssertionError("a read of a closed connection raised no TypeError")


def _record(message, exc_info):
    return logging.LogRecord("distributed.nanny", logging.ERROR, __file__, 1, message, (), exc_info)


def test_the_retired_workers_stop_queue_error_alone_is_dropped(monkeypatch):
    """The filter drops Dask's "Worker process died unexpectedly" only where its error is the
    TypeError of a read of the stop queue closed in the worker's own process once its worker
    closed; the nanny's real errors (the queue's other end gone: EOFError), a TypeError of
    another origin, another message, or the same while a worker still runs are kept."""
    keep = worker_setup._RetiredWorkerStopQueue().filter
    race = _closed_stop_queue_read()
    monkeypatch.setattr(worker_setup, "_worker_running", lambda: False)
    assert not keep(_record("Worker process died unexpectedly", race))
    assert keep(_record("Failed to start worker", race))
    try:
        int(None)
    except TypeError:
        assert keep(_record("Worker process died unexpectedly", sys.exc_info()))
    try:
        raise EOFError
    except EOFError:
        assert keep(_record("Worker process died unexpectedly", sys.exc_info()))
    monkeypatch.setattr(worker_setup, "_worker_running", lambda: True)
    assert keep(_record("Worker process died unexpectedly", race))


@pytest.mark.filterwarnings("ignore:parallel='sharded' shares")
def test_a_worker_retired_after_gang_steps_leaves_no_traceback_on_the_console(capfd, own_runtime):
    """``client.retire_workers([one])`` after gang steps (``parallel="sharded"``): as the retired
    worker's process ended, its nanny logged "ERROR - Worker process died unexpectedly" and a
    traceback ending in "TypeError: 'NoneType' object cannot be interpreted as an integer" on the
    console, about one retirement in three: Dask's race between the process closing the nanny's
    stop queue and the thread that reads it (a plain LocalCluster's workers do it too). Now
    every worker of a tilegraph runtime drops that record (and it alone: see the test above);
    the console holds nothing of the kind."""
    rt, data = own_runtime, regression_data(0, 64)
    model = tg.nn.MLP(16, 64, out_dim=4, tile=8, seed=0)
    step = tg.TrainStep(model, tg.optim.AdamW(model.parameters(), lr=1e-2), mse, runtime=rt, parallel="sharded")
    for i in range(1, 3):
        step(*data(i))
    installed = rt.client.run(lambda: any(isinstance(f, worker_setup._RetiredWorkerStopQueue)
                                          for f in logging.getLogger("distributed.nanny").filters))
    assert installed and all(installed.values()), installed
    victim = sorted(rt.workers())[1]
    process = psutil.Process(rt.client.run(os.getpid, workers=[victim])[victim])
    rt.client.retire_workers([victim])
    deadline = time.monotonic() + 30  # (the process ends about 2 s after its worker closed)
    while process.is_running() and process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)
    assert victim not in rt.workers()
    err = capfd.readouterr().err
    assert "died unexpectedly" not in err and "TypeError" not in err, err


# -- a process group that outlives the grace of end_group --------------------------------------------

_OUTLIVED = """
import multiprocessing
import time

import tilegraph as tg

if __name__ == "__main__":
    rt = tg.connect(n_workers=2, threads_per_worker=1, dashboard=False, quiet=True)
    # a child that outlives this process (an MPI rank, a data loader's process): it keeps
    # multiprocessing's resource tracker waiting after the process is killed
    multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,)).start()
    print("ready", flush=True)
    time.sleep(600)
"""


def test_a_group_still_running_after_the_grace_leaves_no_semaphores_in_dev_shm(tmp_path):
    """``end_group`` (the tests' way to end a `tilegraph train` or a script with an embedded
    cluster) kills the process and lets its group drain; a group still running after the grace
    (a child outliving its parent: a hung MPI rank, a loader's process) was then killed whole
    with a SIGKILL, multiprocessing's resource tracker with it: the 12 semaphores of the embedded
    cluster stayed in /dev/shm (sem.mp-*). Now the tracker is killed last, after it unlinked
    them."""
    (tmp_path / "outlived.py").write_text(textwrap.dedent(_OUTLIVED))
    with semaphore_group(tmp_path / "outlived.py", grace=2.0) as (_, made):
        pass
    left = [p for p in made if os.path.exists(p)]
    for p in left:  # (this test's own: removed, so that a failure leaves nothing behind either)
        os.remove(p)
    assert not left, left


def test_a_lost_workers_error_says_how_the_scheduler_lost_it():
    """A worker the scheduler removed unexpectedly was named "(left the cluster)" alone, whether
    its nanny reported its process's end or its connection closed (a process killed, a network
    that failed). The scheduler's event log says which (the remove-worker's stimulus), and the
    error says it; a removal it cannot place (or an expected one: retired) keeps the old words."""
    events = [(1.0, {"action": "remove-worker", "worker": "tcp://a:1", "expected": False,
                     "stimulus_id": "handle-worker-cleanup-1.0"}),
              (2.0, {"action": "remove-worker", "worker": "tcp://b:1", "expected": False,
                     "stimulus_id": "nanny-close-2.0"}),
              (3.0, {"action": "remove-worker", "worker": "tcp://c:1", "expected": False, "stimulus_id": "other-3.0"}),
              (4.0, {"action": "remove-worker", "worker": "tcp://d:1", "expected": True,
                     "stimulus_id": "handle-worker-cleanup-4.0"}),
              (5.0, "not a dict")]
    causes = _health.removal_causes(events)
    assert causes == {"tcp://a:1": "disconnected", "tcp://b:1": "exited"}
    health = _health.WorkerHealth(lost=["tcp://a:1", "tcp://b:1", "tcp://c:1"], causes=causes)
    text = str(_health.lost_worker_error(health, "step 3", None))
    assert ("tcp://a:1 (left the cluster: its connection to the scheduler closed (its process ended, or the network "
            "between them failed))") in text
    assert "tcp://b:1 (left the cluster: its process ended, as its nanny reported" in text
    assert "tcp://c:1 (left the cluster), " in text or "tcp://c:1 (left the cluster) while" in text
