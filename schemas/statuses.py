"""Job and bulk job statuses of the contract: plain tuples, importable without SQLAlchemy or pydantic (the
command line lists them in --help)."""

JOB_STATUSES = ("queued", "running", "succeeded", "failed", "rejected", "cancelled", "expired")
TERMINAL_STATUSES = ("succeeded", "failed", "rejected", "cancelled", "expired")
BULK_STATUSES = ("validating", "submitting", "running", "finalizing", "completed", "cancelled", "failed")
BULK_FINISHED_STATUSES = ("completed", "cancelled", "failed")
BULK_OPEN_STATUSES = tuple(s for s in BULK_STATUSES if s not in BULK_FINISHED_STATUSES)

# Engine finish reasons → the job status stored and published.
STATUS_OF_FINISH = {
    "stop": "succeeded",
    "length": "succeeded",
    "tool_calls": "succeeded",
    "abort": "cancelled",
    "expired": "expired",
    "rejected": "rejected",
}
