"""LoRA adapters across a fleet, on the real Kafka and PostgreSQL, with adapters PEFT makes here for the
workers' tiny model: an adapter registered while two workers run is served by both without a restart, with
the output HF + PEFT gives (greedy, token for token) mixed with base jobs and another adapter's; a tenant's
private adapter serves only that tenant; a removed adapter and an unknown model are refused with a reason
naming them; the jobs row keeps the model; a worker's own --lora-modules are checked at start."""

from __future__ import annotations

import signal
import uuid

import pytest
from sqlalchemy import create_engine

from gpu.model import load_model
from schemas.jobs import JobResult
from tests.gpu.factories import assert_matches_hf
from tests.gpu.lora_factories import make_adapter
from tests.services.factories import run_cli
from tests.workers.worker_factories import (
    make_deployment,
    now_ms,
    read_topic,
    serving_worker,
    start_worker,
    token_events,
    wait_group_members,
    wait_terminal,
)
from workers.client import JobClient
from workers.kafka_io import partition_for_key

pytestmark = [pytest.mark.services, pytest.mark.slow]

PRIORITIES = ("high", "normal", "low")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    """The workers' `--model tiny` (the same seed), as HF and PEFT see it."""
    return load_model("tiny", "float32", "cpu", 0)


@pytest.fixture(scope="module")
def made(tiny, tmp_path_factory):
    """Two PEFT adapters of the tiny model (random A, non-zero B) and their HF + PEFT references."""
    directory = tmp_path_factory.mktemp("adapters")
    a, ref_a = make_adapter(tiny, directory, "a", seed=1)
    b, ref_b = make_adapter(tiny, directory, "b", seed=2, r=4, targets=("q_proj", "v_proj", "down_proj"))
    return {"a": (a.path, ref_a), "b": (b.path, ref_b)}


@pytest.fixture(scope="module")
def fleet(settings, tmp_path_factory):
    """(deployment, client, database, workers): two workers in one group, started before any adapter."""
    dep = make_deployment(settings)
    tmp = tmp_path_factory.mktemp("fleet")
    workers = [start_worker(dep, tmp, name) for name in ("w-a", "w-b")]
    client = JobClient(dep)
    db = create_engine(dep.database_url)
    try:
        wait_group_members(dep, 2, timeout_s=600)  # two models loading at once on a shared machine
        yield dep, client, db, workers
    finally:
        client.close()
        db.dispose()
        codes = [w.stop(signal.SIGTERM) for w in workers]
        assert codes == [0, 0], [w.output()[-3000:] for w in workers]


@pytest.fixture
def names(fleet):
    """Adapter names of this test (the registry's database is shared), removed after it."""
    dep = fleet[0]
    made: list[str] = []

    def name(base: str) -> str:
        made.append(f"{base}-{dep.topic_prefix}-{uuid.uuid4().hex[:4]}")
        return made[-1]

    yield name
    for n in made:
        run_cli("adapter", "remove", n, check=False)


def ids_over_partitions(prefix: str, partitions: int) -> list[tuple[str, str]]:
    """(job_id, priority) pairs, one for every partition of every jobs topic: whichever worker owns
    a partition gets one of them."""
    out = []
    for priority in PRIORITIES:
        for partition in range(partitions):
            i = 0
            while partition_for_key(f"{prefix}-{priority}-{i}", partitions) != partition:
                i += 1
            out.append((f"{prefix}-{priority}-{i}", priority))
    return out


def submit(client, job_id: str, priority: str = "normal", **fields) -> str:
    job = {"job_id": job_id, "prompt": f"Tell me about {job_id[-12:]}", "max_tokens": MAX_TOKENS, **fields}
    return client.submit(job, priority).job_id


def token_ids(dep, since: int, job_ids: list[str]) -> dict[str, list[int]]:
    """Each job's generated token ids, from its token events (its last attempt's)."""
    wanted = set(job_ids)

    def done(records) -> bool:
        finals = {e.job_id for es in token_events(records).values() for e in es if e.final}
        return wanted <= finals

    events = token_events(read_topic(dep, dep.topics.tokens, since, done, timeout_s=120))
    out = {}
    for job_id in job_ids:
        mine = events[job_id]
        last = max(e.attempt for e in mine)
        out[job_id] = [t for e in sorted(mine, key=lambda e: e.seq) if e.attempt == last for t in e.token_ids]
    return out


def check_outputs(tiny, dep, since: int, rows: dict, references: dict) -> None:
    """Greedy output of each job = HF generate on its model (HF + PEFT for an adapter)."""
    got = token_ids(dep, since, list(rows))
    for job_id, row in rows.items():
        prompt = tuple(tiny.tokenizer.encode(row["prompt"], False))
        assert_matches_hf(references[row["model"]], prompt, got[job_id], MAX_TOKENS)


def test_an_adapter_added_while_two_workers_run_is_served_by_both_mixed_with_base_and_another(
    fleet, made, tiny, names
):
    dep, client, db, workers = fleet
    a, b = names("style"), names("extract")
    early = submit(client, f"early-{dep.topic_prefix}", model=a)  # before it is registered: unknown
    assert wait_terminal(db, [early])[early]["status"] == "rejected"

    run_cli("adapter", "add", a, made["a"][0])  # no worker restarts
    run_cli("adapter", "add", b, made["b"][0])
    since = now_ms()
    jobs = []
    spread = ids_over_partitions(f"mix-{dep.topic_prefix}", dep.jobs_partitions)
    for i, (job_id, priority) in enumerate(spread):
        model = (a, None, b)[i % 3]
        jobs.append(submit(client, job_id, priority, **({"model": model} if model else {})))
    client.flush()
    rows = wait_terminal(db, jobs)
    assert {r["status"] for r in rows.values()} == {"succeeded"}, {j: r["error"] for j, r in rows.items()}
    served_a = {r["worker_id"] for r in rows.values() if r["model"] == a}
    assert served_a == {"w-a", "w-b"}  # both workers loaded it on their first job naming it
    assert {r["model"] for r in rows.values()} == {a, b, "tiny"}  # rows keep the model; the base's name
    check_outputs(tiny, dep, since, rows, {a: made["a"][1], b: made["b"][1], "tiny": tiny})
    assert all(w.proc.poll() is None for w in workers)


def test_a_private_adapter_serves_its_tenant_and_is_refused_to_others_with_the_reason(fleet, made, names):
    dep, client, db, _ = fleet
    private = names("acme-only")
    run_cli("adapter", "add", private, made["a"][0], "--tenant", "acme")
    since = now_ms()
    mine = submit(client, f"mine-{dep.topic_prefix}", model=private, tenant="acme")
    theirs = submit(client, f"theirs-{dep.topic_prefix}", model=private, tenant="globex")
    rows = wait_terminal(db, [mine, theirs])
    assert (rows[mine]["status"], rows[mine]["model"]) == ("succeeded", private)
    refused = rows[theirs]
    assert (refused["status"], refused["model"]) == ("rejected", private)
    assert f"model '{private}' is not served to tenant 'globex'" in refused["error"]
    results = read_topic(dep, dep.topics.results, since, lambda rs: len(rs) >= 2)
    by_id = {r.key.decode(): JobResult.model_validate_json(r.value) for r in results}
    assert (by_id[theirs].status, by_id[theirs].error) == ("rejected", refused["error"])


def test_a_removed_adapter_and_an_unknown_model_are_refused_with_a_reason_naming_them(fleet, made, names):
    dep, client, db, workers = fleet
    gone = names("gone")
    run_cli("adapter", "add", gone, made["b"][0])
    before = submit(client, f"before-{dep.topic_prefix}", model=gone)
    assert wait_terminal(db, [before])[before]["status"] == "succeeded"
    run_cli("adapter", "remove", gone)
    since = now_ms()
    after = submit(client, f"after-{dep.topic_prefix}", model=gone)
    unknown = submit(client, f"unknown-{dep.topic_prefix}", model="gpt-4o")
    rows = wait_terminal(db, [after, unknown])
    for job_id, model in ((after, gone), (unknown, "gpt-4o")):
        row = rows[job_id]
        assert (row["status"], row["model"]) == ("rejected", model)
        assert row["error"].startswith(f"model '{model}' is not served to tenant 'default'")
    dead = read_topic(dep, dep.topics.dlq, since, lambda rs: {after, unknown} <= {r.key.decode() for r in rs})
    reasons = {r.key.decode(): dict(r.headers) for r in dead}
    assert {after, unknown} <= set(reasons)
    assert all(w.proc.poll() is None for w in workers)


def test_an_adapter_the_engine_cannot_load_ends_its_job_rejected_with_the_cause(fleet, tiny, tmp_path, names):
    dep, client, db, workers = fleet
    wide, _ = make_adapter(tiny, tmp_path, "wide", seed=5, r=32)  # over the workers' --max-lora-rank 16
    bad = names("wide")
    run_cli("adapter", "add", bad, wide.path)
    refused = submit(client, f"wide-{dep.topic_prefix}", model=bad)
    fine = submit(client, f"fine-{dep.topic_prefix}")
    rows = wait_terminal(db, [refused, fine])
    assert rows[fine]["status"] == "succeeded"
    row = rows[refused]
    assert (row["status"], row["model"]) == ("rejected", bad)
    assert bad in row["error"] and "rank" in row["error"]  # the engine's reason: the adapter and the cause
    assert all(w.proc.poll() is None for w in workers)


def test_lora_modules_serve_every_tenant_and_a_bad_one_stops_the_worker_at_start(
    tiny, made, settings, tmp_path
):
    wide, _ = make_adapter(tiny, tmp_path, "wide", seed=5, r=32)
    for spec, why in (
        (f"x={tmp_path / 'missing'}", "does not exist"),
        (f"x={wide.path}", "adapter 'x'"),  # a whole PEFT directory, refused by the engine: rank 32 > 16
        (f"tiny={made['a'][0]}", "'tiny' is a name of the served base model"),
    ):
        dep = make_deployment(settings)
        worker = start_worker(dep, tmp_path, "w-bad", "--lora-modules", spec)
        assert worker.proc.wait(300) == 2, worker.output()[-2000:]
        assert why in worker.output()

    with serving_worker(settings, tmp_path, "w-own", "--lora-modules", f"own={made['a'][0]}") as served:
        dep, client, db, _ = served
        since = now_ms()
        tenants = ("acme", "globex")
        jobs = [submit(client, f"own-{t}-{dep.topic_prefix}", model="own", tenant=t) for t in tenants]
        rows = wait_terminal(db, jobs)
        assert [(r["status"], r["model"]) for r in rows.values()] == [("succeeded", "own")] * 2
        check_outputs(tiny, dep, since, rows, {"own": made["a"][1]})
