"""`python -m dsv41.server serve ...`: the same command as `dsv41 serve` (one entry point, one error format)."""

import sys

from ..cli import main

sys.exit(main())
