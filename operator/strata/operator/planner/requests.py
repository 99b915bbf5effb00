"""GPUs already taken on each node: the effective requests of the pods bound there.

Kubernetes counts a pod's request for a resource as the larger of two numbers: what its app containers and
restartable init containers (sidecars) hold together while the pod runs, and the peak during initialisation,
where each regular init container runs alone beside the sidecars started before it. For extended resources such
as GPUs a request defaults to the limit. Pods that finished (Succeeded, Failed) hold nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from strata.operator.planner.errors import InvalidInventoryError

FINISHED_PHASES = frozenset({"Succeeded", "Failed"})


def _quantity(raw: object, *, where: str) -> int:
    """A device count: extended resources are whole numbers (`2` or "2")."""
    text = str(raw).strip()
    if not text.isdigit():
        raise InvalidInventoryError(f"{where}: GPU quantity {raw!r} is not a whole number")
    return int(text)


def container_request(container: Mapping[str, Any], resource: str, *, where: str) -> int:
    """A container's request for `resource`, falling back to its limit as Kubernetes does for extended resources."""
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        amounts = resources.get(kind) or {}
        if resource in amounts:
            return _quantity(amounts[resource], where=where)
    return 0


def pod_request(pod: Mapping[str, Any], resource: str) -> int:
    """The pod's effective request for `resource` (app containers, sidecars and init containers combined)."""
    spec = pod.get("spec") or {}
    name = _pod_name(pod)
    sidecars = 0
    init_peak = 0
    for container in spec.get("initContainers") or ():
        request = container_request(container, resource, where=f"pod {name}")
        if container.get("restartPolicy") == "Always":
            sidecars += request
            init_peak = max(init_peak, sidecars)
        else:
            init_peak = max(init_peak, sidecars + request)
    running = sidecars + sum(container_request(c, resource, where=f"pod {name}") for c in spec.get("containers") or ())
    overhead = _quantity((spec.get("overhead") or {}).get(resource, 0), where=f"pod {name} overhead")
    return max(running, init_peak) + overhead


def _pod_name(pod: Mapping[str, Any]) -> str:
    metadata = pod.get("metadata") or {}
    return f"{metadata.get('namespace', 'default')}/{metadata.get('name', '?')}"


@dataclass
class NodeUsage:
    """GPUs requested on one node, per resource, and by which pods (for the exclusion message)."""

    requested: dict[str, int] = field(default_factory=dict)
    pods: dict[str, list[str]] = field(default_factory=dict)


def usage_by_node(pods: Iterable[Mapping[str, Any]], resources: Iterable[str]) -> dict[str, NodeUsage]:
    """GPU requests of every bound, unfinished pod, grouped by spec.nodeName."""
    wanted = tuple(resources)
    usage: dict[str, NodeUsage] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in FINISHED_PHASES:
            continue
        for resource in wanted:
            count = pod_request(pod, resource)
            if count:
                entry = usage.setdefault(node, NodeUsage())
                entry.requested[resource] = entry.requested.get(resource, 0) + count
                entry.pods.setdefault(resource, []).append(_pod_name(pod))
    return usage
