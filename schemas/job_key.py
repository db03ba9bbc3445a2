"""A job's identity as it travels: job ids are unique per tenant, so a job is its tenant and its id.

`JobKey` is that pair wherever it travels (rows are keyed by it, results, cancels and leases are matched
by it); `RequestId` is the one string the engine knows the job by, made from it.
"""

from __future__ import annotations

from typing import NamedTuple, NewType

RequestId = NewType("RequestId", str)  # a job's request id in the engine: JobKey.request_id


class JobKey(NamedTuple):
    """(tenant, job_id). A tuple, so SQL (`tuple_(tenant, job_id).in_(keys)`) and unpacking take it as is,
    and it equals the plain (tenant, job_id) tuple a database row gives."""

    tenant: str
    job_id: str

    @property
    def request_id(self) -> RequestId:
        """One string for the pair, the engine's request id of the job: a job id never contains `#` (see
        JobRequest) and the tenant is quoted, so it always ends with a quote and never equals the id the
        engine gives sample i > 0 of another job (`key#i`, scheduler.types.sample_seq_id)."""
        return RequestId(f"{self.job_id}#{self.tenant!r}")
