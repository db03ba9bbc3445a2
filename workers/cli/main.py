"""`inferq` — the one command-line entry point. Each verb lives in a module of workers/cli/."""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError, version

# Each module defines `register(subparsers)`, adding its verbs with `set_defaults(func=...)`.
# Heavy imports (torch, Kafka, SQL) happen inside the verbs, so `inferq --help` stays fast.
COMMAND_MODULES = (
    "workers.cli.services",  # up, down, status, db
    "workers.cli.worker",  # worker
    "workers.cli.jobs",  # submit, cancel, tail, jobs, schema
    "workers.cli.demo",  # demo
    "workers.cli.bench",  # bench engine
    "workers.cli.history",  # history
    "workers.cli.bulk",  # bulk submit|status|wait|fetch|cancel, bulk-worker
    "workers.cli.run_batch",  # run-batch
    "workers.cli.tenants",  # tenant add
    "workers.cli.api",  # api
    "workers.cli.api_keys",  # api-key create|list|revoke
    "workers.cli.adapters",  # adapter add|list|remove
)


def inferq_version() -> str:
    try:
        return version("inferq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferq",
        description="Kafka-driven continuous-batching LLM inference worker with job history in PostgreSQL.",
    )
    parser.add_argument("--version", action="version", version=f"inferq {inferq_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
