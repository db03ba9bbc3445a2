"""Tool calling through the official `openai` SDK against `inferq api` and a tiny-model worker: forced calls
(a named function, `required`) always parse and match their function's schema, `none` calls nothing, the
streamed deltas add up to the same call, earlier calls and their results render, and a Batch line calls
tools as the synchronous request does. The tiny random model's calls are the grammar's doing; what a model
chooses itself (`auto`) is tested on the parser (tests/schemas/test_tool_calls.py) and the worker
(tests/workers/test_tool_call_worker.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from sqlalchemy import create_engine, select

from gpu.tokenizer import ByteTokenizer
from schemas.jobs import JobRequest
from schemas.tables import jobs
from tests.api.api_factories import MODEL, wait_batch
from workers.serving.intake.chat_prompt import chat_turns

pytestmark = [pytest.mark.services, pytest.mark.slow]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def ask(client: openai.OpenAI, **fields):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 120, **fields}
    return client.chat.completions.create(**body)


def check_call(call, names=("get_weather",)) -> dict:
    """The call is OpenAI's shape, of one of `names`, its arguments JSON valid against its schema."""
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_a_named_tool_call_parses_against_its_schema_10_of_10(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    with ThreadPoolExecutor(10) as pool:
        answers = list(
            pool.map(lambda seed: ask(client, tool_choice=NAMED, temperature=1.0, seed=seed), range(10))
        )
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])
    assert len({a.choices[0].message.tool_calls[0].function.arguments for a in answers}) > 1  # sampled


def test_required_calls_one_of_the_tools_and_parallel_calls_only_when_allowed(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    for seed in range(4):
        one = ask(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
        (call,) = one.choices[0].message.tool_calls
        check_call(call, names=("get_weather", "get_time"))
    several = ask(client, tool_choice="required", temperature=1.0, seed=7, max_tokens=400, n=3)
    for choice in several.choices:
        assert choice.message.tool_calls, choice
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)  # each call its own id
        if choice.finish_reason == "tool_calls":  # (a choice cut short by max_tokens keeps what it wrote)
            for call in choice.message.tool_calls:
                check_call(call, names=("get_weather", "get_time"))


def test_tool_choice_none_calls_nothing(served):
    _, api, keys = served
    answer = ask(api.client(keys["acme"]), tool_choice="none", max_tokens=24, temperature=0)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content is not None


def test_streamed_deltas_add_up_to_the_same_call(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    whole = ask(client, tool_choice=NAMED, temperature=0)
    chunks = list(ask(client, tool_choice=NAMED, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    first, later = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather")
    assert first.id.startswith("call_") and later  # the arguments come in pieces as they are written
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in later)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    expected = whole.choices[0].message.tool_calls[0]
    assert arguments == expected.function.arguments
    check_call(whole.choices[0].message.tool_calls[0])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""


def test_earlier_calls_and_their_results_render(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    first = ask(client, tool_choice=NAMED, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        {"role": "developer", "content": "Be brief."},
        *ASK,
        first.choices[0].message,  # the answer sent back as the SDK returned it (content null, tool_calls)
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.tool_calls is None
    # the prompt is the default format's turns (the tiny model's template shows no tools), call and result
    sent = [*conversation[:2], first.choices[0].message.model_dump(exclude_unset=True), conversation[3]]
    job = JobRequest.model_validate({"messages": sent, "tools": TOOLS, "tool_choice": "none"})
    turns, _ = chat_turns(job, native=None)
    assert '"arguments": {"city": ' in turns[2]["content"] and "sunny" in turns[3]["content"]
    assert answer.usage.prompt_tokens == len(ByteTokenizer().apply_chat_template(turns))
    with create_engine(dep.database_url).connect() as conn:
        prompt = conn.execute(select(jobs.c.prompt).where(jobs.c.job_id == answer.id)).scalar_one()
    assert f"[call {call.id}: get_weather(" in prompt and f"tool ({call.id}): " in prompt
    # the row keeps the calls: any API process answers the first request again by its id
    again = client.chat.completions.retrieve(first.id)
    assert again.choices[0].message.tool_calls == first.choices[0].message.tool_calls


def test_bad_tool_requests_are_refused_naming_the_field(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {"tool_choice": NAMED, "tools": [{**TOOLS[0], "function": {**TOOLS[0]["function"],
             "parameters": {"type": "object", "not": {}}}}]},
            "tools",
        ),
    ]  # fmt: skip
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, **fields)
        assert caught.value.param == param, (fields, caught.value.body)


def test_a_batch_line_with_tools_calls_as_the_synchronous_request(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "max_tokens": 120,
        "temperature": 0,
    }
    line = {"custom_id": "weather", "method": "POST", "url": "/v1/chat/completions", "body": body}
    file_id = client.files.create(file=("tools.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id, ("completed", "failed"))
    assert batch.status == "completed", batch
    (output,) = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    choice = output["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    sync = client.chat.completions.create(**body).choices[0].message.tool_calls[0]
    assert call["function"] == sync.function.model_dump()
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
