"""Every child of a ModelDeployment, for the pipelines it places, in the order they are applied (no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from strata.gguf.model import ModelInfo
from strata.operator.children import (
    Manifest,
    Owner,
    pipelines_configmap,
    plan_configmap,
    stage_statefulset,
    stages_disruption_budget,
    stages_service,
)
from strata.operator.gateway_children import (
    coordinator_lease,
    gateway_access,
    gateway_deployment,
    gateway_ingress,
    gateway_service,
)
from strata.operator.network_policies import gateway_network_policy, stage_network_policy
from strata.operator.spec import ModelDeploymentSpec
from strata.operator.status import PlanSummary
from strata.plan import Plan


@dataclass(frozen=True)
class PipelineChildren:
    """What one pipeline's stages are rendered from: its index, its plan and that plan's generation."""

    index: int
    plan: Plan
    generation: int


def render_children(
    owner: Owner,
    spec: ModelDeploymentSpec,
    pipelines: Sequence[PipelineChildren],
    *,
    serving: PlanSummary,
    served: Sequence[tuple[int, PlanSummary]],
    image: str,
    model_name: str,
    operator_namespace: str,
    draft: ModelInfo | None = None,
) -> list[Manifest]:
    """Every child for the `pipelines` to render, in the order they should be applied; the gateway
    stays on `serving`, and `served` lists the pipelines that serve for the plan ConfigMap.

    `operator_namespace` is where the operator's own pods run: stage NetworkPolicies admit them.
    """
    children = [pipelines_configmap(owner, served), stages_service(owner)]
    # Pipeline 0's plan is published when it is rendered: one waiting for its turn in a rollout keeps the old one.
    zero = next((p for p in pipelines if p.index == 0), None)
    if zero is not None:
        children.insert(0, plan_configmap(owner, zero.plan, generation=zero.generation))
    children += [
        stage_statefulset(owner, spec, p.plan, stage, generation=p.generation, image=image, pipeline=p.index)
        for p in pipelines
        for stage in p.plan.stages
    ]
    children += [stages_disruption_budget(owner), coordinator_lease(owner), *gateway_access(owner)]
    children += [
        gateway_deployment(owner, spec, serving=serving, image=image, model_name=model_name, draft=draft),
        gateway_service(owner),
    ]
    ingress = gateway_ingress(owner, spec)
    if ingress is not None:
        children.append(ingress)
    if spec.network_policy.enabled:
        # A policy selects by stage index across pipelines: stage i of any pipeline takes stage i-1's traffic.
        deepest = max((len(p.plan.stages) for p in pipelines), default=0)
        children += [
            stage_network_policy(owner, spec, index=index, operator_namespace=operator_namespace)
            for index in range(deepest)
        ]
        children.append(gateway_network_policy(owner, spec))
    return children
