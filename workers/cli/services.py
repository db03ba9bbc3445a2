"""Verbs for the local services: `up`, `down`, `status`, and `db upgrade|downgrade|current`."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = (
    "Start the local Kafka and PostgreSQL (on 127.0.0.1, state in .state/ or "
    "INFERQ_STATE_DIR) unless already running, wait until they answer, create the contract's topics "
    "and run `db upgrade`. Idempotent. Services configured elsewhere are only provisioned. An existing "
    "topic with fewer partitions than configured is reported and left as it is (see --grow-partitions)."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up", help="start local Kafka + PostgreSQL, create topics, run migrations", description=DESCRIPTION
    )
    p.add_argument(
        "--grow-partitions",
        action="store_true",
        help="grow existing topics that have fewer partitions than configured (moves keys to other "
        "partitions: stop producers and workers first)",
    )
    p.set_defaults(func=_up)

    p = subparsers.add_parser(
        "down",
        help="stop the local services started by `up`",
        description="Stop the processes `up` started, by their pid files.",
    )
    p.add_argument("--purge", action="store_true", help="also delete Kafka data and the PostgreSQL cluster")
    p.set_defaults(func=_down)

    p = subparsers.add_parser(
        "status",
        help="settings and health of each service",
        description="Print the effective settings and each service's health; "
        "exit 0 when all are healthy, 1 otherwise.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_status)

    db = subparsers.add_parser(
        "db",
        help="database migrations (Alembic)",
        description="Alembic migrations against INFERQ_DATABASE_URL.",
    )
    verbs = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    p = verbs.add_parser("upgrade", help="migrate up (default: to head)")
    p.add_argument("revision", nargs="?", default="head")
    p.set_defaults(func=_db_upgrade)
    p = verbs.add_parser("downgrade", help="migrate down (default: one revision)")
    p.add_argument("revision", nargs="?", default="-1", help="target revision, -1 or `base`")
    p.set_defaults(func=_db_downgrade)
    p = verbs.add_parser("current", help="print the database's revision")
    p.set_defaults(func=_db_current)


def _guarded(verb):
    """Report a service error as one clear message and exit status 1, not a traceback."""

    def run(args: argparse.Namespace) -> int:
        from workers.services.process import ServiceError

        try:
            return verb(args)
        except ServiceError as exc:
            print(f"inferq {args.command}: error: {exc}", file=sys.stderr)
            return 1

    return run


@_guarded
def _up(args: argparse.Namespace) -> int:
    from workers.services import manager
    from workers.settings import Settings

    statuses = manager.up(Settings.from_env(), say=_say, grow_partitions=args.grow_partitions)
    _print_table(statuses)
    return 0 if all(s.healthy for s in statuses) else 1


@_guarded
def _down(args: argparse.Namespace) -> int:
    from workers.services import manager
    from workers.settings import Settings

    manager.down(Settings.from_env(), purge=args.purge, say=_say)
    return 0


@_guarded
def _status(args: argparse.Namespace) -> int:
    from workers.services import manager
    from workers.settings import Settings

    settings = Settings.from_env()
    statuses = manager.status(settings)
    if args.json:
        doc = {
            "settings": {  # never a secret: the URL's password is masked, SASL's is not printed
                "kafka": settings.kafka,
                "kafka_security_protocol": settings.kafka_security.protocol,
                "kafka_sasl_mechanism": settings.kafka_security.sasl_mechanism,
                "database_url": statuses[1].address,
                "topic_prefix": settings.topic_prefix,
                "state_dir": str(settings.state_dir),
                "cache_dir": str(settings.cache_dir),
            },
            "topics": settings.topic_partitions(),
            "services": {s.name: s.to_dict() for s in statuses},
        }
        print(json.dumps(doc, indent=2))
    else:
        print(f"state dir: {settings.state_dir}  topic prefix: {settings.topic_prefix}")
        _print_table(statuses)
    return 0 if all(s.healthy for s in statuses) else 1


def _say(line: str) -> None:
    print(line, flush=True)  # progress shows at once even when piped (CI logs)


def _print_table(statuses) -> None:
    from workers.cli import tables

    rows = [
        (s.name, "up" if s.healthy else "DOWN", s.address, f"pid {s.pid}" if s.pid else
         "not running" if s.managed else "external")
        for s in statuses
    ]  # fmt: skip
    print(tables.render(("service", "health", "address", "process"), rows))


@_guarded
def _db_upgrade(args: argparse.Namespace) -> int:
    return _migrate("upgrade", args.revision)


@_guarded
def _db_downgrade(args: argparse.Namespace) -> int:
    return _migrate("downgrade", args.revision)


def _migrate(direction: str, revision: str) -> int:
    from workers.db import migrate
    from workers.settings import Settings

    url = Settings.from_env().database_url
    getattr(migrate, direction)(url, revision)
    print(f"database at revision {migrate.current(url)}")
    return 0


@_guarded
def _db_current(args: argparse.Namespace) -> int:
    from workers.db import migrate
    from workers.settings import Settings

    print(migrate.current(Settings.from_env().database_url) or "(none)")
    return 0
