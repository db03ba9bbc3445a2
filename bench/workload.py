"""The benchmark workload: seeded requests, random prompt tokens, fixed output lengths (EOS disabled)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of a workload; the same spec and vocabulary always give the same requests."""

    requests: int = 64
    prompt_len: tuple[int, int] = (16, 128)  # inclusive bounds, uniform
    output_len: tuple[int, int] = (8, 256)  # inclusive bounds, uniform; every token is generated (no EOS)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1:
            raise ValueError("requests must be >= 1")
        for name in ("prompt_len", "output_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"{name} must satisfy 1 <= MIN <= MAX, got {low}:{high}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int  # exactly this many tokens are generated and counted as useful


def parse_range(text: str) -> tuple[int, int]:
    """'16:128' -> (16, 128); a single number 'N' means N:N."""
    low, sep, high = text.partition(":")
    return (int(low), int(high)) if sep else (int(low), int(low))


def make_workload(spec: WorkloadSpec, vocab_size: int) -> tuple[BenchRequest, ...]:
    """Requests in arrival order. Token ids come from the whole vocabulary, as in the reference numbers."""
    rng = random.Random(spec.seed)
    requests = []
    for index in range(spec.requests):
        prompt_len = rng.randint(*spec.prompt_len)
        output_len = rng.randint(*spec.output_len)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(prompt_len))
        requests.append(BenchRequest(f"req-{index:04d}", prompt, output_len))
    return tuple(requests)


def useful_tokens(requests: tuple[BenchRequest, ...]) -> int:
    return sum(request.max_new_tokens for request in requests)


def check_lengths(requests: tuple[BenchRequest, ...], produced: dict[str, list[int]]) -> list[str]:
    """Requests whose produced token count differs from what they asked for (missing ones included)."""
    return [r.request_id for r in requests if len(produced.get(r.request_id, ())) != r.max_new_tokens]


def compare_tokens(
    requests: tuple[BenchRequest, ...], reference: dict[str, list[int]], other: dict[str, list[int]]
) -> dict[str, object]:
    """How many requests produced the reference's tokens; for the others, where they first diverge."""
    first_divergence: dict[str, int] = {}
    for request in requests:
        ref, got = reference.get(request.request_id, []), other.get(request.request_id, [])
        if ref != got:
            index = next(
                (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got))
            )
            first_divergence[request.request_id] = index
    return {
        "identical": len(requests) - len(first_divergence),
        "compared": len(requests),
        "first_divergence": first_divergence,
    }
