"""How many pipelines a deployment wants, from what its gateway observes: a pure function of its inputs.

The executor (strata.operator.autoscaler) reads the inputs (spec.autoscaling, spec.replicas, ready pipelines, the
gateway's demand from the coordinator Lease, the timers kept in status.autoscaling, the time) and applies the answer;
nothing here reads the cluster or a clock, so the table in tests/operator/test_scaling.py is the whole behaviour.

The rules, in order:
- outside [minReplicas, maxReplicas]: back inside at once;
- no readable demand (no coordinator, or an annotation this operator cannot read): keep the count. Blind is not
  idle: scaling down on a missing signal would take capacity from traffic nobody can see;
- at zero: a request held or queued at the gateway brings one pipeline (a cold start), at once;
- pressure (requests waiting per serving lane above the target, or requests held while pipelines exist but none
  serves) for scaleUpDelaySeconds adds one pipeline, and only while every pipeline asked for serves: a pipeline
  that is still loading is capacity on its way, and adding another for the same queue would overshoot;
- idle (nothing waits, nothing held, and the busy lanes fit in one serving pipeline fewer) for
  scaleDownDelaySeconds removes one; the delay starts again after each change, so a burst that ends removes one
  pipeline per delay, not all at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from strata.demand import Demand


class ScaleReason(StrEnum):
    BELOW_MINIMUM = "BelowMinimum"
    ABOVE_MAXIMUM = "AboveMaximum"
    NO_SIGNAL = "NoSignal"
    COLD_START = "ColdStart"
    SCALED_TO_ZERO = "ScaledToZero"
    QUEUE_ABOVE_TARGET = "QueueAboveTarget"
    WAITING_FOR_PIPELINES = "WaitingForPipelines"
    AT_MAXIMUM = "AtMaximum"
    IDLE = "Idle"
    AT_MINIMUM = "AtMinimum"
    STEADY = "Steady"


@dataclass(frozen=True, kw_only=True)
class Bounds:
    min_replicas: int
    max_replicas: int
    target_queue_per_lane: float
    scale_up_delay_s: float
    scale_down_delay_s: float


@dataclass(frozen=True, kw_only=True)
class Timers:
    """When the current stretch of pressure or of idleness began (None while there is none), kept in status."""

    pressure_since: float | None = None
    idle_since: float | None = None


@dataclass(frozen=True, kw_only=True)
class Observed:
    replicas: int  # spec.replicas now
    ready: int  # pipelines that serve
    demand: Demand | None  # None: no coordinator holds the Lease, or its annotation cannot be read
    now: float  # seconds, on the clock the timers use


@dataclass(frozen=True, kw_only=True)
class Decision:
    replicas: int
    reason: ScaleReason
    message: str
    timers: Timers
    recheck_in: float | None = None  # seconds until a running timer may change the answer


def pressure(demand: Demand, *, replicas: int, target: float) -> bool:
    if demand.held > 0:
        return replicas > 0
    if demand.lanes == 0:
        return False
    return demand.queue / demand.lanes > target


def idle(demand: Demand, *, ready: int) -> bool:
    """Nothing waits, and the busy lanes would fit on the serving pipelines less one (lanes per pipeline as now)."""
    if demand.queue or demand.held:
        return False
    if ready == 0:
        return demand.busy == 0
    per_pipeline = demand.lanes / ready
    return demand.busy <= per_pipeline * (ready - 1)


def _since(start: float | None, now: float) -> float:
    return now if start is None else start


def _elapsed(start: float, now: float, delay: float) -> tuple[bool, float]:
    left = start + delay - now
    return left <= 0, max(left, 0.0)


def decide(observed: Observed, *, bounds: Bounds, timers: Timers) -> Decision:
    n, now = observed.replicas, observed.now
    if n < bounds.min_replicas:
        return Decision(
            replicas=bounds.min_replicas,
            reason=ScaleReason.BELOW_MINIMUM,
            message=f"{n} pipeline(s) is below minReplicas {bounds.min_replicas}",
            timers=Timers(),
        )
    if n > bounds.max_replicas:
        return Decision(
            replicas=bounds.max_replicas,
            reason=ScaleReason.ABOVE_MAXIMUM,
            message=f"{n} pipeline(s) is above maxReplicas {bounds.max_replicas}",
            timers=Timers(),
        )
    demand = observed.demand
    if demand is None:
        return Decision(
            replicas=n,
            reason=ScaleReason.NO_SIGNAL,
            message="no gateway coordinates, or its demand cannot be read: keeping the count",
            timers=Timers(),
        )
    if n == 0:
        if demand.held or demand.queue:
            return Decision(
                replicas=1,
                reason=ScaleReason.COLD_START,
                message=f"{demand.held + demand.queue} request(s) wait at the gateway with no pipeline: adding one",
                timers=Timers(),
            )
        return Decision(
            replicas=0,
            reason=ScaleReason.SCALED_TO_ZERO,
            message="no pipeline runs and none is asked for",
            timers=Timers(),
        )
    figures = f"{demand.queue} waiting, {demand.held} held, {demand.busy} of {demand.lanes} lanes busy"
    if pressure(demand, replicas=n, target=bounds.target_queue_per_lane):
        since = _since(timers.pressure_since, now)
        kept = Timers(pressure_since=since)
        if n >= bounds.max_replicas:
            return Decision(
                replicas=n, reason=ScaleReason.AT_MAXIMUM, message=f"{figures}; at maxReplicas", timers=kept
            )
        if observed.ready < n:
            message = f"{figures}; {n - observed.ready} pipeline(s) still loading"
            return Decision(replicas=n, reason=ScaleReason.WAITING_FOR_PIPELINES, message=message, timers=kept)
        due, left = _elapsed(since, now, bounds.scale_up_delay_s)
        if not due:
            message = f"{figures}; adding a pipeline in {left:.0f} s if it lasts"
            return Decision(replicas=n, reason=ScaleReason.STEADY, message=message, timers=kept, recheck_in=left)
        return Decision(
            replicas=n + 1,
            reason=ScaleReason.QUEUE_ABOVE_TARGET,
            message=f"{figures}: above {bounds.target_queue_per_lane:g} waiting per lane, adding a pipeline",
            timers=Timers(),
        )
    if idle(demand, ready=observed.ready):
        since = _since(timers.idle_since, now)
        kept = Timers(idle_since=since)
        if n <= bounds.min_replicas:
            return Decision(
                replicas=n, reason=ScaleReason.AT_MINIMUM, message=f"{figures}; at minReplicas", timers=kept
            )
        due, left = _elapsed(since, now, bounds.scale_down_delay_s)
        if not due:
            message = f"{figures}; removing a pipeline in {left:.0f} s if it stays idle"
            return Decision(replicas=n, reason=ScaleReason.STEADY, message=message, timers=kept, recheck_in=left)
        # The next removal waits a whole delay again.
        return Decision(
            replicas=n - 1,
            reason=ScaleReason.IDLE,
            message=f"{figures} for {bounds.scale_down_delay_s:g} s: removing a pipeline",
            timers=Timers(idle_since=now),
            recheck_in=bounds.scale_down_delay_s if n - 1 > bounds.min_replicas else None,
        )
    return Decision(replicas=n, reason=ScaleReason.STEADY, message=figures, timers=Timers())
