"""`POST /v1/completions`: the completions endpoint's stream chunks (`text_completion`)."""

from __future__ import annotations

from typing import Any

from schemas.jobs import TokenEvent
from workers.api.protocol import COMPLETIONS
from workers.api.serving_engine import ServingEngine
from workers.bulk.output import completion_logprobs


class ServingCompletion(ServingEngine):
    url = COMPLETIONS
    id_prefix = "cmpl"
    kind = "text_completion"

    def chunk_choice(self, event: TokenEvent, first: bool) -> dict[str, Any]:
        logprobs = None
        if event.logprobs is not None:
            logprobs = completion_logprobs({"content": [e.model_dump(mode="json") for e in event.logprobs]})
        return {
            "index": event.index,
            "text": event.text,
            "logprobs": logprobs,
            "finish_reason": event.finish_reason,
        }
