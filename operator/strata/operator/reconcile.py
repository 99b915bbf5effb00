"""What the operator does for one ModelDeployment: inspect, inventory, plan, apply, report.

The kopf handlers (handlers.py) only call into this module and map its typed errors to kopf's retry semantics.
A plan that differs from the one in status starts a new plan generation; a shortfall leaves the children that
serve now in place and says why nothing new fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from strata.operator.backoff import Backoff
from strata.operator.children import Owner, gateway_deployment, render_children
from strata.operator.conditions import refuse, set_condition
from strata.operator.kube import Cluster
from strata.operator.models import ModelCache, ModelUnreadable
from strata.operator.names import Names
from strata.operator.planning import PlanRefused, foreign_pods, plan_deployment
from strata.operator.progress import load_failure, load_progress
from strata.operator.reasons import Reason
from strata.operator.spec import ModelDeploymentSpec
from strata.operator.status import (
    ConditionType,
    Coordinator,
    EventReason,
    Excluded,
    ModelDeploymentStatus,
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
    reason: str  # an EventReason, or the Planned condition's Reason when the spec cannot be applied
    message: str


@dataclass
class Outcome:
    status: ModelDeploymentStatus
    events: list[Event] = field(default_factory=list)
    retry_in: float | None = None  # seconds until the model is read again, while it cannot be read


def summarize(plan: Plan, *, generation: int, spec_generation: int | None = None) -> PlanSummary:
    return PlanSummary(
        generation=generation,
        specGeneration=spec_generation,
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
    same = {"generation", "spec_generation"}
    return current.model_dump(exclude=same) == new.model_dump(exclude=same)


def model_name(spec: ModelDeploymentSpec) -> str:
    if spec.served_model_name:
        return spec.served_model_name
    return spec.model.url.rsplit("/", 1)[-1].removesuffix(".gguf").split("@")[0]


class Reconciler:
    def __init__(
        self,
        *,
        cluster: Cluster,
        models: ModelCache,
        image: str,
        operator_namespace: str,
        backoff: Backoff | None = None,
    ) -> None:
        self.cluster = cluster
        self.models = models
        self.backoff = backoff or Backoff()
        self.image = image
        self.operator_namespace = operator_namespace  # where the operator's pods run; stage policies admit them

    def reconcile(self, body: Manifest) -> Outcome:
        """Plan and apply the spec, or say in the Planned condition why it cannot be (never an exception for a
        spec or a model that is wrong: every failure a person can fix is a condition)."""
        meta = body["metadata"]
        name, namespace, generation = meta["name"], meta["namespace"], int(meta.get("generation", 1))
        status = ModelDeploymentStatus.model_validate(body.get("status") or {})
        status.observed_generation = generation
        outcome = Outcome(status=status)
        try:
            spec = ModelDeploymentSpec.from_manifest(body["spec"])
        except ValidationError as e:
            return self._refused(outcome, reason=Reason.INVALID_SPEC, message=_validation_message(e), meta=meta)
        status.model_name = model_name(spec)
        try:
            model = self.models.inspect(spec.model.url, token=self._token(spec, namespace))
        except ModelUnreadable as e:
            outcome.retry_in = self.backoff.failed(meta["uid"], generation=generation)
            status.shortfall = None  # it described an older reading; kept, it would make the monitor re-plan
            return self._refused(outcome, reason=e.reason, message=str(e), meta=meta)
        self.backoff.succeeded(meta["uid"])

        nodes, pods = self.cluster.pool()
        others = foreign_pods(pods, name=name, namespace=namespace)
        try:
            plan = plan_deployment(model=model, nodes=nodes, pods=others, spec=spec)
        except PlanRefused as e:
            return self._refused(outcome, reason=e.reason, message=str(e), meta=meta, event=e.event)

        status.excluded = [Excluded(node=x.node, reason=x.reason) for x in plan.excluded]
        if plan.shortfall is not None:
            message = plan.shortfall.message
            repeated = status.shortfall == message
            status.shortfall = message
            set_condition(
                status,
                ConditionType.CAPACITY_AVAILABLE,
                ok=False,
                reason=Reason.SHORTFALL,
                message=message,
                generation=generation,
            )
            refuse(status, reason=Reason.NO_PLAN_FITS, message=message, generation=generation)
            if not repeated:
                outcome.events.append(Event("Warning", EventReason.CAPACITY_SHORTFALL, message))
            return outcome

        status.shortfall = None
        previous = status.plan
        plan_generation = previous.generation if previous else 0
        summary = summarize(plan, generation=plan_generation or 1, spec_generation=generation)
        if not same_placement(previous, summary):
            plan_generation += 1
            summary = summarize(plan, generation=plan_generation, spec_generation=generation)
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
            status,
            ConditionType.PLANNED,
            ok=True,
            reason=Reason.PLANNED,
            message=_describe(summary),
            generation=generation,
        )
        set_condition(
            status,
            ConditionType.CAPACITY_AVAILABLE,
            ok=True,
            reason=Reason.FITS,
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
            reason=Reason.LOAD_FAILED if failed else Reason.READY if stages_ok else Reason.LOADING,
            message=failed or f"{ready} of {total} stages ready",
            generation=generation,
        )
        gateway_ok = self.cluster.gateway_available(namespace=namespace, name=Names(name, namespace).gateway)
        set_condition(
            status,
            ConditionType.GATEWAY_READY,
            ok=gateway_ok,
            reason=Reason.AVAILABLE if gateway_ok else Reason.UNAVAILABLE,
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
            reason=Reason.READY if all_ok else Reason.NOT_READY,
            message=note if gateway_ok else f"{note}; no gateway replica available",
            generation=generation,
        )

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

    def _refused(
        self,
        outcome: Outcome,
        *,
        reason: str,
        message: str,
        meta: Manifest,
        event: EventReason | str | None = None,
    ) -> Outcome:
        """The spec cannot be applied: Planned=False with `reason`, and a Warning Event (the Event's message leaves
        out the retry delay, so that each retry of one cause counts on one Event)."""
        generation = int(meta.get("generation", 1))
        said = refuse(outcome.status, reason=reason, message=message, generation=generation, retry_in=outcome.retry_in)
        outcome.events.append(Event("Warning", event or reason, said))
        if outcome.retry_in is None:
            self.backoff.succeeded(meta["uid"])
        return outcome

    def _token(self, spec: ModelDeploymentSpec, namespace: str) -> str | None:
        ref = spec.model.token_secret_ref
        if ref is None:
            return None
        try:
            return self.cluster.read_secret_value(namespace=namespace, name=ref.name, key=ref.key)
        except ApiException as e:
            problem = "does not exist" if e.status == 404 else f"cannot be read (HTTP {e.status} {e.reason})"
            message = f"the token Secret {namespace}/{ref.name} {problem}"
        except KeyError:
            message = f"the token Secret {namespace}/{ref.name} has no key {ref.key!r}"
        raise ModelUnreadable(message, reason=Reason.TOKEN_SECRET_UNREADABLE)


def _validation_message(error: ValidationError) -> str:
    """Each field and what is wrong with it, without pydantic's links to its documentation."""
    return "; ".join(f"spec.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())


def _describe(summary: PlanSummary) -> str:
    stages = ", ".join(f"{s.node} layers [{s.layer_start},{s.layer_end})" for s in summary.stages)
    kv = f"{summary.cache_type_k}/{summary.cache_type_v}"
    return (
        f"generation {summary.generation}: {len(summary.stages)} stage(s) ({stages}), "
        f"context {summary.context_length}, {summary.parallel} slots, KV {kv}"
    )
