"""Tokenizers behind one interface: the built-in byte-level one and an adapter for local HF ones."""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any, Protocol

from schemas.tool_calls import HERMES, LLAMA3_JSON, ToolDialect

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3  # ids 3..258 are the bytes 0..255
NUM_BYTE_IDS = 256 + BYTE_OFFSET


class Tokenizer(Protocol):
    """`special_tokens=False` (the default for user text): a control token's spelling in the text (say
    `<|im_start|>`) is tokenized as plain text, so a user cannot forge chat roles or end a turn early."""

    eos_token_ids: tuple[int, ...]  # the tokenizer's own; the engine adds the generation_config's
    # How the chat template shows tools and the calls the model makes, when it does (a template given
    # `tools` renders them itself); None: it knows no tools, and inferq's default format is used.
    tool_dialect: ToolDialect | None

    def encode(self, text: str, special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """`tools` (OpenAI's tool objects) only where `tool_dialect` is not None."""
        ...

    def clone(self) -> Tokenizer:
        """One for another thread: a tokenizer object is not safe to share between threads."""
        ...


def template_tool_dialect(template: str | Mapping[str, str] | None) -> ToolDialect | None:
    """The dialect of a chat template that renders tools itself, from its source; None for one that
    renders none, or in a syntax the worker cannot parse (inferq's default format is used for those)."""
    if isinstance(template, Mapping):  # named templates: HF picks "tool_use" when given tools
        template = template.get("tool_use") or template.get("default")
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:  # Qwen2.5, Qwen3, Hermes
        return HERMES
    if '"parameters": dictionary of argument name' in template:  # Llama 3.1-3.3's JSON calls
        return LLAMA3_JSON
    return None


def render_chat(messages: Sequence[Mapping[str, Any]]) -> str:
    """The byte tokenizer's chat template: one plain block per message, ending with the assistant's turn."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


class ByteTokenizer:
    """Byte-level tokenizer needing no files: ids 0/1/2 are pad/bos/eos, 3..258 are the bytes.

    Ids >= 259 are never produced by `encode`; they decode to one printable ASCII character each so that a
    random model's output stays readable.
    """

    pad_token_id = PAD_ID
    bos_token_id = BOS_ID
    eos_token_ids: tuple[int, ...] = (EOS_ID,)
    decodes_by_bytes = True  # decode() is exactly the concatenation of token_bytes
    tool_dialect: ToolDialect | None = None  # its template shows no tools

    def __init__(self, vocab_size: int = NUM_BYTE_IDS) -> None:
        if vocab_size < NUM_BYTE_IDS:
            raise ValueError(
                f"byte tokenizer needs a vocabulary of at least {NUM_BYTE_IDS}, got {vocab_size}"
            )
        self.vocab_size = vocab_size

    def encode(self, text: str, special_tokens: bool = False, add_bos: bool = True) -> list[int]:
        # a byte tokenizer's special tokens have no spelling: text is always just bytes
        ids = [b + BYTE_OFFSET for b in text.encode("utf-8")]
        return [BOS_ID, *ids] if add_bos else ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (special tokens stand for none)."""
        if token_id < BYTE_OFFSET:
            return b""
        if token_id < NUM_BYTE_IDS:
            return bytes((token_id - BYTE_OFFSET,))
        return bytes((32 + (token_id - NUM_BYTE_IDS) % 95,))

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        if tools:
            raise ValueError("the byte tokenizer's chat template shows no tools")
        return self.encode(render_chat(messages))

    def clone(self) -> ByteTokenizer:
        return self  # no state


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: every byte as a printable character (the table byte-level
    tokenizers spell their tokens in: a space is Ġ, a newline Ċ)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # SentencePiece byte fallback: one byte per token


def _vocab_kind(hf: Any) -> str:
    """ "byte_level" (GPT-2 style), "byte_fallback" (SentencePiece with <0xNN> tokens) or "plain", from
    the tokenizer's decoder."""
    try:
        state = json.loads(hf.backend_tokenizer.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - a slow tokenizer, or no decoder: its tokens are their text
        return "plain"
    kinds = {state.get("type"), *(d.get("type") for d in state.get("decoders") or [])}
    if "ByteLevel" in kinds:
        return "byte_level"
    return "byte_fallback" if "ByteFallback" in kinds else "plain"


class HFTokenizer:
    """Adapter over a transformers tokenizer loaded from a local checkpoint directory."""

    def __init__(self, tokenizer: Any, model_name: str = "model") -> None:
        self.hf = tokenizer
        self.model_name = model_name  # for error messages
        eos = tokenizer.eos_token_id
        self.eos_token_ids: tuple[int, ...] = () if eos is None else (eos,)
        # every token the tokenizer would parse out of text (special and added ones), longest first
        spellings = {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()}
        self._control = tuple(sorted((t for t in spellings if t), key=len, reverse=True))
        self._vocab_kind: str | None = None  # how a token's string spells its bytes: found on first use
        self._added = dict(tokenizer.added_tokens_decoder)  # id -> AddedToken (a property built per call)

    @property
    def decodes_by_bytes(self) -> bool:
        """Whether decode() is exactly the UTF-8 of the tokens' bytes joined (GPT-2-style byte-level
        vocabularies without clean-up of spaces): then text is streamed from token_bytes, an O(1) step per
        token, rather than by decoding windows. SentencePiece decoders strip a leading space and clean-up
        rewrites " ." to ".", so those decode as HF does."""
        if self._vocab_kind is None:
            self._vocab_kind = _vocab_kind(self.hf)
        cleans_up = getattr(self.hf, "clean_up_tokenization_spaces", False)
        return self._vocab_kind == "byte_level" and not cleans_up

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, exactly: a piece of a multi-byte character is that piece (which
        `decode` can only show as U+FFFD). Special tokens stand for none, as `decode` skips them."""
        added = self._added.get(token_id)
        if added is not None:
            return b"" if added.special else added.content.encode()
        token = self.hf.convert_ids_to_tokens(token_id)
        if not token:
            return b""
        if self._vocab_kind is None:
            self._vocab_kind = _vocab_kind(self.hf)
        if self._vocab_kind == "byte_level" and all(c in _UNICODE_TO_BYTE for c in token):
            return bytes(_UNICODE_TO_BYTE[c] for c in token)
        if self._vocab_kind == "byte_fallback" and _BYTE_TOKEN.fullmatch(token):
            return bytes((int(token[3:5], 16),))
        return token.replace("\u2581", " ").encode()  # SentencePiece spells a space as ▁

    def clone(self) -> HFTokenizer:
        return HFTokenizer(copy.deepcopy(self.hf), self.model_name)

    def _spells_control(self, text: str) -> bool:
        return any(token in text for token in self._control)

    def encode(self, text: str, special_tokens: bool = False) -> list[int]:
        split = not special_tokens and self._spells_control(text)
        return list(self.hf.encode(text, split_special_tokens=split))

    def decode(self, ids: Sequence[int]) -> str:
        # No clean-up of spaces before punctuation: it depends on the following token, so the streamed
        # deltas would no longer add up to the final text.
        return self.hf.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @cached_property
    def tool_dialect(self) -> ToolDialect | None:
        return template_tool_dialect(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        special_tokens: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """The model's own chat template with the assistant's turn opened; never an invented layout.
        Contents are strings (an assistant turn that only made calls has ""); `tools` are OpenAI's."""
        if not getattr(self.hf, "chat_template", None):
            raise ValueError(f"model {self.model_name} has no chat template; send `prompt` instead")
        if not special_tokens:
            structured = json.dumps([tools, [m.get("tool_calls") for m in messages]], ensure_ascii=False)
            if self._spells_control(structured):
                raise ValueError("tool definitions and tool calls must not spell the model's control tokens")
            if any(self._spells_control(m["content"]) for m in messages):
                return self._chat_with_plain_contents(messages, tools)
        ids = self._render(list(messages), tools, tokenize=True)
        if isinstance(ids, Mapping):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def _render(self, messages: list[Mapping[str, Any]], tools: Any, tokenize: bool) -> Any:
        try:
            return self.hf.apply_chat_template(
                messages, tools=list(tools) if tools else None, add_generation_prompt=True, tokenize=tokenize
            )
        except Exception as exc:
            if type(exc).__module__.startswith("jinja2"):  # the template refused (raise_exception, ...)
                raise ValueError(f"the chat template refused the messages: {exc}") from None
            raise

    def _chat_with_plain_contents(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The template rendered around placeholders; its own text keeps its control tokens, while each
        message's content is tokenized as plain text where its placeholder stood."""
        marks = [f"inferq-content-{secrets.token_hex(8)}" for _ in messages]
        stand_ins = [{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)]
        text = self._render(stand_ins, tools, tokenize=False)
        ids: list[int] = []
        for mark, message in zip(marks, messages, strict=True):
            before, found, text = text.partition(mark)
            if not found:  # the template dropped or changed the content: refuse rather than guess
                raise ValueError(f"model {self.model_name}'s chat template does not show a message as sent")
            ids += self.hf.encode(before, add_special_tokens=False)
            ids += self.hf.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
        return ids + self.hf.encode(text, add_special_tokens=False)
