"""Incremental detokenization: emit only complete characters, hold back a possible partial stop string."""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from typing import Any

from gpu.tokenizer import Tokenizer

# Prompt tokens decoded together with the first output tokens, so tokenizers that render a token
# differently by context (leading spaces in SentencePiece) give the right first delta.
_CONTEXT_TOKENS = 5


# tokenizer -> {token id: its text}, for tokens whose bytes are whole UTF-8 characters: shared by every
# request's detokenizer, so the common token costs one dict lookup.
_WHOLE_TEXTS: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


class _ByteStream:
    """For tokenizers whose decode is their tokens' bytes joined: an incremental UTF-8 decoder, exact and
    O(1) a token."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._token_bytes = tokenizer.token_bytes  # type: ignore[attr-defined]
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._texts = _WHOLE_TEXTS.setdefault(tokenizer, {})
        self._held = False  # the decoder holds the first bytes of a character

    def push(self, token_id: int) -> str:
        if not self._held:
            text = self._texts.get(token_id)
            if text is not None:
                return text  # whole characters after whole characters: what the decoder would return
            data = self._token_bytes(token_id)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                pass
            else:
                self._texts[token_id] = text
                return text
        else:
            data = self._token_bytes(token_id)
        out = self._decoder.decode(data)
        self._held = bool(self._decoder.getstate()[0])
        return out

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class _WindowStream:
    """For any tokenizer: decode a short window and hold output while it ends in an incomplete character."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> None:
        self._decode = tokenizer.decode
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def _advance(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(prefix_text) :]

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)


class Detokenizer:
    """Turns one request's output tokens into text deltas; deltas concatenate exactly to the final text.

    The final text excludes a matched stop string and everything after it; `stopped` tells the engine to
    end the request.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), stop: Sequence[str] = ()
    ) -> None:
        if getattr(tokenizer, "decodes_by_bytes", False):
            self._stream: _ByteStream | _WindowStream = _ByteStream(tokenizer)
        else:
            self._stream = _WindowStream(tokenizer, prompt_ids)
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded text not emitted yet: it may be the start of a stop string
        self.stopped = False
        self._emitted: list[str] = []  # joined on demand: appending to one string would copy it per token

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    def push(self, token_id: int) -> str:
        """Add one output token; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        piece = self._stream.push(token_id)
        if not self._stop:  # nothing to match or hold back: the common case, kept short
            if piece:
                self._emitted.append(piece)
            return piece
        self._pending += piece
        return self._release(final=False)

    def flush(self) -> str:
        """The request ended: emit whatever was held back (nothing after a matched stop string)."""
        if self.stopped:
            return ""
        self._pending += self._stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = self._first_stop()
        if cut is not None:
            out, self._pending, self.stopped = self._pending[:cut], "", True
        else:
            keep = 0 if final else self._partial_stop_len()
            end = len(self._pending) - keep
            out, self._pending = self._pending[:end], self._pending[end:]
        if out:
            self._emitted.append(out)
        return out

    def _first_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the pending text that a stop string starts with."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:k]):
                    best = k
                    break
        return best
