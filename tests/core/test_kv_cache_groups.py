"""KV cache groups in the scheduler: per-group tables, sliding-window release,
prefix hits that need only the last window, admission by what groups hold."""
from __future__ import annotations

import pytest
from core_harness import Run, make_request, make_scheduler, reference_tokens

from octavo.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.scheduler import Scheduler


def _grow(kv: KVCacheManager, req, n: int) -> None:
    """Allocate n more tokens as the scheduler does, compute and register them."""
    assert kv.allocate_slots(req, n)
    req.num_computed_tokens += n
    kv.cache_blocks(req)


@pytest.mark.parametrize("chunk", [1, 7])
def test_a_window_group_holds_one_window_of_blocks_over_300_tokens(chunk):
    window, bs = 20, 4
    kv = KVCacheManager(64, bs, windows=(window,))
    req = make_request("a", 50)
    while req.num_computed_tokens < req.num_tokens:  # the prompt in chunks
        _grow(kv, req, min(chunk, req.num_tokens - req.num_computed_tokens))
    most = 0
    for t in range(300):
        req.append_output_token(t % 50)
        _grow(kv, req, 1)
        most = max(most, kv.num_held_blocks(req))
        table = kv.get_block_ids(req)
        assert kv.num_held_blocks(req) <= -(-window // bs) + 1
        # The released entries are the null block; the window's blocks are real.
        unread = max(0, req.num_computed_tokens - window) // bs
        assert table[:unread] == [kv.null_block] * unread and kv.null_block not in table[unread:]
    assert most == -(-window // bs) + 1
    kv.free(req)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_full_and_window_groups_keep_their_own_tables():
    kv = KVCacheManager(64, 4, windows=(None, 8))
    req = make_request("a", 40)
    for _ in range(5):
        _grow(kv, req, 8)
    full, windowed = kv.get_block_ids(req, 0), kv.get_block_ids(req, 1)
    assert len(full) == len(windowed) == 10 and kv.null_block not in full
    assert not set(full) & set(windowed)
    # The last chunk started at 32: its queries read from position 25 on (block 6).
    assert windowed[:6] == [kv.null_block] * 6 and kv.null_block not in windowed[6:]
    assert kv.num_held_blocks(req) == 10 + 4
    kv.free(req)
    assert kv.num_free_blocks == 64


def test_a_prefix_hit_in_a_window_group_needs_only_the_last_window():
    bs, window = 4, 8
    kv = KVCacheManager(40, bs, windows=(None, window))
    a = make_request("a", 40)
    released = []  # the window group's blocks, in the order they were released
    for _ in range(10):
        before = kv.get_block_ids(a, 1)
        _grow(kv, a, 4)
        released += [b for b, now in zip(before, kv.get_block_ids(a, 1)) if now == kv.null_block and b != now]
    full = kv.get_block_ids(a, 0)
    last = kv.get_block_ids(a, 1)[8:]
    kv.free(a)
    # Reuse the window group's early blocks (freed first, so evicted first).
    free = kv.pool.free_block_ids()
    filler = kv.pool.allocate(max(free.index(b) for b in released) + 1)

    b = make_request("b", a.prompt_token_ids + [1, 2, 3])
    tables, hit = kv.get_computed_blocks(b)
    # Block 10 would need position 33 on: blocks 8 and 9, still cached.
    assert hit == 40
    assert tables == [full, [kv.null_block] * 8 + last]

    # A prompt that shares only 30 tokens: the full group could resume after 7
    # blocks, but the window group's blocks 5 and 6 are gone, and so is every
    # shorter window: no hit at all.
    c = make_request("c", a.prompt_token_ids[:30] + [5] * 10)
    assert kv.get_computed_blocks(c) == ([[], []], 0)

    kv.pool.free(filler)
    assert kv.allocate_slots(b, 3, tables)
    assert kv.num_held_blocks(b) == 10 + 2 + 1 + 1
    kv.free(b)


def test_window_groups_admit_what_full_tables_would_not():
    """Two requests of 130 tokens need 66 blocks of 4 with whole tables, a few each when a window group of 8
    keeps only its window: 36 blocks run both without a preemption, and their tokens equal the reference
    of a model that reads the last 8 positions."""
    sched, runner = make_scheduler(num_blocks=36, block_size=4, max_num_batched_tokens=16, windows=(8,))
    reqs = [make_request(f"r{i}", 30, max_tokens=100) for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner).until_done()
    assert sched.num_preemptions == 0
    for r in reqs:
        assert run.tokens[r.request_id] == reference_tokens(r.prompt_token_ids, 100, r.request_id, (8,))


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_hybrid_groups_under_preemption_and_prefix_hits(prefix_caching):
    windows = (None, 6)
    sched, runner = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=10,
                                   enable_prefix_caching=prefix_caching, windows=windows)
    shared = make_request("s", 25).prompt_token_ids
    reqs = [make_request(f"r{i}", shared + [i] * (3 + i), max_tokens=14) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    run = Run(sched, runner).until_done()
    assert sched.num_preemptions > 0
    for r in reqs:
        assert run.tokens[r.request_id] == reference_tokens(r.prompt_token_ids, 14, r.request_id, windows)
    if prefix_caching:
        assert sched.prefix_cache_hits > 0


def test_bad_windows_are_a_value_error():
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(8, 4, windows=(0,))
    with pytest.raises(ValueError, match="windows"):
        KVCacheManager(8, 4, windows=())


def test_with_a_draft_model_no_group_releases_blocks():
    """A draft model's cache is indexed by the first group's tables and reads them whole."""
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 32, 128,
                      SpeculativeConfig(speculative_model="draft"), kv_cache_windows=(8, None))
    assert sched.kv_cache_manager.windows == (None, None)
