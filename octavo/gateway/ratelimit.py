"""Rate limits per API key: token buckets for requests and tokens per minute.

A bucket holds up to its per-minute budget and refills continuously at
budget/60 per second, so a key may burst its whole minute at once and then
runs at the steady rate. The request bucket is charged 1 at admission. The
token bucket admits while it is above zero, and the admitted request
reserves its estimated cost at once (its prompt, and the most it may
generate; at most the whole budget), so requests running side by side are
bounded together; when it ends the reservation is settled to its usage
(prompt + completion tokens): the difference is refunded or charged. The
bucket can go negative: the debt delays the key's next requests instead of
being forgiven.

In memory, or in Redis (one Lua script per take: atomic across gateway
replicas sharing the budget).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from octavo.gateway.config import KeyConfig


@dataclass
class Take:
    allowed: bool
    retry_after_s: float  # when not allowed: until the bucket holds what was needed


class Buckets(Protocol):
    async def take(self, key: str, capacity: float, cost: float, need: float) -> Take:
        """Refill ``key``'s bucket (``capacity`` per minute), then, if it holds
        at least ``need``, subtract ``cost`` (a refund when negative; never
        above ``capacity``) and allow."""


def _retry_after(tokens: float, need: float, capacity: float) -> float:
    return max(0.0, (need - tokens) / (capacity / 60.0))


class MemoryBuckets:
    def __init__(self) -> None:
        self._state: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)

    async def take(self, key: str, capacity: float, cost: float, need: float) -> Take:
        now = time.monotonic()
        tokens, at = self._state.get(key, (capacity, now))
        tokens = min(capacity, tokens + (now - at) * capacity / 60.0)
        if tokens < need:
            self._state[key] = (tokens, now)
            return Take(False, _retry_after(tokens, need, capacity))
        self._state[key] = (min(capacity, tokens - cost), now)
        return Take(True, 0.0)


# KEYS[1]: the bucket; ARGV: capacity, cost, need, now (s). Returns {allowed, tokens * 1000}.
_TAKE_LUA = """
local capacity = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local need = tonumber(ARGV[3])
local now = tonumber(ARGV[4])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * capacity / 60.0)
local allowed = 0
if tokens >= need then
  tokens = math.min(capacity, tokens - cost)
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
-- Gone once it would have refilled anyway (a debt is never forgotten early).
redis.call('EXPIRE', KEYS[1], math.ceil((capacity - tokens) * 60.0 / capacity) + 1)
return {allowed, math.floor(tokens * 1000)}
"""


class RedisBuckets:
    def __init__(self, redis: Any) -> None:
        self._script = redis.register_script(_TAKE_LUA)

    async def take(self, key: str, capacity: float, cost: float, need: float) -> Take:
        allowed, milli = await self._script(
            keys=[f"octavo:gateway:bucket:{key}"], args=[capacity, cost, need, time.time()]
        )
        if allowed:
            return Take(True, 0.0)
        return Take(False, _retry_after(milli / 1000.0, need, capacity))


def retry_after_header(seconds: float) -> str:
    """Whole seconds, at least 1 (the header has no fractions)."""
    return str(max(1, math.ceil(seconds)))


def _bucket_name(key: KeyConfig, kind: str) -> str:
    return f"{kind}:{key.digest}"


@dataclass
class Rejection:
    limit: str  # "requests" or "tokens"
    retry_after_s: float


class RateLimiter:
    def __init__(self, buckets: Buckets) -> None:
        self._buckets = buckets

    async def admit(self, key: KeyConfig, reserve: int) -> Optional[Rejection]:
        """Charge one request and reserve ``reserve`` tokens (capped at the
        key's budget); None when the key may go ahead. The reservation must be
        settled when the request ends."""
        if key.tpm is not None:
            # Checked and reserved in one take (atomic in Redis too); first, so that a request refused for
            # tokens does not spend its request budget.
            take = await self._buckets.take(_bucket_name(key, "tpm"), key.tpm, self.reserved(key, reserve), 1e-9)
            if not take.allowed:
                return Rejection("tokens", take.retry_after_s)
        if key.rpm is not None:
            take = await self._buckets.take(_bucket_name(key, "rpm"), key.rpm, 1.0, 1.0)
            if not take.allowed:
                await self.settle(key, reserve, 0)
                return Rejection("requests", take.retry_after_s)
        return None

    @staticmethod
    def reserved(key: KeyConfig, reserve: int) -> int:
        return min(reserve, key.tpm) if key.tpm is not None else 0

    async def settle(self, key: KeyConfig, reserve: int, used: int) -> None:
        """A request that reserved ``reserve`` (as given to admit) used ``used`` tokens."""
        if key.tpm is not None:
            cost = float(used - self.reserved(key, reserve))
            if cost:
                await self._buckets.take(_bucket_name(key, "tpm"), key.tpm, cost, -1e18)  # always applies
