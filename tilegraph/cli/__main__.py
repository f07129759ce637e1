"""``python -m tilegraph.cli``: the ``tilegraph`` command."""

import sys

from tilegraph.cli import main

sys.exit(main())
