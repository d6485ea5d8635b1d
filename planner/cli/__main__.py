"""``python -m planner.cli``: the same as the ``meshplan`` command."""
import sys

from . import main

sys.exit(main())
