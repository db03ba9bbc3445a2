"""A chat or completion request's body as a job, by the Batch path's rules, refusing a body by the field at
fault (OpenAI's `param`, `messages[2].content` for a nested one): a body means here what it means as a Batch
line (workers/bulk/batch_fields.py says what each field does)."""

from __future__ import annotations

from typing import Any

from schemas.jobs import JobRequest
from schemas.validation import InvalidMessage
from workers.api.errors import APIError
from workers.api.protocol import body_param
from workers.bulk.batch_fields import check_body
from workers.bulk.batch_format import BatchLine, checked_job

# Fields whose check may compile a grammar (xgrammar: milliseconds to seconds), best done off an event loop
GRAMMAR_FIELDS = ("response_format", "guided_regex", "guided_choice", "tools")


def needs_grammar(body: dict[str, Any]) -> bool:
    return any(body.get(name) is not None for name in GRAMMAR_FIELDS)


def job_of_body(
    url: str, body: dict[str, Any], tenant: str, model: str | None, job_id: str
) -> tuple[BatchLine, JobRequest]:
    """The Batch line a body stands for and its job (id `job_id`, the key's tenant); APIError 400 naming
    the field when the body cannot run as asked."""
    problem = check_body(url, body)
    if problem is None and body.get("model") is not None and not isinstance(body["model"], str):
        problem = ("model", "body.model must be a string")
    if problem is not None:
        raise APIError(400, problem[1].removeprefix("body."), param=problem[0], code="invalid_request")
    line = BatchLine(1, job_id, url, body.get("model") or model, body)
    try:
        job = checked_job(line, bulk_id="api", tenant=tenant)
    except InvalidMessage as exc:
        param = body_param(url, body, exc.param)
        raise APIError(400, str(exc).removeprefix("body."), param=param, code="invalid_request") from None
    return line, job.model_copy(update={"job_id": job_id, "bulk_id": None, "metadata": {}})
