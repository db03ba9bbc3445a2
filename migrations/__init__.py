"""Alembic migrations of the job history tables; run them with `inferq db upgrade` (also run by `up`)."""
