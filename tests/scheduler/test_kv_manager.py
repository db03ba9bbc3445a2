import pytest

from scheduler import kv_manager
from scheduler.kv_manager import KVCacheManager, chain_key, root_key
from scheduler.sequence import Sequence
from tests.scheduler.factories import make_request


def make_seq(seq_id="s", prompt_len=10, prompt=None, order=0, tenant="default"):
    return Sequence(make_request(seq_id, prompt_len, prompt=prompt, tenant=tenant), order)


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
    assert seq.block_table == () and seq.num_computed_tokens == 0
    assert kv.pool.num_free == 2


def test_free_releases_every_block():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = make_seq(prompt_len=10)
    kv.allocate(seq, 10)
    kv.free(seq)
    assert kv.pool.num_free == 4 and seq.block_table == ()


def test_prefix_hit_shares_full_computed_blocks_and_counts_them_computed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 11))
    first = computed_and_cached(kv, prompt)  # two full blocks; the third holds 2 tokens
    second = make_seq("b", prompt=prompt + [50, 51], order=1)
    hits = kv.find_cached_prefix(second)
    assert hits == list(first.block_table[:2])
    new = kv.allocate(second, 4, hits)
    assert second.num_computed_tokens == 8
    assert list(second.block_table[:2]) == hits and len(new) == 1
    assert kv.pool.blocks[hits[0]].ref_count == 2


def test_prefix_lookup_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 9))  # exactly two full blocks
    first = computed_and_cached(kv, prompt)
    same = make_seq("b", prompt=prompt, order=1)
    assert kv.find_cached_prefix(same) == list(first.block_table[:1])


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
    assert kv.pool.num_free == 3 and kv.find_cached_prefix(second) == hits  # nothing changed


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    prompt = list(range(1, 10))
    computed_and_cached(kv, prompt)
    assert kv.find_cached_prefix(make_seq("b", prompt=prompt, order=1)) == []


def test_keys_are_sha256_chained_and_salted_per_tenant():
    root_a, root_b = root_key("a"), root_key("b")
    assert len(root_a) == 32 and len({root_a, root_b, root_key(None)}) == 3
    assert chain_key(root_a, (1, 2)) != chain_key(root_b, (1, 2))
    assert chain_key(root_a, (1, 2)) != chain_key(root_a, (2, 1))
    assert chain_key(chain_key(root_a, (1,)), (2,)) != chain_key(root_a, (1, 2))


@pytest.mark.parametrize("share", [False, True])
def test_tenants_share_prefix_blocks_only_when_allowed(share):
    kv = KVCacheManager(num_blocks=8, block_size=4, share_across_tenants=share)
    prompt = list(range(1, 11))
    computed_and_cached(kv, prompt)  # tenant "default"
    same_tenant = make_seq("b", prompt=prompt, order=1)
    other_tenant = make_seq("c", prompt=prompt, order=2, tenant="other")
    assert len(kv.find_cached_prefix(same_tenant)) == 2
    assert len(kv.find_cached_prefix(other_tenant)) == (2 if share else 0)


def test_a_colliding_key_never_shares_other_tokens(monkeypatch):
    """Every key collides: only blocks whose parent and tokens really match are hits."""
    monkeypatch.setattr(kv_manager, "chain_key", lambda parent, tokens: b"same key for everything")
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed_and_cached(kv, list(range(1, 11)))
    other = make_seq("b", prompt=[7, 7, 7, 7, 8, 8, 8, 8, 9], order=1)
    assert kv.find_cached_prefix(other) == []
    same_first_block = make_seq("c", prompt=[1, 2, 3, 4, 9, 9, 9, 9, 9], order=2)
    assert len(kv.find_cached_prefix(same_first_block)) == 1  # its second block differs: no hit there


def test_blocks_needed_and_exclusive_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(1, 11))
    first = computed_and_cached(kv, prompt)
    assert kv.exclusive_blocks(first) == 3
    second = make_seq("b", prompt=prompt + [50, 51], order=1)
    hits = kv.find_cached_prefix(second)
    assert kv.blocks_needed(second, 4, hits) == 1  # hits are in use (not revived); one new block
    kv.allocate(second, 4, hits)
    assert kv.exclusive_blocks(first) == 1 and kv.exclusive_blocks(second) == 1


# ---- a model windowed on every layer: blocks behind the window are given back ----------------------


def test_blocks_wholly_behind_the_window_are_given_back_as_the_sequence_advances():
    kv = KVCacheManager(num_blocks=8, block_size=4, window=6)
    seq = make_seq(prompt_len=10)
    kv.allocate(seq, 10)
    first = seq.block_table
    seq.num_computed_tokens = 10  # next query at 10 sees keys 5..10: block 0 (0..3) is behind
    assert kv.release_behind_window(seq) == 1
    assert seq.block_table == (kv_manager.NO_BLOCK, *first[1:]) and kv.pool.num_free == 6
    assert kv.release_behind_window(seq) == 0  # nothing more until the window moves past a block
    seq.token_ids.extend([7] * 4)
    kv.allocate(seq, 4)
    seq.num_computed_tokens = 14  # keys 9..14: blocks 0 and 1 (4..7) are behind, block 2 (8..11) is not
    assert kv.release_behind_window(seq) == 1
    assert seq.block_table[:2] == (kv_manager.NO_BLOCK,) * 2 and kv.exclusive_blocks(seq) == 2
    kv.free(seq)  # only what it still holds
    assert kv.pool.num_free == 8


def test_without_a_window_nothing_is_given_back():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(prompt_len=20)
    kv.allocate(seq, 20)
    seq.num_computed_tokens = 20
    assert kv.release_behind_window(seq) == 0
    assert kv_manager.NO_BLOCK not in seq.block_table


def test_blocks_are_cached_before_they_are_given_back_and_hit_later():
    kv = KVCacheManager(num_blocks=16, block_size=4, window=4)
    prompt = list(range(3, 19))  # 16 tokens, 4 full blocks
    seq = computed_and_cached(kv, prompt)
    assert kv.release_behind_window(seq) == 3  # keys 12.. are seen: blocks 0..2 go, still cached
    later = make_seq("b", prompt=prompt + [99])
    hits = kv.find_cached_prefix(later)
    assert len(hits) == 4  # the chain survives: each given-back block kept its key
    assert kv.allocate(later, 1, hits) is not None and later.num_computed_tokens == 16


def test_a_sibling_shares_a_table_with_places_given_back():
    kv = KVCacheManager(num_blocks=8, block_size=4, window=4)
    prompt = list(range(3, 15))  # 12 tokens
    first = computed_and_cached(kv, prompt)
    kv.release_behind_window(first)
    shared = list(first.block_table)
    assert shared[0] == kv_manager.NO_BLOCK
    sibling = make_seq("b", prompt=prompt)
    used = kv.pool.num_used
    assert kv.blocks_needed(sibling, 0, shared) == 0
    assert kv.allocate(sibling, 0, shared) == [] and kv.pool.num_used == used  # no new block, no revive
    kv.free(sibling)
    kv.free(first)
    assert kv.pool.num_free == 8
