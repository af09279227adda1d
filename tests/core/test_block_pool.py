from __future__ import annotations

import pytest

from octavo.core.block_pool import BlockPool
from octavo.core.prefix_hash import extend_block_hashes, hash_block


def _in_use(pool: BlockPool) -> int:
    return sum(1 for b in range(pool.num_total_blocks) if pool.ref_cnt(b) > 0)


def test_allocate_and_free_keep_counts_exact():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert a == [0, 1, 2] and b == [3, 4]
    assert pool.num_free_blocks == 3 and _in_use(pool) == 5
    assert pool.usage == pytest.approx(5 / 8)
    pool.touch([1, 2])
    assert [pool.ref_cnt(i) for i in a] == [1, 2, 2]
    pool.free(a)
    assert [pool.ref_cnt(i) for i in a] == [0, 1, 1]
    assert pool.num_free_blocks + _in_use(pool) == 8
    pool.free([1, 2, *b])
    assert pool.num_free_blocks == 8 and _in_use(pool) == 0


def test_uncached_free_blocks_are_reused_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[0], b"h0")
    pool.free(blocks)
    # Uncached blocks jump to the front (each to the very front, so 3, 2, 1);
    # the cached one waits at the back.
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert pool.allocate(3) == [3, 2, 1]
    assert pool.cached_blocks() == {b"h0": 0}


def test_cached_blocks_survive_free_and_evict_lru_from_the_front():
    pool = BlockPool(3)
    ids = pool.allocate(3)
    for i, h in zip(ids, (b"a", b"b", b"c")):
        assert pool.cache_block(i, h)
    pool.free([2, 0, 1])  # order of freeing = order of eviction
    assert pool.free_block_ids() == [2, 0, 1]
    assert pool.cached_blocks() == {b"a": 0, b"b": 1, b"c": 2}

    # A hit revives a free cached block: out of the queue, ref 0 -> 1.
    assert pool.lookup(b"c") == 2
    pool.touch([2])
    assert pool.ref_cnt(2) == 1 and pool.free_block_ids() == [0, 1]
    pool.free([2])  # used again: now the most recently used
    assert pool.free_block_ids() == [0, 1, 2]

    assert pool.allocate(2) == [0, 1]
    assert pool.cached_blocks() == {b"c": 2}
    assert pool.lookup(b"a") is None and pool.block_hash(0) is None
    assert pool.block_hash(2) == b"c"


def test_duplicate_and_repeated_registration_are_ignored():
    pool = BlockPool(2)
    x, y = pool.allocate(2)
    assert pool.cache_block(x, b"h")
    assert not pool.cache_block(y, b"h")  # same content computed twice
    assert not pool.cache_block(x, b"other")
    assert pool.cached_blocks() == {b"h": x} and pool.block_hash(y) is None


def test_misuse_is_an_error():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_hash_chain_names_the_whole_prefix():
    tokens = list(range(40))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 16, 10)
    assert len(hashes) == 2  # only full blocks
    h0 = hash_block(None, tokens[:16])
    assert hashes == [h0, hash_block(h0, tokens[16:32])]
    # Same block tokens under another parent, or another salt, hash differently.
    assert hash_block(None, tokens[16:32]) != hashes[1]
    assert hash_block(None, tokens[:16], "tenant-a") != h0
    assert hash_block(None, tokens[:16]) == h0  # deterministic
    extend_block_hashes(hashes, tokens + [1] * 8, 16, 3)
    assert len(hashes) == 3 and hashes[2] == hash_block(hashes[1], tokens[32:] + [1] * 8)
