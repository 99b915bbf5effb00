"""A scale-down under traffic on the real control plane, the kwok GPU pool and the pod runner (the real stage and
gateway processes): every request in flight on a removed pipeline completes, and the removed pipelines' stages go
once the gateway has drained them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from strata.draining import retire_after_s
from strata.gguf.testmodels.shapes import SMALL_SHAPES
from strata.gguf.testmodels.vocabulary import vocabulary
from strata.gguf.testmodels.writer import write_test_model
from strata.operator.names import LABEL_GENERATION, LABEL_PIPELINE
from strata.operator.spec import GROUP, PLURAL, VERSION
from strata_testbed.controlplane import ControlPlane
from strata_testbed.demo import gateway_url
from strata_testbed.operator_run import create, deployment, read, stage_pods
from strata_testbed.pod_runner import PodRunner
from strata_testbed.traffic import Streamed, pipeline_gauges
from strata_testbed.waiting import eventually

pytestmark = pytest.mark.cluster

REPLICAS = 3
LANES = 2
MAX_TOKENS = 20  # long enough to be running when the pipelines leave, short enough to end within the drain
POLL_S = 1  # spec.coordination.retryPeriodSeconds: how often the gateway reads the pipelines


def _spec() -> dict[str, Any]:
    return {
        "context": 512,
        "parallel": LANES,
        "servedModelName": "drain",
        "cacheTypeK": "f32",
        "cacheTypeV": "f32",
        "replicas": REPLICAS,
        "coordination": {"leaseDurationSeconds": 6, "renewDeadlineSeconds": 4, "retryPeriodSeconds": POLL_S},
    }


def _scale(cluster: client.ApiClient, namespace: str, replicas: int) -> None:
    client.CustomObjectsApi(cluster).patch_namespaced_custom_object_scale(
        group=GROUP,
        version=VERSION,
        namespace=namespace,
        plural=PLURAL,
        name="drain",
        body={"spec": {"replicas": replicas}},
    )


def _pipelines_of_pods(cluster: client.ApiClient, namespace: str) -> dict[str, set[str]]:
    """pipeline -> generations of the stage pods that exist."""
    found: dict[str, set[str]] = {}
    for pod in stage_pods(cluster, namespace, "drain"):
        found.setdefault(pod.metadata.labels[LABEL_PIPELINE], set()).add(pod.metadata.labels[LABEL_GENERATION])
    return found


@pytest.mark.usefixtures("operator")
def test_scaling_from_three_pipelines_to_one_completes_every_request_in_flight_and_then_removes_the_two(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster)
    tiny = write_test_model(tmp_path / "tiny.gguf", architecture="llama").path
    no_end = {str(vocabulary(size=SMALL_SHAPES["llama"].vocab_size).eos_token_id): -100}
    create(cluster, namespace, deployment("drain", tiny, **_spec()))
    runner = PodRunner(
        core=core,
        namespaces=[namespace],
        log_dir=tmp_path / "pods",
        api_server=control_plane.server,
        ca=control_plane.pki.ca.cert,
    )
    with runner:
        url = eventually(
            lambda: gateway_url(core, namespace=namespace, deployment="drain"), timeout=180, what=f"{runner.errors}"
        )
        root = url.removesuffix("/v1")
        eventually(
            lambda: pipeline_gauges(root, "strata_gateway_pipeline_ready") == dict.fromkeys(range(REPLICAS), 1.0),
            timeout=180,
            what=f"the gateway driving {REPLICAS} ready pipelines; {runner.errors}",
        )
        before = read(cluster, namespace, "drain")["status"]
        generations = {p["index"]: p["serving"]["generation"] for p in before["pipelines"]}

        # One request per lane of every pipeline: bounded loads spread them over all three.
        streams = [
            Streamed(
                url,
                {"model": "drain", "prompt": [1, 17, 200, 3, 45 + n], "max_tokens": MAX_TOKENS, "logit_bias": no_end},
                timeout_s=120,
            ).start()
            for n in range(REPLICAS * LANES)
        ]
        busy = eventually(
            lambda: (
                (b := pipeline_gauges(root, "strata_gateway_pipeline_lanes_busy"))
                and all(b.get(i, 0) >= 1 for i in range(REPLICAS))
                and b
            ),
            timeout=60,
            what="requests in flight on every pipeline",
        )
        _scale(cluster, namespace, 1)

        def retiring() -> dict[str, Any] | None:
            status = read(cluster, namespace, "drain").get("status") or {}
            return status if len(status.get("pipelines") or ()) == 1 and status.get("retiring") else None

        status = eventually(retiring, timeout=30, what="pipelines 1 and 2 leaving the plan and retiring")
        still_running = sum(s.running for s in streams)
        assert {r["generation"] for r in status["retiring"]} == {generations[1], generations[2]}
        assert {r["pipeline"] for r in status["retiring"]} == {1, 2}
        pods = _pipelines_of_pods(cluster, namespace)
        assert pods.get("1") == {str(generations[1])}, f"the removed pipelines' stages stay while they drain: {pods}"
        assert pods.get("2") == {str(generations[2])}, f"the removed pipelines' stages stay while they drain: {pods}"

        results = [s.join(120) for s in streams]
        for n, result in enumerate(results):
            ended = (result.status, result.error, result.failure, result.done, result.finish_reason)
            assert ended == (200, None, "", True, "length"), f"request {n}: {result}"
            assert result.completion_tokens == MAX_TOKENS, f"request {n}: {result}"
            assert "".join(result.pieces), f"request {n} produced no text"

        bound = retire_after_s(poll_s=POLL_S)
        gone = eventually(
            lambda: (p := _pipelines_of_pods(cluster, namespace)) == {"0": {str(generations[0])}} and p,
            timeout=bound + 60,
            what="only pipeline 0's stage pods left once the drain bound passed",
        )
        assert gone == {"0": {str(generations[0])}}
        final = eventually(
            lambda: (s := read(cluster, namespace, "drain").get("status") or {}) and not s.get("retiring") and s,
            timeout=30,
            what="status.retiring empty once the stages went",
        )
        assert final["readyReplicas"] == 1
    print(f"lanes busy when scaled: {busy}; streams running when the pipelines retired: {still_running}")
    assert still_running > 0, "no request was still in flight when the pipelines left: the test proved nothing"
