"""The one wall clock of job timings and rows: timezone-aware UTC (PostgreSQL stores timestamptz)."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)
