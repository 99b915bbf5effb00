"""Admission on a real one-lane `strata serve`: a burst, an expired wait, and clients that hang up."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from strata_testbed.serve import Served

LONG = 3000  # tokens: several seconds of decoding, far longer than the one-second wait


def wait_for_gauge(served: Served, name: str, value: float, *, timeout_s: float = 2.0) -> float:
    """Seconds until the gauge reads `value` (the lane is freed by the driver, between two steps)."""
    start = time.monotonic()
    while served.metric(name) != value:
        assert time.monotonic() - start < timeout_s, f"{name} did not reach {value}"
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_burst_runs_one_queues_one_and_rejects_the_rest(one_lane: Served) -> None:
    client = AsyncOpenAI(base_url=one_lane.base_url, api_key="unused", max_retries=0, timeout=60)

    async def one() -> object:
        try:
            # Short: the queued request gets the lane only if the first one ends within the one-second wait (64
            # tokens took 1.2-1.7 s on the 2-core machine while other tests ran).
            return await client.completions.create(model=one_lane.model, prompt="Hi", max_tokens=16, temperature=0)
        except openai.RateLimitError as error:
            return error

    async def burst() -> list[object]:
        return await asyncio.gather(*(one() for _ in range(6)))

    results = asyncio.run(burst())
    served = [r for r in results if not isinstance(r, openai.RateLimitError)]
    rejected = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(served) == 2, "one request takes the lane, one waits for it"
    assert len(rejected) == 4
    for error in rejected:
        assert error.status_code == 429
        assert error.response.headers["retry-after"] == "1"
        assert error.body == {
            "message": error.body["message"],  # type: ignore[index]
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    assert one_lane.metric('strata_gateway_rejected_total{reason="queue_full"}') >= 4


def test_a_wait_longer_than_allowed_is_429_and_a_hang_up_frees_the_lane(one_lane: Served) -> None:
    body = {"model": one_lane.model, "prompt": "Hi", "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{one_lane.base_url}/completions", json=body) as long:
        assert long.status_code == 200
        lines = long.iter_lines()  # one iterator: dropping it would close the stream
        next(lines)  # it is generating: the lane is taken
        assert one_lane.metric("strata_gateway_lanes_busy") == 1
        started = time.monotonic()
        client = OpenAI(base_url=one_lane.base_url, api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=one_lane.model, prompt="Hi", max_tokens=2)
        waited = time.monotonic() - started
        assert 1.0 <= waited < 2.0, "the request waited its second for a lane, then gave up"
        assert caught.value.response.headers["retry-after"] == "1"
        assert "within 1 s" in caught.value.message
    # Leaving the `with` closed the stream mid-generation.
    assert wait_for_gauge(one_lane, "strata_gateway_lanes_busy", 0) < 1.0
    started = time.monotonic()
    follow_up = OpenAI(base_url=one_lane.base_url, api_key="unused", max_retries=0).completions.create(
        model=one_lane.model, prompt="Hi", max_tokens=2
    )
    assert follow_up.usage is not None
    assert time.monotonic() - started < 1.0, "the follow-up request was admitted at once"


def test_a_client_that_hangs_up_on_a_whole_reply_frees_the_lane(one_lane: Served) -> None:
    body = {"model": one_lane.model, "prompt": "Hi", "max_tokens": LONG, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{one_lane.base_url}/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_for_gauge(one_lane, "strata_gateway_lanes_busy", 0) < 1.0
    reply = httpx.post(f"{one_lane.base_url}/completions", json=body | {"max_tokens": 2}, timeout=5)
    assert reply.status_code == 200
