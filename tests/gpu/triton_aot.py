"""`python -m tests.gpu.triton_aot`: every Triton kernel of the engine compiled ahead of time for the GPUs it
serves on (sm_90: H100/H200, sm_80: A100), in bf16 and fp16, at the attention shapes of the device check's
models and of docs/models.md's checkpoints, with their resource use checked against the hardware's limits.
No GPU is needed: Triton compiles for a named target, and its wheel ships ptxas.

What gets compiled is what the engine would launch: each kernel's host wrapper (gpu/triton_kernels/*) is
called as the engine calls it, on `meta` tensors laid out as the forward lays them out (q a strided view of
the fused projection, a KV cache as large as a device's, persistent block tables), with the launch replaced
by Triton's own argument binder for the target. So constexprs, dtypes, integer widths and alignment
specialisations come from the wrappers themselves, and a tile size or head-dim rule changed there is
compiled here. Distinct variants are compiled once each, in parallel processes, into a fresh cache
directory (nothing cached between runs: a cache could hide a kernel that no longer compiles).

Checked per variant: the compile succeeds; registers <= 255 a thread and <= 65,536 a block; shared memory
(Triton's dynamic + ptxas's static) within the target's per-block limit; no register spills. Run it in a
process whose `triton` is the device image's version (tests/gpu/test_triton_aot.py puts a pinned Triton 3.6
first on sys.path): a kernel written against a newer Triton's language fails here, not on the device.

Exit status 0 when every variant compiled within the limits; the JSON (--json) holds every variant's
numbers, and the table printed at the end the worst of each kernel.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

# Per-block limits of each target (CUDA C Programming Guide, compute capabilities table): registers a
# thread, registers a block (the whole SM's file), shared memory a block with the opt-in carve-out.
LIMITS = {
    90: dict(regs_per_thread=255, regs_per_block=65536, smem_per_block=227 * 1024),  # H100/H200
    80: dict(regs_per_thread=255, regs_per_block=65536, smem_per_block=163 * 1024),  # A100
}
DTYPES = ("bfloat16", "float16")
DEVICE_DEFAULT = (90, "bfloat16")  # the lent machines' target and the engine's dtype on CUDA
BLOCK_SIZE = 16  # the engine's default KV block size (EngineConfig.block_size)
MAX_SEQS, MAX_MODEL_LEN = 256, 8192  # the decode graphs' widest batch; a long context's block-table width
# KV blocks of one layer: a device's usual cache (per-head strides under 2^31 elements: 32-bit stride
# arguments), and one past that (64-bit strides: a cache filling most of an H200 for a model of few layers,
# the int64 offsets of tests/gpu/test_triton_offsets.py), compiled for one shape.
CACHE_BLOCKS, HUGE_CACHE_BLOCKS = 1 << 16, 1 << 22
HUGE_CACHE_SHAPE = "llama-3-8b"


@dataclass(frozen=True)
class Shape:
    """What a model's attention, norms and MLP give the kernels."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    window: int | None = None  # sliding window on (some or every) layer
    every_layer_windowed: bool = False
    softcap: float | None = None  # Gemma 2's attention logit soft-capping
    qk_norm: bool = False  # q and k normed per head (Qwen3, Gemma 3): qk is then a contiguous copy
    silu: bool = True  # SiLU MLP (the fused SiLU*up kernel); Gemma's GeGLU has none


# The device check's three shapes (bench/device/models.py) and one checkpoint per architecture and GQA group
# of docs/models.md: head sizes 64, 96, 128, 256; groups 1 to 8.
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape(9, 3, 64, 576, 1536, 49152),
    "llama-1.1b": Shape(32, 4, 64, 2048, 5632, 32000),
    "llama-3-8b": Shape(32, 8, 128, 4096, 14336, 128256),
    "smollm2-1.7b": Shape(32, 32, 64, 2048, 8192, 49152),  # GQA 1
    "qwen3-0.6b": Shape(16, 8, 128, 1024, 3072, 151936, qk_norm=True),  # GQA 2
    "qwen2.5-14b": Shape(40, 8, 128, 5120, 13824, 152064),  # GQA 5
    "qwen2.5-1.5b": Shape(12, 2, 128, 1536, 8960, 151936),  # GQA 6
    "qwen2.5-7b": Shape(28, 4, 128, 3584, 18944, 152064),  # GQA 7
    "mistral-7b-v0.1": Shape(32, 8, 128, 4096, 14336, 32000, 4096, every_layer_windowed=True),
    "phi-3-mini-4k": Shape(32, 32, 96, 3072, 8192, 32064, 2047, every_layer_windowed=True),
    "gemma-2-2b": Shape(8, 4, 256, 2304, 9216, 256000, 4096, softcap=50.0, silu=False),
    "gemma-3-270m": Shape(4, 1, 256, 640, 2048, 262144, 512, qk_norm=True, silu=False),
}
# Every shape is compiled for the device's default (DEVICE_DEFAULT); the other targets and dtypes at the
# device check's shapes and one shape of each other head size (96 with a window, 256 with soft-capping),
# which covers every tile configuration and every constexpr but the GQA group, at a third of the cost.
CORE = ("smollm2-135m", "llama-1.1b", "llama-3-8b", "phi-3-mini-4k", "gemma-2-2b")


@dataclass
class Variant:
    """One compilation: a kernel with its signature, constexprs, alignment attributes and options."""

    kernel: str  # module.function
    target: int
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]
    seen_in: list[str] = field(default_factory=list)  # "shape/dtype" that launch it

    def key(self) -> str:
        return repr((self.kernel, self.target, self.signature, sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.items())))  # fmt: skip

    def describe(self) -> str:
        names = list(self.signature)
        consts = {names[path[0]]: value for path, value in sorted(self.constexprs.items())}
        wide = [n for n, t in self.signature.items() if t == "i64"]
        extra = f" i64={','.join(wide)}" if wide else ""
        return f"{self.kernel} sm_{self.target} {consts} warps={self.options.get('num_warps')}{extra}"


class Recorder:
    """Stands in for every Triton launch: binds the launch's arguments as Triton would for `target` and
    records the compilation it would need, launching nothing."""

    def __init__(self) -> None:
        self.variants: dict[str, Variant] = {}
        self.label = ""
        self._backends: dict[int, Any] = {}
        self._binders: dict[tuple[int, int], Callable[..., Any]] = {}
        self.target = 90

    @contextlib.contextmanager
    def installed(self) -> Iterator[Recorder]:
        from triton.runtime.jit import JITFunction

        recorder, original = self, JITFunction.run

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            recorder.record(self, args, kwargs)

        JITFunction.run = run
        try:
            yield self
        finally:
            JITFunction.run = original

    def record(self, kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        backend = self._backends.get(self.target)
        if backend is None:
            backend = self._backends[self.target] = make_backend(GPUTarget("cuda", self.target, 32))
        binder = self._binders.get((id(kernel), self.target))
        if binder is None:
            binder = create_function_from_signature(kernel.signature, kernel.params, backend)
            self._binders[(id(kernel), self.target)] = binder
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options
        )
        name = f"{kernel.fn.__module__}.{kernel.fn.__name__}"
        variant = Variant(name, self.target, signature, constexprs, attrs, dict(options.__dict__))
        variant = self.variants.setdefault(variant.key(), variant)
        if self.label not in variant.seen_in:
            variant.seen_in.append(self.label)


def _meta(*shape: int, dtype: Any) -> Any:
    import torch

    return torch.empty(shape, dtype=dtype, device="meta")


def launch_all(
    shape: Shape, dtype_name: str, cache_blocks: int = CACHE_BLOCKS, other_sizes: bool = False
) -> None:
    """Call every kernel wrapper as the engine does for a model of this shape (gpu/forward.py's layouts).
    other_sizes: steps of other sizes (row and chunk counts odd instead of even, tile counts a multiple of
    16 or not), which must need no other compilation: serving never compiles mid-run."""
    import torch

    from gpu.attention.metadata import AttentionMetadata, PrefillChunk
    from gpu.cuda.attention import CudaPagedAttention
    from gpu.cuda.kernels import CudaKernels
    from gpu.kv_cache import KVCache, KVShape
    from gpu.triton_kernels import argmax, decode, lora, rms_norm, rope_cache, silu_mul

    dtype = getattr(torch, dtype_name)
    long = torch.int64
    h, kv, d = shape.heads, shape.kv_heads, shape.head_dim
    max_blocks = MAX_MODEL_LEN // BLOCK_SIZE
    cache = KVCache(KVShape(1, kv, d, BLOCK_SIZE, dtype), cache_blocks, torch.device("meta"))
    cache_k, cache_v = cache.k[0], cache.v[0]
    tables = _meta(MAX_SEQS, max_blocks, dtype=long)
    windows = (
        [shape.window] if shape.every_layer_windowed else [None, shape.window] if shape.window else [None]
    )

    def qkv(tokens: int) -> tuple[Any, Any, Any]:
        """q, qk and v as the forward has them: views of the fused projection (or of qk's normed copy)."""
        fused = _meta(tokens, (h + 2 * kv) * d, dtype=dtype)
        qk = fused[:, : (h + kv) * d].view(tokens, h + kv, d)
        v = fused[:, (h + kv) * d :].view(tokens, kv, d)
        if shape.qk_norm:
            qk = _meta(tokens, h + kv, d, dtype=dtype)
        return qk[:, :h], qk, v

    scale = d**-0.5
    options = [dict(window=w, softcap=shape.softcap) for w in windows]
    for option in options:
        # Decode graphs (gpu/cuda/graphs.py): batch buckets, rows reading the graph's own table rows up
        # to its width, the lengths a row of its [4, batch] static inputs; a small batch splits its context.
        for batch in (1, 12, MAX_SEQS) if not other_sizes else (2, 23, MAX_SEQS):
            q, _, _ = qkv(batch)
            lens = _meta(4, batch + batch % 2, dtype=long)[3, :batch]
            decode.paged_decode_attention(q, cache_k, cache_v, tables[:batch], lens, scale, **option)
    # Eager steps (gpu/cuda/attention.py), with each choice of kernels the engine may make: a mixed step
    # (decode rows, then prefill chunks of every length) and a decode-only step.
    n = 9 if other_sizes else 8
    rows = torch.arange(n)
    lengths = (1000, 17, 2, 33) if other_sizes else (1000, 17, 2)  # tiles: a multiple of 16 or not
    chunks, row = [], n
    for i, length in enumerate(lengths):
        chunks.append(PrefillChunk(row, length, 40 * i, n + i))
        row += length
    steps = (
        AttentionMetadata(tables, rows, rows, rows + 100, 0, 100 + n, tuple(chunks)),
        AttentionMetadata(tables, rows, rows, rows + 3000, 0, 3000 + n, ()),
    )
    for kernels in (
        CudaKernels(varlen=True, decode=True),
        CudaKernels(varlen=True),
        CudaKernels(decode=True),
    ):
        attention = CudaPagedAttention(kernels, group=h // kv)
        for step in steps:
            step = _to_meta(step)
            tokens = step.num_decodes + sum(c.num_tokens for c in step.prefills)
            q, _, v = qkv(tokens)
            plan = attention.plan(step, cache)
            if kernels.varlen or not step.prefills:  # (the SDPA prefill path runs no Triton kernel)
                for option in options:
                    attention(q, v, v, cache, 0, plan, scale, **option)
    for tokens in (1, 2048):  # a decode step's rows and a prefill step's tokens
        _, qk, v = qkv(tokens)
        cos = _meta(MAX_MODEL_LEN, d, dtype=dtype)
        positions, slots = _meta(tokens, dtype=long), _meta(tokens, dtype=long)
        rope_cache.rope_cache_write(qk, v, positions, cos, cos, cache_k, cache_v, slots)
        x = _meta(tokens, shape.hidden, dtype=dtype)
        weight = _meta(shape.hidden, dtype=dtype)
        rms_norm.add_rms_norm(x, None, weight, 1e-6)
        rms_norm.add_rms_norm(x, _meta(tokens, shape.hidden, dtype=dtype), weight, 1e-6)
        if shape.silu:
            silu_mul.silu_mul(_meta(tokens, 2 * shape.intermediate, dtype=dtype))
    argmax.greedy_argmax(_meta(MAX_SEQS, shape.vocab, dtype=torch.float32))
    # LoRA (gpu/lora/slots.py's SlotLora): shrink and expand of each adapted product, at the default slots and
    # rank (EngineConfig.max_loras, max_lora_rank); a step's row count sizes the grid alone
    slots_n, rank = 4, 16
    products = (
        (shape.hidden, (h + 2 * kv) * d),  # qkv
        (h * d, shape.hidden),  # o
        (shape.hidden, 2 * shape.intermediate),  # gate_up
        (shape.intermediate, shape.hidden),  # down
    )
    lora_meta = _meta(2 * slots_n + MAX_SEQS, dtype=long)
    for width_in, width_out in products:
        x, out = _meta(MAX_SEQS, width_in, dtype=dtype), _meta(MAX_SEQS, width_out, dtype=dtype)
        y = lora.lora_shrink(x, _meta(slots_n, rank, width_in, dtype=dtype), lora_meta, MAX_SEQS)
        lora.lora_expand(y, _meta(slots_n, width_out, rank, dtype=dtype), out, lora_meta, MAX_SEQS)


def _to_meta(meta: Any) -> Any:
    """The metadata's device tensors on the meta device (the prefill chunks' numbers stay host values)."""
    import dataclasses

    fields = ("block_tables", "decode_rows", "decode_seats", "decode_lens")
    return dataclasses.replace(meta, **{f: getattr(meta, f).to("meta") for f in fields})


def collect(
    shapes: dict[str, Shape],
    dtypes: tuple[str, ...],
    targets: tuple[int, ...],
    everything: bool = False,
    other_sizes: bool = False,
) -> list[Variant]:
    """The distinct compilations of every shape at the device's default, and of the CORE shapes at the
    other targets and dtypes (every shape at every one: `everything`)."""
    recorder = Recorder()
    with recorder.installed():
        for target in targets:
            recorder.target = target
            for name, shape in shapes.items():
                for dtype in dtypes:
                    if not (everything or (target, dtype) == DEVICE_DEFAULT or name in CORE):
                        continue
                    recorder.label = f"{name}/{dtype}"
                    launch_all(shape, dtype, other_sizes=other_sizes)
                    if name == HUGE_CACHE_SHAPE and (target, dtype) == DEVICE_DEFAULT:
                        recorder.label = f"{name}/{dtype}/64-bit strides"
                        launch_all(shape, dtype, HUGE_CACHE_BLOCKS, other_sizes)
    return list(recorder.variants.values())


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_VARIANTS: list[Variant] = []  # filled before the worker processes fork


def compile_variant(index: int) -> dict[str, Any]:
    """Compile one variant (in a worker process); its resource use from ptxas's report and the metadata."""
    import importlib

    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    variant = _VARIANTS[index]
    module, _, function = variant.kernel.rpartition(".")
    kernel = getattr(importlib.import_module(module), function)
    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed: registers, spills, static smem
    log = io.StringIO()
    start = time.perf_counter()
    result: dict[str, Any] = {"variant": variant.describe(), "seen_in": variant.seen_in}
    try:
        with contextlib.redirect_stdout(log):
            source = ASTSource(kernel, variant.signature, variant.constexprs, variant.attrs)
            compiled = triton.compile(
                source, target=GPUTarget("cuda", variant.target, 32), options=variant.options
            )
    except Exception as error:  # noqa: BLE001 - reported with the variant, the run fails
        result["error"] = f"{type(error).__name__}: {error}"[-3000:]
        return result
    report = log.getvalue()
    regs, smem, spills = _PTXAS_REGS.search(report), _PTXAS_SMEM.search(report), _PTXAS_SPILLS.search(report)
    warps = compiled.metadata.num_warps
    result.update(
        seconds=round(time.perf_counter() - start, 2),
        registers=int(regs.group(1)) if regs else None,
        threads=warps * 32,
        shared=compiled.metadata.shared + (int(smem.group(1)) if smem else 0),
        spill_bytes=sum(map(int, spills.groups())) if spills else None,
        cubin_bytes=len(compiled.asm["cubin"]),
    )
    result["problems"] = problems(result, variant.target)
    return result


def problems(result: dict[str, Any], target: int) -> list[str]:
    limits, found = LIMITS[target], []
    regs, threads = result["registers"], result["threads"]
    if regs is None or result["spill_bytes"] is None:
        found.append("ptxas reported no register or spill counts")
        return found
    if regs > limits["regs_per_thread"]:
        found.append(f"{regs} registers a thread > {limits['regs_per_thread']}")
    if regs * threads > limits["regs_per_block"]:
        found.append(f"{regs} x {threads} threads = {regs * threads} registers > {limits['regs_per_block']}")
    if result["shared"] > limits["smem_per_block"]:
        found.append(f"{result['shared']} bytes of shared memory > {limits['smem_per_block']}")
    if result["spill_bytes"]:
        found.append(f"{result['spill_bytes']} bytes of register spills")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.triton_aot", description=__doc__)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--targets", default="90,80")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--everything", action="store_true", help="every shape at every target and dtype")
    parser.add_argument("--list", action="store_true", help="print the variants and exit")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # A fresh cache: every variant compiled now, by this Triton (set before triton is imported).
    cache = tempfile.TemporaryDirectory(prefix="inferq-triton-aot-")
    os.environ["TRITON_CACHE_DIR"] = cache.name
    import triton

    shapes = {n: SHAPES[n] for n in args.shapes.split(",")}
    targets = tuple(int(t) for t in args.targets.split(","))
    start = time.perf_counter()
    dtypes = tuple(args.dtypes.split(","))
    _VARIANTS[:] = collect(shapes, dtypes, targets, args.everything)
    others = {v.key(): v for v in collect(shapes, dtypes, targets, args.everything, other_sizes=True)}
    mid_run = [v.describe() for k, v in others.items() if k not in {u.key() for u in _VARIANTS}]
    for variant in mid_run:  # a step of another size would compile this while serving
        print(f"FAILED: steps of other sizes need another compilation: {variant}")
    print(f"triton {triton.__version__}: {len(_VARIANTS)} distinct compilations for {len(shapes)} shapes, "
          f"targets {targets}, dtypes {args.dtypes} (collected in {time.perf_counter() - start:.1f} s)",
          flush=True)  # fmt: skip
    if args.list:
        print("\n".join(v.describe() for v in _VARIANTS))
        return 1 if mid_run else 0
    import multiprocessing

    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(compile_variant, range(len(_VARIANTS))))
    wall = time.perf_counter() - start
    failed = [r for r in results if r.get("error") or r.get("problems")]
    for r in failed:
        print(f"FAILED {r['variant']} (in {', '.join(r['seen_in'][:4])}): {r.get('error') or r['problems']}")
    print(_table(results))
    compile_s = sum(r.get("seconds", 0) for r in results)
    print(f"{len(results)} compiled in {wall:.1f} s wall ({compile_s:.0f} s of compiles, {args.jobs} jobs), "
          f"{len(failed)} failed")  # fmt: skip
    if args.json:
        with open(args.json, "w") as out:
            summary = {"triton": triton.__version__, "wall_s": wall, "mid_run": mid_run, "results": results}
            json.dump(summary, out, indent=1)
    cache.cleanup()
    return 1 if failed or mid_run or not results else 0


def _table(results: list[dict[str, Any]]) -> str:
    """Per kernel and target: variants, and the most registers, shared memory and compile time of any."""
    worst: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        if "registers" not in r:
            continue
        kernel, target = r["variant"].split(" ")[:2]
        row = worst.setdefault((kernel, target), dict(n=0, registers=0, shared=0, seconds=0.0))
        row["n"] += 1
        for k in ("registers", "shared", "seconds"):
            row[k] = max(row[k], r[k] or 0)
    lines = [
        "| kernel | target | variants | max registers | max shared B | slowest compile s |",
        "|---" * 6 + "|",
    ]
    for (kernel, target), row in sorted(worst.items()):
        lines.append(
            f"| {kernel.rsplit('.', 1)[-1]} | {target} | {row['n']} | {row['registers']} | {row['shared']} | "
            f"{row['seconds']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
