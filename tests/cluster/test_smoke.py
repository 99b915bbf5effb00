"""The local control plane behaves like a real cluster: optimistic concurrency, scheduling, controllers, GC."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from typing import Any, TypeVar

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from strata_testbed.controlplane import TESTBED_DIR, binaries_dir
from strata_testbed.gpu_pool import pool_nodes
from strata_testbed.waiting import eventually

pytestmark = pytest.mark.cluster

T = TypeVar("T")


@pytest.fixture
def namespace(api_client: client.ApiClient) -> Iterator[str]:
    core = client.CoreV1Api(api_client)
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    core.create_namespace(body={"metadata": {"name": name}})
    # ServiceAccount admission refuses pods until the controller manager has made the default account.
    eventually(lambda: _default_sa_exists(core, name), what=f"the default ServiceAccount in {name}")
    yield name
    core.delete_namespace(name=name)


def _default_sa_exists(core: client.CoreV1Api, namespace: str) -> bool:
    try:
        core.read_namespaced_service_account(name="default", namespace=namespace)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def gpu_pod(name: str, *, gpus: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "strata:test",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ]
        },
    }


def _pinned(module_dir: str, module: str) -> str:
    for line in (TESTBED_DIR / "go" / module_dir / "go.mod").read_text().splitlines():
        fields = line.split("//")[0].split()
        if len(fields) >= 2 and fields[-2] == module:
            return fields[-1]
    raise AssertionError(f"testbed/go/{module_dir}/go.mod pins no version of {module}")


@pytest.mark.parametrize(
    ("binary", "argv", "module_dir", "module", "expected"),
    [
        pytest.param(
            "kube-apiserver", ["--version"], "kubernetes", "k8s.io/kubernetes", "Kubernetes {v}", id="apiserver"
        ),
        pytest.param(
            "kubectl", ["version", "--client"], "kubernetes", "k8s.io/kubernetes", "Client Version: {v}", id="kubectl"
        ),
        pytest.param(
            "kube-scheduler", ["--version"], "kubernetes", "k8s.io/kubernetes", "Kubernetes {v}", id="scheduler"
        ),
        pytest.param("etcd", ["--version"], "etcd", "go.etcd.io/etcd/server/v3", "etcd Version: {n}", id="etcd"),
        pytest.param("kwok", ["--version"], "kwok", "sigs.k8s.io/kwok", "kwok version {v}", id="kwok"),
        pytest.param("helm", ["version", "--short"], "helm", "helm.sh/helm/v3", "{v}", id="helm"),
    ],
)
def test_every_binary_reports_the_version_its_wrapper_module_pins(
    binary: str, argv: list[str], module_dir: str, module: str, expected: str
) -> None:
    output = subprocess.run([str(binaries_dir() / binary), *argv], capture_output=True, text=True, check=True)
    pinned = _pinned(module_dir, module)
    assert expected.format(v=pinned, n=pinned.removeprefix("v")) in output.stdout


def test_a_lease_update_with_a_stale_resource_version_is_a_conflict(
    api_client: client.ApiClient, namespace: str
) -> None:
    leases = client.CoordinationV1Api(api_client)
    lease = leases.create_namespaced_lease(
        namespace=namespace, body={"metadata": {"name": "coordinator"}, "spec": {"holderIdentity": "a"}}
    )
    stale_version = lease.metadata.resource_version
    lease.spec.holder_identity = "b"
    leases.replace_namespaced_lease(name="coordinator", namespace=namespace, body=lease)

    lease.spec.holder_identity = "c"
    lease.metadata.resource_version = stale_version
    with pytest.raises(ApiException) as conflict:
        leases.replace_namespaced_lease(name="coordinator", namespace=namespace, body=lease)
    assert conflict.value.status == 409
    assert leases.read_namespaced_lease(name="coordinator", namespace=namespace).spec.holder_identity == "b"


def test_the_pool_has_every_node_of_the_yaml_file(api_client: client.ApiClient) -> None:
    names = {n.metadata.name for n in client.CoreV1Api(api_client).list_node().items}
    assert names == {n["metadata"]["name"] for n in pool_nodes()}


def test_a_pod_asking_for_two_nvidia_gpus_runs_on_an_nvidia_node(api_client: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api_client)
    core.create_namespaced_pod(namespace=namespace, body=gpu_pod("two-gpus", gpus=2))

    def running() -> client.V1Pod | None:
        pod = core.read_namespaced_pod(name="two-gpus", namespace=namespace)
        return pod if pod.status.phase == "Running" else None

    pod = eventually(running, what="the two-GPU pod to run")
    node = core.read_node(name=pod.spec.node_name)
    assert node.metadata.labels.get("nvidia.com/gpu.present") == "true"
    assert int(node.status.allocatable["nvidia.com/gpu"]) >= 2
    assert pod.spec.node_name not in {"gpu-notready-0", "gpu-cordoned-0", "gpu-tainted-0"}


def test_a_pod_asking_for_nine_gpus_stays_pending_as_unschedulable(
    api_client: client.ApiClient, namespace: str
) -> None:
    core = client.CoreV1Api(api_client)
    core.create_namespaced_pod(namespace=namespace, body=gpu_pod("nine-gpus", gpus=9))

    def unschedulable() -> client.V1PodCondition | None:
        pod = core.read_namespaced_pod(name="nine-gpus", namespace=namespace)
        for condition in pod.status.conditions or []:
            if condition.type == "PodScheduled" and condition.reason == "Unschedulable":
                return condition
        return None

    condition = eventually(unschedulable, what="the scheduler to call the nine-GPU pod Unschedulable")
    assert "nvidia.com/gpu" in condition.message
    pod = core.read_namespaced_pod(name="nine-gpus", namespace=namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def test_a_statefulset_creates_its_pod_and_kwok_runs_it(api_client: client.ApiClient, namespace: str) -> None:
    apps = client.AppsV1Api(api_client)
    core = client.CoreV1Api(api_client)
    apps.create_namespaced_stateful_set(
        namespace=namespace,
        body={
            "metadata": {"name": "stage"},
            "spec": {
                "serviceName": "stage",
                "replicas": 1,
                "selector": {"matchLabels": {"app": "stage"}},
                "template": {
                    "metadata": {"labels": {"app": "stage"}},
                    "spec": gpu_pod("unused", gpus=1)["spec"],
                },
            },
        },
    )

    def running() -> client.V1Pod | None:
        pods = core.list_namespaced_pod(namespace=namespace, label_selector="app=stage").items
        return pods[0] if pods and pods[0].status.phase == "Running" else None

    pod = eventually(running, what="the StatefulSet's pod to run")
    assert pod.metadata.name == "stage-0"
    assert pod.metadata.owner_references[0].kind == "StatefulSet"


def test_deleting_an_owner_garbage_collects_its_child(api_client: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api_client)
    owner = core.create_namespaced_config_map(namespace=namespace, body={"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(
        namespace=namespace,
        body={
            "metadata": {
                "name": "child",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
                ],
            }
        },
    )
    core.delete_namespaced_config_map(name="owner", namespace=namespace)

    def child_gone() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(namespace=namespace).items}
        return "child" not in names

    eventually(child_gone, what="the garbage collector to delete the child ConfigMap")
