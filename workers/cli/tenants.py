"""`inferq tenant add`: a tenant's own topics and the Kafka ACLs that confine its principal to them."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tenant",
        help="per-tenant topics and ACLs (INFERQ_TENANT_TOPICS)",
        description="Tenant isolation: with INFERQ_TENANT_TOPICS=1 each tenant posts to and reads its own "
        "topics, and workers take a job's tenant from its topic.",
    )
    verbs = p.add_subparsers(dest="tenant_command", metavar="VERB", required=True)
    a = verbs.add_parser(
        "add",
        help="create a tenant's topics and ACLs",
        description="Create <prefix>.tenant.NAME.{jobs.high,jobs.normal,jobs.low,control,tokens,results} "
        "and allow PRINCIPAL to write its jobs and control topics, read its tokens and results topics, and "
        "use consumer groups named <prefix>.tenant.NAME.*; nothing else. Run it as a Kafka super user, "
        "against a broker with an authorizer (e.g. StandardAuthorizer). Safe to run again.",
    )
    a.add_argument("name", help="the tenant (1-64 of A-Z a-z 0-9 _ -)")
    a.add_argument("--principal", required=True, help="the tenant's Kafka principal, e.g. User:acme")
    a.add_argument(
        "--worker-principal",
        default=None,
        help="also allow this principal (the workers') to read and write the tenant's topics "
        "(not needed when it is a super user)",
    )
    a.set_defaults(func=add)


def add(args: argparse.Namespace) -> int:
    from workers.kafka_io.tenants import add_tenant
    from workers.settings import Settings

    settings = Settings.from_env()
    done = add_tenant(
        settings.kafka_connection,
        settings.topics,
        args.name,
        args.principal,
        worker_principal=args.worker_principal,
        jobs_partitions=settings.jobs_partitions,
        stream_partitions=settings.stream_partitions,
        replication_factor=settings.replication_factor,
    )
    for line in done:
        print(line)
    if not settings.tenant_topics:
        print("note: workers read tenant topics only with INFERQ_TENANT_TOPICS=1")
    return 0
