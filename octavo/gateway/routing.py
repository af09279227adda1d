"""Routing policies: which replica serves a request, and why.

Each policy returns a ``Decision`` whose ``reason`` feeds the
``octavo_gateway:routing_decisions`` metric. Every locality-seeking policy
(prefix, kv-aware, session) gives way to least-load when its choice is
overloaded: a cache hit saves one prefill, a queue of ``max_imbalance``
requests costs more than that.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Protocol

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


_turns = itertools.count()


def least_loaded(candidates: list[Replica]) -> Replica:
    """Shortest queue; KV usage breaks ties (the emptier cache evicts less),
    then turns: idle replicas share the work instead of the first taking it all."""
    start = next(_turns) % len(candidates)
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
    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        return Decision(least_loaded(candidates), "least_load")


@dataclass
class _Remembered:
    """Key -> replica URL, least recently used first."""

    entries: OrderedDict[object, str] = field(default_factory=OrderedDict)

    def get(self, key: object) -> Optional[str]:
        url = self.entries.get(key)
        if url is not None:
            self.entries.move_to_end(key)
        return url

    def put(self, key: object, url: str) -> None:
        self.entries[key] = url
        self.entries.move_to_end(key)
        while len(self.entries) > _MAX_REMEMBERED:
            self.entries.popitem(last=False)


class PrefixAffinity:
    """Without events: the prompt's text in chunks of ``chunk_bytes``, hashed
    as a chain (the prefix cache's hashing over bytes instead of token ids);
    the replica that last served the longest matching chain gets the request."""

    def __init__(self, chunk_bytes: int, max_imbalance: int) -> None:
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
            decision = Decision(least_loaded(candidates), "prefix_miss" if hashes else "least_load")
        for h in hashes:
            self._owner.put(h, decision.replica.url)
        return decision


class Session:
    """Sticky by the session header or the ``user`` field; new sessions go to the least loaded replica."""

    def __init__(self, max_imbalance: int) -> None:
        self._max_imbalance = max_imbalance
        self._owner = _Remembered()

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        if request.session is None:
            return Decision(least_loaded(candidates), "least_load")
        owner = next((r for r in candidates if r.url == self._owner.get(request.session)), None)
        if owner is not None and not _overloaded(owner, candidates, self._max_imbalance):
            return Decision(owner, "session")
        chosen = least_loaded(candidates)
        self._owner.put(request.session, chosen.url)
        return Decision(chosen, "session_new")


class KVAware:
    """The replica whose published KV blocks cover the longest prefix of the prompt's tokens."""

    def __init__(self, index: KVIndex, block_size: int, max_imbalance: int) -> None:
        self._index = index
        self._block_size = block_size
        self._max_imbalance = max_imbalance

    def choose(self, request: RouteInput, candidates: list[Replica]) -> Decision:
        tokens = request.token_ids or []
        # The engine never hits the prompt's last token (it must compute its logits).
        hashes: list[BlockHash] = []
        extend_block_hashes(hashes, tokens, self._block_size, max(0, len(tokens) - 1) // self._block_size)
        best, best_len = None, 0
        for replica in candidates:
            n = self._index.matched_blocks(replica.url, hashes)
            if n > best_len or (n == best_len and best is not None and n and replica.load < best.load):
                best, best_len = replica, n
        if best is None:
            return Decision(least_loaded(candidates), "kv_miss")
        if _overloaded(best, candidates, self._max_imbalance):
            return Decision(least_loaded(candidates), "kv_overloaded")
        return Decision(best, "kv_hit")
