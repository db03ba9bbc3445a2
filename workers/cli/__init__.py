"""The `inferq` command line, the composition root: options, building the engine, one module per verb.

Each verb module defines `register(subparsers)` and imports its implementation inside the command, so
`inferq --help` stays fast and nothing below depends on the command line.
"""

from workers.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
