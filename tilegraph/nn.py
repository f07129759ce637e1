"""Modules: small callables over TileTensors whose parameters are attributes.

A layer only records graph; shapes come from its inputs at call time. Tile sizes of parameters
are given by ``tile`` (feature dims) and must agree with the activations they meet, e.g. a
Linear's input tile must equal the tile of the activation's last dim.

>>> import numpy as np, tilegraph as tg
>>> mlp = tg.nn.MLP(8, 16, tile=4, seed=0)
>>> x = tg.from_numpy(np.ones((2, 3, 8), np.float32), tiles=(1, 3, 4))
>>> mlp(x).shape
(2, 3, 8)
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
import weakref
from typing import Iterator, Mapping

import numpy as np

from tilegraph import ops
from tilegraph._config import check_array_dtype, is_int, require_float_dtype, require_int
from tilegraph._errors import TileError, TileIndexError
from tilegraph._graph import Cell, TileRef, leaf
from tilegraph._graph import _SCOPES as _scopes_stack
from tilegraph._graph import scope as _scope
from tilegraph._tensor import (TileTensor, Tiling, _host_array, assign_cells, from_numpy, is_array, split_into_cells,
                               tensor_from_cells)
from tilegraph.ops.embedding import check_padding_idx
from tilegraph.ops.shape import fit_last_dim

__all__ = ["Module", "Parameter", "Linear", "Embedding", "LayerNorm", "RMSNorm", "MLP", "SwiGLU",
           "CausalSelfAttention", "SelfAttention", "KVCache", "ModuleList", "Sequential", "ReLU", "GELU", "SiLU", "Tanh", "Sigmoid",
           "Identity", "Dropout", "Flatten", "Softmax", "LogSoftmax", "LeakyReLU", "CrossEntropyLoss", "MSELoss",
           "defaults", "deferred_init", "training", "is_training"]

#: the cells of every :class:`Parameter` of this process (held weakly: a model dropped takes its
#: cells with it). :func:`tilegraph.compute` lends those holding large arrays here to the workers
#: once (:func:`tilegraph._lower._parameters_held_here`), also under ``tg.no_grad()``, where no
#: recorded op leads from an output to its model's parameters. The cells of other weights held here
#: (a quantized weight's parts) are lent the same way once added.
PARAMETER_CELLS: "weakref.WeakSet[Cell]" = weakref.WeakSet()


class Parameter(TileTensor):
    """A trainable leaf TileTensor. Its tiles live in cells whose values the optimizer replaces
    after each step (arrays on the client, or futures on the workers)."""

    __slots__ = ("cells", "requires_grad", "_grad")

    def __init__(self, array: np.ndarray, tiles=None, *, name: str | None = None, requires_grad: bool = True):
        where = f"tilegraph.nn.Parameter({name or ''})"
        array = _host_array(array, where)  # a torch tensor's data (a torch Parameter requires grad)
        tiling = Tiling.from_sizes(array.shape, tiles, where=where)
        check_array_dtype(where, array.dtype, array.shape)  # not float128 nor complex
        if requires_grad and array.dtype.kind != "f":
            raise TileError(where, "only floating-point parameters can require gradients (as in torch): pass "
                            "requires_grad=False for integer or bool values, or cast them to a float dtype",
                            f"dtype {array.dtype}")
        if _DEFERRED:  # no values yet: load_state_dict/assign fills the cells
            cells = np.empty(tiling.grid, dtype=object)
            for idx in np.ndindex(*tiling.grid):
                cells[idx] = Cell(None, tiling.tile_shape(idx), array.dtype, token=f"deferred-{name}-{idx}")
        else:
            cells = split_into_cells(array, tiling)
        t = tensor_from_cells(tiling, array.dtype, cells, name=name)
        super().__init__(t.tiling, t.dtype, t.grid, name=name)
        self.cells = cells
        PARAMETER_CELLS.update(cells.flat)
        self.requires_grad = requires_grad

    def requires_grad_(self, requires_grad: bool = True) -> "Parameter":
        """Set ``requires_grad`` (``False`` freezes the parameter); returns it, as torch's."""
        where = f"tilegraph.nn.Parameter({self.name or ''}).requires_grad_"
        if not isinstance(requires_grad, (bool, np.bool_)):
            raise TileError(where, "requires_grad must be a bool", f"{requires_grad!r:.60}")
        if requires_grad and self.dtype.kind != "f":
            raise TileError(where, "only floating-point parameters can require gradients (as in torch)",
                            f"dtype {self.dtype}")
        self.requires_grad = bool(requires_grad)
        return self

    @property
    def grad(self) -> TileTensor | None:
        """The gradient that ``loss.backward()`` accumulated (a symbolic TileTensor), or None."""
        return getattr(self, "_grad", None)

    @grad.setter
    def grad(self, value) -> None:
        if value is not None and (not isinstance(value, TileTensor) or value.shape != self.shape
                                  or value.chunks != self.chunks):
            raise TileError(f"tilegraph.nn.Parameter({self.name}).grad", f"the gradient must be None or a TileTensor "
                            f"of the parameter's shape {self.shape} and tiles {self.chunks}",
                            repr(value)[:80])
        self._grad = value

    def assign(self, array: np.ndarray) -> None:
        """Replace the value (same shape and dtype), keeping the tiling."""
        array = _host_array(array, f"tilegraph.nn.Parameter({self.name}).assign")
        if array.shape != self.shape or array.dtype != self.dtype:
            raise TileError(f"tilegraph.nn.Parameter({self.name}).assign", f"expected {self.shape} {self.dtype}",
                            f"{array.shape} {array.dtype}")
        assign_cells(self.cells, self.tiling, array)

    def __deepcopy__(self, memo) -> "Parameter":
        """``copy.deepcopy(model)`` (an EMA or teacher copy, a snapshot to compare with): a
        Parameter of its own, with cells of its own holding the same values. A value is never
        changed in place (a step gives a cell a new one), so the copy shares them: arrays on the
        client, and the references to values on the workers, which deepcopy made into Dask futures
        of another client (the copy's every compute then failed, "held by another runtime"). The
        symbolic ``grad`` of ``loss.backward()`` is not copied (it reads the original's values)."""
        cells = np.empty(self.cells.shape, dtype=object)
        for idx in np.ndindex(*cells.shape):
            cell = self.cells[idx]
            cells[idx] = Cell(cell.value, cell.shape, cell.dtype, token=cell.token)
        new = object.__new__(type(self))
        t = tensor_from_cells(self.tiling, self.dtype, cells, name=self.name)
        TileTensor.__init__(new, t.tiling, t.dtype, t.grid, name=self.name)
        new.cells, new.requires_grad = cells, self.requires_grad
        PARAMETER_CELLS.update(cells.flat)
        memo[id(self)] = new  # (a tied parameter's other names get this copy too)
        return new

    def __setstate__(self, state) -> None:
        """Unpickled (a model saved with pickle and loaded here): its cells are a Parameter's too
        (:data:`PARAMETER_CELLS`), lent to the workers as the original's are."""
        attributes, slots = state if isinstance(state, tuple) else (state, None)  # (a subclass's __dict__, slots)
        for part in (attributes, slots):
            for name, value in (part or {}).items():
                setattr(self, name, value)
        PARAMETER_CELLS.update(self.cells.flat)

    def __repr__(self) -> str:
        return f"Parameter({self.name}, shape={self.shape}, dtype={self.dtype}, tiles={self.chunks})"


def _fit(tile, n: int):
    """A module-wide tile size applied to a dim of size ``n`` (whole dim when it is larger). A
    tile that is no integer goes on as it is, for the parameter's tiling to name."""
    if tile is None or not is_int(tile):
        return tile
    return None if tile >= n else tile


def _check_layer(where: str, dtype=None, **sizes) -> np.dtype:
    """A layer's sizes (integers >= 1) and dtype (float16, float32 or float64, as
    :func:`tilegraph._config.as_dtype` reads it: integer weights would be drawn as zeros and never
    train, and nothing computes in float128 or bfloat16; None: the :func:`defaults` block's, else
    float32), checked where the layer is built; returns the dtype as a NumPy dtype."""
    for name, value in sizes.items():
        require_int(where, name, value, 1)
    return require_float_dtype(where, _default("dtype", dtype, np.float32))


def _rng(seed, where: str = "tilegraph.nn") -> np.random.Generator:
    """The generator a layer draws its initial values from: ``seed`` (an int >= 0 or a Generator;
    None: the :func:`defaults` block's, else fresh entropy, as torch's unseeded layers)."""
    seed = _default("seed", seed)
    if seed is not None and not isinstance(seed, (np.random.Generator, _NoDraw)) and not is_int(seed, 0):
        raise TileError(where, "seed must be an int >= 0, a numpy.random.Generator or None (the seed of the "
                        "tilegraph.nn.defaults() block in force, else a fresh one)", f"seed={seed!r:.60}")
    if _DEFERRED:
        return _NO_DRAW
    return seed if isinstance(seed, (np.random.Generator, _NoDraw)) else np.random.default_rng(seed)


#: what :func:`defaults` blocks in force set (the innermost wins), by argument name
_DEFAULTS: contextvars.ContextVar[dict] = contextvars.ContextVar("tilegraph_layer_defaults", default={})


def _default(name: str, value, fallback=None):
    """``value`` where it is given (not None), else the :func:`defaults` block's, else ``fallback``."""
    if value is not None:
        return value
    return _DEFAULTS.get().get(name, fallback)


def _init_std(where: str, init_std, dtype=None, fallback=None) -> float | None:
    """A layer's ``init_std`` (given, else the :func:`defaults` block's, else ``fallback``), checked:
    a finite real number > 0 whose draws ``dtype`` holds (float64 where None), or None."""
    init_std = _default("init_std", init_std, fallback)
    if init_std is None:
        return None
    std = None  # (a bool, a complex, a string, ...: no standard deviation)
    if not isinstance(init_std, (bool, np.bool_)) and isinstance(init_std, (int, float, np.integer, np.floating)):
        try:
            std = float(init_std)
        except OverflowError:  # an int past float64's range
            std = math.inf
    said = f"init_std={init_std!r:.60}"
    if std is None or not math.isfinite(std) or std <= 0:
        raise TileError(where, "init_std must be a finite number > 0 (the standard deviation of the normal initial "
                        "weights) or None", said)
    dt = np.dtype(np.float64 if dtype is None else dtype)
    info = np.finfo(dt)
    low, high = float(info.smallest_normal), float(info.max) / _INIT_SIGMAS
    if not low <= std <= high:  # weights of inf, or underflowing ones
        raise TileError(where, f"init_std between {low:.3g} and {high:.3g} for {dt.name} weights (a larger one draws "
                        "weights of inf, a smaller one weights that underflow to subnormals or zeros)", said)
    return std


#: how many standard deviations a drawn initial weight may reach, for the largest ``init_std`` a dtype holds
_INIT_SIGMAS = 16


@contextlib.contextmanager
def defaults(*, tile=None, dtype=None, seed=None, init_std=None, inherit: bool = True):
    """Defaults for the layers built inside the block, for each argument a layer is not given (or
    given as None), so a model reads as its architecture, as a torch one does::

        with tg.nn.defaults(tile=256, dtype="float32", seed=0, init_std=0.02):
            self.attn = tg.nn.CausalSelfAttention(768, 12)
            self.mlp = tg.nn.MLP(768, 3072, act="gelu_tanh")

    - ``tile``: the feature tile of every layer (a Linear's ``out_tile`` follows it unless
      given; an Embedding's vocabulary tile does not);
    - ``dtype``: of the parameters (float16, float32 or float64; float32 outside any block);
    - ``seed``: an int >= 0 or a ``numpy.random.Generator``; the layers of the block draw from one
      generator made from it, one after another, so the same code and seed give the same weights
      (outside a block, a layer given no seed draws fresh ones, as torch's do without
      ``torch.manual_seed``);
    - ``init_std``: weights drawn from N(0, init_std^2) and zero biases instead of torch's uniform
      init (an Embedding's default is N(0, 1), torch's).

    A block holds for the code that runs inside it (a context variable: its thread, and what that
    thread runs with ``contextvars.copy_context().run``), not for threads started from it. Blocks
    nest; an inner one changes only what it sets (``inherit=False``: it sets all of it, what
    it leaves None as outside any block; the shipped models build so, as their tiling, dtype and
    seed say, whatever block they are built in). Re-draw a layer's weights after it is
    built with :meth:`Linear.reset_parameters` (GPT-2's smaller init of the projections into the
    residual stream).

    >>> import tilegraph as tg
    >>> with tg.nn.defaults(tile=4, dtype="float64", seed=0):
    ...     mlp = tg.nn.MLP(8, 16)
    >>> mlp.fc1.weight.chunks, mlp.fc2.weight.dtype
    (((4, 4), (4, 4, 4, 4)), dtype('float64'))
    """
    where = "tilegraph.nn.defaults"
    if not isinstance(inherit, (bool, np.bool_)):
        raise TileError(where, "inherit must be a bool", f"inherit={inherit!r:.60}")
    given = {}
    if tile is not None:
        if not is_int(tile, 1):
            raise TileError(where, "tile must be an int >= 1 (the feature tile of the layers built in the block) or "
                            "None", f"tile={tile!r:.60}")
        given["tile"] = int(tile)
    if dtype is not None:
        given["dtype"] = require_float_dtype(where, dtype)
    if seed is not None:
        if isinstance(seed, np.random.Generator):
            given["seed"] = seed
        elif is_int(seed, 0):
            given["seed"] = np.random.default_rng(int(seed))
        else:
            raise TileError(where, "seed must be an int >= 0, a numpy.random.Generator or None", f"seed={seed!r:.60}")
    if init_std is not None:
        given["init_std"] = _init_std(where, init_std, given.get("dtype"))
    token = _DEFAULTS.set({**_DEFAULTS.get(), **given} if inherit else given)
    try:
        yield
    finally:
        _DEFAULTS.reset(token)


_DEFERRED: list[bool] = []  # non-empty inside deferred_init()


class _NoDraw:
    """Stands in for the random generator under :func:`deferred_init`: float32 zeros that take no
    memory (a broadcast scalar), so a 1B-parameter model is built without drawing 1B numbers."""

    def _zeros(self, *args, size=None, **kwargs):
        shape = size if size is not None else args[-1]
        return np.broadcast_to(np.float32(0.0), (shape,) if isinstance(shape, int) else tuple(shape))

    uniform = normal = _zeros


_NO_DRAW = _NoDraw()


@contextlib.contextmanager
def deferred_init():
    """Build modules without initial values: their parameters get shapes, tiles and empty cells,
    which :meth:`Module.load_state_dict` then fills (how ``models.from_hf`` skips drawing random
    weights it would overwrite). A parameter left unloaded holds no value and cannot be computed."""
    _DEFERRED.append(True)
    try:
        yield
    finally:
        _DEFERRED.pop()


#: the mode of the graph being recorded, set by :func:`training` (None: no step is recording)
_TRAINING: contextvars.ContextVar[bool | None] = contextvars.ContextVar("tilegraph_training", default=None)


@contextlib.contextmanager
def training(mode: bool = True):
    """Record the graphs made inside the block as a training step's (``mode=False``: an
    evaluation's): layers that behave differently in training (:class:`~tilegraph.peft.LoRALinear`'s
    dropout, ``tg.dropout(x, p, training=self.training)`` in a module) do so. It decides for every
    module, whatever ``model.train()`` / ``model.eval()`` set, as a torch training loop calls those
    itself: :class:`~tilegraph.TrainStep` records its step in ``training()``, an evaluation
    (``EvalStep``, the Trainer's) and generation in ``training(False)``. A graph is recorded once
    and replayed, so the mode is the recorded graph's.

    >>> import tilegraph as tg
    >>> with tg.nn.training():
    ...     tg.nn.is_training()
    True
    >>> tg.nn.is_training()
    False
    """
    token = _TRAINING.set(bool(mode))
    try:
        yield
    finally:
        _TRAINING.reset(token)


def is_training() -> bool:
    """Whether the graph being recorded is a training step's (inside :func:`training`)."""
    return bool(_TRAINING.get())


def _check_mode(where: str, mode) -> bool | None:
    if mode is not None and not isinstance(mode, (bool, np.bool_)):
        raise TileError(where, "the training mode must be a bool (or None: the recording's mode)", f"{mode!r:.60}")
    return None if mode is None else bool(mode)


def _scopes() -> list[str]:
    return _scopes_stack


class Module:
    """Base class: parameters and submodules are plain attributes (also inside lists/dicts).

    ``module.training`` is what layers that behave differently in training read (pass it on as
    ``tg.dropout(x, p, training=self.training)``). Inside a step's recording (:func:`training`:
    ``TrainStep`` records in training mode; ``EvalStep``, the Trainer's evaluations and
    ``generate`` in eval mode) the step decides, as a torch training loop calls
    ``model.train()`` / ``model.eval()`` itself. Elsewhere (a plain forward, ``tg.compute``,
    ``loss.backward()``) it is what ``model.train()`` / ``model.eval()`` set for the module and its
    submodules, as in torch, and False before either is called; ``train(None)`` clears it.
    """

    _training: bool | None = None  # set by train() / eval(); None: neither called

    def __setattr__(self, name: str, value) -> None:
        # torch's rule: a parameter attribute takes a Parameter or None. ``m.weight = m.weight * 0.5``
        # made the attribute a plain tensor, and the module silently lost its weight (not trained,
        # not in state_dict, not saved).
        if isinstance(value, TileTensor) and not isinstance(value, Parameter) and \
                isinstance(self.__dict__.get(name), Parameter):
            raise TileError(f"tilegraph.nn.{type(self).__name__}.{name}",
                            "a Parameter or None, as torch's: a tensor that is no Parameter would leave the module "
                            f"(not trained, not saved); set its values with module.{name}.assign(array), or assign "
                            "a tg.nn.Parameter", repr(value))
        object.__setattr__(self, name, value)

    @property
    def training(self) -> bool:
        """True where this module records training behaviour (dropout); see the class doc."""
        step = _TRAINING.get()
        return step if step is not None else bool(self._training)

    @training.setter
    def training(self, mode) -> None:
        self._training = _check_mode(f"{type(self).__name__}.training", mode)

    def train(self, mode: bool | None = True) -> "Module":
        """Set the training mode of this module and its submodules to ``mode`` for the graphs
        recorded outside a step (see the class doc; None: cleared); returns the module, as torch's
        ``train`` does."""
        mode = _check_mode(f"{type(self).__name__}.train", mode)
        for m in self.modules():
            m._training = mode
        return self

    def eval(self) -> "Module":
        """``train(False)``: no training behaviour (dropout) in the graphs recorded afterwards
        outside a step; returns the module."""
        return self.train(False)

    def modules(self) -> Iterator["Module"]:
        """This module and every submodule (each once), as torch's ``modules``."""
        seen: set[int] = set()
        stack: list = [self]
        while stack:
            value = stack.pop()
            if isinstance(value, Module):
                if id(value) in seen:
                    continue
                seen.add(id(value))
                yield value
                items = value.layers if isinstance(value, ModuleList) else list(vars(value).values())
                stack.extend(reversed(items))
            elif isinstance(value, (list, tuple)):
                stack.extend(reversed(value))
            elif isinstance(value, dict):
                stack.extend(reversed(list(value.values())))

    def __call__(self, *args, **kwargs):
        if not _scopes():  # the model itself: name every submodule by its attribute path, once
            self._name_modules()
        with _scope(getattr(self, "_scope_name", None) or type(self).__name__.lower()):
            return self.forward(*args, **kwargs)

    def _name_modules(self) -> None:
        """Give each submodule the dotted path of its attribute (``layers.3.attn``) as the scope
        of the kernels it records (the names of its tasks on the Dask dashboard)."""
        if getattr(self, "_scope_name", None) is not None:
            return
        object.__setattr__(self, "_scope_name", type(self).__name__.lower())
        # a Sequential model's layers by their state_dict names (0, 1, ...), as a ModuleList's inside one
        items = enumerate(self.layers) if isinstance(self, ModuleList) else vars(self).items()
        stack = [(f"{name}", value) for name, value in items]
        while stack:
            path, value = stack.pop()
            if isinstance(value, Module):
                if getattr(value, "_scope_name", None) is None:
                    object.__setattr__(value, "_scope_name", path)
                items = value.layers if isinstance(value, ModuleList) else vars(value).items()
                if isinstance(value, ModuleList):
                    stack.extend((f"{path}.{i}", m) for i, m in enumerate(items))
                else:
                    stack.extend((f"{path}.{k}", v) for k, v in items if k != "_scope_name")
            elif isinstance(value, (list, tuple)):
                stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
            elif isinstance(value, dict):
                stack.extend((f"{path}.{k}", v) for k, v in value.items())

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"[tilegraph.nn.Module] {type(self).__name__} defines no forward(self, ...): a "
                                  "module is called through the forward method it defines, as in torch")

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        """The direct submodules with their attribute names (``blocks.0`` for one in a list), as
        torch's ``named_children``."""
        if isinstance(self, ModuleList):
            stack = [(str(i), m) for i, m in enumerate(self.layers)]
        else:
            stack = [(k, v) for k, v in vars(self).items() if not k.startswith("_")]
        stack.reverse()
        seen: set[int] = set()
        while stack:
            name, value = stack.pop()
            if isinstance(value, Module):
                if id(value) not in seen:
                    seen.add(id(value))
                    yield name, value
            elif isinstance(value, (list, tuple)):
                stack.extend(reversed([(f"{name}.{i}", v) for i, v in enumerate(value)]))
            elif isinstance(value, dict):
                stack.extend(reversed([(f"{name}.{k}", v) for k, v in value.items()]))

    def children(self) -> Iterator["Module"]:
        """The direct submodules (torch's ``children``)."""
        return (m for _, m in self.named_children())

    def apply(self, fn) -> "Module":
        """Call ``fn(module)`` on every submodule, each once and its children before it, then on
        this module; returns this module, as torch's ``apply``. An init pass, as nanoGPT's::

            def init(m):
                if isinstance(m, (tg.nn.Linear, tg.nn.Embedding)):
                    m.reset_parameters(init_std=0.02)
            model.apply(init)
        """
        if not callable(fn):
            raise TileError(f"{type(self).__name__}.apply", "a function of a module (called on each)",
                            f"{fn!r:.60} ({type(fn).__name__})")
        seen: set[int] = set()

        def visit(module: Module) -> None:
            seen.add(id(module))
            for child in module.children():
                if id(child) not in seen:
                    visit(child)
            fn(module)

        visit(self)
        return self

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """This module (named ``prefix``) and every submodule with its dotted path, each once, as
        torch's ``named_modules``."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            name, m = stack.pop()
            if id(m) in seen:
                continue
            seen.add(id(m))
            yield name, m
            stack.extend(reversed([(f"{name}.{k}" if name else k, c) for k, c in m.named_children()]))

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        """Set ``requires_grad`` of every parameter (``False`` freezes the module); returns the
        module, as torch's."""
        if not isinstance(requires_grad, (bool, np.bool_)):
            raise TileError(f"{type(self).__name__}.requires_grad_", "requires_grad must be a bool",
                            f"{requires_grad!r:.60}")
        for p in self.parameters():
            if requires_grad and p.dtype.kind not in "fc":
                continue  # an integer buffer never takes a gradient
            p.requires_grad = bool(requires_grad)
        return self

    def __repr__(self) -> str:
        """torch's layout: the module's type, its parameters' shapes, then each child indented."""
        own = ", ".join(f"{k}={v.shape}" for k, v in vars(self).items() if isinstance(v, Parameter))
        kids = list(self.named_children())
        if not kids:
            return f"{type(self).__name__}({own})"
        lines = [f"{type(self).__name__}({own}" if own else f"{type(self).__name__}("]
        for name, child in kids:
            lines.append(f"  ({name}): " + repr(child).replace("\n", "\n  "))
        return "\n".join(lines) + "\n)"

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        yield from self._walk(prefix, seen)

    def _walk(self, prefix: str, seen: set) -> Iterator[tuple[str, Parameter]]:
        for name, value in vars(self).items():
            yield from _walk_value(f"{prefix}{name}", value, seen)

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        """Clear the ``grad`` that ``loss.backward()`` accumulated on every parameter (None, as
        torch's default ``set_to_none=True``)."""
        for p in self.parameters():
            p.grad = None

    def num_parameters(self) -> int:
        return sum(p.size for p in self.parameters())

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameter values as NumPy arrays (computed/fetched from wherever they live)."""
        from tilegraph._lower import compute

        named = list(self.named_parameters())
        values = compute(*[p for _, p in named]) if named else []
        return {n: v for (n, _), v in zip(named, values)}

    def load_state_dict(self, state: dict[str, np.ndarray], strict: bool = True) -> None:
        """Assign ``state``'s arrays (as :meth:`state_dict` gives) to the parameters of those
        names; with ``strict``, every parameter must be given and no other name. A tied parameter
        (one Parameter under two attribute names) is listed once by state_dict, under its first
        name, and may be given under any of them, as torch's state_dict writes each."""
        if not isinstance(state, Mapping):
            raise TileError(f"{type(self).__name__}.load_state_dict", "state must be a mapping of parameter names to "
                            "arrays (as model.state_dict() gives)", f"{type(state).__name__}")
        # every name of every parameter: a tied one (lm_head.weight = wte.weight) has one in
        # named_parameters and state_dict, and torch's state_dict writes all of them
        named = dict(self._walk("", _EveryName()))
        where = f"{type(self).__name__}.load_state_dict"
        # a torch state dict's tensors as arrays (their data: a Parameter's requires grad)
        state = {k: _host_array(v, f"{where} {k}") for k, v in state.items()}
        given = {id(named[k]) for k in state if k in named}
        problems = []
        if strict:
            problems += [f"missing: {k}" for k, p in self.named_parameters() if id(p) not in given]
            problems += [f"unexpected: {k}" for k in state if k not in named]
        modules = dict(self.named_modules())
        for k, v in state.items():
            if k in named and tuple(np.shape(v)) != named[k].shape:
                owner, _, attr = k.rpartition(".")
                flipped = (isinstance(modules.get(owner), Linear) and attr == "weight"
                           and tuple(np.shape(v))[::-1] == named[k].shape)
                problems.append(f"shape of {k}: expected {named[k].shape}, got {tuple(np.shape(v))}"
                                + (" (tilegraph stores a Linear's weight (in, out), torch's is (out, in): give "
                                   "it transposed, w.T)" if flipped else ""))
            if k in named and np.asarray(v).dtype.kind not in "biuf":
                # (a complex value lost its imaginary part, an object one failed in astype)
                problems.append(f"dtype of {k}: {np.asarray(v).dtype} is not a real number type")
        if problems:  # (all checked first: a bad value leaves every parameter as it was)
            raise TileError(where, "state does not match the model", "; ".join(problems))
        for k, v in state.items():
            if k in named:
                named[k].assign(np.asarray(v, dtype=named[k].dtype))


def _check_module(where: str, module) -> "Module":
    if not isinstance(module, Module):
        raise TileError(where, "module must be a tilegraph.nn.Module", f"{type(module).__name__} {module!r:.60}")
    return module


def _check_modules(where: str, modules, hint: str) -> list["Module"]:
    """``modules`` (an iterable of Modules, not one Module, a string or a dict) as a list, each checked."""
    if isinstance(modules, (Module, str, bytes, Mapping)) or not hasattr(modules, "__iter__"):
        raise TileError(where, f"modules must be a list of tilegraph.nn.Modules {hint}",
                        f"{type(modules).__name__} {modules!r:.60}")
    return [_check_module(where, m) for m in modules]


class _EveryName(set):
    """A ``seen`` set for :meth:`Module._walk` that sees nothing: every name of a tied parameter."""

    def __contains__(self, item) -> bool:
        return False


def _walk_value(name: str, value, seen: set):
    if isinstance(value, Parameter):
        if id(value) not in seen:
            seen.add(id(value))
            yield name, value
    elif isinstance(value, Module):
        yield from value._walk(f"{name}.", seen)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk_value(f"{name}.{i}", v, seen)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk_value(f"{name}.{k}", v, seen)


def _layer_index(where: str, i, n: int):
    """``i`` as a list index of ``n`` layers (a slice as it is); an int out of range is an
    IndexError (TileIndexError), as a list's, so loops that stop at one still stop."""
    if isinstance(i, slice):
        return i
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
        raise TileError(where, "an index must be an int or a slice", f"{type(i).__name__} {i!r:.60}")
    if not -n <= i < n:
        raise TileIndexError(where, f"index out of range for {n} layers", f"{int(i)}")
    return int(i)


class ModuleList(Module):
    """torch's ``nn.ModuleList``: modules in a list, named ``0``, ``1``, ... (``append``, ``extend``,
    ``insert`` as torch's)."""

    def __init__(self, modules=None):
        self.layers = [] if modules is None else \
            _check_modules(f"tilegraph.nn.{type(self).__name__}", modules, "(ModuleList([m0, m1]))")

    def append(self, module: Module) -> "ModuleList":
        """Add ``module`` at the end; returns the list, as torch's."""
        self.layers.append(_check_module(f"tilegraph.nn.{type(self).__name__}.append", module))
        return self

    def extend(self, modules) -> "ModuleList":
        """Add each of ``modules`` at the end; returns the list, as torch's."""
        self.layers.extend(_check_modules(f"tilegraph.nn.{type(self).__name__}.extend", modules, "(append adds one)"))
        return self

    def insert(self, index: int, module: Module) -> None:
        """Put ``module`` before ``index``, as torch's."""
        where = f"tilegraph.nn.{type(self).__name__}.insert"
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TileError(where, "index must be an int", f"index={index!r:.60}")
        self.layers.insert(int(index), _check_module(where, module))

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[_layer_index(f"tilegraph.nn.{type(self).__name__}.__getitem__", i, len(self.layers))]

    def _walk(self, prefix, seen):
        for i, m in enumerate(self.layers):
            yield from _walk_value(f"{prefix}{i}", m, seen)


class Sequential(ModuleList):
    """torch's ``nn.Sequential``: the modules called in order, each on the previous one's output;
    parameters are named by position (``0.weight``, ``2.bias``), as torch names them.

    >>> import numpy as np, tilegraph as tg
    >>> net = tg.nn.Sequential(tg.nn.Linear(4, 8, seed=0), tg.nn.ReLU(), tg.nn.Linear(8, 2, seed=1))
    >>> net(tg.from_numpy(np.ones((3, 4), np.float32))).shape, list(net.state_dict())[:2]
    ((3, 2), ['0.weight', '0.bias'])
    """

    def __init__(self, *modules):
        where = "tilegraph.nn.Sequential"
        if len(modules) == 1 and isinstance(modules[0], Mapping):
            raise TileError(where, "pass the modules as arguments, Sequential(m0, m1, ...) (named modules from an "
                            "OrderedDict are not supported: set them as attributes of a Module)",
                            type(modules[0]).__name__)
        for i, m in enumerate(modules):
            if not isinstance(m, Module):
                hint = (f" (for the function tg.{m.__name__}, a module such as tg.nn.ReLU())"
                        if callable(m) and hasattr(m, "__name__") else "")
                raise TileError(where, f"every argument must be a tilegraph.nn.Module{hint}",
                                f"argument {i}: {type(m).__name__} {m!r:.60}")
        super().__init__(modules)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Sequential(*self.layers[i])
        return self.layers[_layer_index("tilegraph.nn.Sequential.__getitem__", i, len(self.layers))]

    def forward(self, x):
        for m in self.layers:
            x = m(x)
        return x


class _Activation(Module):
    """A parameterless module calling one op (torch's activation modules)."""

    fn = staticmethod(ops.relu)

    def __init__(self, inplace: bool = False):
        if not isinstance(inplace, (bool, np.bool_)):
            raise TileError(f"tilegraph.nn.{type(self).__name__}", "inplace must be a bool", f"{inplace!r:.60}")
        self.inplace = bool(inplace)  # accepted for torch's signature; nothing changes in place here

    def forward(self, x: TileTensor) -> TileTensor:
        return type(self).fn(x)


class ReLU(_Activation):
    """torch's ``nn.ReLU``: :func:`tilegraph.relu` (``inplace`` is accepted and changes nothing: a
    TileTensor is never changed in place)."""

    fn = staticmethod(ops.relu)


class SiLU(_Activation):
    """torch's ``nn.SiLU``: :func:`tilegraph.silu`."""

    fn = staticmethod(ops.silu)


class Tanh(Module):
    """torch's ``nn.Tanh``: :func:`tilegraph.tanh`."""

    def forward(self, x: TileTensor) -> TileTensor:
        return ops.tanh(x)


class Sigmoid(Module):
    """torch's ``nn.Sigmoid``: :func:`tilegraph.sigmoid`."""

    def forward(self, x: TileTensor) -> TileTensor:
        return ops.sigmoid(x)


class GELU(Module):
    """torch's ``nn.GELU``: :func:`tilegraph.gelu`, exact or ``approximate="tanh"``."""

    def __init__(self, approximate: str = "none"):
        if approximate not in ("none", "tanh"):
            raise TileError("tilegraph.nn.GELU", "approximate must be 'none' or 'tanh'", f"{approximate!r:.60}")
        self.approximate = approximate

    def forward(self, x: TileTensor) -> TileTensor:
        return ops.gelu(x, approximate=self.approximate)


class Identity(Module):
    """torch's ``nn.Identity``: returns its input (its arguments, as torch's, are ignored)."""

    def __init__(self, *args, **kwargs):
        pass

    def forward(self, x):
        return x


class Dropout(Module):
    """torch's ``nn.Dropout(p)``: in training (``self.training``: inside a ``TrainStep``, or after
    ``model.train()``) each element is zeroed with probability ``p`` and the others scaled by
    1 / (1 - p); in evaluation it returns its input.

    A step's graph is recorded once and replayed, so the mask is not drawn while recording: each
    run's seed is a hash of ``seed``, the module's place in the model (its attribute path) and the
    values of the first tile of its *input* (:func:`tilegraph.ops.dropout.seed_tensor`), which
    change from batch to batch and, through the parameters, from step to step. Limits: the same
    input values give the same mask (the same batch through unchanged parameters, or the
    micro-batches of ``accum_steps`` where they are equal), and the mask depends on how the input
    is tiled, through its first tile.
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, seed: int = 0):
        from tilegraph.ops.dropout import check_dropout

        where = "tilegraph.nn.Dropout"
        self.p = check_dropout(p, where, "p")
        if inplace is not False:
            raise TileError(where, "inplace=True is not supported (a TileTensor is never changed in place)",
                            f"inplace={inplace!r:.60}")
        require_int(where, "seed", seed, 0)
        self.seed = int(seed)

    def forward(self, x: TileTensor) -> TileTensor:
        from tilegraph.ops.dropout import seed_tensor
        from tilegraph.peft import _hash_seed

        if not isinstance(x, TileTensor):
            raise TileError("tilegraph.nn.Dropout", "the input must be a TileTensor", type(x).__name__)
        if not self.training or self.p == 0:
            return x
        from tilegraph._graph import current_scope

        base = _hash_seed(np.frombuffer(f"{self.seed}/{current_scope()}".encode(), np.uint8))
        return ops.dropout(x, self.p, True, seed=seed_tensor(x, base=base))

    def __repr__(self) -> str:
        return f"Dropout(p={self.p:g})"


class LeakyReLU(_Activation):
    """torch's ``nn.LeakyReLU(negative_slope=0.01)``: :func:`tilegraph.leaky_relu` (``inplace`` is
    accepted and changes nothing, as :class:`ReLU`'s)."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False):
        from tilegraph.ops.elementwise import check_negative_slope

        self.negative_slope = check_negative_slope(negative_slope, "tilegraph.nn.LeakyReLU")
        super().__init__(inplace)

    def forward(self, x: TileTensor) -> TileTensor:
        return ops.leaky_relu(x, self.negative_slope)

    def __repr__(self) -> str:
        return f"LeakyReLU(negative_slope={self.negative_slope!r}{', inplace=True' if self.inplace else ''})"


def _module_dim(where: str, name: str, value) -> int:
    """A dim argument of a module (checked against the input's rank when it is called)."""
    if not is_int(value):
        raise TileError(where, f"{name} must be an int (negative counts from the end)",
                        f"{value!r:.60} ({type(value).__name__})")
    return int(value)


class Flatten(Module):
    """torch's ``nn.Flatten(start_dim=1, end_dim=-1)``: :func:`tilegraph.flatten` of dims
    ``start_dim`` to ``end_dim`` (the batch dim kept by default). As every reshape, the tiles must
    allow it: of the merged dims only the first may be split into several tiles."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        self.start_dim = _module_dim("tilegraph.nn.Flatten", "start_dim", start_dim)
        self.end_dim = _module_dim("tilegraph.nn.Flatten", "end_dim", end_dim)

    def forward(self, x: TileTensor) -> TileTensor:
        from tilegraph.ops.shape import flatten

        return flatten(x, self.start_dim, self.end_dim, where="tilegraph.nn.Flatten")

    def __repr__(self) -> str:
        return f"Flatten(start_dim={self.start_dim}, end_dim={self.end_dim})"


class _SoftmaxModule(Module):
    """torch's ``nn.Softmax(dim)`` / ``nn.LogSoftmax(dim)`` over the op ``fn``. ``dim`` must be
    given: torch's ``dim=None`` (deprecated there, with a warning) picks dim 0 for 0-, 1- and
    3-d inputs and dim 1 otherwise, which is rarely the class dim; here it is a TileError when
    the module is made."""

    def __init__(self, dim: int | None = None):
        where = f"tilegraph.nn.{type(self).__name__}"
        if dim is None:
            raise TileError(where, f"dim must be given, e.g. {type(self).__name__}(dim=-1) (torch's implicit "
                            "choice when dim is None is deprecated: dim 0 for 0-, 1- and 3-d inputs, 1 otherwise)",
                            "dim=None")
        self.dim = _module_dim(where, "dim", dim)

    def forward(self, x: TileTensor) -> TileTensor:
        return type(self).fn(x, self.dim, where=f"tilegraph.nn.{type(self).__name__}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim})"


class Softmax(_SoftmaxModule):
    """torch's ``nn.Softmax(dim)``: :func:`tilegraph.softmax` along ``dim`` (which may span
    several tiles). ``dim`` is required (torch's deprecated ``dim=None`` guess is a TileError)."""

    fn = staticmethod(ops.softmax)


class LogSoftmax(_SoftmaxModule):
    """torch's ``nn.LogSoftmax(dim)``: :func:`tilegraph.log_softmax` along ``dim``; ``dim`` is
    required (torch's deprecated ``dim=None`` guess is a TileError)."""

    fn = staticmethod(ops.log_softmax)


def _reduction(where: str, reduction, size_average, reduce) -> str:
    """A loss module's ``reduction``; torch's deprecated ``size_average`` / ``reduce`` refused."""
    from tilegraph.ops.loss import check_reduction

    if size_average is not None or reduce is not None:
        raise TileError(where, "size_average and reduce are not supported (deprecated in torch): pass "
                        "reduction='mean', 'sum' or 'none'", f"size_average={size_average!r:.40}, reduce={reduce!r:.40}")
    return check_reduction(reduction, where)


class CrossEntropyLoss(Module):
    """torch's ``nn.CrossEntropyLoss``: ``loss(logits, targets)`` is
    :func:`tilegraph.cross_entropy` with this module's ``ignore_index``, ``reduction`` and
    ``label_smoothing``. The arguments bind in torch's order, but class weights (``weight``, torch's
    first) are refused with the op's TileError (which shows the weighted mean to write), and
    torch's deprecated ``size_average`` / ``reduce`` with one naming ``reduction``. As the op's,
    the classes are the LAST dim of the logits (torch's are dim 1 for inputs of more than 2 dims).
    """

    def __init__(self, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0):
        from tilegraph.ops.loss import _no_class_weights

        where = "tilegraph.nn.CrossEntropyLoss"
        _no_class_weights(weight)
        self.reduction = _reduction(where, reduction, size_average, reduce)
        if not is_int(ignore_index):
            raise TileError(where, "ignore_index must be an int", f"{ignore_index!r:.60}")
        if (isinstance(label_smoothing, (bool, np.bool_)) or not isinstance(label_smoothing, numbers.Real)
                or not 0 <= label_smoothing <= 1):
            raise TileError(where, "label_smoothing must be a number in [0, 1] (as torch's)", f"{label_smoothing!r:.60}")
        self.ignore_index = int(ignore_index)
        self.label_smoothing = float(label_smoothing)

    def forward(self, input: TileTensor, target) -> TileTensor:  # noqa: A002 - torch's names
        return ops.cross_entropy(input, target, self.ignore_index, self.reduction, self.label_smoothing)


class MSELoss(Module):
    """torch's ``nn.MSELoss(reduction="mean")``: ``loss(input, target)`` is
    :func:`tilegraph.mse_loss`; torch's deprecated ``size_average`` / ``reduce`` are refused with a
    TileError naming ``reduction``."""

    def __init__(self, size_average=None, reduce=None, reduction: str = "mean"):
        self.reduction = _reduction("tilegraph.nn.MSELoss", reduction, size_average, reduce)

    def forward(self, input: TileTensor, target) -> TileTensor:  # noqa: A002 - torch's names
        return ops.mse_loss(input, target, self.reduction)


def _linear_init(where: str, n_in: int, n_out: int, bias, seed, init_std, dtype):
    """A Linear's initial weight (n_in, n_out) and bias (or None), in float64: torch's uniform
    init, or N(0, init_std^2) weights and zero biases (the bias is drawn either way, so that the
    layers after it draw the same numbers whatever ``init_std`` is)."""
    init_std = _init_std(where, init_std, dtype)
    rng = _rng(seed, where)
    bound = 1.0 / math.sqrt(n_in)
    w = rng.uniform(-bound, bound, (n_in, n_out)) if init_std is None else rng.normal(0.0, init_std, (n_in, n_out))
    if not bias:
        return w, None
    b = rng.uniform(-bound, bound, n_out)
    return w, (b if init_std is None else np.zeros(n_out))


class Linear(Module):
    """``y = x @ weight + bias`` with ``weight`` stored (in, out); torch's default init.

    ``tile`` tiles both dims; ``out_tile`` (default: ``tile``) the output dim alone, e.g. a
    vocabulary projection whose output tile differs from the feature tile.

    ``grad_sketch`` ("gaussian", "rademacher", "rows", "dct" or "wta-crs"; None: exact) estimates
    the weight gradient from a sketch of the input with ``sketch_ratio * N`` of its N rows, kept
    instead of the input (randomized matmul, :mod:`tilegraph.ops.rmm`); ``sketch_seed`` is the
    base seed of the sketches, which change every step. The forward and dX stay exact.
    """

    grad_sketch: str | None = None  # class defaults: also for Linears made without __init__
    sketch_ratio: float = 0.2
    sketch_seed: int = 0

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tile=None, out_tile=None,
                 dtype=None, seed=None, init_std: float | None = None, grad_sketch: str | None = None,
                 sketch_ratio: float = 0.2, sketch_seed: int = 0):
        where = "tilegraph.nn.Linear"
        dtype = _check_layer(where, dtype, in_features=in_features, out_features=out_features)
        self.grad_sketch, self.sketch_ratio, self.sketch_seed = ops.rmm.check_grad_sketch(
            grad_sketch, sketch_ratio, sketch_seed, where)
        tile = _default("tile", tile)
        out_tile = tile if out_tile is None else out_tile
        w, b = _linear_init(where, in_features, out_features, bias, seed, init_std, dtype)
        self.weight = Parameter(w.astype(dtype, copy=False), (_fit(tile, in_features), _fit(out_tile, out_features)),
                                name="weight")
        self.bias = None if b is None else Parameter(b.astype(dtype, copy=False), (_fit(out_tile, out_features),),
                                                     name="bias")

    def reset_parameters(self, *, init_std: float | None = None, seed=None) -> None:
        """Draw the weight and bias again as the constructor does, keeping their tiles and dtype:
        ``init_std`` N(0, init_std^2) weights and zero biases (None: the :func:`defaults` block's,
        else torch's uniform init), from ``seed`` (an int, a Generator, or None: the block's, else
        fresh). E.g. GPT-2's smaller init of the projections into the residual stream, after the
        layers are built::

            for proj in (self.attn.o, self.mlp.fc2):
                proj.reset_parameters(init_std=0.02 / math.sqrt(2 * n_layers))

        Under :func:`deferred_init` nothing is drawn."""
        n_in, n_out = self.weight.shape
        w, b = _linear_init("tilegraph.nn.Linear.reset_parameters", n_in, n_out, self.bias is not None, seed,
                            init_std, self.weight.dtype)
        if _DEFERRED:
            return
        self.weight.assign(w.astype(self.weight.dtype, copy=False))
        if self.bias is not None:
            self.bias.assign(b.astype(self.bias.dtype, copy=False))

    def forward(self, x: TileTensor) -> TileTensor:
        x = fit_last_dim(x, self.weight, "tilegraph.nn.Linear", "in_features")
        if self.grad_sketch is not None:
            return ops.sketched_linear(x, self.weight, self.bias, sketch=self.grad_sketch, ratio=self.sketch_ratio,
                                       seed=self.sketch_seed)
        return ops.matmul(x, self.weight, bias=self.bias)


class Embedding(Module):
    """``weight[ids]``, weight (num_embeddings, dim) drawn from N(0, init_std^2) as torch's.

    ``padding_idx`` (torch's): that row starts as zeros and gets no gradient, so it stays as it is
    (a negative index counts from the end)."""

    padding_idx: int | None = None  # class default: also for Embeddings made without __init__

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None = None, *, tile=None,
                 vocab_tile=None, dtype=None, seed=None, init_std: float | None = None):
        where = "tilegraph.nn.Embedding"
        dtype = _check_layer(where, dtype, num_embeddings=num_embeddings, dim=dim)
        self.padding_idx = check_padding_idx(padding_idx, num_embeddings, where)
        tile = _default("tile", tile)
        w = self._draw(where, (num_embeddings, dim), dtype, init_std, seed)
        self.weight = Parameter(w, (_fit(vocab_tile, num_embeddings), _fit(tile, dim)), name="weight")

    def _draw(self, where: str, shape, dtype, init_std, seed) -> np.ndarray:
        w = _rng(seed, where).normal(0.0, _init_std(where, init_std, dtype, 1.0), shape).astype(dtype, copy=False)
        if self.padding_idx is not None and not _DEFERRED:
            w = np.array(w)  # writable (a deferred layer's zeros are a read-only broadcast)
            w[self.padding_idx] = 0
        return w

    def reset_parameters(self, *, init_std: float | None = None, seed=None) -> None:
        """Draw the weight again as the constructor does, keeping its tiles and dtype: N(0,
        init_std^2) (None: the :func:`defaults` block's, else 1, torch's), the ``padding_idx`` row
        zeros, from ``seed`` (None: the block's, else fresh). Under :func:`deferred_init` nothing
        is drawn."""
        w = self._draw("tilegraph.nn.Embedding.reset_parameters", self.weight.shape, self.weight.dtype, init_std, seed)
        if not _DEFERRED:
            self.weight.assign(w)

    def forward(self, ids: TileTensor) -> TileTensor:
        if is_array(ids):  # as torch's: an array of ids
            ids = from_numpy(ids)
        return ops.embedding(ids, self.weight, padding_idx=self.padding_idx)

    def unembed(self, x: TileTensor) -> TileTensor:
        """``x @ weight.T``: scores over the vocabulary with the same (tied) weight, (..., C) -> (..., V)."""
        return ops.matmul(x, self.weight, trans_b=True)


def _normalized_dim(dim, where: str):
    """torch's ``normalized_shape`` of one dim, ``(768,)``, as the int 768 (the norms normalise the last dim)."""
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            raise TileError(where, "a normalized_shape of one dim (the last: tilegraph's norms normalise over it "
                            "alone)", repr(dim))
        return dim[0]
    return dim


class LayerNorm(Module):
    """torch's ``nn.LayerNorm(normalized_shape, eps, elementwise_affine, bias)`` over the last dim
    (``elementwise_affine=False``: neither weight nor bias; ``bias=False``: a weight alone)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True, *, tile=None,
                 dtype=None):
        where = "tilegraph.nn.LayerNorm"
        dim = _normalized_dim(dim, where)
        dtype, tile = _check_layer(where, dtype, dim=dim), _default("tile", tile)
        for name, flag in (("elementwise_affine", elementwise_affine), ("bias", bias)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TileError(where, f"{name} must be a bool (torch's LayerNorm(normalized_shape, eps, "
                                "elementwise_affine, bias))", f"{name}={flag!r:.60}")
        self.eps, self.dim = eps, dim
        self.weight = Parameter(np.ones(dim, dtype), (_fit(tile, dim),), name="weight") if elementwise_affine else None
        self.bias = (Parameter(np.zeros(dim, dtype), (_fit(tile, dim),), name="bias") if bias and elementwise_affine
                     else None)

    def reset_parameters(self) -> None:
        """The weight back to ones and the bias to zeros (their init), keeping tiles and dtype."""
        _reset_norm(self)

    def forward(self, x: TileTensor) -> TileTensor:
        if self.weight is not None:
            x = fit_last_dim(x, self.weight, "tilegraph.nn.LayerNorm", "dim")
        elif is_array(x):
            x = from_numpy(x)
        return ops.layer_norm(x, (self.dim,) if self.weight is None else self.weight.shape, self.weight, self.bias,
                              eps=self.eps)


def _reset_norm(norm) -> None:
    """A norm's weight to ones and bias to zeros (nothing under :func:`deferred_init`)."""
    if _DEFERRED:
        return
    for p, fill in ((getattr(norm, "weight", None), 1), (getattr(norm, "bias", None), 0)):
        if p is not None:
            p.assign(np.full(p.shape, fill, p.dtype))


class RMSNorm(Module):
    """torch's ``nn.RMSNorm(normalized_shape, eps, elementwise_affine)`` over the last dim
    (``elementwise_affine=False``: no weight). The default ``eps`` is Llama's 1e-6, not torch's:
    torch's ``eps=None`` is the machine epsilon of the input's dtype (``np.finfo(dtype).eps``),
    and ``eps=None`` here is that too, so a ported ``nn.RMSNorm(dim)`` computes as torch's with
    ``RMSNorm(dim, eps=None)`` (``None`` was refused at the first forward)."""

    def __init__(self, dim: int, eps: float | None = 1e-6, elementwise_affine: bool = True, *, tile=None,
                 dtype=None):
        where = "tilegraph.nn.RMSNorm"
        dim = _normalized_dim(dim, where)
        dtype, tile = _check_layer(where, dtype, dim=dim), _default("tile", tile)
        if not isinstance(elementwise_affine, (bool, np.bool_)):
            raise TileError(where, "elementwise_affine must be a bool (torch's RMSNorm(normalized_shape, eps, "
                            "elementwise_affine))", f"elementwise_affine={elementwise_affine!r:.60}")
        self.eps, self.dim = eps, dim
        self.weight = Parameter(np.ones(dim, dtype), (_fit(tile, dim),), name="weight") if elementwise_affine else None

    def reset_parameters(self) -> None:
        """The weight back to ones (its init), keeping tiles and dtype."""
        _reset_norm(self)

    def forward(self, x: TileTensor) -> TileTensor:
        if self.weight is not None:
            x = fit_last_dim(x, self.weight, "tilegraph.nn.RMSNorm", "dim")
        elif is_array(x):
            x = from_numpy(x)
        # torch's eps=None: the machine epsilon of the input's dtype (a float one; an integer
        # input is refused by rms_norm as before)
        eps = self.eps
        if eps is None and isinstance(x, TileTensor) and np.dtype(x.dtype).kind == "f":
            eps = float(np.finfo(x.dtype).eps)
        return ops.rms_norm(x, self.weight, eps=eps)


class MLP(Module):
    """``fc2(act(fc1(x)))``; ``act`` is "gelu", "gelu_tanh", "relu" or "silu"."""

    def __init__(self, dim: int, hidden: int, act: str = "gelu", bias: bool = True, *, out_dim: int | None = None,
                 tile=None, dtype=None, seed=None, init_std: float | None = None):
        where = "tilegraph.nn.MLP"
        if act not in ("gelu", "gelu_tanh", "relu", "silu"):
            raise TileError(where, "act must be gelu, gelu_tanh, relu or silu", repr(act))
        dtype = _check_layer(where, dtype, dim=dim, hidden=hidden, **({} if out_dim is None else {"out_dim": out_dim}))
        rng, init_std = _rng(seed, where), _init_std(where, init_std, dtype)
        self.act = act
        self.fc1 = Linear(dim, hidden, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)
        self.fc2 = Linear(hidden, out_dim or dim, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)

    def forward(self, x: TileTensor) -> TileTensor:
        h = self.fc1(x)
        if self.act == "gelu_tanh":
            h = ops.gelu(h, approximate="tanh")
        else:
            h = getattr(ops, self.act)(h)
        return self.fc2(h)


class SwiGLU(Module):
    """Gated MLP of Llama: ``down(silu(gate(x)) * up(x))``, no biases by default."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, *, tile=None, dtype=None, seed=None,
                 init_std: float | None = None):
        where = "tilegraph.nn.SwiGLU"
        dtype = _check_layer(where, dtype, dim=dim, hidden=hidden)
        rng, init_std = _rng(seed, where), _init_std(where, init_std, dtype)
        self.gate = Linear(dim, hidden, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)
        self.up = Linear(dim, hidden, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)
        self.down = Linear(hidden, dim, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)

    def forward(self, x: TileTensor) -> TileTensor:
        return self.down(ops.silu(self.gate(x)) * self.up(x))


class CausalSelfAttention(Module):
    """Multi-head causal self-attention with optional grouped-query heads and rotary embeddings.

    Activations are (B, T, C); the feature tile ``tile`` must hold whole heads (a multiple of
    ``dim // n_heads``) so that splitting C into (heads, head_dim) moves no data between tiles.
    ``dropout`` (torch's ``nn.MultiheadAttention`` name; HF's ``attn_pdrop``) drops attention
    weights in training (``self.training``), as ``scaled_dot_product_attention(dropout_p=...)``
    does (inside the attention kernels where T is one tile, the models' default).
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, bias: bool = True,
                 rope: bool = False, rope_base: float = 10000.0, tile=None, dtype=None, seed=None,
                 init_std: float | None = None, dropout: float = 0.0):
        from tilegraph.ops.dropout import check_dropout

        where = f"tilegraph.nn.{type(self).__name__}"
        self.dropout = check_dropout(dropout, where)
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        dtype = _check_layer(where, dtype, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads)
        if dim % n_heads:
            raise TileError(where, "n_heads must divide dim", f"dim={dim}, n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise TileError(where, "n_kv_heads must divide n_heads", f"n_heads={n_heads}, n_kv_heads={n_kv_heads}")
        self.head_dim = dim // n_heads
        block = " (the tile of the tilegraph.nn.defaults() block in force; tile= given here wins)" \
            if tile is None and _default("tile", None) is not None else ""
        tile = _default("tile", tile)
        if tile is not None and not is_int(tile, 1):
            raise TileError(where, "tile must be a positive int (a multiple of the head dim) or None",
                            f"tile={tile!r} ({type(tile).__name__})")
        if tile is not None and tile % self.head_dim:
            raise TileError(where, f"the feature tile must hold whole heads (a multiple of {self.head_dim})",
                            f"tile={tile}{block}")
        rng, init_std = _rng(seed, where), _init_std(where, init_std, dtype)
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.rope, self.rope_base = rope, rope_base
        # The kv width is a whole number of heads, so its tiles (a multiple of head_dim, or the
        # whole width when the tile is larger) hold whole heads too.
        kv = n_kv_heads * self.head_dim
        self.q = Linear(dim, dim, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)
        self.k = Linear(dim, kv, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)
        self.v = Linear(dim, kv, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)
        self.o = Linear(dim, dim, bias, tile=tile, dtype=dtype, seed=rng, init_std=init_std)

    def _heads(self, x: TileTensor, n: int) -> TileTensor:
        b, t, _ = x.shape
        return ops.transpose(ops.reshape(x, (b, t, n, self.head_dim)), 1, 2)  # (B, n, T, hd)

    def _check_input(self, x, where: str) -> None:
        if not isinstance(x, TileTensor) or x.ndim != 3 or x.shape[2] != self.n_heads * self.head_dim:
            raise TileError(where, f"x must be a (B, T, C) TileTensor with C = {self.n_heads * self.head_dim} "
                            "(the layer's dim)", f"shape {x.shape}" if isinstance(x, TileTensor) else type(x).__name__)

    def _qkv(self, x: TileTensor) -> tuple[TileTensor, TileTensor, TileTensor]:
        """The heads of the queries (B, H, T, hd), keys and values (B, Hkv, T, hd) of ``x``."""
        return (self._heads(self.q(x), self.n_heads), self._heads(self.k(x), self.n_kv_heads),
                self._heads(self.v(x), self.n_kv_heads))

    def _rope(self, q: TileTensor, k: TileTensor, start: int = 0) -> tuple[TileTensor, TileTensor]:
        if not self.rope:
            return q, k
        return (ops.rope(q, base=self.rope_base, position_offset=start),
                ops.rope(k, base=self.rope_base, position_offset=start))

    def _out(self, y: TileTensor) -> TileTensor:
        """The heads' outputs (B, H, T, hd) merged to (B, T, C), then the output projection."""
        b, _, t, _ = y.shape
        return self.o(ops.reshape(ops.transpose(y, 1, 2), (b, t, self.n_heads * self.head_dim)))

    def forward(self, x: TileTensor, cache: "KVCache | None" = None) -> TileTensor:
        """``x`` (B, T, C) -> (B, T, C). With a ``cache``, x holds the positions after the
        ``cache.length`` ones already in it: their keys and values are appended to the cache and
        the queries attend to all of them (decoding; the earlier positions are not recomputed)."""
        self._check_input(x, "tilegraph.nn.CausalSelfAttention")
        if cache is not None and not isinstance(cache, KVCache):
            hint = (" (it takes no mask: tg.nn.SelfAttention(dim, heads, causal=True) takes attn_mask= and "
                    "padding_mask=)" if isinstance(cache, TileTensor) or is_array(cache) else "")
            got = (f"{type(cache).__name__} of shape {tuple(cache.shape)}" if hint else f"cache={cache!r:.60}")
            raise TileError("tilegraph.nn.CausalSelfAttention", f"cache must be a tilegraph.nn.KVCache or None{hint}",
                            got)
        b, t, c = x.shape
        start = 0 if cache is None else cache.length
        q, k, v = self._qkv(x)
        if cache is not None and cache.position is not None:   # one position, held in a tile (a replayed step)
            return self.o(self._at_position(q, k, v, cache, b, c))
        q, k = self._rope(q, k, start)
        if cache is not None:
            k, v = cache.append(k, v)                                   # (B, Hkv, start + T, hd)
        return self._out(ops.scaled_dot_product_attention(q, k, v, dropout_p=self._dropout_p(), is_causal=True,
                                                          q_offset=start))  # (B, H, T, hd)

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _at_position(self, q, k, v, cache: "KVCache", b: int, c: int) -> TileTensor:
        """Attention of one new position whose index is the value of ``cache.position`` (so that
        the recorded graph serves the next position too): RoPE, the cache write and the key range
        read it from that tile."""
        from tilegraph.ops.attention import sdpa_at
        from tilegraph.ops.rope import rope_at

        if q.shape[2] != 1:
            raise TileError("tilegraph.nn.CausalSelfAttention", "a cache with a position tile takes one new "
                            "position per call", f"{q.shape[2]} positions")
        if self._dropout_p():
            raise TileError("tilegraph.nn.CausalSelfAttention", "a cache with a position tile (decoding) in "
                            "evaluation mode: attention dropout applies in training only (record it under "
                            "tg.nn.training(False) or call model.eval())", f"dropout={self.dropout:g}, training")
        if self.rope:
            q = rope_at(q, cache.position, self.rope_base)
            k = rope_at(k, cache.position, self.rope_base)
        k, v = cache.write(k, v)
        y = sdpa_at(q, k, v, cache.position)                            # (B, H, 1, hd)
        return ops.reshape(ops.transpose(y, 1, 2), (b, 1, c))


class SelfAttention(CausalSelfAttention):
    """Multi-head self-attention that is not causal unless ``causal=True`` (an encoder's, as BERT's),
    with the masks of an encoder: ``attn(x, padding_mask=m)`` with ``m`` (B, T), True or 1 for a
    real token and False or 0 for padding (a tokenizer's ``attention_mask``): no query attends to
    padding. ``attn_mask=`` is torch's SDPA mask (bool, True where a query attends to a key, or
    float, added to the scores; broadcasting to (B, H, T, T)); given both, both apply. Parameters
    as :class:`CausalSelfAttention` (grouped-query heads too, with masks or not). The masks are
    NumPy arrays or TileTensors (a step's inputs).

    >>> import numpy as np, tilegraph as tg
    >>> attn = tg.nn.SelfAttention(8, 2, seed=0)
    >>> x = np.ones((2, 3, 8), np.float32)
    >>> attn(tg.from_numpy(x), padding_mask=np.array([[1, 1, 1], [1, 1, 0]])).shape
    (2, 3, 8)
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *, causal: bool = False,
                 bias: bool = True, rope: bool = False, rope_base: float = 10000.0, tile=None, dtype=None, seed=None,
                 init_std: float | None = None, dropout: float = 0.0):
        if not isinstance(causal, (bool, np.bool_)):
            raise TileError("tilegraph.nn.SelfAttention", "causal must be a bool",
                            f"{causal!r} ({type(causal).__name__})")
        super().__init__(dim, n_heads, n_kv_heads, bias=bias, rope=rope, rope_base=rope_base, tile=tile, dtype=dtype,
                         seed=seed, init_std=init_std, dropout=dropout)
        self.causal = bool(causal)

    def forward(self, x: TileTensor, attn_mask=None, padding_mask=None) -> TileTensor:
        """``x`` (B, T, C) -> (B, T, C), with the masks above."""
        where = "tilegraph.nn.SelfAttention"
        self._check_input(x, where)
        q, k, v = self._qkv(x)   # (first: a wrong dtype of x is named as such, not as the mask's)
        mask = _with_padding(attn_mask, padding_mask, x.shape[0], x.shape[1], where, self.n_heads, q.dtype)
        q, k = self._rope(q, k)
        return self._out(ops.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self._dropout_p(),
                                                          is_causal=self.causal))


def _aligned_tiles(shape: tuple, ref: TileTensor) -> tuple:
    """Tiles for a mask of ``shape`` that broadcasts against the mask ``ref`` (dims aligned from the
    right): ``ref``'s tiles where both have the same size past one, the whole dim elsewhere."""
    lead = len(shape) - ref.ndim
    return tuple(tuple(ref.chunks[i - lead]) if n > 1 and 0 <= i - lead and ref.shape[i - lead] == n else None
                 for i, n in enumerate(shape))


def _with_padding(attn_mask, padding_mask, b: int, t: int, where: str, heads: int, dtype: np.dtype):
    """``attn_mask`` with the keys that ``padding_mask`` (B, T) marks as padding masked out: a bool
    (B, 1, 1, T) mask where there is no ``attn_mask``; else both, as a bool or float mask. The
    ``attn_mask`` is checked first, as scaled_dot_product_attention checks it (for scores (B,
    ``heads``, T, T) of ``dtype``): what it refuses alone is refused with a padding mask too."""
    if padding_mask is None:
        return attn_mask
    if isinstance(padding_mask, TileTensor):
        ok = padding_mask.shape == (b, t) and padding_mask.dtype.kind in "biu"
        keep = padding_mask if padding_mask.dtype.kind == "b" else padding_mask.gt(0)
        keep = ops.reshape(keep, (b, 1, 1, t)) if ok else None
    else:
        arr = np.asarray(padding_mask) if is_array(padding_mask) or isinstance(padding_mask, (list, tuple)) else None
        ok = arr is not None and arr.shape == (b, t) and arr.dtype.kind in "biu"
        keep = (arr != 0)[:, None, None, :] if ok else None
    if not ok:
        got = (f"shape {tuple(padding_mask.shape)}, dtype {padding_mask.dtype}" if hasattr(padding_mask, "dtype")
               else type(padding_mask).__name__)
        raise TileError(where, f"padding_mask must be (B, T) = ({b}, {t}) bool or 0/1 integers (True or 1: a real "
                        "token), a NumPy array or a TileTensor", got)
    if attn_mask is None:
        return keep
    from tilegraph.ops.attention_masked import check_mask, numpy_float_mask

    # (combined, an int or list mask became a float one, a bad shape a raw NumPy error, ...)
    check_mask(attn_mask, dtype, (b, heads, t, t), where, f", for {heads} heads and x of (B, T) = ({b}, {t})")
    if isinstance(attn_mask, np.ndarray) and isinstance(keep, np.ndarray):
        return (attn_mask & keep) if attn_mask.dtype.kind == "b" else np.where(keep, attn_mask, -np.inf)
    # one of them is a TileTensor: both become TileTensors, with the same tiles where they meet
    if isinstance(attn_mask, TileTensor):
        if isinstance(keep, TileTensor):
            keep = ops.rechunk(keep, tuple(w if w is not None else c
                                           for w, c in zip(_aligned_tiles(keep.shape, attn_mask), keep.chunks)), where)
        else:
            keep = from_numpy(np.ascontiguousarray(keep), _aligned_tiles(keep.shape, attn_mask))
    else:
        if attn_mask.dtype.kind == "f":  # (as a NumPy mask alone is cast, in masked_attention)
            attn_mask = numpy_float_mask(attn_mask, np.dtype(dtype))
        attn_mask = from_numpy(np.ascontiguousarray(attn_mask), _aligned_tiles(attn_mask.shape, keep))
    if attn_mask.dtype.kind == "b":
        return ops.logical_and(attn_mask, keep)
    return ops.where(keep, attn_mask, -np.inf)


class KVCache:
    """Keys and values (B, Hkv, S, hd) of the positions one attention layer has seen, for decoding.

    ``CausalSelfAttention(x, cache)`` appends the keys and values of ``x`` (see
    :func:`tilegraph.ops.attention.kv_cache_append`: past tiles are reused, only the last one
    grows up to ``block`` rows) and leaves them symbolic. After the graph ran, :meth:`store` turns
    the computed tiles (:meth:`pending`) into leaf cells holding their values, arrays or
    references to values left on the workers, so the next step reads them where they are.

    With :attr:`position` set (a one-tile (1,) int64 TileTensor holding :attr:`length`), a call
    takes one position and writes it into a last tile with room for ``block`` rows
    (:func:`tilegraph.ops.attention.kv_cache_write`), so that the graph recorded for one position
    runs again for the next ones of that tile (:class:`tilegraph.models.Decoder` does so).

    >>> import numpy as np, tilegraph as tg
    >>> attn = tg.nn.CausalSelfAttention(8, 2, seed=0)
    >>> cache = tg.nn.KVCache()
    >>> y = attn(tg.from_numpy(np.ones((1, 3, 8), np.float32)), cache)
    >>> cache.length, len(cache.pending())
    (3, 2)
    """

    def __init__(self, block: int = 64):
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
            raise TileError("tilegraph.nn.KVCache", "block must be a positive int", repr(block))
        self.block = int(block)
        self.k: TileTensor | None = None
        self.v: TileTensor | None = None
        #: positions written where k and v have room for more (None: all of k's positions)
        self._written: int | None = None
        #: the position of the next call, as a one-tile (1,) int64 TileTensor, or None (see above)
        self.position: TileTensor | None = None

    @property
    def length(self) -> int:
        """Positions held (S)."""
        if self._written is not None:
            return self._written
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: TileTensor, v: TileTensor) -> tuple[TileTensor, TileTensor]:
        """Append new keys and values (B, Hkv, T, hd); returns all of them, (B, Hkv, S + T, hd)."""
        from tilegraph.ops.attention import kv_cache_append, kv_cache_rows

        if self._written is not None:  # a last tile with room: cut to what it holds first
            self.k, self.v = kv_cache_rows(self.k, self._written), kv_cache_rows(self.v, self._written)
            self._written = None
        self.k = kv_cache_append(self.k, k, self.block)
        self.v = kv_cache_append(self.v, v, self.block)
        return self.k, self.v

    def write(self, k: TileTensor, v: TileTensor) -> tuple[TileTensor, TileTensor]:
        """Write one new position's keys and values (B, Hkv, 1, hd) at :attr:`position`; returns
        the cache with room, (B, Hkv, S', hd) with S' past the position (see above)."""
        from tilegraph.ops.attention import kv_cache_write

        n = self.length
        self.k = kv_cache_write(self.k, k, self.position, n, self.block)
        self.v = kv_cache_write(self.v, v, self.position, n, self.block)
        self._written = n + 1
        return self.k, self.v

    def pending(self) -> list[TileRef]:
        """Tiles of k, then v, that are still to be computed (not leaves), in grid order."""
        return [r for t in (self.k, self.v) if t is not None for r in t.grid.flat if not r.node.is_leaf]

    def store(self, values) -> None:
        """Replace the :meth:`pending` tiles by leaf cells holding ``values`` (one per tile, same order)."""
        values = iter(values)
        for name in ("k", "v"):
            t = getattr(self, name)
            if t is None:
                continue
            grid = np.empty(t.tiling.grid, dtype=object)
            for idx, r in zip(np.ndindex(*t.tiling.grid), t.grid.flat):
                grid[idx] = r if r.node.is_leaf else leaf(Cell(next(values), r.shape, r.dtype))
            setattr(self, name, TileTensor(t.tiling, t.dtype, grid, name=f"cache.{name}"))

    def rewritten_cells(self) -> list[Cell] | None:
        """Where each :meth:`pending` tile was written over a cache tile of its own shape (a write
        at a :attr:`position` into a tile with room), the cells of those old tiles, in the same
        order: a step that stores its results back into them (:meth:`store_into`) can run again
        for the next position. None otherwise."""
        cells = []
        for r in self.pending():
            ins = r.node.inputs
            if r.node.kernel.name != "kv_cache_write" or len(ins) != 3 or not ins[0].node.is_leaf \
                    or ins[0].shape != r.shape:
                return None
            cells.append(ins[0].node.cell)
        return cells

    def store_into(self, cells: list[Cell], values) -> None:
        """Store the :meth:`pending` tiles' ``values`` into ``cells`` (:meth:`rewritten_cells`),
        which become the cache's tiles again."""
        _fill(cells, values)
        for name in ("k", "v"):
            t = getattr(self, name)
            grid = np.empty(t.tiling.grid, dtype=object)
            for idx, r in zip(np.ndindex(*t.tiling.grid), t.grid.flat):
                grid[idx] = r if r.node.is_leaf else r.node.inputs[0]
            setattr(self, name, TileTensor(t.tiling, t.dtype, grid, name=f"cache.{name}"))

    def advance(self, cells: list[Cell], values) -> None:
        """A replayed step's results: the tiles it rewrote, ``values``, into ``cells``, which
        already are the cache's tiles (:meth:`store_into` made them so); one position more written."""
        _fill(cells, values)
        self._written += 1


def _fill(cells: list[Cell], values) -> None:
    for cell, value in zip(cells, values):
        cell.set(value)


from tilegraph.peft import LoRALinear  # noqa: E402,F401 - tg.nn.LoRALinear; it lives with apply_lora
