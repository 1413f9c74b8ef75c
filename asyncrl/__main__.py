"""``python -m asyncrl``: the ``asyncrl`` command (how asyncrl starts its own processes)."""

import sys

from .commands.cli import main

sys.exit(main())
