"""Shared fixtures: settings, a database engine, scratch databases, and the `services` rule.

Tests marked `services` use the real Kafka and PostgreSQL of `inferq up` (`bash dev.sh test` starts them).
When those are down such tests FAIL with a message saying so; they never skip, so a CI run without
services cannot pass by running nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from hypothesis import settings as hypothesis_settings

from workers.settings import Settings

# Property tests check logic, not speed: on a loaded 2-core machine per-example deadlines only add flakes.
hypothesis_settings.register_profile("inferq", deadline=None)
hypothesis_settings.load_profile("inferq")


@pytest.fixture(scope="session")
def settings() -> Settings:
    return Settings.from_env()


@pytest.fixture(scope="session")
def services_up(settings: Settings) -> None:
    from workers.services import manager

    down = [s for s in manager.status(settings) if not s.healthy]
    if down:
        names = ", ".join(f"{s.name} at {s.address}" for s in down)
        pytest.fail(
            f"services down: {names}. Start them with `inferq up` (or run `bash dev.sh test`).", pytrace=False
        )


@pytest.fixture(autouse=True)
def _require_services(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("services"):
        request.getfixturevalue("services_up")


@pytest.fixture(scope="session")
def db_engine(settings: Settings, services_up: None):
    """An engine on the shared, migrated database. Other people use it too: use unique keys, clean up."""
    from sqlalchemy import create_engine

    engine = create_engine(settings.database_url, pool_pre_ping=True)
    yield engine
    engine.dispose()


@pytest.fixture
def scratch_database(settings: Settings, services_up: None) -> Iterator[str]:
    """The URL of a new, empty database on the same server, dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"inferq_scratch_{uuid.uuid4().hex[:12]}"
    admin = create_engine(
        make_url(settings.database_url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(settings.database_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
