"""How many KV blocks to allocate: from an explicit byte budget, from free GPU memory after the weights, or
on the CPU from available RAM; and the start-up line that says what that buys (as vLLM logs it)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from gpu.kv_cache import KVShape

CPU_CAP_BYTES = 4 * 2**30  # vLLM's CPU default KV space
CPU_RAM_FRACTION = 0.25  # of the RAM available at start: the rest is for weights, activations, others
SHORT_SEQUENCE_TOKENS = 256  # the floor: every seat can hold a sequence this long


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    bytes: int
    source: str  # where the budget came from, for the log line

    def describe(self, shape: KVShape, max_model_len: int, tokens_kept: int | None = None) -> str:
        """`tokens_kept`: the KV one request holds at most, when less than its length (a model windowed on
        every layer gives back what falls behind its window)."""
        tokens = self.num_blocks * shape.block_size
        kept = max_model_len if tokens_kept is None else min(tokens_kept, max_model_len)
        per_request = -(-kept // shape.block_size)
        windowed = "" if kept == max_model_len else f" (each holds at most {kept:,} tokens of KV)"
        context = "tokens in the cache" if windowed else "tokens of context at most"
        return (
            f"KV cache: {self.num_blocks} blocks of {shape.block_size} tokens, {self.bytes / 2**20:,.0f} MiB "
            f"({self.source}); {tokens:,} {context}; maximum concurrency for "
            f"{max_model_len:,}-token requests{windowed}: {self.num_blocks / per_request:.2f}x"
        )


def floor_blocks(shape: KVShape, max_num_seqs: int, max_model_len: int) -> int:
    """Blocks for every seat to hold a short sequence at once."""
    return max_num_seqs * -(-min(SHORT_SEQUENCE_TOKENS, max_model_len) // shape.block_size)


def cpu_budget(shape: KVShape, max_num_seqs: int, max_model_len: int, available: int) -> int:
    """A share of available RAM, capped, no more than every seat at full length needs, at least the floor."""
    useful = max_num_seqs * -(-max_model_len // shape.block_size) * shape.bytes_per_block
    budget = min(CPU_CAP_BYTES, int(available * CPU_RAM_FRACTION), useful)
    return max(budget, floor_blocks(shape, max_num_seqs, max_model_len) * shape.bytes_per_block)


def cuda_budget(device: torch.device, utilization: float, activation_bytes: int) -> int:
    """vLLM-style: this fraction of the whole device, minus what is in use now (weights, other processes),
    minus the activations of the largest step."""
    gc.collect()  # an earlier engine's cache, unreachable but not yet collected, is not "in use"
    torch.cuda.empty_cache()  # nor are blocks torch's allocator keeps cached for reuse
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization) - (total - free) - activation_bytes


def activation_estimate(hidden: int, intermediate: int, vocab: int, tokens: int, rows: int, elem: int) -> int:
    """Peak activation bytes of a step of `tokens` tokens sampling `rows` rows (generous: 2x the widest)."""
    per_token = (4 * hidden + 2 * intermediate) * elem
    return 2 * tokens * per_token + rows * vocab * 4


def plan_kv(
    shape: KVShape,
    device: torch.device,
    max_num_seqs: int,
    max_model_len: int,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    num_blocks: int | None = None,
    activation_bytes: int = 0,
) -> KVPlan:
    if num_blocks is not None:
        return KVPlan(num_blocks, num_blocks * shape.bytes_per_block, "num_blocks set")
    if kv_cache_memory is not None:
        budget, source = kv_cache_memory, "kv_cache_memory set"
    elif device.type == "cuda":
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        budget = cuda_budget(device, gpu_memory_utilization, activation_bytes)
        source = f"{gpu_memory_utilization:.0%} of GPU memory after weights and activations"
    else:
        import psutil

        budget = cpu_budget(shape, max_num_seqs, max_model_len, psutil.virtual_memory().available)
        source = "CPU default: a quarter of available RAM, at most 4 GiB"
    blocks = budget // shape.bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"KV cache budget {budget:,} B ({source}) is below one block ({shape.bytes_per_block:,} B)"
        )
    return KVPlan(blocks, blocks * shape.bytes_per_block, source)
