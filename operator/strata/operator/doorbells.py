"""Which deployments a change in the cluster concerns, and the doorbell that wakes each one's monitor.

A Node that changes (NotReady, cordoned, tainted, relabelled, GPUs gone) concerns the deployments with a stage on it;
a GPU pod that appears or goes concerns the deployments placed on its node (a foreign pod may have taken a planned
GPU) and the deployment it belongs to (its stage turned ready). Deployments without a placement (a shortfall) are
concerned by every change to the pool, since any of them may make room. Children (StatefulSets, the gateway, the
coordinator Lease) concern their owner. The routing is pure; the doorbells are asyncio events the informers' threads
ring through the event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from strata.operator.names import LABEL_INSTANCE, LABEL_NAME, fit

DeploymentKey = tuple[str, str]  # (namespace, name)


@dataclass
class Placements:
    """Nodes each deployment's plan and serving generation use; None for one that has no placement yet."""

    nodes: dict[DeploymentKey, frozenset[str] | None] = field(default_factory=dict)

    def on_node(self, node: str) -> set[DeploymentKey]:
        return {key for key, nodes in self.nodes.items() if nodes is not None and node in nodes}

    def unplaced(self) -> set[DeploymentKey]:
        return {key for key, nodes in self.nodes.items() if nodes is None}

    def owner(self, namespace: str, instance: str) -> set[DeploymentKey]:
        return {key for key in self.nodes if key[0] == namespace and fit(key[1]) == instance}


def concerned_by_node(placements: Placements, name: str) -> set[DeploymentKey]:
    return placements.on_node(name) | placements.unplaced()


def concerned_by_pod(
    placements: Placements, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None
) -> set[DeploymentKey]:
    found: set[DeploymentKey] = set()
    for pod in (old, new):
        if pod is None:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            found |= placements.on_node(node)
        found |= concerned_by_child(placements, pod)
    return found | placements.unplaced()


def concerned_by_child(placements: Placements, body: Mapping[str, Any]) -> set[DeploymentKey]:
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(LABEL_NAME) != "strata" or LABEL_INSTANCE not in labels:
        return set()
    return placements.owner(str(meta.get("namespace")), labels[LABEL_INSTANCE])


class Doorbells:
    """One asyncio.Event per running monitor; ring() is safe from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.placements = Placements()
        self._bells: dict[DeploymentKey, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}

    def register(self, key: DeploymentKey) -> asyncio.Event:
        """Called from the monitor's own coroutine: the event belongs to the running loop."""
        bell = asyncio.Event()
        with self._lock:
            self._bells[key] = (asyncio.get_running_loop(), bell)
            self.placements.nodes.setdefault(key, None)
        return bell

    def unregister(self, key: DeploymentKey) -> None:
        with self._lock:
            self._bells.pop(key, None)
            self.placements.nodes.pop(key, None)

    def place(self, key: DeploymentKey, nodes: Iterable[str] | None) -> None:
        with self._lock:
            if key in self._bells:
                self.placements.nodes[key] = frozenset(nodes) if nodes is not None else None

    def ring_node(self, name: str) -> None:
        with self._lock:
            keys = concerned_by_node(self.placements, name)
        self.ring(keys)

    def ring_pod(self, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> None:
        with self._lock:
            keys = concerned_by_pod(self.placements, old, new)
        self.ring(keys)

    def ring_child(self, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> None:
        with self._lock:
            keys = set().union(*(concerned_by_child(self.placements, b) for b in (old, new) if b is not None))
        self.ring(keys)

    def ring(self, keys: Iterable[DeploymentKey]) -> None:
        with self._lock:
            bells = [self._bells[k] for k in keys if k in self._bells]
        for loop, bell in bells:
            if not loop.is_closed():
                loop.call_soon_threadsafe(bell.set)
