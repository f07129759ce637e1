"""What you need to write your own ops: a tile kernel, the graph nodes that call it, and an
:class:`~tilegraph.Op` with a forward and a backward (README "Your own ops").

- :func:`kernel` registers a function of tiles (NumPy arrays on CPU workers, CuPy on GPU ones:
  ``cupy.get_array_module`` style code runs on both) under a unique name; it returns new arrays
  and never writes into its inputs (they may be a parameter's own value). ``cost(in_shapes,
  out_shapes, itemsize, params)`` returns a :class:`Cost` of the call's flops and bytes (finite,
  >= 0) for the scheduler (:func:`elementwise_cost` for elementwise work).
- :func:`emit` / :func:`emit1` record one call of a kernel on some tiles (a node of the graph),
  returning references to its outputs; :func:`new_tensor` builds a TileTensor from one such
  reference per tile.
- An Op's ``forward(*args)`` returns ``(out, ctx)``: a new TileTensor and what ``backward(ctx,
  g)`` needs; ``backward`` returns one gradient per positional argument (None where there is
  none), each tiled like its argument, with its dtype.

>>> import numpy as np, tilegraph as tg
>>> from tilegraph.ext import elementwise_cost, emit1, kernel, new_tensor
>>> @kernel("doc_twice", cost=elementwise_cost(1))
... def _twice(x):
...     return x * 2
>>> class Twice(tg.Op):
...     name = "twice"
...     def forward(self, x):
...         out = new_tensor(x.tiling, x.dtype, lambda i: emit1(_twice, [x.grid[i]], x.tiling.tile_shape(i),
...                                                          x.dtype, op=self.name))
...         return out, None
...     def backward(self, ctx, g):
...         return (g * 2,)
>>> x = tg.from_numpy(np.arange(3.0), tiles=2)
>>> tg.compute(Twice()(x))[0]
array([0., 2., 4.])
"""

from tilegraph._graph import Cost, emit, emit1, kernel, xp_of
from tilegraph.ops._common import elementwise_cost, new_tensor, require_float, require_tensor

__all__ = ["Cost", "xp_of", "kernel", "emit", "emit1", "new_tensor", "elementwise_cost", "require_tensor", "require_float"]
