"""PNG figures of the benchmark results (matplotlib, Agg backend: no display needed).

Imported only when a benchmark writes its report; without matplotlib the figure is skipped with a note.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CONTENDER_ORDER = ("static", "hf_cb", "inferq", "limit")


def _pyplot():  # noqa: ANN202 - matplotlib's module
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(json_path: Path) -> Path:
    return json_path.with_suffix(".png")


def engine_figure(payload: dict, path: Path) -> Path:
    """tok/s per contender (median bar, min-max whiskers), and inferq's decode step time per batch size."""
    plt = _pyplot()
    raw: dict = payload["raw"]
    names = [n for n in CONTENDER_ORDER if n in raw]
    steps: dict = (payload.get("inferq") or {}).get("step_time") or {}
    fig, axes = plt.subplots(1, 2 if steps else 1, figsize=(11 if steps else 6, 4.2), squeeze=False)
    ax = axes[0][0]
    medians = [_median(raw[n]["tok_s"]) for n in names]
    lows = [m - min(raw[n]["tok_s"]) for n, m in zip(names, medians, strict=True)]
    highs = [max(raw[n]["tok_s"]) - m for n, m in zip(names, medians, strict=True)]
    bars = ax.bar(
        names, medians, yerr=[lows, highs], capsize=6, color=["#999", "#c88", "#4a7", "#bbb"][: len(names)]
    )
    for bar, value in zip(bars, medians, strict=True):
        ax.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                    xytext=(0, 3), textcoords="offset points")  # fmt: skip
    workload = payload.get("workload", {})
    ax.set_title(
        f"useful tok/s, {payload.get('reps')} reps (bars: median, whiskers: min-max)\n"
        f"{workload.get('requests')} requests, prompts {_range(workload.get('prompt_len'))}, "
        f"outputs {_range(workload.get('output_len'))}",
        fontsize=9,
    )
    ax.set_ylabel("tokens / s")
    if steps:
        ax2 = axes[0][1]
        batches = list(steps)
        ax2.bar(batches, [steps[b]["step_ms"] for b in batches], color="#4a7")
        ax2.set_xlabel("decode batch (sequences)")
        ax2.set_ylabel("ms per step (median)")
        ax2.set_title("inferq decode step time", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_figure(groups: dict[str, dict[str, Sequence[float]]], title: str, path: Path) -> Path:
    """Distributions (box plots over jobs) of TTFT and ITL per priority group."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, metric, label in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "itl_ms", "ITL (ms)")):
        names = [name for name, data in groups.items() if data.get(metric)]
        if names:
            ax.boxplot([list(groups[n][metric]) for n in names], showfliers=True)
            ax.set_xticks(range(1, len(names) + 1), [f"{n}\n(n={len(groups[n][metric])})" for n in names])
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _range(bounds: object) -> str:
    if isinstance(bounds, list | tuple) and len(bounds) == 2:
        return f"{bounds[0]}-{bounds[1]}"
    return "-"


def write_or_explain(make: object, *args: object) -> str:
    """Run a figure function; a missing matplotlib is reported, not fatal (the JSON and table stand)."""
    try:
        path = make(*args)  # type: ignore[operator]
    except ImportError as error:
        return f"figure skipped: {error} (pip install matplotlib)"
    return f"figure: {path}"
