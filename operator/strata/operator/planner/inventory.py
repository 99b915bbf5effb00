"""The GPU inventory: free GPUs per node with their memory and backend, and every node left out with a reason.

Input is the plain Node and Pod objects the API returns (dicts, camelCase), so the same function serves the
operator (which lists them) and `strata plan` (which reads `kubectl get nodes,pods -A -o yaml`). The checks run in
the order a person would fix them: does the deployment want this node at all, is the node up and schedulable,
does it have a free GPU, do we know how much memory that GPU has.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strata.operator.planner.errors import InvalidInventoryError
from strata.operator.planner.requests import NodeUsage, usage_by_node
from strata.operator.planner.scheduling import (
    Toleration,
    cordoned_reason,
    not_ready_reason,
    selector_mismatch_reason,
    untolerated_taint_reason,
)
from strata.operator.planner.vendors import (
    GPU_RESOURCES,
    VENDORS,
    BadMemoryLabelError,
    Vendor,
    memory_from_labels,
    memory_label_names,
)
from strata.plan import Backend, Excluded


@dataclass(frozen=True)
class NodeGpus:
    """Free GPUs of one vendor on one node, all with the same memory."""

    node: str
    resource: str
    backend: Backend
    memory_bytes: int
    free: int


@dataclass(frozen=True)
class Inventory:
    gpus: tuple[NodeGpus, ...]
    excluded: tuple[Excluded, ...]

    @property
    def gpu_count(self) -> int:
        return sum(entry.free for entry in self.gpus)


def _allocatable(node: Mapping[str, Any], resource: str, *, name: str) -> int:
    raw = (node.get("status", {}).get("allocatable") or {}).get(resource, 0)
    text = str(raw).strip()
    if not text.isdigit():
        raise InvalidInventoryError(f"node {name}: allocatable {resource} {raw!r} is not a whole number")
    return int(text)


def _free_gpus(
    node: Mapping[str, Any], *, name: str, usage: NodeUsage | None, memory_override: int | None
) -> tuple[list[NodeGpus], str | None]:
    """The node's free GPUs per vendor, or the reason it has none we can use."""
    labels: Mapping[str, str] = node.get("metadata", {}).get("labels") or {}
    found: list[NodeGpus] = []
    reasons: list[str] = []
    has_gpu = False
    for vendor in VENDORS:
        allocatable = _allocatable(node, vendor.resource, name=name)
        if not allocatable:
            continue
        has_gpu = True
        taken = usage.requested.get(vendor.resource, 0) if usage else 0
        free = allocatable - taken
        if free <= 0:
            holders = ", ".join(usage.pods.get(vendor.resource, [])) if usage else ""
            reasons.append(f"no free GPU: all {allocatable} {vendor.resource} requested by pods ({holders})")
            continue
        memory, unknown = _memory(vendor, labels, memory_override)
        if unknown:
            reasons.append(unknown)
            continue
        found.append(NodeGpus(name, vendor.resource, vendor.backend, memory, free))
    if not has_gpu:
        return [], f"no GPU: status.allocatable lists none of {', '.join(GPU_RESOURCES)}"
    return found, None if found else "; ".join(reasons)


def _memory(vendor: Vendor, labels: Mapping[str, str], memory_override: int | None) -> tuple[int, str | None]:
    if memory_override is not None:
        return memory_override, None
    try:
        memory = memory_from_labels(vendor, labels)
    except BadMemoryLabelError as error:
        return 0, f"GPU memory unknown: {error}; fix the label or set the GPU memory in the spec"
    if memory is None:
        return 0, (
            f"GPU memory unknown: no {memory_label_names(vendor)} label; "
            "run the vendor's node labeller (e.g. GPU Feature Discovery) or set the GPU memory in the spec"
        )
    return memory, None


def build_inventory(
    *,
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]] = (),
    node_selector: Mapping[str, str] | None = None,
    tolerations: Sequence[Toleration] = (),
    gpu_memory_bytes: int | None = None,
) -> Inventory:
    """Free GPUs per node, sorted by node name, and every node left out with the first reason that applies."""
    usage = usage_by_node(pods, GPU_RESOURCES)
    selector = node_selector or {}
    gpus: list[NodeGpus] = []
    excluded: list[Excluded] = []
    for node in sorted(nodes, key=_node_name):
        name = _node_name(node)
        reason = _unschedulable_reason(node, selector=selector, tolerations=tolerations)
        if reason is None:
            free, reason = _free_gpus(node, name=name, usage=usage.get(name), memory_override=gpu_memory_bytes)
            gpus.extend(free)
        if reason is not None:
            excluded.append(Excluded(node=name, reason=reason))
    return Inventory(gpus=tuple(gpus), excluded=tuple(excluded))


def _unschedulable_reason(
    node: Mapping[str, Any], *, selector: Mapping[str, str], tolerations: Sequence[Toleration]
) -> str | None:
    """The first reason a stage pod could not land here: not wanted, not ready, cordoned, or tainted."""
    labels: Mapping[str, str] = node.get("metadata", {}).get("labels") or {}
    return (
        selector_mismatch_reason(labels, selector)
        or not_ready_reason(node)
        or cordoned_reason(node)
        or untolerated_taint_reason(node, tolerations)
    )


def _node_name(node: Mapping[str, Any]) -> str:
    name = (node.get("metadata") or {}).get("name")
    if not name:
        raise InvalidInventoryError("a Node object has no metadata.name")
    return str(name)
