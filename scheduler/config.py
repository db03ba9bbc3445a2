"""Scheduler limits and policy knobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks in the cache (the memory budget)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens per step at most (decode + prefill chunks)
    max_model_len: int = 2048  # prompt + output tokens of one sequence at most
    enable_prefix_caching: bool = True
    aging_s: float = 30.0  # a waiting sequence older than this is promoted one class
