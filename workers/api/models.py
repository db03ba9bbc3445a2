"""The models a tenant may name in `model`: the served base (any of the API's names for it) and the fleet's
adapters that tenant may use (workers/db/adapters.py). `/v1/models` lists them; a request or Batch line
naming anything else is refused with 404 `model_not_found`, as OpenAI refuses it.

A job names the base by leaving `model` out (the worker's own names for it may differ from the API's) and an
adapter by its name; the worker checks the adapter again when it admits the job (it may have been removed).
The API never shows an adapter's directory: that is the operators' business.
"""

from __future__ import annotations

from typing import Any

from workers.api.errors import APIError
from workers.db import Engine
from workers.db import adapters as registry


def model_not_found(model: str, param: str | None = "model") -> APIError:
    return APIError(
        404, f"The model '{model}' does not exist or you do not have access to it.", param=param,
        code="model_not_found",
    )  # fmt: skip


def adapter_card(adapter: registry.Adapter, parent: str) -> dict[str, Any]:
    """An adapter as vLLM's /v1/models lists a LoRA: a model whose `parent` is the base."""
    created = int(adapter.created_at.timestamp()) if adapter.created_at else 0
    return {"id": adapter.name, "object": "model", "created": created, "owned_by": "inferq", "parent": parent}


def adapter_cards(db: Engine, tenant: str, parent: str) -> list[dict[str, Any]]:
    """The cards of the adapters `tenant` may use (its own and the shared ones), by name. Blocking."""
    with db.connect() as conn:
        return [adapter_card(a, parent) for a in registry.listed(conn, tenant)]


def job_model(model: str | None, base_names: tuple[str, ...]) -> str | None:
    """What a job's `model` says for a name the API took: None for the base (the workers' names for it may
    differ from the API's), the name itself for an adapter (the worker that admits the job checks it)."""
    return None if model is None or model in base_names else model


class ModelNames:
    """Checks `model` for one tenant: the base's names and the adapters the tenant may use. Registry
    look-ups are kept for the object's life (one request, one batch's lines): a batch naming one adapter
    a million times reads it once. Blocking (it may read the registry)."""

    def __init__(self, db: Engine, base_names: tuple[str, ...], tenant: str) -> None:
        self._db = db
        self._base = base_names
        self._tenant = tenant
        self._seen: dict[str, registry.Adapter | None] = {}

    def allows(self, model: str | None) -> bool:
        if model is None or model in self._base:
            return True
        if model not in self._seen:
            with self._db.connect() as conn:
                self._seen[model] = registry.lookup(conn, [model]).get(model)
        adapter = self._seen[model]
        return adapter is not None and adapter.allows(self._tenant)

    def job_model(self, model: str | None) -> str | None:
        """The job's `model` for a request naming `model`; raises model_not_found."""
        if not self.allows(model):
            raise model_not_found(model)
        return job_model(model, self._base)
