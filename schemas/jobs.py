"""Wire messages of the contract (pydantic v2). Producers can validate against `inferq schema`."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    field_validator,
    model_validator,
)

from schemas.chat import (
    MAX_TOOLS,
    ChatMessage,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolMode,
    tool_mode,
)

JobStatus = Literal["queued", "running", "succeeded", "failed", "rejected", "cancelled", "expired"]
# `tool_calls`: a sample that ended (as `stop` would) having called tools; its choice has `tool_calls`
FinishReasonName = Literal["stop", "length", "tool_calls", "abort", "expired", "rejected", "error"]


# Numbers as JSON has them: a float field takes 1 as well as 1.0, a whole-number field 2.0 as well as 2
# (JSON Schema's integers; JobRequest._whole_numbers), and neither takes a string ("1") or a boolean,
# which lax pydantic would convert.
Number = Annotated[float, Field(strict=True)]
# The worker's default limits (schemas.validation.Limits), here so the published schema states them; a
# worker may be configured lower, never higher than these.
MAX_N = 16
MAX_REGEX_BYTES = 4_000
MAX_CHOICES = 256
MAX_CHOICE_BYTES = 1_000


def _none(value: Any) -> bool:
    return value is None


class FieldError(ValueError):
    """A check across fields that names the one at fault (validation's `param`, the HTTP API's too)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Message(BaseModel):
    # NaN and infinities are never valid values of any field (a timeout of Infinity would overflow later)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class JsonSchemaSpec(_Message):
    """OpenAI's `response_format.json_schema`: the output is one JSON value valid against `schema`."""

    # `schema` on the wire (a pydantic attribute of that name would shadow BaseModel's own)
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, validate_by_name=True, serialize_by_alias=True
    )
    name: str = Field("response", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=4096)
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")  # {}: any JSON value
    strict: StrictBool | None = None  # accepted for OpenAI files; the output always follows the schema


class TextFormat(_Message):
    type: Literal["text"]


class JsonObjectFormat(_Message):
    type: Literal["json_object"]  # any JSON object


class JsonSchemaFormat(_Message):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class JobRequest(_Message):
    """A generation job, OpenAI-flavoured. Exactly one of `prompt` and `messages`."""

    job_id: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:@/+=-]+$")
    tenant: str = Field("default", min_length=1, max_length=128)
    # The served base model (one of its names), or a LoRA adapter on it: one of the worker's
    # `--lora-modules`, or of the fleet's registry that this tenant may use. None: the base.
    model: str | None = Field(None, min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # None: up to the context left after the prompt (or a deployment's cap, Limits.max_tokens)
    max_tokens: int | None = Field(None, ge=1)
    # Sampling fields left out (None) take the model's generation_config default, else greedy decoding.
    temperature: Number | None = Field(None, ge=0.0, le=2.0)  # 0 = greedy
    top_p: Number | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=1_000_000)  # 0 = off
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] = Field(default_factory=list)
    timeout_s: Number | None = Field(None, gt=0)
    metadata: dict[str, Any] = Field(default_factory=dict)
    bulk_id: str | None = Field(None, max_length=64)  # set by `inferq bulk submit`
    # Structured output (at most one of a JSON response_format, guided_regex and guided_choice). The
    # schema's lengths count characters; the worker counts UTF-8 bytes (Limits: max_regex_bytes, ...).
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_REGEX_BYTES)  # the output matches it
    # the output is exactly one of these
    guided_choice: list[Annotated[str, Field(max_length=MAX_CHOICE_BYTES)]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_CHOICES,
        json_schema_extra={"items": {"type": "string", "minLength": 1, "maxLength": MAX_CHOICE_BYTES}},
    )
    # n samples of the prompt; each is a choice of the result
    n: int = Field(1, ge=1, le=MAX_N)
    # token events on the tokens topic as the job generates (its result is published either way); false
    # for a job nobody follows token by token (a bulk or Batch API job, a non-streaming API call): Kafka, the
    # relay and the worker then handle its result alone, half the messages of a short job
    stream: StrictBool = True
    # Log probabilities of each generated token (and of the top_logprobs most likely at its position)
    logprobs: StrictBool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)  # None: 0 with logprobs
    presence_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Number = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: Number | None = Field(None, gt=0.0, le=10.0)  # None: the model's default, else 1
    # token id (as a string, as OpenAI's) -> bias added to its logit; ids are checked against the vocabulary
    logit_bias: dict[str, Number] | None = Field(
        None,
        max_length=300,
        json_schema_extra={  # what _token_ids checks, with its own messages
            "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        },
    )
    # Tool calling (chat jobs): the functions the model may call, whether and which it must call, and
    # whether one turn may make several calls. Calls are parsed from the output into each choice's
    # `tool_calls`; `required` and a named function are forced through the grammar (schemas/chat.py).
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: `auto` with tools, else `none`
    parallel_tool_calls: StrictBool = True

    @field_validator("max_tokens", "top_k", "seed", "n", "top_logprobs", mode="before")
    @classmethod
    def _whole_numbers(cls, value: Any) -> Any:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError("must be a whole number")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 9):
                raise ValueError(f"keys must be token ids (non-negative integers), got {key[:20]!r}")
            if int(key) in seen:  # "7" and "07"
                raise ValueError(f"token {int(key)} is named twice")
            seen.add(int(key))
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias of token {key} is {value:g}; it must be within -100..100")
        return bias

    @model_validator(mode="after")
    def _one_input(self) -> JobRequest:
        if (self.prompt is None) == (self.messages is None):
            raise FieldError("prompt" if self.prompt is not None else "messages",
                             "give exactly one of 'prompt' and 'messages'")  # fmt: skip
        if any(not s for s in self.stop):
            raise FieldError("stop", "stop strings must not be empty")
        constraints = [name for name in ("guided_regex", "guided_choice") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            constraints.append("response_format")
        if len(constraints) > 1:
            raise FieldError(
                constraints[-1], f"give at most one output constraint, got {' and '.join(constraints)}"
            )
        if any(not c for c in self.guided_choice or ()):
            raise FieldError("guided_choice", "guided_choice entries must not be empty")
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        self._check_tools(constraints)
        return self

    def _check_tools(self, constraints: list[str]) -> None:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            raise FieldError("tools", "tools must have distinct function names")
        mode = self.tool_mode
        if mode in ("required", "named") and not self.tools:
            raise FieldError("tool_choice", f"tool_choice {mode!r} needs tools")
        named = self.named_tool
        if named is not None and named not in names:
            raise FieldError("tool_choice", f"tool_choice names {named!r}, which is not in tools")
        if mode != "none" and self.messages is None:
            raise FieldError("tools", "tools need messages (a chat job), not prompt")
        if mode != "none" and constraints:
            raise FieldError(
                "tool_choice",
                f"tool calls cannot be combined with {constraints[0]}; give tool_choice 'none' to use it",
            )

    @property
    def tool_mode(self) -> ToolMode:
        """`none`, `auto`, `required` or `named`: whether and how the job's output calls its tools."""
        return tool_mode(self.tools, self.tool_choice)

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice forces, else None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def logprobs_k(self) -> int | None:
        """None: no log probabilities; k: each token's and the k most likely alternatives'."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CancelRequest(_Message):
    """Cancels `tenant`'s job of that id (job ids are per tenant). With per-tenant topics the tenant is the
    control topic's, and a cancel naming another is refused."""

    type: Literal["cancel"]
    job_id: str = Field(min_length=1, max_length=128)
    tenant: str = Field("default", min_length=1, max_length=128)


class Usage(_Message):
    prompt_tokens: int
    completion_tokens: int
    # of prompt_tokens, those the engine found in its prefix cache (OpenAI's
    # prompt_tokens_details.cached_tokens); None: not known (a job that never ran, an older worker's row)
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TopLogprob(_Message):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's UTF-8 bytes


class TokenLogprobEntry(_Message):
    """One generated token's entry of OpenAI's chat `logprobs.content`."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)  # most likely first


class TokenEvent(_Message):
    """A streamed text delta of one sample. (job_id, attempt, seq) identifies it; seq counts 0,1,2… per
    attempt. Each sample's last event has its `finish_reason`; the attempt's last event (`final`) also has
    `usage`, for the whole job. With n = 1 these are the same event.

    `offset` and `text_offset` say where the event starts in its sample's output, counting every attempt's:
    a resumed attempt continues from where the attempt before it saved (its first events restate the
    sample's output from 0), and an event for a position seen before carries the same text there, so a
    consumer keeps what it saw first. An attempt that could not resume starts over (`restarted`)."""

    job_id: str
    attempt: int
    seq: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReasonName | None = None  # set on the last event of sample `index`
    usage: Usage | None = None  # set on the last event of the attempt (after every sample's finish_reason)
    index: int = 0  # which of the job's n choices the delta belongs to
    logprobs: list[TokenLogprobEntry] | None = None  # one per token id, when the job asked for logprobs
    # None: sent by a worker from before these fields (its attempts restart the text at seq 0)
    offset: int | None = Field(None, ge=0)  # tokens of the sample's output before token_ids[0]
    text_offset: int | None = Field(None, ge=0)  # characters (code points) of its text before text[0]
    # this attempt's output starts over (it could not resume): what earlier attempts sent is not its text
    restarted: bool = False
    # pieces of the sample's tool calls (a job with tools): `text` is then what is not a call; left out of
    # the JSON when there are none, so events of jobs without tools are as they were
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_none)

    @property
    def final(self) -> bool:
        """The attempt's last event: its stream is over."""
        return self.usage is not None


class Timings(_Message):
    created_at: datetime | None = None
    started_at: datetime | None = None
    first_token_at: datetime | None = None
    finished_at: datetime | None = None
    queue_ms: float | None = None
    ttft_ms: float | None = None
    mean_itl_ms: float | None = None
    e2e_ms: float | None = None


class ChoiceLogprobs(_Message):
    content: list[TokenLogprobEntry]


class Choice(_Message):
    """One of a job's n samples, as OpenAI's `choices[i]`."""

    index: int
    text: str
    finish_reason: FinishReasonName | None = None
    logprobs: ChoiceLogprobs | None = None  # when the job asked for logprobs
    # the calls the sample made (a job with tools); `text` is then the output outside them (left out of
    # the JSON when there are none)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_none)


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
    # every sample of a job that ran, in index order ([] for one that never ran, or a compact result);
    # output_text and finish_reason are those of choice 0
    choices: list[Choice] = Field(default_factory=list)


class Rejection(_Message):
    """Why a message went to the dead-letter topic (also carried in its headers)."""

    job_id: str | None
    source_topic: str
    partition: int
    offset: int
    error: str
