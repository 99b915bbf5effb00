"""The children of a ModelDeployment, rendered as plain manifests from its spec and plan (no I/O): the stages' here,
with what every child shares (owner metadata, resources, the containers' security); the gateway's in
strata.operator.gateway_children.

One StatefulSet per stage pins that stage to its planned node and asks for the vendor's GPU resource; stage
StatefulSets carry the plan generation in their name so a new generation can come up beside the old one. The
reconciler applies what this module returns with server-side apply; owner references make the API server's
garbage collector remove everything when the ModelDeployment goes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from strata.operator.names import (
    LABEL_PIPELINE,
    STAGE_PORT,
    Names,
    labels,
    stage_labels,
)
from strata.operator.spec import GROUP, KIND, VERSION, ModelDeploymentSpec, Resources
from strata.operator.status import PlanSummary
from strata.plan import Backend, Plan
from strata.plan import Stage as StagePlan
from strata.quantity import quantity_to_bytes

Manifest = dict[str, Any]

# Containers run as this user; the image creates it.
RUN_AS_USER = 10001
# The root filesystem is read-only: scratch space is an emptyDir mounted here, inside the pod.
POD_TMP = "/tmp"  # noqa: S108
# Requests a pod gets unless its spec sets that resource's request or limit (a limit alone implies the request).
STAGE_REQUESTS = {"cpu": "1", "memory": "4Gi"}
GATEWAY_REQUESTS = {"cpu": "250m", "memory": "512Mi"}
# Stage and gateway containers that serve Prometheus metrics name that port so; scrapers reach it by this name.
METRICS_PORT_NAME = "metrics"
# torch addresses ROCm GPUs through its CUDA device type.
TORCH_DEVICE = {Backend.CUDA: "cuda", Backend.ROCM: "cuda", Backend.XPU: "xpu"}


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> Manifest:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def owned_metadata(owner: Owner, *, name: str, labels: dict[str, str]) -> Manifest:
    return {"name": name, "namespace": owner.namespace, "labels": labels, "ownerReferences": [owner.reference()]}


def resources(
    resources: Resources, *, defaults: dict[str, str], gpu: tuple[str, int] | None = None, host_bytes: int = 0
) -> Manifest:
    """The container's resources; `host_bytes` (the host KV tier) is added to its memory request and to a memory
    limit the user set, so the tier never pushes the pod past what it asked for."""
    limits = dict(resources.limits)
    requests = {key: value for key, value in defaults.items() if key not in limits} | resources.requests
    for given in (requests, limits):
        if host_bytes and "memory" in given:
            given["memory"] = str(quantity_to_bytes(given["memory"]) + host_bytes)
    if host_bytes and "memory" not in requests:
        requests["memory"] = str(quantity_to_bytes(limits["memory"]))
    if gpu is not None:
        limits[gpu[0]] = str(gpu[1])
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def container_security() -> Manifest:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def env_list(values: dict[str, str | int | float]) -> list[Manifest]:
    return [{"name": key, "value": str(value)} for key, value in values.items()]


def serving_pipelines(owner: Owner, serving: Sequence[tuple[int, PlanSummary]]) -> str:
    """The pipelines that serve, as JSON: where a gateway finds each one's first stage and how many lanes it has.

    One list in one ConfigMap, so a gateway that routes across pipelines reads (and watches) them in one place.
    """
    names = Names(owner.name, owner.namespace)
    entries = [
        {
            "index": index,
            "generation": plan.generation,
            "firstStage": names.stage_address(generation=plan.generation, index=0),
            "parallel": plan.parallel,
            "contextLength": plan.context_length,
        }
        for index, plan in serving
    ]
    return json.dumps(entries, sort_keys=True)


def plan_configmap(owner: Owner, plan: Plan, *, generation: int) -> Manifest:
    """Pipeline 0's newest plan."""
    names = Names(owner.name, owner.namespace)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owned_metadata(owner, name=names.plan_configmap, labels=labels(owner.name, component="plan")),
        "data": {"plan.json": plan.model_dump_json(), "generation": str(generation)},
    }


def pipelines_configmap(owner: Owner, serving: Sequence[tuple[int, PlanSummary]]) -> Manifest:
    """The serving pipelines (pipelines.json): where a gateway that routes across pipelines finds them."""
    names = Names(owner.name, owner.namespace)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": owned_metadata(owner, name=names.pipelines_configmap, labels=labels(owner.name, component="plan")),
        "data": {"pipelines.json": serving_pipelines(owner, serving)},
    }


def stages_service(owner: Owner) -> Manifest:
    names = Names(owner.name, owner.namespace)
    selector = labels(owner.name, component="stage")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": owned_metadata(owner, name=names.stages_service, labels=selector),
        "spec": {
            "clusterIP": "None",
            # Stages find each other before they are ready: the next stage's address must resolve while it loads.
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "grpc", "port": STAGE_PORT, "targetPort": STAGE_PORT}],
        },
    }


def stage_statefulset(
    owner: Owner,
    spec: ModelDeploymentSpec,
    plan: Plan,
    stage: StagePlan,
    *,
    generation: int,
    image: str,
    pipeline: int = 0,
) -> Manifest:
    names = Names(owner.name, owner.namespace)
    pod_labels = stage_labels(owner.name, generation=generation, index=stage.index, pipeline=pipeline)
    # A StatefulSet's selector cannot change: it names the generation and stage only (a generation belongs to one
    # pipeline), as it did before pipelines had an index, so an operator upgrade can apply over an older set.
    selector = {key: value for key, value in pod_labels.items() if key != LABEL_PIPELINE}
    last = stage.index == len(plan.stages) - 1
    next_stage = "" if last else names.stage_address(generation=generation, index=stage.index + 1)
    env = env_list(
        {
            "STRATA_MODEL_URL": spec.model.url,
            "STRATA_STAGE_INDEX": stage.index,
            "STRATA_STAGE_COUNT": len(plan.stages),
            "STRATA_LAYER_START": stage.layer_start,
            "STRATA_LAYER_END": stage.layer_end,
            "STRATA_CONTEXT": plan.context_length,
            "STRATA_PARALLEL": plan.parallel,
            "STRATA_CACHE_TYPE_K": plan.cache_type_k,
            "STRATA_CACHE_TYPE_V": plan.cache_type_v,
            "STRATA_NEXT_STAGE": next_stage,
            # Each stage serves on its pod IP, the address the operator asks for load progress.
            "STRATA_LISTEN": f"$(POD_IP):{STAGE_PORT}",
            "STRATA_DEVICE": TORCH_DEVICE[stage.backend],
            "STRATA_PLAN_GENERATION": generation,
            "STRATA_PREFIX_CACHE_BYTES": stage.prefix_cache_bytes,
            "STRATA_KV_HOST_BYTES": stage.host_kv_bytes,
        }
    )
    if plan.resident_window is not None:  # only then, so a stage without one renders as it did before the field
        window = plan.resident_window
        env += env_list(
            {
                "STRATA_RESIDENT_TOKENS": window.tokens,
                "STRATA_RESIDENT_SINK_TOKENS": window.sink_tokens,
                "STRATA_RESIDENT_RECENT_TOKENS": window.recent_tokens,
            }
        )
    env.insert(0, {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if spec.model.token_secret_ref is not None:
        ref = spec.model.token_secret_ref
        env.append({"name": "STRATA_MODEL_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    probe = {"grpc": {"port": STAGE_PORT}, "periodSeconds": 5, "failureThreshold": 3}
    container = {
        "name": "stage",
        "image": spec.stage.image or image,
        "command": ["strata", "stage-worker"],
        "env": env,
        "ports": [{"name": "grpc", "containerPort": STAGE_PORT}],
        # Loading a slice of a large model takes minutes: liveness waits for the start-up probe.
        "startupProbe": probe | {"failureThreshold": 360},
        "readinessProbe": probe,
        "livenessProbe": probe | {"failureThreshold": 6},
        "resources": resources(
            spec.stage.resources,
            defaults=STAGE_REQUESTS,
            gpu=(stage.resource, len(stage.gpus)),
            host_bytes=stage.host_kv_bytes,
        ),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "tmp", "mountPath": POD_TMP}],
    }
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [stage.node]}]}
                ]
            }
        }
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": owned_metadata(
            owner, name=names.stage(generation=generation, index=stage.index), labels=pod_labels
        ),
        "spec": {
            "serviceName": names.stages_service,
            "replicas": 1,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "affinity": affinity,
                    "nodeSelector": dict(spec.placement.node_selector),
                    "tolerations": [t.model_dump(by_alias=True, exclude_none=True) for t in spec.placement.tolerations],
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}}],
                },
            },
        },
    }


def stages_disruption_budget(owner: Owner) -> Manifest:
    names = Names(owner.name, owner.namespace)
    selector = labels(owner.name, component="stage")
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": owned_metadata(owner, name=names.stages_pdb, labels=selector),
        # Every stage is a single point of failure of its pipeline: a drain waits until the operator has moved
        # the stages off the cordoned node (a re-plan), instead of evicting a stage that still serves.
        "spec": {"maxUnavailable": 0, "selector": {"matchLabels": selector}},
    }
