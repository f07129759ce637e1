"""Tile ops: each one Op object with forward (records tile kernels), backward (vjp) and cost.

Kernels are NumPy (Numba where it is faster) on the CPU and run on CuPy arrays on a GPU; CuPy is
imported only when a GPU task runs.
"""

from .attention import scaled_dot_product_attention
from .dropout import dropout
from .elementwise import (absolute, add, affine, cast, clamp, div, exp, floor_divide, gelu, leaky_relu, log, mul,
                          ones_like, pow, relu, remainder, sigmoid, silu, sub, tanh, zeros_like)
from .embedding import embedding
from .index import chunk, narrow, select, split, unbind
from .loss import cross_entropy, mse_loss
from .lora import lora_linear  # noqa: F401 - tg.ops.lora_linear (RunLoRA's choice: tilegraph.ops.lora)
from .matmul import linear, matmul
from .norm import layer_norm, rms_norm
from .rmm import sketched_linear  # noqa: F401 - tg.ops.sketched_linear (randomized weight gradients: tilegraph.ops.rmm)
from .reduce import max, mean, min, std, sum, var
from .rope import rope
from .shape import cat, flatten, permute, rechunk, reshape, squeeze, stack, transpose, unsqueeze
from .softmax import log_softmax, softmax
from .where import logical_and, logical_not, logical_or, logical_xor, masked_fill, where

abs = absolute  # noqa: A001 - torch's name (elementwise keeps Python's abs for its Numba kernels)

__all__ = ["add", "affine", "cross_entropy", "mse_loss", "div", "dropout", "embedding", "layer_norm", "log_softmax", "rms_norm", "softmax", "gelu", "linear", "matmul", "mean", "mul", "ones_like", "permute", "pow", "relu", "leaky_relu",
           "reshape", "rope", "scaled_dot_product_attention", "silu", "sub", "sum", "transpose", "zeros_like",
           "exp", "log", "tanh", "sigmoid", "cast", "cat", "stack", "unsqueeze", "squeeze", "flatten", "max", "min",
           "var", "std", "rechunk", "narrow", "select", "split", "chunk", "unbind", "abs", "absolute", "clamp", "where", "masked_fill",
           "logical_and", "logical_or", "logical_xor", "logical_not", "floor_divide", "remainder"]
