"""Tool calls in the worker: a job with tools whose model writes a call (`auto`) streams OpenAI's
tool_calls deltas in its token events and stores the call in its choices with finish reason `tool_calls`;
one that writes none is plain text; results and Batch bodies carry the calls in OpenAI's message shape."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import jsonschema
import pytest
from sqlalchemy import create_engine

from gpu.engine_types import RequestOutput
from gpu.tokenizer import ByteTokenizer
from scheduler.types import FinishReason
from schemas.job_key import JobKey
from schemas.jobs import JobRequest, TokenEvent
from schemas.tables import jobs as jobs_table
from schemas.tool_calls import HERMES, call_id
from schemas.topics import Topics
from schemas.validation import Limits
from tests.gpu.factories import make_engine, make_model
from tests.workers.bulk_factories import CHAT, batch_line
from tests.workers.resume_factories import as_client_reads
from tests.workers.worker_factories import now_ms, read_topic, serving_worker, token_events, wait_terminal
from workers.bulk.batch_format import parse_line
from workers.bulk.output import response_body
from workers.bulk.run_batch import BatchRunner
from workers.db.jobs import Admitted
from workers.db.outbox import result_from_row
from workers.db.progress import SavedProgress, SavedSample
from workers.kafka_io import Record
from workers.serving.intake.validation import Accepted
from workers.serving.loop.lifecycle import JobLifecycle
from workers.serving.metrics import WorkerMetrics
from workers.serving.offsets import OffsetTracker
from workers.serving.outbox.writes import Concluded
from workers.settings import Settings

TOK = ByteTokenizer(512)
KEY = JobKey("acme", "j").request_id
NOBODY = SimpleNamespace(assignment=frozenset())
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL_TEXT = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def lifecycle_with(sent: list[TokenEvent], written: list) -> JobLifecycle:
    return JobLifecycle(
        make_engine(), Topics("inferq"), worker_id="w-t", limits=Limits(), coalesce_s=60.0,
        database=create_engine(Settings.from_env().database_url),  # never connected: no admissions here
        ready=threading.Event(), offsets=OffsetTracker(), owner=NOBODY, metrics=WorkerMetrics(),
        write=written.extend, send_event=lambda event, tenant: sent.append(event),
    )  # fmt: skip


def pieces_of(text: str, pieces: int) -> list[tuple[int, ...]]:
    ids = TOK.encode(text, add_bos=False)
    size = -(-len(ids) // pieces)
    return [tuple(ids[i : i + size]) for i in range(0, len(ids), size)]


def attempt(
    sent: list[TokenEvent],
    written: list,
    steps: list[tuple[int, ...]],
    admitted: Admitted,
    ends: bool = True,
    resumed: tuple[int, ...] = (),
) -> JobLifecycle:
    """One attempt of an `auto` job (a worker of its own) whose model writes `steps`, one a step, after the
    `resumed` tokens an earlier attempt saved; `ends`: the last step ends it (else its worker dies)."""
    lifecycle = lifecycle_with(sent, written)
    job = JobRequest.model_validate(
        {"job_id": "j", "tenant": "acme", "messages": [{"role": "user", "content": "Paris?"}], "tools": TOOLS}
    )
    rec = Record("inferq.jobs.normal", 0, 1, b"j", b"{}", 0)
    lifecycle._start(Accepted(rec, "j", "normal", job, "hi", (5, 6), 200, None, HERMES), admitted)
    assert lifecycle.jobs[KEY].engine_request.resume == ((resumed,) if resumed else ())
    lifecycle.engine.abort_request(KEY)  # the outputs below stand in for the engine's steps
    if resumed:  # the engine hands a resumed sample's saved tokens out once, first
        lifecycle.on_output(RequestOutput(KEY, resumed, TOK.decode(resumed), None, True, 2, 0, resumed=True))
    for k, chunk in enumerate(steps):
        finish = FinishReason.STOP if ends and k == len(steps) - 1 else None
        out = RequestOutput(KEY, chunk, TOK.decode(chunk), finish, k == 0 and not resumed, 2, len(chunk))
        lifecycle.on_output(out)
        lifecycle.flush(force=True)  # an event per step, so the deltas come in pieces
    return lifecycle


def run(text: str, pieces: int = 7) -> tuple[list[TokenEvent], dict]:
    """An `auto` job whose model writes `text` in `pieces` steps: its events, and its terminal row."""
    sent: list[TokenEvent] = []
    written: list = []
    attempt(sent, written, pieces_of(text, pieces), Admitted("start", 1))
    (concluded,) = [w for w in written if isinstance(w, Concluded)]
    return sent, {"status": concluded.row.status, **concluded.row.values}


def calls_streamed(events: list[TokenEvent]) -> list[dict]:
    """The calls a consumer builds from the events' deltas, as OpenAI's SDK does (a head starts a call)."""
    calls: dict[int, dict] = {}
    for d in (d for e in events for d in e.tool_calls or ()):
        if d.id is not None:
            assert d.index not in calls, f"call {d.index} started twice"
            calls[d.index] = {
                "id": d.id,
                "type": "function",
                "function": {"name": d.function.name, "arguments": ""},
            }
        calls[d.index]["function"]["arguments"] += d.function.arguments
    return [calls[k] for k in sorted(calls)]


def test_a_call_the_model_writes_streams_as_deltas_and_is_stored_in_the_choice():
    sent, row = run(CALL_TEXT)
    expected = {
        "id": call_id("acme/j", 0, 0),
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert (row["status"], row["finish_reason"], row["output_text"]) == ("succeeded", "tool_calls", "Sure.")
    assert (
        row["choices"][0]["tool_calls"] == [expected] and row["choices"][0]["finish_reason"] == "tool_calls"
    )
    # the stream: the text outside the call, and the call in OpenAI's delta shape
    assert "".join(e.text for e in sent) == "Sure."
    deltas = [d for e in sent for d in e.tool_calls or ()]
    assert (deltas[0].id, deltas[0].function.name) == (expected["id"], "get_weather")
    assert len([e for e in sent if e.tool_calls]) > 1  # the arguments came in more than one event
    assert "".join(d.function.arguments for d in deltas) == expected["function"]["arguments"]
    assert all(d.id is None for d in deltas[1:])
    assert sent[-1].finish_reason == "tool_calls" and sent[-1].usage is not None
    assert [e.seq for e in sent] == list(range(len(sent)))


def test_calls_coalesced_into_one_event_stay_apart():
    second = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    sent, row = run(f"{CALL_TEXT}\n{second}", pieces=1)  # the whole text in one step: one event
    ids = [call_id("acme/j", 0, k) for k in (0, 1)]
    assert [c["id"] for c in row["choices"][0]["tool_calls"]] == ids
    (event,) = [e for e in sent if e.tool_calls]
    assert [(d.index, d.id) for d in event.tool_calls] == [(0, ids[0]), (1, ids[1])]
    assert [d.function.arguments for d in event.tool_calls] == ['{"city": "Paris"}', '{"city": "Rome"}']


@pytest.mark.parametrize(("streamed", "saved"), [(5, 8), (9, 4), (6, 6)])
def test_a_job_with_tools_resumed_after_its_worker_died_streams_and_ends_as_an_uninterrupted_run(
    streamed, saved
):
    """Attempt 1 streamed `streamed` steps of two calls and saved `saved` (the kill in a call's arguments:
    its stream behind or ahead of its save); attempt 2 resumes from the saved tokens: its parser state is
    rebuilt from them (the calls so far, what it holds back), so its row is the uninterrupted run's, and its
    stream read as JobClient reads it has each call's head once and the same content and arguments."""
    text = (
        f'{CALL_TEXT}\n<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}\n</tool_call>'
    )
    steps = pieces_of(text, 14)
    reference, reference_row = run(text, pieces=14)
    sent: list[TokenEvent] = []
    first = attempt(sent, [], steps[: max(streamed, saved)], Admitted("start", 1), ends=False)
    assert len(sent) == max(streamed, saved)  # an event a step: the kill loses those after `streamed`
    events_1 = sent[:streamed]
    resumed = tuple(t for chunk in steps[:saved] for t in chunk)
    sample = SavedSample(resumed, TOK.decode(resumed), frozenset({first.saver.fingerprint}))
    admitted = Admitted("start", 2, seed=7, progress=SavedProgress({0: sample}, latest_attempt=1))
    written: list = []
    sent_2: list[TokenEvent] = []
    attempt(sent_2, written, steps[saved:], admitted, resumed=resumed)
    (concluded,) = [w for w in written if isinstance(w, Concluded)]
    row = concluded.row.values
    assert (row["output_text"], row["finish_reason"]) == (reference_row["output_text"], "tool_calls")
    assert row["choices"][0]["tool_calls"] == reference_row["choices"][0]["tool_calls"]
    assert len(row["choices"][0]["tool_calls"]) == 2
    assert not any(e.restarted for e in sent_2)
    read = as_client_reads(events_1 + sent_2)
    assert "".join(e.text for e in read) == "".join(e.text for e in reference) == "Sure."
    assert calls_streamed(read) == calls_streamed(reference) == reference_row["choices"][0]["tool_calls"]
    assert read[-1].finish_reason == "tool_calls"


def test_text_without_a_call_is_plain_content():
    sent, row = run("It is sunny in Paris <tool but no call.")
    assert (row["finish_reason"], row["output_text"]) == ("stop", "It is sunny in Paris <tool but no call.")
    assert row["choices"][0]["tool_calls"] is None
    assert "".join(e.text for e in sent) == row["output_text"] and not any(e.tool_calls for e in sent)
    assert "tool_calls" not in json.loads(sent[0].model_dump_json())  # events without calls are as before


def test_results_and_batch_bodies_carry_calls_in_openais_message_shape():
    _, row = run(CALL_TEXT)
    base = {c.name: None for c in jobs_table.c}
    stored = SimpleNamespace(**{**base, "job_id": "j", "tenant": "acme", "priority": "normal", "attempts": 1,
                                "params": {}, **row})  # fmt: skip
    result = result_from_row(stored)
    assert (
        result.finish_reason == "tool_calls"
        and result.choices[0].tool_calls[0].function.name == "get_weather"
    )
    line = parse_line(json.dumps(batch_line("c", CHAT, tools=TOOLS)), 1)
    body = response_body(line, vars(stored))
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Sure.", "tool_calls": row["choices"][0]["tool_calls"]}
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    only_call = {**vars(stored), "choices": [{**row["choices"][0], "text": ""}]}
    assert response_body(line, only_call)["choices"][0]["message"]["content"] is None


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.mark.services
@pytest.mark.slow
def test_smollm2_called_through_kafka_fills_in_the_arguments_itself(settings, tmp_path):
    """A Kafka producer's job with a named tool on the default model: the grammar gives the call's shape,
    the model its arguments; the result and the token stream carry the call."""
    ask = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    with serving_worker(settings, tmp_path, "w-tools", "--model", "smollm2") as (dep, client, db, _):
        since = now_ms()
        named = {"type": "function", "function": {"name": "get_weather"}}
        forced = client.submit({"job_id": f"named-{dep.topic_prefix}", "messages": ask, "tools": [WEATHER],
                                "tool_choice": named, "temperature": 0, "max_tokens": 64})  # fmt: skip
        free = client.submit({"job_id": f"auto-{dep.topic_prefix}", "messages": ask, "tools": [WEATHER],
                              "temperature": 0, "max_tokens": 32})  # fmt: skip
        result = client.wait(forced, timeout_s=300)
        assert (result.status, result.finish_reason, result.output_text) == ("succeeded", "tool_calls", "")
        (call,) = result.choices[0].tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        assert call.id == call_id(f"default/{forced.job_id}", 0, 0)
        done = lambda rs: any(b'"usage"' in r.value and r.key == forced.job_id.encode() for r in rs)  # noqa: E731
        events = token_events(read_topic(dep, dep.topics.tokens, since, done, timeout_s=120))[forced.job_id]
        arguments = "".join(d.function.arguments for e in events for d in e.tool_calls or ())
        assert arguments == call.function.arguments and events[-1].finish_reason == "tool_calls"
        # left to itself (auto) this small model answers in words: plain content, no call
        answer = client.wait(free, timeout_s=300)
        assert answer.finish_reason in ("stop", "length") and answer.choices[0].tool_calls is None
        assert answer.output_text
        wait_terminal(db, [forced.job_id, free.job_id])


def test_run_batch_lines_call_tools_as_the_worker_does():
    """`inferq run-batch` (the engine in-process): a forced call per line, in OpenAI's message shape."""
    params = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    named = {"type": "function", "function": {"name": "pick"}}
    body = {"tools": tools, "tool_choice": named, "max_tokens": 80, "temperature": 1.0}
    items = [parse_line(json.dumps(batch_line(f"l{i}", CHAT, seed=i, **body)), i + 1) for i in range(3)]
    runner = BatchRunner(make_engine(make_model(max_position_embeddings=2048), max_model_len=2048), "tiny")
    for answer, ok in runner.run(items):
        assert ok, answer
        choice = answer["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "pick" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), params)
