"""One call of :meth:`tilegraph.Trainer.fit`: its steps submitted group by group, each step's loss
waited for and logged, the evaluations, checkpoints and hooks between them, a lost worker's
restart, and the :class:`FitResult` at the end (``tilegraph.trainer`` imports it from here, with
:func:`perplexity`).

:class:`FitRun` holds what the loop shares between its parts (the steps waiting, the clock, the
counts of tokens and graphs); the :class:`~tilegraph.Trainer` holds what outlives one fit (the
step, the optimizer, the checkpoints, the folders) and the checks and fault handling that
:meth:`~tilegraph.Trainer.evaluate` and the CLI use too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

from tilegraph import _config
from tilegraph._progress import _Aside, _import_matplotlib_aside, _progress
from tilegraph._health import (StepTimeoutError, WorkerLostError, _steps_text, end_calls, on_workers, why_removed,
                               workers_left)
from tilegraph._train import StepStats
from tilegraph.runtime import _plural

logger = logging.getLogger("tilegraph")


def perplexity(loss: float) -> float:
    """``exp(loss)`` of a mean next-token loss in nats (inf past float64's range, not an error)."""
    return math.inf if loss >= 709.0 else math.exp(loss)  # a NaN loss stays NaN


@dataclass
class FitResult:
    steps: int                         # optimizer steps run by this call
    losses: list[float]                # training loss of each step
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, validation loss)
    seconds: float = 0.0
    #: tokens trained per second, where the batches are tokens (a token dataset, or integer ids
    #: (B, T) as a callable's first array); 0.0 for other data, whose rate is :attr:`samples_per_s`
    tokens_per_s: float = 0.0
    checkpoints: list[str] = field(default_factory=list)
    #: seconds inside tile kernels per part of the model and phase ("blocks.0.attn:backward",
    #: "optimizer:update"), summed over the workers' threads, largest first
    kernel_seconds: dict[str, float] = field(default_factory=dict)
    #: the share of the workers' thread time spent outside kernels (Dask, transfers, waiting)
    outside_kernels: float = 0.0
    #: the part of :attr:`outside_kernels` when no tile task held the thread: threads a step
    #: leaves idle (a small model's step may keep one thread of several busy), Dask's scheduling
    #: and transfers, a gang's waits for other processes, the client's work between steps
    #: (validation, checkpoints); the rest is tilegraph's task runner around the kernels
    no_task: float = 0.0
    #: ``restart_on_failure``: one record per restart: the steps that were running ("failed"),
    #: the workers lost, the checkpoint resumed and its step
    restarts: list[dict] = field(default_factory=list)
    #: :meth:`Trainer.request_stop` (Ctrl-C, SIGTERM in the CLI) ended the fit before its last step
    stopped: bool = False
    #: rows (the first dim of a batch's first array: sequences of a token dataset) per second
    samples_per_s: float = 0.0

    def __repr__(self) -> str:
        """A short summary: a notebook shows it as the value of a cell ending in ``trainer.fit(n)``,
        where the dataclass's repr printed every loss and every kernel time (~60 entries for
        gpt2-debug: 2.7 kB for a 3-step fit). The fields hold them all."""
        def last(items: list, text, keep: int) -> str:  # the newest ``keep``, after a count of the others
            earlier = [f"... {len(items) - keep} earlier"] if len(items) > keep else []
            return "[" + ", ".join(earlier + [text(x) for x in items[-keep:]]) + "]"

        losses = [f"{v:.4g}" for v in self.losses]
        shown = losses if len(losses) <= 6 else [*losses[:3], "...", *losses[-2:]]
        rate = (f"tokens_per_s={self.tokens_per_s:,.0f}" if self.tokens_per_s else
                f"samples_per_s={self.samples_per_s:,.0f}")
        parts = [f"steps={self.steps}", f"losses=[{', '.join(shown)}]"]
        if self.val_losses:
            parts.append("val_losses=" + last(self.val_losses, lambda sv: f"({sv[0]}, {sv[1]:.4g})", 3))
        parts += [f"seconds={self.seconds:.3g}", rate]
        if self.checkpoints:
            parts.append("checkpoints=" + last(self.checkpoints, repr, 1))
        if self.restarts:
            parts.append(f"restarts={len(self.restarts)}")
        if self.stopped:
            parts.append("stopped=True")
        return f"FitResult({', '.join(parts)})"

    @property
    def val_perplexities(self) -> list[tuple[int, float]]:
        """(step, validation perplexity): :func:`perplexity` of each of :attr:`val_losses` (a
        number that means something for a language model's token cross-entropy only)."""
        return [(step, perplexity(loss)) for step, loss in self.val_losses]

    def profile(self, top: int = 8) -> str:
        """Where the time went: the parts of the model with the most kernel time, and the share
        outside kernels.

        >>> FitResult(1, [1.0], seconds=2.0, kernel_seconds={"blocks.0.mlp": 1.5, "optimizer:update": 0.5},
        ...           outside_kernels=0.5, no_task=0.4).profile()
        'kernel time: blocks.0.mlp 75%, optimizer:update 25%; outside kernels: 50% of worker thread time (40% in no task: idle threads, Dask, waits; 10% in the task runner)'
        """
        total = sum(self.kernel_seconds.values()) or 1.0
        parts = ", ".join(f"{k or '(outside modules)'} {v / total:.0%}" for k, v in list(self.kernel_seconds.items())[:top])
        runner = max(0.0, self.outside_kernels - self.no_task)
        return (f"kernel time: {parts}; outside kernels: {self.outside_kernels:.0%} of worker thread time "
                f"({self.no_task:.0%} in no task: idle threads, Dask, waits; {runner:.0%} in the task runner)")


class FitRun:
    """The steps ``start + 1`` to ``start + steps`` of ``trainer``; :meth:`run` runs them.

    ``waiting`` holds the steps submitted and not yet finished, oldest first, as
    ``(step, pending, batch)``: with ``trainer.pipeline`` a group's graph is submitted before the
    previous group's losses are waited for, so the workers never wait for the loop."""

    def __init__(self, trainer, where: str, steps: int):
        self.trainer = trainer
        self.where = where
        self.start = trainer.optimizer.step_count
        self.end = self.start + steps
        self.result = FitResult(0, [])
        self.waiting: list[tuple[int, object, tuple]] = []
        #: batches asked for and not run yet, by step: those asked for ahead of their group, and
        #: those of steps undone after a worker retired (:meth:`_undone_on_workers_left`)
        self.ahead: dict[int, tuple] = {}
        self.redraw: list[int] = []  # an evaluation's step after which loss.png is due
        self.report = contextlib.ExitStack()
        self.report_step = trainer.report_step  # None: the fit's second graph (its first one where it has one)
        self.outside = self.report_step is not None and not self.start < self.report_step <= self.end
        self.reported = False  # whether a graph of this fit was reported on
        self.graphs = 0  # the graphs submitted
        self.tokens = self.samples = 0
        self.step_seconds = 0.0  # the last graph's time per step (see log_step)
        self.fresh = range(0)  # the steps of the last graph that was recorded (and compiled) for its first run
        self.bar = self.log = None
        self.t0 = self.clock = 0.0  # the fit's start; when the graph the loop waits for could start

    def run(self) -> FitResult:
        """Run the steps and return what they did (called by :meth:`Trainer.fit`: the warnings
        name its caller's line)."""
        tr, start, end, result = self.trainer, self.start, self.end, self.result
        if tr.runtime is not None:  # workers joined since the last fit (a lost one started again): use them
            tr.step.follow_workers()
            if tr._eval is not None:
                tr._eval.follow_workers()
        tr._check_checkpoint_dir(self.where, start)
        tr._warn_past_schedule(start, end)
        tr._join_logged_run(start)
        self.bar = _progress(end - start, tr.progress)
        if tr.log_dir is not None:
            tr.log_dir.mkdir(parents=True, exist_ok=True)
        self.log = open(tr.log_dir / "metrics.jsonl", "a") if tr.log_dir is not None else None
        if tr._summary_writer is not None:  # flushed every 10 s, so TensorBoard follows the run
            tr._tb = tr._summary_writer(str(tr.tensorboard_dir), flush_secs=10)
        tr._kernel_stats(reset=True)
        if tr.performance_report is not None and self.outside:
            warnings.warn(f"[tilegraph.Trainer.fit] report_step={self.report_step} is not among this fit's "
                          f"steps {start + 1}-{end}: no performance report is written to "
                          f"{tr.performance_report}", stacklevel=3)
        self.t0 = self.clock = time.perf_counter()
        tr._stop = False
        drawing = None
        ended = False  # every step ran: an interruption from here on lands in the end-of-fit work
        try:
            try:
                self._steps_and_restarts()
                ended = True
                if tr.log_dir is not None:  # drawn while the last checkpoint is written
                    drawing = _Aside(tr.plot)
                if tr.checkpoints is not None:
                    last = tr.optimizer.step_count
                    tr._watched(tr.checkpoints.wait, f"the checkpoint of step {last}", range(last, last + 1))
                    tr._checkpoint_hooks()
            finally:
                self.report.close()
                self.bar.close()
                if self.log is not None:
                    self.log.close()
                if tr._tb is not None:
                    tr._tb.close()
                    tr._tb = None
            if tr.performance_report is not None and not self.reported and result.losses and not self.outside:
                warnings.warn(f"[tilegraph.Trainer.fit] no graph of this fit held report_step={self.report_step}: no "
                              f"performance report was written to {tr.performance_report}", stacklevel=3)
            self._summarize()
            if drawing is not None:
                drawing.result()
        except KeyboardInterrupt:
            # (one during the steps said so in _steps_and_restarts; after them the loop had
            # returned, and the traceback came with no word of the state left)
            if ended and not tr._stop:
                self.bar.write(self._interrupted_text())
            raise
        return result

    # -- the loop -----------------------------------------------------------------------------

    def _steps_and_restarts(self) -> None:
        """Every step from ``start + 1``; after a lost worker, again from the checkpoint the
        trainer restarted at (``trainer._restart``); a stop asked for (``request_stop``) ends
        with a checkpoint of the last step run."""
        tr, result, end = self.trainer, self.result, self.end
        i = self.start + 1
        while True:
            try:
                self._submit_from(i)
                done = tr.optimizer.step_count
                if tr._stop and done < end:  # stopped: a checkpoint of the last step run
                    result.stopped = True
                    self.bar.write(f"stopping after step {done} (of {end})")
                    if tr.checkpoints is not None and done > self.start \
                            and str(tr.checkpoints.path(done)) not in result.checkpoints:
                        path = tr._watched(lambda: tr._start_checkpoint(done),
                                           f"the checkpoint of step {done}", range(done, done + 1))
                        result.checkpoints.append(str(path))
                return
            except (WorkerLostError, StepTimeoutError, FloatingPointError) as e:
                if isinstance(e, WorkerLostError):  # a worker retired: its values moved to the others
                    undone = self._undone_on_workers_left(e)
                    if undone is not None:
                        i = undone + 1
                        continue
                self.waiting.clear()  # steps on lost workers, past a time limit or after a NaN: none to log
                if not isinstance(e, WorkerLostError):
                    raise
                i = self._restarted(e) + 1
            except BaseException as e:
                lost = tr._scheduler_lost(e, self.waiting[0][0] if self.waiting else tr.optimizer.step_count)
                if lost is not None:  # nothing of the steps waiting comes from a scheduler that is gone
                    self.waiting.clear()
                    raise lost from e
                self._settle()
                # a notebook shows the traceback: say where it stands. Not after request_stop(): a
                # program that stops the fit itself (tilegraph train's Ctrl-C handler; its second
                # Ctrl-C comes here) says its own thing, where "fit again" means nothing
                if isinstance(e, KeyboardInterrupt) and not tr._stop:
                    self.bar.write(self._interrupted_text())
                raise

    def _submit_from(self, i: int) -> None:
        """Steps ``i`` to ``end``, submitted in groups (one recorded graph each), each group's
        losses finished while the next one runs."""
        tr, end = self.trainer, self.end
        # each step's batch is asked for once (a data callable may be a stream): those asked
        # for ahead of their group wait here (and those of steps undone, to run again)
        ahead = self.ahead
        if i not in ahead:
            ahead[i] = tr._batch(i)
        tr._check_first_batch(i, ahead[i])
        tr._note_batch_kind(ahead[i])
        per_graph = tr._steps_per_graph(ahead[i])
        while i <= end and not tr._stop:
            # this group: up to the next step the loop waits at, cut into near-equal groups
            # of at most per_graph steps (one recorded graph serves them all)
            # (looked for no further than per_graph**2 steps ahead: one farther cuts the same groups,
            # of per_graph steps each, and a run of 10**12 steps without checkpoints or evaluations
            # scanned them all in Python before its first step, as if it hung)
            horizon = min(end, i + per_graph * per_graph)
            stop = next((j for j in range(i, horizon + 1) if self._waits(j)), horizon)
            size = math.ceil((stop - i + 1) / math.ceil((stop - i + 1) / per_graph))
            group = range(i, min(stop, i + size - 1) + 1)
            for j in group:
                if j not in ahead:
                    ahead[j] = tr._batch(j)
            batches = [ahead[j] for j in group]
            # a group is one graph of one batch signature: a batch of other shapes (a data
            # callable whose last batch of an epoch is smaller, say) starts the next group
            sig = tr.step.signature(batches[0])
            cut = next((n for n, b in enumerate(batches) if tr.step.signature(b) != sig), len(batches))
            group, batches = group[:cut], batches[:cut]
            self.graphs += 1
            reporting = self._reports(group)
            self.reported = self.reported or reporting
            if reporting:
                tr._start_report(self.report)
            with tr._translate_lost_workers(_steps_text(group), group):
                pendings = tr.step.submit_steps(batches)
            for j in group:  # (kept until submitted: a worker retiring as they are sent, they go again)
                del ahead[j]
            # waiting at once: a stop during the redraw below leaves them for _settle to log (they run)
            earlier = len(self.waiting)
            self.waiting.extend(zip(group, pendings, batches))
            if self.redraw:  # while these steps run
                self.redraw.clear()
                tr.plot()
            elif tr.log_dir is not None and group[0] == self.start + 1:
                _import_matplotlib_aside()  # while the workers run the first steps
            self._finish_waiting(earlier)  # the earlier group's, while this one runs
            if not tr.pipeline or self._waits(group[-1]) or reporting:
                self._finish_waiting()
                self._close_report()
            i = group[-1] + 1
        self._finish_waiting()  # stopped early (request_stop)

    def _reports(self, group: range) -> bool:
        """Whether the performance report covers ``group``'s graph: the one holding
        ``report_step``, else the fit's second graph (its first, where that one is its last)."""
        tr = self.trainer
        if tr.performance_report is None:
            return False
        if self.report_step is None:
            return not self.reported and (self.graphs == 2 or group[-1] == self.end)
        return self.report_step in group

    def _evaluates(self, i: int) -> bool:
        tr = self.trainer
        return tr._eval is not None and (i == self.end or bool(tr.eval_every and i % tr.eval_every == 0))

    def _checkpoints(self, i: int) -> bool:
        tr = self.trainer
        return tr.checkpoints is not None and (i == self.end or tr.checkpoints.due(i))

    def _waits(self, i: int) -> bool:
        """Whether the loop waits after step ``i``: the last step, and before an evaluation or checkpoint."""
        return i == self.end or self._evaluates(i) or self._checkpoints(i)

    # -- each step's end ------------------------------------------------------------------------

    def _log_step(self, i: int, pending, batch, patient: bool) -> float:
        """Wait for step ``i``'s loss and log it."""
        tr, result = self.trainer, self.result
        # raises on a NaN/inf loss naming the step, and on a lost or stalled worker
        began = self.clock
        try:
            loss = pending.result(tr._time_limit(pending, self.clock), patient=patient, undo_retired=False)
        except FloatingPointError:
            raise tr._diverged(pending) from None
        self.clock = time.perf_counter()
        stats: StepStats = pending.stats
        if i == pending.steps[0]:  # its graph's time from when it could start, shared by its steps
            self.step_seconds = (self.clock - max(began, pending.submitted)) / len(pending.steps)
        self.fresh = pending.steps if pending.fresh else self.fresh
        if i not in self.fresh:  # a first run's time (recording, compilation) says little of the next ones
            tr._recent.append(stats.seconds)
        counted = tr._counted(batch)
        self.tokens, self.samples = self.tokens + counted[0], self.samples + counted[1]
        elapsed = time.perf_counter() - self.t0
        if i > self.start:  # a restart may go back before this fit's first step
            result.losses.append(loss)
        # tokens where the batches are tokens; rows of other data (a (B, D) batch of float
        # features counted B x D "tokens")
        rate, short, count = (("tokens_per_s", "tok_s", self.tokens) if tr.token_batches else
                              ("samples_per_s", "samples_per_s", self.samples))
        tr._log(self.log, {"step": i, "loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm,
                           rate: count / elapsed, "step_seconds": self.step_seconds, "tasks": stats.tasks,
                           "time": time.time()})
        self.bar.set_postfix(loss=f"{loss:.4f}", **{short: f"{count / elapsed:,.0f}"}, refresh=False)
        self.bar.update(1)
        return loss

    def _finish(self, i: int, pending, batch) -> None:
        """Log the oldest step waiting (``i``), taking it off ``waiting`` once logged (an
        interruption while it waits for the loss leaves it there, for _settle() to log), then
        its hooks, evaluation and checkpoint."""
        tr, result = self.trainer, self.result
        loss = self._log_step(i, pending, batch, patient=tr.step_timeout == "auto")
        self.waiting.pop(0)  # logged: a hook that raises below leaves the later ones waiting
        for hook in tr.on_step:
            hook(tr, pending.stats)
        if self._evaluates(i):
            val = tr._watched(tr.evaluate, f"the evaluation after step {i}", range(i, i + 1))
            result.val_losses.append((i, val))
            # a perplexity only of a language model's token cross-entropy (exp of an MSE is none)
            ppl = {"val_ppl": perplexity(val)} if tr.language_model else {}
            tr._log(self.log, {"step": i, "val_loss": val, **ppl, "time": time.time()})
            self.bar.write(f"step {i}: loss {loss:.4f}, validation loss {val:.4f}"
                           + (f" (perplexity {perplexity(val):.2f})" if tr.language_model else ""))
            if i != self.end and tr.log_dir is not None and tr._plot_due(self.t0):  # the end draws anyway
                self.redraw.append(i)  # drawn once the next steps run (the workers wait for nothing it does)
        if self._checkpoints(i):
            path = tr._watched(lambda: tr._start_checkpoint(i), f"the checkpoint of step {i}", range(i, i + 1))
            result.checkpoints.append(str(path))
        tr._checkpoint_hooks()

    def _finish_waiting(self, n: int | None = None) -> None:
        """Finish the ``n`` oldest steps waiting (None: all)."""
        for _ in range(len(self.waiting) if n is None else n):
            self._finish(*self.waiting[0])

    def _close_report(self) -> None:
        """Write the performance report (if one is open): its time (Dask gathers the task
        stream and profiles, and draws them) is not training time, so the fit's clock skips it."""
        began = time.perf_counter()
        self.report.close()
        spent = time.perf_counter() - began
        self.t0 += spent
        self.clock += spent

    # -- interruptions and lost workers ---------------------------------------------------------

    def _settle(self) -> None:
        """After an interruption (KeyboardInterrupt, an error in a hook or in the data): the
        steps already submitted ran, or run, and their updates are in the parameters and the
        step count, so their losses are logged too (without hooks, evaluations or
        checkpoints). Before, they were missing from ``metrics.jsonl`` and ``history``
        while the next fit went on after them."""
        again = False
        waiting = self.waiting
        while waiting:
            i, pending, batch = waiting[0]
            try:
                self._log_step(i, pending, batch, patient=False)
            except KeyboardInterrupt:  # a second stop while the steps run out: logged all the same,
                if again:  # (the steps are short, each under its time limit); a third stops at once
                    waiting.clear()
                    raise
                again = True
                self.bar.write(f"stopping: logging the {_plural(len(waiting), 'step')} already run "
                               "(interrupt again to stop at once, without their records)")
                continue
            except Exception:  # a step that failed itself: the interruption's error is the one raised
                waiting.clear()
                break
            waiting.pop(0)

    def _interrupted_text(self) -> str:
        """What a KeyboardInterrupt leaves, said above the traceback a notebook shows: the step
        the model is at, and after the fit's last step (in its hooks, the evaluation, the final
        checkpoint or the end-of-fit work) whether that checkpoint was written, and the last one
        complete."""
        tr = self.trainer
        done, ck = tr.optimizer.step_count, tr.checkpoints
        said = f"interrupted: stopped after step {done}, every step run logged"
        if done < self.end or ck is None:
            return f"{said} (fit again to go on from there)"
        said += ", the fit's last"
        path = ck.path(done)
        if path.is_dir():  # renamed into place when complete: a folder under its name is whole
            return f"{said}; the checkpoint of step {done} was written: {path}"
        if ck.busy and ck.pending_step == done:  # a daemon thread: it commits unless the process ends first
            state = (f"is still being written in the background ({path}; it completes unless the process ends first: "
                     "trainer.wait_for_checkpoint() waits for it and runs the on_checkpoint hooks)")
        else:
            state = "was not written (trainer.save_checkpoint(path) writes one)"
            if ck.busy:  # an earlier one, interrupted while the final save waited for it
                state += (f"; that of step {ck.pending_step} is still being written in the background (it "
                          "completes unless the process ends first: trainer.wait_for_checkpoint() waits for it)")
        complete = ck.checkpoints()
        last = f"the last complete one: {complete[-1]}" if complete else f"no complete checkpoint in {ck.dir}"
        return f"{said}; the checkpoint of step {done} {state}; {last}"

    def _undone_on_workers_left(self, e: WorkerLostError) -> int | None:
        """After worker loss ``e`` while steps ran or were sent: where the worker left the cluster
        and every value the steps read is on the workers left (a worker retired, by
        ``client.retire_workers`` or a cluster scaling down: Dask moved what it held first),
        undo the steps not logged yet (the model's parameters and optimizer state, and the step
        count, as before them), plan again on the workers left and return the step the run goes
        on after: the steps run again, with their batches, as if no worker had left. Before, the
        step failed with a WorkerLostError saying the state was lost, and the next fit was refused
        as "state lost", although none was. None where it cannot be done (a worker that died took
        values with it, one stopped or hung holds them): the caller restarts from a checkpoint,
        or raises ``e``."""
        tr = self.trainer
        if tr.runtime is None or e.during is not None or e.stalled or e.steps is None:
            return None
        try:
            info = tr.runtime.workers()
            staying, left = workers_left(info, tr.step.executables)
            if not staying or not left or set(e.workers) & set(info):  # (a lost worker still there: stalled)
                return None
            if self.waiting:  # the oldest step not logged yet failed: what its cells held before it
                first, pending, _ = self.waiting[0]
                undo = getattr(pending, "_undo", None)
                if first not in e.steps or undo is None or undo.before is None or undo.undone is not None \
                        or undo.rollbacks != tr.step._rollbacks:
                    return None
                kept = [value for _, value, _ in undo.before.values()]
            else:  # its parameters were being sent to the workers: the step was taken back (not counted)
                first = e.steps[0]
                if tr.optimizer.step_count != first - 1:
                    return None
                kept = [c.value for p in tr.optimizer.params for c in p.cells.flat]
                kept += [c.value for state in tr.optimizer.state_cells for grid in state for c in grid.flat]
            if not on_workers(tr.runtime, kept, staying):
                return None
            # the tasks of the steps waiting end first: a gang task waits for the last one on its worker
            end_calls(tr.runtime, [p for _, p, _ in self.waiting])
            why = why_removed(tr.runtime, left)
        except Exception:  # (the scheduler gone meanwhile): the caller's error handling says so
            return None
        if self.waiting:
            undo()
            if undo.undone != first - 1 or tr.optimizer.step_count != first - 1:
                return None  # (not put back: the cells hold the failed steps' values)
            self.ahead.update((i, batch) for i, _, batch in self.waiting)  # run again with the same batches
        steps = range(first, max([first, *e.steps, *(i for i, _, _ in self.waiting)]) + 1)
        self.waiting.clear()
        self._close_report()
        tr.step.reset_plans()  # planned again on the workers there are now
        if tr._eval is not None:
            tr._eval.reset_plans()
        logger.warning("tilegraph.Trainer: worker(s) %s %s while %s ran; the model's values are on the workers left "
                       "(Dask moved them), so training goes on from step %d (the model as it was before it), planned "
                       "again for %s", ", ".join(sorted(left)), why, _steps_text(steps), first,
                       _plural(len(staying), "worker"))
        return first - 1

    def _restarted(self, e: WorkerLostError) -> int:
        """After worker loss ``e``: plan again, let a save under way end, and have the trainer
        restart from its last checkpoint (or raise); the records after that checkpoint go.
        Returns the step the run goes on after."""
        tr, result = self.trainer, self.result
        self._close_report()
        self.ahead.clear()  # a restarted run asks for its batches again, from the checkpoint's step
        # the cached plans pin tasks and programs to workers that are gone: plan
        # again (also when the caller resumes by hand after this error)
        tr.step.reset_plans()
        if tr._eval is not None:
            tr._eval.reset_plans()
        lost_save = None  # the step of a save under way that the worker took with it
        if tr.checkpoints is not None:
            saving = tr.checkpoints.pending_step
            try:  # a save under way when the worker went: it committed, or never will
                tr.checkpoints.wait()
            except Exception:
                lost_save = saving
            tr._checkpoint_hooks()
        resumed = tr._restart(e, len(result.restarts), lost_save)
        record = {"failed": [e.steps[0], e.steps[-1]] if e.steps else None, "workers": e.workers,
                  "checkpoint": str(tr._last_checkpoint), "step": resumed}
        if e.during:  # lost in an evaluation or a checkpoint, not a step's graph
            record = {"failed": record["failed"], "during": e.during, **record}
        result.restarts.append(record)
        tr._log(self.log, {**record, "restart": True, "time": time.time()})
        del result.losses[max(0, resumed - self.start):]
        # the evaluations after the checkpoint run again too (they were kept twice)
        result.val_losses[:] = [(s, v) for s, v in result.val_losses if s <= resumed]
        self.bar.n = max(0, resumed - self.start)
        self.bar.refresh()
        return resumed

    # -- the result -----------------------------------------------------------------------------

    def _summarize(self) -> None:
        """The result's counts, rates and the share of the threads' time outside kernels."""
        tr, result = self.trainer, self.result
        result.steps = len(result.losses)
        result.seconds = time.perf_counter() - self.t0
        result.tokens_per_s = self.tokens / result.seconds
        result.samples_per_s = self.samples / result.seconds
        ks = tr._kernel_stats()
        result.kernel_seconds = dict(sorted(ks["by_scope"].items(), key=lambda kv: -kv[1]))
        threads = sum(tr.runtime.processors().values()) if tr.runtime is not None else _config.usable_cores()
        thread_seconds = result.seconds * threads
        result.outside_kernels = max(0.0, 1.0 - ks["kernel_seconds"] / thread_seconds)
        result.no_task = min(result.outside_kernels, max(0.0, 1.0 - ks["task_seconds"] / thread_seconds))
