"""What the operator sees of a ModelDeployment's children, folded into its status: the stages' readiness and load
failures, each pipeline's readiness, the gateway's, and which gateway replica coordinates."""

from __future__ import annotations

from strata.operator.children import Owner, pipelines_configmap
from strata.operator.conditions import set_condition, set_gateway_ready
from strata.operator.kube import Cluster
from strata.operator.names import Names, stage_selector
from strata.operator.outcome import Event, Outcome
from strata.operator.progress import load_failure, load_progress
from strata.operator.reasons import Reason
from strata.operator.replicas import count, previous_pipelines
from strata.operator.replicas import serving as serving_pipelines
from strata.operator.status import ConditionType, Coordinator, EventReason, ModelDeploymentStatus
from strata.operator.zero import observed_at_zero


def observe(cluster: Cluster, owner: Owner, *, outcome: Outcome, generation: int, replicas: int) -> None:
    """Fold the children's readiness, and the load failures the stages report, into the status; a LoadFailed
    Event each time the failure says something new. `replicas` is spec.replicas."""
    name, namespace = owner.name, owner.namespace
    status = outcome.status
    if status.plan is None:
        return
    if replicas == 0:
        _observe_zero(cluster, owner, status=status, generation=generation)
        return
    stages = cluster.stage_readiness(namespace=namespace, deployment=name, generation=status.plan.generation)
    pods = cluster.stage_pods(namespace=namespace, deployment=name, generation=status.plan.generation)
    loads = load_progress(pods)
    status.load_progress = [load.progress() for load in loads]
    failed = load_failure(loads)
    ready = sum(s.ready for s in stages)
    total = len(status.plan.stages)
    status.ready = f"{ready}/{total}"
    stages_ok = ready == total
    if failed is not None:
        before = next((c for c in status.conditions if c.type == ConditionType.STAGES_READY), None)
        if before is None or (before.reason, before.message) != (EventReason.LOAD_FAILED.value, failed):
            outcome.events.append(Event("Warning", EventReason.LOAD_FAILED, failed))
    set_condition(
        status,
        ConditionType.STAGES_READY,
        ok=stages_ok and failed is None,
        reason=Reason.LOAD_FAILED if failed else Reason.READY if stages_ok else Reason.LOADING,
        message=failed or f"{ready} of {total} stages ready",
        generation=generation,
    )
    gateway_ok = cluster.gateway_available(namespace=namespace, name=Names(name, namespace).gateway)
    set_gateway_ready(status, ok=gateway_ok, generation=generation)
    _count_pipelines(cluster, owner, status=status)
    serving = status.serving
    if serving is not None and serving.generation != status.plan.generation:
        old = cluster.stage_readiness(namespace=namespace, deployment=name, generation=serving.generation)
        serving_ok = bool(old) and all(s.ready for s in old)
        note = (
            f"generation {serving.generation} serves while generation {status.plan.generation} loads "
            f"({ready} of {total} stages ready)"
        )
        if failed:
            note = f"generation {serving.generation} serves; generation {status.plan.generation}: {failed}"
    else:
        serving_ok, note = stages_ok, "serving" if stages_ok else failed or "waiting for stages"
    all_ok = serving_ok and gateway_ok
    set_condition(
        status,
        ConditionType.READY,
        ok=all_ok,
        reason=Reason.READY if all_ok else Reason.NOT_READY,
        message=note if gateway_ok else f"{note}; no gateway replica available",
        generation=generation,
    )


def _observe_zero(cluster: Cluster, owner: Owner, *, status: ModelDeploymentStatus, generation: int) -> None:
    gateway = Names(owner.name, owner.namespace).gateway
    gateway_ok = cluster.gateway_available(namespace=owner.namespace, name=gateway)
    observed_at_zero(status, generation=generation, gateway_ok=gateway_ok)
    status.selector = stage_selector(owner.name)
    cluster.apply(pipelines_configmap(owner, []))


def _count_pipelines(cluster: Cluster, owner: Owner, *, status: ModelDeploymentStatus) -> None:
    """Each pipeline's readiness into status, and the serving ones into the pipelines ConfigMap."""
    if not status.pipelines:
        status.pipelines = list(previous_pipelines(status).values())
    ready = {
        p.index: p.serving is not None and generation_ready(cluster, owner, p.serving.generation)
        for p in status.pipelines
    }
    desired = max(len(status.pipelines), 1)
    count(status, desired=desired, ready=ready)
    status.selector = stage_selector(owner.name)
    cluster.apply(pipelines_configmap(owner, serving_pipelines(status.pipelines)))


def observe_coordinator(cluster: Cluster, *, namespace: str, name: str, outcome: Outcome) -> None:
    """The gateway replica holding the coordinator Lease into status; an Event when the holder or term moves."""
    held = cluster.lease_holder(namespace=namespace, name=Names(name, namespace).coordinator_lease)
    status = outcome.status
    current = Coordinator(holder=held[0], term=held[1]) if held is not None else None
    if current is None or current == status.coordinator:
        return
    before = status.coordinator
    status.coordinator = current
    moved = f"from {before.holder} (term {before.term})" if before is not None else "as the first coordinator"
    outcome.events.append(
        Event(
            "Normal",
            EventReason.COORDINATOR_CHANGED,
            f"gateway replica {current.holder} coordinates the stages with term {current.term}, {moved}",
        )
    )


def generation_ready(cluster: Cluster, owner: Owner, generation: int) -> bool:
    """Every stage of the generation is ready."""
    stages = cluster.stage_readiness(namespace=owner.namespace, deployment=owner.name, generation=generation)
    return bool(stages) and all(s.ready for s in stages)
