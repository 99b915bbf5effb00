"""The operator's watch-fed view of the cluster: Nodes and GPU-holding pods cluster-wide, and Strata's own
StatefulSets, gateway Deployments and coordinator Leases in the watched namespaces.

The planner and the status read this view instead of the API: after the first LIST of each resource the operator
only watches, so its requests do not grow with the number of deployments, and every change that matters rings the
doorbells of the deployments it concerns. A new leader builds the whole view before it acts (`wait_synced`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kubernetes import client
from strata.operator import projections
from strata.operator.doorbells import Doorbells
from strata.operator.informer import Informer, Manifest, Project
from strata.operator.names import LABEL_COMPONENT, LABEL_GENERATION, LABEL_INSTANCE, LABEL_NAME, fit

STRATA_SELECTOR = f"{LABEL_NAME}=strata"
RUNNING_PODS = "status.phase!=Succeeded,status.phase!=Failed"


class CacheNotSynced(Exception):
    """The watches did not list their resources in time: acting on a partial pool would misplace stages."""


class ClusterCache:
    def __init__(self, api_client: client.ApiClient, *, namespaces: Sequence[str] = (), doorbells: Doorbells) -> None:
        core, apps, leases = (
            client.CoreV1Api(api_client),
            client.AppsV1Api(api_client),
            client.CoordinationV1Api(api_client),
        )
        self.doorbells = doorbells
        # Told (api_version, kind, namespace, name) of every watched child that goes, so its next apply is sent.
        self.gone_listeners: list[Callable[[str, str, str, str], None]] = []
        self.nodes = Informer(
            name="nodes", list_call=core.list_node, project=projections.node, on_change=self._node_changed
        )
        self.pods = Informer(
            name="gpu-pods",
            list_call=core.list_pod_for_all_namespaces,
            project=projections.gpu_pod,
            on_change=self._pod_changed,
            selectors={"field_selector": RUNNING_PODS},
        )
        self.stage_sets = _Namespaced(
            "statefulsets", apps.list_stateful_set_for_all_namespaces, apps.list_namespaced_stateful_set,
            projections.stage_set, namespaces, self._child_changed("apps/v1", "StatefulSet"),
        )  # fmt: skip
        self.gateways = _Namespaced(
            "deployments", apps.list_deployment_for_all_namespaces, apps.list_namespaced_deployment,
            projections.gateway, namespaces, self._child_changed("apps/v1", "Deployment"),
        )  # fmt: skip
        self.leases = _Namespaced(
            "leases", leases.list_lease_for_all_namespaces, leases.list_namespaced_lease,
            projections.lease, namespaces, self._child_changed("coordination.k8s.io/v1", "Lease"),
        )  # fmt: skip
        self._informers = [self.nodes, self.pods, *self.stage_sets.all, *self.gateways.all, *self.leases.all]

    def start(self, *, timeout: float) -> None:
        for informer in self._informers:
            informer.start()
        for informer in self._informers:
            if not informer.wait_synced(timeout):
                raise CacheNotSynced(f"the {informer.name} watch did not list within {timeout:.0f} s")

    def stop(self) -> None:
        for informer in self._informers:
            informer.stop()

    def pool(self) -> tuple[list[Manifest], list[Manifest]]:
        return self.nodes.items(), self.pods.items()

    def stage_sets_of(self, *, namespace: str, deployment: str) -> list[Manifest]:
        return [s for s in self.stage_sets.items() if _belongs(s, namespace, deployment, "stage")]

    def stage_pods_of(self, *, namespace: str, deployment: str, generation: int) -> list[Manifest]:
        return [
            p
            for p in self.pods.items()
            if _belongs(p, namespace, deployment, "stage")
            and p["metadata"]["labels"].get(LABEL_GENERATION) == str(generation)
        ]

    def gateway(self, *, namespace: str, name: str) -> Manifest | None:
        return self.gateways.get(namespace, name)

    def lease(self, *, namespace: str, name: str) -> Manifest | None:
        return self.leases.get(namespace, name)

    def _node_changed(self, key: str, old: Manifest | None, new: Manifest | None) -> None:
        self.doorbells.ring_node(key)

    def _pod_changed(self, key: str, old: Manifest | None, new: Manifest | None) -> None:
        self.doorbells.ring_pod(old, new)

    def _child_changed(self, api_version: str, kind: str) -> Callable[[str, Manifest | None, Manifest | None], None]:
        def changed(key: str, old: Manifest | None, new: Manifest | None) -> None:
            if new is None and old is not None:
                namespace, _, name = key.partition("/")
                for listener in self.gone_listeners:
                    listener(api_version, kind, namespace, name)
            self.doorbells.ring_child(old, new)

        return changed


def _belongs(body: Manifest, namespace: str, deployment: str, component: str) -> bool:
    meta = body["metadata"]
    labels = meta["labels"]
    return bool(
        meta.get("namespace") == namespace
        and labels.get(LABEL_INSTANCE) == fit(deployment)
        and labels.get(LABEL_COMPONENT) == component
    )


class _Namespaced:
    """Strata-labelled objects of one kind: one watch over all namespaces, or one per watched namespace."""

    def __init__(
        self,
        name: str,
        list_all: Callable[..., Any],
        list_namespaced: Callable[..., Any],
        project: Project,
        namespaces: Sequence[str],
        on_change: Callable[[str, Manifest | None, Manifest | None], None],
    ) -> None:
        selectors = {"label_selector": STRATA_SELECTOR}
        if namespaces:
            self.all = [
                Informer(
                    name=f"{name}-{ns}",
                    list_call=functools.partial(list_namespaced, ns),
                    project=project,
                    on_change=on_change,
                    selectors=selectors,
                )
                for ns in namespaces
            ]
        else:
            self.all = [
                Informer(name=name, list_call=list_all, project=project, on_change=on_change, selectors=selectors)
            ]

    def items(self) -> list[Manifest]:
        return [item for informer in self.all for item in informer.items()]

    def get(self, namespace: str, name: str) -> Manifest | None:
        for informer in self.all:
            found = informer.get(f"{namespace}/{name}")
            if found is not None:
                return found
        return None
