"""Requests kept sorted by (priority, arrival): the scheduler's waiting and running sets."""
from __future__ import annotations

import bisect
from typing import Callable, Iterator

from octavo.core.request import Request

# (priority, arrival_time, admission counter): unique per request.
SortKey = tuple[int, float, int]


class RequestQueue:
    """Ordered by ``key(request)``, lowest first: the most urgent request at
    the front, the first preemption victim at the back. Keys must be unique."""

    def __init__(self, key: Callable[[Request], SortKey]) -> None:
        self._key = key
        self._keys: list[SortKey] = []
        self._requests: list[Request] = []

    def add(self, request: Request) -> None:
        key = self._key(request)
        i = bisect.bisect_left(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)

    def remove(self, request: Request) -> None:
        i = bisect.bisect_left(self._keys, self._key(request))
        if i == len(self._requests) or self._requests[i] is not request:
            raise KeyError(request.request_id)
        del self._keys[i]
        del self._requests[i]

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        # A snapshot: callers add and remove while walking.
        return iter(list(self._requests))
