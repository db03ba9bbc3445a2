"""Incremental detokenization: complete characters only, exact concatenation, stop strings across tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gpu.detokenizer import Detokenizer
from gpu.tokenizer import ByteTokenizer


class DecodeOnly:
    """A tokenizer exposing only decode(), like an HF tokenizer: exercises the windowed path."""

    eos_token_ids = (2,)

    def __init__(self) -> None:
        self._bytes = ByteTokenizer()

    def decode(self, ids: Sequence[int]) -> str:
        return self._bytes.decode(ids)


TOKENIZERS = [ByteTokenizer(), DecodeOnly()]
ENCODE = ByteTokenizer().encode


def run(tokenizer, text, stop=()):
    detok = Detokenizer(tokenizer, [1], stop)
    deltas = [detok.push(t) for t in ENCODE(text, add_bos=False)]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("tokenizer", TOKENIZERS, ids=["bytes", "window"])
def test_multibyte_characters_split_over_tokens_are_never_broken(tokenizer):
    text = "añb€c😀d 中文"
    deltas, detok = run(tokenizer, text)
    assert "".join(deltas) == text == detok.text
    assert all("\ufffd" not in d for d in deltas)
    assert "😀" in deltas  # the 4 bytes come out together, once complete


@pytest.mark.parametrize("tokenizer", TOKENIZERS, ids=["bytes", "window"])
def test_stop_string_across_token_boundaries(tokenizer):
    deltas, detok = run(tokenizer, "hello wor<END>ld", stop=("<END>",))
    assert detok.stopped and "".join(deltas) == "hello wor" == detok.text
    assert all("<" not in d for d in deltas)  # the partial match was held back, never emitted


@pytest.mark.parametrize("tokenizer", TOKENIZERS, ids=["bytes", "window"])
def test_partial_stop_match_is_released_when_it_fails(tokenizer):
    deltas, detok = run(tokenizer, "a <EN b <E", stop=("<END>", "zz"))
    assert not detok.stopped and "".join(deltas) == "a <EN b <E"
    assert deltas[-1] == "<E"  # held to the end, released by flush


def test_stop_string_straddling_a_multibyte_character():
    deltas, detok = run(ByteTokenizer(), "x€€y", stop=("€y",))
    assert detok.stopped and "".join(deltas) == "x€"


def test_unused_ids_decode_to_printable_ascii():
    tok = ByteTokenizer(32000)
    text = tok.decode([259, 260, 259 + 95, 31999])
    assert text.isprintable() and text[:3] == "  !"[0] + "!" + " " and len(text) == 4
    assert tok.decode(tok.encode("héllo")) == "héllo"
