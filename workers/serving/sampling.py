"""A job's sampling settings: what the job says, else the model's generation_config, else greedy."""

from __future__ import annotations

from typing import Any

from scheduler.types import SamplingParams
from schemas.jobs import JobRequest

# When neither the job nor the model says: greedy decoding, no top-p/top-k filtering.
HOUSE_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}


def sampling_params(job: JobRequest, max_tokens: int, engine: Any) -> SamplingParams:
    model = getattr(engine, "generation_defaults", None)
    values = {}
    for name, house in HOUSE_DEFAULTS.items():
        given = getattr(job, name)
        if given is None and model is not None:
            given = getattr(model, name, None)
        values[name] = house if given is None else given
    return SamplingParams(max_tokens=max_tokens, seed=job.seed, **values)
