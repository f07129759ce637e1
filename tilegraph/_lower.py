"""From the logical tile graph to executed Dask tasks: placement, clustering, lowering.

The logical graph has one node per tile kernel call, often thousands per training step, while
Dask distributed pays milliseconds per dependent task. So nodes are never submitted one by one:

1. placement gives every node a device class ("cpu" or "gpu");
2. clustering groups neighbouring nodes of one device into coarse tasks (a list-scheduling
   simulation on the available worker threads decides which nodes may run in parallel; each
   virtual processor's node sequence is cut once a cluster reaches ``target_seconds`` of estimated
   work, or when another processor needs one of its values);
3. lowering writes one raw Dask task per cluster, ``(run_cluster, program, *inputs)``, into a
   graph whose GPU layer carries a ``{"GPU": 1}`` resource annotation.

An :class:`Executable` keeps the placed, clustered plan; running it again only re-binds the leaf
cells (parameters, batches) and writes fresh keys, which is how a training step is replayed.
``fuse=False`` keeps one task per tile kernel for debugging.
"""

from __future__ import annotations

import heapq
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import numpy as np

from tilegraph._errors import TileError
from tilegraph._graph import Cell, Node, ReplicatedRef, TileRef, ValueRef, topo_order
from tilegraph._tensor import TileTensor

__all__ = ["compile", "compute", "Executable", "config", "DaskKey", "run_cluster"]


@dataclass
class Config:
    """Global knobs of the lowering (``tilegraph.config``)."""

    fuse: bool = True
    #: estimated wall seconds of one fused task (its kernels spread over its worker's threads);
    #: Dask pays ~1-10 ms per dependent task, plus the wait for a task's slowest kernel. Measured
    #: on the bench block stack (2 cores): 0.5 s -> 4 tasks/step, 5.5% outside kernels; 1.0 s ->
    #: 2 tasks/step, 3.9%
    target_seconds: float = 1.0
    #: a graph spreads over another worker process only when each gets at least this much estimated
    #: work (~20 Dask hops). Measured on the bench MLP, 2 workers x 1 thread: a full task's worth
    #: (1 s) kept its 1.4 s step on one worker (0.48 of torch); 0.1 s spreads it (0.78)
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
    #: speed of moving a value between worker processes, for the plan (localhost TCP with
    #: serialisation: ~1 GB/s)
    transfer_bytes_per_second: float = 1e9
    #: "cpu", "gpu" or "auto" (GPU for heavy kernels when GPU workers exist)
    placement: str = "auto"
    #: "auto" placement sends kernels of at least this many flops to GPU workers
    gpu_min_flops: float = 1e6
    #: array library of GPU tasks: "cupy", or "numpy" to emulate GPU workers on a CPU-only machine
    gpu_array_module: str = "cupy"
    #: latency Dask adds per dependent task (measured ~6 ms on 2 cores); spreading work over
    #: another worker only pays when it saves more than this
    hop_seconds: float = 0.005
    #: data parallelism: gradients leave their process in buckets of about this many bytes while
    #: the backward pass goes on (as PyTorch DDP's 25 MB buckets). Default: one exchange after
    #: the backward. On CPU workers a transfer under way takes CPU and the GIL from the kernels
    #: it would overlap, and each bucket costs a task boundary. Measured on 2 cores, 2 workers x
    #: 1 thread, GPT-2 6x768 (330 MB of gradients): 32 MB buckets 262 tok/s, 100 MB 280,
    #: 256 MB 278, one exchange 305 (one process x 2 threads: 304); block stack: 608 either way.
    #: Smaller buckets can pay where the link, not the CPU, is the bottleneck (several nodes).
    bucket_bytes: float = float("inf")
    #: "auto" parallelism: a tiles plan spread over several worker processes runs this much
    #: slower than its simulation says (Dask fetches a task's inputs only once it may start, and
    #: copies take CPU from the kernels). Measured on 2 cores, 2 workers x 1 thread: simulated vs
    #: real step 0.90 vs 1.06 s (bench MLP), 1.55 vs 1.86 s (block stack); data-parallel plans of
    #: the same steps: 0.99 vs 0.97 s, 1.67 vs 1.68 s
    tiles_across_processes_penalty: float = 0.2
    #: how a training step spreads over several worker processes (``PARALLEL_STRATEGIES``):
    #: "tiles" list-schedules the tile kernels over all processes; "data" gives each process a
    #: share of the batch's row tiles and a replica of the parameters and optimizer state
    #: (gradients summed across replicas inside the graph); "sharded" is "data" with each
    #: parameter tile's gradient sum, update and optimizer state on one owner process (ZeRO-2);
    #: "auto" plans "tiles" and "data" (or "sharded", see replicated_state_fraction) and keeps
    #: the one whose simulated step finishes first
    parallel: str = "auto"
    #: "auto" shards the state when parameters plus optimizer state would take more than this
    #: share of the smallest worker memory limit on every replica
    replicated_state_fraction: float = 0.25
    #: scheduler when no runtime is connected: "threads" or "sync"
    local_scheduler: str = "threads"
    #: assumed speeds for the cost model: (flop/s, byte/s, seconds per kernel call)
    #: (CPU: one core of the development machine, OpenBLAS fp32 GEMM ~125 GFLOP/s; a call on
    #: tiny tiles takes ~10 us, mostly Python and NumPy dispatch)
    speeds: dict = field(default_factory=lambda: {"cpu": (1.2e11, 1e10, 1e-5), "gpu": (2e13, 2e12, 2e-5)})
    #: what running a task's kernels on several threads costs per kernel (handing kernels between
    #: threads, which also contend for the GIL): a task runs them on one thread unless the plan's
    #: parallel schedule saves more than this per kernel
    thread_handoff_seconds: float = 2e-5


config = Config()

#: the values of ``config.parallel`` (and of the ``parallel=`` option of TrainStep and Executable)
PARALLEL_STRATEGIES = ("auto", "tiles", "data", "sharded")


def _memory_limit(runtime) -> float:
    """The smallest memory limit of the runtime's workers (bytes; inf where none is set)."""
    if runtime is None:
        return float("inf")
    limits = [w.get("memory_limit") or float("inf") for w in runtime.workers().values()]
    return min(limits, default=float("inf"))


@dataclass(frozen=True)
class DaskKey:
    """A leaf whose value is ``key`` of an existing dask ``graph`` (``from_dask_array``)."""

    graph: Any
    key: Any


# -------------------------------------------------------------------------------- execution ----
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
        import cupy

        return cupy.asarray(x)
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return x


#: per-process counters: seconds inside kernels, seconds inside fused tasks, tasks run
_STATS = {"kernel_seconds": 0.0, "task_seconds": 0.0, "tasks": 0}
_BY_KERNEL: dict[str, float] = {}
_BY_SCOPE: dict[str, float] = {}
_STATS_LOCK = threading.Lock()


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


def _call(op: Call, regs: list, device: str) -> tuple[tuple, float]:
    """Run one kernel call on its input registers; returns (output values, seconds)."""
    fn = op.kernel.impl(device)
    t0 = time.perf_counter()
    try:
        res = fn(*[regs[i] for i in op.ins], **op.params)
    except Exception as e:  # say which op failed; the traceback keeps the cause
        e.add_note(f"in tile kernel {op.kernel.name!r} of op {op.op!r}" + (f" in {op.scope}" if op.scope else ""))
        raise
    dt = time.perf_counter() - t0
    if len(op.outs) == 1:
        res = (res,)
    for val, (shape, dtype) in zip(res, op.metas):
        if val.shape != shape or val.dtype != dtype:
            raise TileError(f"tile kernel {op.kernel.name} of op {op.op}",
                            f"computed tile does not match its declared meta {shape} {dtype}",
                            f"{val.shape} {val.dtype}")
    return res, dt


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

    def work(self) -> None:
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
        by_kernel = run.by_kernel
    else:
        by_kernel: dict[tuple[str, str], float] = {}
        for op in prog.ops:
            res, dt = _call(op, regs, prog.device)
            _count(by_kernel, op, dt)
            for r, val in zip(op.outs, res):
                regs[r] = val
            for r in op.free:
                regs[r] = None
    out = tuple(regs[r] for r in prog.out_regs)
    with _STATS_LOCK:
        _STATS["kernel_seconds"] += sum(by_kernel.values())
        _STATS["task_seconds"] += (time.perf_counter() - t_start) * max(held, 1)
        _STATS["tasks"] += 1
        for (name, where), dt in by_kernel.items():
            _BY_KERNEL[name] = _BY_KERNEL.get(name, 0.0) + dt
            _BY_SCOPE[where] = _BY_SCOPE.get(where, 0.0) + dt
    return out


def _count(seconds: dict, op: Call, dt: float) -> None:
    key = (op.kernel.name, op.scope)
    seconds[key] = seconds.get(key, 0.0) + dt


# ------------------------------------------------------------------------------- placement ----
def place(nodes: Sequence[Node], policy: str, has_gpu: bool) -> None:
    if policy not in ("cpu", "gpu", "auto"):
        raise TileError("tilegraph.place", "placement must be 'cpu', 'gpu' or 'auto'", repr(policy))
    if policy == "gpu" and not has_gpu:
        raise TileError("tilegraph.place", "placement 'gpu' needs workers with a GPU resource",
                        "a runtime without GPU workers")
    for n in nodes:
        if policy == "auto":
            n.device = "gpu" if has_gpu and n.cost.flops >= config.gpu_min_flops else "cpu"
        else:
            n.device = policy


def est_seconds(node: Node) -> float:
    f, b, c = config.speeds[node.device]
    return node.cost.flops / f + node.cost.bytes / b + c


#: the phase words in task names; "backward" would end Dask's prefix (eight letters that begin
#: like a hex token look like a hash to ``key_split``)
_PHASE_WORDS = {"forward": "fwd", "backward": "bwd"}


def task_label(nodes: Sequence[Node]) -> str:
    """A task's name on the Dask dashboard, from the scope of most of its estimated work.

    Dask groups and colours tasks by the alphabetic words at the start of their key (its
    ``key_split``): ``layers.3.attn:backward`` becomes ``layers-attn-bwd-3``, so the task stream
    reads ``tg-layers-attn-bwd`` and the key keeps the layer's index; a task spanning several
    parts of the model is named after the largest, with ``-etc``."""
    work: dict[str, float] = {}
    for n in nodes:
        work[n.scope] = work.get(n.scope, 0.0) + est_seconds(n)
    top = max(work, key=work.get, default="")
    path, _, phase = top.partition(":")
    parts = path.split(".") if path else [nodes[0].op if nodes else "task"]
    words = ["".join(ch for ch in p if ch.isalpha()) for p in parts if not p.isdigit()]
    words = [w for w in words if w] + [_PHASE_WORDS.get(phase or "forward", phase)]
    numbers = [p for p in parts if p.isdigit()]
    if len(work) > 1:
        words.append("etc")  # more than one part of the model
    return "-".join(words + numbers)


# ------------------------------------------------------------------------------ clustering ----
def by_upward_rank(nodes: Sequence[Node]) -> list[Node]:
    """Nodes in decreasing order of their longest estimated path to a sink (HEFT's upward rank).

    A valid topological order that visits the critical path first and leaves work only the end
    needs (weight-gradient joins, optimizer updates) for last, so it does not cut the parallel
    streams of the forward and backward passes into small tasks.
    """
    rank: dict[int, float] = {}
    succs: dict[int, list[Node]] = {id(n): [] for n in nodes}
    for n in nodes:
        for i in n.inputs:
            if id(i.node) in succs:
                succs[id(i.node)].append(n)
    for n in reversed(nodes):  # nodes are topologically ordered: successors come later
        rank[id(n)] = est_seconds(n) + max((rank[id(s)] for s in succs[id(n)]), default=0.0)
    position = {id(n): k for k, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (-rank[id(n)], position[id(n)]))


class Cluster:
    __slots__ = ("id", "device", "proc", "threads", "nodes", "seconds", "open")

    def __init__(self, cid: int, device: str, proc: int, threads: int = 1):
        self.id, self.device, self.proc, self.threads = cid, device, proc, threads
        self.nodes: list[Node] = []
        self.seconds = 0.0
        self.open = True


def cluster_nodes(nodes: Sequence[Node], groups: dict[str, list[int]], target: float,
                  fuse: bool, fixed: dict[int, int] | None = None,
                  home: int | None = None) -> tuple[list[Cluster], dict[int, Cluster], float]:
    """Group placed nodes (in a topological order) into acyclic clusters, one Dask task each.

    ``groups`` gives, per device class, the threads of each worker process. A list-scheduling
    simulation puts every node on the thread where it can start first; the nodes a process runs
    form its open cluster, which runs them on the process's threads as one task. A value is ready
    on another thread of the same open cluster when its node finishes, anywhere else only when its
    cluster's task has finished plus a Dask hop (``config.hop_seconds``). A cluster closes once its
    estimated wall time passes ``target`` or when another cluster needs one of its values.

    A cluster only ever gains dependencies on clusters that are already closed, and every cluster
    closes after those it depends on, so the cluster graph is acyclic by construction.

    ``fixed`` maps ``id(node)`` to the process a strategy put it on (data parallelism: its
    replica); those nodes only choose among that process's threads. With ``home``, process ``g``
    is a second lane of worker process ``g % home`` (values between lanes of one process are not
    copied). Returns the clusters, the cluster of each node and the simulated finish time of the
    whole graph (seconds).
    """
    clusters: list[Cluster] = []
    of: dict[int, Cluster] = {}
    if not fuse:
        for n in nodes:
            c = Cluster(len(clusters), n.device, 0)
            c.nodes.append(n)
            c.open = False
            clusters.append(c)
            of[id(n)] = c
        return clusters, of, sum(est_seconds(n) for n in nodes)
    # Use only as many processes as there is work for: a graph with little work per extra process
    # runs faster as fewer, larger tasks.
    total = {dev: 0.0 for dev in groups}
    for n in nodes:
        total[n.device] += est_seconds(n)
    used = {dev: max(1, min(len(threads), int(total[dev] / config.min_process_seconds))) for dev, threads in groups.items()}
    if fixed:  # a strategy's processes are all used, whatever the work per process
        used = {dev: len(threads) for dev, threads in groups.items()}
    free_at = {dev: [[0.0] * t for t in threads[:used[dev]]] for dev, threads in groups.items()}
    open_on: dict[tuple[str, int], Cluster] = {}
    finish: dict[int, float] = {}
    end: dict[int, float] = {}  # cluster id -> latest finish of its nodes so far
    begin: dict[int, float] = {}  # cluster id -> start of its first node
    hop = config.hop_seconds
    bandwidth = config.transfer_bytes_per_second

    def where(proc: int) -> int:
        return proc if home is None else proc % home

    def ready_time(inputs, cur, dev, g) -> float:
        """When all inputs can be there for a node on process g: at once from its own open task;
        after their task, a hop and, from another process, the transfer of the bytes otherwise."""
        return max((f if c is cur else end[c.id] + hop + (0.0 if (c.device, where(c.proc)) == (dev, where(g)) else b / bandwidth)
                    for c, f, b in inputs), default=0.0)

    for n in nodes:
        dev = n.device
        t = est_seconds(n)
        inputs = [(of[id(i.node)], finish[id(i.node)], i.nbytes) for i in n.inputs if id(i.node) in of]
        starts = []
        for g, frees in enumerate(free_at[dev]):
            cur = open_on.get((dev, g))
            starts.append(max(ready_time(inputs, cur if cur is not None and cur.open else None, dev, g), min(frees)))
        if fixed is not None and id(n) in fixed:
            best = fixed[id(n)]
        else:
            best = min(range(len(starts)), key=lambda g: (starts[g], g))
            # Ties go to the process of the latest input: chains stay in one task.
            last = max(((c, f) for c, f, _ in inputs if c.device == dev), key=lambda cf: cf[1], default=None)
            if last is not None and last[0].proc < len(starts) and starts[last[0].proc] <= starts[best]:
                best = last[0].proc
        cur = open_on.get((dev, best))
        for c, _, _ in inputs:
            if c.open and c is not cur:
                c.open = False
        frees = free_at[dev][best]
        # A Dask task starts only once all its inputs exist: a node whose value from elsewhere is
        # ready only after the open cluster began would hold back the cluster's earlier nodes.
        late = cur is not None and cur.open and \
            ready_time([x for x in inputs if x[0] is not cur], None, dev, best) > begin[cur.id]
        if cur is None or not cur.open or late or (cur.seconds > 0 and (cur.seconds + t) / len(frees) > target):
            if cur is not None:
                cur.open = False
            cur = Cluster(len(clusters), dev, best, len(frees))
            clusters.append(cur)
            open_on[(dev, best)] = cur
        thread = min(range(len(frees)), key=frees.__getitem__)
        start = max(ready_time(inputs, cur, dev, best), frees[thread])
        begin.setdefault(cur.id, start)
        cur.nodes.append(n)
        cur.seconds += t
        of[id(n)] = cur
        finish[id(n)] = frees[thread] = start + t
        end[cur.id] = max(end.get(cur.id, 0.0), start + t)
    # Kernels too small to gain from the worker's threads run one after another.
    for c in clusters:
        if c.threads > 1 and c.seconds - (end[c.id] - begin[c.id]) < len(c.nodes) * config.thread_handoff_seconds:
            c.threads = 1
    return clusters, of, max(end.values(), default=0.0)


# --------------------------------------------------------------------------------- lowering ----
@dataclass
class _Plan:
    prog: Program
    ext: list[TileRef]          # external inputs, in argument order
    outputs: list[TileRef]      # values returned, in tuple order
    device: str


class Executable:
    """A placed and clustered tile graph, ready to be lowered and run any number of times."""

    def __init__(self, roots: Sequence[TileRef], *, fuse: bool | None = None, target_seconds: float | None = None,
                 placement: str | None = None, runtime=None, parallel: str | None = None,
                 state_groups: Sequence[Sequence[int]] = (), batch_cells: Sequence = ()):
        from tilegraph._runtime import current_runtime

        runtime = runtime if runtime is not None else current_runtime()
        self.runtime = runtime
        self.roots = list(roots)
        fuse = config.fuse if fuse is None else fuse
        target = config.target_seconds if target_seconds is None else target_seconds
        placement = placement or config.placement
        parallel = parallel or config.parallel
        if parallel not in PARALLEL_STRATEGIES:
            raise TileError("tilegraph.Executable", f"parallel must be one of {', '.join(map(repr, PARALLEL_STRATEGIES))}",
                            repr(parallel))
        nodes = topo_order(self.roots)
        self.leaves = [n for n in nodes if n.is_leaf]
        work = [n for n in nodes if not n.is_leaf]
        # Threads of each worker process; without a runtime, Dask's local threaded scheduler runs
        # in this one process.
        groups = runtime.worker_threads() if runtime is not None else {"cpu": [os.cpu_count() or 1], "gpu": []}
        addrs = runtime.worker_addrs if runtime is not None else {}
        place(work, placement, len(groups.get("gpu", ())) > 0)
        groups = {"cpu": groups.get("cpu") or [1], "gpu": groups.get("gpu") or [1]}
        #: each root's refs: one, or one per replica for the replicated roots of a data-parallel plan
        self.replicas: list[list[TileRef]] = [[r] for r in self.roots]
        self.clusters, of, self.est_makespan = cluster_nodes(by_upward_rank(work), groups, target, fuse)
        self.strategy = "tiles"
        #: data-parallel plans: the replicas (worker processes); process p's tasks run on lanes
        #: p (compute) and replicas + p (exchange)
        self.n_replicas = 1
        if parallel != "tiles" and fuse:
            sharded = parallel == "sharded" or parallel == "auto" and \
                self._state_bytes(state_groups) > config.replicated_state_fraction * _memory_limit(runtime)
            dp = self._data_parallel(work, groups, state_groups, batch_cells, target, sharded)
            # "auto": whichever plan the simulation finishes first (the tiles plan's figure
            # corrected for what its simulation leaves out when it spans several processes)
            tiles_seconds = self.est_makespan
            if len({(c.device, c.proc) for c in self.clusters}) > 1:
                tiles_seconds *= 1.0 + config.tiles_across_processes_penalty
            if dp is not None and (parallel != "auto" or dp[3] < tiles_seconds):
                self.replicas, self.clusters, of, self.est_makespan, nodes, self.n_replicas = dp
                work = [n for n in nodes if not n.is_leaf]
                self.strategy = "sharded" if sharded else "data"
        # With several worker processes, each task goes to the worker the plan gave it.
        self.worker_of: dict[int, str] = {}
        if fuse:
            for c in self.clusters:
                dev_addrs = addrs.get(c.device) or []
                proc = self.process_of(c)
                if len(set(dev_addrs)) > 1 and proc < len(dev_addrs):
                    self.worker_of[c.id] = dev_addrs[proc]
        self.n_nodes = len(work)

        # Which values leave their cluster (consumed elsewhere, or wanted by the caller).
        needed: dict[int, set[tuple[int, int]]] = {c.id: set() for c in self.clusters}
        for c in self.clusters:
            for n in c.nodes:
                for i in n.inputs:
                    pc = of.get(id(i.node))
                    if pc is not None and pc is not c:
                        needed[pc.id].add((id(i.node), i.index))
        for r in (r for refs in self.replicas for r in refs):
            pc = of.get(id(r.node))
            if pc is not None:
                needed[pc.id].add((id(r.node), r.index))

        self.plans: list[_Plan] = []
        self.where: dict[tuple[int, int], tuple[int, int]] = {}  # value -> (cluster id, tuple index)
        array_module = config.gpu_array_module
        for c in self.clusters:
            plan = self._plan(c, of, needed[c.id], array_module)
            self.plans.append(plan)
            for k, ref in enumerate(plan.outputs):
                self.where[(id(ref.node), ref.index)] = (c.id, k)
        self.structure = self._structure_token(nodes, of)
        self._program_futures = None  # (runtime, futures of self.plans' programs on its workers)

    def _state_bytes(self, state_groups: Sequence[Sequence[int]]) -> int:
        """Bytes of the roots in ``state_groups`` (parameters and optimizer state)."""
        return sum(self.roots[k].nbytes for g in state_groups for k in g)

    def _data_parallel(self, work: Sequence[Node], groups: dict[str, list[int]], state_groups: Sequence[Sequence[int]],
                       batch_cells: Sequence, target: float, sharded: bool):
        """The data-parallel plan of this graph: ``(refs of each root, clusters, cluster of each
        node, simulated seconds, nodes, replicas)``; None where it does not apply: no batch to
        split, one process, or kernels placed on both device classes.

        ``state_groups`` lists the roots updated together (a parameter tile, then its optimizer
        state). Data parallel: every replica keeps all of them. ``sharded``: each group has one
        owner replica (balanced by bytes) that alone sums its gradient, updates it and keeps its
        state; the other replicas read the parameter from there."""
        devices = {n.device for n in work}
        if not batch_cells or len(devices) != 1:
            return None
        from tilegraph.parallel.data_parallel import batch_groups, split_replicas, visit_order

        dev = devices.pop()
        rows = min(cells.shape[0] if cells.ndim else 1 for cells in batch_cells)
        procs = min(len(groups[dev]), rows)
        if procs < 2:
            return None
        if sharded:
            load, owners = [0] * procs, {}
            for g in state_groups:
                o = min(range(procs), key=lambda p: (load[p], p))
                load[o] += self.roots[g[0]].nbytes
                owners.update((k, o) for k in g)
            replicated = [g[0] for g in state_groups]
        else:
            owners, replicated = {}, [k for g in state_groups for k in g]
        dp = split_replicas(self.roots, replicated=replicated, groups=batch_groups(batch_cells, procs),
                            replicas=procs, owners=owners)
        # each replica's exchange phase (gradient sums, updates) on a lane of its own, so that
        # its tasks wait for other replicas' values without holding back the backward pass
        lane = {i: p + (procs if i in dp.exchange else 0) for i, p in dp.replica.items()}
        threads = groups[dev][:procs]
        order = visit_order(dp, est_seconds, config.bucket_bytes)
        clusters, of, seconds = cluster_nodes(order, {**groups, dev: threads + threads}, target, True,
                                              fixed=lane, home=procs)
        nodes = topo_order([r for refs in dp.roots for r in refs])
        return dp.roots, clusters, of, seconds, nodes, procs

    def process_of(self, c: Cluster) -> int:
        """The worker process (index among those of its device class) that runs cluster ``c``."""
        return c.proc % self.n_replicas if self.n_replicas > 1 else c.proc

    @staticmethod
    def _plan(c: Cluster, of, needed, array_module) -> _Plan:
        regs: dict[tuple[int, int], int] = {}
        ext: list[TileRef] = []
        for n in c.nodes:
            for i in n.inputs:
                key = (id(i.node), i.index)
                if of.get(id(i.node)) is not c and key not in regs:
                    regs[key] = len(ext)
                    ext.append(i)
        n_regs = len(ext)
        last_use: dict[int, int] = {}
        body = []
        for step, n in enumerate(c.nodes):
            ins = [regs[(id(i.node), i.index)] for i in n.inputs]
            for r in ins:
                last_use[r] = step
            outs = []
            for k in range(len(n.out_meta)):
                regs[(id(n), k)] = n_regs
                outs.append(n_regs)
                n_regs += 1
            body.append((n, ins, outs))
        outputs = [ref for n in c.nodes for ref in (TileRef(n, k) for k in range(len(n.out_meta)))
                   if (id(n), ref.index) in needed]
        out_regs = tuple(regs[(id(r.node), r.index)] for r in outputs)
        keep = set(out_regs)
        ops = []
        for step, (n, ins, outs) in enumerate(body):
            free = tuple(r for r in set(ins) if last_use[r] == step and r not in keep)
            ops.append(Call(n.kernel, n.params, tuple(ins), tuple(outs), n.out_meta, free, n.op, n.scope))
        # Dependencies between the task's own ops, for running them on several threads.
        made_by = {r: step for step, (_, _, outs) in enumerate(body) for r in outs}
        uses = [0] * n_regs
        deps, succs = [], [[] for _ in body]
        for step, (_, ins, _) in enumerate(body):
            producers = {made_by[r] for r in ins if r in made_by}
            for p in sorted(producers):
                succs[p].append(step)
            deps.append(len(producers))
            for r in set(ins):
                uses[r] += 1
        label = task_label(c.nodes)
        prog = Program(tuple(ops), len(ext), n_regs, out_regs, c.device, array_module, label,
                       c.threads if c.device == "cpu" else 1, tuple(deps), tuple(map(tuple, succs)), tuple(uses))
        return _Plan(prog, ext, outputs, c.device)

    def _structure_token(self, nodes: Sequence[Node], of) -> str:
        """A token of the graph and its plan: equal tokens mean equal programs for every task."""
        from dask.base import tokenize

        index = {id(n): k for k, n in enumerate(nodes)}
        desc = []
        for n in nodes:
            if n.is_leaf:
                desc.append(("leaf", n.out_meta))
            else:
                desc.append((n.kernel.name, repr(sorted(n.params.items())), n.device,
                             tuple((index[id(i.node)], i.index) for i in n.inputs), n.out_meta, of[id(n)].id))
        plan = [(p.prog.threads, p.prog.array_module, [index[id(n)] for n in c.nodes], p.prog.out_regs)
                for c, p in zip(self.clusters, self.plans)]
        return tokenize(desc, plan)

    # -- lowering ------------------------------------------------------------------------------
    def est_seconds(self) -> float:
        """The plan's estimated wall time if its tasks ran one after another (each task's kernels
        spread over the threads it runs on)."""
        return sum(c.seconds / p.prog.threads for c, p in zip(self.clusters, self.plans))

    @property
    def n_tasks(self) -> int:
        return len(self.clusters)

    def critical_path(self) -> tuple[int, float]:
        """(tasks, estimated kernel seconds) along the longest chain of dependent tasks: each task
        on it pays Dask's per-hop latency, so this bounds how much fusion can still save."""
        deps: dict[int, set[int]] = {c.id: set() for c in self.clusters}
        for c, plan in zip(self.clusters, self.plans):
            for ref in plan.ext:
                if not ref.node.is_leaf:
                    deps[c.id].add(self.where[(id(ref.node), ref.index)][0])
        seconds = {c.id: c.seconds for c in self.clusters}
        best: dict[int, tuple[int, float]] = {}
        for root in deps:
            stack = [root]
            while stack:
                cid = stack[-1]
                todo = [d for d in deps[cid] if d not in best]
                if todo:
                    stack.extend(todo)
                    continue
                stack.pop()
                n, t = max((best[d] for d in deps[cid]), default=(0, 0.0))
                best[cid] = (n + 1, t + seconds[cid])
        return max(best.values(), default=(0, 0.0))

    def lower(self, token: str | None = None, programs: Sequence | None = None):
        """Write the Dask graph for one call.

        Returns ``(layers, keys)``: ``layers`` maps a device class to its raw task dict (plus
        ``"data"`` for embedded leaf values and ``"dask"`` for merged dask-array graphs), ``keys``
        the task key of each cluster. ``programs`` replaces each cluster's program in its task
        (futures of programs already on the workers); default: the programs themselves.
        """
        from dask.base import tokenize

        if token is None:
            token = tokenize(self.structure, [n.cell.token for n in self.leaves])
        keys = [f"tg-{p.prog.label}-{c.id}-{token}" for c, p in zip(self.clusters, self.plans)]
        layers: dict[str, dict] = {"data": {}, "dask": {}, "cpu": {}, "gpu": {}}
        for c, plan, key in zip(self.clusters, self.plans, keys):
            args, idx = [], []
            for ref in plan.ext:
                node = ref.node
                if node.is_leaf:
                    a, i = self._bind_leaf(node.cell, layers, inline=True, proc=self.process_of(c))
                else:
                    cid, k = self.where[(id(node), ref.index)]
                    a, i = keys[cid], k
                args.append(a)
                idx.append(i)
            prog = plan.prog if programs is None else programs[c.id]
            layers[plan.device][key] = (run_cluster, Bound(tuple(idx)), prog, *args)
        return layers, keys

    def _programs(self, runtime) -> list:
        """Futures of the clusters' programs, scattered to the workers once per runtime: a
        program of a few thousand kernel calls takes ~50 ms to unpickle, every call otherwise.
        Their keys derive from the plan's token, like the task keys: executables of the same
        graph and plan write the same tasks, with the same dependencies."""
        cached = self._program_futures
        if cached is None or cached[0] is not runtime or any(f.status != "finished" for f in cached[1]):
            # each to the worker the plan pinned its task to (Dask moves it if another runs the
            # task); programs of unpinned tasks to every worker
            names = [f"tg-program-{c.id}-{self.structure}" for c in self.clusters]
            by_worker: dict[str | None, dict[str, Program]] = {}
            for c, p, name in zip(self.clusters, self.plans, names):
                by_worker.setdefault(self.worker_of.get(c.id), {})[name] = p.prog
            futures = {}
            for addr, progs in by_worker.items():
                where = {"broadcast": True} if addr is None else {"workers": [addr]}
                futures.update(runtime.client.scatter(progs, **where))
            cached = self._program_futures = (runtime, [futures[name] for name in names])
        return cached[1]

    @staticmethod
    def _bind_leaf(cell: Cell, layers, inline: bool = False, proc: int | None = None):
        """The task argument of a leaf's value: a future (of a replicated value, the copy of
        process ``proc``), a dask key, the array itself (small arrays, ``inline``: a task of its
        own would cost the scheduler more than the copy) or the key of a data task holding it."""
        v = cell.value
        if isinstance(v, ReplicatedRef):
            v = v.on(proc)
        if isinstance(v, ValueRef):
            return v.future, v.index
        if isinstance(v, DaskKey):
            if v.key not in layers["dask"]:
                layers["dask"].update(dict(v.graph))
            return v.key, None
        if inline and getattr(v, "nbytes", INLINE_MAX_BYTES + 1) <= INLINE_MAX_BYTES:
            return v, None
        key = f"tgc-{cell.token}"
        layers["data"][key] = v
        return key, None

    def root_location(self, ref: TileRef) -> tuple[int, int] | None:
        return self.where.get((id(ref.node), ref.index))

    def run(self, runtime=None, fetch: Sequence[int] | None = None, wait: bool = True) -> list[Any]:
        """Run once and return the value of each root.

        Roots listed in ``fetch`` (default: all) come back as arrays; on a distributed runtime the
        others stay on the workers as :class:`ValueRef` (a future plus a tuple index), so only
        what the caller asked for crosses to the client. With ``wait=False`` the fetched roots
        come as :class:`Fetching` handles (:func:`gather` waits for them) and the call returns at once.
        """
        runtime = runtime if runtime is not None else self.runtime
        fetch = set(range(len(self.roots))) if fetch is None else set(fetch)
        layers, keys = self.lower(programs=None if runtime is None else self._programs(runtime))
        out: list[Any] = [None] * len(self.roots)
        # Where each root's value is (per replica: data-parallel plans keep some roots on every
        # process): (task key or remote future, tuple index); a plain value goes straight to out.
        source: dict[tuple[int, int], tuple[Any, int | None]] = {}
        for pos, refs in enumerate(self.replicas):
            for p, r in enumerate(refs):
                if not r.node.is_leaf:
                    cid, k = self.where[(id(r.node), r.index)]
                    source[(pos, p)] = (keys[cid], k)
                elif isinstance(r.node.cell.value, ValueRef):
                    v = r.node.cell.value
                    v = v.on(p) if isinstance(v, ReplicatedRef) else v
                    source[(pos, p)] = (v.future, v.index)
                elif p == 0:
                    out[pos] = r.node.cell.value
        if runtime is None:  # no futures exist without a runtime: every source is a task key
            remote = [pos for pos, (key, _) in source.items() if not isinstance(key, str)]
            if remote:
                raise TileError("tilegraph.compute", "values that live on a runtime's workers need that runtime "
                                "(pass runtime=..., or run inside `with rt.as_current():`)",
                                f"{len(remote)} of the graph's values held by a Dask cluster, no runtime")
            want = sorted({key for (_, p), (key, _) in source.items() if p == 0})
            results = dict(zip(want, _local_get(layers, want)))
            for (pos, p), (key, k) in source.items():
                if p == 0:
                    out[pos] = results[key] if k is None else results[key][k]
            return out
        # Fetched values come back through one small task per task holding some (it picks them
        # out of the result tuple next to the data); the rest stay.
        fetch_of: dict[int, tuple[str, int | None]] = {}  # position -> (fetch task key, index in its value)
        wanted: dict[Any, list[tuple[int, int | None]]] = {}  # source -> its fetched (position, index)
        for (pos, p), (src, k) in source.items():
            if pos in fetch and p == 0:
                wanted.setdefault(src, []).append((pos, k))
        for n, (src, items) in enumerate(wanted.items()):
            idx = list(dict.fromkeys(k for _, k in items))
            key = f"tg-fetch-{n}-{keys[0] if keys else self.structure}"
            layers["cpu"][key] = src if idx == [None] else (_pick, src, tuple(idx))
            for pos, k in items:
                fetch_of[pos] = (key, None if idx == [None] else idx.index(k))
        kept = [(pos, p) for pos, p in source if pos not in fetch or p > 0]
        # Values that stay on the workers (parameters, optimizer state) must not keep the rest of
        # their task's result tuple (activations for later tasks) alive: where a task returns
        # more than what stays, one small task per task picks out just the kept elements.
        kept_of: dict[str, set[int]] = {}
        for at in kept:
            src, k = source[at]
            if isinstance(src, str):
                kept_of.setdefault(src, set()).add(k)
        moved: dict[tuple[str, int], tuple[str, int]] = {}
        plan_of = dict(zip(keys, self.plans))
        for src, idx in kept_of.items():
            # A pick is one more dependent hop before the next step can use the values: only
            # worth it when the rest of the result is more than a tenth of what stays (so the
            # workers never hold more than 110% of the kept state between steps).
            outputs = plan_of[src].outputs
            rest = sum(r.nbytes for k, r in enumerate(outputs) if k not in idx)
            if rest > PICK_MIN_BYTES and rest > 0.1 * sum(outputs[k].nbytes for k in idx):
                idx = tuple(sorted(idx))
                pick = f"tg-keep-{src[3:]}"
                layers["cpu"][pick] = (_pick, src, idx)
                moved.update({(src, k): (pick, j) for j, k in enumerate(idx)})
        want = sorted({moved.get((src, k), (src, k))[0] for src, idx in kept_of.items() for k in idx})
        want += sorted({key for key, _ in fetch_of.values()})
        pinned = {keys[cid]: addr for cid, addr in self.worker_of.items()}
        futures = dict(zip(want, runtime.submit_layers(layers, want, workers=pinned)))
        for pos, (key, k) in fetch_of.items():
            out[pos] = Fetching(futures[key], k)
        if wait:
            out = gather(runtime, out)
        stays: dict[int, list[ValueRef]] = {}
        for pos, p in kept:
            src, k = source[(pos, p)]
            if isinstance(src, str):
                src, k = moved.get((src, k), (src, k))
                src = futures[src]
            stays.setdefault(pos, []).append(ValueRef(src, k))
        for pos, refs in stays.items():
            if pos not in fetch:
                out[pos] = refs[0] if len(refs) == 1 else ReplicatedRef(refs[0].future, refs[0].index, tuple(refs))
        return out


@dataclass(frozen=True)
class Fetching:
    """A root that :meth:`Executable.run` with ``wait=False`` is fetching: element ``index`` of
    ``future``'s value (``None``: all of it); :func:`gather` waits for it."""

    future: Any
    index: int | None


def gather(runtime, values: Sequence) -> list:
    """``values`` with every :class:`Fetching` replaced by its value (one gather for all)."""
    futures = list({id(v.future): v.future for v in values if isinstance(v, Fetching)}.values())
    if not futures:
        return list(values)
    got = dict(zip(map(id, futures), runtime.client.gather(futures)))
    return [(got[id(v.future)] if v.index is None else got[id(v.future)][v.index]) if isinstance(v, Fetching) else v
            for v in values]


#: client-side leaf values up to this size travel inside the tasks that read them (batches, the
#: optimizer's scalars); larger ones as a data task of their own, sent once
INLINE_MAX_BYTES = 65536

#: kept values are picked out of a task's result only when the rest of it holds more than this
#: (and more than a tenth of the kept values)
PICK_MIN_BYTES = 4096


def _pick(values: tuple, idx: tuple) -> tuple:
    """The elements ``idx`` of a task's result tuple (so the rest can be released)."""
    return tuple(values[i] for i in idx)


def _local_get(layers: dict, keys: list):
    import dask

    dsk = {}
    for part in layers.values():
        dsk.update(part)
    if config.local_scheduler == "sync":
        return dask.get(dsk, keys)
    from dask.threaded import get

    return get(dsk, keys)


def compile(outputs: Sequence[TileTensor | TileRef], **kw) -> Executable:
    """Place, cluster and plan the graph behind ``outputs`` (TileTensors or tile refs)."""
    roots: list[TileRef] = []
    for o in outputs:
        if isinstance(o, TileTensor):
            roots.extend(o.grid.flat)
        else:
            roots.append(o)
    return Executable(roots, **kw)


def _assemble(t: TileTensor, tiles: list) -> np.ndarray:
    if t.ndim == 0:
        return tiles[0].reshape(())
    arr = np.empty(t.shape, dtype=t.dtype)
    for idx, v in zip(np.ndindex(*t.tiling.grid), tiles):
        arr[t.tiling.slices(idx)] = _host(v)
    return arr


def _host(v):
    return v.get() if type(v).__module__.startswith("cupy") else np.asarray(v)


def compute(*tensors: TileTensor, **kw) -> list[np.ndarray]:
    """Run the graph behind ``tensors`` and return them as NumPy arrays.

    Uses the connected runtime (:func:`tilegraph.connect`) when there is one, else Dask's local
    threaded scheduler. Keyword arguments go to :class:`Executable` (``fuse``, ``placement``...).
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, TileTensor):
            raise TileError("tilegraph.compute", f"argument {i} must be a TileTensor", type(t).__name__)
    exe = compile(tensors, **kw)
    values = exe.run()
    out, k = [], 0
    for t in tensors:
        n = t.ntiles
        out.append(_assemble(t, values[k:k + n]))
        k += n
    return out


def to_dask_array(t: TileTensor):
    """The TileTensor as a ``dask.array.Array`` whose chunks are its tiles."""
    import operator

    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph

    exe = compile([t])
    layers, keys = exe.lower()
    name = f"tilegraph-{uuid.uuid4().hex[:12]}"
    dsk: dict = {}
    for part in layers.values():
        dsk.update(part)
    for idx, ref in zip(np.ndindex(*t.tiling.grid), t.grid.flat):
        if ref.node.is_leaf:
            a, i = exe._bind_leaf(ref.node.cell, {"data": dsk, "dask": dsk})
        else:
            cid, i = exe.root_location(ref)
            a = keys[cid]
        dsk[(name,) + idx] = (operator.getitem, a, i) if i is not None else a
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=())
    return da.Array(graph, name, t.chunks, dtype=t.dtype)
