"""SmolLM2's real tokenizer: chat template, EOS ids, streamed text that is clean UTF-8 (byte-level BPE)."""

from __future__ import annotations

import pytest

from gpu.detokenizer import Detokenizer
from gpu.engine import Engine, EngineConfig
from gpu.tokenizer import HFTokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hé 😀 中文 café —  two  spaces\tand\nnewline ñ€",
    "👨‍👩‍👧 family, 🇫🇷 flag, x😀😀😀y",
    "   leading spaces and trailing   ",
    "日本語のテキスト、句読点。don't , . ; it's",
]


def stream(tokenizer, prompt_ids, ids, stop=()):
    detok = Detokenizer(tokenizer, prompt_ids, stop)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_are_whole_characters_that_add_up_to_the_text(smollm2, text):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(text)
    assert len(ids) < len(text.encode())  # real BPE merges, not one token per byte
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Say something 😀"}])
    deltas, detok = stream(tokenizer, prompt, ids)
    assert "".join(deltas) == detok.text == text == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_an_emoji_split_over_tokens_comes_out_once_complete(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(" 😀")
    assert len(ids) > 1 and tokenizer.decode(ids[:1]).endswith("\ufffd")  # the bytes span two tokens
    deltas, _ = stream(tokenizer, tokenizer.encode("Hi"), ids)
    # the tokenizer knows each token's bytes (HFTokenizer.token_bytes): the space goes out at once, the
    # emoji is held while incomplete, never a replacement character
    assert deltas == [" ", "😀", ""]


def test_stop_string_on_real_tokens(smollm2):
    tokenizer = smollm2.tokenizer
    deltas, detok = stream(tokenizer, [], tokenizer.encode("The answer is 42. Done."), stop=(". D",))
    assert detok.stopped and "".join(deltas) == "The answer is 42"


def test_chat_template_opens_the_assistant_turn(smollm2):
    tokenizer = smollm2.tokenizer
    assert isinstance(tokenizer, HFTokenizer)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    text = tokenizer.hf.decode(ids)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nHello<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_engine_stops_at_im_end(smollm2):
    engine = Engine(smollm2, EngineConfig(num_blocks=64))
    end_of_turn = smollm2.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in engine.eos_token_ids
    assert engine.generation_defaults.temperature is None  # SmolLM2's generation_config sets no sampling
