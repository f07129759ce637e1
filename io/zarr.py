"""Zarr checkpoints: the full training state, written by the workers that hold the tiles.

A checkpoint is a Zarr v3 group (a folder)::

    zarr.json                     attributes["tilegraph"]: format, version, model config and
                                  tiling, step, optimizer and LR-schedule state, user metadata,
                                  the list of arrays (with how each is stored) and ``complete``
    model/<parameter name>        one array per parameter, chunks = the parameter's tiles
    optimizer/<state>/<parameter> one array per optimizer moment (exp_avg, exp_avg_sq, ...) and
                                  parameter, named as in model/ (format 2 and earlier:
                                  optimizer/<parameter>/<state>, still read)
    <extra files>                 e.g. the tokenizer, written before the commit

Other tools: zarr-python and other Zarr v3 readers (TensorStore) open every array, a quantized
parameter's tiles as byte arrays. A checkpoint's values may be changed with zarr-python by
writing into its arrays, with ``zarr.config.set({"array.write_empty_chunks": True})``: a load
takes a missing chunk file for damage (a copy cut short), never for the fill value zeros that
the Zarr spec reads it as. An array made anew in another layout (compressed, ``c/0/1``) is
refused at opening, named with how it differs.

Every chunk carries a CRC32C checksum (Zarr's ``crc32c`` codec), checked on every read. A
quantized parameter is a group instead of an array: one subgroup per tile holding that tile's
quantized parts (codes, scales, codebook); it loads dequantized, tile by tile, on the workers.
A weight the model holds quantized (a :class:`tilegraph.peft.QuantizedTensor`: the frozen base
of a fine-tuning run on a quantized checkpoint) is stored the same way, its parts copied as they
are, so the checkpoint is complete: ``peft.from_quantized`` reopens it with the same parts, and
``load_into`` puts them back into a model holding that weight quantized.

Saving never gathers to the client: one task per task result that holds parameter tiles runs
on the worker holding it and writes those tiles. Everything is written under a hidden temporary
name next to the target, verified, and renamed: a save that fails or is killed leaves the
previous checkpoints as they were and nothing that loads as a checkpoint. Loading reads each
tile of the *model's* tiling on a worker (any tiling, any number of workers: resharding is a
read of other slices), so the values again never pass through the client.

>>> import tilegraph as tg, numpy as np
>>> from tilegraph import models
>>> model = models.build("gpt2-debug", seed=0)
>>> path = tg.io.save_checkpoint(tmp / "ck", model, step=3)  # doctest: +SKIP
>>> ck = tg.io.load_checkpoint(tmp / "ck")                   # doctest: +SKIP
>>> ck.step, ck.model.config == model.config                 # doctest: +SKIP
(3, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import itertools
import json
import warnings
import os
import shutil
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from tilegraph._config import is_int
from tilegraph._errors import TileError
from tilegraph._graph import ReplicatedRef, ValueRef

from ._store import (CHUNK_SEPARATOR, STALE_OTHER_HOST_SECONDS, TMP_MARK, CheckpointError, Opaque, SaveAbandoned,
                     array_meta, chunk_key, chunk_path, chunks_of, file_in_the_way, group_meta, host_label, job_bytes,
                     layout_problems, process_alive, quantized_layout, quantized_parts, read_parts_task, read_region,
                     read_regions, shards_of, slices, temp_name, temp_writer, tile_label, untouched_for,
                     unwritable_folder, user_path, write_failure, write_meta, write_parts_task, write_shard_task,
                     write_tiles, write_values)

__all__ = ["save_checkpoint", "prepare_save", "PendingSave", "load_checkpoint", "Checkpoint", "CheckpointManager",
           "is_checkpoint", "quantize_rule", "FORMAT", "FORMAT_VERSION",
           "CheckpointError"]

FORMAT = "tilegraph-checkpoint"
#: bumped when a reader of an older version could not read what a newer one writes. 3: the
#: optimizer's arrays ``optimizer/<state>/<parameter>`` (one group per state, not one per
#: parameter: 194 fewer folders and zarr.json files for GPT-2 124M with AdamW); 2 (still read):
#: ``optimizer/<parameter>/<state>``, chunk keys ``c.i.j`` (``_store.CHUNK_SEPARATOR``); 1 (still
#: read): chunk keys ``c/i/j``
FORMAT_VERSION = 3
ATTR = "tilegraph"
#: characters a checkpoint array name may hold (parameter names are dotted paths)
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


#: the problems an error lists at most (then "... and N more")
_SHOWN = 8


def _listed(problems: list[str]) -> str:
    """``problems`` joined with "; ", at most :data:`_SHOWN` of them, then how many more."""
    more = len(problems) - _SHOWN
    return "; ".join(problems[:_SHOWN]) + (f"; ... and {more} more" if more > 0 else "")


def _check_name(name: str, where: str) -> None:
    if not name or not set(name) <= _NAME_OK or name.startswith(".") or ".." in name:
        raise CheckpointError(where, "array names may hold only letters, digits, '.', '_' and '-'", repr(name))


def _json_ready(value, where: str, what: str):
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CheckpointError(where, f"{what} must be JSON-serialisable (no pickle is ever written)",
                              f"{e}") from None


def _check_runtime(where: str, runtime, require_open: bool = True) -> None:
    """``runtime`` is None or an open :class:`tilegraph.Runtime` (``runtime="x"`` failed on its
    first use as an AttributeError 'workers', a closed one's client with Dask's "No clients
    found"); ``require_open=False``: a Runtime, open or not."""
    from tilegraph._lower import check_runtime

    try:
        check_runtime(where, runtime if require_open or runtime is None or not getattr(runtime, "closed", False)
                      else None)
    except CheckpointError:
        raise
    except TileError as e:
        raise CheckpointError(e.where, e.what, e.received) from None


def _closed_runtime_error(where: str, what: str, label: str, value) -> CheckpointError | None:
    """The error of a tile whose value lived on the workers of a runtime that was closed since
    (the values went with it), or None."""
    client = getattr(getattr(value, "future", None), "client", None)
    if getattr(client, "status", None) not in ("closing", "closed"):
        return None
    return CheckpointError(where, f"{what} lived on the workers of a runtime that was closed, and went with it: "
                           "save before closing the runtime (rt.close(), the end of its `with` block); load a "
                           "checkpoint, or build the model again, to go on", f"{label} held by a closed runtime")


# ----------------------------------------------------------------------------------- quantize ----
def quantize_rule(quantize, where: str) -> Callable[[str, tuple], dict | None]:
    """``quantize`` (None, "method", "method:bits", a dict name -> spec, or a callable) as a function
    of (parameter name, shape) -> {"method", "bits"} or None (stored exact), as
    :func:`save_checkpoint` reads it; a spec it cannot read is a TileError naming ``where`` (the
    CLI's --quantize and the benchmarks check theirs with it before any work)."""
    if quantize is None:
        return lambda name, shape: None

    def parse(spec, name=None):
        if spec is None:
            return None
        if not isinstance(spec, str):
            raise CheckpointError(where, "a quantization is 'method' or 'method:bits' (e.g. 'int8', 'kashin:4')",
                                  repr(spec) + (f" for {name}" if name else ""))
        method, colon, bits = spec.partition(":")
        try:
            bits = int(bits) if colon else None  # 'kashin:' too: the default is 'kashin', no ':'
        except ValueError:
            raise CheckpointError(where, "the bits after ':' must be an integer (or no ':' for the method's "
                                  "default)", repr(spec)) from None
        from tilegraph.io.quantize import METHODS, method_bits

        if method not in METHODS:
            raise CheckpointError(where, f"unknown quantization method; known: {', '.join(METHODS)}", repr(spec))
        try:  # a budget the method takes (None: its default)
            method_bits(method, bits, where, CheckpointError)
        except CheckpointError as e:  # received: the whole spec and, from a dict or function, whose
            raise CheckpointError(where, e.what, f"{e.received} (in {spec!r}" + (f" for {name})" if name else ")")) \
                from None
        return {"method": method, "bits": bits}

    if callable(quantize):
        def call(name, shape):
            try:
                spec = quantize(name, shape)
            except Exception as e:  # a wrong signature or the function's own error: say what called it
                raise CheckpointError(where, "quantize, a function, is called as quantize(name, shape) for each "
                                      "parameter and returns 'method[:bits]' or None (kept exact); it raised",
                                      f"{type(e).__name__}: {e} for {name} {tuple(shape)}") from e
            return parse(spec, name)

        return call
    if isinstance(quantize, Mapping):
        specs = {k: parse(v, k) for k, v in quantize.items()}
        return lambda name, shape: specs.get(name)
    spec = parse(quantize)

    def default(name: str, shape: tuple) -> dict | None:
        from tilegraph.io.quantize import default_method

        return spec if default_method(name, shape) is not None else None

    return default


# ---------------------------------------------------------------------------------------- save ----
def _model_info(model) -> dict:
    info: dict[str, Any] = {"class": type(model).__name__}
    config = getattr(model, "config", None)
    if getattr(model, "arch", "") and dataclasses.is_dataclass(config):
        info.update(architecture=model.arch, config=dataclasses.asdict(config),
                    dtype=str(np.dtype(getattr(model, "dtype", np.float32))))
        tiling = getattr(model, "tiling", None)
        if dataclasses.is_dataclass(tiling):
            info["tiling"] = dataclasses.asdict(tiling)
    if getattr(model, "hf_extra", None):  # e.g. the tokenizer's end-of-text id, for HF export
        info["hf_extra"] = dict(model.hf_extra)
    from tilegraph.nn import Module
    from tilegraph.peft import adapter_settings

    adapters = adapter_settings(model) if isinstance(model, Module) else {}
    if adapters:  # what rebuilds them on the stored base (load_checkpoint(...).model, from_zarr)
        info["adapters"] = adapters
    return info


def _warn_other_settings(where: str, optimizer, hyper: Mapping, options: list | None, names: list[str],
                         stacklevel: int) -> None:
    """A warning naming each of the optimizer's own settings (weight decay, betas, eps, momentum,
    clipping ...) and each of its parameter groups' that differs from the checkpoint's ``hyper``
    (``options``: per parameter of the optimizer, the settings its saved group gave it; ``names``:
    the parameters' names): the restored run goes on with the optimizer's, where torch's
    ``load_state_dict`` brings back the saved ones, so a notebook's rebuilt optimizer with another
    weight decay changed the run without a word (and one of another decay for its no-decay group,
    biases and norm gains, as ``tilegraph train`` makes, still did). ``stacklevel``: the warning
    names the line that many calls up from this one (1: the line that calls it)."""
    import warnings

    from tilegraph.optim import _same_setting  # (as load_state_dict compares them)

    def plain(v):
        return repr(list(v) if isinstance(v, tuple) else v)

    other = optimizer.setting_differences(hyper, options, names, show=plain)
    k = "clip_grad_norm"
    if k in hyper and not _same_setting(optimizer.clip_grad_norm, hyper[k]):
        other.append(f"{k}={plain(optimizer.clip_grad_norm)} here, {plain(hyper[k])} saved")
    if other:
        warnings.warn(f"[{where}] the optimizer's settings differ from the checkpoint's: {'; '.join(other)}; "
                      "training goes on with this optimizer's (torch's load_state_dict would bring back the saved "
                      "ones: make the optimizer with them to continue the run as it was)", UserWarning,
                      stacklevel=stacklevel + 1)


def _optimizer_info(optimizer, names: list[str]) -> dict:
    """The optimizer's record: its kind, settings, schedule and step; ``names``: its parameters'
    names, in its order (each parameter's group settings are recorded in that order)."""
    hyper = {k: v for k, v in vars(optimizer).items()
             if k in ("betas", "eps", "weight_decay", "momentum", "dampening", "nesterov", "base_lr",
                      "clip_grad_norm")}

    def as_json(settings: dict) -> dict:  # (betas: a tuple)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}

    hyper = as_json(hyper)
    options = getattr(optimizer, "param_options", [])
    if any(options):  # parameter groups: each parameter's own settings, in the order of optimizer.params
        hyper["param_options"] = [as_json(o) for o in options]
        hyper["param_names"] = list(names)
    schedule = getattr(optimizer.schedule, "spec", None)
    info = {"type": type(optimizer).__name__, "step_count": int(optimizer.step_count),
            "state_names": list(optimizer.state_names), "hyper": hyper,
            "schedule": schedule, "lr": float(optimizer.lr)}
    behind = {n: int(c) for n, c in zip(names, getattr(optimizer, "param_steps", ())) if c != optimizer.step_count}
    if behind:  # parameters some steps' losses did not depend on: their own update counts, by name
        info["param_steps"] = behind
    return info


def save_checkpoint(path, model, optimizer=None, *, step: int | None = None, quantize=None,
                    metadata: Mapping | None = None, runtime=None, files: Mapping[str, bytes] | None = None,
                    trainer_state: Mapping | None = None) -> Path:
    """Write ``model`` (and ``optimizer``'s state) as a Zarr checkpoint folder ``path``.

    - Chunks are the parameters' tiles; each tile is written by the worker that holds it (tiles
      still on the client are written by the client). Nothing is gathered.
    - ``step`` defaults to the optimizer's step count (0 without one).
    - ``quantize``: None (exact), ``"method[:bits]"`` for every weight matrix (norms, biases and
      other 1-D parameters stay exact; see :func:`tilegraph.io.quantize.default_method`), a dict
      parameter name -> spec, or a callable ``(name, shape) -> spec or None``. Optimizer state is
      never quantized.
    - ``metadata``: JSON-serialisable user data, returned by :func:`load_checkpoint` as is.
    - ``files``: extra files (name -> bytes, e.g. the tokenizer), written before the commit.
    - ``trainer_state``: what a trainer needs to continue (batch size, data position, run id).
    - Weights the model holds quantized (:class:`tilegraph.peft.QuantizedTensor`, e.g. the
      Linear weights of :func:`tilegraph.peft.from_quantized`) are stored as ``quantize=``
      stores a quantized weight, their parts copied bit for bit (never requantized), whatever
      ``quantize`` says; they load dequantized into a model of Parameters.

    The folder is written under a temporary name next to ``path``, verified and renamed; an
    existing ``path`` is never replaced. Returns ``path``.
    """
    return prepare_save(path, model, optimizer, step=step, quantize=quantize, metadata=metadata,
                        runtime=runtime, files=files, trainer_state=trainer_state).run()


class PendingSave:
    """A save whose values are fixed (the tiles' values when it was prepared, so training may go
    on and replace them) and whose writing is still to do: :meth:`run` writes, verifies and
    commits (any thread)."""

    def __init__(self, path: Path, where: str, entries: list, attrs: dict, runtime, files: Mapping[str, bytes],
                 copies: Sequence[tuple] = ()):
        self.path, self.where, self.entries, self.attrs = path, where, entries, attrs
        # quantized tiles to copy: (array path, tile label, part names, values, attrs, sizes)
        self.copies = list(copies)
        self.runtime, self.files = runtime, dict(files)
        self.workers: set[str] = set()  # the workers that wrote tiles (their addresses)
        self._futures: list = []
        self._tmp: Path | None = None  # the temporary folder, once started
        self._plan: tuple | None = None  # what start() left for finish() to write and wait for
        self._made = False  # the temporary folder was made (a failure after that finds it removed?)

    def run(self) -> Path:
        self.start()
        return self.finish()

    def start(self) -> None:
        """Make the temporary folder and hand the workers their write tasks (at
        :data:`SAVE_PRIORITY`: a worker runs them before the training tasks waiting with it); the
        rest is :meth:`finish`'s (any thread). Once: a second call does nothing."""
        if self._tmp is not None:
            return
        path = self.path
        tmp = self._tmp = path.parent / temp_name(path.name)  # .NAME.tmp-PID-HEX-HOST
        _WRITING.add(os.path.abspath(tmp))  # (until finish() commits it or the save is abandoned)
        # what a killed process's save of this name left (never loaded as a checkpoint, but on disk)
        remove_stale_temporaries(path.parent, path.name)
        with self._failures(tmp, release=False):
            path.parent.mkdir(parents=True, exist_ok=True)
            self._submit(tmp)

    def finish(self) -> Path:
        """Wait for the workers' writes, write the rest, verify and commit (:meth:`start`s first
        when not started); returns the path."""
        self.start()
        path, tmp = self.path, self._tmp
        try:
            with self._failures(tmp, release=True):
                self._complete(tmp)
                appeared = CheckpointError(self.where, "the checkpoint folder appeared while it was being written "
                                           "(another save of the same name?)", f"{path} exists")
                if os.path.lexists(path):
                    raise appeared
                try:
                    os.rename(tmp, path)
                except OSError as e:  # made between the check and the rename: "Directory not empty" said less
                    if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                        raise appeared from None
                    raise
        finally:
            _WRITING.discard(os.path.abspath(tmp))
        return path

    @contextlib.contextmanager
    def _failures(self, tmp: Path, release: bool):
        """A failure in the block abandons the save (its temporary folder removed) and is raised
        as a write failure naming where; the values this save held are released on a failure and,
        with ``release``, at the end."""
        path, where = self.path, self.where
        try:
            yield
        except OSError as e:
            began = tmp.exists()
            self._release()
            self._abandon(tmp)
            if not began and self._made:  # made, and gone (an OSError of the rename, or of a file in it)
                raise self._removed(tmp) from None
            # where it failed: in the temporary folder once that was made, else the folder that could
            # not be made (the OS names it) or the parent that refused the temporary folder
            raise write_failure(where, e, tmp if began else (e.filename if e.filename and not path.parent.exists()
                                                             else path.parent)) from None
        except BaseException as e:
            gone = self._made and not tmp.is_dir()
            self._release()
            self._abandon(tmp)
            # a write task found it gone (this save abandoned nothing), or the check did; an interrupt stays one
            if isinstance(e, Exception) and (gone or isinstance(e, SaveAbandoned)):
                raise self._removed(tmp) from None
            if _is_os_error(e):  # a worker's OSError arrives re-raised (disk full, read-only, ...)
                raise write_failure(where, e, path.parent) from None
            raise
        if release:
            self._release()

    def _removed(self, tmp: Path) -> CheckpointError:
        """The error of a save whose temporary folder was removed while it wrote it (it said that
        chunks were missing, as if the workers had written to a disk this process does not see,
        or that "the save was abandoned")."""
        return CheckpointError(self.where, "the save's temporary folder was removed while the save wrote it (by "
                               "another process, or a folder above it deleted); earlier checkpoints are untouched",
                               f"{tmp} removed")

    def _release(self) -> None:
        """Release the values (futures) this save held."""
        self.entries, self.copies, self._plan = [], [], None

    def _abandon(self, tmp: Path) -> None:
        """Remove the temporary folder of a save that failed or was interrupted, once no write
        task of it runs: its tasks are cancelled (one already running stops at its next folder,
        finding the folder gone: :func:`make_dir` never makes it again, or at its next file), the
        folder removed, and removed again once the workers run none of them (at most
        :data:`ABANDON_SECONDS`). In a thread of its own, which a second interrupt does not stop."""
        _WRITING.discard(os.path.abspath(tmp))
        futures, self._futures = self._futures, []
        client = getattr(self.runtime, "client", None) if futures else None

        def clean() -> None:
            shutil.rmtree(tmp, ignore_errors=True)  # a task still running stops at its next folder
            if client is not None:
                with contextlib.suppress(Exception):
                    client.cancel(futures)
                keys, deadline = [f.key for f in futures], time.monotonic() + ABANDON_SECONDS
                while time.monotonic() < deadline and _still_running(client, keys):
                    time.sleep(0.05)
                    shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)  # what the last of them wrote

        thread = threading.Thread(target=clean, name="tilegraph-abandoned-save", daemon=False)
        thread.start()
        thread.join()

    def _submit(self, tmp: Path) -> None:
        """Make the folder and submit the workers' write tasks; what is left to do here is in
        ``self._plan`` for :meth:`_complete`."""
        # absolute: the workers write there, and a worker's working folder is its own (a cluster
        # started elsewhere: `run/checkpoints/...` was another folder to each worker, or none)
        root = os.path.abspath(tmp)
        os.mkdir(root)  # here alone: a write task never makes it (one of an abandoned save stops)
        self._made = True
        write_meta(root, "", group_meta({ATTR: self.attrs}))
        metas: list[tuple[str, dict]] = []  # written while the workers write their tiles
        groups = {"model", "optimizer"}
        local: list[tuple[Any, list]] = []        # (array, jobs) written here
        remote: dict[Any, tuple[Any, list]] = {}  # future key -> (future, jobs)
        shard_jobs = []                           # (values, tuple positions, spec) of each shard
        for apath, shape, dtype, chunks, tiles, quant in self.entries:
            parts = apath.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
            chunk_shape = chunks_of(chunks)
            shards = self.attrs["arrays"][apath].get("shards")
            if quant is None and shards:
                metas.append((apath, (shape, dtype, chunk_shape, shards)))  # zarr.json made in _complete
                by_shard: dict[tuple, list] = {}
                for idx, value in tiles:
                    region = slices(chunks, idx)
                    at = tuple(lo // sh for (lo, _), sh in zip(region, shards))
                    by_shard.setdefault(at, []).append((value, region))
                for at, items in by_shard.items():
                    values = [v.future if isinstance(v, ValueRef) else v for v, _ in items]
                    indices = [v.index if isinstance(v, ValueRef) else None for v, _ in items]
                    spec = (root, apath, [r for _, r in items], shape, chunk_shape, tuple(shards), at)
                    shard_jobs.append((values, indices, spec))
                continue
            if quant is None:
                metas.append((apath, (shape, dtype, chunk_shape, None)))
            else:
                metas.append((apath, group_meta({"quantized_tiles": [list(c) for c in chunks]})))
            for idx, value in tiles:
                job = (root, apath, slices(chunks, idx), chunk_shape, quant, tile_label(idx))
                if isinstance(value, ValueRef):
                    _, jobs = remote.setdefault(value.future.key, (value.future, []))
                    jobs.append((value.index, *job))
                else:
                    local.append((value, [(None, *job)]))
        copy_local, copy_remote = [], []  # quantized tiles copied as they are: (job, values, indices, sizes)
        copied: set[str] = set()
        for apath, label, names, values, attrs, sizes in self.copies:
            if apath not in copied:
                copied.add(apath)
                metas.append((apath, group_meta({"quantized_tiles": self.attrs["arrays"][apath]["tiles"]})))
                parts = apath.split("/")
                groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
            job = (root, f"{apath}/{label}", names, attrs)
            refs = [isinstance(v, ValueRef) for v in values]
            (copy_remote if any(refs) else copy_local).append(
                (job, [v.future if r else v for v, r in zip(values, refs)],
                 [v.index if r else None for v, r in zip(values, refs)], sizes))
        metas += [(group, group_meta()) for group in sorted(groups)]
        futures = self._futures = []  # the workers' write tasks (stopped if the save is abandoned)
        shard_futures = {v.key: v for values, _, _ in shard_jobs for v in values if not hasattr(v, "shape")}
        copy_futures = {v.key: v for _, values, _, _ in copy_remote for v in values if not hasattr(v, "shape")}
        threads = {a: int(w.get("nthreads", 1)) for a, w in self.runtime.workers().items()} \
            if remote or shard_futures or copy_futures else {}
        holders = _holders(self.runtime.client, [f for f, _ in remote.values()] + list(shard_futures.values())
                           + list(copy_futures.values()), threads) if threads else {}
        if remote:  # one task per worker thread, writing tiles that worker holds (a task per tile costs more)
            client = self.runtime.client
            by_worker = _by_holder(list(remote.values()), lambda it: it[0].key, lambda it: job_bytes(it[1]), holders)
            for addr, items in by_worker.items():
                for batch in _balanced(items, threads.get(addr, 1), lambda it: job_bytes(it[1])):
                    futures.append(client.submit(write_values, [f for f, _ in batch], Opaque([j for _, j in batch]),
                                                 key=f"tg-save-{uuid.uuid4().hex[:12]}", priority=SAVE_PRIORITY,
                                                 workers=[addr] if addr else None, allow_other_workers=True))
        if shard_jobs:
            futures += self._write_shards(shard_jobs, holders)
        if copy_remote:
            futures += self._write_copies(copy_remote, holders, threads)
        # every group's and array's folder, parents first, while the workers begin: their chunks and
        # the zarr.json files are then one file creation each, with no mkdir beside it (a write task
        # that finds its folder not made yet makes it: either side takes the other's for done)
        made: set[str] = set()
        for folder in sorted({p for p, _ in metas if p}, key=lambda p: p.count("/")):
            with contextlib.suppress(FileExistsError):
                os.mkdir(os.path.join(root, folder))
            made.add(os.path.join(root, folder))
        self._plan = (metas, made, local, copy_local, futures)

    def _complete(self, tmp: Path) -> None:
        """The writes :meth:`_submit` left: the metadata and the tiles held here (while the
        workers write theirs), the workers' results, the extra files, the check and the
        metadata that marks the folder complete."""
        root = os.path.abspath(tmp)  # (as the workers were given it)
        metas, made, local, copy_local, futures = self._plan
        for path, meta in metas:  # an array's zarr.json from zarr's (imported here, not in start())
            write_meta(root, path, meta if isinstance(meta, dict) else array_meta(*meta[:3], shards=meta[3]), made)
        for value, jobs in local:
            write_tiles(value, jobs)
        for (root_, path, names, attrs), values, indices, _ in copy_local:
            write_parts_task(values, indices, [(root_, path, names, 0, attrs)])
        if futures:
            done = self.runtime.client.gather(futures)  # re-raises a worker's error (disk full, ...)
            self.workers = {d["worker"] for d in done if d["worker"]}
        for name, data in self.files.items():
            (tmp / name).write_bytes(bytes(data))
        _verify(tmp, self.attrs, self.where, bool(futures))
        write_meta(root, "", group_meta({ATTR: dict(self.attrs, complete=True)}))
        _fsync(tmp / "zarr.json")

    def _write_copies(self, copies: list, holders: dict, threads: dict) -> list:
        """Copy quantized tiles whose parts are on the workers: each tile by a worker holding its
        largest part (Dask brings it the others, small), a task per worker thread (``threads``:
        each worker's), as tiles of parameters are written. Returns futures."""
        client = self.runtime.client

        def size(item) -> int:
            return sum(item[3]) or 1

        def largest_remote(item) -> str:  # the key of the largest part on a worker (the codes)
            _, values, _, sizes = item
            return max(((n, v) for n, v in zip(sizes, values) if not hasattr(v, "shape")), key=lambda nv: nv[0])[1].key

        by_worker = _by_holder(copies, largest_remote, size, holders)
        futures = []
        for addr, items in by_worker.items():
            for batch in _balanced(items, threads.get(addr, 1), size):
                values, indices, jobs = [], [], []
                for (root, path, names, attrs), vals, idxs, _ in batch:
                    jobs.append((root, path, names, len(values), attrs))
                    values += vals
                    indices += idxs
                futures.append(client.submit(write_parts_task, values, indices, Opaque(jobs),
                                             key=f"tg-save-copy-{uuid.uuid4().hex[:12]}", priority=SAVE_PRIORITY,
                                             workers=[addr] if addr else None, allow_other_workers=True))
        return futures

    def _write_shards(self, shard_jobs: list, holders: dict) -> list:
        """Write each shard in one task: here when its tiles are all here, else on the worker
        holding most of its bytes (``holders``: the workers holding each value; Dask brings it
        the other, small, tiles). Returns futures."""
        remote = [job for job in shard_jobs if any(not hasattr(v, "shape") for v in job[0])]
        for values, indices, spec in shard_jobs:
            if all(hasattr(v, "shape") for v in values):
                write_shard_task(values, indices, spec)
        if not remote:
            return []
        client = self.runtime.client
        futures = []
        assigned: dict[str, int] = {}  # bytes of the shards given to each worker: ties go to the least busy
        for values, indices, spec in remote:
            weight: dict[str, int] = {}
            for v, region in zip(values, spec[2]):
                for addr in holders.get(getattr(v, "key", None), ()) or ():
                    weight[addr] = weight.get(addr, 0) + int(np.prod([hi - lo for lo, hi in region]))
            best = max(weight, key=lambda a: (weight[a], -assigned.get(a, 0))) if weight else None
            if best is not None:
                assigned[best] = assigned.get(best, 0) + sum(weight.values())
            futures.append(client.submit(write_shard_task, values, indices, Opaque(spec),
                                         key=f"tg-save-shard-{uuid.uuid4().hex[:12]}", priority=SAVE_PRIORITY,
                                         workers=[best] if best else None, allow_other_workers=True))
        return futures


#: how long an abandoned save waits for its running write tasks to stop before it leaves
ABANDON_SECONDS = 30.0

#: Dask priority of a save's write tasks: above a training step's tasks (0), so that a worker
#: writes the checkpoint before the steps submitted after it (a background save waited behind
#: them on one-thread workers), and below the transfers between processes that a running step
#: waits for (``tilegraph.runtime.TRANSFER_PRIORITY``, 100)
SAVE_PRIORITY = 50


#: the temporary folders (absolute paths) that saves of this process are writing now: never stale
#: (a Trainer made again on a folder, its cell run again right after a stop, removed the one a
#: save still wrote in the background, and that checkpoint was lost)
_WRITING: set[str] = set()


def remove_stale_temporaries(folder: Path, name: str | None = None, keep_own: bool = True) -> list[Path]:
    """Remove the temporary folders of interrupted saves in ``folder`` (of the checkpoint
    ``name`` alone, or of any): this host's whose process is gone (the earlier names, without a
    host, count as this host's) and, unless ``keep_own``, this process's that no save of it is
    writing (:data:`_WRITING`); another host's untouched for ``STALE_OTHER_HOST_SECONDS`` (its
    process cannot be looked up from here). Returns them."""
    if not folder.is_dir():
        return []
    gone = []
    for p in folder.iterdir():
        writer = temp_writer(p.name)
        if writer is None or not p.is_dir() or (name is not None and not p.name.startswith(f".{name}{TMP_MARK}")):
            continue
        pid, host = writer
        if host is not None and host != host_label():  # a pid of another node says nothing here
            if untouched_for(p) <= STALE_OTHER_HOST_SECONDS:
                continue
        elif pid == os.getpid():
            if keep_own or os.path.abspath(p) in _WRITING:
                continue
        elif process_alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        gone.append(p)
    return gone


def _still_running(client, keys: list) -> bool:
    """Whether a worker still runs (or has queued) one of the tasks ``keys``."""
    def running(keys, dask_worker=None) -> bool:  # nested: travels by value to the workers
        tasks = dask_worker.state.tasks
        return any(k in tasks and tasks[k].state not in ("memory", "error", "released", "forgotten") for k in keys)

    try:
        return any(client.run(running, keys, nanny=False).values())
    except Exception:  # no worker left to ask, a closed client: nothing runs there
        return False


def _by_holder(items: Sequence, key: Callable, size: Callable, holders: dict) -> dict[str | None, list]:
    """``items`` dealt, largest ``size`` first, to a worker holding the value of Dask key
    ``key(item)`` (``holders``: key -> workers; of several, the one given the fewest bytes so far;
    None where no worker holds it)."""
    by_worker: dict[str | None, list] = {}
    assigned: dict[str | None, int] = {}
    for item in sorted(items, key=lambda it: -size(it)):
        on = sorted(holders.get(key(item), ()) or ())
        addr = min(on, key=lambda a: (assigned.get(a, 0), a)) if on else None
        assigned[addr] = assigned.get(addr, 0) + size(item)
        by_worker.setdefault(addr, []).append(item)
    return by_worker


def _balanced(items: Sequence, n: int, weight: Callable) -> list[list]:
    """``items`` dealt into ``n`` bins of about equal total ``weight`` (largest first, each to the
    lightest bin so far); empty bins are dropped."""
    bins: list[list] = [[] for _ in range(max(1, n))]
    load = [0] * len(bins)
    for item in sorted(items, key=lambda it: -weight(it)):
        k = load.index(min(load))
        bins[k].append(item)
        load[k] += weight(item)
    return [b for b in bins if b]


def _holders(client, futures: list, workers: Mapping) -> dict:
    """Which of ``workers`` (addresses) hold each future's value, once computed (a value still
    being computed has no holder yet, and its write would go wherever Dask likes). One worker
    holds them all; of several, the scheduler is asked once (and waited on first only for
    values this client does not know to be finished)."""
    from distributed import wait

    pending = [f for f in futures if f.status != "finished"]
    if pending:
        wait(pending)
    if len(workers) == 1:
        (addr,) = workers
        return {f.key: (addr,) for f in futures}
    return client.who_has(futures)


def _is_os_error(e: BaseException) -> bool:
    return isinstance(e, OSError) or isinstance(getattr(e, "__cause__", None), OSError)


def check_files(files, where: str, what: str = "files", error: type[TileError] = CheckpointError) -> dict:
    """The extra files of a checkpoint (``save_checkpoint``'s ``files``, the Trainer's
    ``checkpoint_files``): a dict of plain file names to bytes, checked (a copy; None: none)."""
    if files is None:
        return {}
    if not isinstance(files, Mapping):  # dict() of a list or str fails obscurely
        raise error(where, f"{what} must be a dict (or None)", type(files).__name__)
    for name, data in files.items():
        if not isinstance(name, str) or "/" in name or name in ("zarr.json", "model", "optimizer") \
                or name.startswith(".") or not isinstance(data, (bytes, bytearray)):
            raise error(where, f"{'extra files' if what == 'files' else what} are plain file names (not zarr.json, "
                        "model, optimizer) mapped to bytes", f"{name!r}: {type(data).__name__}")
    return dict(files)


def prepare_save(path, model, optimizer=None, *, step: int | None = None, quantize=None,
                 metadata: Mapping | None = None, runtime=None, files: Mapping[str, bytes] | None = None,
                 trainer_state: Mapping | None = None) -> PendingSave:
    """Check the arguments of :func:`save_checkpoint` and fix the values to write (the tiles'
    current values); returns the :class:`PendingSave` that writes them."""
    from tilegraph.runtime import current_runtime

    path = user_path(path, "tilegraph.io.save_checkpoint", CheckpointError)
    where = f"tilegraph.io.save_checkpoint({path})"
    if os.path.lexists(path):
        raise CheckpointError(where, "the checkpoint folder must not exist yet (a checkpoint is never overwritten)",
                              f"{path} exists" + (f" ({_dangling(path)})" if _dangling(path) else ""))
    # a file where a folder above the checkpoint must be: it failed as "could not write the checkpoint
    # (File exists)" naming the file, without saying that it is one (checked again when the save starts)
    in_the_way = file_in_the_way(path.parent)
    if in_the_way is not None:
        raise CheckpointError(where, "could not write the checkpoint (a file stands where a folder above it must "
                              "be); earlier checkpoints are untouched",
                              f"{in_the_way} is {_dangling(in_the_way) or 'a file'}")
    # a closed one is named below, after the values it held (an error of their own: they are gone)
    _check_runtime(where, runtime, require_open=False)
    runtime = runtime if runtime is not None else current_runtime()
    named = list(model.named_parameters()) if hasattr(model, "named_parameters") else None
    if not named:
        raise CheckpointError(where, "a model with parameters (a tilegraph.nn.Module)", type(model).__name__)
    rule = quantize_rule(quantize, where)
    if isinstance(quantize, Mapping):  # a misspelt name would leave its weight exact without a word
        known = set(dict(named)) | set(_held_quantized(model))
        unknown = [k for k in quantize if k not in known]
        if unknown:
            raise CheckpointError(where, "quantize names parameters the model does not have (its names: "
                                  "model.named_parameters(), e.g. " + ", ".join(n for n, _ in named[:3]) + ")",
                                  ", ".join(map(repr, unknown[:8])))
    for what, value in (("metadata", metadata), ("trainer_state", trainer_state)):
        if value is not None and not isinstance(value, Mapping):  # dict() of a list or str fails obscurely
            raise CheckpointError(where, f"{what} must be a dict (or None)", type(value).__name__)
    user = _json_ready(dict(metadata or {}), where, "metadata")
    trainer = _json_ready(dict(trainer_state or {}), where, "trainer_state")
    check_files(files, where)
    if optimizer is not None and not hasattr(optimizer, "step_count"):  # save_checkpoint(path, model, 5)
        raise CheckpointError(where, "optimizer must be a tilegraph.optim optimizer or None (the step is step=...)",
                              f"{type(optimizer).__name__} {optimizer!r:.60}")
    if step is None:
        step = int(optimizer.step_count) if optimizer is not None else 0
    elif not is_int(step, 0):  # int() would make 1.7 step 1 and fail on "x" with a bare ValueError
        raise CheckpointError(where, "step must be an int >= 0 (None: the optimizer's step count)", repr(step))

    # what to write: (array path, shape, dtype, tiles, [(tile index, value)], quantization)
    entries: list[tuple] = []
    deal = itertools.count()  # replicated tiles: which copy writes each

    def add(apath, p, cells, quant, dtype=None):  # dtype: the cells' (optimizer state may differ from p's)
        dtype = np.dtype(p.dtype if dtype is None else dtype)
        entries.append((apath, tuple(p.shape), dtype, p.chunks, _values(cells, p, where, runtime, deal, dtype), quant))

    from tilegraph.io.quantize import _SPECS, method_bits

    for name, p in named:
        _check_name(name, where)
        quant = rule(name, p.shape)
        if quant is not None and quant["bits"] is None and len(_SPECS[quant["method"]].bits) > 1:
            # a method of several budgets records the one used ("kmeans" is kmeans:4); int8, fp16 ... say it
            quant = dict(quant, bits=method_bits(quant["method"], None, where, CheckpointError))
        add(f"model/{name}", p, p.cells, quant)
    held, copies = _quantized_weights(model, dict(named), where, runtime, deal)
    if quantize is not None:  # weights held quantized are stored as they are, whatever quantize asks of them
        other = [(name, spec) for name, q, spec in held
                 if (asked := rule(name, q.shape)) is not None
                 and (asked["method"], asked.get("bits") or spec.get("bits")) != (spec.get("method"), spec.get("bits"))]
        if other:
            kept = ", ".join(sorted({f"{s.get('method')}" + (f":{s['bits']}" if s.get("bits") else "") for _, s in other}))
            warnings.warn(f"[{where}] quantize={quantize!r}: the model holds {len(other)} weight"
                          f"{'s' if len(other) > 1 else ''} quantized already ({kept}: {other[0][0]}"
                          f"{', ...' if len(other) > 1 else ''}), stored as they are, not quantized anew "
                          "(tilegraph.peft.merge_lora, or tilegraph.models.from_zarr of the checkpoint, gives float "
                          "weights to quantize)", UserWarning, stacklevel=3)
    if optimizer is not None:
        from tilegraph._train import optimizer_param_names

        names_of = optimizer_param_names(optimizer, model, where, CheckpointError)
        for i, p in enumerate(optimizer.params):
            for sname, grid in zip(optimizer.state_names, optimizer.state_cells[i]):
                add(optimizer_array(names_of[id(p)], sname), p, grid, None, optimizer.state_dtype(p))
    _check_runtime(where, runtime)
    arrays = {}
    for apath, shape, dtype, chunks, _, q in entries:
        shards = shards_of(shape, dtype, chunks) if q is None else None
        arrays[apath] = {"shape": list(shape), "dtype": str(dtype), "tiles": [list(c) for c in chunks],
                         "chunks": list(chunks_of(chunks)), "shards": list(shards) if shards else None,
                         "quantized": q}
    for name, q, spec in held:
        arrays[f"model/{name}"] = {"shape": list(q.shape), "dtype": str(q.dtype), "tiles": [list(c) for c in q.chunks],
                                   "chunks": list(chunks_of(q.chunks)), "shards": None, "quantized": spec}
    attrs = {"format": FORMAT, "version": FORMAT_VERSION, "complete": False,
             "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "step": int(step), "model": _model_info(model),
             "parameters": [n for n, _ in named] + [n for n, _, _ in held],
             "optimizer": _optimizer_info(optimizer, [names_of[id(p)] for p in optimizer.params])
             if optimizer is not None else None,
             "trainer": trainer, "metadata": user, "arrays": arrays}
    attrs = _json_ready(attrs, where, "the model config")
    return PendingSave(path, where, entries, attrs, runtime, files or {}, copies)


def optimizer_array(param: str, state: str, version: int | None = FORMAT_VERSION) -> str:
    """The array path of optimizer state ``state`` (``exp_avg``, ...) of parameter ``param`` in
    a checkpoint of format ``version``."""
    return f"optimizer/{param}/{state}" if isinstance(version, int) and version < 3 else f"optimizer/{state}/{param}"


def _dangling(path: Path) -> str:
    """"a symbolic link to X, which does not exist" for a dangling link ``path``, else ""."""
    if os.path.islink(path) and not os.path.exists(path):
        with contextlib.suppress(OSError):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
    return ""


def _quantized_weights(model, named: dict, where: str, runtime, deal) -> tuple[list, list]:
    """The weights ``model`` holds quantized (:class:`tilegraph.peft.QuantizedTensor`), to store as
    they are: ``[(name, tensor, {"method", "bits"})]`` and, per tile, ``(array path, tile label,
    part names, part values, attributes, part sizes)``. The values are the parts' cells' current
    values: arrays here, or references to the workers' copies (``scatter_cells`` put them there),
    which those workers write (:meth:`PendingSave._write_copies`)."""
    held, copies = [], []
    for name, q in _held_quantized(model).items():
        _check_name(name, where)
        if name in named:
            raise CheckpointError(where, "one value per name", f"{name} is both a Parameter and a quantized weight")
        spec = None
        for idx, (names, refs, attrs) in q._tiles.items():
            cells = [r.node.cell for r in refs]
            attrs = json.loads(attrs)
            spec = spec or {"method": attrs.get("method"), "bits": attrs.get("bits")}
            values = []
            for c in cells:
                value = c.value
                if isinstance(value, ReplicatedRef):  # equal copies on several workers: dealt over them
                    value = value.on(next(deal) % max(1, len(value.replicas)))
                if isinstance(value, ValueRef):
                    closed = _closed_runtime_error(where, "the quantized weights", f"{name} tile {idx}", value)
                    if closed is not None:
                        raise closed
                    if runtime is None:
                        raise CheckpointError(where, "the quantized weights live on a runtime's workers: pass "
                                              "runtime=..., or save inside `with rt.as_current():`",
                                              f"{name} tile {idx} held by a Dask worker")
                elif not hasattr(value, "shape"):
                    raise CheckpointError(where, "quantized weights whose parts are arrays or worker values",
                                          f"{name} tile {idx}: {type(value).__name__}")
                values.append(value)
            copies.append((f"model/{name}", tile_label(idx), list(names), values, attrs,
                           [int(np.prod(c.shape)) * c.dtype.itemsize for c in cells]))
        held.append((name, q, spec))
    return held, copies


def _values(cells: np.ndarray, p, where: str, runtime, deal, dtype=None) -> list[tuple[tuple[int, ...], Any]]:
    """The current value of every tile: a reference to a worker's copy, or an array here
    (``dtype``: the cells', default ``p``'s)."""
    out = []
    for idx in np.ndindex(*cells.shape):
        value = cells[idx].value
        if isinstance(value, ReplicatedRef):  # equal copies: the tiles dealt over them, so all write
            value = value.on(next(deal) % max(1, len(value.replicas)))
        if isinstance(value, ValueRef):
            closed = _closed_runtime_error(where, "the parameters (and optimizer state)", f"{p.name} tile {idx}",
                                           value)
            if closed is not None:
                raise closed
            if runtime is None:
                raise CheckpointError(where, "the parameters live on a runtime's workers: pass runtime=..., or save "
                                      "inside `with rt.as_current():`", f"{p.name} tile {idx} held by a Dask worker")
            holder = getattr(value.future, "client", None)
            if holder is not None and holder is not runtime.client:  # (Dask's own error named no runtime)
                raise CheckpointError(where, "the runtime holding the model's values: save inside `with "
                                      "rt.as_current():` of that runtime, or pass runtime=rt (a tg.connect() run "
                                      "again makes a second runtime the current one)",
                                      f"{p.name} tile {idx} held by another runtime than {runtime!r}")
        elif value is None or not hasattr(value, "shape"):  # a value only a graph makes (a dask key): compute it
            from tilegraph._lower import compute
            from tilegraph._tensor import Tiling, tensor_from_cells

            one = np.empty((1,) * len(idx), dtype=object)
            one[(0,) * len(idx)] = cells[idx]
            (value,) = compute(tensor_from_cells(Tiling(tuple((s,) for s in cells[idx].shape)),
                                                 p.dtype if dtype is None else dtype, one))
        out.append((idx, value))
    return out


def _verify(tmp: Path, attrs: dict, where: str, remote: bool) -> None:
    """Every chunk file of every array is there, as this process sees the folder (a worker that
    wrote nothing, or wrote to a disk of its own, is caught here), with exactly the size its
    chunks make: a chunk's bytes and CRC32C, a shard's inner chunks and index.

    The files are not read back: a write that failed raised in its task (the gather re-raises
    it), a short or interrupted write leaves a file of the wrong size (caught here, one ``stat``
    per file), and the bytes themselves are checked against the CRC32C on every load, which the
    writer computed from the values in memory, so a chunk that the disk or the page cache
    garbles after it was written is caught there, naming the chunk. Re-reading 1.5 GB right after
    writing it would only read the page cache, which holds what was written."""
    missing, wrong = chunk_file_problems(tmp, attrs["arrays"])
    if (missing or wrong) and not (tmp / "zarr.json").is_file():  # removed meanwhile (PendingSave._removed)
        raise SaveAbandoned(str(tmp))
    if missing:
        shared = (" (the workers wrote them to a disk this process does not see? the checkpoint folder must be "
                  "on a file system that every worker and this process share)") if remote else ""
        raise CheckpointError(where, f"every chunk written; {len(missing)} missing{shared}", ", ".join(missing[:6]))
    if wrong:
        raise CheckpointError(where, f"every chunk written whole; {len(wrong)} of the wrong size (a short or "
                              "failed write)", ", ".join(wrong[:6]))


def chunk_file_problems(folder: Path, arrays: Mapping[str, dict]) -> tuple[list[str], list[str]]:
    """``(missing, wrong)``: the chunk files (shards, quantized tiles' metadata) of ``arrays``
    (a checkpoint's array entries) that are not in ``folder``, and those whose size is not the
    one their chunks make (``"key: N bytes, expected M"``); one ``stat`` per file, no data read."""
    root = Path(folder)
    missing, wrong = [], []
    for apath, info in arrays.items():
        grid = [len(c) for c in info["tiles"]]
        if info["quantized"] is None:
            chunk = [int(c) for c in info["chunks"]]
            shards = info.get("shards")
            chunk_bytes = int(np.prod(chunk)) * np.dtype(info["dtype"]).itemsize + 4
            file_shape = shards or chunk  # a shard is one file
            counts = [-(-int(n) // c) for n, c in zip(info["shape"], file_shape)]
            inner = [-(-int(n) // c) for n, c in zip(info["shape"], chunk)]  # chunks per dimension
            per = [s // c for s, c in zip(shards, chunk)] if shards else None
            sep = info.get("separator", CHUNK_SEPARATOR)  # format 1: c/i/j
            for idx in np.ndindex(*counts):
                if per is None:
                    size = chunk_bytes
                else:  # the inner chunks inside the array, then the index of every slot and its CRC32C
                    present = np.prod([max(0, min(p, k - i * p)) for i, p, k in zip(idx, per, inner)])
                    size = int(present) * chunk_bytes + 16 * int(np.prod(per)) + 4
                key = f"{apath}/{chunk_key(idx, sep)}"
                try:
                    got = os.stat(chunk_path(str(root), apath, idx, sep)).st_size
                except FileNotFoundError:
                    missing.append(key)
                    continue
                if got != size:
                    wrong.append(f"{key}: {got} bytes, expected {size}")
        else:
            missing += [f"{apath}/{tile_label(i)}" for i in np.ndindex(*grid)
                        if not (root / apath / tile_label(i) / "zarr.json").is_file()]
    return missing, wrong


def _fsync(path: Path) -> None:
    """Flush the file that commits the checkpoint before the rename makes it visible (chunk
    data is flushed by the OS; its checksums catch a chunk that did not make it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


# ---------------------------------------------------------------------------------------- load ----
def is_checkpoint(path) -> bool:
    """Whether ``path`` is a folder holding a committed tilegraph Zarr checkpoint."""
    try:
        _read_attrs(user_path(path, "tilegraph.io.is_checkpoint"), "tilegraph.io.is_checkpoint")
        return True
    except TileError:
        return False


def _read_attrs(path: Path, where: str) -> dict:
    if not path.exists():
        raise CheckpointError(where, "a checkpoint folder", f"{path} does not exist")
    meta = path / "zarr.json"
    if not path.is_dir() or not meta.is_file():
        raise CheckpointError(where, "a tilegraph checkpoint folder (a Zarr group with zarr.json)",
                              f"{path} is not one" + ("" if path.is_dir() else " (not a folder)"))
    try:
        doc = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(where, "a readable zarr.json", f"{meta}: {e}") from None
    group = doc.get("attributes") if isinstance(doc, dict) else None  # (any JSON: a damaged or foreign file)
    attrs = group.get(ATTR) if isinstance(group, dict) else None
    if not isinstance(attrs, dict) or attrs.get("format") != FORMAT:
        raise CheckpointError(where, "a tilegraph checkpoint (a Zarr group without tilegraph's attributes is not one)",
                              str(path))
    version = attrs.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(where, f"a checkpoint format version this tilegraph reads (<= {FORMAT_VERSION}); "
                              "upgrade tilegraph", f"version {version!r}")
    if attrs.get("complete") is not True:
        raise CheckpointError(where, "a complete checkpoint; this one is a save that did not finish "
                              "(a temporary folder of a killed or failed save)", str(path))
    return attrs


def _check_attr_types(where: str, attrs: dict, meta: Path) -> None:
    """Refuse tilegraph attributes of ``meta`` (a checkpoint's zarr.json) of another type than a
    save writes (a damaged or hand-edited file): a "step" of "x" or null, "parameters" of 3, a
    "model" of "x" were a ValueError, TypeError or AttributeError of whichever command read it."""
    wrong = []
    if "step" in attrs and not is_int(attrs["step"], 0):
        wrong.append(f"step {attrs['step']!r} (an int >= 0)")
    for key in ("metadata", "arrays", "optimizer", "trainer", "model"):
        if attrs.get(key) is not None and not isinstance(attrs[key], dict):
            wrong.append(f"{key} {attrs[key]!r} (an object)")
    if isinstance(attrs.get("arrays"), dict) and not all(isinstance(v, dict) for v in attrs["arrays"].values()):
        wrong.append("arrays whose entries are not all objects")
    params = attrs.get("parameters")
    if params is not None and not (isinstance(params, list) and all(isinstance(n, str) for n in params)):
        wrong.append(f"parameters {params!r} (a list of names)")
    if wrong:
        raise CheckpointError(where, "a zarr.json whose tilegraph attributes have the types a save writes (this "
                              "one is damaged or was edited)", f"{meta}: " + "; ".join(w[:200] for w in wrong))


class Checkpoint:
    """A checkpoint opened by :func:`load_checkpoint`.

    - ``step``, ``metadata`` (the user's), ``info`` (every stored attribute), ``arrays`` (name ->
      shape, dtype, tiles, quantization), ``optimizer_info``, ``trainer_state``.
    - ``model``: the model built from the stored config (on ``tiling``, default the stored one),
      its tiles read on the workers.
    - :meth:`load_into` fills an existing model's parameters; :meth:`restore_optimizer` an
      optimizer's state and step count; :meth:`array` reads one array to the client.
    """

    def __init__(self, path, *, tiling=None, runtime=None):
        self.path = user_path(path, "tilegraph.io.load_checkpoint", CheckpointError)
        self._where = f"tilegraph.io.load_checkpoint({self.path})"
        _check_runtime(self._where, runtime)
        self.info = _read_attrs(self.path, self._where)
        _check_attr_types(self._where, self.info, self.path / "zarr.json")
        self.step = int(self.info.get("step", 0))
        self.metadata = self.info.get("metadata") or {}
        self.arrays: dict[str, dict] = self.info.get("arrays") or {}
        if self.info.get("version") == 1:  # chunk keys c/i/j (the readers' default is c.i.j)
            self.arrays = {a: dict(info, separator="/") for a, info in self.arrays.items()}
        self.optimizer_info = self.info.get("optimizer")
        self.trainer_state = self.info.get("trainer") or {}
        self.parameters: list[str] = list(self.info.get("parameters") or [])
        self._tiling, self._runtime = tiling, runtime
        self._model = None
        missing = [f"model/{n}" for n in self.parameters if f"model/{n}" not in self.arrays]
        unreadable = []  # an array's zarr.json that is there but no JSON object (Zarr cannot open it)
        relaid = []  # an array's zarr.json of another layout than tilegraph's (another tool made it anew)
        for a in self.arrays:
            meta = self.path / a / "zarr.json"
            if not meta.is_file():
                missing.append(a if not (self.path / a).is_dir() else f"{a}/zarr.json")
                continue
            try:
                doc = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                unreadable.append(f"{a}/zarr.json: {type(e).__name__}: {e}")
                continue
            if not isinstance(doc, dict):
                unreadable.append(f"{a}/zarr.json: a JSON {type(doc).__name__}, not an object")
            elif not self.arrays[a].get("quantized"):
                problems = layout_problems(doc, self.arrays[a])
                if problems:
                    relaid.append(f"{a}: " + ", ".join(problems))
        if missing:
            if not (self.path / "zarr.json").is_file():  # deleted since its attributes were read
                raise CheckpointError(self._where, "the checkpoint was removed while it was being opened (pruned by "
                                      "a CheckpointManager's keep, or deleted, in another process?)",
                                      f"{self.path} is gone")
            raise CheckpointError(self._where, "every array the checkpoint lists", "missing: " + ", ".join(missing[:8]))
        if unreadable:
            raise CheckpointError(self._where, "a readable zarr.json (a JSON object) for every array the checkpoint "
                                  "lists", "; ".join(unreadable[:8]))
        if relaid:  # made anew by another tool: read as tilegraph's layout, a missing chunk or a failed checksum
            raise CheckpointError(self._where, "every array in the layout tilegraph wrote it in, the only one it reads "
                                  "(made anew by another tool? zarr-python's create_array compresses and names chunks "
                                  "c/0/1: to change a checkpoint's values, write into its arrays, group[name][...] = "
                                  "values, with zarr.config.set({'array.write_empty_chunks': True}))", _listed(relaid))

    def __repr__(self) -> str:
        quant = sorted({a["quantized"]["method"] for a in self.arrays.values() if a.get("quantized")})
        return (f"Checkpoint({str(self.path)!r}, step={self.step}, {len(self.parameters)} parameters"
                + (f", quantized: {', '.join(quant)}" if quant else "") + ")")

    @property
    def runtime(self):
        from tilegraph.runtime import current_runtime

        if self._runtime is not None:  # closed since the checkpoint was opened: say so, naming the checkpoint
            _check_runtime(self._where, self._runtime)
            return self._runtime
        return current_runtime()

    @property
    def model(self):
        """The model of the stored architecture and config, with the stored weights."""
        if self._model is None:
            self._model = self._build_model()
        return self._model

    def _build_model(self, dtype=None):
        model = self.new_model(values=False, dtype=dtype)
        self.load_into(model)
        return model

    def new_model(self, seed=0, *, values: bool = True, adapters: bool = True, dtype=None):
        """A model of the stored architecture, config and tiling (``tiling`` of
        :func:`load_checkpoint` instead, when given), its weights freshly initialised from
        ``seed``; with ``values=False`` its parameters hold no values
        (:func:`tilegraph.nn.deferred_init`: no random draw, ~3 s for GPT-2 124M) until
        :meth:`load_into` or :meth:`restore` fills them (``tilegraph train --resume``).
        The LoRA / LoTR adapters the stored model had (:func:`tilegraph.peft.adapter_settings`)
        are on it too, on the same layers (``adapters=False``: the base alone).
        ``dtype``: the model's float dtype (default: the stored model's); :meth:`load_into` casts
        the stored weights to it (``tilegraph train --init`` widens a float16 checkpoint to
        float32 so). :attr:`model` holds the stored weights."""
        import contextlib

        from tilegraph._config import require_float_dtype
        from tilegraph.models import ARCHITECTURES, ModelTiling
        from tilegraph.nn import deferred_init

        if dtype is not None:  # named here, before the stored config is looked at
            dtype = require_float_dtype(f"{self._where}.new_model", dtype)
        m = self.info.get("model") or {}
        arch = m.get("architecture")
        if arch not in ARCHITECTURES:
            raise CheckpointError(self._where, "a checkpoint of a known architecture to build the model from; "
                                  f"known: {', '.join(ARCHITECTURES)} (use load_into(model) for other models)",
                                  repr(arch or m.get("class")))
        config_cls, model_cls = ARCHITECTURES[arch]
        try:
            config = config_cls(**m.get("config", {}))
        except TypeError as e:
            raise CheckpointError(self._where, f"a stored config that {config_cls.__name__} accepts", str(e)) from None
        except TileError as e:  # a value out of range (attn_dropout 1.5 edited in): named with the checkpoint
            raise CheckpointError(self._where, f"a stored config that {config_cls.__name__} accepts: {e.what}",
                                  f"{e.received} (its model config in zarr.json)") from None
        tiling = self._tiling
        if tiling is None and m.get("tiling") is not None:
            tiling = ModelTiling(**m["tiling"])
        with contextlib.nullcontext() if values else deferred_init():
            model = model_cls(config, tiling, dtype=np.dtype(m.get("dtype", "float32")) if dtype is None else dtype,
                              seed=seed)
            if adapters and m.get("adapters"):
                from tilegraph.peft import add_adapters

                add_adapters(model, m["adapters"])
        if m.get("hf_extra"):
            model.hf_extra = dict(m["hf_extra"])
        return model

    # -- reading ------------------------------------------------------------------------------
    def _info(self, apath: str) -> dict:
        info = self.arrays.get(apath)
        if info is None:
            raise CheckpointError(self._where, "an array the checkpoint holds", f"{apath!r} is not in it")
        return info

    def check(self, read: bool = False) -> list[str]:
        """What is wrong with the stored arrays, one line each (empty: nothing found): chunk files
        missing or of the wrong size (one ``stat`` per file); with ``read``, every array read here
        too, each chunk against its CRC32C (as loads check them; a checkpoint's size in bytes to
        read)."""
        missing, wrong = chunk_file_problems(self.path, self.arrays)
        problems = [f"missing: {k}" for k in missing] + [f"wrong size: {k}" for k in wrong]
        if read and not problems:
            for apath in self.arrays:
                try:
                    self.array(apath)
                except CheckpointError as e:
                    problems.append(f"{e.what}: {e.received}")
        return problems

    def array(self, name: str) -> np.ndarray:
        """One stored array (``"model/<param>"``, ``"optimizer/<state>/<param>"``, or a parameter
        name), read to the client and dequantized. An optimizer array is found by either
        layout's name in a checkpoint of any format (``optimizer/<param>/<state>`` is how format 2
        and 1 store it): a script written for one format reads the other's."""
        apath = self._array_path(name)
        info = self._info(apath)
        return read_region(str(self.path), apath, [(0, n) for n in info["shape"]], info)

    def _array_path(self, name: str) -> str:
        """The stored path of the array :meth:`array` names ``name``."""
        if not isinstance(name, str):
            raise CheckpointError(f"{self._where}.array", "an array's name, a str", repr(name))
        if name in self.arrays:
            return name
        parts = name.split("/")
        if len(parts) == 3 and parts[0] == "optimizer":  # optimizer/a/b: the other layout's name (a swap)
            other = f"optimizer/{parts[2]}/{parts[1]}"
            if other in self.arrays:
                return other
            version = self.info.get("version")
            states = ", ".join(self._optimizer_states()) or "none: saved without an optimizer"
            raise CheckpointError(f"{self._where}.array", "an array the checkpoint holds (its optimizer's: "
                                  f"{optimizer_array('<parameter>', '<state>', version)}, format {version}; "
                                  f"states {states})", f"{name!r} is not in it")
        apath = f"model/{name}"
        if apath not in self.arrays:
            raise CheckpointError(f"{self._where}.array", "an array the checkpoint holds (model/<parameter>, "
                                  "optimizer/..., or a parameter's name)", f"{name!r} is not in it (nor {apath!r})")
        return apath

    def _optimizer_states(self) -> list[str]:
        """The names of the optimizer's states the checkpoint holds (exp_avg, ...; none without an
        optimizer)."""
        return list((self.optimizer_info or {}).get("state_names") or [])

    def _read(self, pairs: Sequence[tuple[str, Any, np.ndarray]]) -> list[tuple[Any, Any]]:
        """The value of every tile of each ``(array path, tensor, cells)``, as ``(cell, value)``
        to set: read on the workers (one task per group of tiles, spread over the workers; the
        values stay there) or here without a runtime. Sets nothing: a failed read (a checksum, a
        missing chunk) raises before any cell changes."""
        jobs = []  # (cell, array path, region, info, nbytes)
        for apath, t, cells in pairs:
            info = self._info(apath)
            if tuple(info["shape"]) != tuple(t.shape):
                raise CheckpointError(self._where, f"array {apath!r} to have the model's shape {tuple(t.shape)}",
                                      f"shape {tuple(info['shape'])}")
            for idx in np.ndindex(*t.tiling.grid):
                region = slices(t.chunks, idx)
                nbytes = int(np.prod(t.tiling.tile_shape(idx))) * np.dtype(info["dtype"]).itemsize
                jobs.append((cells[idx], apath, region, _info_as(info, cells[idx].dtype), nbytes))
        if not jobs:
            return []
        runtime = self.runtime
        root = os.path.abspath(self.path)  # absolute: read on the workers, whose working folders are their own
        if runtime is None:
            return [(cell, np.asarray(read_region(root, a, r, i), dtype=cell.dtype)) for cell, a, r, i, _ in jobs]
        addrs = sorted(runtime.workers())
        if not addrs:
            raise CheckpointError(self._where, "a runtime with workers to read the checkpoint", "no workers")
        # groups of about equal bytes, a few per worker, dealt round robin
        client = runtime.client
        futures = []
        for k, b in enumerate(_balanced(jobs, 4 * len(addrs), lambda j: j[4])):
            # each read as its cell's dtype (a model of another dtype than the stored one,
            # new_model(dtype=...): a float16 tile in a float32 cell failed the first op that met it)
            group = [(a, r, i, cell.dtype.str) for cell, a, r, i, _ in b]
            futures.append((client.submit(read_regions, root, group, pure=False, key=f"tg-load-{uuid.uuid4().hex[:12]}",
                                          workers=[addrs[k % len(addrs)]], allow_other_workers=True), b))
        from distributed import wait

        wait([f for f, _ in futures])
        for f, _ in futures:
            if f.status == "error":
                f.result()  # raises the worker's CheckpointError (checksum, missing chunk, ...)
        return [(cell, ValueRef(f, j)) for f, b in futures for j, (cell, *_rest) in enumerate(b)]

    def _restore(self, exact: Sequence[tuple[str, Any, np.ndarray]], quantized: Sequence[tuple[str, Any]] = ()) -> None:
        """Read the tiles of ``exact`` (:meth:`_read`) and the quantized weights ``quantized``
        (:meth:`_read_quantized`), then set them all: nothing changes unless every read succeeded."""
        for cell, value in self._read(exact) + self._read_quantized(quantized):
            cell.set(value)

    def load_into(self, model, *, strict: bool = True) -> None:
        """Put the stored weights into ``model``'s parameters (on its own tiling); every missing,
        unexpected and mis-shaped array is reported at once, before anything changes.

        A weight the model holds quantized (:class:`tilegraph.peft.QuantizedTensor`) gets the
        stored parts of each of its tiles, as they are: the checkpoint must store it quantized
        alike (the same tiles, parts and quantization attributes). One the checkpoint does not
        hold (written before checkpoints held them) keeps its parts."""
        self._load_into(model, _flag(f"{self._where}.load_into", "strict", strict), quantized=True)

    def _load_into(self, model, strict: bool, quantized: bool) -> None:
        reads = self._model_reads(model, strict, quantized)
        seeds = self._dropout_seeds(model)
        self._restore(*reads)
        for layer, seed in seeds:
            layer.dropout_seed = seed

    def _dropout_seeds(self, model) -> list:
        """``(layer, seed)``: the LoRA layers of ``model`` whose adapters are read from here, and
        the dropout seeds recorded with them (:func:`tilegraph.peft.adapter_settings`), for a
        resumed run to draw the masks of the run that saved them; none from a checkpoint written
        before the seeds were recorded (every layer keeps its own). Checked, nothing set."""
        import sys

        stored = ((self.info.get("model") or {}).get("adapters") or {}).get("lora")
        if not stored or not isinstance(stored, dict) or "tilegraph.peft" not in sys.modules:
            return []
        from tilegraph.peft import recorded_dropout_seeds

        names = set(self.parameters)
        loaded = {name for name in stored if f"{name}.lora_u" in names and f"{name}.lora_v" in names}
        try:
            return recorded_dropout_seeds(model, stored, loaded, where=self._where)
        except TileError as e:  # a seed edited by hand: the checkpoint's error
            raise CheckpointError(e.where, e.what, e.received) from None

    def _model_reads(self, model, strict: bool, quantized: bool) -> tuple[list, list]:
        """Check ``model`` against the stored arrays (every problem reported at once); returns
        what :meth:`_restore` reads into it: ``(array path, parameter, cells)`` of its weights
        and, with ``quantized``, ``(array path, QuantizedTensor)`` of those it holds quantized."""
        if not callable(getattr(model, "named_parameters", None)):
            raise CheckpointError(self._where, "a model to load into (a tilegraph.nn.Module; load_checkpoint(...).model "
                                  "builds one)", type(model).__name__)
        named = dict(model.named_parameters())
        held = _held_quantized(model)
        stored = set(self.parameters)
        problems = []
        if strict:
            problems += [f"missing: {n}" for n in named if n not in stored]
            problems += [f"unexpected: {n}" for n in self.parameters if n not in named and n not in held]
        for n, p in named.items():
            if n in stored and tuple(self.arrays[f"model/{n}"]["shape"]) != tuple(p.shape):
                problems.append(f"shape of {n}: model {tuple(p.shape)}, checkpoint "
                                f"{tuple(self.arrays[f'model/{n}']['shape'])}")
        pairs = [(f"model/{n}", q) for n, q in held.items() if n in stored] if quantized else []
        problems += self._quantized_problems(pairs)
        if problems:
            differ = self._config_differences(model)
            raise CheckpointError(self._where, "the checkpoint's arrays to match the model" + (
                f" (the checkpoint holds another model: its config has {differ}; load_checkpoint(...).model builds "
                "its own)" if differ else ""), f"{len(problems)} difference{'s' if len(problems) > 1 else ''}: {_listed(problems)}")
        return [(f"model/{n}", p, p.cells) for n, p in named.items() if n in stored], pairs

    def _refuse_other_config(self, model) -> None:
        """A CheckpointError naming each key of the stored model config that ``model``'s differs
        in, where its weights fit the stored arrays all the same (another ``n_heads``, ``norm_eps``,
        ``rope_base``: the same weights, another function), but for ``max_seq_len`` no larger
        than ``model``'s (a limit of the positions read; where it sizes a weight, GPT-2's position
        embedding, the shapes differ first)."""
        stored = (self.info.get("model") or {}).get("config")
        config = getattr(model, "config", None)
        if not isinstance(stored, dict) or not dataclasses.is_dataclass(config):
            return
        mine = dataclasses.asdict(config)
        as_stored = json.loads(json.dumps(mine, default=str))  # (a tuple as the stored list)
        from tilegraph.models._common import dropout_fields

        drops = dropout_fields(config)

        def other(k, v) -> bool:
            if k not in mine or v is None or mine[k] is None:  # None: derived from others (GPT-2's hidden, 4 * dim;
                return False  # Llama's n_kv_heads, n_heads), and where that differs, so do the shapes
            if k in drops:  # training only: the same function (a resumed run may change it)
                return False
            if k == "max_seq_len" and is_int(v) and is_int(mine[k]):
                return mine[k] < v
            return v != as_stored[k]

        differ = [f"{k} {v!r}, the model's {mine[k]!r}" for k, v in stored.items() if other(k, v)]
        arch = (self.info.get("model") or {}).get("architecture")
        if arch not in (None, getattr(model, "arch", None)):
            differ.insert(0, f"architecture {arch!r}, the model's {getattr(model, 'arch', None)!r}")
        if differ:
            raise CheckpointError(self._where, "a model of the checkpoint's config to restore into (its weights fit "
                                  "this one's shapes, but it computes another function): build it as the checkpoint "
                                  "does (load_checkpoint(path).model, or its .new_model()), or load the weights alone "
                                  "on purpose (load_into)", "; ".join(differ))

    def _config_differences(self, model) -> str:
        """How the stored model config differs from ``model``'s ("dim 32, the model's 64; ..."),
        or "" where they agree or either has none."""
        stored = (self.info.get("model") or {}).get("config")
        config = getattr(model, "config", None)
        if not isinstance(stored, dict) or not dataclasses.is_dataclass(config):
            return ""
        mine = dataclasses.asdict(config)
        from tilegraph.models._common import dropout_fields

        # not the dropout (training only, no part of the weights' shapes: as _refuse_other_config)
        drops = dropout_fields(config)
        differ = [(k, v, mine[k]) for k, v in stored.items() if k in mine and k not in drops and v != mine[k]]
        arch = (self.info.get("model") or {}).get("architecture")
        if arch not in (None, getattr(model, "arch", None)):
            differ.insert(0, ("architecture", arch, model.arch))
        return "; ".join(f"{k} {theirs!r}, the model's {ours!r}" for k, theirs, ours in differ[:_SHOWN])

    def _quantized_problems(self, pairs) -> list[str]:
        """How the stored arrays differ from the quantized weights they go into (read from the
        tiles' zarr.json, no data)."""
        problems, root = [], str(self.path)
        for apath, q in pairs:
            info, name = self.arrays[apath], apath.split("/", 1)[1]
            if not info.get("quantized"):
                problems.append(f"{name}: stored exact, the model holds it quantized")
                continue
            tiles = tuple(tuple(c) for c in info["tiles"])
            if tiles != tuple(map(tuple, q.chunks)) or np.dtype(info["dtype"]) != q.dtype:
                problems.append(f"{name}: model {q.dtype} in tiles {q.chunks}, stored {info['dtype']} in tiles {tiles}")
                continue
            for idx, (names, refs, attrs) in q._tiles.items():
                parts, stored_attrs = quantized_layout(root, f"{apath}/{tile_label(idx)}")
                have = {n: (r.node.cell.dtype, tuple(r.node.cell.shape)) for n, r in zip(names, refs)}
                if parts != have or stored_attrs != json.loads(attrs):
                    problems.append(f"{name} tile {idx}: stored {stored_attrs.get('method')} parts "
                                    f"{_describe_parts(parts)}, the model's {json.loads(attrs).get('method')} "
                                    f"{_describe_parts(have)} (other quantization attributes or parts)")
                    break
        return problems

    def _read_quantized(self, pairs) -> list[tuple[Any, Any]]:
        """The stored parts of every tile of each ``(array path, QuantizedTensor)``, as ``(cell,
        value)`` for its leaf cells (which stay: graphs recorded with them read the new values):
        read on the workers, where steps use them, or here without a runtime. Sets nothing."""
        jobs = [(r.node.cell, f"{apath}/{tile_label(idx)}", names, i)
                for apath, q in pairs for idx, (names, refs, _) in q._tiles.items() for i, r in enumerate(refs)]
        if not jobs:
            return []
        root, runtime = os.path.abspath(self.path), self.runtime  # (read on the workers, as in _read)
        tiles: dict[str, tuple] = {}  # tile path -> part names, in the order of its cells
        for _, path, names, _ in jobs:
            tiles.setdefault(path, tuple(names))
        if runtime is None:
            parts = {path: quantized_parts(root, path)[0] for path in tiles}
            return [(cell, parts[path][names[i]]) for cell, path, names, i in jobs]
        addrs = sorted(runtime.workers())
        if not addrs:
            raise CheckpointError(self._where, "a runtime with workers to read the checkpoint", "no workers")
        client = runtime.client
        where_of: dict[str, tuple] = {}  # tile path -> (future, position of its first part)
        groups = _balanced(list(tiles.items()), 4 * len(addrs), lambda t: len(t[1]))
        futures = []
        for k, group in enumerate(groups):
            f = client.submit(read_parts_task, root, group, pure=False, key=f"tg-load-q-{uuid.uuid4().hex[:12]}",
                              workers=[addrs[k % len(addrs)]], allow_other_workers=True)
            futures.append(f)
            at = 0
            for path, names in group:
                where_of[path] = (f, at)
                at += len(names)
        from distributed import wait

        wait(futures)
        for f in futures:
            if f.status == "error":
                f.result()  # raises the worker's CheckpointError
        return [(cell, ValueRef(where_of[path][0], where_of[path][1] + i)) for cell, path, _, i in jobs]

    def restore_optimizer(self, optimizer, model=None, *, schedule: bool = True) -> None:
        """Restore ``optimizer``'s state tensors (onto its parameters' tilings), step count and,
        with ``schedule``, its learning-rate schedule (as saved: the same total step budget, so
        the run continues exactly), with a warning naming both where it replaces a schedule the
        optimizer was given (set ``optimizer.schedule`` after restoring to go on with that one).
        The optimizer's settings (weight decay, betas, ..., each parameter group's) stay its own,
        with a warning naming each that differs from the checkpoint's. Parameters are matched by
        name through ``model`` (default: the optimizer's parameter names). Everything is checked,
        and every tile read, before the optimizer changes."""
        schedule = _flag(f"{self._where}.restore_optimizer", "schedule", schedule)
        reads, finish = self._optimizer_reads(optimizer, model, schedule, stacklevel=2)
        self._restore(reads)
        finish()

    def _optimizer_reads(self, optimizer, model, schedule: bool, stacklevel: int) -> tuple[list, Callable[[], None]]:
        """Check ``optimizer`` against the stored state (its kind, an array of the right shape per
        parameter and state); returns the ``(array path, parameter, state cells)`` that
        :meth:`_restore` reads into it, and what sets its step count and schedule afterwards.
        ``stacklevel``: the warnings (other settings, another schedule replaced) name the line
        that many calls up from this one (1: the line that calls it; the user's, above a public method)."""
        info = self.optimizer_info
        if info is None:
            raise CheckpointError(self._where, "a checkpoint with optimizer state", "saved without an optimizer")
        kind, saved_kind = type(optimizer).__name__, info.get("type")
        if saved_kind != kind:  # (Adam's m and v are not AdamW's, nor SGD's buffer either)
            raise CheckpointError(self._where, f"an optimizer of the kind whose state the checkpoint holds, "
                                  f"{saved_kind}: make a tg.optim.{saved_kind} with the run's settings to continue "
                                  f"it; to train on from its weights with another optimizer, load the model alone "
                                  f"(load_into, or load_checkpoint(...).model) and leave the optimizer's state",
                                  f"the state of {_article(saved_kind)} for {_article(kind)}")
        kept, keeps = info.get("state_names"), list(optimizer.state_names)
        if isinstance(kept, list) and set(keeps) - set(kept):  # an SGD with momentum, the run's without
            hyper = info.get("hyper") or {}
            run = ", ".join(f"{k}={hyper[k]!r}" for k in getattr(optimizer, "setting_keys", ()) if k in hyper)
            raise CheckpointError(self._where, f"an optimizer that keeps the state the checkpoint's {saved_kind} kept "
                                  f"per parameter ({', '.join(kept) or 'none'}): make it with the run's settings"
                                  + (f" ({run})" if run else "") + ", or load the model alone (load_into) to train "
                                  "on from its weights with these", f"this {kind} keeps {', '.join(keeps)}"
                                  + "".join(f", {k}={getattr(optimizer, k)!r}" for k in ("momentum",)
                                            if hasattr(optimizer, k)))
        if model is not None:
            from tilegraph._train import optimizer_param_names

            names = optimizer_param_names(optimizer, model, self._where, CheckpointError)
        else:
            names = {id(p): p.name for p in optimizer.params}
        pairs, problems = [], []
        for i, p in enumerate(optimizer.params):
            n = names.get(id(p))
            for sname, grid in zip(optimizer.state_names, optimizer.state_cells[i]):
                apath = optimizer_array(n, sname, self.info.get("version"))
                if apath not in self.arrays:
                    problems.append(f"missing: {apath}")
                elif tuple(self.arrays[apath]["shape"]) != tuple(p.shape):
                    problems.append(f"shape of {apath}: {tuple(self.arrays[apath]['shape'])}, expected {p.shape}")
                else:
                    pairs.append((apath, p, grid))
        problems = list(dict.fromkeys(problems))  # parameters of one name ("weight") miss the same array
        if problems:
            hint = (" (the parameters are named by their own names, as no model was given: pass the model, "
                    "restore_optimizer(optimizer, model), to name them as the checkpoint does)") if model is None else ""
            raise CheckpointError(self._where, "optimizer state for every parameter" + hint, _listed(problems))
        hyper = info.get("hyper") or {}
        saved = hyper.get("param_options")  # per parameter of the optimizer, its saved group's settings
        if isinstance(saved, list) and isinstance(hyper.get("param_names"), list):
            by_name = dict(zip(hyper["param_names"], saved))
            saved = [by_name.get(names.get(id(p)), {}) for p in optimizer.params]
        if schedule:  # the restored schedule drives each group at its multiple of the schedule's rate
            optimizer.refuse_other_lr_scales(self._where, saved, hyper.get("base_lr"), CheckpointError)
        _warn_other_settings(self._where, optimizer, hyper, saved, [names.get(id(p)) or p.name
                                                                    for p in optimizer.params], stacklevel + 1)
        sched = None
        if schedule and info.get("schedule") is not None:
            from tilegraph.optim import schedule_from_spec

            sched = schedule_from_spec(info["schedule"])
        step_count = int(info.get("step_count", self.step))
        stored = info.get("param_steps") or {}
        if not isinstance(stored, Mapping):
            raise CheckpointError(self._where, "param_steps to map parameter names to their update counts",
                                  repr(stored)[:200])
        param_steps = [stored.get(names.get(id(p)), step_count) for p in optimizer.params]
        param_steps = optimizer.checked_param_steps(self._where, param_steps, step_count)

        def finish() -> None:
            optimizer.step_count = step_count
            optimizer.param_steps = param_steps
            if sched is not None:  # with a warning where it replaces a schedule the optimizer was given
                optimizer.restore_schedule(sched, self._where, stacklevel=stacklevel + 1)

        return pairs, finish

    def restore(self, model, optimizer=None, *, strict: bool = True, schedule: bool = True,
                stacklevel: int = 1) -> None:
        """:meth:`load_into` ``model`` and :meth:`restore_optimizer` ``optimizer`` (matched through
        ``model``) as one: every check of both (arrays, shapes and quantized layout of the
        weights; the optimizer's kind, parameters and state) and every read happen before
        anything changes, so a checkpoint that does not fit leaves model and optimizer as they
        were (what resuming training needs: :meth:`tilegraph.Trainer.load_checkpoint`).

        With ``strict``, the model's config must also be the stored one wherever it changes what
        the weights compute (``n_heads``, ``norm_eps``, ``rope_base`` ... of the same shapes; a
        longer ``max_seq_len`` only lets it read longer sequences, and is taken): the run would
        otherwise go on as another model, silently. ``stacklevel``: the warnings (the
        optimizer's settings, the schedule it replaces) name the line that many calls up from
        this one (1: the line that calls it)."""
        strict = _flag(f"{self._where}.restore", "strict", strict)
        schedule = _flag(f"{self._where}.restore", "schedule", schedule)
        exact, quantized = self._model_reads(model, strict, quantized=True)
        if strict:
            self._refuse_other_config(model)
        reads, finish = self._optimizer_reads(optimizer, model, schedule, stacklevel + 1) if optimizer is not None \
            else ([], None)
        seeds = self._dropout_seeds(model)
        self._restore(exact + reads, quantized)
        for layer, seed in seeds:
            layer.dropout_seed = seed
        if finish is not None:
            finish()


def _article(name: str) -> str:
    """``an AdamW``, ``an SGD``, ``a Lion``: a name (read letter by letter where it is capitals)."""
    spoken = name[:1] in "AEIOU" or name[:1] in "FHLMNRSX" and name[1:2].isupper()
    return f"{'an' if spoken else 'a'} {name}"


def _flag(where: str, name: str, value) -> bool:
    """A switch given as a bool (``strict="no"`` is a true str: a strict load, silently)."""
    if not isinstance(value, (bool, np.bool_)):
        raise CheckpointError(where, f"{name} must be True or False", repr(value)[:100])
    return bool(value)


def _held_quantized(model) -> dict:
    """The weights ``model`` holds quantized, by name (none when tilegraph.peft was never imported)."""
    import sys

    if "tilegraph.peft" not in sys.modules:
        return {}
    from tilegraph.peft import named_quantized

    return dict(named_quantized(model))


def _describe_parts(parts: dict) -> str:
    return ", ".join(f"{n} {np.dtype(d).str} {tuple(s)}" for n, (d, s) in sorted(parts.items()))


def complete_checkpoints(folder) -> list[Path]:
    """The complete checkpoints ``step-N`` of a :class:`CheckpointManager`'s folder, oldest
    first (none where the folder is missing)."""
    folder = user_path(folder, "tilegraph.io.complete_checkpoints")
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if checkpoint_step(p.name) is not None and is_checkpoint(p)]
    # by step number, not by name: past step 999999 the name grows a digit, and "step-1000000"
    # sorts before "step-999999" (the newest would be pruned as the oldest)
    return sorted(found, key=lambda p: (checkpoint_step(p.name), p.name))


def checkpoint_step(name: str) -> int | None:
    """The step of a :class:`CheckpointManager` folder name ``step-NNNNNN`` (None: not one;
    ``tilegraph train``'s run folders read it too)."""
    digits = name[5:]
    if not name.startswith("step-") or not digits.isascii() or not digits.isdigit():
        return None
    return int(digits)


def _info_as(info: dict, dtype: np.dtype) -> dict:
    """The attributes to read array ``info`` with into a cell of ``dtype``: a quantized array
    dequantizes straight to it (through the stored dtype, a float16 array's float32 dequantized
    values were rounded to float16 first, unlike those of a float32 checkpoint of the same
    weights); an exact one reads as stored, cast after."""
    if info.get("quantized") and np.dtype(info["dtype"]) != dtype:
        return dict(info, dtype=str(dtype))
    return info


def load_checkpoint(path, *, tiling=None, runtime=None) -> Checkpoint:
    """Open the Zarr checkpoint folder ``path`` (see :class:`Checkpoint`): ``.model`` builds the
    model (on ``tiling``, default the stored one) with its tiles read on ``runtime``'s workers
    (default: the current runtime, else here); ``.restore_optimizer(opt)`` restores an
    optimizer. Problems (not a checkpoint, an unfinished save, a format from a newer tilegraph,
    a missing array, a chunk that fails its checksum) raise a :class:`CheckpointError` naming
    the path or array."""
    return Checkpoint(path, tiling=tiling, runtime=runtime)


# ------------------------------------------------------------------------------------- manager ----

#: the manager of this process that saves in each folder (resolved path -> weak reference): the
#: last one to save there (a Trainer built again, a notebook cell run again). Another manager of
#: this process that saved there before is refused at its next save and no longer prunes there
#: (both pruned with ``keep``, each deleted the other's checkpoints, and ``latest()`` named the
#: other's model)
_SAVING_IN: dict[str, Any] = {}
_SAVING_GUARD = threading.Lock()


class CheckpointManager:
    """Checkpoints ``step-NNNNNN`` in the folder ``dir``: every ``every`` steps (:meth:`due`),
    the newest ``keep`` kept (None: all), written in the background with ``async_save`` (the
    values are fixed when :meth:`save` is called, so training goes on while the workers write).

    Temporary folders of saves that a kill or a crash interrupted (``.step-N.tmp-PID-HEX-HOST``,
    or the earlier ``.step-N.tmp-PID-HEX``) are removed when the manager starts: those of this
    host whose process is gone, and those of another host (a folder shared by several nodes)
    untouched for ``_store.STALE_OTHER_HOST_SECONDS`` (a day); they are never loaded. A run resumed
    from an earlier checkpoint keeps it (:meth:`protect`) and moves the later ones aside
    (:meth:`set_aside`).

    One manager saves in a folder at a time, so that no two prune each other's checkpoints: within
    this process the last one to save there (a Trainer or a notebook cell made again); one that
    saved there before is refused at its next save, and prunes nothing there any more. A save
    is refused while another process's ``Trainer.fit`` or ``tilegraph train`` holds the folder
    (its ``.tilegraph.lock``), and so is one of a step that ``keep`` would delete at once (older
    than the newest ``keep`` checkpoints there).

    >>> mgr = CheckpointManager(tmp / "ck", keep=2, every=100)  # doctest: +SKIP
    >>> mgr.save(step, model, optimizer)  # returns at once; mgr.wait() for the commit  # doctest: +SKIP
    >>> mgr.latest()                                                                  # doctest: +SKIP
    """

    def __init__(self, dir, keep: int | None = None, every: int = 0, async_save: bool = True):
        where = "tilegraph.io.CheckpointManager"
        if keep is not None and not is_int(keep, 1):  # NumPy's integers too
            raise CheckpointError(where, "keep must be None (keep all) or an int >= 1", f"keep={keep!r}")
        if not is_int(every, 0):
            raise CheckpointError(where, "every must be an int >= 0 (0: only when asked)", f"every={every!r}")
        if not isinstance(async_save, (bool, np.bool_)):  # "no" would count as True
            raise CheckpointError(where, "async_save must be True or False", f"async_save={async_save!r}")
        folder = user_path(dir, where, CheckpointError)
        in_the_way = file_in_the_way(folder)  # else accepted, and every save failed (after training up to it)
        if in_the_way is not None:
            raise CheckpointError(where, "dir must be a folder (made when missing)",
                                  f"{folder}: " + ("an existing file" if in_the_way == folder
                                                   else f"{in_the_way} is a file"))
        # made when missing, and written in: a read-only or forbidden folder was accepted, and
        # every save failed (after training up to it)
        problem = unwritable_folder(folder)
        if problem is not None:
            raise CheckpointError(where, "dir must be a folder this process can create and write in",
                                  f"{folder}: {problem}")
        self.dir, self.keep, self.every = folder, None if keep is None else int(keep), int(every)
        self.async_save = bool(async_save)
        if self.async_save:  # zarr imported here, not by the first save's thread while training holds the GIL
            array_meta((1,), np.float32, (1,))
        self._thread = None
        self._error: BaseException | None = None
        self._pending: Path | None = None
        self._pending_step: int | None = None
        self.committed: list[Path] = []  # saved by this manager, in order (for hooks and restarts)
        self.protected: set[Path] = set()  # never pruned (resolved paths): see protect()
        self._saved_here = False  # whether this manager saved in dir (took it: see _take_folder)
        self.removed_stale = self.clean()

    def path(self, step: int) -> Path:
        if not is_int(step, 0):  # a negative step would name "step--00001", a float be truncated
            raise CheckpointError(f"tilegraph.io.CheckpointManager({self.dir})", "step must be an int >= 0",
                                  repr(step))
        return self.dir / f"step-{int(step):06d}"

    def due(self, step: int) -> bool:
        """Whether step ``step`` (an int >= 0) is one of every ``every``-th (never with ``every=0``)."""
        if not is_int(step, 0):  # "4" was a TypeError of '%' ("not all arguments converted")
            raise CheckpointError(f"tilegraph.io.CheckpointManager({self.dir}).due", "step must be an int >= 0",
                                  repr(step))
        return bool(self.every) and step % self.every == 0

    def checkpoints(self) -> list[Path]:
        """The complete checkpoints in ``dir``, oldest first."""
        return complete_checkpoints(self.dir)

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def clean(self) -> list[Path]:
        """Remove temporary folders of interrupted saves: this host's whose process is gone (the
        earlier names, without a host, count as this host's), another host's untouched for
        ``STALE_OTHER_HOST_SECONDS`` (its process cannot be looked up from here); returns them."""
        return remove_stale_temporaries(self.dir, keep_own=self._pending is not None)

    def save(self, step: int, model, optimizer=None, **kw) -> Path:
        """Save ``step`` (see :func:`save_checkpoint` for ``kw``); in the background with
        ``async_save`` (an earlier save still running is waited for first). Returns the path the
        checkpoint has once committed."""
        self.wait()
        path = self.path(step)
        self._take_folder(f"tilegraph.io.CheckpointManager({self.dir}).save", step)
        pending = prepare_save(path, model, optimizer, step=step, **kw)
        if not self.async_save:
            self._finish(pending.run())
            return path
        # the write tasks are submitted here, before the caller submits the next steps, at a
        # priority above theirs: the workers write first and the commit follows at once. (Submitted
        # from the thread, they queued behind the steps submitted meanwhile, and the thread's first
        # save imported zarr while the training loop held the GIL: a step-3 save still uncommitted
        # after step 6.)
        pending.start()
        self._pending, self._pending_step = path, int(step)

        def target():
            try:
                self._finish(pending.finish())
            except BaseException as e:  # reported by wait()
                self._error = e

        self._thread = threading.Thread(target=target, name=f"tilegraph-save-{step}", daemon=True)
        self._thread.start()
        return path

    def _finish(self, path: Path) -> None:
        self.committed.append(path)
        if self._saver() is self:  # (one that took the folder since prunes it, not this one)
            self.prune()

    def _key(self) -> str:
        return str(self.dir.resolve())

    def _saver(self) -> "CheckpointManager | None":
        """The manager of this process that last saved in ``dir`` (None: none alive)."""
        with _SAVING_GUARD:
            ref = _SAVING_IN.get(self._key())
        return None if ref is None else ref()

    def _displaced(self, where: str, received: str) -> CheckpointError:
        return CheckpointError(where, f"a folder this manager still saves in: another CheckpointManager of this "
                               f"process has saved in {self.dir} since (a Trainer or a notebook cell made again on "
                               "the same folder), and only that one saves and prunes there now (two would delete "
                               "each other's checkpoints with keep). Save with that one, or make this one on "
                               "another dir", received)

    def _take_folder(self, where: str, step: int) -> None:
        """Before a save of ``step``: make this manager the one of this process saving in ``dir``
        (refused when another has saved there since this one did); refuse a folder another live
        process's Trainer.fit or ``tilegraph train`` holds, and a step ``keep`` would prune at once."""
        import socket

        from tilegraph._lock import LOCK_NAME, _read

        held = _read(self.dir / LOCK_NAME)
        if held is not None and (held["host"] != socket.gethostname()
                                 or (held["pid"] != os.getpid() and process_alive(held["pid"]))):
            gone = "" if held["host"] == socket.gethostname() else (
                f"; if that process is gone, delete {self.dir / LOCK_NAME} (another machine's processes cannot be "
                "looked up from here)")
            raise CheckpointError(where, f"a folder no other run is using: {self.dir} is in use by {held['by']} (pid "
                                  f"{held['pid']} on {held['host']}), whose checkpoints this manager's would collide "
                                  f"with or prune: wait for it to end, or save in another dir{gone}",
                                  str(self.dir / LOCK_NAME))
        with _SAVING_GUARD:
            ref = _SAVING_IN.get(self._key())
            other = None if ref is None else ref()
            if other is not None and other is not self and self._saved_here:
                raise self._displaced(where, f"step {step}")
        if self.keep is not None and self.path(step).resolve() not in self.protected:
            newer = [p.name for p in self.checkpoints() if checkpoint_step(p.name) > step]
            if len(newer) >= self.keep:
                raise CheckpointError(where, f"a step keep={self.keep} keeps: {self.dir} holds {len(newer)} "
                                      f"checkpoint{'s' if len(newer) > 1 else ''} of later steps, so this one would "
                                      "be deleted as soon as it is saved. Move them aside first "
                                      f"(set_aside({step})), or save in another dir",
                                      f"step {step}; later: {', '.join(newer[:4])}"
                                      + (f" (and {len(newer) - 4} more)" if len(newer) > 4 else ""))
        with _SAVING_GUARD:  # (a manager that never saved here takes the folder over)
            _SAVING_IN[self._key()] = weakref.ref(self)
            self._saved_here = True

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending_step(self) -> int | None:
        """The step of the background save not yet waited for (committed, failed or under way),
        or None."""
        return self._pending_step

    def wait(self, timeout: float | None = None) -> Path | None:
        """Wait for the background save; re-raises its error. Returns the newest committed path."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return None
            self._thread, self._pending, self._pending_step = None, None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.committed[-1] if self.committed else None

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep`` complete checkpoints, and those :meth:`protect`
        names; returns the deleted ones. A symbolic link among them is removed, never what it
        points to; each folder is renamed to a temporary name before its files go. Refused in a
        manager of this process that another has saved in ``dir`` after (see the class)."""
        if self.keep is None:
            return []
        saver = self._saver()
        if saver is not None and saver is not self and self._saved_here:
            raise self._displaced(f"tilegraph.io.CheckpointManager({self.dir}).prune", "prune()")
        old = [p for p in self.checkpoints()[:-self.keep] if p.resolve() not in self.protected]
        gone = []
        for p in old:
            if p.is_symlink():  # a link to a checkpoint put here: the link goes, never what it points to
                with contextlib.suppress(OSError):  # (rmtree refused a link, silently: it stayed, kept forever)
                    p.unlink()
                    gone.append(p)
                continue
            # renamed first, at once no longer a checkpoint: a kill while the files go leaves a
            # temporary folder that clean() removes, never a half-deleted one that lists and
            # opens as a checkpoint and fails to load
            doomed = p.parent / temp_name(p.name)
            try:
                os.rename(p, doomed)
            except OSError:  # gone meanwhile (another process pruned it), or not ours to move
                continue
            shutil.rmtree(doomed, ignore_errors=True)
            gone.append(p)
        return gone

    def protect(self, path) -> None:
        """Never :meth:`prune` the checkpoint ``path`` (e.g. the one a run resumed from: its
        branch point, kept however many newer ones follow)."""
        self.protected.add(user_path(path, "tilegraph.io.CheckpointManager.protect").resolve())

    def set_aside(self, after: int, name: str = "abandoned") -> list[Path]:
        """Move the checkpoints of the steps after ``after`` into a new subfolder of ``dir``
        named ``name`` (``name-2``, ... when taken), where :meth:`checkpoints`, :meth:`latest` and
        :meth:`prune` no longer see them: a run resumed from step ``after`` abandons them, and its
        own checkpoints must neither collide with them nor be pruned as older than them. Nothing
        is deleted; returns their new paths (none moved: no folder made)."""
        where = f"tilegraph.io.CheckpointManager({self.dir}).set_aside"
        if not is_int(after, 0):  # "4" was a TypeError of '>', 1.5 moved step 2 on
            raise CheckpointError(where, "after must be a step, an int >= 0", f"after={after!r}")
        steps = {p: checkpoint_step(p.name) for p in self.dir.iterdir()} if self.dir.is_dir() else {}
        later = sorted(p for p, s in steps.items() if s is not None and s > after)
        if not later:
            return []
        dest, n = self.dir / name, 1
        while os.path.lexists(dest):
            n += 1
            dest = self.dir / f"{name}-{n}"
        moved = []
        try:
            dest.mkdir()
            for p in later:
                p.rename(dest / p.name)
                moved.append(dest / p.name)
        except OSError as e:
            raise write_failure(where, e, dest, f"the folder for the checkpoints after step {after}",
                                f"moved so far: {', '.join(p.name for p in moved) or 'none'}; none deleted") from None
        return moved
