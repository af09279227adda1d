"""``merge``: the interleaving the handlers read their engine requests through."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

import pytest

from octavo.server.streams import merge


async def _counting(name: str, n: int, closed: list[str]) -> AsyncIterator[str]:
    try:
        for i in range(n):
            await asyncio.sleep(0)
            yield f"{name}{i}"
    finally:
        closed.append(name)  # where an engine request's stream aborts it


@pytest.mark.parametrize("num_streams", [1, 3])
def test_merge_yields_every_item_with_its_stream_index(num_streams):
    async def run() -> list[tuple[int, str]]:
        closed: list[str] = []
        streams = [_counting(f"s{k}-", 4, closed) for k in range(num_streams)]
        return [pair async for pair in merge(streams)]

    got = asyncio.run(run())
    for k in range(num_streams):
        assert [item for i, item in got if i == k] == [f"s{k}-{j}" for j in range(4)]
    assert len(got) == 4 * num_streams


@pytest.mark.parametrize("num_streams", [1, 3])
def test_leaving_merge_early_closes_every_stream(num_streams):
    async def run() -> list[str]:
        closed: list[str] = []
        streams = [_counting(f"s{k}", 100, closed) for k in range(num_streams)]
        async with contextlib.aclosing(merge(streams)) as merged:
            async for _ in merged:
                break
        return closed

    assert sorted(asyncio.run(run())) == [f"s{k}" for k in range(num_streams)]
