"""Lost, stalled and retired workers: what the scheduler says of the workers a step needs, and
the errors that name them (:class:`WorkerLostError`, :class:`StepTimeoutError`), shared by
training steps, evaluation, generation and the runner's waits."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Sequence

from tilegraph._errors import TileError
from tilegraph._graph import ValueRef
from tilegraph._lower import calls_of

#: a worker whose last heartbeat to the scheduler (one every 0.5 s) is older than this is taken
#: for stalled (stopped, swapped out, hung). Measured on 2 cores, 2 workers x 1 thread: the longest
#: silence between heartbeats was 1.0 s training the debug GPT-2, 2.7 s during GPT-2 124M's
#: data-parallel gradient exchange (a worker's event loop busy with 500 MB messages)
STALL_SECONDS = 10.0
#: after a time limit, the workers are looked at this often until each has answered since (or one
#: reaches STALL_SECONDS)
RECHECK_SECONDS = 0.5
#: a worker that Dask's memory manager paused (its process over 80% of its memory limit) this long
#: is taken for stuck: memory that is not a task result (no spilling frees it) holds it there.
#: Measured pauses while a sharded model 4x the workers' limits trained: about 1 s each
PAUSED_SECONDS = 60.0
#: how long the scheduler may take to answer a health check
SCHEDULER_ANSWER_SECONDS = 10.0
#: a gang task that found another worker's process gone ends at once; the scheduler is given
#: this long to see the loss too, so that the error names that worker
LOSS_SETTLE_SECONDS = 5.0


@functools.cache
def _lost_errors() -> tuple[type[BaseException], ...]:
    """What Dask raises when the data or the task behind a future went with a worker (imported
    when needed: importing tilegraph does not import distributed)."""
    from concurrent.futures import CancelledError

    from distributed import KilledWorker
    from distributed.comm.core import CommClosedError

    from tilegraph.exec.gang import ChannelWaitError

    return CancelledError, KilledWorker, CommClosedError, ChannelWaitError


class WorkerLostError(TileError):
    """A worker that training needed died, left the cluster or stopped responding.

    ``workers``: the addresses (``stalled``: those among them still connected but silent);
    ``steps``: the steps whose graph was running; ``during``: the work beside the steps' graphs
    that was running instead (``"the evaluation after step 8"``), or None. Parameters and
    optimizer state live on the workers as Dask futures, so what the lost workers held is gone:
    training resumes from a checkpoint (``Trainer(restart_on_failure=True)`` does it by itself).
    """

    def __init__(self, where: str, what: str, received: str | None = None, *, workers: Sequence[str] = (),
                 stalled: Sequence[str] = (), steps: range | None = None, during: str | None = None):
        super().__init__(where, what, received)
        self.workers, self.stalled, self.steps, self.during = list(workers), list(stalled), steps, during


class StepTimeoutError(TileError):
    """A step ran past its time limit while every worker kept answering (busy, or waiting for
    something that never comes)."""


@dataclass
class WorkerHealth:
    """What the scheduler says of the workers: those gone and how long each other one was silent."""

    lost: list[str] = field(default_factory=list)
    silence: dict[str, float] = field(default_factory=dict)  # connected worker -> seconds since heard from
    timed_out: set[str] = field(default_factory=set)  # lost workers the scheduler removed for silence
    #: workers Dask's memory manager paused: (seconds since, process memory, memory limit) in bytes
    paused: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    #: lost workers the scheduler's event log shows retired (:func:`retired_in`)
    retired: set[str] = field(default_factory=set)
    #: lost workers the scheduler removed unexpectedly, and why, by its event log
    #: (:func:`removal_causes`): "exited" (its nanny saw its process end) or "disconnected" (its
    #: connection to the scheduler closed: the process ended, or the network between them failed)
    causes: dict[str, str] = field(default_factory=dict)

    @property
    def stalled(self) -> dict[str, float]:
        return {a: s for a, s in self.silence.items() if s >= STALL_SECONDS}

    @property
    def stuck(self) -> dict[str, tuple[float, int, int]]:
        """Workers paused for :data:`PAUSED_SECONDS` or longer."""
        return {a: p for a, p in self.paused.items() if p[0] >= PAUSED_SECONDS}

    @property
    def failing(self) -> bool:
        """Whether a worker is lost, stalled or stuck: waiting on would not end."""
        return bool(self.lost or self.stalled or self.stuck)

    @property
    def answering(self) -> list[str]:
        return sorted(a for a, s in self.silence.items() if s < STALL_SECONDS)


def worker_health(runtime, since: float | None = None) -> WorkerHealth:
    """Ask the scheduler which workers are gone (of those the runtime last planned with, and with
    ``since``, any removed since that wall time: the scheduler's event log, read only then) and
    how long ago it heard from each of the others."""
    def heartbeat_ages(dask_scheduler) -> dict[str, tuple]:
        # seconds since each worker's last heartbeat, by the scheduler's clock, and for a paused
        # worker how long since it paused, its process memory and its limit; a nested function
        # travels by value, so a scheduler without tilegraph installed runs it too
        from time import time as now

        t = now()
        out = {}
        for addr, ws in dask_scheduler.workers.items():
            paused = None
            if ws.status.name == "paused":
                since = max((e for e, m in dask_scheduler.get_events(addr) if isinstance(m, dict)
                             and m.get("action") == "worker-status-change" and m.get("status") == "paused"),
                            default=t)
                paused = (t - since, int(ws.memory.process), int(ws.memory_limit or 0))
            out[addr] = (t - ws.last_seen, paused)
        return out

    client = runtime.client
    try:  # (the event reads too: a scheduler lost between them raised a bare CommClosedError)
        ages = client.run_on_scheduler(heartbeat_ages, callback_timeout=SCHEDULER_ANSWER_SECONDS)
        paused = {a: p for a, (_, p) in ages.items() if p is not None}
        ages = {a: age for a, (age, _) in ages.items()}
        gone = {a for addrs in runtime.last_workers.addrs.values() for a in addrs} - set(ages)
        events = client.get_events("all") if since is not None else None  # (read once: one scheduler call)
        if events is not None:  # workers that joined after the plan (a nanny's replacement) count too
            gone |= {m["worker"] for t, m in events if t >= since and isinstance(m, dict)
                     and m.get("action") == "remove-worker" and not m.get("expected")} - set(ages)
        timed_out, retired, causes = set(), set(), {}
        if gone:  # the scheduler restarts (or removes) a worker silent for distributed.scheduler.worker-ttl
            timed_out = {w for _, m in client.get_events("scheduler") if isinstance(m, dict)
                         and m.get("action") == "worker-ttl-timed-out" for w in m.get("workers", ())} & gone
            events = events if events is not None else client.get_events("all")
            retired = retired_in(events) & gone
            causes = {a: c for a, c in removal_causes(events).items() if a in gone}
    except (TimeoutError, OSError) as e:
        at = f" at {runtime.address}" if getattr(runtime, "address", None) else ""
        raise TileError("tilegraph.TrainStep", f"the Dask scheduler{at} to answer a health check within "
                        f"{SCHEDULER_ANSWER_SECONDS:g} s", _short(e)) from None
    return WorkerHealth(sorted(gone), ages, timed_out, paused, retired, causes)


def retired_in(events) -> set[str]:
    """The workers that the scheduler's event log (``client.get_events("all")``) shows retired:
    removed as expected, or named by a ``retire-workers`` (``client.retire_workers``, a user's or
    a cluster's scaling down, ``adapt``); Dask moves what such a worker holds to the others
    before it goes."""
    retired = {m.get("worker") for _, m in events if isinstance(m, dict) and m.get("action") == "remove-worker"
               and m.get("expected")}
    retired |= {w for _, m in events if isinstance(m, dict) and m.get("action") == "retire-workers"
                for w in m.get("retired", ())}
    return retired


#: what a lost worker's error says of one the scheduler removed, by :func:`removal_causes`
LEFT_BECAUSE = {
    "exited": "left the cluster: its process ended, as its nanny reported (killed, crashed, out of memory, or "
              "closed with its nanny)",
    "disconnected": "left the cluster: its connection to the scheduler closed (its process ended, or the network "
                    "between them failed)",
}


def removal_causes(events) -> dict[str, str]:
    """Why the scheduler removed workers unexpectedly, by its event log (``client.get_events("all")``,
    the stimulus of each ``remove-worker``): "exited" where the worker's nanny reported its
    process's end, "disconnected" where its connection to the scheduler closed first (a process
    killed before its nanny said so, or a network that failed: TCP gave up on it); the latest removal of
    each worker counts, and others are left out (Dask's stimulus ids: ``nanny-close-...`` of a
    nanny unregistering its worker, ``handle-worker-cleanup-...`` of a closed stream)."""
    causes: dict[str, str] = {}
    for _, m in events:
        if not (isinstance(m, dict) and m.get("action") == "remove-worker") or m.get("expected"):
            continue
        stimulus = str(m.get("stimulus_id", ""))
        cause = ("exited" if stimulus.startswith("nanny-close") else
                 "disconnected" if stimulus.startswith("handle-worker-cleanup") else None)
        if cause is not None:
            causes[m.get("worker")] = cause
    return causes


def workers_left(info, executables) -> tuple[set[str], set[str]]:
    """``(staying, left)``: the workers of ``info`` (a runtime's ``workers()``, the scheduler's
    records) not leaving the cluster (:data:`tilegraph.runtime.LEAVING`), and those the plans of
    ``executables`` name that are gone or leaving."""
    from tilegraph.runtime import LEAVING

    staying = {a for a, w in info.items() if w.get("status") not in LEAVING}
    planned = {a for exe in executables if exe.workers is not None for a in exe.workers.memory_limits}
    return staying, planned - staying


def why_removed(runtime, workers) -> str:
    """How ``workers`` left the cluster, by the scheduler's event log: "retired from the cluster"
    (a ``retire_workers``: a user's, or a cluster scaling down; or leaving so), else "left the
    cluster"."""
    retiring = {a for a, w in runtime.workers().items() if w.get("status") == "closing_gracefully"}
    if set(workers) <= retired_in(runtime.client.get_events("all")) | retiring:
        return "retired from the cluster"
    return "left the cluster"


def _futures(values) -> list:
    """The Dask futures behind ``values`` (cells' values: arrays, :class:`ValueRef` s; every copy
    of a replicated one)."""
    from tilegraph._graph import CopiesRef, ReplicatedRef

    out = []
    for v in values:
        if isinstance(v, ReplicatedRef):
            out += [r.future for r in v.replicas]
        elif isinstance(v, CopiesRef):
            out += [r.future for _, r in v.copies]
        elif isinstance(v, ValueRef):
            out.append(v.future)
    return out


def on_workers(runtime, values, workers: set) -> bool:
    """Whether every value of ``values`` on the workers is computed and held by one of ``workers``
    (the scheduler's record: one call)."""
    futures = list({f.key: f for f in _futures(values)}.values())
    if any(f.status != "finished" for f in futures):
        return False
    if not futures:
        return True
    held = runtime.client.who_has(futures)
    return all(set(held.get(f.key) or ()) & workers for f in futures)


def end_calls(runtime, pendings, seconds: float = 10.0) -> None:
    """Cancel the tasks of the steps ``pendings`` (their gang calls) still running, and wait up to
    ``seconds`` until none is pending: the next gang task on a worker runs after the last one
    submitted there, and would fail with it."""
    values = [v for p in pendings for v in [*p._losses, p._norm] if v is not None]
    futures = list({id(f): f for call in calls_of(values) for f in call}.values())
    pending = [f for f in futures if f.status == "pending"]
    if pending:
        runtime.client.cancel(pending)
    deadline = time.perf_counter() + seconds
    while any(f.status == "pending" for f in futures) and time.perf_counter() < deadline:
        time.sleep(0.05)


#: what a lost worker's error says of one that retired (:func:`retired_in`)
RETIRED = "retired from the cluster: retire_workers, by a user or a cluster scaling down"


def _steps_text(steps: range) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _short(error: BaseException, limit: int = 300) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


#: what a lost worker's error says is gone (the Trainer's and tilegraph train's advice follow it)
LOST_STATE = "parameters and optimizer state live on the workers as Dask futures, and what a lost worker held is gone"
#: what a lost worker's error tells to do
LOST_STATE_HINT = (f"{LOST_STATE}: resume from a checkpoint (Trainer.load_checkpoint), or train with "
                   "Trainer(restart_on_failure=True, checkpoint_dir=..., checkpoint_every=...)")


#: what a lost worker's error tells to do when the model's parameters are this process's own
EVAL_LENT_HINT = ("the model's parameters are this process's own, only lent to the workers for the evaluation: it can "
                  "run again on the workers left")


def lost_worker_error(health: WorkerHealth, during: str, received: str, *, steps: range | None = None,
                      where: str = "tilegraph.TrainStep", hint: str = LOST_STATE_HINT) -> WorkerLostError:
    """The error for workers found lost (or, when none is named, for data the cluster lost)
    while ``during`` ran; ``hint`` says what is gone and how to go on."""
    stalled = health.stalled
    named = [f"{a} (silent past the scheduler's worker-ttl, restarted)" if a in health.timed_out
             else f"{a} ({RETIRED})" if a in health.retired
             else f"{a} ({LEFT_BECAUSE.get(health.causes.get(a), 'left the cluster')})" for a in health.lost]
    named += [f"{a} (no heartbeat for {s:.0f} s: stopped, hung or cut off from the network)" for a, s in sorted(stalled.items())]
    stuck = {a: p for a, p in health.stuck.items() if a not in stalled}
    mb = 1 << 20
    named += [f"{a} (paused by Dask's memory manager for {t:.0f} s, its process at {m / mb:,.0f} MiB of its "
              f"{lim / mb:,.0f} MiB memory limit: memory that spilling to disk cannot free; give the workers more "
              "memory (tg.connect(memory_limit=...)), or lower tilegraph.config.task_memory_fraction)"
              for a, (t, m, lim) in sorted(stuck.items())]
    stalled = {**stalled, **{a: p[0] for a, p in stuck.items()}}
    if named:
        what = f"lost worker{'s' if len(named) > 1 else ''} {', '.join(named)} while {during} ran"
    else:
        what = f"the cluster lost tasks or data of {during} (no worker was found missing)"
    return WorkerLostError(where, f"{what}; {hint}", received, workers=[*health.lost, *sorted(stalled)],
                           stalled=sorted(stalled), steps=steps)


def translate_worker_failure(runtime, error: BaseException, during: str, *, steps: range | None = None,
                             since: float | None = None, where: str = "tilegraph.TrainStep",
                             hint: str = LOST_STATE_HINT) -> TileError | None:
    """The clear error for ``error`` (raised while ``during`` ran) when a worker was lost: a
    :class:`WorkerLostError` naming the workers. None when ``error`` has another cause (a kernel's
    error, say): the caller re-raises it."""
    if runtime is None or isinstance(error, TileError):
        return None
    from tilegraph.exec.gang import ChannelWaitError

    dask_loss = isinstance(error, _lost_errors())
    lost_scheduler = getattr(runtime, "scheduler_problem", None)
    problem = lost_scheduler(probe=False) if dask_loss and lost_scheduler is not None else None
    if problem is not None:  # the client lost its scheduler: no health check can answer (it waited
        return TileError(where, f"{during} failed: {problem}", _short(error))  # 10 s), no worker is to blame
    try:
        health = worker_health(runtime, since)
        # a gang task finds its peer's process gone as soon as it looks, the scheduler a moment later
        settle = time.perf_counter() + LOSS_SETTLE_SECONDS if isinstance(error, ChannelWaitError) else 0.0
        while not health.failing and time.perf_counter() < settle:
            time.sleep(0.1)
            health = worker_health(runtime, since)
    except Exception as e:  # the scheduler itself is unreachable
        if not dask_loss:
            return None
        return TileError(where, f"{during} failed and the Dask scheduler did not answer ({_short(e, 120)})",
                         _short(error))
    if not dask_loss and not health.failing:
        return None
    return lost_worker_error(health, during, _short(error), steps=steps, where=where, hint=hint)
