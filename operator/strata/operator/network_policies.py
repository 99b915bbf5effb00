"""The NetworkPolicies around a deployment's pipelines, rendered as plain manifests (no I/O).

Each stage accepts gRPC only from its predecessor and the operator; the gateway's HTTP port is open; scrapers the
spec names reach the metrics ports. Policies select by stage index, so every pipeline and every plan generation is
covered by the same few objects.
"""

from __future__ import annotations

from strata.operator.children import METRICS_PORT_NAME, Manifest, Owner, owned_metadata
from strata.operator.names import (
    GATEWAY_PORT,
    LABEL_NAMESPACE_NAME,
    LABEL_STAGE,
    STAGE_PORT,
    Names,
    labels,
    operator_labels,
)
from strata.operator.spec import ModelDeploymentSpec


def _scrapers(spec: ModelDeploymentSpec) -> list[Manifest]:
    """An ingress rule for the metrics port, from the scrapers the spec names (none: no rule)."""
    peers = [scraper.model_dump(by_alias=True, exclude_none=True) for scraper in spec.network_policy.metrics_from]
    if not peers:
        return []
    return [{"from": peers, "ports": [{"protocol": "TCP", "port": METRICS_PORT_NAME}]}]


def _network_policy(owner: Owner, *, name: str, selected: dict[str, str], ingress: list[Manifest]) -> Manifest:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": owned_metadata(owner, name=name, labels=labels(owner.name, component="network-policy")),
        "spec": {"podSelector": {"matchLabels": selected}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def stage_network_policy(owner: Owner, spec: ModelDeploymentSpec, *, index: int, operator_namespace: str) -> Manifest:
    """Stage `index` accepts gRPC from its predecessor (the gateway for stage 0, stage index-1 otherwise) and from
    the operator, which asks each stage for its load progress; the operator may run in another namespace.

    A NetworkPolicy has one pod selector, so each stage gets its own; it selects by stage index, not plan
    generation, so the new generation of a re-plan is covered the moment its pods start.
    """
    names = Names(owner.name, owner.namespace)
    stage = labels(owner.name, component="stage")
    predecessor = labels(owner.name, component="gateway") if index == 0 else stage | {LABEL_STAGE: str(index - 1)}
    port = [{"protocol": "TCP", "port": STAGE_PORT}]
    grpc = {"from": [{"podSelector": {"matchLabels": predecessor}}], "ports": port}
    operator = {
        "namespaceSelector": {"matchLabels": {LABEL_NAMESPACE_NAME: operator_namespace}},
        "podSelector": {"matchLabels": operator_labels()},
    }
    return _network_policy(
        owner,
        name=names.stage_policy(index=index),
        selected=stage | {LABEL_STAGE: str(index)},
        ingress=[grpc, {"from": [operator], "ports": port}, *_scrapers(spec)],
    )


def gateway_network_policy(owner: Owner, spec: ModelDeploymentSpec) -> Manifest:
    """Clients (and an ingress controller) reach the gateway's HTTP port from anywhere; nothing else is open."""
    names = Names(owner.name, owner.namespace)
    http = {"ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]}
    return _network_policy(
        owner, name=names.gateway, selected=labels(owner.name, component="gateway"), ingress=[http, *_scrapers(spec)]
    )
