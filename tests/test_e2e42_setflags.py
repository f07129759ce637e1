"""`tilegraph train --set KEY=VALUE` as a new user types it (session 42): each mistake below ended
in a message that did not name --set or its form, or went through without a word.

- `--set runtime.workers = 2` (spaces around '=') ended in argparse's "unrecognized arguments: 2"
  (the '=' taken for the config file); `--set runtime.workers =2` in "an existing TOML config file;
  received: =2"; after a config file, `--set train.lr= 1e-3` in "unrecognized arguments: 1e-3":
  each names --set, the form KEY=VALUE and what it received, with the pair it meant;
- `--set =2` listed every known key as if one were misspelt: it says the key is missing;
  `--set runtime.workers=` said "valid settings; ... not ''": it names --set and the empty value;
- `--set train.steps=10 --set train.steps=20` ran 20 steps without a word: refused, naming both;
- `--set runtime.workers=100000` on 2 cores began spawning processes: refused above 4 per usable
  core (TILEGRAPH_MAX_WORKERS sets another limit); a cluster of the user's is not limited.

No cluster starts: every case fails before any work (tilegraph.connect is replaced by one that
fails the test where a run would reach it)."""

import pytest

import tilegraph
from tilegraph import _config
from tilegraph._errors import TileError
from tilegraph.cli import main
from tilegraph.cli.config import apply_overrides, check_config, load_config

MAX_WORKERS = "TILEGRAPH_MAX_WORKERS"  # (the name users type, not tilegraph._config's constant)
FORM = ("[tilegraph train --set] SECTION.KEY=VALUE as one word: no spaces around '=' (or the pair in quotes: "
        "--set 'SECTION.KEY=VALUE'); received: ")


@pytest.fixture
def no_cluster(monkeypatch, tmp_path):
    """Run in ``tmp_path``, and fail where a command would start a cluster (a wrong refusal must
    not spawn the workers it was to refuse)."""
    monkeypatch.chdir(tmp_path)

    def refused(*args, **kwargs):
        raise AssertionError(f"tilegraph.connect{args}{kwargs}: the command was to stop before any cluster")

    monkeypatch.setattr(tilegraph, "connect", refused)
    return tmp_path


def _error(argv, capsys) -> str:
    """The one error line of ``tilegraph train ARGV`` (which must exit with status 2)."""
    assert main(["train", *argv, "--out", "run", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


@pytest.mark.parametrize("argv, received", [
    (["--set", "runtime.workers", "=", "2"], "--set runtime.workers = 2 (did you mean --set runtime.workers=2?)"),
    (["--set", "runtime.workers", "=2"], "--set runtime.workers =2 (did you mean --set runtime.workers=2?)"),
    (["--set=runtime.workers", "=", "2"], "--set=runtime.workers = 2 (did you mean --set runtime.workers=2?)"),
    (["--set", "runtime.workers", "="], "--set runtime.workers = (did you mean --set runtime.workers=VALUE?)"),
    (["--steps", "2", "--set", "data.sources", "=", '["a b.txt"]'],
     "--set data.sources = '[\"a b.txt\"]' (did you mean --set 'data.sources=[\"a b.txt\"]'?)"),
    # after a config file, a value after a space is no config file: argparse had no place for it
    (["my.toml", "--set", "train.lr=", "1e-3"], "--set train.lr= 1e-3 (did you mean --set train.lr=1e-3?)"),
    (["my.toml", "--set", "train.lr", "1e-3"], "--set train.lr 1e-3 (did you mean --set train.lr=1e-3?)"),
])
def test_a_set_pair_split_at_spaces_names_the_form(no_cluster, capsys, argv, received):
    (no_cluster / "my.toml").write_text("[train]\nsteps = 2\n")
    assert _error(argv, capsys) == f"tilegraph train: error: {FORM}{received}"
    assert not (no_cluster / "run").exists()


def test_a_quoted_pair_with_spaces_is_one_pair():
    cfg, _ = load_config(None)
    apply_overrides(cfg, ["runtime.workers = 2", "train.lr= 1e-3"])
    assert cfg["runtime"]["workers"] == 2 and cfg["train"]["lr"] == 1e-3


def test_other_unrecognized_arguments_are_argparses_as_before(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["info", "a", "b"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.rstrip().endswith("tilegraph: error: unrecognized arguments: b")
    with pytest.raises(SystemExit):
        main(["train", "--steps", "2", "--bogus"])
    assert capsys.readouterr().err.rstrip().endswith("tilegraph: error: unrecognized arguments: --bogus")


@pytest.mark.parametrize("pair, message", [
    ("=2", "section.key=value: the key before '=' (e.g. runtime.workers=2); received: '=2' (no key)"),
    ("=", "section.key=value: the key before '=' (e.g. runtime.workers=2); received: '=' (no key)"),
    ("runtime.workers=", "section.key=value with a value after '=': runtime.workers must be an integer >= 0 (no "
                         "spaces around '=', or the pair quoted: --set 'runtime.workers=VALUE'); received: "
                         "'runtime.workers=' (an empty value)"),
    ("model.dim= ", "section.key=value with a value after '=' (no spaces around '=', or the pair quoted: --set "
                    "'model.dim=VALUE'); received: 'model.dim= ' (an empty value)"),
    ("runtime.workers", "section.key=value: an '=' and the value after the key (runtime.workers=VALUE); received: "
                        "'runtime.workers' (no '=')"),
])
def test_a_set_pair_without_a_key_or_a_value(pair, message):
    cfg, _ = load_config(None)
    with pytest.raises(TileError) as e:
        apply_overrides(cfg, [pair])
    assert str(e.value) == f"[tilegraph train --set] {message}"


def test_an_empty_value_of_a_key_that_takes_one_is_still_taken():
    cfg, _ = load_config(None)
    apply_overrides(cfg, ["runtime.address=", "model.init="])  # "": no cluster address, no pretrained weights
    assert cfg["runtime"]["address"] == "" and cfg["model"]["init"] == ""


def test_an_empty_value_from_the_command_line(no_cluster, capsys):
    assert _error(["--set", "runtime.workers="], capsys).endswith("received: 'runtime.workers=' (an empty value)")


def test_a_key_set_twice_with_two_values_is_refused(no_cluster, capsys):
    """The later one won without a word: --set train.steps=10 ... --set train.steps=20 ran 20."""
    err = _error(["--set", "train.steps=10", "--set", "train.lr=1e-3", "--set", "train.steps=20"], capsys)
    assert err == ("tilegraph train: error: [tilegraph train --set] one value per key: each key given once (a later "
                   "--set does not override an earlier one: keep the one you mean); received: --set train.steps=10 "
                   "and --set train.steps=20")
    assert not (no_cluster / "run").exists()


def test_each_key_given_twice_is_named():
    cfg, _ = load_config(None)
    with pytest.raises(TileError) as e:
        apply_overrides(cfg, ["train.steps=10", "model.flavor=gpt2-debug", "train.steps=20", "train.steps=30",
                              "model.flavor=llama-debug"])
    assert str(e.value).endswith("received: --set train.steps=10 and --set train.steps=20; --set train.steps=10 "
                                 "and --set train.steps=30; --set model.flavor=gpt2-debug and --set "
                                 "model.flavor=llama-debug")
    assert cfg["train"]["steps"] != 10  # refused before any was applied


def test_a_key_set_twice_to_one_value_passes():
    cfg, _ = load_config(None)
    apply_overrides(cfg, ["train.lr=1e-3", "train.lr=0.001", "train.steps=5", "train.steps = 5"])
    assert cfg["train"]["lr"] == 1e-3 and cfg["train"]["steps"] == 5
    with pytest.raises(TileError, match="--set train.steps=5 and --set train.steps=5.0"):
        apply_overrides(cfg, ["train.steps=5", "train.steps=5.0"])  # an integer and a float: not one value


@pytest.fixture
def two_cores(monkeypatch):
    """A machine whose process may use 2 of its 64 cores (a batch job's share), no limit set."""
    monkeypatch.setattr(_config, "usable_cores", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    monkeypatch.delenv(MAX_WORKERS, raising=False)


def _check_workers(workers: int, **runtime) -> str | None:
    cfg, source = load_config(None)
    cfg["runtime"].update(workers=workers, **runtime)
    try:
        check_config(cfg, source)
    except TileError as e:
        return str(e)
    return None


def test_more_workers_than_the_machine_runs_are_refused(two_cores):
    err = _check_workers(100000)
    assert err == ("[tilegraph train] valid settings; received: runtime.workers must be at most 8 (4 per core, of the "
                   "2 cores of the machine's 64 this process may use): the embedded cluster starts that many worker "
                   "processes on this machine, not 100000 (to start more on purpose: TILEGRAPH_MAX_WORKERS=100000 "
                   "tilegraph train ...; under --mpi, runtime.address or runtime.scheduler_file the cluster brings "
                   "its own workers: leave runtime.workers = 0) (in shipped default.toml (examples/configs/))"), err
    assert _check_workers(9) is not None
    assert _check_workers(8) is None and _check_workers(0) is None


def test_the_worker_limit_is_refused_from_the_command_line(no_cluster, capsys, two_cores):
    err = _error(["--set", "runtime.workers=100000"], capsys)
    assert "runtime.workers must be at most 8 (4 per core" in err and "not 100000" in err, err
    assert not (no_cluster / "run").exists()


def test_the_worker_limit_is_the_variables_where_set(two_cores, monkeypatch):
    monkeypatch.setenv(MAX_WORKERS, "100")
    assert _check_workers(100) is None
    assert "runtime.workers must be at most 100 (TILEGRAPH_MAX_WORKERS=100): " in _check_workers(101)
    for bad in ("0", "many", "-3", "2.5"):
        monkeypatch.setenv(MAX_WORKERS, bad)
        assert _check_workers(9) == ("[tilegraph train] TILEGRAPH_MAX_WORKERS: an integer >= 1 (the most worker "
                                     f"processes an embedded cluster may start); received: {bad!r}")
    assert _check_workers(0) is None  # the default count is not checked, nor the variable read


def test_a_cluster_of_ones_own_has_no_worker_limit(two_cores):
    """runtime.workers is the embedded cluster's alone: with another cluster it is refused apart
    (by tilegraph train, naming the launch), never as too many for this machine."""
    for runtime in ({"address": "tcp://10.0.0.1:8786"}, {"scheduler_file": "s.json"}, {"mpi": True}):
        assert _check_workers(100000, **runtime) is None
