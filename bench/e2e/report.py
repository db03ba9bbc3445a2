"""The table of `bench e2e`: saturation, Poisson latencies, priority, and the verdict against the bar."""

from __future__ import annotations

from pathlib import Path

from bench.report import format_table

BAR_E2E_VS_ENGINE = 0.9  # at one intra-op thread: the broker and the client have the other core
BAR_HIGH_TTFT_RATIO = 2.0


def render(p: dict) -> str:
    sat = p["saturation_reps"]
    head = format_table(
        ["saturation", "tok/s (median)", "reps", "tok/s per rep", "CPU s per rep"],
        [
            ["engine alone", p["engine_tok_s"], len(sat["engine_tok_s"]), _join(sat["engine_tok_s"]),
             _join(sat["engine_cpu_s"])],
            ["through Kafka", p["e2e_tok_s"], len(sat["e2e_tok_s"]), _join(sat["e2e_tok_s"]),
             _join(sat["e2e_cpu_s"])],
        ],
    )  # fmt: skip
    events, broker = _join(sat.get("e2e_events", [])), _join(sat.get("e2e_kafka_cpu_s", []), 1)
    others = [_join(sat.get(f"{side}_others_cpu_s", []), 1) for side in ("engine", "e2e")]
    head += (
        f"\ne2e reps: token events {events}; Kafka broker CPU s {broker}"
        f"\nCPU s of all other processes (Kafka, Postgres, other users): engine reps {others[0]};"
        f" e2e reps {others[1]}"
    )
    head += "\n\n" + _threads(p)
    rows = [
        [f"{r['fraction_of_saturation']:.0%}", r["rate_jobs_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
         r["itl_p50_ms"], r["itl_p99_ms"], r["e2e_p50_ms"], r["e2e_p99_ms"], r["finished"]]
        for r in p["poisson"]
    ]  # fmt: skip
    poisson = format_table(
        ["poisson", "jobs/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50", "e2e p99", "jobs"],
        rows,
        digits=1,
    )
    load = p.get("priority_load") or {}
    prio = format_table(
        ["high priority", "TTFT p99", "intake p50/max", "schedule p50/max", "emit p50/max"],
        [
            ["idle worker", p["high_ttft_p99_idle_ms"], *_parts(load.get("ttft_breakdown_idle"))],
            ["behind low backlog", p["high_ttft_p99_loaded_ms"], *_parts(load.get("ttft_breakdown_loaded"))],
        ],
    )
    prio += "\n(ms; intake: Kafka timestamp to admission; schedule: to first token; emit: to the client)"
    verdict = [
        _bar("e2e_vs_engine", p["e2e_vs_engine"], ">=", BAR_E2E_VS_ENGINE),
        _bar("  per CPU second", p["e2e_vs_engine_per_cpu_s"], ">=", BAR_E2E_VS_ENGINE),
        _bar("high_ttft_p99_ratio", p["high_ttft_p99_ratio"], "<=", BAR_HIGH_TTFT_RATIO),
    ]
    return "\n\n".join([head, poisson + "\n(ms; ITL per job from event arrivals)", prio, "\n".join(verdict)])


def _threads(p: dict) -> str:
    """Both sides at each thread count, and where the worker's loop spent an e2e rep outside the model."""
    by = p.get("by_threads") or {}
    table = format_table(
        ["threads", "engine tok/s", "e2e tok/s", "e2e / engine", "per CPU s"],
        [
            [t, r["engine_tok_s"], r["e2e_tok_s"], r["e2e_vs_engine"], r["e2e_vs_engine_per_cpu_s"]]
            for t, r in by.items()
        ],
        digits=2,
    )
    lines = []
    for t, r in by.items():
        every = r.get("worker_loop_s_per_rep") or {}
        loop = {k: v for k, v in every.items() if k != "idle" and not k.startswith("thread:")}
        total = sum(loop.values()) or 1.0
        ranked = sorted(loop.items(), key=lambda kv: -kv[1])
        lines.append(f"worker loop per e2e rep (busy), {t} thread(s): " + ", ".join(
            f"{phase} {s:.2f}s ({s / total:.0%})" for phase, s in ranked if s >= 0.005
        ))  # fmt: skip
        cpu, runqueue = every.get("thread:cpu"), every.get("thread:runqueue")
        if cpu is not None and runqueue is not None and loop:
            blocked = max(0.0, total - cpu - runqueue)
            lines.append(
                f"  its thread: on a core {cpu:.2f}s ({cpu / total:.0%}), waiting for a core {runqueue:.2f}s "
                f"({runqueue / total:.0%}), blocked (GIL, I/O) {blocked:.2f}s ({blocked / total:.0%})"
            )
    return table + "\n" + "\n".join(lines)


def _parts(breakdown: dict | None) -> list[str]:
    if not breakdown:
        return ["-", "-", "-"]
    return [
        f"{breakdown[f'{n}_p50_ms'] or 0:,.0f} / {breakdown[f'{n}_max_ms'] or 0:,.0f}"
        for n in ("intake", "schedule", "emit")
    ]


def _join(values: list, digits: int = 0) -> str:
    return " / ".join(f"{v:,.{digits}f}" if v is not None else "-" for v in values)


def _bar(name: str, value: float | None, op: str, bar: float) -> str:
    if value is None:
        return f"{name}: -  (bar {op} {bar})"
    ok = value >= bar if op == ">=" else value <= bar
    return f"{name}: {value:.3f}  (bar {op} {bar}: {'met' if ok else 'MISSED'})"


def latency_groups(p: dict) -> dict[str, dict[str, list[float]]]:
    """Per-job TTFT and ITL by priority: normal jobs of the Poisson phase (every rate), high jobs on the
    idle worker and behind the low backlog, and the backlog's low jobs."""
    normal: dict[str, list[float]] = {"ttft_ms": [], "itl_ms": []}
    for row in p.get("poisson") or []:
        for metric in normal:
            normal[metric] += (row.get("per_job") or {}).get(metric, [])
    load = p.get("priority_load") or {}
    groups = {
        "normal\n(poisson)": normal,
        "high\n(idle worker)": load.get("high_idle_per_job") or {},
        "high\n(behind low)": load.get("high_per_job") or {},
        "low\n(backlog)": load.get("low_per_job") or {},
    }
    return {name: data for name, data in groups.items() if data.get("ttft_ms") or data.get("itl_ms")}


def figure(p: dict, path: Path) -> Path:
    from bench.plots import latency_figure

    title = f"bench e2e: TTFT and ITL per priority (e2e_vs_engine {p.get('e2e_vs_engine') or 0:.2f})"
    return latency_figure(latency_groups(p), title, path)
