"""Trainer: folders it cannot write, a callable data's batch size, and steps past the LR schedule.

Found by a user audit: a read-only ``checkpoint_dir`` was accepted and failed after training up to
the first checkpoint (a read-only ``log_dir`` as a bare OSError); ``batch_size`` was ignored for a
callable data yet saved in the checkpoints' trainer state; training went on at lr 0 past a
``warmup_cosine`` schedule's total without a word.
"""

import os
import tempfile
import warnings

import numpy as np
import pytest

import tilegraph as tg
from tilegraph.io.zarr import CheckpointError, CheckpointManager
from conftest import mse

W = np.random.default_rng(100).standard_normal((8, 2)).astype(np.float32) / 3


def _data(rows=16):
    def batch(step):
        x = np.random.default_rng([0, step]).standard_normal((rows, 8)).astype(np.float32)
        return x, np.tanh(x @ W)
    return batch


def _trainer(data=None, lr=1e-2, **kw):
    model = tg.nn.MLP(8, 16, out_dim=2, tile=8, seed=0)
    opt = tg.optim.AdamW(model.parameters(), lr=lr)
    return tg.Trainer(model, opt, _data() if data is None else data, loss_fn=mse, **{"progress": False, **kw})


def _cannot_write(folder) -> bool:
    try:
        fd, probe = tempfile.mkstemp(dir=folder)
    except OSError:
        return True
    os.close(fd)
    os.unlink(probe)
    return False


@pytest.fixture
def unwritable(tmp_path):
    """An existing folder this process cannot create files in. chmod does not stop root (its
    writes pass any permission): as root, /sys (sysfs refuses new files even to root), else a
    folder of mode 0o555."""
    if os.geteuid() == 0:
        folder = "/sys"
        if not os.path.isdir(folder) or not _cannot_write(folder):
            pytest.skip("no folder root cannot write in (/sys is writable here)")
        yield folder
        return
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if not _cannot_write(folder):
            pytest.skip("a folder of mode 0o555 is writable here")
        yield str(folder)
    finally:
        folder.chmod(0o755)


def _too_long(tmp_path):
    """A folder no one can make, root included: a name past the file system's NAME_MAX (255)."""
    return str(tmp_path / ("n" * 300) / "ck")


# -- 1. folders it cannot write ----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["checkpoint_dir", "log_dir"])
def test_a_folder_it_cannot_write_is_refused_at_construction(tmp_path, unwritable, name):
    """A read-only checkpoint_dir was accepted: fit(5) trained steps 1-3, then raised at the
    checkpoint of step 3; a read-only log_dir failed at fit with a bare OSError (errno 30). Both
    are now a TileError of the Trainer naming the argument, the folder and the OS's reason."""
    extra = {"checkpoint_every": 3} if name == "checkpoint_dir" else {}
    for folder in (unwritable, os.path.join(unwritable, "ck")):  # an existing folder, one to make in it
        with pytest.raises(tg.TileError, match=rf"\[tilegraph.Trainer\] {name} must be a folder this process can "
                           rf"create and write in \(checked here, not (at the first checkpoint after training up to "
                           rf"it|as an OSError when fit opens metrics.jsonl)\); received: {name}='{folder}': "
                           r"(creating|writing a file in) .*failed: \w"):
            _trainer(**{name: folder}, **extra)
    with pytest.raises(tg.TileError, match=rf"{name}='{_too_long(tmp_path)}': creating .* failed: File name too long "
                       r"\(ENAMETOOLONG\)"):
        _trainer(**{name: _too_long(tmp_path)}, **extra)
    assert list(tmp_path.iterdir()) == ([tmp_path / "ro"] if os.geteuid() != 0 else [])


def test_a_folder_it_cannot_make_fails_before_any_step_not_after(tmp_path):
    """The audit's case, without root tricks: before, fit trained steps 1-3 and failed at the
    checkpoint of step 3 (a log_dir: an OSError at the start of fit). Now nothing is built."""
    folder = _too_long(tmp_path)
    for kw in ({"checkpoint_dir": folder, "checkpoint_every": 3}, {"log_dir": folder}):
        with pytest.raises(tg.TileError, match="must be a folder this process can create and write in"):
            _trainer(**kw).fit(5)
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_manager_refuses_a_folder_it_cannot_write(tmp_path, unwritable):
    for folder in (unwritable, os.path.join(unwritable, "ck"), _too_long(tmp_path)):
        with pytest.raises(CheckpointError, match=r"\[tilegraph.io.CheckpointManager\] dir must be a folder this "
                           r"process can create and write in; received: .+: (creating|writing a file in) .* failed: \w"):
            CheckpointManager(folder)


def test_the_write_check_leaves_nothing_behind(tmp_path):
    """The check makes a missing folder (as training would) and creates and removes an empty file
    of a unique name: existing files are untouched, no file is left, and the folders it made are
    removed again when the check fails."""
    logs, ck = tmp_path / "logs", tmp_path / "a" / "b" / "ck"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"step": 1}\n')
    mtime = (logs / "metrics.jsonl").stat().st_mtime_ns
    trainer = _trainer(log_dir=logs, checkpoint_dir=ck)
    assert sorted(p.name for p in logs.iterdir()) == ["metrics.jsonl"]
    assert (logs / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert (logs / "metrics.jsonl").stat().st_mtime_ns == mtime
    assert ck.is_dir() and list(ck.iterdir()) == []
    mgr = CheckpointManager(tmp_path / "m" / "ck")
    assert mgr.dir.is_dir() and list(mgr.dir.iterdir()) == []
    # a failed check removes the folders it made, and only those
    with pytest.raises(tg.TileError, match="checkpoint_dir must be a folder"):
        _trainer(checkpoint_dir=tmp_path / "a" / "new" / "deeper" / ("n" * 300))
    with pytest.raises(CheckpointError, match="dir must be a folder"):
        CheckpointManager(tmp_path / "x" / ("n" * 300))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "logs", "m"]
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b"]
    # and training writes where it was checked
    res = trainer.fit(2)
    assert res.checkpoints == [str(ck / "step-000002")]
    assert len((logs / "metrics.jsonl").read_text().splitlines()) == 3


# -- 2. a callable data's batch size --------------------------------------------------------------
def test_an_explicit_batch_size_must_match_the_callable_datas_rows():
    """batch_size=64 with data(step) returning 4 rows trained on the 4 rows without a word (and
    saved batch_size 64 in the checkpoints' trainer state)."""
    trainer = _trainer(data=_data(4), batch_size=64)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer.fit\] batch_size must be the rows of each batch "
                       r"data\(step\) returns .*; received: batch_size=64, data\(1\) gave 4 rows \(shape \(4, 8\)\)"):
        trainer.fit(1)
    assert trainer.optimizer.step_count == 0  # refused before any step
    assert trainer.batch_size == 64
    ok = _trainer(data=_data(4), batch_size=np.int64(4))
    assert len(ok.fit(2).losses) == 2 and ok.batch_size == 4


def test_the_batch_size_of_a_callable_data_is_taken_from_its_batches(tmp_path):
    trainer = _trainer(data=_data(4), checkpoint_dir=tmp_path / "ck")
    assert trainer.batch_size is None  # not known before the first batch is read
    res = trainer.fit(2)
    assert trainer.batch_size == 4 and type(trainer.batch_size) is int
    assert tg.io.load_checkpoint(res.checkpoints[-1]).trainer_state["batch_size"] == 4
    trainer.batch_size = 4  # the same value again is fine; another is refused
    with pytest.raises(tg.TileError, match="batch_size is fixed when the Trainer is built"):
        trainer.batch_size = 8
    # a smaller batch later (the end of an epoch) is trained as before: only the first is checked
    rows = {1: 6, 2: 6, 3: 3}
    short = _trainer(data=lambda s: _data(rows[s])(s), batch_size=6)
    assert len(short.fit(3).losses) == 3 and short.batch_size == 6


def test_accum_steps_without_batch_size_takes_the_datas_rows():
    """The default batch_size 8 was checked against accum_steps even for a callable data, where it
    was never used: accum_steps=3 without a batch_size was refused ("batch_size must be a positive
    multiple of accum_steps; received: batch_size=8")."""
    trainer = _trainer(data=_data(6), accum_steps=3)
    assert len(trainer.fit(1).losses) == 1 and trainer.batch_size == 6
    # one given is checked against the batches (rows not divisible by accum_steps run unevenly)
    with pytest.raises(tg.TileError, match=r"batch_size must be the rows of each batch data\(step\) returns.*"
                       r"received: batch_size=8, data\(1\) gave 6 rows"):
        _trainer(data=_data(6), accum_steps=3, batch_size=8).fit(1)


# -- 3. steps past the schedule's total -----------------------------------------------------------------
def test_fit_past_the_schedules_total_warns_once():
    """lr=warmup_cosine(1e-2, 1, 3) and fit(5) trained steps 4-5 at lr 0 without a word."""
    trainer = _trainer(lr=tg.optim.warmup_cosine(1e-2, 1, 3), batch_size=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(5)
    past = [w for w in caught if "schedule" in str(w.message)]
    assert len(past) == 1 and past[0].category is UserWarning
    assert str(past[0].message) == (
        "tilegraph.Trainer.fit: steps 1-5 asked for go past the total of the learning-rate schedule "
        "(warmup_cosine, total=3): steps 4-5 run at its floor, lr 0 (min_lr). Give the schedule a total of at "
        "least 5 (trainer.optimizer.schedule = ...) to train them at a higher rate")
    assert past[0].filename == __file__  # points at the caller's fit()
    assert [r["lr"] for r in trainer.history] == [0.01, 0.005, 0.0, 0.0, 0.0]
    with pytest.warns(UserWarning, match=r"step 6 asked for go past .*total=3\): step 6 runs at its floor"):
        trainer.fit(1)


def test_no_warning_within_the_schedules_total():
    trainer = _trainer(lr=tg.optim.warmup_cosine(1e-2, 1, 5, min_lr=1e-3), batch_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(3)
        trainer.fit(2)  # up to the total exactly
    with pytest.warns(UserWarning, match=r"total=5\): step 6 runs at its floor, lr 0.001 \(min_lr\)"):
        trainer.fit(1)
    constant = _trainer(lr=1e-2, batch_size=16)  # no total: never warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        constant.fit(3)


# -- 4. ~ in log_dir and tensorboard; a tensorboard folder it cannot write ----------------------------
def test_a_leading_tilde_is_the_home_folder_in_every_folder_argument(tmp_path, monkeypatch):
    """log_dir="~/x" wrote into a folder named "~" in the working directory (checkpoint_dir
    expanded it already)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    trainer = _trainer(log_dir="~/logs")
    assert trainer.log_dir == tmp_path / "home" / "logs"
    trainer.fit(1)
    assert (tmp_path / "home" / "logs" / "metrics.jsonl").is_file() and not (tmp_path / "~").exists()


def test_a_tensorboard_folder_it_cannot_write_is_refused_at_construction(tmp_path, monkeypatch):
    import tilegraph.plotting

    # a SummaryWriter class stands in where TensorBoard is not installed: the check comes before any writer
    monkeypatch.setattr(tilegraph.plotting, "summary_writer_class", lambda where: object)
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] tensorboard must be a folder this process can "
                                           r"create and write in"):
        _trainer(tensorboard=_too_long(tmp_path))


def test_save_adapters_errors_are_named_as_save_adapters(tmp_path):
    model = tg.peft.apply_lora(tg.nn.Sequential(tg.nn.Linear(4, 4, seed=0)), ["0"], rank=2)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(tg.TileError, match=r"^\[tilegraph.peft.save_adapters\]"):
        tg.peft.save_adapters(model, tmp_path / "afile" / "ad")


@pytest.mark.distributed
def test_a_performance_report_path_it_cannot_write_is_refused_at_construction(tmp_path, unwritable,
                                                                              embedded_runtime, monkeypatch):
    """The report's path was only used after the reported step: a folder there, or one that
    cannot be written, failed after training up to it (and a leading ~ was a folder named ~)."""
    rt = embedded_runtime
    with pytest.raises(tg.TileError, match=r"\[tilegraph.Trainer\] performance_report's folder must be a folder this "
                       r"process can create and write in \(checked here, not after training up to the reported "
                       rf"step\); received: performance_report's folder='{unwritable}': writing a file in it failed"):
        _trainer(runtime=rt, performance_report=os.path.join(unwritable, "report.html"))
    with pytest.raises(tg.TileError, match=r"performance_report must be the path of an HTML file to write, not a "
                       rf"folder; received: performance_report='{tmp_path}', a folder"):
        _trainer(runtime=rt, performance_report=tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    trainer = _trainer(runtime=rt, performance_report="~/reports/step.html")
    assert trainer.performance_report == tmp_path / "reports" / "step.html" and (tmp_path / "reports").is_dir()
