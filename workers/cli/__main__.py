"""`python -m workers.cli ...` runs `inferq ...` (used where the console script may not be on PATH)."""

import sys

from workers.cli.main import main

sys.exit(main())
