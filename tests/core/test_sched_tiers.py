"""The scheduler over a pool with tiers below it (octavo/kv_offload/index.py),
driven by the fake runner with fake tiers that move its token-id "K/V"
exactly as the step's moves say: a move applied out of order, a load from
the wrong slot or file, a block reused before it was saved or read before
its load ended all change the output, which must equal the reference of a
run without any cache. Loads from disk may end steps later or fail: the
request waits meanwhile, or computes the blocks a failure left out."""
from __future__ import annotations

import random
from typing import Optional

import pytest
from core_harness import FakeRunner, Run, make_request, reference_tokens

from octavo.config import CacheConfig, SchedulerConfig
from octavo.core.outputs import ModelRunnerOutput, SchedulerOutput
from octavo.core.prefix_hash import extend_block_hashes
from octavo.core.scheduler import Scheduler
from octavo.kv_events import BlockRemoved, BlockStored, decode_batch, encode_batch
from octavo.kv_offload.index import TierIndex
from octavo.kv_offload.transfers import (DELETE_FILE, FROM_DISK, FROM_HOST, HOST_TO_DISK, TO_DISK, TO_HOST,
                                         BlockKey, KVTransfer, TierLayout, TierReport)


class TieredRunner(FakeRunner):
    """The fake runner plus host slots and files, applying each step's moves
    first. A load from disk copies the file when its move is applied and
    fills its block at the end of a step's moves, that step's or, while
    ``hold`` is set, a later one's (as reads that take a while would);
    files named in ``unreadable`` fail to load."""

    def __init__(self, num_blocks: int, block_size: int, windows: tuple[Optional[int], ...] = (None,)) -> None:
        super().__init__(num_blocks, block_size, windows)
        self.host: dict[int, list[Optional[int]]] = {}
        self.disk: dict[BlockKey, list[Optional[int]]] = {}
        self.reading: list[tuple[int, BlockKey, list[Optional[int]]]] = []
        self.hold = False
        self.unreadable: set[BlockKey] = set()

    def apply(self, transfers: list[KVTransfer]) -> None:
        for t in transfers:
            if t.op == TO_HOST:
                self.host[t.slot] = list(self.slots[t.block_id])
            elif t.op == TO_DISK:
                self.disk[t.key] = list(self.slots[t.block_id])
            elif t.op == HOST_TO_DISK:
                self.disk[t.key] = list(self.host[t.slot])
            elif t.op == FROM_HOST:
                self.slots[t.block_id] = list(self.host[t.slot])
            elif t.op == FROM_DISK:
                self.reading.append((t.block_id, t.key, list(self.disk[t.key])))
            else:
                assert t.op == DELETE_FILE
                del self.disk[t.key]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.apply(out.kv_transfers)
        report = TierReport()
        if not self.hold:
            for block_id, key, content in self.reading:
                if key in self.unreadable:
                    report.failed.append(block_id)
                else:
                    self.slots[block_id] = content
                    report.loaded.append(block_id)
            self.reading = []
        result = super().execute(out)
        result.kv_tiers = report
        return result


def _tiered(num_blocks: int, block_size: int, host_blocks: int, disk_blocks: int,
            windows: tuple[Optional[int], ...] = (None,)) -> tuple[Scheduler, TieredRunner, TierIndex]:
    index = TierIndex([TierLayout(host_blocks, disk_blocks, 100, [])], block_size)
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=block_size), num_blocks, 4096,
                      kv_cache_windows=windows, kv_offload=index)
    return sched, TieredRunner(num_blocks, block_size, windows), index


def _assert_tiers_match(runner: TieredRunner, index: TierIndex) -> None:
    """Nothing held below the pool that the index does not know of, and the reverse."""
    assert sorted(runner.host) == sorted(index.host_slots().values())
    assert sorted(runner.disk) == sorted(index.disk_blocks())


def test_evicted_prefixes_come_back_from_host_and_disk():
    sched, runner, index = _tiered(num_blocks=6, block_size=4, host_blocks=3, disk_blocks=6)
    run = Run(sched, runner)
    # 3 prompts of 4 full blocks: 12 blocks, more than the pool holds, fewer than pool and tiers do.
    prompts = {f"p{i}": make_request(f"p{i}", 17).prompt_token_ids for i in range(3)}
    # After the first three, p1's blocks are in host memory and p0's on disk.
    order = ["p0", "p1", "p2", "p1", "p0", "p2", "p1"]
    for turn, name in enumerate(order):
        rid = f"{name}-{turn}"
        sched.add_request(make_request(rid, prompts[name], max_tokens=2))
        run.until_done()
        assert run.tokens[rid] == reference_tokens(prompts[name], 2, rid)
        _assert_tiers_match(runner, index)
    # Each returning turn finds its 4 full blocks, in the pool or below it.
    assert sched.prefix_cache_hits == 4 * 16
    assert index.hits["cpu"] > 0 and index.hits["disk"] > 0
    assert sum(index.hits.values()) <= sched.prefix_cache_hits
    assert len(index.disk_blocks()) <= 6 and len(index.host_slots()) <= 3


def test_the_pool_s_own_hits_survive_the_room_made_for_tier_hits():
    """A prompt whose first block is still a free cached pool block (next in
    line for reuse) and whose next blocks are below the pool: loading those
    must not evict the first."""
    sched, runner, index = _tiered(num_blocks=4, block_size=4, host_blocks=4, disk_blocks=0)
    run = Run(sched, runner)
    a = make_request("a", 13, max_tokens=1)
    sched.add_request(a)
    run.until_done()  # blocks 0-2 cached; the prompt's 4th block holds 1 token
    other = make_request("o", 12, max_tokens=1)
    sched.add_request(other)
    run.until_done()  # reuses the 4th block and a's 3rd and 2nd: those go to the host tier
    pool = sched.kv_cache_manager.pool
    assert len(index.host_slots()) == 2
    first = pool.free_block_ids()[0]
    assert pool.block_hash(first) is not None  # a's first block, the next to be reused
    again = make_request("a2", a.prompt_token_ids, max_tokens=3)
    sched.add_request(again)
    run.until_done()
    assert [o.num_cached_tokens for o in run.outputs if o.request_id == "a2"][0] == 12
    assert run.tokens["a2"] == reference_tokens(a.prompt_token_ids, 3, "a2")
    assert index.hits["cpu"] == 8


def test_an_earlier_run_s_files_are_adopted_when_every_rank_has_them():
    """Files are blocks of one KV cache group each: the same hash in another group is another block."""
    h = bytes([1]) * 32
    a, b, c, d = (h, 0), (h, 1), (bytes([3]) * 32, 0), (bytes([4]) * 32, 1)
    index = TierIndex([TierLayout(0, 2, 10, [a, b, c]), TierLayout(0, 3, 10, [b, c, d])], 16)
    assert index.disk_blocks() == [b, c]
    assert index.tier_of(b) == "disk" and index.tier_of(a) is None
    # a and d are half blocks (one rank each): deleted in the first step.
    assert index.take_transfers() == [KVTransfer(DELETE_FILE, block_hash=h, group=0),
                                      KVTransfer(DELETE_FILE, block_hash=d[0], group=1)]
    assert index.bytes_held() == {"cpu": 0, "disk": 2 * 20}
    small = TierIndex([TierLayout(0, 1, 10, [a, b, c])], 16)
    assert small.disk_blocks() == [c]  # the newest that fit


def test_persist_leaves_host_and_pool_blocks_on_disk_and_events_name_the_medium():
    """Events describe group 0's blocks, as the pool's do: a router asks about prefixes, which every group caches."""
    h = [bytes([i]) * 32 for i in range(6)]
    index = TierIndex([TierLayout(2, 3, 10, [])], 16)
    index.enable_events()
    index.evicted((h[0], 0), 0)
    index.evicted((h[1], 0), 1)
    index.evicted((h[2], 0), 2)  # spills h[0]
    assert index.take_transfers() == [KVTransfer(TO_HOST, 0, 0), KVTransfer(TO_HOST, 1, 1),
                                      KVTransfer(HOST_TO_DISK, slot=0, block_hash=h[0]), KVTransfer(TO_HOST, 2, 0)]
    index.load((h[1], 0), 5)
    index.evicted((h[1], 0), 5)  # back to its slot
    index.evicted((h[5], 1), 3)  # another group's block: moved (h[2] spills), no event of its own
    assert index.take_transfers()[-2:] == [KVTransfer(HOST_TO_DISK, slot=0, block_hash=h[2]), KVTransfer(TO_HOST, 3, 0)]
    events = index.take_events()
    assert not any(h[5] in e.block_hashes for e in events)
    _, batch = decode_batch(encode_batch(events, 0))  # as the engine publishes them
    assert batch.events == events
    assert BlockRemoved([h[0]], medium="cpu") in events
    assert [e.block_hashes for e in events if isinstance(e, BlockStored) and e.medium == "disk"] == [[h[0]], [h[2]]]
    moves = index.persist([((h[3], 0), 7), ((h[4], 0), 8)])
    # Three files at most: the newest three of host (h1, then h5 of group 1) then pool (h3, h4).
    assert index.disk_blocks() == [(h[5], 1), (h[3], 0), (h[4], 0)]
    assert KVTransfer(HOST_TO_DISK, slot=0, block_hash=h[5], group=1) in moves
    assert KVTransfer(TO_DISK, 8, block_hash=h[4]) in moves
    assert KVTransfer(DELETE_FILE, block_hash=h[0]) in moves


def _evict_to_disk(sched: Scheduler, run: Run, prompt: list[int], tag: str) -> None:
    """Run ``prompt``, then two others that take the whole pool: its blocks go to disk (no host tier)."""
    sched.add_request(make_request(f"{tag}-first", prompt, max_tokens=1))
    run.until_done()
    for i in range(2):
        sched.add_request(make_request(f"{tag}-filler{i}", 17, max_tokens=1))
        run.until_done()


def test_a_request_loading_from_disk_waits_while_other_requests_run():
    sched, runner, index = _tiered(num_blocks=8, block_size=4, host_blocks=0, disk_blocks=16)
    run = Run(sched, runner)
    prompt = make_request("p", 17).prompt_token_ids
    _evict_to_disk(sched, run, prompt, "a")
    runner.hold = True  # the files take a while to read
    sched.add_request(make_request("back", prompt, max_tokens=2))
    sched.add_request(make_request("other", 9, max_tokens=6))  # behind it in the queue
    for _ in range(4):
        step = run.step()
        assert [s.request_id for s in step.scheduled] == ["other"] and step.kv_loads_in_flight
    assert sched.kv_cache_manager.is_loading(sched.get_request("back"))
    assert len(run.tokens["other"]) == 4 and "back" not in run.tokens
    runner.hold = False
    run.until_done()
    assert run.tokens["back"] == reference_tokens(prompt, 2, "back")
    other_prompt = make_request("other", 9).prompt_token_ids  # derived from the id alone
    assert run.tokens["other"] == reference_tokens(other_prompt, 6, "other")
    assert [o.num_cached_tokens for o in run.outputs if o.request_id == "back"][0] == 16
    assert index.hits == {"cpu": 0, "disk": 16}
    _assert_tiers_match(runner, index)


def test_a_file_that_cannot_be_read_is_a_miss_and_is_forgotten():
    sched, runner, index = _tiered(num_blocks=8, block_size=4, host_blocks=0, disk_blocks=16)
    run = Run(sched, runner)
    prompt = make_request("p", 17).prompt_token_ids
    _evict_to_disk(sched, run, prompt, "a")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 4, 4)
    runner.unreadable = {(hashes[2], 0)}
    sched.kv_cache_manager.enable_events()
    sched.add_request(make_request("back", prompt, max_tokens=3))
    run.until_done()
    # A router learns the file is gone, and that the blocks read are in the pool (with their tokens).
    events = sched.kv_cache_manager.take_events()
    assert BlockRemoved([hashes[2]], medium="disk") in events
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium is None and e.block_hashes[0] in hashes]
    assert [e.block_hashes for e in stored[:3]] == [[hashes[0]], [hashes[1]], [hashes[3]]]
    assert stored[2].parent_block_hash == hashes[2] and stored[2].token_ids == prompt[12:16]
    assert run.tokens["back"] == reference_tokens(prompt, 3, "back")
    # Blocks 0 and 1 came back, block 2 failed; block 3 loaded too, but a hit is a run from the start.
    assert [o.num_cached_tokens for o in run.outputs if o.request_id == "back"][0] == 8
    assert index.errors == {"read": 1, "write": 0} and index.tier_of((hashes[2], 0)) is None
    _assert_tiers_match(runner, index)


def test_an_aborted_loading_request_leaves_its_blocks_held_until_the_load_ends():
    """The workers write a block being loaded whenever its read ends: it must
    not go back to the pool (and to another request) before."""
    sched, runner, index = _tiered(num_blocks=8, block_size=4, host_blocks=0, disk_blocks=16)
    run = Run(sched, runner)
    prompt = make_request("p", 17).prompt_token_ids
    _evict_to_disk(sched, run, prompt, "a")
    runner.hold = True
    sched.add_request(make_request("back", prompt, max_tokens=2))
    run.step()
    sched.abort_requests("back")
    kv = sched.kv_cache_manager
    assert kv.loads_in_flight and kv.num_free_blocks == 4 and sched.has_unfinished_requests()
    run.step()  # still reading
    assert kv.num_free_blocks == 4
    runner.hold = False
    run.until_done()
    assert not kv.loads_in_flight and kv.num_free_blocks == kv.num_total_blocks
    # What was read is registered all the same: the next request hits it in the pool.
    sched.add_request(make_request("again", prompt, max_tokens=2))
    run.until_done()
    assert run.tokens["again"] == reference_tokens(prompt, 2, "again")
    assert [o.num_cached_tokens for o in run.outputs if o.request_id == "again"][0] == 16
    assert index.hits["disk"] == 16


WINDOWS = (None, 8)  # a full-attention group and a group of window 8 (two blocks of 4)


def test_a_window_group_loads_only_the_blocks_of_its_last_window():
    """A 33-token prompt comes back after the pool evicted all of it: the full
    group loads its 8 blocks from host memory, the window group only the 2
    that queries from position 32 on read (positions 25-31)."""
    sched, runner, index = _tiered(num_blocks=20, block_size=4, host_blocks=64, disk_blocks=0, windows=WINDOWS)
    run = Run(sched, runner)
    prompt = make_request("p", 33).prompt_token_ids
    sched.add_request(make_request("first", prompt, max_tokens=2))
    run.until_done()
    for i in range(3):  # each takes most of the pool
        sched.add_request(make_request(f"filler{i}", 33, max_tokens=2))
        run.until_done()
    hashes: list[bytes] = []
    extend_block_hashes(hashes, prompt, 4, 8)
    pool = sched.kv_cache_manager.pool
    assert all(pool.lookup(h, g) is None for h in hashes for g in range(2))
    before = set(index.host_slots())  # a load from host memory frees its slot; nothing else leaves this tier
    sched.add_request(make_request("back", prompt, max_tokens=3))
    run.until_done()
    assert run.tokens["back"] == reference_tokens(prompt, 3, "back", WINDOWS)
    assert [o.num_cached_tokens for o in run.outputs if o.request_id == "back"][0] == 32
    loaded = before - set(index.host_slots())
    assert loaded == {(h, 0) for h in hashes} | {(hashes[6], 1), (hashes[7], 1)}
    assert index.hits == {"cpu": 4 * 10, "disk": 0}
    _assert_tiers_match(runner, index)


@pytest.mark.parametrize("windows", [(None,), WINDOWS, (8,), (None, 8, 12)])
def test_random_traffic_over_a_tiny_pool_and_tiers_gives_the_reference(windows):
    """Every KV cache group's blocks go down as the pool evicts them and come
    back as each group's hit rule asks, from host memory and from disk
    (loads that end steps later included), through tiers too small to keep
    them all: outputs equal the reference, the tiers hold what the index
    says, and every block returns to the pool."""
    rng = random.Random(11)
    sched, runner, index = _tiered(num_blocks=12 * len(windows), block_size=4, host_blocks=8,
                                   disk_blocks=12 * len(windows), windows=windows)
    run = Run(sched, runner)
    bases = [make_request(f"base{i}", 40).prompt_token_ids for i in range(5)]
    want = {}
    for i in range(40):
        prompt = rng.choice(bases)[: rng.randrange(9, 41)] + [rng.randrange(97) for _ in range(rng.randrange(3))]
        rid = f"r{i}"
        sched.add_request(make_request(rid, prompt, max_tokens=rng.randrange(1, 6)))
        want[rid] = (prompt, sched.get_request(rid).sampling_params.max_tokens)
        runner.hold = rng.random() < 0.3
        if rng.random() < 0.5:
            run.step()
            runner.hold = False
            run.until_done()
    runner.hold = False
    run.until_done()
    for rid, (prompt, n) in want.items():
        assert run.tokens[rid] == reference_tokens(prompt, n, rid, windows), rid
    _assert_tiers_match(runner, index)
    assert index.hits["cpu"] > 0 and index.hits["disk"] > 0
    held = [*index.host_slots(), *index.disk_blocks()]
    assert {g for _, g in held} == set(range(len(windows)))  # every group's blocks went down
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not kv.loads_in_flight
