"""Admission as a unit, on the event loop: lanes at once, a bounded wait, 429 with Retry-After, nothing lost."""

from __future__ import annotations

import asyncio

import pytest
from strata.gateway.admission import Admission, AdmissionPolicy
from strata.gateway.errors import RateLimitedError
from strata.gateway.metrics import GatewayMetrics


def admission(**policy: float) -> Admission:
    return Admission(AdmissionPolicy(**policy), metrics=GatewayMetrics())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lanes", "queue_per_lane", "burst", "admitted", "waiting", "rejected"),
    [
        pytest.param(2, 1, 2, 2, 0, 0, id="free lanes are taken at once"),
        pytest.param(1, 1, 2, 1, 1, 0, id="with the lane busy one request may wait"),
        pytest.param(1, 1, 6, 1, 1, 4, id="with the queue full the rest are refused"),
        pytest.param(2, 2, 9, 2, 4, 3, id="the queue holds queue_per_lane places per lane"),
        pytest.param(1, 0, 3, 1, 0, 2, id="no queue: every request beyond the lanes is refused"),
    ],
)
def test_a_burst_splits_into_admitted_waiting_and_refused(
    lanes: int, queue_per_lane: int, burst: int, admitted: int, waiting: int, rejected: int
) -> None:
    async def run() -> None:
        gate = admission(lanes=lanes, queue_per_lane=queue_per_lane, max_wait_s=5)
        tasks = [asyncio.create_task(gate.acquire()) for _ in range(burst)]
        await asyncio.sleep(0.01)
        refused = [t for t in tasks if t.done() and isinstance(t.exception(), RateLimitedError)]
        assert sum(t.done() and t.exception() is None for t in tasks) == admitted
        assert gate.waiting == waiting
        assert len(refused) == rejected
        assert all(t.exception().retry_after_s == 1 for t in refused)  # type: ignore[union-attr]
        for t in tasks:
            t.cancel()

    asyncio.run(run())


def test_a_released_lane_goes_to_the_oldest_waiter() -> None:
    async def run() -> None:
        gate = admission(lanes=1, queue_per_lane=2, max_wait_s=5)
        lane = await gate.acquire()
        first, second = asyncio.create_task(gate.acquire()), asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        gate.release(lane)
        assert await first == lane
        assert not second.done()
        second.cancel()

    asyncio.run(run())


def test_an_expired_wait_is_refused_and_leaves_the_queue() -> None:
    async def run() -> None:
        gate = admission(lanes=1, queue_per_lane=1, max_wait_s=0.05, retry_after_s=3)
        await gate.acquire()
        with pytest.raises(RateLimitedError, match=r"within 0.05 s") as caught:
            await gate.acquire()
        assert caught.value.headers() == {"Retry-After": "3"}
        assert gate.waiting == 0

    asyncio.run(run())


def test_a_waiter_that_hangs_up_gives_back_a_lane_handed_to_it() -> None:
    async def run() -> None:
        gate = admission(lanes=1, queue_per_lane=1, max_wait_s=5)
        lane = await gate.acquire()
        waiter = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        gate.release(lane)  # handed to the waiter...
        waiter.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.busy == 0
        assert await asyncio.wait_for(gate.acquire(), timeout=0.1) == lane

    asyncio.run(run())


def test_a_request_for_several_lanes_waits_for_all_of_them_and_nobody_overtakes() -> None:
    async def scenario() -> None:
        admission = Admission(AdmissionPolicy(lanes=3, queue_per_lane=1, max_wait_s=5), metrics=GatewayMetrics())
        held = await admission.acquire_lanes(2)
        three = asyncio.ensure_future(admission.acquire_lanes(3))
        await asyncio.sleep(0)
        one = asyncio.ensure_future(admission.acquire())  # behind the waiter for three, though a lane is free
        await asyncio.sleep(0)
        assert not three.done()
        assert not one.done()
        admission.release(held[0])
        await asyncio.sleep(0)
        assert not three.done()
        admission.release(held[1])
        assert sorted(await three) == [0, 1, 2]
        assert not one.done()
        for lane in await three:
            admission.release(lane)
        assert await one in (0, 1, 2)

    asyncio.run(scenario())


def test_an_expired_wait_for_several_lanes_passes_what_it_collected_on() -> None:
    async def scenario() -> None:
        admission = Admission(AdmissionPolicy(lanes=2, queue_per_lane=2, max_wait_s=0.05), metrics=GatewayMetrics())
        first = await admission.acquire()
        with pytest.raises(RateLimitedError):
            await admission.acquire_lanes(2)  # collects the free lane, waits for the other in vain
        assert admission.busy == 1
        admission.release(first)
        assert sorted(await admission.acquire_lanes(2)) == [0, 1]

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("lanes", "held", "resized", "released", "busy", "free_after"),
    [
        pytest.param(4, 1, 8, 0, 1, 7, id="lanes added with a pipeline are free at once"),
        pytest.param(8, 2, 4, 0, 2, 2, id="lanes taken away come out of the free ones first"),
        pytest.param(8, 6, 4, 0, 6, 0, id="lanes taken away while held are owed by their holders"),
        pytest.param(8, 6, 4, 2, 4, 0, id="owed lanes vanish as their holders release them"),
        pytest.param(8, 6, 4, 4, 2, 2, id="once the debt is paid released lanes are free again"),
        pytest.param(4, 4, 0, 4, 0, 0, id="no pipeline serves: no lane at all"),
    ],
)
def test_resizing_follows_the_serving_pipelines_without_handing_out_more_than_there_is(
    lanes: int, held: int, resized: int, released: int, busy: int, free_after: int
) -> None:
    async def run() -> None:
        gate = admission(lanes=lanes, queue_per_lane=1, max_wait_s=5)
        taken = [await gate.acquire() for _ in range(held)]
        gate.resize(resized)
        for lane in taken[:released]:
            gate.release(lane)
        assert gate.lanes == resized
        assert gate.busy == busy
        got = [await asyncio.wait_for(gate.acquire(), timeout=1) for _ in range(free_after)]
        assert len(set(got) | set(taken[released:])) == free_after + held - released, "no lane is handed out twice"
        assert gate.busy == busy + free_after <= max(resized, busy)

    asyncio.run(run())


def test_lanes_added_go_to_the_oldest_waiter_first() -> None:
    async def run() -> None:
        gate = admission(lanes=1, queue_per_lane=2, max_wait_s=5)
        await gate.acquire()
        first, second = asyncio.create_task(gate.acquire()), asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        gate.resize(2)
        assert await asyncio.wait_for(first, timeout=1) == 1
        await asyncio.sleep(0.01)
        assert not second.done()
        second.cancel()

    asyncio.run(run())
