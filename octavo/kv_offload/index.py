"""The scheduler's half of the KV tiers: which blocks each tier holds, and
the moves each step carries (torch-free).

Blocks reach the host tier when the pool evicts them, and the move is applied
by the workers at the start of the step whose scheduling evicted them, before
anything of that step writes the pool. That is the one moment a block is
both final and about to be lost: a block is only ever evicted once it is
registered (its tokens computed, its step's results applied), and the step
that reuses it writes it only in its forward, after the move (see
``transfers.py``). Saving at registration instead would copy every block the
pool ever computes, most of which are hit or dropped while still in the pool;
delaying the reuse of an evicted block would cost pool capacity and a second
round trip. Both tiers are LRU; what the host tier evicts spills to disk,
what the disk tier evicts is deleted.

A block loaded back from host memory leaves it (its slot is free again): a
copy back costs a memcpy at the next eviction, while keeping both would
spend the host tier on blocks the pool holds anyway. A file stays when it is
loaded: writing it again would cost far more, and it is what a restart finds.

A model with sliding-window layers has several KV cache groups, which cache
the same prefixes in blocks of their own: a tier's entry is one group's block,
keyed by the prefix hash and the group (``BlockKey``). Every group's blocks
go down as the pool evicts them; which ones a prefix needs back is the KV
cache manager's hit rule (a window group's last window only).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence

from octavo.kv_events import BlockRemoved, BlockStored, KVEvent
from octavo.kv_offload.transfers import (DELETE_FILE, DISK, FROM_DISK, FROM_HOST, HOST, HOST_TO_DISK, TIERS,
                                         TO_DISK, TO_HOST, BlockKey, KVTransfer, TierLayout)


def _file_move(op: str, key: BlockKey, block_id: int = -1, slot: int = -1) -> KVTransfer:
    return KVTransfer(op, block_id, slot, block_hash=key[0], group=key[1])


class TierIndex:
    """One index for every rank: each applies the same moves to its own shard,
    so capacities are the smallest any rank reported and a file found at
    start counts only when every rank has it."""

    def __init__(self, layouts: Sequence[TierLayout], block_size: int) -> None:
        if not layouts:
            raise ValueError("TierIndex needs the layout of at least one rank")
        self.block_size = block_size
        # Every rank's share of a block: what a tier's entry costs in all.
        self.block_bytes = sum(layout.block_bytes for layout in layouts)
        self._host_capacity = min(layout.host_blocks for layout in layouts)
        self._disk_capacity = min(layout.disk_blocks for layout in layouts)
        self._host: OrderedDict[BlockKey, int] = OrderedDict()  # block -> slot, least recently used first
        self._free_slots = list(reversed(range(self._host_capacity)))
        self._disk: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first
        self._transfers: list[KVTransfer] = []
        self.events: Optional[list[KVEvent]] = None
        # Prompt tokens loaded from each tier into the pool; with several KV cache groups each
        # group's block loaded counts its tokens (a token loaded for two groups counts twice).
        self.hits = dict.fromkeys(TIERS, 0)
        self.errors = dict.fromkeys(("read", "write"), 0)  # files the workers could not read or write
        self._adopt([layout.files for layout in layouts])

    def _adopt(self, files: list[list[BlockKey]]) -> None:
        """Index the files an earlier run left: those every rank holds, the
        newest that fit the disk tier; the others are deleted (a file only
        some ranks hold is half a block)."""
        common = set(files[0]).intersection(*files[1:])
        kept = [h for h in files[0] if h in common][-self._disk_capacity:] if self._disk_capacity else []
        self._disk.update(dict.fromkeys(kept))
        stale = set().union(*files) - set(kept)
        self._transfers += [_file_move(DELETE_FILE, key) for key in sorted(stale)]

    # ---- what the tiers hold ----------------------------------------------

    def tier_of(self, key: BlockKey) -> Optional[str]:
        """The fastest tier holding the block, None when none does."""
        if key in self._host:
            return HOST
        return DISK if key in self._disk else None

    def num_blocks(self, tier: str) -> int:
        return len(self._host) if tier == HOST else len(self._disk)

    def bytes_held(self) -> dict[str, int]:
        """Per tier, the bytes its blocks take on all ranks together (disk: file payloads)."""
        return {tier: self.num_blocks(tier) * self.block_bytes for tier in TIERS}

    def host_slots(self) -> dict[BlockKey, int]:
        """A copy of the host tier: block -> slot."""
        return dict(self._host)

    def disk_blocks(self) -> list[BlockKey]:
        """The disk tier's blocks, least recently used first."""
        return list(self._disk)

    # ---- decisions --------------------------------------------------------

    def touch(self, keys: Iterable[BlockKey]) -> None:
        """Mark blocks about to be loaded as just used, so that the evictions
        the caller's allocations cause take other blocks."""
        for key in keys:
            if key in self._host:
                self._host.move_to_end(key)
            elif key in self._disk:
                self._disk.move_to_end(key)

    def load(self, key: BlockKey, block_id: int) -> Optional[str]:
        """Fill pool block ``block_id`` with the block's K/V from the fastest
        tier holding it, and name that tier; None when none does any longer
        (an eviction since ``touch`` dropped it), and then nothing moves. A
        load from host memory is done when the step's moves are applied; one
        from disk only starts then, and ends in ``load_done`` or
        ``load_failed`` (the workers' ``TierReport`` of a later step)."""
        tier = self.tier_of(key)
        if tier == HOST:
            slot = self._host.pop(key)
            self._transfers.append(KVTransfer(FROM_HOST, block_id, slot))
            self._free_slots.append(slot)
            self._record_removed(key, HOST)
            self.hits[HOST] += self.block_size
        elif tier == DISK:
            self._transfers.append(_file_move(FROM_DISK, key, block_id))
        return tier

    def load_done(self) -> None:
        """A load from disk that filled its block."""
        self.hits[DISK] += self.block_size

    def load_failed(self, key: BlockKey) -> None:
        """A file that some rank could not read: forgotten (and deleted, if it can be), so the block is a miss."""
        self.errors["read"] += 1
        self._forget_file(key)
        self._transfers.append(_file_move(DELETE_FILE, key))

    def write_failed(self, key: BlockKey) -> None:
        """A file that was not written (a full disk, a folder gone read-only): the disk tier does not hold it."""
        self.errors["write"] += 1
        self._forget_file(key)

    def _forget_file(self, key: BlockKey) -> None:
        if key in self._disk:
            del self._disk[key]
            self._record_removed(key, DISK)

    def evicted(self, key: BlockKey, block_id: int) -> None:
        """The pool is about to reuse ``block_id``, which holds block ``key``: keep its K/V below the pool."""
        if key in self._host:
            self._host.move_to_end(key)
        elif self._host_capacity:
            slot = self._take_slot()
            self._host[key] = slot
            self._transfers.append(KVTransfer(TO_HOST, block_id, slot))
            self._record_stored(key, HOST)
        elif key in self._disk:
            self._disk.move_to_end(key)
        elif self._disk_capacity:
            self._put_on_disk(key, _file_move(TO_DISK, key, block_id))

    def _take_slot(self) -> int:
        """A free host slot, spilling the least recently used block to disk when there is none."""
        if self._free_slots:
            return self._free_slots.pop()
        old, slot = self._host.popitem(last=False)
        self._record_removed(old, HOST)
        if old in self._disk:
            self._disk.move_to_end(old)
        elif self._disk_capacity:
            self._put_on_disk(old, _file_move(HOST_TO_DISK, old, slot=slot))
        return slot

    def _put_on_disk(self, key: BlockKey, write: KVTransfer) -> None:
        # Delete first: the folder never holds more than its bound, even mid-step.
        while len(self._disk) >= self._disk_capacity:
            old, _ = self._disk.popitem(last=False)
            self._transfers.append(_file_move(DELETE_FILE, old))
            self._record_removed(old, DISK)
        self._disk[key] = None
        self._transfers.append(write)
        self._record_stored(key, DISK)

    def persist(self, pool_blocks: Sequence[tuple[BlockKey, int]]) -> list[KVTransfer]:
        """The moves that leave on disk the most recent blocks of the host
        tier and then of ``pool_blocks`` (block, block id; least recent first),
        as many as the disk tier holds: run before the engine stops, so that
        the next one started on the folder finds them."""
        if not self._disk_capacity:
            return self.take_transfers()
        candidates = [(key, _file_move(HOST_TO_DISK, key, slot=s)) for key, s in self._host.items()]
        candidates += [(key, _file_move(TO_DISK, key, b)) for key, b in pool_blocks]
        for key, write in candidates[-self._disk_capacity:]:
            if key in self._disk:
                self._disk.move_to_end(key)
            else:
                self._put_on_disk(key, write)
        return self.take_transfers()

    def take_transfers(self) -> list[KVTransfer]:
        """The moves decided since the last call, in order, for the next step."""
        transfers, self._transfers = self._transfers, []
        return transfers

    # ---- events -----------------------------------------------------------

    def enable_events(self) -> None:
        """Record tier changes as KV events; the first batch announces what the tiers hold now.
        Like the pool's, the events describe group 0's blocks: a router asks whether a prefix is
        here, and every group caches the same prefixes."""
        self.events = []
        for tier in TIERS:
            held = [h for h, group in (self._host if tier == HOST else self._disk) if group == 0]
            if held:
                self.events.append(BlockStored(held, None, [], self.block_size, medium=tier))

    def _record_stored(self, key: BlockKey, tier: str) -> None:
        if self.events is not None and key[1] == 0:
            self.events.append(BlockStored([key[0]], None, [], self.block_size, medium=tier))

    def _record_removed(self, key: BlockKey, tier: str) -> None:
        if self.events is not None and key[1] == 0:
            self.events.append(BlockRemoved([key[0]], medium=tier))

    def take_events(self) -> list[KVEvent]:
        if self.events is None:
            return []
        events, self.events = self.events, []
        return events
