"""Pipelines under streaming traffic on the real control plane, the kwok GPU pool and the pod runner (the real stage
and gateway processes): a scale-down completes every request in flight on a removed pipeline and removes its stages
once the gateway has drained them; a pipeline whose every stage dies fails only its own requests, retryably and at
once, and the survivor takes the next ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
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
from strata_testbed.pod_runner import PodRunner, namespace_runner
from strata_testbed.traffic import Streamed, pipeline_gauges
from strata_testbed.waiting import eventually

pytestmark = pytest.mark.cluster

LANES = 2
# The scale-down's streams run long enough that a poll of the gauges sees every pipeline busy (20 tokens could end
# between two polls on a loaded CI machine, and then no poll saw all three busy), and short enough to end within the
# drain: 200 tokens on three pipelines at once took more than 30 s when the machine's two cores were busy, so these
# run 100 tokens and the drain is three times the default.
MAX_TOKENS = 100
DRAIN_S = 90
# The kill test's requests run until the pipeline dies: 20 tokens on the tiny model could end between two polls of the
# gauges on a loaded machine, and then no poll ever saw both pipelines busy.
KILLED_MAX_TOKENS = 200  # the prompt and these fit a slot: a context of 512 over 2 lanes
POLL_S = 1  # spec.coordination.retryPeriodSeconds: how often the gateway reads the pipelines
ENDS_WITHIN_S = 120.0  # every request ends by then, answered or failed: none hangs


def _spec(replicas: int) -> dict[str, Any]:
    return {
        "context": 512,
        "parallel": LANES,
        "servedModelName": "drain",
        "cacheTypeK": "f32",
        "cacheTypeV": "f32",
        "replicas": replicas,
        "rollout": {"drainSeconds": DRAIN_S},
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


def _serving(core: client.CoreV1Api, namespace: str, runner: PodRunner, replicas: int) -> str:
    """The gateway's base URL once it drives `replicas` ready pipelines."""
    url = eventually(
        lambda: gateway_url(core, namespace=namespace, deployment="drain"), timeout=180, what=f"{runner.errors}"
    )
    eventually(
        lambda: (
            pipeline_gauges(url.removesuffix("/v1"), "strata_gateway_pipeline_ready")
            == dict.fromkeys(range(replicas), 1.0)
        ),
        timeout=180,
        what=f"the gateway driving {replicas} ready pipelines; {runner.errors}",
    )
    return url


def _streams(url: str, count: int, *, max_tokens: int) -> list[Streamed]:
    """`count` streamed greedy completions that never stop early, one per lane when `count` is every lane: routing's
    bounded loads then spread them over every pipeline."""
    no_end = {str(vocabulary(size=SMALL_SHAPES["llama"].vocab_size).eos_token_id): -100}
    return [
        Streamed(
            url,
            {"model": "drain", "prompt": [1, 17, 200, 3, 45 + n], "max_tokens": max_tokens, "logit_bias": no_end},
            timeout_s=ENDS_WITHIN_S,
        ).start()
        for n in range(count)
    ]


def _every_pipeline_busy(url: str, replicas: int) -> dict[int, float]:
    root = url.removesuffix("/v1")

    def busy() -> dict[int, float] | None:
        lanes = pipeline_gauges(root, "strata_gateway_pipeline_lanes_busy")
        return lanes if all(lanes.get(i, 0) >= 1 for i in range(replicas)) else None

    return eventually(busy, timeout=60, what="requests in flight on every pipeline")


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
    create(cluster, namespace, deployment("drain", tiny, **_spec(3)))
    with namespace_runner(control_plane, core=core, namespace=namespace, folder=tmp_path) as runner:
        url = _serving(core, namespace, runner, 3)
        before = read(cluster, namespace, "drain")["status"]
        generations = {p["index"]: p["serving"]["generation"] for p in before["pipelines"]}
        streams = _streams(url, 3 * LANES, max_tokens=MAX_TOKENS)
        busy = _every_pipeline_busy(url, 3)
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

        results = [s.join(ENDS_WITHIN_S) for s in streams]
        for n, result in enumerate(results):
            ended = (result.status, result.error, result.failure, result.done, result.finish_reason)
            assert ended == (200, None, "", True, "length"), f"request {n}: {result}"
            assert result.completion_tokens == MAX_TOKENS, f"request {n}: {result}"
            assert "".join(result.pieces), f"request {n} produced no text"

        bound = retire_after_s(poll_s=POLL_S, drain_s=DRAIN_S)
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


@pytest.mark.usefixtures("operator")
def test_killing_every_stage_of_one_pipeline_fails_only_its_requests_retryably_and_the_other_serves_on(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster)
    tiny = write_test_model(tmp_path / "tiny.gguf", architecture="llama").path
    create(cluster, namespace, deployment("drain", tiny, **_spec(2)))
    with namespace_runner(control_plane, core=core, namespace=namespace, folder=tmp_path) as runner:
        url = _serving(core, namespace, runner, 2)
        streams = _streams(url, 2 * LANES, max_tokens=KILLED_MAX_TOKENS)
        _every_pipeline_busy(url, 2)
        lost = [p for p in stage_pods(cluster, namespace, "drain") if p.metadata.labels[LABEL_PIPELINE] == "1"]
        assert lost, "pipeline 1 has stage pods"
        for pod in lost:  # every stage of pipeline 1, killed at once: a crash, not a shutdown
            runner.processes()[f"{namespace}/{pod.metadata.name}"].stop(grace=0)

        results = [s.join(ENDS_WITHIN_S) for s in streams]
        answered = [r for r in results if r.error is None and not r.failure]
        failed = [r for r in results if r.error is not None]
        assert len(answered) == LANES, f"the surviving pipeline's requests complete: {results}"
        assert len(failed) == LANES, f"exactly the lost pipeline's requests fail: {results}"
        for result in answered:
            assert (result.status, result.done, result.completion_tokens) == (200, True, KILLED_MAX_TOKENS), result
        for result in failed:
            assert result.error is not None
            assert result.error["error"]["code"] == "service_unavailable", f"a retryable error: {result}"
            assert result.done, f"the stream ends after its error: {result}"

        root = url.removesuffix("/v1")
        tokens = pipeline_gauges(root, "strata_gateway_pipeline_tokens_generated_total")
        after = [
            httpx.post(f"{url}/completions", json={"model": "drain", "prompt": [1, 5, n], "max_tokens": 3}, timeout=30)
            for n in range(4)
        ]
        assert [r.status_code for r in after] == [200] * 4, [r.text for r in after]
        grown = pipeline_gauges(root, "strata_gateway_pipeline_tokens_generated_total")
        assert grown[0] > tokens[0], f"the next requests went to the survivor: {tokens} -> {grown}"
        assert grown.get(1, 0.0) <= tokens.get(1, 0.0), f"none went to the lost pipeline: {tokens} -> {grown}"
