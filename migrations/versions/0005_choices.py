"""Every sample of a job: the `choices` column.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

`choices` (jsonb): OpenAI-style [{index, text, finish_reason, logprobs}] of a job that asked for n > 1
samples or for log probabilities. NULL otherwise (and for rows from before this column): the job's one
sample is its output_text and finish_reason. Operators query it with jsonb operators, e.g.
`jsonb_array_length(choices)` or `choices->1->>'text'`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("choices", JSONB))


def downgrade() -> None:
    op.drop_column("jobs", "choices")
