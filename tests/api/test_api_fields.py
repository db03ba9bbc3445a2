"""Every field the official `openai` SDK can send on chat.completions.create, completions.create,
files.create and batches.create is in docs/api.md's table, and the table says what the code does: honoured
and ignored fields are taken, a `partly` field at its neutral value is taken and at another is refused, and
a refused one is a 400 whose `param` names it. The SDK's own request types are read, so a field a new SDK
adds fails here until the table (and the code) decide about it."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types import batch_create_params, completion_create_params, file_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError
from sqlalchemy import create_engine, func, select, update

from schemas.tables import api_files
from tests.api.api_factories import MODEL, wait_batch
from workers.api.bodies import job_of_body
from workers.api.errors import APIError
from workers.api.protocol import (
    BATCH_FIELDS,
    FILE_FIELDS,
    BatchCreate,
    check_file_form,
    field_kinds,
    split_live_options,
    upload_lifetime,
)
from workers.bulk.batch_fields import EXTENSIONS
from workers.db.api_files import purge_expired

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
CALLS = {
    "chat.completions.create": chat_create_params.CompletionCreateParamsStreaming,  # Base + `stream`
    "completions.create": completion_create_params.CompletionCreateParamsStreaming,
    "files.create": file_create_params.FileCreateParams,
    "batches.create": batch_create_params.BatchCreateParams,
}
KINDS = ("honoured", "ignored", "partly", "refused")


def table() -> dict[str, dict[str, tuple[str, str]]]:
    """docs/api.md's tables: call -> field -> (what inferq does, notes)."""
    found: dict[str, dict[str, tuple[str, str]]] = {}
    call = None
    for line in DOC.read_text().splitlines():
        heading = re.match(r"^\*\*([a-z.]+\.create)\*\* ", line)
        if heading:
            call = heading[1]
            found[call] = {}
        elif call and (row := re.match(r"^\| `(\w+)` \| (\w+) \|\s*(.*?)\s*\|$", line)):
            found[call][row[1]] = (row[2], row[3])
        elif call and found[call] and not line.startswith("|"):
            call = None
    return found


def sdk_fields(call: str) -> set[str]:
    """The request's keys: a TypedDict's annotations hold its bases' too."""
    return set(CALLS[call].__annotations__)


def test_the_table_lists_every_field_of_the_sdk_and_only_its_own_or_extensions():
    documented = table()
    assert set(documented) == set(CALLS)
    for call, fields in documented.items():
        sdk = sdk_fields(call)
        missing = sdk - set(fields)
        assert not missing, f"the SDK's {call} has fields docs/api.md does not list: {sorted(missing)}"
        for name, (kind, notes) in fields.items():
            assert kind in KINDS, (call, name, kind)
            if name not in sdk:  # inferq's own, or a field an OpenAI Batch file may carry
                assert "*extension*" in notes or kind == "ignored", (call, name)
            else:
                assert "*extension*" not in notes, (call, name)


@pytest.mark.parametrize(
    ("call", "code"),
    [
        ("chat.completions.create", field_kinds("/v1/chat/completions")),
        ("completions.create", field_kinds("/v1/completions")),
        ("files.create", FILE_FIELDS),
        ("batches.create", BATCH_FIELDS),
    ],
)
def test_the_table_says_what_the_code_does(call, code):
    documented = {name: kind for name, (kind, _) in table()[call].items()}
    assert documented == code
    if call == "batches.create":
        assert set(BatchCreate.model_fields) == set(code)
    extensions = {n for n, (_, notes) in table()[call].items() if "*extension*" in notes}
    assert extensions <= EXTENSIONS | {"priority", "response_format"}


# ---- the code's behaviour, field by field (the route's own checks, without services) -------------------
BASE = {
    "chat.completions.create": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "completions.create": {"model": MODEL, "prompt": "hi"},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# a value each taken field is taken at (its neutral value, for a `partly` one) ...
TAKEN: dict[str, Any] = {
    "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "frequency_penalty": 0.5,
    "presence_penalty": 0.5, "logit_bias": {"5": 1}, "logprobs": True, "top_logprobs": 2,
    "max_completion_tokens": 8, "max_tokens": 8, "n": 2, "response_format": {"type": "json_object"},
    "seed": 1, "stop": ["x"], "stream": True,
    "stream_options": {"include_usage": True, "include_obfuscation": False},
    "temperature": 0.5, "top_p": 0.9, "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False,
    "metadata": {"a": "b"}, "store": True, "user": "u", "safety_identifier": "s", "service_tier": "flex",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit"},
    "prediction": {"type": "content", "content": "x"}, "modalities": ["text"], "best_of": 1, "echo": False,
    "suffix": "", "top_k": 5, "repetition_penalty": 1.1, "guided_regex": "[a-z]+",
    "guided_choice": ["a", "b"], "priority": "high",
}  # fmt: skip
# ... and a value a `partly` field is refused at
NOT_NEUTRAL = {"modalities": ["text", "audio"], "best_of": 3, "echo": True, "suffix": "tail"}


def live(call: str, body: dict[str, Any]) -> None:
    """What the route does with a body before posting its job: raises APIError when it refuses it."""
    url = "/v1/chat/completions" if call == "chat.completions.create" else "/v1/completions"
    rest, _ = split_live_options(body)
    job_of_body(url, rest, "acme", MODEL, "chatcmpl-1")


def request_cases() -> list[tuple[str, str, str]]:
    return [(call, name, kind) for call in BASE for name, (kind, _) in table()[call].items()]


@pytest.mark.parametrize(("call", "name", "kind"), request_cases())
def test_each_request_field_does_what_the_table_says(call, name, kind):
    if kind == "refused":
        with pytest.raises(APIError) as caught:
            live(call, {**BASE[call], name: {"any": "value"}})
        assert caught.value.status == 400 and caught.value.param == name
        live(call, {**BASE[call], name: None})  # null is the field left out
        return
    body = {**BASE[call], name: TAKEN[name]}
    if call == "completions.create" and name == "logprobs":
        body[name] = 2  # the completions API's logprobs is a count
    if name == "top_logprobs":
        body["logprobs"] = True  # (it needs it)
    live(call, body)
    if kind == "partly":
        with pytest.raises(APIError) as caught:
            live(call, {**BASE[call], name: NOT_NEUTRAL[name]})
        assert caught.value.param == name


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 9}, "temperature"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "x", "audio": {}}]}, "messages[0].audio"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"wat": 1}, "wat"),
        ({"model": 5}, "model"),
        ({"messages": [{"role": "user", "content": "a\x00b"}]}, "messages[0].content"),
    ],
)
def test_a_refused_value_names_its_field_never_null(body, param):
    with pytest.raises(APIError) as caught:
        live("chat.completions.create", {**BASE["chat.completions.create"], **body})
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def test_an_earlier_answer_sent_back_as_openai_returns_it_is_taken():
    answer = {"role": "assistant", "content": "hi", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}  # fmt: skip
    turns = [{"role": "user", "content": "hi", "name": "ann"}, answer, {"role": "user", "content": "more"}]
    live("chat.completions.create", {**BASE["chat.completions.create"], "messages": turns})


def test_file_fields_as_the_sdk_sends_them():
    assert upload_lifetime({"purpose": "batch", "expires_after[anchor]": "created_at",
                            "expires_after[seconds]": "7200"}) == 7200  # fmt: skip
    assert upload_lifetime({"purpose": "batch"}) is None
    for form, param in [
        ({"expires_after[anchor]": "last_used", "expires_after[seconds]": "7200"}, "expires_after.anchor"),
        ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, "expires_after.seconds"),
        ({"expires_after[anchor]": "created_at"}, "expires_after.seconds"),
    ]:
        with pytest.raises(APIError) as caught:
            upload_lifetime(form)
        assert caught.value.param == param
    check_file_form(["file", "purpose", "expires_after[anchor]", "expires_after[seconds]"])
    with pytest.raises(APIError) as caught:
        check_file_form(["file", "purpose", "chunking"])
    assert caught.value.param == "chunking"


def test_batch_fields_as_the_sdk_sends_them():
    expiry = {"anchor": "created_at", "seconds": 3600}
    body = {"input_file_id": "file-1", "endpoint": "/v1/chat/completions", "completion_window": "24h",
            "metadata": {"a": "b"}, "output_expires_after": expiry}  # fmt: skip
    assert BatchCreate.model_validate(body).output_expires_after.seconds == 3600
    refusals = [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"output_expires_after": {"seconds": 5}}, "output_expires_after.anchor"),
        ({"wat": 1}, "wat"),
    ]
    for bad, param in refusals:
        with pytest.raises(ValidationError) as caught:
            BatchCreate.model_validate({**body, **bad})
        assert ".".join(str(p) for p in caught.value.errors()[0]["loc"]) == param


@pytest.mark.services
@pytest.mark.slow
def test_through_the_sdk_refused_fields_name_themselves_and_ignored_ones_are_taken(served):
    _, api, keys = served
    client = api.client(keys["acme"])
    chat = table()["chat.completions.create"]
    for name in [n for n, (kind, _) in chat.items() if kind == "refused"]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                **BASE["chat.completions.create"], max_tokens=2, extra_body={name: {}}
            )
        assert caught.value.param == name, caught.value.body
    ignored = {n: TAKEN[n] for n, (kind, _) in chat.items() if kind == "ignored"}
    answer = client.chat.completions.create(
        **BASE["chat.completions.create"], max_tokens=2, stream=False, extra_body=ignored
    )
    assert answer.choices[0].message.content is not None
    stream = client.chat.completions.create(
        **BASE["chat.completions.create"], max_tokens=2, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": True},
    )  # fmt: skip
    assert list(stream)[-1].usage.completion_tokens == 2


@pytest.mark.services
@pytest.mark.slow
def test_expiry_of_uploads_and_batch_outputs_is_honoured(served):
    dep, api, keys = served
    client = api.client(keys["acme"])
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {**BASE["chat.completions.create"], "max_tokens": 2}}  # fmt: skip
    upload = client.files.create(
        file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 7200},
    )  # fmt: skip
    assert upload.expires_at == upload.created_at + 7200
    assert client.files.retrieve(upload.id).expires_at == upload.expires_at
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 10})  # fmt: skip
    assert caught.value.param == "expires_after.seconds"
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )  # fmt: skip
    batch = wait_batch(client, batch.id, ("completed", "failed"))
    output = client.files.retrieve(batch.output_file_id)
    assert batch.status == "completed" and output.expires_at == output.created_at + 3600
    # past its expires_at a file is gone: not served, not listed, and deleted by the driver
    db = create_engine(dep.database_url)
    with db.begin() as conn:
        conn.execute(update(api_files).where(api_files.c.file_id == output.id).values(
            expires_at=func.now() - timedelta(seconds=1)))  # fmt: skip
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(output.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(output.id)
    assert output.id not in [f.id for f in client.files.list()]
    with db.connect() as conn:
        assert purge_expired(conn) <= 1  # (the driver may have been first)
        conn.commit()
        assert (
            conn.execute(select(api_files.c.file_id).where(api_files.c.file_id == output.id)).first() is None
        )
    db.dispose()
