"""The GPU inventory: which nodes count, how many GPUs are free, how much memory each has, and why a node is out."""

from __future__ import annotations

from typing import Any

import pytest
from strata.operator.planner.errors import InvalidInventoryError
from strata.operator.planner.inventory import NodeGpus, build_inventory
from strata.operator.planner.requests import pod_request
from strata.operator.planner.scheduling import Toleration
from strata.plan import Backend
from strata_testbed.cluster_objects import gpu_node, gpu_pod
from strata_testbed.gpu_pool import pool_nodes

GIB = 1 << 30
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("node", "selector", "tolerations", "reason"),
    [
        pytest.param(gpu_node("n", ready=False), {}, (), "NotReady", id="a node whose Ready condition is False is out"),
        pytest.param(gpu_node("n", unschedulable=True), {}, (), "cordoned", id="a cordoned node is out"),
        pytest.param(
            gpu_node("n", taints=[GPU_TAINT]),
            {},
            (),
            "taint nvidia.com/gpu=present:NoSchedule is not tolerated",
            id="an untolerated NoSchedule taint is named in the reason",
        ),
        pytest.param(
            gpu_node("n", taints=[{"key": "maintenance", "effect": "NoExecute"}]),
            {},
            (Toleration(key="maintenance", operator="Exists", effect="NoSchedule"),),
            "taint maintenance:NoExecute is not tolerated",
            id="a toleration for another effect does not tolerate a NoExecute taint",
        ),
        pytest.param(
            gpu_node("n", taints=[GPU_TAINT]),
            {},
            (Toleration(key="nvidia.com/gpu", value="absent"),),
            "not tolerated",
            id="an Equal toleration with another value does not tolerate the taint",
        ),
        pytest.param(
            gpu_node("n", labels={"pool": "batch"}),
            {"pool": "serving"},
            (),
            "selector mismatch: label pool=serving wanted, is 'batch'",
            id="a node whose label has another value than the selector is out",
        ),
        pytest.param(
            gpu_node("n"),
            {"pool": "serving"},
            (),
            "selector mismatch: label pool=serving wanted, missing",
            id="a node without the selector's label is out",
        ),
        pytest.param(gpu_node("n", gpus=0), {}, (), "no GPU", id="a node with no allocatable GPU is out"),
        pytest.param(
            gpu_node("n", gib=None),
            {},
            (),
            "GPU memory unknown: no nvidia.com/gpu.memory label",
            id="a node without a memory label is out and the label is named",
        ),
        pytest.param(
            gpu_node("n", gib=None, labels={"nvidia.com/gpu.memory": "lots"}),
            {},
            (),
            "GPU memory unknown: label nvidia.com/gpu.memory='lots'",
            id="a node with a malformed memory label is out and the value is quoted",
        ),
    ],
)
def test_a_node_that_cannot_take_a_stage_is_excluded_with_a_reason(
    node: dict[str, Any], selector: dict[str, str], tolerations: tuple[Toleration, ...], reason: str
) -> None:
    inventory = build_inventory(nodes=[node], node_selector=selector, tolerations=tolerations)
    assert inventory.gpus == ()
    assert [excluded.node for excluded in inventory.excluded] == ["n"]
    assert reason in inventory.excluded[0].reason


@pytest.mark.parametrize(
    ("node", "tolerations"),
    [
        pytest.param(
            gpu_node("n", taints=[{"key": "spot", "value": "true", "effect": "PreferNoSchedule"}]),
            (),
            id="a PreferNoSchedule taint does not exclude a node",
        ),
        pytest.param(
            gpu_node("n", taints=[GPU_TAINT]),
            (Toleration(key="nvidia.com/gpu", operator="Exists"),),
            id="an Exists toleration for the key tolerates any value and effect",
        ),
        pytest.param(
            gpu_node("n", taints=[GPU_TAINT]),
            (Toleration(key="nvidia.com/gpu", value="present", effect="NoSchedule"),),
            id="an Equal toleration with the same value and effect tolerates the taint",
        ),
        pytest.param(
            gpu_node("n", taints=[GPU_TAINT, {"key": "dedicated", "value": "llm", "effect": "NoExecute"}]),
            (Toleration(operator="Exists"),),
            id="an Exists toleration without a key tolerates every taint",
        ),
        pytest.param(gpu_node("n", ready=None), (), id="a node with no conditions reported yet is not held against"),
    ],
)
def test_a_schedulable_node_is_counted(node: dict[str, Any], tolerations: tuple[Toleration, ...]) -> None:
    inventory = build_inventory(nodes=[node], tolerations=tolerations)
    assert inventory.excluded == ()
    assert inventory.gpu_count == 8


@pytest.mark.parametrize(
    ("node", "override", "memory", "backend"),
    [
        pytest.param(gpu_node("n", gib=80), None, 80 * GIB, Backend.CUDA, id="nvidia memory is read in MiB"),
        pytest.param(
            gpu_node("n", gib=None, resource="amd.com/gpu", labels={"amd.com/gpu.vram": "192G"}),
            None,
            192 * GIB,
            Backend.ROCM,
            id="amd vram like 192G is read in GiB and runs ROCm",
        ),
        pytest.param(
            gpu_node("n", gib=None, resource="amd.com/gpu", labels={"beta.amd.com/gpu.vram": "64G"}),
            None,
            64 * GIB,
            Backend.ROCM,
            id="the legacy beta amd vram label is read too",
        ),
        pytest.param(
            gpu_node("n", gib=None, resource="amd.com/gpu", labels={"amd.com/gpu.vram": "48Gi"}),
            None,
            48 * GIB,
            Backend.ROCM,
            id="amd vram with a Gi suffix is read as GiB",
        ),
        pytest.param(
            gpu_node("n", gib=16, resource="gpu.intel.com/i915"),
            None,
            16 * GIB,
            Backend.XPU,
            id="intel i915 memory is read in bytes and runs XPU",
        ),
        pytest.param(
            gpu_node("n", gib=24, resource="gpu.intel.com/xe"), None, 24 * GIB, Backend.XPU, id="intel xe runs XPU"
        ),
        pytest.param(gpu_node("n", gib=80), 40 * GIB, 40 * GIB, Backend.CUDA, id="a memory override wins over a label"),
        pytest.param(
            gpu_node("n", gib=None), 24 * GIB, 24 * GIB, Backend.CUDA, id="a memory override stands in for no label"
        ),
    ],
)
def test_memory_per_gpu_comes_from_the_vendor_label_or_the_override(
    node: dict[str, Any], override: int | None, memory: int, backend: Backend
) -> None:
    inventory = build_inventory(nodes=[node], gpu_memory_bytes=override)
    assert [(g.memory_bytes, g.backend) for g in inventory.gpus] == [(memory, backend)]


@pytest.mark.parametrize(
    ("pods", "free"),
    [
        pytest.param([gpu_pod("p", node="n", gpus=3)], 5, id="gpus requested by a running pod are taken"),
        pytest.param([gpu_pod("p", node="n", gpus=2, via="limits")], 6, id="a limit without a request counts"),
        pytest.param([gpu_pod("p", node="n", gpus=3, phase="Succeeded")], 8, id="a succeeded pod holds nothing"),
        pytest.param([gpu_pod("p", node="n", gpus=3, phase="Failed")], 8, id="a failed pod holds nothing"),
        pytest.param([gpu_pod("p", node="n", gpus=1, phase="Pending")], 7, id="a pending pod already bound holds"),
        pytest.param([gpu_pod("p", node=None, gpus=3)], 8, id="an unbound pod holds nothing"),
        pytest.param([gpu_pod("p", node="other", gpus=3)], 8, id="a pod on another node holds nothing here"),
        pytest.param(
            [gpu_pod("p", node="n", gpus=1, resource="amd.com/gpu")], 8, id="a pod holding another vendor's gpu"
        ),
        pytest.param(
            [gpu_pod("a", node="n", gpus=3), gpu_pod("b", node="n", gpus=4)], 1, id="requests of several pods add up"
        ),
    ],
)
def test_free_gpus_are_allocatable_minus_what_bound_pods_request(pods: list[dict[str, Any]], free: int) -> None:
    inventory = build_inventory(nodes=[gpu_node("n", gpus=8)], pods=pods)
    assert [g.free for g in inventory.gpus] == [free]


def _init(gpus: int, *, sidecar: bool = False) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "init", "resources": {"requests": {"nvidia.com/gpu": str(gpus)}}}
    if sidecar:
        container["restartPolicy"] = "Always"
    return container


@pytest.mark.parametrize(
    ("init_containers", "effective"),
    [
        pytest.param([_init(4)], 4, id="an init container asking more than the app raises the effective request"),
        pytest.param([_init(1)], 2, id="an init container asking less leaves the app's request"),
        pytest.param([_init(3), _init(5)], 5, id="init containers run one at a time so the largest counts"),
        pytest.param([_init(1, sidecar=True)], 3, id="a sidecar adds to the app containers"),
        pytest.param([_init(2, sidecar=True), _init(4)], 6, id="an init container after a sidecar runs beside it"),
    ],
)
def test_a_pod_request_follows_the_effective_request_rule(
    init_containers: list[dict[str, Any]], effective: int
) -> None:
    pod = gpu_pod("p", node="n", gpus=2, init_containers=init_containers)
    assert pod_request(pod, "nvidia.com/gpu") == effective


def test_a_node_whose_gpus_are_all_requested_names_the_pods_that_hold_them() -> None:
    inventory = build_inventory(
        nodes=[gpu_node("n", gpus=2)], pods=[gpu_pod("train", node="n", gpus=2, namespace="ml")]
    )
    assert inventory.excluded[0].reason == "no free GPU: all 2 nvidia.com/gpu requested by pods (ml/train)"


def test_a_malformed_gpu_quantity_is_an_error_that_names_the_pod() -> None:
    pod = gpu_pod("p", node="n")
    pod["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] = "half"
    with pytest.raises(InvalidInventoryError, match="pod default/p: GPU quantity 'half' is not a whole number"):
        build_inventory(nodes=[gpu_node("n")], pods=[pod])


def test_the_testbed_pool_keeps_its_four_gpu_nodes_and_explains_the_other_three() -> None:
    inventory = build_inventory(nodes=pool_nodes())
    assert inventory.gpus == (
        NodeGpus("gpu-a100-0", "nvidia.com/gpu", Backend.CUDA, 81920 << 20, 8),
        NodeGpus("gpu-a100-1", "nvidia.com/gpu", Backend.CUDA, 81920 << 20, 8),
        NodeGpus("gpu-a10g-0", "nvidia.com/gpu", Backend.CUDA, 24576 << 20, 4),
        NodeGpus("gpu-mi300x-0", "amd.com/gpu", Backend.ROCM, 192 << 30, 8),
    )
    assert {e.node: e.reason.split(":")[0].split(" ")[0] for e in inventory.excluded} == {
        "gpu-cordoned-0": "cordoned",
        "gpu-notready-0": "NotReady",
        "gpu-tainted-0": "taint",
    }
