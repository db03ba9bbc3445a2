"""Chat messages and tools of the job message, as OpenAI's chat API has them (pydantic v2).

A conversation with tools: the job lists `tools` (function definitions with JSON-schema `parameters`), an
assistant turn may be `content: null` with `tool_calls`, and each call's result comes back as a `tool`
message naming its `tool_call_id`. `developer` is OpenAI's newer name for `system` (rendered as one).
What a job's output calls is in its choices' `tool_calls` (schemas/jobs.py `Choice`), parsed by the worker
(schemas/tool_calls.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

MAX_TOOLS = 128  # OpenAI's limit on a request's tools
# OpenAI's rule for a function's name; it also keeps names safe inside the grammar and prompt literals
FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
MAX_CALL_ID = 256


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class FunctionCall(_Message):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as the model wrote it (OpenAI's shape): parse it before use


class ToolCall(_Message):
    """A call an assistant turn made: in a result's choice, or sent back in a later turn's messages."""

    id: str = Field(min_length=1, max_length=MAX_CALL_ID)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(_Message):
    name: str | None = None  # on a call's first delta only
    arguments: str = ""  # the next piece of the arguments' JSON text


class ToolCallDelta(_Message):
    """A piece of a streamed call, as OpenAI's stream chunks carry it: the call's first delta has its `id`,
    `type` and `function.name`; later ones (same `index`) append to `function.arguments`."""

    index: int  # which call of the choice (0, 1, ...)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatMessage(_Message):
    """One turn. `content` is required except on an assistant turn that made `tool_calls`; a `tool` turn
    answers the call named by `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=MAX_CALL_ID)

    @model_validator(mode="after")
    def _shape_of_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role}")
        if (self.tool_call_id is None) != (self.role != "tool"):
            raise ValueError("a tool message needs tool_call_id (and only tool messages have one)")
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs content" + (
                " (or tool_calls)" if self.role == "assistant" else ""
            ))  # fmt: skip
        return self


class FunctionDefinition(_Message):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    # The arguments' JSON schema; absent: a function without arguments (an empty object)
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # accepted for OpenAI's files: forced calls always follow the schema

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(_Message):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Message):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(_Message):
    """`{"type": "function", "function": {"name": ...}}`: exactly one call, of that function."""

    type: Literal["function"]
    function: FunctionName


# `none`: no call (the tools are not shown to the model); `auto`: the model may call; `required`: at least
# one call (exactly one unless parallel_tool_calls); a named function: one call of it.
ToolChoiceMode = Literal["none", "auto", "required"]
ToolChoice = Annotated[ToolChoiceMode | NamedToolChoice, Field(union_mode="left_to_right")]
ToolMode = Literal["none", "auto", "required", "named"]


def tool_mode(tools: list[Tool] | None, choice: str | NamedToolChoice | None) -> ToolMode:
    """What a job's tools and tool_choice ask for: OpenAI's default is `auto` with tools, else `none`."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        return "named"
    return choice  # type: ignore[return-value]  # one of the three literals (validated)
