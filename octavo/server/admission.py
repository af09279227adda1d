"""Exact admission: how many requests the server holds at once.

A request reserves its place the moment its handler starts, before the
handler awaits anything (reading the body, tokenizing in a thread), and
gives it back when its response is over: finished, refused, failed, its
client gone or its task cancelled. Checking and taking a place is one
synchronous step on the event loop, so no burst can slip past the limit
between a check and the count it relies on (counting when the engine
request started let 71 of a burst of 100 in against a limit of 6).

The limit is the engine's running batch (``--max-num-seqs``) plus the
waiting queue the server allows (``--max-waiting-requests``): with the
batch full, at most that many requests wait. Each prompt of a batched
request is one engine request and takes one place.
"""
from __future__ import annotations

from typing import Optional

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from octavo.openai.errors import APIError


class Admission:
    """Places for ``limit`` engine requests at once (None: no limit); ``batch``: how many of them
    the engine runs at once (``--max-num-seqs``), the others wait."""

    def __init__(self, limit: Optional[int], batch: Optional[int] = None) -> None:
        self.limit = limit
        self.batch = batch
        self.in_use = 0

    def waiting_besides(self, reservation: Reservation) -> int:
        """Requests held now, ``reservation``'s aside, beyond what the engine's batch runs: the queue
        as of this moment, where the engine's own count arrives a snapshot later."""
        others = self.in_use - reservation.count
        return max(0, others - self.batch) if self.batch is not None else 0

    def reserve(self) -> Reservation:
        """One place, or the 503 when none is free."""
        reservation = Reservation(self)
        reservation.grow(1)
        return reservation

    def _take(self, count: int) -> None:
        if self.limit is not None and self.in_use + count > self.limit:
            raise APIError(
                503,
                f"the server holds as many requests as it admits ({self.in_use} of {self.limit}); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
        self.in_use += count


class Reservation:
    """A request's places; ``release`` gives them all back, once."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.count = 0

    def grow(self, count: int) -> None:
        """``count`` more places (a batch of prompts), or the 503 with none taken."""
        if self._admission is None:
            raise RuntimeError("a released reservation cannot grow")
        self._admission._take(count)
        self.count += count

    def release(self) -> None:
        if self._admission is not None:
            self._admission.in_use -= self.count
            self._admission, self.count = None, 0


class ReleasingResponse(Response):
    """``response``, releasing ``reservation`` once it is over: for a stream,
    after its last byte, its failure or its client's disconnect. (A finally in
    the stream's generator is not enough: a client gone before the first
    chunk cancels a generator that never started, and its finally never runs.)"""

    def __init__(self, response: Response, reservation: Reservation) -> None:
        # No super().__init__: this renders nothing of its own. Status and
        # headers are the wrapped response's (the same list: headers set here land there).
        self.response = response
        self.reservation = reservation
        self.status_code = response.status_code
        self.raw_headers = response.raw_headers
        self.background = response.background

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.response.background = self.background  # FastAPI sets it on the response it was given
        try:
            await self.response(scope, receive, send)
        finally:
            self.reservation.release()
