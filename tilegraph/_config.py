"""The global knobs (``tilegraph.config``), read by the ops, the planner and training."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tilegraph._errors import TileError

__all__ = ["Config", "config", "PARALLEL_STRATEGIES", "BATCH_SPLITTING_STRATEGIES", "EXCHANGES"]


#: the values of ``config.parallel`` (and of the ``parallel=`` option of TrainStep and Executable)
PARALLEL_STRATEGIES = ("auto", "tiles", "data", "sharded", "zero3")
#: the strategies that give each worker process a share of the batch's row tiles
BATCH_SPLITTING_STRATEGIES = ("data", "sharded", "zero3")
#: why a "zero3" step runs as Dask tasks, never as gangs (after "its parameters stay with their owners")
ZERO3_TASKS_WHY = "each task fetches the ones it reads, and a gang would hold them all for the whole step"
#: the values of ``config.exchange``
EXCHANGES = ("auto", "gang", "tasks")
#: what the planner takes a move between worker processes of one host to run at (bytes per
#: second): localhost TCP with serialisation moved 100-400 MB values at 0.4-2 GB/s between two
#: workers of the 2-core development machine (values of 1 MiB and more go through shared memory
#: there, faster)
DEFAULT_TRANSFER_BYTES_PER_SECOND = 1e9
#: ``config.bucket_bytes = "auto"``: the gradient buckets of a data-parallel plan whose worker
#: processes span several hosts (PyTorch DDP's default size)
AUTO_BUCKET_BYTES = 25e6


@dataclass
class Config:
    """Global knobs of the lowering (``tilegraph.config``). Each assignment is checked: a name
    that is no setting, or a value a setting cannot take, is a TileError that names it."""

    fuse: bool = True
    #: estimated wall seconds of one fused task (its kernels spread over its worker's threads);
    #: Dask pays ~1-10 ms per dependent task, plus the wait for a task's slowest kernel. Measured
    #: on the bench block stack (2 cores): 0.5 s -> 4 tasks/step, 5.5% outside kernels; 1.0 s ->
    #: 2 tasks/step, 3.9%
    target_seconds: float = 1.0
    #: a graph spreads over another worker process only when each gets at least this much estimated
    #: work (~20 Dask hops). Measured on the bench MLP, 2 workers x 1 thread: a full task's worth
    #: (1 s) kept its 1.4 s step on one worker (0.48 of torch); 0.1 s spreads it (0.78). inf: never
    #: (a "tiles" plan keeps to one worker process)
    min_process_seconds: float = 0.1
    #: training steps whose estimated time is below this are recorded several to a graph
    #: (``TrainStep.auto_steps_per_graph``, used by the Trainer): one graph then pays Dask's
    #: ~10-40 ms per submission and dependent hop for all of them
    graph_seconds: float = 0.1
    #: at most this many optimizer steps per graph (recording and planning grow with it)
    max_steps_per_graph: int = 32
    #: weight gradients (``a^T @ g`` summed over row tiles) as one product per row tile plus a
    #: sum tree, instead of one kernel looping over the row tiles
    split_weight_grads: bool = True
    #: speed of moving a value between worker processes, for the plan (bytes per second).
    #: "auto": where the workers span several hosts, measured on the runtime the first time a
    #: plan spans several worker processes (``Runtime.link_bytes_per_second``: a value moved
    #: between workers on two hosts, over the cluster's own comms), and
    #: :data:`DEFAULT_TRANSFER_BYTES_PER_SECOND` on one host (where the measure would add
    #: nothing but run-to-run noise to the plans). A number sets it everywhere.
    transfer_bytes_per_second: float | str = "auto"
    #: "cpu", "gpu" or "auto" (GPU for heavy kernels when GPU workers exist)
    placement: str = "auto"
    #: "auto" placement sends a kernel to GPU workers when it has at least this many flops and
    #: the cost model (``speeds``) has it finish sooner there; kernels reading its values follow it
    gpu_min_flops: float = 1e6
    #: array library of GPU tasks: "cupy", or "numpy" to emulate GPU workers on a CPU-only machine
    gpu_array_module: str = "cupy"
    #: latency Dask adds per dependent task (measured ~6 ms on 2 cores); spreading work over
    #: another worker only pays when it saves more than this
    hop_seconds: float = 0.005
    #: data parallelism: gradients leave their process in buckets of about this many bytes while
    #: the backward pass goes on (as PyTorch DDP's 25 MB buckets); inf: one exchange after the
    #: backward. "auto": :data:`AUTO_BUCKET_BYTES` where the plan's worker processes span several
    #: hosts, one exchange where they share one. On one host a transfer under way takes CPU
    #: and the GIL from the kernels it would overlap, and each bucket costs a task boundary.
    #: Measured on 2 cores, 2 workers x 1 thread, GPT-2 6x768 (330 MB of gradients): 32 MB
    #: buckets 262 tok/s, 100 MB 280, 256 MB 278, one exchange 305 (one process x 2 threads:
    #: 304); block stack: 608 either way. Between hosts the link, not the CPU, is the bottleneck,
    #: and buckets hide part of it behind the backward (the README's "Buckets between hosts")
    bucket_bytes: float | str = "auto"
    #: values read by another worker process of the same host go through shared memory
    #: (``/dev/shm``, :mod:`tilegraph.exec.shm`; a gang step's channels too) rather than Dask's
    #: loopback TCP, when they hold at least ``shm_min_bytes``. Measured on 2 cores: 0.09 against 0.21 CPU seconds per 170 MB
    shm_transfers: bool = True
    shm_min_bytes: int = 1 << 20
    #: how the worker processes of a data-parallel plan exchange values (``tilegraph.parallel.gang``):
    #: "gang" runs each process's share of a call as one Dask task, all at once, the values
    #: between them going through channels as soon as they are made (shared-memory files on one
    #: host, the workers' own comms between hosts); "tasks" writes them as Dask tasks (send, receive, update, push: each
    #: dependent task is a round trip through the scheduler, 6-25 ms on 2 busy cores); "auto":
    #: "gang" wherever it applies. Measured on 2 cores, block stack, 2 workers x 1 thread: see
    #: the README's scaling table
    exchange: str = "auto"
    #: a gang step's wait for another process's values fails after this long (it fails at once
    #: when that process is gone, or when the step is cancelled)
    exchange_timeout_seconds: float = 600.0
    #: how a training step spreads over several worker processes (``PARALLEL_STRATEGIES``):
    #: "tiles" list-schedules the tile kernels over all processes; "data" gives each process a
    #: share of the batch's row tiles and a replica of the parameters and optimizer state
    #: (gradients summed across replicas inside the graph); "sharded" is "data" with each
    #: parameter tile's gradient sum, update and optimizer state on one owner process, which
    #: sends the new parameter to every other process (ZeRO-2: each holds all parameters);
    #: "zero3" is "sharded" with the parameters kept by their owner alone, each task fetching
    #: the ones it reads, no task reading more than a process's share of them, and the copies
    #: dropped once read (ZeRO-3, FSDP's full sharding: what each worker holds, between steps
    #: and at a step's peak, falls with the number of workers, measured in the README; the step
    #: runs as Dask tasks);
    #: "sharded" runs as "zero3" where tasks are kept under a memory bound and no gang runs.
    #: "auto" plans "tiles" and "sharded"; it keeps "sharded" where the tiles plan spans several
    #: processes, else the one whose simulated step finishes first ("sharded" rather than "data":
    #: the same bytes cross processes, each replica updates only its share and holds less;
    #: measured on 2 cores, 2 x 1 workers, two runs each: GPT-2 6 x 768 sharded 423-452 tok/s
    #: against data 386-414, the block stack 772-825 against 723-807). The simulation misjudges
    #: both plans across processes: it leaves out the tiles plan's waits for whole tasks and
    #: copies, and models a data-parallel exchange as Dask tasks where it runs as one gang task
    #: per process. Block stack on 16 cores (batch 16): simulated tiles 0.97 / 0.84 / 0.89 s per
    #: step for 2 x 8 / 4 x 4 / 8 x 2, sharded 3.55 / 2.18 / 1.41 s; sharded measured 1.31 /
    #: 1.29 / 1.68 s (0.93 / 0.95 / 0.73 of torch with 16 threads), where tiles across processes
    #: has measured 0.61 / 0.30 / 0.22 of torch; on 2 cores sharded beat tiles for every model
    parallel: str = "auto"
    #: "zero3": drop the parameters a process fetched for the forward pass once its forward
    #: tasks have read them, and fetch them again for the backward (FSDP's
    #: reshard_after_forward): a step's peak holds the fetched parameters of the layers under
    #: way, not of every layer run, for twice the parameter traffic. False: a copy stays from
    #: the forward to the backward (measured in the README)
    zero3_reshard_after_forward: bool = True
    #: "zero3": as soon as a process's task is sent to its worker, that worker fetches what its
    #: next tasks there read from other workers (their parameters), while the task runs, as
    #: FSDP prefetches the next layer's parameters; else a task's inputs are fetched only once it
    #: may start (Dask's rule), with its worker idle meanwhile. Fetched one task ahead: two
    #: ahead held more and ran no faster (measured in the README). Not under a memory bound
    #: (a model larger than the workers' memory): there what arrives early is spilled to disk
    zero3_prefetch: bool = True
    #: a fused task's memory bound (its inputs plus everything its kernels write) stays under
    #: this share of the smallest worker memory limit, so that a worker can hold a task while
    #: Dask spills the other task results it keeps (parameters, optimizer state, activations)
    #: to disk: what lets a sharded model larger than the workers' memory train. A worker runs
    #: a task per thread at once, and Dask pauses it at 80% of its limit, with the
    #: interpreter's own ~150 MB counted.
    #: Applied where all of a step's values (leaves and kernel outputs) take over half the limit:
    #: elsewhere nothing needs spilling, and tasks shaped by time alone run faster.
    task_memory_fraction: float = 0.1
    #: scheduler when no runtime is connected: "threads" or "sync"
    local_scheduler: str = "threads"
    #: assumed speeds for the cost model: (flop/s, byte/s, seconds per kernel call)
    #: (CPU: one core of the development machine, OpenBLAS fp32 GEMM ~125 GFLOP/s; a call on
    #: tiny tiles takes ~10 us, mostly Python and NumPy dispatch. GPU: an H100 in fp32; a call
    #: takes ~100 us, a few CuPy launches each: GPT-2 124M with every kernel on the GPU spent
    #: ~0.2 s per step on its 1,600 kernels outside attention)
    #: "cpu" always, "gpu" the default where not given (the planner weighs a kernel on each
    #: where GPU workers exist). Held
    #: read-only (:class:`Speeds`): ``config.speeds = {**config.speeds, "gpu": (...)}`` changes
    #: one device, checked as every assignment is; ``config.speeds["gpu"] = ...`` is refused
    speeds: Mapping = field(default_factory=lambda: dict(DEFAULT_SPEEDS))
    #: what the threads of one process cannot do at once, for ``plan.cluster.threads_worth_using``
    #: (a task keeps the number of threads, 1, 2, 4, ... or all, that it estimates quickest):
    #: the seconds of a kernel's estimated time that hold the GIL, at most (its Python: the
    #: runner's bookkeeping, argument handling, NumPy's dispatch; a kernel estimated shorter is
    #: taken to hold it all its time, as NumPy calls on small arrays do; inf: every kernel holds
    #: it all its time, and a task keeps one thread)...
    kernel_gil_seconds: float = 1e-4
    #: ... and the seconds of it that handing a kernel to another thread adds (waking the thread,
    #: passing the GIL). On 2 cores, 164 kernels of ~40 us took 6.4 ms on one thread and 9.6 ms on two.
    thread_handoff_seconds: float = 2e-5

    def __setattr__(self, name: str, value) -> None:
        check = _CHECKS.get(name)
        if check is None:
            from difflib import get_close_matches

            near = get_close_matches(name, list(_CHECKS), n=1)
            raise TileError("tilegraph.config", "one of its settings" + (f" (did you mean {near[0]!r}?)" if near else
                                                                        f": {', '.join(_CHECKS)}"), repr(name))
        ok, want = check
        if not ok(value):
            raise TileError(f"tilegraph.config.{name}", f"must be {want}", repr(value))
        store = _STORED_AS.get(name)
        object.__setattr__(self, name, value if store is None else store(value))


@functools.cache
def usable_cores() -> int:
    """The cores this process may run on: the machine's, less those its CPU affinity mask leaves out
    (``taskset``, ``numactl``, a batch scheduler's binding) and beyond its cgroup CPU quota (a
    container's ``--cpus``, Slurm's ``--cpus-per-task``). Thread and worker counts follow this, not
    ``os.cpu_count()``: a job given 8 cores of a 64-core node must not start 64 threads' worth.
    Read once per process (the quota's files took ~0.25 ms a call; plans ask at every run)."""
    import os

    from dask.system import cpu_count

    return max(1, min(os.cpu_count() or 1, cpu_count()))


#: ``tilegraph train``'s embedded cluster starts at most this many worker processes per usable
#: core ([runtime] workers): each is a Python process (and its Dask nanny) on this machine, and
#: beyond a few per core they only share the cores out (`--set runtime.workers=100000` on 2
#: cores began spawning processes). Tests run up to 2 per core; the README's measurements 1 per core
WORKERS_PER_CORE = 4
#: the environment variable that sets another limit, for one who means more
MAX_WORKERS_VARIABLE = "TILEGRAPH_MAX_WORKERS"


def max_local_workers(where: str) -> tuple[int, str]:
    """The most worker processes an embedded cluster may start on this machine, and why, in words:
    ``$TILEGRAPH_MAX_WORKERS`` where it is set, else :data:`WORKERS_PER_CORE` per usable core
    (:func:`usable_cores`). A bad value of the variable is a TileError naming it (``where``: the
    command)."""
    import os

    text = os.environ.get(MAX_WORKERS_VARIABLE, "").strip()
    if text:
        try:
            most = int(text)
        except ValueError:
            most = 0
        if most < 1:
            raise TileError(where, f"{MAX_WORKERS_VARIABLE}: an integer >= 1 (the most worker processes an "
                            "embedded cluster may start)", repr(os.environ[MAX_WORKERS_VARIABLE]))
        return most, f"{MAX_WORKERS_VARIABLE}={most}"
    cores, machine = usable_cores(), os.cpu_count() or 1
    of = f" of the machine's {machine}" if machine != cores else ""
    return WORKERS_PER_CORE * cores, (f"{WORKERS_PER_CORE} per core, of the {cores} "
                                      f"core{'s' if cores > 1 else ''}{of} this process may use")


def over_worker_limit(where: str, workers) -> tuple[int, str] | None:
    """(the limit, why, in words) where ``workers`` worker processes are more than an embedded
    cluster may start on this machine (:func:`max_local_workers`), else None. The one place of
    the rule, for ``tilegraph train``'s [runtime] workers and ``tilegraph.connect``'s n_workers;
    each caller says it in its own words. No integer >= 1 (0 or None: the default count, one
    per 4 cores or per GPU) is never over it, and the variable is then not read."""
    if not is_int(workers, 1):
        return None
    most, why = max_local_workers(where)
    return (most, why) if workers > most else None


#: an embedded cluster's worker runs at most this many threads per usable core: threads past the
#: cores only share them out, and a worker's threads shape the plans made for it. Declaring more
#: threads than cores has its uses (tests make plans for 2 workers x 8 threads on 2 cores), so the
#: bound stops only what no machine runs (`threads_per_worker=10**6` was taken without a word)
THREADS_PER_CORE = 64


def over_thread_limit(threads) -> tuple[int, str] | None:
    """(the limit, why, in words) where ``threads`` threads per worker are more than
    :data:`THREADS_PER_CORE` per usable core (:func:`usable_cores`), else None (also for no
    integer >= 1: refused apart, as the type or range it must have)."""
    if not is_int(threads, 1):
        return None
    cores = usable_cores()
    most = THREADS_PER_CORE * cores
    return (most, f"{THREADS_PER_CORE} per core, of the {cores} core{'s' if cores > 1 else ''} this process "
                  "may use") if threads > most else None


def number_check(low: float = 0.0, strict: bool = False, high: float | None = None, below: bool = False,
                 whole: bool = False, finite: bool = False):
    """(check, what it wants) of a number (not a bool; an integer where ``whole``; not inf where
    ``finite``) at least ``low`` (above it where ``strict``) and at most ``high`` (below it where
    ``below``)."""
    def ok(v) -> bool:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral if whole else numbers.Real) or v != v:
            return False
        return ((v > low if strict else v >= low) and (high is None or (v < high if below else v <= high))
                and (not finite or math.isfinite(v)))
    noun = "an integer" if whole else "a finite number" if finite else "a number"
    return ok, (f"{noun} {'>' if strict else '>='} {low:g}"
                + (f" and {'<' if below else '<='} {high:g}" if high is not None else ""))


def require_arg(where: str, name: str, value, check) -> None:
    """A TileError naming ``name`` and ``value`` unless ``check`` (an ``(ok, what it wants)``
    pair, as :func:`number_check` makes) accepts ``value``."""
    ok, want = check
    if not ok(value):
        raise TileError(where, f"{name} must be {want}", f"{name}={value!r}")


def is_int(value, low: int | None = None, high: int | None = None) -> bool:
    """Whether ``value`` is an integer (NumPy's too, not a bool) at least ``low`` and at most
    ``high`` (None: no bound)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) \
        and (low is None or value >= low) and (high is None or value <= high)


def require_int(where: str, name: str, value, low: int, high: int | None = None) -> None:
    """A TileError naming ``name`` and ``value`` unless ``value`` is an integer (NumPy's too, not
    a bool) at least ``low`` and, given ``high``, at most ``high``."""
    if not is_int(value, low, high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise TileError(where, f"{name} must be an integer {rng}", repr(value))


FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))  # what tilegraph computes in
_SUPPORTED_FLOATS = "float16, float32 and float64 are"
# names NumPy does not know (or reads otherwise) that ML code writes; looked up lower-cased
_ML_DTYPE_NAMES = {"fp16": "float16", "fp32": "float32", "fp64": "float64"}
_BFLOAT16_NAMES = ("bfloat16", "bf16")
_DEVICE_NAMES = ("cpu", "cuda", "gpu", "mps", "xpu", "meta", "tpu", "hip", "npu")
_F16_NOTE = ("; NumPy reads 'f16' as the 16-byte float128 (np.longdouble): half precision is 'float16', "
             "'f2', 'half' or 'fp16'")


def as_dtype(dtype, where: str, *, floating: bool = False) -> np.dtype:
    """``dtype`` as a NumPy dtype tilegraph computes in, or one TileError naming ``where``, what is
    supported and what was received. This is the one parser of every public ``dtype=`` argument
    (``x.to``, ``tg.zeros``, ``sum(dtype=)``, layers, models, ``from_hf``).

    Accepted: a NumPy dtype or type, its name or code ("float16", "half", "float", "double",
    "f2", "f4", "f8", "int64", ...), a torch dtype (``torch.float16``: torch is not imported for
    this), and the ML spellings "fp16", "fp32", "fp64". Refused with a message that says so:
    bfloat16 ("bf16"), float128 (np.longdouble, and NumPy's "f16", which ML users mean as half),
    complex and other kinds; with ``floating``, anything but float16, float32 and float64 (a
    layer's weights: integer weights would be drawn as zeros and never train).
    """
    given = dtype
    shown = f"{given!r:.60}"
    if type(dtype).__module__.split(".")[0] == "torch":  # torch.float16 -> "float16"; torch.device("cuda") -> "cuda"
        shown = str(dtype) if str(dtype).startswith("torch.") else shown
        dtype = str(dtype).removeprefix("torch.")
    must = "dtype must be a floating dtype (float16, float32 or float64)"
    if isinstance(dtype, str):
        key = dtype.strip().lower()
        dtype = _ML_DTYPE_NAMES.get(key, dtype)
        if key in _BFLOAT16_NAMES:
            raise TileError(where, f"bfloat16 is not supported ({_SUPPORTED_FLOATS})", shown)
        if key == "f16":  # float128 where NumPy has it (where it has not, np.dtype's error would not say why)
            raise TileError(where, f"float128 is not supported ({_SUPPORTED_FLOATS}){_F16_NOTE}", shown)
        if key.split(":")[0] in _DEVICE_NAMES:
            first = must if floating else "expected a dtype (np.float32, 'float64', 'fp16', torch.float16, ...)"
            raise TileError(where, f"{first}; a device is not given here (the planner places every tile)", shown)
    try:
        if dtype is None or isinstance(dtype, (bool, int, float, complex)):
            raise TypeError
        out = np.dtype(dtype)
    except (TypeError, ValueError):
        if floating:
            raise TileError(where, f"{must}: a NumPy or torch dtype, or a name such as 'float32', 'fp16' or 'half'",
                            shown) from None
        raise TileError(where, "expected a dtype (np.float32, 'float64', 'fp16', torch.float16, ...)", shown) from None
    if out.name == "bfloat16":  # ml_dtypes' (a NumPy extension type)
        raise TileError(where, f"bfloat16 is not supported ({_SUPPORTED_FLOATS})", shown)
    if out.kind == "f" and out not in FLOAT_DTYPES:  # float128 / float96 (np.longdouble, "f16", "g")
        note = _F16_NOTE if out.itemsize > 8 else ""
        raise TileError(where, f"{out.name} is not supported ({_SUPPORTED_FLOATS}){note}", shown)
    if floating and out.kind != "f":
        raise TileError(where, must, shown if isinstance(given, str) or shown.startswith("torch.") else str(out))
    if out.kind not in "biuf":
        raise TileError(where, "expected a bool, integer or float dtype", str(out))
    return out


def require_float_dtype(where: str, dtype) -> np.dtype:
    """``dtype`` as float16, float32 or float64 (see :func:`as_dtype`), or a TileError naming ``where``."""
    return as_dtype(dtype, where, floating=True)


def check_array_dtype(where: str, dtype, shape=None) -> np.dtype:
    """The dtype of an array made a tensor or parameter (``from_numpy``, ``nn.Parameter``): bool,
    integer, float16, float32 or float64, else a TileError naming ``where`` (a float128 or complex
    array was taken and failed at its first op as "must have a floating dtype")."""
    dt = np.dtype(dtype)
    if dt.name != "bfloat16" and (dt.kind in "biu" or dt in FLOAT_DTYPES):
        return dt
    got = f"an array{'' if shape is None else f' of shape {tuple(shape)}'}, {dt}"
    hint = ": convert the array first, e.g. a.astype(np.float64)" if dt.kind in "fcV" else ""
    if dt.name == "bfloat16":
        raise TileError(where, f"bfloat16 is not supported ({_SUPPORTED_FLOATS}){hint}", got)
    if dt.kind == "f":
        raise TileError(where, f"{dt.name} is not supported ({_SUPPORTED_FLOATS}){hint}", got)
    raise TileError(where, f"expected an array of bool, integers or float16/float32/float64{hint}", got)


def transfer_speed(measured: float | None = None) -> float:
    """The bytes per second the planner takes a move between worker processes to run at:
    ``config.transfer_bytes_per_second`` where it is a number, else ``measured`` (the
    runtime's), else :data:`DEFAULT_TRANSFER_BYTES_PER_SECOND`."""
    v = config.transfer_bytes_per_second
    if v != "auto":
        return float(v)
    return float(measured) if measured else DEFAULT_TRANSFER_BYTES_PER_SECOND


def bucket_size(across_hosts: bool) -> float:
    """The bytes of gradients a data-parallel plan sends in one bucket during the backward:
    ``config.bucket_bytes`` where it is a number, else :data:`AUTO_BUCKET_BYTES` where the
    plan's worker processes span several hosts (``across_hosts``), else inf (one exchange)."""
    v = config.bucket_bytes
    if v != "auto":
        return float(v)
    return AUTO_BUCKET_BYTES if across_hosts else float("inf")


def one_of_check(*names: str):
    """(check, what it wants) of a string among ``names``."""
    return (lambda v: isinstance(v, str) and v in names), f"one of {', '.join(map(repr, names))}"


#: the devices ``config.speeds`` gives speeds for: the planner reads the CPU's for every kernel,
#: and the GPU's for each where GPU workers exist (``plan.cluster.place``)
SPEED_DEVICES = ("cpu", "gpu")
#: ``config.speeds`` by default; a device an assignment leaves out keeps its default here
DEFAULT_SPEEDS = {"cpu": (1.2e11, 1e10, 1e-5), "gpu": (2e13, 2e12, 1e-4)}


def _speeds(v) -> bool:
    return isinstance(v, Mapping) and "cpu" in v and set(v) <= set(SPEED_DEVICES) and all(
        isinstance(s, (tuple, list)) and len(s) == 3 and all(number_check(strict=True, finite=True)[0](x) for x in s)
        for s in v.values())


class ReadOnlySettingError(TileError, TypeError):
    """A setting held read-only changed in place (a TypeError, as for a tuple or a mappingproxy,
    and a TileError that names it)."""


def _refusing(method: str):
    """A dict's mutating ``method`` for :class:`Speeds`: refused, with what was called."""
    def refused(self, *args, **kwargs):
        shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        self._refuse(f"tilegraph.config.speeds.{method}({shown})")
    refused.__name__ = method
    return refused


class Speeds(Mapping):
    """``config.speeds`` as stored: a read-only copy of the mapping assigned (each device's
    speeds a tuple). Changed in place it would skip the check of the assignment, and the next
    step's planning would fail on it (a bare KeyError or ValueError); assign a whole mapping."""

    __slots__ = ("_speeds",)

    def __init__(self, speeds: Mapping):
        object.__setattr__(self, "_speeds", {d: tuple(s) for d, s in {**DEFAULT_SPEEDS, **speeds}.items()})

    def __getitem__(self, device: str) -> tuple:
        return self._speeds[device]

    def __iter__(self):
        return iter(self._speeds)

    def __len__(self) -> int:
        return len(self._speeds)

    def __repr__(self) -> str:
        return repr(self._speeds)

    def __reduce__(self):
        return type(self), (self._speeds,)

    def _refuse(self, received: str):
        raise ReadOnlySettingError("tilegraph.config.speeds", "an assignment of the whole setting (it is checked; "
                                   "changed in place it would not be): tilegraph.config.speeds = "
                                   "{**tilegraph.config.speeds, \"cpu\": (flop/s, byte/s, seconds per kernel call)}",
                                   received)

    def __setitem__(self, device, value) -> None:
        self._refuse(f"tilegraph.config.speeds[{device!r}] = {value!r}")

    def __delitem__(self, device) -> None:
        self._refuse(f"del tilegraph.config.speeds[{device!r}]")

    def __setattr__(self, name, value) -> None:
        self._refuse(f"tilegraph.config.speeds.{name} = {value!r}")

    update, pop, popitem, clear, setdefault = (_refusing(m) for m in ("update", "pop", "popitem", "clear",
                                                                     "setdefault"))


_BOOL = ((lambda v: isinstance(v, bool)), "True or False")
_AUTO_OR_POSITIVE = ((lambda v: v == "auto" or number_check(strict=True)[0](v)), '"auto" or a number > 0')
#: what each setting may hold
_CHECKS = {
    # seconds are finite (inf: a plan or cost of inf, an int() of it, a wait that overflows), but
    # for min_process_seconds and kernel_gil_seconds, where inf means "never" (see their comments)
    "fuse": _BOOL, "target_seconds": number_check(strict=True, finite=True), "min_process_seconds": number_check(),
    "graph_seconds": number_check(finite=True), "max_steps_per_graph": number_check(1, whole=True),
    "split_weight_grads": _BOOL,
    "transfer_bytes_per_second": _AUTO_OR_POSITIVE,
    "placement": one_of_check("auto", "cpu", "gpu"),
    "gpu_min_flops": number_check(), "gpu_array_module": one_of_check("cupy", "numpy"),
    "hop_seconds": number_check(finite=True),
    "bucket_bytes": _AUTO_OR_POSITIVE, "shm_transfers": _BOOL, "shm_min_bytes": number_check(whole=True),
    "exchange": one_of_check(*EXCHANGES), "exchange_timeout_seconds": number_check(strict=True, finite=True),
    "parallel": one_of_check(*PARALLEL_STRATEGIES),
    "zero3_reshard_after_forward": _BOOL,
    "zero3_prefetch": _BOOL,
    "task_memory_fraction": number_check(strict=True, high=1.0), "local_scheduler": one_of_check("threads", "sync"),
    "speeds": (_speeds, 'a dict of device ("cpu", and "gpu" or its default; no other) -> (flop/s, byte/s, '
                        'seconds per kernel call), each a finite number > 0'),
    "thread_handoff_seconds": number_check(finite=True), "kernel_gil_seconds": number_check(),
}

#: how a setting's value is stored, where not as assigned
_STORED_AS = {"speeds": Speeds}


config = Config()
