"""One step on the model: SchedulerOutput in, one sampled token per sampling sequence out."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu.attention import PagedAttention
from gpu.attention.prefill import pack_keys
from gpu.cpu import autotune
from gpu.cpu.linear import Linear
from gpu.cpu.native_decode import NativeDecode
from gpu.cpu.rope_write import RopeCacheWrite
from gpu.cpu.threads import ThreadTuner
from gpu.forward import LlamaForward
from gpu.grammar.closing import Closing
from gpu.inputs import InputBuilder, StepInputs
from gpu.kv_cache import KVCache, KVShape
from gpu.kv_sizing import KVPlan, activation_estimate, plan_kv
from gpu.logits_processors import LogitsPlan, LogitsState, launch_logprobs, read_logprobs
from gpu.lora.manager import LoraManager
from gpu.lora.rows import LoraRows
from gpu.model import LoadedModel
from gpu.resume import ResumedSample, ResumeRows, process_gathered, resume_rows
from gpu.sampler import SamplingBatch, SamplingTable, sample
from gpu.step_clock import FORWARD, INPUTS, SAMPLE, StepClock
from scheduler.output import SchedulerOutput

log = logging.getLogger(__name__)

TUNE_CONTEXT = 256  # context length the decode kernels are compared at


@dataclass(frozen=True)
class RunnerConfig:
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int | None = None  # overrides the memory budget (tests use tiny caches)
    kv_cache_memory: int | None = None  # bytes; None = derived from the device's memory
    gpu_memory_utilization: float = 0.9
    decode_kernel: str | None = None  # "native" or "torch" on CPU; None = measured at start
    fused_rope: bool | None = None  # the native RoPE + cache write on CPU; None = measured at start
    tune_linears: bool = True  # measure the linear kernels (plain, oneDNN, panel) per shape at start (CPU)
    max_loras: int = 0  # LoRA adapters resident at once (gpu/lora); 0: no adapters served
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: gpu.lora.manager.default_max_cpu_loras


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: RunnerConfig, clock: StepClock | None = None) -> None:
        self.config = config
        self.clock = clock or StepClock()  # the engine's, so the runner's phases add to its step
        self.device, self.dtype = loaded.device, loaded.dtype
        self.forward = LlamaForward(loaded, max_positions=config.max_model_len)
        # LoRA adapters: made before the KV cache is sized, so the device slots are counted in
        self.lora: LoraManager | None = None
        if config.max_loras > 0:
            self.lora = LoraManager(loaded, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        shape = self.forward.kv_shape(config.block_size)
        model_config = loaded.config
        element = torch.empty((), dtype=self.dtype).element_size()
        activations = activation_estimate(
            model_config.hidden_size,
            model_config.intermediate_size,
            model_config.vocab_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            element,
        )
        # On CUDA the kernels are chosen first (their trials need no KV cache), so the cache is sized after
        # what the chosen decode path really needs: the SDPA path's per-layer gather, or nothing more.
        kernels, trials, chose_s = None, [], 0.0
        if self.device.type == "cuda":
            from gpu.cuda import choice

            began = time.perf_counter()
            max_blocks = -(-config.max_model_len // config.block_size)
            kernels, trials = choice.choose(self.forward, shape, config.max_num_seqs, max_blocks)
            choice.log_choice(kernels, trials)
            chose_s = time.perf_counter() - began
        activations += decode_gather_bytes(kernels, config.max_num_seqs, config.max_model_len, shape, element)
        if kernels is not None:  # CUDA: the block table's device copy and the graphs' static one, int64
            activations += (2 * config.max_num_seqs + 1) * -(-config.max_model_len // config.block_size) * 8
        self.kv_window = self.forward.kv_window  # every layer windowed: blocks behind it are given back
        self.tokens_kept = config.max_model_len  # the KV one sequence holds at most
        if self.kv_window is not None:  # its window, one step's chunk, a partial block at each end
            kept = self.kv_window + 1 + config.max_num_batched_tokens + 2 * config.block_size
            self.tokens_kept = min(config.max_model_len, kept)
        self.kv_plan: KVPlan = plan_kv(
            shape,
            self.device,
            config.max_num_seqs,
            self.tokens_kept,
            config.kv_cache_memory,
            config.gpu_memory_utilization,
            config.num_blocks,
            activations,
        )
        self.num_blocks = self.kv_plan.num_blocks  # what the scheduler may hand out
        cuda = self.device.type == "cuda"
        # On CUDA one more block, never scheduled, takes the K/V of a graph's padding rows.
        self.cache = KVCache(shape, self.num_blocks + cuda, self.device)
        # On CUDA the block table is kept on the device too: a step copies only the entries it changed.
        self.inputs = InputBuilder(
            config.block_size, config.max_model_len, config.max_num_seqs, device_tables=cuda
        )
        self.cuda_step = None
        if cuda:
            from gpu.cuda.step import build_cuda_step

            # The kernels chosen above, then every decode graph captured: logged.
            self.cuda_step = build_cuda_step(
                self.forward,
                self.cache,
                config.max_num_seqs,
                self.inputs.max_blocks,
                self.num_blocks,
                kernels,
                lora_slots=self.lora.slots if self.lora is not None else None,
            )
            self.cuda_step.trials = trials
            self.cuda_step.start_seconds += chose_s
            self.attention = self.cuda_step.attention
        else:
            self.attention = self._choose_attention()
            self._choose_rope_write()
            if config.tune_linears:
                self._tune_linears()
        self.threads = ThreadTuner(config.max_num_seqs) if self.device.type == "cpu" else None
        # A sampled row also runs the output projection: its cost relative to a token's pass through every
        # layer, in weights multiplied (2.4 for the tiny model, 0.27 for SmolLM2).
        layer_weights = sum(m.weight.numel() for m in linears_of(self.forward))
        self.lm_head_weight = self.forward.lm_head.weight.numel() / max(layer_weights, 1)
        self.vocab_size = self.forward.lm_head.out_features  # the logits' width
        self.token_mask: Any = None  # a gpu.grammar.mask.TokenMask, made on the first constrained step
        self.closing: Closing | None = None  # which constrained sequences are JSON (set by the engine)

    def _choose_attention(self) -> PagedAttention:
        shape, heads = self.cache.shape, self.forward.num_heads
        native = NativeDecode.load() if NativeDecode.supports(shape, self.device, heads) else None
        kind = self.config.decode_kernel
        if kind is None:
            batch = min(self.config.max_num_seqs, 32)
            context = min(self.config.max_model_len, TUNE_CONTEXT)
            kind = autotune.decode_kernel(shape, heads, batch, context, torch.get_num_threads())
        pack_keys(shape.num_kv_heads, shape.head_dim, shape.dtype, self.device)  # measured at start, once
        return PagedAttention(kind, native)

    def _choose_rope_write(self) -> None:
        f, wanted = self.forward, self.config.fused_rope
        supported = f.graph_safe and RopeCacheWrite.supports(self.dtype, self.device, f.head_dim)
        if wanted is False or not supported:
            return
        if wanted is None:
            tokens, threads = min(self.config.max_num_seqs, 32), torch.get_num_threads()
            wanted = autotune.rope_write_kernel(f.num_heads, f.num_kv_heads, f.head_dim, tokens, threads)
        if wanted:
            f.rope_write = RopeCacheWrite.load()

    def _tune_linears(self) -> None:
        linears = linears_of(self.forward)
        rows = {id(m): self.config.max_num_batched_tokens for m in linears}
        rows[id(self.forward.lm_head)] = self.config.max_num_seqs  # it only runs on sampling rows
        start = time.perf_counter()
        autotune.tune_linears([*linears, self.forward.lm_head], rows, torch.get_num_threads())
        log.info("linear kernels measured in %.2f s", time.perf_counter() - start)

    def release(self, seq_id: str) -> None:
        """The sequence ended or was preempted: forget its block table."""
        self.inputs.release(seq_id)

    def execute(
        self,
        output: SchedulerOutput,
        table: SamplingTable,
        logits_state: LogitsState | None = None,
        grammars: Mapping[str, Any] | None = None,
        resumes: Mapping[str, ResumedSample] | None = None,
    ) -> list[int]:
        """Run every scheduled token through the model and sample for the chunks that ask for it: the
        tokens, in the order of the chunks that sample. logits_state: the sequences using logit_bias,
        penalties or logprobs; the step's sampled tokens and log probabilities are recorded into it.
        `grammars`: each constrained sequence's grammar matcher (gpu.grammar); the others sample freely.
        `resumes`: resumed samples whose saved tokens are not out yet (gpu/resume.py)."""
        return self.run(self.prepare(output, table, None, resumes, logits_state), logits_state, grammars)

    def forget_tables(self) -> None:
        """A step failed after its inputs were built: its block-table updates may never have reached the
        device (CUDA), so every sequence's next step writes its whole row."""
        self.inputs.forget()

    @torch.inference_mode()  # its tensors are made as before the split: inference tensors
    def prepare(
        self,
        output: SchedulerOutput,
        table: SamplingTable,
        previous: list[str] | None = None,
        resumes: Mapping[str, ResumedSample] | None = None,
        logits_state: LogitsState | None = None,
    ) -> PreparedStep:
        """The host's part of a step before the model runs: its inputs and sampling settings. `previous`
        (async scheduling): the sequences of the step still in flight that sample, in its sampling order,
        for this step's placeholder tokens; this step then runs while the next one is prepared, so it gets
        its own copy of the block tables. `resumes`, `logits_state`: as `execute`'s (the rows of resumed
        samples: gpu.resume.resume_rows; the bias and penalties of tracked rows: LogitsState.plan, built here
        once the step before has recorded its tokens)."""
        inputs = self.inputs.build(output, previous)
        chunks = inputs.sample_chunks
        resume = resume_rows(output.chunks, chunks, resumes) if resumes else None
        if resume is not None and len(resume.gathered):  # their logits come after the sampling rows'
            gathered = torch.cat([inputs.sample_rows, torch.from_numpy(resume.gathered)])
            inputs = dataclasses.replace(inputs, sample_rows=gathered)
        # their settings' rows, looked up only when some sequence draws, is tracked or resumes
        rows = table.rows(chunks) if table.drawing or logits_state or resume is not None else None
        # None: all greedy, the common case: one argmax and no per-row settings
        batch = SamplingBatch.for_step(table, chunks, self.vocab_size, resume, rows)
        plan = logits_state.plan(chunks, rows) if logits_state else None  # None: no tracked sequence (common)
        work = len(inputs.input_ids) + self.lm_head_weight * len(chunks)  # token-equivalents, for threads
        lora = self.lora.rows(output) if self.lora is not None and self.lora.active else None
        self.clock.lap(INPUTS)
        return PreparedStep(inputs, batch, work, lora, resume, plan)

    def run(
        self,
        step: PreparedStep,
        logits_state: LogitsState | None = None,
        grammars: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """The model's part of a prepared step: forward and sampling, the tokens back as a list (the
        synchronous step: it waits for the device)."""
        tokens = self.launch(step, logits_state, grammars).tokens()
        self.clock.lap(SAMPLE)
        return tokens

    def launch(
        self,
        step: PreparedStep,
        logits_state: LogitsState | None = None,
        grammars: Mapping[str, Any] | None = None,
        previous: SampledTokens | None = None,
        clock: bool = True,
    ) -> SampledTokens:
        """Queue a prepared step's forward and sampling; its tokens come back as SampledTokens, on the
        device at once and on the host when asked (on CUDA nothing here waits for the device). `previous`
        (async scheduling): the step before's, whose device tensor fills this step's placeholder tokens
        on the device, so this step is queued before the one before it is back on the host. `clock`: lap
        the step clock (off on the async worker thread: the engine thread times its own phases)."""
        fill = None
        rows = step.inputs.placeholder_rows
        if len(rows):
            if previous is None:
                raise ValueError("a step with placeholder tokens ran without its previous step's tokens")
            fill = placeholder_fill(
                step.inputs.input_ids, rows, step.inputs.placeholder_from, previous.device
            )
        if self.threads is None:
            return self._execute(step, logits_state, grammars, clock, fill)
        self.threads.before_step()
        start = time.perf_counter()
        try:
            return self._execute(step, logits_state, grammars, clock, fill)
        finally:
            self.threads.after_step(time.perf_counter() - start, step.work)

    @torch.inference_mode()
    def _execute(
        self,
        step: PreparedStep,
        logits_state: LogitsState | None,
        grammars: Mapping[str, Any] | None,
        clock: bool,
        fill: Callable[[torch.Tensor], None] | None,
    ) -> SampledTokens:
        inputs = step.inputs
        greedy = None  # each row's argmax, when the device computed it inside the step's graph
        if self.cuda_step is not None:
            # Adapters come into their slots here, in step order on the stream: a step in flight before
            # this one has read the slots it used by the time the copies run.
            meta = self.lora.assign(step.lora) if step.lora is not None and self.lora is not None else None
            # the pinned staging buffers rotate under per-slot events (gpu/cuda/staging.py): no wait here
            result = self.cuda_step.run(inputs, fill, meta)
            logits, greedy = result.logits, result.greedy
        else:
            if self.device.type != "cpu":
                inputs = to_device(inputs, self.device)
            if fill is not None:
                fill(inputs.input_ids)
            lora = self.lora.host_step(step.lora) if step.lora is not None and self.lora is not None else None
            if self.threads is not None:
                logits = self.threads.forward(
                    lambda: self.forward(inputs, self.cache, self.attention, lora),
                    len(inputs.input_ids),
                    step.work,
                )
            else:
                logits = self.forward(inputs, self.cache, self.attention, lora)
        if clock:
            self.clock.lap(FORWARD)
        chunks = inputs.sample_chunks
        then: list[Callable[[list[int]], None]] = []  # what needs the tokens on the host, once they are
        if step.resume is not None and len(step.resume.gathered):
            logits, gathered = logits[: len(chunks)], logits[len(chunks) :]
            then += process_gathered(gathered, step.resume, self.closing)
        if grammars and self._constrain(logits, chunks, grammars):
            greedy = None  # the mask changed the logits after the graph's argmax
        device = logits.device
        plan = step.plan.to(device) if step.plan is not None else None
        batch = step.batch.to(device) if step.batch is not None else None
        sampled = sample(logits, batch, plan, greedy if plan is None else None)
        if plan is not None and logits_state is not None:
            state, launched = logits_state, launch_logprobs(logits, sampled, plan)
            then.append(lambda tokens: state.record(plan, tokens, read_logprobs(plan, launched)))
        if sampled is greedy and sampled.is_cuda:  # a graph's output buffer (its pool is shared by every
            sampled = sampled.clone()  # graph, the next replay overwrites it): the step's own buffer
        return SampledTokens.of(sampled, then)

    def _constrain(self, logits: torch.Tensor, chunks: tuple, grammars: Mapping[str, Any]) -> bool:
        """Forbid, in the rows of constrained sequences, every token their grammar does not allow next.
        False when no row of this step is constrained."""
        matchers = [(i, grammars[c.seq_id]) for i, c in enumerate(chunks) if c.seq_id in grammars]
        if not matchers:
            return False
        if self.token_mask is None:
            from gpu.grammar.mask import TokenMask  # xgrammar loads only once a grammar is used

            self.token_mask = TokenMask(logits.shape[-1], self.config.max_num_seqs)
        self.token_mask.apply(logits, self.token_mask.fill(matchers))
        closing = self.closing
        if closing is not None and closing.sequences:  # JSON outputs in their budget's last tokens close
            due = closing.due
            rows = [
                (i, chunks[i].seq_id, matcher)
                for i, matcher in matchers
                if due(chunks[i].seq_id, chunks[i].sampling.max_tokens, chunks[i].num_generated)
            ]
            closing.restrict(logits, rows)
        return True


@dataclass(slots=True)
class SampledTokens:
    """A launched step's sampled tokens, in its sampling order: `device` at once (the next step's
    placeholders read it there), the host list once `tokens()` has waited for the copy to land."""

    device: torch.Tensor  # [S] the step's own tensor (never a graph's output buffer, reused by the next)
    host: torch.Tensor | None = None  # a pinned copy in flight (CUDA); None: read `device`
    ready: Any = None  # torch.cuda.Event recorded after the copy to `host`
    known: list[int] | None = None
    # called with the tokens once they are on the host (penalty counts, logprobs read), in order
    then: list[Callable[[list[int]], None]] | None = None

    @classmethod
    def of(
        cls, sampled: torch.Tensor, then: list[Callable[[list[int]], None]] | None = None
    ) -> SampledTokens:
        """Start the copy to the host (CUDA: asynchronous, into pinned memory of its own)."""
        if sampled.device.type != "cuda":
            return cls(sampled, then=then or None)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(sampled, host, ready, then=then or None)

    def tokens(self) -> list[int]:
        """The tokens on the host (waits for the step on CUDA, releasing the GIL meanwhile). The first call
        also runs what waited for them (`then`): the first read of the step's device values."""
        if self.known is None:
            if self.ready is not None:
                self.ready.synchronize()
            known = (self.device if self.host is None else self.host).tolist()
            then, self.then = self.then, None
            for call in then or ():
                call(known)
            self.known = known
        return self.known


def placeholder_fill(
    input_ids: torch.Tensor, rows: np.ndarray, sources: np.ndarray, previous: torch.Tensor
) -> Callable[[torch.Tensor], None]:
    """Async scheduling: input row rows[i] takes the previous step's sampled token sources[i]. The host
    marks each such row in `input_ids` (a CPU tensor, before it is staged) as -1 - sources[i]; the fill,
    called with the ids on the model's device, reads the previous step's tokens there, so nothing waits
    for them to reach the host. The common decode step (the first n rows take tokens 0..n-1) is one copy."""
    count = len(rows)
    if int(sources.max()) >= previous.shape[0] or int(rows[-1]) >= input_ids.shape[0]:
        raise ValueError("a placeholder names a token the previous step did not sample")
    prefix = count if int(rows[-1]) == count - 1 and np.array_equal(sources, rows) else 0
    input_ids.numpy()[rows] = -1 - sources

    def fill(ids: torch.Tensor) -> None:
        if prefix:
            ids[:prefix].copy_(previous[:prefix])
        else:
            ids.copy_(torch.where(ids < 0, previous[(-1 - ids).clamp_(min=0)].to(ids.dtype), ids))

    return fill


@dataclass(frozen=True)
class PreparedStep:
    """A step's inputs and sampling settings, built on the engine's thread, ready for the model."""

    inputs: StepInputs
    batch: SamplingBatch | None  # the rows that draw at random (or are forced); None: every row is greedy
    work: float  # the step's compute in token-equivalents (attention left out): the thread tuner's measure
    lora: LoraRows | None = None  # the rows that run under an adapter; None: every row is the base model's
    resume: ResumeRows | None = None  # resumed samples' forced and gathered rows; None: none this step
    plan: LogitsPlan | None = None  # the tracked rows' bias, penalties and logprobs; None: none this step


def decode_gather_bytes(
    kernels: Any, max_num_seqs: int, max_model_len: int, shape: KVShape, element: int
) -> int:
    """Activation bytes the CUDA decode path adds: the SDPA path (kernels None or without the Triton decode
    kernel) gathers every row's context, K and V, for one layer at a time; the Triton kernel reads the
    cache in place and needs none."""
    if kernels is not None and kernels.decode:
        return 0
    return 2 * max_num_seqs * max_model_len * shape.num_kv_heads * shape.head_dim * element


def linears_of(forward: LlamaForward) -> list[Linear]:
    """The decoder layers' linear layers (the output projection not included)."""
    return [m for layer in forward.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]


def to_device(inputs: StepInputs, device: torch.device) -> StepInputs:
    """Move every tensor of the step's inputs (built on the CPU) to the model's device."""

    def move(value: object) -> object:
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(
                value, **{f.name: move(getattr(value, f.name)) for f in dataclasses.fields(value)}
            )
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            return tuple(move(v) for v in value)
        return value

    return move(inputs)  # type: ignore[return-value]
