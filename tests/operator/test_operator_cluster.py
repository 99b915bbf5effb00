"""The operator on the real control plane with the kwok GPU pool: plan, place, report, re-plan, clean up.

The operator runs as its own process (`strata operator`), exactly as in a cluster, against header-only GGUF files
with real large shapes; kwok runs the stage pods, so scheduling and GPU accounting are the real scheduler's.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from kubernetes import client
from strata.gguf import read_model_header
from strata.gguf.testmodels.shapes import LARGE_SHAPES
from strata.gguf.testmodels.writer import write_header_only_model, write_test_model
from strata.operator.names import LABEL_GENERATION, LABEL_INSTANCE, Names
from strata.operator.spec import GROUP, PLURAL, VERSION
from strata_testbed.broken_models import cut_tensor_data
from strata_testbed.controlplane import ControlPlane
from strata_testbed.demo import gateway_url
from strata_testbed.operator_run import (
    OperatorProcess,
    condition,
    create,
    deployment,
    planned_and_running,
    read,
    stage_pods,
)
from strata_testbed.pod_runner import PodRunner, namespace_runner
from strata_testbed.waiting import eventually

pytestmark = pytest.mark.cluster

T = TypeVar("T")


STAGE_FAULTS = Path(__file__).parents[1] / "stage_faults"  # a sitecustomize that breaks stage workers on request
REPORTED_WITHIN_S = 10.0  # a stage's failed load is in the condition by then


def pod_runner(
    control_plane: ControlPlane, *, core: client.CoreV1Api, namespace: str, folder: Path, fault: str = ""
) -> PodRunner:
    """`namespace_runner`, where `fault` names one of tests/stage_faults for every stage worker."""
    path = os.pathsep.join(p for p in (str(STAGE_FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    node_env = {"PYTHONPATH": path, "STRATA_TEST_FAULT": fault} if fault else None
    return namespace_runner(control_plane, core=core, namespace=namespace, folder=folder, node_env=node_env)


@pytest.mark.usefixtures("operator")
def test_an_example_runs_its_stage_pods_on_the_planned_nodes_with_their_gpus(
    cluster: client.ApiClient, namespace: str, models: dict[str, Path]
) -> None:
    create(cluster, namespace, deployment("llama", models["70b"], context=8192))
    body = eventually(lambda: planned_and_running(cluster, namespace, "llama"), what="stage pods Running")

    status = body["status"]
    assert (condition(body, "Planned") or {}).get("status") == "True"
    assert (condition(body, "CapacityAvailable") or {}).get("status") == "True"
    assert status["contextLength"] == 8192
    assert status["stageCount"] == len(status["plan"]["stages"]) >= 1
    assert status["observedGeneration"] == body["metadata"]["generation"]
    pods = {p.metadata.labels["strata.dev/stage"]: p for p in stage_pods(cluster, namespace, "llama")}
    for stage in status["plan"]["stages"]:
        pod = pods[str(stage["index"])]
        assert pod.spec.node_name == stage["node"]
        limits = pod.spec.containers[0].resources.limits
        vendor = "amd.com/gpu" if stage["backend"] == "rocm" else "nvidia.com/gpu"
        assert limits[vendor] == str(stage["gpus"])
        env = {e.name: e.value for e in pod.spec.containers[0].env}
        assert (int(env["STRATA_LAYER_START"]), int(env["STRATA_LAYER_END"])) == (
            stage["layerStart"],
            stage["layerEnd"],
        )
        assert env["STRATA_CONTEXT"] == "8192"
    events = client.CoreV1Api(cluster).list_namespaced_event(namespace=namespace).items
    assert "Planned" in {e.reason for e in events if e.involved_object.name == "llama"}


@pytest.mark.usefixtures("operator")
def test_status_shows_each_stage_loading_its_bytes_from_the_real_stage_process(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    tiny = write_test_model(tmp_path / "tiny.gguf", architecture="llama").path
    create(cluster, namespace, deployment("tiny", tiny, context=512, parallel=2))
    with pod_runner(control_plane, core=client.CoreV1Api(cluster), namespace=namespace, folder=tmp_path) as runner:

        def loaded() -> list[dict[str, Any]] | None:
            progress = (read(cluster, namespace, "tiny").get("status") or {}).get("loadProgress") or []
            done = progress and all(p["bytesTotal"] > 0 and p["bytesLoaded"] == p["bytesTotal"] for p in progress)
            return list(progress) if done else None

        progress = eventually(loaded, timeout=120, what=f"load progress from the stage processes {runner.errors}")
    body = read(cluster, namespace, "tiny")
    assert [p["stage"] for p in progress] == [s["index"] for s in body["status"]["plan"]["stages"]]
    header, _ = read_model_header(str(tiny))
    assert sum(p["bytesTotal"] for p in progress) == sum(t.nbytes for t in header.tensors)


def tiny(folder: Path) -> Path:
    """A tiny model that loads whole, unless a fault breaks its stage."""
    return write_test_model(folder / "tiny.gguf", architecture="llama").path


def cut_tiny(folder: Path) -> Path:
    """A tiny model whose tensor data stops halfway: it plans, its stage pods start, and their load fails."""
    return cut_tensor_data(tiny(folder), folder / "cut.gguf")


def falcon(folder: Path) -> Path:
    """A header of an architecture the stages do not run."""
    shape = dataclasses.replace(LARGE_SHAPES["llama3-8b"], architecture="falcon", block_count=4)
    return write_header_only_model(folder / "falcon.gguf", shape=shape).path


def failed_in_a_stage_log(folder: Path) -> float | None:
    """When a stage pod's log first says its load failed (this clock), or None while none has."""
    for log in (folder / "pods").glob("*.log"):
        if "failed to load layers" in log.read_text(errors="replace"):
            return time.monotonic()
    return None


@dataclasses.dataclass(frozen=True)
class Broken:
    model: Callable[[Path], Path]
    kind: str  # the condition that says why
    reason: str
    message: str
    fault: str = ""  # one of tests/stage_faults, for every stage worker
    stage_starts: bool = True  # a stage starts and fails to load; else the model is refused before any starts
    phase: str = "Failed"


@pytest.mark.usefixtures("operator")
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(
            Broken(cut_tiny, "StagesReady", "LoadFailed", "stage 0 failed to load: the file ends at byte"),
            id="a stage whose tensor data is cut short reports LoadFailed with its message",
        ),
        pytest.param(
            Broken(
                tiny,
                "StagesReady",
                "LoadFailed",
                "stage 0 failed to load: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                fault="kv-pool-out-of-memory",
            ),
            id="a stage that runs out of memory for its KV pool reports LoadFailed with its message",
        ),
        pytest.param(
            Broken(
                tiny,
                "StagesReady",
                "LoadFailed",
                "stage 0 failed to load: the decode step runs on no path: eager: RuntimeError: CUDA error: operation "
                "not permitted when stream is capturing",
                fault="decode-step-fails",
            ),
            id="a stage whose decode step fails to capture on every path reports LoadFailed with its message",
        ),
        pytest.param(
            Broken(
                falcon,
                "Planned",
                "ModelNotExecutable",
                "architecture 'falcon' is not one the stage worker runs",
                stage_starts=False,
            ),
            id="a model the stages cannot run is refused before any stage starts",
        ),
    ],
)
def test_a_model_that_cannot_load_says_why_in_a_condition_and_an_event(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path, case: Broken
) -> None:
    core = client.CoreV1Api(cluster)
    create(cluster, namespace, deployment("broken", case.model(tmp_path), context=512, parallel=2))
    with pod_runner(control_plane, core=core, namespace=namespace, folder=tmp_path, fault=case.fault) as runner:

        def reported() -> tuple[dict[str, Any], str, float] | None:
            status = read(cluster, namespace, "broken")
            found = condition(status, case.kind)
            if not found or found["reason"] != case.reason:
                return None
            return found, status["status"]["phase"], time.monotonic()

        failed_at = None
        if case.stage_starts:
            # The stage pod's process starts (about 10 s here) and fails to load in well under a second; two minutes
            # leaves room on a busy two-core machine. From its log's line on, the operator has 10 s to say so.
            failed_at = eventually(
                lambda: failed_in_a_stage_log(tmp_path), timeout=120, what=f"a failed load; {runner.errors}"
            )
        # The phase is read with the condition: the operator writes both in one status.
        found, seen_phase, seen_at = eventually(
            reported, timeout=120, what=f"{case.kind} with reason {case.reason}; pod runner: {runner.errors}"
        )

        def recorded() -> list[client.CoreV1Event]:
            return [
                e
                for e in core.list_namespaced_event(namespace=namespace).items
                if e.reason == case.reason and e.involved_object.name == "broken"
            ]

        eventually(recorded, timeout=30, what=f"a {case.reason} Event")
        time.sleep(2 * 5.0)  # two more looks by the operator's monitor at the same failure
        events = recorded()
    assert found["status"] == "False"
    assert case.message in found["message"], found
    assert seen_phase == case.phase
    if failed_at is not None:
        print(f"{case.kind}={case.reason} {seen_at - failed_at:.1f} s after the stage's log said its load failed")
        assert seen_at - failed_at < REPORTED_WITHIN_S, f"reported {seen_at - failed_at:.1f} s after the failure"
    assert len(events) == 1, "one Event for one failure, not one per look"
    assert events[0].type == "Warning"
    assert case.message in events[0].message


@pytest.mark.usefixtures("operator")
def test_a_model_too_big_for_the_pool_reports_the_shortfall(
    cluster: client.ApiClient, namespace: str, models: dict[str, Path]
) -> None:
    create(cluster, namespace, deployment("huge", models["too-big"]))

    def short() -> dict[str, Any] | None:
        c = condition(read(cluster, namespace, "huge"), "CapacityAvailable")
        return c if c and c["status"] == "False" else None

    capacity = eventually(short, what="CapacityAvailable=False")
    assert "short by" in capacity["message"]
    assert read(cluster, namespace, "huge")["status"]["phase"] == "Shortfall"
    events = client.CoreV1Api(cluster).list_namespaced_event(namespace=namespace).items
    assert any(e.reason == "CapacityShortfall" and "short by" in e.message for e in events)
    assert stage_pods(cluster, namespace, "huge") == []


@pytest.mark.usefixtures("operator")
def test_cordoning_a_node_that_hosts_a_stage_moves_it_in_a_new_plan_generation(
    cluster: client.ApiClient, namespace: str, models: dict[str, Path]
) -> None:
    core = client.CoreV1Api(cluster)
    create(cluster, namespace, deployment("moving", models["70b"], context=8192))
    body = eventually(lambda: planned_and_running(cluster, namespace, "moving"), what="the first plan")
    first = body["status"]["plan"]
    node = first["stages"][0]["node"]
    core.patch_node(name=node, body={"spec": {"unschedulable": True}})
    try:

        def replanned() -> dict[str, Any] | None:
            current = planned_and_running(cluster, namespace, "moving")
            if current and current["status"]["plan"]["generation"] > first["generation"]:
                return current
            return None

        moved = eventually(replanned, what="a new plan generation off the cordoned node")
        assert node not in {s["node"] for s in moved["status"]["plan"]["stages"]}
        eventually(
            lambda: (
                (read(cluster, namespace, "moving")["status"].get("serving") or {}).get("generation")
                == moved["status"]["plan"]["generation"]
            ),
            what="the gateway to cut over",
        )
        reasons = {e.reason for e in core.list_namespaced_event(namespace=namespace).items}
        assert {"StageLost", "Replanned", "CutOver"} <= reasons
        eventually(
            lambda: all(
                p.metadata.labels[LABEL_GENERATION] == str(moved["status"]["plan"]["generation"])
                for p in stage_pods(cluster, namespace, "moving")
            ),
            what="the old generation's pods to go",
        )
    finally:
        core.patch_node(name=node, body={"spec": {"unschedulable": False}})


@pytest.mark.usefixtures("operator")
def test_a_new_generation_that_cannot_start_leaves_the_old_one_serving_until_it_can(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, models: dict[str, Path]
) -> None:
    core, apps = client.CoreV1Api(cluster), client.AppsV1Api(cluster)
    create(cluster, namespace, deployment("steady", models["70b"], context=8192))
    first = eventually(lambda: planned_and_running(cluster, namespace, "steady"), what="the first plan")
    old = first["status"]["plan"]
    node = old["stages"][0]["node"]
    scheduler = control_plane.process("kube-scheduler")
    scheduler.pause()  # the new generation's pods stay Pending: they can never load
    try:
        core.patch_node(name=node, body={"spec": {"unschedulable": True}})

        def pending() -> dict[str, Any] | None:
            body = read(cluster, namespace, "steady")
            return body if body["status"]["plan"]["generation"] > old["generation"] else None

        body = eventually(pending, what="a re-plan off the cordoned node")
        time.sleep(3 * 5.0)  # several monitor rounds: nothing may cut over to a generation that is not ready
        body = read(cluster, namespace, "steady")
        assert body["status"]["serving"]["generation"] == old["generation"]
        ready = condition(body, "Ready") or {}
        assert f"generation {old['generation']} serves while generation" in ready.get("message", "")
        gateway = apps.read_namespaced_deployment(name="steady-gateway", namespace=namespace)
        env = {e.name: e.value for e in gateway.spec.template.spec.containers[0].env}
        assert env["STRATA_PLAN_GENERATION"] == str(old["generation"])
        old_pods = [
            p
            for p in stage_pods(cluster, namespace, "steady")
            if p.metadata.labels[LABEL_GENERATION] == str(old["generation"])
        ]
        assert old_pods
        assert all(p.status.phase == "Running" for p in old_pods)
    finally:
        scheduler.resume()
        core.patch_node(name=node, body={"spec": {"unschedulable": False}})

    def cut_over() -> dict[str, Any] | None:
        body = read(cluster, namespace, "steady")
        status = body["status"]
        return body if status["serving"]["generation"] == status["plan"]["generation"] > old["generation"] else None

    eventually(cut_over, what="the cutover once the new generation can start")


def _greedy(url: str) -> str:
    body = {"model": "held", "prompt": [1, 17, 200, 3, 45], "max_tokens": 8, "temperature": 0}
    reply = httpx.post(f"{url}/completions", json=body, timeout=60)
    reply.raise_for_status()
    return str(reply.json()["choices"][0]["text"])


@pytest.mark.usefixtures("operator")
def test_requests_are_answered_by_the_old_generation_while_the_new_one_cannot_start(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster)
    tiny = write_test_model(tmp_path / "tiny.gguf", architecture="llama").path
    spec = {"context": 512, "parallel": 2, "servedModelName": "held", "cacheTypeK": "f32", "cacheTypeV": "f32"}
    create(cluster, namespace, deployment("held", tiny, **spec))
    scheduler = control_plane.process("kube-scheduler")
    node = ""
    try:
        with pod_runner(control_plane, core=core, namespace=namespace, folder=tmp_path) as runner:
            url = eventually(
                lambda: gateway_url(core, namespace=namespace, deployment="held"), timeout=180, what=f"{runner.errors}"
            )
            before = _greedy(url)
            first = read(cluster, namespace, "held")["status"]["plan"]
            node = first["stages"][0]["node"]
            scheduler.pause()  # the new generation's pods stay Pending: they can never load
            core.patch_node(name=node, body={"spec": {"unschedulable": True}})

            def replanned() -> dict[str, Any] | None:
                status = read(cluster, namespace, "held")["status"]
                return status if status["plan"]["generation"] > first["generation"] else None

            eventually(replanned, what="a re-plan off the cordoned node")
            answers = []
            for _ in range(4):
                answers.append(_greedy(url))
                time.sleep(1.0)
            status = read(cluster, namespace, "held")["status"]
    finally:
        scheduler.resume()
        if node:
            core.patch_node(name=node, body={"spec": {"unschedulable": False}})
    assert answers == [before] * 4
    assert status["serving"]["generation"] == first["generation"]
    assert status["plan"]["generation"] > first["generation"]


def test_restarting_the_operator_mid_reconcile_leaves_no_duplicates(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, models: dict[str, Path], tmp_path: Path
) -> None:
    process = OperatorProcess(control_plane.kubeconfig, namespace, tmp_path / "operator.log")
    process.start()
    try:
        create(cluster, namespace, deployment("restart", models["70b"], context=8192))
        apps = client.AppsV1Api(cluster)
        eventually(lambda: apps.list_namespaced_stateful_set(namespace=namespace).items, what="a first child")
        process.kill()
        process.start()
        body = eventually(lambda: planned_and_running(cluster, namespace, "restart"), what="convergence")
        sets = apps.list_namespaced_stateful_set(namespace=namespace).items
        assert len(sets) == len(body["status"]["plan"]["stages"])
        assert len({s.metadata.name for s in sets}) == len(sets)
        maps = (
            client.CoreV1Api(cluster)
            .list_namespaced_config_map(namespace=namespace, label_selector=f"{LABEL_INSTANCE}=restart")
            .items
        )
        names = Names("restart", namespace)
        assert sorted(m.metadata.name for m in maps) == sorted([names.plan_configmap, names.pipelines_configmap])
    finally:
        process.stop()


@pytest.mark.usefixtures("operator")
def test_deleting_the_deployment_removes_its_children(
    cluster: client.ApiClient, namespace: str, models: dict[str, Path]
) -> None:
    create(cluster, namespace, deployment("gone", models["70b"], context=8192))
    eventually(lambda: planned_and_running(cluster, namespace, "gone"), what="stage pods Running")
    client.CustomObjectsApi(cluster).delete_namespaced_custom_object(
        group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, name="gone"
    )
    apps, core = client.AppsV1Api(cluster), client.CoreV1Api(cluster)
    selector = f"{LABEL_INSTANCE}=gone"

    def all_gone() -> bool:
        return not (
            apps.list_namespaced_stateful_set(namespace=namespace, label_selector=selector).items
            or apps.list_namespaced_deployment(namespace=namespace, label_selector=selector).items
            or core.list_namespaced_service(namespace=namespace, label_selector=selector).items
            or core.list_namespaced_config_map(namespace=namespace, label_selector=selector).items
            or core.list_namespaced_pod(namespace=namespace, label_selector=selector).items
        )

    eventually(all_gone, what="the garbage collector to remove every child")
