"""Job history: the `jobs` and `bulk_jobs` tables of the contract, with the indexes history queries use.

Revision ID: 0001
Revises:
Create Date: 2026-12-02

A snapshot written out column by column (not `metadata.create_all`), so later edits of schemas/tables.py
need a new revision; tests/services/test_migrations.py fails while the two differ.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False, server_default="default"),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt", sa.Text),
        sa.Column("params", JSONB),
        sa.Column("output_text", sa.Text),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("prompt_tokens", sa.Integer),
        sa.Column("completion_tokens", sa.Integer),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("worker_id", sa.String(128)),
        sa.Column("bulk_id", sa.String(64)),
        sa.Column("error", sa.Text),
        sa.Column("source_topic", sa.String(255)),
        sa.Column("source_partition", sa.Integer),
        sa.Column("source_offset", sa.BigInteger),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("queued_at", TS),
        sa.Column("started_at", TS),
        sa.Column("first_token_at", TS),
        sa.Column("finished_at", TS),
        sa.Column("ttft_ms", sa.Float),
        sa.Column("mean_itl_ms", sa.Float),
        sa.Column("e2e_ms", sa.Float),
        sa.Column("queue_ms", sa.Float),
        sa.Column("updated_at", TS, nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_jobs_tenant_created_at", "jobs", ["tenant", "created_at"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.create_index("ix_jobs_bulk_id", "jobs", ["bulk_id"])

    op.create_table(
        "bulk_jobs",
        sa.Column("bulk_id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False, server_default="default"),
        sa.Column("priority", sa.String(16), nullable=False, server_default="low"),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("endpoint", sa.String(64)),
        sa.Column("input_path", sa.Text),
        sa.Column("output_path", sa.Text),
        sa.Column("error_path", sa.Text),
        sa.Column("total_lines", sa.Integer, nullable=False, server_default="0"),
        sa.Column("invalid_lines", sa.Integer, nullable=False, server_default="0"),
        sa.Column("submitted_lines", sa.Integer, nullable=False, server_default="0"),
        sa.Column("error", sa.Text),
        sa.Column("metadata", JSONB),
        sa.Column("created_at", TS, nullable=False, server_default=sa.func.now()),
        sa.Column("started_at", TS),
        sa.Column("finished_at", TS),
    )


def downgrade() -> None:
    op.drop_table("bulk_jobs")
    op.drop_table("jobs")  # drops its indexes with it
