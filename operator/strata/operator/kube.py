"""The operator's thin executor against the API server: read the pool, apply children, read their readiness.

Children are written with server-side apply under one field manager, so re-applying the same manifest is a no-op
and a restarted operator converges on the same objects instead of creating duplicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException
from strata.operator.names import FIELD_MANAGER, LABEL_COMPONENT, LABEL_GENERATION, LABEL_INSTANCE, fit

Manifest = dict[str, Any]


@dataclass(frozen=True)
class StageReadiness:
    index: int
    ready: bool


class Cluster:
    """One API client; every method is a handful of calls and no waiting."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api_client = api_client
        self.configuration = api_client.configuration
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.coordination = client.CoordinationV1Api(api_client)
        self._dynamic = dynamic.DynamicClient(api_client)

    def pool(self) -> tuple[list[Manifest], list[Manifest]]:
        """Nodes and pods as the API returns them (camelCase dicts), the planner's input."""
        serialize = self._api_client.sanitize_for_serialization
        nodes = [serialize(n) for n in self.core.list_node().items]
        pods = [
            serialize(p)
            for p in self.core.list_pod_for_all_namespaces(field_selector="status.phase!=Succeeded").items
            if p.status.phase != "Failed"
        ]
        return nodes, pods

    def resource_version(self, *, api_version: str, kind: str, namespace: str, name: str) -> str | None:
        """The object's current resourceVersion, None once it is gone."""
        resource = self._dynamic.resources.get(api_version=api_version, kind=kind)
        try:
            return str(resource.get(name=name, namespace=namespace).metadata.resourceVersion)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def read_secret_value(self, *, namespace: str, name: str, key: str) -> str:
        import base64

        secret = self.core.read_namespaced_secret(name=name, namespace=namespace)
        data = (secret.data or {}).get(key)
        if data is None:
            raise KeyError(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data).decode()

    def apply(self, manifest: Manifest) -> None:
        resource = self._dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        resource.server_side_apply(
            body=manifest,
            name=manifest["metadata"]["name"],
            namespace=manifest["metadata"].get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )

    def delete(self, *, api_version: str, kind: str, namespace: str, name: str) -> None:
        resource = self._dynamic.resources.get(api_version=api_version, kind=kind)
        try:
            resource.delete(name=name, namespace=namespace, body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise

    def stage_sets(self, *, namespace: str, deployment: str) -> list[Any]:
        selector = f"{LABEL_INSTANCE}={fit(deployment)},{LABEL_COMPONENT}=stage"
        return list(self.apps.list_namespaced_stateful_set(namespace=namespace, label_selector=selector).items)

    def delete_other_generations(self, *, namespace: str, deployment: str, keep: set[int]) -> list[str]:
        removed = []
        kept = {str(g) for g in keep}
        for sts in self.stage_sets(namespace=namespace, deployment=deployment):
            if sts.metadata.labels.get(LABEL_GENERATION) not in kept:
                self.delete(api_version="apps/v1", kind="StatefulSet", namespace=namespace, name=sts.metadata.name)
                removed.append(sts.metadata.name)
        return removed

    def stage_readiness(self, *, namespace: str, deployment: str, generation: int) -> list[StageReadiness]:
        result = []
        for sts in self.stage_sets(namespace=namespace, deployment=deployment):
            labels = sts.metadata.labels or {}
            if labels.get(LABEL_GENERATION) != str(generation):
                continue
            ready = (sts.status.ready_replicas or 0) >= 1
            result.append(StageReadiness(index=int(labels.get("strata.dev/stage", "0")), ready=ready))
        return sorted(result, key=lambda s: s.index)

    def stage_pods(self, *, namespace: str, deployment: str, generation: int) -> list[Any]:
        selector = f"{LABEL_INSTANCE}={fit(deployment)},{LABEL_COMPONENT}=stage,{LABEL_GENERATION}={generation}"
        return list(self.core.list_namespaced_pod(namespace=namespace, label_selector=selector).items)

    def lease_holder(self, *, namespace: str, name: str) -> tuple[str, int] | None:
        """(holder, term) of a Lease, None while it does not exist or nobody holds it."""
        try:
            lease = self.coordination.read_namespaced_lease(name=name, namespace=namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        if not lease.spec.holder_identity:
            return None
        return lease.spec.holder_identity, lease.spec.lease_transitions or 0

    def gateway_rolled_out(self, *, namespace: str, name: str) -> bool:
        """The gateway Deployment's current spec is what runs: every replica updated and one available."""
        try:
            deployment = self.apps.read_namespaced_deployment(name=name, namespace=namespace)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        status = deployment.status
        return bool(
            (status.observed_generation or 0) >= deployment.metadata.generation
            and (status.updated_replicas or 0) >= (deployment.spec.replicas or 0)
            and (status.available_replicas or 0) >= 1
            and (status.replicas or 0) == (status.updated_replicas or 0)
        )

    def gateway_available(self, *, namespace: str, name: str) -> bool:
        try:
            deployment = self.apps.read_namespaced_deployment(name=name, namespace=namespace)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return (deployment.status.available_replicas or 0) >= 1
