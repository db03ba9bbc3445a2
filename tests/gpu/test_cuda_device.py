"""The CUDA path on a real GPU (skipped without one; bench/device_check.sh runs these on an H200):
greedy equals HF on the device, decode graphs are captured (every batch bucket at start with the paged
kernel) and agree with eager steps, every Triton kernel agrees with its torch path in bfloat16 at start,
the KV cache is sized from device memory, bfloat16 is the default there."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu.engine import Engine, EngineConfig, EngineRequest
from gpu.model import LoadedModel
from tests.gpu.factories import make_model, make_prompts, make_requests
from tests.gpu.test_gold import OUTPUT_LENS, run_and_check

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="this machine has no CUDA device")


def on_cuda(model: LoadedModel, dtype: torch.dtype = torch.float32) -> LoadedModel:
    hf = copy.deepcopy(model.model).to(device="cuda", dtype=dtype).eval()
    return LoadedModel(hf, hf.config, model.tokenizer, torch.device("cuda"), dtype)


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # HF and the engine both in true fp32
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_greedy_matches_hf_on_cuda_with_graphs_captured():
    model = on_cuda(make_model())
    engine = Engine(model, EngineConfig(num_blocks=256))
    run_and_check(engine, model, make_prompts(8, 1, 60), OUTPUT_LENS)
    graphs = engine.runner.cuda_step.graphs
    assert graphs is not None and graphs.capture and graphs._graphs  # decode steps ran as graphs


def test_chunked_prefill_preemption_and_prefix_hits_match_hf_on_cuda():
    model = on_cuda(make_model())
    engine = Engine(
        model, EngineConfig(block_size=4, num_blocks=14, max_num_batched_tokens=16, max_num_seqs=16)
    )
    assert run_and_check(engine, model, make_prompts(5, 10, 20, seed=5), [20, 25, 15, 22, 18]).preemptions > 0
    shared = make_prompts(1, 40, 40, seed=3)[0]
    engine = Engine(model, EngineConfig(block_size=8, num_blocks=256))
    run_and_check(engine, model, [shared + t for t in make_prompts(3, 1, 12, seed=4)], [10, 5, 8], prefix="a")
    run_and_check(engine, model, [shared + t for t in make_prompts(3, 1, 12, seed=6)], [6, 9, 4], prefix="b")
    assert engine.stats().prefix_cache_hits > 0


def test_graph_replay_equals_eager_decode():
    model = on_cuda(make_model())
    prompts = make_prompts(6, 5, 30, seed=8)
    eager = Engine(model, EngineConfig(num_blocks=256))
    eager.runner.cuda_step.graphs = None  # every step eager
    graphed = Engine(model, EngineConfig(num_blocks=256))
    want = eager.generate(make_requests(prompts, [12] * 6))
    got = graphed.generate(make_requests(prompts, [12] * 6))
    assert got == want


def test_kv_cache_sized_from_device_memory_and_bf16_by_default():
    engine = Engine.from_options(None, device="cuda", max_num_seqs=16, max_num_batched_tokens=256)
    assert engine.model.dtype == torch.bfloat16
    plan = engine.runner.kv_plan
    free, total = torch.cuda.mem_get_info()
    assert "GPU memory" in plan.source and plan.num_blocks > 1000
    assert free >= 0.05 * total  # about 10% of the device is left for graphs and activations
    out = engine.generate(make_requests(make_prompts(4, 5, 40, vocab=32000), [16] * 4))
    assert all(len(tokens) == 16 for tokens in out.values())
    del engine
    torch.cuda.empty_cache()  # give the device back to later tests that size from free memory


def test_staging_buffers_are_pinned():
    engine = Engine(on_cuda(make_model()), EngineConfig(num_blocks=64))
    engine.generate(make_requests(make_prompts(2, 30, 40), [3, 3]))
    buffers = [b for slot in engine.runner.cuda_step.staging._slots for b in slot.values()]
    assert buffers and all(buffer.is_pinned() for buffer in buffers)


def test_penalties_bias_and_logprobs_on_cuda_equal_the_cpu():
    from scheduler.types import SamplingParams
    from tests.gpu.factories import make_engine
    from tests.gpu.test_penalties_logprobs import run

    cpu_model = make_model()
    prompts = make_prompts(4, 5, 30, seed=31)
    settings = [
        SamplingParams(max_tokens=12, logprobs=5),
        SamplingParams(max_tokens=12, presence_penalty=0.05, frequency_penalty=0.03, logprobs=1),
        SamplingParams(max_tokens=12, repetition_penalty=1.4),
        SamplingParams(max_tokens=12, logit_bias=((9, 0.05), (40, -1.0)), logprobs=0),
    ]
    requests = [EngineRequest(f"c{i}", p, s) for i, (p, s) in enumerate(zip(prompts, settings, strict=True))]
    on_device = run(Engine(on_cuda(cpu_model), EngineConfig(num_blocks=256)), requests)
    on_cpu = run(make_engine(cpu_model), requests)
    for request in requests:
        got, want = on_device[request.request_id], on_cpu[request.request_id]
        assert [t for t, _ in got] == [t for t, _ in want], request.request_id
        for (_, g), (_, w) in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if g is not None:
                assert abs(g.logprob - w.logprob) < 1e-4


def test_every_batch_bucket_captured_at_start_with_the_paged_kernel():
    engine = Engine(on_cuda(make_model()), EngineConfig(num_blocks=256, max_num_seqs=24))
    step = engine.runner.cuda_step
    graphs = step.graphs
    assert step.start_seconds > 0 and {t.name for t in step.trials} >= {"decode", "varlen", "argmax"}
    if not step.kernels.decode:
        pytest.skip(f"the SDPA decode path was measured faster here ({step.trials}): graphs are lazy")
    assert set(graphs._graphs) == {(b, graphs.tables.shape[1]) for b in (1, 2, 4, 8, 12, 16, 24)}
    before = len(graphs._graphs)
    run_and_check(engine, engine.model, make_prompts(8, 1, 60), OUTPUT_LENS)
    assert len(graphs._graphs) == before  # nothing captured mid-run


def test_sdpa_fallback_graphs_captured_mid_run_match_hf():
    """The decode graphs of the SDPA fallback (the Triton decode kernel not chosen: it failed, disagreed or
    was slower) are captured when a (batch, blocks) bucket first appears: the step that triggers a capture
    must decode its own rows, not the capture's padding (tests/gpu/test_cuda_path.py drives the order on
    the CPU)."""
    from gpu.cuda.kernels import CudaKernels
    from gpu.cuda.step import CudaStep
    from gpu.forward import LlamaForward

    model = on_cuda(make_model())
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=5, block_size=4))
    runner = engine.runner
    forward = LlamaForward(engine.model, runner.config.max_model_len)
    step = CudaStep(
        forward, runner.cache, 5, runner.inputs.max_blocks, runner.num_blocks, True, CudaKernels()
    )
    runner.cuda_step = step
    assert step.capture_graphs() >= 0 and not step.graphs._graphs and not step.graphs.paged
    run_and_check(engine, model, make_prompts(8, 1, 60), OUTPUT_LENS)
    assert len(step.graphs._graphs) > 3  # several (batch, blocks) buckets, each captured by a live step


def test_every_triton_kernel_agrees_with_torch_in_bfloat16_at_start():
    """The start-up trials in the device's default dtype, at a real model's proportions (GQA 8:2, head
    size 64): each kernel compiled, ran and agreed with its torch path; only speed decided the choice."""
    model = make_model(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024)
    engine = Engine(on_cuda(model, torch.bfloat16), EngineConfig(num_blocks=512, max_num_seqs=64))
    trials = engine.runner.cuda_step.trials
    assert [t.name for t in trials] == [
        "decode",
        "varlen",
        "argmax",
        "add_rms_norm",
        "rope_write",
        "silu_mul",
    ]
    assert all(t.reason in ("faster", "slower") for t in trials), trials
    out = engine.generate(make_requests(make_prompts(6, 5, 40), [12] * 6))
    assert all(len(tokens) == 12 for tokens in out.values())


def test_lora_adapters_match_peft_on_cuda_through_the_lora_graphs(tmp_path):
    """Three adapters over two slots with base rows, float32: greedy equals HF + PEFT on the device; decode
    steps with adapter rows replayed the LoRA graphs (Triton shrink/expand compiled)."""
    from tests.gpu.lora_factories import lora_requests
    from tests.gpu.test_gold_lora import adapters, check

    cpu_model = make_model()
    loras, references = adapters(cpu_model, tmp_path, count=3, r=8)
    model = on_cuda(cpu_model)
    references = {k: on_cuda(v) if k is not None else model for k, v in references.items()}
    engine = Engine(model, EngineConfig(num_blocks=256, max_loras=2, max_num_seqs=8))
    requests = lora_requests(
        make_prompts(8, 1, 40, seed=9), OUTPUT_LENS, [*loras, None, *loras, None, loras[0]]
    )
    check(engine, references, requests)
    graphs = engine.runner.cuda_step.graphs
    assert graphs._lora_graphs and engine.runner.lora.slots.swaps >= 3


def test_lora_graph_replay_equals_eager_steps_in_bfloat16(tmp_path):
    from tests.gpu.lora_factories import lora_requests
    from tests.gpu.test_gold_lora import adapters

    cpu_model = make_model()
    loras, _ = adapters(cpu_model, tmp_path, count=2, r=16)
    model = on_cuda(cpu_model, torch.bfloat16)
    prompts = make_prompts(6, 5, 30, seed=10)
    eager = Engine(model, EngineConfig(num_blocks=256, max_loras=2))
    eager.runner.cuda_step.graphs = None
    graphed = Engine(model, EngineConfig(num_blocks=256, max_loras=2))
    batch = [loras[0], None, loras[1], loras[1], None, loras[0]]
    want = eager.generate(lora_requests(prompts, [12] * 6, batch))
    assert graphed.generate(lora_requests(prompts, [12] * 6, batch)) == want
