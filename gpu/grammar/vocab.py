"""The token vocabulary as xgrammar sees it: what text each id stands for, which ids end generation."""

from __future__ import annotations

import json
from collections.abc import Iterable

import xgrammar as xgr

from gpu.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Iterable[int]) -> xgr.TokenizerInfo:
    """`vocab_size` is the width of the model's logits, which may exceed the tokenizer's own vocabulary:
    ids past it stand for nothing and are never allowed. The EOS ids are the only stop tokens, so a
    constrained sequence may end exactly where its grammar can."""
    stops = sorted(eos_token_ids)
    if isinstance(tokenizer, ByteTokenizer):
        # Ids 0-2 (pad, bos, eos) stand for no bytes: an empty entry is a special token, never text.
        raw = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        return xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops)
    if isinstance(tokenizer, HFTokenizer):
        return _from_huggingface(tokenizer.hf, vocab_size, stops)
    raise TypeError(f"no grammar support for tokenizer {type(tokenizer).__name__}")


def _from_huggingface(hf: object, vocab_size: int, stops: list[int]) -> xgr.TokenizerInfo:
    # xgrammar's own reading of a HF tokenizer treats special tokens such as <|im_start|> as text, which
    # would let them appear inside a JSON string; rebuild its vocabulary with every special token blanked.
    base = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stops)
    meta = json.loads(base.dump_metadata())
    special = {i for i, t in hf.added_tokens_decoder.items() if t.special}  # type: ignore[attr-defined]
    encoded = [""] * vocab_size
    for text, i in hf.get_vocab().items():  # type: ignore[attr-defined]
        if i < vocab_size and i not in special:
            encoded[i] = text
    return xgr.TokenizerInfo(
        encoded,
        xgr.VocabType(meta["vocab_type"]),
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=meta["add_prefix_space"],
    )
