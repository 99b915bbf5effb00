"""Several pipelines of one model: each on its own GPUs, planned on what the earlier ones left."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from strata.operator.planner import PlanOptions, build_inventory
from strata.operator.planner.errors import OverrideDoesNotFitError
from strata.operator.planner.pipelines import PipelinePlan, plan_pipelines
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import Q8_0, llama3_8b, llama3_70b

A100 = 80
A10G = 24


def _pipelines(nodes: list[dict[str, Any]], replicas: int, **options: Any) -> tuple[PipelinePlan, ...]:
    inventory = build_inventory(nodes=nodes)
    return plan_pipelines(
        model=llama3_70b(weight_type=Q8_0), inventory=inventory, options=PlanOptions(**options), replicas=replicas
    )


def _gpus(pipeline: PipelinePlan) -> Counter[str]:
    assert pipeline.plan is not None
    return Counter(s.node for s in pipeline.plan.stages for _ in s.gpus)


@pytest.mark.parametrize(
    ("nodes", "replicas", "placed"),
    [
        pytest.param([gpu_node("a", gpus=8, gib=A10G)], 2, 2, id="two four-stage pipelines share an eight-GPU node"),
        pytest.param([gpu_node("a", gpus=6, gib=A10G)], 2, 1, id="six A10Gs hold one pipeline; the second is short"),
        pytest.param([gpu_node("a", gpus=6, gib=A10G)], 3, 1, id="every pipeline after the first short one is short"),
        pytest.param([gpu_node("a", gpus=8, gib=A10G)], 0, 0, id="zero replicas plan nothing"),
    ],
)
def test_each_pipeline_takes_gpus_no_earlier_pipeline_took(
    nodes: list[dict[str, Any]], replicas: int, placed: int
) -> None:
    pipelines = _pipelines(nodes, replicas, context_length=8192)
    assert [p.index for p in pipelines] == list(range(replicas))
    assert sum(p.plan is not None for p in pipelines) == placed
    taken = sum((_gpus(p) for p in pipelines if p.plan is not None), Counter())
    capacity = {n["metadata"]["name"]: int(n["status"]["allocatable"]["nvidia.com/gpu"]) for n in nodes}
    assert all(taken[node] <= capacity[node] for node in taken)
    for short in pipelines[placed:]:
        assert short.plan is None
        assert short.short
        assert "short by" in short.short


def test_a_later_pipeline_may_split_differently_on_smaller_gpus() -> None:
    nodes = [gpu_node("big", gpus=1, gib=A100), gpu_node("small", gpus=8, gib=A10G)]
    first, second = _pipelines(nodes, 2, context_length=8192)
    assert first.plan is not None
    assert second.plan is not None
    assert {s.node for s in first.plan.stages} == {"big"}
    assert {s.node for s in second.plan.stages} == {"small"}
    assert len(second.plan.stages) > len(first.plan.stages)


def test_adding_a_replica_leaves_the_placement_of_the_earlier_ones_as_it_was() -> None:
    nodes = [gpu_node("a", gpus=4, gib=A100), gpu_node("b", gpus=4, gib=A100)]
    two = _pipelines(nodes, 2, context_length=8192)
    three = _pipelines(nodes, 3, context_length=8192)
    assert three[:2] == two


def test_an_override_the_whole_pool_cannot_honour_is_refused_but_a_later_pipeline_is_only_short() -> None:
    nodes = [gpu_node("big", gpus=1, gib=A100), gpu_node("small", gpus=1, gib=12)]
    model = llama3_8b(weight_type=Q8_0)
    inventory = build_inventory(nodes=nodes)
    with pytest.raises(OverrideDoesNotFitError):
        plan_pipelines(model=model, inventory=inventory, options=PlanOptions(context_length=1 << 24), replicas=2)
    fits_big_only = PlanOptions(context_length=65536)
    first, second = plan_pipelines(model=model, inventory=inventory, options=fits_big_only, replicas=2)
    assert first.plan is not None
    assert first.plan.stages[0].node == "big"
    assert second.plan is None
    assert second.short
    assert second.short.startswith("on the GPUs left to it: context 65536")


def test_negative_replicas_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas must be zero or more, not -1"):
        _pipelines([gpu_node("a", gpus=1, gib=A100)], -1)
