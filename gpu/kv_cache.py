"""Paged KV cache: fixed-size blocks of K and V per layer, addressed through block tables."""

from __future__ import annotations

import ctypes
import math
import mmap
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element


class KVCache:
    """K and V tensors shaped [num_layers, kv_heads, num_blocks, block_size, head_dim].

    Heads lead so that one head's blocks of one layer are a plain [num_blocks * block_size, head_dim]
    matrix: the C decode kernel walks it by block id, and a gather of a batch's blocks gives
    [kv_heads, B, context, head_dim] directly. Zero-initialised on purpose: attention may read whole
    blocks and mask the unused slots, and a masked weight of 0 times uninitialised NaN would be NaN.
    """

    def __init__(self, shape: KVShape, num_blocks: int, device: torch.device) -> None:
        self.shape = shape
        self.num_blocks = num_blocks
        dims = (shape.num_layers, shape.num_kv_heads, num_blocks, shape.block_size, shape.head_dim)
        self.k = _zeros(dims, shape.dtype, device)
        self.v = _zeros(dims, shape.dtype, device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V of [T, kv_heads, head_dim] at flat slots (block * block_size + offset)."""
        flat = (self.shape.num_kv_heads, -1, self.shape.head_dim)
        self.k[layer].view(flat).index_copy_(1, slots, k.transpose(0, 1))
        self.v[layer].view(flat).index_copy_(1, slots, v.transpose(0, 1))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of [kv_heads, B, max_blocks * block_size, head_dim] for block tables [B, max_blocks]."""
        out = (self.shape.num_kv_heads, block_tables.shape[0], -1, self.shape.head_dim)
        k = self.k[layer].index_select(1, block_tables.reshape(-1)).view(out)
        v = self.v[layer].index_select(1, block_tables.reshape(-1)).view(out)
        return k, v


HUGE_PAGE = 2 << 20


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU from anonymous memory the OS maps on first write, so a multi-GiB cache costs
    resident memory only as sequences fill it (torch.zeros writes every page).

    The memory asks for transparent huge pages: a new block touches one 4 KiB page per layer, head and K/V
    (180 page faults for SmolLM2), and a fault cost 27 us on this project's VMs, so first use of each block
    cost 5 ms, half a second for a 1,024-token prefill step. With 2 MiB pages a fault covers 512 blocks."""
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    count = math.prod(dims)
    size = count * torch.empty((), dtype=dtype).element_size()
    memory = mmap.mmap(-1, size + HUGE_PAGE)  # anonymous: zero-filled, mapped lazily
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere plain pages
        memory.madvise(mmap.MADV_HUGEPAGE)
    anchor = ctypes.c_char.from_buffer(memory)
    offset = -ctypes.addressof(anchor) % HUGE_PAGE  # start on a huge-page boundary
    del anchor
    # frombuffer keeps the mapping alive as long as the tensor
    return torch.frombuffer(memory, dtype=dtype, count=count, offset=offset).view(dims)
