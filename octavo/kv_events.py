"""KV-cache events: which prefix blocks an engine holds, for routers outside it.

An engine started with ``--kv-events-endpoint`` publishes, on a ZMQ PUB socket,
one batch per scheduler step in which its prefix cache changed. The shape is
vLLM's (msgpack, array-like structs with the class name as tag, multipart
frames ``[topic, sequence number (8 bytes, big-endian), payload]``), so routers
written for vLLM's events can read Octavo's. Block hashes are the prefix
cache's own chained SHA-256 digests (``octavo/core/prefix_hash.py``): a router
that hashes a prompt's tokens the same way finds the blocks by their names.

Torch-free and at the package root: the engine publishes, the gateway reads.
"""
from __future__ import annotations

import time
from typing import Optional, Union

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union["BlockStored", "BlockRemoved", "AllBlocksCleared"]]


class _KVEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVEvent):
    """Full blocks registered in the prefix cache, in chain order."""

    block_hashes: list[bytes]
    parent_block_hash: Optional[bytes]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int] = None
    medium: Optional[str] = None


class BlockRemoved(_KVEvent):
    """Blocks evicted: their hashes no longer name cached K/V."""

    block_hashes: list[bytes]
    medium: Optional[str] = None


class AllBlocksCleared(_KVEvent):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)
TOPIC = b"kv-events"


def encode_batch(events: list[KVEvent], seq: int) -> list[bytes]:
    """The multipart message of one batch."""
    return [TOPIC, seq.to_bytes(8, "big"), _ENCODER.encode(EventBatch(time.time(), events))]


def decode_batch(frames: list[bytes]) -> tuple[int, EventBatch]:
    """``(sequence number, batch)``; ``ValueError`` on a malformed message."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
    try:
        return int.from_bytes(frames[1], "big"), _DECODER.decode(frames[2])
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from None
