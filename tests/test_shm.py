"""Values between worker processes of one host through shared memory (tilegraph.exec.shm)."""

import os

import numpy as np
import pytest

import tilegraph as tg
from conftest import fresh_transfer_logs
from tilegraph.exec import shm

needs_shm = pytest.mark.skipif(shm.shm_domain() is None, reason="no writable /dev/shm on this machine")


@needs_shm
def test_a_sent_value_is_read_back_once_and_its_file_is_gone():
    big = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    fortran = np.asfortranarray(np.arange(60_000, dtype=np.float64).reshape(200, 300))
    small = np.ones(4, np.float32)
    sent = shm.send_shm((small, big, 3.5, fortran), (1, 0, 3), 1024)
    assert isinstance(sent[0], shm.ShmArray) and sent[1] is small and isinstance(sent[2], shm.ShmArray)
    paths = [sent[0].path, sent[2].path]
    assert all(os.path.exists(p) and os.path.dirname(p) == os.path.join(shm.SHM_ROOT, f"tilegraph-{os.getpid()}")
               for p in paths)
    got = shm.receive_shm(sent)
    np.testing.assert_array_equal(got[0], big)
    np.testing.assert_array_equal(got[2], fortran)
    assert got[1] is small and got[0].dtype == big.dtype and got[2].shape == fortran.shape
    assert not any(os.path.exists(p) for p in paths)  # unlinked once mapped; the arrays keep the pages
    got[0][0, 0] = -1.0  # private copy-on-write pages: writable, and nobody else sees it
    assert got[0][0, 0] == -1.0 and big[0, 0] == 0.0
    with pytest.raises(RuntimeError, match=r"shared-memory file .* is gone"):
        shm.receive_shm(sent)  # a second read finds nothing: the clear error, not a crash


@needs_shm
def test_without_room_in_shared_memory_values_travel_as_they_are(monkeypatch):
    big = np.ones((1000, 1000), np.float32)
    monkeypatch.setattr(shm, "SHM_MARGIN_BYTES", 1 << 62)  # /dev/shm "full" (a container's 64 MB)
    sent = shm.send_shm((big,), (0,), 1024)
    assert sent[0] is big
    monkeypatch.setattr(shm, "SHM_ROOT", "/nonexistent-shm")  # no /dev/shm at all
    assert shm.shm_domain() is None
    assert shm.send_shm((big,), (0,), 1024)[0] is big


@needs_shm
def test_folders_of_dead_processes_are_swept():
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    folder = os.path.join(shm.SHM_ROOT, f"tilegraph-{pid}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "left"), "wb") as f:
        f.write(b"x" * 10)
    shm.send_shm((np.ones(1000, np.float32),), (0,), 16)  # this process's own folder, with a file in it
    own = os.path.join(shm.SHM_ROOT, f"tilegraph-{os.getpid()}")
    assert folder in shm.sweep() and not os.path.exists(folder)
    assert os.path.isdir(own)  # alive: kept
    assert own in shm.sweep(remove_own=True) and not os.path.exists(own)


def _shm_files(dask_worker=None) -> int:
    """Files of send tasks in this worker's folder (not the gang channels' pool, tests/test_gang.py)."""
    folder = os.path.join(shm.SHM_ROOT, f"tilegraph-{os.getpid()}")
    return len([f for f in os.listdir(folder) if "-" not in f]) if os.path.isdir(folder) else 0


@needs_shm
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["data", "sharded"])
def test_data_parallel_values_go_through_shared_memory(embedded_runtime, strategy, monkeypatch):
    """Both workers share /dev/shm: what one reads of the other's tasks goes through it (Dask
    moves only the handles), the losses are those of the same plan over TCP, and no file is left
    once the steps are done. (The Dask-task exchange; a gang's channels: tests/test_gang.py.)"""
    from distributed import wait

    from tilegraph import models

    monkeypatch.setattr(tg.config, "exchange", "tasks")

    def run(on: bool):
        monkeypatch.setattr(tg.config, "shm_transfers", on)
        monkeypatch.setattr(tg.config, "shm_min_bytes", 1024)  # the debug model's gradients are small
        model = models.build("gpt2-debug", seed=0)
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (8, 32))
        x, y = ids, np.roll(ids, -1, axis=1)
        opt = tg.optim.AdamW(model.parameters(), lr=1e-3)
        step = tg.TrainStep(model, opt, lambda m, i, t: tg.cross_entropy(m(i), t),
                            batch_tiles=[(2, None), (2, None)], runtime=embedded_runtime, parallel=strategy)
        losses = [step(x, y) for _ in range(2)]  # the second call sends the programs
        wait([r.future for p in opt.params for c in p.cells.flat for r in getattr(c.value, "replicas", ())
              or (c.value,)])
        client = embedded_runtime.client
        fresh_transfer_logs(client)
        losses += [step(x, y) for _ in range(3)]
        wait([r.future for p in opt.params for c in p.cells.flat for r in getattr(c.value, "replicas", ())
              or (c.value,)])
        moved = sum(sum(t["total"] for t in log) for log in
                    client.run(lambda dask_worker: list(dask_worker.transfer_incoming_log)).values()) / 3
        return losses, step.plan(x, y), moved

    losses, exe, moved = run(True)
    assert exe.shm and exe.shm <= exe.sends
    big = sum(exe.plans[cid].outputs[k].nbytes for (cid, _), read in exe.cross.items() for k in read
              if exe.plans[cid].outputs[k].nbytes >= 1024)
    tcp_losses, tcp_exe, tcp_moved = run(False)
    assert not tcp_exe.shm
    assert losses == tcp_losses  # the same values, moved another way
    assert moved < tcp_moved - 0.9 * big, (moved, tcp_moved, big)  # the large values no longer cross TCP
    assert sum(embedded_runtime.client.run(_shm_files).values()) == 0  # every file read, and unlinked
