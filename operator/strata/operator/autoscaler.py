"""The autoscaler's thin executor: read the inputs of strata.operator.scaling.decide, keep its timers in status, and
set spec.replicas when the answer differs.

It runs inside each deployment's monitor (strata.operator.handlers), so only the operator replica that holds the
operator Lease acts: the others run no kopf handler at all. Its inputs cost no request: the gateway's demand is an
annotation on the coordinator Lease (strata.demand), which the watch-fed cache holds, and a change in it rings the
deployment's doorbell. The count is written as `kubectl scale` writes it (spec.replicas), so the scale subresource,
`kubectl get` and the rollout all see one number and the spec handler reconciles it like any other change.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.demand import DEMAND_ANNOTATION, Demand, DemandUnreadable
from strata.operator.kube import Cluster
from strata.operator.names import Names
from strata.operator.scaling import Bounds, Decision, Observed, ScaleReason, Timers, decide
from strata.operator.spec_scaling import Autoscaling
from strata.operator.status import AutoscalingStatus, ModelDeploymentStatus, ObservedDemand
from strata.operator.timestamps import seconds, stamp


def bounds_of(autoscaling: Autoscaling) -> Bounds:
    return Bounds(
        min_replicas=autoscaling.min_replicas,
        max_replicas=autoscaling.max_replicas,
        target_queue_per_lane=autoscaling.target_queue_per_lane,
        scale_up_delay_s=autoscaling.scale_up_delay_seconds,
        scale_down_delay_s=autoscaling.scale_down_delay_seconds,
    )


def _stamp(at: float | None) -> str | None:
    return None if at is None else stamp(at)


def _seconds(text: str | None) -> float | None:
    return None if text is None else seconds(text)


def read_demand(cluster: Cluster, *, namespace: str, name: str) -> tuple[Demand | None, str | None]:
    """The coordinator's demand, or None and why not (no gateway has reported, or the annotation is malformed)."""
    lease = Names(name, namespace).coordinator_lease
    if cluster.lease_holder(namespace=namespace, name=lease) is None:
        return None, "no gateway replica holds the coordinator Lease"
    text = cluster.lease_annotation(namespace=namespace, name=lease, key=DEMAND_ANNOTATION)
    if text is None:
        return None, f"the coordinator has not written {DEMAND_ANNOTATION} on Lease {lease} yet"
    try:
        return Demand.decode(text), None
    except DemandUnreadable as e:
        return None, str(e)


@dataclass(frozen=True)
class Applied:
    decision: Decision
    scaled_from: int | None  # spec.replicas before, when it was changed


def autoscale(
    cluster: Cluster,
    *,
    namespace: str,
    name: str,
    autoscaling: Autoscaling,
    replicas: int,
    status: ModelDeploymentStatus,
    now: float,
) -> Applied:
    """Decide, record the decision in status.autoscaling, and scale when it says so."""
    demand, unread = read_demand(cluster, namespace=namespace, name=name)
    before = status.autoscaling
    timers = Timers(
        pressure_since=_seconds(before.pressure_since) if before else None,
        idle_since=_seconds(before.idle_since) if before else None,
    )
    decision = decide(
        Observed(replicas=replicas, ready=status.ready_replicas, demand=demand, now=now),
        bounds=bounds_of(autoscaling),
        timers=timers,
    )
    message = decision.message if unread is None or decision.reason is not ScaleReason.NO_SIGNAL else unread
    scaled = decision.replicas != replicas
    status.autoscaling = AutoscalingStatus(
        desiredReplicas=decision.replicas,
        reason=decision.reason.value,
        message=message[:1024],
        demand=ObservedDemand(**vars(demand)) if demand is not None else None,
        pressureSince=_stamp(decision.timers.pressure_since),
        idleSince=_stamp(decision.timers.idle_since),
        lastScaleTime=_stamp(now) if scaled else (before.last_scale_time if before else None),
    )
    if scaled:
        cluster.scale(namespace=namespace, name=name, replicas=decision.replicas)
    return Applied(decision=decision, scaled_from=replicas if scaled else None)
