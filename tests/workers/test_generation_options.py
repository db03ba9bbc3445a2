"""Issue 20's options between the job message and the engine, and back (no services): the engine's knobs a
job maps to, grammars compiled at intake, and n samples with their logprobs gathered into choices, token
events, rows, results and Batch output bodies."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from sqlalchemy import create_engine

from gpu.engine_types import GrammarSpec, RequestOutput, TokenLogprob
from gpu.grammar import DEAD_END
from gpu.tokenizer import ByteTokenizer
from scheduler.types import FinishReason
from schemas.job_key import JobKey
from schemas.jobs import JobRequest, JobResult, TokenEvent, Usage
from schemas.tables import jobs as jobs_table
from schemas.topics import Topics
from schemas.validation import Limits
from tests.gpu.factories import make_engine
from tests.workers.bulk_factories import CHAT, COMPLETIONS, batch_line
from workers.bulk.batch_format import BatchLine, parse_line, to_job
from workers.bulk.output import response_body
from workers.db.jobs import Admitted
from workers.db.outbox import COMPACT_NOTE, result_from_row
from workers.kafka_io import Record
from workers.serving.intake.sampling import grammar_spec, sampling_params
from workers.serving.intake.validation import Accepted, Intake
from workers.serving.loop.choices import LOGPROB_FLOOR, Choices, LogprobFormatter
from workers.serving.loop.inflight import InFlightJob
from workers.serving.loop.lifecycle import JobLifecycle
from workers.serving.metrics import WorkerMetrics
from workers.serving.offsets import OffsetTracker
from workers.serving.outbox.writes import Concluded
from workers.serving.streaming.stream import TokenStreamer
from workers.settings import Settings

TOK = ByteTokenizer(512)
A, B, C = 3 + ord("a"), 3 + ord("b"), 3 + ord("c")  # byte-tokenizer ids of the letters


def request(**fields) -> JobRequest:
    return JobRequest.model_validate({"prompt": "hi", **fields})


USAGE = Usage(prompt_tokens=3, completion_tokens=2)
KEY = JobKey("default", "j").request_id  # the engine's request id of job "j" of the default tenant
NOBODY = SimpleNamespace(assignment=frozenset())  # the owner of no partition: no admissions here


def output(
    index=0, ids: tuple[int, ...] = (), finish: FinishReason | None = None, lps=(), started=False, cached=0
):
    text = TOK.decode(ids)
    return RequestOutput(
        KEY, ids, text, finish, started, 3, len(ids), index=index, logprobs=tuple(lps), cached_tokens=cached
    )


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(token_id, logprob, tuple(top))


# ---- job -> engine --------------------------------------------------------------------------------
def test_sampling_params_carry_penalties_bias_and_logprobs():
    job = request(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, logprobs=True,
                  top_logprobs=3, logit_bias={"300": -100, "7": 2.5, "40": 0})  # fmt: skip
    params = sampling_params(job, 9, engine=None)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1, 1.2)
    assert params.logit_bias == ((7, 2.5), (40, 0.0), (300, -100.0))  # by id, as the engine expects
    assert params.logprobs == 3 and params.max_tokens == 9
    plain = sampling_params(request(), 5, engine=None)
    assert (plain.repetition_penalty, plain.logit_bias, plain.logprobs) == (1.0, (), None)


def test_repetition_penalty_left_out_takes_the_models_default():
    engine = SimpleNamespace(generation_defaults=SimpleNamespace(repetition_penalty=1.1, temperature=None))
    assert sampling_params(request(), 5, engine).repetition_penalty == 1.1
    assert sampling_params(request(repetition_penalty=1.0), 5, engine).repetition_penalty == 1.0


def test_grammar_spec_of_each_constraint():
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    spec = grammar_spec(request(response_format=fmt))
    assert spec.kind == "json_schema" and json.loads(spec.source) == schema
    assert grammar_spec(request(response_format={"type": "json_object"})) == GrammarSpec("json_object")
    assert grammar_spec(request(guided_regex=r"\d+")) == GrammarSpec("regex", r"\d+")
    choice = grammar_spec(request(guided_choice=["yes", "no"]))
    assert choice.kind == "choice" and json.loads(choice.source) == ["yes", "no"]
    assert grammar_spec(request()) is None and grammar_spec(request(response_format={"type": "text"})) is None


# ---- intake: grammars compiled on the intake thread, vocabulary checked -----------------------
@dataclass(frozen=True)
class Compiled:
    """What a grammar compiler returns here: the spec, with Python's own regex compiled for regexes."""

    spec: GrammarSpec


def compile_with_re(spec: GrammarSpec) -> Compiled:
    if spec.kind == "regex":
        try:
            re.compile(spec.source)
        except re.error as exc:
            raise ValueError(f"invalid regex: {exc}") from None
    return Compiled(spec)


def intake(compile_grammar=compile_with_re) -> Intake:
    return Intake(Topics("inferq"), Limits(), TOK, 256, vocab_size=512, compile_grammar=compile_grammar)


def record(value: dict, offset: int = 1) -> Record:
    return Record("inferq.jobs.normal", 0, offset, b"k", json.dumps(value).encode(), 1_700_000_000_000)


def test_a_grammar_is_compiled_at_intake_and_travels_with_the_accepted_job():
    decision = intake().accept(record({"job_id": "g1", "prompt": "x", "guided_regex": "[ab]+", "n": 2}))
    assert isinstance(decision, Accepted)
    assert decision.grammar == Compiled(GrammarSpec("regex", "[ab]+")) and decision.job.n == 2
    assert intake().accept(record({"job_id": "g2", "prompt": "x"})).grammar is None


def test_an_invalid_grammar_is_a_rejection_with_the_compilers_reason():
    bad = intake().accept(record({"job_id": "g3", "prompt": "x", "guided_regex": "(unclosed"}))
    assert bad.reason == "invalid_grammar" and bad.job_id == "g3"
    assert bad.error.startswith("guided_regex cannot be compiled: invalid regex: missing )")
    unsupported = intake(compile_grammar=None).accept(
        record({"job_id": "g4", "prompt": "x", "response_format": {"type": "json_object"}})
    )
    assert unsupported.reason == "invalid_grammar"
    assert unsupported.error == "response_format: this worker does not support output constraints"


def test_a_compiler_that_breaks_rejects_only_that_job():
    def broken(spec: GrammarSpec):
        raise RuntimeError("compiler bug")

    decision = intake(broken).accept(record({"job_id": "g5", "prompt": "x", "guided_choice": ["a"]}))
    assert decision.reason == "error" and "compiler bug" in decision.error


def test_logit_bias_ids_must_be_in_the_models_vocabulary():
    ok = intake().accept(record({"job_id": "v1", "prompt": "x", "logit_bias": {"511": 5}}))
    assert isinstance(ok, Accepted)
    bad = intake().accept(record({"job_id": "v2", "prompt": "x", "logit_bias": {"3": 1, "512": 5, "900": 1}}))
    assert bad.reason == "invalid"
    assert bad.error == "logit_bias names token 512; this model's vocabulary has 512 tokens (ids 0-511)"


# ---- engine outputs -> choices -----------------------------------------------------------------
def test_logprob_entries_have_openai_chat_shape():
    fmt = LogprobFormatter(TOK)
    entry = fmt.entry(lp(A, -0.25, (A, -0.25), (B, -1.5), (0, float("-inf"))))
    assert entry == {
        "token": "a",
        "logprob": -0.25,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.25, "bytes": [97]},
            {"token": "b", "logprob": -1.5, "bytes": [97 + 1]},
            {"token": "", "logprob": LOGPROB_FLOOR, "bytes": []},  # JSON has no -Infinity
        ],
    }
    half = fmt.entry(lp(3 + 0xC3, -2.0))  # the first byte of "é": its own bytes, its text a U+FFFD
    assert half["bytes"] == [0xC3] and half["token"] == "\ufffd" and half["top_logprobs"] == []


def make_job(**fields) -> InFlightJob:
    return InFlightJob("j", 1, "normal", request(**fields), datetime.now(UTC), [("t", 0, 1)], prompt_tokens=3,
                       logprob_format=LogprobFormatter(TOK))  # fmt: skip


def test_n_samples_with_logprobs_conclude_when_all_have_ended():
    job = make_job(n=2, logprobs=True, top_logprobs=1)
    feed = [
        output(0, (A,), lps=[lp(A, -0.1, (A, -0.1))]),
        output(1, (B,), lps=[lp(B, -0.7, (A, -0.6))]),
        output(1, (C,), FinishReason.LENGTH, lps=[lp(C, -0.2, (C, -0.2))]),
        output(0, (B,), lps=[lp(B, -0.3, (B, -0.3))]),
        output(0, (), FinishReason.STOP),
    ]
    ends = []
    for out in feed:
        job.on_tokens(len(out.new_token_ids), out.text_delta, out.index, out.logprobs)
        if out.finish_reason is not None:
            ends.append(job.on_end(out.index, out.finish_reason.value))
    assert ends == [None, "stop"]  # sample 1 ended first: the job waits for sample 0
    row, _ = job.conclude("stop", "w-1")
    values = row.values
    assert (values["output_text"], values["finish_reason"], row.status) == ("ab", "stop", "succeeded")
    assert (values["prompt_tokens"], values["completion_tokens"]) == (3, 4)  # the prompt counted once
    first, second = values["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "ab", "stop")
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "bc", "length")
    assert [e["token"] for e in second["logprobs"]["content"]] == ["b", "c"]
    assert second["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "a", "logprob": -0.6, "bytes": [97]}
    ]
    assert json.loads(json.dumps(values["choices"])) == values["choices"]  # storable as jsonb


def test_one_sample_without_logprobs_stores_its_row_as_before():
    job = make_job()
    job.on_tokens(2, "ab")
    assert job.on_end(0, "length") == "length"
    row, _ = job.conclude("length", "w-1")
    assert "choices" not in row.values  # the column stays NULL: output_text is the one choice
    assert (row.values["output_text"], row.values["completion_tokens"]) == ("ab", 2)


def test_an_abort_ends_every_sample_at_once():
    job = make_job(n=3)
    job.on_tokens(1, "a", index=2)
    assert job.on_end(0, "length") is None
    assert job.on_end(2, "abort") == "abort"
    row, _ = job.conclude("abort", "w-1")
    assert row.status == "cancelled"
    assert [c["finish_reason"] for c in row.values["choices"]] == ["length", "abort", "abort"]


def test_choices_know_the_longest_sample_for_inter_token_latency():
    choices = Choices(2)
    choices.add(0, 3, "abc")
    choices.add(1, 5, "abcde")
    assert (choices.longest, choices.completion_tokens) == (5, 8)


# ---- token events ------------------------------------------------------------------------------
def test_token_events_carry_the_sample_index_and_logprobs():
    sent: list[TokenEvent] = []
    streamer = TokenStreamer(lambda event, tenant: sent.append(event), 60.0, LogprobFormatter(TOK).entries)
    streamer.start("j", attempt=1)
    streamer.add("j", "a", (A,), 0, [lp(A, -0.5)])
    streamer.add("j", "b", (B,), 1, [lp(B, -0.1)])
    streamer.flush_due()
    streamer.add("j", "a", (A,), 1, [lp(A, -0.5)])
    streamer.finish("j", "stop", USAGE)
    assert [(e.seq, e.index, e.text, e.finish_reason, e.final) for e in sent] == [
        (0, 0, "a", None, False), (1, 1, "b", None, False),
        (2, 0, "", "stop", False), (3, 1, "a", "stop", True),
    ]  # fmt: skip
    assert sent[0].logprobs[0].token == "a" and sent[0].logprobs[0].logprob == -0.5
    plain: list[TokenEvent] = []
    streamer = TokenStreamer(lambda event, tenant: plain.append(event), coalesce_s=60.0)
    streamer.start("k", attempt=1)
    streamer.add("k", "x", (9,))
    streamer.finish("k", "length", USAGE)
    assert [(e.index, e.logprobs, e.finish_reason, e.usage) for e in plain] == [(0, None, "length", USAGE)]


def test_each_sample_ends_with_its_own_reason_and_the_last_event_carries_usage():
    sent: list[TokenEvent] = []
    streamer = TokenStreamer(lambda event, tenant: sent.append(event), coalesce_s=60.0)
    streamer.start("j", attempt=1)
    streamer.add("j", "a", (A,), 0)
    streamer.add("j", "b", (B,), 1)
    streamer.add("j", "c", (C,), 2)
    streamer.end_sample("j", 1, "stop")  # sent at once, with what sample 1 had buffered
    assert [(e.index, e.text, e.finish_reason, e.usage) for e in sent] == [(1, "b", "stop", None)]
    streamer.add("j", "b", (B,), 0)
    streamer.finish("j", "length", USAGE, {0: "length", 1: "stop", 2: None})  # 2 cut short by the job's end
    assert [(e.index, e.text, e.finish_reason, e.usage) for e in sent[1:]] == [
        (0, "ab", "length", None),
        (2, "c", "length", USAGE),
    ]
    assert [e.seq for e in sent] == [0, 1, 2]


def test_the_lifecycle_routes_engine_outputs_to_samples_events_and_the_terminal_row():
    engine = make_engine()
    sent: list[TokenEvent] = []
    written: list = []
    lifecycle = JobLifecycle(
        engine, Topics("inferq"), worker_id="w-t", limits=Limits(), coalesce_s=60.0,
        database=create_engine(Settings.from_env().database_url),  # never connected: no admissions here
        ready=threading.Event(), offsets=OffsetTracker(), owner=NOBODY, metrics=WorkerMetrics(),
        write=written.extend, send_event=lambda event, tenant: sent.append(event),
    )  # fmt: skip
    job = request(job_id="j", n=2, logprobs=True, max_tokens=4)
    ids = tuple(TOK.encode("hi"))
    rec = record({"job_id": "j", "prompt": "hi"})
    lifecycle._start(Accepted(rec, "j", "normal", job, "hi", ids, 4), Admitted("start", 1))
    engine.abort_request(KEY)  # the outputs below stand in for the engine's steps
    for out in [
        output(0, (A,), lps=[lp(A, -0.1)], started=True),
        output(1, (B,), lps=[lp(B, -0.2)]),
        output(0, (B,), FinishReason.STOP, lps=[lp(B, -0.3)], cached=2),  # its prompt's cache hits
    ]:
        lifecycle.on_output(out)
    assert KEY in lifecycle.jobs  # sample 1 still runs
    lifecycle.on_output(output(1, (C,), FinishReason.LENGTH, lps=[lp(C, -0.4)]))
    assert KEY not in lifecycle.jobs
    lifecycle.flush(force=True)
    (concluded,) = [w for w in written if isinstance(w, Concluded)]
    values = concluded.row.values
    assert (values["output_text"], values["completion_tokens"], values["prompt_tokens"]) == ("ab", 4, 3)
    assert values["cached_tokens"] == 2  # sample 0's, once for the job
    assert [(c["text"], c["finish_reason"]) for c in values["choices"]] == [("ab", "stop"), ("bc", "length")]
    assert [e["logprob"] for e in values["choices"][1]["logprobs"]["content"]] == [-0.2, -0.4]
    by_index: dict[int, str] = {}
    for event in sent:
        by_index[event.index] = by_index.get(event.index, "") + event.text
        assert event.logprobs is not None and len(event.logprobs) == len(event.token_ids)
    assert by_index == {0: "ab", 1: "bc"}
    finishes = [(e.index, e.finish_reason, e.usage is not None) for e in sent if e.finish_reason]
    assert finishes == [(0, "stop", False), (1, "length", True)]  # each sample's own; usage on the last
    assert sent[-1].usage.model_dump() == {"prompt_tokens": 3, "completion_tokens": 4, "cached_tokens": 2}
    assert [e.seq for e in sent] == list(range(len(sent)))


def test_a_grammar_dead_end_rejects_the_job_with_the_reason_and_stops_its_other_samples():
    engine = make_engine()
    written: list = []
    lifecycle = JobLifecycle(
        engine, Topics("inferq"), worker_id="w-t", limits=Limits(), coalesce_s=60.0,
        database=create_engine(Settings.from_env().database_url),  # never connected: no admissions here
        ready=threading.Event(), offsets=OffsetTracker(), owner=NOBODY, metrics=WorkerMetrics(),
        write=written.extend, send_event=lambda event, tenant: None,
    )  # fmt: skip
    job = request(job_id="j", n=2, max_tokens=4)
    lifecycle._start(
        Accepted(record({"job_id": "j", "prompt": "hi"}), "j", "normal", job, "hi", (5, 6), 4),
        Admitted("start", 1),
    )
    assert engine.has_unfinished()
    dead = RequestOutput(KEY, (), "", FinishReason.REJECTED, False, 2, 1, DEAD_END, index=1)
    lifecycle.on_output(dead)
    assert KEY not in lifecycle.jobs and not engine.has_unfinished()  # sample 0 no longer runs for nothing
    lifecycle.flush(force=True)
    (concluded,) = [w for w in written if isinstance(w, Concluded)]
    assert (concluded.row.status, concluded.row.values["error"]) == ("rejected", DEAD_END)
    assert concluded.row.values["finish_reason"] == "rejected"


# ---- rows -> results and Batch output bodies -------------------------------------------------
def row_of(**values) -> SimpleNamespace:
    base = {c.name: None for c in jobs_table.c}
    base.update(job_id="j", status="succeeded", tenant="t", priority="normal", attempts=1, params={})
    return SimpleNamespace(**{**base, **values})


def test_results_always_have_choices():
    one = result_from_row(row_of(output_text="hello", finish_reason="stop", prompt_tokens=2,
                                 completion_tokens=1))  # fmt: skip
    assert one.output_text == "hello"
    assert [c.model_dump() for c in one.choices] == [
        {"index": 0, "text": "hello", "finish_reason": "stop", "logprobs": None}
    ]
    stored = [
        {"index": 0, "text": "a", "finish_reason": "stop",
         "logprobs": {"content": [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]}},
        {"index": 1, "text": "b", "finish_reason": "length", "logprobs": {"content": []}},
    ]  # fmt: skip
    many = result_from_row(row_of(output_text="a", finish_reason="stop", choices=stored))
    assert JobResult.model_validate_json(many.model_dump_json()) == many
    assert many.choices[0].logprobs.content[0].token == "a" and many.choices[1].finish_reason == "length"
    never_ran = result_from_row(row_of(status="rejected", finish_reason="rejected", error="bad"))
    assert never_ran.choices == []
    compact = result_from_row(row_of(output_text="a", choices=stored, error=f"{COMPACT_NOTE} (x)"))
    assert compact.choices == [] and compact.output_text is None


STORED = [
    {"index": 0, "text": "ab", "finish_reason": "stop", "logprobs": {"content": [
        {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
            {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "b", "logprob": -2.0, "bytes": [98]}]},
        {"token": "b", "logprob": -0.3, "bytes": [98], "top_logprobs": [
            {"token": "b", "logprob": -0.3, "bytes": [98]}, {"token": "c", "logprob": -1.0, "bytes": [99]}]},
    ]}},
    {"index": 1, "text": "c", "finish_reason": "length", "logprobs": {"content": [
        {"token": "c", "logprob": -0.5, "bytes": [99], "top_logprobs": [
            {"token": "c", "logprob": -0.5, "bytes": [99]}, {"token": "a", "logprob": -0.9, "bytes": [97]}]},
    ]}},
]  # fmt: skip
BATCH_ROW = {"job_id": "b:x", "status": "succeeded", "output_text": "ab", "finish_reason": "stop",
             "choices": STORED, "prompt_tokens": 5, "completion_tokens": 3}  # fmt: skip


def test_chat_batch_body_has_every_choice_with_logprobs_content():
    line = BatchLine(1, "x", CHAT, "m", {})
    body = response_body(line, BATCH_ROW)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    first = body["choices"][0]
    assert first["message"] == {"role": "assistant", "content": "ab"} and first["finish_reason"] == "stop"
    assert first["logprobs"] == STORED[0]["logprobs"]  # OpenAI's chat shape: {"content": [...]}
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip
    plain = response_body(line, {**BATCH_ROW, "choices": None})
    assert plain["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ab"},
                                 "logprobs": None, "finish_reason": "stop"}]  # fmt: skip


def test_completions_batch_body_has_the_legacy_logprobs_shape():
    body = response_body(BatchLine(1, "x", COMPLETIONS, "m", {}), BATCH_ROW)
    first, second = body["choices"]
    assert (first["text"], second["text"], second["finish_reason"]) == ("ab", "c", "length")
    assert first["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.3],
        "top_logprobs": [{"a": -0.1, "b": -2.0}, {"b": -0.3, "c": -1.0}],
        "text_offset": [0, 1],
    }
    assert second["logprobs"]["text_offset"] == [0]


# ---- Batch lines -> jobs: the same fields and meaning as the job message ---------------------------
@pytest.mark.parametrize(
    ("url", "body", "expected"),
    [
        (CHAT, {"logprobs": True, "top_logprobs": 4}, {"logprobs": True, "top_logprobs": 4}),
        (CHAT, {"logprobs": False, "top_logprobs": 0}, {"logprobs": False, "top_logprobs": None}),
        (COMPLETIONS, {"logprobs": 3}, {"logprobs": True, "top_logprobs": 3}),
        (COMPLETIONS, {"logprobs": 0}, {"logprobs": True, "top_logprobs": 0}),
        (COMPLETIONS, {"logprobs": None}, {"logprobs": False, "top_logprobs": None}),
        (COMPLETIONS, {"n": 3, "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1,
                       "logit_bias": {"50": -100}}, {"n": 3, "presence_penalty": 0.5,
                       "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logit_bias": {"50": -100}}),
        (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {
            "type": "object"}, "strict": True}}}, {"guided_regex": None}),
        (COMPLETIONS, {"guided_regex": "[0-9]+"}, {"guided_regex": "[0-9]+"}),
        (CHAT, {"guided_choice": ["yes", "no"]}, {"guided_choice": ["yes", "no"]}),
    ],
)  # fmt: skip
def test_batch_bodies_become_job_fields(url, body, expected):
    item = parse_line(json.dumps(batch_line("x", url, **body)), 1)
    assert isinstance(item, BatchLine), item
    job = to_job(item, bulk_id="b", tenant="t")
    for name, value in expected.items():
        assert getattr(job, name) == value, name
    if "response_format" in body:
        assert job.response_format.json_schema.json_schema == {"type": "object"}
