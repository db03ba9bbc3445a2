"""`POST /v1/chat/completions`: the chat endpoint's stream chunks (`chat.completion.chunk`)."""

from __future__ import annotations

from typing import Any

from schemas.jobs import TokenEvent
from workers.api.protocol import CHAT
from workers.api.serving_engine import ServingEngine


class ServingChat(ServingEngine):
    url = CHAT
    id_prefix = "chatcmpl"
    kind = "chat.completion.chunk"

    def chunk_choice(self, event: TokenEvent, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": event.text}
        if event.tool_calls:  # OpenAI's: the call's first delta names it, later ones add to its arguments
            delta = {"content": event.text or None}
            delta["tool_calls"] = [call.model_dump(exclude_none=True) for call in event.tool_calls]
        if first:  # a choice's first chunk names the role, as OpenAI's does
            delta = {"role": "assistant", **delta}
        logprobs = None
        if event.logprobs is not None:
            logprobs = {"content": [e.model_dump(mode="json") for e in event.logprobs]}
        return {
            "index": event.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": event.finish_reason,
        }
