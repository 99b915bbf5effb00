"""Several async streams read as one: the choices of an n > 1 request stream side by side, each line as it comes.

Each stream is pumped by its own task into one queue, so a slow choice never holds back a fast one. The first error
any stream raises ends the merged stream with that error; leaving early (the client hung up) cancels every pump,
which closes each stream where it stands (a generation's own cleanup cancels it on the pipeline).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

T = TypeVar("T")


class _Ended:
    pass


async def merged(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[T]:
    if len(streams) == 1:
        async for only in streams[0]:
            yield only
        return
    queue: asyncio.Queue[T | _Ended | BaseException] = asyncio.Queue()

    async def pump(stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put(item)
        except Exception as exc:  # handed to the reader, which raises it in the merged stream
            await queue.put(exc)
        finally:
            await queue.put(_Ended())

    pumps = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        ended = 0
        while ended < len(pumps):
            got = await queue.get()
            if isinstance(got, _Ended):
                ended += 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task
