"""The ``tilegraph`` command's entry point. It imports tilegraph's command line (NumPy, Dask and
Numba take a second or more), and a Ctrl-C during that import ends in one line and exit status
130, as one during a command does, instead of Python's traceback. It lives outside the tilegraph
package, whose import is what it guards."""

import sys


def main() -> int:
    try:
        from tilegraph.cli import main as run
    except KeyboardInterrupt:
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
        print(f"tilegraph {command}: interrupted" if command else "tilegraph: interrupted", file=sys.stderr,
              flush=True)
        return 130  # tilegraph.cli.EXIT_INTERRUPTED (not imported: the import is what was stopped)
    return run()
