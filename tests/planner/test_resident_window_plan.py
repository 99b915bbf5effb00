"""spec.kvCache.residentWindow: the plan counts the keys' bounds a resident window keeps and says it decodes over
one, the stage pods are told its shape, and a window that leaves nothing to choose is refused naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from strata.kv_layout import BLOCK_TOKENS, ResidentBudget
from strata.operator.children import Owner, stage_statefulset
from strata.operator.plan_command import to_table
from strata.operator.planner import PlanOptions, plan_placement
from strata.operator.planner.errors import InvalidOptionError
from strata.operator.planning import options_for
from strata.operator.replicas import describe, summarize
from strata.operator.spec import ModelDeploymentSpec
from strata.plan import Plan
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import Q8_0, gemma3_like, llama3_70b

NODES = [gpu_node("h100", gpus=8, gib=80, resource="nvidia.com/gpu")]
OWNER = Owner(name="llama", namespace="team-a", uid="0f0e0d0c-0000-4000-8000-000000000001")
CONTEXT = 32768


def spec(**fields: Any) -> ModelDeploymentSpec:
    return ModelDeploymentSpec.from_manifest({"model": {"url": "https://models.example/m.gguf"}, **fields})


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(llama3_70b(weight_type=Q8_0), id="llama 3 70B, every layer full attention"),
        pytest.param(gemma3_like(layers=48), id="a gemma 3, one full-attention layer in six"),
    ],
)
def test_the_plan_counts_the_bounds_of_every_full_attention_block(model: Any) -> None:
    def plan(window: ResidentBudget | None) -> Plan:
        options = PlanOptions(context_length=CONTEXT, parallel=2, resident_window=window)
        return plan_placement(model=model, nodes=NODES, options=options)

    without, resident = plan(None), plan(ResidentBudget(tokens=4096))
    assert [(s.layer_start, s.layer_end) for s in resident.stages] == [
        (s.layer_start, s.layer_end) for s in without.stages
    ]
    blocks = CONTEXT // BLOCK_TOKENS + 1  # the context in whole blocks, and a partial one for the second slot
    for before, after in zip(without.stages, resident.stages, strict=True):
        full = [il for il in range(after.layer_start, after.layer_end) if not model.is_sliding(il)]
        bounds = sum(blocks * 2 * model.head_count_kv[il] * model.key_length * 2 for il in full)
        assert after.kv_bytes - before.kv_bytes == bounds
        assert bounds < 0.04 * before.kv_bytes, "the bounds are a few percent of a q8_0 cache"
    assert resident.resident_window == ResidentBudget(tokens=4096)
    assert "resident window of 4096 tokens" in to_table(resident)
    assert "resident window of 4096 tokens" in describe(summarize(resident, generation=1))


@pytest.mark.parametrize(
    ("window", "env"),
    [
        pytest.param(None, {}, id="unset: the pod is rendered as before"),
        pytest.param(
            {"tokens": 8192},
            {
                "STRATA_RESIDENT_TOKENS": "8192",
                "STRATA_RESIDENT_SINK_TOKENS": "64",
                "STRATA_RESIDENT_RECENT_TOKENS": "1024",
            },
            id="tokens alone, the default sinks and recent positions",
        ),
        pytest.param(
            {"tokens": 4096, "sinkTokens": 128, "recentTokens": 2048},
            {
                "STRATA_RESIDENT_TOKENS": "4096",
                "STRATA_RESIDENT_SINK_TOKENS": "128",
                "STRATA_RESIDENT_RECENT_TOKENS": "2048",
            },
            id="every field",
        ),
    ],
)
def test_the_stage_pods_are_told_the_window(window: dict[str, int] | None, env: dict[str, str]) -> None:
    deployment = spec(kvCache={} if window is None else {"residentWindow": window})
    options = options_for(deployment)
    planned = plan_placement(model=llama3_70b(weight_type=Q8_0), nodes=NODES, options=options)
    for stage in planned.stages:
        workload = stage_statefulset(OWNER, deployment, planned, stage, generation=1, image="strata:test")
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        told = {e["name"]: e.get("value") for e in container["env"] if e["name"].startswith("STRATA_RESIDENT_")}
        assert told == env


@pytest.mark.parametrize(
    ("window", "named"),
    [
        pytest.param({"tokens": 1088}, "leaves no block to choose", id="sinks and recent positions take it all"),
        pytest.param({"tokens": 100}, "tokens", id="fewer tokens than the field allows"),
        pytest.param({"tokens": 4096, "recentTokens": 10}, "recentTokens", id="recent positions under a block"),
        pytest.param({"tokens": 4096, "lookahead": 2}, "lookahead", id="a field the window does not have"),
    ],
)
def test_the_spec_refuses_a_window_it_cannot_honour(window: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        spec(kvCache={"residentWindow": window})


def test_a_plan_option_that_leaves_nothing_to_choose_is_refused() -> None:
    with pytest.raises(InvalidOptionError, match="leaves no block to choose"):
        PlanOptions(resident_window=ResidentBudget(tokens=1024))
