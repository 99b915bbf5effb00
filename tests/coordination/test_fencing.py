"""Term fencing end to end, in process: two pipeline drivers (the gateway's) against one real pipeline of stages.

Whoever claims the stages with a newer term wins; the other learns it on its next call (FAILED_PRECONDITION), fails
what it was running with a retryable 503, stays down, and reports the refusal (the gateway records it as an Event).
A token whose Lease was not renewed in time is never sent, and nothing is reported: no stage refused it.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest
from strata.gateway.errors import GatewayError, NotReadyError
from strata.gateway.generation import Generation, Sampling, Token
from strata.gateway.pipeline import Pipeline
from strata.lease import FencingToken
from strata.stage_worker.server import RunningStage

PROMPT = (11, 22, 33, 44, 55)
Refusals = list[tuple[FencingToken, str]]


def _driver(stages: list[RunningStage], fence: FencingToken | None, refusals: Refusals | None = None) -> Pipeline:
    """A pipeline driver; what it hands to on_fenced goes into `refusals`."""
    settings = stages[0].service.settings
    return Pipeline(
        first_stage=f"127.0.0.1:{stages[0].port}",
        slots=settings.parallel,
        context=settings.context,
        fence=fence,
        probe_interval_s=0.1,
        on_fenced=lambda refused, details: (refusals if refusals is not None else []).append((refused, details)),
    )


async def _settled(pipeline: Pipeline, *, timeout_s: float = 30.0) -> None:
    """Until the driver is ready or has stepped down."""
    deadline = time.monotonic() + timeout_s
    while not (pipeline.ready or pipeline.deposed):
        assert time.monotonic() < deadline, f"the driver did not settle: {pipeline.not_ready_reason}"
        await asyncio.sleep(0.02)


async def _drain(generation: Generation) -> list[int] | GatewayError:
    """The generation's tokens, or the error that ended it."""
    try:
        return [event.token_id async for event in generation.stream() if isinstance(event, Token)]
    except GatewayError as error:
        return error


async def _generate(pipeline: Pipeline) -> list[int] | GatewayError:
    try:
        generation = pipeline.submit(
            slot=0, prompt=PROMPT, max_tokens=6, sampling=Sampling(), stop_ids=frozenset(), on_freed=lambda: None
        )
    except GatewayError as error:
        return error
    return await _drain(generation)


@pytest.mark.parametrize(
    ("second", "winner"),
    [
        pytest.param(
            FencingToken(lease_uid="lease-1", term=2, holder="b"),
            "second",
            id="a newer term claims the stages and the older coordinator steps down on its next call",
        ),
        pytest.param(
            FencingToken(lease_uid="lease-1", term=1, holder="b"),
            "first",
            id="the same term from another holder is refused and the first coordinator keeps serving",
        ),
        pytest.param(
            FencingToken(lease_uid="lease-2", term=1, holder="a"),
            "first",
            id="the same term from another Lease is refused and the first coordinator keeps serving",
        ),
    ],
)
def test_the_stages_follow_one_coordinator(stages: list[RunningStage], second: FencingToken, winner: str) -> None:
    async def scenario() -> None:
        refusals: dict[str, Refusals] = {"first": [], "second": []}
        first = _driver(stages, FencingToken(lease_uid="lease-1", term=1, holder="a"), refusals["first"])
        other = _driver(stages, second, refusals["second"])
        await first.start()
        try:
            await _settled(first)
            reference = await _generate(first)
            assert isinstance(reference, list)
            assert len(reference) == 6
            await other.start()
            await _settled(other)
            winning, losing = (other, first) if winner == "second" else (first, other)
            assert winning.ready
            assert not winning.deposed
            assert await _generate(winning) == reference, "the winner's output is the healthy pipeline's"
            refused = await _generate(losing)
            assert isinstance(refused, NotReadyError), refused
            assert refused.status == 503
            assert refused.headers() == {"Retry-After": "1"}
            assert losing.deposed
            assert not losing.ready
            assert winning.fence is not None
            assert stages[-1].service.fence.accepted_term == winning.fence.term, "every stage saw the winning term"
            if winner == "second":
                assert "older than the accepted term 2" in losing.not_ready_reason
            else:
                assert "cannot use it" in losing.not_ready_reason
            loser = "first" if winner == "second" else "second"
            assert refusals[winner] == []
            assert [fence for fence, _details in refusals[loser]] == [losing.fence], "one report, of the losing term"
            assert refusals[loser][0][1].startswith("stage 0: "), "the report names the stage that refused"
        finally:
            await first.close()
            await other.close()

    asyncio.run(scenario())


def test_a_lapsed_token_is_never_sent_to_the_stages(stages: list[RunningStage]) -> None:
    async def scenario() -> None:
        refusals: Refusals = []
        standby = _driver(stages, None, refusals)
        await standby.start()
        try:
            assert not standby.ready
            assert "standby" in standby.not_ready_reason
            standby.promote(FencingToken(lease_uid="lease-1", term=5, holder="a"), valid_until=-math.inf)
            await _settled(standby)
            assert standby.deposed
            assert "not renewed in time" in standby.not_ready_reason
            assert [s.service.fence.accepted_term for s in stages] == [0, 0]
            assert refusals == [], "a token that lapsed here was refused by no stage"
        finally:
            await standby.close()

    asyncio.run(scenario())


def test_stepping_down_fails_a_running_generation_with_a_retryable_error(stages: list[RunningStage]) -> None:
    async def scenario() -> None:
        leader = _driver(stages, None)
        await leader.start()
        try:
            leader.promote(FencingToken(lease_uid="lease-1", term=1, holder="a"), valid_until=math.inf)
            await _settled(leader)
            assert leader.ready
            generation = leader.submit(
                slot=1, prompt=PROMPT, max_tokens=200, sampling=Sampling(), stop_ids=frozenset(), on_freed=lambda: None
            )
            leader.step_down("lost the coordinator Lease")
            ended = await _drain(generation)
            assert isinstance(ended, NotReadyError)
            assert "lost the coordinator Lease" in ended.message
            assert not leader.ready
            assert leader.deposed
            with pytest.raises(NotReadyError):
                leader.submit(
                    slot=1,
                    prompt=PROMPT,
                    max_tokens=1,
                    sampling=Sampling(),
                    stop_ids=frozenset(),
                    on_freed=lambda: None,
                )
        finally:
            await leader.close()

    asyncio.run(scenario())
