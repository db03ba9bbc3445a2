"""Files that expire: OpenAI's `expires_after` on uploads and `output_expires_after` on batches.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-07

`api_files.expires_at` (NULL: never) is when a file stops being served and is deleted: an upload's
`created_at` + its `expires_after.seconds`, a batch's output and error files' creation + the batch's
`output_expires_after.seconds`, which `api_batches.output_expires_after` keeps until they are written.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_files", sa.Column("expires_at", sa.DateTime(timezone=True)))
    op.create_index(
        "ix_api_files_expires_at",
        "api_files",
        ["expires_at"],
        postgresql_where=sa.text("expires_at IS NOT NULL"),
    )
    op.add_column("api_batches", sa.Column("output_expires_after", sa.Integer))


def downgrade() -> None:
    op.drop_column("api_batches", "output_expires_after")
    op.drop_index("ix_api_files_expires_at", table_name="api_files")
    op.drop_column("api_files", "expires_at")
