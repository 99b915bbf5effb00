"""The autoscaler's decision (strata.operator.scaling.decide): a table of what the gateway reports and what follows."""

from __future__ import annotations

import pytest
from strata.demand import Demand, DemandUnreadable
from strata.operator.scaling import Bounds, Observed, ScaleReason, Timers, decide

NOW = 10_000.0
BOUNDS = Bounds(min_replicas=0, max_replicas=3, target_queue_per_lane=0.5, scale_up_delay_s=5, scale_down_delay_s=60)


def _demand(*, lanes: int = 4, busy: int = 0, queue: int = 0, held: int = 0) -> Demand:
    return Demand(lanes=lanes, busy=busy, queue=queue, held=held)


def _seen(replicas: int, demand: Demand | None, *, ready: int | None = None) -> Observed:
    return Observed(replicas=replicas, ready=replicas if ready is None else ready, demand=demand, now=NOW)


@pytest.mark.parametrize(
    ("observed", "bounds", "timers", "replicas", "reason", "kept"),
    [
        pytest.param(
            _seen(0, _demand(lanes=0)),
            Bounds(
                min_replicas=1, max_replicas=3, target_queue_per_lane=0.5, scale_up_delay_s=5, scale_down_delay_s=60
            ),
            Timers(),
            1,
            ScaleReason.BELOW_MINIMUM,
            Timers(),
            id="below minReplicas: up to it at once",
        ),
        pytest.param(
            _seen(5, _demand(lanes=20)),
            BOUNDS,
            Timers(),
            3,
            ScaleReason.ABOVE_MAXIMUM,
            Timers(),
            id="above maxReplicas: down to it at once",
        ),
        pytest.param(
            _seen(2, None),
            BOUNDS,
            Timers(idle_since=NOW - 600),
            2,
            ScaleReason.NO_SIGNAL,
            Timers(),
            id="no signal is not idleness: the count stays and the idle timer is dropped",
        ),
        pytest.param(
            _seen(0, _demand(lanes=0, held=1)),
            BOUNDS,
            Timers(),
            1,
            ScaleReason.COLD_START,
            Timers(),
            id="at zero a held request brings one pipeline at once",
        ),
        pytest.param(
            _seen(0, _demand(lanes=0)),
            BOUNDS,
            Timers(),
            0,
            ScaleReason.SCALED_TO_ZERO,
            Timers(),
            id="at zero with nothing held it stays at zero",
        ),
        pytest.param(
            _seen(1, _demand(busy=4, queue=3)),
            BOUNDS,
            Timers(),
            1,
            ScaleReason.STEADY,
            Timers(pressure_since=NOW),
            id="a queue above the target starts the scale-up timer",
        ),
        pytest.param(
            _seen(1, _demand(busy=4, queue=3)),
            BOUNDS,
            Timers(pressure_since=NOW - 5),
            2,
            ScaleReason.QUEUE_ABOVE_TARGET,
            Timers(),
            id="a queue above the target for the delay adds one pipeline",
        ),
        pytest.param(
            _seen(1, _demand(busy=4, queue=2)),
            BOUNDS,
            Timers(pressure_since=NOW - 30),
            1,
            ScaleReason.STEADY,
            Timers(),
            id="a queue at the target is not above it",
        ),
        pytest.param(
            _seen(2, _demand(busy=4, queue=4), ready=1),
            BOUNDS,
            Timers(pressure_since=NOW - 30),
            2,
            ScaleReason.WAITING_FOR_PIPELINES,
            Timers(pressure_since=NOW - 30),
            id="while an added pipeline loads no other is added",
        ),
        pytest.param(
            _seen(3, _demand(lanes=12, busy=12, queue=12)),
            BOUNDS,
            Timers(pressure_since=NOW - 30),
            3,
            ScaleReason.AT_MAXIMUM,
            Timers(pressure_since=NOW - 30),
            id="at maxReplicas a queue adds nothing",
        ),
        pytest.param(
            _seen(1, _demand(lanes=0, held=2), ready=0),
            BOUNDS,
            Timers(pressure_since=NOW - 30),
            1,
            ScaleReason.WAITING_FOR_PIPELINES,
            Timers(pressure_since=NOW - 30),
            id="requests held while the only pipeline loads wait for it",
        ),
        pytest.param(
            _seen(2, _demand(lanes=8, busy=4)),
            BOUNDS,
            Timers(),
            2,
            ScaleReason.STEADY,
            Timers(idle_since=NOW),
            id="busy lanes that fit in one pipeline fewer start the idle timer",
        ),
        pytest.param(
            _seen(2, _demand(lanes=8, busy=5)),
            BOUNDS,
            Timers(idle_since=NOW - 600),
            2,
            ScaleReason.STEADY,
            Timers(),
            id="busy lanes that need every pipeline are not idle",
        ),
        pytest.param(
            _seen(2, _demand(lanes=8, busy=4)),
            BOUNDS,
            Timers(idle_since=NOW - 60),
            1,
            ScaleReason.IDLE,
            Timers(idle_since=NOW),
            id="idle for the delay removes one pipeline and starts the delay again",
        ),
        pytest.param(
            _seen(1, _demand()),
            BOUNDS,
            Timers(idle_since=NOW - 60),
            0,
            ScaleReason.IDLE,
            Timers(idle_since=NOW),
            id="with minReplicas 0 the last idle pipeline goes after the delay",
        ),
        pytest.param(
            _seen(1, _demand(busy=1)),
            BOUNDS,
            Timers(idle_since=NOW - 600),
            1,
            ScaleReason.STEADY,
            Timers(),
            id="one busy lane keeps the last pipeline",
        ),
        pytest.param(
            _seen(1, _demand()),
            Bounds(
                min_replicas=1, max_replicas=3, target_queue_per_lane=0.5, scale_up_delay_s=5, scale_down_delay_s=60
            ),
            Timers(idle_since=NOW - 600),
            1,
            ScaleReason.AT_MINIMUM,
            Timers(idle_since=NOW - 600),
            id="idle at minReplicas removes nothing",
        ),
    ],
)
def test_the_decision(
    observed: Observed, bounds: Bounds, timers: Timers, replicas: int, reason: ScaleReason, kept: Timers
) -> None:
    decision = decide(observed, bounds=bounds, timers=timers)
    assert (decision.replicas, decision.reason, decision.timers) == (replicas, reason, kept), decision.message


def test_a_running_timer_says_when_to_look_again() -> None:
    decision = decide(_seen(2, _demand(lanes=8)), bounds=BOUNDS, timers=Timers(idle_since=NOW - 45))
    assert decision.recheck_in == pytest.approx(15)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        pytest.param("not json", "not JSON", id="not JSON"),
        pytest.param("[1]", "a JSON object", id="not an object"),
        pytest.param('{"lanes":1,"busy":0,"queue":0}', "lacks ['held']", id="a field missing"),
        pytest.param('{"lanes":1,"busy":0,"queue":0,"held":0,"x":1}', "unknown fields ['x']", id="an unknown field"),
        pytest.param('{"lanes":-1,"busy":0,"queue":0,"held":0}', "demand.lanes", id="a negative count"),
        pytest.param('{"lanes":true,"busy":0,"queue":0,"held":0}', "demand.lanes", id="a boolean for a count"),
        pytest.param("{" + " " * 300 + "}", "over 256", id="too long"),
    ],
)
def test_a_demand_annotation_that_is_not_ours_is_refused_by_name(text: str, problem: str) -> None:
    with pytest.raises(DemandUnreadable, match=problem.replace("[", r"\[").replace("]", r"\]")):
        Demand.decode(text)


def test_demand_goes_through_its_annotation_unchanged() -> None:
    demand = Demand(lanes=8, busy=3, queue=1, held=0)
    assert Demand.decode(demand.encode()) == demand
