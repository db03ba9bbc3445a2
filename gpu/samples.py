"""Counter-based sampling randomness: the uniform number a sampled token is drawn with is a pure function of
(the request's seed, the sample's index, the token's position in that sample's output).

Nothing is a stream that other rows share or that a step advances, so a request draws the same tokens alone
or batched with any others, in any order, under async scheduling, preempted and recomputed, or resumed at
any position by another engine (gpu/resume.py): what an uninterrupted run drew there.

- Sample i's seed: `sample_seed(seed, i)`: the request's own for sample 0 (an n = 1 request is sample 0),
  a splitmix64 mix of (seed, i) for the others, so sample i draws as an n = 1 request with that seed would.
- Its stream key: `stream_key(seed, i)` = splitmix64's mix of that seed, made once when the request is added.
- The uniform at output position p (0 for the first generated token): the top 52 bits of
  mix64(key + (p + 1) * golden), the p-th output of a SplitMix64 generator started at the key, computed for
  all of a step's rows at once (`uniforms`). The golden-ratio step between positions is SplitMix64's own
  (a step of 1 is weak for its mixer); keys are hashed, so seeds 1, 2, 3 are unrelated streams.

A request without a seed gets one drawn from the OS when the engine adds it (EngineCore._fresh_seed); its
draws are then reproducible only within that engine, so the worker sends every job's seed (drawn once, kept
with the job) and a resumed attempt draws as the first one did.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def sample_seed(seed: int, index: int) -> int:
    """Sample 0 draws with the request's own seed (so n = 1 is unchanged); sample i with a seed mixed
    from (seed, i) by splitmix64, so the samples' streams are unrelated yet reproducible run to run."""
    if index == 0:
        return seed
    return _mix64((seed + index * _GOLDEN) & _MASK) >> 1  # 63 bits, like an unseeded request's


def stream_key(seed: int, index: int) -> int:
    """The 64-bit key of sample `index`'s draws (as a signed int64, ready for numpy)."""
    key = _mix64(sample_seed(seed, index) & _MASK)
    return key - (1 << 64) if key >> 63 else key


def uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One uniform number in [0, 1) per row, from its stream key (int64) and output position (int64)."""
    # uint64 arrays wrap, as SplitMix64 intends (numpy warns of overflow for scalars only); in place, as a
    # step computes this for every drawing row
    z = positions.astype(np.uint64)
    z += _ONE
    z *= _STEP
    z += keys.view(np.uint64)
    shifted = z >> _S30
    z ^= shifted
    z *= _M1
    np.right_shift(z, _S27, out=shifted)
    z ^= shifted
    z *= _M2
    np.right_shift(z, _S31, out=shifted)
    z ^= shifted
    z >>= _S12
    out = z.astype(np.float64)
    out *= 1.0 / (1 << 52)  # 52 bits: u * total < total
    return out


_ONE, _STEP = np.uint64(1), np.uint64(_GOLDEN)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S12, _S27, _S30, _S31 = np.uint64(12), np.uint64(27), np.uint64(30), np.uint64(31)
