"""Value types shared by the scheduler and everything that drives it (pure Python)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Priority(enum.IntEnum):
    """Priority class; a lower value is served first (matches the jobs topic the request came from)."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS token or a stop string/token
    LENGTH = "length"  # max_tokens reached (or the model's context is full)
    ABORT = "abort"  # cancelled by the caller
    EXPIRED = "expired"  # deadline passed before completion
    REJECTED = "rejected"  # can never fit (e.g. larger than the whole KV cache)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature == 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # OpenAI's penalties: minus presence_penalty once, and minus frequency_penalty per occurrence, for every
    # token already generated; HF's repetition_penalty divides positive (multiplies negative) logits of
    # prompt and output tokens (1 = off).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    logprobs: int | None = None  # None: none; k (0-20): each sampled token's logprob and the k most likely

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class SequenceRequest:
    """Everything the scheduler needs to admit one request."""

    seq_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: Priority = Priority.NORMAL
    tenant: str = "default"
    arrival: float = 0.0  # caller's clock (seconds); orders requests within a class
    deadline: float | None = None  # same clock; past it the sequence ends as EXPIRED
    eos_token_ids: frozenset[int] = frozenset()  # any of them ends the sequence (models have several)
    # Samples of the prompt: one sequence each (ids from sample_seq_id), the prompt
    # prefilled once and its KV blocks shared.
    n: int = 1
    # The LoRA adapter it runs under, as the engine identifies its weights (None: the base model). Its
    # prefix-cache keys are salted with it; a step mixes at most SchedulerConfig.max_loras adapters.
    lora: str | None = None
    # Tokens an earlier attempt generated, per sample (fewer entries than n: the rest have none): they follow
    # the prompt, count as generated (max_tokens included) and are prefilled with it (gpu/resume.py).
    # resumed_logits: their logits are read (logprobs recomputed), so no cache may serve their positions.
    resumed: tuple[tuple[int, ...], ...] = ()
    resumed_logits: bool = False


def sample_seq_id(request_id: str, index: int) -> str:
    """Sample 0 is the request's own id, so an n = 1 request is what it always was; the others `id#i`
    (job ids cannot hold '#'; a clash with a live id is refused when the request is added)."""
    return request_id if index == 0 else f"{request_id}#{index}"
