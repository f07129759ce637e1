"""What a fused task runs on a worker: a :class:`Program` of kernel calls over registers, run in
order on one thread or, as their inputs become ready, on several (:func:`run_cluster`); with
per-process counters of the time spent inside kernels (:func:`kernel_stats`)."""

from __future__ import annotations

import contextlib
import heapq
import os
import sys
import threading
import time
from typing import Any, NamedTuple

import numpy as np

from tilegraph._errors import TileError
from tilegraph._graph import checking_in, deferred_device_checks, raise_failed_checks

__all__ = ["Call", "Program", "Bound", "Results", "run_cluster", "kernel_stats"]


class Results(tuple):
    """A task's result values. Dask sizes a plain tuple of more than ten values from ten sampled
    ones; the size of these is exact, which is what a worker's spilling to disk and its memory
    limit go by (a task's results are a tuple of tiles of very different sizes)."""

    __slots__ = ()


_SIZEOF = []  # Dask's sizeof, once :func:`measured_exactly` registered Results with it


def _results_sizeof(values: Results) -> int:
    size = _SIZEOF[0]
    return sys.getsizeof(values) + sum(size(v) for v in values)


def measured_exactly(values: tuple) -> Results:
    """``values`` as :class:`Results`, whose size Dask measures exactly (registered with Dask's
    ``sizeof`` on first use: in a worker, where Dask is loaded anyway)."""
    if not _SIZEOF:
        from dask.sizeof import sizeof

        sizeof.register(Results)(_results_sizeof)
        _SIZEOF.append(sizeof)
    return Results(values)


class Call(NamedTuple):
    """One kernel call of a task's program, over the task's registers."""

    kernel: Any           # the Kernel
    params: dict
    ins: tuple            # input registers
    outs: tuple           # output registers
    metas: tuple          # (shape, dtype) of each output
    free: tuple           # registers freed after it (one thread running the calls in order)
    op: str               # the op that recorded it (error messages)
    scope: str            # the model part and phase (timings per part)


class Program:
    """What one fused task runs: kernel calls (:class:`Call`) over registers, in a valid order.
    With ``threads > 1`` the task runs its kernels on that many threads of its worker process as
    their inputs become ready (``deps``/``succs`` give the dependencies between the task's ops,
    ``uses`` how many ops read each register); otherwise it runs them one after another.
    """

    __slots__ = ("ops", "n_ext", "n_regs", "out_regs", "device", "array_module", "label", "threads",
                 "deps", "succs", "uses")

    def __init__(self, ops, n_ext, n_regs, out_regs, device, array_module, label, threads=1,
                 deps=(), succs=(), uses=()):
        self.ops = ops
        self.n_ext, self.n_regs, self.out_regs = n_ext, n_regs, out_regs
        self.device, self.array_module, self.label = device, array_module, label
        self.threads, self.deps, self.succs, self.uses = threads, deps, succs, uses

    def __getstate__(self):
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state):
        for s, v in zip(self.__slots__, state):
            setattr(self, s, v)


class Bound:
    """Which element of each input argument a task takes (None: the whole value)."""

    __slots__ = ("ext_index",)

    def __init__(self, ext_index: tuple):
        self.ext_index = ext_index

    def __getstate__(self):
        return self.ext_index

    def __setstate__(self, state):
        self.ext_index = state


def _to_device(x, device: str, array_module: str):
    if device == "gpu" and array_module == "cupy":
        try:
            import cupy
        except ImportError as e:  # a worker given {"GPU": 1} without the GPU extra: say so, not a bare import error
            raise TileError(f"tilegraph: GPU kernels on worker process {os.getpid()}",
                            "CuPy on every worker with a GPU resource (pip install 'tilegraph[gpu]'; or give that "
                            "worker no GPU resource; tg.config.gpu_array_module = 'numpy' emulates GPU workers on "
                            "NumPy)", f"{type(e).__name__}: {e}") from None
        return cupy.asarray(x)
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return realigned(x)


def realigned(x):
    """``x``, or a copy of it where its data does not start at a multiple of its item size.
    Dask packs a message's small frames into one buffer, so an array it received (a value
    scattered to this worker, or another worker's result) can start at any byte, and NumPy then
    takes slow paths: a (1, 768) x (768, 7180) product took 6.2 ms on such a GPT-2 embedding
    tile against 1.9 ms on its copy, which is what every kernel reading it paid."""
    if isinstance(x, np.ndarray) and not x.flags.aligned:
        return x.copy()
    return x


#: per-process counters: seconds inside kernels, seconds inside fused tasks, tasks run
_STATS = {"kernel_seconds": 0.0, "task_seconds": 0.0, "tasks": 0}
_BY_KERNEL: dict[str, float] = {}
_BY_SCOPE: dict[str, float] = {}
_STATS_LOCK = threading.Lock()
#: called (no arguments) in this process after each task's kernels: a worker under a memory limit
#: hands freed memory back to the system there (see ``tilegraph.runtime.worker_setup._tune_malloc``)
AFTER_TASK: list = []


def kernel_stats(reset: bool = False) -> dict:
    """This process's counters: kernel seconds (also ``by_kernel`` name and ``by_scope``, the
    model part and phase that recorded the kernels, e.g. ``blocks.0.attn:backward``), task
    seconds (wall time times the threads a task held), tasks run. See Runtime.kernel_stats for
    the sum over a cluster's workers."""
    with _STATS_LOCK:
        out = dict(_STATS, by_kernel=dict(_BY_KERNEL), by_scope=dict(_BY_SCOPE))
        if reset:
            _STATS.update(kernel_seconds=0.0, task_seconds=0.0, tasks=0)
            _BY_KERNEL.clear()
            _BY_SCOPE.clear()
    return out


#: wait for the GPU after each kernel, so that its seconds are the GPU's (a profiling aid: kernels
#: on a GPU are only queued otherwise, and their seconds measure the queueing)
SYNC_GPU_KERNELS = os.environ.get("TILEGRAPH_SYNC_KERNELS", "") not in ("", "0")


def _where(op: Call) -> str:
    return f"in tile kernel {op.kernel.name!r} of op {op.op!r}" + (f" in {op.scope}" if op.scope else "")


def _tiles(op: Call, regs: list) -> str:
    """Which tiles a failed call had (its inputs, as they came) and was to make (as declared)."""
    def meta(v) -> str:
        shape, dtype = getattr(v, "shape", None), getattr(v, "dtype", None)
        return f"{tuple(shape)} {dtype}" if shape is not None and dtype is not None else type(v).__name__

    ins = ", ".join(meta(regs[i]) for i in op.ins) or "none"
    outs = ", ".join(f"{shape} {np.dtype(dtype)}" for shape, dtype in op.metas)
    return f"on input tiles {ins} making {outs}"


def _call(op: Call, regs: list, device: str) -> tuple[tuple, float]:
    """Run one kernel call on its input registers; returns (output values, seconds)."""
    fn = op.kernel.impl(device)
    t0 = time.perf_counter()
    try:
        if device == "gpu":
            checking_in(op)
        res = fn(*[regs[i] for i in op.ins], **op.params)
        if SYNC_GPU_KERNELS and device == "gpu":
            _gpu_sync()
    except Exception as e:  # say which op failed, on which tiles; the traceback keeps the cause
        e.add_note(f"{_where(op)}, {_tiles(op, regs)}")
        raise
    dt = time.perf_counter() - t0
    if len(op.outs) == 1:
        res = (res,)
    elif not isinstance(res, (tuple, list)) or len(res) != len(op.metas):
        _bad_result(op, res)
    try:
        for val, (shape, dtype) in zip(res, op.metas):
            if val.shape != shape or val.dtype != dtype:
                raise TileError(f"tile kernel {op.kernel.name} of op {op.op}",
                                f"computed tile does not match its declared meta {shape} {dtype}",
                                f"{val.shape} {val.dtype}")
    except AttributeError:  # not an array (a list, a Python float): no shape or dtype
        _bad_result(op, res[0] if len(op.outs) == 1 else res)
    return res, dt


def _bad_result(op: Call, res) -> None:
    """Raise the error of a kernel call that returned no array (or no tuple of one array per
    declared output)."""
    n = len(op.metas)
    metas = ", ".join(f"{shape} {dtype}" for shape, dtype in op.metas)
    if n == 1:
        what = f"a tile kernel must return an array (NumPy, or CuPy on a GPU) of its declared meta {metas}"
    else:
        what = (f"a tile kernel with {n} declared outputs must return a tuple of {n} arrays (NumPy, or CuPy on "
                f"a GPU) of its declared metas {metas}")

    def describe(v) -> str:
        if isinstance(v, (tuple, list)):
            inner = ", ".join(describe(x) for x in v[:4]) + (", ..." if len(v) > 4 else "")
            return f"{type(v).__name__} of {len(v)}: ({inner})"
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            return f"{type(v).__name__} {tuple(v.shape)} {v.dtype}"
        import reprlib

        return f"{type(v).__name__} {reprlib.repr(v)}"

    raise TileError(f"tile kernel {op.kernel.name} of op {op.op}", what, describe(res))


def _gpu_sync() -> None:
    cupy = sys.modules.get("cupy")  # None: GPU workers emulated with NumPy (config.gpu_array_module)
    if cupy is not None:
        cupy.cuda.get_current_stream().synchronize()


def _device_checks(prog: Program, checks: list):
    """On a GPU task: the checks its kernels make of device values, kept in ``checks`` and read
    once its kernels are queued (``_graph.check_on_device``)."""
    return deferred_device_checks(checks) if prog.device == "gpu" else contextlib.nullcontext()


def _quiet_floats():
    """NumPy's floating-point warnings off while kernels run (inf and NaN still come out, as in
    torch). A diverging run otherwise printed a RuntimeWarning per kernel line (overflow in exp,
    invalid value in matmul, ...) pointing into tilegraph's ops, from the workers, before the
    Trainer's own error naming the step where the loss stopped being finite."""
    return np.errstate(all="ignore")


_POOL = None
_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_POOL_LOCK = threading.Lock()


def _pool_and_slots(threads: int):
    """This process's kernel threads, and a semaphore letting at most ``threads`` kernels run at
    once however many fused tasks Dask runs side by side on the worker."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="tilegraph-kernel")
        if threads not in _SLOTS:
            _SLOTS[threads] = threading.BoundedSemaphore(threads)
        return _POOL, _SLOTS[threads]


class _ParallelRun:
    """One task's kernels run by several threads, each taking the ready kernel that comes first in
    the program's order (the planner's priority) until all are done or one failed."""

    def __init__(self, prog: Program, regs: list, slots):
        self.prog, self.regs, self.slots = prog, regs, slots
        self.pending = list(prog.deps)
        self.uses = list(prog.uses)
        self.keep = set(prog.out_regs)
        self.ready = [k for k, d in enumerate(prog.deps) if d == 0]
        heapq.heapify(self.ready)
        self.left = len(prog.ops)
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.by_kernel: dict[str, float] = {}
        self.checks: list = []

    def work(self) -> None:
        # each thread's own NumPy error state (a context variable) and list of checks (the task's)
        with _quiet_floats(), _device_checks(self.prog, self.checks):
            self._work()

    def _work(self) -> None:
        prog, regs, cond = self.prog, self.regs, self.cond
        while True:
            with cond:
                while not self.ready and self.left and self.error is None:
                    cond.wait()
                if not self.left or self.error is not None:
                    return
                k = heapq.heappop(self.ready)
            op = prog.ops[k]
            try:
                with self.slots:
                    res, dt = _call(op, regs, prog.device)
            except BaseException as e:
                with cond:
                    if self.error is None:
                        self.error = e
                    cond.notify_all()
                return
            with cond:
                for r, val in zip(op.outs, res):
                    regs[r] = val
                for r in set(op.ins):
                    self.uses[r] -= 1
                    if not self.uses[r] and r not in self.keep:
                        regs[r] = None
                _count(self.by_kernel, op, dt)
                woken = 0
                for s in prog.succs[k]:
                    self.pending[s] -= 1
                    if not self.pending[s]:
                        heapq.heappush(self.ready, s)
                        woken += 1
                self.left -= 1
                if not self.left:
                    cond.notify_all()
                elif woken > 1:  # this thread takes one of them itself
                    cond.notify(woken - 1)


def run_cluster(bound: Bound, prog: Program, *args):
    """Run one fused task: its kernels (in order, or on the worker's threads), returning the values
    other tasks need."""
    t_start = time.perf_counter()
    regs: list[Any] = [None] * prog.n_regs
    for r, (a, idx) in enumerate(zip(args, bound.ext_index)):
        regs[r] = _to_device(a if idx is None else a[idx], prog.device, prog.array_module)
    held = min(prog.threads, len(prog.ops))  # threads this task keeps busy
    if held > 1:
        pool, slots = _pool_and_slots(prog.threads)
        run = _ParallelRun(prog, regs, slots)
        for _ in range(held - 1):
            pool.submit(run.work)
        run.work()
        if run.error is not None:
            raise run.error
        by_kernel, checks = run.by_kernel, run.checks
    else:
        by_kernel: dict[tuple[str, str], float] = {}
        checks = []
        with _quiet_floats(), _device_checks(prog, checks):
            for op in prog.ops:
                res, dt = _call(op, regs, prog.device)
                _count(by_kernel, op, dt)
                for r, val in zip(op.outs, res):
                    regs[r] = val
                for r in op.free:
                    regs[r] = None
    raise_failed_checks(checks, _where)  # the task's one wait for its GPU, if its kernels checked values there
    out = measured_exactly(tuple(regs[r] for r in prog.out_regs))
    for hook in AFTER_TASK:
        hook()
    with _STATS_LOCK:
        _STATS["kernel_seconds"] += sum(by_kernel.values())
        _STATS["task_seconds"] += (time.perf_counter() - t_start) * max(held, 1)
        _STATS["tasks"] += 1
        for (name, where), dt in by_kernel.items():
            _BY_KERNEL[name] = _BY_KERNEL.get(name, 0.0) + dt
            _BY_SCOPE[where] = _BY_SCOPE.get(where, 0.0) + dt
    _digest_kernels(by_kernel)
    return out


_BLAS = None


def one_blas_thread():
    """A context in which BLAS libraries (OpenBLAS, MKL, BLIS, via threadpoolctl) run each call on
    one thread: where tilegraph's kernels themselves run on several threads of this process. Dask
    workers already have one (their nanny sets ``OPENBLAS_NUM_THREADS=1``); in a process running
    a graph itself, OpenBLAS's own threads beside the kernels' made the same graph take 20-36 ms
    by stretches instead of a steady 20 ms on 2 cores. The setting is the process's: it comes
    back when the context ends (the limit itself applies at once: call it in a ``with``)."""
    return blas_controller().limit(limits=1, user_api="blas")


def blas_controller():
    """threadpoolctl's controller of the BLAS libraries loaded when it was first asked for
    (NumPy's, which the kernels call)."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS


def task_meter():
    """Dask's per-task metrics (``distributed.metrics.context_meter``): what a task digests shows
    on the dashboard's Fine Performance Metrics page as an activity of that task's group."""
    from distributed.metrics import context_meter

    return context_meter


def _digest_kernels(by_kernel: dict) -> None:
    """Hand the task's kernel seconds by kernel name (``kernel:matmul``, ...) to Dask's metrics.
    They are thread-seconds: a task whose kernels ran on several threads can digest more than its
    wall time (Dask then counts none of it as ``thread-cpu``). Outside a Dask task this does
    nothing."""
    meter = task_meter()
    totals: dict[str, float] = {}
    for (name, _), dt in by_kernel.items():
        totals[name] = totals.get(name, 0.0) + dt
    for name, dt in totals.items():
        meter.digest_metric(f"kernel:{name}", dt, "seconds")


#: the kernels this process has called: a kernel's first call compiles it (Numba, or loads its
#: cached machine code), up to a second for the embedding's, and counts under FIRST_CALLS
_CALLED: set[str] = set()
#: the scope of a kernel's first call in a process in the time per model part: it would read as
#: the first fit's most expensive part (the embedding: 82-93% of a fresh gpt2-debug fit's kernels)
FIRST_CALLS = "first calls (compiling)"


def _count(seconds: dict, op: Call, dt: float) -> None:
    name = op.kernel.name
    if name not in _CALLED:
        _CALLED.add(name)
        key = (name, FIRST_CALLS)
    else:
        key = (name, op.scope)
    seconds[key] = seconds.get(key, 0.0) + dt

