"""JSON outputs that close before their token budget runs out.

A JSON constrained output cut off by `max_tokens` is not JSON at all, and a small model decoding greedily
often loops inside an open array or string (SmolLM2-135M listing ever longer genre names) until it is. So
in the last tokens of its budget a JSON sequence takes a closing token wherever its grammar allows one:
inside a string a token that ends it (`"`, `"]`, `"}`, ...), elsewhere one that ends arrays and objects
(`]`, `}`, `]}`, ...), never one that opens a string (a key or an item). What the grammar still requires (a
required key, a number's digit) is generated as before, and an output that ends earlier is never touched.
A string that may not end yet (a `pattern` such as `^[0-9]+Z$` needs its last piece after any number of
digits) is bridged: of its highest allowed tokens, it keeps those that end it or after which it may end (one
token of lookahead through its matcher, rolled back), where there are any. (A time's fraction of a second,
where SmolLM2 wrote zeros until `max_tokens`, is bounded in the grammar itself: gpu/grammar/compiler.py.)
Imports no xgrammar: the ids come from the compiler's decoded vocabulary, the matchers are the runner's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

JSON_KINDS = ("json_schema", "json_object")
# the grammars closed this way: JSON outputs, and forced tool calls (JSON arguments inside the call's syntax)
CLOSING_KINDS = (*JSON_KINDS, "tool_calls")
QUOTE, BACKSLASH = ord('"'), ord("\\")
MAX_CLOSING_TOKENS = 64  # at most this many last tokens of a budget close; a quarter of smaller budgets
BRIDGE_CANDIDATES = 32  # a string that may not end yet: how many of its highest allowed tokens to look past


def closing_window(max_tokens: int) -> int:
    """How many of a budget's last tokens close: enough for the usual nesting, never most of a small
    budget (max_tokens 16: the last 4)."""
    return min(MAX_CLOSING_TOKENS, max_tokens // 4)


def closing_token_ids(
    decoded_vocab: Sequence[bytes], stop_ids: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids that end a string: `"` then only `"]}`; ids that end arrays and objects: only `]}`, and the
    stop tokens, which end the output where its grammar may end: after a number, or a tool call that
    could be followed by another)."""
    in_string, outside = [], list(stop_ids)
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
        self._scratch: torch.Tensor | None = None  # one bitmask row for the bridge's lookahead

    def set_vocabulary(self, decoded_vocab: Sequence[bytes], stop_ids: Sequence[int] = ()) -> None:
        self._vocab = decoded_vocab
        self._ids = closing_token_ids(decoded_vocab, stop_ids)

    def add(self, seq_id: str) -> None:
        self.sequences[seq_id] = [False, False]

    def drop(self, seq_id: str) -> None:
        self.sequences.pop(seq_id, None)

    def accept(self, seq_id: str, token_id: int) -> None:
        """Follow the sequence's new token's bytes in and out of strings (the grammar keeps it JSON)."""
        state = self.sequences.get(seq_id)
        if state is not None:
            self.follow(state, token_id)

    def follow(self, state: list[bool], token_id: int) -> None:
        """Move a state [inside a string, after a backslash there] past the token's bytes, in place."""
        if token_id < len(self._vocab):
            state[0], state[1] = self._walk(state, token_id)

    def _walk(self, state: list[bool], token_id: int) -> tuple[bool, bool]:
        """(inside a string, after a backslash there) once the token's bytes follow the given state."""
        inside, escaped = state
        for byte in self._vocab[token_id]:
            if escaped:
                escaped = False
            elif inside and byte == BACKSLASH:
                escaped = True
            elif byte == QUOTE:
                inside = not inside
        return inside, escaped

    def due(self, seq_id: str, max_tokens: int, num_generated: int) -> bool:
        """Whether the token sampled now (the sequence's num_generated + 1-th) is in its closing window."""
        return seq_id in self.sequences and max_tokens - num_generated <= closing_window(max_tokens)

    def restrict(self, logits: torch.Tensor, rows: Sequence[tuple[int, str, Any]]) -> None:
        """For each (row, seq id, grammar matcher): where the row's mask allows a closing token, forbid every
        other one; inside a string that may not end yet, keep the tokens after which it may (`_bridge`)."""
        self.restrict_states(logits, [(row, self.sequences[s], m) for row, s, m in rows])

    def restrict_states(self, logits: torch.Tensor, rows: Sequence[tuple[int, list[bool], Any]]) -> None:
        """`restrict` with each row's closing state given (a resumed sample's saved positions had theirs)."""
        for inside in (True, False):
            picked = [(row, state, m) for row, state, m in rows if state[0] is inside]
            if not picked:
                continue
            closers = self._closers(logits.device, inside)
            stuck = self._keep_only(logits, [row for row, _, _ in picked], closers)
            if inside and stuck:
                on_cpu = closers.cpu()
                for row, state, matcher in picked:
                    if row in stuck:
                        self._bridge(logits, row, state, matcher, on_cpu)

    def _bridge(
        self, logits: torch.Tensor, row: int, state: list[bool], matcher: Any, closers: torch.Tensor
    ) -> None:
        """Keep, of the row's BRIDGE_CANDIDATES highest allowed tokens, those that end its string or after
        which its grammar allows a closing token; leave the row alone where none does."""
        allowed = int(torch.isfinite(logits[row]).sum())
        if not allowed or not len(closers):
            return
        words = (logits.shape[-1] + 31) // 32
        if self._scratch is None or self._scratch.shape[1] != words:
            self._scratch = torch.full((1, words), -1, dtype=torch.int32)
        scratch = self._scratch
        bridges = []
        for token in torch.topk(logits[row], min(BRIDGE_CANDIDATES, allowed)).indices.tolist():
            if token < len(self._vocab) and not self._walk(state, token)[0]:
                bridges.append(token)  # it ends the string itself (`Z"`)
                continue
            if not matcher.accept_token(token):
                continue
            matcher.fill_next_token_bitmask(scratch, 0)
            matcher.rollback(1)
            if bool(((scratch[0, closers >> 5] >> (closers & 31)) & 1).any()):
                bridges.append(token)
        if bridges and len(bridges) < allowed:
            self._keep_only(logits, [row], torch.tensor(bridges, device=logits.device))

    def _closers(self, device: torch.device, inside: bool) -> torch.Tensor:
        ids = self._on_device.get((device, inside))
        if ids is None:
            assert self._ids is not None, "set_vocabulary first"
            ids = self._on_device[(device, inside)] = self._ids[0 if inside else 1].to(device)
        return ids

    @staticmethod
    def _keep_only(logits: torch.Tensor, rows: list[int], ids: torch.Tensor) -> set[int]:
        """In each row that allows one of ids, forbid every other token; the rows that allow none."""
        if not len(ids):
            return set(rows)
        picked = torch.tensor(rows, dtype=torch.long, device=logits.device)
        kept = logits[picked][:, ids]  # [R, C] the closing tokens' logits, -inf where the grammar forbids
        closable = torch.isfinite(kept).any(dim=1)
        stuck = {row for row, ok in zip(rows, closable.tolist(), strict=True) if not ok}
        picked, kept = picked[closable], kept[closable]
        if len(picked):
            logits[picked] = float("-inf")
            logits[picked.unsqueeze(1), ids.unsqueeze(0)] = kept
        return stuck
