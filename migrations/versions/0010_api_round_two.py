"""The HTTP API, round two: cached prompt tokens, files in chunks, batches read and written in steps, the
requests a retry reattaches to, and the models the fleet serves.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08

- `jobs.cached_tokens`: prompt tokens the engine served from its prefix cache (NULL: not known, a row
  written before this revision or by a job that never ran). `job_stats` and `bulk_progress` sum it.
- `api_file_chunks`: a file's content as chunks of 1 MiB (all but the last exactly that; `api_files.content`
  moves there), so uploads are stored as they arrive and reads and batch input are streamed, whatever the
  file's size. `api_files.status`: `uploading` while its chunks are written (no reader sees it), then
  `processed`.
- `api_batches.model` (the model its lines name), `input_offset` (the byte where the line after the last
  one submitted starts: production resumes there without re-reading the file) and `usage` (its tokens,
  once finished).
- `api_requests`: a request a retry should reattach to (an `Idempotency-Key`, or an SDK's retry of a
  request answered 504): the tenant's key -> the job, with the request's fingerprint.
- `served_models`: each live worker's model, announced at start, renewed while it runs, removed at a
  graceful stop; `/v1/models` lists those with a recent heartbeat.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

CHUNK = 1024 * 1024  # schemas.tables.FILE_CHUNK_BYTES when this revision was written

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def _migration(name: str):
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"inferq_migration_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _job_stats(cached: bool) -> str:
    sql = _migration("0009_adapters.py")._job_stats(by_model=True)  # 0009's: grouped by model too
    if not cached:
        return sql
    edits = (
        ("prompt_tokens bigint, completion_tokens bigint,",
         "prompt_tokens bigint, completion_tokens bigint, cached_tokens bigint,"),
        ("       prompt_tokens, completion_tokens,\n",
         "       prompt_tokens, completion_tokens, cached_tokens,\n"),
        ("coalesce(sum(completion_tokens), 0)::bigint AS completion_tokens,",
         "coalesce(sum(completion_tokens), 0)::bigint AS completion_tokens,\n"
         "           coalesce(sum(cached_tokens), 0)::bigint AS cached_tokens,"),
    )  # fmt: skip
    for old, new in edits:
        assert old in sql, old
        sql = sql.replace(old, new)
    return sql


def _bulk_progress(cached: bool) -> str:
    sql = _migration("0006_tenant_job_keys.py")._bulk_progress(scoped=True)
    if not cached:
        return sql
    edits = (
        ("       b.created_at, b.started_at,", "       coalesce(j.cached_tokens, 0) AS cached_tokens,\n"
         "       b.created_at, b.started_at,"),
        ("coalesce(sum(completion_tokens), 0) AS completion_tokens,",
         "coalesce(sum(completion_tokens), 0) AS completion_tokens,\n"
         "           coalesce(sum(cached_tokens), 0) AS cached_tokens,"),
    )  # fmt: skip
    for old, new in edits:
        assert old in sql, old
        sql = sql.replace(old, new)
    return sql


def _recreate_job_stats(cached: bool) -> None:
    """The function's result type changes: its views go first and come back after."""
    views = {n: q for n, q in _migration("0002_history_views.py").VIEWS.items() if n.startswith("job_stats")}
    for name in views:
        op.execute(f"DROP VIEW IF EXISTS {name}")
    op.execute("DROP FUNCTION IF EXISTS job_stats(text, timestamptz, timestamptz)")
    op.execute(_job_stats(cached))
    for name, query in views.items():
        op.execute(f"CREATE VIEW {name} AS {query}")


def _ts(name: str, nullable: bool = True, now: bool = False) -> sa.Column:
    return sa.Column(
        name, sa.DateTime(timezone=True), nullable=nullable, server_default=sa.func.now() if now else None
    )


def upgrade() -> None:
    op.add_column("jobs", sa.Column("cached_tokens", sa.Integer))
    _recreate_job_stats(cached=True)
    op.execute("DROP VIEW IF EXISTS bulk_progress")  # a column in the middle: not a CREATE OR REPLACE
    op.execute(_bulk_progress(cached=True).replace("CREATE OR REPLACE VIEW", "CREATE VIEW"))

    op.create_table(
        "api_file_chunks",
        sa.Column(
            "file_id", sa.String(40), sa.ForeignKey("api_files.file_id", ondelete="CASCADE"), primary_key=True
        ),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("data", sa.LargeBinary, nullable=False),
    )
    op.execute(
        f"""INSERT INTO api_file_chunks (file_id, seq, data)
SELECT file_id, g, substring(content FROM g * {CHUNK} + 1 FOR {CHUNK})
FROM api_files, generate_series(0, greatest(0, (length(content) - 1) / {CHUNK})) AS g"""
    )
    op.drop_column("api_files", "content")
    op.add_column("api_files", sa.Column("status", sa.String(16), nullable=False, server_default="processed"))

    op.add_column("api_batches", sa.Column("model", sa.String(256)))
    op.add_column("api_batches", sa.Column("input_offset", sa.BigInteger, nullable=False, server_default="0"))
    op.add_column("api_batches", sa.Column("usage", JSONB))

    op.create_table(
        "api_requests",
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("request_key", sa.String(300), primary_key=True),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(128), nullable=False),
        _ts("created_at", nullable=False, now=True),
        _ts("expires_at", nullable=False),
    )
    op.create_index("ix_api_requests_expires_at", "api_requests", ["expires_at"])

    op.create_table(
        "served_models",
        sa.Column("worker_id", sa.String(128), primary_key=True),
        sa.Column("topic_prefix", sa.String(128), nullable=False),
        sa.Column("model", sa.String(256), nullable=False),
        sa.Column("max_model_len", sa.Integer),
        _ts("started_at", nullable=False, now=True),
        _ts("heartbeat_at", nullable=False, now=True),
    )
    op.create_index("ix_served_models_prefix", "served_models", ["topic_prefix", "heartbeat_at"])


def downgrade() -> None:
    op.drop_table("served_models")
    op.drop_table("api_requests")
    op.drop_column("api_batches", "usage")
    op.drop_column("api_batches", "input_offset")
    op.drop_column("api_batches", "model")
    op.execute("DELETE FROM api_files WHERE status <> 'processed'")
    op.drop_column("api_files", "status")
    op.add_column("api_files", sa.Column("content", sa.LargeBinary))
    op.execute(
        "UPDATE api_files f SET content = coalesce((SELECT string_agg(c.data, ''::bytea ORDER BY c.seq) "
        "FROM api_file_chunks c WHERE c.file_id = f.file_id), ''::bytea)"
    )
    op.alter_column("api_files", "content", nullable=False)
    op.drop_table("api_file_chunks")
    op.execute("DROP VIEW IF EXISTS bulk_progress")
    op.execute(_bulk_progress(cached=False).replace("CREATE OR REPLACE VIEW", "CREATE VIEW"))
    _recreate_job_stats(cached=False)
    op.drop_column("jobs", "cached_tokens")
