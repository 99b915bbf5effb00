"""The operator on the test bed reacts to the watches, not to a timer, and costs a quiet cluster nothing.

The operator runs under its own identity, which the test bed's API server audits: every request it makes is counted
by the API server itself.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from strata_testbed.audit import audited_requests, by_verb_and_resource
from strata_testbed.controlplane import KWOK_MANAGED_ANNOTATION, ControlPlane
from strata_testbed.operator_run import OperatorProcess, create, deployment, planned_and_running, read
from strata_testbed.waiting import eventually

pytestmark = pytest.mark.cluster

REPLAN_BOUND_SECONDS = 2.0  # issue 27: a planned node going NotReady is re-planned within 2 s
QUIET_SECONDS = 60.0
LEADER_LEASE = "strata-operator"  # the operator's own election Lease: renewing it is its one steady cost
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


@pytest.fixture
def audited_operator(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    process = OperatorProcess(control_plane.operator_kubeconfig, namespace, tmp_path / "operator.log")
    process.start()
    yield process
    process.stop()
    print((tmp_path / "operator.log").read_text(errors="replace")[-6000:])  # shown when the test fails


def _ready(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    body = read(api, namespace, name)
    return body if (body.get("status") or {}).get("phase") == "Ready" else None


def _set_ready(core: client.CoreV1Api, node: str, *, ready: bool) -> None:
    """kwok turns any node it manages Ready again at once, as a kubelet that still runs would: the node leaves
    kwok's hands first, like a node whose kubelet stopped, and returns to them once Ready again."""
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    if not ready:
        condition |= {"reason": "KubeletNotReady", "message": "the test stopped the kubelet"}
        core.patch_node(name=node, body={"metadata": {"annotations": {KWOK_MANAGED_ANNOTATION: "stopped"}}})
    core.patch_node_status(name=node, body={"status": {"conditions": [condition]}})
    if ready:
        core.patch_node(name=node, body={"metadata": {"annotations": {KWOK_MANAGED_ANNOTATION: "fake"}}})


@pytest.mark.usefixtures("audited_operator")
def test_a_planned_node_going_not_ready_is_replanned_within_two_seconds(
    cluster: client.ApiClient, namespace: str, models: dict[str, Path]
) -> None:
    core = client.CoreV1Api(cluster)
    create(cluster, namespace, deployment("watched", models["70b"], context=8192))
    first = eventually(lambda: planned_and_running(cluster, namespace, "watched"), what="the first plan")
    plan = first["status"]["plan"]
    node = plan["stages"][0]["node"]
    started = time.monotonic()
    _set_ready(core, node, ready=False)
    try:

        def replanned() -> dict[str, Any] | None:
            status = read(cluster, namespace, "watched")["status"]
            return status if status["plan"]["generation"] > plan["generation"] else None

        moved = eventually(replanned, timeout=30, what="a re-plan off the NotReady node")
        elapsed = time.monotonic() - started
    finally:
        _set_ready(core, node, ready=True)
    assert node not in {s["node"] for s in moved["plan"]["stages"]}
    assert elapsed < REPLAN_BOUND_SECONDS, f"re-planned {elapsed:.2f} s after the node went NotReady"

    def events() -> set[str] | None:
        reasons = {e.reason for e in core.list_namespaced_event(namespace=namespace).items}
        return reasons if {"StageLost", "Replanned"} <= reasons else None

    eventually(events, timeout=30, what="the StageLost and Replanned Events")


def test_a_quiet_cluster_costs_the_operator_no_lists_and_no_writes(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, models: dict[str, Path], tmp_path: Path
) -> None:
    started = dt.datetime.now(dt.UTC)
    operator = OperatorProcess(control_plane.operator_kubeconfig, namespace, tmp_path / "operator.log")
    operator.start()
    try:
        for name in ("quiet-a", "quiet-b"):
            create(cluster, namespace, deployment(name, models["70b"], context=8192))
        eventually(lambda: all(_ready(cluster, namespace, name) for name in ("quiet-a", "quiet-b")), what="both Ready")
        window = dt.datetime.now(dt.UTC)
        time.sleep(QUIET_SECONDS)
        until = dt.datetime.now(dt.UTC)
    finally:
        operator.stop()
    during_start = audited_requests(control_plane.audit_log, since=started, until=window)
    quiet = audited_requests(control_plane.audit_log, since=window, until=until)
    print(sorted(by_verb_and_resource(quiet).items()))

    assert any(r.verb == "list" and r.resource == "nodes" for r in during_start), "the audit log sees the operator"
    others = [r for r in quiet if not (r.resource == "leases" and r.name == LEADER_LEASE)]
    lists = [r for r in others if r.verb == "list"]
    writes = [r for r in others if r.verb in WRITE_VERBS]
    reads = [r for r in others if r.verb == "get"]
    assert lists == [], "no LIST once the watches are fed"
    assert writes == [], "no status patch or apply while nothing changes"
    assert reads == [], "no per-deployment reads: readiness comes from the watches"
    assert {r.verb for r in others} <= {"watch"}
