"""Tenant fairness by tokens served (virtual time): the tenant served least goes first."""

from __future__ import annotations


class TenantLedger:
    """Tokens served per tenant, and which tenants have live (waiting or running) sequences.

    A tenant that becomes active again starts no lower than the least-served active tenant, so idle time
    cannot be banked as credit and a newcomer cannot monopolise the batch to "catch up".

    Idle tenants are forgotten, so the ledger stays bounded however many tenants come and go: one served
    no more than the least-served live tenant at once (it would rejoin at that floor anyway), and, beyond
    `max_idle` idle tenants, the least-served of them (those whose standing matters least).
    """

    def __init__(self, max_idle: int = 10_000) -> None:
        self._served: dict[str, int] = {}
        self._live: dict[str, int] = {}  # tenant -> number of live sequences
        self._max_idle = max_idle

    def join(self, tenant: str) -> None:
        """A sequence of this tenant entered the scheduler."""
        count = self._live.get(tenant, 0)
        if count == 0:
            floor = self._floor()
            own = self._served.get(tenant, 0)
            self._served[tenant] = own if floor is None else max(own, floor)
        self._live[tenant] = count + 1

    def leave(self, tenant: str) -> None:
        """A sequence of this tenant ended."""
        count = self._live[tenant] - 1
        if count:
            self._live[tenant] = count
            return
        del self._live[tenant]
        floor = self._floor()
        if floor is not None and self._served.get(tenant, 0) <= floor:
            del self._served[tenant]
        elif len(self._served) - len(self._live) > self._max_idle:
            self._forget_least_served_idle()

    def _floor(self) -> int | None:
        return min((self._served[t] for t in self._live), default=None)

    def _forget_least_served_idle(self) -> None:
        """Down to half the idle allowance at once, so the sort is paid once per max_idle/2 departures."""
        idle = sorted((served, t) for t, served in self._served.items() if t not in self._live)
        for _, t in idle[: len(idle) - self._max_idle // 2]:
            del self._served[t]

    def tracked(self) -> int:
        """Tenants the ledger holds (live and idle): bounded by the live ones plus `max_idle`."""
        return len(self._served)

    def charge(self, tenant: str, num_tokens: int) -> None:
        self._served[tenant] = self._served.get(tenant, 0) + num_tokens

    def served(self, tenant: str) -> int:
        return self._served.get(tenant, 0)

    def is_live(self, tenant: str) -> bool:
        return tenant in self._live
