"""Requests that arrive while no pipeline serves (strata.gateway.cold_start): held until one serves, counted as the
demand the operator scales up on, and answered 503 with Retry-After and the load progress once the wait is over."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from strata.gateway.cold_start import ColdStart, load_report
from strata.gateway.errors import ColdStartTimeoutError
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.pipelines import PipelineEntry, Pipelines
from strata.lease import FencingToken

TERM = FencingToken(lease_uid="lease", term=1, holder="gateway-a")
ENTRY = PipelineEntry(index=0, generation=3, first_stage="stage-0:9000", parallel=2, context=64)
STATUS = {
    "phase": "Loading",
    "replicas": 1,
    "readyReplicas": 0,
    "loadProgress": [
        {"stage": 0, "bytesLoaded": 10, "bytesTotal": 40},
        {"stage": 1, "bytesLoaded": 5, "bytesTotal": 60},
    ],
    "autoscaling": {"desiredReplicas": 1, "reason": "ColdStart"},
}


@dataclass(eq=False)
class ReadyDriver:
    """A driver that serves as soon as it is made: all a held request needs to see."""

    entry: PipelineEntry
    fence: FencingToken | None
    ready: bool = True
    deposed: bool = False
    not_ready_reason: str = ""
    prefixes: None = None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def promote(self, fence: FencingToken, *, valid_until: float) -> None:
        self.fence = fence

    def extend(self, *, valid_until: float) -> None:
        pass

    def step_down(self, reason: str) -> None:
        pass


def _pipelines(capacities: list[int]) -> Pipelines:
    def make(entry: PipelineEntry, fence: FencingToken | None, _ready: Callable[[bool], None]) -> ReadyDriver:
        return ReadyDriver(entry=entry, fence=fence)

    return Pipelines(make_driver=make, metrics=GatewayMetrics(), fence=TERM, on_capacity=capacities.append)  # type: ignore[arg-type]


def test_a_held_request_goes_on_once_a_pipeline_serves_and_counts_as_demand_meanwhile() -> None:
    async def body() -> None:
        capacities: list[int] = []
        pipelines = _pipelines(capacities)
        await pipelines.start(())
        assert not pipelines.ready
        assert pipelines.coordinating
        cold = ColdStart(wait_s=5, retry_after_s=2, progress=lambda: None)
        woken: list[str] = []
        cold.listeners.append(lambda: woken.append("renew the Lease now"))
        held = asyncio.create_task(cold.hold(pipelines))
        await asyncio.sleep(0.01)
        assert cold.held == 1, "the operator sees the request while it waits"
        assert woken == ["renew the Lease now"], "the demand goes out at once, not at the next renewal"
        await pipelines.update((ENTRY,))
        await asyncio.wait_for(held, timeout=1)
        assert cold.held == 0
        assert capacities[-1] == 2, "the lanes reach admission before the held request goes on"
        await pipelines.close()

    asyncio.run(body())


def test_a_request_held_past_the_bound_is_a_503_with_retry_after_and_the_load_progress() -> None:
    async def body() -> None:
        pipelines = _pipelines([])
        await pipelines.start(())
        cold = ColdStart(wait_s=0.05, retry_after_s=7, progress=lambda: load_report(STATUS))
        with pytest.raises(ColdStartTimeoutError) as raised:
            await cold.hold(pipelines)
        error = raised.value
        assert cold.held == 0
        assert error.status == 503
        assert error.headers() == {"Retry-After": "7"}
        assert error.body()["progress"] == {
            "phase": "Loading",
            "replicas": 1,
            "readyReplicas": 0,
            "bytesLoaded": 15,
            "bytesTotal": 100,
            "autoscaling": "ColdStart",
        }
        assert error.body()["error"]["code"] == "cold_start"  # type: ignore[index]
        await pipelines.close()

    asyncio.run(body())


def test_a_standby_does_not_coordinate_until_it_is_promoted() -> None:
    async def body() -> None:
        def make(entry: PipelineEntry, fence: FencingToken | None, _ready: Callable[[bool], None]) -> ReadyDriver:
            return ReadyDriver(entry=entry, fence=fence)

        pipelines = Pipelines(make_driver=make, metrics=GatewayMetrics(), fence=None)  # type: ignore[arg-type]
        await pipelines.start(())
        assert not pipelines.coordinating, "a standby holds nothing: it is not ready, so no request reaches it"
        pipelines.promote(TERM)
        assert pipelines.coordinating
        pipelines.step_down("lost the Lease")
        assert not pipelines.coordinating
        await pipelines.close()

    asyncio.run(body())


@pytest.mark.parametrize(
    ("wait_s", "retry_after_s"),
    [pytest.param(0, 1, id="no wait"), pytest.param(1, 0, id="no Retry-After")],
)
def test_a_cold_start_without_a_bound_is_refused(wait_s: float, retry_after_s: int) -> None:
    with pytest.raises(ValueError, match="positive wait"):
        ColdStart(wait_s=wait_s, retry_after_s=retry_after_s, progress=lambda: None)
