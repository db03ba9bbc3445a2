"""Token events: per-job text deltas, coalesced so Kafka is not sent one message per token under load."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from schemas.jobs import TokenEvent, Usage

Emit = Callable[[TokenEvent, str], Any]  # sends one event of a tenant's job; returns a handle (or None)


@dataclass
class _Pending:
    attempt: int
    tenant: str  # carried in every event's headers (and, with per-tenant topics, naming its topic)
    job_id: str
    seq: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    since: float = 0.0  # monotonic time of the oldest unsent delta


class TokenStreamer:
    """Buffers deltas per job and emits a TokenEvent when the oldest one is `coalesce_s` old.

    The first event of a job goes out at the next flush, so coalescing never delays the first token.
    The last event of an attempt (finish_reason set) is emitted at once, with whatever is buffered.
    Deltas of one job concatenate exactly to its final output, since nothing is ever dropped.
    """

    def __init__(self, emit: Emit, coalesce_s: float) -> None:
        self._emit = emit
        self._coalesce_s = coalesce_s
        self._jobs: dict[str, _Pending] = {}  # by the worker's key of a job (job ids are per tenant)

    def start(self, key: str, attempt: int, tenant: str = "default", job_id: str | None = None) -> None:
        """Start a job's stream under `key` (what the other calls name it by); `job_id` (default: `key`)
        is what its events carry."""
        self._jobs[key] = _Pending(attempt=attempt, tenant=tenant, job_id=job_id or key)

    def add(self, job_id: str, text: str, token_ids: tuple[int, ...]) -> None:
        p = self._jobs[job_id]
        if not p.token_ids and not p.text:
            # the first delta of a job is due at once: coalescing must not add to time to first token
            p.since = time.monotonic() if p.seq else float("-inf")
        p.text.append(text)
        p.token_ids.extend(token_ids)

    def finish(self, job_id: str, finish_reason: str, usage: Usage) -> Any:
        """Send the attempt's last event; returns what `emit` returned for it."""
        p = self._jobs.pop(job_id, None)
        return self._send(p, finish_reason, usage) if p is not None else None

    def drop(self, job_id: str) -> None:
        """Forget a job without a final event (aborted locally; another worker redoes it)."""
        self._jobs.pop(job_id, None)

    def flush_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for p in self._jobs.values():
            if p.token_ids and (force or now - p.since >= self._coalesce_s):
                self._send(p, None, None)

    def _send(self, p: _Pending, finish_reason: str | None, usage: Usage | None) -> Any:
        sent = self._emit(
            TokenEvent(
                job_id=p.job_id,
                attempt=p.attempt,
                seq=p.seq,
                text="".join(p.text),
                token_ids=list(p.token_ids),
                finish_reason=finish_reason,
                usage=usage,
            ),
            p.tenant,
        )
        p.seq += 1
        p.text.clear()
        p.token_ids.clear()
        return sent
