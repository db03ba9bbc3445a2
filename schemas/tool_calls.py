"""Tool calls in a model's text: how a model writes them (its dialect), and the parser that takes them out.

A model with tools writes a call in the syntax its chat template taught it; the worker parses each sample's
text as it streams, so token events carry OpenAI's `tool_calls` deltas and the result's choices carry the
calls, for Kafka consumers and the HTTP API alike. Two dialects:

- `hermes` (Qwen2.5, Qwen3, Hermes, and inferq's default format for templates without tools of their own):
  `<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>`, one block a call.
- `llama3_json` (Llama 3.1-3.3): the whole turn is one JSON object `{"name": ..., "parameters": {...}}`.

The parser is incremental and decides each piece once: text outside calls is content, streamed as it comes
(only a possible start of a call's marker is held back); a call whose opening `{"name": "...", "arguments": `
is read gets its first delta (id, name) at once and its arguments streamed as written; a block that is not a
call after all (no JSON object with a name) is handed back as content. So the deltas a stream carried add up
to exactly the final choice. A call cut short (`max_tokens`) keeps the arguments written so far, as OpenAI's.
Pure Python: the worker (workers/serving/loop) and `inferq run-batch` use it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolDialect:
    name: str
    open: str  # what starts a call block ("" when a call is a bare JSON object)
    close: str  # what ends it
    arguments_key: str  # the key of the arguments in the call object
    separator: str | None  # what the model writes between two calls; None: one call a turn

    def call_prefix(self, name: str) -> str:
        """A call of `name` as written up to its arguments (what a forced call's grammar fixes)."""
        return f'{self.open}{{"name": "{name}", "{self.arguments_key}": '

    @property
    def call_suffix(self) -> str:
        return "}" + self.close


HERMES = ToolDialect("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n")
LLAMA3_JSON = ToolDialect("llama3_json", "", "", "parameters", None)
DEFAULT_DIALECT = HERMES  # inferq's own format, for templates that render no tools
DIALECTS = {d.name: d for d in (HERMES, LLAMA3_JSON)}

# A call object's opening, once its name is known: `{"name": "f", "arguments": ` (either key).
_OPENING = re.compile(
    r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)
_MAX_OPENING = 256  # a call object that has not shown its name within this many characters never will


def call_id(seed: str, index: int, position: int) -> str:
    """The id of call `position` of sample `index` of the job `seed` names: OpenAI's `call_` and 24
    characters, the same whichever worker or attempt parses it (a re-sent token event says the same)."""
    digest = hashlib.blake2b(f"{seed}/{index}/{position}".encode(), digest_size=12).hexdigest()
    return f"call_{digest}"


@dataclass(frozen=True)
class Parsed:
    """What one piece of text (or the end) adds: content, and pieces of calls in OpenAI's delta shape."""

    content: str = ""
    tool_calls: tuple[dict[str, Any], ...] = ()


@dataclass
class _Out:
    """A Parsed as it is being made."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def done(self) -> Parsed:
        return Parsed(self.content, tuple(self.tool_calls))


class _JsonDepth:
    """Follows JSON text character by character: nesting depth and whether inside a string."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False

    def push(self, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1


class _Call:
    """The call block being read: its raw text, and its object's progress."""

    def __init__(self, opened_by: str) -> None:
        self.raw = opened_by  # everything read of the block, markers included (content, if it is no call)
        self.body = ""  # the call object's text from its `{`
        self.scan = _JsonDepth()
        self.started = False  # its `{` was read
        self.closed = False  # its object ended
        self.malformed = False  # text that is no JSON object came first
        self.position: int | None = None  # its index among the sample's calls, once its delta went out
        self.arguments: _Arguments | None = None


class _Arguments:
    """The arguments value of a call whose opening was read: which characters belong to it."""

    def __init__(self) -> None:
        self.scan = _JsonDepth()
        self.first: str | None = None  # the value's first character
        self.done = False

    def take(self, char: str) -> bool:
        """Whether `char` is part of the value (False once the value has ended)."""
        if self.done:
            return False
        if self.first is None:
            if char.isspace():
                return False
            self.first = char
        elif self.first not in '{["' and not self.scan.in_string and char in ",}] \n\r\t":
            self.done = True  # a number, true, false or null ends at what follows it
            return False
        self.scan.push(char)
        if self.first in "{[" and self.scan.depth == 0 or self.first == '"' and not self.scan.in_string:
            self.done = True
        return True


class ToolCallParser:
    """Parses one sample's text as it arrives; `feed` each delta, then `finish` once at its end.

    `ids(position)` names the sample's call at that position (`call_id`)."""

    def __init__(self, dialect: ToolDialect, ids: Callable[[int], str]) -> None:
        self.dialect = dialect
        self._ids = ids
        self._open = dialect.open.strip()
        self._close = dialect.close.strip()
        self._pending = ""  # text read but not decided yet
        self._call: _Call | None = None
        self._text_only = False  # llama3_json: the turn did not start with `{`, so it is all content
        self._after_call = False  # a call just ended: whitespace next is a separator
        self.calls: list[dict[str, Any]] = []  # every call so far, OpenAI's message shape

    def feed(self, text: str) -> Parsed:
        self._pending += text
        out = _Out()
        self._run(out, final=False)
        return out.done()

    def finish(self) -> Parsed:
        out = _Out()
        self._run(out, final=True)
        if self._call is not None:
            self._end_call(out)
        out.content += self._pending
        self._pending = ""
        return out.done()

    # ---- the states --------------------------------------------------------------------------------
    def _run(self, out: _Out, final: bool) -> None:
        while self._pending:
            if self._call is not None:
                if not self._in_call(out, final):
                    return
            elif not self._outside(out, final):
                return

    def _outside(self, out: _Out, final: bool) -> bool:
        """Text between calls; False when the rest must wait for more text. Whitespace that only separates
        content from a call, or calls from each other, is no content: it waits until text follows."""
        if self._open:
            if self._after_call:
                self._pending = self._pending.lstrip()
                if not self._pending:
                    return False
                self._after_call = False
            found = self._pending.find(self._open)
            if found < 0:
                keep = 0 if final else _partial_suffix(self._pending, self._open)
                head = self._pending[: len(self._pending) - keep]
                if not final:
                    head = head.rstrip()
                out.content += head
                self._pending = self._pending[len(head) :]
                return False
            out.content += self._pending[:found].rstrip()
            self._pending = self._pending[found + len(self._open) :]
            self._call = _Call(self._open)
            return True
        # no marker (llama3_json): a call is the turn's whole text, starting with `{`
        if self._text_only or self.calls:
            out.content += self._pending
            self._pending = ""
            return False
        stripped = self._pending.lstrip()
        if not stripped:
            return False  # only whitespace so far: wait
        if stripped[0] != "{":
            self._text_only = True
            return True
        self._call = _Call("")
        return True

    def _in_call(self, out: _Out, final: bool) -> bool:
        """Inside a call block: read its object; end it at the close marker (or, without markers, at the
        object's end). False when the rest must wait for more text."""
        call = self._call
        assert call is not None
        i = 0
        text = self._pending
        while i < len(text):
            if self._close and not call.scan.in_string and text.startswith(self._close[0], i):
                if text.startswith(self._close, i):
                    call.raw += text[i : i + len(self._close)]
                    self._pending = text[i + len(self._close) :]
                    self._end_call(out)
                    return True
                if not final and self._close.startswith(text[i:]):
                    break  # a possible start of the marker: wait
            char = text[i]
            if call.closed and not char.isspace():  # text after the object but no marker: the call ends
                self._pending = text[i:]
                self._end_call(out)
                return True
            call.raw += char
            i += 1
            if call.closed or call.malformed:
                continue  # whitespace before the marker, or no object: on to the marker
            if not call.started:
                if char == "{":
                    call.started = True
                elif not char.isspace():
                    call.malformed = True
                    continue
                else:
                    continue
            call.body += char
            call.scan.push(char)
            self._stream_arguments(call, char, out)
            if call.scan.depth == 0:
                call.closed = True
                if not self._close:  # a bare object is the whole call
                    self._pending = text[i:]
                    self._end_call(out)
                    return True
        self._pending = text[i:]
        return False

    def _stream_arguments(self, call: _Call, char: str, out: _Out) -> None:
        if call.arguments is not None:
            if call.arguments.take(char):
                self._delta(out, call, arguments=char)
            return
        if len(call.body) > _MAX_OPENING:
            return
        opening = _OPENING.fullmatch(call.body)
        if opening is None:
            return
        call.position = len(self.calls)
        self.calls.append(
            {
                "id": self._ids(call.position),
                "type": "function",
                "function": {"name": opening[1], "arguments": ""},
            }
        )
        out.tool_calls.append(
            {"index": call.position, "id": self.calls[-1]["id"], "type": "function",
             "function": {"name": opening[1], "arguments": ""}}
        )  # fmt: skip
        call.arguments = _Arguments()

    def _delta(self, out: _Out, call: _Call, arguments: str) -> None:
        assert call.position is not None
        self.calls[call.position]["function"]["arguments"] += arguments
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last["index"] == call.position:
            last["function"]["arguments"] += arguments
        else:
            out.tool_calls.append({"index": call.position, "function": {"arguments": arguments}})

    def _end_call(self, out: _Out) -> None:
        """The block ended (its marker, its object, or the text): a call, or content after all."""
        call, self._call = self._call, None
        assert call is not None
        if call.position is not None:
            self._after_call = True
            return  # announced as it streamed: it stays a call, with the arguments written
        parsed = _whole_call(call.body) if call.closed and not call.malformed else None
        if parsed is None:
            out.content += call.raw
            return
        self._after_call = True
        name, arguments = parsed
        position = len(self.calls)
        self.calls.append(
            {
                "id": self._ids(position),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )
        out.tool_calls.append(
            {"index": position, "id": self.calls[-1]["id"], "type": "function",
             "function": {"name": name, "arguments": arguments}}
        )  # fmt: skip


def _whole_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a complete call object written in another order; None if it is none."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return value["name"], arguments
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a beginning of `marker` (0 if none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def parse_tool_calls(
    text: str, dialect: ToolDialect, seed: str = "", index: int = 0
) -> tuple[str, list[dict]]:
    """(content, calls) of a whole text: what the parser gives fed all at once."""
    parser = ToolCallParser(dialect, lambda position: call_id(seed, index, position))
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls
