"""``python -m tilegraph.cli``: the ``tilegraph`` command."""

import sys

from tilegraph.cli import main
from tilegraph.runtime.worker_setup import quick_exit

quick_exit()  # as the `tilegraph` command ends: without the interpreter's walks of every live object
sys.exit(main())
