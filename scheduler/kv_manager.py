"""Per-sequence KV block tables on top of the block pool, with prefix-cache lookup and registration."""

from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.sequence import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a whole token prefix, built block by block (the parent hash covers everything before)."""
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of a sequence that holds no blocks yet.

        Only full blocks, and never the block holding the last token: at least one token is always
        computed, so the runner has logits to sample from.
        """
        if not self.enable_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._hashes(seq, max_blocks):
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None
    ) -> list[int] | None:
        """Make the block table cover num_computed_tokens + num_new_tokens (after the cached prefix).

        `cached` are prefix-cache hits from `find_cached_prefix`; on success they are shared, appended first,
        and their tokens count as computed. Returns the new block ids, or None (nothing changed) if they
        do not fit.
        """
        if not cached:
            if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
                return []  # the common decode step: the last block still has room
            cached = []
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        num_needed = self.blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(cached)
        num_needed = max(num_needed, 0)
        revived = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        if not self.pool.can_allocate(num_needed + revived):
            return None
        for block_id in cached:  # share first, so allocating below cannot evict a hit
            self.pool.share(block_id)
        new_blocks = self.pool.allocate(num_needed)
        assert new_blocks is not None  # checked above
        seq.block_table.extend(cached)
        seq.block_table.extend(new_blocks)
        seq.num_computed_tokens = num_computed
        seq.num_cached_blocks += len(cached)
        return new_blocks

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register blocks whose tokens are all computed, so later sequences can share them."""
        if not self.enable_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.pool.cache(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence; the tail first, so it is evicted before the shared head."""
        self.pool.free(list(reversed(seq.block_table)))
        seq.block_table.clear()
        seq.num_cached_blocks = 0

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of the first num_blocks full blocks (memoised: a sequence's tokens never change)."""
        hashes = seq.block_hashes
        size = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(chain_hash(parent, tuple(seq.token_ids[i * size : (i + 1) * size])))
        return hashes[:num_blocks]
