"""Properties every plan holds, over random pools and models (hypothesis)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from strata.fit import KV_BUDGET_PERCENT
from strata.gguf.model import ModelInfo
from strata.operator.planner import PlanOptions, plan_placement
from strata.operator.planner.errors import OverrideDoesNotFitError
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import F16, Q4_0, Q8_0, dense_model, gemma3_like

RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "gpu.intel.com/xe")
gpu_groups = st.lists(
    st.tuples(st.integers(1, 8), st.sampled_from((4, 6, 8, 12, 16, 24, 48)), st.sampled_from(RESOURCES)),
    min_size=1,
    max_size=6,
)
models = st.one_of(
    st.builds(
        dense_model,
        layers=st.integers(2, 96),
        embd=st.sampled_from((2048, 4096, 8192)),
        kv_heads=st.sampled_from((1, 4, 8)),
        ffn=st.sampled_from((8192, 14336, 28672)),
        context=st.sampled_from((4096, 32768, 131072)),
        weight_type=st.sampled_from((Q4_0, Q8_0, F16)),
        tied=st.booleans(),
    ),
    st.builds(gemma3_like, layers=st.integers(6, 62), window=st.sampled_from((512, 1024, 4096))),
)
PROPERTY_SETTINGS = settings(max_examples=100, deadline=None)


def _nodes(groups: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
    return [gpu_node(f"node-{i}", gpus=n, gib=gib, resource=res) for i, (n, gib, res) in enumerate(groups)]


@PROPERTY_SETTINGS
@given(model=models, groups=gpu_groups, parallel=st.integers(1, 16))
def test_every_plan_covers_each_layer_once_and_fits_every_stage(
    model: ModelInfo, groups: list[tuple[int, int, str]], parallel: int
) -> None:
    plan = plan_placement(model=model, nodes=_nodes(groups), options=PlanOptions(parallel=parallel))
    if not plan.feasible:
        assert plan.shortfall is not None
        assert plan.shortfall.short_by_bytes > 0
        return
    covered = [layer for stage in plan.stages for layer in range(stage.layer_start, stage.layer_end)]
    assert covered == list(range(model.block_count))
    assert plan.context_length <= model.context_length
    for stage in plan.stages:
        kv = model.kv_bytes(
            n_ctx=plan.context_length,
            type_k=plan.cache_type_k,
            type_v=plan.cache_type_v,
            layers=range(stage.layer_start, stage.layer_end),
            n_seq=parallel,
        )
        assert stage.kv_bytes == kv
        free = stage.usable_bytes - stage.weight_bytes - stage.buffer_bytes
        assert kv * 100 <= free * KV_BUDGET_PERCENT
    # Every tensor is loaded once, except a tied head on a later stage than the embeddings: token_embd twice.
    duplicated = model.resident_embedding_bytes if model.output_tied and len(plan.stages) > 1 else 0
    assert sum(stage.weight_bytes for stage in plan.stages) == model.resident_total_bytes + duplicated


@PROPERTY_SETTINGS
@given(model=models, groups=gpu_groups)
def test_the_same_input_gives_the_same_plan(model: ModelInfo, groups: list[tuple[int, int, str]]) -> None:
    nodes = _nodes(groups)
    first = plan_placement(model=model, nodes=nodes)
    again = plan_placement(model=model, nodes=list(reversed(nodes)))
    assert first.model_dump_json() == again.model_dump_json()


@PROPERTY_SETTINGS
@given(model=models, groups=gpu_groups, extra=gpu_groups)
def test_adding_gpus_never_lowers_the_planned_context(
    model: ModelInfo, groups: list[tuple[int, int, str]], extra: list[tuple[int, int, str]]
) -> None:
    before = plan_placement(model=model, nodes=_nodes(groups))
    after = plan_placement(model=model, nodes=_nodes(groups + extra))
    assert after.context_length >= before.context_length


@PROPERTY_SETTINGS
@given(model=models, groups=gpu_groups, context=st.integers(1, 262144))
def test_a_context_override_is_honoured_exactly_or_refused(
    model: ModelInfo, groups: list[tuple[int, int, str]], context: int
) -> None:
    automatic = plan_placement(model=model, nodes=_nodes(groups))
    fits = True
    try:
        plan = plan_placement(model=model, nodes=_nodes(groups), options=PlanOptions(context_length=context))
    except OverrideDoesNotFitError:
        fits = False
    if not automatic.feasible:
        return
    if context <= automatic.context_length:
        assert fits
    if fits:
        assert plan.context_length == context
