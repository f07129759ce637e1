"""tilegraph: train large neural networks as dataflow graphs of tile tasks on Dask.

>>> import numpy as np, tilegraph as tg
>>> x = tg.from_numpy(np.arange(6.0).reshape(2, 3), tiles=(1, 2))
>>> tg.compute((x * 2).sum())[0]
array(30.)
"""

from tilegraph._errors import TileError
from tilegraph._tensor import TileTensor, Tiling, from_dask_array, from_numpy
from tilegraph._autograd import Op, grad, no_grad
from tilegraph.recompute import checkpoint
from tilegraph._lower import compile, compute, config
from tilegraph.runtime import Runtime, connect, current_runtime

from tilegraph import ops, nn, optim
from tilegraph._health import StepTimeoutError, WorkerLostError
from tilegraph._train import EvalStep, StepStats, TrainStep
from tilegraph.trainer import FitResult, NonFiniteLossError, Trainer
from tilegraph.ops import *  # noqa: F401,F403 - functional ops live in the tilegraph namespace
from tilegraph.ops import __all__ as _ops_all
# torch's creators (arange; after the star import: these zeros_like / ones_like take dtype= and read nothing of x),
# expand, cumsum and norm
from tilegraph._tensor import arange, full, full_like, ones, ones_like, zeros, zeros_like
from tilegraph.ops.reduce import norm
from tilegraph.ops.scan import cumsum
from tilegraph.ops.shape import expand, expand_as

__version__ = "0.1.0"


def __getattr__(name: str):
    """``tg.io`` (checkpoints, quantizers, data), ``tg.models`` and ``tg.peft`` load on first use."""
    if name in ("io", "models", "peft"):
        import importlib

        return importlib.import_module(f"tilegraph.{name}")
    raise AttributeError(f"module 'tilegraph' has no attribute {name!r}")


__all__ = ["TileError", "TileTensor", "Tiling", "from_numpy", "from_dask_array", "Op", "grad", "no_grad", "checkpoint", "compile",
           "compute", "config", "Runtime", "connect", "current_runtime", "ops", "nn", "optim", "TrainStep", "StepStats", "EvalStep", "Trainer", "FitResult",
           "WorkerLostError", "StepTimeoutError", "NonFiniteLossError", *_ops_all,
           *(n for n in ("arange", "zeros", "ones", "full", "full_like", "zeros_like", "ones_like", "expand", "expand_as",
                         "cumsum", "norm") if n not in _ops_all)]
