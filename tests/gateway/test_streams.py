"""Merging the streams of several choices: every item of each, in each one's own order; the first error ends the
merge and closes the other streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from strata.gateway.streams import merged


async def counting(
    name: str, count: int, *, delay: float, closed: list[str], fail_at: int | None = None
) -> AsyncIterator[str]:
    try:
        for i in range(count):
            await asyncio.sleep(delay)
            if i == fail_at:
                raise ValueError(f"{name} failed")
            yield f"{name}{i}"
    finally:
        closed.append(name)


@pytest.mark.parametrize("streams", [1, 3], ids=["one stream", "three streams"])
def test_every_item_comes_through_in_each_streams_order(streams: int) -> None:
    async def scenario() -> list[str]:
        closed: list[str] = []
        sources = [counting(chr(97 + s), 4, delay=0.001 * (s + 1), closed=closed) for s in range(streams)]
        return [item async for item in merged(sources)]

    items = asyncio.run(scenario())
    for s in range(streams):
        name = chr(97 + s)
        assert [i for i in items if i.startswith(name)] == [f"{name}{i}" for i in range(4)]


def test_the_first_error_ends_the_merge_and_closes_the_others() -> None:
    async def scenario() -> tuple[list[str], list[str]]:
        closed: list[str] = []
        got: list[str] = []
        slow = counting("slow", 100, delay=0.01, closed=closed)
        failing = counting("bad", 5, delay=0.001, closed=closed, fail_at=2)

        async def drain() -> None:
            async for item in merged([slow, failing]):
                got.append(item)

        with pytest.raises(ValueError, match="bad failed"):
            await drain()
        return got, closed

    got, closed = asyncio.run(scenario())
    assert got[:2] == ["bad0", "bad1"]
    assert sorted(closed) == ["bad", "slow"]
