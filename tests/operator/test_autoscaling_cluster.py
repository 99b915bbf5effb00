"""spec.autoscaling on the real control plane, the kwok GPU pool and the pod runner (the real stage and gateway
processes): an idle deployment scales to zero pipelines, and the next request brings one back and gets its answer,
or a 503 with Retry-After and the load progress when the cold-start bound passes first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client
from strata.gguf.testmodels.writer import write_test_model
from strata_testbed.controlplane import ControlPlane
from strata_testbed.demo import gateway_url
from strata_testbed.operator_run import create, deployment, read, stage_pods
from strata_testbed.pod_runner import namespace_runner
from strata_testbed.waiting import eventually

pytestmark = pytest.mark.cluster

PROMPT = {"prompt": [1, 17, 200, 3, 45], "max_tokens": 8, "temperature": 0}


def _spec(*, cold_start_s: float) -> dict[str, Any]:
    return {
        "context": 512,
        "parallel": 2,
        "servedModelName": "cold",
        "cacheTypeK": "f32",
        "cacheTypeV": "f32",
        "autoscaling": {
            "minReplicas": 0,
            "maxReplicas": 1,
            "scaleDownDelaySeconds": 3,
            "coldStartWaitSeconds": cold_start_s,
        },
    }


def _at_zero(cluster: client.ApiClient, namespace: str, url: str) -> dict[str, Any] | None:
    """The status once no stage pod is left and the gateway has let go of the last pipeline (it then holds
    requests for a cold start instead of serving them)."""
    status = read(cluster, namespace, "cold").get("status") or {}
    if status.get("phase") != "ScaledToZero" or stage_pods(cluster, namespace, "cold"):
        return None
    ready = httpx.get(f"{url.removesuffix('/v1')}/readyz", timeout=5)
    if ready.status_code != 200 or ready.json()["status"] != "holding requests for a cold start":
        return None
    return status


def _scaled(core: client.CoreV1Api, namespace: str) -> list[str]:
    return [e.message for e in core.list_namespaced_event(namespace=namespace).items if e.reason == "Scaled"]


@pytest.mark.usefixtures("operator")
def test_an_idle_deployment_scales_to_zero_and_the_next_request_is_answered_once_a_pipeline_loads(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster)
    tiny = write_test_model(tmp_path / "tiny.gguf", architecture="llama").path
    create(cluster, namespace, deployment("cold", tiny, **_spec(cold_start_s=120)))
    with namespace_runner(control_plane, core=core, namespace=namespace, folder=tmp_path) as runner:
        url = eventually(
            lambda: gateway_url(core, namespace=namespace, deployment="cold"), timeout=180, what=f"{runner.errors}"
        )
        first = httpx.post(f"{url}/completions", json={"model": "cold", **PROMPT}, timeout=60)
        assert first.status_code == 200, first.text

        status = eventually(
            lambda: _at_zero(cluster, namespace, url), timeout=120, what="no stage pod after the idle delay"
        )
        assert status["replicas"] == 0
        assert status["autoscaling"]["reason"] in {"Idle", "ScaledToZero"}
        assert read(cluster, namespace, "cold")["spec"]["replicas"] == 0
        assert gateway_url(core, namespace=namespace, deployment="cold") == url, "the gateway stays up at zero"

        again = httpx.post(f"{url}/completions", json={"model": "cold", **PROMPT}, timeout=150)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    scaled = _scaled(core, namespace)
    assert any(m.startswith("1 -> 0 pipeline(s)") for m in scaled), scaled
    assert any(m.startswith("0 -> 1 pipeline(s)") and "wait at the gateway" in m for m in scaled), scaled


@pytest.mark.usefixtures("operator")
def test_a_request_at_zero_that_outwaits_the_cold_start_bound_is_a_503_with_retry_after_and_progress(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster)
    tiny = write_test_model(tmp_path / "tiny.gguf", architecture="llama").path
    create(cluster, namespace, deployment("cold", tiny, **_spec(cold_start_s=1)))
    scheduler = control_plane.process("kube-scheduler")
    with namespace_runner(control_plane, core=core, namespace=namespace, folder=tmp_path) as runner:
        url = eventually(
            lambda: gateway_url(core, namespace=namespace, deployment="cold"), timeout=180, what=f"{runner.errors}"
        )
        eventually(lambda: _at_zero(cluster, namespace, url), timeout=120, what="no stage pod after the idle delay")
        scheduler.pause()  # the stage pod of the cold start stays Pending: no pipeline can come within the bound
        try:
            reply = httpx.post(f"{url}/completions", json={"model": "cold", **PROMPT}, timeout=30)
        finally:
            scheduler.resume()
        assert reply.status_code == 503, reply.text
        assert reply.headers["Retry-After"] == "1"
        body = reply.json()
        assert body["error"]["code"] == "cold_start"
        assert set(body["progress"]) == {
            "phase",
            "replicas",
            "readyReplicas",
            "bytesLoaded",
            "bytesTotal",
            "autoscaling",
        }
    eventually(
        lambda: any(m.startswith("0 -> 1 pipeline(s)") for m in _scaled(core, namespace)) or None,
        what="a Scaled Event from 0 to 1: the held request was heard",
    )
