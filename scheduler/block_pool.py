"""Fixed-size KV blocks: a free pool, ref counts, and the prefix-cache map with LRU eviction."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is in the prefix cache (full, KV computed): its key; what it extends (the
    # tenant's root key for a first block, else the serial of the cached block before it) and its tokens,
    # so every hit is checked against its real provenance rather than trusted; and a serial never reused.
    block_hash: bytes | None = None
    parent: bytes | int | None = None
    token_ids: tuple[int, ...] | None = None
    serial: int | None = None


class BlockPool:
    """Owns every block. A free block that still has a hash stays reusable until its id is needed.

    Free blocks live in one ordered map; allocation takes from the front. Uncached free blocks are put at
    the front (taken first) and cached ones at the back, so cached blocks are evicted least recently used.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._serials = itertools.count(1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks (evicting cached free ones as needed); None if fewer than n are free."""
        if n > len(self._free):
            return None
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: bytes, parent: bytes | int, token_ids: tuple[int, ...]) -> int | None:
        """The block caching exactly this prefix block (in use or free), if any.

        A hit counts only if the block was cached on top of the same parent (the same root key, or the very
        cached block just matched, by its serial) with the same tokens: even colliding keys can then never
        hand one sequence another's KV, since a verified chain is one registered block on top of another.
        """
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.parent != parent or block.token_ids != token_ids:
            return None
        return block_id

    def share(self, block_id: int) -> None:
        """Take one more reference to a cached block (a prefix-cache hit); revives it if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per id; a block whose count reaches zero becomes free."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache(
        self, block_id: int, block_hash: bytes, parent: bytes | int, token_ids: tuple[int, ...]
    ) -> bool:
        """Register a full, computed block under its prefix key. False if that key is already cached."""
        if not self.enable_caching:
            return False
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False  # same content computed twice concurrently: keep the first, this one stays private
        block.block_hash, block.parent, block.token_ids = block_hash, parent, token_ids
        block.serial = next(self._serials)
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the runner reloads weights)."""
        for block in self.blocks:
            block.block_hash = block.parent = block.token_ids = block.serial = None
        self._cached.clear()

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = block.parent = block.token_ids = block.serial = None
