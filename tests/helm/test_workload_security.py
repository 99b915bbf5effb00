"""Every pod the operator starts is locked down, and each stage accepts traffic only from its predecessor and the
operator (which polls load progress).

The manifests come from strata.operator.children exactly as the reconciler applies them; a NetworkPolicy is read
as the API server's network plugin would: which pods it selects and which peers, in which namespaces, its ingress
rules admit.
"""

from __future__ import annotations

from typing import Any

import pytest
from strata.gguf.model import CacheType
from strata.operator.children import GATEWAY_REQUESTS, RUN_AS_USER, STAGE_REQUESTS, Owner
from strata.operator.names import (
    GATEWAY_PORT,
    LABEL_COMPONENT,
    LABEL_NAMESPACE_NAME,
    LABEL_STAGE,
    STAGE_PORT,
    labels,
)
from strata.operator.render import PipelineChildren, render_children
from strata.operator.replicas import summarize
from strata.operator.spec import ModelDeploymentSpec
from strata.plan import Backend, Plan, Stage

Manifest = dict[str, Any]
OWNER = Owner(name="llama", namespace="team-a", uid="0f0e0d0c-0000-4000-8000-000000000001")
OPERATOR_NAMESPACE = "strata-system"


def _plan(stages: int) -> Plan:
    return Plan(
        stages=tuple(
            Stage(
                index=i,
                node=f"gpu-{i}",
                resource="nvidia.com/gpu",
                gpus=(0,),
                backend=Backend.CUDA,
                layer_start=i * 10,
                layer_end=(i + 1) * 10,
                embeddings=i == 0,
                output_head=i == stages - 1,
                memory_bytes=80 << 30,
                usable_bytes=72 << 30,
                weight_bytes=30 << 30,
                buffer_bytes=1 << 30,
                kv_bytes=8 << 30,
            )
            for i in range(stages)
        ),
        context_length=8192,
        parallel=4,
        cache_type_k=CacheType.Q8_0,
        cache_type_v=CacheType.Q8_0,
        kv_bytes_per_token=69_632,
    )


def _children(stages: int = 3, operator_namespace: str = OPERATOR_NAMESPACE, **spec: Any) -> list[Manifest]:
    parsed = ModelDeploymentSpec.from_manifest({"model": {"url": "https://models.example/m.gguf"}, **spec})
    return render_children(
        OWNER,
        parsed,
        [PipelineChildren(index=0, plan=(plan := _plan(stages)), generation=1)],
        serving=(serving := summarize(plan, generation=1)),
        served=[(0, serving)],
        image="strata:test",
        model_name="m",
        operator_namespace=operator_namespace,
    )


def _matches(selector: Manifest, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peer: Manifest, *, source: dict[str, str], namespace: str, policy_namespace: str) -> bool:
    """A peer without a namespaceSelector means the policy's own namespace; without a podSelector, every pod."""
    if "namespaceSelector" in peer:
        namespace_ok = _matches(peer["namespaceSelector"], {LABEL_NAMESPACE_NAME: namespace})
    else:
        namespace_ok = namespace == policy_namespace
    return namespace_ok and _matches(peer.get("podSelector", {}), source)


def _admitted(
    policies: list[Manifest],
    *,
    source: dict[str, str],
    target: dict[str, str],
    port: int | str,
    namespace: str = OWNER.namespace,
) -> bool:
    """Whether a pod labelled `source` in `namespace` may open `port` on a pod labelled `target`."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], target)]
    if not selecting:
        return True  # no policy selects the pod: Kubernetes leaves it open
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            ports_ok = not rule.get("ports") or any(p["port"] == port for p in rule["ports"])
            peers = rule.get("from")
            peers_ok = peers is None or any(
                _peer_matches(
                    peer, source=source, namespace=namespace, policy_namespace=policy["metadata"]["namespace"]
                )
                for peer in peers
            )
            if ports_ok and peers_ok:
                return True
    return False


def _template(children: list[Manifest], kind: str, component: str, index: str | None = None) -> Manifest:
    for child in children:
        labels = child["metadata"]["labels"]
        if child["kind"] == kind and labels[LABEL_COMPONENT] == component and labels.get(LABEL_STAGE) in (None, index):
            return dict(child["spec"]["template"])
    raise LookupError(f"no {kind} for {component} {index}")


POD_CASES = [
    pytest.param("StatefulSet", "stage", "0", id="the first stage pod"),
    pytest.param("StatefulSet", "stage", "2", id="the last stage pod"),
    pytest.param("Deployment", "gateway", None, id="the gateway pod"),
]


@pytest.mark.parametrize(("kind", "component", "index"), POD_CASES)
def test_a_workload_pod_runs_as_the_image_user_without_privileges(kind: str, component: str, index: str | None) -> None:
    spec = _template(_children(), kind, component, index)["spec"]
    assert spec["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["enableServiceLinks"] is False
    for container in spec["containers"]:
        security = container["securityContext"]
        assert security["runAsUser"] == RUN_AS_USER
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}


STAGE_POD_CASES = [case for case in POD_CASES if case.values[1] == "stage"]


@pytest.mark.parametrize(("kind", "component", "index"), STAGE_POD_CASES)
def test_a_stage_pod_gets_no_service_account_token(kind: str, component: str, index: str | None) -> None:
    # The gateway's token, narrowed to its own Lease, is tested in tests/coordination/test_gateway_access.py.
    assert _template(_children(), kind, component, index)["spec"]["automountServiceAccountToken"] is False


RESOURCE_CASES = [
    pytest.param({}, "StatefulSet", "stage", STAGE_REQUESTS, id="a stage without resources gets the default requests"),
    pytest.param(
        {}, "Deployment", "gateway", GATEWAY_REQUESTS, id="a gateway without resources gets the default requests"
    ),
    pytest.param(
        {"stage": {"resources": {"requests": {"memory": "64Gi"}}}},
        "StatefulSet",
        "stage",
        {"cpu": STAGE_REQUESTS["cpu"], "memory": "64Gi"},
        id="a request in the spec wins over the default for that resource only",
    ),
    pytest.param(
        {"gateway": {"resources": {"limits": {"memory": "256Mi"}}}},
        "Deployment",
        "gateway",
        {"cpu": GATEWAY_REQUESTS["cpu"]},
        id="a limit alone leaves the request to Kubernetes so it never exceeds the limit",
    ),
]


@pytest.mark.parametrize(("spec", "kind", "component", "requests"), RESOURCE_CASES)
def test_resource_requests_default_without_overriding_the_spec(
    spec: Manifest, kind: str, component: str, requests: dict[str, str]
) -> None:
    container = _template(_children(**spec), kind, component, "0")["spec"]["containers"][0]
    assert container["resources"]["requests"] == requests


def test_the_gateway_reads_its_api_keys_from_the_named_secret() -> None:
    children = _children(gateway={"apiKeySecretRef": {"name": "llama-keys"}})
    env = _template(children, "Deployment", "gateway")["spec"]["containers"][0]["env"]
    keys = [e for e in env if e["name"] == "STRATA_API_KEYS"]
    assert keys == [
        {"name": "STRATA_API_KEYS", "valueFrom": {"secretKeyRef": {"name": "llama-keys", "key": "api-keys"}}}
    ]


def test_without_an_api_key_secret_the_gateway_gets_no_keys_variable() -> None:
    env = _template(_children(), "Deployment", "gateway")["spec"]["containers"][0]["env"]
    assert "STRATA_API_KEYS" not in {e["name"] for e in env}


def _stage(index: int) -> dict[str, str]:
    return labels(OWNER.name, component="stage") | {LABEL_STAGE: str(index), "strata.dev/plan-generation": "1"}


GATEWAY = labels(OWNER.name, component="gateway")
CLIENT = {"app": "some-client"}
OTHER_STAGE = labels("other-model", component="stage") | {LABEL_STAGE: "0"}

FLOW_CASES = [
    pytest.param(GATEWAY, _stage(0), STAGE_PORT, True, id="the gateway reaches stage 0"),
    pytest.param(_stage(0), _stage(1), STAGE_PORT, True, id="stage 0 reaches stage 1"),
    pytest.param(_stage(1), _stage(2), STAGE_PORT, True, id="stage 1 reaches stage 2"),
    pytest.param(GATEWAY, _stage(1), STAGE_PORT, False, id="the gateway cannot skip to stage 1"),
    pytest.param(_stage(0), _stage(2), STAGE_PORT, False, id="stage 0 cannot skip to stage 2"),
    pytest.param(_stage(2), _stage(1), STAGE_PORT, False, id="stage 2 cannot call back into stage 1"),
    pytest.param(_stage(1), _stage(1), STAGE_PORT, False, id="a stage does not admit its own index from elsewhere"),
    pytest.param(CLIENT, _stage(0), STAGE_PORT, False, id="a client pod cannot reach a stage"),
    pytest.param(OTHER_STAGE, _stage(1), STAGE_PORT, False, id="another model's stage cannot reach this pipeline"),
    pytest.param(GATEWAY, _stage(0), 22, False, id="the gateway reaches stage 0 on the gRPC port only"),
    pytest.param(CLIENT, GATEWAY, GATEWAY_PORT, True, id="any client reaches the gateway's HTTP port"),
    pytest.param(CLIENT, GATEWAY, 9000, False, id="no other port of the gateway is open"),
]


@pytest.mark.parametrize(("source", "target", "port", "admitted"), FLOW_CASES)
def test_network_policies_admit_only_the_pipeline_order(
    source: dict[str, str], target: dict[str, str], port: int | str, admitted: bool
) -> None:
    policies = [c for c in _children() if c["kind"] == "NetworkPolicy"]
    assert _admitted(policies, source=source, target=target, port=port) is admitted


# The chart's operator pod: its selector labels plus the release's; it runs in the operator's namespace.
OPERATOR = {
    "app.kubernetes.io/name": "strata",
    "app.kubernetes.io/instance": "strata",
    "app.kubernetes.io/component": "operator",
    "app.kubernetes.io/part-of": "strata",
}

OPERATOR_CASES = [
    pytest.param(OPERATOR, OPERATOR_NAMESPACE, _stage(0), STAGE_PORT, True, id="the operator reaches stage 0"),
    pytest.param(OPERATOR, OPERATOR_NAMESPACE, _stage(1), STAGE_PORT, True, id="the operator reaches a middle stage"),
    pytest.param(OPERATOR, OPERATOR_NAMESPACE, _stage(2), STAGE_PORT, True, id="the operator reaches the last stage"),
    pytest.param(OPERATOR, OPERATOR_NAMESPACE, _stage(1), 22, False, id="the operator reaches the gRPC port only"),
    pytest.param(
        OPERATOR, OWNER.namespace, _stage(1), STAGE_PORT, False, id="an operator-labelled pod elsewhere is refused"
    ),
    pytest.param(
        CLIENT,
        OPERATOR_NAMESPACE,
        _stage(1),
        STAGE_PORT,
        False,
        id="other pods of the operator's namespace are refused",
    ),
    pytest.param(
        GATEWAY, OPERATOR_NAMESPACE, _stage(1), STAGE_PORT, False, id="a gateway in the operator's namespace is refused"
    ),
]


@pytest.mark.parametrize(("source", "namespace", "target", "port", "admitted"), OPERATOR_CASES)
def test_the_operator_reaches_every_stage_to_poll_its_load_progress(
    source: dict[str, str], namespace: str, target: dict[str, str], port: int, admitted: bool
) -> None:
    policies = [c for c in _children() if c["kind"] == "NetworkPolicy"]
    assert _admitted(policies, source=source, target=target, port=port, namespace=namespace) is admitted


def test_an_operator_in_the_deployments_own_namespace_reaches_every_stage() -> None:
    policies = [c for c in _children(operator_namespace=OWNER.namespace) if c["kind"] == "NetworkPolicy"]
    for index in range(3):
        assert _admitted(policies, source=OPERATOR, target=_stage(index), port=STAGE_PORT, namespace=OWNER.namespace)


SCRAPER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_metrics_scrapers_reach_the_named_metrics_port_of_every_pod() -> None:
    children = _children(networkPolicy={"metricsFrom": [SCRAPER]})
    policies = [c for c in children if c["kind"] == "NetworkPolicy"]
    assert len(policies) == 4  # three stages and the gateway
    for policy in policies:
        metrics = [r for r in policy["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": "metrics"}]]
        assert metrics == [{"from": [SCRAPER], "ports": [{"protocol": "TCP", "port": "metrics"}]}]
        assert policy["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_without_scrapers_no_metrics_rule_is_rendered() -> None:
    for policy in (c for c in _children() if c["kind"] == "NetworkPolicy"):
        assert all(r["ports"][0]["port"] != "metrics" for r in policy["spec"]["ingress"])


def test_network_policies_can_be_turned_off_in_the_spec() -> None:
    assert not [c for c in _children(networkPolicy={"enabled": False}) if c["kind"] == "NetworkPolicy"]


def test_a_metrics_scraper_must_name_a_selector() -> None:
    with pytest.raises(ValueError, match="namespaceSelector, a podSelector or both"):
        _children(networkPolicy={"metricsFrom": [{}]})
