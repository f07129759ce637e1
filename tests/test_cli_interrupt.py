"""Ctrl-C in any command ends in one line and exit status 130 (a shell's 128 + SIGINT), never a
traceback: while a command runs, and while the embedded cluster starts (a terminal's Ctrl-C
reaches the worker processes too, and Dask then fails with "Nanny failed to start")."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tilegraph as tg
import tilegraph.cli as cli
from test_cli import end_group


@pytest.mark.parametrize("command", ["generate", "eval", "info", "convert"])
def test_ctrl_c_in_a_command_is_one_line(monkeypatch, capsys, command):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, f"cmd_{command}", interrupted)
    argv = {"generate": ["generate", "ck"], "eval": ["eval", "ck"], "info": ["info"], "convert": ["convert", "a", "b"]}
    assert cli.main(argv[command]) == 130
    assert capsys.readouterr().err == f"tilegraph {command}: interrupted\n"


def test_a_cluster_start_broken_by_ctrl_c_is_the_interrupt(monkeypatch):
    import distributed

    def broken_start(*args, **kwargs):  # what the worker processes' own SIGINT does to the start
        os.kill(os.getpid(), signal.SIGINT)
        raise RuntimeError("Nanny failed to start.")

    monkeypatch.setattr(distributed, "SpecCluster", broken_start)
    with pytest.raises(KeyboardInterrupt):
        tg.connect(n_workers=1, dashboard=False, quiet=True)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    def failed_start(*args, **kwargs):  # no Ctrl-C: the failure itself
        raise RuntimeError("Nanny failed to start.")

    monkeypatch.setattr(distributed, "SpecCluster", failed_start)
    with pytest.raises(RuntimeError, match="Nanny failed to start"):
        tg.connect(n_workers=1, dashboard=False, quiet=True)


@pytest.mark.slow
def test_ctrl_c_while_train_starts_its_cluster(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "tilegraph.cli", "train", "--steps", "100000", "--out", "run",
                             "--no-progress"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        # the corpus read (its token file's sidecar written): the embedded cluster starts next. (A
        # fixed 3 s wait sent the Ctrl-C, on a loaded machine, while `python -m tilegraph.cli` still
        # imported tilegraph, before any guard: Python's traceback and exit status -2.)
        sidecar, deadline = tmp_path / "run" / "tokens.bin.json", time.time() + 240
        while not sidecar.is_file():
            assert time.time() < deadline and proc.poll() is None, "no corpus read"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: to the whole process group
        out, err = proc.communicate(timeout=120)
    finally:
        end_group(proc)  # (a SIGKILL to the group left multiprocessing's semaphores in /dev/shm)
    # (a worker process that the Ctrl-C reaches while it starts prints its own KeyboardInterrupt:
    # the command's process prints none, nor the "Nanny failed to start" that followed)
    assert proc.returncode == 130 and "tilegraph/cli" not in err and "RuntimeError" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("tilegraph train: stopped at once"), err[-3000:]


def test_ctrl_c_while_the_command_imports_tilegraph_is_one_line(monkeypatch, capsys):
    """Before: a Ctrl-C in the first second or so of any command, while Python imported
    tilegraph (NumPy, Dask, Numba), printed Python's KeyboardInterrupt traceback. The console
    script's entry point imports the command line itself and catches it."""
    import importlib.abc

    import _tilegraph_cli

    class Interrupted(importlib.abc.MetaPathFinder):  # the Ctrl-C, arriving during the import
        def find_spec(self, name, path, target=None):
            if name == "tilegraph.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "tilegraph.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    for argv, line in ((["tilegraph", "train", "--steps", "3"], "tilegraph train: interrupted"),
                       (["tilegraph", "--help"], "tilegraph: interrupted")):
        monkeypatch.setattr(sys, "argv", argv)
        assert _tilegraph_cli.main() == 130
        assert capsys.readouterr().err == line + "\n"


def test_ctrl_c_that_an_extension_s_import_turns_into_another_error_is_one_line(monkeypatch, capsys):
    """A SIGINT inside NumPy's C import reached Python as an ImportError ("PyCapsule_Import could
    not import module datetime"), a traceback the guard did not catch (CI, rarely). The entry point
    notes the signal itself, so whatever error it became ends in the same one line. An error of
    the import without a Ctrl-C still propagates."""
    import importlib.abc

    import _tilegraph_cli

    class Converted(importlib.abc.MetaPathFinder):  # the signal arrives; C code reports an ImportError
        def __init__(self, signal_first):
            self.signal_first = signal_first

        def find_spec(self, name, path, target=None):
            if name != "tilegraph.cli":
                return None
            if self.signal_first:
                try:
                    signal.raise_signal(signal.SIGINT)
                except KeyboardInterrupt:
                    pass
            raise ImportError("PyCapsule_Import could not import module \"datetime\"")

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.delitem(sys.modules, "tilegraph.cli")
    monkeypatch.setattr(sys, "argv", ["tilegraph", "train"])
    monkeypatch.setattr(sys, "meta_path", [Converted(True), *sys.meta_path])
    assert _tilegraph_cli.main() == 130
    assert capsys.readouterr().err == "tilegraph train: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # (the entry point's handler is gone again)
    monkeypatch.setattr(sys, "meta_path", [Converted(False), *sys.meta_path[1:]])
    with pytest.raises(ImportError, match="PyCapsule_Import"):
        _tilegraph_cli.main()


@pytest.mark.slow
def test_the_console_script_is_the_guarded_entry_point(tmp_path):
    """The installed ``tilegraph`` command goes through _tilegraph_cli (a real SIGINT during its
    imports: one line, 130), and runs commands as before."""
    exe = os.path.join(os.path.dirname(sys.executable), "tilegraph")  # (pip's script, beside the interpreter)
    script = open(exe, encoding="utf-8").read()
    assert "_tilegraph_cli" in script, script  # (pip writes the entry point's module into the script)
    proc = subprocess.Popen([exe, "info", "nothing-here"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    # Python is up and importing NumPy, Dask, ... (over a second): NumPy's libraries are mapped.
    # (A fixed 0.3 s wait sent the SIGINT, on a loaded machine, while Python's own start-up still
    # ran site-packages' .pth files: "Fatal Python error: init_import_site", before any guard.)
    maps, deadline = Path(f"/proc/{proc.pid}/maps"), time.time() + 60
    if not maps.is_file():
        proc.kill()
        proc.wait()
        pytest.skip("no /proc/PID/maps here to see the command's imports")
    while proc.poll() is None and "/numpy/" not in maps.read_text():
        assert time.time() < deadline, "NumPy not imported after 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    if proc.returncode == 130:  # (the SIGINT came during the imports, or in the command itself)
        assert err == "tilegraph info: interrupted\n", err
    else:
        assert "Traceback" not in err, err


def test_the_stop_line_goes_straight_to_stderr_s_descriptor(capfd):
    """The Ctrl-C / SIGTERM handler of ``tilegraph train`` says it is stopping through stderr's
    file descriptor, in one write: a signal handler runs between two steps of the main thread,
    which may be inside a write to ``sys.stderr``, and a second write through it there raises
    "reentrant call". Nothing goes through ``sys.stderr``'s buffer (replaced here by one that
    fails on any write)."""
    from tilegraph.cli.train import say_now

    class Busy:
        def __init__(self, fd):
            self.fd, self.encoding = fd, "utf-8"

        def fileno(self):
            return self.fd

        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

        flush = write

    real = sys.stderr
    sys.stderr = Busy(real.fileno())
    try:
        say_now("tilegraph train: SIGINT: stopping \u2026\n")
    finally:
        sys.stderr = real
    assert capfd.readouterr().err == "tilegraph train: SIGINT: stopping \u2026\n"


def test_the_stop_line_goes_through_sys_stderr_where_it_has_no_descriptor(capsys):
    """In-process, with ``sys.stderr`` replaced by an object without a file descriptor (a
    notebook's, pytest's), the line still arrives, through it."""
    from tilegraph.cli.train import say_now

    say_now("stopping\n")
    assert capsys.readouterr().err == "stopping\n"
