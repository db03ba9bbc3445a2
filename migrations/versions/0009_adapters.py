"""LoRA adapters: the fleet's registry, and the model of each job (a column, in the history).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-08

`adapters` is the fleet's registry (`inferq adapter add NAME DIR [--tenant T]`): a name a job's `model` may
give, the PEFT directory every worker reads it from, and the one tenant allowed to use it (NULL: all).
Workers read it when they admit a job that names an adapter, so an adapter added is served by every worker
from its next job, and one removed is refused from then on, without a restart.

`jobs.model` keeps the model that served each job (the base's name or the adapter's; for a rejected job
the name it asked for), indexed with created_at for one model's history. `job_stats` (and the views over
it) gain a `model` column and group by it: the history of each adapter, beside the base's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def _history_views_0002():
    path = Path(__file__).with_name("0002_history_views.py")
    spec = importlib.util.spec_from_file_location("inferq_migration_0002", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (0002's text, this revision's): the function's result gains `model`, grouped by beside tenant and class
_BY_MODEL = (
    ("tenant varchar, priority varchar,\n", "tenant varchar, priority varchar, model varchar,\n"),
    ("SELECT b, tenant, priority, jobs,", "SELECT b, tenant, priority, model, jobs,"),
    ("           tenant, priority,\n", "           tenant, priority, model,\n"),
    ("    GROUP BY 1, 2, 3\n", "    GROUP BY 1, 2, 3, 4\n"),
)
JOB_STATS_VIEWS = ("job_stats_hourly", "job_stats_daily")
_DROP_JOB_STATS = "DROP FUNCTION job_stats(text, timestamptz, timestamptz)"


def _job_stats(by_model: bool) -> str:
    sql = _history_views_0002().JOB_STATS
    if by_model:
        for old, new in _BY_MODEL:
            assert sql.count(old) == 1, old
            sql = sql.replace(old, new)
    return sql


def _recreate_job_stats(by_model: bool) -> None:
    """A function's result type cannot change in place: the views over it go, then come back."""
    views = _history_views_0002().VIEWS
    for name in JOB_STATS_VIEWS:
        op.execute(f"DROP VIEW {name}")
    op.execute(_DROP_JOB_STATS)
    op.execute(_job_stats(by_model))
    for name in JOB_STATS_VIEWS:
        op.execute(f"CREATE VIEW {name} AS {views[name]}")


def upgrade() -> None:
    op.create_table(
        "adapters",
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("tenant", sa.String(128)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_adapters_tenant", "adapters", ["tenant"])
    op.add_column("jobs", sa.Column("model", sa.String(256)))
    op.create_index("ix_jobs_model_created_at", "jobs", ["model", "created_at"])
    _recreate_job_stats(by_model=True)


def downgrade() -> None:
    _recreate_job_stats(by_model=False)
    op.drop_index("ix_jobs_model_created_at", "jobs")
    op.drop_column("jobs", "model")
    op.drop_table("adapters")
