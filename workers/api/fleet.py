"""The models the fleet serves: what `/v1/models` lists and what a body's `model` may name.

Workers announce their model (workers/serving/announcer.py, the served_models table); this process reads the
live ones at most every REFRESH_S (one query, off the event loop) and answers from that. `model_list` is the
listing itself, a function of the served models alone, so other sources (LoRA adapters) extend it there.

A body may name a model a live worker serves; while no worker runs (a deployment scaled to zero, a
restart), one this API was told its deployment serves (`--model-name`): its jobs wait in the queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from workers.api.context import APIContext
from workers.api.errors import APIError
from workers.api.models import ModelNames, adapter_cards
from workers.clock import utcnow
from workers.db import served_models
from workers.db.served_models import ServedModel

REFRESH_S = 2.0


def model_card(name: str, created: int, max_model_len: int | None = None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "inferq"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len  # as vLLM's cards say it
    return card


def model_list(served: Iterable[ServedModel]) -> list[dict[str, Any]]:
    """One card per model the live workers serve (several workers of one model: one card, created when
    the first of them started, with the smallest context any of them has)."""
    cards: dict[str, dict[str, Any]] = {}
    for s in served:
        created = int(s.started_at.timestamp())
        card = cards.get(s.model)
        if card is None:
            cards[s.model] = model_card(s.model, created, s.max_model_len)
            continue
        card["created"] = min(card["created"], created)
        if s.max_model_len is not None:
            card["max_model_len"] = min(card.get("max_model_len", s.max_model_len), s.max_model_len)
    return list(cards.values())


class Fleet:
    def __init__(self, ctx: APIContext, refresh_s: float = REFRESH_S) -> None:
        self.ctx = ctx
        self.refresh_s = refresh_s
        self._served: list[ServedModel] = []
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    async def served(self) -> list[ServedModel]:
        """The live workers' models, at most `refresh_s` old."""
        if time.monotonic() - self._at < self.refresh_s:
            return self._served
        async with self._lock:  # one query for every request that finds the copy old
            if time.monotonic() - self._at >= self.refresh_s:
                prefix = self.ctx.settings.topic_prefix

                def read() -> list[ServedModel]:
                    with self.ctx.db.connect() as conn:
                        return served_models.live(conn, prefix, utcnow())

                self._served = await self.ctx.run_db(read)
                self._at = time.monotonic()
        return self._served

    async def names(self) -> list[str]:
        return [card["id"] for card in model_list(await self.served())]

    async def base_names(self) -> tuple[str, ...]:
        """What names the base model: the live workers' names, or the configured ones while none runs."""
        return tuple(await self.names()) or self.ctx.models

    async def check(self, model: Any, tenant: str) -> str:
        """The model a request runs on: the one it names, if served or an adapter `tenant` may use (404
        otherwise, the same for another tenant's adapter: its name is not disclosed); else the fleet's."""
        names = await self.names()
        if model is None:
            return self.default(names)
        if not isinstance(model, str):
            raise APIError(400, "model must be a string", param="model", code="invalid_value")
        bases = tuple(names) or self.ctx.models  # while no worker runs: the configured names
        if model not in bases:  # an adapter, or 404: the registry says (read off the loop)
            await self.ctx.run_db(ModelNames(self.ctx.db, bases, tenant).job_model, model)
        return model

    async def cards(self, tenant: str) -> list[dict[str, Any]]:
        """/v1/models: the live workers' models, then the adapters `tenant` may use (`parent`: the base)."""
        bases = model_list(await self.served())
        parent = bases[0]["id"] if bases else self.default([])
        return bases + await self.ctx.run_db(adapter_cards, self.ctx.db, tenant, parent)

    def default(self, names: list[str]) -> str:
        """The model a request naming none runs on: the fleet's first, else the configured one."""
        if names:
            return names[0]
        return self.ctx.models[0] if self.ctx.models else "default"
