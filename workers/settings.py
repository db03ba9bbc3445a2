"""Settings: the one place that reads environment variables.

Defaults point at the local services of `inferq up`, so the same code runs against a production cluster
by setting INFERQ_KAFKA / INFERQ_DATABASE_URL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from schemas.topics import Topics

REPO_ROOT = Path(__file__).resolve().parent.parent

KAFKA_PORT = 19092
KAFKA_CONTROLLER_PORT = 19093
POSTGRES_PORT = 15432


def _state_dir() -> Path:
    return Path(os.environ.get("INFERQ_STATE_DIR", REPO_ROOT / ".state")).resolve()


def _cache_dir() -> Path:
    # shared by checkouts, outside the repo: the Kafka jars fetched by `inferq up`
    return Path(os.environ.get("INFERQ_CACHE", Path.home() / ".cache" / "inferq")).resolve()


@dataclass(frozen=True)
class Settings:
    kafka: str = f"127.0.0.1:{KAFKA_PORT}"
    database_url: str = f"postgresql+psycopg2://postgres@127.0.0.1:{POSTGRES_PORT}/inferq"
    topic_prefix: str = "inferq"
    celery_broker: str = ""  # empty: the project's PostgreSQL through SQLAlchemy
    retention_days: float = 30.0  # bulk maintenance purges finished jobs and bulk jobs older than this
    state_dir: Path = field(default_factory=_state_dir)
    cache_dir: Path = field(default_factory=_cache_dir)

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix)

    @property
    def celery_broker_url(self) -> str:
        return self.celery_broker or "sqla+" + self.database_url

    @classmethod
    def from_env(cls) -> Settings:
        env = os.environ
        defaults = cls()
        return cls(
            kafka=env.get("INFERQ_KAFKA", defaults.kafka),
            database_url=env.get("INFERQ_DATABASE_URL", defaults.database_url),
            topic_prefix=env.get("INFERQ_TOPIC_PREFIX", defaults.topic_prefix),
            celery_broker=env.get("INFERQ_CELERY_BROKER", ""),
            retention_days=float(env.get("INFERQ_RETENTION_DAYS", defaults.retention_days)),
            state_dir=_state_dir(),
            cache_dir=_cache_dir(),
        )
