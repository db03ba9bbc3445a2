"""Flatten one SchedulerOutput into the tensors a batched forward needs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from scheduler.output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class PrefillChunk:
    """A chunk of more than one token: attends causally within itself and to its cached prefix."""

    row_start: int  # first row of the chunk in the flattened tokens
    num_tokens: int
    block_table: torch.Tensor  # [ceil(context_len / block_size)] block ids
    causal_bias: torch.Tensor  # [num_tokens, blocks * block_size]: 0 where attending, else -inf


@dataclass(frozen=True)
class DecodeBatch:
    """Every one-token chunk, attended to as one padded batch."""

    rows: torch.Tensor  # [B] rows in the flattened tokens
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0 (its slots are masked)
    bias: torch.Tensor  # [1, B, 1, max_blocks * block_size]: 0 for context slots, -inf for padding
    contiguous: bool  # rows are 0..B-1, so the batch is a plain slice


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] position of every token in its sequence
    slots: torch.Tensor  # [T] flat KV slot (block * block_size + offset) where each token's K/V goes
    decode: DecodeBatch | None
    prefills: tuple[PrefillChunk, ...]
    sample_rows: torch.Tensor  # [S] rows whose hidden state predicts a sampled token
    sample_chunks: tuple[ScheduledChunk, ...]  # the S chunks that sample, in the same order


def _slot(chunk: ScheduledChunk, position: int, block_size: int) -> int:
    return chunk.block_table[position // block_size] * block_size + position % block_size


def _blocks_for(context_len: int, block_size: int) -> int:
    return -(-context_len // block_size)


def _prefill(
    chunk: ScheduledChunk, row: int, block_size: int, dtype: torch.dtype
) -> tuple[PrefillChunk, torch.Tensor]:
    n, start = len(chunk.token_ids), chunk.start_position
    context = start + n
    table = torch.tensor(chunk.block_table[: _blocks_for(context, block_size)], dtype=torch.long)
    positions = torch.arange(start, context, dtype=torch.long)
    slots = table[positions // block_size] * block_size + positions % block_size
    # Keys span whole blocks; the causal mask also hides the slots past the context.
    keys = torch.arange(table.numel() * block_size, dtype=torch.long)
    bias = torch.zeros(n, keys.numel(), dtype=dtype).masked_fill_(
        keys[None, :] > positions[:, None], float("-inf")
    )
    return PrefillChunk(row, n, table, bias), slots


def _decode_batch(
    chunks: list[tuple[int, ScheduledChunk]], block_size: int, dtype: torch.dtype
) -> DecodeBatch:
    contexts = [c.start_position + 1 for _, c in chunks]
    max_blocks = _blocks_for(max(contexts), block_size)
    tables = [list(c.block_table[:max_blocks]) + [0] * (max_blocks - len(c.block_table)) for _, c in chunks]
    context = torch.tensor(contexts, dtype=torch.long)
    keys = torch.arange(max_blocks * block_size, dtype=torch.long)
    bias = torch.zeros(1, len(chunks), 1, keys.numel(), dtype=dtype)
    bias.masked_fill_((keys[None, :] >= context[:, None])[None, :, None, :], float("-inf"))
    rows = [r for r, _ in chunks]
    return DecodeBatch(
        rows=torch.tensor(rows, dtype=torch.long),
        block_tables=torch.tensor(tables, dtype=torch.long),
        bias=bias,
        contiguous=rows == list(range(len(rows))),
    )


def build_inputs(output: SchedulerOutput, block_size: int, dtype: torch.dtype = torch.float32) -> StepInputs:
    ids: list[int] = []
    positions: list[int] = []
    slot_parts: list[torch.Tensor] = []
    decode_slots: list[int] = []
    decodes: list[tuple[int, ScheduledChunk]] = []
    prefills: list[PrefillChunk] = []
    sample_rows: list[int] = []
    sample_chunks: list[ScheduledChunk] = []
    for chunk in output.chunks:
        row, n = len(ids), len(chunk.token_ids)
        ids.extend(chunk.token_ids)
        if n == 1:
            positions.append(chunk.start_position)
            decode_slots.append(_slot(chunk, chunk.start_position, block_size))
            decodes.append((row, chunk))
        else:
            positions.extend(range(chunk.start_position, chunk.start_position + n))
            part, slots = _prefill(chunk, row, block_size, dtype)
            prefills.append(part)
            slot_parts.append(slots)
        if chunk.sample:
            sample_rows.append(row + n - 1)
            sample_chunks.append(chunk)
    # Decode slots are collected apart from prefill slots; put every slot back in row order.
    slots = torch.empty(len(ids), dtype=torch.long)
    if decodes:
        slots[torch.tensor([r for r, _ in decodes])] = torch.tensor(decode_slots, dtype=torch.long)
    for part, chunk_slots in zip(prefills, slot_parts, strict=True):
        slots[part.row_start : part.row_start + part.num_tokens] = chunk_slots
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slots=slots,
        decode=_decode_batch(decodes, block_size, dtype) if decodes else None,
        prefills=tuple(prefills),
        sample_rows=torch.tensor(sample_rows, dtype=torch.long),
        sample_chunks=tuple(sample_chunks),
    )
