"""Gang steps: a data-parallel plan lowered to one Dask task per worker process per call.

The plan (its clusters, their processes, what crosses between processes) is the one
:class:`tilegraph._lower.Executable` made; this pass only changes how it runs. Each process's
clusters become the *stages* of one task, in one order shared by every process (a topological
order of the cluster graph, by the simulation's start times), so a stage that waits for another
process's values never waits for one that comes later in that process's own order: no gang can
deadlock. Values read by another process go through channels (:mod:`tilegraph.exec.gang`) the
moment their stage ends: shared-memory files between processes of one host (one ``/dev/shm``
and process-id namespace, room there for what the call moves), messages over the workers' own
comms between the others (:mod:`tilegraph.exec.comm_channel`: several hosts, or
``tilegraph.config.shm_transfers`` off). A sharded plan's updated parameters go to every other
process the same way, and each process's gang returns its own copy, so the next call's tasks
read only values already on their worker.

Used by ``tilegraph.config.exchange`` ("auto": wherever it applies; "gang": required; "tasks":
never): a plan of CPU tasks, every task pinned to a worker, each process on a worker of its own,
and each process's share of the step small enough for its worker (:func:`peak_bytes`; a model
larger than its workers runs as small tasks, so that Dask can spill between them).
"""

from __future__ import annotations

import heapq

from tilegraph._config import ZERO3_TASKS_WHY, config
from tilegraph._errors import TileError
from tilegraph.exec.gang import GangSpec, Stage
from tilegraph.exec.shm import SHM_MARGIN_BYTES
from tilegraph.plan.cluster import gang_label

__all__ = ["GangPlan", "plan_gang", "peak_bytes"]


class GangPlan:
    """Per worker process ``p`` (index among the plan's processes): its worker ``addrs[p]``, its
    ``specs[p]`` (without pids), the leaf refs bound to its task's arguments ``leaves[p]``, the
    cluster ids of its stages ``stages[p]``; ``locate[(pos, p)]``: where process p's value of root
    ``pos`` is, as (process whose gang holds it, index in that gang's result); ``outputs[p]``:
    the TileRefs of its gang's result (their sizes)."""

    def __init__(self, addrs, specs, leaves, stages, locate, outputs, label: str):
        self.addrs, self.specs, self.leaves, self.stages = addrs, specs, leaves, stages
        self.locate, self.outputs, self.label = locate, outputs, label

    @property
    def procs(self) -> range:
        return range(len(self.addrs))


def _order(exe) -> list[int]:
    """The clusters in a topological order of their graph, earliest simulated start first."""
    deps = exe.task_deps()
    users: dict[int, list[int]] = {cid: [] for cid in deps}
    for cid, ds in deps.items():
        for d in ds:
            users[d].append(cid)
    start = {c.id: c.start for c in exe.clusters}
    left = {cid: len(ds) for cid, ds in deps.items()}
    ready = [(start[cid], cid) for cid, n in left.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, cid = heapq.heappop(ready)
        order.append(cid)
        for u in users[cid]:
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(ready, (start[u], u))
    assert len(order) == len(deps), "the cluster graph has a cycle"
    return order


#: a gang runs where each process's share of a step (:func:`peak_bytes`) takes at most this share
#: of its worker's memory limit (Dask spills at 60% and pauses a worker at 80%)
GANG_MEMORY_SHARE = 0.5


def peak_bytes(exe, cids: list[int]) -> int:
    """About the most memory a gang running clusters ``cids`` (in that order) holds at once: the
    leaf values it reads (parameters, optimizer state, batch tiles), each element of an earlier
    stage's result and each other process's values until their last use (what the gang returns
    to its end), and everything the running stage writes."""
    where = exe.where
    leaves: dict[tuple[int, int], int] = {}
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    size: dict[tuple, int] = {}
    own = set(cids)
    seen: set[tuple[int, int]] = set()  # values read from other processes, each counted once
    for s, cid in enumerate(cids):
        for k, r in enumerate(exe.plans[cid].outputs):  # readers come later (a topological order)
            first[("r", cid, k)] = last[("r", cid, k)] = s
            size[("r", cid, k)] = r.nbytes
        for ref in exe.plans[cid].ext:
            if ref.node.is_leaf:
                leaves[(id(ref.node), ref.index)] = ref.nbytes
                continue
            d, k = where[(id(ref.node), ref.index)]
            if d in own:
                key = ("r", d, k)
            else:  # another process's values: their channel, held whole until its last reader
                key = ("c", d)
                if (id(ref.node), ref.index) not in seen:
                    seen.add((id(ref.node), ref.index))
                    first.setdefault(key, s)
                    size[key] = size.get(key, 0) + ref.nbytes
            last[key] = s
    end = len(cids)
    for refs in exe.replicas:  # what the gang returns stays to its end
        for r in refs:
            if not r.node.is_leaf:
                key = ("r", *where[(id(r.node), r.index)])
                if key in last:
                    last[key] = end
    base = sum(leaves.values())
    peak = 0
    for s, cid in enumerate(cids):
        held = sum(n for key, n in size.items() if first[key] <= s <= last[key] and key[:2] != ("r", cid))
        peak = max(peak, base + held + exe.clusters[cid].made)
    return peak


def _links(exe, runtime, addrs: list[str]) -> tuple[list[list[bool]] | None, str | None]:
    """Which pairs of the plan's processes exchange through shared memory (one host, one
    ``/dev/shm`` and process-id namespace, room there for what the step moves, and
    ``tilegraph.config.shm_transfers``); the others go over the workers' comms. Returns
    (``shared[p][q]``, None), or (None, why no gang can run)."""
    ids = runtime.gang_identities(addrs)
    if any(i is None for i in ids.values()):
        return None, "a worker did not answer"
    n = len(addrs)
    same = [[p == q or (ids[addrs[p]][0] is not None and ids[addrs[p]][:2] == ids[addrs[q]][:2])
             for q in range(n)] for p in range(n)]
    comms_only = [[p == q for q in range(n)] for p in range(n)]  # every other process over the comms
    no_handler = "the workers have no tilegraph channel handler (the scheduler refused its plugin)"
    if not all(all(row) for row in same) and not runtime.comm_channels:
        return None, f"its workers do not share one /dev/shm and process-id namespace (several hosts), and {no_handler}"
    if not config.shm_transfers:
        if not runtime.comm_channels:
            return None, f"tilegraph.config.shm_transfers is off, and {no_handler}"
        return comms_only, None
    moved = exe.step_bytes()
    if any(same[p][q] for p in range(n) for q in range(n) if p != q):
        free = min(ids[a][3] for a in addrs)
        if free < moved + SHM_MARGIN_BYTES:  # (an over-estimate where some pairs use comms anyway)
            if not runtime.comm_channels:
                return None, f"/dev/shm has {free / 2**20:,.0f} MiB free, the step moves {moved / 2**20:,.0f} MiB"
            return comms_only, None
    return same, None


def _why_not(exe) -> str | None:
    """Why the plan cannot run as gangs, whatever its workers (None: it can)."""
    if exe.n_replicas < 2:
        return "the plan runs on one worker process"
    if exe.strategy == "zero3":
        return f"its parameters stay with their owners (parallel='zero3'): {ZERO3_TASKS_WHY}"
    if any(c.device != "cpu" for c in exe.clusters):
        return "the plan has GPU tasks"
    if any(c.id not in exe.worker_of for c in exe.clusters):
        return "some tasks are not pinned to a worker"
    addrs = exe._process_workers()
    if len(set(addrs.values())) != len(addrs):
        return "two of its processes share a worker"
    return None


def plan_gang(exe, runtime, mode: str) -> GangPlan | None:
    """The gang plan of the data-parallel Executable ``exe``; None where it does not apply and
    ``mode`` is "auto"; a TileError saying why with ``mode="gang"``."""
    why = _why_not(exe)
    if why is None:
        n = exe.n_replicas
        at = exe._process_workers()
        addrs = [at[("cpu", p)] for p in range(n)]
        shared, why = _links(exe, runtime, addrs)
    if why is not None:
        if mode == "gang":
            raise TileError("tilegraph.config.exchange", "'gang' needs a data-parallel plan of CPU tasks, each "
                            "process on a worker of its own; use 'auto' or 'tasks'", why)
        return None
    proc = {c.id: exe.process_of(c) for c in exe.clusters}
    order = _order(exe)
    stage_of: dict[int, int] = {}
    stages: list[list[int]] = [[] for _ in range(n)]
    for cid in order:
        stage_of[cid] = len(stages[proc[cid]])
        stages[proc[cid]].append(cid)
    if exe.max_task_bytes != float("inf"):  # values large against the workers: does a gang fit?
        limit = exe.memory_limit
        peak = max(peak_bytes(exe, cids) for cids in stages)
        if peak > GANG_MEMORY_SHARE * limit:
            why = (f"a process's share of the step holds about {peak / 2**20:,.0f} MiB at once, over "
                   f"{GANG_MEMORY_SHARE:.0%} of a worker's memory limit ({limit / 2**20:,.0f} MiB): it runs as small "
                   "tasks that Dask can spill between")
            if mode == "gang":
                raise TileError("tilegraph.config.exchange", "'gang' needs each process's share of a step to fit "
                                "its worker's memory; use 'auto' or 'tasks'", why)
            return None

    # Channels: what each process reads of each cluster of another (exe.cross), and, in a
    # sharded plan, each updated parameter for every process but its owner.
    sends: dict[int, list[tuple[str, tuple, int]]] = {}  # cluster id -> (channel, elements, reader)
    reads: list[list[tuple[str, int]]] = [[] for _ in range(n)]
    channel_of: dict[tuple[int, int], tuple[int, tuple]] = {}  # (cluster id, reader) -> (its index, elements)
    for (cid, (_, q)), read in sorted(exe.cross.items()):
        name = f"{cid}-{q}"
        sends.setdefault(cid, []).append((name, read, q))
        channel_of[(cid, q)] = (len(reads[q]), read)
        reads[q].append((name, proc[cid]))
    # each root's value on each process: (process holding it, (source)); sources as in Stage
    value_of: dict[tuple[int, int], tuple[int, tuple]] = {}
    pushed: dict[tuple[int, int], list[int]] = {}  # (cluster id, reader) -> elements pushed
    for pos, refs in enumerate(exe.replicas):
        for p, r in enumerate(refs):
            if r.node.is_leaf:
                continue
            cid, k = exe.where[(id(r.node), r.index)]
            if pos in exe.shared_roots and proc[cid] != p:
                elems = pushed.setdefault((cid, p), [])
                if k not in elems:
                    elems.append(k)
                value_of[(pos, p)] = (p, ("push", cid, k))
            else:
                value_of[(pos, p)] = (proc[cid], ("r", stage_of[cid], k))
    for (cid, q), elems in sorted(pushed.items()):
        name = f"p{cid}-{q}"
        sends.setdefault(cid, []).append((name, tuple(elems), q))
        channel_of[(cid, q, "push")] = (len(reads[q]), tuple(elems))
        reads[q].append((name, proc[cid]))

    outputs: list[list[tuple]] = [[] for _ in range(n)]
    out_refs: list[list] = [[] for _ in range(n)]
    locate: dict[tuple[int, int], tuple[int, int]] = {}
    index: list[dict[tuple, int]] = [{} for _ in range(n)]
    for (pos, p), (holder, src) in value_of.items():
        if src[0] == "push":
            _, cid, k = src
            ch, elems = channel_of[(cid, p, "push")]
            src = ("c", ch, elems.index(k))
        if src not in index[holder]:
            index[holder][src] = len(outputs[holder])
            outputs[holder].append(src)
            out_refs[holder].append(exe.replicas[pos][p])
        locate[(pos, p)] = (holder, index[holder][src])

    specs, leaves = [], []
    for p in range(n):
        leaf_index: dict[int, int] = {}
        leaf_refs = []
        built = []
        last: dict[tuple, int] = {}
        for s, cid in enumerate(stages[p]):
            plan = exe.plans[cid]
            ins = []
            for ref in plan.ext:
                if ref.node.is_leaf:
                    if id(ref.node) not in leaf_index:
                        leaf_index[id(ref.node)] = len(leaf_refs)
                        leaf_refs.append(ref)
                    ins.append(("x", leaf_index[id(ref.node)]))
                    continue
                d, k = exe.where[(id(ref.node), ref.index)]
                if proc[d] == p:
                    ins.append(("r", stage_of[d], k))
                    last[("e", (stage_of[d], k))] = s
                else:
                    ch, elems = channel_of[(d, p)]
                    ins.append(("c", ch, elems.index(k)))
                    last[("c", ch)] = s
            built.append((s, cid, tuple(ins)))
        # each element of a stage's result goes after its last reader (the rest of the tuple,
        # activations another stage read earlier, does not wait for it); a stage no later stage
        # reads is dropped at once
        read = {which[0] for kind, which in last if kind == "e"}
        for s, cid, _ in built:
            if s not in read:
                last[("r", s)] = s
            else:  # (what it sends or returns is taken before its drops)
                for k in range(len(exe.plans[cid].outputs)):
                    last.setdefault(("e", (s, k)), s)
        drops: dict[int, list[tuple]] = {}
        for what, s in last.items():
            drops.setdefault(s, []).append(what)
        spec_stages = tuple(Stage(s, ins, tuple(sends.get(cid, ())), tuple(sorted(drops.get(s, ()))))
                            for s, cid, ins in built)
        specs.append(GangSpec(spec_stages, tuple(reads[p]), tuple(outputs[p]), tuple(shared[p])))
        leaves.append(leaf_refs)
    label = gang_label([n for cid in order for n in exe.clusters[cid].nodes])
    return GangPlan(addrs, specs, leaves, stages, locate, out_refs, label)

