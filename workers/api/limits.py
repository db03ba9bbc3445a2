"""Per-tenant request limits of one API process: 429 in OpenAI's shape, with `Retry-After`.

Two limits, each off unless set (`INFERQ_API_TENANT_MAX_IN_FLIGHT`, `INFERQ_API_TENANT_RPM`):
- in flight: a tenant's chat and completion requests this process is answering at once (a stream counts
  until its last chunk is sent or its client leaves). A request over it is refused before its job is posted.
- requests per minute: every /v1 request of a tenant, as a token bucket (the full minute's worth at once,
  then one more every 60/RPM s); `Retry-After` says when the next one is allowed.

The key decides the tenant, so a tenant's keys share its limits. The counts live in this process only (it
keeps no state outside Kafka and PostgreSQL): N processes behind a balancer allow up to N times as much.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict

from workers.api.errors import APIError


class Slot:
    """One in-flight request's place; `release` may be called any number of times (once counts)."""

    def __init__(self, limits: TenantLimits | None, tenant: str) -> None:
        self._limits, self._tenant = limits, tenant
        self._held = limits is not None

    def release(self) -> None:
        if self._limits is not None:
            self._limits._release(self)


class TokenBuckets:
    """A token bucket of `per_minute` per name (the full minute's worth at once, then one more every
    60/per_minute s); 0: off. At most `max_names` are kept (the least recently used go first: a name
    forgotten starts again with a full bucket, so the bound costs at most one minute's allowance)."""

    def __init__(self, per_minute: int, max_names: int = 100_000) -> None:
        self.per_minute = per_minute
        self.max_names = max_names
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # name -> (tokens, at)

    def take(self, name: str, what: str) -> None:
        """Count one against `name`; 429 (naming `what`) when its bucket is empty."""
        self._use(name, what, 1.0)

    def check(self, name: str, what: str) -> None:
        """429 when `name`'s bucket is empty; counts nothing."""
        self._use(name, what, 0.0)

    def _use(self, name: str, what: str, cost: float) -> None:
        rate = self.per_minute
        if rate <= 0:
            return
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(name, (float(rate), now))
            tokens = min(float(rate), tokens + (now - at) * rate / 60.0)
            if tokens < 1.0:
                self._buckets[name] = (tokens, now)
                wait_s = (1.0 - tokens) * 60.0 / rate
                raise _too_many(
                    f"Rate limit reached for {what}: limit {rate} per minute. "
                    f"Please try again in {wait_s:.1f}s.",
                    wait_s,
                    rate,
                )
            self._buckets[name] = (tokens - cost, now)
            self._buckets.move_to_end(name)
            while len(self._buckets) > self.max_names:
                self._buckets.popitem(last=False)


class TenantLimits:
    def __init__(self, max_in_flight: int = 0, requests_per_minute: int = 0) -> None:
        """0: that limit is off."""
        self.max_in_flight = max_in_flight
        self.requests_per_minute = requests_per_minute
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._rpm = TokenBuckets(requests_per_minute)

    def admit(self, tenant: str) -> None:
        """Count one request of the tenant against its requests per minute; 429 when over."""
        self._rpm.take(tenant, f"requests per minute (RPM) of tenant '{tenant}'")

    def hold(self, tenant: str) -> Slot:
        """A place among the tenant's requests in flight in this process; 429 when all are taken."""
        limit = self.max_in_flight
        if limit <= 0:
            return Slot(None, tenant)
        with self._lock:
            held = self._in_flight.get(tenant, 0)
            if held >= limit:
                raise _too_many(
                    f"Too many requests in flight for tenant '{tenant}': limit {limit} at once on this "
                    "server. Please try again when one has finished.",
                    1.0,
                    limit,
                    code="concurrency_limit_exceeded",
                )
            self._in_flight[tenant] = held + 1
        return Slot(self, tenant)

    def in_flight(self, tenant: str) -> int:
        with self._lock:
            return self._in_flight.get(tenant, 0)

    def _release(self, slot: Slot) -> None:
        with self._lock:
            if not slot._held:
                return
            slot._held = False
            left = self._in_flight.get(slot._tenant, 0) - 1
            if left > 0:
                self._in_flight[slot._tenant] = left
            else:
                self._in_flight.pop(slot._tenant, None)


def _too_many(message: str, wait_s: float, limit: int, code: str = "rate_limit_exceeded") -> APIError:
    headers = {
        "Retry-After": str(max(1, math.ceil(wait_s))),
        "x-ratelimit-limit-requests": str(limit),
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": f"{wait_s:.3f}s",
    }
    return APIError(429, message, code=code, headers=headers)
