"""Publishes the prefix cache's KV events on a ZMQ PUB socket (``--kv-events-endpoint``).

One message per step that changed the cache, sent without blocking: a
subscriber too slow to keep up loses messages at the socket's high-water mark
(and sees the gap in the sequence numbers) rather than slowing the engine.
"""
from __future__ import annotations

import logging

import zmq

from octavo.kv_events import AllBlocksCleared, KVEvent, encode_batch

logger = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 10_000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"kv_events_endpoint: cannot bind {endpoint}: {exc}") from None
        self._seq = 0
        # A (re)started engine's cache is empty: subscribers drop what they knew of it.
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        try:
            self._sock.send_multipart(encode_batch(events, self._seq), flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.debug("KV events: send queue full, batch %d dropped", self._seq)
        self._seq += 1

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
