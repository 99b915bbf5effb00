"""Every pod Strata runs is admitted under the Kubernetes `restricted` Pod Security Standard.

The test bed's API server runs the PodSecurity admission plugin; a namespace labelled to enforce `restricted`
refuses any pod that runs as root, keeps capabilities, allows privilege escalation or lacks a seccomp profile.
Each pod template (the chart's operator, the operator's stage and gateway pods) is created there with a
server-side dry run, which runs admission without storing anything; a deliberately weaker pod shows the namespace
really enforces.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from strata.gguf.model import CacheType
from strata.operator.children import Owner
from strata.operator.render import PipelineChildren, render_children
from strata.operator.replicas import summarize
from strata.operator.spec import ModelDeploymentSpec
from strata.plan import Backend, Plan, Stage
from strata_testbed.helm import Helm, find

pytestmark = pytest.mark.cluster
Manifest = dict[str, Any]


def _plan() -> Plan:
    stage = Stage(
        index=0,
        node="gpu-a100-0",
        resource="nvidia.com/gpu",
        gpus=(0,),
        backend=Backend.CUDA,
        layer_start=0,
        layer_end=32,
        embeddings=True,
        output_head=True,
        memory_bytes=80 << 30,
        usable_bytes=72 << 30,
        weight_bytes=8 << 30,
        buffer_bytes=1 << 30,
        kv_bytes=4 << 30,
    )
    return Plan(
        stages=(stage,),
        context_length=8192,
        parallel=4,
        cache_type_k=CacheType.Q8_0,
        cache_type_v=CacheType.Q8_0,
        kv_bytes_per_token=69_632,
    )


def _workload_templates() -> dict[str, Manifest]:
    spec = ModelDeploymentSpec.from_manifest(
        {"model": {"url": "https://models.example/m.gguf"}, "gateway": {"apiKeySecretRef": {"name": "keys"}}}
    )
    owner = Owner(name="llama", namespace="unused", uid="0f0e0d0c-0000-4000-8000-000000000002")
    plan = _plan()
    children = render_children(
        owner,
        spec,
        [PipelineChildren(index=0, plan=plan, generation=1)],
        serving=summarize(plan, generation=1),
        served=[],
        image="strata:test",
        model_name="m",
        operator_namespace="strata-system",
    )
    templates = {c["kind"]: c["spec"]["template"] for c in children if c["kind"] in ("StatefulSet", "Deployment")}
    (operator,) = find(Helm.pinned().manifests(), "Deployment")
    return {
        "stage": templates["StatefulSet"],
        "gateway": templates["Deployment"],
        "operator": operator["spec"]["template"],
    }


TEMPLATES = _workload_templates()


@pytest.fixture(scope="module")
def restricted(control_plane: Any) -> Iterator[tuple[client.CoreV1Api, str]]:
    from kubernetes import config

    api = config.new_client_from_config(config_file=str(control_plane.kubeconfig))
    core = client.CoreV1Api(api)
    name = f"restricted-{uuid.uuid4().hex[:6]}"
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    core.create_namespace(body={"metadata": {"name": name, "labels": labels}})
    # ServiceAccount admission refuses pods until the controller manager has made the default account.
    deadline = time.monotonic() + 60
    while not core.list_namespaced_service_account(namespace=name, field_selector="metadata.name=default").items:
        assert time.monotonic() < deadline, f"no default ServiceAccount in {name}"
        time.sleep(0.2)
    yield core, name
    core.delete_namespace(name=name)
    api.close()


def _dry_run_pod(core: client.CoreV1Api, namespace: str, template: Manifest, name: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**template["metadata"], "name": name},
        "spec": template["spec"],
    }
    # The operator's ServiceAccount lives in the release namespace; admission here only judges the pod's security.
    pod["spec"] = {k: v for k, v in pod["spec"].items() if k != "serviceAccountName"}
    core.create_namespaced_pod(namespace=namespace, body=pod, dry_run="All")


@pytest.mark.parametrize(
    "role",
    [
        pytest.param("operator", id="the operator pod is admitted as restricted"),
        pytest.param("stage", id="a stage pod is admitted as restricted"),
        pytest.param("gateway", id="a gateway pod is admitted as restricted"),
    ],
)
def test_a_strata_pod_passes_the_restricted_standard(restricted: tuple[client.CoreV1Api, str], role: str) -> None:
    core, namespace = restricted
    _dry_run_pod(core, namespace, TEMPLATES[role], f"{role}-probe")


WEAKENED = [
    pytest.param(("securityContext", "runAsNonRoot"), "runAsNonRoot", id="a pod that may run as root is refused"),
    pytest.param(("securityContext", "seccompProfile"), "seccompProfile", id="a pod without seccomp is refused"),
]


@pytest.mark.parametrize(("path", "message"), WEAKENED)
def test_the_namespace_really_enforces(
    restricted: tuple[client.CoreV1Api, str], path: tuple[str, str], message: str
) -> None:
    core, namespace = restricted
    template = copy.deepcopy(TEMPLATES["gateway"])
    template["spec"][path[0]].pop(path[1])
    for container in template["spec"]["containers"]:
        container["securityContext"].pop(path[1], None)
    with pytest.raises(ApiException) as refused:
        _dry_run_pod(core, namespace, template, "weakened-probe")
    assert refused.value.status == 403
    assert message in str(refused.value.body)
