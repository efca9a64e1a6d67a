"""Block pool accounting: no model, no tensors."""
import pytest

from kiln.plugins.paged_kv.block_pool import BlockPool

pytestmark = pytest.mark.unit


def alloc(pool, toks):
    return pool.allocate(toks, pool.hash_blocks(toks))


def test_allocate_free_counts():
    pool = BlockPool(8, 4)
    assert pool.num_free_blocks == 8
    table, cached = alloc(pool, list(range(10)))        # 3 blocks
    assert len(table) == 3 and cached == 0 and len(set(table)) == 3
    assert pool.stats().used_blocks == 3 and pool.num_free_blocks == 5
    assert pool.can_append(table, 12) and pool.blocks_for(12) == 3
    pool.may_append(table, 13)
    assert len(table) == 4
    pool.free(table)
    assert pool.num_free_blocks == 8 and pool.stats().used_blocks == 0


def test_cannot_allocate_beyond_pool():
    pool = BlockPool(4, 4)
    toks = list(range(17))                               # 5 blocks
    assert not pool.can_allocate(toks, pool.hash_blocks(toks))
    with pytest.raises(RuntimeError):
        alloc(pool, toks)
    small = list(range(8))
    assert pool.can_allocate(small, pool.hash_blocks(small), reserve=2)
    assert not pool.can_allocate(small, pool.hash_blocks(small), reserve=3)


def test_prefix_hit_shares_blocks_and_counts_refs():
    pool = BlockPool(16, 4)
    a = list(range(100, 110))                            # 2 full blocks + 2 tokens
    ta, _ = alloc(pool, a)
    pool.cache_blocks(ta, a, len(a))                     # computed: 2 full blocks hashed
    b = a[:8] + [7, 7, 7]                                # same first 2 blocks
    tb, cached = alloc(pool, b)
    assert cached == 8 and tb[:2] == ta[:2] and tb[2] != ta[2]
    assert pool.blocks[ta[0]].ref_count == 2
    pool.free(ta)
    assert pool.blocks[ta[0]].ref_count == 1 and pool.stats().cached_blocks == 0
    pool.free(tb)
    s = pool.stats()
    assert s.used_blocks == 0 and s.cached_blocks == 2 and s.free_blocks == 16
    assert s.prefix_hit_tokens == 8 and s.prefix_queried_tokens == 21


def test_hit_leaves_last_token_to_compute():
    pool = BlockPool(8, 4)
    a = list(range(8))
    ta, _ = alloc(pool, a)
    pool.cache_blocks(ta, a, 8)
    pool.free(ta)
    tb, cached = alloc(pool, a)                          # whole prompt cached
    assert cached == 4                                   # last block recomputed for logits


def test_only_computed_full_blocks_are_cached():
    pool = BlockPool(8, 4)
    a = list(range(10))
    ta, _ = alloc(pool, a)
    pool.cache_blocks(ta, a, 5)                          # one full block computed
    b = list(range(10))
    assert pool.cached_prefix_len(b, pool.hash_blocks(b)) == 4
    pool.cache_blocks(ta, a, 10)
    assert pool.cached_prefix_len(b, pool.hash_blocks(b)) == 8


def test_chained_hash_needs_whole_prefix():
    pool = BlockPool(8, 4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    ta, _ = alloc(pool, a)
    pool.cache_blocks(ta, a, 9)
    b = [0, 2, 3, 4, 5, 6, 7, 8, 9]                      # second block equal, first differs
    assert pool.cached_prefix_len(b, pool.hash_blocks(b)) == 0


def test_lru_eviction_of_unreferenced_cached_blocks():
    pool = BlockPool(4, 2)
    seqs = [[1, 1, 9], [2, 2, 9]]                        # 2 blocks each
    tables = []
    for s in seqs:
        t, _ = alloc(pool, s)
        pool.cache_blocks(t, s, 3)
        tables.append(t)
    pool.free(tables[0])                                 # [1,1] cached first (LRU)
    pool.free(tables[1])
    assert pool.stats().cached_blocks == 2 and pool.num_free_blocks == 4
    t, _ = alloc(pool, [5, 5, 5, 5, 5, 5])               # 3 blocks: 2 never used + 1 evicted
    assert len(t) == 3 and pool.stats().cached_blocks == 1
    hit = [1, 1, 9]
    assert pool.cached_prefix_len(hit, pool.hash_blocks(hit)) == 0     # evicted (oldest)
    hit = [2, 2, 9]
    assert pool.cached_prefix_len(hit, pool.hash_blocks(hit)) == 2     # still cached


def test_prefix_caching_off():
    pool = BlockPool(8, 4, prefix_caching=False)
    a = list(range(10))
    ta, _ = alloc(pool, a)
    pool.cache_blocks(ta, a, 10)
    pool.free(ta)
    _, cached = alloc(pool, a)
    assert cached == 0 and pool.stats().cached_blocks == 0


def test_double_free_is_caught():
    pool = BlockPool(4, 4)
    t, _ = alloc(pool, [1, 2])
    pool.free(t)
    with pytest.raises(AssertionError):
        pool.free(t)
