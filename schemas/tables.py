"""SQLAlchemy table definitions of the contract. Migrations in migrations/ create exactly these."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB

from schemas.statuses import BULK_STATUSES, JOB_STATUSES, TERMINAL_STATUSES

__all__ = ["BULK_STATUSES", "JOB_STATUSES", "TERMINAL_STATUSES", "bulk_jobs", "jobs", "metadata"]


metadata = MetaData()

jobs = Table(
    "jobs",
    metadata,
    # the key is (job_id, tenant): job ids are scoped by tenant (two tenants may use the same id)
    Column("job_id", String(128), primary_key=True),
    Column("tenant", String(128), primary_key=True, server_default="default"),
    Column("priority", String(16), nullable=False),  # high | normal | low
    Column("status", String(16), nullable=False),  # one of JOB_STATUSES
    Column("prompt", Text),
    Column("params", JSONB),  # the request as received (sampling parameters, stop, metadata)
    Column("output_text", Text),
    # OpenAI-style choices [{index, text, finish_reason, logprobs}] of a job with n > 1 or logprobs;
    # NULL for one sample without logprobs (its output_text and finish_reason say it all)
    Column("choices", JSONB),
    Column("finish_reason", String(32)),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("attempts", Integer, nullable=False, server_default="0"),
    # the consumer-group generation the current attempt's record was fetched in (0: not known)
    Column("admitted_generation", Integer, nullable=False, server_default="0"),
    Column("worker_id", String(128)),
    Column("bulk_id", String(64)),
    Column("error", Text),
    Column("source_topic", String(255)),
    Column("source_partition", Integer),
    Column("source_offset", BigInteger),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("queued_at", DateTime(timezone=True)),  # when a worker took it off Kafka
    Column("started_at", DateTime(timezone=True)),  # first scheduled
    Column("first_token_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("ttft_ms", Float),
    Column("mean_itl_ms", Float),
    Column("e2e_ms", Float),
    Column("queue_ms", Float),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Outbox: a terminal row whose result is not on the results topic yet has published_at NULL.
    Column("published_at", DateTime(timezone=True)),
    Column("publisher", String(128)),  # the worker publishing the result, while published_at is NULL
    Column("publish_lease_until", DateTime(timezone=True)),  # its claim; renewed before every try
    Column("cancel_requested_at", DateTime(timezone=True)),  # a cancel that arrived while not terminal
    # what history queries filter on: one tenant over a time range, a status, recent completions, a bulk job
    Index("ix_jobs_tenant_created_at", "tenant", "created_at"),
    Index("ix_jobs_status", "status"),
    Index("ix_jobs_finished_at", "finished_at"),
    Index("ix_jobs_bulk_id", "bulk_id"),
    Index(
        "ix_jobs_unpublished",
        "finished_at",
        postgresql_where=text(f"published_at IS NULL AND status IN {TERMINAL_STATUSES}"),
    ),
)

bulk_jobs = Table(
    "bulk_jobs",
    metadata,
    Column("bulk_id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False, server_default="default"),
    Column("priority", String(16), nullable=False, server_default="low"),
    Column("status", String(16), nullable=False),  # one of BULK_STATUSES
    Column("endpoint", String(64)),  # /v1/completions | /v1/chat/completions
    Column("input_path", Text),
    Column("output_path", Text),
    Column("error_path", Text),
    Column("total_lines", Integer, nullable=False, server_default="0"),
    Column("invalid_lines", Integer, nullable=False, server_default="0"),
    Column("submitted_lines", Integer, nullable=False, server_default="0"),
    Column("error", Text),
    Column("metadata", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
)
