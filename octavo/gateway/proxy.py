"""Sending one request to a replica, with retries on others.

A request is retried on another replica only while nothing has reached the
client: on a connection error, a timeout or a 502/503 before the response
started, and, for streams, until the first chunk has arrived (it is read
before the client's response starts). Once bytes are on their way, a failing
replica ends the stream with an error event. Every failure counts against the
replica's breaker; every answer under 500 counts for it. A 503 that says the
replica is overloaded (its queue is full, or it sheds the request's priority)
is retried elsewhere but is no failure: the replica is healthy, only busy, and
opening its breaker would move its load onto the others. When every replica
is overloaded, the client gets the last one's 503 and its Retry-After.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import httpx

from octavo.gateway.metrics import GatewayMetrics
from octavo.gateway.replicas import Replica, ReplicaSet
from octavo.gateway.routing import Policy, RouteInput

logger = logging.getLogger(__name__)

# 504: the request's own deadline ran out on the replica; another replica would not help.
_RETRIED = {500, 502, 503}
# The error codes of a replica's 503 that mean "busy" rather than "broken" (octavo/server/state.py, shedding.py).
_OVERLOADED_CODES = ("overloaded", "shed_low_priority")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class NoReplica(Exception):
    """Every routable replica failed (or there is none)."""


@dataclass
class Upstream:
    """The replica's answer: a whole body, or a stream of server-sent events."""

    status: int
    headers: dict[str, str]
    replica: Replica
    waited_s: float  # until the body, or the first chunk of a stream
    body: bytes = b""
    events: Optional[AsyncIterator[bytes]] = None
    overloaded: bool = False  # a 503 of a busy replica: try another before answering with it


@dataclass
class Forwarder:
    client: httpx.AsyncClient
    replicas: ReplicaSet
    policy: Policy
    metrics: GatewayMetrics
    auth_headers: dict[str, str]

    async def send(
        self, method: str, path: str, content: bytes, headers: dict[str, str], route: RouteInput, stream: bool
    ) -> Upstream:
        tried: set[str] = set()
        busy: Optional[Upstream] = None
        while True:
            candidates = [r for r in self.replicas.routable() if r.url not in tried]
            if not candidates:
                if busy is not None:
                    return busy
                raise NoReplica()
            decision = self.policy.choose(route, candidates)
            self.metrics.routing.labels(decision.reason).inc()
            replica = decision.replica
            tried.add(replica.url)
            answer = await self._attempt(replica, method, path, content, headers, stream)
            if answer is not None and answer.overloaded:
                busy = answer
            elif answer is not None:
                return answer

    async def _attempt(
        self, replica: Replica, method: str, path: str, content: bytes, headers: dict[str, str], stream: bool
    ) -> Optional[Upstream]:
        """The answer, or None after a failure worth a retry elsewhere."""
        replica.in_flight += 1
        handed_off = False
        start = time.monotonic()
        response: Optional[httpx.Response] = None
        try:
            request = self.client.build_request(
                method, replica.url + path, content=content, headers={**headers, **self.auth_headers}
            )
            response = await self.client.send(request, stream=True)
            self.metrics.requests.labels(replica.url, str(response.status_code)).inc()
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
            if response.status_code in _RETRIED:
                body = await response.aread()
                if response.status_code == 503 and _error_code(body) in _OVERLOADED_CODES:
                    return Upstream(503, out_headers, replica, time.monotonic() - start, body=body, overloaded=True)
                self._failed(replica)
                return None
            if stream and response.status_code == 200:
                events = _events(response.aiter_raw())
                first = await anext(events, b"")
                handed_off = True
                relay = self._relay(replica, response, events, first)
                return Upstream(200, out_headers, replica, time.monotonic() - start, events=relay)
            body = await response.aread()
            self._succeeded(replica, response.status_code)
            return Upstream(response.status_code, out_headers, replica, time.monotonic() - start, body=body)
        except httpx.HTTPError:
            self._failed(replica)
            return None
        finally:
            if not handed_off:
                replica.in_flight -= 1
                if response is not None:
                    await response.aclose()

    async def _relay(
        self, replica: Replica, response: httpx.Response, events: AsyncIterator[bytes], first: bytes
    ) -> AsyncIterator[bytes]:
        """The stream's events; closing it (the client went away) closes the
        upstream connection, which makes the replica abort the request."""
        try:
            if first:
                yield first
            async for event in events:
                yield event
            self._succeeded(replica, 200)
        except httpx.HTTPError as exc:
            logger.warning("replica %s lost mid-stream (%s): the client gets an in-band error",
                           replica.url, type(exc).__name__)
            self._failed(replica)
            error = {"error": {"message": "the replica failed during the stream", "type": "server_error",
                               "param": None, "code": "replica_failed"}}
            # The error, then the stream's usual end: clients that wait for [DONE] stop waiting.
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
        finally:
            replica.in_flight -= 1
            await response.aclose()

    def _failed(self, replica: Replica) -> None:
        self.metrics.errors.labels(replica.url).inc()
        replica.breaker.record_failure()

    def _succeeded(self, replica: Replica, status: int) -> None:
        if status < 500:
            replica.breaker.record_success()


def _error_code(body: bytes) -> Optional[str]:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None
    return code if isinstance(code, str) else None


async def _events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole server-sent events (each ending in a blank line), however TCP cut them."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            yield buffer[: end + 2]
            buffer = buffer[end + 2 :]
    if buffer:
        yield buffer


def split_events(data: bytes) -> list[bytes]:
    """A stored stream, cut back into its events for replay."""
    parts = data.split(b"\n\n")
    events = [p + b"\n\n" for p in parts[:-1]]
    return events + ([parts[-1]] if parts[-1] else [])
