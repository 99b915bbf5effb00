"""Pipelines following the serving list, with drivers that only record what they are told (the live test,
test_pipelines_live.py, runs real stages; these pin the bookkeeping: who is driven, who drains, who is told to stop).

Each case is a list of serving pipelines before and after an update, with generations running where the case says.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from strata.gateway.errors import NotReadyError
from strata.gateway.generation import Generation, Sampling
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipelines import PipelineEntry, Pipelines
from strata.lease import FencingToken

TERM_1 = FencingToken(lease_uid="lease", term=1, holder="gateway-a")
TERM_2 = FencingToken(lease_uid="lease", term=2, holder="gateway-a")


def entry(index: int, *, generation: int = 1, parallel: int = 2) -> PipelineEntry:
    return PipelineEntry(
        index=index, generation=generation, first_stage=f"stage-{index}:9000", parallel=parallel, context=64
    )


@dataclass(eq=False)
class RecordingDriver:
    """What Pipelines asks of a driver, recorded; generations end when the test says."""

    entry: PipelineEntry
    fence: FencingToken | None
    ready: bool = True
    deposed: bool = False
    not_ready_reason: str = ""
    prefixes: None = None
    started: bool = False
    closed: bool = False
    stopped: list[str] = field(default_factory=list)
    running: list[Generation] = field(default_factory=list)

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        self.closed = True

    def promote(self, fence: FencingToken, *, valid_until: float) -> None:
        self.fence = fence

    def extend(self, *, valid_until: float) -> None:
        pass

    def step_down(self, reason: str) -> None:
        self.stopped.append(reason)
        for generation in list(self.running):
            self.finish(generation)

    def submit(
        self,
        *,
        slot: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: Sampling,
        stop_ids: frozenset[int],
        on_freed: Callable[[], None],
        constraint: object = None,
        cache_salt: str = "",
    ) -> Generation:
        generation = Generation(
            slot=slot, prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids, on_freed=on_freed,
            cache_salt=cache_salt,
        )  # fmt: skip
        self.running.append(generation)
        return generation

    def cancel(self, generation: Generation) -> None:
        self.finish(generation)

    def finish(self, generation: Generation) -> None:
        self.running.remove(generation)
        generation.on_freed()


class Gateway:
    """Pipelines over recording drivers: every driver ever made, in order, and the capacities announced."""

    def __init__(self, *, drain_s: float = 5.0) -> None:
        self.made: list[RecordingDriver] = []
        self.capacities: list[int] = []

        def make(e: PipelineEntry, fence: FencingToken | None, _on_ready: Callable[[bool], None]) -> RecordingDriver:
            driver = RecordingDriver(entry=e, fence=fence)
            self.made.append(driver)
            return driver

        self.pipelines = Pipelines(
            make_driver=make,  # type: ignore[arg-type]
            metrics=GatewayMetrics(),
            fence=TERM_1,
            on_capacity=self.capacities.append,
            drain_s=drain_s,
        )

    def driver(self, index: int, generation: int = 1) -> RecordingDriver:
        return next(d for d in reversed(self.made) if d.entry.index == index and d.entry.generation == generation)

    def submit(self, prompt: tuple[int, ...] = (1, 2, 3)) -> Generation:
        return self.pipelines.submit(
            prompt=prompt, max_tokens=4, sampling=Sampling(), stop_ids=frozenset(), on_freed=lambda: None
        )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@dataclass(frozen=True)
class Case:
    before: tuple[PipelineEntry, ...]
    after: tuple[PipelineEntry, ...]
    driven: set[tuple[int, int]]  # (index, generation) of the drivers that serve after the update
    closed: set[tuple[int, int]]  # drivers closed at once (nothing ran on them)
    capacity: int


CASES = {
    "a pipeline added": Case((entry(0),), (entry(0), entry(1, parallel=3)), {(0, 1), (1, 1)}, set(), 5),
    "a pipeline removed": Case((entry(0), entry(1)), (entry(0),), {(0, 1)}, {(1, 1)}, 2),
    "a new generation replaces the old": Case((entry(0),), (entry(0, generation=2),), {(0, 2)}, {(0, 1)}, 2),
    "every pipeline gone": Case((entry(0), entry(1)), (), set(), {(0, 1), (1, 1)}, 0),
    "the same list again": Case((entry(0), entry(1)), (entry(0), entry(1)), {(0, 1), (1, 1)}, set(), 4),
}


@pytest.mark.parametrize("name", CASES)
def test_an_update_drives_exactly_the_serving_pipelines(name: str) -> None:
    async def body() -> None:
        case = CASES[name]
        gateway = Gateway()
        await gateway.pipelines.start(case.before)
        await gateway.pipelines.update(case.after)
        await settle()
        assert set(gateway.pipelines.drivers) == {index for index, _ in case.driven}
        serving = {id(d) for d in gateway.pipelines.drivers.values()}
        assert {(d.entry.index, d.entry.generation) for d in gateway.made if id(d) in serving} == case.driven
        assert {(d.entry.index, d.entry.generation) for d in gateway.made if d.closed} == case.closed
        assert all(d.started for d in gateway.made)
        assert gateway.pipelines.capacity == case.capacity
        assert gateway.capacities[-1] == case.capacity
        assert gateway.pipelines.ready == bool(case.after)
        await gateway.pipelines.close()

    asyncio.run(body())


def test_a_pipeline_that_leaves_takes_no_new_request_and_closes_once_its_last_one_ends() -> None:
    async def body() -> None:
        gateway = Gateway()
        await gateway.pipelines.start((entry(0, parallel=1),))
        running = gateway.submit()
        await gateway.pipelines.update((entry(1, parallel=1),))
        old = gateway.driver(0)
        assert not old.closed, "it drains: what it runs may finish"
        assert not old.stopped
        assert gateway.pipelines.pipeline_of(gateway.submit()) == 1, "new requests go to the pipeline that serves"
        old.finish(running)
        await settle()
        assert old.closed
        assert old.stopped == ["pipeline 0 (generation 1) no longer serves"]

    asyncio.run(body())


def test_a_pipeline_that_does_not_drain_in_time_is_stopped() -> None:
    async def body() -> None:
        gateway = Gateway(drain_s=0.05)
        await gateway.pipelines.start((entry(0),))
        gateway.submit()
        await gateway.pipelines.update(())
        await asyncio.sleep(0.2)
        old = gateway.driver(0)
        assert old.stopped == ["pipeline 0 (generation 1) no longer serves"]
        assert old.closed
        assert not old.running
        with pytest.raises(NotReadyError, match="no serving pipeline has a free lane"):
            gateway.submit()

    asyncio.run(body())


def test_a_new_term_stops_what_a_leaving_pipeline_still_runs() -> None:
    async def body() -> None:
        gateway = Gateway()
        await gateway.pipelines.start((entry(0), entry(1)))
        gateway.submit()
        gateway.submit()
        leaving = [d for d in gateway.made if d.running]
        await gateway.pipelines.update(())
        gateway.pipelines.promote(TERM_2)
        await settle()
        assert leaving, "the requests ran somewhere"
        for driver in leaving:
            assert driver.stopped[0] == "the coordinator moved to term 2"
            assert driver.closed

    asyncio.run(body())


def test_a_full_pipeline_sends_the_next_request_to_another() -> None:
    async def body() -> None:
        gateway = Gateway()
        await gateway.pipelines.start((entry(0, parallel=1), entry(1, parallel=1)))
        first, second = gateway.submit(), gateway.submit()
        freed = gateway.pipelines.pipeline_of(first)
        assert {freed, gateway.pipelines.pipeline_of(second)} == {0, 1}
        with pytest.raises(NotReadyError):
            gateway.submit()
        gateway.pipelines.cancel(first)
        assert gateway.pipelines.pipeline_of(first) is None
        assert gateway.pipelines.pipeline_of(gateway.submit()) == freed, "the lane that freed takes the next request"
        await gateway.pipelines.close()

    asyncio.run(body())
