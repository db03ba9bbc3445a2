"""Per-sequence KV block tables on top of the block pool, with prefix-cache lookup and registration.

When every layer of the model attends within a sliding window, a sequence's blocks that fall wholly behind
the window are given back as it advances (vLLM's sliding-window manager does the same): its table keeps
their places as NO_BLOCK, so positions still index it, and a windowed model's long sequence holds about
window / block_size blocks, not its whole length. The runner reads NO_BLOCK places as any block (their
keys are outside every query's window, masked before the softmax).
"""

from __future__ import annotations

import hashlib
from array import array

from scheduler.block_pool import BlockPool
from scheduler.sequence import NO_BLOCK, Sequence

__all__ = ["NO_BLOCK", "KVCacheManager", "chain_key", "root_key"]

_DOMAIN = b"inferq/prefix-cache/v1\0"


def root_key(tenant: str | None, lora: str | None = None) -> bytes:
    """The parent key of a sequence's first block: one per tenant, or one shared by all when tenant is None;
    and one per LoRA adapter (None: the base model, whose keys are as they always were).

    Salting the root per tenant makes every key of one tenant differ from every key of another, so
    tenants never share KV blocks (and cannot probe each other's prompts through cache timing). An adapter
    changes every layer's keys and values, so the same prompt under two adapters shares nothing either.
    """
    salt = b"shared" if tenant is None else b"tenant\0" + tenant.encode()
    if lora is not None:
        salt += b"\0lora\0" + lora.encode()
    return hashlib.sha256(_DOMAIN + salt).digest()


def chain_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Key of a whole token prefix, built block by block: SHA-256 over the parent key and this block."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        share_across_tenants: bool = False,
        window: int | None = None,
    ) -> None:
        """`window`: set when every layer attends within a sliding window, the widest of them in tokens."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if window is not None and window <= 0:
            raise ValueError("window must be positive")
        self.block_size = block_size
        self.window = window
        self.enable_caching = enable_caching
        self.share_across_tenants = share_across_tenants
        self.pool = BlockPool(num_blocks, enable_caching)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def root(self, seq: Sequence) -> bytes:
        return root_key(None if self.share_across_tenants else seq.tenant, seq.lora)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of a sequence that holds no blocks yet.

        Only full blocks, and never the block holding the last token: at least one token is always
        computed, so the runner has logits to sample from (nor one holding `seq.logits_from` or later).
        Each hit is verified (parent key and tokens).
        """
        if not self.enable_caching or seq.block_table:
            return []
        last = seq.num_tokens - 1 if seq.logits_from is None else min(seq.num_tokens - 1, seq.logits_from)
        max_blocks = last // self.block_size
        hashes = self._hashes(seq, max_blocks)
        hits: list[int] = []
        parent: bytes | int | None = self.root(seq)
        for i, block_hash in enumerate(hashes):
            block_id = self.pool.lookup(block_hash, parent, self._block_tokens(seq, i))
            if block_id is None:
                break
            hits.append(block_id)
            parent = self.pool.blocks[block_id].serial
        return hits

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None) -> int:
        """Free blocks that `allocate(seq, num_new_tokens, cached)` would take (revived hits included)."""
        cached = cached or []
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        new = self.blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(cached)
        revived = sum(1 for b in cached if b != NO_BLOCK and self.pool.blocks[b].ref_count == 0)
        return max(new, 0) + revived

    def exclusive_blocks(self, seq: Sequence) -> int:
        """Blocks that would become free if this sequence released its table (shared ones stay used)."""
        return sum(1 for b in seq.block_table if b != NO_BLOCK and self.pool.blocks[b].ref_count == 1)

    def allocate(
        self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None
    ) -> list[int] | None:
        """Make the block table cover num_computed_tokens + num_new_tokens (after the cached prefix).

        `cached` are prefix-cache hits from `find_cached_prefix` (or a sibling's computed prompt blocks,
        NO_BLOCK places included); on success they are shared, appended first, and their tokens count as
        computed. Returns the new block ids, or None (nothing changed) if they
        do not fit.
        """
        if not cached:
            if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
                return []  # the common decode step: the last block still has room
            cached = []
        if not self.pool.can_allocate(self.blocks_needed(seq, num_new_tokens, cached)):
            return None
        num_computed = seq.num_computed_tokens + len(cached) * self.block_size
        num_new = max(self.blocks_for(num_computed + num_new_tokens) - len(seq.block_table) - len(cached), 0)
        for block_id in cached:  # share first, so allocating below cannot evict a hit
            if block_id != NO_BLOCK:
                self.pool.share(block_id)
        new_blocks = self.pool.allocate(num_new)
        assert new_blocks is not None  # checked above
        seq.block_table = (*seq.block_table, *cached, *new_blocks)
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
            if seq.block_table[i] == NO_BLOCK or (i and seq.block_table[i - 1] == NO_BLOCK):
                seq.num_cached_blocks = i  # given back before it was registered: the chain ends here
                return
            parent = self.pool.blocks[seq.block_table[i - 1]].serial if i else self.root(seq)
            if parent is None:  # the block before stayed private (its key was cached already): so do the rest
                seq.num_cached_blocks = i
                return
            self.pool.cache(seq.block_table[i], hashes[i], parent, self._block_tokens(seq, i))
        seq.num_cached_blocks = num_full

    def release_behind_window(self, seq: Sequence) -> int:
        """Give back the blocks wholly behind the window of the sequence's next token; how many.

        A query at position p sees keys p - window + 1 .. p, and no query comes before num_computed_tokens;
        one token more than that is kept."""
        if self.window is None or (seq.group is not None and seq.group.unforked):
            return 0  # (samples still to fork from this one will start behind it and read back there)
        behind = (seq.num_computed_tokens - self.window) // self.block_size
        table = seq.block_table
        if behind <= 0 or table[behind - 1] == NO_BLOCK:  # (given back as a prefix: done up to there)
            return 0
        gone = [b for b in table[:behind] if b != NO_BLOCK]
        if not gone:
            return 0
        self.pool.free(gone)
        seq.block_table = (NO_BLOCK,) * behind + table[behind:]
        return len(gone)

    def free(self, seq: Sequence) -> None:
        """Release every block of the sequence; the tail first, so it is evicted before the shared head."""
        self.pool.free([b for b in reversed(seq.block_table) if b != NO_BLOCK])
        seq.block_table = ()
        seq.num_cached_blocks = 0

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained keys of the first num_blocks full blocks (memoised: a sequence's tokens never change)."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else self.root(seq)
            hashes.append(chain_key(parent, self._block_tokens(seq, len(hashes))))
        return hashes[:num_blocks]
