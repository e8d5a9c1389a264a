"""``python -m deploy.loadtest``: the same as the ``spyre-loadtest`` command."""

import sys

from .cli import main

sys.exit(main())
