"""Node and Pod objects as the API returns them (plain dicts, camelCase), built in one line for tests and benches.

The planner reads exactly these shapes from `kubectl get nodes,pods -A -o yaml`, so tests build them the same way
rather than through the kubernetes client's typed models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

GPU_MEMORY_LABELS: dict[str, tuple[str, str]] = {
    # resource: (memory label, how a 80 GB-class value is written)
    "nvidia.com/gpu": ("nvidia.com/gpu.memory", "MiB"),
    "amd.com/gpu": ("amd.com/gpu.vram", "G"),
    "gpu.intel.com/i915": ("gpu.intel.com/memory.max", "bytes"),
    "gpu.intel.com/xe": ("gpu.intel.com/memory.max", "bytes"),
}


def memory_label(resource: str, gib: int) -> dict[str, str]:
    """The vendor's memory label for GPUs of `gib` GiB, in the unit that vendor's labeller writes."""
    label, unit = GPU_MEMORY_LABELS[resource]
    value = {"MiB": str(gib * 1024), "G": f"{gib}G", "bytes": str(gib << 30)}[unit]
    return {label: value}


def gpu_node(
    name: str,
    *,
    gpus: int = 8,
    gib: int | None = 80,
    resource: str = "nvidia.com/gpu",
    labels: Mapping[str, str] | None = None,
    ready: bool | None = True,
    unschedulable: bool = False,
    taints: Sequence[Mapping[str, str]] = (),
) -> dict[str, Any]:
    """A Node with `gpus` allocatable GPUs of `gib` GiB each (no memory label when gib is None)."""
    all_labels = {"kubernetes.io/os": "linux", **(memory_label(resource, gib) if gib else {}), **(labels or {})}
    status: dict[str, Any] = {"allocatable": {"cpu": "96", "memory": "1Ti", "pods": "110", resource: str(gpus)}}
    if ready is not None:
        status["conditions"] = [
            {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletNotReady" if not ready else ""}
        ]
    spec: dict[str, Any] = {}
    if unschedulable:
        spec["unschedulable"] = True
    if taints:
        spec["taints"] = [dict(taint) for taint in taints]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "spec": spec,
        "status": status,
    }


def gpu_pod(
    name: str,
    *,
    node: str | None,
    gpus: int = 1,
    resource: str = "nvidia.com/gpu",
    phase: str = "Running",
    via: str = "requests",
    init_containers: Sequence[Mapping[str, Any]] = (),
    namespace: str = "default",
) -> dict[str, Any]:
    """A Pod whose one container asks for `gpus` GPUs through `via` (requests or limits), bound to `node`."""
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {via: {resource: str(gpus)}}}]}
    if node is not None:
        spec["nodeName"] = node
    if init_containers:
        spec["initContainers"] = [dict(container) for container in init_containers]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
        "status": {"phase": phase},
    }
