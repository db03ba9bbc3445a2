"""Kernel choices measured at engine start on this machine, at the model's shapes (cached per process).

Why measure: the same code ran 2x apart on two machines of one kind (issue 10), and which kernel wins
depends on the CPU, its cache sizes and the thread count. Each choice times the candidates alternately
(so a noisy neighbour slows both alike) and takes the median; a candidate whose output disagrees with
the reference is never chosen.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from functools import cache

import torch

from gpu.attention import PagedAttention
from gpu.attention.metadata import AttentionMetadata
from gpu.cpu.linear import UNBOUNDED, Choice, Linear
from gpu.cpu.native_decode import NativeDecode
from gpu.kv_cache import KVCache, KVShape

log = logging.getLogger(__name__)

REPS = 5
LINEAR_ROWS = (1, 4, 8, 16, 32, 64, 128, 256, 512)


def race(candidates: dict[str, Callable[[], object]], reps: int = REPS) -> dict[str, float]:
    """Median seconds per call of each candidate, timed in alternation after one warm-up call each."""
    for run in candidates.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(reps):
        for name, run in candidates.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def synthetic_decode(
    shape: KVShape, heads: int, batch: int, context: int, seed: int = 0
) -> tuple[torch.Tensor, KVCache, AttentionMetadata]:
    """A one-layer cache with `batch` sequences of up to `context` tokens in shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    per_seq = -(-context // shape.block_size)
    one_layer = KVShape(1, shape.num_kv_heads, shape.head_dim, shape.block_size, shape.dtype)
    cache = KVCache(one_layer, batch * per_seq, torch.device("cpu"))
    cache.k.normal_(generator=generator)
    cache.v.normal_(generator=generator)
    tables = torch.randperm(batch * per_seq, generator=generator).view(batch, per_seq)
    lens = torch.randint(max(1, context // 4), context + 1, (batch,), generator=generator)
    q = torch.randn(batch, heads, shape.head_dim, generator=generator, dtype=shape.dtype)
    meta = AttentionMetadata(
        block_tables=tables,
        decode_rows=torch.arange(batch),
        decode_seats=torch.arange(batch),
        decode_lens=lens,
        decode_first=0,
        max_decode_len=int(lens.max()),
        prefills=(),
    )
    return q, cache, meta


@cache
def decode_kernel(shape: KVShape, heads: int, batch: int, context: int, threads: int) -> str:
    """ "native" when the C kernel builds, agrees with the torch kernel and is faster here; else "torch"."""
    native = NativeDecode.load()
    if native is None or not NativeDecode.supports(shape, torch.device("cpu"), heads):
        return "torch"
    q, cache, meta = synthetic_decode(shape, heads, batch, context)
    scale = shape.head_dim**-0.5
    kernels = {kind: PagedAttention(kind, native) for kind in ("native", "torch")}
    empty = torch.empty(batch, shape.num_kv_heads, shape.head_dim)

    def run(kind: str) -> torch.Tensor:
        attention = kernels[kind]
        return attention(q, empty, empty, cache, 0, attention.plan(meta, cache), scale)

    if not torch.allclose(run("native"), run("torch"), atol=1e-4, rtol=1e-4):
        log.warning("native decode kernel disagrees with the torch kernel here; using torch")
        return "torch"
    times = race({kind: lambda kind=kind: run(kind) for kind in kernels})
    choice = min(times, key=times.__getitem__)
    log.info(
        "decode attention at batch %d, context <= %d, %d threads: %s (native %.3f ms, torch %.3f ms)",
        batch, context, threads, choice, times["native"] * 1e3, times["torch"] * 1e3,
    )  # fmt: skip
    return choice


@cache
def linear_choice(
    out_features: int, in_features: int, dtype: torch.dtype, max_rows: int, threads: int
) -> Choice:
    """Which kernel each row count uses for this weight shape: the fastest at each measured size, among
    the kernels whose output agrees with the plain one."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    linear = Linear(weight, None, packed=True)
    kernels = linear.kernels
    if kernels == ("plain",):
        return Linear.ALWAYS_PLAIN
    winners = []  # (rows, fastest kernel)
    for rows in [r for r in LINEAR_ROWS if r <= max_rows] or [1]:
        x = torch.randn(rows, in_features, generator=generator).to(dtype)
        reference = linear.plain(x)
        tolerance = 1e-4 * float(reference.abs().max()) + 1e-6
        agreeing = [
            k for k in kernels if torch.allclose(linear.run(k, x), reference, rtol=1e-4, atol=tolerance)
        ]
        if len(agreeing) < len(kernels):
            log.warning("linear %dx%d at %d rows: %s disagree with the plain kernel; not used",
                        out_features, in_features, rows, sorted(set(kernels) - set(agreeing)))  # fmt: skip
        times = race({k: lambda k=k, x=x: linear.run(k, x) for k in agreeing})
        winners.append((rows, min(times, key=times.__getitem__)))
    choice = choice_from(winners)
    log.info("linear %dx%d, %d threads: %s", out_features, in_features, threads, choice)
    return choice


def choice_from(winners: list[tuple[int, str]]) -> Choice:
    """Row ranges from the fastest kernel at each measured size, ascending: a range ends halfway
    (geometrically) to the next size where another kernel won; the largest size's winner holds beyond it."""
    choice: list[tuple[int, str]] = []
    for (rows, kernel), (next_rows, next_kernel) in zip(winners, winners[1:], strict=False):
        if kernel != next_kernel:
            choice.append((math.ceil(math.sqrt(rows * next_rows)), kernel))
    choice.append((UNBOUNDED, winners[-1][1]))
    return tuple(choice)


def tune_linears(linears: list[Linear], max_rows: dict[int, int], threads: int) -> None:
    """Each linear's kernel per row count, by measurement (shapes shared by many layers measure once)."""
    for linear in linears:
        out_features, in_features = linear.weight.shape
        rows = max_rows.get(id(linear), max(LINEAR_ROWS))
        linear.use(linear_choice(out_features, in_features, linear.weight.dtype, rows, threads))


@cache
def rope_write_kernel(heads: int, kv_heads: int, head_dim: int, tokens: int, threads: int) -> bool:
    """True when the fused native RoPE + cache write builds, equals the torch path bit for bit and is
    faster here for a step of `tokens` tokens (a decode batch)."""
    from gpu.cpu.rope_write import RopeCacheWrite
    from gpu.forward import rotate

    fused = RopeCacheWrite.load()
    if fused is None:
        return False
    generator = torch.Generator().manual_seed(0)
    shape = KVShape(1, kv_heads, head_dim, 16, torch.float32)
    blocks = -(-tokens // shape.block_size) * 4
    cache = KVCache(shape, blocks, torch.device("cpu"))
    positions = torch.randint(0, 2048, (tokens,), generator=generator)
    slots = torch.randperm(blocks * shape.block_size, generator=generator)[:tokens]
    angles = torch.rand(2048, head_dim, generator=generator) * 6.3
    cos, sin = angles.cos(), angles.sin()
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator)

    def split() -> tuple[torch.Tensor, torch.Tensor]:
        qk, v = qkv.clone().split(((heads + kv_heads) * head_dim, kv_heads * head_dim), dim=-1)
        return qk.view(tokens, heads + kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)

    def run_torch() -> torch.Tensor:
        qk, v = split()
        qk = rotate(qk, cos[positions][:, None], sin[positions][:, None])
        cache.write(0, slots, qk[:, heads:], v)
        return qk

    def run_fused() -> torch.Tensor:
        qk, v = split()
        fused(qk, v, positions, cos, sin, cache, 0, slots)
        return qk

    reference = run_torch()
    cached = cache.k.clone(), cache.v.clone()
    cache.k.zero_(), cache.v.zero_()
    if not (
        torch.equal(run_fused(), reference)
        and torch.equal(cache.k, cached[0])
        and torch.equal(cache.v, cached[1])
    ):
        log.warning("fused RoPE + cache write disagrees with the torch path here; using torch")
        return False
    times = race({"fused": run_fused, "torch": run_torch})
    log.info(
        "RoPE + cache write at %d tokens, %d threads: fused %.3f ms, torch %.3f ms",
        tokens, threads, times["fused"] * 1e3, times["torch"] * 1e3,
    )  # fmt: skip
    return times["fused"] < times["torch"]
