"""JSON outputs that close before their token budget runs out.

A JSON constrained output cut off by `max_tokens` is not JSON at all, and a small model decoding greedily
often loops inside an open array or string (SmolLM2-135M listing ever longer genre names) until it is. So
in the last tokens of its budget a JSON sequence takes a closing token wherever its grammar allows one:
inside a string a token that ends it (`"`, `"]`, `"}`, ...), elsewhere one that ends arrays and objects
(`]`, `}`, `]}`, ...), never one that opens a string (a key or an item). What the grammar still requires (a
required key, a number's digit) is generated as before, and an output that ends earlier is never touched.
Imports no xgrammar: the ids come from the compiler's decoded vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

JSON_KINDS = ("json_schema", "json_object")
QUOTE, BACKSLASH = ord('"'), ord("\\")
MAX_CLOSING_TOKENS = 64  # at most this many last tokens of a budget close; a quarter of smaller budgets


def closing_window(max_tokens: int) -> int:
    """How many of a budget's last tokens close: enough for the usual nesting, never most of a small
    budget (max_tokens 16: the last 4)."""
    return min(MAX_CLOSING_TOKENS, max_tokens // 4)


def closing_token_ids(decoded_vocab: Sequence[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids that end a string: `"` then only `"]}`; ids that end arrays and objects: only `]}`)."""
    in_string, outside = [], []
    for i, text in enumerate(decoded_vocab):
        if not text or not set(text) <= {QUOTE, ord("]"), ord("}")}:
            continue
        if text[0] == QUOTE:
            in_string.append(i)
        elif QUOTE not in text:
            outside.append(i)
    return torch.tensor(in_string, dtype=torch.long), torch.tensor(outside, dtype=torch.long)


class Closing:
    """The live JSON sequences, whether each is inside a string, and the closing of their last tokens."""

    def __init__(self) -> None:
        self.sequences: dict[str, list[bool]] = {}  # seq id -> [inside a string, after a backslash there]
        self._vocab: Sequence[bytes] = ()
        self._ids: tuple[torch.Tensor, torch.Tensor] | None = None
        self._on_device: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def set_vocabulary(self, decoded_vocab: Sequence[bytes]) -> None:
        self._vocab = decoded_vocab
        self._ids = closing_token_ids(decoded_vocab)

    def add(self, seq_id: str) -> None:
        self.sequences[seq_id] = [False, False]

    def drop(self, seq_id: str) -> None:
        self.sequences.pop(seq_id, None)

    def accept(self, seq_id: str, token_id: int) -> None:
        """Follow the sequence's new token's bytes in and out of strings (the grammar keeps it JSON)."""
        state = self.sequences.get(seq_id)
        if state is None or token_id >= len(self._vocab):
            return
        inside, escaped = state
        for byte in self._vocab[token_id]:
            if escaped:
                escaped = False
            elif inside and byte == BACKSLASH:
                escaped = True
            elif byte == QUOTE:
                inside = not inside
        state[0], state[1] = inside, escaped

    def due(self, seq_id: str, max_tokens: int, num_generated: int) -> bool:
        """Whether the token sampled now (the sequence's num_generated + 1-th) is in its closing window."""
        return seq_id in self.sequences and max_tokens - num_generated <= closing_window(max_tokens)

    def restrict(self, logits: torch.Tensor, rows: Sequence[tuple[int, str]]) -> None:
        """For each (row, seq id): where the row's mask allows a closing token, forbid every other one."""
        for inside in (True, False):
            picked = [row for row, seq_id in rows if self.sequences[seq_id][0] is inside]
            if picked:
                self._keep_only(logits, picked, self._closers(logits.device, inside))

    def _closers(self, device: torch.device, inside: bool) -> torch.Tensor:
        ids = self._on_device.get((device, inside))
        if ids is None:
            assert self._ids is not None, "set_vocabulary first"
            ids = self._on_device[(device, inside)] = self._ids[0 if inside else 1].to(device)
        return ids

    @staticmethod
    def _keep_only(logits: torch.Tensor, rows: list[int], ids: torch.Tensor) -> None:
        if not len(ids):
            return
        picked = torch.tensor(rows, dtype=torch.long, device=logits.device)
        kept = logits[picked][:, ids]  # [R, C] the closing tokens' logits, -inf where the grammar forbids
        closable = torch.isfinite(kept).any(dim=1)
        picked, kept = picked[closable], kept[closable]
        if len(picked):
            logits[picked] = float("-inf")
            logits[picked.unsqueeze(1), ids.unsqueeze(0)] = kept
