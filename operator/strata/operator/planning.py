"""The operator's view of the planner: a spec becomes PlanOptions, and a running plan is checked against the pool.

The planner itself is pure (strata.operator.planner); this module only translates the CRD's vocabulary into it
and decides when a placement has been lost (a node cordoned, NotReady, tainted, or out of GPUs), which is what
triggers a re-plan. A better placement appearing elsewhere does not: moving a serving model costs a reload.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from strata.gguf import NotExecutableError, check_executable
from strata.gguf.model import ModelInfo
from strata.operator.names import LABEL_INSTANCE, fit
from strata.operator.planner import PipelinePlan, PlanOptions, build_inventory, plan_pipelines, plan_placement
from strata.operator.planner.errors import PlanningError
from strata.operator.planner.scheduling import Toleration
from strata.operator.spec import ModelDeploymentSpec
from strata.operator.status import EventReason, ModelDeploymentStatus
from strata.plan import Excluded, Plan
from strata.quantity import quantity_to_bytes


class PlanRefused(Exception):
    """The spec asks for something no plan can honour (an override that cannot fit); the message says why."""

    reason = "OverrideCannotFit"  # the Planned condition's
    event = EventReason.CAPACITY_SHORTFALL


class ModelNotExecutable(PlanRefused):
    """Strata's stages do not run the model's architecture: every stage would fail to load it."""

    reason = EventReason.MODEL_NOT_EXECUTABLE.value
    event = EventReason.MODEL_NOT_EXECUTABLE


def quantity_bytes(value: str, *, field: str = "placement.gpuMemory") -> int:
    try:
        return quantity_to_bytes(value)
    except ValueError as e:
        raise PlanRefused(f"{field} {e}") from e


def options_for(spec: ModelDeploymentSpec) -> PlanOptions:
    placement = spec.placement
    return PlanOptions(
        context_length=spec.context,
        parallel=spec.parallel,
        cache_type_k=spec.cache_type_k,
        cache_type_v=spec.cache_type_v,
        max_stages=placement.max_stages,
        headroom_fraction=placement.headroom_percent / 100,
        node_selector=dict(placement.node_selector),
        tolerations=tuple(
            Toleration.from_dict(t.model_dump(by_alias=True, exclude_none=True)) for t in placement.tolerations
        ),
        gpu_memory_bytes=quantity_bytes(placement.gpu_memory) if placement.gpu_memory else None,
        host_kv_bytes=(
            quantity_bytes(spec.kv_cache.host_memory, field="kvCache.hostMemory") if spec.kv_cache.host_memory else 0
        ),
        resident_window=None if spec.kv_cache.resident_window is None else spec.kv_cache.resident_window.budget(),
    )


def foreign_pods(pods: Sequence[Mapping[str, Any]], *, name: str, namespace: str) -> list[Mapping[str, Any]]:
    """Pods that hold GPUs against this deployment: everything but its own stage pods."""
    own = fit(name)
    return [
        p
        for p in pods
        if (p["metadata"].get("labels") or {}).get(LABEL_INSTANCE) != own or p["metadata"].get("namespace") != namespace
    ]


def plan_deployment(
    *,
    model: ModelInfo,
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    spec: ModelDeploymentSpec,
) -> Plan:
    """One pipeline's placement on the whole pool (pipeline 0's), or PlanRefused; a model the stages cannot run is
    refused before placing it, by the check `strata inspect` and `strata serve` make."""
    try:
        check_executable(model.architecture, unsupported=model.unsupported)
        return plan_placement(model=model, nodes=nodes, pods=pods, options=options_for(spec))
    except NotExecutableError as e:
        raise ModelNotExecutable(str(e)) from e
    except PlanningError as e:
        raise PlanRefused(str(e)) from e


def plan_replicas(
    *,
    model: ModelInfo,
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    spec: ModelDeploymentSpec,
) -> tuple[tuple[PipelinePlan, ...], tuple[Excluded, ...]]:
    """spec.replicas pipelines for the model (each placed or short) and the nodes left out, or PlanRefused; a model
    the stages cannot run is refused before placing it, by the check `strata inspect` and `strata serve` make.

    At replicas 0 pipeline 0 is planned all the same and not placed: the status says whether a cold start fits,
    and the gateway, which stays up, is configured from that plan."""
    options = options_for(spec)
    try:
        check_executable(model.architecture, unsupported=model.unsupported)
        inventory = build_inventory(
            nodes=nodes,
            pods=pods,
            node_selector=options.node_selector,
            tolerations=options.tolerations,
            gpu_memory_bytes=options.gpu_memory_bytes,
        )
        pipelines = plan_pipelines(model=model, inventory=inventory, options=options, replicas=max(spec.replicas, 1))
    except NotExecutableError as e:
        raise ModelNotExecutable(str(e)) from e
    except PlanningError as e:
        raise PlanRefused(str(e)) from e
    return pipelines, inventory.excluded


def placement_problem(
    *,
    status: ModelDeploymentStatus,
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    spec: ModelDeploymentSpec,
    deployment: Mapping[str, Any],
) -> str | None:
    """Why the current placement no longer holds, or None while it does. Without a plan for every pipeline asked
    for, always look again (the pool may have grown)."""
    if status.plan is None:
        return "no placement yet: planning again"
    if spec.replicas == 0:
        return None  # nothing is placed to lose; a cold start plans on the pool as it is then
    plans = [p.plan for p in status.pipelines if p.plan is not None] or [status.plan]
    if len(plans) < spec.replicas:
        return f"{len(plans)} of {spec.replicas} pipelines placed: planning again"
    options = options_for(spec)
    try:
        inventory = build_inventory(
            nodes=nodes,
            pods=foreign_pods(pods, name=deployment["name"], namespace=deployment["namespace"]),
            node_selector=options.node_selector,
            tolerations=options.tolerations,
            gpu_memory_bytes=options.gpu_memory_bytes,
        )
    except PlanningError as e:
        return f"the pool cannot be read: {e}"
    excluded = {x.node: x.reason for x in inventory.excluded}
    free = Counter({(g.node, g.backend.value): g.free for g in inventory.gpus})
    stages = [stage for plan in plans for stage in plan.stages]
    needed = Counter((s.node, s.backend) for s in stages)
    for stage in stages:
        if stage.node in excluded:
            return f"stage {stage.index} on {stage.node} lost its node: {excluded[stage.node]}"
        if free[(stage.node, stage.backend)] < needed[(stage.node, stage.backend)]:
            return f"stage {stage.index} on {stage.node} lost its GPU: the node has no free {stage.backend} GPU left"
    return None
