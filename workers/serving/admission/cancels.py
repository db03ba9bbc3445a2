"""Cancels: durable, tenant-scoped, and free of races with admission.

A cancel reaches a worker three ways, and any one of them is enough:
- the control topic read by the group (one worker owns its partition): the cancel is written to the
  jobs row (`cancel_requested_at`, or a `cancelled` row when nobody has the job yet), and only then is
  its offset committed, so no cancel is lost while workers restart;
- the control topic read by every worker from its end: the owner of a running job aborts it at once, and
  every worker remembers recent cancels so a job admitted just after its cancel arrived never runs;
- the persister's periodic look-up of recorded cancels among the jobs a worker runs.
Admission also refuses to start a job whose row holds a cancel. Only the tenant that owns a job can
cancel it: a cancel names (tenant, job_id), and with per-tenant topics its tenant is its topic's.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from schemas.job_key import JobKey
from schemas.jobs import CancelRequest
from schemas.topics import Topics
from schemas.validation import InvalidMessage, Limits, parse_control
from workers.kafka_io import Record

REMEMBER_S = 600.0  # how long a broadcast cancel is remembered for jobs not seen yet
MAX_REMEMBERED = 100_000


def parse(record: Record, limits: Limits, topics: Topics) -> CancelRequest | str:
    """The cancel a control record asks for, or why it is refused. With per-tenant topics its tenant is
    the topic's: a cancel that names another tenant is refused."""
    if record.undecodable:
        return record.undecodable
    try:
        cancel = parse_control(record.value, limits)
    except InvalidMessage as exc:
        return f"not a valid control message: {exc}"
    tenant = topics.tenant_of(record.topic) if topics.tenants else None
    if tenant is None:
        return cancel
    if "tenant" in cancel.model_fields_set and cancel.tenant != tenant:
        return (
            f"tenant {cancel.tenant!r} does not match the topic's tenant {tenant!r}: a tenant cancels "
            "only its own jobs"
        )
    return cancel.model_copy(update={"tenant": tenant})


class RecentCancels:
    """The jobs of cancels seen lately, bounded in time and count."""

    def __init__(self) -> None:
        self._seen: OrderedDict[JobKey, float] = OrderedDict()

    def add(self, key: JobKey) -> None:
        self._expire()
        self._seen[key] = time.monotonic() + REMEMBER_S
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_REMEMBERED:
            self._seen.popitem(last=False)

    def __contains__(self, key: JobKey) -> bool:
        self._expire()
        return key in self._seen

    def _expire(self) -> None:
        now = time.monotonic()
        while self._seen:
            key, until = next(iter(self._seen.items()))
            if until > now:
                return
            del self._seen[key]
