"""The HTTP API's tables: keys (hashed), files (their content in PostgreSQL) and batches.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

`api_keys` maps a bearer key's sha256 to its tenant (the key itself is never stored). `api_files` holds
uploaded Batch input files and written output/error files, content as bytea, so any API process serves any
file. `api_batches` is an OpenAI Batch object; its lines are jobs rows with `bulk_id` = `batch_id`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _ts(name: str, nullable: bool = True, now: bool = False) -> sa.Column:
    return sa.Column(
        name, sa.DateTime(timezone=True), nullable=nullable, server_default=sa.func.now() if now else None
    )


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("name", sa.String(128)),
        sa.Column("key_hash", sa.String(64), nullable=False, unique=True),
        _ts("created_at", nullable=False, now=True),
        _ts("revoked_at"),
    )
    op.create_table(
        "api_files",
        sa.Column("file_id", sa.String(40), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
        _ts("created_at", nullable=False, now=True),
    )
    op.create_index("ix_api_files_tenant_created_at", "api_files", ["tenant", "created_at"])
    op.create_table(
        "api_batches",
        sa.Column("batch_id", sa.String(64), primary_key=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("topic_prefix", sa.String(128), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("output_file_id", sa.String(40)),
        sa.Column("error_file_id", sa.String(40)),
        sa.Column("errors", JSONB),
        sa.Column("metadata", JSONB),
        sa.Column("total", sa.Integer, nullable=False, server_default="0"),
        sa.Column("submitted", sa.Integer, nullable=False, server_default="0"),
        sa.Column("final_counts", JSONB),
        _ts("created_at", nullable=False, now=True),
        _ts("expires_at", nullable=False),
        *(
            _ts(f"{s}_at")
            for s in (
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "expired",
                "cancelling",
                "cancelled",
                "cancels_sent",
                "event_published",
            )
        ),
    )
    op.create_index("ix_api_batches_tenant_created_at", "api_batches", ["tenant", "created_at"])
    op.create_index("ix_api_batches_open", "api_batches", ["topic_prefix", "status"])


def downgrade() -> None:
    op.drop_table("api_batches")
    op.drop_table("api_files")
    op.drop_table("api_keys")
