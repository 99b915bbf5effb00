"""The prefix cache's share of each stage: subtracted before the KV budget, reported per stage, passed to the stage
pod, and a share of zero gives back exactly the plan the planner made without a prefix cache."""

from __future__ import annotations

from typing import Any

import pytest
from strata.operator.children import Owner, stage_statefulset
from strata.operator.plan_command import to_table
from strata.operator.planner import PlanOptions, plan_placement
from strata.operator.planner.errors import InvalidOptionError
from strata.operator.planner.memory import DEFAULT_PREFIX_CACHE_FRACTION, kv_budget_bytes
from strata.operator.spec import ModelDeploymentSpec
from strata.plan import Plan
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import Q8_0, llama3_70b

SEVENTY_B = llama3_70b(weight_type=Q8_0)
# Four 24 GiB GPUs hold a Q8_0 70B (75.0 GB, kept in its blocks) short of its native context, so the KV budget, and
# with it the prefix cache's share, decides the context. Without a prefix cache the middle stages (21 layers) have
# 3.83 GB free, 85% of which holds 71,284 cells of 45,696 B, less three slots' partial blocks (192): 70912 once
# snapped; the default 5% share leaves 67328.
FOUR_A10G = [gpu_node("a10g", gpus=4, gib=24, resource="nvidia.com/gpu")]
CONTEXT_WITHOUT_PREFIX_CACHE = 70912
CONTEXT_WITH_THE_DEFAULT_SHARE = 67328


def plan(**options: Any) -> Plan:
    return plan_placement(model=SEVENTY_B, nodes=FOUR_A10G, options=PlanOptions(**options))


@pytest.mark.parametrize(
    ("fraction", "budget"),
    [
        pytest.param(0.0, 51, id="without a prefix cache the KV budget is 85 percent of what is left"),
        pytest.param(0.05, 48, id="the prefix cache takes its five percent first, the KV cache 85 percent of the rest"),
        pytest.param(0.5, 25, id="a larger share leaves less KV"),
    ],
)
def test_the_prefix_cache_share_comes_off_before_the_kv_budget(fraction: float, budget: int) -> None:
    assert kv_budget_bytes(usable=100, weights=30, buffers=10, prefix_cache_fraction=fraction) == budget


def test_a_share_of_zero_restores_the_plan_without_a_prefix_cache() -> None:
    without = plan(prefix_cache_fraction=0.0)
    assert without.context_length == CONTEXT_WITHOUT_PREFIX_CACHE
    assert {s.prefix_cache_bytes for s in without.stages} == {0}


def test_every_stage_reports_its_share_and_the_context_pays_for_it() -> None:
    default = plan()
    assert PlanOptions().prefix_cache_fraction == DEFAULT_PREFIX_CACHE_FRACTION == 0.05
    assert default.context_length == CONTEXT_WITH_THE_DEFAULT_SHARE < CONTEXT_WITHOUT_PREFIX_CACHE
    for stage in default.stages:
        free = stage.usable_bytes - stage.weight_bytes - stage.buffer_bytes
        assert stage.prefix_cache_bytes == int(free * DEFAULT_PREFIX_CACHE_FRACTION) > 0
        assert stage.spare_bytes >= 0
        assert stage.kv_bytes * 100 <= (free - stage.prefix_cache_bytes) * 85
    assert "PREFIX GB" in to_table(default)


def test_the_stage_pod_is_told_its_prefix_cache_budget() -> None:
    default = plan()
    spec = ModelDeploymentSpec.from_manifest({"model": {"url": "https://models.example/m.gguf"}})
    owner = Owner(name="llama", namespace="team-a", uid="0f0e0d0c-0000-4000-8000-000000000001")
    for stage in default.stages:
        workload = stage_statefulset(owner, spec, default, stage, generation=1, image="strata:test")
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["STRATA_PREFIX_CACHE_BYTES"] == str(stage.prefix_cache_bytes)


@pytest.mark.parametrize(
    "fraction",
    [pytest.param(-0.1, id="a negative share is refused"), pytest.param(1.0, id="the whole memory is refused")],
)
def test_a_share_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(InvalidOptionError, match="prefix cache share"):
        PlanOptions(prefix_cache_fraction=fraction)
