"""The training loop: ``tilegraph.Trainer(model, optimizer, data, runtime).fit(steps)``.

One :class:`~tilegraph.TrainStep` per optimizer step (forward, backward and update as one Dask
graph, recorded once and replayed), with gradient accumulation, a progress bar (loss, tokens/s
or samples/s, ETA), a JSONL metrics log, a loss-curve PNG, evaluation on held-out data and
checkpoints.

``data`` is either a token dataset (:class:`tilegraph.io.TokenDataset`: a batch is the start
offsets of its windows, read on the workers; the loss defaults to the next-token cross-entropy of
``model(inputs)``) or any callable ``data(step) -> tuple of arrays`` used with ``loss_fn(model,
*tensors)``, called with the optimizer step's number, counted from 1 (:class:`Trainer`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from tilegraph import _config
from tilegraph._config import config, is_int, require_int
from tilegraph._errors import TileError
from tilegraph._fit import FitResult, FitRun, perplexity  # noqa: F401 (perplexity: tilegraph.trainer's too)
from tilegraph._lower import WATCH_SECONDS
from tilegraph._tensor import Default
from tilegraph.runtime import _plural
from tilegraph._health import (EVAL_LENT_HINT, LOST_STATE, LOST_STATE_HINT, STALL_SECONDS, StepTimeoutError,
                               WorkerHealth, WorkerLostError, _steps_text, lost_worker_error, translate_worker_failure,
                               worker_health)
from tilegraph._train import EvalStep, TrainStep, check_step_arguments, wait_for_replacements
from tilegraph._progress import _matplotlib_imported, _tensorboard, _tensorboard_write

__all__ = ["Trainer", "FitResult", "lm_loss", "WorkerLostError", "StepTimeoutError", "NonFiniteLossError"]

#: ``step_timeout="auto"``: a graph may run this many times the slowest recent step's wall time
#: (per step of the graph) before the workers are checked...
STEP_TIMEOUT_FACTOR = 10.0
#: ...and at least this long (a step of a few milliseconds waits behind the previous graph, the
#: client's recording, a busy machine)
STEP_TIMEOUT_MIN = 10.0
#: the first graph of a plan records, plans and compiles its kernels with Numba on every worker
#: (debug GPT-2 on 2 cores: ~10 s with an empty Numba cache): it gets at least this long, with
#: any ``step_timeout``
FIRST_GRAPH_SECONDS = 60.0
#: during :meth:`Trainer.fit`, ``loss.png`` is redrawn at an evaluation only once this many times
#: the last drawing's seconds have passed since it (at most ~5% of the run goes to drawing; the
#: end of the fit always draws). Drawing took 0.15-0.25 s on 2 cores (0.4 s the first time, with
#: matplotlib's import): `tilegraph train`'s three evaluations in a 3.5 s run cost it 15%.
PLOT_INTERVAL_FACTOR = 20.0
#: what the first drawing is taken to cost, before one was timed
PLOT_SECONDS_GUESS = 0.3
#: ``restart_on_failure=True``: restarts allowed in one fit
MAX_RESTARTS = 3
#: after a loss, how long a restart waits for at least one answering worker (a nanny's
#: replacement for a killed worker joined within ~1 s on 2 cores)
RESTART_WAIT_SECONDS = 30.0

logger = logging.getLogger("tilegraph")

#: what a trainer whose runtime was closed needs, after connecting again: a Trainer is bound to its
#: runtime (its values lived on that cluster's workers), so a new connection alone changed nothing
_REBUILD = ("build the model, optimizer and a Trainer on the new runtime (Trainer(..., runtime=rt)), and "
            "trainer.load_checkpoint(...) to go on from a checkpoint: this Trainer stays bound to the closed one")

#: ``Trainer(batch_size=...)`` when not given: 8 rows for a token dataset; a callable data's batch
#: size is then the rows of the first batch it returns (told apart from an explicit ``batch_size=8``)
BATCH_SIZE = Default(8)


def lm_loss(model, inputs, targets):
    """Mean next-token cross-entropy of ``model(inputs)`` (logits (B, T, V)) against ``targets``."""
    from tilegraph.ops import cross_entropy

    return cross_entropy(model(inputs), targets)


class NonFiniteLossError(TileError, FloatingPointError):
    """A training loss became NaN or inf (:meth:`Trainer.fit`): says the step, that its update
    was applied already, and how to go on (``received``: "loss became nan at step N")."""


class Trainer:
    """Train ``model`` with ``optimizer`` on ``data``.

    - ``batch_size``: sequences (rows) per optimizer step; with ``accum_steps=k`` they run as k
      micro-batches whose gradients are summed on the workers before the update. With a callable
      ``data``, its batches are trained as returned: ``batch_size`` may be left out (it is then
      the rows of the first batch, None until the first fit reads it); given, it must match them
      (checked on the first batch, before any step). A batch whose rows do not divide by k (the
      short last batch of an epoch, 10 rows with k=4) runs as micro-batches of unequal rows (3, 3,
      2, 2), each weighted by its rows: the update is that of the whole batch
      (:class:`TrainStep`). A token dataset's ``batch_size`` must be a multiple of k.
    - ``eval_data`` / ``eval_every`` / ``eval_batches``: validation loss every that many steps
      (and at the end) over that many batches of ``eval_data``.
    - How a callable ``data`` and ``eval_data`` are called: ``data(step)`` with the number of the
      optimizer step the batch trains, counted from 1 as the progress, ``metrics.jsonl`` and the
      checkpoints count them: a first ``fit(3)`` calls ``data(1)``, ``data(2)``, ``data(3)``, a
      second ``fit(3)`` goes on with ``data(4)``..``data(6)``, and a trainer resumed from the
      checkpoint of step 3 (:meth:`load_checkpoint`) calls ``data(4)`` next, as the
      uninterrupted run did. Each step's batch is asked for once, in order. Batch ``k`` (from 0)
      of arrays of ``n`` rows in batches of ``B`` is thus ``X[(step - 1) * B:step * B]``, and an
      epoch has ``n // B`` steps (``k = (step - 1) % (n // B)`` for several epochs): a batch with
      no rows is refused naming the step, and an IndexError of ``data(step)`` gets a note of this
      numbering. ``eval_data(i)`` is called with the batch index ``i = 0 .. eval_batches - 1``
      at every evaluation (the same held-out batches each time, not a step number).
    - The rate: ``tokens_per_s`` in ``metrics.jsonl`` (``tok_s`` in the progress,
      :attr:`FitResult.tokens_per_s`) where the batches are tokens (a token dataset, or a callable
      whose first array, the model's input, holds integer ids of two or more dims, (B, T): B x T
      tokens); for other data (float features (B, D), images) ``samples_per_s``, the rows (the
      first dim of the first array) per second (:attr:`FitResult.samples_per_s`).
    - ``perplexity``: whether the validation loss is shown and logged (``val_ppl``) with its
      perplexity ``exp(loss)``, which means something only for a language model's token-level
      cross-entropy. ``None`` (default): for a token dataset, and for a callable whose batches'
      first array (the input) and last array (the targets) are integer token ids of one shape
      (B, T) (one integer (B, T) array alone counts: a loss that shifts it itself); not for float
      features, class labels (B,) or regression targets. ``True`` / ``False`` say it outright
      (a model taking float embeddings of a sequence, say).
    - ``log_dir``: writes ``metrics.jsonl`` (one JSON object per step and per evaluation) and
      ``loss.png`` (the loss curve, redrawn at the end and at evaluations, those at least 20
      times the last drawing's time apart: drawing never takes more than ~5% of a run).
    - ``checkpoint_every`` / ``checkpoint_dir``: a Zarr checkpoint (:mod:`tilegraph.io.zarr`:
      weights, optimizer state, step, LR schedule) ``checkpoint_dir/step-NNNNNN`` every that many
      steps and at the end; ``checkpoint_keep`` keeps only the newest that many; with
      ``async_checkpoint`` (default) the workers write while training goes on (the values are
      those of the step; the end of :meth:`fit` waits for the last write; with
      ``restart_on_failure`` each save is waited for). ``checkpoint_files``
      (name -> bytes, e.g. a tokenizer) go into every checkpoint before its commit.
      ``on_checkpoint`` hooks are called with ``(trainer, path)`` once each is committed.
    - ``log_dir`` and ``checkpoint_dir`` are made when missing and checked to be writable here
      (an empty file of a unique name is created in each and removed), not at their first write.
      :meth:`fit` holds them while it runs (a ``.tilegraph.lock`` file in each, naming the
      process, as ``tilegraph train`` locks its run folder): a fit of another live process (or
      another trainer of this one still fitting, in another thread) there is refused at once,
      naming it and its pid and host; a lock whose process is gone is taken over. The lock goes
      when the fit ends, however it ends, so a Trainer built again on the same folders (a
      notebook cell run again) fits there.
    - ``on_step`` hooks are called with ``(trainer, stats)`` after each step. What a hook does to
      the run (an early stop, :meth:`request_stop`; a new ``optimizer.schedule`` or setting) takes
      effect after the steps already submitted: those of the hook's graph (``steps_per_graph``: a
      small model's ``"auto"`` may hold every step of the fit) and, with ``pipeline``, the next
      graph's. For it to act right after the step the hook saw, as in a torch loop (a ``break``),
      give ``steps_per_graph=1, pipeline=False``.
    - ``steps_per_graph``: optimizer steps recorded and submitted as one graph
      (:meth:`TrainStep.submit_steps`). ``"auto"`` (default) takes several when a step's
      estimated time is short (a small model's step is shorter than Dask's per-task latency)
      and 1 for larger models or with accumulation. Groups end at evaluation and checkpoint
      steps; their losses arrive together when the group has run.
    - ``pipeline``: submit step (or group) i+1 before waiting for i's loss, so consecutive graphs
      overlap Dask's round trip (on steps with an evaluation or a checkpoint the loop waits).
      Hooks then run while the next step is already under way: its update may already be in
      the parameters; ``pipeline=False`` runs strictly one graph at a time.
    - ``progress``: a tqdm bar on a terminal and in Jupyter (``tqdm.auto``: a widget where
      ipywidgets is installed); when stderr is a file or a pipe, a plain line every
      ``PROGRESS_LOG_SECONDS`` instead, whose rate is that of the steps since the line before.
      ``progress=False`` leaves the bar out, not the results: each evaluation's line ("step 20:
      loss ..., validation loss ...") and the notes of a stop or an interrupt still print.
    - ``tensorboard``: also write every metric to TensorBoard (tensorboardX, or torch with
      tensorboard): ``True`` under ``log_dir/tensorboard``, or a folder. Checked here: without
      the package, the Trainer is refused with what to install.
    - ``performance_report``: a path: the Dask performance report (HTML: task stream, worker
      profiles, bandwidth) of the graph holding step ``report_step`` (default: the fit's second
      graph, after the first one recorded, planned and compiled; its first where it has one
      graph). A ``report_step`` outside the fit's steps is a warning (no report). The workers'
      profiler (off on tilegraph's clusters) samples their tasks for that graph only, so the
      report's profile tab shows where their time went; it is off again after it. Writing the
      report does not count in the fit's time. :attr:`FitResult.kernel_seconds` tells the time
      per model part, which Dask cannot see inside a task.

    - ``step_timeout``: how long a step may run (seconds; a graph of k steps: k times that).
      ``"auto"`` (default): ten times the slowest recent step, at least 10 s. When it passes,
      the workers are checked: one that left or stopped answering the scheduler's heartbeats
      for 10 s (stopped, hung) ends training with a :class:`WorkerLostError` naming it and the
      steps; while every worker answers, ``"auto"`` waits on and a number raises
      :class:`StepTimeoutError`. ``None``: no limit, while the workers are still checked every
      ``WATCH_SECONDS`` (2 s): one silent for 10 s ends training as above, never a wait for
      Dask's worker-ttl (a minute on the embedded cluster, 5 by default). The first graph of a
      plan (recording, Numba compilation on the workers) gets at least ``FIRST_GRAPH_SECONDS``.
      A worker that dies ends training at once with a WorkerLostError, whatever
      ``step_timeout``.
    - ``restart_on_failure``: on a lost worker, reload the last checkpoint this trainer wrote
      (or loaded), plan again on the workers left (a stalled worker is restarted through its
      nanny first) and go on from the checkpoint's step; ``True`` allows ``MAX_RESTARTS``
      restarts per fit, an int that many. Needs ``checkpoint_dir`` (and ``checkpoint_every``
      for checkpoints before the end). The steps after the checkpoint run again (their
      records then appear twice in ``metrics.jsonl``, around a ``"restart"`` record);
      :attr:`FitResult.losses` and ``val_losses`` keep the rerun's. Without it, or with no checkpoint
      yet, the WorkerLostError ends the fit.

    A loss that becomes NaN/inf stops training with a :class:`NonFiniteLossError` (a
    FloatingPointError) naming the step (the metrics of the steps before it are on disk): the
    step's update is in the weights already, so it names the newest checkpoint from before the
    loss went bad to reload (:meth:`load_checkpoint`, then a lower ``optimizer.schedule``).
    :meth:`load_checkpoint` warns when the checkpoint's run had another ``batch_size``,
    ``accum_steps`` or data seed (its next batches are then other windows than that run's).
    """

    def __init__(self, model, optimizer, data, runtime=None, *, batch_size: int = BATCH_SIZE,
                 loss_fn: Callable | None = None, accum_steps: int = 1, eval_data=None, eval_every: int = 0,
                 eval_batches: int = 4, perplexity: bool | None = None,
                 log_dir: str | os.PathLike | None = None, checkpoint_every: int = 0,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_keep: int | None = None,
                 async_checkpoint: bool = True, checkpoint_files: Mapping[str, bytes] | None = None,
                 progress: bool = True, tensorboard: bool | str | os.PathLike = False,
                 on_step: Sequence[Callable] = (), on_checkpoint: Sequence[Callable] = (),
                 batch_tiles: Sequence | None = None, pipeline: bool = True, steps_per_graph: int | str = "auto",
                 performance_report: str | os.PathLike | None = None, report_step: int | None = None,
                 step_timeout: float | str | None = "auto", restart_on_failure: bool | int = False,
                 **compile_options):
        where = "tilegraph.Trainer"
        check_step_arguments(where, model, optimizer, lm_loss if loss_fn is None else loss_fn, batch_tiles, runtime,
                             compile_options)
        require_int(where, "accum_steps", accum_steps, 1)
        require_int(where, "eval_every", eval_every, 0)
        require_int(where, "eval_batches", eval_batches, 1)
        _check_data(where, model, data, eval_data)
        if eval_every and eval_data is None:
            raise TileError(where, "eval_every evaluates on eval_data: give an eval_data, or eval_every=0",
                            f"eval_every={eval_every!r}, eval_data=None")
        on_step, on_checkpoint = _hooks(where, "on_step", on_step), _hooks(where, "on_checkpoint", on_checkpoint)
        # (NumPy's integers too, as for accum_steps: np.int64(2) was refused as not "an int >= 1")
        if not (isinstance(steps_per_graph, str) and steps_per_graph == "auto" or is_int(steps_per_graph, 1)):
            raise TileError(where, "steps_per_graph must be 'auto' or an int >= 1", repr(steps_per_graph))
        steps_per_graph = steps_per_graph if isinstance(steps_per_graph, str) else int(steps_per_graph)
        if steps_per_graph != "auto" and steps_per_graph > 1 and accum_steps > 1:
            raise TileError(where, "steps_per_graph > 1 does not combine with accum_steps > 1",
                            f"steps_per_graph={steps_per_graph}, accum_steps={accum_steps}")
        # flags: a truthy string ("no", "False" from a config) or a number would count as True
        for name, value in (("pipeline", pipeline), ("progress", progress), ("async_checkpoint", async_checkpoint)):
            if not isinstance(value, (bool, np.bool_)):
                raise TileError(where, f"{name} must be True or False", f"{name}={_short_repr(value)}")
        if perplexity is not None and not isinstance(perplexity, (bool, np.bool_)):
            raise TileError(where, "perplexity must be None (a language model's data: token ids), True or False",
                            f"perplexity={_short_repr(perplexity)}")
        if performance_report is not None and (not isinstance(performance_report, (str, os.PathLike))
                                               or isinstance(performance_report, str) and not performance_report):
            raise TileError(where, "performance_report must be a file path (a non-empty str or os.PathLike) or None",
                            f"performance_report={_short_repr(performance_report)}")
        if report_step is not None:
            require_int(where, "report_step (None: the fit's second step)", report_step, 1)
            if performance_report is None:  # taken and never used, without a word
                raise TileError(where, "report_step picks the step of performance_report: give a "
                                "performance_report path too", f"report_step={report_step!r}, performance_report=None")
            report_step = int(report_step)
        # a callable data's batches are what it returns: batch_size, when given, is checked against
        # the first one (fit); when not, it is taken from it (None until then), so that the
        # checkpoints' trainer state says the batch size trained on, not an unused default of 8
        self._batch_size_given = not isinstance(batch_size, Default)
        if not self._batch_size_given:
            batch_size = batch_size.value if _is_token_data(data) else None
        if is_int(batch_size):  # NumPy's integers too, as for accum_steps
            batch_size = int(batch_size)
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):  # (True trained 1 row)
            raise TileError(where, "batch_size must be an int >= 1 (the rows of a step's batch)",
                            f"batch_size={batch_size!r}")
        # a callable data's batches of rows that do not divide by accum_steps run as micro-batches
        # of unequal rows (TrainStep._micro_batches); a token dataset's evaluation batches are its
        # micro-batches' windows, batch_size / accum_steps, and so are its row tiles
        if batch_size is not None and _is_token_data(data) and batch_size % accum_steps:
            near = [m for m in (batch_size // accum_steps * accum_steps, -(-batch_size // accum_steps) * accum_steps)
                    if m]
            raise TileError(where, "batch_size must be a multiple of accum_steps for a token dataset (its "
                            "micro-batches, and evaluation batches, are of batch_size / accum_steps windows): "
                            f"batch_size={' or '.join(map(str, near))}, or another accum_steps",
                            f"batch_size={batch_size!r}, accum_steps={accum_steps!r}")
        if batch_size is not None and eval_data is not None and _is_token_data(eval_data) \
                and eval_data.num_eval_windows < batch_size // accum_steps:  # not after training up to an evaluation
            raise TileError(where, f"eval_data to hold one evaluation batch of batch_size / accum_steps = "
                            f"{batch_size // accum_steps} windows: a larger val_fraction, a smaller seq_len or "
                            "batch_size", f"{eval_data.num_eval_windows} window(s) in {eval_data!r}")
        require_int(where, "checkpoint_every", checkpoint_every, 0)  # (the manager's error named its own "every")
        if checkpoint_keep is not None:
            require_int(where, "checkpoint_keep (None: keep all)", checkpoint_keep, 1)
        for name, value in (("checkpoint_every", checkpoint_every), ("checkpoint_keep", checkpoint_keep),
                            ("checkpoint_files", checkpoint_files)):
            if value and checkpoint_dir is None:  # taken and never used, without a word
                raise TileError(where, f"{name} needs a checkpoint_dir", f"{name}={_short_repr(value)}")
        from tilegraph.io.zarr import check_files

        # checked here, not at the first checkpoint after training up to it
        checkpoint_files = check_files(checkpoint_files, where, "checkpoint_files", TileError)
        # (NumPy's numbers too: np.int64(5) was refused as not "a finite number of seconds")
        seconds = isinstance(step_timeout, (int, float, np.integer, np.floating)) \
            and not isinstance(step_timeout, (bool, np.bool_))
        if not (step_timeout is None or isinstance(step_timeout, str) and step_timeout == "auto"
                or seconds and 0 < step_timeout < math.inf):
            raise TileError(where, "step_timeout must be 'auto', None (no limit) or a finite number of seconds > 0",
                            _short_repr(step_timeout))
        step_timeout = float(step_timeout) if isinstance(step_timeout, (np.integer, np.floating)) else step_timeout
        if isinstance(restart_on_failure, np.bool_):
            restart_on_failure = bool(restart_on_failure)
        if not (isinstance(restart_on_failure, bool) or is_int(restart_on_failure, 0)):
            raise TileError(where, "restart_on_failure must be a bool or the number of restarts allowed (an int >= 0)",
                            _short_repr(restart_on_failure))
        restart_on_failure = restart_on_failure if isinstance(restart_on_failure, bool) else int(restart_on_failure)
        if restart_on_failure and checkpoint_dir is None:
            raise TileError(where, "restart_on_failure resumes from checkpoints: it needs a checkpoint_dir",
                            f"restart_on_failure={restart_on_failure!r}, checkpoint_dir=None")
        self.step_timeout = step_timeout
        self.max_restarts = MAX_RESTARTS if restart_on_failure is True else int(restart_on_failure)
        self._last_checkpoint: Path | None = None  # written or loaded: where a restart resumes
        self._recent = collections.deque(maxlen=8)  # wall seconds per step of recent graphs
        self._plotted = (0.0, PLOT_SECONDS_GUESS)  # (perf_counter at the end of the last drawing, its seconds)
        self.model, self.optimizer, self.data, self.runtime = model, optimizer, data, runtime
        self.batch_size, self.accum_steps = batch_size, accum_steps
        self.eval_data, self.eval_every, self.eval_batches = eval_data, eval_every, eval_batches
        self.log_dir = _folder(where, "log_dir", log_dir)
        self.checkpoint_every = checkpoint_every
        self.checkpoint_dir = _folder(where, "checkpoint_dir", checkpoint_dir)
        self.checkpoint_files = checkpoint_files
        self.checkpoints = None  # the CheckpointManager of checkpoint_dir
        # checked here, not at the first checkpoint (or metrics record) after training up to it
        if self.log_dir is not None:
            _check_writable(where, "log_dir", self.log_dir, "not as an OSError when fit opens metrics.jsonl")
        if checkpoint_dir is not None:
            from tilegraph.io.zarr import CheckpointManager

            _check_writable(where, "checkpoint_dir", self.checkpoint_dir,
                            "not at the first checkpoint after training up to it")

            # restarts resume from the last committed checkpoint: with them, each save is waited
            # for (a background save whose tiles a lost worker held would never commit)
            keep = None if checkpoint_keep is None else int(checkpoint_keep)
            self.checkpoints = CheckpointManager(checkpoint_dir, keep=keep, every=int(checkpoint_every),
                                                 async_save=bool(async_checkpoint) and not self.max_restarts)
        self._hooked = 0  # committed checkpoints whose on_checkpoint hooks have run
        self.progress = bool(progress)
        self.tensorboard_dir, self._summary_writer = _tensorboard(tensorboard, self.log_dir)
        if self.tensorboard_dir is not None and self.tensorboard_dir.parent != self.log_dir:
            _check_writable(where, "tensorboard", self.tensorboard_dir, "not as an OSError when fit starts")
        self._tb = None  # the SummaryWriter while fit() runs
        self.pipeline = bool(pipeline)
        self.steps_per_graph = steps_per_graph
        self.on_step, self.on_checkpoint = on_step, on_checkpoint
        if performance_report is not None and runtime is None:
            raise TileError(where, "performance_report needs a distributed runtime (tg.connect())",
                            f"performance_report={str(performance_report)!r}, runtime=None")
        if performance_report is not None:  # (it was written, or failed, only after the reported step)
            from tilegraph.io._store import user_path

            performance_report = user_path(performance_report, where)
            if performance_report.is_dir():
                raise TileError(where, "performance_report must be the path of an HTML file to write, not a folder",
                                f"performance_report={str(performance_report)!r}, a folder")
            _check_writable(where, "performance_report's folder", performance_report.parent,
                            "not after training up to the reported step")
        self.performance_report, self.report_step = performance_report, report_step
        self.token_data = _is_token_data(data)
        #: whether the batches are tokens (the rate is tokens_per_s, else samples_per_s) and whether
        #: the validation perplexity is shown: a token dataset's are; a callable's are told from its
        #: first batch (:meth:`_note_batch_kind`; None until then)
        self.token_batches = True if self.token_data else None
        self._perplexity_given = perplexity
        self.language_model = bool(perplexity) if perplexity is not None else (True if self.token_data else None)
        if self.token_data:
            seq_tile = getattr(getattr(model, "tiling", None), "seq", None)
            row_tile = getattr(getattr(model, "tiling", None), "batch", None)
            micro = batch_size // accum_steps
            width = getattr(getattr(model, "config", None), "dim", 0)
            if row_tile is None:
                row_tile = _default_row_tile(runtime, micro, data.seq_len * width,
                                             compile_options.get("parallel") or config.parallel)
            self.batch_tiles = batch_tiles or [(min(row_tile, micro),)]

            def on_offsets(ds, fn=loss_fn or lm_loss):
                """The loss of the windows at a batch of offsets, read from ``ds`` where tasks run."""
                return lambda m, offsets: fn(m, *ds.tensors(offsets, seq_tile=seq_tile))

            self.loss_fn, self.eval_loss_fn = on_offsets(data), on_offsets(eval_data)
        else:
            if loss_fn is None:
                raise TileError(where, "a callable data source needs loss_fn(model, *tensors)", "loss_fn=None")
            self.batch_tiles = batch_tiles
            self.loss_fn = self.eval_loss_fn = loss_fn
        self.step = TrainStep(model, optimizer, self.loss_fn, batch_tiles=self.batch_tiles, runtime=runtime,
                              accum_steps=accum_steps, **compile_options)
        self._eval = None
        if eval_data is not None:
            self._eval = EvalStep(model, self.eval_loss_fn, batch_tiles=self.batch_tiles, runtime=runtime,
                                  **compile_options)
        self.history: list[dict] = []  # every metrics record written, in order
        #: names this run in every metrics record; a resumed run keeps its checkpoint's
        self.run_id = uuid.uuid4().hex[:12]
        #: names this trainer's stretch of the run in its metrics records (a new one from each
        #: checkpoint loaded); ``lineage`` is the path of segments, ``[segment, last_step]``,
        #: that led to its first step (:func:`tilegraph.plotting.on_lineage`)
        self.segment = uuid.uuid4().hex[:8]
        self.lineage: list = []
        self._lineage_logged = False
        self._stop = False
        self._first_batch_checked = False  # batch_size against a callable data's first batch
        #: the source of the code that called the running fit (its performance report shows it)
        self._caller_code: str | None = None
        #: held while a fit runs: one fit of a trainer at a time (see :meth:`fit`)
        self._fit_lock = threading.Lock()
        self._fitting: tuple[int, int] | None = None  # the running fit's (steps, first step)

    #: set when the Trainer is built: its training step is recorded for that model, optimizer,
    #: loss, runtime and batch (``trainer.optimizer = AdamW(..., lr=1e-4)`` between fits went on
    #: with the old optimizer, logging its steps from 1 again; a new model was never trained)
    FIXED = ("model", "optimizer", "loss_fn", "runtime", "batch_size", "accum_steps")

    def __setattr__(self, name: str, value) -> None:
        if name in self.FIXED and name in self.__dict__ and not _same(value, self.__dict__[name]):
            raise TileError("tilegraph.Trainer", f"{name} is fixed when the Trainer is built (its training step is "
                            f"recorded for it): build a new Trainer for another {name}",
                            f"trainer.{name} = {_short_repr(value)}")
        super().__setattr__(name, value)

    # -- data ----------------------------------------------------------------------------------
    def _batch(self, step: int) -> tuple[np.ndarray, ...]:
        if self.token_data:
            return (self.data.batch_offsets(step, self.batch_size),)
        try:
            batch = self.data(step)
        except IndexError as e:  # batches[step] of a list past its end: steps count from 1, not 0
            e.add_note(f"[tilegraph.Trainer.fit] data(step) is called with the optimizer step's number, counted "
                       f"from 1 (data({step}) here): batch k (from 0) of a list is batches[step - 1], of arrays "
                       "X[(step - 1) * B:step * B]")
            raise
        return _batch_arrays("tilegraph.Trainer.fit", "data(step)", f"data({step})", batch, _STEP_NUMBERING)

    def _check_first_batch(self, step: int, batch: tuple) -> None:
        """A callable data's first batch (``data(step)``, before any step runs): its rows (the first
        array's first dim) are the batch size. An explicit ``batch_size`` must be that (it was
        ignored: ``batch_size=64`` trained on the 4 rows returned without a word, and went into the
        checkpoints' trainer state); without one, the batch size is taken from it."""
        if self.token_data or self._first_batch_checked:
            return
        shape = np.shape(batch[0]) if batch else ()
        if not shape:  # a scalar first argument has no rows to count
            self._first_batch_checked = True
            return
        rows = int(shape[0])
        if self._batch_size_given and rows != self.batch_size:
            raise TileError("tilegraph.Trainer.fit", "batch_size must be the rows of each batch data(step) returns "
                            "(the first dim of its first array): a callable data's batches are trained as returned. "
                            "Leave batch_size out to take it from the data, or make data(step) return batch_size "
                            "rows", f"batch_size={self.batch_size}, data({step}) gave {rows} rows "
                            f"(shape {tuple(shape)})")
        if not self._batch_size_given:
            super().__setattr__("batch_size", rows)  # (a FIXED attribute: set here once, by the trainer)
        self._first_batch_checked = True

    def _warn_past_schedule(self, start: int, end: int) -> None:
        """Warn (once, as a fit starts) when steps ``start + 1 .. end`` go past the total of the
        optimizer's schedule (``tg.optim.warmup_cosine``'s, saved as its ``spec``): from there on,
        every step runs at the schedule's floor (``min_lr``, 0 by default), which kept training
        at lr 0 without a word. A warning, not an error: going on at the floor may be meant."""

        from tilegraph.optim import steps_past_schedule

        spec = getattr(self.optimizer.schedule, "spec", None)
        past = steps_past_schedule(spec, start, end)
        if not past:
            return
        total, floor = spec["total"], spec.get("min_lr", 0.0)
        warnings.warn(f"tilegraph.Trainer.fit: {_steps_text(range(start + 1, end + 1))} asked for go past the "
                      f"total of the learning-rate schedule ({spec.get('name', 'schedule')}, total={total}): "
                      f"{_steps_text(past)} {'runs' if len(past) == 1 else 'run'} at its floor, lr "
                      f"{floor:g} (min_lr). Give the schedule a total of at least {end} (trainer.optimizer.schedule "
                      "= ...) to train them at a higher rate", UserWarning, stacklevel=4)

    def _note_batch_kind(self, batch: tuple) -> None:
        """A callable data's first batch tells whether its batches are tokens (the input, its
        first array, integer ids of two or more dims: the rate is tokens/s) and, unless
        ``perplexity`` was given, whether its loss is a language model's (input and targets, its
        first and last arrays, integer ids of one shape (B, T)): exp of an MSE or of a classifier's
        cross-entropy over class labels is no perplexity."""
        if self.token_batches is not None:
            return
        first, last = (np.asarray(batch[0]), np.asarray(batch[-1])) if batch else (np.empty(()), np.empty(()))
        ids = first.dtype.kind in "iu" and first.ndim >= 2
        self.token_batches = ids
        if self._perplexity_given is None:
            self.language_model = ids and first.ndim == 2 and last.dtype.kind in "iu" and last.shape == first.shape

    def _counted(self, batch) -> tuple[int, int]:
        """(tokens, samples) of a step's batch: a token dataset's windows x ``seq_len``, integer ids
        (B, T, ...) B x T (0 for other data); samples: the rows (the first array's first dim)."""
        if self.token_data:
            return len(batch[0]) * int(self.data.seq_len), len(batch[0])
        a = np.asarray(batch[0])
        rows = int(a.shape[0]) if a.ndim else 1
        return (int(np.prod(a.shape[:2])) if self.token_batches and a.ndim >= 2 else 0), rows

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, batches: int | None = None) -> float:
        """Mean loss over ``batches`` (default ``eval_batches``) batches of ``eval_data``
        (:func:`perplexity` of it is the validation perplexity). A token dataset's batches are of
        ``batch_size`` windows, evaluated in micro-batches with ``accum_steps`` > 1.

        A token dataset gives the same windows each time, spread evenly over its whole split
        (:meth:`TokenDataset.eval_offsets`); a callable gives batches ``0 .. batches - 1``.
        """
        where = "tilegraph.Trainer.evaluate"
        if self._eval is None:
            raise TileError(where, "needs eval_data", "eval_data=None")
        if self.runtime is not None:
            self.runtime.require_open(where, then=_REBUILD)
        n = self.eval_batches if batches is None else batches
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise TileError(where, "batches (or eval_batches) must be an int >= 1", repr(n))
        with self._current():
            if self.token_data:  # n batches of batch_size windows, read as micro-batches (each one
                # step's memory): the same windows, and loss, whatever accum_steps is
                micro = self.batch_size // self.accum_steps
                batches = [(offsets,) for offsets in self.eval_data.eval_offsets(micro, n * self.accum_steps)]
            else:
                batches = []
                for k in range(n):
                    try:
                        batch = self.eval_data(k)
                    except IndexError as e:  # a list of held-out batches shorter than eval_batches
                        e.add_note(f"[{where}] {_EVAL_NUMBERING} (eval_data({k}) here)")
                        raise
                    batches.append(_batch_arrays(where, "eval_data(i)", f"eval_data({k})", batch, _EVAL_NUMBERING))
            losses = self._eval.losses(batches)
        return float(np.mean(losses))

    def _current(self):
        return self.runtime.as_current() if self.runtime is not None else contextlib.nullcontext()

    # -- the loop --------------------------------------------------------------------------------
    def fit(self, steps: int) -> FitResult:
        """Run ``steps`` optimizer steps (continuing from the optimizer's step count)."""
        where = "tilegraph.Trainer.fit"
        require_int(where, "steps", steps, 1)  # NumPy's integers too (a count computed with NumPy); no bool
        steps = int(steps)
        if self.runtime is not None:  # closed after this trainer was built: say so before anything starts
            self.runtime.require_open(where, then=_REBUILD)
            self._require_state(where)
        # the performance report's "Calling Code": the caller's (see _start_report)
        self._caller_code = _calling_code(sys._getframe(1)) if self.performance_report is not None else None
        # one fit at a time: a second one (a notebook cell run while `threading.Thread(target=
        # trainer.fit, ...)` trains, a hook calling fit) ran beside the first on the same step
        # count, asking data() for the same steps twice and logging steps 6, 5, 7, 6, ...
        self._refuse_while_fitting(where, f"fit({steps})")
        try:
            self._fitting = (steps, self.optimizer.step_count + 1)
            # the folders are this fit's alone while it runs: another process's (or trainer's) run
            # there would interleave its records with ours and fail at its first checkpoint
            release = self._hold_folders(where)
            try:
                return FitRun(self, where, steps).run()
            finally:
                release()
        finally:
            self._fitting = None
            self._fit_lock.release()

    def _refuse_while_fitting(self, where: str, call: str) -> None:
        """Take the trainer's fit lock (the caller releases it), or raise naming the fit that holds it."""
        if not self._fit_lock.acquire(blocking=False):
            steps, first = self._fitting or (0, 0)
            raise TileError(where, "no other fit of this Trainer running: its fit is still running (in another "
                            "thread, or a hook of it made this call); wait for it to end, or call "
                            "trainer.request_stop() and wait, then call again",
                            f"{call} while fit({steps}) runs from step {first} (now at step "
                            f"{self.optimizer.step_count})")

    def _diverged(self, pending) -> "NonFiniteLossError":
        """The error of step ``pending.step``'s NaN/inf loss: its update (and those of the steps
        after it in its graph) is in the weights already, so every later loss would be NaN too;
        it says how to go on, naming the newest checkpoint from before the loss went bad."""
        step, loss = pending.step, pending.stats.loss
        done = self.optimizer.step_count
        good = self._checkpoint_before(step - 1)  # step - 1's update made the weights of that loss
        lr = (getattr(self.optimizer.schedule, "spec", None) or {}).get("base_lr")
        lower = "tg.optim.warmup_cosine(...) or tg.optim.constant(...)" + (
            f" below this run's {lr:g}" if lr is not None else "")
        if good is not None:
            from tilegraph.io.zarr import checkpoint_step

            good_step = self._checkpoint_steps().get(good)
            later = self.checkpoints is not None and any(
                (checkpoint_step(p.name) or 0) > good_step for p in self.checkpoints.checkpoints())
            how = (f"reload the newest checkpoint from before the loss went bad, trainer.load_checkpoint({str(good)!r})"
                   + (f", move the later ones out of checkpoint_dir (trainer.checkpoints.set_aside({good_step}))"
                      if later else "")
                   + f", then give the optimizer a lower learning rate (trainer.optimizer.schedule = {lower}; set "
                   "it after the load, which restores the checkpoint's schedule) and fit again")
        else:
            how = ("this trainer has no checkpoint from before it (checkpoint_dir and checkpoint_every write them): "
                   f"build the model, optimizer and Trainer again with a lower learning rate ({lower})")
        return NonFiniteLossError(
            "tilegraph.Trainer.fit",
            f"a finite loss; the loss of step {step} is {loss}, and the updates up to step {done} were already "
            f"applied: the weights are now NaN/inf, so every later step's loss would be too (a learning rate too "
            f"high for the model, or bad values in the data of step {step}). To go on, {how}",
            f"loss became {loss} at step {step}")

    def _checkpoint_before(self, step: int) -> Path | None:
        """The newest complete checkpoint of a step before ``step`` that this trainer wrote or
        loaded, or that its ``checkpoint_dir`` holds (None: none)."""
        before = [(s, p) for p, s in self._checkpoint_steps().items() if s < step]
        return max(before)[1] if before else None

    def _checkpoint_steps(self) -> dict[Path, int]:
        """The complete checkpoints of ``checkpoint_dir`` and the last one this trainer wrote or
        loaded, with their steps (a save under way is waited for first)."""
        from tilegraph.io.zarr import Checkpoint, checkpoint_step

        found: dict[Path, int] = {}
        if self.checkpoints is not None:
            try:  # a save under way (its values are those of its step): committed, or failed
                self.checkpoints.wait()
            except Exception:
                pass
            found.update((p, checkpoint_step(p.name)) for p in self.checkpoints.checkpoints())
        last = self._last_checkpoint
        if last is not None and last not in found:
            try:
                found[last] = Checkpoint(last).step if checkpoint_step(last.name) is None else checkpoint_step(last.name)
            except Exception:  # a legacy checkpoint, or one deleted since
                pass
        return {p: s for p, s in found.items() if s is not None}

    def _check_checkpoint_dir(self, where: str, start: int) -> None:
        """Refuse, before any step, a ``checkpoint_dir`` that holds checkpoints of steps after
        ``start`` (another run's, say a notebook cell run again with a fresh model, or those of
        steps a loaded checkpoint went back before): this fit's checkpoints would collide with
        them partway (after training up to there), or, with ``checkpoint_keep``, be pruned at
        once as older than them."""
        from tilegraph.io.zarr import checkpoint_step

        if self.checkpoints is None or not self.checkpoints.dir.is_dir():
            return
        # by name alone (a step-N folder is in the way, complete or not; no checkpoint is opened)
        later = sorted((p for p in self.checkpoints.dir.iterdir() if (checkpoint_step(p.name) or 0) > start),
                       key=lambda p: checkpoint_step(p.name))
        if later:
            raise TileError(where, f"checkpoint_dir must hold no checkpoint of a step after the optimizer's step "
                            f"count ({start}): this fit's checkpoints would collide with them or be pruned as older "
                            "than them. Continue the newest with trainer.load_checkpoint(path) before fit, or give "
                            "another checkpoint_dir, or move them (tg.io.CheckpointManager(dir).set_aside(step))",
                            f"{self.checkpoints.dir}: {', '.join(p.name for p in later[:4])}"
                            + (f" (and {len(later) - 4} more)" if len(later) > 4 else ""))

    def _hold_folders(self, where: str) -> Callable[[], None]:
        """Take ``checkpoint_dir`` and ``log_dir`` for this fit (:func:`tilegraph._lock.hold_folder`,
        the lock ``tilegraph train`` takes on its run folder); returns the release function.
        Another live process's fit (or ``tilegraph train``) in either is refused here, naming
        it: two runs there both trained, the second failing only at its first checkpoint ("must
        not exist yet") and ``metrics.jsonl`` interleaving two run ids. Within this process
        the folders are the trainer's while its fit runs: another trainer still fitting there
        (in another thread) is refused; one whose fit ended holds nothing, so a Trainer built
        again on them (a notebook cell run again) fits; the ``tilegraph train`` job that runs
        this trainer holds its run folder for it."""
        import socket

        from tilegraph._lock import LOCK_NAME, hold_folder

        releases: list[Callable[[], None]] = []

        def release() -> None:
            for undo in reversed(releases):
                undo()

        def refuser(name: str):
            def refuse(holder) -> TileError:
                if holder.here:
                    who = (f"another Trainer of this process (pid {holder.pid} on {holder.host}), whose fit still "
                           "runs (in another thread)" if holder.by == where else
                           f"{holder.by} in this process (pid {holder.pid} on {holder.host})")
                else:
                    who = f"{holder.by} (pid {holder.pid} on {holder.host})"
                gone = "" if holder.here or holder.host == socket.gethostname() else (
                    f"; if that process is gone, delete {holder.lock} (another machine's processes cannot be "
                    "looked up from here)")
                mixed = "two runs' checkpoints there collide" if name == "checkpoint_dir" else \
                    "two runs' records would interleave in its metrics.jsonl"
                return TileError(where, f"a {name} no other run is using ({mixed}): {holder.folder} is in use by "
                                 f"{who}: wait for it to end, or give this Trainer another {name}{gone}",
                                 str(holder.lock))
            return refuse

        taken: list[Path] = []
        try:
            for name, folder in (("checkpoint_dir", self.checkpoint_dir), ("log_dir", self.log_dir)):
                if folder is None or folder.resolve() in taken:  # (log_dir the checkpoint_dir: one lock)
                    continue
                try:
                    releases.append(hold_folder(folder, where, refuser(name), owner=self, where=where, name=name))
                except OSError as e:  # (writable when the Trainer was built; a disk full or remounted since)
                    from tilegraph.io._store import write_failure

                    raise write_failure(where, e, folder / LOCK_NAME, f"the lock file of {name}",
                                        "nothing was trained or written") from None
                taken.append(folder.resolve())
        except BaseException:
            release()
            raise
        return release

    # -- lost workers ----------------------------------------------------------------------------
    def _require_state(self, where: str) -> None:
        """Refuse, before any step, a fit whose model's values on the workers are gone: a worker
        lost in an earlier fit (its WorkerLostError) took its parameter and optimizer state tiles
        with it, and a fit again without a checkpoint loaded ran steps that each failed, with a
        WorkerLostError naming a worker lost "while step 7 ran" (it was lost during step 5) or
        "the cluster lost tasks or data of step 8 (no worker was found missing)", counting those
        steps all the same."""
        tiles = [c.value for p in self.optimizer.params for c in p.cells.flat]
        tiles += [c.value for state in self.optimizer.state_cells for grid in state for c in grid.flat]
        futures = [v.future for v in tiles if getattr(v, "future", None) is not None]
        gone = sum(f.status in ("cancelled", "lost") for f in futures)
        if gone:
            problem = self.runtime.scheduler_problem()
            if problem is not None:  # (what cancelled them: the scheduler, not a worker)
                raise self._scheduler_error(problem, "since the last fit", f"{gone} of the {len(futures)} parameter "
                                            "and optimizer state tiles on the workers are gone")
            raise TileError(where, f"the model's values on the workers to train on: {self._lost_state_hint(None)}",
                            f"{gone} of the {len(futures)} parameter and optimizer state tiles on the workers are "
                            "gone (with a worker lost in an earlier fit: its WorkerLostError)")

    def _time_limit(self, pending, clock: float) -> float | None:
        """Seconds left for ``pending``'s graph, which could start at ``clock`` (None: no limit)."""
        if self.step_timeout is None or self.runtime is None:
            return None
        k = len(pending.steps)
        if self.step_timeout == "auto":
            limit = STEP_TIMEOUT_MIN
            if self._recent:
                limit = max(limit, STEP_TIMEOUT_FACTOR * max(self._recent) * k)
        else:
            limit = float(self.step_timeout) * k
        if pending.fresh or not self._recent:
            limit = max(limit, FIRST_GRAPH_SECONDS)
        return limit - (time.perf_counter() - max(clock, pending.submitted))

    @contextlib.contextmanager
    def _translate_lost_workers(self, during: str, steps: range, beside: bool = False):
        """Dask's errors of a lost worker, raised in the block, as a :class:`WorkerLostError`
        (``beside``: ``during`` is work beside the steps' graphs, an evaluation or a checkpoint)."""
        try:
            yield
        except Exception as e:
            err = translate_worker_failure(self.runtime, e, during, steps=steps, where="tilegraph.Trainer.fit")
            if err is None:
                raise
            if beside and isinstance(err, WorkerLostError):
                _during(err, during)
            raise err from None

    def _watched(self, fn: Callable, during: str, steps: range):
        """``fn()``, work on the workers with no time limit of its own (an evaluation, a
        checkpoint), while the workers are checked every ``WATCH_SECONDS``: one lost or stalled
        ends the wait with a :class:`WorkerLostError` (``fn``'s thread then ends when Dask gives
        up on the worker, or goes on if it comes back)."""
        if self.runtime is None:
            with self._translate_lost_workers(during, steps, beside=True):
                return fn()
        out: dict = {}
        since = time.time()  # workers the scheduler removed from here on were lost during it

        def target():
            try:
                out["value"] = fn()
            except BaseException as e:  # re-raised by the loop's thread
                out["error"] = e

        t0 = time.perf_counter()
        thread = threading.Thread(target=target, name=f"tilegraph: {during}", daemon=True)
        thread.start()
        while True:
            thread.join(WATCH_SECONDS)
            if not thread.is_alive():
                break
            health = worker_health(self.runtime)
            if health.failing:
                raise _during(lost_worker_error(health, during, f"still running after {time.perf_counter() - t0:.1f} s",
                                                steps=steps, where="tilegraph.Trainer.fit"), during)
        if "error" in out:
            if isinstance(out["error"], WorkerLostError):  # (an evaluation's own)
                raise self._lost_during(out["error"], during, steps, since) from None
            with self._translate_lost_workers(during, steps, beside=True):
                raise out["error"]
        return out["value"]

    def _lost_during(self, error: WorkerLostError, during: str, steps: range, since: float) -> WorkerLostError:
        """``error``, a worker lost while ``during`` (an evaluation) ran, as the fit's error: it names
        ``during`` and ``steps`` (the EvalStep's said "while the evaluation ran", without steps,
        so a restart was logged as lost "while training ran" and recorded with "failed": null),
        and the workers removed ``since`` it began (an evaluation planned after the loss, its
        first, named none: "no worker was found missing")."""
        hint = next((h for h in (LOST_STATE_HINT, EVAL_LENT_HINT) if h in error.what), LOST_STATE_HINT)
        try:
            health = worker_health(self.runtime, since)
        except TileError:  # (the scheduler went too: the workers the evaluation named)
            health = None
        if health is None or not health.failing:
            health = WorkerHealth(lost=[w for w in error.workers if w not in error.stalled],
                                  silence={w: STALL_SECONDS for w in error.stalled})
        return _during(lost_worker_error(health, during, error.received, steps=steps, where="tilegraph.Trainer.fit",
                                         hint=hint), during)

    def _restart(self, error: WorkerLostError, restarts: int, lost_save: int | None = None) -> int:
        """Reload the last checkpoint after ``error`` (the next steps plan again, on the workers
        left); returns the checkpoint's step. Raises when restarting is off or cannot be done
        (``lost_save``: the step of a save under way that the lost worker took with it)."""
        where = "tilegraph.Trainer.fit"

        def fail(why: str):
            return WorkerLostError(where, f"{error.what}; {why}", error.received, workers=error.workers,
                                   stalled=error.stalled, steps=error.steps)

        if not self.max_restarts:
            if LOST_STATE_HINT not in error.what:  # an error of its own (not of the state on the workers)
                raise error
            raise WorkerLostError(error.where, error.what.replace(LOST_STATE_HINT, self._lost_state_hint(lost_save)),
                                  error.received, workers=error.workers, stalled=error.stalled,
                                  steps=error.steps) from None
        if restarts >= self.max_restarts:
            raise fail(f"restart_on_failure gave up after {_plural(restarts, 'restart')}") from None
        if self._last_checkpoint is None:
            raise fail("restart_on_failure has no checkpoint to resume from: this trainer has written or loaded "
                       "none yet (checkpoint_every sets how often it writes one)") from None
        before = len(self.runtime.last_workers.memory_limits)  # the workers the lost steps were planned for
        if error.stalled:  # its nanny kills the silent process and starts a fresh one (no nanny: removed)
            _restart_or_remove(self.runtime.client, error.stalled)
        deadline = time.perf_counter() + RESTART_WAIT_SECONDS
        while not (answering := worker_health(self.runtime).answering):
            if time.perf_counter() > deadline:
                raise fail(f"no worker is left to restart on (none answered within {RESTART_WAIT_SECONDS:g} s)") \
                    from None
            time.sleep(0.5)
        if len(answering) < before:  # the nannies of lost workers start them again: go on with as many
            wait_for_replacements(self.runtime, before)
            answering = worker_health(self.runtime).answering
        step = self._load_checkpoint(self._last_checkpoint, schedule=False, stacklevel=1)
        logger.warning("tilegraph.Trainer: lost worker(s) %s while %s ran; resuming from checkpoint %s (step %d) "
                       "on %d worker(s): %s", ", ".join(error.workers) or "(none named)",
                       error.during or (_steps_text(error.steps) if error.steps else "training"),
                       self._last_checkpoint, step,
                       len(answering), ", ".join(answering))
        return step

    def _scheduler_lost(self, error: BaseException, step: int) -> TileError | None:
        """The error of a fit that failed at ``step`` because its scheduler ended, stopped or hung
        (``error`` is what Dask's side said of it: a step's health check that timed out, a
        cancelled future), naming the scheduler and what went with it; None where the scheduler
        answers (the error is the fit's own) or ``error`` is no failure (an interrupt). Before, a
        killed scheduler ended the fit after 10 s with "step 5 failed and the Dask scheduler did
        not answer (TileError: ... within 10 s; received: TimeoutError: timed ...)", which named
        no scheduler, and a stopped one after 30 s with "the Dask scheduler to answer a health
        check within 10 s"."""
        if self.runtime is None or not isinstance(error, Exception) or isinstance(error, FloatingPointError):
            return None
        try:
            problem = self.runtime.scheduler_problem()
        except Exception:  # (a runtime closed meanwhile, in another thread: the error as it is)
            return None
        if problem is None:
            return None
        return self._scheduler_error(problem, f"at step {step}", f"{type(error).__name__}: {error}"[:300])

    def _scheduler_error(self, problem: str, when: str, received: str) -> TileError:
        """The fit's error for a scheduler ``problem`` (:meth:`Runtime.scheduler_problem`) met
        ``when``: what went with it, and the newest checkpoint to resume from."""
        found = {}
        if self.checkpoints is not None:  # committed on disk (a save under way waits on the scheduler)
            from tilegraph.io.zarr import checkpoint_step

            found = {p: checkpoint_step(p.name) for p in self.checkpoints.checkpoints()}
        if self._last_checkpoint is not None and self._last_checkpoint.is_dir():
            from tilegraph.io.zarr import checkpoint_step

            found.setdefault(self._last_checkpoint, checkpoint_step(self._last_checkpoint.name))
        found = {p: s for p, s in found.items() if s is not None}
        if found:
            path, at = max(found.items(), key=lambda ps: ps[1])
            resume = (f"resume from the newest committed checkpoint, {path} (step {at}): connect again (tg.connect), "
                      "build the model, optimizer and Trainer on that runtime, then "
                      f"trainer.load_checkpoint({str(path)!r}) and fit")
        else:
            resume = ("this trainer has no committed checkpoint to resume from: connect again (tg.connect) and train "
                      "from the start (checkpoint_dir and checkpoint_every write checkpoints)")
        return TileError("tilegraph.Trainer.fit", f"a Dask scheduler that answers: {problem}, {when}. The model's "
                         "parameters and optimizer state live on its workers: a scheduler that ended took them along "
                         f"(one that was stopped and goes on answers again: then fit again). To go on, {resume}",
                         received)

    def _lost_state_hint(self, lost_save: int | None) -> str:
        """What a lost worker's error tells a trainer without ``restart_on_failure`` to do: the
        newest checkpoint it can resume from (path and step), or that it has none yet
        (``lost_save``: the step of a save under way that the worker took with it)."""
        found = self._checkpoint_steps()
        lost = (f" (the checkpoint of step {lost_save}, still being written, was lost with the worker)"
                if lost_save is not None else "")
        gone = LOST_STATE
        if found:
            path, step = max(found.items(), key=lambda ps: ps[1])
            return (f"{gone}: resume from the newest committed checkpoint, {path} (step {step}){lost}, with "
                    f"Trainer.load_checkpoint({str(path)!r}) and fit again (the steps after {step} run again), or "
                    "train with Trainer(restart_on_failure=True) to resume by itself")
        if self.checkpoints is None:
            return (f"{gone}, and this trainer has no checkpoint to resume from (checkpoint_dir=None; "
                    "Trainer.load_checkpoint resumes from one): build the model again and fit from the start, or "
                    "train with Trainer(restart_on_failure=True, checkpoint_dir=..., checkpoint_every=...) to resume "
                    "by itself")
        return (f"{gone}, and no checkpoint was committed yet in {self.checkpoints.dir}{lost}: nothing of this run "
                "can be resumed; build the model again and fit from the start (checkpoint_every sets how often a "
                "checkpoint is written; Trainer(restart_on_failure=True) resumes from the last one by itself)")

    def _kernel_stats(self, reset: bool = False) -> dict:
        """Kernel time counters of the workers (of this process without a runtime)."""
        if self.runtime is not None:
            return self.runtime.kernel_stats(reset)
        from tilegraph._lower import kernel_stats

        return kernel_stats(reset)

    def _start_report(self, stack: contextlib.ExitStack) -> None:
        """Open the Dask performance report of the next graph (closed, and written, by ``stack``),
        showing the code that called :meth:`fit` as its calling code (Dask's own, taken as the
        report closes, was contextlib's ``ExitStack.__exit__``, a frame inside fit). It is the
        runtime's scheduler's: Dask's ``performance_report`` asks the default client's, which is
        the last one connected (another ``tg.connect``, ``make_current=False`` or not): the
        report showed that cluster's workers and none of the fit's tasks. The workers' profiler
        samples the tasks while it is open (:func:`~tilegraph.runtime.profiler.worker_profiler`:
        tilegraph's clusters run with it off, and the report's profile tab was empty), and is
        put back as it was before the report is written (also after an error or an interrupt)."""
        from distributed import performance_report

        from tilegraph.runtime.profiler import worker_profiler

        path = Path(self.performance_report)
        path.parent.mkdir(parents=True, exist_ok=True)
        client, code = self.runtime.client, self._caller_code
        report = performance_report(filename=str(path))
        with client.as_current():  # (the coroutine runs in the client's loop with this context)
            client.sync(report.__aenter__)

        def write() -> None:
            with client.as_current():
                client.sync(report.__aexit__, None, None, None, code=code or "<Code not available>")
        stack.callback(write)
        # (closed first: the samples are filed in the workers' profile history as it stops)
        stack.enter_context(worker_profiler(client))

    def _steps_per_graph(self, batch) -> int:
        if self.steps_per_graph != "auto":
            return self.steps_per_graph
        with self._current():
            return self.step.auto_steps_per_graph(*batch)

    def _log(self, log, record: dict) -> None:
        record = {"run": self.run_id, "segment": self.segment, **record}
        if self.lineage and not self._lineage_logged:  # a resumed segment's first record: the path it continues
            record["lineage"] = self.lineage
            self._lineage_logged = True
        self.history.append(record)
        if log is not None:
            log.write(json.dumps(record) + "\n")
            log.flush()
        if self._tb is not None:
            _tensorboard_write(self._tb, record)

    def plot(self, path: str | os.PathLike | None = None):
        """Draw this run's curves to ``path`` (default ``log_dir/loss.png``) with
        :func:`tilegraph.plotting.plot_training`: training loss (raw and smoothed), validation
        loss, learning rate and, for a language model, the uniform guess ``ln(vocab_size)``.
        Returns the path written (a :class:`~pathlib.Path` that a notebook shows as the image:
        ``trainer.plot()`` at the end of a cell draws the curve, where it showed
        ``PosixPath('run/loss.png')``); without a ``path`` or a ``log_dir``, the matplotlib
        Figure (a notebook shows it inline), where it drew nothing and returned None."""
        _matplotlib_imported()
        from tilegraph.plotting import plot_training

        if path is None and self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)  # made when missing, as fit() does
            path = self.log_dir / "loss.png"
        t0 = time.perf_counter()
        # the uniform guess over the model's outputs: the loss a language model starts near
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None) if self.token_data else None
        fig = plot_training(self.history, vocab_size=vocab if isinstance(vocab, int) else None, path=path,
                            run=self.run_id)
        if path is None:
            return fig
        end = time.perf_counter()
        self._plotted = (end, end - t0)
        return _ImagePath(path)

    def _plot_due(self, fit_start: float) -> bool:
        """Whether :meth:`fit` redraws ``loss.png`` at an evaluation now: once
        ``PLOT_INTERVAL_FACTOR`` times the last drawing's seconds passed since it (or since the
        fit started)."""
        last, seconds = self._plotted
        return time.perf_counter() - max(last, fit_start) >= PLOT_INTERVAL_FACTOR * seconds

    # -- checkpoints -----------------------------------------------------------------------------
    def _param_names(self) -> dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write a Zarr checkpoint folder ``path`` (:func:`tilegraph.io.save_checkpoint`): the
        model's weights and the optimizer's state (each tile written by the worker holding it),
        the step, the LR schedule, the data position and the trainer's batch settings, plus
        ``checkpoint_files``. It is written under a temporary name and renamed when complete, so
        a failure or a kill leaves no partial checkpoint and never replaces an existing one.
        Waits for the write; the ``on_checkpoint`` hooks run after it."""
        _require_path("tilegraph.Trainer.save_checkpoint", path, "the checkpoint folder to write")
        if self.runtime is not None:  # the values are on its workers: a lost scheduler took them along
            self.runtime.require_open("tilegraph.Trainer.save_checkpoint", then=_REBUILD)
        path = self._prepare_checkpoint(path).run()
        self._last_checkpoint = path
        for hook in self.on_checkpoint:
            hook(self, path)
        return path

    def _trainer_state(self) -> dict:
        # The random state of training: a token dataset draws each step's windows from (seed, split,
        # step) alone, so the next step and the seed are the whole data position; nothing else draws
        # (no dropout; gradient sketches seed themselves from the weights).
        state = {"batch_size": self.batch_size, "accum_steps": self.accum_steps, "run_id": self.run_id,
                 "lineage": [*self.lineage, [self.segment, self.optimizer.step_count]],
                 "data": repr(self.data) if self.token_data else None, "next_step": self.optimizer.step_count + 1,
                 "rng": {"data_seed": getattr(self.data, "seed", None),
                         "data_split": getattr(self.data, "split", None)}}
        if self.eval_data is not None:  # what a validation loss covers: `tilegraph train --resume` keeps them
            state.update(eval_every=self.eval_every, eval_batches=self.eval_batches)
        return state

    def _save_options(self) -> dict:
        """What every checkpoint of this trainer is saved with, besides the model and optimizer."""
        return {"runtime": self.runtime, "files": self.checkpoint_files, "trainer_state": self._trainer_state()}

    def _prepare_checkpoint(self, path):
        from tilegraph.io.zarr import prepare_save

        with self._current():
            return prepare_save(path, self.model, self.optimizer, **self._save_options())

    def _start_checkpoint(self, step: int) -> Path:
        """The checkpoint of ``step`` through the manager (in the background when async)."""
        with self._current():
            return self.checkpoints.save(step, self.model, self.optimizer, **self._save_options())

    def wait_for_checkpoint(self) -> Path | None:
        """Wait for the checkpoint being written in the background, if any (``async_checkpoint``:
        the one a fit interrupted after its last step leaves, which completes unless the process
        ends first, or the runtime is closed under it), re-raising its error; then run the
        ``on_checkpoint`` hooks of the checkpoints committed since they last ran (a fit runs them
        as it goes, and an interrupted one left them to the next fit). Returns the last checkpoint
        written or loaded (where a restart resumes; None: none yet)."""
        if self.checkpoints is not None:
            self.checkpoints.wait()
            self._checkpoint_hooks()
        return self._last_checkpoint

    def _checkpoint_hooks(self) -> None:
        """Run the ``on_checkpoint`` hooks of checkpoints committed since the last call."""
        if self.checkpoints is None:
            return
        if not self.checkpoints.busy:
            self.checkpoints.wait()  # re-raises a failed background save
        done = self.checkpoints.committed
        for path in done[self._hooked:]:
            self._last_checkpoint = path
            for hook in self.on_checkpoint:
                hook(self, path)
        self._hooked = len(done)

    def load_checkpoint(self, path) -> int:
        """Restore weights, optimizer state and step from a checkpoint folder (a Zarr checkpoint,
        on the model's own tiling and the runtime's workers, or a folder of the earlier
        HF-and-safetensors format), or from a Zarr checkpoint already opened
        (:func:`tilegraph.io.load_checkpoint`: its attributes are not read again); the next
        :meth:`fit` continues with the next step's batch. Returns the step. A checkpoint that
        does not fit (another optimizer, parameters of other names or shapes) raises before the
        model or the optimizer changes.

        The checkpoint's learning-rate schedule replaces the optimizer's, with a warning where the
        optimizer was given another (a longer ``total``, another peak): set
        ``trainer.optimizer.schedule = ...`` after loading to go on with another (as after a
        divergence, at a lower rate); the optimizer's other settings stay its own, with a warning
        naming each (and each parameter group's) that differs from the checkpoint's."""
        # (not while a fit runs: its steps would go on from the checkpoint's step halfway)
        self._refuse_while_fitting("tilegraph.Trainer.load_checkpoint", f"load_checkpoint({_short_repr(str(path))})")
        try:
            return self._load_checkpoint(path, schedule=True, stacklevel=2)
        finally:
            self._fit_lock.release()

    def _load_checkpoint(self, path, schedule: bool, stacklevel: int) -> int:
        """:meth:`load_checkpoint`; ``schedule``: whether the checkpoint's schedule replaces the
        optimizer's (a restart after a lost worker keeps the one the fit runs with: one set after
        loading, a lower rate after a divergence, went back to the checkpoint's); ``stacklevel``:
        the warnings name the line that many calls up from this one (1: the line that calls it)."""
        from tilegraph.io.zarr import Checkpoint, load_checkpoint

        if self.runtime is not None:  # the values go to its workers
            self.runtime.require_open("tilegraph.Trainer.load_checkpoint", then=_REBUILD)
        if isinstance(path, Checkpoint):
            ck = path
        else:
            from tilegraph.io._store import user_path

            # None, 42: a TypeError of Path(); "~/ck" a folder named "~" here
            _require_path("tilegraph.Trainer.load_checkpoint", path,
                          "a checkpoint folder, or a checkpoint opened with tilegraph.io.load_checkpoint")
            path = user_path(path, "tilegraph.Trainer.load_checkpoint")
            if (path / "trainer_state.json").is_file():
                return self._load_legacy_checkpoint(path)
            ck = load_checkpoint(path, runtime=self.runtime)
        with self._current():  # an opened checkpoint without a runtime of its own reads on the trainer's
            # all checked and read first: a failure changes nothing (the warnings name the caller's line)
            ck.restore(self.model, self.optimizer, schedule=schedule, stacklevel=stacklevel + 1)
        self._warn_other_batches(ck, stacklevel + 1)
        self._last_checkpoint = ck.path
        self._begin_segment(ck.trainer_state, ck.step)
        return ck.step

    def _begin_segment(self, state: dict, step: int, logged: list[dict] | None = None) -> None:
        """Start a new segment of the run from a checkpoint of ``step`` with trainer state
        ``state``: its lineage is the checkpoint's (one written before lineages were recorded
        stands for the records without a segment, up to its step). A resumed run (another
        trainer's checkpoint) takes that run's id, and its records on the lineage as history
        (from ``logged``, the records of ``log_dir`` when already read)."""
        from tilegraph.plotting import on_lineage, record_lineage

        self.lineage = record_lineage(state.get("lineage")) or [[None, step]]
        self.segment, self._lineage_logged = uuid.uuid4().hex[:8], False
        run = state.get("run_id")
        if isinstance(run, str) and run != self.run_id:  # resuming: the run's earlier records, for the plot
            self.run_id = run
            logged = self._logged() if logged is None else logged
            self.history = on_lineage([r for r in logged if r.get("run") == run], self.lineage)

    def _warn_other_batches(self, ck, stacklevel: int) -> None:
        """Warn where the checkpoint's run read its data otherwise than this trainer will: another
        ``batch_size``, data seed, ``seq_len`` or token range of the split (another token file,
        another ``val_fraction``: the data position, the next step, then means other windows
        than that run's next ones) or another ``accum_steps`` (the same windows, averaged in
        micro-batches of another size: not the losses that run would have had)."""

        from tilegraph.io.data import described_windows

        state = ck.trainer_state
        rng = state.get("rng") if isinstance(state.get("rng"), dict) else {}
        ours = {"batch_size": self.batch_size, "accum_steps": self.accum_steps}
        theirs = {"batch_size": state.get("batch_size"), "accum_steps": state.get("accum_steps"),
                  "data seed": rng.get("data_seed")}
        if self.token_data and state.get("data") is not None:
            ours["data seed"] = getattr(self.data, "seed", None)
            # the windows: the repr of the run's TokenDataset (its path may differ: a run folder copied)
            found = described_windows(str(state["data"]))
            if found:
                theirs["seq_len"], ours["seq_len"] = found[0], self.data.seq_len
                theirs["split tokens"] = "[{}, {}) of {}".format(*found[1:])
                ours["split tokens"] = f"[{self.data.lo}, {self.data.hi}) of {self.data.count}"
        differ = [k for k, v in ours.items() if theirs.get(k) is not None and v is not None and theirs[k] != v
                  and (isinstance(v, str) or is_int(theirs[k]) and is_int(v))]
        if not differ:
            return
        what = ("the next batches are other windows than that run's"
                if set(differ) - {"accum_steps"} else "the same windows, averaged in micro-batches of another size")
        warnings.warn(f"tilegraph.Trainer.load_checkpoint: {ck.path} was written by a run with "
                      + ", ".join(f"{k} {theirs[k]}" for k in differ) + "; this trainer has "
                      + ", ".join(f"{k} {ours[k]}" for k in differ) + f": from step {ck.step + 1} on, {what} "
                      "(build the Trainer with the checkpoint's values to continue that run as it was)",
                      stacklevel=stacklevel + 1)

    def _join_logged_run(self, start: int) -> None:
        """Before this trainer's first record: where ``log_dir/metrics.jsonl`` ends with another
        run's records (a notebook cell that builds the Trainer run again), a run whose last step is
        this optimizer's step count is the one this trainer continues, so its records go on under
        that run's id (and the plot draws the whole run, not the steps since the new Trainer);
        any other run there gets a warning: this run's records follow its own under another run
        id, and loss.png shows this run alone. Runs that resumed from a checkpoint
        (:meth:`load_checkpoint`) already continue theirs."""
        if self.log_dir is None or self.history or self.lineage:
            return

        from tilegraph.plotting import record_lineage

        logged = self._logged()
        steps = [r for r in logged if isinstance(r.get("step"), int) and "loss" in r and isinstance(r.get("run"), str)]
        if not steps or steps[-1]["run"] == self.run_id:
            return
        last = steps[-1]
        run, segment, step = last["run"], last.get("segment"), last["step"]
        if step == start and start > 0:  # continued as from a checkpoint of that step
            first = next((r for r in logged if r.get("run") == run and r.get("segment") == segment), {})
            lineage = [*(record_lineage(first.get("lineage")) or []), [segment, step]]
            self._begin_segment({"run_id": run, "lineage": lineage}, step, logged)
            return
        warnings.warn(f"tilegraph.Trainer.fit: {self.log_dir / 'metrics.jsonl'} ends with another run's records "
                      f"(run {run}, up to step {step}), and this trainer starts after step {start}: its records "
                      "follow them under a run id of their own, and loss.png will show this run alone (give each "
                      "run a log_dir of its own to keep them apart; a run continued from a checkpoint, "
                      "load_checkpoint, goes on under its run id)", stacklevel=4)

    def _logged(self) -> list[dict]:
        """The records of ``log_dir/metrics.jsonl`` (none without one)."""
        f = self.log_dir / "metrics.jsonl" if self.log_dir is not None else None
        if f is None or not f.is_file():
            return []
        out = []
        for line in f.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line cut by a kill
                continue
        return out

    def request_stop(self) -> None:
        """Ask :meth:`fit` to stop after the steps under way (thread- and signal-safe): it then
        writes a checkpoint of the last step (with ``checkpoint_dir``) and returns early. A
        KeyboardInterrupt after it (a second Ctrl-C the caller's handler lets through, as
        ``tilegraph train``'s) still logs the steps run, without the line a notebook gets ("fit
        again to go on"): the caller that asked for the stop says what happens next."""
        self._stop = True

    def _load_legacy_checkpoint(self, path: Path) -> int:
        """A checkpoint of tilegraph's first format: HF weights (or ``model.safetensors``),
        ``optimizer.safetensors`` and ``trainer_state.json``. As for a Zarr checkpoint, a
        checkpoint that does not fit changes nothing: the optimizer's state is read and checked
        first, then the weights are checked and set (both loaders check every weight before they
        set one), and only then the optimizer's state, which can no longer fail."""
        from tilegraph.io.safetensors import load_file

        where = "tilegraph.Trainer.load_checkpoint"
        state = _legacy_trainer_state(path, where)
        names = self._param_names()
        if state.get("parameters") != [names[id(p)] for p in self.optimizer.params]:
            raise TileError(where, "the checkpoint's parameters to match the optimizer's",
                            f"{len(state.get('parameters', []))} parameters named differently")
        moments = self._legacy_optimizer_state(path / "optimizer.safetensors", names, where)
        if hasattr(self.model, "to_hf"):
            from tilegraph.io.hf import load_hf_weights

            load_hf_weights(self.model, path)
        else:
            self.model.load_state_dict(load_file(path / "model.safetensors"))
        self.optimizer.load_state(moments, state["step"])
        self._last_checkpoint = path
        return state["step"]

    def _legacy_optimizer_state(self, file: Path, names: dict[int, str], where: str) -> list[dict]:
        """The state arrays of every optimizer parameter in a legacy ``optimizer.safetensors``
        (``PARAM.exp_avg``, ...), for :meth:`Optimizer.load_state`: each present, of its
        parameter's shape (every problem named at once). Reads; sets nothing."""
        from tilegraph.io.safetensors import load_file

        stored = load_file(file)
        arrays, problems = [], []
        for p in self.optimizer.params:
            keys = {k: f"{names[id(p)]}.{k}" for k in self.optimizer.state_names}
            problems += [f"missing: {key}" for key in keys.values() if key not in stored]
            problems += [f"shape of {key}: {tuple(stored[key].shape)}, expected {tuple(p.shape)}"
                         for key in keys.values() if key in stored and tuple(stored[key].shape) != tuple(p.shape)]
            arrays.append({k: stored[key] for k, key in keys.items() if key in stored})
        if problems:
            raise TileError(where, f"optimizer state for every parameter in {file}", "; ".join(problems[:8]))
        return arrays


class _ImagePath(type(Path())):  # (Path itself takes subclasses only from Python 3.12)
    """The path :meth:`Trainer.plot` wrote, shown by IPython as the PNG image it names (a notebook
    cell ending in ``trainer.plot()``); anything else (a folder, a PDF, a file gone) shows as a path."""

    def __repr__(self) -> str:  # as the Path it is (PosixPath('run/loss.png'))
        return f"{type(Path()).__name__}({str(self)!r})"

    def _repr_png_(self) -> bytes | None:
        try:
            data = self.read_bytes() if self.suffix.lower() == ".png" and self.is_file() else b""
        except OSError:
            return None
        return data if data.startswith(b"\x89PNG\r\n\x1a\n") else None


def _legacy_trainer_state(path: Path, where: str) -> dict:
    """The ``trainer_state.json`` of a legacy checkpoint folder ``path``, with its step."""
    file = path / "trainer_state.json"
    try:
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TileError(where, "a readable trainer_state.json (JSON) in the checkpoint", f"{file}: {e}") from None
    if not isinstance(state, dict):
        raise TileError(where, "a trainer_state.json holding a JSON object", f"{file}: {_short_repr(state)}")
    step = state.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise TileError(where, "a trainer_state.json naming the checkpoint's step (an integer >= 0)",
                        f"{file}: step {_short_repr(step)}")
    return state


def _restart_or_remove(client, addrs: Sequence[str]) -> None:
    """Have the stalled workers ``addrs`` restarted by their nannies; a worker without a nanny
    (``dask worker --no-nanny``, dask-mpi's ranks) is removed from the cluster instead, so that
    the next plan leaves it out. Dask's ``restart_workers`` refuses such a worker with a
    ValueError ("Restarting workers requires a nanny to be used"), which ended the fit."""
    def nannies(dask_scheduler, addrs) -> dict[str, bool]:  # nested: travels by value to the scheduler
        return {a: bool(dask_scheduler.workers[a].nanny) for a in addrs if a in dask_scheduler.workers}

    async def remove(dask_scheduler, addrs) -> None:
        for a in addrs:
            await dask_scheduler.remove_worker(a, stimulus_id="tilegraph-stalled-worker", close=True)

    has_nanny = client.run_on_scheduler(nannies, addrs=list(addrs))
    with_nanny = [a for a, n in has_nanny.items() if n]
    if with_nanny:
        client.restart_workers(with_nanny, timeout=RESTART_WAIT_SECONDS, raise_for_error=False)
    without = [a for a, n in has_nanny.items() if not n]
    if without:
        client.run_on_scheduler(remove, addrs=without)


def _is_token_data(data) -> bool:
    """A token dataset (:class:`tilegraph.io.TokenDataset`): its batches are window offsets."""
    return hasattr(data, "batch_offsets") and hasattr(data, "tensors")


def _check_data(where: str, model, data, eval_data) -> None:
    """``data`` is a token dataset or a callable, ``eval_data`` None or of the same kind, and a
    token dataset's ids fit the model's embedding (its ``vocab_size`` at most the model's
    ``config.vocab_size``: a model's may be padded larger)."""
    if _is_token_data(data):
        if eval_data is not None and not (_is_token_data(eval_data) and hasattr(eval_data, "eval_offsets")):
            raise TileError(where, "eval_data must be None or a token dataset (eval_offsets, tensors), as data is",
                            f"eval_data={_short_repr(eval_data)}")
    elif not callable(data):
        # a list of batches, a generator or a torch DataLoader (a torch loop's ``for x, y in loader``)
        hint = ("; for a list of batches, data=lambda step: batches[step - 1]; for an iterator or a "
                "DataLoader, it = iter(loader) and data=lambda step: next(it) (each step's batch is asked "
                "for once, in order)") if hasattr(data, "__iter__") and not isinstance(data, (str, bytes)) else ""
        raise TileError(where, "data must be a token dataset (batch_offsets, tensors) or a callable "
                        "data(step) -> tuple of arrays" + hint, type(data).__name__)
    elif eval_data is not None and not callable(eval_data):
        raise TileError(where, "eval_data must be None or a callable eval_data(batch) -> tuple of arrays, as data is",
                        f"eval_data={_short_repr(eval_data)}")
    model_vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for name, ds in (("data", data), ("eval_data", eval_data)):
        vocab = getattr(ds, "vocab_size", None) if _is_token_data(ds) else None
        if isinstance(vocab, int) and isinstance(model_vocab, int) and vocab > model_vocab:
            raise TileError(where, f"{name}'s token ids must fit the model: {name}.vocab_size at most the model's "
                            "config.vocab_size (build the model with the tokenizer's vocab_size)",
                            f"{name}.vocab_size={vocab} (ids up to {vocab - 1}), model config.vocab_size={model_vocab}")


#: what a batch without elements says of how a callable data is called (a slice past the end of
#: its arrays, by a user who counted the steps from 0)
_STEP_NUMBERING = ("data(step) is called with the optimizer step's number, counted from 1 (as the progress and "
                   "metrics.jsonl count them): batch k (from 0) of arrays of n rows in batches of B is "
                   "X[(step - 1) * B:step * B], and an epoch has n // B steps")
_EVAL_NUMBERING = ("eval_data(i) is called with i = 0 .. eval_batches - 1 at each evaluation: batch i of held-out "
                   "arrays of n rows is X[i * B:(i + 1) * B], so eval_batches is at most n // B")


def _batch_arrays(where: str, name: str, call: str, batch, numbering: str) -> tuple[np.ndarray, ...]:
    """The arrays of a batch that a callable ``data`` or ``eval_data`` returned (``name``:
    "data(step)", ``call``: "data(3)"): arrays of numbers, each with at least one element.
    (None, a dict, ragged lists: NumPy makes an object array of them, which would fail deep inside
    the recording, or as a missing argument of loss_fn; an empty slice, past the end of the user's
    arrays, failed inside the TrainStep naming neither the call nor how it is numbered.)"""
    batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
    arrays = tuple(np.asarray(a) for a in batch)
    for n, (a, array) in enumerate(zip(batch, arrays)):
        if array.dtype.kind not in "biuf":
            raise TileError(where, f"{name} must return an array of numbers, or a tuple of them (the arguments of "
                            "loss_fn after the model)", f"{call} item {n}: {_short_repr(a)} ({type(a).__name__})")
        if array.size == 0:
            raise TileError(where, f"{name} must return arrays with at least one element (no dim of size 0; a slice "
                            f"past the end of the data?): {numbering}", f"{call} item {n}: shape {array.shape}")
    return arrays


def _same(a, b) -> bool:
    """The same object, or equal integers (``trainer.batch_size = 8`` again)."""
    return a is b or (is_int(a) and is_int(b) and a == b)


def _short_repr(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _hooks(where: str, name: str, hooks) -> list[Callable]:
    """``on_step`` / ``on_checkpoint``: a list (or tuple) of callables."""
    if not isinstance(hooks, (list, tuple)):
        bad = f"{name}={_short_repr(hooks)}"
    else:
        bad = next((f"{name}[{i}]={_short_repr(h)} ({type(h).__name__})" for i, h in enumerate(hooks)
                    if not callable(h)), None)
    if bad is not None:
        raise TileError(where, f"{name} must be a list of callables hook(trainer, ...)", bad)
    return list(hooks)


def _check_writable(where: str, name: str, folder: Path, instead: str) -> None:
    """Refuse, before any step, a ``log_dir`` / ``checkpoint_dir`` this process cannot make or
    write in (a read-only file system, no permission): it failed after training up to the first
    checkpoint, or as a bare OSError at the metrics log (``tilegraph.io._store.unwritable_folder``
    makes the folder and probes it, touching no existing file)."""
    from tilegraph.io._store import unwritable_folder

    problem = unwritable_folder(folder)
    if problem is not None:
        raise TileError(where, f"{name} must be a folder this process can create and write in (checked here, "
                        f"{instead})", f"{name}={str(folder)!r}: {problem}")


def _require_path(where: str, path, what: str) -> None:
    """``path``, the argument of ``save_checkpoint`` / ``load_checkpoint``, is a non-empty str or
    os.PathLike (``None`` was refused as "a path (a str or pathlib.Path, not empty)", naming no
    argument, and by save_checkpoint as tilegraph.io.save_checkpoint's)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, str) and not path:
        raise TileError(where, f"a path (a non-empty str or os.PathLike) as path: {what}", f"path={_short_repr(path)}")


def _folder(where: str, name: str, value) -> Path | None:
    """``log_dir`` / ``checkpoint_dir`` as a Path (None stays None): a folder, or a path where one
    can be made (no file on the way)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or isinstance(value, str) and not value:
        # ("" was refused as "a path (a str or pathlib.Path, not empty)", naming no argument)
        raise TileError(where, f"{name} must be a folder (a non-empty str or os.PathLike) or None", repr(value))
    from tilegraph.io._store import file_in_the_way, user_path

    path = user_path(value, where)  # a leading ~ expanded, as checkpoint_dir's always was
    existing = file_in_the_way(path)
    if existing is not None:
        file = "an existing file" if existing == path else f"{existing} is a file"
        raise TileError(where, f"{name} must be a folder (made when missing)", f"{name}={str(path)!r}: {file}")
    return path


#: a row tile smaller than this many activation elements (tokens x width) costs more in extra
#: kernel calls and their hand-offs between threads than a thread of its own gains. Measured on 2
#: cores, GPT-2 6 x 768, batch 4, 2 row tiles against 1: 196,608 elements a tile 1.25-1.34x
#: faster, 98,304 1.08-1.10x, 49,152 0.82-0.94x (bench_gpt2.py --seq 128 / 64 / 32 --batch-tile)
MIN_ROW_TILE_ELEMENTS = 1 << 16


def row_tile_for(rows: int, row_elements: int, streams: int) -> int:
    """Rows per tile for ``rows`` rows of ``row_elements`` activation elements each, on
    ``streams`` threads (or GPUs): a tile per stream, or, where such tiles would be smaller than
    :data:`MIN_ROW_TILE_ELEMENTS`, as many tiles as reach it (one where even all rows do not)."""
    tiles = max(1, min(streams, rows, rows * row_elements // MIN_ROW_TILE_ELEMENTS))
    return math.ceil(rows / tiles)


def _default_row_tile(runtime, rows: int, row_elements: int, parallel: str | None = None) -> int:
    """One row tile per worker thread, so every thread has a stream of its own, unless the tiles
    would be too small to pay for their kernel calls (then fewer, :func:`row_tile_for`). With GPU
    workers, one row tile per GPU (a GPU takes large kernels best: GPT-2 124M trained at 0.53 of
    torch in whole tiles on an H100). A step asked to run data-parallel (``parallel`` "data",
    "sharded" or "zero3") gets at least one row tile per worker process: each process trains on its own
    share of the batch."""
    if runtime is None:
        threads = _config.usable_cores()
    else:
        processors = runtime.processors()
        threads = processors.get("gpu") or processors["cpu"]
    tile = row_tile_for(rows, row_elements, max(1, threads))
    if parallel in _config.BATCH_SPLITTING_STRATEGIES and runtime is not None:
        procs = len(runtime.worker_threads().get("cpu") or ())
        tile = min(tile, max(1, math.ceil(rows / max(1, procs))))
    return tile


def _during(error: WorkerLostError, during: str) -> WorkerLostError:
    """``error`` marked as a loss while ``during`` ran (an evaluation, a checkpoint: not a step's
    graph): its restart is logged and recorded so."""
    error.during = during
    return error


def _calling_code(frame) -> str:
    """The source a performance report shows as the code that ran it: ``frame``'s function or
    module (a notebook cell: IPython's current cell), as Dask's report takes it around a compute
    call."""
    import inspect

    try:
        return inspect.getsource(frame)
    except (OSError, TypeError):  # no source file (python -c, stdin)
        pass
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    cell = getattr(getattr(shell, "history_manager", None), "_i00", None)
    return cell if isinstance(cell, str) and cell else "<Code not available>"
