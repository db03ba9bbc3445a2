"""A chat job's messages (and tools) as its model's chat template takes them.

Templates that render tools themselves (their `tool_dialect`: Qwen's `<tool_call>`, Llama 3's JSON) get
OpenAI's tools and the turns as HF's chat-template convention has them: an assistant turn's calls with
their arguments as objects, `tool` turns with their `tool_call_id`. Every other template (SmolLM2's,
Gemma's, the byte tokenizer's) gets inferq's default format in plain turns, which any template renders:

- the tools in the system turn: their definitions as JSON inside `<tools></tools>`, and how to call one,
  `<tool_call>` + `{"name": ..., "arguments": {...}}` + `</tool_call>` (the `hermes` dialect, parsed back
  by schemas/tool_calls.py);
- an assistant turn's calls written the same way after its content;
- tool results as a user turn of `<tool_response>` blocks (consecutive results in one turn, so templates
  that want users and assistants to alternate accept it).

`developer` is rendered as `system` (OpenAI's newer name for it), and the leading system turns are joined
into one, which every template accepts. With tool_choice `none` the tools are not shown at all: a model
that is not told of them cannot call them (earlier calls in the conversation still are).
"""

from __future__ import annotations

import json
from typing import Any

from schemas.chat import ChatMessage, Tool, ToolCall
from schemas.jobs import JobRequest
from schemas.tool_calls import DEFAULT_DIALECT, ToolDialect

ChatTurn = dict[str, Any]


def chat_turns(job: JobRequest, native: ToolDialect | None) -> tuple[list[ChatTurn], list[dict] | None]:
    """(the turns, the tools) to hand the template; `native`: the template's own tool dialect, if any."""
    messages = list(job.messages or ())
    shown = list(job.tools or ()) if job.tool_mode != "none" else []
    if native is not None:
        turns = [_native_turn(m) for m in messages]
        return _join_leading_system(turns), [t.model_dump(exclude_none=True) for t in shown] or None
    turns = []
    for m in messages:
        turn = _default_turn(m)
        previous = turns[-1] if turns else None
        if m.role == "tool" and previous is not None and previous.get("tool_results"):
            previous["content"] += "\n" + turn["content"]  # consecutive results: one turn
            continue
        turns.append(turn)
    for turn in turns:
        turn.pop("tool_results", None)
    turns = _join_leading_system(turns)
    if shown:  # after the system turn's own text, as templates with tools place them
        section = tools_section(shown, job.parallel_tool_calls)
        if turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{section}" if turns[0]["content"] else section
        else:
            turns.insert(0, {"role": "system", "content": section})
    return turns, None


def tools_section(tools: list[Tool], parallel: bool) -> str:
    """The default format's tool instructions, in the system turn."""
    lines = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    how_many = "one block per call" if parallel else "at most one call"
    return (
        "# Tools\n\nYou may call functions to help with the user's request. Their definitions, as JSON:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        f"To call a function, answer with a JSON object of its name and arguments in <tool_call></tool_call>"
        f" tags, {how_many}:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
    )


def call_text(call: ToolCall, dialect: ToolDialect = DEFAULT_DIALECT) -> str:
    """A call as the dialect writes it (an earlier turn's call shown in the default format)."""
    arguments = call.function.arguments
    try:
        json.loads(arguments)
    except ValueError:
        arguments = json.dumps(arguments, ensure_ascii=False)  # not JSON: shown as a string, never broken
    return f"{dialect.call_prefix(call.function.name)}{arguments}{dialect.call_suffix}"


def _default_turn(m: ChatMessage) -> ChatTurn:
    if m.role == "tool":
        content = f"<tool_response>\n{m.content}\n</tool_response>"
        return {"role": "user", "content": content, "tool_results": True}
    content = m.content or ""
    if m.tool_calls:
        calls = "\n".join(call_text(c) for c in m.tool_calls)
        content = f"{content}\n{calls}" if content else calls
    return {"role": _role(m), "content": content}


def _native_turn(m: ChatMessage) -> ChatTurn:
    turn: ChatTurn = {"role": _role(m), "content": m.content or ""}
    if m.tool_calls:  # (HF's convention: the function's arguments as an object)
        turn["tool_calls"] = [
            {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _arguments(call: ToolCall) -> Any:
    """HF templates write a call's arguments with `tojson`: an object, where OpenAI sends JSON text."""
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


def _role(m: ChatMessage) -> str:
    return "system" if m.role == "developer" else m.role


def _join_leading_system(turns: list[ChatTurn]) -> list[ChatTurn]:
    leading = 0
    while leading < len(turns) and turns[leading]["role"] == "system":
        leading += 1
    if leading < 2:
        return turns
    joined = "\n\n".join(t["content"] for t in turns[:leading] if t["content"])
    return [{"role": "system", "content": joined}, *turns[leading:]]


def prompt_text(job: JobRequest) -> str:
    """What the jobs row stores of a chat job: one line per turn, calls and results named."""
    lines = []
    for m in job.messages or ():
        head = f"{m.role} ({m.tool_call_id})" if m.tool_call_id else m.role
        calls = [f"[call {c.id}: {c.function.name}({c.function.arguments})]" for c in m.tool_calls or ()]
        lines.append(f"{head}: " + " ".join([m.content, *calls] if m.content else calls))
    return "\n".join(lines)
