"""From the logical tile graph to executed Dask tasks: placement, clustering, lowering.

The logical graph has one node per tile kernel call, often thousands per training step, while
Dask distributed pays milliseconds per dependent task. So nodes are never submitted one by one:

1. placement gives every node a device class ("cpu" or "gpu");
2. clustering groups neighbouring nodes of one device into coarse tasks (a list-scheduling
   simulation on the available worker threads decides which nodes may run in parallel; each
   virtual processor's node sequence is cut once a cluster reaches ``target_seconds`` of estimated
   work, or when another processor needs one of its values);
3. lowering writes one raw Dask task per cluster, ``(run_cluster, program, *inputs)``, into a
   graph whose GPU layer carries a ``{"GPU": 1}`` resource annotation; a data-parallel plan of
   CPU tasks runs instead as one *gang* task per worker process (:mod:`tilegraph.parallel.gang`),
   its clusters run in order inside it and the values between processes going through channels
   (shared-memory files on one host, the workers' own comms between hosts).

An :class:`Executable` keeps the placed, clustered plan; running it again only re-binds the leaf
cells (parameters, batches) and writes fresh keys, which is how a training step is replayed.
``fuse=False`` keeps one task per tile kernel for debugging.

Placement and clustering live in :mod:`tilegraph.plan.cluster`, parallel strategies in
:mod:`tilegraph.parallel`, what the tasks run on the workers in :mod:`tilegraph.exec.program`;
this module writes and runs the Dask graph.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any, Callable, Sequence

import numpy as np

from tilegraph import _config
from tilegraph._config import PARALLEL_STRATEGIES, Config, config, transfer_speed  # noqa: F401 - re-exported
from tilegraph._errors import TileError
from tilegraph._graph import (Cell, CopiesRef, Node, ReplicatedRef, TileRef, ValueRef, current_kernel, kernels_redefined,
                              to_host, topo_order)
from tilegraph._tensor import TileTensor
from tilegraph.exec.program import (Bound, Call, Program, kernel_stats, measured_exactly,  # noqa: F401 - re-exported
                                    one_blas_thread, run_cluster)
from tilegraph.exec.gang import AFTER_INDEX, PeerFailedError, run_gang
from tilegraph.exec.shm import receive_shm, send_shm
from tilegraph.parallel.data_parallel import plan_data_parallel, zero3_task_bytes
from tilegraph.parallel.gang import plan_gang
from tilegraph.plan.cluster import (Cluster, by_upward_rank, cluster_nodes, out_bytes, state_writers,  # noqa: F401 - re-exported
                                    place, task_label)

__all__ = ["compile", "compute", "Executable", "config", "DaskKey", "run_cluster"]


def _memory_limit(workers) -> float:
    """The smallest memory limit of a plan's workers (a :class:`~tilegraph.runtime.Workers`;
    bytes, inf where none is set or without a runtime)."""
    return float("inf") if workers is None else workers.memory_limit


def check_runtime(where: str, runtime) -> None:
    """``runtime`` is None (the current one, else Dask's local scheduler) or an open Runtime (a
    closed one's client would say 'IOLoop is closed')."""
    from tilegraph.runtime import Runtime

    if runtime is not None and not isinstance(runtime, Runtime):
        raise TileError(where, "runtime must be None or a tilegraph Runtime (rt = tg.connect(...) or "
                        "tg.connect(\"tcp://scheduler:8786\"))", f"runtime={runtime!r}")
    if runtime is not None:
        runtime.require_open(where)


def _client_address(client) -> str:
    """" (scheduler ADDRESS)" of a Dask client, also after it was closed (then from the identity
    the scheduler gave when it connected); "" where it cannot be told."""
    addr = getattr(getattr(client, "scheduler", None), "address", None)
    addr = addr or (getattr(client, "_scheduler_identity", None) or {}).get("address")
    return f" (scheduler {addr})" if addr else ""


def check_values_reachable(where: str, leaves: Sequence[Node], runtime) -> None:
    """Fail before a graph runs (a step: before it changes anything, its step count or its cells)
    where a value it reads cannot be had: a parameter that holds none (built under
    :func:`tilegraph.nn.deferred_init` and never loaded: it would run as None, or read as NaN),
    or values on the workers of a runtime that was closed (they went with it) or of another
    runtime than the one the graph runs on (Dask cancels a graph reading another client's
    futures, "lost dependencies", and a step's parameters would then point to values that never
    came). ``leaves``: the graph's leaf nodes; ``runtime``: where it runs (None: this process)."""
    here = None if runtime is None else runtime.client
    empty: list[str] = []
    closed: dict[str, int] = {}
    elsewhere: dict[str, int] = {}
    for node in leaves:
        value = node.cell.value
        if value is None:
            empty.append(node.cell.token)
        elif isinstance(value, ValueRef):
            client = getattr(value.future, "client", None)
            if getattr(client, "status", None) in ("closing", "closed"):
                addr = _client_address(client)
                closed[addr] = closed.get(addr, 0) + 1
            elif client is not here:
                addr = _client_address(client)
                elsewhere[addr] = elsewhere.get(addr, 0) + 1
    if empty:
        raise TileError(where, "a value in every tile the graph reads: parameters built without values "
                        "(tilegraph.nn.deferred_init, Checkpoint.new_model(values=False)) get them from "
                        "load_state_dict or a checkpoint's load_into / restore before they are computed",
                        f"{len(empty)} tile{'s' * (len(empty) > 1)} without a value: {', '.join(empty[:4])}"
                        + (", ..." if len(empty) > 4 else ""))
    if closed:
        addr, n = next(iter(closed.items()))
        raise TileError(where, "the model's values (parameters, optimizer state) on an open runtime: they lived on "
                        "the workers of a runtime that was closed, and went with it; build the model again, or load "
                        "a checkpoint (tg.io.load_checkpoint, Trainer.load_checkpoint); next time, take what you "
                        "need out before closing (tg.io.save_checkpoint, model.state_dict())",
                        f"{n} tile{'s' * (n > 1)} held by a closed runtime{addr}")
    if elsewhere:
        addr, n = next(iter(elsewhere.items()))
        there = "no runtime (Dask's local scheduler)" if runtime is None else f"{runtime!r}"
        raise TileError(where, "the graph to run on the runtime holding its values: run it inside "
                        "`with rt.as_current():` of that runtime (or give runtime=rt)",
                        f"{n} tile{'s' * (n > 1)} held by another runtime{addr}, the graph runs on {there}")


def _check_fits(work: Sequence[Node], limit: float) -> None:
    """Fail before running when one kernel call's tiles (inputs and outputs) exceed a worker's
    memory limit: Dask would otherwise pause, spill and finally kill the worker, again and again."""
    if not work or limit == float("inf"):
        return

    def nbytes(n: Node) -> int:
        return out_bytes(n) + sum(r.nbytes for r in n.inputs)

    big = max(work, key=nbytes)
    if nbytes(big) > limit:
        mb = 1 << 20
        raise TileError("tilegraph.compile", f"every kernel call's tiles to fit in a worker's memory limit "
                        f"({limit / mb:,.0f} MiB): {big.op!r}" + (f" in {big.scope!r}" if big.scope else "")
                        + f" reads and writes {nbytes(big) / mb:,.0f} MiB; use smaller tiles (tiles=...), or "
                        "workers with more memory (tg.connect(memory_limit=...))",
                        f"tiles {[r.shape for r in big.inputs]} -> {[s for s, _ in big.out_meta]}")



@dataclass(frozen=True)
class DaskKey:
    """A leaf whose value is ``key`` of an existing dask ``graph`` (``from_dask_array``)."""

    graph: Any
    key: Any



# --------------------------------------------------------------------------------- lowering ----
@dataclass
class _Plan:
    prog: Program
    ext: list[TileRef]          # external inputs, in argument order
    outputs: list[TileRef]      # values returned, in tuple order
    device: str


@dataclass
class _Call:
    """The Dask graph of one call of an :class:`Executable`, as :meth:`Executable.run` submits it."""

    layers: dict[str, dict]           # raw task dicts by layer (:meth:`Executable.lower`)
    keys: list[str]                   # the task key of each cluster (of a gang plan: of each process)
    outputs_of: dict[str, Sequence]   # task key -> the values its result tuple holds, in order
    locate: Callable[[int, int], tuple[str, int]]  # (root position, process) -> (task key, index)


#: where each root's value is, per replica: (root position, process) -> (task key or remote
#: future, index in its value; None: all of it)
_Sources = dict[tuple[int, int], tuple[Any, int | None]]


class Executable:
    """A placed and clustered tile graph, ready to be lowered and run any number of times."""

    def __init__(self, roots: Sequence[TileRef], *, fuse: bool | None = None, target_seconds: float | None = None,
                 placement: str | None = None, runtime=None, parallel: str | None = None,
                 state_groups: Sequence[Sequence[int]] = (), batch_cells: Sequence = ()):
        from tilegraph.runtime import current_runtime

        runtime = runtime if runtime is not None else current_runtime()
        check_runtime("tilegraph.compile", runtime)
        self.runtime = runtime
        self.roots = list(roots)
        if fuse is not None and not isinstance(fuse, bool):
            raise TileError("tilegraph.compile", "fuse must be True (kernels fused into tasks), False (a task per "
                            "tile kernel) or None (tilegraph.config.fuse)", repr(fuse))
        if target_seconds is not None and (isinstance(target_seconds, bool) or not isinstance(
                target_seconds, (int, float)) or not 0 < target_seconds < float("inf")):
            raise TileError("tilegraph.compile", "target_seconds must be a positive number of seconds (None: "
                            "tilegraph.config.target_seconds)", repr(target_seconds))
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
        #: the workers this plan is made for (one snapshot, None without a runtime)
        self.workers = runtime.snapshot() if runtime is not None else None
        groups = ({dev: list(t) for dev, t in self.workers.threads.items()} if self.workers is not None
                  else {"cpu": [_config.usable_cores()], "gpu": []})
        addrs = self.workers.addrs if self.workers is not None else {}
        #: bytes per second of a move between worker processes, as this plan takes it
        #: (``config.transfer_bytes_per_second``; "auto": the runtime's measure between hosts)
        spread = runtime is not None and sum(len(t) for t in groups.values()) > 1  # room for several workers
        every = {a for v in addrs.values() for a in v}
        measured = (runtime.link_bytes_per_second(every)
                    if spread and config.transfer_bytes_per_second == "auto" else None)
        self.link_bytes_per_second = transfer_speed(measured)
        #: whether that speed was measured on the runtime (between hosts)
        self.link_measured = measured is not None
        #: whether the workers span several hosts; a data-parallel plan then sends its
        #: gradients in buckets during the backward (``config.bucket_bytes``)
        self.across_hosts = spread and runtime.spans_hosts(every)
        self.bucket_bytes = _config.bucket_size(self.across_hosts)
        place(work, placement, len(groups.get("gpu", ())) > 0, self.link_bytes_per_second)
        #: the smallest memory limit of those workers (bytes, inf: none)
        self.memory_limit = limit = _memory_limit(self.workers)
        _check_fits(work, limit)
        # Tasks are kept under a memory bound where the step's values could outgrow what a worker
        # holds before Dask spills (a model larger than the workers' memory); elsewhere only the
        # time target shapes them
        total = sum(out_bytes(n) for n in nodes)
        #: whether the workers' memory limit bounds the tasks (the step's values would outgrow it)
        self.memory_bound = total > 0.5 * limit
        self.max_task_bytes = config.task_memory_fraction * limit if self.memory_bound else float("inf")
        if parallel == "zero3":  # parameters gathered only when used: no task reads more than a
            # process's share of them
            self.max_task_bytes = min(self.max_task_bytes, zero3_task_bytes(self.roots, state_groups, groups))
        processes = sum(len(t) for t in groups.values())  # worker processes (of either device class)
        groups = {"cpu": groups.get("cpu") or [1], "gpu": groups.get("gpu") or [1]}
        #: each root's refs: one, or one per replica for the replicated roots of a data-parallel plan
        self.replicas: list[list[TileRef]] = [[r] for r in self.roots]
        self.strategy = "tiles"
        #: data-parallel plans: the replicas (worker processes); process p's tasks run on lanes
        #: p (compute) and replicas + p (exchange)
        self.n_replicas = 1
        dp = None
        if parallel != "tiles" and fuse:
            dp = plan_data_parallel(self.roots, work, groups, state_groups, batch_cells, target, parallel,
                                    self.max_task_bytes, self.link_bytes_per_second, self.bucket_bytes)
        if dp is None or parallel == "auto":  # the tiles plan: the only one, or the one to beat
            # in one worker process, the backward's weight-gradient products join its task (they
            # free the activations there); across processes the plain rank order decides where
            # work goes (the other order finished the simulated 2 x 8 block stack 55% later)
            state = state_writers(self.replicas, state_groups)  # one ref per root, as yet
            self.clusters, of, self.est_makespan = cluster_nodes(by_upward_rank(work, state if processes <= 1 else ()),
                                                                groups, target, fuse,
                                                                max_bytes=self.max_task_bytes,
                                                                bandwidth=self.link_bytes_per_second, state=state)
            # "auto": the data-parallel plan where the tiles plan would span several processes
            # (config.parallel says why); else whichever plan the simulation finishes first
            spans = len({(c.device, c.proc) for c in self.clusters}) > 1
            if dp is not None and dp[3] >= self.est_makespan and not spans:
                dp = None
        if dp is not None:
            self.replicas, self.clusters, of, self.est_makespan, nodes, self.n_replicas, self.strategy = dp
            work = [n for n in nodes if not n.is_leaf]
        #: roots that other worker processes read in the next call: a sharded plan's parameters
        self.shared_roots = {g[0] for g in state_groups} if self.strategy in ("sharded", "zero3") else set()
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
        #: values read by another worker process: (cluster id, (device, process) of the readers)
        #: -> the result tuple indices they read (``_cross_reads``)
        self.cross = self._cross_reads()
        #: those that go through shared memory (producer and reader on one host): their send task
        #: writes what is read there, and the receive task maps it
        self.shm = self._shm_edges(runtime)
        #: those that a send task picks out of their task's result (or writes to shared memory)
        self.sends = {edge for edge, read in self.cross.items()
                      if edge in self.shm or _pick_pays(self.plans[edge[0]].outputs, read)}
        self.structure = self._structure_token(nodes, of)
        #: a data-parallel plan run as one task per worker process (``config.exchange``), or None
        self.gang = None
        if fuse and runtime is not None and self.n_replicas > 1 and config.exchange != "tasks":
            self.gang = plan_gang(self, runtime, config.exchange)
        if self.strategy == "sharded" and self.gang is None and self.max_task_bytes != float("inf"):
            # under a memory bound, Dask tasks leave each parameter with its owner alone (the
            # other processes would hold every parameter between steps): that is "zero3"
            self.strategy = "zero3"
        self._program_futures = None  # (runtime, futures of self.plans' programs on its workers)
        # program keys of this executable's own: another of the same plan, dropped just before
        # this one scatters, would have Dask forget a shared key after it was sent again
        self._program_id = uuid.uuid4().hex[:8]
        #: kernels registered again (``_graph.kernels_redefined``) when the programs were made
        self._kernels = kernels_redefined()

    def _cpu_resource(self, runtime) -> bool | None:
        """Whether this plan's CPU tasks ask for the "CPU" resource on ``runtime`` (None: as
        ``runtime`` last saw its workers, when it is not the one planned for)."""
        return self.workers.cpu_resource if runtime is self.runtime and self.workers is not None else None

    def root_workers(self) -> list[str | None]:
        """The worker that computes each root (its first replica's), where the plan pins it;
        None for leaves and unpinned tasks. Initial values of state go there (its owner, in a
        sharded plan)."""
        out = []
        for refs in self.replicas:
            loc = None if refs[0].node.is_leaf else self.where.get((id(refs[0].node), refs[0].index))
            out.append(None if loc is None else self.worker_of.get(loc[0]))
        return out

    def process_of(self, c: Cluster) -> int:
        """The worker process (index among those of its device class) that runs cluster ``c``."""
        return c.proc % self.n_replicas if self.n_replicas > 1 else c.proc

    def _cross_reads(self) -> dict[tuple[int, tuple[str, int]], tuple[int, ...]]:
        """What each worker process reads of each task run by another.

        Dask moves a task's value whole, and fetches a task's inputs only once all of them are
        done. So :meth:`lower` writes, for each such (task, reading process):

        - a *send* task on the producer's worker, where the rest of the result is large
          (:func:`_pick_pays`): it picks out what that process reads, and only that moves (a
          forward task's activations, 254 MB, to read a 0.1 MB partial loss: GPT-2 6 x 768,
          data parallel);
        - a *receive* task on the reading process's worker, depending on that value alone: the
          value moves as soon as it is made, while the reader still computes (the last gradient
          bucket of a backward used to wait for the whole backward before moving at all).

        Readers read the receive task's value, which is already on their worker."""
        reads: dict[tuple[int, tuple[str, int]], set[int]] = {}
        for c, plan in zip(self.clusters, self.plans):
            dst = (c.device, self.process_of(c))
            for ref in plan.ext:
                if ref.node.is_leaf:
                    continue
                cid, k = self.where[(id(ref.node), ref.index)]
                src = self.clusters[cid]
                if (src.device, self.process_of(src)) != dst:
                    reads.setdefault((cid, dst), set()).add(k)
        return {edge: tuple(sorted(read)) for edge, read in reads.items()}

    def _process_workers(self) -> dict[tuple[str, int], str]:
        """The worker address of each (device class, process) that runs pinned tasks."""
        return {(c.device, self.process_of(c)): self.worker_of[c.id] for c in self.clusters if c.id in self.worker_of}

    def _shm_edges(self, runtime) -> set[tuple[int, tuple[str, int]]]:
        """The cross-process reads (:attr:`cross`) between CPU workers that share ``/dev/shm``
        (``config.shm_transfers``; both ends pinned, so both workers are known)."""
        if not config.shm_transfers or runtime is None or not self.cross:
            return set()
        at = self._process_workers()
        pairs = {(self.worker_of.get(cid), at.get(dst)) for cid, dst in self.cross}
        domains = runtime.shm_domains({a for pair in pairs for a in pair if a is not None})
        return {(cid, dst) for cid, dst in self.cross if self.clusters[cid].device == "cpu" and dst[0] == "cpu"
                and _share_memory(domains, self.worker_of.get(cid), at.get(dst))}

    def _transfer_workers(self, keys: Sequence[str]) -> dict[str, str]:
        """The worker of each send task (its producer's) and receive task (its readers')."""
        at = self._process_workers()
        out = {}
        for cid, dst in self.cross:
            if (cid, dst) in self.sends and cid in self.worker_of:
                out[send_key(keys[cid], dst)] = self.worker_of[cid]
            if dst in at:
                out[receive_key(keys[cid], dst)] = at[dst]
        return out

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
            ops.append(Call(current_kernel(n.kernel), n.params, tuple(ins), tuple(outs), n.out_meta, free, n.op,
                            n.scope))
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
        """A token of the graph and its plan: equal tokens mean equal programs for every task.
        A hash of the description's ``repr`` (ints, strings, dtype codes, nested tuples): Dask's
        ``tokenize`` of the same description took 3.4 ms for a 91-node decoding step of the
        default job's model (one plan per generated token), this 0.9 ms. Dtypes go in as their
        codes (``"<f4"``; a void-kind dtype, whose code would not tell two apart, as its ``repr``):
        NumPy's ``repr`` of a dtype is Python code, and took 1.4 of the 2.4 ms for a 275-node GPT-2
        124M decoding step."""
        import hashlib

        index = {id(n): k for k, n in enumerate(nodes)}
        desc = []
        for n in nodes:
            meta = tuple((shape, dtype.str if dtype.kind != "V" else repr(dtype)) for shape, dtype in n.out_meta)
            if n.is_leaf:
                desc.append(("leaf", meta))
            else:
                desc.append((n.kernel.name, repr(sorted(n.params.items())), n.device,
                             tuple((index[id(i.node)], i.index) for i in n.inputs), meta, of[id(n)].id))
        plan = [(p.prog.threads, p.prog.array_module, [index[id(n)] for n in c.nodes], p.prog.out_regs)
                for c, p in zip(self.clusters, self.plans)]
        return hashlib.blake2b(repr((desc, plan)).encode(), digest_size=16).hexdigest()

    # -- lowering ------------------------------------------------------------------------------
    def est_seconds(self) -> float:
        """The plan's estimated wall time if its tasks ran one after another (each task's kernels
        spread over the threads it runs on)."""
        return sum(c.seconds / p.prog.threads for c, p in zip(self.clusters, self.plans))

    @property
    def n_tasks(self) -> int:
        """The plan's clusters: one task each on Dask (a gang plan runs them as one per process)."""
        return len(self.clusters)

    @property
    def tasks_per_call(self) -> int:
        """The Dask tasks the last call ran: its clusters' (or a gang plan's, one per worker
        process) with the tasks that move values between processes, fetch results and keep what
        stays on the workers, and the values embedded in the graph (each a key Dask runs). Before
        a call, :attr:`n_tasks`."""
        return getattr(self, "_tasks_per_call", self.n_tasks)

    def _local_threads(self) -> int:
        """The most kernels that may run at once when this process runs the graph itself: a
        task's threads, or tasks side by side on Dask's threaded scheduler."""
        most = max((p.prog.threads for p in self.plans), default=1)
        if config.local_scheduler == "threads" and len(self.plans) > 1:
            most = max(most, min(len(self.plans), _config.usable_cores()))
        return most

    def task_deps(self) -> dict[int, set[int]]:
        """The clusters (by id) each cluster reads values of."""
        deps: dict[int, set[int]] = {c.id: set() for c in self.clusters}
        for c, plan in zip(self.clusters, self.plans):
            for ref in plan.ext:
                if not ref.node.is_leaf:
                    deps[c.id].add(self.where[(id(ref.node), ref.index)][0])
        return deps

    def parallel_summary(self) -> str:
        """How this plan spreads over worker processes, in words: its strategy, the processes,
        and how they exchange values (gang steps through shared memory or the workers' comms,
        or Dask tasks)."""
        procs = len({self.process_of(c) for c in self.clusters}) if self.n_replicas == 1 else self.n_replicas
        text = f"{self.strategy} over {procs} worker process{'es' if procs != 1 else ''}"
        if self.link_measured:
            text += f" (planned for a link of {self.link_bytes_per_second / 1e9:.2g} GB/s between hosts, measured)"
        if self.n_replicas == 1:
            return text
        if self.bucket_bytes < float("inf"):
            text += f", gradients sent in buckets of {self.bucket_bytes / 1e6:.3g} MB during the backward"
        if self.gang is None:
            return f"{text}, values as Dask tasks"
        shared = {s for p, spec in enumerate(self.gang.specs) for q, s in enumerate(spec.shared) if q != p}
        how = {frozenset({True}): "shared memory", frozenset({False}): "the workers' comms"}.get(
            frozenset(shared), "shared memory within a host, the workers' comms between hosts")
        return f"{text}, one gang task per process and step (values through {how})"

    def cross_bytes(self) -> int:
        """Bytes one call moves between worker processes: what each process reads of the tasks
        another one runs (:attr:`cross`), each value counted once per reading process."""
        return sum(self.plans[cid].outputs[k].nbytes for (cid, _), read in self.cross.items() for k in read)

    def step_bytes(self) -> int:
        """Bytes one call moves between worker processes in all: :meth:`cross_bytes`, and a
        sharded plan's new parameters, which each owner sends to every other process once its
        update made them; a "zero3" plan's tasks fetch them in the next call instead, for the
        forward pass and, with ``config.zero3_reshard_after_forward``, again for the backward."""
        pushed = sum(self.roots[pos].nbytes for pos in self.shared_roots) * max(self.n_replicas - 1, 0)
        if self.strategy == "zero3" and config.zero3_reshard_after_forward:
            pushed *= 2
        return self.cross_bytes() + pushed

    def critical_path(self) -> tuple[int, float]:
        """(tasks, estimated kernel seconds) along the longest chain of dependent tasks: each task
        on it pays Dask's per-hop latency, so this bounds how much fusion can still save."""
        deps = self.task_deps()
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

    def values_token(self) -> str:
        """A token of the plan, of its leaves' values (their cells' tokens) and of the kernels'
        definitions (a kernel defined again makes other tasks): what a call's task keys are
        named after by default."""
        from dask.base import tokenize

        return tokenize(self.structure, [n.cell.token for n in self.leaves], self._kernels)

    def lower(self, token: str | None = None, programs: Sequence | None = None):
        """Write the Dask graph for one call.

        Returns ``(layers, keys)``: ``layers`` maps a device class to its raw task dict (plus
        ``"data"`` for embedded leaf values and ``"dask"`` for merged dask-array graphs), ``keys``
        the task key of each cluster. ``programs`` replaces each cluster's program in its task
        (futures of programs already on the workers); default: the programs themselves.
        """
        if token is None:
            token = self.values_token()
        keys = [f"tg-{p.prog.label}-{c.id}-{token}" for c, p in zip(self.clusters, self.plans)]
        layers: dict[str, dict] = {"data": {}, "dask": {}, "cpu": {}, "gpu": {}, "transfer": {}}
        at: dict[tuple[int, tuple[str, int]], dict[int, int]] = {}  # -> {index in the task: in the received}
        for (cid, dst), read in self.cross.items():
            src = keys[cid]
            if (cid, dst) in self.sends:  # what is read, picked out there (and written to shared memory)
                shm = (cid, dst) in self.shm
                layers["transfer"][send_key(src, dst)] = (send_shm, src, read, config.shm_min_bytes) if shm \
                    else (_pick, src, read)
                src = send_key(src, dst)
                at[(cid, dst)] = {k: j for j, k in enumerate(read)}
            else:
                at[(cid, dst)] = {k: k for k in read}
            layers["transfer"][receive_key(keys[cid], dst)] = \
                (receive_shm if (cid, dst) in self.shm else _received, src)
        for c, plan, key in zip(self.clusters, self.plans, keys):
            args, idx = [], []
            dst = (c.device, self.process_of(c))
            for ref in plan.ext:
                node = ref.node
                if node.is_leaf:
                    a, i = self._bind_leaf(node.cell, layers, inline=True, proc=self.process_of(c),
                                            addr=self.worker_of.get(c.id))
                else:
                    cid, k = self.where[(id(node), ref.index)]
                    if (cid, dst) in at:
                        a, i = receive_key(keys[cid], dst), at[(cid, dst)][k]
                    else:
                        a, i = keys[cid], k
                args.append(a)
                idx.append(i)
            prog = plan.prog if programs is None else programs[c.id]
            layers[plan.device][key] = (run_cluster, Bound(tuple(idx)), prog, *args)
        return layers, keys

    def lower_gang(self, runtime, programs: Sequence | None = None):
        """Write the Dask graph of one call of a gang plan (:attr:`gang`): one task per worker
        process. Returns ``(layers, keys, locate)``: ``keys`` the task key of each process,
        ``locate(pos, p)`` where process p's value of root ``pos`` is, as (task key, index)."""
        g = self.gang
        # a name of the call's own for its channels and keys (not a token of its values): a gang
        # whose peers' tasks Dask kept from an earlier call of the same values would wait for
        # channels never written
        call = uuid.uuid4().hex[:16]
        # "tg-gang-fwd-bwd-update-p0-...": Dask's task stream and its groups read the words
        # before the process index (its key_split)
        keys = [f"tg-gang-{g.label}-p{p}-{call}" for p in g.procs]
        layers: dict[str, dict] = {"data": {}, "dask": {}, "cpu": {}, "gpu": {}, "transfer": {}, "gang": {}}
        ids = runtime.gang_identities(g.addrs)
        pids = tuple(ids[a][2] for a in g.addrs)
        for p in g.procs:
            args, idx = [], []
            for ref in g.leaves[p]:
                a, i = self._bind_leaf(ref.node.cell, layers, inline=True, proc=p, addr=g.addrs[p])
                args.append(a)
                idx.append(i)
            progs = [self.plans[cid].prog if programs is None else programs[cid] for cid in g.stages[p]]
            spec = g.specs[p].bound(pids, tuple(g.addrs), config.exchange_timeout_seconds)
            layers["gang"][keys[p]] = (run_gang, spec, call, Bound(tuple(idx)), progs, None, *args)

        def locate(pos: int, p: int) -> tuple[str, int]:
            holder, k = g.locate[(pos, p)]
            return keys[holder], k

        return layers, keys, locate

    def _programs(self, runtime) -> list:
        """Futures of the clusters' programs, scattered to the workers once per runtime: a
        program of a few thousand kernel calls takes ~50 ms to unpickle, every call otherwise.
        Their keys are this executable's own (the plan's token and an id): a key shared with
        another executable of the same plan, released as that one was dropped, could be freed on
        a worker after this one's scatter had sent it again (the scatter goes to the worker
        directly, the release through the scheduler), and the step's tasks then fail with
        "lost dependencies"."""
        cached = self._program_futures
        if cached is None or cached[0] is not runtime or any(f.status != "finished" for f in cached[1]):
            # each to the worker the plan pinned its task to (Dask moves it if another runs the
            # task); programs of unpinned tasks to every worker
            names = [f"tg-program-{c.id}-{self.structure}-{self._program_id}" for c in self.clusters]
            by_worker: dict[str | None, dict[str, Program]] = {}
            for c, p, name in zip(self.clusters, self.plans, names):
                by_worker.setdefault(self.worker_of.get(c.id), {})[name] = p.prog
            from tilegraph.runtime import no_worker_alive_error

            futures = {}
            # (a worker of the plan retiring meanwhile: the step's error names it, as gone, without
            # the scheduler's traceback of a scatter to a worker it no longer knows)
            pinned = sorted(a for a in by_worker if a is not None)
            if pinned:  # (none: each program goes to every worker there is)
                runtime._require_staying(pinned)
            for addr, progs in by_worker.items():
                where = {"broadcast": True} if addr is None else {"workers": [addr]}
                with no_worker_alive_error("tilegraph.Executable", "the step's programs",
                                           getattr(runtime, "address", None)):
                    futures.update(runtime.client.scatter(progs, **where))
            cached = self._program_futures = (runtime, [futures[name] for name in names])
        return cached[1]

    @staticmethod
    def _bind_leaf(cell: Cell, layers, inline: bool = False, proc: int | None = None, addr: str | None = None):
        """The task argument of a leaf's value: a future (of a replicated value, the copy of
        process ``proc``; of a value copied to several workers, the copy on worker ``addr``), a dask key, the array itself (small arrays, ``inline``: a task of its
        own would cost the scheduler more than the copy) or the key of a data task holding it."""
        v = cell.value
        if isinstance(v, ReplicatedRef):
            v = v.on(proc)
        elif isinstance(v, CopiesRef):
            v = v.at(addr)
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

    def run(self, runtime=None, fetch: Sequence[int] | None = None, wait: bool = True,
            during: str = "tilegraph.compute", lost: dict | None = None) -> list[Any]:
        """Run once and return the value of each root.

        Roots listed in ``fetch`` (default: all) come back as arrays; on a distributed runtime the
        others stay on the workers as :class:`ValueRef` (a future plus a tuple index), so only
        what the caller asked for crosses to the client. With ``wait=False`` the fetched roots
        come as :class:`Fetching` handles (:func:`gather` waits for them) and the call returns at once.
        ``lost``: the ``where`` and ``hint`` of the error for a worker lost meanwhile (:func:`gather`).
        """
        runtime = runtime if runtime is not None else self.runtime
        check_runtime("tilegraph.Executable.run", runtime)
        check_values_reachable(during, self.leaves, runtime)
        fetch = set(range(len(self.roots))) if fetch is None else set(fetch)
        call = self._lower_call(runtime)
        source, plain = self._root_sources(call)
        out: list[Any] = [plain.get(pos) for pos in range(len(self.roots))]
        if runtime is None:  # no futures exist without a runtime: every source is a task key
            return self._run_locally(call, source, out)
        return self._run_on_workers(runtime, call, source, out, fetch, wait, during, lost or {})

    def _follow_redefined_kernels(self) -> None:
        """Where a kernel was defined again since the programs were made (a notebook cell run
        again), its calls take the new definition, and the programs go to the workers again
        under new keys (they carry a kernel of ``__main__`` by value; a worker replaces its
        definition when another comes). A compiled graph then runs what the name names now, in
        this process and on the workers alike: the workers ran the old definition until another
        graph brought them the new one, and this process ran the old one for good."""
        count = kernels_redefined()
        if count == self._kernels:
            return
        self._kernels = count
        changed = False
        for plan in self.plans:
            ops = tuple(op._replace(kernel=current_kernel(op.kernel)) for op in plan.prog.ops)
            if any(a.kernel is not b.kernel for a, b in zip(ops, plan.prog.ops)):
                plan.prog.ops = ops
                changed = True
        if changed:
            self._program_futures = None
            self._program_id = uuid.uuid4().hex[:8]

    def _lower_call(self, runtime) -> _Call:
        """Write the Dask graph of one call on ``runtime`` (None: this process runs it): one task
        per worker process for a gang plan, else one per cluster; on a runtime, the tasks carry
        futures of the programs already on its workers."""
        self._follow_redefined_kernels()
        if runtime is not None and self.gang is not None:
            layers, keys, locate = self.lower_gang(runtime, programs=self._programs(runtime))
            return _Call(layers, keys, dict(zip(keys, self.gang.outputs)), locate)
        layers, keys = self.lower(programs=None if runtime is None else self._programs(runtime))

        def locate(pos: int, proc: int) -> tuple[str, int]:
            ref = self.replicas[pos][proc]
            cid, index = self.where[(id(ref.node), ref.index)]
            return keys[cid], index

        return _Call(layers, keys, {key: plan.outputs for key, plan in zip(keys, self.plans)}, locate)

    def _root_sources(self, call: _Call) -> tuple[_Sources, dict[int, Any]]:
        """Where each root's value is, per replica (data-parallel plans keep some roots on every
        process): ``(position, process) -> (task key or remote future, tuple index)``; and the
        roots that are plain values (leaves on the client), by position."""
        source: _Sources = {}
        plain: dict[int, Any] = {}
        for pos, refs in enumerate(self.replicas):
            for proc, ref in enumerate(refs):
                if not ref.node.is_leaf:
                    source[(pos, proc)] = call.locate(pos, proc)
                    continue
                value = ref.node.cell.value
                if isinstance(value, ValueRef):
                    value = value.on(proc) if isinstance(value, ReplicatedRef) else value
                    source[(pos, proc)] = (value.future, value.index)
                elif proc == 0:
                    if isinstance(value, DaskKey):  # a tile of tg.from_dask_array asked for as it is: its chunk
                        from dask.threaded import get as dask_get

                        value = dask_get(dict(value.graph), value.key)
                    plain[pos] = value
        return source, plain

    def _run_locally(self, call: _Call, source: _Sources, out: list) -> list:
        """Run the call in this process (Dask's local scheduler) and fill in ``out``: the first
        replica of each root from its task's result."""
        want = sorted({key for (_, proc), (key, _) in source.items() if proc == 0})
        results = dict(zip(want, _local_get(call.layers, want, self._local_threads())))
        for (pos, proc), (key, index) in source.items():
            if proc == 0:
                out[pos] = results[key] if index is None else results[key][index]
        return out

    def _run_on_workers(self, runtime, call: _Call, source: _Sources, out: list, fetch: set[int], wait: bool,
                        during: str, lost: dict) -> list:
        """Submit the call to ``runtime``'s workers and fill in ``out``: :class:`Fetching` handles
        (their values, with ``wait``) for the roots in ``fetch``, references to the workers'
        values for the others."""
        fetch_of = self._add_fetch_tasks(call, source, fetch)
        kept = [(pos, proc) for pos, proc in source if pos not in fetch or proc > 0]
        kept_of, moved = self._add_kept_picks(call, source, kept)
        want = sorted({moved.get((src, index), (src, index))[0] for src, indices in kept_of.items()
                       for index in indices})
        want += sorted({key for key, _ in fetch_of.values()})
        pinned, pushed = self._pin_tasks(runtime, call, source, moved)
        want += sorted({key for copies in pushed.values() for key, _ in copies.values()})
        futures = self._submit(runtime, call, want, pinned)
        # (the count alone: the call's tasks hold futures of the values they read, kept alive here)
        self._tasks_per_call = sum(len(tasks) for tasks in call.layers.values())
        gang = tuple(futures[key] for key in call.keys) if self.gang is not None else ()
        for pos, (key, index) in fetch_of.items():
            out[pos] = Fetching(futures[key], index, gang)
        if wait:
            out = gather(runtime, out, during, **lost)
        for pos, refs in self._kept_refs(futures, source, kept, moved, pushed).items():
            if pos not in fetch:
                out[pos] = refs[0] if len(refs) == 1 else ReplicatedRef(refs[0].future, refs[0].index, tuple(refs))
        return out

    def _add_fetch_tasks(self, call: _Call, source: _Sources, fetch: set[int]) -> dict[int, tuple[str, int | None]]:
        """Add the tasks that bring the roots in ``fetch`` (their first replica) to the client;
        returns, for each such root's position, (fetch task key, index in its value)."""
        # Fetched values come back through one small task per task holding some (it picks them
        # out of the result tuple next to the data); the rest stay.
        wanted: dict[Any, list[tuple[int, int | None]]] = {}  # source -> its fetched (position, index)
        for (pos, proc), (src, index) in source.items():
            if pos in fetch and proc == 0:
                wanted.setdefault(src, []).append((pos, index))
        # named after the call's first task, or, in a call without tasks (every root a leaf), after
        # the leaves' values as lower() names tasks: two such calls of one structure on other values
        # must not share a key (Dask would hand the second the first one's value while it is held)
        call_name = call.keys[0] if call.keys else self.values_token()
        fetch_of: dict[int, tuple[str, int | None]] = {}
        for n, (src, items) in enumerate(wanted.items()):
            if isinstance(src, str) and src in call.layers["cpu"] and src in call.outputs_of and \
                    sum(r.nbytes for r in call.outputs_of[src]) <= FETCH_WHOLE_MAX_BYTES:
                for pos, index in items:  # a small result comes back whole: no pick task to wait for
                    fetch_of[pos] = (src, index)
                continue
            indices = list(dict.fromkeys(index for _, index in items))
            whole = indices == [None]
            key = f"tg-fetch-{n}-{call_name}"
            call.layers["cpu"][key] = src if whole else (_pick, src, tuple(indices))
            for pos, index in items:
                fetch_of[pos] = (key, None if whole else indices.index(index))
        return fetch_of

    def _add_kept_picks(self, call: _Call, source: _Sources, kept: list[tuple[int, int]]) \
            -> tuple[dict[str, set[int]], dict[tuple[str, int], tuple[str, int]]]:
        """Add the tasks that pick the values staying on the workers (``kept`` roots, by position
        and process) out of their tasks' results. Returns the indices kept of each task's result,
        by task key, and where each picked value moved: (task key, index) -> (pick key, index)."""
        # Values that stay on the workers (parameters, optimizer state) must not keep the rest of
        # their task's result tuple (activations for later tasks) alive: where a task returns
        # more than what stays, one small task per task picks out just the kept elements.
        # In a sharded plan the parameters also go apart from their optimizer state: the other
        # replicas fetch them, and Dask moves (and spills) a task's value whole.
        kept_of: dict[str, set[int]] = {}
        shared_of: dict[str, set[int]] = {}
        for at in kept:
            src, index = source[at]
            if isinstance(src, str):
                kept_of.setdefault(src, set()).add(index)
                if at[0] in self.shared_roots and self.gang is None:  # a gang holds each process's own copy
                    shared_of.setdefault(src, set()).add(index)
        moved: dict[tuple[str, int], tuple[str, int]] = {}
        for src, indices in kept_of.items():
            # A pick is one more dependent hop before the next step can use the values: only
            # worth it when the rest of the result is more than a tenth of what stays (so the
            # workers never hold more than 110% of the kept state between steps).
            shared = shared_of.get(src, set())
            if shared and shared != indices or _pick_pays(call.outputs_of[src], indices):
                for kind, part in (("keep", indices - shared), ("params", shared)):
                    if part:
                        part = tuple(sorted(part))
                        pick = derived_key(kind, src)
                        call.layers["cpu"][pick] = (_pick, src, part)
                        moved.update({(src, index): (pick, j) for j, index in enumerate(part)})
        return kept_of, moved

    def _pin_tasks(self, runtime, call: _Call, source: _Sources, moved) \
            -> tuple[dict[str, str], dict[int, dict[int, tuple[str, int]]]]:
        """The worker each task is pinned to, by key; and a sharded plan's parameters pushed to
        every process (:meth:`_push_shared`, whose tasks it adds)."""
        if self.gang is not None:  # each process's copies of shared parameters come out of its own gang
            return {**self._gang_input_workers(call), **dict(zip(call.keys, self.gang.addrs))}, {}
        pinned = {call.keys[cid]: addr for cid, addr in self.worker_of.items()}
        pinned.update(self._transfer_workers(call.keys))
        pushed = self._push_shared(call.layers, call.keys, source, moved, pinned, runtime)
        return pinned, pushed

    def _gang_input_workers(self, call: _Call) -> dict:
        """The worker each task that makes a gang's input runs on (a leaf's value embedded in the
        graph, a dask array's tasks): that gang's worker (the first gang's, of an input several
        read). A gang holds a thread of its worker while it waits for the other gangs' values;
        an input of another gang that Dask had put on that worker, behind it, would never run:
        with one thread per worker, a step that waits forever."""
        from dask.core import get_dependencies

        inputs = {**call.layers["data"], **call.layers["dask"]}
        out: dict = {}
        for key, addr in zip(call.keys, self.gang.addrs):
            stack = [a for a in call.layers["gang"][key][AFTER_INDEX + 1:] if _is_key_of(a, inputs)]
            while stack:
                k = stack.pop()
                if k not in out:
                    out[k] = addr
                    if k in call.layers["dask"]:
                        stack.extend(d for d in get_dependencies(call.layers["dask"], k) if d in inputs)
        return out

    def _submit(self, runtime, call: _Call, want: list[str], pinned: dict[str, str]) -> dict:
        """Submit the call's graph; returns the futures of the tasks in ``want`` (and, for a gang
        plan, of every gang task), by key."""
        if self.gang is not None:
            want = want + [key for key in call.keys if key not in want]
            return self._submit_gang(runtime, call.layers, call.keys, want, pinned)
        return dict(zip(want, runtime.submit_layers(call.layers, want, workers=pinned,
                                                    cpu_resource=self._cpu_resource(runtime),
                                                    drop_fetched=self._phases(call.keys),
                                                    prefetch=self.prefetch)))

    @property
    def prefetch(self) -> bool:
        """Whether a "zero3" plan's workers fetch their next tasks' parameters ahead
        (``config.zero3_prefetch``): not under a memory bound, where what arrives early pushes
        values the worker needs sooner out to disk (4.1x capacity model, 2 x 1 GB: 6.4-6.8 GiB
        written to disk per worker over 3 steps with it against 5.3-5.8 without, and 64-73 s
        against 63-65)."""
        return config.zero3_prefetch and not self.memory_bound

    def _phases(self, keys: Sequence[str]) -> dict[str, str] | None:
        """The phase of each task of a "zero3" plan, by key (also a "sharded" plan under a
        memory bound, which runs as one: the capacity path): "update" where it updates the
        optimizer's state, else "backward" where it has kernels of the backward pass (or their
        recompute), else "forward" (or "forward-kept" without
        ``config.zero3_reshard_after_forward``). The scheduler's plugin drops a parameter
        fetched for the forward once the "forward" tasks there have read it (the backward
        fetches it again), never while an update there waits for it (its owner's copy). None
        for any other plan."""
        if self.strategy != "zero3":
            return None
        forward = "forward" if config.zero3_reshard_after_forward else "forward-kept"
        out = {}
        for key, c in zip(keys, self.clusters):
            phases = {n.scope.partition(":")[2] for n in c.nodes}
            out[key] = "update" if "update" in phases else forward if phases <= {"", "forward"} else "backward"
        return out

    @staticmethod
    def _kept_refs(futures: dict, source: _Sources, kept: list[tuple[int, int]], moved,
                   pushed: dict[int, dict[int, tuple[str, int]]]) -> dict[int, list[ValueRef]]:
        """Where the values that stay on the workers are, each root's per replica, by position."""
        stays: dict[int, list[ValueRef]] = {}
        for pos, proc in kept:
            src, index = source[(pos, proc)]
            if isinstance(src, str):
                src, index = moved.get((src, index), (src, index))
                src = futures[src]
            stays.setdefault(pos, []).append(ValueRef(src, index))
        for pos, copies in pushed.items():  # a sharded plan's parameters: a copy on every process
            stays[pos] = [ValueRef(futures[key], j) for _, (key, j) in sorted(copies.items())]
        return stays

    def _submit_gang(self, runtime, layers, keys, want, pinned) -> dict:
        """Submit a gang call, each of its tasks after the last gang task submitted to its worker
        (of any graph) until that one has finished: the gangs of different calls then start on
        every worker in the order they were submitted. Without that, two calls in flight at once
        (two models trained side by side) could each hold one worker while waiting for their task
        queued on the other. A finished gang is forgotten (its result is not kept alive).

        Nor does a gang wait for one of a call that failed on another process: the failed call's
        other gangs end at once (the failed one sent them its error), but one still ending when
        the next call comes (the step after a failed one, say) would pass its error on, and this
        gang would fail without running while its peers waited for its values until the exchange
        time limit (then every later step failed: its error read as a lost worker)."""
        with runtime.gang_lock:
            for p, key in enumerate(keys):
                prev, call = runtime.last_gang.get(self.gang.addrs[p], (None, ()))
                if prev is not None and any(f.status in ("error", "cancelled", "lost") for f in call):
                    prev = None
                task = layers["gang"][key]
                layers["gang"][key] = task[:AFTER_INDEX] + (prev,) + task[AFTER_INDEX + 1:]
            futures = dict(zip(want, runtime.submit_layers(layers, want, workers=pinned,
                                                           cpu_resource=self._cpu_resource(runtime))))
            call = tuple(futures[key] for key in keys)
            for p, key in enumerate(keys):
                runtime.last_gang[self.gang.addrs[p]] = (futures[key], call)
                futures[key].add_done_callback(partial(runtime.gang_done, self.gang.addrs[p]))
                futures[key].add_done_callback(partial(end_failed_call, runtime, call, addrs=tuple(self.gang.addrs)))
        return futures

    def _push_shared(self, layers, keys, source, moved, pinned, runtime) -> dict[int, dict[int, tuple[str, int]]]:
        """A sharded plan's parameters, sent to every other process as soon as their owner's
        update makes them (else the next step's first task on each process fetches them when it
        may start, and waits: Dask fetches a task's inputs only then). Adds the send and receive
        tasks to ``layers`` and ``pinned``; returns, for each parameter root, each process's copy
        as (task key, index in its value). Not in a "zero3" plan (also what a "sharded" one under a
        memory bound becomes): each process would then hold every parameter between steps."""
        if not self.shared_roots or self.n_replicas < 2 or self.strategy == "zero3" or runtime is None:
            return {}
        at = self._process_workers()
        by_task: dict[str, list[tuple[int, int]]] = {}  # task holding parameters -> (root, index)
        owner: dict[str, tuple[str, int]] = {}
        cid_of = {key: cid for cid, key in enumerate(keys)}
        for pos in sorted(self.shared_roots):
            src, k = source.get((pos, 0), (None, None))
            if src not in cid_of:  # a leaf (not updated by this plan)
                continue
            cid = cid_of[src]
            key, j = moved.get((src, k), (src, k))
            by_task.setdefault(key, []).append((pos, j))
            owner[key] = (self.clusters[cid].device, self.process_of(self.clusters[cid]))
        domains = runtime.shm_domains(set(at.values())) if config.shm_transfers else {}
        out: dict[int, dict[int, tuple[str, int]]] = {}
        for key, items in by_task.items():
            dev, proc = owner[key]
            src_addr = at.get((dev, proc))
            idx = tuple(sorted({j for _, j in items}))
            for pos, j in items:
                out.setdefault(pos, {})[proc] = (key, j)
            for p in range(self.n_replicas):
                dst_addr = at.get((dev, p))
                if p == proc or dst_addr is None or src_addr is None:
                    continue
                send, receive = derived_key("push", key, (dev, p)), derived_key("pushed", key, (dev, p))
                shm = dev == "cpu" and _share_memory(domains, src_addr, dst_addr)
                layers["transfer"][send] = (send_shm, key, idx, config.shm_min_bytes) if shm else (_pick, key, idx)
                layers["transfer"][receive] = (receive_shm if shm else _received, send)
                pinned.update({send: src_addr, receive: dst_addr})
                for pos, j in items:
                    out[pos][p] = (receive, idx.index(j))
        return {pos: copies for pos, copies in out.items() if len(copies) == self.n_replicas}


@dataclass(frozen=True)
class Fetching:
    """A root that :meth:`Executable.run` with ``wait=False`` is fetching: element ``index`` of
    ``future``'s value (``None``: all of it); :func:`gather` waits for it."""

    future: Any
    index: int | None
    #: a gang call's tasks, one per worker process (the value is good only if every one of them
    #: is: a process whose task failed after its last exchange leaves the others' values intact)
    call: tuple = ()


def _is_key_of(arg, tasks: dict) -> bool:
    """Whether a task argument is the key of one of ``tasks`` (a Dask key: a string or a tuple;
    not an array passed inline)."""
    try:
        return type(arg) in (str, tuple) and arg in tasks
    except TypeError:  # a tuple holding something unhashable: a value, not a key
        return False


def raising_copies(fn):
    """``fn``, raising a copy of an error it raises (:func:`own_copy`): for the waits that gather
    tasks' values, where the error may be a task's own, kept by its Dask future."""
    @wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            error = own_copy(e)
            if error is e:
                raise
            raise error from error.__cause__  # (the copy's own: "from" also hides e, its context)
    return wrapped


@raising_copies
def gather(runtime, values: Sequence, during: str | None = None, **lost) -> list:
    """``values`` with every :class:`Fetching` replaced by its value (one gather for all).

    A task's error is raised as a copy of it (:func:`own_copy`: the one its future keeps would
    keep the frames it passes through, and with them the futures, until the client closes).

    With ``during`` (what is running, for the error), the wait is watched: every
    ``WATCH_SECONDS`` without the values the workers are checked, and one that died, left or
    stopped answering (``tilegraph._health.STALL_SECONDS``) ends it with a WorkerLostError naming
    it, never a hang or Dask's traceback. ``lost``: the error's ``where`` (default
    "tilegraph.compute"), ``hint`` (what is gone, how to go on) and ``steps``, as
    :func:`tilegraph._health.lost_worker_error` takes them, and ``since`` (a wall time: workers
    removed from then on count as lost too)."""
    futures = list({id(v.future): v.future for v in values if isinstance(v, Fetching)}.values())
    if not futures:
        return list(values)
    calls = calls_of(values)
    try:
        if during is None:
            if calls:
                _wait_for_calls(runtime, futures, calls)
            got = dict(zip(map(id, futures), runtime.client.gather(futures)))
        else:
            got = dict(zip(map(id, futures), _watched_gather(runtime, futures, during, calls=calls, **lost)))
    except PeerFailedError as e:
        raise first_failure(e) from None
    except Exception:
        failed = call_failure(runtime, calls)
        if failed is None:
            raise
        raise failed from None
    return [(got[id(v.future)] if v.index is None else got[id(v.future)][v.index]) if isinstance(v, Fetching) else v
            for v in values]


def first_failure(error: BaseException) -> BaseException:
    """The error to raise for ``error``: for a gang's :class:`PeerFailedError`, the error of the
    process that failed first where it crossed (the kernel's own, e.g. a TileError for a token id
    out of range). Which process's error a gather met first is a race: a bad row in the second
    process's share of a batch raised PeerFailedError out of the first's, and ``except
    TileError`` missed it."""
    return getattr(error, "first", None) or error


def call_failure(runtime, calls: Sequence[tuple]) -> BaseException | None:
    """The error of the first of ``calls`` (gang calls: one task per worker process) one of
    whose tasks failed, else None; the call's tasks still running are cancelled (they wait for
    values the failed one will not send). The error is the failing process's own where one
    raised it (:func:`first_failure`), not a peer's wait for it."""
    from tilegraph.exec.gang import ChannelWaitError

    for call in calls:
        erred = [f for f in call if f.status == "error"]
        if not erred:
            continue
        end_failed_call(runtime, call)
        errors = [first_failure(f.exception()) for f in erred]
        own = [e for e in errors if not isinstance(e, (PeerFailedError, ChannelWaitError))]
        return (own or errors)[0]
    return None


def end_failed_call(runtime, call: tuple, future=None, addrs: Sequence[str] = ()) -> None:
    """Cancel the tasks of gang call ``call`` still running once one failed (``future``: the one
    whose end called this, as a done callback). A task that failed after its last exchange sent
    its peers all they needed; one that failed without running (its input had failed) sent
    nothing, and its peers would wait for it until the exchange time limit, holding their
    worker's thread.

    Once every task of a failed call has ended (the done callback of the last one), each of its
    workers ``addrs`` removes what the call left there (:func:`_end_call_on_worker`): the channel
    files no reader took stayed in ``/dev/shm/tilegraph-<pid>/`` until the worker closed (a
    step's gradients each time a step failed), and values sent over the comms to a gang that
    never ran, in that worker's memory."""
    if future is not None and future.status == "finished":
        return
    if not any(f.status in ("error", "cancelled", "lost") for f in call):
        return  # (a cancelled one's callback, in a call that otherwise ran: nothing failed)
    pending = [f for f in call if f.status == "pending"]
    if pending:
        try:
            runtime.client.cancel(pending)
        except Exception:  # (a closing client): the waits end by their time limit
            pass
        return  # (their callbacks come: the last one clears up)
    if future is None or not addrs:
        return
    name = str(call[0].key).rsplit("-", 1)[-1]
    with _ENDED_LOCK:
        if name in _ENDED:
            return
        _ENDED[name] = None
        while len(_ENDED) > 1024:
            _ENDED.popitem(last=False)
    try:  # (the workers still there: a worker gone took its files along, and a message to it
        # would be logged by the scheduler as a failed broadcast)
        from tilegraph.runtime import LEAVING

        there = runtime.workers()
        workers = [a for a in dict.fromkeys(addrs) if a in there and there[a].get("status") not in LEAVING]
        if workers:
            runtime.client.run(_end_call_on_worker, name, config.exchange_timeout_seconds, workers=workers,
                               wait=False, on_error="ignore")
    except Exception:  # (a closing client, the scheduler gone): a worker's files go when it closes
        pass


#: the gang calls whose workers were asked to clear up after them (:func:`end_failed_call`), the
#: last 1,024
_ENDED: "OrderedDict[str, None]" = OrderedDict()
_ENDED_LOCK = threading.Lock()
#: a task's states on a worker while its function still runs (a cancelled one runs to its end)
_RUNNING_STATES = ("executing", "long-running", "cancelled", "resumed")
#: how long a worker waits for a failed gang call's task there to end before clearing up after it
END_CALL_WAIT_SECONDS = 60.0


async def _end_call_on_worker(call: str, max_age: float, dask_worker=None) -> int:
    """Run on each worker of gang call ``call``, which failed: once no task of the call runs
    there (up to :data:`END_CALL_WAIT_SECONDS`), remove the channel files this process wrote for
    it that no reader took (``g-<call>-...``, and a write cut short), and drop what its channels
    over the comms left in this worker's mailbox (``max_age``: the exchange time limit, for
    :func:`tilegraph.exec.comm_channel.close`). Returns how many files it removed."""
    import asyncio
    import os

    from tilegraph.exec import comm_channel
    from tilegraph.exec.shm import _PREFIX, SHM_ROOT

    suffix = f"-{call}"
    deadline = time.monotonic() + END_CALL_WAIT_SECONDS
    while dask_worker is not None and time.monotonic() < deadline and any(
            isinstance(key, str) and key.endswith(suffix) and ts.state in _RUNNING_STATES
            for key, ts in list(dask_worker.state.tasks.items())):
        await asyncio.sleep(0.05)
    comm_channel.close(call, max_age)
    folder = os.path.join(SHM_ROOT, f"{_PREFIX}{os.getpid()}")
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:  # (no shared memory used)
        return 0
    for entry in names:
        if entry.startswith((f"g-{call}-", f".g-{call}-")):
            try:
                os.unlink(os.path.join(folder, entry))
                removed += 1
            except OSError:
                pass
    return removed


def _wait_for_calls(runtime, futures: list, calls: list[tuple]) -> None:
    """Wait for ``futures`` and every task of ``calls``; raise the error of a call that failed
    (:func:`call_failure`) even where the values asked for were computed."""
    from distributed import wait

    wait(with_calls(futures, calls))
    failed = call_failure(runtime, calls)
    if failed is not None:
        raise failed


def calls_of(values: Sequence) -> list[tuple]:
    """The gang calls (their tasks) of the :class:`Fetching` among ``values``, each once."""
    return list({id(v.call): v.call for v in values if isinstance(v, Fetching) and v.call}.values())


def with_calls(futures: list, calls: list[tuple]) -> list:
    """``futures`` and then the tasks of ``calls`` not among them."""
    out, seen = list(futures), {id(f) for f in futures}
    for f in (f for call in calls for f in call):
        if id(f) not in seen:
            seen.add(id(f))
            out.append(f)
    return out


#: how often a watched wait (compute(), a step without a time limit, an evaluation, a checkpoint)
#: looks at the workers while it has no result (a scheduler round trip of a few milliseconds)
WATCH_SECONDS = 2.0


class AllDone:
    """Whether every one of some Dask futures has finished (a result, an error or cancelled):
    :meth:`wait` returns False after its seconds, where Dask's waits with a time limit raise a
    TimeoutError. That error is a reference cycle (Dask's ``sync`` keeps it in a closure cell, and
    its traceback holds that frame and each frame it passed through, ours with the values of the
    step waited for), so each wait that timed out kept what its frames held until Python's cyclic
    collector ran: GPT-2 6x768 over 2 data-parallel workers held 2-5 states (937 MiB each) per
    worker after steps of over 2 s."""

    def __init__(self, futures: Sequence):
        self._event, self._lock = threading.Event(), threading.Lock()
        self._left = len(futures)
        if not futures:
            self._event.set()
        for f in futures:
            f.add_done_callback(self._one_done)

    def _one_done(self, _future) -> None:  # (also when its value was lost: a status other than "pending")
        with self._lock:
            self._left -= 1
            if self._left <= 0:
                self._event.set()

    def wait(self, seconds: float | None) -> bool:
        return self._event.wait(seconds)


def forget_frames(error: BaseException) -> None:
    """Let a caught error go of the frames it passed through and of the errors before it: a
    TimeoutError of a Dask wait with a time limit is kept in a reference cycle with them
    (:class:`AllDone`), and with them the values the waiting frames held."""
    error.__traceback__ = error.__context__ = error.__cause__ = None


def own_copy(error: BaseException) -> BaseException:
    """A copy of a task's ``error`` to raise and annotate, where the original is kept by its Dask
    future: raised itself, it took into that keeping the frames it passed through (a failed
    step's, with its values and futures; a frame holding the future keeps it, and so the error,
    until the client closes), and a note added to it was added again each time it was raised.
    The copy has the original's traceback (the worker's, and the frames up to here), cause,
    context and notes; the original lets go of its frames. An error that does not copy is
    returned as it is."""
    import copy

    try:
        twin = copy.copy(error)
    except Exception:  # (an error whose arguments do not rebuild it)
        return error
    if type(twin) is not type(error):
        return error
    twin.__traceback__, twin.__cause__, twin.__context__ = error.__traceback__, error.__cause__, error.__context__
    twin.__suppress_context__ = error.__suppress_context__
    if hasattr(error, "__notes__"):
        twin.__notes__ = list(error.__notes__)
    forget_frames(error)
    return twin


def _watched_gather(runtime, futures: list, during: str, where: str = "tilegraph.compute", steps: range | None = None,
                    since: float | None = None, calls: Sequence[tuple] = (), **hint) -> list:
    from tilegraph._health import _lost_errors, lost_worker_error, translate_worker_failure, worker_health

    t0 = time.perf_counter()
    waited = with_calls(futures, list(calls))
    done = AllDone(waited)
    try:
        while not done.wait(WATCH_SECONDS) or any(f.status == "lost" for f in waited):
            if done.wait(0):  # a value went with its worker: Dask computes it again, or the checks end the wait
                time.sleep(WATCH_SECONDS)
            failed = call_failure(runtime, calls)
            if failed is not None:
                raise failed
            health = worker_health(runtime)
            if health.failing:
                raise lost_worker_error(health, during, f"no result after {time.perf_counter() - t0:.1f} s",
                                        steps=steps, where=where, **hint)
        failed = call_failure(runtime, calls)
        if failed is not None:
            raise failed
        return runtime.client.gather(futures)
    except _lost_errors() as e:
        error = translate_worker_failure(runtime, e, during, steps=steps, since=since, where=where, **hint)
        if error is None:
            raise
        raise error from None


#: client-side leaf values up to this size travel inside the tasks that read them (batches, the
#: optimizer's scalars); larger ones as a data task of their own, sent once
INLINE_MAX_BYTES = 65536

#: a CPU task's result of at most this many bytes comes back whole where the client fetches some
#: of it, instead of through a task picking those out (one scheduler round trip less: a decoding
#: step of a small model on the embedded cluster)
FETCH_WHOLE_MAX_BYTES = 1 << 20

#: kept values are picked out of a task's result only when the rest of it holds more than this
#: (and more than a tenth of the kept values)
PICK_MIN_BYTES = 4096


def _pick_pays(outputs: Sequence, read) -> bool:
    """Whether picking the elements ``read`` out of a task's result ``outputs`` pays: the rest is
    more than :data:`PICK_MIN_BYTES` and a tenth of what is read."""
    size = sum(outputs[k].nbytes for k in read)
    rest = sum(r.nbytes for r in outputs) - size
    return rest > PICK_MIN_BYTES and rest > 0.1 * size


def _share_memory(domains: dict, a: str | None, b: str | None) -> bool:
    """Whether workers ``a`` and ``b`` see the same ``/dev/shm`` (``domains``: each worker's
    ``exec.shm.shm_domain``)."""
    return domains.get(a) is not None and domains.get(a) == domains.get(b)


def derived_key(kind: str, src: str, dst: tuple[str, int] | None = None) -> str:
    """The key of a small task working on task ``src``'s result (a pick, send or receive):
    ``src``'s own key (unique to its call) after ``tg-{kind}-`` and, for a task serving process
    ``dst`` (device class, process index), ``{device}{index}-``."""
    serves = "" if dst is None else f"{dst[0]}{dst[1]}-"
    return f"tg-{kind}-{serves}{src[3:]}"


def send_key(src: str, dst: tuple[str, int]) -> str:
    """The key of the task picking out of task ``src``'s result what process ``dst`` (device
    class, process index) reads (:meth:`Executable._cross_reads`)."""
    return derived_key("send", src, dst)


def receive_key(src: str, dst: tuple[str, int]) -> str:
    """The key of the task on process ``dst`` that takes in what it reads of task ``src``."""
    return derived_key("receive", src, dst)


def _received(values: tuple) -> tuple:
    """A receive task: its input, now on the reading worker."""
    return values


def _pick(values: tuple, idx: tuple) -> tuple:
    """The elements ``idx`` of a task's result tuple (so the rest can be released)."""
    return measured_exactly(tuple(values[i] for i in idx))


def _local_get(layers: dict, keys: list, threads: int = 1):
    """Run a lowered graph in this process. Where ``threads`` > 1 kernels run at once (a task's
    kernels on several threads, or tasks side by side), each BLAS call keeps to one thread; a
    graph of one kernel at a time leaves BLAS its threads (a few large tiles then still use the
    cores)."""
    import dask

    with one_blas_thread() if threads > 1 else contextlib.nullcontext():
        alone = _one_task(layers, keys)
        if alone is not None:
            return [alone()]
        dsk = {}
        for part in layers.values():
            dsk.update(part)
        if config.local_scheduler == "sync":
            return dask.get(dsk, keys)
        from dask.threaded import get

        return get(dsk, keys)


def _one_task(layers: dict, keys: list):
    """A call of the graph's only task, where it reads nothing but embedded values (one fused
    task: a decoding step, a small model's training step), to run in this thread: Dask's ordering
    and scheduler state for it took 8 of a GPT-2 124M decoding step's 60 ms. None otherwise."""
    tasks = [(k, t) for name, part in layers.items() if name != "data" for k, t in part.items()]
    if len(tasks) != 1 or [tasks[0][0]] != list(keys):
        return None
    data = layers.get("data", {})
    fn, *args = tasks[0][1]
    if not callable(fn):
        return None
    return lambda: fn(*[data[a] if isinstance(a, str) and a in data else a for a in args])


#: the keyword arguments of :class:`Executable` (and so of :func:`compile` and :func:`compute`)
EXECUTABLE_OPTIONS = tuple(n for n, p in inspect.signature(Executable.__init__).parameters.items()
                           if p.kind is p.KEYWORD_ONLY)


def compile(outputs: Sequence[TileTensor | TileRef], **kw) -> Executable:
    """Place, cluster and plan the graph behind ``outputs`` (TileTensors or tile refs); keyword
    arguments go to :class:`Executable` (:data:`EXECUTABLE_OPTIONS`)."""
    unknown = sorted(set(kw) - set(EXECUTABLE_OPTIONS))
    if unknown:
        raise TileError("tilegraph.compile", f"keyword arguments among {', '.join(EXECUTABLE_OPTIONS)}",
                        ", ".join(f"{k}={kw[k]!r:.40}" for k in unknown))
    if isinstance(outputs, (TileTensor, TileRef)):
        outputs = [outputs]
    if isinstance(outputs, (str, bytes)) or not hasattr(outputs, "__iter__"):
        raise TileError("tilegraph.compile", "outputs must be a list of TileTensors (or tile refs)",
                        f"{type(outputs).__name__} {outputs!r:.60}")
    roots: list[TileRef] = []
    for i, o in enumerate(outputs):
        if isinstance(o, TileTensor):
            roots.extend(o.grid.flat)
        elif isinstance(o, TileRef):
            roots.append(o)
        else:
            raise TileError("tilegraph.compile", "outputs must be a list of TileTensors (or tile refs)",
                            f"outputs[{i}]: {type(o).__name__} {o!r:.60}")
    return Executable(roots, **kw)


def _assemble(t: TileTensor, tiles: list) -> np.ndarray:
    if t.ndim == 0:
        return to_host(tiles[0]).reshape(())
    arr = np.empty(t.shape, dtype=t.dtype)
    for idx, v in zip(np.ndindex(*t.tiling.grid), tiles):
        arr[t.tiling.slices(idx)] = to_host(v)
    return arr


def compute(*tensors: TileTensor, **kw) -> list[np.ndarray]:
    """Run the graph behind ``tensors`` and return them as NumPy arrays.

    Uses the connected runtime (:func:`tilegraph.connect`) when there is one, else Dask's local
    threaded scheduler. Keyword arguments go to :class:`Executable` (``fuse``, ``placement``...).
    On a runtime, the arrays of the :class:`tilegraph.nn.Parameter` s the graph reads that are
    too large to travel inside a task are lent to its workers once, with gradients enabled or not
    (sent again once a parameter holds a new array); other arrays travel with each graph.
    """
    for i, t in enumerate(tensors):
        if not isinstance(t, TileTensor):
            raise TileError("tilegraph.compute", f"argument {i} must be a TileTensor", type(t).__name__)
    exe = compile(tensors, **kw)
    restore = []
    if exe.runtime is not None:  # the model's parameters held here are lent to the workers (sent once while
        from tilegraph._train import lend_cells, put_back  # unchanged); in the graph, they were sent with each call

        restore = lend_cells(exe.runtime, _parameters_held_here(exe))
    try:
        values = exe.run()
    finally:
        if restore:
            put_back(restore)
    out, k = [], 0
    for t in tensors:
        n = t.ntiles
        out.append(_assemble(t, values[k:k + n]))
        k += n
    return out


def _parameters_held_here(exe: Executable) -> list[Cell]:
    """The cells of the :class:`tilegraph.nn.Parameter` s that ``exe`` reads (those of
    :data:`tilegraph.nn.PARAMETER_CELLS`) whose arrays here are too large to travel inside a task.
    Each ``tg.compute(model(ids))`` sent them inside its graph (GPT-2 124M: 475 MB and Dask's
    "Sending large graph" warning at every call, with gradients enabled or under ``tg.no_grad()``);
    lent (:func:`tilegraph._train.lend_cells`), they are sent once while unchanged. Other arrays
    (a user's inputs) still travel with the graph: lent, a copy would stay on the workers as long
    as the array lives here. A parameter asked for itself (``model.weight.numpy()``) is not lent:
    its value is the array here, where lent it was sent to the workers and fetched back."""
    from tilegraph.nn import PARAMETER_CELLS  # (tilegraph.nn imports this module)

    asked = {id(r.node.cell) for r in exe.roots if r.node.is_leaf}
    cells: dict[int, Cell] = {}
    for n in exe.leaves:
        c = n.cell
        if (id(c) not in asked and c in PARAMETER_CELLS and isinstance(c.value, np.ndarray)
                and c.value.nbytes > INLINE_MAX_BYTES):
            cells[id(c)] = c
    return list(cells.values())


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
