"""`inferq adapter add|list|remove`: the fleet's registry of LoRA adapters (workers/db/adapters.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DESCRIPTION = (
    "The fleet's LoRA adapters, in PostgreSQL. A job names one in `model`; any worker of the group loads it "
    "from its directory on the first job that names it, without a restart, and refuses it from the moment "
    "it is removed. Directories are read by the workers: give a path every worker can read (a shared "
    "volume), as they see it."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("adapter", help="the fleet's LoRA adapters (add, list, remove)",
                              description=DESCRIPTION)  # fmt: skip
    verbs = p.add_subparsers(dest="adapter_command", metavar="VERB", required=True)
    a = verbs.add_parser(
        "add",
        help="register an adapter for every worker",
        description="Register a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) "
        "under NAME. Names: letters, digits and ._:/@+- (at most 128), never a name of the base model.",
    )
    a.add_argument("name", help="what jobs put in `model` to use it")
    a.add_argument("directory", type=Path, help="the PEFT directory, on a volume every worker reads")
    a.add_argument("--tenant", default=None, help="only this tenant's jobs may use it (default: all)")
    a.add_argument(
        "--no-check",
        action="store_true",
        help="register a directory this machine cannot see (each worker checks it when a job first names it)",
    )
    a.set_defaults(func=add)
    ls = verbs.add_parser("list", help="list adapters")
    ls.add_argument("--tenant", default=None, help="only those this tenant may use (its own and shared ones)")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(func=list_adapters)
    r = verbs.add_parser("remove", help="unregister an adapter (jobs naming it are refused from now on)")
    r.add_argument("name")
    r.set_defaults(func=remove)


def reserved_names() -> tuple[str, ...]:
    """Names an adapter may not take: the built-in models' and the deployment's served model names."""
    from gpu.model_source import DEFAULT_MODEL, GEMMA3_MODEL, TINY_MODEL
    from workers.settings import Settings

    served = Settings.from_env().served_model_name
    return (DEFAULT_MODEL, GEMMA3_MODEL, TINY_MODEL, *(n.strip() for n in served.split(",") if n.strip()))


def _engine():
    from workers.db.connect import make_engine
    from workers.settings import Settings

    return make_engine(Settings.from_env().database_url)


def add(args: argparse.Namespace) -> int:
    from schemas.adapters import adapter_name_problem, peft_directory_problem
    from workers.db import adapters

    path = args.directory.expanduser().absolute()
    problem = adapter_name_problem(args.name, reserved_names())
    if problem is None and not args.no_check:
        problem = peft_directory_problem(path)
    if problem is None and args.tenant is not None and not 0 < len(args.tenant) <= 128:
        problem = "a tenant has 1-128 characters"
    if problem is not None:
        print(f"inferq adapter add: {problem}", file=sys.stderr)
        return 2
    engine = _engine()
    try:
        with engine.begin() as conn:
            added = adapters.add(conn, args.name, str(path), args.tenant)
            taken = None if added is not None else adapters.lookup(conn, [args.name]).get(args.name)
    finally:
        engine.dispose()
    if added is None:
        where = f" ({taken.path}, {_owner(taken.tenant)})" if taken is not None else ""
        print(f"inferq adapter add: adapter {args.name!r} exists{where}; remove it first", file=sys.stderr)
        return 1
    print(f"adapter {added.name} ({added.path}) registered for {_owner(added.tenant)}")
    return 0


def list_adapters(args: argparse.Namespace) -> int:
    from workers.cli.tables import render
    from workers.db import adapters

    engine = _engine()
    try:
        with engine.connect() as conn:
            rows = adapters.listed(conn, args.tenant)
    finally:
        engine.dispose()
    if args.json:
        for a in rows:
            doc = {"name": a.name, "path": a.path, "tenant": a.tenant, "created_at": a.created_at.isoformat()}
            print(json.dumps(doc))
        return 0
    table = [[a.name, a.tenant or "(every tenant)", a.path, a.created_at] for a in rows]
    print(render(["name", "tenant", "directory", "created (UTC)"], table))
    return 0


def remove(args: argparse.Namespace) -> int:
    from workers.db import adapters

    engine = _engine()
    try:
        with engine.begin() as conn:
            removed = adapters.remove(conn, args.name)
    finally:
        engine.dispose()
    if removed is None:
        print(f"inferq adapter remove: no adapter {args.name!r}", file=sys.stderr)
        return 1
    print(f"adapter {removed.name} removed: jobs naming it are refused from now on")
    return 0


def _owner(tenant: str | None) -> str:
    return "every tenant" if tenant is None else f"tenant {tenant}"
