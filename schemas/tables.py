"""SQLAlchemy table definitions of the contract. Migrations in migrations/ create exactly these."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from schemas.statuses import BULK_STATUSES, JOB_STATUSES, TERMINAL_STATUSES

__all__ = [
    "BULK_STATUSES",
    "JOB_STATUSES",
    "TERMINAL_STATUSES",
    "adapters",
    "api_batches",
    "api_file_chunks",
    "api_files",
    "api_keys",
    "api_requests",
    "bulk_jobs",
    "job_progress",
    "jobs",
    "metadata",
    "served_models",
]


metadata = MetaData()

jobs = Table(
    "jobs",
    metadata,
    # the key is (job_id, tenant): job ids are scoped by tenant (two tenants may use the same id)
    Column("job_id", String(128), primary_key=True),
    Column("tenant", String(128), primary_key=True, server_default="default"),
    Column("priority", String(16), nullable=False),  # high | normal | low
    Column("status", String(16), nullable=False),  # one of JOB_STATUSES
    Column("prompt", Text),
    Column("params", JSONB),  # the request as received (sampling parameters, stop, metadata)
    Column("output_text", Text),
    # OpenAI-style choices [{index, text, finish_reason, logprobs}] of a job with n > 1 or logprobs;
    # NULL for one sample without logprobs (its output_text and finish_reason say it all)
    Column("choices", JSONB),
    Column("finish_reason", String(32)),
    Column("prompt_tokens", Integer),
    Column("completion_tokens", Integer),
    Column("cached_tokens", Integer),  # prompt tokens served from the prefix cache (NULL: not known)
    Column("attempts", Integer, nullable=False, server_default="0"),
    # the consumer-group generation the current attempt's record was fetched in (0: not known)
    Column("admitted_generation", Integer, nullable=False, server_default="0"),
    Column("worker_id", String(128)),
    Column("bulk_id", String(64)),
    # the model that served the job: the base's (first served) name or the adapter's; for a rejected job,
    # the name it asked for
    Column("model", String(256)),
    Column("error", Text),
    Column("source_topic", String(255)),
    Column("source_partition", Integer),
    Column("source_offset", BigInteger),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("queued_at", DateTime(timezone=True)),  # when a worker took it off Kafka
    Column("started_at", DateTime(timezone=True)),  # first scheduled
    Column("first_token_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
    Column("ttft_ms", Float),
    Column("mean_itl_ms", Float),
    Column("e2e_ms", Float),
    Column("queue_ms", Float),
    Column("updated_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    # Outbox: a terminal row whose result is not on the results topic yet has published_at NULL.
    Column("published_at", DateTime(timezone=True)),
    Column("publisher", String(128)),  # the worker publishing the result, while published_at is NULL
    Column("publish_lease_until", DateTime(timezone=True)),  # its claim; renewed before every try
    Column("cancel_requested_at", DateTime(timezone=True)),  # a cancel that arrived while not terminal
    # what history queries filter on: one tenant over a time range, a status, recent completions, a bulk job
    Index("ix_jobs_tenant_created_at", "tenant", "created_at"),
    Index("ix_jobs_status", "status"),
    Index("ix_jobs_finished_at", "finished_at"),
    Index("ix_jobs_bulk_id", "bulk_id"),
    Index("ix_jobs_model_created_at", "model", "created_at"),  # one model's (an adapter's) history
    Index(
        "ix_jobs_unpublished",
        "finished_at",
        postgresql_where=text(f"published_at IS NULL AND status IN {TERMINAL_STATUSES}"),
    ),
)

# A running job's generated tokens, saved as it goes (one row per save of a sample: insert-only), so its
# next attempt resumes from them; deleted with its terminal row's write (workers/db/progress.py).
job_progress = Table(
    "job_progress",
    metadata,
    Column("job_id", String(128), primary_key=True),
    Column("tenant", String(128), primary_key=True),
    Column("sample", Integer, primary_key=True),  # the choice's index (0 unless n > 1)
    Column("attempt", Integer, primary_key=True),  # the attempt that generated these tokens
    Column("position", Integer, primary_key=True),  # where token_ids start in the sample's output
    Column("token_ids", ARRAY(Integer), nullable=False),
    Column("text", Text, nullable=False),  # what these tokens added to the sample's text
    Column("fingerprint", String(64), nullable=False),  # the model and tokenizer that generated them
    Column("finish_reason", String(32)),  # on a sample's last chunk, once it ended (its job goes on)
    Column("saved_at", DateTime(timezone=True), nullable=False),
)

bulk_jobs = Table(
    "bulk_jobs",
    metadata,
    Column("bulk_id", String(64), primary_key=True),
    Column("tenant", String(128), nullable=False, server_default="default"),
    Column("priority", String(16), nullable=False, server_default="low"),
    Column("status", String(16), nullable=False),  # one of BULK_STATUSES
    Column("endpoint", String(64)),  # /v1/completions | /v1/chat/completions
    Column("input_path", Text),
    Column("output_path", Text),
    Column("error_path", Text),
    Column("total_lines", Integer, nullable=False, server_default="0"),
    Column("invalid_lines", Integer, nullable=False, server_default="0"),
    Column("submitted_lines", Integer, nullable=False, server_default="0"),
    Column("error", Text),
    Column("metadata", JSONB),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
)

# ---- the HTTP API (workers/api/): keys, OpenAI Files and Batches -------------------------------------------
api_keys = Table(
    "api_keys",
    metadata,
    Column("key_id", String(40), primary_key=True),  # shown by `inferq api-key list`; not a secret
    Column("tenant", String(128), nullable=False),
    Column("name", String(128)),
    Column(
        "key_hash", String(64), nullable=False, unique=True
    ),  # sha256 hex of the key; the key is shown once
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("revoked_at", DateTime(timezone=True)),
)

api_files = Table(
    "api_files",
    metadata,
    Column("file_id", String(40), primary_key=True),
    Column("tenant", String(128), nullable=False),
    Column("purpose", String(32), nullable=False),  # batch (uploaded) | batch_output (written by a batch)
    Column("filename", Text, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("expires_at", DateTime(timezone=True)),  # no longer served from then on, and deleted; NULL: never
    # uploading: its chunks are being written (no reader sees it); processed: complete
    Column("status", String(16), nullable=False, server_default="processed"),
    Index("ix_api_files_tenant_created_at", "tenant", "created_at"),
    Index("ix_api_files_expires_at", "expires_at", postgresql_where=text("expires_at IS NOT NULL")),
)

FILE_CHUNK_BYTES = 1024 * 1024  # every chunk of a file but its last holds exactly this many bytes

# A file's content in order, in chunks of FILE_CHUNK_BYTES: in PostgreSQL, so any API process serves
# any file, and written and read a chunk at a time, so no process holds a whole file in memory.
api_file_chunks = Table(
    "api_file_chunks",
    metadata,
    Column("file_id", String(40), ForeignKey("api_files.file_id", ondelete="CASCADE"), primary_key=True),
    Column("seq", Integer, primary_key=True),
    Column("data", LargeBinary, nullable=False),
)

api_batches = Table(
    "api_batches",
    metadata,
    Column("batch_id", String(64), primary_key=True),  # also jobs.bulk_id of its lines' jobs
    Column("tenant", String(128), nullable=False),
    Column("topic_prefix", String(128), nullable=False),  # the deployment whose API processes advance it
    # validating | in_progress | finalizing | completed | failed | expired | cancelling | cancelled
    Column("status", String(16), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(40), nullable=False),
    Column("completion_window", String(8), nullable=False),
    Column("output_file_id", String(40)),
    Column("error_file_id", String(40)),
    Column("errors", JSONB),  # OpenAI's `errors.data` of a batch that failed validation
    Column("metadata", JSONB),
    Column("total", Integer, nullable=False, server_default="0"),  # request_counts.total: the valid lines
    Column("submitted", Integer, nullable=False, server_default="0"),  # lines handed to Kafka (a checkpoint)
    # where the line after the last submitted one starts in the input file: production resumes there
    Column("input_offset", BigInteger, nullable=False, server_default="0"),
    Column("model", String(256)),  # the model its lines name (the first line's), else the served one
    Column("usage", JSONB),  # OpenAI's Batch `usage` once its files are written (before: from its jobs)
    Column("final_counts", JSONB),  # request_counts once the files are written
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Column("in_progress_at", DateTime(timezone=True)),
    Column("finalizing_at", DateTime(timezone=True)),
    Column("completed_at", DateTime(timezone=True)),
    Column("failed_at", DateTime(timezone=True)),
    Column("expired_at", DateTime(timezone=True)),
    Column("cancelling_at", DateTime(timezone=True)),
    Column("cancelled_at", DateTime(timezone=True)),
    Column("cancels_sent_at", DateTime(timezone=True)),  # its unfinished jobs were sent a cancel
    Column("event_published_at", DateTime(timezone=True)),  # its terminal event is on the batches topic
    Column("output_expires_after", Integer),  # seconds its output and error files live; NULL: no end
    Index("ix_api_batches_tenant_created_at", "tenant", "created_at"),
    Index("ix_api_batches_open", "topic_prefix", "status"),
)

# ---- the fleet's LoRA adapters (`inferq adapter add|list|remove`) ------------------------------------------
adapters = Table(
    "adapters",
    metadata,
    Column("name", String(128), primary_key=True),  # what a job's `model` names (schemas/adapters.py)
    Column("path", Text, nullable=False),  # a PEFT directory every worker can read (a shared volume)
    Column("tenant", String(128)),  # the only tenant whose jobs may name it; NULL: every tenant's
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_adapters_tenant", "tenant"),
)

# Requests a retry reattaches to instead of posting another job: an `Idempotency-Key` (request_key
# "key:<key>", written before its job is posted), or an SDK's retry of a request answered without its result
# (a 504: request_key "retry:<fingerprint>", written when that answer is sent).
api_requests = Table(
    "api_requests",
    metadata,
    Column("tenant", String(128), primary_key=True),
    Column("request_key", String(300), primary_key=True),
    Column("fingerprint", String(64), nullable=False),  # sha256 of the endpoint and the body
    Column("job_id", String(128), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_api_requests_expires_at", "expires_at"),
)

# ---- the fleet -------------------------------------------------------------------------------------------
# Each live worker's model: written at start, its heartbeat renewed while it runs, removed at a graceful
# stop; a row whose heartbeat is old belongs to a worker that died (ignored, and removed by the next start).
served_models = Table(
    "served_models",
    metadata,
    Column("worker_id", String(128), primary_key=True),
    Column("topic_prefix", String(128), nullable=False),  # the deployment whose topics it reads
    Column("model", String(256), nullable=False),  # its served model name (`--served-model-name`)
    Column("max_model_len", Integer),
    Column("started_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False, server_default=func.now()),
    Index("ix_served_models_prefix", "topic_prefix", "heartbeat_at"),
)
