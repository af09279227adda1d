"""Per-request block tables over a BlockPool: prefix hits, growth, forks,
copy-on-write, registration of computed blocks, and the release of blocks
that sliding-window layers will never read again.

KV cache groups: the layers that keep the same positions form a group
(octavo/attention/kv_groups.py), and a request has one block table per
group, every group's blocks drawn from the one pool. ``windows`` gives each
group's sliding window, None for a group that keeps every position (full
attention, or any cache read whole). A window group frees a block once every
query still to come lies a window or more past its last position; its table
entry becomes ``null_block``, an id past the pool (the worker's spare block),
which attention never reads. A prefix hit in a window group needs only the
blocks of the last window before the hit. A model with one kind of layer is
one group: one table per request, as if groups did not exist.

The KV tiers below the pool (octavo/kv_offload/) keep every group's blocks as
the pool evicts them, each under its prefix hash and group; a prefix hit runs
through them by the same rule, and only the blocks each group needs are
loaded back."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from octavo.core.block_pool import BlockPool
from octavo.core.prefix_hash import BlockHash, extend_block_hashes
from octavo.core.request import Request
from octavo.kv_events import BlockStored, KVEvent
from octavo.kv_offload.index import TierIndex
from octavo.kv_offload.transfers import HOST, KVTransfer, TierReport

_IN_TIER = -1  # a prefix lookup's entry for a block that is not in the pool but in a tier below it


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Load:
    """A pool block being filled from disk: the request whose hit it extends
    (None once that request left), the block's hash and KV cache group, and
    what the KV event of the block's registration names (its parent's hash,
    its tokens)."""

    request_id: Optional[str]
    block_hash: BlockHash
    group: int
    parent: Optional[BlockHash]
    token_ids: list[int]


class KVCacheManager:
    """Block tables hold the K/V of ``request.all_token_ids`` in order; block
    ``i`` of a table covers positions ``i*block_size .. (i+1)*block_size - 1``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[Optional[int]] = (None,), offload: Optional[TierIndex] = None) -> None:
        """``windows``: per KV cache group, its sliding window (None: it keeps every position);
        ``offload``: the tiers below the pool, which keep the blocks it evicts."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows:
            raise ValueError("windows must list at least one KV cache group")
        for window in windows:
            if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
                raise ValueError(f"windows: a sliding window must be an integer >= 1 or None, got {window!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self._windowed = any(w is not None for w in self.windows)  # else nothing is ever released
        self.pool = BlockPool(num_blocks, len(self.windows))
        self.null_block = num_blocks
        self._tables: dict[str, list[list[int]]] = {}  # request id -> one table per group
        # Per request and group: how many leading entries are null_block (released or never taken).
        self._released: dict[str, list[int]] = {}
        self.offload = offload
        if offload is not None:
            self.pool.on_evict = offload.evicted
        self._loads: dict[int, _Load] = {}  # pool block -> its load from disk, until the workers report it
        self._staged: dict[str, list[int]] = {}  # a loading request -> the blocks its hit holds meanwhile
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []
        # Cumulative, in tokens: looked up at admission / found in the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request: Request, group: int = 0) -> list[int]:
        tables = self._tables.get(request.request_id)
        return list(tables[group]) if tables else []

    def block_tables(self, request: Request) -> list[list[int]]:
        """The request's live tables, one per group, not copies: read them, never change them."""
        return self._tables.get(request.request_id) or [[] for _ in self.windows]

    def num_held_blocks(self, request: Request) -> int:
        """Blocks of the pool the request's tables hold (null entries are none), or its hit while it loads."""
        rid = request.request_id
        return len(self._staged.get(rid, ())) + sum(
            len(table) - skip for table, skip in zip(self._tables.get(rid, ()), self._released.get(rid, ())))

    def _can_hit(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, and every
        # pooling but last its hidden states, so nothing of the prompt may be skipped.
        return (self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None
                and request.pooling in (None, "last"))

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, num_blocks, request.cache_salt)
        return hashes

    def _unread_blocks(self, group: int, first_query: int) -> int:
        """How many leading blocks of ``group`` no query at ``first_query`` or later reads:
        those queries see keys after ``query - window`` only."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, first_query - window + 1) // self.block_size

    def _lookup(self, group: int, hashes: list[BlockHash], below: bool = False) -> list[Optional[int]]:
        """The group's cached block per hash, None where there is none (``below``: ``_IN_TIER``
        where a tier below the pool holds it); for a group without a window only the run from
        the start, all that it can resume after."""
        found = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash, group)
            if block_id is None and below and self.offload.tier_of((block_hash, group)) is not None:
                block_id = _IN_TIER
            if block_id is None and self.windows[group] is None:
                break
            found.append(block_id)
        return found

    def _longest_hit(self, group: int, found: list[Optional[int]], limit: int) -> int:
        """The most blocks, up to ``limit``, that ``group`` can resume after: every block the
        following queries read is cached (``found``: as ``_lookup`` gives it)."""
        if self.windows[group] is None:
            return min(limit, len(found))
        runs = [0]  # runs[k]: cached blocks in a row ending with block k - 1
        for block_id in found[:limit]:
            runs.append(runs[-1] + 1 if block_id is not None else 0)
        for k in range(limit, 0, -1):
            if runs[k] >= k - self._unread_blocks(group, k * self.block_size):
                return k
        return 0

    def _hit(self, hashes: list[BlockHash], below: bool = False) -> list[list[int]]:
        """Per group, the blocks of the longest prefix of ``hashes`` every group can resume
        after (a window group's unread leading ones as ``null_block``); ``below``: counting
        the blocks the tiers hold, which appear as ``_IN_TIER``."""
        found = [self._lookup(g, hashes, below) for g in range(self.num_groups)]
        num = len(hashes)
        while True:  # a group's best length may be shorter than another's: settle on one every group can use
            fit = min(self._longest_hit(g, found[g], num) for g in range(self.num_groups))
            if fit == num:
                break
            num = fit
        tables = []
        for g in range(self.num_groups):
            skip = self._unread_blocks(g, num * self.block_size)
            tables.append([self.null_block] * skip + found[g][skip:num])
        return tables

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """Per group, the cached blocks a request can start after (a window group's
        unread leading ones as ``null_block``), and the number of tokens they cover:
        the most full blocks every group has cached what the later queries read, in
        the pool or, loaded back now, in the tiers below it. The last token is never
        a hit: computing it is what yields the logits to sample from. Nothing while
        the request is loading (``is_loading``): its hit is not there yet."""
        if not self._can_hit(request) or self.is_loading(request):
            return [[] for _ in self.windows], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks)[:max_blocks]
        tables = self._hit(hashes)
        if self.offload is not None and len(tables[0]) < max_blocks and self._load_from_tiers(request, hashes):
            if self.is_loading(request):
                return [[] for _ in self.windows], 0
            tables = self._hit(hashes)  # the blocks loaded from host memory are registered in the pool now
        return tables, len(tables[0]) * self.block_size

    def free_unread_blocks(self, request: Request) -> None:
        """Release the window groups' blocks that none of the request's tokens still to be
        computed reads (after a step, once its blocks are registered: they stay hittable)."""
        if self._windowed and request.request_id in self._tables:
            self._release_unread(request.request_id, request.num_computed_tokens)

    def _release_unread(self, rid: str, first_query: int) -> None:
        """Free the window groups' blocks that no query from ``first_query`` on reads."""
        tables, released = self._tables[rid], self._released[rid]
        for g, table in enumerate(tables):
            skip = min(self._unread_blocks(g, first_query), len(table))
            if skip <= released[g]:
                continue
            self.pool.free(table[released[g] : skip])
            table[released[g] : skip] = [self.null_block] * (skip - released[g])
            released[g] = skip

    def _load_from_tiers(self, request: Request, hashes: list[BlockHash]) -> bool:
        """Load into fresh pool blocks the blocks of the tiers below the pool
        that extend the request's hit: the longest prefix every group can
        resume after counting what the tiers hold, each group loading only
        the blocks it lacks of what it reads there (a window group: the last
        window's). Returns whether anything was loaded (this step's moves).

        The hit's pool blocks and the blocks loaded are held while later ones
        are loaded: making room evicts pool blocks, which may push the tiers'
        own LRU blocks out, and must take neither. One block at a time, a
        position's blocks of every group before the next position's, as each
        load precedes the evictions that come after it; a load that cannot
        be made (the pool is full, the tier dropped the block) ends them,
        and the hit is what the blocks in hand allow.

        A block from host memory is filled when the step's moves are applied,
        so it is registered now: an ordinary cached block from here on, even
        if the request then waits. A block from disk is filled in a later
        step (``finish_loads``): until then the request is loading (staged),
        holding its hits and every block loaded, and is not scheduled."""
        plan = self._hit(hashes, below=True)
        wanted = [(i, g) for i in range(len(plan[0])) for g, table in enumerate(plan) if table[i] == _IN_TIER]
        if not wanted:
            return False
        self.offload.touch((hashes[i], g) for i, g in wanted)
        hits = [b for table in plan for b in table if b not in (self.null_block, _IN_TIER)]
        self.pool.touch(hits)
        loaded: list[int] = []
        filled: list[int] = []  # positions in the prefix of group 0's blocks from host memory
        for i, g in wanted:
            if not self.pool.num_free_blocks:
                break
            (block_id,) = self.pool.allocate(1)
            tier = self.offload.load((hashes[i], g), block_id)
            if tier is None:
                self.pool.free([block_id])
                break
            if tier == HOST:
                self.pool.cache_block(block_id, hashes[i], g)
                filled += [i] if g == 0 else []
            else:
                tokens = list(request.all_token_ids[i * self.block_size : (i + 1) * self.block_size])
                self._loads[block_id] = _Load(request.request_id, hashes[i], g, hashes[i - 1] if i else None, tokens)
            loaded.append(block_id)
        if self.pool.events is not None and filled:
            self._record_stored(request, hashes, filled)
        if any(b in self._loads for b in loaded):
            self._staged[request.request_id] = hits + loaded
        else:
            self.pool.free(reversed(loaded))
            self.pool.free(hits)
        return bool(loaded)

    def is_loading(self, request: Request) -> bool:
        """Whether the request waits for blocks of its prefix hit to be read from disk."""
        return request.request_id in self._staged

    @property
    def loads_in_flight(self) -> bool:
        """Loads from disk started and not yet reported done (a request that left may have started them)."""
        return bool(self._loads)

    def finish_loads(self, report: TierReport) -> None:
        """Apply what the workers report of the tiers: blocks loaded from disk
        are registered (ordinary cached blocks from now on), those that failed
        stay unregistered (the prefix is a miss from there: computed again),
        files not written are forgotten. A request whose loads have all ended
        lets its blocks go, as a prefix hit does until its request is admitted,
        so that no held block can stop the scheduler from making room."""
        for key in report.failed_writes:
            self.offload.write_failed(key)
        owners = set()
        for block_id, ok in [*((b, True) for b in report.loaded), *((b, False) for b in report.failed)]:
            load = self._loads.pop(block_id)
            if not ok:
                self.offload.load_failed((load.block_hash, load.group))
            else:
                self.offload.load_done()
                registered = self.pool.cache_block(block_id, load.block_hash, load.group)
                if registered and load.group == 0 and self.pool.events is not None:
                    self.pool.events.append(BlockStored([load.block_hash], load.parent, load.token_ids,
                                                        self.block_size))
            if load.request_id is None:
                self.pool.free([block_id])  # its request left while it loaded
            else:
                owners.add(load.request_id)
        for rid in owners:
            held = self._staged[rid]
            if not any(b in self._loads for b in held):
                del self._staged[rid]
                self.pool.free(reversed(held))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Sequence[int]] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for K/V of the next ``num_new_tokens`` tokens after
        ``request.num_computed_tokens`` (plus ``computed_blocks``, per group the
        prefix hits of a request that holds no blocks yet), and ``num_lookahead_tokens``
        scratch slots after those (a draft model's own proposal steps). Shared
        blocks about to be written are copied first (copy-on-write). Window groups
        first free the blocks these and later tokens will not read. Returns False,
        changing nothing else, when the pool is short."""
        rid = request.request_id
        bs = self.block_size
        if not (computed_blocks or self._windowed) and self._fits_held(request, num_new_tokens + num_lookahead_tokens):
            return True
        hits = list(computed_blocks) or [[] for _ in self.windows]
        num_hit = len(hits[0])
        if num_hit and rid in self._tables:
            raise RuntimeError(f"request {rid} already holds blocks; prefix hits apply only at admission")
        start = request.num_computed_tokens + num_hit * bs
        if self._windowed and rid in self._tables:
            self._release_unread(rid, start)
        tables = self._tables.get(rid) or [[] for _ in self.windows]
        num_needed = _cdiv(start + num_new_tokens + num_lookahead_tokens, bs)
        num_new = [max(0, num_needed - len(table) - len(hit)) for table, hit in zip(tables, hits)]
        shared = [[i for i in range(start // bs, min(len(table), num_needed)) if self.pool.ref_cnt(table[i]) > 1]
                  for table in tables]
        # Free cached hits are counted as free but stop being so once taken.
        revived = num_hit and sum(1 for hit in hits for b in hit
                                  if b != self.null_block and self.pool.ref_cnt(b) == 0)
        if sum(num_new) + sum(map(len, shared)) > self.pool.num_free_blocks - revived:
            return False

        if rid not in self._tables and self._can_hit(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit * bs
        if rid not in self._tables:
            self._released[rid] = [list(hit).count(self.null_block) for hit in hits]
        # Every group's hits first: allocating could otherwise evict them.
        for hit in hits if num_hit else ():
            self.pool.touch(b for b in hit if b != self.null_block)
        for g, hit in enumerate(hits):
            table = tables[g] + list(hit)
            for i in shared[g]:
                (fresh,) = self.pool.allocate(1)
                self._copies.append((table[i], fresh))
                self.pool.free([table[i]])
                table[i] = fresh
            table.extend(self.pool.allocate(num_new[g]))
            tables[g] = table
        self._tables[rid] = tables
        return True

    def _fits_held(self, request: Request, num_tokens: int) -> bool:
        """Whether the request's next ``num_tokens`` slots lie in blocks it already holds alone, so that
        allocate_slots has nothing to allocate, copy or count: a decode step between block boundaries, 15
        of 16 steps at block size 16. Checked first because the general path costs ~5 us a request in
        Python, over a millisecond a step at batch 256."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return False
        start = request.num_computed_tokens
        first, num_needed = start // self.block_size, _cdiv(start + num_tokens, self.block_size)
        ref_cnt = self.pool.ref_cnt
        for table in tables:  # loops, not all() over generators: this runs for every request every step
            if len(table) < num_needed:
                return False
            for i in range(first, num_needed):
                if ref_cnt(table[i]) != 1:
                    return False
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (holding no blocks) the parent's whole tables by reference."""
        if child.request_id in self._tables:
            raise RuntimeError(f"request {child.request_id} already holds blocks")
        tables = [list(table) for table in self._tables[parent.request_id]]
        released = list(self._released[parent.request_id])
        for table, skip in zip(tables, released):
            self.pool.touch(table[skip:])
        self._tables[child.request_id] = tables
        self._released[child.request_id] = released

    def cache_blocks(self, request: Request) -> None:
        """Register the blocks filled by the request's computed tokens, so later
        requests (and this one after a preemption) hit them."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        tables = self._tables[rid]
        # Past num_tokens lie speculative proposals not yet verified: their
        # blocks must never be found by another request.
        num_verified = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_verified // self.block_size, len(tables[0]))
        done = self._num_registered.get(rid, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(request, num_full)
        for g, table in enumerate(tables):
            # A block released before its step's results came back (pipeline stages) stays unregistered.
            stored = [i for i in range(done, num_full)
                      if table[i] != self.null_block and self.pool.cache_block(table[i], hashes[i], g)]
            if g == 0 and self.pool.events is not None and stored:
                self._record_stored(request, hashes, stored)
        self._num_registered[rid] = num_full

    def _record_stored(self, request: Request, hashes: list[BlockHash], stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly registered blocks (a
        run shares one parent, as the event shape wants)."""
        bs = self.block_size
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        tokens = request.all_token_ids
        for run in runs:
            parent = hashes[run[0] - 1] if run[0] > 0 else None
            ids = list(tokens[run[0] * bs : (run[-1] + 1) * bs])
            self.pool.events.append(BlockStored([hashes[i] for i in run], parent, ids, bs))

    def enable_events(self) -> None:
        """Record prefix-cache changes as KV events, for ``take_events``."""
        self.pool.events = []
        if self.offload is not None:
            self.offload.enable_events()

    def take_events(self) -> list[KVEvent]:
        if self.pool.events is None:
            return []
        events, self.pool.events = self.pool.events, []
        # Each medium's events keep their order; a router tracks each medium apart.
        return events + (self.offload.take_events() if self.offload is not None else [])

    def take_kv_transfers(self) -> list[KVTransfer]:
        """The moves between the pool and its tiers decided since the last call."""
        return self.offload.take_transfers() if self.offload is not None else []

    def free_unused_blocks(self, request: Request) -> None:
        """Release the blocks past the request's computed tokens: after
        rejected proposals are rolled back, the blocks that held only them
        (or lookahead slots) are empty. None of them was registered (see
        ``cache_blocks``)."""
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        keep = _cdiv(request.num_computed_tokens, self.block_size)
        for table in tables:
            if len(table) > keep:
                self.pool.free(reversed(table[keep:]))
                del table[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks; registered ones stay hittable until evicted."""
        rid = request.request_id
        for block_id in self._staged.get(rid, ()):
            if block_id in self._loads:
                self._loads[block_id].request_id = None  # held until its load ends: the workers write it
        self.pool.free(reversed([b for b in self._staged.pop(rid, ()) if b not in self._loads]))
        tables = self._tables.pop(rid, None)
        released = self._released.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        if tables is None:
            return
        # A copy into a block of this request is moot now.
        dropped = {b for table in tables for b in table}
        self._copies = [(s, d) for s, d in self._copies if d not in dropped]
        # Tail blocks first: a prefix's last blocks are the least likely to be
        # shared, so they should be the first evicted.
        for table, skip in zip(tables, released):
            self.pool.free(reversed(table[skip:]))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies made since the last call, for the runner to
        apply before the next forward."""
        copies, self._copies = self._copies, []
        return copies
