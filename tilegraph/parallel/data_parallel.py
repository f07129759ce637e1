"""Data parallelism as a rewrite of the logical tile graph.

Each of ``P`` worker processes (replicas) runs the forward and backward passes of its share of the
batch's row tiles, and keeps its own copy of the parameters and optimizer state. Everything that
combines the replicas' shares (weight-gradient sums, the loss, clipping norms) and everything
that depends on no batch tile at all (the updates, the optimizer's scalars) is computed by every
replica that needs it, from the same inputs in the same order, so the copies stay bitwise equal:
this is PyTorch DDP's all-reduce-then-identical-update, written as graph nodes. The only values
that cross processes are the replicas' partial gradient sums (one per parameter tile and replica)
and small partial losses.

The pass never looks at data. It returns the rewritten roots and the replica (process) of every
node; the planner's list scheduler then clusters each replica's nodes into tasks on its process's
threads, cutting a task where another replica needs one of its values.

>>> import numpy as np, tilegraph as tg
>>> from tilegraph._graph import Cell, leaf
>>> cells = [Cell(np.ones((2, 3), np.float32), (2, 3), np.float32) for _ in range(4)]
>>> from tilegraph.ops.matmul import _matmul_tn
>>> from tilegraph.ops.reduce import _tree
>>> parts = [tg._graph.emit1(_matmul_tn, [leaf(c), leaf(c)], (3, 3), np.float32, op="g", n=1, batched=False)
...          for c in cells]
>>> grad = _tree(parts, (3, 3), np.float32, (), 1.0, "g")
>>> dp = split_replicas([grad], replicated=[0], groups={id(c): i // 2 for i, c in enumerate(cells)}, replicas=2)
>>> [dp.replica[id(r.node)] for r in dp.roots[0]]     # the summed gradient, on both replicas
[0, 1]
>>> sorted(dp.replica[id(i.node)] for i in dp.roots[0][1].node.inputs)   # from one partial sum each
[0, 1]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tilegraph._config import bucket_size
from tilegraph._errors import TileError
from tilegraph._graph import Node, TileRef, topo_order
from tilegraph.plan.cluster import STATE_TASK_BYTES, cluster_nodes, state_writers

__all__ = ["split_replicas", "Replicas", "batch_groups", "plan_data_parallel"]

#: kernels whose calls over several replicas' tiles are split into one partial per replica first
_SUM_KERNEL = "reduce_sum"
_SUMSQ_KERNEL = "sumsq"


@dataclass
class Replicas:
    """The rewritten graph: ``roots[k]`` holds root k's ref on each replica that computes it (all
    replicas for replicated roots, one otherwise); ``replica[id(node)]`` is each node's process."""

    roots: list[list[TileRef]]
    replica: dict[int, int]
    nodes: list[Node]
    #: ids of the nodes of the exchange phase: those reading another replica's values, and the
    #: clones that follow from them (gradient sums, clipping, updates); the rest is the compute
    #: phase (forward, backward, each replica's partial sums)
    exchange: set[int]


def _row_tiles(cells) -> int:
    """Row tiles of a batch array's cell grid (axis 0); 0 for a 0-d array (a scalar: no rows)."""
    return cells.shape[0] if cells.ndim else 0


def _several_row_tiles(batch_cells: Sequence) -> bool:
    """Whether some array of the batch has several row tiles: arrays of one row tile beside it
    (a loss scale, per-class weights given whole) are then read whole by every replica, as the
    parameters are, not shared out as rows."""
    return any(_row_tiles(c) > 1 for c in batch_cells)


def _splittable_rows(batch_cells: Sequence) -> int:
    """Row tiles of the batch to share among replicas: the fewest of any array of several row
    tiles (arrays of one row tile beside them, and 0-d ones, are read whole by every replica);
    1 where no array has several."""
    counts = [n for n in map(_row_tiles, batch_cells) if n > 1]
    return min(counts, default=1)


def batch_groups(batch_cells: Sequence, replicas: int) -> dict[int, int]:
    """Replica of each batch leaf cell: row tiles (axis 0 of each input's cell grid) split into
    ``replicas`` contiguous, near-equal groups. A 0-d array, and an array of one row tile beside
    arrays of several, is in no group: every replica reads it, as it reads a parameter."""
    groups: dict[int, int] = {}
    several = _several_row_tiles(batch_cells)
    for cells in batch_cells:
        rows = _row_tiles(cells)
        if rows == 0 or (rows == 1 and several):
            continue
        for idx in np.ndindex(*cells.shape):
            groups[id(cells[idx])] = (idx[0] if idx else 0) * replicas // rows
    return groups


def _copy(node: Node, inputs: tuple[TileRef, ...]) -> Node:
    """``node`` with other inputs (same kernel, params, metas, cost and device)."""
    new = Node.__new__(Node)
    new.kernel, new.params, new.inputs, new.out_meta = node.kernel, node.params, inputs, node.out_meta
    new.cost, new.cell, new.device, new.op, new.scope = node.cost, node.cell, node.device, node.op, node.scope
    return new


def _like(node: Node, kernel, inputs: tuple[TileRef, ...], params: dict, meta=None) -> Node:
    """A new call of ``kernel`` in ``node``'s place (its device and op name)."""
    new = Node(kernel, params, inputs, meta or node.out_meta, op=node.op)
    new.device, new.scope = node.device, node.scope
    return new


def split_replicas(roots: Sequence[TileRef], *, replicated: Sequence[int], groups: dict[int, int],
                   replicas: int, owners: dict[int, int] | None = None) -> Replicas:
    """Rewrite the graph behind ``roots`` for ``replicas`` data-parallel processes.

    ``groups`` maps ``id(cell)`` of each batch leaf to its replica; ``replicated`` lists the roots
    every replica needs after the step (parameters; with plain data parallelism also the optimizer
    state); the others are computed on one replica (the one holding their inputs, else replica 0).

    A node whose batch-dependent inputs all come from one replica's share runs once, there. Any
    other node (combining several replicas' shares, or depending on no share) is cloned into each
    replica that needs it. A ``reduce_sum`` over several replicas' tiles first sums each
    replica's tiles where they are, so only one partial per replica travels.

    ``owners`` shards the state (ZeRO-2 style): root ``k`` is computed by replica ``owners[k]``
    only, and so is every cloned node whose results reach no other owner's roots (a parameter
    tile's gradient sum, its update, and those of earlier steps in the same graph). Each replica
    then sends its partial gradient of a tile only to the tile's owner, keeps the optimizer state
    of its own tiles only, and reads the other parameters from their owners (a replicated root
    of ``owners`` is one value that every replica reads). A sum of squares over tiles of several
    owners (gradient clipping) is summed per owner first.
    """
    nodes = topo_order(list(roots))
    replicated = set(replicated)
    owners = owners or {}
    # share[id(node)]: the replica of a node of one replica's share; None: cloned where needed
    share: dict[int, int | None] = {}
    users: dict[int, list[Node]] = {id(n): [] for n in nodes}
    for n in nodes:
        if n.is_leaf:
            share[id(n)] = groups.get(id(n.cell))
            continue
        for i in n.inputs:
            users[id(i.node)].append(n)
        shares = {share[id(i.node)] for i in n.inputs} - {None}
        share[id(n)] = shares.pop() if len(shares) == 1 else None

    # pin[id(node)]: the owner that alone computes a cloned node: the one whose roots are all it
    # reaches along cloned nodes (None: no owner's, or several owners')
    pin: dict[int, int | None] = {}
    if owners:
        reach: dict[int, set[int]] = {}
        root_owner: dict[int, set[int]] = {}
        for k, o in owners.items():
            root_owner.setdefault(id(roots[k].node), set()).add(o)
        for n in reversed(nodes):
            if n.is_leaf or share[id(n)] is not None:
                continue
            r = set(root_owner.get(id(n), ()))
            for u in users[id(n)]:
                if share[id(u)] is None:
                    r |= reach[id(u)]
            reach[id(n)] = r
            pin[id(n)] = next(iter(r)) if len(r) == 1 else None

    # which replicas need a clone of each cloned node (reverse topological order)
    need: dict[int, set[int]] = {id(n): set() for n in nodes}
    for k, r in enumerate(roots):
        if share[id(r.node)] is None:
            need[id(r.node)] |= {owners[k]} if k in owners else set(range(replicas)) if k in replicated else {0}
    for n in reversed(nodes):
        if n.is_leaf:
            continue
        if share[id(n)] is not None:
            mine = {share[id(n)]}
        elif pin.get(id(n)) is not None:
            mine = {pin[id(n)]} if need[id(n)] else set()
        else:
            mine = need[id(n)]
        if not mine:
            continue  # a cloned node nobody needs
        for i in n.inputs:
            if share[id(i.node)] is None:
                need[id(i.node)] |= mine

    made: dict[tuple[int, int], Node] = {}   # (id(old node), replica) -> new node
    split: dict[int, Node] = {}              # id(old node) -> the call its clones copy (partials first)
    cloned: set[int] = set()
    replica: dict[int, int] = {}
    out_nodes: list[Node] = []

    def home(n: Node, p: int) -> int:
        """The replica whose copy of ``n`` replica ``p`` reads."""
        if share[id(n)] is not None:
            return share[id(n)]
        return pin[id(n)] if pin.get(id(n)) is not None else p

    def ref(r: TileRef, p: int) -> TileRef:
        """Root/input ``r`` as seen from replica ``p``."""
        return r if r.node.is_leaf else TileRef(made[(id(r.node), home(r.node, p))], r.index)

    def add(new: Node, p: int, clone: bool = False) -> Node:
        replica[id(new)] = p
        out_nodes.append(new)
        if clone:
            cloned.add(id(new))
        return new

    for n in nodes:
        if n.is_leaf:
            continue
        o = share[id(n)]
        if o is not None:
            where = [o]
        elif pin.get(id(n)) is not None:
            where = [pin[id(n)]] if need[id(n)] else []
        else:
            where = sorted(need[id(n)])
        for p in where:
            model, inputs = n, tuple(ref(i, p) for i in n.inputs)
            if o is None and n.kernel.name in (_SUM_KERNEL, _SUMSQ_KERNEL):
                if id(n) not in split:  # one set of partial sums for every clone
                    split[id(n)] = (_presum(n, inputs, share, add) if n.kernel.name == _SUM_KERNEL
                                    else _sumsq_by_replica(n, inputs, replica, add))
                model = split[id(n)]
                inputs = model.inputs
            made[(id(n), p)] = add(_copy(model, inputs), p, clone=o is None)

    out_roots = []
    for k, r in enumerate(roots):
        copies = replicas if k in replicated else 1
        if r.node.is_leaf:
            out_roots.append([r] * copies)
        elif share[id(r.node)] is not None or k in owners:
            out_roots.append([ref(r, owners.get(k, 0))] * copies)
        else:
            out_roots.append([ref(r, p) for p in range(copies)])
    reachable = {id(n) for n in topo_order([r for refs in out_roots for r in refs])}
    out_nodes = [n for n in out_nodes if id(n) in reachable]
    exchange: set[int] = set()
    for n in out_nodes:  # topological: a node's inputs come before it
        p = replica[id(n)]
        if id(n) in cloned and any(not i.node.is_leaf and (replica[id(i.node)] != p or id(i.node) in exchange)
                                   for i in n.inputs):
            exchange.add(id(n))
    return Replicas(out_roots, replica, out_nodes, exchange)


def _sumsq_by_replica(node: Node, inputs: tuple[TileRef, ...], replica, add) -> Node:
    """The call every clone of a sum of squares over tiles that different replicas hold (the
    gradients of a sharded state) makes: each replica sums the squares of its own tiles, and the
    clones add those partials, so no gradient tile travels for it."""
    from tilegraph.ops.reduce import _reduce_sum

    by_replica: dict[int, list[TileRef]] = {}
    for i in inputs:
        if i.node.is_leaf:
            return _copy(node, inputs)
        by_replica.setdefault(replica[id(i.node)], []).append(i)
    if len(by_replica) < 2:
        return _copy(node, inputs)
    partials = tuple(TileRef(add(_copy(node, tuple(tiles)), p, clone=True), 0) for p, tiles in sorted(by_replica.items()))
    (shape, _), = node.out_meta
    return _like(node, _reduce_sum, partials, {"axes": (), "shape": shape, "scale": 1.0})


def _presum(node: Node, inputs: tuple[TileRef, ...], share, add) -> Node:
    """The call every clone of a ``reduce_sum`` over tiles of several replicas' shares makes:
    each replica's tiles are first summed (over the call's ``axes`` too) where they were made,
    and the clone adds one partial per replica. When an input is not one
    replica's own tile, or when there is nothing to pre-sum: a plain copy."""
    from tilegraph.ops.reduce import _reduce_sum

    axes = node.params["axes"]
    by_replica: dict[int, list[TileRef]] = {}
    for orig, new in zip(node.inputs, inputs):
        o = share[id(orig.node)]
        if o is None:
            return _copy(node, inputs)
        by_replica.setdefault(o, []).append(new)
    if all(len(tiles) == 1 for tiles in by_replica.values()) and not axes:
        return _copy(node, inputs)
    kshape = tuple(1 if a in axes else d for a, d in enumerate(inputs[0].shape))
    partials = []
    for p, tiles in sorted(by_replica.items()):
        if len(tiles) == 1 and not axes:
            partials.append(tiles[0])
            continue
        part = _like(node, _reduce_sum, tuple(tiles), {"axes": axes, "shape": kshape, "scale": 1.0},
                     ((kshape, tiles[0].dtype),))
        partials.append(TileRef(add(part, p), 0))
    return _like(node, node.kernel, tuple(partials), {**node.params, "axes": ()})


def visit_order(dp: Replicas, bucket_bytes: float) -> list[Node]:
    """A topological order of ``dp.nodes`` for the list scheduler that overlaps the gradient
    exchange with the backward pass, as DDP's buckets do.

    Compute-phase nodes go in decreasing upward rank (longest estimated path to a sink), except that a node whose results only feed the exchange (a
    weight-gradient product, a replica's partial sum) takes the rank of its inputs' makers, so it
    runs as soon as they are done rather than at the end. Each time the ready exchange nodes would
    move ``bucket_bytes`` across processes (or no compute node is ready), all ready exchange nodes
    follow: visiting one closes the task holding its inputs, so each bucket's values leave their
    process while the next part of the backward runs.
    """
    import heapq

    from tilegraph.plan.cluster import after_inputs, only_feeding, upward_ranks, users_of

    users = users_of(dp.nodes)
    pending = {id(n): sum(id(i.node) in users for i in n.inputs) for n in dp.nodes}
    rank = upward_ranks(dp.nodes, users)
    feeds = only_feeding(dp.nodes, users, dp.exchange)  # compute nodes whose every use is in the exchange
    # Feeders right after their latest input, not their earliest: ranked as their highest input,
    # every node of a training step (all of it feeds the updates) took the rank of the first,
    # and the order became the graph's own, one replica's whole backward after the other's,
    # and the weight-gradient products after it (so one replica sent all its gradients at the
    # end, in one message).
    after_inputs(dp.nodes, rank, feeds)

    position = {id(n): k for k, n in enumerate(dp.nodes)}
    compute: list[tuple[float, int, Node]] = []
    exchange: list[tuple[int, Node]] = []
    waiting_bytes = 0.0

    def release(n: Node) -> None:
        nonlocal waiting_bytes
        if id(n) in dp.exchange:
            heapq.heappush(exchange, (position[id(n)], n))
            p = dp.replica[id(n)]
            waiting_bytes += sum(i.nbytes for i in n.inputs if not i.node.is_leaf and dp.replica[id(i.node)] != p)
        else:
            heapq.heappush(compute, (-rank[id(n)], position[id(n)], n))

    def visit(n: Node) -> None:
        order.append(n)
        for u in users[id(n)]:
            pending[id(u)] -= 1
            if not pending[id(u)]:
                release(u)

    order: list[Node] = []
    for n in dp.nodes:
        if not pending[id(n)]:
            release(n)
    while compute or exchange:
        if exchange and (not compute or waiting_bytes >= bucket_bytes):
            waiting_bytes = 0.0
            while exchange:  # the bucket, and the exchange nodes it makes ready (updates)
                visit(heapq.heappop(exchange)[1])
            continue
        visit(heapq.heappop(compute)[2])
    return order


#: the least memory bound of a "zero3" task (:func:`zero3_task_bytes`): that of the optimizer's
#: update tasks (``plan.cluster.STATE_TASK_BYTES``); a model whose share of parameters per process
#: is under it has its tasks shaped by time alone, as "sharded"'s
ZERO3_MIN_TASK_BYTES = STATE_TASK_BYTES


def zero3_task_bytes(roots: Sequence[TileRef], state_groups: Sequence[Sequence[int]],
                     groups: dict[str, list[int]]) -> float:
    """The memory bound of a "zero3" plan's tasks: a worker process's share of the parameters
    (their bytes over the processes). A task holds what it reads and makes until it ends: one
    task for a process's whole forward pass gathered every parameter there with every
    activation, one for its backward every gradient, and a step's peak was no lower than
    "sharded"'s. Measured on the block stack (6 x 768, 2 x 1 workers, ``bench_scale.py
    --strategies zero3 --exchange tasks``): the most memory Dask held on one worker fell from
    790 to 535-538 MiB with this bound alone (456-462 with the fetched copies dropped, README);
    bounds of a fifth to half of the parameters gave the same peak, the smallest a third more
    tasks and 15% fewer tokens/s. In one process (nothing to share): no bound. Never under
    :data:`ZERO3_MIN_TASK_BYTES`: the debug GPT-2's share (58 KiB) cut a step into 257 tasks
    instead of 11, each a Dask round trip, and it ran 10-20 times slower than "sharded", where
    the memory it saved was a few kilobytes."""
    params = sum(roots[g[0]].nbytes for g in state_groups)
    procs = max([len(t) for t in groups.values()] + [1])
    if not params or procs < 2:  # one process: no sharing
        return float("inf")
    return max(params / procs, ZERO3_MIN_TASK_BYTES, 1.0)


def _batch_rows(batch_cells) -> int:
    """The batch's rows: the fewest of any array's first dim (1 where every array is 0-d)."""
    counts = [sum(c.shape[0] for c in cells[(slice(None),) + (0,) * (cells.ndim - 1)])
              for cells in batch_cells if cells.ndim]  # each array's rows: its first column of tiles
    return min(counts, default=1)


def _row_tiles_hint(batch_cells, procs: int) -> str:
    """What would give each of ``procs`` processes a row tile of this batch."""
    rows = _batch_rows(batch_cells)
    if rows < 2:
        return f"this batch has {rows} row"
    most = -(-rows // procs)
    return (f"batch_tiles whose row tiles have at most {most} row{'s' if most > 1 else ''}, the first size of each "
            "array's tiling; or no batch_tiles: a row tile per process")


def plan_data_parallel(roots: Sequence[TileRef], work: Sequence[Node], groups: dict[str, list[int]],
                       state_groups: Sequence[Sequence[int]], batch_cells: Sequence, target: float, parallel: str,
                       max_task_bytes: float, bandwidth: float | None = None, bucket_bytes: float | None = None):
    """The data-parallel plan of the graph of ``roots`` (its kernels ``work``, over the worker
    processes' threads ``groups``; tasks of about ``target`` seconds, each under
    ``max_task_bytes``; values between processes at ``bandwidth``; gradients sent in buckets of
    ``bucket_bytes``, default ``config.bucket_bytes`` as on one host): ``(refs of each root,
    clusters, cluster of each node, simulated seconds, nodes, replicas, strategy)``; None where
    it does not apply: no batch to split, one process, or kernels placed on both device classes.

    ``state_groups`` lists the roots updated together (a parameter tile, then its optimizer
    state). "data": every replica keeps all of them. "sharded" (and "auto") and "zero3": each
    group has one owner replica (balanced by bytes) that alone sums its gradient, updates it and
    keeps its state; the other replicas read the new parameter from it (the lowering sends it
    to them at once, or with "zero3" lets each task fetch it; ``config.parallel`` says why
    "auto" takes "sharded")."""
    devices = {n.device for n in work}
    if not batch_cells or len(devices) != 1:
        return None
    dev = devices.pop()
    rows = _splittable_rows(batch_cells)
    procs = min(len(groups[dev]), rows)
    if procs < 2:
        if parallel != "auto" and len(groups[dev]) == 1:  # asked for by name: say why it does nothing
            from tilegraph._train import _outside_tilegraph

            # (from the user's line, so once per line: a Trainer plans again after workers left)
            warnings.warn(f"parallel={parallel!r} shares the batch among worker processes, and the step runs in "
                          "one (a runtime of one worker, a cluster down to one, or none: this process), so it runs "
                          "as parallel='tiles' (more processes: tg.connect(n_workers=2), [runtime] workers)",
                          UserWarning, stacklevel=_outside_tilegraph())
        if parallel != "auto" and len(groups[dev]) > 1 and _batch_rows(batch_cells) < 2:
            # one row (the last batch of an epoch, a micro-batch of an uneven accumulation): nothing
            # to share, and refusing it stopped a run at the end of its first epoch
            from tilegraph._train import _outside_tilegraph

            warnings.warn(f"parallel={parallel!r} shares a batch's rows among the {len(groups[dev])} worker "
                          "processes, and this batch has 1 row: its step runs as parallel='tiles' (the same "
                          "update; batches of 2 rows or more are shared)", UserWarning,
                          stacklevel=_outside_tilegraph())
            return None
        if parallel != "auto" and len(groups[dev]) > 1:  # asked for, and there are processes to share
            raise TileError("tilegraph.Executable", f"parallel={parallel!r} gives each of the "
                            f"{len(groups[dev])} worker processes a share of the batch's row tiles, so the "
                            f"batch needs at least 2 row tiles ({_row_tiles_hint(batch_cells, len(groups[dev]))}); "
                            "or use parallel='auto' or 'tiles'", f"a batch of {rows} row tile")
        return None
    sharded = parallel in ("sharded", "zero3", "auto")
    if sharded:
        load, owners = [0] * procs, {}
        for g in state_groups:
            o = min(range(procs), key=lambda p: (load[p], p))
            load[o] += roots[g[0]].nbytes
            owners.update((k, o) for k in g)
        replicated = [g[0] for g in state_groups]
    else:
        owners, replicated = {}, [k for g in state_groups for k in g]
    dp = split_replicas(roots, replicated=replicated, groups=batch_groups(batch_cells, procs),
                        replicas=procs, owners=owners)
    # each replica's exchange phase (gradient sums, updates) on a lane of its own, so that
    # its tasks wait for other replicas' values without holding back the backward pass
    lane = {i: p + (procs if i in dp.exchange else 0) for i, p in dp.replica.items()}
    threads = groups[dev][:procs]
    order = visit_order(dp, bucket_size(False) if bucket_bytes is None else bucket_bytes)
    clusters, of, seconds = cluster_nodes(order, {**groups, dev: threads + threads}, target, True,
                                          fixed=lane, home=procs, max_bytes=max_task_bytes, bandwidth=bandwidth,
                                          state=state_writers(dp.roots, state_groups))
    nodes = topo_order([r for refs in dp.roots for r in refs])
    return dp.roots, clusters, of, seconds, nodes, procs, parallel if parallel in ("data", "zero3") else "sharded"
