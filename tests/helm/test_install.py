"""`helm install` on the local control plane: the CRD is established, the operator's objects exist, and its
ServiceAccount can do what the operator needs and nothing else.

Two releases share the cluster: one cluster-wide (the defaults, with one model-token Secret listed) and one
namespace-scoped to `team-x` without CRDs. The permission matrix asks the real API server's RBAC authorizer
(`kubectl auth can-i --as system:serviceaccount:...`). Then the real operator process runs with a token of the
namespace-scoped ServiceAccount (TokenRequest API) and reconciles a ModelDeployment: the RBAC is sufficient, not
only restrictive.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from strata.gguf.testmodels.writer import write_header_only_model
from strata.operator.names import LABEL_INSTANCE
from strata.operator.spec import GROUP, PLURAL, VERSION
from strata_testbed.controlplane import ControlPlane, free_port
from strata_testbed.helm import Helm

pytestmark = pytest.mark.cluster

T = TypeVar("T")
CRD_NAME = f"{PLURAL}.{GROUP}"
TOKEN_SECRET = "hf-token"


def eventually(probe: Callable[[], T | None], *, timeout: float = 90.0, what: str) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}")


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str
    service_account: str
    lease: str
    notes: str

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


@dataclass(frozen=True)
class Installed:
    cluster_wide: Release
    scoped: Release
    watched: str  # the namespace the scoped release watches
    unwatched: str  # a namespace neither may write in through the scoped release


def _adopt_crd(ext: client.ApiextensionsV1Api, release: str, namespace: str) -> None:
    """Other test modules create the CRD without Helm; mark it as this release's so Helm adopts it, as a platform
    team does when it moves a hand-installed CRD under the chart."""
    try:
        ext.patch_custom_resource_definition(
            name=CRD_NAME,
            body={
                "metadata": {
                    "labels": {"app.kubernetes.io/managed-by": "Helm"},
                    "annotations": {
                        "meta.helm.sh/release-name": release,
                        "meta.helm.sh/release-namespace": namespace,
                    },
                }
            },
        )
    except ApiException as e:
        if e.status != 404:
            raise


def _release(helm: Helm, *, name: str, namespace: str, values: dict[str, object]) -> Release:
    notes = helm.install(release=name, namespace=namespace, values=values)
    operator = f"{name}-strata-operator"
    return Release(name=name, namespace=namespace, service_account=operator, lease=operator, notes=notes)


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[Installed]:
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    core, ext = client.CoreV1Api(api), client.ApiextensionsV1Api(api)
    suffix = uuid.uuid4().hex[:5]
    names = [f"strata-{suffix}", f"scoped-{suffix}", f"team-x-{suffix}", f"team-y-{suffix}"]
    for namespace in names:
        core.create_namespace(body={"metadata": {"name": namespace}})
    helm = Helm.pinned(kubeconfig=control_plane.kubeconfig)
    wide = f"cw-{suffix}"
    _adopt_crd(ext, wide, names[0])
    cluster_wide = _release(helm, name=wide, namespace=names[0], values={"operator": {"secretNames": [TOKEN_SECRET]}})
    scoped = _release(
        helm,
        name=f"ns-{suffix}",
        namespace=names[1],
        values={"crds": {"enabled": False}, "operator": {"watchNamespaces": [names[2]], "secretNames": [TOKEN_SECRET]}},
    )
    yield Installed(cluster_wide=cluster_wide, scoped=scoped, watched=names[2], unwatched=names[3])
    helm.uninstall(release=scoped.name, namespace=scoped.namespace)
    for namespace in names:
        core.delete_namespace(name=namespace)
    api.close()


def test_the_crd_is_established_and_kept_by_the_release(installed: Installed, api_client: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api_client)

    def established() -> bool:
        crd = ext.read_custom_resource_definition(name=CRD_NAME)
        return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])

    eventually(established, what="the CRD to be established")
    crd = ext.read_custom_resource_definition(name=CRD_NAME)
    assert crd.metadata.annotations["meta.helm.sh/release-name"] == installed.cluster_wide.name
    assert crd.metadata.annotations["helm.sh/resource-policy"] == "keep"


def test_the_operator_objects_exist(installed: Installed, api_client: client.ApiClient) -> None:
    release = installed.cluster_wide
    apps, core = client.AppsV1Api(api_client), client.CoreV1Api(api_client)
    rbac = client.RbacAuthorizationV1Api(api_client)
    deployment = apps.read_namespaced_deployment(name=f"{release.name}-strata-operator", namespace=release.namespace)
    pod = deployment.spec.template.spec
    assert pod.service_account_name == release.service_account
    assert pod.security_context.run_as_non_root is True
    assert pod.containers[0].security_context.read_only_root_filesystem is True
    core.read_namespaced_service_account(name=release.service_account, namespace=release.namespace)
    rbac.read_cluster_role(name=f"{release.name}-strata-operator")
    rbac.read_cluster_role_binding(name=f"{release.name}-strata-operator-pool-reader")
    rbac.read_namespaced_role(name=f"{release.name}-strata-operator-leader-election", namespace=release.namespace)
    scoped = installed.scoped
    rbac.read_namespaced_role(name=f"{scoped.name}-strata-operator", namespace=installed.watched)
    with pytest.raises(ApiException) as missing:
        rbac.read_cluster_role(name=f"{scoped.name}-strata-operator")
    assert missing.value.status == 404


def test_the_notes_tell_the_next_steps(installed: Installed) -> None:
    notes = installed.cluster_wide.notes
    assert f"rollout status deployment/{installed.cluster_wide.name}-strata-operator" in notes
    assert "kind: ModelDeployment" in notes
    assert f"read these Secrets for model tokens, and no others: {TOKEN_SECRET}" in notes
    assert f"watches only these namespaces: {installed.watched}" in installed.scoped.notes


def _can(kubectl: Path, kubeconfig: Path, user: str, verb: str, resource: str, namespace: str | None) -> bool:
    scope = ["--namespace", namespace] if namespace else ["--all-namespaces"]
    # "serviceaccounts#token" is the token subresource; "serviceaccounts/token" would name an object "token".
    resource, _, subresource = resource.partition("#")
    extra = ["--subresource", subresource] if subresource else []
    argv = [
        str(kubectl),
        "--kubeconfig",
        str(kubeconfig),
        "auth",
        "can-i",
        verb,
        resource,
        "--as",
        user,
        *scope,
        *extra,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if result.returncode not in (0, 1):
        raise AssertionError(f"kubectl auth can-i failed: {result.stderr}")
    return result.returncode == 0


# (verb, resource, namespace: "release", "watched", "unwatched", "other" or None for all namespaces, allowed)
CLUSTER_WIDE = [
    ("watch", "modeldeployments.strata.dev", None, True),
    ("patch", "modeldeployments.strata.dev/status", "other", True),
    ("patch", "statefulsets.apps", "other", True),
    ("delete", "statefulsets.apps", "other", True),
    ("patch", "networkpolicies.networking.k8s.io", "other", True),
    ("patch", "poddisruptionbudgets.policy", "other", True),
    ("create", "events", "other", True),
    ("create", "configmaps", "other", True),
    ("get", "configmaps", "other", False),
    ("list", "services", None, False),
    ("delete", "deployments.apps", "other", False),
    ("list", "nodes", None, True),
    ("list", "pods", None, True),
    ("get", f"secrets/{TOKEN_SECRET}", "other", True),
    ("get", "leases.coordination.k8s.io/LEASE", "release", True),
    ("update", "leases.coordination.k8s.io/LEASE", "release", True),
    ("create", "leases.coordination.k8s.io", "release", True),
    ("get", "secrets/another-secret", "other", False),
    ("list", "secrets", "other", False),
    ("watch", "secrets", None, False),
    ("create", "pods", "other", False),
    ("delete", "pods", "other", False),
    ("patch", "nodes", None, False),
    ("delete", "modeldeployments.strata.dev", "other", False),
    # It grants each gateway get/update on its coordinator Lease, so it must hold those itself (RBAC escalation
    # prevention); it watches the coordinator Leases (and gateway Deployments) instead of reading them on a timer,
    # and never deletes a Lease.
    ("update", "leases.coordination.k8s.io/a-gateway-lease", "other", True),
    ("patch", "leases.coordination.k8s.io/a-gateway-lease", "other", True),
    ("delete", "leases.coordination.k8s.io/LEASE", "release", False),
    ("list", "leases.coordination.k8s.io", "other", True),
    ("watch", "leases.coordination.k8s.io", None, True),
    ("watch", "deployments.apps", None, True),
    ("get", "events", "other", True),
    ("patch", "events", "other", True),
    ("create", "serviceaccounts", "other", True),
    ("create", "roles.rbac.authorization.k8s.io", "other", True),
    ("create", "rolebindings.rbac.authorization.k8s.io", "other", True),
    ("delete", "rolebindings.rbac.authorization.k8s.io", "other", False),
    ("escalate", "roles.rbac.authorization.k8s.io", "other", False),
    ("bind", "roles.rbac.authorization.k8s.io", "other", False),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None, False),
    ("create", "clusterroles.rbac.authorization.k8s.io", None, False),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io", None, True),
    ("patch", "customresourcedefinitions.apiextensions.k8s.io", None, False),
    ("list", "namespaces", None, False),
    ("impersonate", "serviceaccounts", "other", False),
    ("create", "serviceaccounts#token", "release", False),
]
SCOPED = [
    ("watch", "modeldeployments.strata.dev", "watched", True),
    ("patch", "statefulsets.apps", "watched", True),
    ("patch", "networkpolicies.networking.k8s.io", "watched", True),
    ("get", f"secrets/{TOKEN_SECRET}", "watched", True),
    ("list", "pods", None, True),
    ("list", "nodes", None, True),
    ("watch", "namespaces", None, True),
    ("get", "leases.coordination.k8s.io/LEASE", "release", True),
    ("watch", "modeldeployments.strata.dev", None, False),
    ("watch", "modeldeployments.strata.dev", "unwatched", False),
    ("patch", "statefulsets.apps", "unwatched", False),
    ("patch", "deployments.apps", "unwatched", False),
    ("delete", "services", "unwatched", False),
    ("create", "events", "unwatched", False),
    ("get", f"secrets/{TOKEN_SECRET}", "unwatched", False),
    ("get", "secrets/another-secret", "watched", False),
    ("delete", "pods", "watched", False),
]
MATRIX = [
    pytest.param(
        "cluster_wide",
        *row,
        id=f"cluster-wide {'can' if row[3] else 'cannot'} {row[0]} {row[1]} in {row[2] or 'all namespaces'}",
    )
    for row in CLUSTER_WIDE
] + [
    pytest.param(
        "scoped",
        *row,
        id=f"namespace-scoped {'can' if row[3] else 'cannot'} {row[0]} {row[1]} in {row[2] or 'all namespaces'}",
    )
    for row in SCOPED
]


@pytest.mark.parametrize(("mode", "verb", "resource", "where", "allowed"), MATRIX)
def test_the_permission_matrix(
    control_plane: ControlPlane,
    installed: Installed,
    mode: str,
    verb: str,
    resource: str,
    where: str | None,
    allowed: bool,
) -> None:
    release: Release = getattr(installed, mode)
    namespaces = {
        "release": release.namespace,
        "watched": installed.watched,
        "unwatched": installed.unwatched,
        "other": installed.unwatched,
        None: None,
    }
    resource = resource.replace("LEASE", release.lease)
    got = _can(control_plane.kubectl, control_plane.kubeconfig, release.user, verb, resource, namespaces[where])
    assert got is allowed


def _token_kubeconfig(control_plane: ControlPlane, release: Release, path: Path) -> Path:
    """A kubeconfig that authenticates as the release's ServiceAccount, with a token from the TokenRequest API."""
    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    token = (
        client.CoreV1Api(api)
        .create_namespaced_service_account_token(
            name=release.service_account, namespace=release.namespace, body={"spec": {"expirationSeconds": 3600}}
        )
        .status.token
    )
    api.close()
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "testbed",
                "cluster": {"server": control_plane.server, "certificate-authority": str(control_plane.pki.ca.cert)},
            }
        ],
        "users": [{"name": release.user, "user": {"token": token}}],
        "contexts": [{"name": "testbed", "context": {"cluster": "testbed", "user": release.user}}],
        "current-context": "testbed",
    }
    path.write_text(yaml.safe_dump(kubeconfig))
    return path


def _condition(body: dict[str, Any], kind: str) -> str | None:
    for c in (body.get("status") or {}).get("conditions", []):
        if c["type"] == kind:
            return str(c["status"])
    return None


RUNS = [
    pytest.param("scoped", "watched", id="the namespace-scoped operator reconciles in its watched namespace"),
    pytest.param("cluster_wide", "unwatched", id="the cluster-wide operator reconciles in any namespace"),
]
# What the API server answers when RBAC denies a ServiceAccount (other failures, a model fetch say, do not count).
RBAC_DENIAL = 'forbidden: User "system:serviceaccount:'


@pytest.mark.parametrize(("mode", "where"), RUNS)
def test_the_operator_reconciles_with_nothing_but_its_service_account(
    control_plane: ControlPlane,
    installed: Installed,
    api_client: client.ApiClient,
    tmp_path: Path,
    mode: str,
    where: str,
) -> None:
    release: Release = getattr(installed, mode)
    namespace: str = getattr(installed, where)
    kubeconfig = _token_kubeconfig(control_plane, release, tmp_path / "operator.kubeconfig")
    model = write_header_only_model(tmp_path / "llama3-70b.gguf", shape="llama3-70b").path
    log = tmp_path / "operator.log"
    argv = [sys.executable, "-m", "strata.cli", "operator", "--kubeconfig", str(kubeconfig)]
    if mode == "scoped":
        argv += ["--namespace", namespace]
    argv += ["--lease-namespace", release.namespace, "--lease-name", release.lease]
    metrics_port = free_port()
    argv += ["--image", "strata:test", "--identity", "operator-under-test", "--metrics-port", str(metrics_port)]
    objects = client.CustomObjectsApi(api_client)
    with log.open("ab") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        objects.create_namespaced_custom_object(
            group=GROUP,
            version=VERSION,
            namespace=namespace,
            plural=PLURAL,
            body={
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "ModelDeployment",
                "metadata": {"name": "llama"},
                "spec": {"model": {"url": model.as_uri()}, "context": 8192},
            },
        )

        def ready_pods() -> dict[str, Any] | None:
            body = dict(objects.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "llama"))
            plan = (body.get("status") or {}).get("plan")
            pods = client.CoreV1Api(api_client).list_namespaced_pod(
                namespace=namespace, label_selector=f"{LABEL_INSTANCE}=llama,app.kubernetes.io/component=stage"
            )
            running = [p for p in pods.items if p.status.phase == "Running"]
            return body if plan and len(running) == len(plan["stages"]) else None

        body = eventually(ready_pods, what="the stage pods of a plan made under the operator's own RBAC")
        assert _condition(body, "Planned") == "True"
        assert body["status"]["observedGeneration"] == body["metadata"]["generation"]
        policies = client.NetworkingV1Api(api_client).list_namespaced_network_policy(
            namespace=namespace, label_selector=f"{LABEL_INSTANCE}=llama"
        )
        assert len(policies.items) == len(body["status"]["plan"]["stages"]) + 1
        events = client.CoreV1Api(api_client).list_namespaced_event(namespace=namespace).items
        assert "Planned" in {e.reason for e in events if e.involved_object.name == "llama"}
        lease = client.CoordinationV1Api(api_client).read_namespaced_lease(
            name=release.lease, namespace=release.namespace
        )
        assert lease.spec.holder_identity == "operator-under-test"
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert "strata_operator_leader 1.0" in response.read().decode()
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        print(log.read_text(errors="replace")[-6000:])  # shown when the test fails
    assert RBAC_DENIAL not in log.read_text(errors="replace")


def test_uninstall_keeps_the_crd_and_removes_the_operator(
    control_plane: ControlPlane, installed: Installed, api_client: client.ApiClient
) -> None:
    release = installed.cluster_wide
    Helm.pinned(kubeconfig=control_plane.kubeconfig).uninstall(release=release.name, namespace=release.namespace)
    rbac, ext = client.RbacAuthorizationV1Api(api_client), client.ApiextensionsV1Api(api_client)

    def operator_gone() -> bool:
        try:
            rbac.read_cluster_role(name=f"{release.name}-strata-operator")
        except ApiException as e:
            return bool(e.status == 404)
        return False

    eventually(operator_gone, what="the release's ClusterRole to go")
    assert ext.read_custom_resource_definition(name=CRD_NAME).metadata.name == CRD_NAME
