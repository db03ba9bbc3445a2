"""Model loading: the seeded default, a local checkpoint directory, unsupported architectures."""

from __future__ import annotations

import pytest
import torch

from gpu.engine import Engine, EngineConfig, EngineRequest
from gpu.model import load_model, parse_dtype
from gpu.tokenizer import ByteTokenizer, HFTokenizer
from scheduler.types import SamplingParams
from tests.gpu.factories import SMALL, assert_matches_hf, make_model, make_prompts, make_requests


def test_default_model_is_deterministic_per_seed():
    a, b = load_model("tiny", seed=0), load_model("tiny", seed=0)
    assert a.config.vocab_size == 32000 and a.config.hidden_size == 256 and a.config.num_key_value_heads == 4
    assert 15e6 < sum(p.numel() for p in a.model.parameters()) < 25e6
    assert torch.equal(a.model.lm_head.weight, b.model.lm_head.weight)
    c = load_model("tiny", seed=1)
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)
    assert isinstance(a.tokenizer, ByteTokenizer)


def test_local_checkpoint_dir_loads_and_generates(tmp_path):
    saved = make_model(seed=3)
    saved.model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert torch.equal(loaded.model.lm_head.weight, saved.model.lm_head.weight)
    assert isinstance(loaded.tokenizer, ByteTokenizer)  # no tokenizer files saved: byte-level fallback
    prompts = make_prompts(2, 4, 20, seed=8)
    got = Engine(loaded, EngineConfig(num_blocks=64)).generate(make_requests(prompts, [6, 9]))
    for i, (prompt, n) in enumerate(zip(prompts, [6, 9], strict=True)):
        assert_matches_hf(loaded, prompt, got[f"r{i}"], n)


def test_unsupported_architecture_is_refused_clearly(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path))


def test_missing_dir_and_bad_dtype_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="float8")


def test_dtype_auto_is_float32_on_cpu_and_bfloat16_on_cuda():
    assert parse_dtype("auto", "cpu") is torch.float32 and parse_dtype("auto", "cuda:1") is torch.bfloat16
    assert load_model("tiny", dtype="auto").dtype is torch.float32


def test_small_factory_shape_is_what_tests_assume():
    assert make_model().config.vocab_size == SMALL["vocab_size"]


def save_char_tokenizer(path) -> None:
    """A tiny character-level HF tokenizer written next to a checkpoint, as a real model dir has one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({ch: 4 + i for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz é€")})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    special = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)


def test_checkpoint_with_hf_tokenizer_uses_it(tmp_path):
    make_model(seed=4).model.save_pretrained(tmp_path)
    save_char_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path))
    tokenizer = loaded.tokenizer
    assert isinstance(tokenizer, HFTokenizer) and tokenizer.eos_token_ids == (2,)
    assert tokenizer.decode(tokenizer.encode("hé €")) == "hé €"
    with pytest.raises(ValueError, match=f"model {tmp_path} has no chat template; send `prompt` instead"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])  # no layout is invented
    engine = Engine(loaded, EngineConfig(num_blocks=64))
    engine.add_request(EngineRequest("a", tuple(tokenizer.encode("abc")), SamplingParams(max_tokens=8)))
    outs = []
    while engine.has_unfinished():
        outs.extend(engine.step())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert "".join(o.text_delta for o in outs) == tokenizer.decode(tokens)
