"""Kernel launches of the CUDA step's eager (prefill and mixed) steps, counted on the CPU, per layer.

A decode step is one graph replay; prefill and mixed steps run eagerly, and each operator or Triton kernel
they launch costs the host a launch (5-20 us on CUDA) whatever its size, so their count per layer bounds
how launch-lean those steps are. Counted here without a GPU: the real CUDA step (gpu/cuda/step.py, its
graphs off) runs on CPU tensors under torch's profiler, every device-kernel-launching operator counted
(view and allocation operators launch nothing and are left out; a matmul or SDPA call is one launch, as on
CUDA, whatever the CPU splits it into), and every Triton launch counted and
skipped instead of run (so its outputs are garbage: only the counts are read). Per layer: the step's count
less that of the same step through no layers (embedding, final norm, lm_head), over the layer count.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

# Operators that launch no device kernel: views, metadata and allocations.
NO_LAUNCH = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::slice", "aten::select", "aten::unbind",
    "aten::split", "aten::split_with_sizes", "aten::as_strided", "aten::t", "aten::transpose",
    "aten::expand", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias",
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::resize_", "aten::lift_fresh",
    "aten::chunk", "aten::narrow", "aten::contiguous", "aten::to", "aten::_to_copy", "aten::numpy_T",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::result_type", "aten::resolve_conj",
    "aten::resolve_neg", "aten::detach_",
}  # fmt: skip
# Operators that are one launch on CUDA whatever the CPU decomposes them into (cuBLAS, SDPA's kernels).
ONE_LAUNCH = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
}  # fmt: skip
KERNEL_SETS = ("torch", "triton")
# Steps counted: a prefill step (4 prompts of 256 tokens) and a mixed one (32 decode rows beside a chunk).
PREFILL = dict(prompts=4, prompt_len=256)
MIXED = dict(decodes=32, prompt_len=16, chunk=512)


@dataclasses.dataclass(frozen=True)
class Launches:
    step: str  # "prefill" | "mixed"
    kernels: str  # "torch" | "triton"
    per_step: int
    per_layer: float
    top: tuple[tuple[str, int], ...]  # the most launched operators and kernels of the step


@contextlib.contextmanager
def _triton_counted(counts: Counter[str]) -> Iterator[None]:
    """Every Triton launch counted and skipped, compiled or interpreted (TRITON_INTERPRET=1, as the tests
    set it on a machine without CUDA: the interpreter would run each kernel's body as torch operations,
    which the profiler would count as launches)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        counts[f"triton:{self.fn.__name__}"] += 1

    for cls in originals:
        cls.run = run
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.run = original


def _count(run: Any) -> Counter[str]:
    from torch.profiler import ProfilerActivity, profile

    counts: Counter[str] = Counter()
    with _triton_counted(counts), torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        run()

    def walk(event: Any) -> None:
        if event.name in ONE_LAUNCH or (
            event.name.startswith("aten::") and not event.cpu_children and event.name not in NO_LAUNCH
        ):
            counts[event.name] += 1
            return
        for child in event.cpu_children:
            walk(child)

    for event in prof.events():
        if event.cpu_parent is None:
            walk(event)
    return counts


def _engine(model: str, kernels: str) -> Any:
    from gpu.cuda.kernels import CudaKernels
    from gpu.cuda.step import CudaStep
    from gpu.engine import Engine, EngineConfig
    from gpu.forward import LlamaForward
    from gpu.kv_cache import KVCache
    from gpu.model import load_model

    loaded = load_model(model, "float32", "cpu", seed=0)
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, num_blocks=1024)
    engine = Engine(loaded, config)
    runner = engine.runner
    cache = KVCache(runner.cache.shape, runner.num_blocks + 1, torch.device("cpu"))  # + the trash block
    runner.cache = cache
    forward = LlamaForward(loaded, runner.config.max_model_len, packed=False)  # plain F.linear, as on CUDA
    # Triton: every kernel, as the choice makes it in bf16 on a GPU (the fused ones too)
    chosen = CudaKernels.all_triton() if kernels == "triton" else CudaKernels.torch_only()
    seats, blocks = config.max_num_seqs, runner.inputs.max_blocks
    runner.inputs.device_tables = True  # the block table kept on the device's side, as on CUDA
    runner.cuda_step = CudaStep(forward, cache, seats, blocks, runner.num_blocks, False, chosen)
    runner.cuda_step.graphs = None  # every step eager: the steps counted here never replay a graph
    return engine


def count_launches(model: str) -> list[Launches]:
    """Launches of a prefill and a mixed step through the CUDA step, with torch's paths and with the
    Triton kernels."""
    from gpu import triton_kernels

    results = []
    for kernels in KERNEL_SETS if triton_kernels.importable() else KERNEL_SETS[:1]:
        with _triton_counted(Counter()):  # the steps before the counted ones launch Triton kernels too
            results += _count_engine(model, kernels)
    return results


def _count_engine(model: str, kernels: str) -> list[Launches]:
    from gpu.engine import EngineRequest
    from scheduler.types import SamplingParams

    engine = _engine(model, kernels)
    step, vocab = engine.runner.cuda_step, engine.model.config.vocab_size
    steps: dict[str, Any] = {}  # the first prefill-only and the first mixed step's inputs
    run = step.run

    def capture(inputs: Any, before_forward: Any = None, lora_meta: Any = None) -> Any:
        meta = inputs.attention
        kind = "mixed" if meta.num_decodes and meta.prefills else "prefill" if meta.prefills else None
        if kind is not None:
            steps.setdefault(kind, inputs)
        return run(inputs, before_forward, lora_meta)

    step.run = capture
    never_stop = SamplingParams(max_tokens=64, ignore_eos=True)

    def add(name: str, length: int) -> None:
        tokens = tuple((7 * len(name) + 13 * j) % (vocab - 3) + 3 for j in range(length))
        engine.add_request(EngineRequest(name, tokens, never_stop))

    for i in range(PREFILL["prompts"]):
        add(f"p{i}", PREFILL["prompt_len"])
    engine.step()  # the prefill step
    for i in range(MIXED["decodes"] - PREFILL["prompts"]):
        add(f"d{i}", MIXED["prompt_len"])
    for _ in range(3):  # every row decoding
        engine.step()
    add("chunk", MIXED["chunk"])
    engine.step()  # the mixed step
    del step.run
    results, layers = [], step.forward.layers
    for kind in ("prefill", "mixed"):
        inputs = steps[kind]
        counts = _count(lambda inputs=inputs: step.run(inputs))
        step.forward.layers = []
        outside = sum(_count(lambda inputs=inputs: step.run(inputs)).values())
        step.forward.layers = layers
        total = sum(counts.values())
        per_layer = (total - outside) / len(layers)
        results.append(Launches(kind, kernels, total, per_layer, tuple(counts.most_common(8))))
    engine.close()
    return results


def render(results: list[Launches]) -> str:
    from bench.report import format_table

    rows = [[r.step, r.kernels, r.per_step, r.per_layer] for r in results]
    table = format_table(["step", "kernels", "launches/step", "launches/layer"], rows, digits=1)
    note = (
        f"eager CUDA steps counted on the CPU (torch profiler + Triton launches): prefill = "
        f"{PREFILL['prompts']} prompts x {PREFILL['prompt_len']} tokens, mixed = {MIXED['decodes']} decode "
        f"rows + a {MIXED['chunk']}-token chunk; per layer: less the same step through no layers"
    )
    top = [f"{r.step}/{r.kernels}: " + ", ".join(f"{n} {c}" for n, c in r.top) for r in results]
    return table + "\n" + note + "\n" + "\n".join(top)
