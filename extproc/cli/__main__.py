"""`python -m extproc.cli` (what `serve --workers N` starts each worker with)."""

import sys

from extproc.cli import main

sys.exit(main())
