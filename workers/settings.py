"""Settings: the one place that reads environment variables.

Defaults point at the local services of `inferq up`, so the same code runs against a production cluster
by setting INFERQ_KAFKA / INFERQ_DATABASE_URL (and the INFERQ_KAFKA_SECURITY_* / SASL / SSL variables).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from schemas.topics import Topics

REPO_ROOT = Path(__file__).resolve().parent.parent

KAFKA_PORT = 19092
KAFKA_CONTROLLER_PORT = 19093
POSTGRES_PORT = 15432
POSTGRES_PASSWORD_FILE = "postgres-password"  # in the state dir, mode 0600, written by `inferq up`

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")

# Every environment variable inferq reads, all of them here: compose files and images are checked against it.
ENV_VARIABLES = (
    "INFERQ_KAFKA",
    "INFERQ_KAFKA_SECURITY_PROTOCOL",
    "INFERQ_KAFKA_SASL_MECHANISM",
    "INFERQ_KAFKA_SASL_USERNAME",
    "INFERQ_KAFKA_SASL_PASSWORD",
    "INFERQ_KAFKA_SSL_CAFILE",
    "INFERQ_KAFKA_SSL_CERTFILE",
    "INFERQ_KAFKA_SSL_KEYFILE",
    "INFERQ_KAFKA_COMPRESSION",
    "INFERQ_DATABASE_URL",
    "INFERQ_TOPIC_PREFIX",
    "INFERQ_TENANT_TOPICS",
    "INFERQ_JOBS_PARTITIONS",
    "INFERQ_STREAM_PARTITIONS",
    "INFERQ_TOPIC_REPLICATION_FACTOR",
    "INFERQ_CELERY_BROKER",
    "INFERQ_RETENTION_DAYS",
    "INFERQ_SERVED_MODEL_NAME",
    "INFERQ_METRICS_PORT",
    "INFERQ_SWITCH_INTERVAL",
    "INFERQ_STATE_DIR",
    "INFERQ_CACHE",
    "INFERQ_FAILPOINT",
    "INFERQ_API_MAX_FILE_BYTES",
    "INFERQ_API_REQUEST_TIMEOUT",
    "INFERQ_API_BATCH_WINDOW",
    "INFERQ_API_TENANT_MAX_IN_FLIGHT",
    "INFERQ_API_TENANT_RPM",
    "INFERQ_API_QUEUE_TIMEOUT",
    "INFERQ_API_GENERATION_TIMEOUT",
    "INFERQ_API_HEARTBEAT",
    "INFERQ_API_CANCEL_ON_DISCONNECT",
    "INFERQ_API_MAX_BODY_BYTES",
    "INFERQ_API_BATCH_IN_FLIGHT",
    "INFERQ_API_BAD_KEY_RPM",
)
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
# What inferq's producers compress record batches with; every one of them is read whatever this says.
COMPRESSION_TYPES = ("none", "gzip", "snappy", "lz4", "zstd")


def check_compression(compression: str) -> str:
    if compression not in COMPRESSION_TYPES:
        raise ValueError(f"INFERQ_KAFKA_COMPRESSION={compression!r}; use one of {COMPRESSION_TYPES}")
    return compression


def _state_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("INFERQ_STATE_DIR", REPO_ROOT / ".state")).resolve()


def _cache_dir(env: Mapping[str, str] | None = None) -> Path:
    # shared by checkouts, outside the repo: the Kafka jars fetched by `inferq up`, converted models
    env = os.environ if env is None else env
    return Path(env.get("INFERQ_CACHE", Path.home() / ".cache" / "inferq")).resolve()


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"expected a yes/no setting (1, 0, true, false, ...), not {text!r}")


def _optional_float(text: str | None) -> float | None:
    return float(text) if text else None


def database_url_for(url: str | None, state_dir: Path) -> str:
    """The database URL: INFERQ_DATABASE_URL, or the cluster `inferq up` runs.

    A loopback URL without a password is taken to mean that cluster, so it gets the password `inferq up`
    generated into the state dir (none before the first up). The URL's query (sslmode, ...) is kept.
    """
    url = url or f"postgresql+psycopg2://postgres@127.0.0.1:{POSTGRES_PORT}/inferq"
    parts = urlsplit(url)
    if parts.password is not None or parts.hostname not in ("127.0.0.1", "localhost"):
        return url
    try:
        password = (state_dir / POSTGRES_PASSWORD_FILE).read_text().strip()
    except OSError:
        password = ""
    if not password:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


@dataclass(frozen=True)
class KafkaSecurity:
    """How every Kafka client authenticates and encrypts; PLAINTEXT by default (local broker)."""

    protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in SECURITY_PROTOCOLS:
            raise ValueError(
                f"INFERQ_KAFKA_SECURITY_PROTOCOL={self.protocol!r}; use one of {SECURITY_PROTOCOLS}"
            )
        if self.protocol.startswith("SASL"):
            if self.sasl_mechanism not in SASL_MECHANISMS:
                raise ValueError(
                    f"INFERQ_KAFKA_SASL_MECHANISM={self.sasl_mechanism!r}; use one of {SASL_MECHANISMS}"
                )
            if not self.sasl_username or self.sasl_password is None:
                raise ValueError("SASL needs INFERQ_KAFKA_SASL_USERNAME and INFERQ_KAFKA_SASL_PASSWORD")

    def client_options(self) -> dict[str, Any]:
        """kafka-python keyword arguments (only those that apply)."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.protocol.startswith("SASL"):
            options |= {
                "sasl_mechanism": self.sasl_mechanism,
                "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password,
            }
        if self.protocol.endswith("SSL"):
            options |= {
                k: v
                for k, v in (
                    ("ssl_cafile", self.ssl_cafile),
                    ("ssl_certfile", self.ssl_certfile),
                    ("ssl_keyfile", self.ssl_keyfile),
                )
                if v
            }
        return options


@dataclass(frozen=True)
class KafkaConnection:
    """Where the brokers are and how to reach them: what every Kafka client of inferq is built from."""

    bootstrap: str
    security: KafkaSecurity = KafkaSecurity()
    compression: str = "none"  # producers only (`producer_options`)

    def __post_init__(self) -> None:
        check_compression(self.compression)

    def client_options(self) -> dict[str, Any]:
        # kafka-python backs reconnects off up to 30 s: after a broker restart a worker would sit idle that
        # long. The Java client's 1 s cap costs a reconnect a second while a broker is away, nothing more.
        return {
            "bootstrap_servers": self.bootstrap,
            "reconnect_backoff_max_ms": 1000,
            **self.security.client_options(),
        }

    def producer_options(self) -> dict[str, Any]:
        """`client_options` plus what only a producer takes."""
        compression = None if self.compression == "none" else self.compression
        return {**self.client_options(), "compression_type": compression}


@dataclass(frozen=True)
class Settings:
    kafka: str = f"127.0.0.1:{KAFKA_PORT}"  # bootstrap servers
    kafka_security: KafkaSecurity = KafkaSecurity()
    # none, gzip, snappy, lz4 or zstd: what inferq's producers (results, tokens, dead letters, clients)
    # compress with; consumers read every codec whatever this says
    kafka_compression: str = "none"
    database_url: str = f"postgresql+psycopg2://postgres@127.0.0.1:{POSTGRES_PORT}/inferq"
    topic_prefix: str = "inferq"
    # Tenant isolation: each tenant posts to and reads its own topics (`inferq tenant add` creates them and
    # their ACLs), and a job's tenant is the one its topic names. Off: the shared topics, tenant as claimed.
    tenant_topics: bool = False
    # topics `inferq up` creates (existing topics are never changed)
    jobs_partitions: int = 4
    stream_partitions: int = 4  # tokens and results
    replication_factor: int = 1
    celery_broker: str = ""  # empty: the project's PostgreSQL through SQLAlchemy
    # Finished jobs and bulk jobs older than this many days are purged by the bulk worker's beat; None (the
    # default): nothing is purged unless asked (`inferq history purge`), history is kept.
    retention_days: float | None = None
    served_model_name: str = ""  # the model name Batch responses echo and metrics carry; "": the --model spec
    metrics_port: int | None = None  # `inferq worker` serves Prometheus metrics here unless --metrics-port
    # The Kafka clients' I/O threads and the persister run Python; with the default 5 ms switch interval
    # the engine loop can wait that long for the GIL after every torch op. A short interval hands it back
    # promptly (the engine thread's GIL waits in `bench e2e` show it).
    switch_interval_s: float = 0.0001
    state_dir: Path = field(default_factory=_state_dir)
    cache_dir: Path = field(default_factory=_cache_dir)
    failpoint: str = (
        ""  # tests only: a named fault to inject (crash-before-publish, crash-after-publish, step-error)
    )
    # `inferq api`: the largest Batch input file taken (bytes), the largest other request body, and (tests) a
    # batch completion window shorter than the 24h asked for
    api_max_file_bytes: int = 200 * 1024 * 1024
    api_max_body_bytes: int = 8 * 1024 * 1024
    api_batch_window_s: float | None = None
    # How long a request waits for its job: to start (a stream's first event, else its row running), then
    # to finish; past either, 504 naming the job, which goes on and stays queryable (a retry reattaches).
    # INFERQ_API_REQUEST_TIMEOUT sets both at once (each of the two settings wins over it).
    api_queue_timeout_s: float = 600.0
    api_generation_timeout_s: float = 600.0
    api_heartbeat_s: float = 15.0  # a stream with nothing to send says so (an SSE comment) this often
    api_cancel_on_disconnect: bool = True  # a client that leaves before its answer cancels its job
    api_batch_in_flight: int = 512  # a batch's lines queued or running at once (the rest wait their turn)
    # `inferq api`, per tenant and per API process (0: off): chat/completion requests in flight at once, and
    # /v1 requests per minute; over either, 429 with Retry-After (workers/api/limits.py)
    api_tenant_max_in_flight: int = 0
    api_tenant_rpm: int = 0
    # requests with a key that is missing, unknown or revoked, per client address and minute (0: off)
    api_bad_key_rpm: int = 60

    def __post_init__(self) -> None:
        check_compression(self.kafka_compression)

    @property
    def topics(self) -> Topics:
        return Topics(self.topic_prefix, self.tenant_topics)

    @property
    def kafka_connection(self) -> KafkaConnection:
        return KafkaConnection(self.kafka, self.kafka_security, self.kafka_compression)

    def topic_partitions(self) -> dict[str, int]:
        return self.topics.partitions(self.jobs_partitions, self.stream_partitions)

    @property
    def celery_broker_url(self) -> str:
        return self.celery_broker or "sqla+" + self.database_url

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        defaults = cls()
        state_dir = _state_dir(env)
        return cls(
            kafka=env.get("INFERQ_KAFKA", defaults.kafka),
            kafka_security=KafkaSecurity(
                protocol=env.get("INFERQ_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT").upper(),
                sasl_mechanism=env.get("INFERQ_KAFKA_SASL_MECHANISM") or None,
                sasl_username=env.get("INFERQ_KAFKA_SASL_USERNAME") or None,
                sasl_password=env.get("INFERQ_KAFKA_SASL_PASSWORD"),
                ssl_cafile=env.get("INFERQ_KAFKA_SSL_CAFILE") or None,
                ssl_certfile=env.get("INFERQ_KAFKA_SSL_CERTFILE") or None,
                ssl_keyfile=env.get("INFERQ_KAFKA_SSL_KEYFILE") or None,
            ),
            kafka_compression=env.get("INFERQ_KAFKA_COMPRESSION", "none").strip().lower() or "none",
            database_url=database_url_for(env.get("INFERQ_DATABASE_URL"), state_dir),
            topic_prefix=env.get("INFERQ_TOPIC_PREFIX", defaults.topic_prefix),
            tenant_topics=_flag(env.get("INFERQ_TENANT_TOPICS", "")),
            jobs_partitions=int(env.get("INFERQ_JOBS_PARTITIONS", defaults.jobs_partitions)),
            stream_partitions=int(env.get("INFERQ_STREAM_PARTITIONS", defaults.stream_partitions)),
            replication_factor=int(env.get("INFERQ_TOPIC_REPLICATION_FACTOR", defaults.replication_factor)),
            celery_broker=env.get("INFERQ_CELERY_BROKER", ""),
            retention_days=_optional_float(env.get("INFERQ_RETENTION_DAYS")),
            served_model_name=env.get("INFERQ_SERVED_MODEL_NAME", ""),
            metrics_port=int(env["INFERQ_METRICS_PORT"]) if env.get("INFERQ_METRICS_PORT") else None,
            switch_interval_s=float(env.get("INFERQ_SWITCH_INTERVAL", defaults.switch_interval_s)),
            state_dir=state_dir,
            cache_dir=_cache_dir(env),
            failpoint=env.get("INFERQ_FAILPOINT", ""),
            api_max_file_bytes=int(env.get("INFERQ_API_MAX_FILE_BYTES", defaults.api_max_file_bytes)),
            api_max_body_bytes=int(env.get("INFERQ_API_MAX_BODY_BYTES", defaults.api_max_body_bytes)),
            api_batch_window_s=_optional_float(env.get("INFERQ_API_BATCH_WINDOW")),
            api_queue_timeout_s=float(
                env.get(
                    "INFERQ_API_QUEUE_TIMEOUT",
                    env.get("INFERQ_API_REQUEST_TIMEOUT", defaults.api_queue_timeout_s),
                )
            ),
            api_generation_timeout_s=float(
                env.get(
                    "INFERQ_API_GENERATION_TIMEOUT",
                    env.get("INFERQ_API_REQUEST_TIMEOUT", defaults.api_generation_timeout_s),
                )
            ),
            api_heartbeat_s=float(env.get("INFERQ_API_HEARTBEAT", defaults.api_heartbeat_s)),
            api_cancel_on_disconnect=_flag(env.get("INFERQ_API_CANCEL_ON_DISCONNECT", "1")),
            api_batch_in_flight=int(env.get("INFERQ_API_BATCH_IN_FLIGHT", defaults.api_batch_in_flight)),
            api_tenant_max_in_flight=int(env.get("INFERQ_API_TENANT_MAX_IN_FLIGHT", "0")),
            api_tenant_rpm=int(env.get("INFERQ_API_TENANT_RPM", "0")),
            api_bad_key_rpm=int(env.get("INFERQ_API_BAD_KEY_RPM", defaults.api_bad_key_rpm)),
        )
