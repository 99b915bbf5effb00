"""Which deployments a change wakes, which changes count as changes, and which status fields a write sends."""

from __future__ import annotations

from typing import Any

import pytest
from strata.operator import projections
from strata.operator.doorbells import Placements, concerned_by_child, concerned_by_node, concerned_by_pod
from strata.operator.status_writer import StatusWriter, status_changes
from strata_testbed.cluster_objects import gpu_node, gpu_pod

A, B, C = ("ns", "llama"), ("ns", "qwen"), ("other", "short")
PLACEMENTS = Placements({A: frozenset({"n1", "n2"}), B: frozenset({"n3"}), C: None})


def stage_pod(deployment: str, *, node: str, namespace: str = "ns") -> dict[str, Any]:
    pod = gpu_pod(f"{deployment}-stage-0", node=node, namespace=namespace)
    pod["metadata"]["labels"] = {"app.kubernetes.io/name": "strata", "app.kubernetes.io/instance": deployment}
    return pod


@pytest.mark.parametrize(
    ("change", "woken"),
    [
        pytest.param(("node", "n1"), {A, C}, id="a node with a stage wakes its deployment and the unplaced ones"),
        pytest.param(("node", "n9"), {C}, id="a node nobody uses wakes only the unplaced ones"),
        pytest.param(("pod", gpu_pod("train", node="n3")), {B, C}, id="a foreign GPU pod wakes who is placed there"),
        pytest.param(("pod", stage_pod("llama", node="n1")), {A, C}, id="a stage pod wakes its own deployment"),
        pytest.param(
            ("pod", stage_pod("llama", node="n3", namespace="elsewhere")),
            {B, C},
            id="a namesake in another namespace is foreign",
        ),
        pytest.param(("child", stage_pod("qwen", node="n1")), {B}, id="a child wakes only its owner"),
        pytest.param(("child", gpu_pod("train", node="n1")), set(), id="an object Strata does not own wakes nobody"),
    ],
)
def test_a_change_wakes_exactly_the_deployments_it_concerns(change: tuple[str, Any], woken: set[Any]) -> None:
    kind, what = change
    if kind == "node":
        assert concerned_by_node(PLACEMENTS, what) == woken
    elif kind == "pod":
        assert concerned_by_pod(PLACEMENTS, None, what) == woken
    else:
        assert concerned_by_child(PLACEMENTS, what) == woken


def heartbeat(node: dict[str, Any]) -> dict[str, Any]:
    beat = {**node, "status": {**node["status"]}}
    beat["status"]["conditions"] = [
        {**c, "lastHeartbeatTime": "2026-01-01T00:00:09Z"} for c in node["status"]["conditions"]
    ]
    beat["status"]["allocatable"] = {**node["status"]["allocatable"], "cpu": "95"}
    return beat


BASE = gpu_node("n1")


@pytest.mark.parametrize(
    ("after", "changed"),
    [
        pytest.param(heartbeat(BASE), False, id="a heartbeat or a CPU change is not a change"),
        pytest.param(gpu_node("n1", ready=False), True, id="NotReady is a change"),
        pytest.param(gpu_node("n1", unschedulable=True), True, id="cordoning is a change"),
        pytest.param(gpu_node("n1", taints=[{"key": "k", "effect": "NoSchedule"}]), True, id="a new taint is a change"),
        pytest.param(gpu_node("n1", labels={"pool": "x"}), True, id="a new label is a change"),
        pytest.param(gpu_node("n1", gpus=4), True, id="fewer GPUs is a change"),
    ],
)
def test_a_node_change_counts_only_when_the_planner_would_see_it(after: dict[str, Any], changed: bool) -> None:
    assert (projections.node(BASE) != projections.node(after)) is changed


def _lease(*, holder: str = "gw-a", renewed: str = "2026-01-01T00:00:00Z", demand: str | None = None) -> dict[str, Any]:
    annotations = {"other": "x"} | ({"strata.dev/demand": demand} if demand is not None else {})
    return {
        "metadata": {"name": "m-coordinator", "namespace": "ns", "labels": {}, "annotations": annotations},
        "spec": {"holderIdentity": holder, "leaseTransitions": 1, "renewTime": renewed},
    }


LEASE = _lease(demand='{"busy":0,"held":0,"lanes":4,"queue":0}')


@pytest.mark.parametrize(
    ("after", "changed"),
    [
        pytest.param(_lease(renewed="2026-01-01T00:00:02Z", demand='{"busy":0,"held":0,"lanes":4,"queue":0}'), False,
                     id="a renewal with the same demand is not a change"),
        pytest.param(_lease(demand='{"busy":0,"held":1,"lanes":0,"queue":0}'), True,
                     id="a request held at zero is a change: it wakes the autoscaler"),
        pytest.param(_lease(holder="gw-b", demand='{"busy":0,"held":0,"lanes":4,"queue":0}'), True,
                     id="a new holder is a change"),
    ],
)  # fmt: skip
def test_a_lease_change_counts_when_its_holder_or_its_demand_moves(after: dict[str, Any], changed: bool) -> None:
    assert (projections.lease(LEASE) != projections.lease(after)) is changed
    assert "other" not in projections.lease(after)["metadata"].get("annotations", {})


@pytest.mark.parametrize(
    ("pod", "kept"),
    [
        pytest.param(gpu_pod("train", node="n1"), True, id="a running GPU pod is kept"),
        pytest.param(gpu_pod("train", node="n1", phase="Succeeded"), False, id="a finished one holds nothing"),
        pytest.param(gpu_pod("web", node="n1", gpus=0), False, id="a pod without GPUs is not kept"),
        pytest.param(gpu_pod("wait", node=None), True, id="a pending GPU pod is kept for when it binds"),
    ],
)
def test_only_pods_that_hold_gpus_are_kept(pod: dict[str, Any], kept: bool) -> None:
    assert (projections.gpu_pod(pod) is not None) is kept


@pytest.mark.parametrize(
    ("current", "new", "sent"),
    [
        pytest.param({"phase": "Ready", "ready": "2/2"}, {"phase": "Ready", "ready": "2/2"}, {}, id="same: nothing"),
        pytest.param({"phase": "Loading"}, {"phase": "Ready"}, {"phase": "Ready"}, id="a changed field alone"),
        pytest.param({}, {"shortfall": None, "phase": "Ready"}, {"phase": "Ready"}, id="absent and None are equal"),
        pytest.param({"shortfall": "short"}, {"shortfall": None}, {"shortfall": None}, id="a cleared field is sent"),
        pytest.param(None, {"phase": "Pending"}, {"phase": "Pending"}, id="no status yet: all of it"),
    ],
)
def test_a_status_write_sends_only_the_changed_fields(
    current: dict[str, Any] | None, new: dict[str, Any], sent: dict[str, Any]
) -> None:
    assert status_changes(current, new) == sent


class RecordingPatcher:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.version = 1

    def patch_status(self, *, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any]:
        self.sent.append(status)
        self.version += 1
        return {"metadata": {"resourceVersion": str(self.version)}, "status": status}


def test_the_writer_uses_its_own_write_until_the_watch_catches_up() -> None:
    patcher = RecordingPatcher()
    writer = StatusWriter(patcher)
    stale = {"metadata": {"resourceVersion": "1"}, "status": {"phase": "Loading"}}
    assert writer.write(A, based_on=stale, status={"phase": "Ready"})
    fresh = writer.freshest(A, stale)
    assert fresh["status"] == {"phase": "Ready"}, "the watch's older object would undo the write"
    assert not writer.write(A, based_on=fresh, status={"phase": "Ready"})
    caught_up = {"metadata": {"resourceVersion": "2"}, "status": {"phase": "Ready"}}
    assert writer.freshest(A, caught_up) == caught_up
    assert patcher.sent == [{"phase": "Ready"}]
