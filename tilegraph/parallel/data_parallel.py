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
>>> w = leaf(Cell(np.ones((3, 3), np.float32), (3, 3), np.float32))
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

from dataclasses import dataclass
from typing import Sequence

from tilegraph._graph import Node, TileRef, topo_order

__all__ = ["split_replicas", "Replicas", "batch_groups"]

#: the kernel whose multi-replica calls are split into one partial sum per replica first
_SUM_KERNEL = "reduce_sum"


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


def batch_groups(batch_cells: Sequence, replicas: int) -> dict[int, int]:
    """Replica of each batch leaf cell: row tiles (axis 0 of each input's cell grid) split into
    ``replicas`` contiguous, near-equal groups."""
    groups: dict[int, int] = {}
    for cells in batch_cells:
        rows = cells.shape[0] if cells.ndim else 1
        for idx, cell in _indexed(cells):
            r = idx[0] if idx else 0
            groups[id(cell)] = r * replicas // rows
    return groups


def _indexed(cells):
    import numpy as np

    for idx in np.ndindex(*cells.shape):
        yield idx, cells[idx]


def _copy(node: Node, inputs: tuple[TileRef, ...], params: dict) -> Node:
    """``node`` with other inputs and params (same kernel, metas, cost and device)."""
    new = Node.__new__(Node)
    new.kernel, new.params, new.inputs, new.out_meta = node.kernel, params, inputs, node.out_meta
    new.cost, new.cell, new.device, new.op = node.cost, node.cell, node.device, node.op
    return new


def split_replicas(roots: Sequence[TileRef], *, replicated: Sequence[int], groups: dict[int, int],
                   replicas: int) -> Replicas:
    """Rewrite the graph behind ``roots`` for ``replicas`` data-parallel processes.

    ``groups`` maps ``id(cell)`` of each batch leaf to its replica; ``replicated`` lists the roots
    every replica needs (parameters, optimizer state); the others are computed on one replica (the
    one holding their inputs, else replica 0).

    A node whose batch-dependent inputs all come from one replica's share runs once, there. Any
    other node (combining several replicas' shares, or depending on no share) is cloned into each
    replica that needs it. A ``reduce_sum`` over several replicas' tiles first sums each
    replica's tiles where they are, so only one partial per replica travels.
    """
    nodes = topo_order(list(roots))
    # owner[id(node)]: the replica of a node of one replica's share; None: cloned where needed
    owner: dict[int, int | None] = {}
    for n in nodes:
        if n.is_leaf:
            owner[id(n)] = groups.get(id(n.cell))
            continue
        shares = {owner[id(i.node)] for i in n.inputs} - {None}
        owner[id(n)] = shares.pop() if len(shares) == 1 else None

    # which replicas need a clone of each cloned node (reverse topological order)
    need: dict[int, set[int]] = {id(n): set() for n in nodes}
    for k, r in enumerate(roots):
        if owner[id(r.node)] is None:
            need[id(r.node)] |= set(range(replicas)) if k in set(replicated) else {0}
    for n in reversed(nodes):
        if n.is_leaf:
            continue
        mine = {owner[id(n)]} if owner[id(n)] is not None else need[id(n)]
        if owner[id(n)] is None and not mine:
            continue  # a cloned node nobody needs
        for i in n.inputs:
            if owner[id(i.node)] is None:
                need[id(i.node)] |= mine

    made: dict[tuple[int, int], Node] = {}   # (id(old node), replica) -> new node
    presummed: dict = {}
    cloned: set[int] = set()
    replica: dict[int, int] = {}
    out_nodes: list[Node] = []

    def ref(r: TileRef, p: int) -> TileRef:
        """Root/input ``r`` as seen from replica ``p``."""
        n = r.node
        if n.is_leaf:
            return r
        o = owner[id(n)]
        return TileRef(made[(id(n), p if o is None else o)], r.index)

    def add(new: Node, p: int) -> Node:
        replica[id(new)] = p
        out_nodes.append(new)
        return new

    for n in nodes:
        if n.is_leaf:
            continue
        o = owner[id(n)]
        for p in ([o] if o is not None else sorted(need[id(n)])):
            inputs, params = tuple(ref(i, p) for i in n.inputs), n.params
            if o is None and n.kernel.name == _SUM_KERNEL:
                if (id(n), "presum") not in presummed:  # one set of partial sums for every clone
                    presummed[(id(n), "presum")] = _presum(n, inputs, owner, add)
                inputs, params = presummed[(id(n), "presum")]
            made[(id(n), p)] = new = add(_copy(n, inputs, params), p)
            if o is None:
                cloned.add(id(new))

    out_roots = []
    for k, r in enumerate(roots):
        o = owner[id(r.node)] if not r.node.is_leaf else None
        if r.node.is_leaf:
            out_roots.append([r] * (replicas if k in set(replicated) else 1))
        elif o is not None:
            out_roots.append([ref(r, o)])
        else:
            out_roots.append([ref(r, p) for p in (range(replicas) if k in set(replicated) else [0])])
    exchange: set[int] = set()
    for n in out_nodes:  # topological: a node's inputs come before it
        p = replica[id(n)]
        if any(not i.node.is_leaf and (replica[id(i.node)] != p or id(i.node) in exchange and id(n) in cloned)
               for i in n.inputs):
            exchange.add(id(n))
    return Replicas(out_roots, replica, out_nodes, exchange)


def _presum(node: Node, inputs: tuple[TileRef, ...], owner, add) -> tuple[tuple[TileRef, ...], dict]:
    """Inputs and params of a cloned ``reduce_sum`` whose inputs are tiles of several replicas'
    shares: each replica's tiles are first summed (over the call's ``axes`` too) where they were
    made, and the clone adds one partial per replica. Unchanged when an input is not one replica's
    own tile, or when there is nothing to pre-sum."""
    from tilegraph.ops.reduce import _reduce_sum

    axes = node.params["axes"]
    by_replica: dict[int, list[TileRef]] = {}
    for orig, new in zip(node.inputs, inputs):
        o = owner[id(orig.node)]
        if o is None:
            return inputs, node.params
        by_replica.setdefault(o, []).append(new)
    if all(len(tiles) == 1 for tiles in by_replica.values()) and not axes:
        return inputs, node.params
    kshape = tuple(1 if a in axes else d for a, d in enumerate(inputs[0].shape))
    partials = []
    for p, tiles in sorted(by_replica.items()):
        if len(tiles) == 1 and not axes:
            partials.append(tiles[0])
            continue
        part = Node(_reduce_sum, {"axes": axes, "shape": kshape, "scale": 1.0}, tuple(tiles),
                    ((kshape, tiles[0].dtype),), op=node.op)
        part.device = node.device
        partials.append(TileRef(add(part, p), 0))
    return tuple(partials), {**node.params, "axes": ()}


def visit_order(dp: Replicas, seconds, bucket_bytes: float) -> list[Node]:
    """A topological order of ``dp.nodes`` for the list scheduler that overlaps the gradient
    exchange with the backward pass, as DDP's buckets do.

    Compute-phase nodes go in decreasing upward rank (longest estimated path to a sink, with
    ``seconds(node)`` per node), except that a node whose results only feed the exchange (a
    weight-gradient product, a replica's partial sum) takes the rank of its inputs' makers, so it
    runs as soon as they are done rather than at the end. Each time the ready exchange nodes would
    move ``bucket_bytes`` across processes (or no compute node is ready), all ready exchange nodes
    follow: visiting one closes the task holding its inputs, so each bucket's values leave their
    process while the next part of the backward runs.
    """
    import heapq

    users: dict[int, list[Node]] = {id(n): [] for n in dp.nodes}
    pending = {id(n): 0 for n in dp.nodes}
    for n in dp.nodes:
        for i in n.inputs:
            if id(i.node) in users:
                users[id(i.node)].append(n)
                pending[id(n)] += 1
    rank: dict[int, float] = {}
    feeds: set[int] = set()  # compute nodes whose every use is in the exchange (or feeds it)
    for n in reversed(dp.nodes):
        rank[id(n)] = seconds(n) + max((rank[id(u)] for u in users[id(n)]), default=0.0)
        if id(n) not in dp.exchange and users[id(n)] and \
                all(id(u) in dp.exchange or id(u) in feeds for u in users[id(n)]):
            feeds.add(id(n))
    for n in dp.nodes:  # topological: a feeder's inputs have their final rank
        if id(n) in feeds:
            rank[id(n)] = max((rank[id(i.node)] for i in n.inputs if id(i.node) in rank), default=rank[id(n)])

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
