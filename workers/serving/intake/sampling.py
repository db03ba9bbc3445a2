"""A job's decoding settings: what the job says, else the model's generation_config, else the house's;
and the output constraint it states, as the engine's GrammarSpec."""

from __future__ import annotations

import json
from typing import Any

from gpu.engine_types import GrammarSpec
from scheduler.types import SamplingParams
from schemas.jobs import JobRequest
from schemas.tool_calls import DEFAULT_DIALECT, ToolDialect

# When neither the job nor the model says: greedy decoding, no top-p/top-k filtering, no repetition penalty.
HOUSE_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


def sampling_params(job: JobRequest, max_tokens: int, engine: Any) -> SamplingParams:
    model = getattr(engine, "generation_defaults", None)
    values = {}
    for name, house in HOUSE_DEFAULTS.items():
        given = getattr(job, name)
        if given is None and model is not None:
            given = getattr(model, name, None)
        values[name] = house if given is None else given
    bias = tuple(sorted((int(token), value) for token, value in (job.logit_bias or {}).items()))
    return SamplingParams(
        max_tokens=max_tokens,
        seed=job.seed,
        presence_penalty=job.presence_penalty,
        frequency_penalty=job.frequency_penalty,
        logit_bias=bias,
        logprobs=job.logprobs_k,
        **values,
    )


def grammar_spec(job: JobRequest, dialect: ToolDialect = DEFAULT_DIALECT) -> GrammarSpec | None:
    """The job's output constraint (validation allows at most one), or None for free text. Tool calls
    that must be made (tool_choice `required` or a named function) are one, written in `dialect`: the
    named function alone, else any of the tools; more than one only with parallel_tool_calls (and never
    in a dialect of one call a turn)."""
    if job.tool_mode in ("required", "named"):
        named = job.named_tool
        tools = [t.function for t in job.tools or () if named is None or t.function.name == named]
        source = {
            "dialect": dialect.name,
            "tools": [{"name": f.name, "parameters": f.arguments_schema} for f in tools],
            "parallel": named is None and job.parallel_tool_calls and dialect.separator is not None,
        }
        return GrammarSpec("tool_calls", json.dumps(source, separators=(",", ":")))
    fmt = job.response_format
    if fmt is not None and fmt.type == "json_schema":
        return GrammarSpec("json_schema", json.dumps(fmt.json_schema.json_schema, separators=(",", ":")))
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec("json_object")
    if job.guided_regex is not None:
        return GrammarSpec("regex", job.guided_regex)
    if job.guided_choice is not None:
        return GrammarSpec("choice", json.dumps(job.guided_choice))
    return None


def constraint_field(spec: GrammarSpec) -> str:
    """The job field a constraint came from, as reasons name it."""
    if spec.kind == "tool_calls":
        return "tools"  # the functions' parameters
    return "response_format" if spec.kind.startswith("json") else f"guided_{spec.kind}"
