"""Placement, the cost estimate, task names, and the list-scheduling simulation that clusters
placed kernels into coarse tasks for worker processes and their threads."""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Sequence

import numpy as np

from tilegraph._config import config, transfer_speed
from tilegraph._errors import TileError
from tilegraph._graph import Node

__all__ = ["place", "est_seconds", "task_label", "users_of", "upward_ranks", "only_feeding", "by_upward_rank",
           "Cluster", "cluster_nodes", "out_bytes", "state_writers", "threads_worth_using", "list_span"]


def place(nodes: Sequence[Node], policy: str, has_gpu: bool, bandwidth: float | None = None) -> None:
    """Put each node on a device class ("cpu" or "gpu") by ``policy``; "auto" weighs the
    kernels' seconds on each against the moves between them (Dask's hop, and the bytes at
    ``bandwidth``: :func:`tilegraph._config.transfer_speed`)."""
    if policy not in ("cpu", "gpu", "auto"):
        raise TileError("tilegraph.place", "placement must be 'cpu', 'gpu' or 'auto'", repr(policy))
    if policy == "gpu" and not has_gpu:
        raise TileError("tilegraph.place", "placement 'gpu' needs workers with a GPU resource",
                        "a runtime without GPU workers")
    if policy != "auto" or not has_gpu:
        for n in nodes:
            n.device = "cpu" if policy == "auto" else policy
        return
    # "auto" with GPU workers. A kernel goes to the GPU where the cost model has it finish sooner
    # there (the GPU's seconds per call count its launches), and a kernel that reads a GPU value
    # follows it there, so that cheap steps between two GPU kernels do not carry values to the
    # host and back. Then the graph as a whole: a value crossing between the devices costs a task
    # boundary (Dask's hop) and a copy, so the GPU takes the graph only where its kernels save
    # more than that; a graph of small kernels stays on the CPU. (The README's quick start, GPT-2
    # debug, trained 300 steps in > 90 s on an H100 machine with its heavier kernels on the GPU,
    # and in 7.1 s with all of them on the CPU.)
    for n in nodes:  # in topological order: inputs placed first
        heavy = n.cost.flops >= config.gpu_min_flops and _seconds(n, "gpu") < _seconds(n, "cpu")
        follows = any(not i.node.is_leaf and i.node.device == "gpu" for i in n.inputs)
        n.device = "gpu" if heavy or follows else "cpu"
    if _placed_seconds(nodes, transfer_speed(bandwidth)) >= sum(_seconds(n, "cpu") for n in nodes):
        for n in nodes:
            n.device = "cpu"


def _placed_seconds(nodes: Sequence[Node], bandwidth: float) -> float:
    """The kernels' seconds on their devices, one after another, plus a hop per value that
    crosses between the devices and its bytes at ``bandwidth``."""
    total = 0.0
    for n in nodes:
        total += _seconds(n, n.device)
        for i in n.inputs:
            if not i.node.is_leaf and i.node.device != n.device:
                total += config.hop_seconds + i.nbytes / bandwidth
    return total


def _seconds(node: Node, device: str) -> float:
    f, b, c = config.speeds[device]
    return node.cost.flops / f + node.cost.bytes / b + c


def est_seconds(node: Node) -> float:
    return _seconds(node, node.device)


#: the phase words in task names; "backward" would end Dask's prefix (eight letters that begin
#: like a hex token look like a hash to ``key_split``)
_PHASE_WORDS = {"forward": "fwd", "backward": "bwd"}


def task_label(nodes: Sequence[Node]) -> str:
    """A task's name on the Dask dashboard, from the scope of most of its estimated work.

    Dask groups and colours tasks by the alphabetic words at the start of their key (its
    ``key_split``): ``layers.3.attn:backward`` becomes ``layers-attn-bwd-3``, so the task stream
    reads ``tg-layers-attn-bwd`` and the key keeps the layer's index; a task spanning several
    parts of the model is named after the largest, with ``-etc``, where that one holds at least
    half of its work. A task where no part does (a whole step in one task: each block and phase
    is a small part beside the optimizer's update) is named after the part of the model all its
    work shares, if any, and the phases it spans in order: ``tg-fwd-bwd-update``,
    ``tg-blocks-fwd-bwd-3``."""
    work: dict[str, float] = {}
    for n in nodes:
        work[n.scope] = work.get(n.scope, 0.0) + est_seconds(n)
    top = max(work, key=work.get, default="")
    if len(work) > 1 and work[top] < 0.5 * sum(work.values()):
        shared = [s.partition(":")[0].split(".") for s in work]
        common = []
        for level in zip(*shared):
            if len(set(level)) > 1 or not level[0]:
                break
            common.append(level[0])
        words = ["".join(ch for ch in p if ch.isalpha()) for p in common if not p.isdigit()]
        return "-".join([w for w in words if w] + [gang_label(nodes)] + [p for p in common if p.isdigit()])
    path, _, phase = top.partition(":")
    parts = path.split(".") if path else [nodes[0].op if nodes else "task"]
    words = ["".join(ch for ch in p if ch.isalpha()) for p in parts if not p.isdigit()]
    words = [w for w in words if w] + [_PHASE_WORDS.get(phase or "forward", phase)]
    numbers = [p for p in parts if p.isdigit()]
    if len(work) > 1:
        words.append("etc")  # more than one part of the model
    return "-".join(words + numbers)


def gang_label(nodes: Sequence[Node]) -> str:
    """A gang task's name on the Dask dashboard: the phases of its nodes in order of first
    appearance (``fwd-bwd-update`` for a training step), as :func:`task_label` words them. A gang
    runs a process's whole share of a call, so no one part of the model names it."""
    phases: list[str] = []
    for n in nodes:
        phase = n.scope.partition(":")[2] or "forward"
        word = _PHASE_WORDS.get(phase, "".join(ch for ch in phase if ch.isalpha()))
        if word and word not in phases:
            phases.append(word)
    return "-".join(phases) or "step"


# ------------------------------------------------------------------------------ clustering ----
def users_of(nodes: Sequence[Node]) -> dict[int, list[Node]]:
    """The nodes among ``nodes`` that read each node's outputs, by ``id``."""
    users: dict[int, list[Node]] = {id(n): [] for n in nodes}
    for n in nodes:
        for i in n.inputs:
            if id(i.node) in users:
                users[id(i.node)].append(n)
    return users


def upward_ranks(nodes: Sequence[Node], users: dict[int, list[Node]]) -> dict[int, float]:
    """Each node's longest estimated path to a sink, itself included (HEFT's upward rank), by
    ``id``; ``nodes`` are in a topological order."""
    rank: dict[int, float] = {}
    for n in reversed(nodes):  # successors come later
        rank[id(n)] = est_seconds(n) + max((rank[id(s)] for s in users[id(n)]), default=0.0)
    return rank


def only_feeding(nodes: Sequence[Node], users: dict[int, list[Node]], targets: set[int]) -> set[int]:
    """Ids of the nodes (``nodes`` in a topological order) outside ``targets`` whose every user
    is in ``targets`` or is such a node itself: work that only ``targets`` need."""
    feeds: set[int] = set()
    for n in reversed(nodes):
        if id(n) not in targets and users[id(n)] and all(id(u) in targets or id(u) in feeds for u in users[id(n)]):
            feeds.add(id(n))
    return feeds


def after_inputs(nodes: Sequence[Node], rank: dict[int, float], feeds: set[int]) -> None:
    """Raise the rank of each node of ``feeds`` (ids; ``nodes`` in a topological order) to just
    below its latest-visited input's, so that an order by decreasing rank visits it right after
    its inputs (still after every one of them) rather than where its own path to a sink puts it."""
    for n in nodes:  # topological: a node's inputs have their final rank
        made = [rank[id(i.node)] for i in n.inputs if id(i.node) in rank]
        if id(n) in feeds and made:
            rank[id(n)] = max(rank[id(n)], math.nextafter(min(made), -math.inf))


def by_upward_rank(nodes: Sequence[Node], state: set[int] = frozenset()) -> list[Node]:
    """Nodes in decreasing order of their longest estimated path to a sink (HEFT's upward rank).

    A valid topological order that visits the critical path first and leaves work only the end
    needs (optimizer updates) for last, so it does not cut the parallel streams of the forward
    and backward passes into small tasks.

    ``state``: ids of the nodes writing the state the next step reads (the updates, as
    :func:`state_writers` finds them). A node whose results only they use, directly or through
    other such nodes (the backward pass: weight gradients, their sums over row tiles), comes
    right after its inputs instead of at the end: it then joins its inputs' task, which frees
    the activations it reads there and hands the updates the gradients (the block stack with two
    row tiles: 162 MiB, where the update's tasks read 326 MiB of activations before).
    """
    users = users_of(nodes)
    rank = upward_ranks(nodes, users)
    after_inputs(nodes, rank, only_feeding(nodes, users, state))
    position = {id(n): k for k, n in enumerate(nodes)}
    return sorted(nodes, key=lambda n: (-rank[id(n)], position[id(n)]))


#: under a memory bound, a task's kernels write at most this share of it: a task that reads
#: another's result holds all of it (Dask moves and unspills results whole), so results near the
#: bound left their readers no room. Measured on a sharded 4-layer x 1024 GPT-2 under 1 GB
#: workers: 635 tasks per step with no such cap (484 of them single kernels), 105 with a quarter;
#: the 20-layer model of bench_capacity.py: 4,641 and 461, peak worker memory 73% and 68% of the limit
RESULT_SHARE = 0.25

#: a task writes at most this many bytes of the state a step carries to the next (new parameters
#: and optimizer moments), or :data:`STATE_TASKS`'s share of it where that is more: a task holds
#: the old values it reads until it ends, so one task updating all of the state held the old and
#: the new state at once. In parts, each part of the old state is freed once its own is written
#: (Dask forgets a result when its last reader ends). Measured on the block stack (6 x 768, 487
#: MiB of state, 1 worker x 2 threads), with the backward's order of :func:`by_upward_rank`: the
#: most memory Dask held in a step fell from 1,302 to 891 MiB, with 10 tasks a step instead of 2
#: and no measurable change in speed. A gang (one task per process and step) holds its inputs
#: to the end, so there it changes nothing
STATE_TASK_BYTES = 64 << 20
#: ... so that a large model's update takes about this many tasks, not one per 64 MiB: each task
#: costs the worker its bookkeeping (a fraction of a millisecond to milliseconds), which a GPU
#: step of tens of milliseconds would feel; the saving is then all but an eighth of the new state
STATE_TASKS = 8


def out_bytes(node: Node) -> int:
    """Bytes of a node's outputs."""
    return sum(math.prod(s) * np.dtype(d).itemsize for s, d in node.out_meta)


def state_writers(refs: Sequence[Sequence], state_groups: Sequence[Sequence[int]]) -> set[int]:
    """Ids of the nodes that make the state a step carries to the next: the roots named in
    ``state_groups`` (``refs[k]``: root k's refs, one per replica that computes it)."""
    return {id(r.node) for g in state_groups for k in g for r in refs[k] if not r.node.is_leaf}


class Cluster:
    __slots__ = ("id", "device", "proc", "threads", "nodes", "seconds", "open", "bytes", "made", "reads", "start",
                 "state")

    def __init__(self, cid: int, device: str, proc: int, threads: int = 1):
        self.id, self.device, self.proc, self.threads = cid, device, proc, threads
        self.nodes: list[Node] = []
        self.seconds = 0.0
        self.open = True
        #: the task's memory bound (bytes): what it reads, plus everything its kernels write
        #: (:attr:`made`; an over-estimate, the runner frees values at last use). A worker holds a
        #: task's inputs whole: another task's result tuple counts with all it holds (at most
        #: that task's :attr:`made`), a leaf value with its own bytes
        self.bytes = 0
        self.made = 0
        self.reads: set = set()  # the clusters (by id) and leaf values (id(node), index) it reads
        self.start = 0.0  # when the simulation started its first node (seconds)
        self.state = 0  # bytes of state its kernels write (:data:`STATE_TASK_BYTES`)

    def _new_reads(self, node: Node, of: dict[int, "Cluster"]) -> dict:
        """What ``node`` would add to this task's reads, with their bytes."""
        new = {}
        for i in node.inputs:
            src = of.get(id(i.node))
            if src is self:
                continue
            key, size = (("c", src.id), src.made) if src is not None else ((id(i.node), i.index), i.nbytes)
            if key not in self.reads:
                new[key] = size
        return new

    def added_bytes(self, node: Node, of: dict[int, "Cluster"]) -> int:
        """How much :attr:`bytes` grows with ``node`` in this cluster."""
        return out_bytes(node) + sum(self._new_reads(node, of).values())

    def add(self, node: Node, seconds: float, of: dict[int, "Cluster"]) -> None:
        new = self._new_reads(node, of)
        self.reads.update(new)
        made = out_bytes(node)
        self.bytes += made + sum(new.values())
        self.made += made
        self.nodes.append(node)
        self.seconds += seconds
        of[id(node)] = self


def cluster_nodes(nodes: Sequence[Node], groups: dict[str, list[int]], target: float,
                  fuse: bool, fixed: dict[int, int] | None = None,
                  home: int | None = None, max_bytes: float = float("inf"),
                  bandwidth: float | None = None,
                  state: set[int] = frozenset()) -> tuple[list[Cluster], dict[int, Cluster], float]:
    """Group placed nodes (in a topological order) into acyclic clusters, one Dask task each.

    ``groups`` gives, per device class, the threads of each worker process. A list-scheduling
    simulation puts every node on the thread where it can start first; the nodes a process runs
    form its open cluster, which runs them on the process's threads as one task. A value is ready
    on another thread of the same open cluster when its node finishes, anywhere else only when its
    cluster's task has finished plus a Dask hop (``config.hop_seconds``). A cluster closes once its
    estimated wall time passes ``target``, when another cluster needs one of its values, or before
    its memory bound (:attr:`Cluster.bytes`: what it reads plus all it writes) would pass
    ``max_bytes`` or what it writes :data:`RESULT_SHARE` of that: a worker must hold a task's
    inputs and results at once, and Dask moves and spills only whole task results. It also closes
    before the nodes of ``state`` (ids of the nodes writing the state the next step reads: the
    updates) in it would write more than :data:`STATE_TASK_BYTES` (or an :data:`STATE_TASKS`-th
    of what they write in all, where that is more).

    A cluster only ever gains dependencies on clusters that are already closed, and every cluster
    closes after those it depends on, so the cluster graph is acyclic by construction.

    ``fixed`` maps ``id(node)`` to the process a strategy put it on (data parallelism: its
    replica); those nodes only choose among that process's threads. With ``home``, process ``g``
    is a second lane of worker process ``g % home`` (values between lanes of one process are not
    copied). A value read in another process also takes its bytes at ``bandwidth`` (the
    runtime's measured link, :func:`tilegraph._config.transfer_speed`). Returns the clusters,
    the cluster of each node and the simulated finish time of the whole graph (seconds).
    """
    if not fuse:
        return _one_task_per_node(nodes)
    state_cap = max(STATE_TASK_BYTES, sum(out_bytes(n) for n in nodes if id(n) in state) / STATE_TASKS)
    sim = _Simulation(groups, _processes_used(nodes, groups, fixed), target, home, max_bytes, transfer_speed(bandwidth),
                      state, state_cap)
    for node in nodes:
        sim.schedule(node, fixed.get(id(node)) if fixed is not None else None)
    for c in sim.clusters:
        if c.threads > 1:
            c.threads = threads_worth_using(c.nodes, c.threads)
    return sim.clusters, sim.cluster_of, sim.makespan()


def _one_task_per_node(nodes: Sequence[Node]) -> tuple[list[Cluster], dict[int, Cluster], float]:
    """:func:`cluster_nodes` without fusion (``fuse=False``, for debugging): a closed cluster per
    node, on process 0, and the nodes' estimated seconds one after another."""
    clusters: list[Cluster] = []
    cluster_of: dict[int, Cluster] = {}
    for n in nodes:
        c = Cluster(len(clusters), n.device, 0)
        c.nodes.append(n)
        c.open = False
        clusters.append(c)
        cluster_of[id(n)] = c
    return clusters, cluster_of, sum(est_seconds(n) for n in nodes)


def _processes_used(nodes: Sequence[Node], groups: dict[str, list[int]],
                    fixed: dict[int, int] | None) -> dict[str, int]:
    """How many of each device class's processes the simulation may use."""
    # Use only as many processes as there is work for: a graph with little work per extra process
    # runs faster as fewer, larger tasks.
    total = {dev: 0.0 for dev in groups}
    for n in nodes:
        total[n.device] += est_seconds(n)
    per = config.min_process_seconds  # 0: every process
    used = {dev: max(1, min(len(threads), int(total[dev] / per) if per > 0 else len(threads)))
            for dev, threads in groups.items()}
    if fixed:  # a strategy's processes are all used, whatever the work per process
        used = {dev: len(threads) for dev, threads in groups.items()}
    return used


class _Input(NamedTuple):
    """A node's input as the simulation sees it: the cluster of the node making it, when that
    node finishes (seconds) and the input's bytes."""

    cluster: Cluster
    finish: float
    nbytes: int


class _Simulation:
    """The state of :func:`cluster_nodes`'s list-scheduling simulation, which places nodes one at
    a time (:meth:`schedule`) on the threads of worker processes (``proc``: an index among those
    of the node's device class) and cuts their nodes into clusters."""

    def __init__(self, groups: dict[str, list[int]], used: dict[str, int], target: float,
                 home: int | None, max_bytes: float, bandwidth: float, state: set[int] = frozenset(),
                 state_cap: float = float("inf")):
        self.clusters: list[Cluster] = []
        self.cluster_of: dict[int, Cluster] = {}  # id(node) -> its cluster
        #: per device class and process: when each of its threads is next free (seconds)
        self.free_at = {dev: [[0.0] * t for t in threads[:used[dev]]] for dev, threads in groups.items()}
        self.open_on: dict[tuple[str, int], Cluster] = {}  # (device, proc) -> its latest cluster
        self.finish: dict[int, float] = {}  # id(node) -> when it finishes
        self.end: dict[int, float] = {}  # cluster id -> latest finish of its nodes so far
        self.target = target
        self.home = home
        self.max_bytes = max_bytes
        self.bounded = max_bytes < float("inf")
        self.hop = config.hop_seconds
        self.bandwidth = bandwidth
        self.state = state
        self.state_cap = state_cap  # the most state one cluster writes (:data:`STATE_TASK_BYTES`)

    def makespan(self) -> float:
        """The simulated finish time of everything scheduled so far (seconds)."""
        return max(self.end.values(), default=0.0)

    def schedule(self, node: Node, fixed_proc: int | None = None) -> None:
        """Place ``node`` (its inputs placed before it) on a thread of the process where it can
        start first, or of ``fixed_proc``, in that process's open cluster or a new one."""
        dev = node.device
        seconds = est_seconds(node)
        inputs = [_Input(self.cluster_of[id(i.node)], self.finish[id(i.node)], i.nbytes)
                  for i in node.inputs if id(i.node) in self.cluster_of]
        proc = fixed_proc if fixed_proc is not None else self._choose_process(dev, inputs)
        self._close_clusters_read(inputs, self.open_on.get((dev, proc)))
        cluster = self._cluster_for(node, seconds, inputs, proc)
        frees = self.free_at[dev][proc]
        thread = min(range(len(frees)), key=frees.__getitem__)
        start = max(self._ready_time(inputs, cluster, dev, proc), frees[thread])
        if not cluster.nodes:
            cluster.start = start
        cluster.add(node, seconds, self.cluster_of)
        if id(node) in self.state:
            cluster.state += out_bytes(node)
        self.finish[id(node)] = frees[thread] = start + seconds
        self.end[cluster.id] = max(self.end.get(cluster.id, 0.0), start + seconds)

    def _host(self, proc: int) -> int:
        """The worker process that process ``proc`` is a lane of (itself without ``home``)."""
        return proc if self.home is None else proc % self.home

    def _open_cluster(self, dev: str, proc: int) -> Cluster | None:
        """The cluster that process ``proc`` of ``dev`` is still adding nodes to, if any."""
        cluster = self.open_on.get((dev, proc))
        return cluster if cluster is not None and cluster.open else None

    def _ready_time(self, inputs: Sequence[_Input], cluster: Cluster | None, dev: str, proc: int) -> float:
        """When all inputs can be there for a node on process ``proc`` of ``dev``: at once from
        ``cluster`` (its own open task); after their task, a hop and, from another process, the
        transfer of the bytes otherwise."""
        return max((i.finish if i.cluster is cluster else
                    self.end[i.cluster.id] + self.hop
                    + (0.0 if (i.cluster.device, self._host(i.cluster.proc)) == (dev, self._host(proc))
                       else i.nbytes / self.bandwidth)
                    for i in inputs), default=0.0)

    def _choose_process(self, dev: str, inputs: Sequence[_Input]) -> int:
        """The process of ``dev`` where a node reading ``inputs`` can start first (the lowest
        index among equals), or that of its latest input where it starts no later there."""
        starts = [max(self._ready_time(inputs, self._open_cluster(dev, proc), dev, proc), min(frees))
                  for proc, frees in enumerate(self.free_at[dev])]
        best = min(range(len(starts)), key=lambda proc: (starts[proc], proc))
        # Ties go to the process of the latest input: chains stay in one task.
        latest = max((i for i in inputs if i.cluster.device == dev), key=lambda i: i.finish, default=None)
        if latest is not None and latest.cluster.proc < len(starts) and starts[latest.cluster.proc] <= starts[best]:
            best = latest.cluster.proc
        return best

    @staticmethod
    def _close_clusters_read(inputs: Sequence[_Input], current: Cluster | None) -> None:
        """Close the open clusters whose values a node in ``current`` reads: another task needs
        them, so they must end before it."""
        for i in inputs:
            if i.cluster.open and i.cluster is not current:
                i.cluster.open = False

    def _cluster_for(self, node: Node, seconds: float, inputs: Sequence[_Input], proc: int) -> Cluster:
        """The cluster ``node`` joins on process ``proc``: the process's open cluster, unless
        that must close first (:meth:`_must_close`); then a new one."""
        dev = node.device
        current = self.open_on.get((dev, proc))
        if current is not None and current.open and not self._must_close(current, node, seconds, inputs, proc):
            return current
        if current is not None:
            current.open = False
        threads = len(self.free_at[dev][proc])
        cluster = Cluster(len(self.clusters), dev, proc, threads)
        self.clusters.append(cluster)
        self.open_on[(dev, proc)] = cluster
        return cluster

    def _must_close(self, cluster: Cluster, node: Node, seconds: float, inputs: Sequence[_Input], proc: int) -> bool:
        """Whether open ``cluster`` must close before ``node`` (on process ``proc``) can run: an
        input from elsewhere would hold back its start, or the node would take it past the time
        target or the memory bound."""
        # A Dask task starts only once all its inputs exist: a node whose value from elsewhere is
        # ready only after the open cluster began would hold back the cluster's earlier nodes.
        from_elsewhere = [i for i in inputs if i.cluster is not cluster]
        late = self._ready_time(from_elsewhere, None, node.device, proc) > cluster.start
        threads = len(self.free_at[node.device][proc])
        over_target = cluster.seconds > 0 and (cluster.seconds + seconds) / threads > self.target
        over_state = (id(node) in self.state and cluster.state > 0
                      and cluster.state + out_bytes(node) > self.state_cap)
        return late or over_target or over_state or self._over_memory(cluster, node)

    def _over_memory(self, cluster: Cluster, node: Node) -> bool:
        """Whether ``node`` would take ``cluster`` past the memory bound (``max_bytes``), or
        what it writes past :data:`RESULT_SHARE` of it; never for an empty cluster."""
        if not self.bounded or not cluster.nodes:
            return False
        return (cluster.bytes + cluster.added_bytes(node, self.cluster_of) > self.max_bytes
                or cluster.made + out_bytes(node) > self.max_bytes * RESULT_SHARE)


def threads_worth_using(nodes: Sequence[Node], threads: int) -> int:
    """How many of its process's ``threads`` a task running ``nodes`` (a topological order)
    should keep busy: the count, among 1, 2, 4, ... and ``threads``, whose estimated wall time is
    least. On one thread that is the sum of the kernels' estimated times. On ``k`` threads it is
    the longer of the nodes' list-scheduled span on ``k`` threads (a Dask task starts once all
    its inputs exist, so only its own dependencies order it) and what the threads must do one
    at a time, holding the GIL: up to ``config.kernel_gil_seconds`` of each kernel (all of a
    shorter one) plus ``config.thread_handoff_seconds`` per kernel handed between threads.

    So small kernels run one after another: measured on 2 cores, a training step of `tilegraph
    train`'s model (164 kernels of ~40 us) took 6.4 ms on one thread, 9.6 ms on 2 threads and
    9.6-26 ms on 16, though the list schedule promised 6.7 and 5.4 ms; and a task with few
    kernels able to run at once keeps no more threads than that. Kernels of milliseconds hold
    the GIL for a small part of their time, so their threads need not wait for each other: the
    block stack's step (5,231 kernels, ~12 s of them on one thread) is planned on 16 threads of
    a 16-core process, not 8 (a cost of (k - 1) x 20 us per kernel and thread, which an earlier
    rule charged, had it kept 8, and half of the cores idle)."""
    times = [est_seconds(n) for n in nodes]
    best_k, best = 1, sum(times)
    held = sum(min(t, config.kernel_gil_seconds) for t in times) + len(nodes) * config.thread_handoff_seconds
    floor = list_span(nodes, times, len(nodes))  # the longest path: no count of threads does better
    for k in sorted({min(threads, 1 << j) for j in range(1, max(1, threads - 1).bit_length() + 1)}):
        span = list_span(nodes, times, k)
        cost = max(span, held)
        if cost < best:
            best_k, best = k, cost
        if span <= floor * (1 + 1e-9) or span <= held:  # more threads would only wait
            break
    return best_k


def list_span(nodes: Sequence[Node], times: Sequence[float], threads: int) -> float:
    """The finish time of ``nodes`` (a topological order; their inputs from outside ready at 0)
    list-scheduled on ``threads`` threads in that order, as a task's runner takes them: each
    node on the first thread free, once its inputs are done."""
    free = [0.0] * threads
    finish: dict[int, float] = {}
    end = 0.0
    for n, t in zip(nodes, times):
        ready = max((finish.get(id(i.node), 0.0) for i in n.inputs), default=0.0)
        start = max(ready, heapq.heappop(free))
        finish[id(n)] = start + t
        heapq.heappush(free, start + t)
        end = max(end, start + t)
    return end

