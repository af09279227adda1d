from __future__ import annotations

from core_harness import make_request

from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.prefix_hash import hash_block


def _compute(kv: KVCacheManager, req, n: int, computed=()) -> None:
    """Allocate like the scheduler does, mark the tokens computed, register."""
    assert kv.allocate_slots(req, n, computed)
    req.num_computed_tokens += (len(computed[0]) if computed else 0) * kv.block_size + n
    kv.cache_blocks(req)


def test_registered_blocks_carry_the_exact_hash_chain():
    kv = KVCacheManager(8, 16)
    a = make_request("a", 40)
    _compute(kv, a, 40)
    table = kv.get_block_ids(a)
    assert len(table) == 3
    h0 = hash_block(None, a.prompt_token_ids[:16])
    h1 = hash_block(h0, a.prompt_token_ids[16:32])
    assert kv.pool.cached_blocks() == {h0: table[0], h1: table[1]}  # the partial block is not

    # Outputs fill blocks too: 8 more computed tokens complete block 2.
    for t in range(8):
        a.append_output_token(t)
    _compute(kv, a, 8)
    h2 = hash_block(h1, a.all_token_ids[32:48])
    assert kv.pool.cached_blocks()[h2] == table[2]


def test_prefix_hit_and_the_last_token_cap():
    kv = KVCacheManager(8, 16)
    a = make_request("a", 32)
    _compute(kv, a, 32)
    kv.free(a)
    assert kv.num_free_blocks == 8

    longer = make_request("b", a.prompt_token_ids + [5, 6, 7])
    blocks, hit = kv.get_computed_blocks(longer)
    h0 = hash_block(None, a.prompt_token_ids[:16])
    h1 = hash_block(h0, a.prompt_token_ids[16:32])
    assert hit == 32
    assert blocks == [[kv.pool.lookup(h0), kv.pool.lookup(h1)]]

    same = make_request("c", list(a.prompt_token_ids))
    blocks, hit = kv.get_computed_blocks(same)
    assert hit == 16 and len(blocks[0]) == 1  # 31 tokens at most, so one full block

    scoring = make_request("d", list(a.prompt_token_ids) + [1], prompt_logprobs=0)
    assert kv.get_computed_blocks(scoring) == ([[]], 0)
    salted = make_request("e", list(a.prompt_token_ids) + [1])
    salted.cache_salt = "tenant-b"
    assert kv.get_computed_blocks(salted) == ([[]], 0)


def test_hits_are_counted_once_per_admission_in_tokens():
    kv = KVCacheManager(8, 16)
    a = make_request("a", 40)
    _compute(kv, a, 40)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (40, 0)
    b = make_request("b", list(a.prompt_token_ids))
    blocks, hit = kv.get_computed_blocks(b)
    _compute(kv, b, b.num_tokens - hit, blocks)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (80, 32)
    assert [kv.pool.ref_cnt(x) for x in kv.get_block_ids(b)] == [2, 2, 1]
    # Growing an admitted request is no new lookup.
    b.append_output_token(1)
    _compute(kv, b, 1)
    assert kv.prefix_cache_queries == 80
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_failed_allocation_changes_nothing_and_counts_free_hits():
    kv = KVCacheManager(4, 4)
    a = make_request("a", 12)
    _compute(kv, a, 12)  # 3 blocks, all full and cached
    kv.free(a)
    b = make_request("b", list(a.prompt_token_ids) + list(range(9)))  # 21 tokens: 6 blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 12 and kv.num_free_blocks == 4
    # The 3 hits are free blocks; only one truly fresh block remains, 3 needed.
    before = (kv.pool.free_block_ids(), kv.pool.cached_blocks())
    assert not kv.allocate_slots(b, 9, blocks)
    assert (kv.pool.free_block_ids(), kv.pool.cached_blocks()) == before
    assert kv.get_block_ids(b) == [] and kv.prefix_cache_queries == 12
    # 4 tokens need exactly the one fresh block: hits are taken before it.
    assert kv.allocate_slots(b, 4, blocks)
    assert [kv.get_block_ids(b)[:3]] == blocks and kv.num_free_blocks == 0
    kv.free(b)
    assert kv.num_free_blocks == 4


def test_fork_shares_and_copy_on_write_swaps_the_written_block():
    kv = KVCacheManager(8, 16)
    parent = make_request("p", 40)
    _compute(kv, parent, 40)
    child = make_request("c", list(parent.prompt_token_ids))
    kv.fork(parent, child)
    table = kv.get_block_ids(parent)
    assert kv.get_block_ids(child) == table
    assert [kv.pool.ref_cnt(b) for b in table] == [2, 2, 2]
    assert kv.num_free_blocks == 5

    child.num_computed_tokens = 39  # recompute the last prompt token
    assert kv.allocate_slots(child, 1)
    new = kv.get_block_ids(child)
    assert new[:2] == table[:2] and new[2] != table[2]
    assert kv.take_block_copies() == [(table[2], new[2])]
    assert kv.take_block_copies() == []
    assert [kv.pool.ref_cnt(b) for b in table] == [2, 2, 1]
    # The parent is now the only owner of its block: it writes in place.
    parent.append_output_token(3)
    assert kv.allocate_slots(parent, 1)
    assert kv.get_block_ids(parent) == table and kv.take_block_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_decode_takes_a_block_only_where_its_slots_or_lookahead_cross_into_one():
    kv = KVCacheManager(8, 4)
    a = make_request("a", 6)
    _compute(kv, a, 6)  # blocks 0-1, two slots of the second free
    table = kv.get_block_ids(a)
    for token in (1, 2):  # positions 6 and 7: inside the blocks held
        a.append_output_token(token)
        _compute(kv, a, 1)
        assert kv.get_block_ids(a) == table and kv.num_free_blocks == 6
    a.append_output_token(3)  # position 8 starts a third block
    _compute(kv, a, 1)
    assert kv.get_block_ids(a)[:2] == table and len(kv.get_block_ids(a)) == 3 and kv.num_free_blocks == 5
    # Position 9 fits, but 3 scratch slots after it reach a fourth block.
    a.append_output_token(4)
    assert kv.allocate_slots(a, 1, num_lookahead_tokens=3)
    assert len(kv.get_block_ids(a)) == 4 and kv.num_free_blocks == 4
    kv.free(a)
    assert kv.num_free_blocks == 8


def test_freeing_a_request_drops_its_pending_copies():
    kv = KVCacheManager(4, 4)
    parent = make_request("p", 6)
    _compute(kv, parent, 6)
    child = make_request("c", list(parent.prompt_token_ids))
    kv.fork(parent, child)
    child.num_computed_tokens = 5
    assert kv.allocate_slots(child, 1)
    kv.free(child)
    assert kv.take_block_copies() == []
    kv.free(parent)
    assert kv.num_free_blocks == 4


def test_prefix_caching_off_registers_and_hits_nothing():
    kv = KVCacheManager(8, 16, enable_prefix_caching=False)
    a = make_request("a", 40)
    _compute(kv, a, 40)
    kv.free(a)
    assert kv.pool.cached_blocks() == {}
    assert kv.get_computed_blocks(make_request("b", list(a.prompt_token_ids))) == ([[]], 0)
    assert kv.prefix_cache_queries == 0


def test_a_freed_request_queues_its_tail_blocks_for_eviction_first():
    kv = KVCacheManager(6, 4)
    a = make_request("a", 12)
    _compute(kv, a, 12)
    table = kv.get_block_ids(a)
    kv.free(a)
    # Never-used blocks are reused first; then a's deepest block, its root last.
    assert kv.pool.free_block_ids() == [3, 4, 5] + table[::-1]
