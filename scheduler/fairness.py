"""Tenant fairness by tokens served (virtual time): the tenant served least goes first."""

from __future__ import annotations


class TenantLedger:
    """Tokens served per tenant, and which tenants have live (waiting or running) sequences.

    A tenant that becomes active again starts no lower than the least-served active tenant, so idle time
    cannot be banked as credit and a newcomer cannot monopolise the batch to "catch up".
    """

    def __init__(self) -> None:
        self._served: dict[str, int] = {}
        self._live: dict[str, int] = {}  # tenant -> number of live sequences

    def join(self, tenant: str) -> None:
        """A sequence of this tenant entered the scheduler."""
        count = self._live.get(tenant, 0)
        if count == 0:
            floor = min((self._served[t] for t in self._live), default=None)
            own = self._served.get(tenant, 0)
            self._served[tenant] = own if floor is None else max(own, floor)
        self._live[tenant] = count + 1

    def leave(self, tenant: str) -> None:
        """A sequence of this tenant ended."""
        count = self._live[tenant] - 1
        if count:
            self._live[tenant] = count
        else:
            del self._live[tenant]

    def charge(self, tenant: str, num_tokens: int) -> None:
        self._served[tenant] = self._served.get(tenant, 0) + num_tokens

    def served(self, tenant: str) -> int:
        return self._served.get(tenant, 0)

    def is_live(self, tenant: str) -> bool:
        return tenant in self._live
