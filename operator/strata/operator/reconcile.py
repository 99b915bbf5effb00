"""What the operator does for one ModelDeployment: inspect, inventory, plan, apply, report.

The kopf handlers (handlers.py) only call into this module and map its typed errors to kopf's retry semantics.
A plan that differs from the one in status starts a new plan generation; a shortfall leaves the children that
serve now in place and says why nothing new fits.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from strata.operator.children import Owner, gateway_deployment, render_children
from strata.operator.kube import Cluster
from strata.operator.models import ModelCache, ModelUnreadable
from strata.operator.names import Names
from strata.operator.planning import PlanRefused, foreign_pods, plan_deployment
from strata.operator.progress import load_failure, load_progress
from strata.operator.spec import ModelDeploymentSpec
from strata.operator.status import (
    Condition,
    ConditionType,
    Coordinator,
    EventReason,
    Excluded,
    ModelDeploymentStatus,
    Phase,
    PlanSummary,
    StageSummary,
)
from strata.plan import Plan

Manifest = dict[str, Any]


class InvalidSpec(Exception):
    """The spec passed the API server but not the handlers' model: retrying will not help."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: EventReason
    message: str


@dataclass
class Outcome:
    status: ModelDeploymentStatus
    events: list[Event] = field(default_factory=list)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    status: ModelDeploymentStatus, kind: ConditionType, *, ok: bool, reason: str, message: str, generation: int
) -> None:
    """Upsert a condition; lastTransitionTime moves only when the status flips."""
    value = "True" if ok else "False"
    for i, existing in enumerate(status.conditions):
        if existing.type == kind:
            moved = existing.last_transition_time if existing.status == value else _now()
            status.conditions[i] = Condition(
                type=kind,
                status=value,
                reason=reason,
                message=message,
                observedGeneration=generation,
                lastTransitionTime=moved,
            )
            return
    status.conditions.append(
        Condition(
            type=kind,
            status=value,
            reason=reason,
            message=message,
            observedGeneration=generation,
            lastTransitionTime=_now(),
        )
    )


def summarize(plan: Plan, *, generation: int) -> PlanSummary:
    return PlanSummary(
        generation=generation,
        stages=[
            StageSummary(
                index=s.index,
                node=s.node,
                gpus=len(s.gpus),
                backend=str(s.backend),
                layerStart=s.layer_start,
                layerEnd=s.layer_end,
            )
            for s in plan.stages
        ],
        contextLength=plan.context_length,
        parallel=plan.parallel,
        cacheTypeK=str(plan.cache_type_k),
        cacheTypeV=str(plan.cache_type_v),
    )


def same_placement(current: PlanSummary | None, new: PlanSummary) -> bool:
    if current is None:
        return False
    return current.model_dump(exclude={"generation"}) == new.model_dump(exclude={"generation"})


def model_name(spec: ModelDeploymentSpec) -> str:
    if spec.served_model_name:
        return spec.served_model_name
    return spec.model.url.rsplit("/", 1)[-1].removesuffix(".gguf").split("@")[0]


class Reconciler:
    def __init__(self, *, cluster: Cluster, models: ModelCache, image: str, operator_namespace: str) -> None:
        self.cluster = cluster
        self.models = models
        self.image = image
        self.operator_namespace = operator_namespace  # where the operator's pods run; stage policies admit them

    def reconcile(self, body: Manifest) -> Outcome:
        meta = body["metadata"]
        name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation", 1))
        status = ModelDeploymentStatus.model_validate(body.get("status") or {})
        status.observed_generation = generation
        try:
            spec = ModelDeploymentSpec.from_manifest(body["spec"])
        except ValidationError as e:
            raise InvalidSpec(str(e)) from e
        status.model_name = model_name(spec)
        token = self._token(spec, namespace)
        model = self.models.inspect(spec.model.url, token=token)

        nodes, pods = self.cluster.pool()
        others = foreign_pods(pods, name=name, namespace=namespace)
        outcome = Outcome(status=status)
        try:
            plan = plan_deployment(model=model, nodes=nodes, pods=others, spec=spec)
        except PlanRefused as e:
            set_condition(
                status, ConditionType.PLANNED, ok=False, reason=e.reason, message=str(e), generation=generation
            )
            status.phase = Phase.FAILED
            outcome.events.append(Event("Warning", e.event, str(e)))
            return outcome

        status.excluded = [Excluded(node=x.node, reason=x.reason) for x in plan.excluded]
        if plan.shortfall is not None:
            message = plan.shortfall.message
            repeated = status.shortfall == message
            status.shortfall = message
            set_condition(
                status,
                ConditionType.CAPACITY_AVAILABLE,
                ok=False,
                reason="Shortfall",
                message=message,
                generation=generation,
            )
            if status.plan is None:
                status.phase = Phase.SHORTFALL
                set_condition(
                    status, ConditionType.PLANNED, ok=False, reason="NoPlanFits", message=message, generation=generation
                )
            if not repeated:
                outcome.events.append(Event("Warning", EventReason.CAPACITY_SHORTFALL, message))
            return outcome

        status.shortfall = None
        previous = status.plan
        plan_generation = previous.generation if previous else 0
        summary = summarize(plan, generation=plan_generation or 1)
        if not same_placement(previous, summary):
            plan_generation += 1
            summary = summarize(plan, generation=plan_generation)
            if previous is None:
                outcome.events.append(Event("Normal", EventReason.PLANNED, _describe(summary)))
            else:
                outcome.events.append(Event("Normal", EventReason.REPLANNED, _describe(summary)))
        # A new generation loads beside the one that serves; the gateway moves over in advance() once it is ready.
        serving = status.serving if status.serving and status.serving.generation != summary.generation else summary
        owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
        for child in render_children(
            owner,
            spec,
            plan,
            generation=plan_generation,
            serving=serving,
            image=self.image,
            model_name=status.model_name,
            operator_namespace=self.operator_namespace,
        ):
            self.cluster.apply(child)
        self.cluster.delete_other_generations(
            namespace=namespace, deployment=name, keep={plan_generation, serving.generation}
        )

        status.plan = summary
        status.serving = serving
        status.stage_count = len(summary.stages)
        status.context_length = summary.context_length
        set_condition(
            status, ConditionType.PLANNED, ok=True, reason="Planned", message=_describe(summary), generation=generation
        )
        set_condition(
            status,
            ConditionType.CAPACITY_AVAILABLE,
            ok=True,
            reason="Fits",
            message=f"{len(summary.stages)} stage(s) placed",
            generation=generation,
        )
        status.endpoint = Names(name, namespace).gateway_url()
        self.observe(namespace=namespace, name=name, outcome=outcome, generation=generation)
        self.observe_coordinator(namespace=namespace, name=name, outcome=outcome)
        return outcome

    def advance(self, body: Manifest) -> Outcome:
        """Cut the gateway over to the newest generation once every one of its stages is ready.

        Until then the previous generation keeps serving: a new generation that never loads costs nothing but
        the GPUs it holds, and the status says which generation serves and why the newest does not yet.
        """
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        status = ModelDeploymentStatus.model_validate(body.get("status") or {})
        outcome = Outcome(status=status)
        pending, serving = status.plan, status.serving
        if pending is None or serving is None:
            return outcome
        if pending.generation == serving.generation:
            # The old generation goes only once the gateway pods that drive the new one are up: until then the
            # gateway that still runs may be driving the old stages.
            if self.cluster.gateway_rolled_out(namespace=namespace, name=Names(name, namespace).gateway):
                self.cluster.delete_other_generations(namespace=namespace, deployment=name, keep={serving.generation})
            return outcome
        stages = self.cluster.stage_readiness(namespace=namespace, deployment=name, generation=pending.generation)
        if len(stages) < len(pending.stages) or not all(s.ready for s in stages):
            return outcome
        try:
            spec = ModelDeploymentSpec.from_manifest(body["spec"])
        except ValidationError as e:
            raise InvalidSpec(str(e)) from e
        owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
        self.cluster.apply(
            gateway_deployment(owner, spec, serving=pending, image=self.image, model_name=model_name(spec))
        )
        status.serving = pending
        outcome.events.append(
            Event(
                "Normal",
                EventReason.CUT_OVER,
                f"every stage of generation {pending.generation} is ready: the gateway moves over from generation "
                f"{serving.generation}, which is removed once the new gateway pods are available",
            )
        )
        return outcome

    def observe(self, *, namespace: str, name: str, outcome: Outcome, generation: int) -> None:
        """Fold the children's readiness, and the load failures the stages report, into the status; a LoadFailed
        Event each time the failure says something new."""
        status = outcome.status
        if status.plan is None:
            return
        stages = self.cluster.stage_readiness(namespace=namespace, deployment=name, generation=status.plan.generation)
        pods = self.cluster.stage_pods(namespace=namespace, deployment=name, generation=status.plan.generation)
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
            reason=EventReason.LOAD_FAILED.value if failed else "Ready" if stages_ok else "Loading",
            message=failed or f"{ready} of {total} stages ready",
            generation=generation,
        )
        gateway_ok = self.cluster.gateway_available(namespace=namespace, name=Names(name, namespace).gateway)
        set_condition(
            status,
            ConditionType.GATEWAY_READY,
            ok=gateway_ok,
            reason="Available" if gateway_ok else "Unavailable",
            message="gateway has an available replica" if gateway_ok else "no gateway replica available",
            generation=generation,
        )
        serving = status.serving
        if serving is not None and serving.generation != status.plan.generation:
            old = self.cluster.stage_readiness(namespace=namespace, deployment=name, generation=serving.generation)
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
            reason="Ready" if all_ok else "NotReady",
            message=note if gateway_ok else f"{note}; no gateway replica available",
            generation=generation,
        )
        status.phase = Phase.READY if all_ok else Phase.FAILED if failed else Phase.LOADING

    def observe_coordinator(self, *, namespace: str, name: str, outcome: Outcome) -> None:
        """The gateway replica holding the coordinator Lease into status; an Event when the holder or term moves."""
        held = self.cluster.lease_holder(namespace=namespace, name=Names(name, namespace).coordinator_lease)
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

    def _token(self, spec: ModelDeploymentSpec, namespace: str) -> str | None:
        ref = spec.model.token_secret_ref
        if ref is None:
            return None
        try:
            return self.cluster.read_secret_value(namespace=namespace, name=ref.name, key=ref.key)
        except Exception as e:
            raise ModelUnreadable(f"cannot read token Secret {ref.name}/{ref.key}: {e}") from e


def _describe(summary: PlanSummary) -> str:
    stages = ", ".join(f"{s.node} layers [{s.layer_start},{s.layer_end})" for s in summary.stages)
    kv = f"{summary.cache_type_k}/{summary.cache_type_v}"
    return (
        f"generation {summary.generation}: {len(summary.stages)} stage(s) ({stages}), "
        f"context {summary.context_length}, {summary.parallel} slots, KV {kv}"
    )
