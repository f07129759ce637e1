"""Leftovers of a new-user audit:

1. [runtime] exchange and connect_timeout where they cannot apply: refused (exchange with
   parallel = "tiles" or workers = 1), or one warning line (exchange on a cluster found to have
   one worker process; connect_timeout without address or scheduler_file).
2. tilegraph.Runtime(...) checks its mpi / make_current flags as tilegraph.connect does.
3. generate / Decoder check that quantized weights (from_quantized, a base under LoRA) are
   reachable, as they check the parameters.
4. time settings of tilegraph.config that refuse inf (those where it means "never" keep it).
5. tilegraph train --help lists every exit status its code paths return.
"""

from __future__ import annotations

import ast
import inspect
import math
import re
import signal
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

import tilegraph as tg
from tilegraph import models, peft
from tilegraph._errors import TileError
from tilegraph._train import WorkerLostError
from tilegraph.cli import main
from tilegraph.cli.config import check_config, load_config
from tilegraph.models import Decoder, generate

PROMPT = np.array([[1, 2, 3]])


# -- 1. [runtime] exchange and connect_timeout ----------------------------------------------------
@pytest.mark.parametrize("sets, why", [
    (["runtime.parallel=tiles", "runtime.exchange=gang"], r"runtime\.parallel = \"tiles\""),
    (["runtime.workers=1", "runtime.exchange=tasks"], r"runtime\.workers = 1 \(one worker process"),
])
def test_an_exchange_that_can_never_apply_is_refused(tmp_path, monkeypatch, capsys, sets, why):
    monkeypatch.chdir(tmp_path)
    args = [a for s in sets for a in ("--set", s)]
    assert main(["train", "--out", "run", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert "tilegraph train: error: [tilegraph train]" in err, err
    exchange = sets[1].split("=")[1]
    assert re.search(rf"runtime\.exchange must be \"auto\" with {why}.*, not {exchange!r} \(in shipped", err), err
    assert not (tmp_path / "run").exists()  # refused before any work


def test_an_exchange_that_may_apply_is_accepted():
    cfg, source = load_config(None)
    for parallel, workers in (("tiles", 0), ("tiles", 2), ("data", 1)):  # "auto" always; the others where they may
        cfg["runtime"].update(parallel=parallel, workers=workers, exchange="auto")
        check_config(cfg, source)
    cfg["runtime"].update(parallel="auto", workers=2, exchange="gang")
    check_config(cfg, source)


def _one_process(n: int = 1):
    return SimpleNamespace(last_workers=SimpleNamespace(addrs={"cpu": tuple(f"tcp://w{i}" for i in range(n))}))


def test_an_exchange_on_a_cluster_of_one_worker_process_is_one_warning_line():
    from tilegraph.cli.train import exchange_note

    note = exchange_note("gang", _one_process())
    assert note.startswith("tilegraph train: warning: [runtime] exchange = 'gang' has no effect: the cluster has one "
                           "worker process") and "\n" not in note
    assert exchange_note("auto", _one_process()) == ""
    assert exchange_note("tasks", _one_process(2)) == ""
    assert exchange_note("tasks", _one_process(0)) == ""  # workers still joining: nothing known


def test_a_connect_timeout_with_nothing_to_wait_for_is_one_warning_line():
    """connect_timeout is the wait for the cluster at address or scheduler_file; chosen for the
    embedded cluster or an MPI launch, it had no effect without a word. One warning line, not an
    error: one config may serve a cluster run (--set runtime.address=...) and a local one."""
    from tilegraph.cli.train import connect_timeout_note

    r = load_config(None)[0]["runtime"]
    line = "--set runtime.connect_timeout=60"
    note = connect_timeout_note({**r, "connect_timeout": 60}, {"runtime.connect_timeout": line}, False)
    assert note == ("tilegraph train: warning: [runtime] connect_timeout = 60 (--set runtime.connect_timeout=60) has "
                    "no effect with the embedded cluster (no address or scheduler_file: it starts here, nothing to "
                    "wait for): it is the wait for the cluster at address or scheduler_file")
    assert "has no effect with --mpi (an MPI launch waits for its worker ranks itself)" in connect_timeout_note(
        {**r, "connect_timeout": 60}, {"runtime.connect_timeout": line}, True)
    assert "connect_timeout = 30 (in job.toml) has no effect" in connect_timeout_note(
        {**r, "connect_timeout": 30}, {"runtime.connect_timeout": "job.toml"}, False)
    # a copy of the shipped config holds its value: no choice of the user's
    assert connect_timeout_note(r, {"runtime.connect_timeout": "job.toml"}, False) == ""
    assert connect_timeout_note(r, {}, False) == ""
    # with a cluster to wait for, it applies
    for where in ("address", "scheduler_file"):
        assert connect_timeout_note({**r, where: "x", "connect_timeout": 60}, {"runtime.connect_timeout": line},
                                    False) == ""


@pytest.mark.distributed
def test_the_connect_timeout_warning_is_printed_and_the_run_goes_on(tmp_path):
    from test_cli import SMALL, _cli

    (tmp_path / "small.toml").write_text(SMALL)
    run = _cli("train", "small.toml", "--out", "run", "--steps", "1", "--no-progress", "--set", "train.eval_every=0",
               "--set", "runtime.connect_timeout=60", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "tilegraph train: warning: [runtime] connect_timeout = 60 (--set runtime.connect_timeout=60) has no " \
           "effect with the embedded cluster" in run.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-000001").is_dir()


# -- 2. tilegraph.Runtime's flags -----------------------------------------------------------------
@pytest.mark.parametrize("flag", ["mpi", "make_current"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_runtime_checks_its_flags_as_connect_does(flag, value):
    with pytest.raises(TileError) as e:
        tg.Runtime(object(), **{flag: value})  # refused before the client is touched
    assert e.value.where == "tilegraph.Runtime"
    assert e.value.what == f"{flag} must be True or False" and e.value.received == f"{flag}={value!r}"
    with pytest.raises(TileError) as c:  # the same words as connect's
        tg.connect(**{flag: value})
    assert c.value.what == e.value.what


# -- 3. quantized weights in generate's reachability check ----------------------------------------
@pytest.fixture(scope="module")
def quantized_checkpoint(tmp_path_factory):
    return tg.io.save_checkpoint(tmp_path_factory.mktemp("q") / "int8", models.build("gpt2-debug", seed=0),
                                 quantize="int8")


def _one_worker():
    return tg.connect(n_workers=1, threads_per_worker=1, dashboard=False, quiet=True, make_current=False)


@pytest.mark.parametrize("lora", [False, True])
def test_quantized_weights_on_another_runtime_are_named_before_anything_runs(quantized_checkpoint, embedded_runtime,
                                                                             monkeypatch, lora):
    monkeypatch.setattr(tg.runtime, "_CURRENT", [])
    model = peft.from_quantized(quantized_checkpoint, runtime=None)  # every value in this process
    if lora:
        model = peft.apply_lora(model, ["attn.q", "attn.v"], rank=2)
    parts = [c for _, q in peft.named_quantized(model) for c in q.cells]
    assert parts
    rt1 = _one_worker()
    try:
        rt1.scatter_cells(parts)  # the quantized base on rt1's workers (as tilegraph train leaves it)
        with pytest.raises(TileError, match="held by another runtime") as e:
            Decoder(model, runtime=embedded_runtime)  # was: no error, then a failure at the first feed
        assert e.value.where == "tilegraph.models.Decoder"
        with pytest.raises(TileError, match=r"24 tiles held by another runtime") as e:
            generate(model, PROMPT, 3, runtime=embedded_runtime)  # was: WorkerLostError ("lost dependencies")
        assert e.value.where == "tilegraph.models.generate" and not isinstance(e.value, WorkerLostError)
    finally:
        rt1.close()
    with pytest.raises(TileError, match="held by a closed runtime") as e:
        Decoder(model, runtime=embedded_runtime)
    assert e.value.where == "tilegraph.models.Decoder"


# -- 4. time settings and inf ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["target_seconds", "graph_seconds", "hop_seconds", "exchange_timeout_seconds",
                                  "thread_handoff_seconds"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_time_settings_refuse_inf(name, value):
    before = getattr(tg.config, name)
    with pytest.raises(TileError) as e:
        setattr(tg.config, name, value)
    assert e.value.where == f"tilegraph.config.{name}"
    assert e.value.what.startswith("must be a finite number") and e.value.received == repr(value)
    assert getattr(tg.config, name) == before


def test_speeds_refuse_inf():
    with pytest.raises(TileError, match=r"each a finite number > 0") as e:
        tg.config.speeds = {"cpu": (1e11, 1e10, math.inf)}
    assert e.value.where == "tilegraph.config.speeds"


@pytest.mark.parametrize("name", ["min_process_seconds", "kernel_gil_seconds"])
def test_settings_where_inf_means_never_keep_it(name, monkeypatch, local_scheduler):
    monkeypatch.setattr(tg.config, name, math.inf)  # (checked as any assignment)
    assert getattr(tg.config, name) == math.inf
    doc = inspect.getsource(type(tg.config))
    assert "inf: never" in doc and "inf: every kernel holds" in doc  # said in the settings' comments
    model = models.build("gpt2-debug", seed=0)
    assert generate(model, PROMPT, 2).shape == (1, 5)  # plans and runs


# -- 5. tilegraph train --help: exit statuses ----------------------------------------------------
def _returned_statuses() -> set[int]:
    """Every exit status the code of tilegraph train returns: the return statements of main,
    _run, cmd_train and _train, evaluated in their modules (a status 128 + a signal for each
    signal _train's handler is installed for), Python's 1 for an uncaught exception, and
    argparse's status for a usage error."""
    import tilegraph.cli as cli
    import tilegraph.cli.train as train

    codes: set[int] = {1}  # an uncaught exception: Python's exit status

    def values(expr, module, fn_source) -> set[int]:
        if isinstance(expr, ast.Constant) and isinstance(expr.value, int):
            return {expr.value}
        if isinstance(expr, ast.Name):
            value = getattr(module, expr.id)
            assert isinstance(value, int), ast.unparse(expr)
            return {value}
        if isinstance(expr, ast.IfExp):
            return values(expr.body, module, fn_source) | values(expr.orelse, module, fn_source)
        if isinstance(expr, ast.BinOp) and ast.unparse(expr) == "128 + int(signals[0])":
            handled = {n.attr for n in ast.walk(ast.parse(fn_source)) if isinstance(n, ast.Attribute)
                       and isinstance(n.value, ast.Name) and n.value.id == "signal" and n.attr.startswith("SIG")
                       and not n.attr.startswith("SIG_")}
            assert handled >= {"SIGINT", "SIGTERM"}, handled
            return {128 + int(getattr(signal, s)) for s in handled}
        if isinstance(expr, ast.Call):  # another of these functions (args.func: cmd_train)
            return set()
        raise AssertionError(f"an exit status this test cannot tell: {ast.unparse(expr)}")

    for module, names in ((cli, ("main", "_run")), (train, ("cmd_train", "_train"))):
        for name in names:
            source = textwrap.dedent(inspect.getsource(getattr(module, name)))
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Return) and node.value is not None:
                    codes |= values(node.value, module, source)
    with pytest.raises(SystemExit) as e:  # a usage error: argparse's own exit
        main(["train", "--no-such-flag"])
    codes.add(e.value.code)
    return codes


def test_train_help_lists_every_exit_status_the_code_returns(capsys):
    codes = _returned_statuses()
    assert {0, 1, 2, 130, 141, 143} <= codes, codes
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    assert "exit status:" in help_text
    listed = {int(line.split()[0]) for line in help_text.split("exit status:")[1].splitlines()
              if line[:6].strip().isdigit()}
    assert listed == codes, (listed, codes)  # every one returned is listed, and none that is not
