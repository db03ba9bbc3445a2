"""What attention needs to know about one step, built once per step and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillChunk:
    """A chunk of more than one token: attends causally within itself and to its cached prefix."""

    row_start: int  # first row of the chunk in the flattened tokens
    num_tokens: int
    start_position: int  # position of its first token (tokens before it are already in the cache)
    seat: int  # row of AttentionMetadata.block_tables holding its sequence's blocks

    @property
    def context_len(self) -> int:
        return self.start_position + self.num_tokens


@dataclass(frozen=True)
class AttentionMetadata:
    """Every one-token chunk is a "decode row"; longer chunks are prefill chunks."""

    block_tables: torch.Tensor  # [seats, max_blocks] int64, persistent: each live sequence's blocks by seat
    decode_rows: torch.Tensor  # [B] int64 rows of the one-token chunks in the flattened tokens
    decode_seats: torch.Tensor  # [B] int64 their seats
    decode_lens: torch.Tensor  # [B] int64 keys each attends to (its position + 1)
    decode_first: int | None  # decode rows are decode_first .. decode_first + B - 1 (then a slice is a view)
    max_decode_len: int  # max(decode_lens), 0 without decode rows
    prefills: tuple[PrefillChunk, ...]

    @property
    def num_decodes(self) -> int:
        return int(self.decode_rows.numel())
