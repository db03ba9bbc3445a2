"""The engine's core: scheduler + model runner + detokenizer, one batched forward per step, run
synchronously. Requests in, outputs out (text, stop strings, grammars, logprobs), statistics.

The Engine (gpu/engine.py) is this class plus async scheduling (the next step launched before the last
one's tokens are back), a subclass that overrides `step`, `has_unfinished` and `close`.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from gpu.detokenizer import Detokenizer
from gpu.engine_types import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    GrammarSpec,
    LoraRequest,
    RequestOutput,
    StepFailed,
    TokenLogprob,
    resolve_max_model_len,
)
from gpu.fingerprint import combine, weights_digest
from gpu.generation_config import GenerationDefaults, eos_token_ids
from gpu.grammar import DEAD_END
from gpu.grammar.constraints import DEAD_END_REASON, Constraints, has_closing
from gpu.logits_processors import LogitsState
from gpu.lora import LoraError
from gpu.model import LoadedModel, load_model
from gpu.resume import ResumedSample, SavedLogprobs, replay, saved_tokens, stop_token_ids
from gpu.runner import ModelRunner, RunnerConfig
from gpu.sampler import SamplingTable
from gpu.samples import stream_key
from gpu.step_clock import OUTPUTS, SCHEDULE, StepClock
from scheduler.config import SchedulerConfig
from scheduler.limits import check_config
from scheduler.output import FinishedSequence, SchedulerOutput, TokenUpdate
from scheduler.scheduler import Scheduler
from scheduler.types import FinishReason, SequenceRequest, sample_seq_id

log = logging.getLogger(__name__)

_DEAD_END = DEAD_END_REASON  # a grammar with no way on (gpu.grammar.constraints)
SEED_BANK = 1024  # seeds drawn from the OS at once
_STOP = FinishReason.STOP  # read per token: an Enum member lookup on the class is not free


@dataclass(slots=True)
class LiveSequence:
    """Engine-side state of one sequence (a request, or one of its n samples) the scheduler still knows."""

    request: EngineRequest
    detokenizer: Detokenizer
    num_prompt_tokens: int
    index: int = 0  # which of the request's samples
    num_tokens: int = 0  # tokens generated so far
    started: bool = False
    lora: str | None = None  # the adapter it holds (gpu.lora.manager.lora_id), released when it ends
    cached_tokens: int = 0  # prompt tokens its first scheduling found computed (prefix cache hits)


@dataclass(slots=True)
class SampleStart:
    """Where one sample of a request being added starts: afresh, or past the tokens it resumes from."""

    detokenizer: Detokenizer
    matcher: Any = None  # its grammar's matcher (None: unconstrained)
    resumed: ResumedSample | None = None
    closing_state: list[bool] | None = None  # a JSON grammar's, past the resumed tokens


class EngineCore:
    """Requests, synchronous steps and their outputs (see the module docstring)."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.model = model
        self.config = config
        self.tokenizer = model.tokenizer
        self._weights_digest = weights_digest(model)  # taken before the runner repacks any weight
        self._fingerprint: str | None = None
        generation_config = getattr(model.model, "generation_config", None)
        self.eos_token_ids = eos_token_ids(generation_config, model.tokenizer)
        self.generation_defaults = GenerationDefaults.from_generation_config(generation_config)
        max_model_len = resolve_max_model_len(model.config, config.max_model_len)
        # Checked before any memory is committed to the KV cache.
        scheduler_config = SchedulerConfig(
            num_blocks=1,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            share_prefix_cache_across_tenants=config.share_prefix_cache_across_tenants,
            aging_s=config.aging_s,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_loras=config.max_loras,
        )
        check_config(scheduler_config)
        self.clock = StepClock()
        self._last_chunks: tuple = ()  # the last step's chunks (their sequences: `last_step`)
        # called with a step's sequences before its forward; test fault injection only (None otherwise)
        self.fault_hook: Callable[[tuple[str, ...]], None] | None = None
        self.runner = ModelRunner(
            model,
            RunnerConfig(
                block_size=config.block_size,
                max_model_len=max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                num_blocks=config.num_blocks,
                kv_cache_memory=config.kv_cache_memory or config.kv_cache_bytes,
                gpu_memory_utilization=config.gpu_memory_utilization,
                decode_kernel=config.decode_kernel,
                fused_rope=config.fused_rope,
                tune_linears=config.tune_linears,
                max_loras=config.max_loras,
                max_lora_rank=config.max_lora_rank,
                max_cpu_loras=config.max_cpu_loras,
            ),
            self.clock,
        )
        runner = self.runner
        log.info("%s", runner.kv_plan.describe(runner.cache.shape, max_model_len, runner.tokens_kept))
        log.info(
            "decode attention kernel: %s; RoPE + cache write: %s",
            self.runner.attention.decode,
            "fused (native)" if self.runner.forward.rope_write else "torch",
        )
        self.scheduler = self._new_scheduler(
            dataclasses.replace(
                scheduler_config, num_blocks=self.runner.num_blocks, kv_window=self.runner.kv_window
            )
        )
        self._live: dict[str, LiveSequence] = {}
        # resumed samples whose saved tokens are not out yet (gpu/resume.py), and this step's outputs of them
        self._resumes: dict[str, ResumedSample] = {}
        self._resumed_outputs: list[tuple[RequestOutput, ResumedSample]] = []
        # each live sequence's sampling settings and the key of its randomness (gpu/samples.py): its seed's
        self._seeds = SamplingTable()
        self._seed_bank: list[int] = []  # unseeded requests' seeds, drawn from the OS in bulk
        # Sample i > 0 of an n > 1 request: its sequence id -> the request id, kept one step past its end
        # so `last_step` can still name the request (`_retired` are dropped when the next step starts).
        self._request_of: dict[str, str] = {}
        self._retired: list[str] = []
        # live sequences using logit_bias, penalties or logprobs (their token history for the penalties)
        on_device = self.runner.device.type == "cuda"  # penalty counts there (gpu/penalty_counts.py)
        self._logits = LogitsState(model.config.vocab_size, on_device, self._seeds)
        # output constraints: the grammar compiler and each constrained live sequence's matcher
        self._constraints = Constraints(self.tokenizer, model.config.vocab_size, self.eos_token_ids)
        self._matchers = self._constraints.matchers  # read every step: whether any sequence is constrained
        self.runner.closing = self._constraints.closing
        self._steps = 0
        self._forward_seconds = 0.0
        self._batch_seqs = 0
        self._batch_tokens = 0
        self._by_batch: dict[int, tuple[int, float]] = {}

    def _new_scheduler(self, config: SchedulerConfig) -> Scheduler:
        return Scheduler(config)

    @classmethod
    def from_options(
        cls,
        model: str | None = None,
        dtype: str | None = "auto",
        device: str = "cpu",
        seed: int = 0,
        cache_dir: Path | None = None,
        **config: Any,
    ) -> Self:
        """`model`: a spec as `load_model` takes it (None: the tiny built-in model). dtype auto (or None):
        bfloat16 on CUDA, float32 on the CPU (where greedy output must equal HF's fp32)."""
        return cls(load_model(model, dtype or "auto", device, seed, cache_dir), EngineConfig(**config))

    @property
    def fingerprint(self) -> str:
        """The model and tokenizer (gpu/fingerprint.py): saved progress is resumed only by an engine whose
        fingerprint it was saved with."""
        if self._fingerprint is None:
            self._fingerprint = combine(self._weights_digest, self.model)
        return self._fingerprint

    # ---- requests --------------------------------------------------------------------------------

    def compile_grammar(self, spec: GrammarSpec) -> Any:
        """The spec compiled for this engine's vocabulary, for EngineRequest.grammar. Any thread may call it
        (the worker's intake thread does, off the engine thread); raises gpu.grammar.GrammarError."""
        return self._constraints.compile(spec)

    def _fresh_seed(self) -> int:
        """A random 63-bit seed for a request added without one, drawn once (its draws are then reproducible
        only inside this engine: the worker sends every job's seed, kept with the job, so a resumed attempt
        draws as the first did); one OS call draws SEED_BANK of them (a call per request is a syscall each,
        visible in a profile of many short jobs)."""
        if not self._seed_bank:
            raw = secrets.token_bytes(8 * SEED_BANK)
            self._seed_bank = [int.from_bytes(raw[i : i + 8], "little") >> 1 for i in range(0, len(raw), 8)]
        return self._seed_bank.pop()

    def load_lora(self, lora: LoraRequest) -> None:
        """Load and check an adapter into the host cache now (raises LoraError naming it and the cause)."""
        if self.runner.lora is None:
            raise LoraError(f"adapter {lora.name!r}: this engine serves no adapters (max_loras 0)")
        self.runner.lora.load(lora)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; n > 1: n samples of its prompt, prefilled once (outputs carry `index`). A
        request whose adapter cannot be loaded ends REJECTED (its detail the LoraError's message) at the
        next step. `request.resume`: see gpu/resume.py; raises ResumeRefused (nothing added) when it
        cannot be used."""
        seq_ids = [sample_seq_id(request.request_id, i) for i in range(max(request.n, 1))]
        if any(seq_id in self._live for seq_id in seq_ids):
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        # Compiled and replayed before anything is added, so an error leaves the engine as it was.
        starts = self._starts(request, len(seq_ids))
        eos = frozenset() if request.sampling.ignore_eos else self.eos_token_ids
        resumed = tuple(s.resumed.tokens[:-1] if s.resumed else () for s in starts)
        lora, refusal = self._hold_lora(request.lora, len(seq_ids))
        sequence = SequenceRequest(
            seq_id=request.request_id,
            prompt_token_ids=tuple(request.prompt_token_ids),
            sampling=request.sampling,
            priority=request.priority,
            tenant=request.tenant,
            arrival=time.monotonic(),
            deadline=request.deadline,
            eos_token_ids=eos,
            n=request.n,
            lora=lora,
            resumed=resumed if any(resumed) else (),
            resumed_logits=request.sampling.logprobs is not None,
        )
        if refusal:
            self.scheduler.refuse(sequence, refusal)
        else:
            self.scheduler.add(sequence)
        seed = request.sampling.seed if request.sampling.seed is not None else self._fresh_seed()
        for index, (seq_id, start) in enumerate(zip(seq_ids, starts, strict=True)):
            self._live[seq_id] = LiveSequence(
                request,
                start.detokenizer,
                len(request.prompt_token_ids),
                index=index,
                num_tokens=len(resumed[index]),
                lora=lora,
            )
            self._seeds.add(seq_id, stream_key(seed, index), request.sampling)
            self._logits.add(seq_id, request.prompt_token_ids, request.sampling, resumed[index])
            if index:
                self._request_of[seq_id] = request.request_id
            if start.matcher is not None:  # every sample follows the grammar on its own
                self._constraints.add(seq_id, request.grammar, start.matcher, start.closing_state)
            if start.resumed is not None and not refusal:  # a refused request ends REJECTED as it is
                self._resumes[seq_id] = start.resumed

    def _starts(self, request: EngineRequest, n: int) -> list[SampleStart]:
        """Each sample's detokenizer and matcher, past its resumed tokens (raises GrammarError or
        ResumeRefused before the engine holds anything of the request)."""
        grammar = request.grammar
        starts = [
            SampleStart(
                Detokenizer(self.tokenizer, request.prompt_token_ids, request.stop),
                None if grammar is None else self._constraints.matcher(grammar),
            )
            for _ in range(n)
        ]
        if not request.resume:
            return starts
        max_model_len = self.scheduler.config.max_model_len
        saved = saved_tokens(request, self.model.config.vocab_size, max_model_len)
        sampling = request.sampling
        stop_ids = stop_token_ids(sampling, self.eos_token_ids)
        json = grammar is not None and has_closing(grammar)
        closing = self._constraints.closing
        for start, tokens in zip(starts, saved, strict=True):
            if not tokens:
                continue
            logprobs = None
            if sampling.logprobs is not None:
                logprobs = SavedLogprobs(
                    tuple(request.prompt_token_ids), tokens[:-1], sampling, self.model.config.vocab_size
                )
                if grammar is not None and len(tokens) > 1:
                    from gpu.grammar.mask import position_masks

                    logprobs.masks = position_masks(len(tokens) - 1, self.model.config.vocab_size)
            state = [False, False] if json else None
            text = replay(
                tokens,
                start.detokenizer,
                start.matcher,
                stop_ids,
                logprobs.observe(closing, state) if logprobs is not None else None,
                (lambda token, s=state: closing.follow(s, token)) if state is not None else None,
            )
            start.resumed = ResumedSample(tokens, len(request.prompt_token_ids), text, logprobs)
            start.closing_state = state
        return starts

    def _hold_lora(self, lora: LoraRequest | None, samples: int) -> tuple[str | None, str]:
        """The adapter's scheduler id, held once per sample; or why the request cannot run under it."""
        if lora is None:
            return None, ""
        manager = self.runner.lora
        if manager is None:
            return None, f"adapter {lora.name!r}: this engine serves no adapters (max_loras 0)"
        try:
            ids = [manager.hold(lora) for _ in range(samples)]
        except LoraError as exc:
            return None, str(exc)
        return ids[0], ""

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """End every live sample of the request: one ABORT output each, by index (none if none is live)."""
        return [self._finish(ended, (), "") for ended in self.scheduler.abort_request(request_id)]

    @property
    def last_step(self) -> tuple[str, ...]:
        """The requests of the step whose outputs the last step() returned, each once (built on demand:
        only failing steps and their probes ask)."""
        return tuple(self._request_ids(self._last_chunks))

    def prompt_token_ids(self, request_id: str) -> tuple[int, ...]:
        """A live request's prompt (empty once it has ended)."""
        live = self._live.get(request_id)
        return tuple(live.request.prompt_token_ids) if live is not None else ()

    def running_ids(self) -> list[str]:
        """Requests with a sample holding a seat (what `step(only=...)` takes)."""
        return self.scheduler.running_request_ids()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def close(self) -> None:
        """Release what the engine holds beyond its memory (nothing, for synchronous steps)."""

    # ---- one step --------------------------------------------------------------------------------

    def step(self, only: str | None = None) -> list[RequestOutput]:
        """One iteration: schedule, forward, sample, outputs. `only`: run that request alone (to find
        which one makes steps fail). Raises StepFailed when the forward or sampling raises."""
        self.clock.start()
        self._drop_retired()
        output = self.scheduler.schedule(time.monotonic(), only)
        for seq_id in output.preempted:  # its blocks are gone; a readmission starts a new table
            self.runner.release(seq_id)
        results = [self._finish(ended, (), "") for ended in output.finished]
        self.clock.lap(SCHEDULE)
        tokens: list[int] = []
        self._last_chunks = output.chunks
        if output.chunks:
            start = time.perf_counter()
            try:
                if self.fault_hook is not None:
                    self.fault_hook(self.last_step)
                tokens = self.runner.execute(
                    output, self._seeds, self._logits, self._matchers, self._resumes or None
                )
            except Exception as exc:
                self.runner.forget_tables()  # its sequences live on: their next step rewrites their rows
                raise StepFailed(self.last_step, results, exc) from exc
            self._record(len(output.chunks), output.num_tokens, time.perf_counter() - start)
        started = self._newly_started(output)
        updates = self.scheduler.update_in_order(output, tokens)
        self._outputs(updates, started, results, bool(tokens))
        self.clock.lap(OUTPUTS)
        return results

    def _drop_retired(self) -> None:
        if self._retired:
            for seq_id in self._retired:
                del self._request_of[seq_id]
            self._retired.clear()

    def _outputs(
        self,
        updates: list[TokenUpdate],
        started: dict[str, LiveSequence],
        results: list[RequestOutput],
        sampled: bool,
    ) -> None:
        """A step's outputs after `results`: sequences it started that sampled nothing yet, then a token
        each (text, stop strings, grammars)."""
        if self._matchers:
            updates = self._constraints.advance(updates, self.scheduler.finish)
        if started:
            sampled_ids, current = {u.seq_id for u in updates}, self._live
            for seq_id, live in started.items():
                # A prefill chunk that sampled nothing yet is still news, unless the request ended since
                # (aborted while its step was in flight: its final output went out already).
                if seq_id not in sampled_ids and current.get(seq_id) is live:
                    results.append(self._output(live, (), "", None, True))
        on_token, append = self._on_resumed_token if self._resumes else self._on_token, results.append
        if started:
            for update in updates:
                append(on_token(update, update.seq_id in started))
        else:  # the common decode step
            for update in updates:
                append(on_token(update, False))
        if sampled and (logprobs := self._logits.take_logprobs()):
            attach_logprobs(results, logprobs)
        if self._resumed_outputs:
            self._attach_saved_logprobs()

    def _request_ids(self, chunks: Iterable[Any]) -> Iterable[str]:
        request_of = self._request_of
        return dict.fromkeys(request_of.get(c.seq_id, c.seq_id) for c in chunks)

    def _newly_started(self, output: SchedulerOutput) -> dict[str, LiveSequence]:
        """Sequences scheduled for the first time this step, in chunk order (a dict: ordered, O(1) `in`).
        Decode chunks continue sequences that started before."""
        started: dict[str, LiveSequence] = {}
        live = self._live
        # A resumed sample may start with one token to compute past its cached prefix: a decode chunk.
        for chunk in output.chunks if self._resumes else output.chunks[output.num_decodes :]:
            state = live[chunk.seq_id]
            if not state.started:
                state.started = True
                # its first chunk starts past the blocks the prefix cache (or a sibling sample) had
                state.cached_tokens = min(chunk.start_position, state.num_prompt_tokens)
                started[chunk.seq_id] = state
        return started

    def _on_token(self, update: TokenUpdate, started: bool) -> RequestOutput:
        live = self._live[update.seq_id]
        live.num_tokens += 1
        token, finish, detokenizer = update.token_id, update.finish, live.detokenizer
        # A token that ended the request by itself (EOS, stop token) is not part of the text.
        delta = "" if finish is _STOP or finish is _DEAD_END else detokenizer.push(token)
        if detokenizer.stopped:
            if finish is None:
                self.scheduler.finish(update.seq_id, _STOP)
            finish = _STOP
        if finish is None:
            return RequestOutput(
                live.request.request_id,
                (token,),
                delta,
                None,
                started,
                live.num_prompt_tokens,
                live.num_tokens,
                "",
                live.index,
            )
        if finish is _DEAD_END:  # the grammar refused the token: not part of the output (Constraints.advance)
            return self._finish(FinishedSequence(update.seq_id, finish, DEAD_END), (), delta, started)
        return self._finish(FinishedSequence(update.seq_id, finish), (token,), delta, started)

    def _on_resumed_token(self, update: TokenUpdate, started: bool) -> RequestOutput:
        """`_on_token` while resumed samples wait for their forced token: that token's output carries all the
        saved tokens (gpu/resume.py)."""
        saved = self._resumes.pop(update.seq_id, None)
        out = self._on_token(update, started)
        if saved is None:
            return out
        out.new_token_ids = saved.tokens
        out.text_delta = saved.text + out.text_delta
        out.resumed = True
        self._resumed_outputs.append((out, saved))
        return out

    def _attach_saved_logprobs(self) -> None:
        """The logprobs of resumed outputs' saved tokens before the last, ahead of the last one's own."""
        for out, saved in self._resumed_outputs:
            if saved.logprobs is None:
                continue
            if saved.logprobs.complete and len(out.logprobs) == 1:
                out.logprobs = (*saved.logprobs.logprobs, *out.logprobs)  # type: ignore[arg-type]
            else:  # never by construction: every saved position ran through the model
                log.error("%s: logprobs of its resumed tokens are missing", out.request_id)
                out.logprobs = ()
        self._resumed_outputs.clear()

    def _finish(
        self, ended: FinishedSequence, tokens: tuple[int, ...], delta: str, started: bool = False
    ) -> RequestOutput:
        self.runner.release(ended.seq_id)
        live = self._live.pop(ended.seq_id, None)
        if live is not None and live.lora is not None and self.runner.lora is not None:
            self.runner.lora.release(live.lora)
        self._drop(ended.seq_id)
        if self._resumes and ended.seq_id in self._resumes and live is not None:
            return self._finish_resumed(ended, live, self._resumes.pop(ended.seq_id), started)
        if live is None:  # rejected by add(): the engine never saw it run
            return RequestOutput(ended.seq_id, (), "", ended.reason, False, 0, 0, ended.detail)
        delta += live.detokenizer.flush()
        return self._output(live, tokens, delta, ended.reason, started, ended.detail)

    def _drop(self, seq_id: str) -> None:
        """Forget an ended sequence's sampling state (its request id stays one more step, see __init__)."""
        self._logits.drop(seq_id)  # before its sampling row goes: its counts are found by it
        self._seeds.drop(seq_id)
        if seq_id in self._request_of:
            self._retired.append(seq_id)
        self._constraints.drop(seq_id)

    def _finish_resumed(
        self, ended: FinishedSequence, live: LiveSequence, saved: ResumedSample, started: bool
    ) -> RequestOutput:
        """A resumed sample ended before its forced token (aborted, expired): its final output carries the
        saved tokens and their text, as their first output would have (their logprobs were not all
        computed: none)."""
        last = saved.tokens[-1]
        ends = last in stop_token_ids(live.request.sampling, self.eos_token_ids)
        text = saved.text + ("" if ends else live.detokenizer.push(last)) + live.detokenizer.flush()
        live.num_tokens = len(saved.tokens)
        out = self._output(live, saved.tokens, text, ended.reason, started, ended.detail)
        out.resumed = True
        return out

    @staticmethod
    def _output(
        live: LiveSequence,
        tokens: tuple[int, ...],
        delta: str,
        finish: FinishReason | None,
        started: bool,
        detail: str = "",
    ) -> RequestOutput:
        request_id = live.request.request_id
        return RequestOutput(
            request_id,
            tokens,
            delta,
            finish,
            started,
            live.num_prompt_tokens,
            live.num_tokens,
            detail,
            live.index,
            cached_tokens=live.cached_tokens,
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
            prompt_tokens_computed=s.prompt_tokens_computed,
            steps=self._steps,
            forward_seconds=self._forward_seconds,
            mean_batch_size=self._batch_seqs / steps,
            mean_batch_tokens=self._batch_tokens / steps,
            forward_by_batch=dict(self._by_batch),
        )

    def generate(self, requests: Iterable[EngineRequest]) -> dict[str, list[int]]:
        """Run the requests to completion; the token ids each one produced (sample i > 0 of an n > 1
        request under `sample_seq_id(request_id, i)`, i.e. `request_id#i`)."""
        ids = []
        for request in requests:
            self.add_request(request)
            ids += [sample_seq_id(request.request_id, i) for i in range(max(request.n, 1))]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_unfinished():
            for out in self.step():
                tokens.setdefault(sample_seq_id(out.request_id, out.index), []).extend(out.new_token_ids)
        return tokens


def attach_logprobs(results: list[RequestOutput], logprobs: dict[str, TokenLogprob]) -> None:
    """Give each output that carries a sampled token that token's log probabilities (keyed by sequence:
    sample i > 0 of an n > 1 request is `request_id#i`)."""
    for out in results:
        if not out.new_token_ids:
            continue
        logprob = logprobs.get(sample_seq_id(out.request_id, out.index))
        if logprob is not None:
            out.logprobs = (logprob,)
