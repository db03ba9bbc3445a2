"""Alembic, run programmatically, so `inferq db ...` works from any cwd and from an installed package."""

from __future__ import annotations

from pathlib import Path

import migrations

MIGRATIONS_DIR = Path(migrations.__file__).resolve().parent


def _config(url: str):
    from alembic.config import Config

    cfg = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = url  # not set_main_option: ConfigParser would expand a '%' in a password
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(_config(url), revision)


def downgrade(url: str, revision: str = "-1") -> None:
    from alembic import command

    command.downgrade(_config(url), revision)


def current(url: str) -> str | None:
    """The database's revision, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_config("")).get_current_head()
