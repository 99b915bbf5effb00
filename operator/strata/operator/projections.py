"""What the operator keeps of each watched object: the fields the planner and the status read, nothing else.

A projection is also the test of whether an event matters: kwok's and the kubelets' heartbeats rewrite a Node's
conditions every few seconds and a gateway renews its Lease as often, but the projection of either only changes
when readiness, schedulability, labels, GPUs or the Lease's holder do, and only a changed projection wakes a
deployment. Pods that request no GPU are not kept at all: they take nothing a plan needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from strata.demand import DEMAND_ANNOTATION
from strata.operator.planner.errors import InvalidInventoryError
from strata.operator.planner.requests import FINISHED_PHASES, pod_request
from strata.operator.planner.vendors import GPU_RESOURCES

Manifest = dict[str, Any]


def _meta(body: Mapping[str, Any], *fields: str) -> Manifest:
    meta = body.get("metadata") or {}
    kept = {"name": meta.get("name"), "labels": dict(meta.get("labels") or {})}
    if meta.get("namespace"):
        kept["namespace"] = meta["namespace"]
    return kept | {f: meta[f] for f in fields if f in meta}


def node(body: Mapping[str, Any]) -> Manifest:
    spec = body.get("spec") or {}
    status = body.get("status") or {}
    allocatable = status.get("allocatable") or {}
    ready = [
        {k: c[k] for k in ("type", "status", "reason", "message") if c.get(k)}
        for c in status.get("conditions") or ()
        if c.get("type") == "Ready"
    ]
    kept_spec = {k: spec[k] for k in ("unschedulable", "taints") if spec.get(k)}
    kept_status: Manifest = {"allocatable": {r: allocatable[r] for r in GPU_RESOURCES if r in allocatable}}
    if ready:
        kept_status["conditions"] = ready
    return {"metadata": _meta(body), "spec": kept_spec, "status": kept_status}


def _container(container: Mapping[str, Any]) -> Manifest:
    resources = container.get("resources") or {}
    kept = {
        kind: {r: amounts[r] for r in GPU_RESOURCES if r in amounts}
        for kind in ("requests", "limits")
        if (amounts := resources.get(kind) or {})
    }
    out: Manifest = {"name": container.get("name"), "resources": kept}
    if container.get("restartPolicy"):
        out["restartPolicy"] = container["restartPolicy"]
    return out


def _holds_gpus(body: Mapping[str, Any]) -> bool:
    try:
        return any(pod_request(body, resource) for resource in GPU_RESOURCES)
    except InvalidInventoryError:
        return True  # kept, so the planner reports the malformed quantity as it would have from a LIST


def gpu_pod(body: Mapping[str, Any]) -> Manifest | None:
    """A pod that holds (or will hold) GPUs, with what the accounting and the stage readers need; None otherwise."""
    status = body.get("status") or {}
    if status.get("phase") in FINISHED_PHASES or not _holds_gpus(body):
        return None
    spec = body.get("spec") or {}
    kept_spec: Manifest = {"containers": [_container(c) for c in spec.get("containers") or ()]}
    if spec.get("initContainers"):
        kept_spec["initContainers"] = [_container(c) for c in spec["initContainers"]]
    overhead = {r: v for r, v in (spec.get("overhead") or {}).items() if r in GPU_RESOURCES}
    if overhead:
        kept_spec["overhead"] = overhead
    if spec.get("nodeName"):
        kept_spec["nodeName"] = spec["nodeName"]
    kept_status = {k: status[k] for k in ("phase", "podIP") if status.get(k)}
    return {"metadata": _meta(body), "spec": kept_spec, "status": kept_status}


def stage_set(body: Mapping[str, Any]) -> Manifest:
    return {"metadata": _meta(body), "status": {"readyReplicas": (body.get("status") or {}).get("readyReplicas", 0)}}


def gateway(body: Mapping[str, Any]) -> Manifest:
    """Strata's gateway Deployments; the rollout fields gateway_rolled_out and gateway_available read."""
    status = body.get("status") or {}
    return {
        "metadata": _meta(body, "generation"),
        "spec": {"replicas": (body.get("spec") or {}).get("replicas", 0)},
        "status": {
            k: status.get(k, 0) for k in ("observedGeneration", "updatedReplicas", "availableReplicas", "replicas")
        },
    }


def lease(body: Mapping[str, Any]) -> Manifest:
    """Holder, transitions and the gateway's demand (strata.demand) only: a renewal moves renewTime, which must not
    wake anything, while a change in demand must wake the autoscaler."""
    spec = body.get("spec") or {}
    annotations = (body.get("metadata") or {}).get("annotations") or {}
    meta = _meta(body)
    if DEMAND_ANNOTATION in annotations:
        meta["annotations"] = {DEMAND_ANNOTATION: annotations[DEMAND_ANNOTATION]}
    return {
        "metadata": meta,
        "spec": {"holderIdentity": spec.get("holderIdentity"), "leaseTransitions": spec.get("leaseTransitions")},
    }
