"""Migrations on the real server, in a scratch database (the shared `inferq` database is left alone)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect

from schemas.tables import metadata
from tests.services.factories import run_cli
from workers.db import migrate

pytestmark = pytest.mark.services


TABLES = {
    "jobs",
    "bulk_jobs",
    "api_keys",
    "api_files",
    "api_file_chunks",
    "api_batches",
    "api_requests",
    "served_models",
    "adapters",
    "job_progress",
}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_through_the_cli(scratch_database: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("INFERQ_DATABASE_URL", scratch_database)
    head = migrate.head()

    run_cli("db", "upgrade", cwd=tmp_path)  # from any cwd
    assert _tables(scratch_database) == TABLES
    assert run_cli("db", "current", cwd=tmp_path).stdout.strip() == head

    run_cli("db", "downgrade", "base", cwd=tmp_path)
    assert _tables(scratch_database) == set()
    assert migrate.current(scratch_database) is None

    run_cli("db", "upgrade", cwd=tmp_path)
    assert _tables(scratch_database) == TABLES
    assert migrate.current(scratch_database) == head


def test_migrated_schema_matches_schemas_tables(scratch_database: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    migrate.upgrade(scratch_database)
    engine = create_engine(scratch_database)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
    finally:
        engine.dispose()
    assert diff == []


def test_history_indexes_exist(scratch_database: str) -> None:
    migrate.upgrade(scratch_database)
    engine = create_engine(scratch_database)
    try:
        indexes = {ix["name"]: ix["column_names"] for ix in inspect(engine).get_indexes("jobs")}
    finally:
        engine.dispose()
    assert indexes["ix_jobs_tenant_created_at"] == ["tenant", "created_at"]
    assert indexes["ix_jobs_status"] == ["status"]
    assert indexes["ix_jobs_finished_at"] == ["finished_at"]
    assert indexes["ix_jobs_model_created_at"] == ["model", "created_at"]
