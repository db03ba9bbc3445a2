"""The seed stream of each of a request's n samples."""

from __future__ import annotations

_MASK = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """Sample 0 draws with the request's own seed (so n = 1 is unchanged); sample i with a seed mixed
    from (seed, i) by splitmix64, so the samples' streams are unrelated yet reproducible run to run."""
    if index == 0:
        return seed
    z = (seed + index * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1  # 63 bits, like an unseeded request's
