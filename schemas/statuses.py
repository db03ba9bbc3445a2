"""Job and bulk job statuses of the contract: plain tuples, importable without SQLAlchemy or pydantic (the
command line lists them in --help)."""

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "rejected", "cancelled", "expired")
TERMINAL_STATUSES = ("succeeded", "failed", "rejected", "cancelled", "expired")
BULK_STATUSES = ("validating", "submitting", "running", "finalizing", "completed", "cancelled", "failed")
