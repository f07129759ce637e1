"""The ``tilegraph`` command's entry point. It imports tilegraph's command line (NumPy, Dask and
Numba take a second or more), and a Ctrl-C during that import ends in one line and exit status
130, as one during a command does, instead of Python's traceback. It lives outside the tilegraph
package, whose import is what it guards."""

import signal
import sys
import threading


def main() -> int:
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    # A Ctrl-C inside an extension's own import can reach Python as another error (NumPy's C code
    # turns it into "PyCapsule_Import could not import module datetime"): the flag says it was one.
    # (Signal handlers are set from the main thread only: called from another, nothing is set.)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_sigint) if main_thread else None
    try:
        from tilegraph.cli import main as run
    except BaseException as exc:
        if not (interrupted or isinstance(exc, KeyboardInterrupt)):
            raise
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
        print(f"tilegraph {command}: interrupted" if command else "tilegraph: interrupted", file=sys.stderr,
              flush=True)
        return 130  # tilegraph.cli.EXIT_INTERRUPTED (not imported: the import is what was stopped)
    finally:
        if main_thread:
            signal.signal(signal.SIGINT, previous)
    from tilegraph.runtime.worker_setup import quick_exit

    quick_exit()  # the end without the interpreter's walks of every live object (0.5-1 s after `train`)
    return run()
