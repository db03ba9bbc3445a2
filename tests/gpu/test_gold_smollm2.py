"""Gold on the real weights: greedy engine output equals HF generate on SmolLM2, token for token.

Chat prompts go through the model's chat template, plain prompts through encode; the tolerance rule of
test_gold applies (a divergence only at a verified near-tie). Outputs are short to keep CPU time low.
"""

from __future__ import annotations

import pytest

from gpu.engine import EngineRequest
from tests.gpu.factories import assert_matches_hf, greedy, make_engine

pytestmark = pytest.mark.slow

QUESTIONS = (
    "Explain continuous batching in one sentence.",
    "What is the capital of France?",
    "Write a haiku about message queues.",
    "Give me two tips for writing clear emails.",
)
PLAIN = ("The three primary colours are", "def fibonacci(n):\n")
LONG = (
    "Kafka is a distributed log. Producers append records to partitions of a topic, and consumers in a "
    "group share those partitions, each reading its own at its own pace and committing offsets. Summary:"
)


def chat(model, question: str) -> tuple[int, ...]:
    return tuple(model.tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def plain(model, text: str) -> tuple[int, ...]:
    return tuple(model.tokenizer.encode(text))


def run(engine, waves):
    """Add each wave after the given number of steps; every request's outputs, in order."""
    outs: dict[str, list] = {}
    step = 0
    for after, requests in waves:
        while step < after and engine.has_unfinished():
            for out in engine.step():
                outs.setdefault(out.request_id, []).append(out)
            step += 1
        for request in requests:
            engine.add_request(request)
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def check(model, requests, outs):
    for r in requests:
        tokens = [t for o in outs[r.request_id] for t in o.new_token_ids]
        assert_matches_hf(model, r.prompt_token_ids, tokens, r.sampling.max_tokens)
        text = "".join(o.text_delta for o in outs[r.request_id])
        assert text == model.tokenizer.decode(tokens)  # EOS decodes to nothing: it is a special token


def test_chat_and_plain_prompts_match_hf(smollm2):
    prompts = [chat(smollm2, q) for q in QUESTIONS[:3]] + [plain(smollm2, p) for p in PLAIN]
    lens = [32, 20, 28, 24, 24]
    requests = [
        EngineRequest(f"p{i}", p, greedy(n)) for i, (p, n) in enumerate(zip(prompts, lens, strict=True))
    ]
    outs = run(make_engine(smollm2, fused_rope=True), [(0, requests)])
    check(smollm2, requests, outs)
    answer = "".join(o.text_delta for o in outs["p0"])
    assert answer.startswith("Continuous batching is")  # real English, not noise


def test_one_batch_with_chunked_prefill_a_prefix_hit_and_a_preemption_matches_hf(smollm2):
    first = [
        EngineRequest(f"a{i}", chat(smollm2, q), greedy(n))
        for i, (q, n) in enumerate(zip(QUESTIONS, [24, 20, 28, 22], strict=True))
    ]
    long_prompt = plain(smollm2, LONG)
    # Later arrivals: the same chat (system prompt and question) shares full blocks with a0's computed ones,
    # and a prompt longer than a step's token budget is prefilled in chunks.
    later = [
        EngineRequest("b0", chat(smollm2, QUESTIONS[0]), greedy(20)),
        EngineRequest("long", long_prompt, greedy(20)),
    ]
    engine = make_engine(smollm2, block_size=16, num_blocks=14, max_num_batched_tokens=32)
    assert len(long_prompt) > 32
    outs = run(engine, [(0, first), (6, later)])
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert outs["long"][0].started and outs["long"][0].new_token_ids == ()  # its first step was a chunk
    check(smollm2, first + later, outs)
