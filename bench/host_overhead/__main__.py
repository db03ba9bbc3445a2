"""`python -m bench.host_overhead`."""

import sys

from bench.host_overhead.command import main

sys.exit(main())
