"""Migration 0005 (the jobs row's `choices`), on the real server in a scratch database."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, inspect
from sqlalchemy.dialects.postgresql import JSONB

from workers.db import migrate

pytestmark = pytest.mark.services


def _columns(url: str) -> dict[str, object]:
    engine = create_engine(url)
    try:
        return {c["name"]: c["type"] for c in inspect(engine).get_columns("jobs")}
    finally:
        engine.dispose()


def test_choices_column_comes_and_goes_with_0005(scratch_database: str) -> None:
    migrate.upgrade(scratch_database, "0004")
    assert "choices" not in _columns(scratch_database)
    migrate.upgrade(scratch_database, "0005")
    assert isinstance(_columns(scratch_database)["choices"], JSONB)
    migrate.downgrade(scratch_database, "0004")
    assert "choices" not in _columns(scratch_database)
