"""Which model a job names in `model`: the served base (any of its names, or none), one of this worker's own
adapters (`--lora-modules`), or an adapter of the fleet's registry that the job's tenant may use. Anything
else is refused, with a reason naming the model.

Resolved when jobs are admitted, with the registry read then (one statement per admission batch that names
an adapter not of this worker's own): an adapter registered before a job is admitted is served to it by
whichever worker admits it, and one removed is refused from the moment its removal commits. No cache, so
nothing to go stale: a removal needs no bound but its commit.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from gpu.engine_types import LoraRequest
from schemas.jobs import JobRequest
from workers.db import Engine
from workers.db import adapters as registry
from workers.serving.errors import describe_error, is_transient
from workers.serving.intake.rejected import Rejected
from workers.serving.intake.validation import Accepted, rejection

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedModel:
    """What a job runs on."""

    name: str | None  # what its row keeps and metrics carry: the base's (first) name or the adapter's
    lora: LoraRequest | None = None  # None: the base


class ModelRefused(Exception):
    """A job's `model` is not served to its tenant; `reason` is the metrics' category."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class ServedModels:
    """The models this worker serves: the base's names and its own adapters (the registry's are looked up
    as jobs name them)."""

    def __init__(
        self, base_names: tuple[str, ...] = (), own: Mapping[str, LoraRequest] | None = None
    ) -> None:
        self.base_names = base_names  # the first is the one rows and metrics carry
        self.own = dict(own or {})  # --lora-modules: every tenant's, and ahead of the registry's
        self.base = ServedModel(base_names[0] if base_names else None)

    def local(self, job: JobRequest) -> ServedModel | None:
        """The job's model if this worker knows it without the registry; None: ask the registry."""
        if job.model is None or job.model in self.base_names:
            return self.base
        lora = self.own.get(job.model)
        return None if lora is None else ServedModel(lora.name, lora)

    def from_registry(self, job: JobRequest, adapter: registry.Adapter | None) -> ServedModel:
        """The job's model as the registry has it (`adapter`: its row of that name, if any); raises
        ModelRefused. Another tenant's adapter is refused in the words an unknown one is: a tenant learns
        nothing of the names others registered."""
        if adapter is None or not adapter.allows(job.tenant):
            reason = "unknown_model" if adapter is None else "model_not_allowed"
            raise ModelRefused(self.refusal(job.model, job.tenant), reason)
        return ServedModel(adapter.name, LoraRequest(adapter.name, adapter.path))

    def refusal(self, model: str | None, tenant: str) -> str:
        base = f" ({', '.join(self.base_names)})" if self.base_names else ""
        return (
            f"model {model!r} is not served to tenant {tenant!r}: it is neither a name of the base "
            f"model{base} nor an adapter this tenant may use"
        )

    def resolve(self, db: Engine, batch: list[Accepted]) -> tuple[list[Accepted], list[Rejected]]:
        """Each job with its adapter resolved (Accepted.model and .lora; a job on the base is left as it is,
        its model None), or its rejection. The registry is read once, for the names this worker does not
        know itself; a transient failure of that read is raised (admission tries the batch again later),
        any other refuses those jobs with the cause. A batch of base jobs costs a look at each `model`."""
        base = self.base_names
        if all(a.job.model is None or a.job.model in base for a in batch):
            return batch, []
        wanted = {a.job.model for a in batch if self.local(a.job) is None}
        found: dict[str, registry.Adapter] = {}
        failure = None
        if wanted:
            try:
                with db.connect() as conn:
                    found = registry.lookup(conn, wanted)
            except Exception as exc:
                if is_transient(exc):
                    raise
                log.exception("the adapter registry could not be read")
                failure = f"the adapter registry could not be read: {describe_error(exc)}"
        resolved: list[Accepted] = []
        refused: list[Rejected] = []
        for a in batch:
            served = self.local(a.job)
            if served is self.base:
                resolved.append(a)
                continue
            try:
                if served is None and failure is not None:
                    raise ModelRefused(failure, "error")
                if served is None:
                    served = self.from_registry(a.job, found.get(a.job.model))
            except ModelRefused as exc:
                r = rejection(a.record, a.priority, str(exc), exc.reason, a.job_id, a.tenant)
                refused.append(dataclasses.replace(r, model=a.job.model))
                continue
            resolved.append(dataclasses.replace(a, model=served.name, lora=served.lora))
        return resolved, refused
