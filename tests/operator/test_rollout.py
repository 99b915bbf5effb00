"""The rollout bound: how many serving pipelines a re-plan replaces at once, and what `place` does with it (pure)."""

from __future__ import annotations

import pytest
from strata.gguf.model import CacheType
from strata.operator.planner import PipelinePlan
from strata.operator.replicas import place, rollout_waits
from strata.operator.rollout import PipelineState, admitted, replacement_budget
from strata.operator.status import PipelineStatus, PlanSummary, StageSummary
from strata.plan import Backend, Plan, Stage


def _state(index: int, *, serves: bool = True, replacing: bool = False, wants_new: bool = True) -> PipelineState:
    return PipelineState(index=index, serves=serves, replacing=replacing, wants_new=wants_new)


@pytest.mark.parametrize(
    ("replicas", "max_unavailable", "budget"),
    [
        pytest.param(1, 1, 1, id="one pipeline is replaced beside itself, its old generation serving meanwhile"),
        pytest.param(2, 1, 1, id="two pipelines are replaced one at a time"),
        pytest.param(2, 5, 1, id="a bound above replicas still leaves one pipeline untouched"),
        pytest.param(4, 2, 2, id="four pipelines two at a time"),
    ],
)
def test_the_budget_never_reaches_every_pipeline_of_two_or_more(
    replicas: int, max_unavailable: int, budget: int
) -> None:
    assert replacement_budget(replicas=replicas, max_unavailable=max_unavailable) == budget


@pytest.mark.parametrize(
    ("states", "budget", "allowed"),
    [
        pytest.param([_state(0), _state(1)], 1, {0}, id="a spec change starts with pipeline 0 alone"),
        pytest.param(
            [_state(0, replacing=True, wants_new=False), _state(1)], 1, set(), id="pipeline 1 waits for pipeline 0"
        ),
        pytest.param([_state(0, wants_new=False), _state(1)], 1, {1}, id="once pipeline 0 moved over, pipeline 1 goes"),
        pytest.param(
            [_state(0, replacing=True), _state(1)],
            1,
            {0},
            id="a pipeline being replaced may take a newer placement; the next still waits",
        ),
        pytest.param(
            [_state(0, replacing=True, wants_new=False), _state(1, serves=False)],
            1,
            {1},
            id="a pipeline that serves nothing is replaced at once",
        ),
        pytest.param([_state(0), _state(1), _state(2)], 2, {0, 1}, id="a budget of two starts two"),
        pytest.param([_state(0, wants_new=False), _state(1, wants_new=False)], 1, set(), id="nothing changes"),
    ],
)
def test_serving_pipelines_start_a_new_generation_within_the_budget(
    states: list[PipelineState], budget: int, allowed: set[int]
) -> None:
    assert admitted(states, budget=budget) == allowed


def _plan(node: str, generation: int = 1, context: int = 8192, spec_generation: int = 1) -> PlanSummary:
    stage = StageSummary(index=0, node=node, gpus=1, backend="cuda", layerStart=0, layerEnd=32)
    return PlanSummary(
        generation=generation,
        specGeneration=spec_generation,
        stages=[stage],
        contextLength=context,
        parallel=4,
        cacheTypeK="q8_0",
        cacheTypeV="q8_0",
    )


def _placed(node: str, index: int, context: int = 8192) -> PipelinePlan:
    summary = _plan(node, context=context)
    stage = Stage(
        index=0,
        node=node,
        resource="nvidia.com/gpu",
        gpus=(0,),
        backend=Backend.CUDA,
        layer_start=0,
        layer_end=32,
        embeddings=True,
        output_head=True,
        memory_bytes=1,
        usable_bytes=1,
        weight_bytes=0,
        buffer_bytes=0,
        kv_bytes=0,
    )
    plan = Plan(
        stages=(stage,),
        context_length=summary.context_length,
        parallel=4,
        cache_type_k=CacheType.Q8_0,
        cache_type_v=CacheType.Q8_0,
        kv_bytes_per_token=1,
    )
    return PipelinePlan(index=index, plan=plan)


SERVING = {
    0: PipelineStatus(index=0, plan=_plan("a", 1), serving=_plan("a", 1), ready=True),
    1: PipelineStatus(index=1, plan=_plan("b", 2), serving=_plan("b", 2), ready=True),
}


@pytest.mark.parametrize(
    ("pipelines", "plans", "serving", "rendered", "reasons"),
    [
        pytest.param(
            [_placed("a", 0), _placed("b", 1)], [1, 2], [1, 2], [1, 2], [], id="the same placement keeps its generation"
        ),
        pytest.param(
            [_placed("a", 0), _placed("b", 1), _placed("c", 2)],
            [1, 2, 3],
            [1, 2, 3],
            [1, 2, 3],
            ["Planned"],
            id="scaling up adds a generation and leaves the serving ones alone",
        ),
        pytest.param(
            [_placed("a", 0, context=4096), _placed("b", 1, context=4096)],
            [3, 2],
            [1, 2],
            [3],
            ["Replanned"],
            id="a spec change loads pipeline 0's new generation beside its old one; pipeline 1 waits, not rendered",
        ),
        pytest.param(
            [_placed("a", 0), PipelinePlan(index=1, plan=None, short="requires 9 GB, short by 1 GB")],
            [1, 2],
            [1, 2],
            [1],
            ["CapacityShortfall"],
            id="a pipeline the pool no longer holds keeps what it serves and says why",
        ),
    ],
)
def test_place_moves_pipelines_by_the_rollout_bound(
    pipelines: list[PipelinePlan], plans: list[int], serving: list[int], rendered: list[int], reasons: list[str]
) -> None:
    placement = place(
        SERVING, pipelines, replicas=len(pipelines), max_unavailable=1, spec_generation=2, ready={1: True, 2: True}
    )
    assert [p.plan.generation for p in placement.pipelines if p.plan] == plans
    assert [p.serving.generation for p in placement.pipelines if p.serving] == serving
    assert [r.generation for r in placement.rendered] == rendered
    assert [reason for _type, reason, _message in placement.events] == reasons


@pytest.mark.parametrize(
    ("pipelines", "waits"),
    [
        pytest.param(list(SERVING.values()), True, id="every pipeline on an older spec and none replaced: one goes"),
        pytest.param(
            [PipelineStatus(index=0, plan=_plan("a", 3), serving=_plan("a", 1)), SERVING[1]],
            False,
            id="while pipeline 0 is replaced the next waits",
        ),
        pytest.param(
            [
                PipelineStatus(index=i, plan=_plan(n, i + 1, spec_generation=5), serving=_plan(n, i + 1))
                for i, n in enumerate("ab")
            ],
            False,
            id="every pipeline on the current spec: nothing to roll",
        ),
    ],
)
def test_the_monitor_reconciles_when_a_pipeline_waits_for_its_turn(
    pipelines: list[PipelineStatus], waits: bool
) -> None:
    assert rollout_waits(pipelines, spec_generation=5) is waits
