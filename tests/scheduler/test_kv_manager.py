from scheduler.kv_manager import KVCacheManager
from scheduler.sequence import Sequence
from tests.scheduler.factories import make_request


def make_seq(seq_id="s", prompt_len=10, prompt=None, order=0):
    return Sequence(make_request(seq_id, prompt_len, prompt=prompt), order)


def computed_and_cached(kv: KVCacheManager, prompt: list[int]):
    """A sequence whose whole prompt was computed, with its full blocks entered in the prefix cache."""
    seq = make_seq("a", prompt=prompt)
    kv.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    kv.cache_full_blocks(seq)
    return seq


def test_allocate_covers_the_tokens_and_grows_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(prompt_len=10)
    assert len(kv.allocate(seq, 10)) == 3
    seq.num_computed_tokens = 10
    seq.token_ids.append(99)
    assert kv.allocate(seq, 1) == []  # token 11 still fits the third block
    seq.num_computed_tokens = 11
    seq.token_ids.extend([99, 99])
    assert len(kv.allocate(seq, 2)) == 1  # tokens 12..13 need a fourth
    assert len(seq.block_table) == 4


def test_allocate_that_does_not_fit_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    seq = make_seq(prompt_len=10)
    assert kv.allocate(seq, 10) is None
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert kv.pool.num_free == 2


def test_free_releases_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = make_seq(prompt_len=10)
    kv.allocate(seq, 10)
    kv.free(seq)
    assert kv.pool.num_free == 4 and seq.block_table == []


def test_prefix_hit_shares_full_computed_blocks_and_counts_them_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 11))
    first = computed_and_cached(kv, prompt)  # two full blocks; the third holds 2 tokens
    second = make_seq("b", prompt=prompt + [50, 51], order=1)
    hits = kv.find_cached_prefix(second)
    assert hits == first.block_table[:2]
    new = kv.allocate(second, 4, hits)
    assert second.num_computed_tokens == 8
    assert second.block_table[:2] == hits and len(new) == 1
    assert kv.pool.blocks[hits[0]].ref_count == 2


def test_prefix_lookup_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 9))  # exactly two full blocks
    first = computed_and_cached(kv, prompt)
    same = make_seq("b", prompt=prompt, order=1)
    assert kv.find_cached_prefix(same) == first.block_table[:1]


def test_only_computed_blocks_are_cached():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(prompt_len=12)
    kv.allocate(seq, 12)
    seq.num_computed_tokens = 7
    kv.cache_full_blocks(seq)
    assert kv.pool.num_cached == 1
    seq.num_computed_tokens = 12
    kv.cache_full_blocks(seq)
    assert kv.pool.num_cached == 3


def test_cached_blocks_survive_the_owner_and_a_hit_revives_them():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(1, 10))
    first = computed_and_cached(kv, prompt)
    kv.free(first)
    assert kv.pool.num_free == 4
    second = make_seq("b", prompt=prompt, order=1)
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2
    kv.allocate(second, 1, hits)
    assert kv.pool.num_used == 3 and second.num_computed_tokens == 8


def test_hit_blocks_are_counted_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    prompt = list(range(1, 10))
    first = computed_and_cached(kv, prompt)
    kv.free(first)
    second = make_seq("b", prompt=prompt + list(range(20, 28)), order=1)  # 17 tokens: 5 blocks
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2
    assert kv.allocate(second, 9, hits) is None  # 2 revived + 3 new > 3 free
    assert kv.pool.num_free == 3 and kv.pool.lookup(kv.pool.blocks[hits[0]].block_hash) == hits[0]


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    prompt = list(range(1, 10))
    computed_and_cached(kv, prompt)
    assert kv.find_cached_prefix(make_seq("b", prompt=prompt, order=1)) == []
