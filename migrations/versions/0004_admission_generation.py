"""The consumer-group generation a job's current attempt was admitted under.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04

`admitted_generation`: the group generation in which the admitting worker fetched the job's record. A
worker whose admission runs late (a slow database) after the record's partition moved to another worker
carries an older generation, and its upsert no longer re-queues the row under the new owner (which then
could never conclude it). 0: not known (a row from before this column, or a record read outside a group).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("admitted_generation", sa.Integer, nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("jobs", "admitted_generation")
