"""From the raw repetitions of `bench engine` to the reported numbers (medians, ratios, checks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.engine.contenders import RunResult
from bench.engine.flops import ModelShape
from bench.engine.near_ties import near_ties
from bench.report import format_table, median, ratio
from bench.workload import BenchRequest, WorkloadSpec, check_lengths, compare_tokens

CONTENDERS = ("static", "hf_cb", "inferq")
REQUIRED_KEYS = (
    "static_tok_s",
    "hf_cb_tok_s",
    "inferq_tok_s",
    "limit_tok_s",
    "forward_fraction",
    "ratio_vs_static",
    "ratio_vs_hf_cb",
    "limit_fraction",
)


@dataclass(frozen=True)
class EngineBenchRaw:
    """Everything one run measured, before any aggregation."""

    spec: WorkloadSpec
    requests: tuple[BenchRequest, ...]
    shape: ModelShape
    workload_flops: int
    runs: dict[str, list[RunResult]]  # contender -> one result per repetition, in run order
    flops_per_s: list[float] = field(default_factory=list)  # the `limit` measurement, one per repetition
    step_times: dict[str, dict[str, float]] = field(default_factory=dict)  # batch size -> numbers
    # contender -> request_id -> the reference's relative logit gap where its tokens left static's
    logit_gaps: dict[str, dict[str, float]] = field(default_factory=dict)


def useful_tokens_of(requests: tuple[BenchRequest, ...], result: RunResult) -> int:
    """Tokens that count: what each request asked for, and no more (a short output counts what it has)."""
    return sum(min(len(result.tokens.get(r.request_id, ())), r.max_new_tokens) for r in requests)


def summarize(raw: EngineBenchRaw, machine: dict[str, object], model_path: str | None) -> dict[str, object]:
    asked = sum(r.max_new_tokens for r in raw.requests)
    per_rep: dict[str, dict[str, list[float]]] = {}
    for name, results in raw.runs.items():
        per_rep[name] = {
            "wall_s": [r.wall_s for r in results],
            "cpu_s": [r.cpu_s for r in results],
            "tok_s": [useful_tokens_of(raw.requests, r) / r.wall_s for r in results],
            "tok_per_cpu_s": [useful_tokens_of(raw.requests, r) / r.cpu_s for r in results],
        }
    if raw.flops_per_s:
        per_rep["limit"] = {
            "flops_per_s": list(raw.flops_per_s),
            "tok_s": [asked / (raw.workload_flops / fps) for fps in raw.flops_per_s],
        }
    tok_s = {name: median(numbers["tok_s"]) for name, numbers in per_rep.items()}
    inferq = _inferq_section(raw)
    payload: dict[str, object] = {
        "static_tok_s": tok_s.get("static"),
        "hf_cb_tok_s": tok_s.get("hf_cb"),
        "inferq_tok_s": tok_s.get("inferq"),
        "limit_tok_s": tok_s.get("limit"),
        "forward_fraction": inferq.get("forward_fraction"),
        "ratio_vs_static": ratio(tok_s.get("inferq"), tok_s.get("static")),
        "ratio_vs_hf_cb": ratio(tok_s.get("inferq"), tok_s.get("hf_cb")),
        "limit_fraction": ratio(tok_s.get("inferq"), tok_s.get("limit")),
        # median of per-repetition ratios: each pair ran back to back, so slow drift of the machine cancels
        "paired_ratio_vs_static": _paired(per_rep, "inferq", "static"),
        "paired_ratio_vs_hf_cb": _paired(per_rep, "inferq", "hf_cb"),
        # the same ratios in tokens per CPU second: a cross-check when other processes share the cores
        "cpu_ratio_vs_static": _cpu_ratio(per_rep, "inferq", "static"),
        "cpu_ratio_vs_hf_cb": _cpu_ratio(per_rep, "inferq", "hf_cb"),
        "reps": len(next(iter(raw.runs.values()), [])) or len(raw.flops_per_s),
        "raw": per_rep,
        "inferq": inferq,
        "correctness": _correctness(raw),
        "workload": {
            **raw.spec.to_dict(),
            "useful_tokens": asked,
            "prompt_tokens": sum(len(r.prompt_token_ids) for r in raw.requests),
            "forward_flops": raw.workload_flops,
        },
        "model": {"path": model_path or "built-in default", **raw.shape.to_dict()},
        "machine": machine,
    }
    return payload


def _paired(per_rep: dict[str, dict[str, list[float]]], top: str, bottom: str) -> float | None:
    if top not in per_rep or bottom not in per_rep:
        return None
    pairs = zip(per_rep[top]["tok_s"], per_rep[bottom]["tok_s"], strict=True)
    return median(ratio(a, b) for a, b in pairs)


def _cpu_ratio(per_rep: dict[str, dict[str, list[float]]], top: str, bottom: str) -> float | None:
    if top not in per_rep or bottom not in per_rep:
        return None
    return ratio(median(per_rep[top]["tok_per_cpu_s"]), median(per_rep[bottom]["tok_per_cpu_s"]))


def _inferq_section(raw: EngineBenchRaw) -> dict[str, object]:
    results = raw.runs.get("inferq", [])
    if not results:
        return {}
    keys = sorted({key for result in results for key in result.extras})
    section: dict[str, object] = {
        key: median(r.extras.get(key, float("nan")) for r in results) for key in keys
    }
    section["per_rep"] = {key: [r.extras.get(key) for r in results] for key in keys}
    section["step_time"] = raw.step_times
    return section


def _correctness(raw: EngineBenchRaw) -> dict[str, object]:
    """Exact lengths for every contender and repetition; first repetition's greedy tokens vs static's."""
    length_errors = {
        name: sorted({rid for result in results for rid in check_lengths(raw.requests, result.tokens)})
        for name, results in raw.runs.items()
    }
    reference = raw.runs.get("static")
    greedy = {
        name: compare_tokens(raw.requests, reference[0].tokens, results[0].tokens)
        for name, results in raw.runs.items()
        if reference and name != "static" and results
    }
    for name, compared in greedy.items():
        gaps = raw.logit_gaps.get(name, {})
        compared["logit_gap_at_divergence"] = gaps
        compared["near_ties"] = near_ties(gaps)
    return {"length_errors": length_errors, "greedy_vs_static": greedy}


def _greedy_cell(greedy: dict | None) -> str:
    """'63/64', and how many of the others left at a near-tie ('+1 tie'): see bench/engine/near_ties.py."""
    if greedy is None:
        return "-"
    cell = f"{greedy['identical']}/{greedy['compared']}"
    ties = greedy.get("near_ties", 0)
    return f"{cell} +{ties} tie" if ties else cell


def render(payload: dict[str, object]) -> str:
    """The human-readable report: the contenders table, then inferq's own numbers."""
    raw: dict = payload["raw"]  # type: ignore[assignment]
    correctness: dict = payload["correctness"]  # type: ignore[assignment]
    rows = []
    for name in (*CONTENDERS, "limit"):
        if name not in raw:
            continue
        tok_s = raw[name]["tok_s"]
        median_tok_s = median(tok_s)
        errors = correctness["length_errors"].get(name)
        greedy = correctness["greedy_vs_static"].get(name)
        rows.append(
            [
                name,
                median_tok_s,
                min(tok_s),
                max(tok_s),
                median(raw[name].get("wall_s", [])),
                median(raw[name].get("cpu_s", [])),
                ratio(median_tok_s, payload["static_tok_s"]),
                ratio(median_tok_s, payload["hf_cb_tok_s"]),
                "-" if errors is None else ("ok" if not errors else f"{len(errors)} bad"),
                _greedy_cell(greedy),
            ]
        )
    headers = [
        "contender",
        "tok/s (median)",
        "min",
        "max",
        "wall s",
        "cpu s",
        "x static",
        "x hf_cb",
        "lengths",
        "= static",
    ]
    lines = [format_table(headers, rows, digits=2)]
    inferq: dict = payload["inferq"]  # type: ignore[assignment]
    if inferq:
        lines.append("")
        lines.append(
            format_table(
                ["inferq", "value"],
                [
                    ["forward fraction", inferq.get("forward_fraction")],
                    ["limit fraction", payload["limit_fraction"]],
                    ["mean batch size", inferq.get("mean_batch_size")],
                    ["steps", inferq.get("steps")],
                    [
                        "KV blocks used (peak) / total",
                        _pair(inferq, "kv_blocks_used_peak", "kv_blocks_total"),
                    ],
                    ["preemptions", inferq.get("preemptions")],
                    ["peak RSS MiB (process)", _mib(inferq.get("peak_rss_bytes"))],
                ],
                digits=2,
            )
        )
        steps = inferq.get("step_time") or {}
        if steps:
            lines.append("")
            step_rows = [[b, v["step_ms"], v["forward_ms"], v["decode_tok_s"]] for b, v in steps.items()]
            lines.append(
                format_table(["decode batch", "step ms", "forward ms", "tok/s"], step_rows, digits=2)
            )
    return "\n".join(lines)


def _pair(section: dict, a: str, b: str) -> str:
    first, second = section.get(a), section.get(b)
    return f"{first:.0f} / {second:.0f}" if first is not None and second is not None else "-"


def _mib(value: float | None) -> float | None:
    return None if value is None else value / 2**20
