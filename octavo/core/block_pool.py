"""A fixed pool of KV blocks: free queue, reference counts and the prefix cache.

Free blocks wait in one ordered queue and are reused from the front. A block
that holds a registered prefix keeps its hash while free and queues at the
back, so prefix hits survive until memory is actually needed (LRU); a free
block without a hash holds nothing worth keeping and queues at the front.
Reusing a cached free block evicts its hash.

A model whose layers form several KV cache groups (core/kv_cache_manager.py)
draws every group's blocks from this one pool; a block holds one group's K/V,
so the prefix cache is kept per group: the same prefix hash names a different
block in each group.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from octavo.core.prefix_hash import BlockHash
from octavo.kv_events import BlockRemoved, KVEvent


@dataclass(eq=False)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    group: int = 0  # the KV cache group whose prefix cache holds block_hash


class BlockPool:
    """Blocks ``0 .. num_blocks-1``. Block ids are what block tables hold."""

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self._blocks = [_Block(i) for i in range(num_blocks)]
        # OrderedDict as the free queue: O(1) pop at the front, append at the
        # back, and removal from the middle when a prefix hit revives a block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: list[dict[BlockHash, int]] = [{} for _ in range(num_groups)]
        # KV events for routers outside the engine (--kv-events-endpoint); None: not
        # recorded. They describe group 0's prefix cache only: a router asks whether
        # a prefix is here, and every group caches the same prefixes.
        self.events: Optional[list[KVEvent]] = None
        # Told ((hash, group), block id) before a cached block is reused: the tiers below the pool keep it.
        self.on_evict: Optional[Callable[[tuple[BlockHash, int], int], None]] = None

    @property
    def num_total_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def ref_cnt(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> Optional[BlockHash]:
        return self._blocks[block_id].block_hash

    def free_block_ids(self) -> list[int]:
        """The free queue, next to be reused first."""
        return list(self._free)

    def cached_blocks(self, group: int = 0) -> dict[BlockHash, int]:
        """A copy of one group's prefix cache: hash -> block id."""
        return dict(self._cached[group])

    def cached_by_age(self) -> list[tuple[tuple[BlockHash, int], int]]:
        """Every group's prefix cache as ((hash, group), block id), the next evicted first and the blocks
        in use last."""
        free = [b for b in self._free if self._blocks[b].block_hash is not None]
        used = [b for cached in self._cached for b in cached.values() if self._blocks[b].ref_cnt > 0]
        return [((self._blocks[b].block_hash, self._blocks[b].group), b) for b in free + used]

    def lookup(self, block_hash: BlockHash, group: int = 0) -> Optional[int]:
        return self._cached[group].get(block_hash)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` fresh blocks (ref-count 1), evicting cached
        contents of the ones reused. The caller checks ``num_free_blocks`` first."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            block = self._blocks[self._free.popitem(last=False)[0]]
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict((block.block_hash, block.group), block.block_id)
                del self._cached[block.group][block.block_hash]
                if self.events is not None and block.group == 0:
                    self.events.append(BlockRemoved([block.block_hash]))
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks whose contents are reused (prefix
        hits, forks); a free cached block leaves the free queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block. Blocks reaching zero are queued in the
        given order, so pass the blocks to evict first first."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def cache_block(self, block_id: int, block_hash: BlockHash, group: int = 0) -> bool:
        """Register a full, computed block of ``group`` under its prefix hash. A block
        that is already registered, or duplicates a registered one, stays as it is."""
        block = self._blocks[block_id]
        cached = self._cached[group]
        if block.block_hash is not None or block_hash in cached:
            return False
        block.block_hash, block.group = block_hash, group
        cached[block_hash] = block_id
        return True
