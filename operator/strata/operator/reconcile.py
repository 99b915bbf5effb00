"""What the operator does for one ModelDeployment: inspect, inventory, plan, apply, report.

The kopf handlers (handlers.py) only call into this module and map its typed errors to kopf's retry semantics.
A plan that differs from the one in status starts a new plan generation; a shortfall leaves the children that
serve now in place and says why nothing new fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from strata.gguf.model import ModelInfo
from strata.operator import observation
from strata.operator.backoff import Backoff
from strata.operator.children import Owner
from strata.operator.conditions import refuse, set_condition
from strata.operator.gateway_children import gateway_deployment
from strata.operator.kube import Cluster
from strata.operator.models import ModelCache, ModelUnreadable
from strata.operator.names import Names
from strata.operator.outcome import Event, InvalidSpec, Outcome
from strata.operator.planner import PipelinePlan
from strata.operator.planning import PlanRefused, foreign_pods, plan_replicas
from strata.operator.reasons import Reason
from strata.operator.render import PipelineChildren, render_children
from strata.operator.replicas import describe, place, previous_pipelines
from strata.operator.replicas import serving as serving_pipelines
from strata.operator.spec import ModelDeploymentSpec
from strata.operator.spec_fields import SecretKeyRef
from strata.operator.stage_cleanup import delete_unkept, listed, settle_retirement
from strata.operator.status import (
    ConditionType,
    EventReason,
    Excluded,
    ModelDeploymentStatus,
)
from strata.operator.zero import park

Manifest = dict[str, Any]


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cluster = cluster
        self.models = models
        self.backoff = backoff or Backoff()
        self.image = image
        self.operator_namespace = operator_namespace  # where the operator's pods run; stage policies admit them
        self.clock = clock  # wall time: retiring generations are stamped with it in status

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
            model = self.models.inspect(spec.model.url, token=self._token(spec.model.token_secret_ref, namespace))
            draft = self._draft(spec, namespace)
        except ModelUnreadable as e:
            outcome.retry_in = self.backoff.failed(meta["uid"], generation=generation)
            status.shortfall = None  # it described an older reading; kept, it would make the monitor re-plan
            return self._refused(outcome, reason=e.reason, message=str(e), meta=meta)
        self.backoff.succeeded(meta["uid"])

        nodes, pods = self.cluster.pool()
        others = foreign_pods(pods, name=name, namespace=namespace)
        try:
            pipelines, excluded = plan_replicas(model=model, nodes=nodes, pods=others, spec=spec)
        except PlanRefused as e:
            return self._refused(outcome, reason=e.reason, message=str(e), meta=meta, event=e.event)

        status.excluded = [Excluded(node=x.node, reason=x.reason) for x in excluded]
        first = pipelines[0]
        if first.plan is None:
            message = first.short or "no placement"
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
        owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
        listed_before = listed(previous_pipelines(status).values())
        if spec.replicas == 0:
            return self._at_zero(owner, status, spec, first, generation=generation, outcome=outcome)
        rendered = self._place(owner, status, pipelines, spec=spec, spec_generation=generation, outcome=outcome)
        zero = status.pipelines[0]
        # Pipeline 0 is placed (checked above): its plan is the new one, or the one it serves while it waits.
        assert zero.plan is not None
        assert zero.serving is not None
        for child in render_children(
            owner,
            spec,
            rendered,
            serving=zero.serving,
            served=serving_pipelines(status.pipelines),
            image=self.image,
            model_name=status.model_name,
            operator_namespace=self.operator_namespace,
            draft=draft,
        ):
            self.cluster.apply(child)
        poll_s = spec.coordination.retry_period_seconds
        retirement = settle_retirement(
            status,
            pipelines=status.pipelines,
            listed_before=listed_before,
            poll_s=poll_s,
            drain_s=spec.rollout.drain_seconds,
            now=self.clock(),
        )
        delete_unkept(self.cluster, namespace=namespace, deployment=name, decision=retirement)

        status.plan, status.serving = zero.plan, zero.serving
        status.stage_count = len(zero.plan.stages)
        status.context_length = zero.plan.context_length
        placed = sum(p.plan is not None for p in pipelines)
        set_condition(
            status,
            ConditionType.PLANNED,
            ok=True,
            reason=Reason.PLANNED,
            message=describe(zero.plan),
            generation=generation,
        )
        short = next((p.short for p in pipelines if p.plan is None), None)
        set_condition(
            status,
            ConditionType.CAPACITY_AVAILABLE,
            ok=short is None,
            reason=Reason.FITS if short is None else Reason.SHORTFALL,
            message=(
                f"{len(zero.plan.stages)} stage(s) placed"
                if spec.replicas == 1
                else f"{placed} of {spec.replicas} pipelines placed"
                + ("" if short is None else f"; pipeline {placed} and later: {short}")
            ),
            generation=generation,
        )
        status.endpoint = Names(name, namespace).gateway_url()
        self.observe(owner, outcome=outcome, generation=generation, replicas=spec.replicas)
        self.observe_coordinator(namespace=namespace, name=name, outcome=outcome)
        return outcome

    def _at_zero(
        self,
        owner: Owner,
        status: ModelDeploymentStatus,
        spec: ModelDeploymentSpec,
        first: PipelinePlan,
        *,
        generation: int,
        outcome: Outcome,
    ) -> Outcome:
        """replicas 0: every pipeline's stages go; the gateway and everything else stay (strata.operator.zero)."""
        assert first.plan is not None  # a shortfall of pipeline 0 returned before
        kept = park(status, first.plan, spec_generation=generation)
        model = status.model_name or model_name(spec)
        for child in render_children(
            owner,
            spec,
            [],
            serving=kept,
            served=[],
            image=self.image,
            model_name=model,
            operator_namespace=self.operator_namespace,
        ):
            self.cluster.apply(child)
        # At zero nothing is kept, retiring or not: the autoscaler scales to zero only once no request runs.
        self.cluster.delete_other_generations(namespace=owner.namespace, deployment=owner.name, keep=set())
        status.retiring = []
        status.endpoint = Names(owner.name, owner.namespace).gateway_url()
        self.observe(owner, outcome=outcome, generation=generation, replicas=0)
        self.observe_coordinator(namespace=owner.namespace, name=owner.name, outcome=outcome)
        return outcome

    def _place(
        self,
        owner: Owner,
        status: ModelDeploymentStatus,
        pipelines: Sequence[PipelinePlan],
        *,
        spec: ModelDeploymentSpec,
        spec_generation: int,
        outcome: Outcome,
    ) -> list[PipelineChildren]:
        """status.pipelines from the planner's pipelines and the rollout bound; the pipelines to render."""
        before = previous_pipelines(status)
        serving = {p.serving.generation for p in before.values() if p.serving is not None}
        placement = place(
            before,
            pipelines,
            replicas=spec.replicas,
            max_unavailable=spec.rollout.max_unavailable,
            spec_generation=spec_generation,
            ready={generation: observation.generation_ready(self.cluster, owner, generation) for generation in serving},
        )
        status.pipelines = placement.pipelines
        outcome.events += [Event(type, reason, message) for type, reason, message in placement.events]
        return placement.rendered

    def advance(self, body: Manifest) -> Outcome:
        """Move each pipeline over to its newest generation once every one of its stages is ready; pipeline 0's
        move also moves the gateway.

        Until then the previous generation keeps serving: a new generation that never loads costs nothing but
        the GPUs it holds, and the status says which generation serves and why the newest does not yet.
        """
        meta = body["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        status = ModelDeploymentStatus.model_validate(body.get("status") or {})
        outcome = Outcome(status=status)
        if status.plan is None or status.serving is None:
            return outcome
        pipelines = list(previous_pipelines(status).values())
        owner = Owner(name=name, namespace=namespace, uid=meta["uid"])
        try:
            spec = ModelDeploymentSpec.from_manifest(body["spec"])
        except ValidationError as e:
            raise InvalidSpec(str(e)) from e
        listed_before = listed(pipelines)
        moved = False
        for pipeline in pipelines:
            pending, serving = pipeline.plan, pipeline.serving
            if pending is None or serving is None or pending.generation == serving.generation:
                continue
            if not observation.generation_ready(self.cluster, owner, pending.generation):
                continue
            if pipeline.index == 0:
                # The draft's header is cached since the reconcile that planned `pending`: a HEAD request checks it.
                draft = self._draft(spec, namespace)
                self.cluster.apply(
                    gateway_deployment(
                        owner, spec, serving=pending, image=self.image, model_name=model_name(spec), draft=draft
                    )
                )
                status.serving = pending
            pipeline.serving = pending
            moved = True
            which = "the gateway moves over" if pipeline.index == 0 else f"pipeline {pipeline.index} moves over"
            outcome.events.append(
                Event(
                    "Normal",
                    EventReason.CUT_OVER,
                    f"every stage of generation {pending.generation} is ready: {which} from generation "
                    f"{serving.generation}, which is removed once the new gateway pods are available and have "
                    "drained it",
                )
            )
        if status.pipelines:
            status.pipelines = sorted(pipelines, key=lambda p: p.index)
        retirement = settle_retirement(
            status,
            pipelines=pipelines,
            listed_before=listed_before,
            poll_s=spec.coordination.retry_period_seconds,
            drain_s=spec.rollout.drain_seconds,
            now=self.clock(),
        )
        if not moved and self.cluster.gateway_rolled_out(namespace=namespace, name=Names(name, namespace).gateway):
            # Old generations go only once the gateway pods that drive the new one are up: until then the gateway
            # that still runs may be driving an old generation of pipeline 0. A generation the gateway may still be
            # draining stays until its bound (strata.operator.retirement).
            delete_unkept(self.cluster, namespace=namespace, deployment=name, decision=retirement)
        return outcome

    def observe(self, owner: Owner, *, outcome: Outcome, generation: int, replicas: int) -> None:
        """strata.operator.observation's `observe` on this operator's cluster."""
        observation.observe(self.cluster, owner, outcome=outcome, generation=generation, replicas=replicas)

    def observe_coordinator(self, *, namespace: str, name: str, outcome: Outcome) -> None:
        observation.observe_coordinator(self.cluster, namespace=namespace, name=name, outcome=outcome)

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

    def _draft(self, spec: ModelDeploymentSpec, namespace: str) -> ModelInfo | None:
        """The draft model's header, with speculative decoding's method draft: the gateway pod's memory counts it."""
        source = None if spec.speculative is None else spec.speculative.draft_model
        if source is None:
            return None
        try:
            return self.models.inspect(source.url, token=self._token(source.token_secret_ref, namespace))
        except ModelUnreadable as e:
            raise ModelUnreadable(f"draft model: {e}", reason=e.reason) from e

    def _token(self, ref: SecretKeyRef | None, namespace: str) -> str | None:
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
