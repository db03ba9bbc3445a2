"""When a request can never run, and when a generated token ends a sequence."""

from __future__ import annotations

from scheduler.config import SchedulerConfig
from scheduler.sequence import Sequence
from scheduler.types import FinishReason, SequenceRequest


def why_never_fits(request: SequenceRequest, config: SchedulerConfig) -> str:
    """A clear reason if the request could never complete under this config; "" if it can."""
    num_prompt = len(request.prompt_token_ids)
    max_tokens = request.sampling.max_tokens
    if num_prompt == 0:
        return "empty prompt"
    if max_tokens < 1:
        return f"max_tokens must be at least 1 (got {max_tokens})"
    if request.n < 1:
        return f"n must be at least 1 (got {request.n})"
    if request.lora is not None and config.max_loras < 1:
        return f"LoRA adapter {request.lora!r} asked for, but this engine serves no adapters (max_loras 0)"
    total = num_prompt + max_tokens
    if total > config.max_model_len:
        return (
            f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens exceeds "
            f"max_model_len {config.max_model_len}"
        )
    # The last sampled token is never fed back, so it needs no KV slot.
    num_blocks = -(-(total - 1) // config.block_size)
    if config.kv_window is not None and request.n == 1:  # it never holds more than its window and a
        # step's chunk (n > 1: the prompt's blocks stay until every sample has forked from them)
        num_blocks = min(num_blocks, windowed_peak_blocks(config))
    if num_blocks > config.num_blocks:
        return (
            f"needs {num_blocks} KV blocks of {config.block_size} tokens ({total - 1} tokens) but the "
            f"whole cache has {config.num_blocks}"
        )
    return ""


def windowed_peak_blocks(config: SchedulerConfig) -> int:
    """Blocks a sequence of a model windowed on every layer holds at most: the window (plus the token
    kept beyond it), a step's chunk, and a partial block at each end."""
    assert config.kv_window is not None
    return -(-(config.kv_window + 1 + config.max_num_batched_tokens) // config.block_size) + 2


def stop_reason(seq: Sequence, token: int, max_model_len: int) -> FinishReason | None:
    """Why the token just appended ends the sequence, if it does."""
    if token in seq.stop_token_ids:  # EOS (unless ignored) and the request's stop tokens
        return FinishReason.STOP
    num_tokens = len(seq.token_ids)
    if num_tokens >= seq.max_num_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def check_config(config: SchedulerConfig) -> None:
    """Refuse limits under which nothing could ever be scheduled."""
    for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        if getattr(config, name) < 1:
            raise ValueError(f"SchedulerConfig.{name} must be at least 1 (got {getattr(config, name)})")
    if config.max_loras < 0:
        raise ValueError(f"SchedulerConfig.max_loras must be at least 0 (got {config.max_loras})")
    if config.max_num_batched_tokens < config.max_num_seqs:
        # Every running sequence may need its decode token in the same step.
        raise ValueError(
            f"SchedulerConfig.max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({config.max_num_seqs}): each running sequence needs a token per step"
        )
    if config.kv_window is not None and config.kv_window < 1:
        raise ValueError("SchedulerConfig.kv_window must be None or positive")
    if config.long_prefill_token_threshold is not None and config.long_prefill_token_threshold < 0:
        raise ValueError("SchedulerConfig.long_prefill_token_threshold must be None, 0 (off) or positive")
