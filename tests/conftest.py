"""Shared test helpers: the one torch reference comparison, tilings and the tolerance table."""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from typing import Callable, Sequence

import numpy as np
import pytest

import tilegraph as tg

# One tolerance table for every op: (rtol, atol relative to the reference's largest magnitude).
TOL = {
    np.dtype(np.float32): (2e-4, 2e-5),
    np.dtype(np.float64): (1e-9, 1e-11),
}
DTYPES = [np.float32, np.float64]
MODES = ["single", "even", "ragged"]


#: parametrize a test over the three tilings and the two float dtypes
by_mode = pytest.mark.parametrize("mode", MODES)
by_dtype = pytest.mark.parametrize("dtype", DTYPES)


@contextlib.contextmanager
def scheduler_file_written_later(path, address: str, delay: float):
    """A thread writing, ``delay`` seconds in, a Dask scheduler file at ``path`` that names
    ``address`` (a scheduler starting beside the client that connects through the file)."""
    def write():
        time.sleep(delay)
        path.write_text(json.dumps({"type": "Scheduler", "address": address}))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield
    finally:
        writer.join()


#: the shared-memory files of MPICH's ranks on one node, and the POSIX semaphores of Python's
#: multiprocessing (dask-mpi's ranks make 6, which a rank ended by a signal leaves behind)
MPICH_SHM = "/dev/shm/mpich_shm_*"
MP_SEMAPHORES = "/dev/shm/sem.mp-*"


def mpich_shm_files() -> set[str]:
    import glob

    return set(glob.glob(MPICH_SHM)) | set(glob.glob(MP_SEMAPHORES))


def shm_mapped(pids=None) -> set[str]:
    """The /dev/shm files that the processes ``pids`` (None: every live process) have mapped, by
    their memory maps (a semaphore in use is mapped)."""
    import glob

    maps = glob.glob("/proc/[0-9]*/maps") if pids is None else [f"/proc/{pid}/maps" for pid in pids]
    held = set()
    for path in maps:
        try:
            with open(path) as f:
                # the path field, without a " (deleted)" after it (a file unlinked while mapped)
                held.update(line.split()[5] for line in f if "/dev/shm/" in line)
        except OSError:  # (a process gone meanwhile, or not ours to read)
            continue
    return held


def remove_mpich_shm_since(before: set[str]) -> None:
    """Remove the MPICH shared-memory files and multiprocessing semaphores made since ``before``
    (:func:`mpich_shm_files`) that no live process holds: ranks ended by a signal or MPI_Abort leave
    theirs in /dev/shm (an MPICH file is 3 MB; a dask-mpi launch leaves 6 semaphores)."""
    new = mpich_shm_files() - before
    held = shm_mapped() if new else set()
    for leftover in new - held:
        try:
            os.remove(leftover)
        except OSError:
            pass


def stop_process(proc) -> None:
    """End a subprocess a test started (an mpiexec launch, ...) and wait for it, whatever state it
    is in: terminate, then kill after 20 s."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def randn(rng, *shape, dtype=np.float64) -> np.ndarray:
    """Standard normal test data of ``dtype``."""
    return rng.standard_normal(shape).astype(dtype)


def tile_size(n: int, mode: str) -> int:
    """Tile size for a dim of size ``n``: one tile, equal tiles, or tiles with a ragged last one."""
    if mode == "single" or n <= 1:
        return max(n, 1)
    if mode == "even":
        for parts in (2, 3, 4, 5):
            if n % parts == 0:
                return n // parts
        return n
    if mode == "ragged":
        for t in range(math.ceil(n / 2.5), n):
            if n % t:
                return t
        return max(1, n - 1)
    raise ValueError(mode)


def tiles_for(shape: Sequence[int], labels: str, mode: str, sizes: dict | None = None) -> tuple:
    """Tile sizes for ``shape`` whose dims are named by ``labels``; a label gets one size everywhere,
    so operands that must agree (contraction dims, broadcast dims) do. Uppercase labels stay whole."""
    sizes = {} if sizes is None else sizes
    out = []
    for n, lab in zip(shape, labels):
        if lab.isupper():
            out.append(None)
            continue
        if lab not in sizes:
            sizes[lab] = tile_size(n, mode)
        out.append(min(sizes[lab], n) if n else None)
    return tuple(out)


def _torch():
    return pytest.importorskip("torch")


def check_against_torch(fn: Callable, torch_fn: Callable, arrays: Sequence[np.ndarray], dims: str, mode: str,
                        *, grad: bool = True, grad_of: Sequence[int] | None = None, tol_scale: float = 1.0,
                        seed: int = 0):
    """Compare ``fn(*TileTensors)`` with ``torch_fn(*torch tensors)``: forward, and the gradients of
    ``sum(out * R)`` for a random R with respect to every floating input (or ``grad_of``).

    ``dims`` names each array's dims, comma separated (``"bmk,kn"``); equal letters share tiles.
    Returns the tilegraph output TileTensor.
    """
    torch = _torch()
    labels = dims.split(",")
    assert len(labels) == len(arrays), "one label group per array"
    sizes: dict = {}
    tts = [tg.from_numpy(a, tiles_for(a.shape, lab, mode, sizes)) for a, lab in zip(arrays, labels)]
    floats = [i for i, a in enumerate(arrays) if np.issubdtype(a.dtype, np.floating)]
    grad_of = floats if grad_of is None else list(grad_of)
    refs = [torch.tensor(a, requires_grad=(i in grad_of and grad)) for i, a in enumerate(arrays)]

    out = fn(*tts)
    ref = torch_fn(*refs)
    assert out.shape == tuple(ref.shape), f"shape {out.shape} vs torch {tuple(ref.shape)}"
    assert out.dtype == np.dtype(str(ref.dtype).replace("torch.", "")), f"dtype {out.dtype} vs {ref.dtype}"
    dtype = np.dtype(out.dtype)
    rtol, atol = TOL[dtype]
    rtol, atol = rtol * tol_scale, atol * tol_scale

    if not grad:
        (got,) = tg.compute(out)
        _close(got, ref.detach().numpy(), rtol, atol, "forward")
        return out

    rng = np.random.default_rng(seed + 1)
    r = rng.standard_normal(out.shape).astype(dtype)
    loss = (out * tg.from_numpy(r, out.chunks)).sum()
    grads = tg.grad(loss, [tts[i] for i in grad_of])
    got = tg.compute(out, *grads)
    (ref * torch.tensor(r)).sum().backward()
    _close(got[0], ref.detach().numpy(), rtol, atol, "forward")
    for i, g in zip(grad_of, got[1:]):
        _close(g, refs[i].grad.numpy(), rtol, atol, f"gradient of input {i}")
    return out


def _close(got, want, rtol, atol, what):
    finite = np.abs(want[np.isfinite(want)]) if np.size(want) else np.zeros(0)
    scale = float(finite.max()) if finite.size else 1.0  # -inf entries (masks) must not widen atol
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol * max(scale, 1.0), err_msg=what)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def local_scheduler():
    """Run graphs on Dask's synchronous scheduler inside the test (restored afterwards)."""
    old = tg.config.local_scheduler
    tg.config.local_scheduler = "sync"
    yield
    tg.config.local_scheduler = old


def _two_workers():
    """An embedded cluster of 2 worker processes x 1 thread, closed after its user."""
    rt = tg.connect(n_workers=2, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)
    try:
        yield rt
    finally:
        rt.close()


def _unbounded_log(dask_worker):
    from collections import deque

    dask_worker.transfer_incoming_log = deque()


def fresh_transfer_logs(client) -> None:
    """Give every worker an empty log of the transfers it receives, without a length limit: Dask
    keeps the last ``low-level-log-length`` entries (100 in tilegraph's clusters), which a few
    steps' fetches can pass, and a sum over the log would then fall short."""
    client.run(_unbounded_log)


def counting_scatters(monkeypatch, rt) -> list:
    """The number of values each ``rt.scatter_cells`` call sends (those not on the workers yet),
    one entry a call, from now on."""
    sent = []
    real = rt.scatter_cells

    def scatter_cells(cells, workers=None):
        sent.append(sum(not isinstance(c.value, tg._graph.ValueRef) for c in cells))
        return real(cells, workers)

    monkeypatch.setattr(rt, "scatter_cells", scatter_cells)
    return sent


def retire_as_values_are_sent(monkeypatch, rt) -> str:
    """Have ``rt``'s second worker (by address) retired the moment values are next sent to the
    workers (an adaptive cluster scaling an idle worker down as the first step starts); returns
    its address."""
    victim = sorted(rt.workers())[1]
    real = type(rt).scatter_cells

    def retire_first(self, cells, workers=None):
        if victim in self.workers():
            self.client.retire_workers([victim])
        return real(self, cells, workers)

    monkeypatch.setattr(type(rt), "scatter_cells", retire_first)
    return victim


def fake_hosts(monkeypatch, runtime, host_of=None):
    """Make ``runtime``'s workers look as if they ran on several hosts: worker ``a`` on host
    ``host_of[a]`` (default: each on a host of its own), by the shared-memory identities the
    gang planner reads, as a cluster of several nodes would give them."""
    real = runtime.gang_identities
    monkeypatch.setattr(runtime, "gang_identities",
                        lambda addrs: {a: ((host_of or {}).get(a, f"host-{a}"), *real([a])[a][1:]) for a in addrs})


@pytest.fixture(scope="session")
def embedded_runtime():
    """One embedded cluster (2 workers) shared by the distributed tests; use ``rt.as_current()``."""
    yield from _two_workers()


@pytest.fixture
def own_runtime():
    """A 2-worker cluster of the test's own (one whose worker a test may kill or break)."""
    yield from _two_workers()


def pytest_collection_modifyitems(config, items):
    has_gpu = False
    if os.environ.get("TILEGRAPH_GPU_TESTS", "1") != "0":
        try:
            import cupy

            has_gpu = cupy.cuda.runtime.getDeviceCount() > 0
        except Exception:
            has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA device and CuPy")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def lm_ids(vocab: int, seed: int = 0, shape=(2, 8)) -> np.ndarray:
    """Random token ids for the language-model tests."""
    return np.random.default_rng(seed).integers(0, vocab, shape)


def lm_loss(model, ids, targets):
    """Next-token cross-entropy of ``model`` (a tg.Trainer loss_fn)."""
    return tg.cross_entropy(model(ids), targets)


def regression_data(seed: int, rows: int):
    """A Trainer's ``data(step)`` for the README's first MLP: ``rows`` random (x, tanh(x[:, :4]))
    of 16 features, drawn from (seed, step)."""
    def batch(step):
        x = np.random.default_rng([seed, step]).standard_normal((rows, 16)).astype(np.float32)
        return x, np.tanh(x[:, :4])
    return batch


def mse(m, x, y):
    """The mean squared error of ``m(x)`` against ``y`` (a tg.Trainer loss_fn)."""
    d = m(x) - y
    return (d * d).mean()


def mpiexec_or_skip() -> str:
    """The ``mpiexec`` of this Python's environment (the mpi extra's MPICH) or on PATH; skips the
    test where it, mpi4py or dask_mpi is missing."""
    import shutil
    import sys
    from pathlib import Path

    pytest.importorskip("mpi4py")
    pytest.importorskip("dask_mpi")
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (the mpi extra's mpich provides one)")
    return found


def connect_refused_within(seconds: float, match: str, *args, **kwargs) -> tuple[str, float]:
    """``tg.connect(*args, **kwargs)`` (never made current) raising a TileError matching
    ``match`` in under ``seconds``: (its message, the seconds it took)."""
    import time

    import tilegraph as tg

    start = time.monotonic()
    with pytest.raises(tg.TileError, match=match) as e:
        tg.connect(*args, make_current=False, **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.1f} s: {e.value}"
    return str(e.value), elapsed
