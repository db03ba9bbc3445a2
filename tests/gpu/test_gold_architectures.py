"""Gold per architecture: greedy engine output equals HF generate token for token on small random-weight
checkpoints of every architecture in gpu/models, with prompts longer than their sliding windows, in a
continuous batch with other requests, through every CPU decode kernel, chunked prefill and the prefix cache.
"""

from __future__ import annotations

import pytest

from gpu.cpu.native_decode import NativeDecode
from gpu.models import Unsupported, architecture
from tests.gpu.factories import make_engine, make_model, make_prompts
from tests.gpu.test_gold import OUTPUT_LENS, native, run_and_check

WINDOW = 8
GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW)
LONGROPE = dict(
    rope_type="longrope",
    short_factor=[1.0 + 0.1 * i for i in range(8)],
    long_factor=[2.0 + 0.5 * i for i in range(8)],
    original_max_position_embeddings=32,
    rope_theta=10000.0,
)
ARCHITECTURES = {
    "mistral-window": dict(arch="mistral", sliding_window=WINDOW),
    "qwen2-window": dict(arch="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3": dict(arch="qwen3", head_dim=16),
    "qwen3-window": dict(
        arch="qwen3", head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "phi3-window": dict(arch="phi3", sliding_window=WINDOW),
    "phi3-longrope": dict(arch="phi3", rope_parameters=LONGROPE, max_position_embeddings=512),
    "phi4-partial-rotary": dict(
        arch="phi3", rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.75)
    ),
    "gemma3_text": dict(
        arch="gemma3_text",
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_local_base_freq=100.0,
        final_logit_softcapping=30.0,
        **GEMMA,
    ),
    "gemma2": dict(
        arch="gemma2", initializer_range=0.2, final_logit_softcapping=5.0, attn_logit_softcapping=1.0, **GEMMA
    ),
}
KERNELS = [
    pytest.param("native", marks=pytest.mark.skipif(NativeDecode.load() is None, reason="no C compiler")),
    "torch",
]


@pytest.fixture(params=list(ARCHITECTURES))
def model(request):
    return make_model(seed=11, **ARCHITECTURES[request.param])


def kernel_engine(model, kernel: str, **config):
    """An engine on the CPU kernels a case names ("native": the C decode attention and fused RoPE + cache
    write; "torch": neither), checked in use: not whatever start-up timing would have picked."""
    engine = make_engine(model, **native(kernel), **config)
    assert engine.runner.attention.decode == kernel
    assert (engine.runner.forward.rope_write is not None) == (kernel == "native")
    return engine


@pytest.mark.parametrize("kernel", KERNELS)
def test_architecture_matches_hf_in_a_mixed_batch(model, kernel):
    # Prompts of 9..30 tokens: all longer than the window; outputs run decoding well past it.
    # (longrope: prompts stay inside its 32-token original context, decoding goes past it.)
    prompts = make_prompts(6, WINDOW + 1, 30, seed=12)
    run_and_check(kernel_engine(model, kernel), model, prompts, OUTPUT_LENS[:6])


@pytest.mark.parametrize("kernel", KERNELS)
def test_windowed_chunked_prefill_and_prefix_cache_match_hf(kernel):
    """Chunks of 6 tokens (smaller than the window), then a second batch hitting the cached prefix."""
    for name in ("mistral-window", "gemma3_text"):
        model = make_model(seed=11, **ARCHITECTURES[name])
        shared = make_prompts(1, 24, 24, seed=13)[0]
        prompts = [shared + tail for tail in make_prompts(6, 1, 10, seed=14)]
        engine = kernel_engine(model, kernel, block_size=4, max_num_batched_tokens=6, max_num_seqs=6)
        run_and_check(engine, model, prompts[:3], [10, 5, 14], prefix="a")
        before = engine.stats().prefix_cache_hits
        stats = run_and_check(engine, model, prompts[3:], [6, 12, 4], prefix="b")
        assert stats.prefix_cache_hits - before >= 3 * 24 // 4 * 4
        assert stats.mean_batch_tokens <= 6


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["mistral-window", "phi3-window"])
def test_a_model_windowed_on_every_layer_serves_sequences_longer_than_its_cache(
    name, kernel, async_scheduling
):
    """Blocks behind the window are given back: 3 sequences of 60-84 tokens run together through a cache
    of 12 blocks of 4 tokens (48 tokens), chunked, with prefix caching, and still match HF (with async
    scheduling too, which gives blocks back as it advances a step, before the step's tokens are known)."""
    model = make_model(seed=11, **ARCHITECTURES[name])
    prompts = make_prompts(3, 30, 40, seed=15)
    engine = kernel_engine(
        model,
        kernel,
        block_size=4,
        num_blocks=12,
        max_num_batched_tokens=6,
        max_num_seqs=3,
        async_scheduling=async_scheduling,
    )
    assert engine.scheduler.kv.window == WINDOW
    run_and_check(engine, model, prompts, [30, 44, 36])
    assert engine.stats().kv_blocks_used == 0  # every block came back (none freed twice: the pool checks)


def test_a_model_with_any_full_attention_layer_keeps_every_block():
    engine = make_engine(make_model(seed=11, **ARCHITECTURES["gemma3_text"]))
    assert engine.scheduler.kv.window is None


def test_unsupported_features_are_refused_by_name():
    from transformers import AutoConfig

    cases = {
        "qwen3_moe": ("qwen3_moe", {}),
        "RoPE type 'dynamic'": (
            "gemma3_text",
            dict(rope_parameters=None, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        ),
        "bidirectional": ("gemma3_text", dict(use_bidirectional_attention=True)),
        "RoPE type 'mrope'": ("qwen3", dict(rope_parameters=dict(rope_type="mrope", rope_theta=1e4))),
    }
    for feature, (model_type, overrides) in cases.items():
        config = AutoConfig.for_model(model_type, **overrides)
        with pytest.raises(Unsupported, match=feature):
            architecture(config)


@pytest.mark.parametrize("name", ["qwen3-window", "phi3-longrope", "gemma3_text", "mistral-window"])
def test_saved_checkpoint_directory_loads_and_matches_hf(tmp_path, name):
    """What `inferq worker --model DIR` loads: a random-weight checkpoint saved by save_pretrained (no
    tokenizer files: the byte tokenizer), read back through gpu.model.load_model."""
    from gpu.model import load_model

    saved = make_model(seed=11, **ARCHITECTURES[name])
    saved.model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "float32", "cpu")
    assert type(loaded.model) is type(saved.model)
    # No tokenizer files: the byte tokenizer (transformers would build an empty one for Qwen3 and Gemma 3).
    assert loaded.tokenizer.encode("hi") == [1, ord("h") + 3, ord("i") + 3]
    prompts = make_prompts(4, WINDOW + 1, 30, seed=15)
    run_and_check(make_engine(loaded), loaded, prompts, [9, 3, 12, 6])


def test_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """A `gemma3` (multimodal) checkpoint: its vision tower is loaded but not run; text prompts match HF."""
    import torch
    from transformers import AutoModelForCausalLM, Gemma3Config

    from gpu.model import load_model

    text = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window_pattern=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **GEMMA,
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(16)
        AutoModelForCausalLM.from_config(
            Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
        ).save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), "float32", "cpu")
    assert loaded.config.model_type == "gemma3_text"
    assert loaded.config.layer_types[:2] == ["sliding_attention", "full_attention"]
    run_and_check(make_engine(loaded), loaded, make_prompts(4, WINDOW + 1, 30, seed=17), [9, 3, 12, 6])
