"""Response cache for deterministic requests.

Only requests whose output is a function of the request (temperature 0, or
an explicit seed) are cached, keyed by whose request it is (the API key, or
the tenant it maps to: one tenant never receives another's response), the
route and the whole body as the client sent it (model, prompt and every
sampling parameter; ``stream`` and ``stream_options`` too, since a stream, a
JSON body and a stream with a usage chunk are different bytes). A hit replays
the stored bytes: a streamed response comes back as the same server-sent
events. Stored only after the replica answered 200 and, for streams, after
the stream's last event, never when it carried an error.

In memory: LRU bounded in entries and bytes, entries expire after ``ttl_s``.
Redis: shared by every gateway pointing at it; SET with EX, so expiry is
Redis's and the size bound is its ``maxmemory`` policy.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from typing import Any, Optional, Protocol

from octavo.gateway.config import CacheConfig

_PREFIX = "octavo:gateway:cache:"


def is_deterministic(body: dict[str, Any]) -> bool:
    return body.get("temperature") == 0 or body.get("seed") is not None


def cache_key(scope: str, path: str, body: dict[str, Any]) -> str:
    """``scope``: whose entry (an API key's digest or a tenant; "" for an open gateway)."""
    # sort_keys: the same request in another key order is the same request.
    canonical = json.dumps([scope, path, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return _PREFIX + hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()


class ResponseCache(Protocol):
    async def get(self, key: str) -> Optional[bytes]: ...

    async def put(self, key: str, value: bytes) -> None: ...

    async def close(self) -> None: ...


class MemoryCache:
    def __init__(self, config: CacheConfig) -> None:
        self._config = config
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._bytes = 0

    async def get(self, key: str) -> Optional[bytes]:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if time.monotonic() >= expires:
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return value

    async def put(self, key: str, value: bytes) -> None:
        if len(value) > self._config.max_bytes:
            return
        self._drop(key)
        self._entries[key] = (time.monotonic() + self._config.ttl_s, value)
        self._bytes += len(value)
        while len(self._entries) > self._config.max_entries or self._bytes > self._config.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])

    async def close(self) -> None:
        self._entries.clear()
        self._bytes = 0


class RedisCache:
    def __init__(self, redis: Any, config: CacheConfig) -> None:
        self._redis = redis
        self._config = config

    async def get(self, key: str) -> Optional[bytes]:
        return await self._redis.get(key)

    async def put(self, key: str, value: bytes) -> None:
        if len(value) <= self._config.max_bytes:
            await self._redis.set(key, value, ex=max(1, round(self._config.ttl_s)))

    async def close(self) -> None:
        pass  # the connection pool belongs to the app
