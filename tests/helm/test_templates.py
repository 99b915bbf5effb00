"""The chart renders what each value set promises, passes `helm lint --strict`, and refuses values it cannot honour.

Rendering uses the pinned helm binary of the test bed (no cluster needed); the schema that refuses bad values is
the generated values.schema.json, so these cases also prove the generator closes every object.
"""

from __future__ import annotations

from typing import Any

import pytest
from strata.cli import build_parser
from strata.operator import command as operator_command
from strata.operator.names import operator_labels
from strata_testbed.helm import Helm, HelmFailed, Manifest, find

NAMESPACED = {"operator": {"watchNamespaces": ["team-a", "team-b"]}}
TOKENS = {"operator": {"secretNames": ["hf-token", "mirror-token"]}}
METRICS = {"metrics": {"enabled": True, "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}}
NO_CRDS = {"crds": {"enabled": False}}

VALUE_SETS = [
    pytest.param({}, id="the defaults"),
    pytest.param(NAMESPACED, id="namespace-scoped"),
    pytest.param(NO_CRDS, id="CRDs managed elsewhere"),
    pytest.param(METRICS, id="metrics with a ServiceMonitor"),
    pytest.param(TOKENS, id="model token Secrets listed"),
    pytest.param({"operator": {"replicas": 3}, "podDisruptionBudget": {"enabled": True}}, id="three replicas"),
]


@pytest.fixture(scope="module")
def helm() -> Helm:
    return Helm.pinned()


def _rules(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [rule for role in find(manifests, kind) for rule in role["rules"]]


def _operator_container(manifests: list[Manifest]) -> Manifest:
    (deployment,) = find(manifests, "Deployment")
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_helm_lint_passes_strictly(helm: Helm, values: Manifest) -> None:
    assert "0 chart(s) failed" in helm.lint(values)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_rendered_name_fits_in_63_characters_even_for_a_long_release(helm: Helm, values: Manifest) -> None:
    release = "a-release-name-that-is-long-enough-to-push-every-derived-name-over"
    for manifest in helm.manifests(values, release=release[:53]):
        assert len(manifest["metadata"]["name"]) <= 63, manifest["metadata"]["name"]
        for value in manifest["metadata"].get("labels", {}).values():
            assert len(value) <= 63


def test_the_defaults_install_a_cluster_wide_operator_with_its_crd_kept(helm: Helm) -> None:
    manifests = helm.manifests()
    kinds = sorted(m["kind"] for m in manifests)
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    ]
    (crd,) = find(manifests, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    args = _operator_container(manifests)["args"]
    assert args[0] == "operator"
    assert not [a for a in args if a.startswith("--namespace")]
    assert "--image=strata:0.1.0-cuda" in args


def test_the_operator_pod_is_locked_down_and_elects_through_the_downward_api(helm: Helm) -> None:
    manifests = helm.manifests()
    (deployment,) = find(manifests, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = _operator_container(manifests)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert container["resources"]["requests"] == {"cpu": "100m", "memory": "256Mi"}
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"STRATA_OPERATOR_NAMESPACE": "metadata.namespace", "POD_NAME": "metadata.name"}
    assert "--lease-name=strata-operator" in container["args"]


def test_the_operator_pod_carries_the_labels_stage_network_policies_admit(helm: Helm) -> None:
    # Stage NetworkPolicies admit the operator's load-progress polls by these labels (strata.operator.children).
    (deployment,) = find(helm.manifests(release="team-strata"), "Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"].items() >= operator_labels().items()


def test_namespace_scoped_mode_grants_workloads_only_in_the_watched_namespaces(helm: Helm) -> None:
    manifests = helm.manifests(NAMESPACED)
    args = _operator_container(manifests)["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    workload_roles = [r for r in find(manifests, "Role") if r["metadata"]["namespace"] != "strata"]
    assert sorted(r["metadata"]["namespace"] for r in workload_roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in find(manifests, "RoleBinding")) == ["strata", "team-a", "team-b"]
    # Only the read-only pool ClusterRole remains cluster-wide.
    (cluster_role,) = find(manifests, "ClusterRole")
    assert cluster_role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get", "list", "watch"]},
        {
            "apiGroups": ["apiextensions.k8s.io"],
            "resources": ["customresourcedefinitions"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get", "list", "watch"]},
    ]


def test_crds_can_be_left_out(helm: Helm) -> None:
    assert not find(helm.manifests(NO_CRDS), "CustomResourceDefinition")


def test_crds_can_be_removed_on_uninstall(helm: Helm) -> None:
    (crd,) = find(helm.manifests({"crds": {"keep": False}}), "CustomResourceDefinition")
    assert "annotations" not in crd["metadata"]


def test_metrics_add_a_port_a_service_and_a_service_monitor(helm: Helm) -> None:
    manifests = helm.manifests(METRICS)
    container = _operator_container(manifests)
    assert "--metrics-port=9402" in container["args"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9402, "protocol": "TCP"}]
    (service,) = find(manifests, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"
    (monitor,) = find(manifests, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]


def test_metrics_are_off_by_default(helm: Helm) -> None:
    manifests = helm.manifests()
    assert not find(manifests, "Service")
    assert not find(manifests, "ServiceMonitor")
    assert not [a for a in _operator_container(manifests)["args"] if a.startswith("--metrics-port")]


SECRET_CASES = [
    pytest.param({}, None, id="no Secret is readable when none is listed"),
    pytest.param(TOKENS, ["hf-token", "mirror-token"], id="only the listed Secrets are readable"),
]


@pytest.mark.parametrize(("values", "names"), SECRET_CASES)
def test_secret_access_is_narrowed_to_the_listed_names(helm: Helm, values: Manifest, names: list[str] | None) -> None:
    manifests = helm.manifests(values)
    secret_rules = [
        r for r in _rules(manifests, "ClusterRole") + _rules(manifests, "Role") if "secrets" in r["resources"]
    ]
    if names is None:
        assert secret_rules == []
    else:
        assert secret_rules == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": names, "verbs": ["get"]}]


def test_the_lease_is_narrowed_by_name_for_every_verb_but_create(helm: Helm) -> None:
    lease_rules = [r for r in _rules(helm.manifests(), "Role") if r["resources"] == ["leases"]]
    assert lease_rules == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["strata-operator"],
            "verbs": ["get", "update", "patch"],
        },
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]


def test_no_rule_uses_a_wildcard_or_a_privilege_verb(helm: Helm) -> None:
    manifests = helm.manifests(TOKENS)
    for rule in _rules(manifests, "ClusterRole") + _rules(manifests, "Role"):
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"])


def test_rbac_is_touched_only_to_write_the_gateways_namespaced_role_and_binding(helm: Helm) -> None:
    """Each gateway gets a Role for its own Lease; the operator can write Roles and RoleBindings but never read,
    delete or cluster-scope them, and without `escalate`/`bind` the API server lets it grant only what it holds."""
    manifests = helm.manifests(TOKENS)
    rbac_rules = [
        r
        for r in _rules(manifests, "ClusterRole") + _rules(manifests, "Role")
        if "rbac.authorization.k8s.io" in r["apiGroups"]
    ]
    assert rbac_rules
    for rule in rbac_rules:
        assert rule["apiGroups"] == ["rbac.authorization.k8s.io"]
        assert sorted(rule["resources"]) == ["rolebindings", "roles"]
        assert sorted(rule["verbs"]) == ["create", "patch"]


REFUSED = [
    pytest.param({"replica": 2}, "additional properties 'replica' not allowed", id="a misspelt top-level key"),
    pytest.param({"operator": {"replica": 2}}, "'replica' not allowed", id="a misspelt nested key"),
    pytest.param({"operator": {"replicas": "two"}}, "/operator/replicas", id="a word where a number belongs"),
    pytest.param({"operator": {"replicas": 0}}, "/operator/replicas", id="zero operator replicas"),
    pytest.param({"crds": {"enabled": "yes"}}, "/crds/enabled", id="a string where a boolean belongs"),
    pytest.param({"operator": {"secretNames": ["Not_A_Name"]}}, "/operator/secretNames/0", id="an invalid Secret name"),
    pytest.param({"operator": {"watchNamespaces": "team-a"}}, "/operator/watchNamespaces", id="one namespace, no list"),
    pytest.param({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy", id="an unknown pull policy"),
    pytest.param(
        {"operator": {"watchNamespaces": ["team-a", "team-a"]}},
        "/operator/watchNamespaces",
        id="a namespace listed twice",
    ),
    pytest.param(
        {"operator": {"resources": {"requests": {"cpu": "lots"}}}},
        "/operator/resources/requests/cpu",
        id="a non-quantity request",
    ),
    pytest.param({"metrics": {"port": 80}}, "/metrics/port", id="a privileged metrics port"),
    pytest.param(
        {"metrics": {"serviceMonitor": {"enabled": True}}},
        "needs metrics.enabled",
        id="a ServiceMonitor without the metrics Service",
    ),
]


@pytest.mark.parametrize(("values", "message"), REFUSED)
def test_bad_values_are_refused_before_anything_renders(helm: Helm, values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmFailed, match=message):
        helm.template(values)


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_rendered_arguments_are_ones_the_operator_command_accepts(helm: Helm, values: Manifest) -> None:
    manifests = helm.manifests(values)
    args = build_parser().parse_args(_operator_container(manifests)["args"])
    operator = {**{"watchNamespaces": [], "jsonLogs": True}, **values.get("operator", {})}
    assert args.run is operator_command.run
    assert args.namespaces == operator["watchNamespaces"]
    assert args.lease_name == "strata-operator"
    assert args.json_logs is operator["jsonLogs"]
    assert args.metrics_port == (9402 if values.get("metrics", {}).get("enabled") else 0)


IMAGE_CASES = [
    pytest.param({}, "strata:0.1.0", "strata:0.1.0-cuda", id="the app version tags both variants"),
    pytest.param(
        {"image": {"repository": "registry.example/strata", "tag": "1.2.3"}},
        "registry.example/strata:1.2.3",
        "registry.example/strata:1.2.3-cuda",
        id="a repository and tag apply to both variants",
    ),
    pytest.param(
        {"image": {"digest": "sha256:" + "ab" * 32}},
        "strata@sha256:" + "ab" * 32,
        "strata:0.1.0-cuda",
        id="a digest pins the operator image",
    ),
    pytest.param(
        {"operator": {"workloadImage": "strata-rocm:0.1.0"}},
        "strata:0.1.0",
        "strata-rocm:0.1.0",
        id="the workload image can be set on its own",
    ),
]


@pytest.mark.parametrize(("values", "operator_image", "workload_image"), IMAGE_CASES)
def test_images_follow_the_values(helm: Helm, values: Manifest, operator_image: str, workload_image: str) -> None:
    container = _operator_container(helm.manifests(values))
    assert container["image"] == operator_image
    assert f"--image={workload_image}" in container["args"]


KEDA = {"kedaExample": {"enabled": True, "deployment": "llama", "namespace": "models", "lanesPerPipeline": 2}}


def test_the_keda_example_is_off_by_default(helm: Helm) -> None:
    assert not find(helm.manifests(), "ScaledObject")


def test_the_keda_example_scales_the_modeldeployment_on_its_gateways_busy_and_queued_lanes(helm: Helm) -> None:
    (scaled,) = find(helm.manifests(KEDA), "ScaledObject")
    assert scaled["metadata"]["namespace"] == "models"
    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "strata.dev/v1alpha1",
        "kind": "ModelDeployment",
        "name": "llama",
    }
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 4)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["threshold"] == "2"
    query = trigger["metadata"]["query"]
    assert 'strata_gateway_pipeline_lanes_busy{namespace="models",pod=~"llama-gateway-.*"}' in query
    assert 'strata_gateway_queue_depth{namespace="models",pod=~"llama-gateway-.*"}' in query


def test_the_keda_example_needs_a_deployment_name(helm: Helm) -> None:
    with pytest.raises(HelmFailed, match=r"kedaExample\.deployment must name the ModelDeployment"):
        helm.manifests({"kedaExample": {"enabled": True}})
