"""Kafka topic names of the contract (prefix configurable, default `inferq`).

With per-tenant topics (`tenants=True`, the operator setting INFERQ_TENANT_TOPICS) every tenant T has
its own `<prefix>.tenant.T.jobs.{high,normal,low}` and `<prefix>.tenant.T.control` to post to and its own
`<prefix>.tenant.T.tokens` and `<prefix>.tenant.T.results` to read, all under the one name prefix
`<prefix>.tenant.T.` that Kafka ACLs grant to T's principal (see workers/kafka_io/tenants.py). Workers then
read only tenant topics, and a job's tenant is the one its topic names, whatever the message says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

Partition = tuple[str, int]  # topic, partition
Coordinates = tuple[str, int, int]  # topic, partition, offset: where one record is

PRIORITY_CLASSES = ("high", "normal", "low")
# A tenant's name inside topic names: no dot, so no tenant's name prefix can cover another's topics
# (with dots, tenant `a`'s prefix `inferq.tenant.a.` would also cover tenant `a.jobs`).
TENANT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_tenant_name(tenant: str) -> str:
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant {tenant!r}: with per-tenant topics a tenant is 1-64 of A-Z a-z 0-9 _ -")
    return tenant


@dataclass(frozen=True)
class Topics:
    prefix: str = "inferq"
    tenants: bool = False  # per-tenant job, control, tokens and results topics (see the module's doc)

    def jobs(self, priority: str) -> str:
        if priority not in PRIORITY_CLASSES:
            raise ValueError(f"unknown priority {priority!r}; expected one of {PRIORITY_CLASSES}")
        return f"{self.prefix}.jobs.{priority}"

    @property
    def all_jobs(self) -> tuple[str, ...]:
        return tuple(self.jobs(p) for p in PRIORITY_CLASSES)

    @property
    def control(self) -> str:
        return f"{self.prefix}.control"

    @property
    def tokens(self) -> str:
        return f"{self.prefix}.tokens"

    @property
    def results(self) -> str:
        return f"{self.prefix}.results"

    @property
    def batches(self) -> str:
        """The HTTP API's Batch lifecycle events (batch.completed, .failed, .expired, .cancelled)."""
        return f"{self.prefix}.batches"

    @property
    def dlq(self) -> str:
        return f"{self.prefix}.dlq"

    # ---- per-tenant topics -------------------------------------------------------------------------
    @property
    def tenant_root(self) -> str:
        """What every tenant topic's name starts with."""
        return f"{self.prefix}.tenant."

    def tenant_prefix(self, tenant: str) -> str:
        """The name prefix of all of one tenant's topics (and of its consumer groups): what ACLs grant."""
        return f"{self.tenant_root}{check_tenant_name(tenant)}."

    def tenant_jobs(self, tenant: str, priority: str) -> str:
        if priority not in PRIORITY_CLASSES:
            raise ValueError(f"unknown priority {priority!r}; expected one of {PRIORITY_CLASSES}")
        return f"{self.tenant_prefix(tenant)}jobs.{priority}"

    def tenant_control(self, tenant: str) -> str:
        return f"{self.tenant_prefix(tenant)}control"

    def tenant_tokens(self, tenant: str) -> str:
        return f"{self.tenant_prefix(tenant)}tokens"

    @property
    def tokens_template(self) -> str:
        """The tokens topic with `{tenant}` where a per-tenant topic names its tenant (the token relay
        fills it in per event); the shared topic without per-tenant topics."""
        return f"{self.tenant_root}{{tenant}}.tokens" if self.tenants else self.tokens

    def tenant_results(self, tenant: str) -> str:
        return f"{self.tenant_prefix(tenant)}results"

    def tenant_partitions(self, tenant: str, jobs: int = 4, stream: int = 4) -> dict[str, int]:
        """Topic → partition count of one tenant's topics (`inferq tenant add` creates them)."""
        counts = {self.tenant_jobs(tenant, p): jobs for p in PRIORITY_CLASSES}
        counts.update({self.tenant_control(tenant): 1, self.tenant_tokens(tenant): stream})
        counts[self.tenant_results(tenant)] = stream
        return counts

    @property
    def tenant_intake_pattern(self) -> str:
        """Regex of every tenant's jobs and control topics: what workers subscribe to."""
        classes = "|".join(PRIORITY_CLASSES)
        return rf"^{re.escape(self.tenant_root)}[A-Za-z0-9_-]{{1,64}}\.(jobs\.({classes})|control)$"

    @property
    def tenant_control_pattern(self) -> str:
        return rf"^{re.escape(self.tenant_root)}[A-Za-z0-9_-]{{1,64}}\.control$"

    def tenant_of(self, topic: str) -> str | None:
        """The tenant a per-tenant topic belongs to; None for a shared topic."""
        if not topic.startswith(self.tenant_root):
            return None
        tenant, dot, _ = topic[len(self.tenant_root) :].partition(".")
        return tenant if dot and TENANT_NAME.fullmatch(tenant) else None

    # ---- where a tenant's messages go ----------------------------------------------------------------
    def tokens_for(self, tenant: str) -> str:
        return self.tenant_tokens(tenant) if self.tenants else self.tokens

    def results_for(self, tenant: str) -> str:
        return self.tenant_results(tenant) if self.tenants else self.results

    def jobs_for(self, tenant: str, priority: str) -> str:
        return self.tenant_jobs(tenant, priority) if self.tenants else self.jobs(priority)

    def control_for(self, tenant: str) -> str:
        return self.tenant_control(tenant) if self.tenants else self.control

    # ---- what a topic is -------------------------------------------------------------------------
    def is_control(self, topic: str) -> bool:
        tenant = self.tenant_of(topic)
        return topic == (self.tenant_control(tenant) if tenant is not None else self.control)

    def is_jobs(self, topic: str) -> bool:
        try:
            self.priority_of(topic)
        except ValueError:
            return False
        return True

    def priority_of(self, topic: str) -> str:
        tenant = self.tenant_of(topic)
        for p in PRIORITY_CLASSES:
            if topic == (self.tenant_jobs(tenant, p) if tenant is not None else self.jobs(p)):
                return p
        raise ValueError(f"{topic!r} is not a jobs topic of prefix {self.prefix!r}")

    def partitions(self, jobs: int = 4, stream: int = 4) -> dict[str, int]:
        """Topic → partition count that `inferq up` creates: `jobs` per jobs topic (workers share a class by
        its partitions), `stream` for tokens and results; control and the DLQ keep one (order matters)."""
        counts = {t: jobs for t in self.all_jobs}
        counts.update({self.control: 1, self.tokens: stream, self.results: stream, self.dlq: 1})
        return counts
