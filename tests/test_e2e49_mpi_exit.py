"""An MPI launch ends when its script does, also where no thread may start at exit (CPython 3.12.0
and 3.12.1 refuse one in atexit handlers, gh-113964): dask-mpi's exit handler opened a client
whose event loop needs a new thread, failed there, and the worker ranks never heard, so mpiexec
waited for them for good after the training had ended (on 3.12.1, every MPI test timed out). The
client rank now starts that loop's thread when it connects. Simulated here on any Python: the
script forbids new threads as it exits, before the launch's own exit handler runs."""

import os
import subprocess
import sys

import pytest

from test_mpi import _mpiexec

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = """
import atexit, threading
import tilegraph as tg


def no_new_threads():  # as CPython 3.12.0 and 3.12.1 are at exit
    def start(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    threading.Thread.start = start


if __name__ == "__main__":
    rt = tg.connect(mpi=True, interface="lo", quiet=True)
    print("workers", len(rt.workers()), flush=True)
    if {close}:
        rt.close()
    atexit.register(no_new_threads)  # (registered last: it runs first)
"""


@pytest.mark.parametrize("close", [True, False], ids=["closed", "left-open"])
def test_an_mpi_launch_ends_where_no_thread_may_start_at_exit(tmp_path, close):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(close=close))
    proc = subprocess.run([_mpiexec(), "-n", "4", sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=150, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "workers 2" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
