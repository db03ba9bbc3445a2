"""Intake: a Kafka record becomes an engine request, or a rejection with a clear reason.

Nothing a record carries may escape as an exception: whatever fails while decoding, validating or
tokenizing it (a chat template that refuses the messages, a tokenizer error, a bug) becomes a rejection
of that one record, and the worker goes on with the next.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from gpu.engine import Engine
from gpu.engine_process import EngineProcess
from gpu.engine_types import GrammarSpec, LoraRequest
from gpu.tokenizer import Tokenizer
from schemas.job_key import JobKey, RequestId
from schemas.jobs import JobRequest
from schemas.tool_calls import DEFAULT_DIALECT, ToolDialect
from schemas.topics import Topics
from schemas.validation import InvalidMessage, Limits, logprob_room, parse_job, peek_job_id, peek_tenant
from workers.kafka_io import Record
from workers.serving.intake.chat_prompt import chat_turns, prompt_text
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.sampling import constraint_field, grammar_spec

log = logging.getLogger(__name__)


class PromptTooLong(InvalidMessage):
    """A prompt that leaves no room in the model's context for a single output token."""


class InvalidGrammar(InvalidMessage):
    """An output constraint (JSON schema, regex, choices) the grammar engine cannot compile."""


CompileGrammar = Callable[[GrammarSpec], Any]  # Engine.compile_grammar: raises ValueError for a bad one


@dataclass(frozen=True)
class Accepted:
    record: Record
    job_id: str
    priority: str
    job: JobRequest
    prompt_text: str  # what the jobs row stores (the prompt, or the messages rendered one per line)
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # the request's, clamped to what the context has room for
    grammar: Any = None  # the job's output constraint, compiled here (None: free text)
    tool_dialect: ToolDialect | None = None  # how its output's tool calls are written (None: no tools)
    # the adapter it runs on, as admission resolved it (admission/models.py): its name and where it is;
    # None: the base
    model: str | None = None
    lora: LoraRequest | None = None

    @property
    def tenant(self) -> str:
        return self.job.tenant

    # cached: read several times a job by the admission and engine threads (the values never change)
    @cached_property
    def key(self) -> JobKey:
        """What names this job (job ids are per tenant)."""
        return JobKey(self.tenant, self.job_id)

    @cached_property
    def request_id(self) -> RequestId:
        """The engine's request id of this job."""
        return self.key.request_id


def derived_job_id(record: Record) -> str:
    """The id of a job that brought none: stable across redeliveries of the same message."""
    return f"{record.topic}:{record.partition}:{record.offset}"


def rejection(
    record: Record,
    priority: str,
    error: str,
    reason: str,
    job_id: str | None = None,
    tenant: str | None = None,
) -> Rejected:
    """`tenant`: the tenant the record is known to come from (its topic's, or its admitted job's); without
    it, the one the message claims."""
    job_id = job_id or peek_job_id(record.value) or derived_job_id(record)
    return Rejected(record, job_id, tenant or peek_tenant(record.value), priority, error, reason)


class Intake:
    def __init__(
        self,
        topics: Topics,
        limits: Limits,
        tokenizer: Tokenizer,
        max_model_len: int,
        *,
        vocab_size: int | None = None,  # the model's logits; None: logit_bias ids are not checked
        compile_grammar: CompileGrammar | None = None,  # None: constrained jobs are rejected
    ) -> None:
        self.topics = topics
        self.limits = limits
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.compile_grammar = compile_grammar

    @classmethod
    def for_engine(cls, topics: Topics, limits: Limits, engine: Engine | EngineProcess) -> Intake:
        """The worker's intake for `engine`, with its own tokenizer: it runs on the intake thread while the
        engine thread detokenizes; grammars are compiled there too (the engine caches them; an engine in
        a process of its own compiles its copy on a thread beside its steps), so a slow schema never holds
        up a step."""
        return cls(
            topics,
            limits,
            engine.tokenizer.clone(),
            engine.scheduler.config.max_model_len,
            vocab_size=engine.model.config.vocab_size,
            compile_grammar=engine.compile_grammar,
        )

    def decide(self, record: Record) -> Accepted | Rejected | None:
        """A record of any polled topic (on the intake thread): a job record validated and tokenized;
        None for a control record (the engine loop handles it)."""
        return None if self.topics.is_control(record.topic) else self.accept(record)

    def accept(self, record: Record) -> Accepted | Rejected:
        priority = self.topics.priority_of(record.topic)
        # with per-tenant topics the topic proves the tenant (only its principal may write there)
        tenant = self.topics.tenant_of(record.topic) if self.topics.tenants else None
        if record.undecodable:
            job_id = derived_job_id(record)
            return rejection(record, priority, record.undecodable, "undecodable", job_id, tenant)
        try:
            return self._accept(record, priority, tenant)
        except InvalidMessage as exc:
            return rejection(record, priority, str(exc), "invalid", tenant=tenant)
        except Exception as exc:  # noqa: BLE001 - any other failure belongs to this record alone
            log.exception("record %s:%d@%d failed at intake", record.topic, record.partition, record.offset)
            error = f"could not be processed: {type(exc).__name__}: {exc}"
            return rejection(record, priority, error, "error", tenant=tenant)

    def _accept(self, record: Record, priority: str, tenant: str | None) -> Accepted | Rejected:
        job = parse_job(record.value, self.limits)
        job_id = job.job_id or derived_job_id(record)
        if tenant is not None:
            if "tenant" in job.model_fields_set and job.tenant != tenant:
                error = (
                    f"tenant {job.tenant!r} does not match the topic's tenant {tenant!r}: a job is posted "
                    "as the tenant whose topic it is on"
                )
                return rejection(record, priority, error, "wrong_tenant", job_id, tenant)
            job = job.model_copy(update={"tenant": tenant})
        try:
            prompt_text, ids, max_tokens = self.prepare(job)
            grammar = self.grammar(job)
        except PromptTooLong as exc:
            return rejection(record, priority, str(exc), "too_long", job_id, job.tenant)
        except InvalidGrammar as exc:
            return rejection(record, priority, str(exc), "invalid_grammar", job_id, job.tenant)
        dialect = self.tool_dialect(job)
        return Accepted(record, job_id, priority, job, prompt_text, ids, max_tokens, grammar, dialect)

    def tool_dialect(self, job: JobRequest) -> ToolDialect | None:
        """How the job's output writes tool calls (its template's dialect, else inferq's default format);
        None for a job whose output calls nothing (no tools, or tool_choice none)."""
        if job.tool_mode == "none":
            return None
        return self.tokenizer.tool_dialect or DEFAULT_DIALECT

    def grammar(self, job: JobRequest) -> Any:
        """The job's output constraint compiled (the engine caches it by its source), or None; raises
        InvalidGrammar with the grammar engine's reason. Runs here, off the engine thread: compiling a
        schema can take far longer than a step."""
        spec = grammar_spec(job, self.tool_dialect(job) or DEFAULT_DIALECT)
        if spec is None:
            return None
        field = constraint_field(spec)
        if self.compile_grammar is None:
            raise InvalidGrammar(f"{field}: this worker does not support output constraints")
        try:
            return self.compile_grammar(spec)
        except ValueError as exc:  # GrammarError: a message meant for the job's producer
            raise InvalidGrammar(f"{field} cannot be compiled: {exc}") from None

    def prepare(self, job: JobRequest) -> tuple[str, tuple[int, ...], int]:
        """The prompt as stored, its token ids, and max_tokens clamped to the context's room; raises
        InvalidMessage (PromptTooLong when it does not fit). `inferq run-batch` uses it too."""
        prompt_text, ids = self._tokenize(job)
        room = self.max_model_len - len(ids)
        if room < 1:
            raise PromptTooLong(
                f"prompt is {len(ids)} tokens; the model's context is {self.max_model_len} tokens"
            )
        self._check_vocabulary(job)
        return prompt_text, tuple(ids), min(self._wanted(job, room), room)

    def _wanted(self, job: JobRequest, room: int) -> int:
        """The job's max_tokens; none named: the deployment's cap if it has one, else the context left,
        and for a job with log probabilities no more than their bound allows (`logprob_room`)."""
        if job.max_tokens is not None:
            return job.max_tokens
        wanted = room if self.limits.max_tokens is None else self.limits.max_tokens
        bound = logprob_room(job, self.limits)
        return wanted if bound is None else min(wanted, bound)

    def _check_vocabulary(self, job: JobRequest) -> None:
        if self.vocab_size is None or not job.logit_bias:
            return
        outside = sorted(int(t) for t in job.logit_bias if int(t) >= self.vocab_size)
        if outside:
            raise InvalidMessage(
                f"logit_bias names token {outside[0]}; this model's vocabulary has {self.vocab_size} tokens "
                f"(ids 0-{self.vocab_size - 1})"
            )

    def _tokenize(self, job: JobRequest) -> tuple[str, list[int]]:
        if job.prompt is not None:
            if not job.prompt:
                raise InvalidMessage("prompt is empty")
            return job.prompt, self.tokenizer.encode(job.prompt, self.limits.special_tokens_in_text)
        turns, tools = chat_turns(job, self.tokenizer.tool_dialect)
        try:
            ids = self.tokenizer.apply_chat_template(turns, self.limits.special_tokens_in_text, tools)
        except ValueError as exc:  # e.g. a model without a chat template, or roles it does not accept
            raise InvalidMessage(f"messages cannot be rendered for this model: {exc}") from None
        return prompt_text(job), ids
