"""`python -m bench.engine`."""

import sys

from bench.engine.command import main

sys.exit(main())
