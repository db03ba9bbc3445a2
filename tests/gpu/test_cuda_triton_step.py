"""The whole CUDA step with the Triton kernels, run on the CPU: the decode graphs' persistent inputs,
padding to the batch bucket and keying by batch alone, the paged decode kernel over block tables, the
argmax computed with the logits, the varlen kernel for prefill and mixed steps (chunked prefill, prefix
hits, preemption), and the fused add+RMSNorm, RoPE+cache write and SiLU*up in the forward. Graph capture
is off (capture=False: the same bodies, run eagerly on CPU tensors) and the kernels run in triton's
interpreter; on a GPU the same tests run compiled, on CUDA tensors, with the graphs captured. Greedy
output must equal HF's and the torch path's.
Also the kernel choice made at start: every kernel checked against its torch path, a wrong one refused.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gpu.cuda import choice as cuda_kernels
from gpu.cuda.kernels import CudaKernels
from gpu.cuda.step import CudaStep
from gpu.forward import LlamaForward
from gpu.model import LoadedModel
from tests.gpu.factories import make_engine, make_model, make_prompts, make_requests
from tests.gpu.test_cuda_path import cuda_path_engine
from tests.gpu.test_gold import OUTPUT_LENS, run_and_check
from tests.gpu.triton_interpreter import CUDA, DEVICE, import_kernels, interpreting

import_kernels("decode", "prefill", "argmax", "rms_norm", "rope_cache", "silu_mul", "lora")
TRITON = CudaKernels.all_triton()


@pytest.fixture(autouse=True, scope="module")
def interpreter():
    with interpreting():
        yield


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # HF and the engine both in true fp32 on a GPU
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def on_device(model: LoadedModel, dtype: torch.dtype = torch.float32) -> LoadedModel:
    if DEVICE.type == "cpu" and dtype == model.dtype:
        return model
    hf = copy.deepcopy(model.model).to(device=DEVICE, dtype=dtype).eval()
    return LoadedModel(hf, hf.config, model.tokenizer, DEVICE, dtype)


def triton_engine(model: LoadedModel, kernels: CudaKernels | None = TRITON, **config):
    """The CUDA step with the given kernels: on a GPU a real engine with its graphs captured, on the CPU
    the CUDA step's logic without capture (tests/gpu/test_cuda_path.py)."""
    if not CUDA:
        return cuda_path_engine(model, kernels, **config)
    engine = make_engine(on_device(model), **config)
    runner = engine.runner
    forward = LlamaForward(engine.model, runner.config.max_model_len)  # no kernels installed yet
    slots = runner.lora.slots if runner.lora is not None else None
    runner.cuda_step = CudaStep(
        forward, runner.cache, engine.config.max_num_seqs, runner.inputs.max_blocks, runner.num_blocks,
        True, kernels, slots,
    )  # fmt: skip
    runner.cuda_step.capture_graphs()
    return engine


def record_decode_steps(graphs) -> list[tuple[int, tuple[int, int]]]:
    """(rows, graph key) of every decode step; each step's in-graph argmax checked against its logits."""
    seen = []
    run = graphs.run

    def recording(
        staging, ids, positions, slots, lens, block_tables, seats, blocks, before_forward=None, **kw
    ):
        out = run(staging, ids, positions, slots, lens, block_tables, seats, blocks, before_forward, **kw)
        assert torch.equal(out.greedy, out.logits.argmax(dim=-1))
        seen.append((len(ids), graphs.key(len(ids), blocks)))
        return out

    graphs.run = recording
    return seen


def test_cuda_step_with_triton_kernels_matches_hf_and_the_torch_path():
    """With 5 seats (buckets 1, 2, 4, 5) sequences come and go, so the batch bucket changes mid-run and
    3-row steps run padded to 4; every decode step is keyed by its batch bucket alone."""
    model, max_num_seqs = make_model(), 5
    engine = triton_engine(model, max_num_seqs=max_num_seqs)
    step = engine.runner.cuda_step
    assert step.attention.kernels.varlen and step.forward.add_rms_norm is not None
    assert step.forward.silu_mul is not None and step.forward.rope_write is not None
    graphs = step.graphs
    assert graphs.paged and graphs.argmax and graphs.capture == CUDA
    steps = record_decode_steps(graphs)
    prompts = make_prompts(8, 1, 60)
    run_and_check(engine, model, prompts, OUTPUT_LENS)
    assert len(steps) > 10  # most steps were decode-only and went through the static buffers
    assert {key[1] for _, key in steps} == {graphs.tables.shape[1]}  # no block bucket: keyed by batch
    assert {key[0] for _, key in steps} <= set(graphs.batches)
    assert any(rows < key[0] for rows, key in steps)  # padding rows ran (and wrote only the trash block)
    torch_path = triton_engine(model, None, max_num_seqs=max_num_seqs)
    requests = make_requests(prompts, OUTPUT_LENS)
    assert engine.generate(make_requests(prompts, OUTPUT_LENS, "again")) == {
        f"again{k[1:]}": v for k, v in torch_path.generate(requests).items()
    }


def test_triton_cuda_step_with_chunked_prefill_preemption_and_prefix_hits():
    """The varlen kernel's cases: chunks resuming mid-prompt, prompts resumed after preemption, chunks
    after a prefix-cache hit, and mixed steps of decode rows and prefill chunks."""
    model = make_model()
    engine = triton_engine(model, block_size=4, num_blocks=14, max_num_batched_tokens=16)
    stats = run_and_check(engine, model, make_prompts(5, 10, 20, seed=5), [20, 25, 15, 22, 18])
    assert stats.preemptions > 0
    shared = make_prompts(1, 40, 40, seed=3)[0]
    engine = triton_engine(model, block_size=8)
    run_and_check(engine, model, [shared + t for t in make_prompts(3, 1, 12, seed=4)], [10, 5, 8], prefix="a")
    run_and_check(engine, model, [shared + t for t in make_prompts(3, 1, 12, seed=6)], [6, 9, 4], prefix="b")
    assert engine.stats().prefix_cache_hits > 0


def _forward() -> LlamaForward:
    return LlamaForward(on_device(make_model()), max_positions=128)


def test_kernel_choice_checks_each_kernel_against_torch_and_skips_fused_ones_in_float32():
    forward = _forward()
    kernels, trials = cuda_kernels.choose(forward, forward.kv_shape(4), 8, 10, allow_cpu=True)
    assert [t.name for t in trials] == ["decode", "varlen", "argmax"]  # fp32: no fused elementwise kernels
    for trial in trials:
        assert trial.reason in ("faster", "slower"), trial  # it ran, agreed with torch, and was timed
        assert trial.triton_ms > 0 and trial.torch_ms > 0
        assert getattr(kernels, trial.name) == trial.chosen == (trial.triton_ms < trial.torch_ms)
    assert not (kernels.add_rms_norm or kernels.rope_write or kernels.silu_mul)


def test_kernel_choice_refuses_a_kernel_that_disagrees_or_fails(monkeypatch):
    from gpu.cuda import choice

    forward = _forward()
    monkeypatch.setattr(choice, "paged_decode", lambda q, *args, **kw: torch.zeros_like(q))
    monkeypatch.setattr(cuda_kernels._Probe, "argmax", lambda self: cuda_kernels._trial(
        "argmax", lambda: 1 / 0, lambda: torch.zeros(1), self.device, self.dtype))  # fmt: skip
    kernels, trials = cuda_kernels.choose(forward, forward.kv_shape(4), 8, 10, allow_cpu=True)
    by_name = {t.name: t for t in trials}
    assert not kernels.decode and by_name["decode"].reason.startswith("disagrees")
    assert not kernels.argmax and by_name["argmax"].reason.startswith("failed: ZeroDivisionError")


def test_kernel_choice_in_half_precision_covers_the_fused_kernels():
    forward = LlamaForward(on_device(make_model(), torch.float16), 128)
    kernels, trials = cuda_kernels.choose(forward, forward.kv_shape(4), 8, 10, allow_cpu=True)
    assert [t.name for t in trials] == [
        "decode",
        "varlen",
        "argmax",
        "add_rms_norm",
        "rope_write",
        "silu_mul",
    ]
    assert all(t.reason in ("faster", "slower") for t in trials), trials


def test_async_scheduling_through_the_decode_graphs_fills_placeholders_on_the_device():
    """Async scheduling's placeholder tokens are filled in the graphs' static ids (before_forward) from the
    previous step's sampled tensor: greedy output stays HF's."""
    model = make_model()
    engine = triton_engine(model, max_num_seqs=4, async_scheduling=True)
    steps = record_decode_steps(engine.runner.cuda_step.graphs)
    run_and_check(engine, model, make_prompts(6, 1, 40, seed=7), [12, 20, 7, 16, 9, 14])
    assert len(steps) > 10


def test_lora_through_the_shrink_and_expand_kernels_matches_peft(tmp_path):
    """Adapters in the stacked slots applied by the Triton LoRA kernels, in the decode graphs' bodies and
    the eager mixed steps, with base rows in the same batches and three adapters over two slots."""
    from tests.gpu.lora_factories import lora_requests
    from tests.gpu.test_gold_lora import adapters, check

    model = make_model()
    (a0, a1, a2), references = adapters(model, tmp_path, count=3, r=4)
    engine = triton_engine(model, max_loras=2, max_num_seqs=4)
    step = engine.runner.cuda_step
    step.lora_kernels = step.graphs._lora_kernels = True  # on CPU tensors: in the interpreter
    loras = [a0, None, a1, a2, a0, None]
    requests = lora_requests(make_prompts(6, 1, 24, seed=12), [6, 5, 7, 4, 6, 5], loras)
    check(engine, references, requests)
    assert engine.runner.lora.slots.swaps >= 3
