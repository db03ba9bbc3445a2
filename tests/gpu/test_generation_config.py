"""The model's generation_config: sampling defaults where it sets them, and every EOS id it lists."""

from __future__ import annotations

import copy

from transformers import GenerationConfig

from gpu.engine import EngineRequest
from gpu.generation_config import GenerationDefaults, eos_token_ids
from gpu.tokenizer import ByteTokenizer
from scheduler.types import FinishReason
from tests.gpu.factories import greedy, make_engine, make_model, make_prompts, wrap


def test_defaults_are_what_the_config_sets_and_none_elsewhere():
    config = GenerationConfig(temperature=0.6, top_p=0.9, max_new_tokens=200, eos_token_id=2)
    assert GenerationDefaults.from_generation_config(config) == GenerationDefaults(0.6, 0.9, None, 200)
    assert GenerationDefaults.from_generation_config(GenerationConfig(top_k=20)).top_k == 20
    assert GenerationDefaults.from_generation_config(GenerationConfig()) == GenerationDefaults()
    assert GenerationDefaults.from_generation_config(None) == GenerationDefaults()


def test_eos_ids_join_the_tokenizer_and_the_config():
    tokenizer = ByteTokenizer()
    assert eos_token_ids(GenerationConfig(eos_token_id=[2, 7, 9]), tokenizer) == {2, 7, 9}
    assert eos_token_ids(GenerationConfig(eos_token_id=5), tokenizer) == {2, 5}
    assert eos_token_ids(None, tokenizer) == {2}


def test_engine_exposes_defaults_and_stops_at_any_eos_id():
    model = wrap(copy.deepcopy(make_model().model))
    prompt = make_prompts(1, 10, 10, seed=2)[0]
    tokens = make_engine(model).generate([EngineRequest("a", prompt, greedy(12, ignore_eos=True))])["a"]
    model.model.generation_config.eos_token_id = [2, tokens[4]]  # the 5th token is now an EOS id too
    model.model.generation_config.temperature = 0.7
    engine = make_engine(model)
    assert engine.generation_defaults.temperature == 0.7 and engine.eos_token_ids == {2, tokens[4]}
    engine.add_request(EngineRequest("a", prompt, greedy(12)))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    end = next(i for i, t in enumerate(tokens) if t in engine.eos_token_ids)
    assert [t for o in outs for t in o.new_token_ids] == tokens[: end + 1]
    assert outs[-1].finish_reason is FinishReason.STOP
    ignoring = make_engine(model).generate([EngineRequest("b", prompt, greedy(12, ignore_eos=True))])["b"]
    assert ignoring == tokens
