"""The operator's thin executor against the API server: apply and delete children; reads come from the watches.

Children are written with server-side apply under one field manager, so re-applying the same manifest is a no-op
and a restarted operator converges on the same objects instead of creating duplicates. A no-op still costs a
request, so a manifest is sent again only when it differs from the one this process last applied (or the watch saw
the object go). The pool, the stage sets, the gateway and the Lease are read from the ClusterCache, which the
watches keep current: no read here reaches the API server.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

from kubernetes import client, dynamic
from kubernetes.client.exceptions import ApiException
from strata.operator.cluster_cache import ClusterCache
from strata.operator.names import FIELD_MANAGER, LABEL_GENERATION, LABEL_STAGE
from strata.operator.spec import GROUP, PLURAL, VERSION

Manifest = dict[str, Any]


@dataclass(frozen=True)
class StageReadiness:
    index: int
    ready: bool


class Cluster:
    """One API client for writes and the watch-fed cache for reads; every method is a handful of calls at most."""

    def __init__(self, api_client: client.ApiClient, cache: ClusterCache) -> None:
        self._api_client = api_client
        self.configuration = api_client.configuration
        self.cache = cache
        self.core = client.CoreV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)
        self._dynamic = dynamic.DynamicClient(api_client)
        self._applied: dict[tuple[str, str, str, str], str] = {}
        self._applied_lock = threading.Lock()
        cache.gone_listeners.append(
            lambda api_version, kind, namespace, name: self.forget(
                api_version=api_version, kind=kind, namespace=namespace, name=name
            )
        )

    def pool(self) -> tuple[list[Manifest], list[Manifest]]:
        """Nodes and GPU-holding pods (camelCase dicts, only the fields the planner reads), the planner's input."""
        return self.cache.pool()

    def read_secret_value(self, *, namespace: str, name: str, key: str) -> str:
        import base64

        secret = self.core.read_namespaced_secret(name=name, namespace=namespace)
        data = (secret.data or {}).get(key)
        if data is None:
            raise KeyError(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data).decode()

    def apply(self, manifest: Manifest) -> None:
        meta = manifest["metadata"]
        key = (manifest["apiVersion"], manifest["kind"], meta.get("namespace") or "", meta["name"])
        content = json.dumps(manifest, sort_keys=True)
        with self._applied_lock:
            if self._applied.get(key) == content:
                return
        resource = self._dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        resource.server_side_apply(
            body=manifest,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        with self._applied_lock:
            self._applied[key] = content

    def patch_status(self, *, namespace: str, name: str, status: Manifest) -> Manifest:
        """A merge patch of the ModelDeployment's status subresource; the object as the API server now holds it."""
        response = self._custom.patch_namespaced_custom_object_status(
            group=GROUP,
            version=VERSION,
            namespace=namespace,
            plural=PLURAL,
            name=name,
            body={"status": status},
            _content_type="application/merge-patch+json",
        )
        return dict(response)

    def forget(self, *, api_version: str, kind: str, namespace: str, name: str) -> None:
        """The object is gone (deleted by us or by someone else): the next apply must send it again."""
        with self._applied_lock:
            self._applied.pop((api_version, kind, namespace, name), None)

    def delete(self, *, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.forget(api_version=api_version, kind=kind, namespace=namespace, name=name)
        resource = self._dynamic.resources.get(api_version=api_version, kind=kind)
        try:
            resource.delete(name=name, namespace=namespace, body={"propagationPolicy": "Background"})
        except ApiException as e:
            if e.status != 404:
                raise

    def delete_other_generations(self, *, namespace: str, deployment: str, keep: set[int]) -> list[str]:
        removed = []
        kept = {str(g) for g in keep}
        for sts in self.cache.stage_sets_of(namespace=namespace, deployment=deployment):
            meta = sts["metadata"]
            if meta["labels"].get(LABEL_GENERATION) not in kept:
                self.delete(api_version="apps/v1", kind="StatefulSet", namespace=namespace, name=meta["name"])
                removed.append(meta["name"])
        return removed

    def stage_readiness(self, *, namespace: str, deployment: str, generation: int) -> list[StageReadiness]:
        result = []
        for sts in self.cache.stage_sets_of(namespace=namespace, deployment=deployment):
            labels = sts["metadata"]["labels"]
            if labels.get(LABEL_GENERATION) != str(generation):
                continue
            ready = (sts["status"].get("readyReplicas") or 0) >= 1
            result.append(StageReadiness(index=int(labels.get(LABEL_STAGE, "0")), ready=ready))
        return sorted(result, key=lambda s: s.index)

    def stage_pods(self, *, namespace: str, deployment: str, generation: int) -> list[Manifest]:
        return self.cache.stage_pods_of(namespace=namespace, deployment=deployment, generation=generation)

    def lease_holder(self, *, namespace: str, name: str) -> tuple[str, int] | None:
        """(holder, term) of a Lease, None while it does not exist or nobody holds it."""
        lease = self.cache.lease(namespace=namespace, name=name)
        if lease is None or not lease["spec"].get("holderIdentity"):
            return None
        return lease["spec"]["holderIdentity"], lease["spec"].get("leaseTransitions") or 0

    def lease_annotation(self, *, namespace: str, name: str, key: str) -> str | None:
        """One annotation of a watched Lease (only those its projection keeps), None when it or the Lease is absent."""
        lease = self.cache.lease(namespace=namespace, name=name)
        if lease is None:
            return None
        value = (lease["metadata"].get("annotations") or {}).get(key)
        return None if value is None else str(value)

    def scale(self, *, namespace: str, name: str, replicas: int) -> None:
        """Set a ModelDeployment's spec.replicas, as `kubectl scale` does; the spec handler reconciles the change."""
        self._custom.patch_namespaced_custom_object(
            group=GROUP,
            version=VERSION,
            namespace=namespace,
            plural=PLURAL,
            name=name,
            body={"spec": {"replicas": replicas}},
            _content_type="application/merge-patch+json",
        )

    def gateway_rolled_out(self, *, namespace: str, name: str) -> bool:
        """The gateway Deployment's current spec is what runs: every replica updated and one available."""
        deployment = self.cache.gateway(namespace=namespace, name=name)
        if deployment is None:
            return False
        status = deployment["status"]
        return bool(
            status["observedGeneration"] >= (deployment["metadata"].get("generation") or 0)
            and status["updatedReplicas"] >= deployment["spec"]["replicas"]
            and status["availableReplicas"] >= 1
            and status["replicas"] == status["updatedReplicas"]
        )

    def gateway_available(self, *, namespace: str, name: str) -> bool:
        deployment = self.cache.gateway(namespace=namespace, name=name)
        return deployment is not None and deployment["status"]["availableReplicas"] >= 1
