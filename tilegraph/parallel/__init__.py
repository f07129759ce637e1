"""Parallel strategies as passes over the logical tile graph (they never import dask).

- :mod:`~tilegraph.parallel.data_parallel`: each worker process runs the steps of its share of the
  batch and keeps a replica of the parameters and optimizer state; gradients are summed across
  replicas inside the graph.
"""

from tilegraph.parallel.data_parallel import Replicas, batch_groups, split_replicas

__all__ = ["Replicas", "batch_groups", "split_replicas"]
