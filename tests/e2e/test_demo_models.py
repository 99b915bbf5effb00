"""What `make demo` may serve (DEMO_MODEL): each model's manifest plans on the test bed's pool as the demo says, and a
name that is not one of them is refused by name before anything starts.

The full runs are tests/e2e/test_demo.py (the default model) and tests/e2e/test_gemma3_270m_cluster.py (the Gemma
deployment, over two stages); these checks are the planner's and the command line's, without a cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from strata.gguf import inspect_model
from strata.operator.planning import plan_deployment
from strata.operator.spec import ModelDeploymentSpec
from strata_testbed.demo import main
from strata_testbed.demo_models import DEMO_MODELS, Endpoint, demo_manifest
from strata_testbed.gpu_pool import pool_nodes


@pytest.mark.parametrize(
    ("name", "deployment", "layers", "context", "endpoint"),
    [
        pytest.param(
            "generated", "tiny", 4, 4096, Endpoint.CHAT, id="the generated model is the tiny example, asked to chat"
        ),
        pytest.param(
            "gemma3-270m",
            "gemma3-270m",
            18,
            4096,
            Endpoint.COMPLETIONS,
            id="Gemma 3 270M is its example at a CPU's context, asked to go on from a prompt (it has no chat template)",
        ),
    ],
)
def test_each_demo_model_plans_on_one_gpu_of_the_pool_with_an_f32_cache(
    tmp_path: Path, name: str, deployment: str, layers: int, context: int, endpoint: Endpoint
) -> None:
    model = DEMO_MODELS[name]
    manifest = demo_manifest(model, url="http://127.0.0.1:8080/model.gguf")
    spec = ModelDeploymentSpec.from_manifest(manifest["spec"])
    plan = plan_deployment(model=inspect_model(str(model.file(tmp_path))), nodes=pool_nodes(), pods=[], spec=spec)

    assert manifest["metadata"]["name"] == deployment
    assert spec.model.url == "http://127.0.0.1:8080/model.gguf"
    assert plan.shortfall is None
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, layers)]
    assert (plan.context_length, str(plan.cache_type_k), str(plan.cache_type_v)) == (context, "f32", "f32")
    assert model.endpoint is endpoint


def test_an_unknown_demo_model_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--model", "llama-9000"])

    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "invalid choice: 'llama-9000'" in error
    assert all(name in error for name in DEMO_MODELS)
