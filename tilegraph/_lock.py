"""A folder one process at a time writes in: a lock file naming the process that holds it.
``tilegraph train`` holds its output folder for the whole job (:func:`tilegraph.cli.runs.lock_output`)
and :meth:`tilegraph.Trainer.fit` its ``checkpoint_dir`` and ``log_dir`` while it fits, so that two
runs never write checkpoints and ``metrics.jsonl`` records into the same folders."""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tilegraph._errors import TileError

__all__ = ["LOCK_NAME", "Holder", "hold_folder"]

#: the lock file in a held folder: JSON {"pid", "host", "by"}
LOCK_NAME = ".tilegraph.lock"
#: what held a lock file that does not say (written before locks named it: tilegraph train alone took them)
EARLIER_HOLDER = "tilegraph train"


@dataclass(frozen=True)
class Holder:
    """The holder of a folder's lock, as its lock file names it: the process (``pid`` and
    ``host``) and what runs there (``by``: "tilegraph train", "tilegraph.Trainer.fit");
    ``here``: this process (another of its trainers, still fitting)."""
    folder: Path
    lock: Path
    pid: int
    host: str
    by: str
    here: bool


#: this process's locks, by the resolved path of their lock file: [pid, by, owner, holds]. The pid
#: tells them from those of the process this one was forked from, which the dict came with
_held: dict[str, list] = {}
_guard = threading.Lock()  # (taking a lock reads, writes and registers it as one: a thread at a time)


def hold_folder(folder: Path, by: str, refuse: Callable[[Holder], TileError], owner: object = None,
                where: str = "tilegraph", name: str = "the folder") -> Callable[[], None]:
    """Take ``folder`` (made when missing) for this process: a lock file in it naming the process
    and ``by``. Returns the release function (call it once), which removes the file when the
    last hold of this process ends. ``where`` and ``name`` (the folder, in words) name a lock that
    keeps changing hands while it is taken (three tries).

    A lock another live process holds is refused with ``refuse(holder)``; one whose process is
    gone (a kill, a crash) is taken over, as is an unreadable one and one naming this process's
    pid that this process does not hold (left by an earlier process of that pid: a container's
    processes start from the same pids). Another machine's process cannot be looked up from here:
    its lock is refused as live.

    Within this process, ``owner`` says who may hold the folder too: None, the process itself (a
    command: the trainer it runs holds the folder inside its hold); an object (a Trainer), that
    one alone: a lock of this process that another such owner holds is refused as another
    process's is (a trainer still fitting in another thread), and one it holds itself, or that
    the process holds, is held once more. A holder that ended (a fit that returned or raised)
    has released its hold, so a Trainer built again on the same folders (a notebook cell run
    again) takes them."""
    from tilegraph.io._store import process_alive

    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "by": by}
    with _guard:
        key = str(lock.resolve())
        entry = _held.get(key)
        if entry is not None and entry[0] == me["pid"]:
            if entry[2] is None or entry[2] is owner:
                entry[3] += 1
                return _releaser(key, lock)
            raise refuse(Holder(folder, lock, me["pid"], me["host"], entry[1], True))
        for _ in range(3):
            if _create(lock, json.dumps(me)):
                _held[key] = [me["pid"], by, owner, 1]
                return _releaser(key, lock)
            held = _read(lock)
            if held is not None and (held["host"] != me["host"] or (held["pid"] != me["pid"]
                                                                    and process_alive(held["pid"]))):
                raise refuse(Holder(folder, lock, held["pid"], held["host"], held["by"], False))
            lock.unlink(missing_ok=True)  # its process is gone
    raise TileError(where, f"a lock on {name}", f"{lock} could not be taken")


def _create(lock: Path, content: str) -> bool:
    """Make ``lock`` holding ``content`` unless it exists (False then). The content is written
    beside it and linked in, so that no other process reads the file empty (a lock half made,
    which would count as unreadable and be taken over); where the file system has no hard links,
    made in place."""
    tmp = lock.with_name(f"{lock.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.write_text(content)
        try:
            os.link(tmp, lock)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some network and FUSE file systems)
            pass
    finally:
        tmp.unlink(missing_ok=True)
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(content)
    return True


def _read(lock: Path) -> dict | None:
    """The holder a lock file names (pid, host, by); None where it names none (unreadable, cut)."""
    try:
        held = json.loads(lock.read_text())
        return {"pid": int(held["pid"]), "host": str(held["host"]), "by": str(held.get("by") or EARLIER_HOLDER)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _releaser(key: str, lock: Path) -> Callable[[], None]:
    """The release function of one hold of the lock ``key`` (``lock``, its file)."""
    done = []

    def release() -> None:
        with _guard:
            if done:  # (once: a second call would end another hold)
                return
            done.append(True)
            entry = _held.get(key)
            if entry is None or entry[0] != os.getpid():
                return
            entry[3] -= 1
            if entry[3] > 0:
                return
            del _held[key]
            held = _read(lock)
            if held is None or (held["pid"] == os.getpid() and held["host"] == socket.gethostname()):
                lock.unlink(missing_ok=True)  # (not one another process took over meanwhile)

    return release
