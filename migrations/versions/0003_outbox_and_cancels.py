"""Result outbox and durable cancels on `jobs`.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

`published_at`: set once the job's result is on the results topic. A terminal row with it NULL is an
outbox entry: its result is (re)published by whichever worker next sees the job's message, so a crash
between the row's commit and the publish can no longer lose a result.
`publisher`, `publish_lease_until`: the worker publishing that result, and until when its claim holds (it
renews it before every try). Another worker takes an outbox entry over only once the lease has lapsed, so
a result stuck behind a broker outage is not published a second time by whoever re-reads the job.
`cancel_requested_at`: a cancel that arrived while the job was queued or running; admission honours
it, so a cancel survives worker restarts and never races intake.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)
TERMINAL = "status IN ('succeeded', 'failed', 'rejected', 'cancelled', 'expired')"


def upgrade() -> None:
    op.add_column("jobs", sa.Column("published_at", TS))
    op.add_column("jobs", sa.Column("publisher", sa.String(128)))
    op.add_column("jobs", sa.Column("publish_lease_until", TS))
    op.add_column("jobs", sa.Column("cancel_requested_at", TS))
    # Rows written before the outbox existed had their results published already.
    op.execute(f"UPDATE jobs SET published_at = finished_at WHERE {TERMINAL}")
    op.create_index(
        "ix_jobs_unpublished",
        "jobs",
        ["finished_at"],
        postgresql_where=sa.text(f"published_at IS NULL AND {TERMINAL}"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_unpublished", table_name="jobs")
    op.drop_column("jobs", "cancel_requested_at")
    op.drop_column("jobs", "publish_lease_until")
    op.drop_column("jobs", "publisher")
    op.drop_column("jobs", "published_at")
