"""Job ids scoped by tenant: the jobs table is keyed by (job_id, tenant).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

Two tenants may use the same job_id: each gets its own row, its own run and its own result, and nothing
one tenant posts (a job, a cancel for an id nobody has yet) can take or block an id of another. The
`job_id` and `tenant` columns stay as they are; the key's column order (job_id first) keeps the look-ups
operators make by job_id alone on the primary key's index.

`bulk_progress` counts only the bulk job's own tenant's jobs: a job of another tenant that names the
same bulk_id is not part of it.

Downgrading fails while two tenants share a job_id (the old key cannot hold both rows).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from alembic import op


def _bulk_progress_0002() -> str:
    path = Path(__file__).with_name("0002_history_views.py")
    spec = importlib.util.spec_from_file_location("inferq_migration_0002", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.BULK_PROGRESS


OLD_JOIN = "FROM jobs WHERE jobs.bulk_id = b.bulk_id\n"
NEW_JOIN = "FROM jobs WHERE jobs.bulk_id = b.bulk_id AND jobs.tenant = b.tenant\n"


def _bulk_progress(scoped: bool) -> str:
    view = _bulk_progress_0002()
    assert OLD_JOIN in view
    view = view.replace("CREATE VIEW", "CREATE OR REPLACE VIEW")
    return view.replace(OLD_JOIN, NEW_JOIN) if scoped else view


revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_constraint("jobs_pkey", "jobs", type_="primary")
    op.create_primary_key("jobs_pkey", "jobs", ["job_id", "tenant"])
    op.execute(_bulk_progress(scoped=True))


def downgrade() -> None:
    op.execute(_bulk_progress(scoped=False))
    op.drop_constraint("jobs_pkey", "jobs", type_="primary")
    op.create_primary_key("jobs_pkey", "jobs", ["job_id"])
