"""The contenders of `inferq bench engine`: each runs a whole workload and returns the tokens it produced."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from bench.workload import BenchRequest

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RunResult:
    wall_s: float  # the timed region: from the first request handed over to the last token received
    cpu_s: float  # process CPU time (all threads) over the same region: less sensitive to a busy machine
    tokens: dict[str, list[int]]  # generated token ids per request, truncated to what each request asked for
    extras: dict[str, float] = field(default_factory=dict)  # contender-specific measurements


class Contender(Protocol):
    name: str

    def warm_up(self, requests: tuple[BenchRequest, ...]) -> None:
        """Run a small workload once, untimed, so one-time costs (thread pools, allocations) go unmeasured."""

    def run(self, requests: tuple[BenchRequest, ...]) -> RunResult: ...


def placed(model: torch.nn.Module, device: str, dtype: str) -> torch.nn.Module:
    """The HF contenders' model on the benchmark's device and dtype (loaded on the CPU in float32)."""
    import torch

    if device == "cpu" and dtype == "float32":
        return model
    return model.to(device=torch.device(device), dtype=getattr(torch, dtype)).eval()
