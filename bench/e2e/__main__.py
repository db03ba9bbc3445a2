"""`python -m bench.e2e`."""

import sys

from bench.e2e.command import main

sys.exit(main())
