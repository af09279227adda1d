"""Per-request block tables over a BlockPool: prefix hits, growth, forks,
copy-on-write and registration of computed blocks."""
from __future__ import annotations

from typing import Optional, Sequence

from octavo.core.block_pool import BlockPool
from octavo.core.prefix_hash import BlockHash, extend_block_hashes
from octavo.core.request import Request
from octavo.kv_events import BlockStored, KVEvent
from octavo.kv_offload.index import TierIndex
from octavo.kv_offload.transfers import KVTransfer


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Block tables hold the K/V of ``request.all_token_ids`` in order; block
    ``i`` of a table covers positions ``i*block_size .. (i+1)*block_size - 1``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 offload: Optional[TierIndex] = None) -> None:
        """``offload``: the tiers below the pool, which keep the blocks it evicts."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.offload = offload
        if offload is not None:
            self.pool.on_evict = offload.evicted
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_registered: dict[str, int] = {}
        self._copies: list[tuple[int, int]] = []
        # Cumulative, in tokens: looked up at admission / found in the cache.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request: Request) -> list[int]:
        return list(self._tables.get(request.request_id, ()))

    def block_table(self, request: Request) -> list[int]:
        """The request's live table, not a copy: read it, never change it."""
        return self._tables.get(request.request_id, [])

    def _can_hit(self, request: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, and every
        # pooling but last its hidden states, so nothing of the prompt may be skipped.
        return (self.enable_prefix_caching and request.sampling_params.prompt_logprobs is None
                and request.pooling in (None, "last"))

    def _block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, num_blocks, request.cache_salt)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached full blocks at the start of the request's
        tokens, and the number of tokens they cover. The last token is never a
        hit: computing it is what yields the logits to sample from."""
        if not self._can_hit(request):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        hashes = self._block_hashes(request, max_blocks)[:max_blocks]
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        if self.offload is not None and len(blocks) < len(hashes):
            blocks += self._load_from_tiers(request, hashes, blocks)
        return blocks, len(blocks) * self.block_size

    def _load_from_tiers(self, request: Request, hashes: list[BlockHash], hits: list[int]) -> list[int]:
        """Extend the pool's ``hits`` through the tiers below it: the blocks
        found there are loaded into fresh pool blocks (this step's moves) and
        registered, so they are ordinary cached blocks from here on, even if
        the request then waits. Blocks are held while later ones are loaded:
        making room evicts pool blocks, which may push the tiers' own LRU
        blocks out, and must take neither the pool's hits nor blocks loaded
        already. One block at a time, as each load precedes the evictions
        that come after it."""
        found = self.offload.find(hashes[len(hits):])
        if not found:
            return []
        self.pool.touch(hits)
        loaded: list[int] = []
        for block_hash in found:
            if not self.pool.num_free_blocks:
                break
            (block_id,) = self.pool.allocate(1)
            if not self.offload.load(block_hash, block_id):
                self.pool.free([block_id])
                break
            self.pool.cache_block(block_id, block_hash)
            loaded.append(block_id)
        self.pool.free(reversed(loaded))
        self.pool.free(hits)
        if self.pool.events is not None and loaded:
            self._record_stored(request, hashes, list(range(len(hits), len(hits) + len(loaded))))
        return loaded

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for K/V of the next ``num_new_tokens`` tokens after
        ``request.num_computed_tokens`` (plus ``computed_blocks``, the prefix
        hits of a request that holds no blocks yet), and ``num_lookahead_tokens``
        scratch slots after those (a draft model's own proposal steps). Shared
        blocks about to be written are copied first (copy-on-write). Returns
        False, changing nothing, when the pool is short."""
        rid = request.request_id
        table = self._tables.get(rid, [])
        if computed_blocks and table:
            raise RuntimeError(f"request {rid} already holds blocks; prefix hits apply only at admission")
        bs = self.block_size
        start = request.num_computed_tokens + len(computed_blocks) * bs
        num_needed = _cdiv(start + num_new_tokens + num_lookahead_tokens, bs)
        num_new_blocks = max(0, num_needed - len(table) - len(computed_blocks))
        shared = [i for i in range(start // bs, min(len(table), num_needed)) if self.pool.ref_cnt(table[i]) > 1]
        # Free cached hits are counted as free but stop being so once taken.
        revived = sum(1 for b in computed_blocks if self.pool.ref_cnt(b) == 0)
        if num_new_blocks + len(shared) > self.pool.num_free_blocks - revived:
            return False

        if rid not in self._tables and self._can_hit(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * bs
        # Hits first: allocating could otherwise evict them.
        self.pool.touch(computed_blocks)
        table = table + list(computed_blocks)
        for i in shared:
            (fresh,) = self.pool.allocate(1)
            self._copies.append((table[i], fresh))
            self.pool.free([table[i]])
            table[i] = fresh
        table.extend(self.pool.allocate(num_new_blocks))
        self._tables[rid] = table
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (holding no blocks) the parent's whole table by reference."""
        if child.request_id in self._tables:
            raise RuntimeError(f"request {child.request_id} already holds blocks")
        table = list(self._tables[parent.request_id])
        self.pool.touch(table)
        self._tables[child.request_id] = table

    def cache_blocks(self, request: Request) -> None:
        """Register the blocks filled by the request's computed tokens, so later
        requests (and this one after a preemption) hit them."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        table = self._tables[rid]
        # Past num_tokens lie speculative proposals not yet verified: their
        # blocks must never be found by another request.
        num_verified = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(num_verified // self.block_size, len(table))
        done = self._num_registered.get(rid, 0)
        if num_full <= done:
            return
        hashes = self._block_hashes(request, num_full)
        stored = [i for i in range(done, num_full) if self.pool.cache_block(table[i], hashes[i])]
        self._num_registered[rid] = num_full
        if self.pool.events is not None and stored:
            self._record_stored(request, hashes, stored)

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
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = _cdiv(request.num_computed_tokens, self.block_size)
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks; registered ones stay hittable until evicted."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)
        if table is None:
            return
        # A copy into a block of this request is moot now.
        dropped = set(table)
        self._copies = [(s, d) for s, d in self._copies if d not in dropped]
        # Tail blocks first: a prefix's last blocks are the least likely to be
        # shared, so they should be the first evicted.
        self.pool.free(reversed(table))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (src, dst) copies made since the last call, for the runner to
        apply before the next forward."""
        copies, self._copies = self._copies, []
        return copies
