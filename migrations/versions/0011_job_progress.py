"""Running jobs' progress: the tokens each sample has generated so far, saved as the job runs.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08

`job_progress` holds, per sample of a running job, its generated token ids in chunks: one row per save of
an attempt (`position`: where the chunk's tokens start in the sample's output), insert-only, so a save
costs the new tokens alone and no row is rewritten. The chunk's `text` is what those tokens added to the
sample's text; `fingerprint` names the model and tokenizer that generated them (progress of another model
is never resumed). A job's next attempt resumes from its chain of chunks (the latest attempt's from where
it began, earlier attempts' below that); its terminal row's write deletes them.

`job_progress_summary` is that chain per sample, for a look in psql: tokens saved so far and their text.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# A chunk is in a sample's chain unless a later attempt began (its lowest position) at or below it.
SUMMARY = """
CREATE VIEW job_progress_summary AS
WITH c AS (
    SELECT p.*, min(p.position) OVER (PARTITION BY p.job_id, p.tenant, p.sample, p.attempt) AS base
    FROM job_progress p
)
SELECT c.job_id, c.tenant, c.sample, max(c.attempt) AS attempt,
       sum(cardinality(c.token_ids))::integer AS tokens,
       string_agg(c.text, '' ORDER BY c.position) AS text,
       max(c.saved_at) AS saved_at
FROM c
WHERE NOT EXISTS (
    SELECT 1 FROM c AS later
    WHERE later.job_id = c.job_id AND later.tenant = c.tenant AND later.sample = c.sample
      AND later.attempt > c.attempt AND later.base <= c.position
)
GROUP BY c.job_id, c.tenant, c.sample
"""


def upgrade() -> None:
    op.create_table(
        "job_progress",
        sa.Column("job_id", sa.String(128), primary_key=True),
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("sample", sa.Integer, primary_key=True),
        sa.Column("attempt", sa.Integer, primary_key=True),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("token_ids", ARRAY(sa.Integer), nullable=False),
        sa.Column("text", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("finish_reason", sa.String(32)),
        sa.Column("saved_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.execute(SUMMARY)


def downgrade() -> None:
    op.execute("DROP VIEW job_progress_summary")
    op.drop_table("job_progress")
