"""The Engine: scheduler + model runner + detokenizer, one batched forward per step."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu.detokenizer import Detokenizer
from gpu.generation_config import GenerationDefaults, eos_token_ids
from gpu.kv_cache import DEFAULT_CPU_BUDGET
from gpu.model import LoadedModel, load_model
from gpu.runner import ModelRunner
from scheduler.config import SchedulerConfig
from scheduler.output import FinishedSequence
from scheduler.scheduler import Scheduler
from scheduler.types import FinishReason, Priority, SamplingParams, SequenceRequest


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int | None = None  # memory budget for KV; None = 256 MiB
    kv_cache_memory: int | None = None  # the same budget under vLLM's name; wins over kv_cache_bytes
    gpu_memory_utilization: float = 0.9  # GPU memory share for KV; range-checked, not read yet (runner sizes)
    num_blocks: int | None = None  # overrides kv_cache_bytes when set (tests use tiny values)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    aging_s: float = 30.0


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()  # stop strings, matched on the text; the output excludes them
    priority: Priority = Priority.NORMAL
    tenant: str = "default"
    deadline: float | None = None  # a time.monotonic() value


@dataclass(frozen=True)
class RequestOutput:
    """News about one request from one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str  # complete characters only; the deltas concatenate to the final text
    finish_reason: FinishReason | None  # set on the request's last output
    started: bool  # True on the step the request was first scheduled
    prompt_tokens: int
    completion_tokens: int
    detail: str = ""  # e.g. why a request was rejected


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


@dataclass
class _Live:
    """Engine-side state of one request the scheduler still knows."""

    request: EngineRequest
    detokenizer: Detokenizer
    seed: int
    tokens: list[int] = field(default_factory=list)
    started: bool = False


def resolve_max_model_len(config: Any, requested: int | None) -> int:
    limit = config.max_position_embeddings
    # The runner attends to the whole context; cap the length where the model would use a sliding window.
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        limit = min(limit, window)
    return min(requested, limit) if requested else limit


class Engine:
    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig()) -> None:
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        generation_config = getattr(model.model, "generation_config", None)
        self.eos_token_ids = eos_token_ids(generation_config, model.tokenizer)
        self.generation_defaults = GenerationDefaults.from_generation_config(generation_config)
        max_model_len = resolve_max_model_len(model.config, config.max_model_len)
        if not 0.0 < config.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
        kv_bytes = config.kv_cache_memory or config.kv_cache_bytes or DEFAULT_CPU_BUDGET
        self.runner = ModelRunner(model, config.block_size, max_model_len, config.num_blocks, kv_bytes)
        num_blocks = self.runner.cache.num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                aging_s=config.aging_s,
            )
        )
        self._live: dict[str, _Live] = {}
        self._steps = 0
        self._forward_seconds = 0.0
        self._batch_seqs = 0
        self._batch_tokens = 0
        self._by_batch: dict[int, tuple[int, float]] = {}

    @classmethod
    def from_options(
        cls,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        cache_dir: Path | None = None,
        **config: Any,
    ) -> Engine:
        """`model` is a spec as `load_model` takes it (None: the tiny built-in model)."""
        return cls(load_model(model, dtype, device, seed, cache_dir), EngineConfig(**config))

    # ---- requests --------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        eos = frozenset() if request.sampling.ignore_eos else self.eos_token_ids
        self.scheduler.add(
            SequenceRequest(
                seq_id=request.request_id,
                prompt_token_ids=tuple(request.prompt_token_ids),
                sampling=request.sampling,
                priority=request.priority,
                tenant=request.tenant,
                arrival=time.monotonic(),
                deadline=request.deadline,
                eos_token_ids=eos,
            )
        )
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        detokenizer = Detokenizer(self.tokenizer, request.prompt_token_ids, request.stop)
        self._live[request.request_id] = _Live(request, detokenizer, seed)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        ended = self.scheduler.abort(request_id)
        return None if ended is None else self._finish(ended, (), "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        output = self.scheduler.schedule(time.monotonic())
        results = [self._finish(ended, (), "") for ended in output.finished]
        sampled: dict[str, int] = {}
        if output.chunks:
            seeds = {c.seq_id: self._live[c.seq_id].seed for c in output.chunks if c.sample}
            start = time.perf_counter()
            sampled = self.runner.execute(output, seeds)
            self._record(len(output.chunks), output.num_tokens, time.perf_counter() - start)
        newly_started = [c.seq_id for c in output.chunks if not self._live[c.seq_id].started]
        for seq_id in newly_started:
            self._live[seq_id].started = True
        updates = {u.seq_id: u for u in self.scheduler.update(output, sampled)}
        for seq_id in newly_started:
            if seq_id not in updates:  # a prefill chunk that sampled nothing yet: still news
                results.append(self._output(self._live[seq_id], (), "", None, started=True))
        for update in updates.values():
            results.append(
                self._on_token(update.seq_id, update.token_id, update.finish, update.seq_id in newly_started)
            )
        return results

    def _on_token(self, seq_id: str, token: int, finish: FinishReason | None, started: bool) -> RequestOutput:
        live = self._live[seq_id]
        live.tokens.append(token)
        # A token that ended the request by itself (EOS, stop token) is not part of the text.
        delta = "" if finish is FinishReason.STOP else live.detokenizer.push(token)
        if live.detokenizer.stopped:
            if finish is None:
                self.scheduler.finish(seq_id, FinishReason.STOP)
            finish = FinishReason.STOP
        if finish is None:
            return self._output(live, (token,), delta, None, started)
        return self._finish(FinishedSequence(seq_id, finish), (token,), delta, started)

    def _finish(
        self, ended: FinishedSequence, tokens: tuple[int, ...], delta: str, started: bool = False
    ) -> RequestOutput:
        live = self._live.pop(ended.seq_id, None)
        if live is None:  # rejected by add(): the engine never saw it run
            return RequestOutput(ended.seq_id, (), "", ended.reason, False, 0, 0, ended.detail)
        delta += live.detokenizer.flush()
        return self._output(live, tokens, delta, ended.reason, started, ended.detail)

    @staticmethod
    def _output(
        live: _Live,
        tokens: tuple[int, ...],
        delta: str,
        finish: FinishReason | None,
        started: bool,
        detail: str = "",
    ) -> RequestOutput:
        return RequestOutput(
            request_id=live.request.request_id,
            new_token_ids=tokens,
            text_delta=delta,
            finish_reason=finish,
            started=started,
            prompt_tokens=len(live.request.prompt_token_ids),
            completion_tokens=len(live.tokens),
            detail=detail,
        )

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _record(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        self._steps += 1
        self._forward_seconds += seconds
        self._batch_seqs += num_seqs
        self._batch_tokens += num_tokens
        count, total = self._by_batch.get(num_seqs, (0, 0.0))
        self._by_batch[num_seqs] = (count + 1, total + seconds)

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        steps = max(self._steps, 1)
        return EngineStats(
            running=s.running,
            waiting=dict(s.waiting),
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            preemptions=s.preemptions,
            prefix_cache_hits=s.prefix_cache_hits,
            steps=self._steps,
            forward_seconds=self._forward_seconds,
            mean_batch_size=self._batch_seqs / steps,
            mean_batch_tokens=self._batch_tokens / steps,
            forward_by_batch=dict(self._by_batch),
        )

    def generate(self, requests: Iterable[EngineRequest]) -> dict[str, list[int]]:
        """Run the requests to completion; the token ids each one produced."""
        ids = []
        for request in requests:
            self.add_request(request)
            ids.append(request.request_id)
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens
