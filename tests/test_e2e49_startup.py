"""The end of a `tilegraph` command and of an embedded cluster's worker processes: each process
has its garbage collected, then freezes what is left at exit (the interpreter's own collections
as it tore its modules down walked every live object: 0.7 s at the end of `tilegraph train`, and
0.2-0.3 s of each worker's end, which the cluster's close waits for). Structure only, no timings."""

import subprocess
import sys

#: a process that leaves a finalizable cycle as garbage, asks for the exit collection (``{ask}``),
#: and says at its very end (an atexit handler registered before, so run after) whether its heap
#: was frozen
_PROBE = """
import atexit, gc
atexit.register(lambda: print("frozen at the end:", gc.get_freeze_count() > 0, flush=True))
class C:
    def __del__(self): print("finalized", flush=True)
c = C(); c.me = c; del c
gc.disable()
{ask}
print("asked", flush=True)
"""


def _run(ask: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(ask=ask)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not out.stderr, out.stderr
    return out.stdout.splitlines()


def test_the_command_collects_then_freezes_at_exit():
    # the cycle's finalizer runs at exit (collected first), then the heap is frozen
    lines = _run("import sys, _tilegraph_cli, tilegraph.cli; tilegraph.cli.main = lambda: 0; "
                 "_tilegraph_cli.main(); _tilegraph_cli.main()")
    assert lines == ["asked", "finalized", "frozen at the end: True"]


def test_without_it_nothing_is_frozen():
    # (the interpreter's own collection finalizes the cycle, after every atexit handler)
    assert _run("pass") == ["asked", "frozen at the end: False", "finalized"]


def test_cli_entry_point_registers_the_exit_collection_once(monkeypatch):
    import _tilegraph_cli
    import tilegraph.cli
    from tilegraph.runtime import worker_setup

    calls = []
    monkeypatch.setattr(tilegraph.cli, "main", lambda: 0)
    monkeypatch.setattr(worker_setup, "_QUICK_EXIT", [])
    monkeypatch.setattr("atexit.register", calls.append)
    assert _tilegraph_cli.main() == 0
    assert _tilegraph_cli.main() == 0  # (tests run it many times in one process)
    assert calls == [worker_setup._exit_collection]


def test_python_m_tilegraph_cli_collects_then_freezes_at_exit():
    lines = _run("import runpy, sys, tilegraph.cli; tilegraph.cli.main = lambda: 0\n"
                 "try:\n    runpy.run_module('tilegraph.cli', run_name='__main__')\nexcept SystemExit:\n    pass")
    assert lines == ["asked", "finalized", "frozen at the end: True"]


def test_cli_exits_with_its_output_and_status():
    # a real command's end with the frozen heap: its output, its status, nothing left on stderr
    out = subprocess.run([sys.executable, "-c", "import sys, _tilegraph_cli; sys.argv = ['tilegraph', 'info']; "
                          "sys.exit(_tilegraph_cli.main())"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and not out.stderr.strip(), out.stderr


def _worker_quick_exit() -> list:
    from tilegraph.runtime import worker_setup

    return list(worker_setup._QUICK_EXIT)


def test_embedded_workers_collect_then_freeze_at_exit():
    import tilegraph as tg
    from tilegraph.runtime.worker_setup import _exit_collection

    rt = tg.connect(n_workers=1, dashboard=False, quiet=True)
    try:
        answers = rt.client.run(_worker_quick_exit)
    finally:
        rt.close()  # (closes as before)
    assert answers and all(a == [_exit_collection] for a in answers.values()), answers
