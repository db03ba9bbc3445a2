"""A job's `model` resolved at admission against the real PostgreSQL: the base by any of its names, the
worker's own adapters, the registry's for the job's tenant; refusals name the model and store it; the
registry is read as it is at each admission (an adapter removed is refused from the next one)."""

from __future__ import annotations

import uuid

import pytest

from gpu.engine_types import LoraRequest
from schemas.jobs import JobRequest
from tests.workers.persistence_factories import accepted, run_items, start_persister
from tests.workers.worker_factories import job_rows, now_ms, read_topic
from workers.db import adapters
from workers.serving.admission.admitter import Admitter
from workers.serving.admission.models import ServedModels
from workers.serving.intake.validation import Accepted

pytestmark = pytest.mark.services

BASE = ("base-m", "base-alias")


def naming(dep, job_id: str, model: str | None, tenant: str = "t-a", offset: int = 0) -> Accepted:
    a = accepted(dep, job_id, tenant=tenant, offset=offset)
    job = JobRequest(job_id=job_id, tenant=tenant, prompt="hello", model=model)
    return Accepted(a.record, job_id, a.priority, job, "hello", a.prompt_token_ids, a.max_tokens)


@pytest.fixture
def registered(env, tmp_path):
    """Two adapters in the registry (names unique to this test: the database is shared)."""
    dep, db, _ = env
    tag = uuid.uuid4().hex[:8]
    shared, private = f"shared-{tag}", f"acme/private-{tag}"
    with db.begin() as conn:
        adapters.add(conn, shared, str(tmp_path / "shared"), None)
        adapters.add(conn, private, str(tmp_path / "private"), "t-a")
    yield shared, private
    with db.begin() as conn:
        for name in (shared, private):
            adapters.remove(conn, name)


def test_each_model_resolves_to_the_base_an_own_adapter_or_the_tenants_registered_one(env, registered):
    dep, db, _ = env
    shared, private = registered
    own = LoraRequest("own-ad", "/adapters/own")
    admitter = Admitter(db, "w-models", ServedModels(BASE, {"own-ad": own}))
    tag = uuid.uuid4().hex[:8]
    jobs = {
        f"m-{tag}-none": (None, "t-a"),
        f"m-{tag}-alias": ("base-alias", "t-a"),
        f"m-{tag}-own": ("own-ad", "t-b"),
        f"m-{tag}-shared": (shared, "t-b"),
        f"m-{tag}-private": (private, "t-a"),
    }
    admitter.add([naming(dep, j, m, t, offset=i) for i, (j, (m, t)) in enumerate(jobs.items())])
    decisions, rejected = admitter.run(lambda a: False)
    assert not rejected and [d.outcome.kind for d in decisions] == ["start"] * 5
    got = {d.accepted.job_id: (d.accepted.model, d.accepted.lora) for d in decisions}
    assert got == {
        f"m-{tag}-none": (None, None),  # the base
        f"m-{tag}-alias": (None, None),
        f"m-{tag}-own": ("own-ad", own),
        f"m-{tag}-shared": (shared, LoraRequest(shared, registered_path(db, shared))),
        f"m-{tag}-private": (private, LoraRequest(private, registered_path(db, private))),
    }
    rows = job_rows(db, jobs)  # the base's first name is the one rows keep
    assert {j: r["model"] for j, r in rows.items()} == {j: m or "base-m" for j, (m, _) in got.items()}


def registered_path(db, name: str) -> str:
    with db.connect() as conn:
        return adapters.lookup(conn, [name])[name].path


def test_unknown_and_other_tenants_models_are_refused_alike_naming_the_model(env, registered):
    dep, db, producer = env
    shared, private = registered
    admitter = Admitter(db, "w-models", ServedModels(BASE))
    tag = uuid.uuid4().hex[:8]
    since = now_ms()
    admitter.add([
        naming(dep, f"r-{tag}-other", private, tenant="t-b"),
        naming(dep, f"r-{tag}-unknown", f"nope-{tag}", tenant="t-b", offset=1),
        naming(dep, f"r-{tag}-ok", shared, tenant="t-b", offset=2),
    ])  # fmt: skip
    decisions, rejected = admitter.run(lambda a: False)
    assert [d.accepted.job_id for d in decisions] == [f"r-{tag}-ok"]
    by_id = {r.job_id: r for r in rejected}
    other, unknown = by_id[f"r-{tag}-other"], by_id[f"r-{tag}-unknown"]
    assert (other.reason, unknown.reason) == ("model_not_allowed", "unknown_model")
    assert other.error == (
        f"model '{private}' is not served to tenant 't-b': it is neither a name of the base model "
        "(base-m, base-alias) nor an adapter this tenant may use"
    )  # the same words as for a name nobody registered: a tenant learns nothing of another's adapters
    assert unknown.error == other.error.replace(private, f"nope-{tag}")
    run_items(start_persister(dep, db, producer), rejected)  # as the worker's persister writes them
    rows = job_rows(db, by_id)
    assert {j: (r["status"], r["model"], r["error"]) for j, r in rows.items()} == {
        j: ("rejected", r.model, r.error) for j, r in by_id.items()
    }
    dead = read_topic(dep, dep.topics.dlq, since, lambda rs: len(rs) >= 2)
    assert {r.key.decode() for r in dead} >= set(by_id)


def test_a_removed_adapter_is_refused_from_the_next_admission_and_ends_its_own_admitted_row(env, registered):
    dep, db, producer = env
    shared, _ = registered
    admitter = Admitter(db, "w-models", ServedModels(BASE))
    job_id = f"rm-{uuid.uuid4().hex[:8]}"
    admitter.add([naming(dep, job_id, shared, offset=7)])
    decisions, _ = admitter.run(lambda a: False)
    assert decisions[0].outcome.kind == "start" and job_rows(db, [job_id])[job_id]["status"] == "queued"

    with db.begin() as conn:
        adapters.remove(conn, shared)
    # its record delivered again (its worker died before the job ended): refused now, and the row that
    # record admitted ends rejected instead of staying queued for ever
    admitter.add([naming(dep, job_id, shared, offset=7)])
    decisions, rejected = admitter.run(lambda a: False)
    assert not decisions and [r.reason for r in rejected] == ["unknown_model"]
    run_items(start_persister(dep, db, producer), rejected)
    row = job_rows(db, [job_id])[job_id]
    assert (row["status"], row["finish_reason"], row["model"]) == ("rejected", "rejected", shared)
    assert row["prompt"] == "hello" and shared in row["error"]  # the admitted row's prompt is kept


def test_a_refused_record_never_ends_a_row_another_record_admitted(env, registered):
    dep, db, producer = env
    shared, _ = registered
    job_id = f"dup-{uuid.uuid4().hex[:8]}"
    admitter = Admitter(db, "w-models", ServedModels(BASE))
    admitter.add([naming(dep, job_id, None, offset=1)])
    admitter.run(lambda a: False)
    # another message with the same id (the same tenant's) names a model it may not use: that record is
    # refused, and the job the first one admitted goes on
    admitter.add([naming(dep, job_id, "nope", offset=2)])
    _, rejected = admitter.run(lambda a: False)
    run_items(start_persister(dep, db, producer), rejected)
    assert job_rows(db, [job_id])[job_id]["status"] == "queued"


def test_a_registry_that_cannot_be_read_refuses_only_the_jobs_that_need_it(env):
    dep, db, _ = env

    class Broken(ServedModels):  # its registry reads fail as if the adapters table were gone
        def resolve(self, db_, batch):
            return super().resolve(NoRegistry(), batch)

    admitter = Admitter(db, "w-models", Broken(BASE))
    tag = uuid.uuid4().hex[:8]
    admitter.add([naming(dep, f"b-{tag}-base", None), naming(dep, f"b-{tag}-ad", "some-ad", offset=1)])
    decisions, rejected = admitter.run(lambda a: False)
    assert [d.accepted.job_id for d in decisions] == [f"b-{tag}-base"]
    assert [(r.reason, r.error.split(":")[0]) for r in rejected] == [
        ("error", "the adapter registry could not be read")
    ]


class NoRegistry:
    """A database whose every connection fails with an error that is not transient."""

    def connect(self):
        raise LookupError('relation "adapters" does not exist')
