"""Which kernels the CUDA step runs: the Triton ones (gpu/triton_kernels/) or the torch paths they replace.

Chosen by measurement at engine start, never by a hard-coded winner: each Triton kernel is first run on a
representative shape and checked against its torch reference (a kernel that fails to compile or disagrees
is dropped), then both are timed and the faster is kept. Without triton (or without CUDA) everything stays
on the torch paths. The choice and its timings are logged.

In float32 the fused elementwise kernels (add+RMSNorm, RoPE+cache write, SiLU*up) stay off: their sums
and roundings differ from HF's operator-by-operator ones, and float32 is where greedy output must equal
HF's (the gold tests). The attention kernels compute float32 in true float32, as SDPA does.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu import triton_kernels
from gpu.attention.metadata import AttentionMetadata, PrefillChunk
from gpu.cuda.attention import CudaPagedAttention, decode_attention, paged_decode
from gpu.cuda.kernels import CudaKernels
from gpu.forward import LlamaForward, rms_norm, rotate
from gpu.kv_cache import KVCache, KVShape

log = logging.getLogger(__name__)

# A representative decode batch and context for the comparison (clipped to the engine's limits).
PROBE_BATCH, PROBE_CONTEXT = 64, 1024
# The varlen kernel is timed on a mixed step, as it runs in serving: the decode batch's rows beside prefill
# chunks (a chunked-prefill step's budget of 2048 tokens, split over a few prompts).
PROBE_CHUNKS, PROBE_CHUNK_TOKENS = 4, 512
TOLERANCE = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}  # atol and rtol


@dataclass(frozen=True)
class Trial:
    """One kernel's comparison: chosen or not, why, and the median times (ms) of both paths."""

    name: str
    chosen: bool
    triton_ms: float | None
    torch_ms: float | None
    reason: str


def choose(
    forward: LlamaForward, shape: KVShape, max_batch: int, max_blocks: int, allow_cpu: bool = False
) -> tuple[CudaKernels, list[Trial]]:
    """Measure every Triton kernel against its torch path on the forward's device and dtype.

    allow_cpu: run the trials on CPU tensors too (tests, under TRITON_INTERPRET=1)."""
    device = forward.device
    if not (triton_kernels.available(device.type) or (allow_cpu and triton_kernels.importable())):
        return CudaKernels.torch_only(), [Trial("all", False, None, None, "triton unavailable here")]
    with torch.no_grad():
        return _choose(forward, shape, max_batch, max_blocks)


def _choose(
    forward: LlamaForward, shape: KVShape, max_batch: int, max_blocks: int
) -> tuple[CudaKernels, list[Trial]]:
    probe = _Probe(forward, shape, max_batch, max_blocks)
    decode = probe.decode()
    trials = [decode, probe.varlen(decode.chosen), probe.argmax()]
    if forward.dtype != torch.float32:
        trials += [probe.add_rms_norm(), probe.rope_write(), probe.silu_mul()]
    chosen = {t.name: t.chosen for t in trials}
    kernels = CudaKernels(**{f.name: chosen.get(f.name, False) for f in dataclasses.fields(CudaKernels)})
    return kernels, trials


def log_choice(kernels: CudaKernels, trials: list[Trial]) -> None:
    for t in trials:
        times = f"triton {t.triton_ms:.3f} ms, torch {t.torch_ms:.3f} ms" if t.torch_ms is not None else ""
        log.info("kernel %s: %s (%s) %s", t.name, "triton" if t.chosen else "torch", t.reason, times)
    log.info("CUDA kernels: %s", kernels.describe())


def _time_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Time of one call in ms. On CUDA, `repeats` calls captured in one graph and replayed: the device's
    time, as in the decode graphs, without Python's launch overhead (which favours torch's cheaper
    launches in eager timing). Elsewhere (tests), the median wall time of eager calls."""
    fn()  # compile, warm caches
    if device.type == "cuda":
        try:
            return _graph_time_ms(fn, repeats)
        except RuntimeError as error:  # not capturable: time it eagerly
            log.info("kernel timing without a graph: %s", error)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _graph_time_ms(fn: Callable[[], object], repeats: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()  # first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * repeats)


def _trial(
    name: str,
    fast: Callable[[], torch.Tensor],
    reference: Callable[[], torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    exact: bool = False,
) -> Trial:
    want = reference()
    try:
        got = fast()
    except Exception as error:  # a kernel that does not compile or launch here: keep torch
        return Trial(name, False, None, None, f"failed: {type(error).__name__}: {error}"[:300])
    tol = TOLERANCE.get(dtype, 4e-2)
    same = (
        torch.equal(got, want)
        if exact
        else got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)
    )
    if not same:
        diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
        return Trial(name, False, None, None, f"disagrees with torch (max diff {diff:.3g})")
    repeats = 20 if device.type == "cuda" else 1
    fast_ms, ref_ms = _time_ms(fast, device, repeats), _time_ms(reference, device, repeats)
    return Trial(name, fast_ms < ref_ms, fast_ms, ref_ms, "faster" if fast_ms < ref_ms else "slower")


class _Probe:
    """Random inputs of the model's shapes on its device, and one trial per kernel."""

    def __init__(self, forward: LlamaForward, shape: KVShape, max_batch: int, max_blocks: int) -> None:
        self.f, self.device, self.dtype = forward, forward.device, forward.dtype
        cpu = self.device.type != "cuda"  # interpreter runs: tiny shapes
        self.batch = min(max_batch, 4 if cpu else PROBE_BATCH)
        self.max_blocks = max_blocks
        self.context = min(max_blocks * shape.block_size, 40 if cpu else PROBE_CONTEXT)
        self.chunks, self.chunk_tokens = (2, 9) if cpu else (PROBE_CHUNKS, PROBE_CHUNK_TOKENS)
        per_row = -(-self.context // shape.block_size)
        blocks = self.batch * per_row + self.chunks * -(-self.chunk_tokens // shape.block_size) + 1
        gen = torch.Generator(device="cpu").manual_seed(0)  # integers, made on the host
        self.floats = torch.Generator(device=self.device).manual_seed(0)  # values, made on the device
        self.cache = KVCache(dataclasses.replace(shape, num_layers=1), blocks, self.device)
        self.cache.k.copy_(self._randn(*self.cache.k.shape))
        self.cache.v.copy_(self._randn(*self.cache.v.shape))
        self.block_size = shape.block_size
        order = torch.randperm(blocks - 1, generator=gen)
        self.tables = torch.zeros(self.batch, max_blocks, dtype=torch.long)
        self.tables[:, :per_row] = order[: self.batch * per_row].view(self.batch, per_row)
        self.tables = self.tables.to(self.device)
        self.lens = torch.randint(self.context // 2, self.context + 1, (self.batch,), generator=gen)
        self.lens = self.lens.to(self.device)
        self.per_row = per_row
        self.gen = gen

    def _randn(self, *size: int) -> torch.Tensor:
        return torch.randn(size, generator=self.floats, device=self.device).to(self.dtype)

    def decode(self) -> Trial:
        f = self.f
        q = self._randn(self.batch, f.num_heads, f.head_dim)
        return _trial(
            "decode",
            lambda: paged_decode(q, self.cache, 0, self.tables, self.lens, f.scale),
            lambda: decode_attention(q, self.cache, 0, self.tables[:, : self.per_row], self.lens, f.scale),
            self.device,
            self.dtype,
        )

    def varlen(self, decode: bool) -> Trial:
        """A mixed step: the decode batch's rows (first, as the scheduler orders them) and prefill chunks,
        through the step's attention with and without the varlen kernel; `decode`: whether the decode
        rows go to the Triton decode kernel (its own trial's outcome) on both sides."""
        f, n, bs = self.f, self.chunk_tokens, self.block_size
        per_chunk = -(-n // bs)
        used = self.batch * self.per_row  # the decode rows' blocks come first in the cache
        chunk_tables = used + torch.arange(self.chunks * per_chunk).view(self.chunks, per_chunk)
        width = self.tables.shape[1]
        padded = torch.zeros(self.chunks, width, dtype=torch.long)
        padded[:, :per_chunk] = chunk_tables
        tables = torch.cat((self.tables, padded.to(self.device)))
        token = torch.arange(self.chunks * n, device=self.device)  # chunk i's tokens fill its own blocks
        chunk, position = token // n, token % n
        seat = self.batch + chunk
        slots = tables[seat, position // bs] * bs + position % bs
        rows = torch.arange(self.batch, device=self.device)
        meta = AttentionMetadata(
            tables,
            rows,
            rows,
            self.lens,
            0,
            int(self.lens.max()),
            tuple(PrefillChunk(self.batch + i * n, n, 0, self.batch + i) for i in range(self.chunks)),
        )
        tokens = self.batch + self.chunks * n
        q = self._randn(tokens, f.num_heads, f.head_dim)
        k = self._randn(tokens, f.num_kv_heads, f.head_dim)
        v = self._randn(tokens, f.num_kv_heads, f.head_dim)
        self.cache.write(0, slots, k[self.batch :], v[self.batch :])
        group = f.num_heads // f.num_kv_heads
        fast = CudaPagedAttention(CudaKernels(varlen=True, decode=decode), group=group)
        reference = CudaPagedAttention(CudaKernels(decode=decode), group=group)
        # Plans (per-step host work, copies included) made once: the timed calls are what a layer runs.
        fast_plan, reference_plan = fast.plan(meta, self.cache), reference.plan(meta, self.cache)
        return _trial(
            "varlen",
            lambda: fast(q, k, v, self.cache, 0, fast_plan, f.scale),
            lambda: reference(q, k, v, self.cache, 0, reference_plan, f.scale),
            self.device,
            self.dtype,
        )

    def argmax(self) -> Trial:
        from gpu.triton_kernels.argmax import greedy_argmax

        vocab = self.f.lm_head.out_features
        logits = torch.randn(self.batch, vocab, generator=self.floats, device=self.device)
        return _trial(
            "argmax", lambda: greedy_argmax(logits), lambda: logits.argmax(-1), self.device, self.dtype, True
        )

    def add_rms_norm(self) -> Trial:
        from gpu.triton_kernels.rms_norm import add_rms_norm

        f = self.f
        x, delta = self._randn(self.batch, f.embed.shape[1]), self._randn(self.batch, f.embed.shape[1])
        weight = f.final_norm
        return _trial(
            "add_rms_norm",
            lambda: add_rms_norm(x, delta, weight, f.eps)[0],
            lambda: rms_norm(x + delta, weight, f.eps),
            self.device,
            self.dtype,
        )

    def silu_mul(self) -> Trial:
        from gpu.triton_kernels.silu_mul import silu_mul

        if not self.f.silu:
            return Trial("silu_mul", False, None, None, "the model's activation is not SiLU")
        gate_up = self._randn(self.batch, 2 * self.f.layers[0].down.weight.shape[1])

        def reference() -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate) * up

        return _trial("silu_mul", lambda: silu_mul(gate_up), reference, self.device, self.dtype)

    def rope_write(self) -> Trial:
        from gpu.triton_kernels.rope_cache import TritonRopeCacheWrite

        f = self.f
        if not f.graph_safe:
            return Trial("rope_write", False, None, None, "RoPE depends on the batch")
        rows = f.num_heads + f.num_kv_heads
        qk = self._randn(self.batch, rows, f.head_dim)
        v = self._randn(self.batch, f.num_kv_heads, f.head_dim)
        positions = (self.lens - 1).clamp(max=f.max_positions - 1)
        slots = torch.arange(self.batch, device=self.device)
        kernel = TritonRopeCacheWrite()

        def fast() -> torch.Tensor:
            out = qk.clone()
            kernel(out, v, positions, f.rope_cos, f.rope_sin, self.cache, 0, slots)
            return out

        def reference() -> torch.Tensor:
            out = rotate(qk, f.rope_cos[positions][:, None], f.rope_sin[positions][:, None])
            self.cache.write(0, slots, out[:, f.num_heads :], v)
            return out

        return _trial("rope_write", fast, reference, self.device, self.dtype)
