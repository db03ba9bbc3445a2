"""Gold under LoRA: greedy engine output under an adapter equals HF + PEFT (`PeftModel` on the same weights)
token for token, fp32 on the CPU, with adapters made here (random A, non-zero random B, saved as PEFT saves
them): base rows and two adapters in one batch, every architecture, fused q|k|v (Phi-3), rsLoRA and
per-module ranks, the prefix cache, adapters swapped out of their slots and back in, and SmolLM2.
"""

from __future__ import annotations

import pytest

from gpu.cuda.graphs import DecodeGraphs
from gpu.engine_types import EngineRequest
from gpu.model import LoadedModel
from tests.gpu.factories import assert_matches_hf, greedy, hf_greedy, make_engine, make_model, make_prompts
from tests.gpu.lora_factories import lora_requests, make_adapter
from tests.gpu.test_cuda_path import RerunRecorder, cuda_path_engine
from tests.gpu.test_gold_architectures import ARCHITECTURES

LENS = [10, 12, 9, 7, 5, 11, 8, 6]


def check(engine, references: dict, requests: list[EngineRequest]) -> dict[str, list[int]]:
    got = engine.generate(requests)
    for request in requests:
        n = request.sampling.max_tokens
        assert_matches_hf(references[request.lora], request.prompt_token_ids, got[request.request_id], n)
    return got


def adapters(model: LoadedModel, tmp_path, count: int = 2, **config) -> tuple[list, dict]:
    made = [make_adapter(model, tmp_path, f"a{i}", seed=i + 1, **config) for i in range(count)]
    references = {None: model, **dict(made)}
    return [lora for lora, _ in made], references


def test_base_and_two_adapters_in_one_batch_match_peft(tmp_path):
    model = make_model()
    (a0, a1), references = adapters(model, tmp_path)
    loras = [None, a0, a1, a0, None, a1, a1, a0]
    requests = lora_requests(make_prompts(8, 1, 40), LENS, loras)
    engine = make_engine(model, max_loras=2)
    got = check(engine, references, requests)
    # the adapters change the output (else the test could not tell them from the base)
    for request in requests[1:4]:
        base = hf_greedy(model, request.prompt_token_ids, request.sampling.max_tokens)
        assert got[request.request_id] != base
    assert engine.stats().mean_batch_size > 4  # they ran together, not one adapter per step
    # every request released its adapter: base-only steps from now on run no LoRA code
    assert not engine.runner.lora.active
    engine.add_request(EngineRequest("base", requests[0].prompt_token_ids, greedy(2)))
    assert engine.runner.prepare(engine.scheduler.schedule(0.0), engine._seeds).lora is None


def test_rows_of_one_adapter_scattered_through_the_batch_match_peft(tmp_path):
    """Decodes of one adapter apart from each other (gathered, then added back by index) and prefill
    chunks of several adapters in one step."""
    model = make_model()
    (a0, a1), references = adapters(model, tmp_path, targets=("q_proj", "v_proj"))
    loras = [a0, None, a1, a0, a1, None, a0, a1]
    requests = lora_requests(make_prompts(8, 5, 40, seed=3), LENS, loras)
    check(make_engine(model, max_loras=2, max_num_batched_tokens=24), references, requests)


@pytest.mark.parametrize("arch", ["qwen3", "phi3-window", "gemma2", "gemma3_text", "mistral-window"])
def test_every_architecture_matches_peft(arch, tmp_path):
    model = make_model(seed=11, **ARCHITECTURES[arch])
    fused = ARCHITECTURES[arch]["arch"] == "phi3"  # Phi-3's checkpoint has q|k|v and gate|up fused
    targets = ("q_proj", "v_proj", "down_proj")
    if fused:
        targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    (a0, a1), references = adapters(model, tmp_path, targets=targets)
    loras = [a0, None, a1, a0, a1, None]
    requests = lora_requests(make_prompts(6, 1, 30, seed=5), LENS[:6], loras)
    check(make_engine(model, max_loras=2), references, requests)


def test_rslora_and_per_module_ranks_and_alphas_match_peft(tmp_path):
    model = make_model()
    a0, r0 = make_adapter(model, tmp_path, "rs", seed=3, r=8, alpha=4, use_rslora=True)
    a1, r1 = make_adapter(
        model, tmp_path, "patterns", seed=4, r=4, alpha=8,
        rank_pattern={"q_proj": 2, "down_proj": 6}, alpha_pattern={"v_proj": 3},
    )  # fmt: skip
    references = {None: model, a0: r0, a1: r1}
    requests = lora_requests(make_prompts(6, 2, 30, seed=6), LENS[:6], [a0, a1, None, a1, a0, a1])
    check(make_engine(model, max_loras=2), references, requests)


def test_the_same_prompt_under_two_adapters_shares_no_prefix_cache(tmp_path):
    """Each adapter's KV is its own: the second and third runs of one prompt must not reuse the first's."""
    model = make_model()
    (a0, a1), references = adapters(model, tmp_path)
    prompt = make_prompts(1, 40, 40, seed=7)[0]
    engine = make_engine(model, block_size=8, max_loras=2)
    for i, lora in enumerate([None, a0, a1, a0]):
        check(engine, references, [EngineRequest(f"p{i}", prompt, greedy(8), lora=lora)])
    assert engine.stats().prefix_cache_hits == 32  # the fourth reused the second's blocks, and only that


def test_adapters_swapped_out_of_their_slots_and_back_match_peft(tmp_path):
    """Three adapters over two device slots (the stacked, rank-padded layout the CUDA kernels read, with the
    torch reference on the CPU, through the CUDA step's decode graphs, captured and replayed as CUDA does
    it): adapters leave their slot and come back while the others run. A LoRA graph is captured the first
    time its bucket has adapter rows, over padding rows: the step that needed it must copy its inputs in
    after the capture, as for the SDPA path's graphs (tests/gpu/test_cuda_path.py)."""
    model = make_model()
    (a0, a1, a2), references = adapters(model, tmp_path, count=3, r=4)
    engine = cuda_path_engine(model, max_loras=2, max_num_seqs=4)
    runner = engine.runner
    step = runner.cuda_step
    holder: list[DecodeGraphs] = []
    recorder = RerunRecorder(holder)
    graphs = DecodeGraphs(
        step.forward, runner.cache, 4, runner.inputs.max_blocks, runner.num_blocks, step.kernels,
        recorder=recorder, lora_slots=runner.lora.slots,
    )  # fmt: skip
    holder.append(graphs)
    step.graphs = graphs
    graph_steps = []
    stage = graphs._stage_lora_meta
    graphs._stage_lora_meta = lambda *args: graph_steps.append(args) or stage(*args)
    loras = [a0, a1, a2, None, a2, a0, a1, a0]
    requests = lora_requests(make_prompts(8, 1, 30, seed=8), LENS, loras)
    check(engine, references, requests)
    assert runner.lora.slots.swaps >= 4  # every adapter came in, and at least one came back
    assert len(graph_steps) > 5  # decode steps with adapter rows went through the LoRA graphs
    assert graphs._lora_graphs and recorder.captures >= len(graphs._lora_graphs)


def test_a_bad_adapter_rejects_its_request_and_nothing_else(tmp_path):
    model = make_model()
    (a0,), references = adapters(model, tmp_path, count=1)
    (tmp_path / "broken").mkdir()
    from gpu.engine_types import LoraRequest

    broken = LoraRequest("broken", str(tmp_path / "broken"))
    engine = make_engine(model, max_loras=2)
    prompts = make_prompts(3, 3, 20, seed=9)
    requests = lora_requests(prompts, [6, 6, 6], [a0, broken, None])
    outs = {}
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    rejected = outs["r1"][-1]
    assert rejected.finish_reason.value == "rejected"
    assert rejected.detail == f"adapter 'broken' ({broken.path}): no adapter_config.json"
    for request in (requests[0], requests[2]):
        tokens = [t for out in outs[request.request_id] for t in out.new_token_ids]
        assert_matches_hf(references[request.lora], request.prompt_token_ids, tokens, 6)


@pytest.mark.slow
def test_smollm2_under_two_adapters_matches_peft(smollm2, tmp_path):
    (a0, a1), references = adapters(smollm2, tmp_path, r=16, alpha=32)
    texts = ("The three primary colours are", "def add(a, b):")
    prompts = [tuple(smollm2.tokenizer.encode(t)) for t in texts]
    loras = [None, a0, a1, a1]
    requests = lora_requests([prompts[0], prompts[0], prompts[1], prompts[0]], [8, 8, 8, 8], loras)
    check(make_engine(smollm2, max_loras=2), references, requests)
