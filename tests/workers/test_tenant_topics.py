"""Per-tenant topics (INFERQ_TENANT_TOPICS): names, what a worker subscribes to, and a job's tenant taken
from its topic, never from what the message claims (jobs and cancels alike)."""

from __future__ import annotations

import json
import re

import pytest

from gpu.tokenizer import ByteTokenizer
from schemas.topics import Topics
from schemas.validation import Limits
from workers.kafka_io import Record
from workers.kafka_io.tenants import tenant_grants
from workers.serving.admission import cancels
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.validation import Accepted, Intake
from workers.settings import Settings

TOPICS = Topics("inferq", tenants=True)


def record(value: dict, topic: str, offset: int = 3) -> Record:
    return Record(topic, 0, offset, b"k", json.dumps(value).encode(), 1_700_000_000_000)


def accept(value: dict, topic: str) -> Accepted | Rejected:
    return Intake(TOPICS, Limits(), ByteTokenizer(32000), 256).accept(record(value, topic))


def test_each_tenant_has_its_own_topics_under_its_own_prefix():
    assert TOPICS.tenant_jobs("acme", "high") == "inferq.tenant.acme.jobs.high"
    assert TOPICS.tenant_control("acme") == "inferq.tenant.acme.control"
    assert (TOPICS.results_for("acme"), TOPICS.tokens_for("acme")) == (
        "inferq.tenant.acme.results",
        "inferq.tenant.acme.tokens",
    )
    assert TOPICS.tokens_template.replace("{tenant}", "acme") == TOPICS.tenant_tokens("acme")
    assert all(t.startswith(TOPICS.tenant_prefix("acme")) for t in TOPICS.tenant_partitions("acme"))
    # off (the default), everything is shared as before
    shared = Topics("inferq")
    assert (shared.results_for("acme"), shared.jobs_for("acme", "low")) == (
        "inferq.results",
        "inferq.jobs.low",
    )
    assert Settings.from_env({"INFERQ_TENANT_TOPICS": "1"}).topics.tenants
    assert not Settings.from_env({}).topics.tenants


@pytest.mark.parametrize("name", ["a.jobs", "", "x" * 65, "a b", "a/b"])
def test_a_tenant_name_that_could_reach_into_another_tenants_prefix_is_refused(name):
    with pytest.raises(ValueError):
        TOPICS.tenant_prefix(name)


def test_workers_subscribe_to_every_tenants_jobs_and_control_topics_and_nothing_else():
    pattern = re.compile(TOPICS.tenant_intake_pattern)
    subscribed = [TOPICS.tenant_jobs("a", p) for p in ("high", "normal", "low")] + [
        TOPICS.tenant_control("b")
    ]
    assert all(pattern.match(t) for t in subscribed)
    others = [TOPICS.tenant_tokens("a"), TOPICS.tenant_results("a"), "inferq.jobs.high", "inferq.control",
              "other.tenant.a.jobs.high", "inferq.tenant.a.b.jobs.high"]  # fmt: skip
    assert not any(pattern.match(t) for t in others)
    assert TOPICS.tenant_of("inferq.tenant.a.jobs.low") == "a" and TOPICS.tenant_of("inferq.jobs.low") is None
    assert TOPICS.priority_of("inferq.tenant.a.jobs.low") == "low"
    assert TOPICS.is_control("inferq.tenant.a.control") and not TOPICS.is_control("inferq.tenant.a.jobs.low")


def test_a_job_takes_its_tenant_from_its_topic():
    decision = accept({"job_id": "j1", "prompt": "hi"}, TOPICS.tenant_jobs("acme", "normal"))
    assert isinstance(decision, Accepted) and decision.tenant == "acme" and decision.priority == "normal"
    same = accept({"job_id": "j1", "tenant": "acme", "prompt": "hi"}, TOPICS.tenant_jobs("acme", "normal"))
    assert isinstance(same, Accepted) and same.tenant == "acme"


def test_a_job_claiming_another_tenant_than_its_topics_is_rejected_as_its_topics_tenant():
    decision = accept({"job_id": "j1", "tenant": "A", "prompt": "hi"}, TOPICS.tenant_jobs("B", "high"))
    assert isinstance(decision, Rejected) and decision.reason == "wrong_tenant"
    assert decision.tenant == "B" and "'A' does not match the topic's tenant 'B'" in decision.error
    invalid = accept({"job_id": "j2", "tenant": "A"}, TOPICS.tenant_jobs("B", "high"))
    assert isinstance(invalid, Rejected) and invalid.tenant == "B"  # its row and result are B's


def test_a_cancel_takes_its_tenant_from_its_topic_and_one_naming_another_is_refused():
    on_b = TOPICS.tenant_control("B")
    cancel = cancels.parse(record({"type": "cancel", "job_id": "j1"}, on_b), Limits(), TOPICS)
    assert not isinstance(cancel, str) and (cancel.job_id, cancel.tenant) == ("j1", "B")
    refused = cancels.parse(record({"type": "cancel", "job_id": "j1", "tenant": "A"}, on_b), Limits(), TOPICS)
    assert isinstance(refused, str) and "does not match the topic's tenant 'B'" in refused
    shared = cancels.parse(record({"type": "cancel", "job_id": "j1", "tenant": "A"}, "inferq.control"),
                           Limits(), Topics("inferq"))  # fmt: skip
    assert not isinstance(shared, str) and shared.tenant == "A"  # off: the tenant as claimed


def test_a_tenants_acls_allow_posting_to_and_reading_from_its_own_topics_only():
    grants = tenant_grants(TOPICS, "acme", "User:acme", "User:worker")
    mine = {(g.operation, g.resource, g.name, g.pattern) for g in grants if g.principal == "User:acme"}
    posts = [TOPICS.tenant_jobs("acme", p) for p in ("high", "normal", "low")] + [
        TOPICS.tenant_control("acme")
    ]
    reads = [TOPICS.tenant_tokens("acme"), TOPICS.tenant_results("acme")]
    assert mine == (
        {(op, "TOPIC", t, "LITERAL") for t in posts for op in ("WRITE", "DESCRIBE")}
        | {(op, "TOPIC", t, "LITERAL") for t in reads for op in ("READ", "DESCRIBE")}
        | {("READ", "GROUP", "inferq.tenant.acme.", "PREFIXED")}
    )
    workers = {(g.operation, g.name, g.pattern) for g in grants if g.principal == "User:worker"}
    ops = ("READ", "WRITE", "DESCRIBE", "DESCRIBE_CONFIGS")
    assert workers == {(op, "inferq.tenant.acme.", "PREFIXED") for op in ops}
    assert all(g.acl().resource_pattern.resource_name == g.name for g in grants)
