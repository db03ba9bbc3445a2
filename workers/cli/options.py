"""Options several verbs share, spelt one way everywhere (old spellings stay as hidden aliases)."""

from __future__ import annotations

import argparse
from typing import Any

from workers.logs import LOG_FORMATS, LOG_LEVELS

# An alias: accepted, not shown in --help, and not defaulted (the visible option's default applies).
HIDDEN: dict[str, Any] = dict(default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_log_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="(default: %(default)s)"
    )
    g.add_argument("--loglevel", dest="log_level", type=str.upper, choices=LOG_LEVELS, **HIDDEN)
    g.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="json: one object per line (time, level, logger, message, worker_id, and job_id, "
        "priority, event for job events) (default: %(default)s)",
    )


def add_timeout_option(parser: argparse.ArgumentParser, default: float | None, what: str) -> None:
    """`--timeout SECONDS`: how long the command waits (`--wait-timeout` is its old spelling)."""
    shown = "none" if default is None else f"{default:g}"
    parser.add_argument(
        "--timeout",
        type=float,
        default=default,
        metavar="SECONDS",
        help=f"give up waiting for {what} after this long (default: {shown})",
    )
    parser.add_argument("--wait-timeout", dest="timeout", type=float, **HIDDEN)
