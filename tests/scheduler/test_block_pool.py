import pytest

from scheduler.block_pool import BlockPool

PARENT = b"parent"


def key(n: int) -> bytes:
    """A stand-in prefix key (the pool never looks inside keys)."""
    return n.to_bytes(8, "big")


def cache(pool: BlockPool, block: int, n: int) -> bool:
    return pool.cache(block, key(n), PARENT, (n,))


def lookup(pool: BlockPool, n: int) -> int | None:
    return pool.lookup(key(n), PARENT, (n,))


def test_allocate_takes_distinct_blocks_and_free_returns_them():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert ids is not None and len(set(ids)) == 3
    assert (pool.num_free, pool.num_used) == (1, 3)
    pool.free(ids)
    assert (pool.num_free, pool.num_used) == (4, 0)


def test_allocate_answers_none_when_it_does_not_fit_and_changes_nothing():
    pool = BlockPool(2)
    assert pool.allocate(3) is None
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == [0, 1]
    assert pool.num_free == 0
    assert pool.allocate(1) is None


def test_shared_block_is_free_only_after_last_reference():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    assert cache(pool, block, 111)
    pool.share(block)
    assert pool.blocks[block].ref_count == 2
    pool.free([block])
    assert pool.num_free == 1
    pool.free([block])
    assert pool.num_free == 2


def test_double_free_raises():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([block])


def test_cached_block_stays_reusable_after_free_until_its_id_is_needed():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    cache(pool, block, 42)
    pool.free([block])
    assert lookup(pool, 42) == block
    pool.share(block)  # a prefix hit revives it
    assert pool.num_free == 1 and pool.blocks[block].ref_count == 1
    pool.free([block])
    pool.allocate(2)  # needs every id: the cached block is evicted
    assert lookup(pool, 42) is None
    assert pool.blocks[block].block_hash is None


def test_uncached_free_blocks_are_used_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    cache(pool, a, 1)
    pool.free([a, b, c])
    taken = pool.allocate(2)
    assert set(taken) == {b, c}
    assert lookup(pool, 1) == a


def test_cached_blocks_are_evicted_least_recently_used_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, block_hash in ((a, 1), (b, 2), (c, 3)):
        cache(pool, block, block_hash)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    pool.share(b)  # b used again: now the most recent once freed
    pool.free([b])
    assert pool.allocate(1) == [a]
    assert pool.allocate(1) == [c]
    assert lookup(pool, 2) == b


def test_same_prefix_cached_twice_keeps_the_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    assert cache(pool, a, 7)
    assert not cache(pool, b, 7)
    assert lookup(pool, 7) == a
    assert pool.blocks[b].block_hash is None


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    [block] = pool.allocate(1)
    assert not cache(pool, block, 5)
    assert lookup(pool, 5) is None


def test_reset_prefix_cache_forgets_everything():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    cache(pool, block, 5)
    pool.reset_prefix_cache()
    assert lookup(pool, 5) is None and pool.num_cached == 0


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_lookup_verifies_parent_and_tokens_behind_a_key():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    assert pool.cache(block, key(9), PARENT, (1, 2))
    assert pool.lookup(key(9), PARENT, (1, 2)) == block
    assert pool.lookup(key(9), PARENT, (1, 3)) is None  # same key, other tokens: a collision, no hit
    assert pool.lookup(key(9), b"other parent", (1, 2)) is None
