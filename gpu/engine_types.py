"""The Engine's value types: its configuration, a request, what a step reports, and its statistics."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from scheduler.types import FinishReason, Priority, SamplingParams

log = logging.getLogger("gpu.engine")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # KV cache memory in bytes. None: on CUDA, gpu_memory_utilization of the device minus what is in use
    # after loading the weights and the activations of the largest step; on CPU, a quarter of available
    # RAM, at most 4 GiB, at least room for every seat to hold a short sequence (gpu/kv_sizing.py).
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None  # older name of kv_cache_memory, still accepted
    num_blocks: int | None = None  # overrides the memory budget when set (tests use tiny values)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024  # long prompts prefill in fewer, fuller steps
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    share_prefix_cache_across_tenants: bool = False  # only for tenants that trust each other
    long_prefill_token_threshold: int | None = None  # see SchedulerConfig
    aging_s: float = 30.0
    decode_kernel: str | None = None  # CPU decode attention, "native" or "torch"; None = measured
    fused_rope: bool | None = None  # CPU: RoPE + K/V cache write in one native pass; None = measured
    tune_linears: bool = True  # CPU: measure the linear kernels per shape and row count at start
    # Schedule step N+1 and build its inputs while step N runs (forward and sampling on a worker thread),
    # its outputs returned one step() call later. None: on for CUDA, off on the CPU (see below).
    async_scheduling: bool | None = None
    # LoRA (gpu/lora/): distinct adapters resident in the engine, and so the most one step may mix; the
    # largest rank an adapter may have (device slots are padded to it: one static layout for the kernels
    # and CUDA graphs); adapters kept loaded in host memory (None: 4 * max_loras, at least 16).
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None


def resolve_async_scheduling(wanted: bool | None, device: Any) -> bool:
    """Whether the engine overlaps scheduling with the model. None: off until measured on a device. On
    the CPU the forward and the host work compete for the same cores (measured: no gain on a shared 2-core
    machine, bench/host_overhead/ and `inferq bench engine --async-scheduling on|off`); on CUDA it is
    correct on the CPU-run CUDA-step logic but has not yet run on a GPU, so bench/device_check.sh measures
    it on and off (`inferq_async` in its tables) before it becomes the default there."""
    return bool(wanted)


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output, as the job states it (compiled by Engine.compile_grammar)."""

    kind: str  # "json_schema" | "json_object" | "regex" | "choice"
    source: str = ""  # the schema as JSON text, the regex, or the choices as a JSON list of strings


@dataclass(frozen=True)
class LoraRequest:
    """A LoRA adapter a request runs under. The host cache keys it by (name, path): the same name
    registered again with another directory is another adapter (loaded anew), never the old weights."""

    name: str  # the adapter's served name (what a job puts in `model`)
    path: str  # a PEFT directory (adapter_config.json + adapter_model.safetensors) every worker can read


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()  # stop strings, matched on the text; the output excludes them
    priority: Priority = Priority.NORMAL
    tenant: str = "default"
    deadline: float | None = None  # a time.monotonic() value
    n: int = 1  # samples of the prompt, prefilled once; their outputs carry `index` 0..n-1
    # A GrammarSpec, or what Engine.compile_grammar made of one (compiled off the engine thread); None: free
    grammar: Any = None
    lora: LoraRequest | None = None  # the adapter to run under; None: the base model
    # Resuming an earlier attempt (gpu/resume.py): per sample index 0..n-1, the token ids it generated (fewer
    # entries than n, or an empty one: those samples start afresh). They follow the prompt, prefilled with it,
    # count as generated (max_tokens and completion_tokens include them), and the output goes on as the
    # uninterrupted run's would have (greedy, or seeded: a sampled resume needs `sampling.seed`). Unusable
    # tokens raise ResumeRefused from add_request, nothing added.
    resume: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log probability and the most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(slots=True)
class RequestOutput:
    """News about one request from one step. Read-only by convention: not frozen, because every step builds
    one per running request and a frozen dataclass costs several times as much to build."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str  # complete characters only; the deltas concatenate to the final text
    finish_reason: FinishReason | None  # set on the request's last output
    started: bool  # True on the step the request was first scheduled
    prompt_tokens: int
    completion_tokens: int
    detail: str = ""  # e.g. why a request was rejected
    index: int = 0  # which of the request's n samples this output is about
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked for logprobs
    # A resumed sample's saved tokens, out once: on its first output with tokens (or its last, if it ends
    # first) new_token_ids are all of them, text_delta exactly the deltas an uninterrupted run emitted for
    # them joined, logprobs theirs (recomputed by the resuming prefill). Later outputs are as that run's.
    resumed: bool = False
    # prompt tokens its first scheduling found in the prefix cache (not computed); set on its last output
    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: dict[Priority, int]
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    prefix_cache_hits: int  # prompt tokens served from the prefix cache
    steps: int  # steps that ran the model
    forward_seconds: float  # cumulative time in the runner: input building, model forward, sampling
    mean_batch_size: float  # sequences per model step
    mean_batch_tokens: float  # tokens per model step
    forward_by_batch: dict[int, tuple[int, float]]  # sequences in a step -> (steps, forward seconds)
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (an n > 1 prompt counts once)


def resolve_max_model_len(config: Any, requested: int | None) -> int:
    """The model's trained context unless asked otherwise (a sliding window does not cap it: windowed
    layers attend to their window of the paged cache, see gpu/models).

    A length above max_position_embeddings is honoured (RoPE extends to any position; quality past the
    trained context is the operator's call, as with vLLM's override) with a warning.
    """
    config = getattr(config, "text_config", None) or config  # gemma3: its language model's
    limit = config.max_position_embeddings
    if requested and requested > limit:
        log.warning("max_model_len %d is past the model's max_position_embeddings %d", requested, limit)
    return requested or limit


class ResumeRefused(ValueError):
    """A resume the engine cannot continue exactly (a token outside the vocabulary, more tokens than
    max_tokens or the context allow, a stop or a grammar that ends or rejects them, a sampled request
    without its seed): nothing was added; add the request without `resume` to start it afresh. The message
    says why."""


class StepFailed(RuntimeError):
    """A step's forward or sampling raised. `seq_ids`: the sequences it ran (their state is as before the
    step, so a later step may run them again); `outputs`: what the step had already produced (sequences
    that ended while it was scheduled), which the caller must still apply."""

    def __init__(self, seq_ids: tuple[str, ...], outputs: list[RequestOutput], cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.seq_ids = seq_ids
        self.outputs = outputs
