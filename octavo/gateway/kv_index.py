"""Which replica holds which KV blocks, kept from the replicas' KV events.

One ZMQ SUB socket per replica endpoint. A gap in the sequence numbers
(a slow subscriber drops messages at the PUB socket's high-water mark) or a
replica restart leaves the index stale in one direction only: it may name
blocks that are gone (a routing miss costs one prefill, nothing breaks) or miss
blocks that exist. Both heal as new events arrive.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import zmq
import zmq.asyncio

from octavo.core.prefix_hash import BlockHash
from octavo.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch

logger = logging.getLogger(__name__)


class KVIndex:
    """A replica holds a block while any of its media does: its pool (events
    without a medium) or a tier below it ("cpu", "disk"), which a replica
    loads back faster than it computes. Each medium's stores and removals are
    tracked apart, so a block leaving the pool for host memory stays held."""

    def __init__(self) -> None:
        self._blocks: dict[str, dict[BlockHash, set[Optional[str]]]] = {}

    def apply(self, replica_url: str, batch: EventBatch) -> None:
        blocks = self._blocks.setdefault(replica_url, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    blocks.setdefault(h, set()).add(event.medium)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    media = blocks.get(h)
                    if media is not None:
                        media.discard(event.medium)
                        if not media:
                            del blocks[h]
            elif isinstance(event, AllBlocksCleared):
                blocks.clear()

    def forget(self, replica_url: str) -> None:
        self._blocks.pop(replica_url, None)

    def num_blocks(self, replica_url: str) -> int:
        return len(self._blocks.get(replica_url, ()))

    def matched_blocks(self, replica_url: str, hashes: Sequence[BlockHash]) -> int:
        """How many of the chain's leading blocks the replica holds."""
        blocks = self._blocks.get(replica_url)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n


class KVEventSubscriber:
    """Feeds one replica's events into the index until ``close``."""

    def __init__(self, ctx: zmq.asyncio.Context, index: KVIndex, replica_url: str, endpoint: str) -> None:
        self._index = index
        self._url = replica_url
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last_seq = None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                seq, batch = decode_batch(frames)
            except ValueError as exc:
                logger.warning("KV events of %s: %s", self._url, exc)
                continue
            if last_seq is not None and seq <= last_seq:
                # Numbering started over: the replica restarted with an empty cache.
                self._index.forget(self._url)
            elif last_seq is not None and seq != last_seq + 1:
                logger.info("KV events of %s: sequence gap %d -> %d", self._url, last_seq, seq)
            last_seq = seq
            self._index.apply(self._url, batch)

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._sock.close()
