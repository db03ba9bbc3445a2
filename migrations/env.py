"""Alembic environment: online migrations against the URL given by `inferq db ...` or the settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from schemas.tables import metadata

config = context.config
target_metadata = metadata  # for autogenerate and schema comparison; revisions themselves are explicit


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from workers.settings import Settings  # plain `alembic` from the command line

    return Settings.from_env().database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url())
    try:
        with engine.connect() as connection:
            context.configure(connection=connection, target_metadata=target_metadata)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
