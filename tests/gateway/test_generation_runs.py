"""A generation's events read as runs: what the driver queued by the time the reader looks comes as one list, a
Finished ends the last, and an error ending the generation is raised after the tokens queued before it."""

from __future__ import annotations

import asyncio

import pytest
from strata.gateway.errors import GatewayError, PipelineError
from strata.gateway.generation import Finished, Generation, Sampling, Token


def token(token_id: int) -> Token:
    return Token(token_id=token_id, logprob=0.0, top_logprobs=())


# The queued events, in order; the lists the reader gets; whether it ends with the error.
CASES: dict[str, tuple[list[Token | Finished | GatewayError], list[list[int | str]], bool]] = {
    "a verified run and its end, queued together: one list": (
        [token(1), token(2), token(3), Finished("length")], [[1, 2, 3, "length"]], False,
    ),
    "tokens, then an error: the tokens, then the error": ([token(1), token(2), PipelineError("gone")], [[1, 2]], True),
    "an error alone": ([PipelineError("gone")], [], True),
    "events after a Finished are not read": ([token(1), Finished("stop"), token(2)], [[1, "stop"]], False),
}  # fmt: skip


@pytest.mark.parametrize(("queued", "runs", "raises"), CASES.values(), ids=CASES.keys())
def test_events_queued_together_are_read_together(
    queued: list[Token | Finished | GatewayError], runs: list[list[int | str]], raises: bool
) -> None:
    async def read() -> tuple[list[list[int | str]], bool]:
        g = Generation(slot=0, prompt=(1,), max_tokens=8, sampling=Sampling(), stop_ids=frozenset(), on_freed=print)
        for event in queued:
            g.events.put_nowait(event)
        got: list[list[int | str]] = []
        try:
            async for together in g.in_runs():
                got.append([e.token_id if isinstance(e, Token) else e.reason for e in together])
        except GatewayError:
            return got, True
        return got, False

    assert asyncio.run(read()) == (runs, raises)


def test_a_reader_waiting_gets_the_next_event_as_it_comes() -> None:
    async def read() -> list[list[Token | Finished]]:
        g = Generation(slot=0, prompt=(1,), max_tokens=8, sampling=Sampling(), stop_ids=frozenset(), on_freed=print)
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, g.events.put_nowait, token(5))
        loop.call_later(0.02, g.events.put_nowait, Finished("stop"))
        return [together async for together in g.in_runs()]

    assert asyncio.run(read()) == [[token(5)], [Finished("stop")]]
