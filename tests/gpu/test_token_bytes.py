"""Log probabilities' `bytes` are each token's own bytes with SmolLM2's byte-level BPE (a piece of an emoji
is that piece, not U+FFFD), so they add up to the output's exact UTF-8, and completions' `text_offset`
counts the characters of the text as emitted."""

from __future__ import annotations

import pytest

from gpu.engine import EngineRequest
from gpu.engine_types import GrammarSpec
from scheduler.types import SamplingParams
from tests.gpu.factories import make_engine
from workers.bulk.output import completion_logprobs
from workers.serving.loop.choices import LogprobFormatter

pytestmark = pytest.mark.slow

TEXT = "Hé 😀 中文 🇫🇷 ñ€ done"


def test_token_bytes_spell_the_encoded_text_exactly(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode(TEXT)
    pieces = [tokenizer.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode()
    assert any(len(p) and p.decode("utf-8", errors="replace") == "\ufffd" for p in pieces)  # split characters
    im_start = tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.token_bytes(im_start) == b""  # a special token is no text, as decode() skips it


def test_logprobs_bytes_add_up_to_the_output_and_offsets_count_its_characters(smollm2):
    """The grammar makes SmolLM2 write emoji (split over tokens in its vocabulary), with logprobs on."""
    engine = make_engine(smollm2)
    prompt = tuple(smollm2.tokenizer.encode("Write it:"))
    params = SamplingParams(max_tokens=60, logprobs=2)
    engine.add_request(EngineRequest("r", prompt, params, grammar=GrammarSpec("regex", TEXT)))
    text, logprobs = "", []
    while engine.has_unfinished():
        for out in engine.step():
            text += out.text_delta
            logprobs += out.logprobs
    assert text == TEXT
    entries = LogprobFormatter(smollm2.tokenizer).entries(logprobs)
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    assert any(e["token"] == "\ufffd" for e in entries)  # some token is part of a character
    offsets = completion_logprobs({"content": entries})["text_offset"]
    utf8, starts, at = text.encode(), [], 0
    for e in entries:
        starts.append(at)
        at += len(e["bytes"])
    # each token starts in the character its first byte belongs to (whole characters before it, counted)
    assert offsets == [len(utf8[:b].decode("utf-8", errors="ignore")) for b in starts]
    assert offsets[-1] <= len(text) and any(a == b for a, b in zip(offsets, offsets[1:], strict=False))


def test_text_streams_from_bytes_only_where_decode_is_exactly_those_bytes(smollm2):
    """SmolLM2's byte-level vocabulary without clean-up streams its text from token bytes; the same
    tokenizer with clean-up of spaces (" ." -> ".") decodes windows as HF does, and both give HF's text."""
    import copy

    from gpu.detokenizer import Detokenizer, _ByteStream, _WindowStream
    from gpu.tokenizer import HFTokenizer

    plain = smollm2.tokenizer
    hf = copy.deepcopy(plain.hf)
    hf.clean_up_tokenization_spaces = True
    cleaning = HFTokenizer(hf)
    assert plain.decodes_by_bytes and not cleaning.decodes_by_bytes
    ids = plain.encode("Hello , world . It 's fine 😀 !")
    for tokenizer, stream in ((plain, _ByteStream), (cleaning, _WindowStream)):
        detokenizer = Detokenizer(tokenizer, ())
        assert isinstance(detokenizer._stream, stream)
        text = "".join(detokenizer.push(i) for i in ids) + detokenizer.flush()
        assert text == tokenizer.hf.decode(ids, skip_special_tokens=True)
