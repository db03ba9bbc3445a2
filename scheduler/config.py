"""Scheduler limits and policy knobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks in the cache (the memory budget)
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 1024  # tokens per step at most (decode + prefill chunks)
    max_model_len: int = 2048  # prompt + output tokens of one sequence at most
    enable_prefix_caching: bool = True
    # Tenants never share prefix-cache blocks unless this is set (only for tenants that trust each other).
    share_prefix_cache_across_tenants: bool = False
    aging_s: float = 30.0  # a waiting sequence older than this is promoted one class
    # Tokens per step at most for a running prefill while better-class work waits (vLLM's
    # long_prefill_token_threshold): None = a quarter of max_num_batched_tokens, 0 = no cap.
    long_prefill_token_threshold: int | None = None
    # A step that prefills better-class work skips worse-class decodes (never two steps running), so a
    # high-priority job's first token waits for its own prompt, not for a full batch of low decodes
    # (TGI likewise pauses decoding to prefill new requests).
    defer_worse_decodes: bool = True
    # Set when every layer of the model attends within a sliding window (the widest, in tokens): blocks
    # behind it are given back as sequences advance, so a long sequence holds about window / block_size.
    kv_window: int | None = None
    # Distinct LoRA adapters among running sequences (so in any step) at most: the engine's device slots.
    max_loras: int = 4

    @property
    def long_prefill_cap(self) -> int:
        """The cap in tokens (0 = none)."""
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // 4)
        return self.long_prefill_token_threshold
