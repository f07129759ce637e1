"""The worker limit of `tilegraph train`, met from the Python API and under --mpi (session 44).

- `tg.connect(n_workers=100000)` went on to spawn the processes that `tilegraph train --set
  runtime.workers=100000` refuses: connect now refuses more than 4 worker processes per usable
  core for the embedded cluster (TILEGRAPH_MAX_WORKERS sets another limit), by the same rule
  (tilegraph._config.over_worker_limit), before any process starts; `threads_per_worker=10**6`
  is refused as well. A cluster of one's own (address, scheduler_file, mpi=True) has no limit.
- `tilegraph train --mpi --set runtime.workers=100000` said the workers were too many for this
  machine; the right word is that workers is the embedded cluster's alone (leave it 0 under
  --mpi, runtime.address or runtime.scheduler_file).

No cluster starts and no process is spawned: Dask's SpecCluster is replaced by one that fails
with ``Started`` (a count within the limit reaches it), and the CLI's tilegraph.connect by one
that fails the test."""

from __future__ import annotations

import time

import distributed
import pytest

import tilegraph
import tilegraph as tg
from tilegraph import _config
from tilegraph.cli.config import check_config, load_config
from test_e2e42_setflags import _error  # the one error line of tilegraph train ARGV (status 2)

MAX_WORKERS = "TILEGRAPH_MAX_WORKERS"  # (the name users type, not tilegraph._config's constant)
WHERE = "[tilegraph.connect] "
TWO_CORES = "4 per core, of the 2 cores this process may use"
LAUNCH = ("[tilegraph train [runtime]] at most one of address, scheduler_file and mpi (--mpi), and workers only "
          "for the embedded cluster (the others bring their own workers); received: ")
SOURCE = " (in shipped default.toml (examples/configs/) and the command line)"


class Started(Exception):
    """What the stand-in for Dask's SpecCluster raises: connect got as far as starting workers."""


@pytest.fixture
def two_cores(monkeypatch):
    """A process that may use 2 cores (of the machine's 2), no limit set."""
    monkeypatch.setattr(_config, "usable_cores", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    monkeypatch.delenv(MAX_WORKERS, raising=False)


@pytest.fixture
def no_spawn(monkeypatch, two_cores):
    """connect's SpecCluster (imported from distributed where connect starts one): records the
    workers and threads asked for, and raises :class:`Started` instead of starting them."""
    asked = []

    def start(*args, workers, **kwargs):
        asked.append((len(workers), next(iter(workers.values()))["options"]["nthreads"]))
        raise Started

    monkeypatch.setattr(distributed, "SpecCluster", start)
    return asked


def _refused(**kwargs) -> str:
    """The message of ``tg.connect(**kwargs)``'s TileError, raised within a second."""
    begin = time.monotonic()
    with pytest.raises(tg.TileError) as e:
        tg.connect(dashboard=False, make_current=False, **kwargs)
    assert time.monotonic() - begin < 1.0, str(e.value)
    return str(e.value)


def _started(asked: list, **kwargs) -> tuple[int, int]:
    """(workers, threads per worker) that ``tg.connect(**kwargs)`` went on to start (``asked``:
    ``no_spawn``'s record)."""
    with pytest.raises(Started):
        tg.connect(dashboard=False, make_current=False, **kwargs)
    return asked.pop()


def _over_limit(name: str, count: int, most: int, why: str, starts: str = "that many worker processes") -> str:
    return (f"{WHERE}{name} at most {most} ({why}): the embedded cluster starts {starts} on this machine (to start "
            f"more on purpose: TILEGRAPH_MAX_WORKERS={count} in the environment, e.g. os.environ, before "
            "tilegraph.connect; a cluster started elsewhere, reached by address, scheduler_file or mpi=True, brings "
            f"its own workers and has no such limit); received: {name}={count}")


# -- 1. tg.connect: the limit of tilegraph train ----------------------------------------------------
def test_connect_refuses_more_workers_than_the_machine_runs(no_spawn):
    assert _refused(n_workers=100000) == _over_limit("n_workers", 100000, 8, TWO_CORES)
    assert _refused(n_workers=9) == _over_limit("n_workers", 9, 8, TWO_CORES)  # just over
    assert no_spawn == []  # refused before any worker was asked for
    assert _started(no_spawn, n_workers=8) == (8, 1)  # the limit itself starts


def test_connect_names_a_share_of_the_machine(no_spawn, monkeypatch):
    """A batch job's 2 cores of a 64-core node: the limit is the job's, and says so."""
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    assert _refused(n_workers=100000) == _over_limit(
        "n_workers", 100000, 8, "4 per core, of the 2 cores of the machine's 64 this process may use")


def test_a_gpu_count_that_sets_the_workers_is_limited_too(no_spawn):
    """gpu=N without n_workers starts a worker per GPU."""
    assert _refused(gpu=100000) == _over_limit("gpu", 100000, 8, TWO_CORES,
                                               "a worker process per GPU (n_workers not given)")
    assert no_spawn == []


def test_the_variable_sets_connects_limit(no_spawn, monkeypatch):
    monkeypatch.setenv(MAX_WORKERS, "10")
    assert _started(no_spawn, n_workers=10) == (10, 1)  # over the default 8: the variable allows it
    assert _refused(n_workers=11) == _over_limit("n_workers", 11, 10, "TILEGRAPH_MAX_WORKERS=10")
    monkeypatch.setenv(MAX_WORKERS, "100000")  # the check itself: no cluster of 100000 is started here
    assert _config.over_worker_limit("tilegraph.connect", 100000) is None
    assert _config.over_worker_limit("tilegraph.connect", 100001) == (100000, "TILEGRAPH_MAX_WORKERS=100000")


@pytest.mark.parametrize("bad", ["0", "many", "-3", "2.5"])
def test_a_bad_variable_is_named_by_connect(no_spawn, monkeypatch, bad):
    monkeypatch.setenv(MAX_WORKERS, bad)
    assert _refused(n_workers=2) == (f"{WHERE}TILEGRAPH_MAX_WORKERS: an integer >= 1 (the most worker processes "
                                     f"an embedded cluster may start); received: {bad!r}")
    assert no_spawn == []


def test_the_default_count_is_not_limited_nor_the_variable_read(no_spawn, monkeypatch):
    monkeypatch.setenv(MAX_WORKERS, "many")
    assert _started(no_spawn) == (1, 2)  # one worker per 4 cores, at least one, with a thread per core


def test_connect_and_tilegraph_train_share_one_rule(no_spawn, monkeypatch):
    """One place decides: a limit of 1 per core reaches connect and the CLI's check alike."""
    monkeypatch.setattr(_config, "WORKERS_PER_CORE", 1)
    assert _refused(n_workers=3) == _over_limit("n_workers", 3, 2, "1 per core, of the 2 cores this process "
                                                "may use")
    cfg, source = load_config(None)
    cfg["runtime"]["workers"] = 3
    with pytest.raises(tg.TileError, match=r"runtime\.workers must be at most 2 \(1 per core, of the 2 cores"):
        check_config(cfg, source)


@pytest.mark.parametrize("launch", [{"address": "tcp://127.0.0.1:1"}, {"scheduler_file": "s.json"},
                                    {"mpi": True}])
def test_a_cluster_of_ones_own_is_not_limited_and_refuses_n_workers_as_before(no_spawn, launch):
    """n_workers is the embedded cluster's: with another it is refused as such, never as too many
    (nothing is dialled, read or launched)."""
    cluster = ("an MPI launch's workers are one per rank from mpiexec" if "mpi" in launch else
               "an existing cluster keeps the workers and settings it was started with")
    assert _refused(n_workers=100000, **launch) == (f"{WHERE}n_workers only for the embedded cluster ({cluster}); "
                                                    "received: n_workers=100000")
    assert no_spawn == []


# -- 2. tg.connect: threads_per_worker ---------------------------------------------------------------
@pytest.mark.parametrize("threads", [0, -1, True, False, 2.0, 10.5, "4", float("nan")])
def test_threads_per_worker_that_is_no_count_is_refused(no_spawn, threads):
    assert _refused(threads_per_worker=threads) == (f"{WHERE}threads_per_worker must be an integer >= 1; received: "
                                                    f"threads_per_worker={threads!r}")
    assert no_spawn == []


@pytest.mark.parametrize("threads", [10 ** 6, 129])
def test_threads_per_worker_past_any_use_is_refused(no_spawn, threads):
    assert _refused(threads_per_worker=threads) == (
        f"{WHERE}threads_per_worker at most 128 (64 per core, of the 2 cores this process may use): threads past the "
        "cores only share them out, and each worker plans work for every thread it declares; received: "
        f"threads_per_worker={threads}")
    assert no_spawn == []


def test_more_threads_than_cores_are_still_declared(no_spawn):
    """Plans are made for 2 workers x 8 threads on 2 cores (test_data_parallel): not refused."""
    assert _started(no_spawn, n_workers=2, threads_per_worker=8) == (2, 8)
    assert _started(no_spawn, threads_per_worker=128) == (1, 128)


# -- 3. tilegraph train: the launch's message wins over the limit -----------------------------------
@pytest.fixture
def no_cluster(monkeypatch, tmp_path, two_cores):
    """Run in ``tmp_path``, and fail where a command would start or reach a cluster."""
    monkeypatch.chdir(tmp_path)

    def refused(*args, **kwargs):
        raise AssertionError(f"tilegraph.connect{args}{kwargs}: the command was to stop before any cluster")

    monkeypatch.setattr(tilegraph, "connect", refused)
    return tmp_path


@pytest.mark.parametrize("argv, launch", [
    (["--set", "runtime.mpi=true"], "mpi = true"),
    (["--set", "runtime.address=tcp://10.0.0.1:8786"], "address = 'tcp://10.0.0.1:8786'"),
    (["--set", "runtime.scheduler_file=s.json"], "scheduler_file = 's.json'"),
])
@pytest.mark.parametrize("more", [[], ["--set", "runtime.parallel=data"]])
def test_workers_with_a_launch_of_the_config_names_the_launch(no_cluster, capsys, argv, launch, more):
    """With runtime.parallel = "data", 100000 workers were first too many for the batch."""
    assert _error([*argv, "--set", "runtime.workers=100000", *more], capsys) == \
        f"tilegraph train: error: {LAUNCH}{launch}, workers = 100000{SOURCE}"
    assert not (no_cluster / "run").exists()


def test_workers_under_mpi_are_not_checked_as_this_machines(two_cores):
    """check_config told of --mpi leaves workers to tilegraph train's launch check."""
    cfg, source = load_config(None)
    cfg["runtime"].update(workers=100000, parallel="data")
    check_config(cfg, source, mpi=True)
    cfg["runtime"].update(workers=1, parallel="auto", exchange="tasks")
    check_config(cfg, source, mpi=True)
    with pytest.raises(tg.TileError, match=r"runtime\.workers must be at most 8 \(4 per core"):
        check_config(cfg | {"runtime": {**cfg["runtime"], "workers": 100000, "exchange": "auto"}}, source)


@pytest.mark.parametrize("more", [[], ["--set", "runtime.parallel=data"]])
def test_workers_with_the_mpi_flag_names_the_launch(no_cluster, capsys, more):
    assert _error(["--mpi", "--set", "runtime.workers=100000", *more], capsys) == \
        f"tilegraph train: error: {LAUNCH}mpi = true, workers = 100000{SOURCE}"
    assert not (no_cluster / "run").exists()


def test_the_embedded_clusters_limit_still_holds_on_the_command_line(no_cluster, capsys):
    assert _error(["--set", "runtime.workers=9"], capsys) == (
        "tilegraph train: error: [tilegraph train] valid settings; received: runtime.workers must be at most 8 "
        f"({TWO_CORES}): the embedded cluster starts that many worker processes on this machine, not 9 (to start "
        "more on purpose: TILEGRAPH_MAX_WORKERS=9 tilegraph train ...; under --mpi, runtime.address or "
        f"runtime.scheduler_file the cluster brings its own workers: leave runtime.workers = 0){SOURCE}")
