"""Intake: a Kafka record becomes an engine request, or a rejection with a clear reason."""

from __future__ import annotations

from dataclasses import dataclass

from gpu.tokenizer import Tokenizer
from schemas.jobs import JobRequest
from schemas.topics import Topics
from schemas.validation import InvalidMessage, Limits, parse_job, peek_job_id
from workers.kafka_io import Record


@dataclass(frozen=True)
class Accepted:
    record: Record
    job_id: str
    priority: str
    job: JobRequest
    prompt_text: str  # what the jobs row stores (the prompt, or the messages rendered one per line)
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # the request's, clamped to what the context has room for


@dataclass(frozen=True)
class Rejected:
    record: Record
    job_id: str
    priority: str
    error: str


def derived_job_id(record: Record) -> str:
    """The id of a job that brought none: stable across redeliveries of the same message."""
    return f"{record.topic}:{record.partition}:{record.offset}"


class Intake:
    def __init__(self, topics: Topics, limits: Limits, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.topics = topics
        self.limits = limits
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def accept(self, record: Record) -> Accepted | Rejected:
        priority = self.topics.priority_of(record.topic)
        try:
            job = parse_job(record.value, self.limits)
            job_id = job.job_id or derived_job_id(record)
            prompt_text, ids = self._tokenize(job)
        except InvalidMessage as exc:
            job_id = peek_job_id(record.value) or derived_job_id(record)
            return Rejected(record, job_id, priority, str(exc))
        room = self.max_model_len - len(ids)
        if room < 1:
            error = f"prompt is {len(ids)} tokens; the model's context is {self.max_model_len} tokens"
            return Rejected(record, job_id, priority, error)
        wanted = job.max_tokens or min(self.limits.default_max_tokens, self.limits.max_tokens)
        return Accepted(record, job_id, priority, job, prompt_text, tuple(ids), min(wanted, room))

    def _tokenize(self, job: JobRequest) -> tuple[str, list[int]]:
        if job.prompt is not None:
            if not job.prompt:
                raise InvalidMessage("prompt is empty")
            return job.prompt, self.tokenizer.encode(job.prompt)
        messages = [m.model_dump() for m in job.messages or ()]
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return text, self.tokenizer.apply_chat_template(messages)
