"""What the lowest declared dependencies need, pinned without installing them (an audit of the
minimums in pyproject.toml, run in a virtual environment with numpy 1.26.0, dask and distributed
2024.8.0, numba 0.60.0, zarr 3.0.0, crc32c 2.4, ...).

- distributed before 2025.4: ``Scheduler.identity`` takes no ``n_workers``; every connect failed
  with "TypeError: Scheduler.identity() got an unexpected keyword argument 'n_workers'"
  (``tilegraph train`` never got to its first step). ``runtime._scheduler_identity`` asks
  without it there.
- zarr before 3.1.x: Zarr's ``crc32c`` codec computes with the crc32c package, not google-crc32c;
  the checkpoint's own checksum must equal what Zarr's codec writes, whichever it uses."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np
import pytest

from tilegraph import runtime as rt_mod

ROOT = Path(__file__).resolve().parents[1]


class _Scheduler:
    """A scheduler RPC whose ``identity`` takes ``n_workers`` (distributed >= 2025.4) or not."""

    def __init__(self, takes_n_workers: bool, error: str | None = None):
        self.takes, self.error, self.calls = takes_n_workers, error, []

    def identity(self, **kwargs):
        self.calls.append(kwargs)
        if "n_workers" in kwargs and not self.takes:
            raise TypeError(self.error or "Scheduler.identity() got an unexpected keyword argument 'n_workers'")
        return {"workers": {"tcp://127.0.0.1:1": {}}, "asked": dict(kwargs)}


class _Client:
    def __init__(self, scheduler: _Scheduler):
        self.scheduler, self.timeouts = scheduler, []

    def sync(self, func, *args, callback_timeout=None, **kwargs):
        self.timeouts.append(callback_timeout)
        return func(*args, **kwargs)


@pytest.mark.parametrize("n", [-1, 0])
def test_an_old_distributed_is_asked_without_n_workers(monkeypatch, n):
    monkeypatch.setattr(rt_mod, "_identity_takes_n_workers", lambda: False)
    client = _Client(_Scheduler(takes_n_workers=False))
    info = rt_mod._scheduler_identity(client, n, 7.0)
    assert info["asked"] == {} and client.scheduler.calls == [{}]
    assert client.timeouts == [7.0]  # the time limit still applies


@pytest.mark.parametrize("n", [-1, 0])
def test_a_new_distributed_is_asked_with_n_workers(monkeypatch, n):
    monkeypatch.setattr(rt_mod, "_identity_takes_n_workers", lambda: True)
    client = _Client(_Scheduler(takes_n_workers=True))
    assert rt_mod._scheduler_identity(client, n, 3.0)["asked"] == {"n_workers": n}
    assert client.scheduler.calls == [{"n_workers": n}]


def test_a_remote_scheduler_older_than_the_client_is_asked_again_without_n_workers(monkeypatch):
    monkeypatch.setattr(rt_mod, "_identity_takes_n_workers", lambda: True)
    client = _Client(_Scheduler(takes_n_workers=False))
    assert rt_mod._scheduler_identity(client, -1, 3.0)["workers"]
    assert client.scheduler.calls == [{"n_workers": -1}, {}]
    # another TypeError is not taken for that one
    client = _Client(_Scheduler(takes_n_workers=False, error="unsupported operand type(s)"))
    with pytest.raises(TypeError, match="unsupported operand"):
        rt_mod._scheduler_identity(client, -1, 3.0)
    assert client.scheduler.calls == [{"n_workers": -1}]


def test_the_installed_distributed_is_read_as_its_release_says():
    """Scheduler.identity's n_workers came with distributed 2025.4.0."""
    import distributed
    from packaging.version import Version

    rt_mod._identity_takes_n_workers.cache_clear()
    try:
        assert rt_mod._identity_takes_n_workers() == (Version(distributed.__version__) >= Version("2025.4.0"))
    finally:
        rt_mod._identity_takes_n_workers.cache_clear()


def _declared_minimum(name: str) -> tuple[int, ...]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = next(d for d in deps if re.match(rf"{re.escape(name)}\s*>=", d))
    return tuple(int(p) for p in re.search(r">=\s*([0-9.]+)", spec).group(1).split("."))


def test_no_direct_identity_call_with_n_workers_while_older_distributed_is_declared():
    """While pyproject admits a distributed older than 2025.4, no library module asks the
    scheduler's identity with n_workers but through runtime._scheduler_identity."""
    if _declared_minimum("distributed") >= (2025, 4):
        pytest.skip("the declared distributed takes n_workers")
    direct = re.compile(r"scheduler\.identity\s*,[^)]*n_workers|scheduler_info\(\s*n_workers")
    found = []
    for folder in ("tilegraph", "ops", "models", "io"):
        for path in (ROOT / folder).rglob("*.py"):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if direct.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    # the helper itself, where the scheduler takes it; scheduler_info(n_workers=-1) in
    # connect(mpi=True) is Client's own keyword (before 2025.4 it takes **kwargs and drops it)
    allowed = {"tilegraph/runtime/__init__.py": {"n_workers=n_workers", "scheduler_info(n_workers=-1)"}}
    bad = [f for f in found if not any(a in f for a in allowed.get(f.split(":")[0], ()))]
    assert not bad, bad
    assert any("n_workers=n_workers" in f for f in found)  # (the scan sees the helper's call)


@pytest.mark.parametrize("dtype,n", [("uint8", 1), ("uint8", 4097), ("float32", 300_001), ("int64", 33)])
def test_the_checkpoint_checksum_is_the_one_zarrs_codec_writes(tmp_path, dtype, n):
    """Whatever CRC32C library this Zarr's codec uses (crc32c before 3.1.x, google-crc32c after),
    a chunk it writes ends in the 4 bytes tilegraph's checkpoint computes for the same data."""
    import zarr
    from zarr.codecs import Crc32cCodec

    from tilegraph.io import _store

    data = (np.random.default_rng(n).standard_normal(n) * 100).astype(dtype)
    arr = zarr.create_array(store=str(tmp_path / "a"), shape=(n,), chunks=(n,), dtype=dtype,
                            compressors=[Crc32cCodec()], fill_value=0)
    arr[:] = data
    raw = (tmp_path / "a" / "c" / "0").read_bytes()
    assert raw[:-4] == data.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert raw[-4:] == _store.crc_bytes(data.view(np.uint8))
    assert _store.crc32c(data.tobytes()) == int.from_bytes(raw[-4:], "little")


def test_lone_surrogates_are_refused_whatever_the_tokenizers_library_does(monkeypatch):
    """tokenizers up to 0.20.0 (at least; 0.20.3 refuses it) encoded a str with lone surrogates
    (as U+FFFD's bytes) where later ones raise the TypeError that BPETokenizer turns into its
    error: both give that error."""
    pytest.importorskip("tokenizers")
    from tilegraph import TileError
    from tilegraph.io import tokenizers as tk

    monkeypatch.setattr(tk, "_library_takes_lone_surrogates", lambda: True)  # as the old library
    for text in ("ab\udcffcd", "é\udcff"):
        with pytest.raises(TileError, match="lone surrogates"):
            tk._no_lone_surrogates(text, "here")
    for text in ("plain", "hé", b"\xff"):  # valid text, and bytes (the library's own TypeError)
        assert tk._no_lone_surrogates(text, "here") is text
    monkeypatch.setattr(tk, "_library_takes_lone_surrogates", lambda: False)
    assert tk._no_lone_surrogates("ab\udcffcd", "here") == "ab\udcffcd"  # left to the library
