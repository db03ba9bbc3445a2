"""Wire messages of the contract (pydantic v2). Producers can validate against `inferq schema`."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

JobStatus = Literal["queued", "running", "succeeded", "failed", "rejected", "cancelled", "expired"]
FinishReasonName = Literal["stop", "length", "abort", "expired", "rejected", "error"]


class _Message(BaseModel):
    # NaN and infinities are never valid values of any field (a timeout of Infinity would overflow later)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ChatMessage(_Message):
    role: Literal["system", "user", "assistant"]
    content: str


class JobRequest(_Message):
    """A generation job, OpenAI-flavoured. Exactly one of `prompt` and `messages`."""

    job_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/+=-]+$")
    tenant: str = Field("default", min_length=1, max_length=128)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: the worker's default (Limits.default_max_tokens)
    # Sampling fields left out (None) take the model's generation_config default, else greedy decoding.
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # 0 = greedy
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000)  # 0 = off
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list)
    timeout_s: float | None = Field(None, gt=0)
    metadata: dict[str, Any] = Field(default_factory=dict)
    bulk_id: str | None = Field(None, max_length=64)  # set by `inferq bulk submit`

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self


class CancelRequest(_Message):
    """Cancels `tenant`'s job of that id (job ids are per tenant). With per-tenant topics the tenant is the
    control topic's, and a cancel naming another is refused."""

    type: Literal["cancel"]
    job_id: str = Field(min_length=1, max_length=128)
    tenant: str = Field("default", min_length=1, max_length=128)


class Usage(_Message):
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenEvent(_Message):
    """A streamed text delta. (job_id, attempt, seq) identifies it; seq counts 0,1,2… per attempt."""

    job_id: str
    attempt: int
    seq: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonName | None = None  # set on the last event of the attempt
    usage: Usage | None = None  # set on the last event


class Timings(_Message):
    created_at: datetime | None = None
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    queue_ms: float | None = None
    ttft_ms: float | None = None
    mean_itl_ms: float | None = None
    e2e_ms: float | None = None


class JobResult(_Message):
    """The final word on a job, published to the results topic after its row is committed."""

    job_id: str
    status: JobStatus
    tenant: str = "default"
    priority: str = "normal"
    output_text: str | None = None
    finish_reason: FinishReasonName | None = None
    usage: Usage | None = None
    timings: Timings = Field(default_factory=Timings)
    attempt: int = 0
    worker_id: str | None = None
    bulk_id: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class Rejection(_Message):
    """Why a message went to the dead-letter topic (also carried in its headers)."""

    job_id: str | None
    source_topic: str
    partition: int
    offset: int
    error: str
