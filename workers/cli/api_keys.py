"""`inferq api-key create|list|revoke`: bearer keys of the HTTP API, one tenant each (stored hashed)."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    k = subparsers.add_parser("api-key", help="bearer keys of the HTTP API (one tenant each)")
    verbs = k.add_subparsers(dest="api_key_command", metavar="VERB", required=True)
    c = verbs.add_parser("create", help="create a key; it is printed once, as the last line")
    c.add_argument("--tenant", required=True, help="the tenant every request with this key acts as")
    c.add_argument("--name", default=None, help="a note to tell keys apart")
    c.set_defaults(func=create_key)
    ls = verbs.add_parser("list", help="list keys (never the keys themselves)")
    ls.add_argument("--tenant", default=None, help="only this tenant's")
    ls.set_defaults(func=list_keys)
    r = verbs.add_parser("revoke", help="revoke a key by its id (requests with it get 401 from now on)")
    r.add_argument("key_id", help="the key's id, as `inferq api-key list` shows it")
    r.set_defaults(func=revoke_key)


def _engine():
    from workers.db.connect import make_engine
    from workers.settings import Settings

    return make_engine(Settings.from_env().database_url)


def create_key(args: argparse.Namespace) -> int:
    from schemas.topics import check_tenant_name
    from schemas.validation import InvalidMessage
    from workers.db import api_keys
    from workers.settings import Settings

    try:
        if Settings.from_env().tenant_topics:  # the tenant names topics: their rule too
            check_tenant_name(args.tenant)
        engine = _engine()
        with engine.begin() as conn:
            key_id, key = api_keys.create(conn, args.tenant, args.name)
    except (InvalidMessage, ValueError) as exc:
        print(f"inferq api-key create: {exc}", file=sys.stderr)
        return 2
    engine.dispose()
    print(f"key {key_id} for tenant {args.tenant}; store it now, it is not shown again:")
    print(key)
    return 0


def list_keys(args: argparse.Namespace) -> int:
    from workers.cli.tables import render
    from workers.db import api_keys

    engine = _engine()
    with engine.connect() as conn:
        rows = api_keys.list_keys(conn, args.tenant)
    engine.dispose()
    headers = ["key_id", "tenant", "name", "created", "revoked"]
    print(
        render(
            headers, [[r[h] for h in ("key_id", "tenant", "name", "created_at", "revoked_at")] for r in rows]
        )
    )
    return 0


def revoke_key(args: argparse.Namespace) -> int:
    from workers.db import api_keys

    engine = _engine()
    with engine.begin() as conn:
        done = api_keys.revoke(conn, args.key_id)
    engine.dispose()
    print(f"revoked {args.key_id}" if done else f"no live key {args.key_id}")
    return 0 if done else 1
