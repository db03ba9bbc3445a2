"""A tenant's topics, and the Kafka ACLs that make per-tenant topics a proof of who posted a job.

With per-tenant topics a worker believes the tenant a topic names. That holds because the broker lets only
that tenant's principal write there: the ACLs below (and a broker with an authorizer, where principals
without an ACL are denied). Each tenant T gets, on its own topics only:
- Write and Describe on `<prefix>.tenant.T.jobs.{high,normal,low}` and `<prefix>.tenant.T.control`;
- Read and Describe on `<prefix>.tenant.T.tokens` and `<prefix>.tenant.T.results`;
- Read on consumer groups named `<prefix>.tenant.T.…` (a prefixed pattern: groups it may make).
Literal topic patterns, so T can neither write its own tokens or results (what its consumers trust came
from a worker) nor read its own jobs; tenant names hold no dot, so no tenant's prefix covers another's.
The workers' principal may be given Read, Write, Describe and DescribeConfigs (a result is checked against
`max.message.bytes`) on every topic under the tenant's prefix (`worker_principal`); a deployment may
instead make it a super user.
"""

from __future__ import annotations

from dataclasses import dataclass

from kafka import KafkaAdminClient
from kafka.admin import (
    ACL,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourcePattern,
    ResourceType,
)

from schemas.topics import PRIORITY_CLASSES, Topics
from workers.kafka_io.admin import ensure_topics
from workers.settings import KafkaConnection

ANY_HOST = "*"


@dataclass(frozen=True)
class Grant:
    """One ACL, as `inferq tenant add` reports it."""

    principal: str
    operation: str  # READ, WRITE, DESCRIBE
    resource: str  # TOPIC, GROUP
    name: str
    pattern: str  # LITERAL, PREFIXED

    def acl(self) -> ACL:
        return ACL(
            principal=self.principal,
            host=ANY_HOST,
            operation=ACLOperation[self.operation],
            permission_type=ACLPermissionType.ALLOW,
            resource_pattern=ResourcePattern(
                ResourceType[self.resource], self.name, ACLResourcePatternType[self.pattern]
            ),
        )

    def __str__(self) -> str:
        where = f"{self.resource.lower()} {self.name} ({self.pattern.lower()})"
        return f"{self.principal}: {self.operation} on {where}"


def tenant_grants(
    topics: Topics, tenant: str, principal: str, worker_principal: str | None = None
) -> list[Grant]:
    """The ACLs of one tenant (see the module's doc)."""
    posts = [topics.tenant_jobs(tenant, p) for p in PRIORITY_CLASSES] + [topics.tenant_control(tenant)]
    reads = [topics.tenant_tokens(tenant), topics.tenant_results(tenant)]
    grants = [Grant(principal, op, "TOPIC", t, "LITERAL") for t in posts for op in ("WRITE", "DESCRIBE")]
    grants += [Grant(principal, op, "TOPIC", t, "LITERAL") for t in reads for op in ("READ", "DESCRIBE")]
    grants.append(Grant(principal, "READ", "GROUP", topics.tenant_prefix(tenant), "PREFIXED"))
    if worker_principal:
        prefix = topics.tenant_prefix(tenant)
        ops = ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")  # configs: results are sized to fit
        grants += [Grant(worker_principal, op, "TOPIC", prefix, "PREFIXED") for op in ops]
    return grants


def add_tenant(
    conn: KafkaConnection,
    topics: Topics,
    tenant: str,
    principal: str,
    *,
    worker_principal: str | None = None,
    jobs_partitions: int = 4,
    stream_partitions: int = 4,
    replication_factor: int = 1,
) -> list[str]:
    """Create a tenant's topics (existing ones are left as they are) and its ACLs (creating one that
    exists changes nothing); what was done, for the operator. Needs a principal allowed to create topics
    and ACLs (a super user)."""
    counts = topics.tenant_partitions(tenant, jobs_partitions, stream_partitions)
    done = ensure_topics(conn, counts, replication_factor)
    grants = tenant_grants(topics, tenant, principal, worker_principal)
    with KafkaAdminClient(**conn.client_options(), client_id="inferq-tenants") as admin:
        outcome = admin.create_acls([g.acl() for g in grants])
    failed = outcome.get("failed") or []
    if failed:
        reasons = "; ".join(f"{acl}: {error}" for acl, error in failed)
        raise RuntimeError(f"the broker refused {len(failed)} of tenant {tenant}'s ACLs: {reasons}")
    return done + [f"allowed {g}" for g in grants]
