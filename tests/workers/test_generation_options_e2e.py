"""Issue 20 end to end: structured outputs, logprobs, n samples and penalties through Kafka, the default
worker (SmolLM2-135M-Instruct) and PostgreSQL, and through `inferq run-batch`.

The worker's database is a scratch one migrated to head (the `choices` column). Only
test_bad_options_are_rejected_with_clear_reasons needs nothing but the contract; every other test needs
the engine side of issue 20 (grammar compilation and masks, logprobs, n samples, penalties and bias).
"""

from __future__ import annotations

import dataclasses
import json
import uuid

import jsonschema
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from gpu.grammar import DEAD_END
from gpu.model import load_model
from gpu.model_source import DEFAULT_MODEL
from tests.gpu.factories import make_engine
from tests.services.factories import run_cli
from tests.workers.bulk_factories import (
    CHAT,
    COMPLETIONS,
    batch_line,
    cli_env,
    read_jsonl,
    start_bulk_worker,
    write_batch,
)
from tests.workers.worker_factories import (
    now_ms,
    read_topic,
    results_by_job,
    serving_worker,
    token_events,
    wait_terminal,
)
from workers.bulk.batch_format import read_batch
from workers.bulk.run_batch import BatchRunner
from workers.db import migrate

pytestmark = [pytest.mark.services, pytest.mark.slow]

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string",
                               "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    },
    "labels": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "tags": {"type": "array", "items": {"enum": ["kafka", "gpu", "sql"]}, "minItems": 1,
                     "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["sentiment", "tags", "score"],
        "additionalProperties": False,
    },
    "flag": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False},
}  # fmt: skip
PROMPTS = {
    "person": "Describe a person who lives in Paris as JSON.",
    "labels": "Classify this review as JSON: 'The queue never loses a message. Great!'",
    "flag": "Is water wet? Answer as JSON.",
}


@pytest.fixture(scope="module")
def deployment(settings, tmp_path_factory):
    """One default-model worker on a private deployment whose database is a scratch one at head."""
    name = f"inferq_gen_{uuid.uuid4().hex[:10]}"
    admin = create_engine(
        make_url(settings.database_url).set(database="postgres"), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(settings.database_url).set(database=name).render_as_string(hide_password=False)
    try:
        migrate.upgrade(url)
        private = dataclasses.replace(settings, database_url=url)
        tmp = tmp_path_factory.mktemp("gen")
        with serving_worker(private, tmp, "w-gen", "--model", "smollm2") as deployed:
            yield deployed
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def submit(client, dep, name: str, **fields) -> str:
    job_id = f"{name}-{dep.topic_prefix}"
    client.submit({"job_id": job_id, **fields})
    return job_id


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


# ---- contract only: rejections with reasons ---------------------------------------------------
def test_bad_options_are_rejected_with_clear_reasons(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    bad = {
        "too-many": {"n": 99},
        "top-alone": {"top_logprobs": 3},
        "bias-range": {"logit_bias": {"5": 150}},
        "bias-vocab": {"logit_bias": {"10000000": 1}},
        "two-constraints": {"guided_regex": "a+", "guided_choice": ["a"]},
    }
    for name, fields in bad.items():
        client.submit_raw(
            json.dumps({"job_id": f"{name}-{dep.topic_prefix}", "prompt": "x", **fields}).encode()
        )
    client.flush()
    rows = wait_terminal(db, [f"{n}-{dep.topic_prefix}" for n in bad], timeout_s=120)
    errors = {n: rows[f"{n}-{dep.topic_prefix}"]["error"] for n in bad}
    assert {r["status"] for r in rows.values()} == {"rejected"}
    assert "n: Input should be less than or equal to 16" in errors["too-many"]
    assert "top_logprobs needs logprobs: true" in errors["top-alone"]
    assert "within -100..100" in errors["bias-range"]
    assert "logit_bias names token 10000000" in errors["bias-vocab"]
    assert "at most one output constraint" in errors["two-constraints"]
    results = results_by_job(dep, since, len(bad))
    assert all(rs[0].status == "rejected" and rs[0].choices == [] for rs in results.values())


# ---- these need the engine side of issue 20 ---------------------------------------------------------
def test_an_invalid_grammar_is_rejected_never_stuck(deployment):
    dep, client, db, _ = deployment
    regex = submit(client, dep, "bad-regex", prompt="x", guided_regex="(unclosed")
    nonsense = {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}
    schema = submit(client, dep, "bad-schema", prompt="x", response_format=nonsense)
    client.flush()
    rows = wait_terminal(db, [regex, schema], timeout_s=120)
    assert rows[regex]["status"] == "rejected" and "guided_regex cannot be compiled" in rows[regex]["error"]
    assert rows[schema]["status"] == "rejected"
    assert "response_format cannot be compiled" in rows[schema]["error"]


def test_schema_keywords_the_grammar_would_drop_and_empty_languages_are_rejected(deployment):
    """Never a job that succeeds with output its schema forbids, never an `abort` nobody asked for."""
    dep, client, db, _ = deployment
    unique = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
              "uniqueItems": True}}, "required": ["tags"]}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"schema": unique}}
    dropped = submit(client, dep, "unique-items", prompt="Tags:", max_tokens=30, response_format=fmt)
    nothing = submit(
        client, dep, "empty-regex", prompt="x", max_tokens=5, guided_regex="[^\\x00-\\U0010FFFF]"
    )
    dead_end = submit(client, dep, "dead-end", prompt="x", max_tokens=5, guided_regex="a[^\\x00-\\U0010FFFF]")
    client.flush()
    rows = wait_terminal(db, [dropped, nothing, dead_end], timeout_s=300)
    assert rows[dropped]["status"] == "rejected"
    assert "keyword 'uniqueItems' at $.properties.tags cannot be enforced" in rows[dropped]["error"]
    assert rows[nothing]["status"] == "rejected" and "allows no output at all" in rows[nothing]["error"]
    ended = rows[dead_end]
    assert (ended["status"], ended["finish_reason"], ended["output_text"]) == ("rejected", "rejected", "a")
    assert ended["error"] == DEAD_END


def test_each_samples_last_token_event_has_its_own_finish_and_the_last_has_usage(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    job_id = submit(client, dep, "n-events", messages=chat("Write a word."), temperature=1.0, seed=5,
                    max_tokens=6, n=3, stop=["e"])  # fmt: skip
    client.flush()
    row = wait_terminal(db, [job_id], timeout_s=300)[job_id]
    done = lambda rs: any(b'"usage":{' in r.value and job_id.encode() in r.value for r in rs)  # noqa: E731
    events = token_events(read_topic(dep, dep.topics.tokens, since, done))[job_id]
    finishes = [(e.index, e.finish_reason) for e in events if e.finish_reason]
    assert sorted(finishes) == sorted((c["index"], c["finish_reason"]) for c in row["choices"])
    assert [e.final for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1].usage.completion_tokens == row["completion_tokens"]
    for choice in row["choices"]:  # each sample's deltas, and only its own, add up to its text
        assert "".join(e.text for e in events if e.index == choice["index"]) == choice["text"]


def test_greedy_json_schema_jobs_parse_validate_and_end_by_themselves(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    jobs = {}
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        jobs[submit(client, dep, f"schema-{name}", messages=chat(PROMPTS[name]), temperature=0,
                    max_tokens=300, response_format=fmt)] = schema  # fmt: skip
    # an open JSON object on a 135M model: a small one, or greedy decoding may loop inside a list
    cat = "Give me a small JSON object describing a cat: its name and age."
    obj = submit(client, dep, "json-object", messages=chat(cat),
                 temperature=0, max_tokens=300, response_format={"type": "json_object"})  # fmt: skip
    client.flush()
    rows = wait_terminal(db, [*jobs, obj], timeout_s=600)
    for job_id, schema in jobs.items():
        row = rows[job_id]
        assert (row["status"], row["finish_reason"]) == ("succeeded", "stop"), row
        jsonschema.validate(json.loads(row["output_text"]), schema)
    assert rows[obj]["finish_reason"] == "stop" and isinstance(json.loads(rows[obj]["output_text"]), dict)
    results = results_by_job(dep, since, len(jobs) + 1)
    for job_id in jobs:
        [result] = results[job_id]
        assert result.choices[0].text == result.output_text == rows[job_id]["output_text"]


def test_regex_and_choice_constraints_hold(deployment):
    dep, client, db, _ = deployment
    regex = submit(client, dep, "regex", prompt="My phone number is", temperature=0, max_tokens=40,
                   guided_regex=r"[0-9]{3}-[0-9]{4}")  # fmt: skip
    choice = submit(client, dep, "choice", messages=chat("Is Kafka a database?"), temperature=0.8, seed=3,
                    max_tokens=20, guided_choice=["yes", "no", "it depends"])  # fmt: skip
    client.flush()
    rows = wait_terminal(db, [regex, choice], timeout_s=300)
    assert rows[regex]["finish_reason"] == "stop"
    assert len(rows[regex]["output_text"]) == 8 and rows[regex]["output_text"][3] == "-"
    assert rows[choice]["output_text"] in ("yes", "no", "it depends")


def test_logprobs_in_the_row_the_result_and_the_token_events(deployment):
    dep, client, db, _ = deployment
    since = now_ms()
    job_id = submit(client, dep, "logprobs", messages=chat("Name a colour."), temperature=0, max_tokens=12,
                    logprobs=True, top_logprobs=3)  # fmt: skip
    client.flush()
    row = wait_terminal(db, [job_id], timeout_s=300)[job_id]
    [choice] = row["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == row["completion_tokens"] and choice["text"] == row["output_text"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        # greedy: the sampled token is the most likely one (logprobs are taken before temperature)
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert (
            bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"] or "\ufffd" in entry["token"]
        )
    [result] = results_by_job(dep, since, 1)[job_id]
    assert [e.model_dump() for e in result.choices[0].logprobs.content] == content
    done = lambda rs: any(b'"finish_reason":"' in r.value for r in rs)  # noqa: E731
    events = token_events(read_topic(dep, dep.topics.tokens, since, done))[job_id]
    streamed = [e.model_dump() for ev in events for e in (ev.logprobs or [])]
    assert streamed == content


def test_n_samples_with_a_seed_are_reproducible_and_count_the_prompt_once(deployment):
    dep, client, db, _ = deployment
    fields = dict(messages=chat("Write a word."), temperature=1.0, seed=11, max_tokens=8, n=4, logprobs=True)
    first, again = submit(client, dep, "n4-a", **fields), submit(client, dep, "n4-b", **fields)
    single = submit(client, dep, "n1", messages=chat("Write a word."), max_tokens=8)
    client.flush()
    rows = wait_terminal(db, [first, again, single], timeout_s=300)
    choices = rows[first]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == [c["text"] for c in rows[again]["choices"]]
    assert len({c["text"] for c in choices}) > 1  # four samples, not one four times
    assert rows[first]["prompt_tokens"] == rows[single]["prompt_tokens"]
    assert rows[first]["completion_tokens"] == sum(len(c["logprobs"]["content"]) for c in choices)
    assert rows[first]["output_text"] == choices[0]["text"]


def test_logit_bias_and_penalties_shape_the_output(deployment):
    dep, client, db, _ = deployment
    tokenizer = load_model(DEFAULT_MODEL, "float32", "cpu", cache_dir=dep.cache_dir).tokenizer
    forced = tokenizer.encode(" queue")[0]
    prompt = "List some fruit: apple, apple, apple, apple,"
    biased = submit(client, dep, "biased", prompt="Hello", temperature=0, max_tokens=6,
                    logit_bias={str(forced): 100})  # fmt: skip
    plain = submit(client, dep, "plain", prompt=prompt, temperature=0, max_tokens=16)
    penalised = submit(client, dep, "penalised", prompt=prompt, temperature=0, max_tokens=16,
                       frequency_penalty=2.0, presence_penalty=2.0)  # fmt: skip
    client.flush()
    rows = wait_terminal(db, [biased, plain, penalised], timeout_s=300)
    assert rows[biased]["output_text"] == tokenizer.decode([forced] * 6)
    assert rows[plain]["output_text"].count("apple") > rows[penalised]["output_text"].count("apple")


def test_run_batch_answers_n_choices_with_logprobs_in_each_endpoints_shape(tmp_path):
    lines = [
        batch_line("c", COMPLETIONS, max_tokens=4, n=2, logprobs=2, temperature=1.0, seed=5),
        batch_line("h", CHAT, max_tokens=4, logprobs=True, top_logprobs=1),
    ]
    path = write_batch(tmp_path / "in.jsonl", lines)
    answers = {a[0]["custom_id"]: a for a in BatchRunner(make_engine(), "tiny").run(read_batch(path))}
    completion = answers["c"][0]["response"]["body"]
    assert [c["index"] for c in completion["choices"]] == [0, 1]
    for c in completion["choices"]:
        lp = c["logprobs"]
        assert (
            len(lp["tokens"])
            == len(lp["token_logprobs"])
            == len(lp["top_logprobs"])
            == len(lp["text_offset"])
        )
        assert all(len(top) <= 2 for top in lp["top_logprobs"])
    assert completion["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["tokens"]) for c in completion["choices"]
    )
    chat_body = answers["h"][0]["response"]["body"]
    content = chat_body["choices"][0]["logprobs"]["content"]
    assert len(content) == chat_body["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 1 for e in content)


def test_bulk_jobs_through_celery_answer_every_choice_with_logprobs(deployment, tmp_path):
    dep, _, _, _ = deployment
    lines = [  # the worker's model by its name (body.model chooses the base or an adapter)
        batch_line("c", COMPLETIONS, max_tokens=6, n=2, logprobs=2, temperature=1.0, seed=5, model="smollm2"),
        batch_line(
            "h",
            CHAT,
            max_tokens=40,
            logprobs=True,
            top_logprobs=1,
            response_format={"type": "json_object"},
            model="smollm2",
        ),
        batch_line("bad", CHAT, guided_regex="(unclosed"),  # refused when the file is read
        batch_line("oov", CHAT, max_tokens=4, logit_bias={"60000": 1}, model=None),  # refused by the worker
    ]
    path = write_batch(tmp_path / "in.jsonl", lines)
    env = cli_env(dep, tmp_path / "state")
    bulk = start_bulk_worker(dep, tmp_path / "state", tmp_path / "bulk-worker.log")
    try:
        bulk_id = run_cli("bulk", "submit", str(path), "--skip-invalid", env=env).stdout.strip()
        run_cli("bulk", "wait", bulk_id, "--interval", "0.5", env=env, check=False)
        out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
        run_cli("bulk", "fetch", bulk_id, "-o", str(out), "--errors", str(err), env=env)
    finally:
        bulk.stop()
    ok = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(out)}
    completion, chat_body = ok["c"], ok["h"]
    assert [c["index"] for c in completion["choices"]] == [0, 1]
    assert all(
        len(c["logprobs"]["tokens"]) == len(c["logprobs"]["text_offset"]) for c in completion["choices"]
    )
    content = chat_body["choices"][0]["logprobs"]["content"]
    assert len(content) == chat_body["usage"]["completion_tokens"]
    assert isinstance(json.loads(chat_body["choices"][0]["message"]["content"]), dict)
    bad, oov = read_jsonl(err)  # both invalid lines, reported as run-batch reports them
    assert bad["custom_id"] == "bad" and "guided_regex cannot be compiled" in bad["error"]["message"]
    assert oov["custom_id"] == "oov" and "logit_bias names token 60000" in oov["error"]["message"]
    for line_no, error in ((3, bad), (4, oov)):
        assert error["id"] is None and error["error"]["code"] == "invalid_request"
        assert error["error"]["message"].startswith(f"line {line_no}: ")
