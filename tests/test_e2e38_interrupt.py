"""Interrupting and continuing (audit): a second Ctrl-C or SIGTERM to ``tilegraph eval`` or
``generate`` while the first one's close runs ends the process at once, and a cluster whose
start a stop cut short is closed before the command returns; a stop that lands while a step is
sent (or, without a runtime, computed) leaves the optimizer's step count where the parameters
are; one that lands while ``fit`` redraws ``loss.png`` leaves the steps just submitted logged;
a stopped ``generate`` lets go of the worker that decoded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import tilegraph as tg

# -- tilegraph eval / generate: the second signal -------------------------------------------------

#: a command's run under run_stoppable: a "worker" process started, the first SIGINT while it works,
#: the second while its ``with`` block closes (a close that takes long, as a cluster's can)
_SECOND_SIGNAL = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time

    def worker():
        time.sleep(60)

    class Closing:
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # the second signal, while it closes
            time.sleep(30)

    def work():
        with Closing():
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            time.sleep(30)
        return 0

    if __name__ == "__main__":
        from tilegraph.cli.signals import run_stoppable

        child = multiprocessing.get_context("spawn").Process(target=worker, daemon=True)
        child.start()
        print(child.pid, flush=True)
        sys.exit(run_stoppable("tilegraph eval", work))
""")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_second_signal_while_the_command_closes_stops_it_at_once(tmp_path, sig):
    """``tilegraph generate``'s "again to stop at once": a second Ctrl-C raised
    KeyboardInterrupt inside the cluster's close, which it cut short, and Dask's exit hook
    closed the cluster again: the command ended 11-12 s later (the first stop alone took 1-3 s),
    or printed tracebacks ("Exception ignored in atexit callback"). Now one line, its worker
    processes killed, and 128 + the signal at once."""
    script = tmp_path / "command.py"
    script.write_text(_SECOND_SIGNAL)
    began = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), sig], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - began
    child = int(proc.stdout.split()[0])
    name = sig[3:]
    assert proc.returncode == 128 + getattr(signal, sig), (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.splitlines() == [
        f"tilegraph eval: {sig}: stopping, closing the cluster (again to stop at once)",
        f"tilegraph eval: {sig} again: stopped at once"], proc.stderr[-2000:]
    assert took < 20, took  # (the slow close alone is 30 s; a spawned process's start, a few)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"the worker process {child} ({name}) outlived the command"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (its parent gone, not reaped yet) is no longer running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_a_cluster_whose_start_a_stop_cut_short_is_closed_before_the_command_returns():
    """A Ctrl-C to ``tilegraph generate`` while its cluster started raised Stopped out of Dask's
    cluster start (``tg.connect`` holds back only Python's own KeyboardInterrupt): the cluster,
    which nothing of tilegraph held yet, was closed by Dask's exit hook after the command
    returned, outside its signal handlers (a second Ctrl-C there printed a traceback). It is
    closed inside them now; a cluster that was there before the command is left alone."""
    from distributed.core import Status
    from distributed.deploy.spec import SpecCluster

    from tilegraph.cli.signals import run_stoppable

    class Half:  # what SpecCluster._instances holds of a cluster whose start was cut short
        def __init__(self):
            self.status, self.closes = Status.starting, []

        def close(self, timeout=None):
            self.closes.append(timeout)
            self.status = Status.closed

    earlier, half = Half(), Half()
    SpecCluster._instances.add(earlier)

    def work():
        SpecCluster._instances.add(half)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        return 0

    try:
        assert run_stoppable("tilegraph generate", work) == 143
        assert half.closes == [10] and earlier.closes == []
    finally:
        SpecCluster._instances.discard(earlier)
        SpecCluster._instances.discard(half)


# -- Trainer.fit: a stop while steps are sent, and while loss.png is drawn ------------------------

def _data(step):
    x = np.random.default_rng([0, step]).standard_normal((32, 8)).astype(np.float32)
    return x, np.tanh(x[:, :2])


def _mse(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _trainer(**kw):
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=tg.optim.warmup_cosine(1e-2, 2, 20))
    return opt, tg.Trainer(model, opt, _data, loss_fn=_mse, batch_size=32, progress=False,
                           batch_tiles=[(16, 8), (16, None)], **kw)


def _losses(trainer):
    return [(r["step"], r["loss"]) for r in trainer.history if "loss" in r]


@pytest.mark.parametrize("steps_per_graph", [1, 3])
def test_a_stop_while_a_step_is_computed_here_leaves_the_step_count_with_the_parameters(monkeypatch, steps_per_graph):
    """Without ``tg.connect()`` a step's graph runs in this process, in the main thread, where
    the stop button's KeyboardInterrupt lands: the step count had advanced (``next_hyper``
    comes before the run) and the parameters had not, so fit said "stopped after step 6, every
    step run logged" with steps 4-6 missing from history, and the next fit went on from step 7
    with other losses than an uninterrupted run's (AdamW's bias correction and the schedule
    counted updates never applied). On the embedded cluster the same happens when the stop
    lands while a step's parameters are sent to the workers (the first step of a large model
    spends seconds there)."""
    from tilegraph import _lower

    opt, straight = _trainer(steps_per_graph=steps_per_graph)
    straight.fit(9)
    real, calls = _lower._local_get, []

    def local_get(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the stop button, while the second graph computes
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    opt, trainer = _trainer(steps_per_graph=steps_per_graph)
    monkeypatch.setattr(_lower, "_local_get", local_get)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(9)
    monkeypatch.undo()
    assert opt.step_count == len(_losses(trainer)) == steps_per_graph  # the first graph's steps alone
    trainer.fit(9 - opt.step_count)
    assert _losses(trainer) == _losses(straight)


def test_a_stop_while_fit_redraws_the_plot_still_logs_the_steps_just_submitted(tmp_path, monkeypatch):
    """After an evaluation, fit redraws ``loss.png`` in the main thread once the next steps are
    submitted (a few hundred ms of matplotlib): a stop then left those steps out of the list
    of steps to log, so they ran, their updates were in the parameters and the step count, and
    their records were never written ("every step run logged" said fit; history and
    metrics.jsonl jumped)."""
    opt, trainer = _trainer(eval_data=_data, eval_every=3, eval_batches=1, log_dir=tmp_path, steps_per_graph=2)
    monkeypatch.setattr(trainer, "_plot_due", lambda *args: True)
    real, drawn = tg.Trainer.plot, []

    def plot(self, *args, **kwargs):
        drawn.append(1)
        if len(drawn) == 1:  # the stop button while the first redraw runs
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tg.Trainer, "plot", plot)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(10)
    assert [s for s, _ in _losses(trainer)] == list(range(1, opt.step_count + 1)) and opt.step_count > 3


@pytest.mark.distributed
def test_a_stopped_generate_lets_go_of_the_worker_that_decoded(own_runtime):
    """A Ctrl-C in generate on a cluster cancels the worker's decoding task, and the worker now
    stops at its next token. Before, it decoded on to the last one (Dask does not stop a running
    task), holding its thread: the next call to that worker waited for it."""
    import _thread

    from tilegraph import models
    from tilegraph.models import generate
    from tilegraph.models.gpt2 import GPT2Config

    rt = own_runtime
    model = models.build(GPT2Config(vocab_size=96, max_seq_len=8192, dim=32, n_layers=2, n_heads=4), seed=0)
    prompt = np.zeros((1, 4), dtype=np.int64)
    with rt.as_current():
        t0 = time.perf_counter()
        generate(model, prompt, 8)
        per_token = (time.perf_counter() - t0) / 8
        timer = threading.Timer(1.0, _thread.interrupt_main)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                generate(model, prompt, 8000)  # far longer than the 1 s before the stop
        finally:
            timer.cancel()
        stopped = time.perf_counter()
        # every worker thread free again soon: one task per thread of the cluster, at once
        nthreads = sum(w["nthreads"] for w in rt.client.scheduler_info()["workers"].values())
        futures = [rt.client.submit(time.sleep, 0, pure=False, workers=[a], allow_other_workers=False)
                   for a in rt.client.scheduler_info()["workers"] for _ in range(nthreads)]
        rt.client.gather(futures)
    assert time.perf_counter() - stopped < 5 + 50 * per_token, time.perf_counter() - stopped


def test_a_manager_made_again_on_a_folder_leaves_the_save_still_being_written(tmp_path):
    """A Trainer's cell run again right after a stop (its checkpoint of step 10 still written in
    the background): the new CheckpointManager's clean-up of this process's temporary folders
    removed the one that save wrote in, and step 10 was lost. A save under way is left to commit."""
    from tilegraph.io.zarr import CheckpointManager, prepare_save

    model = tg.nn.MLP(16, 24, out_dim=4, tile=8, seed=0)
    pending = prepare_save(tmp_path / "ck" / "step-000010", model, step=10)
    pending.start()  # its temporary folder made, its writes under way
    assert [p.name for p in (tmp_path / "ck").iterdir() if p.name.startswith(".step-000010.tmp-")]
    again = CheckpointManager(tmp_path / "ck", keep=3)
    assert again.removed_stale == []
    assert pending.finish() == tmp_path / "ck" / "step-000010"
    assert [p.name for p in again.checkpoints()] == ["step-000010"]
    # and a temporary folder of this process that no save writes is still cleaned up
    (tmp_path / "ck" / pending._tmp.name).mkdir()
    assert [p.name for p in CheckpointManager(tmp_path / "ck", keep=3).removed_stale] == [pending._tmp.name]
