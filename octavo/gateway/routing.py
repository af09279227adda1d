"""Routing policies: which replica serves a request, and why.

Each policy returns a ``Decision`` whose ``reason`` feeds the
``octavo_gateway:routing_decisions`` metric. Every locality-seeking policy
(prefix, kv-aware, session) gives way to least-load when its choice is
overloaded: a cache hit saves one prefill, a queue of ``max_imbalance``
requests costs more than that.
"""
from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from octavo.core.prefix_hash import BlockHash, extend_block_hashes
from octavo.gateway.kv_index import KVIndex
from octavo.gateway.replicas import Replica

# Bounded memory of the prefix and session policies (oldest forgotten first).
_MAX_REMEMBERED = 100_000


@dataclass
class RouteInput:
    """What the policies know about a request."""

    prompt_bytes: bytes = b""  # the prompt's text (messages concatenated), for the prefix policy
    token_ids: Optional[list[int]] = None  # the prompt as the replicas tokenize it (kv-aware only)
    session: Optional[str] = None


@dataclass
class Decision:
    replica: Replica
    reason: str


class Policy(Protocol):
    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        """``candidates``: routable replicas, never empty."""


def least_loaded(candidates: list[Replica], turn: int) -> Replica:
    """Shortest queue; KV usage breaks ties (the emptier cache evicts less),
    then turns: idle replicas share the work instead of the first taking it all.
    ``turn`` counts the calling policy's decisions: its own, so a policy's
    choices depend on its history only (the simulator replays them exactly)."""
    start = turn % len(candidates)
    rotated = candidates[start:] + candidates[:start]
    return min(rotated, key=lambda r: (r.load, r.kv_usage))


def _overloaded(replica: Replica, candidates: list[Replica], max_imbalance: int) -> bool:
    return replica.load - min(r.load for r in candidates) > max_imbalance


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)], "round_robin")


class LeastLoad:
    def __init__(self) -> None:
        self._turns = itertools.count()

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        return Decision(least_loaded(candidates, next(self._turns)), "least_load")


@dataclass
class _Remembered:
    """Key -> replica URL (or what the policy keeps with it), least recently used first."""

    entries: OrderedDict[object, Any] = field(default_factory=OrderedDict)

    def get(self, key: object) -> Optional[Any]:
        url = self.entries.get(key)
        if url is not None:
            self.entries.move_to_end(key)
        return url

    def put(self, key: object, value: Any) -> None:
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > _MAX_REMEMBERED:
            self.entries.popitem(last=False)


class PrefixAffinity:
    """Without events: the prompt's text in chunks of ``chunk_bytes``, hashed
    as a chain (the prefix cache's hashing over bytes instead of token ids);
    the replica that last served the longest matching chain gets the request."""

    def __init__(self, chunk_bytes: int, max_imbalance: int) -> None:
        self._turns = itertools.count()
        self._chunk = chunk_bytes
        self._max_imbalance = max_imbalance
        self._owner = _Remembered()

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, request.prompt_bytes, self._chunk, len(request.prompt_bytes))
        by_url = {r.url: r for r in candidates}
        decision = None
        for h in reversed(hashes):
            owner = by_url.get(self._owner.get(h) or "")
            if owner is not None:
                if not _overloaded(owner, candidates, self._max_imbalance):
                    decision = Decision(owner, "prefix_hit")
                break
        if decision is None:
            chosen = least_loaded(candidates, next(self._turns))
            decision = Decision(chosen, "prefix_miss" if hashes else "least_load")
        for h in hashes:
            self._owner.put(h, decision.replica.url)
        return decision


class Session:
    """Sticky by the session header or the ``user`` field; new sessions go to the least loaded replica."""

    def __init__(self, max_imbalance: int) -> None:
        self._turns = itertools.count()
        self._max_imbalance = max_imbalance
        self._owner = _Remembered()

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        if request.session is None:
            return Decision(least_loaded(candidates, next(self._turns)), "least_load")
        owner = next((r for r in candidates if r.url == self._owner.get(request.session)), None)
        if owner is not None and not _overloaded(owner, candidates, self._max_imbalance):
            return Decision(owner, "session")
        chosen = least_loaded(candidates, next(self._turns))
        self._owner.put(request.session, chosen.url)
        return Decision(chosen, "session_new")


class KVAware:
    """Cached prefix against queue, in prompt tokens: each replica's cost is the
    prompt tokens it would prefill (those past its cached prefix) plus the
    prefills queued before it, each waiting request (and each sent since the
    last scrape) counted as the mean prefill routed so far: the mean of the
    routed prompts' tokens past the chosen replica's cached prefix, as the
    queue's requests are mostly cache hits too. (Counted as whole prompts, one
    request waiting out a prefill step outweighed a tenant's whole cached
    prefix and sent the tenant to a replica without it: on the gateway
    benchmark's 8 tenants over two replicas, 0.75 of the shared-prefix tokens
    hit and TTFT p50 was 0.77x round-robin's; counted as prefills, 0.96 and
    0.42x.) Running requests only slow each step a little under continuous
    batching; they weigh in through ``max_imbalance`` and the tie-break. A replica whose
    cached prefix is worth less than the extra queue it carries loses the
    request, so a hot replica sheds new tenants before its tail grows, and a
    returning tenant stays where its prefix is while the queues are close.

    The index learns of blocks from the replicas' events, which come only after
    a prefill: a tenant's second request arriving before then would miss. So the
    blocks of every routed prompt are remembered as in flight on their replica
    for ``in_flight_s`` and count as cached there."""

    def __init__(self, index: KVIndex, block_size: int, max_imbalance: int, in_flight_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        self._block_size = block_size
        self._max_imbalance = max_imbalance
        self._in_flight_s = in_flight_s
        self._clock = clock
        self._in_flight = _Remembered()  # block hash -> (replica URL, routed at)
        self._turns = itertools.count()
        self._mean_prefill = 0.0
        self._routed = 0

    def _matched(self, replica: Replica, hashes: list[BlockHash], now: float) -> int:
        n = self._index.matched_blocks(replica.url, hashes)
        for h in hashes[n:]:
            sent = self._in_flight.get(h)
            if sent is None or sent[0] != replica.url or now - sent[1] > self._in_flight_s:
                break
            n += 1
        return n

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        tokens = request.token_ids or []
        now = self._clock()
        # The engine never hits the prompt's last token (it must compute its logits).
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, tokens, self._block_size, max(0, len(tokens) - 1) // self._block_size)
        matched = {r.url: self._matched(r, hashes, now) for r in candidates}
        fewest = min(r.load for r in candidates)

        def prefill(replica: Replica) -> int:
            return len(tokens) - matched[replica.url] * self._block_size

        def cost(replica: Replica) -> float:
            queued = replica.load - replica.running
            return prefill(replica) + queued * self._mean_prefill

        eligible = [r for r in candidates if r.load - fewest <= self._max_imbalance]
        best = min(cost(r) for r in eligible)
        chosen = least_loaded([r for r in eligible if cost(r) == best], next(self._turns))
        self._routed += 1
        self._mean_prefill += (prefill(chosen) - self._mean_prefill) / min(self._routed, 100)
        if matched[chosen.url]:
            reason = "kv_hit"
        elif any(matched.values()):
            reason = "kv_overloaded"  # a replica holds part of the prompt, its queue outweighs it
        else:
            reason = "kv_miss"
        for h in hashes:
            self._in_flight.put(h, (chosen.url, now))
        return Decision(chosen, reason)
