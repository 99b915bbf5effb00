"""The placement search: what each stage carries, how many stages, how long a context, and what overrides do."""

from __future__ import annotations

from typing import Any

import pytest
from strata.gguf.model import CacheType, ModelInfo
from strata.kv_layout import BLOCK_TOKENS
from strata.operator.planner import PlanOptions, plan_placement
from strata.operator.planner.errors import InvalidOptionError, OverrideDoesNotFitError
from strata.operator.planner.profile import ModelProfile
from strata.operator.planner.scheduling import Toleration
from strata.operator.planner.split import Span, fill
from strata.plan import Backend, Plan
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import F16, Q8_0, dense_model, llama3_8b, llama3_70b

GIB = 1 << 30
A100 = 80
A10G = 24
MI210 = 64
MI300X = 192
# Q8_0 is kept in its blocks, so the weights take what they take in the file: 909,148,160 B a layer (855,638,016
# values at 34 B per 32, plus two F32 norms at 2 B a value) and 75.0 GB in all with token_embd and the output head.
# That is more than three 24 GiB GPUs hold (3 x 23.2 GB usable), so the A10G pools below need four stages or more.
SEVENTY_B = llama3_70b(weight_type=Q8_0)


def _pool(*sizes: tuple[str, int, int, str]) -> list[dict[str, Any]]:
    """Nodes from (name, GPUs, GiB per GPU, resource)."""
    return [gpu_node(name, gpus=gpus, gib=gib, resource=resource) for name, gpus, gib, resource in sizes]


def _plan(model: ModelInfo, nodes: list[dict[str, Any]], **options: Any) -> Plan:
    return plan_placement(model=model, nodes=nodes, options=PlanOptions(**options))


@pytest.mark.parametrize(
    "tied",
    [
        pytest.param(False, id="untied: embeddings on the first stage and the output head on the last"),
        pytest.param(True, id="tied: the last stage holds token_embd again as its head"),
    ],
)
def test_the_first_stage_carries_embeddings_and_the_last_the_output_head(tied: bool) -> None:
    model = dense_model(tied=tied, weight_type=Q8_0)
    plan = _plan(model, _pool(("a10g", 4, A10G, "nvidia.com/gpu")))
    assert len(plan.stages) == 4
    first, *middle, last = plan.stages
    assert (first.embeddings, last.output_head) == (True, True)
    assert not any(s.embeddings or s.output_head for s in middle)
    layers = sum(model.layer_resident_bytes[first.layer_start : first.layer_end])
    assert first.weight_bytes == layers + model.resident_embedding_bytes
    last_layers = sum(model.layer_resident_bytes[last.layer_start : last.layer_end])
    assert last.weight_bytes == last_layers + model.resident_head_bytes


def test_a_single_stage_with_a_tied_head_loads_token_embd_once() -> None:
    model = dense_model(tied=True, layers=32, embd=4096, heads=32, ffn=14336)
    (stage,) = _plan(model, _pool(("a100", 1, A100, "nvidia.com/gpu"))).stages
    assert stage.weight_bytes == model.resident_total_bytes


@pytest.mark.parametrize(
    ("nodes", "stages", "context"),
    [
        pytest.param(
            _pool(("a100", 8, A100, "nvidia.com/gpu")), 2, 131072, id="two A100s hold a Q8 70B at full context"
        ),
        pytest.param(
            _pool(("a10g", 4, A10G, "nvidia.com/gpu")),
            4,
            67328,
            id="four 24 GB GPUs hold it at a shorter context",
        ),
        pytest.param(
            _pool(("a10g", 8, A10G, "nvidia.com/gpu")),
            5,
            131072,
            id="with more small GPUs the fewest stages that reach full context are used",
        ),
    ],
)
def test_context_comes_first_then_the_fewest_stages(nodes: list[dict[str, Any]], stages: int, context: int) -> None:
    plan = _plan(SEVENTY_B, nodes)
    assert (len(plan.stages), plan.context_length) == (stages, context)


def test_ties_in_context_and_stages_go_to_the_split_with_the_most_spare_memory() -> None:
    model = SEVENTY_B
    plan = _plan(model, _pool(("a10g", 8, A10G, "nvidia.com/gpu")))
    share = PlanOptions().prefix_cache_fraction
    profile = ModelProfile.of(
        model, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, parallel=4, prefix_cache_fraction=share
    )
    usable = [s.usable_bytes for s in plan.stages]
    packed = fill(profile, usable=usable, context=plan.context_length)
    assert packed is not None

    def spare(u: int, p: Span) -> int:
        last = p.end == 80
        free = u - profile.weight_bytes(p.start, p.end, first=p.start == 0, last=last) - profile.buffer_bytes(last=last)
        return free - profile.prefix_cache_bytes(free) - profile.kv_bytes(p.start, p.end, plan.context_length)

    packed_spare = min(spare(u, p) for u, p in zip(usable, packed, strict=True))
    # The plain greedy fill packs the first stages full; the chosen split moves layers until every stage has room.
    assert min(s.spare_bytes for s in plan.stages) > packed_spare + GIB


def test_a_pipeline_may_mix_nvidia_and_amd_stages() -> None:
    model = llama3_70b(weight_type=Q8_0)
    nodes = _pool(("a10g", 2, A10G, "nvidia.com/gpu"), ("mi210", 1, MI210, "amd.com/gpu"))
    plan = _plan(model, nodes)
    assert {s.backend for s in plan.stages} == {Backend.CUDA, Backend.ROCM}
    assert [s.node for s in plan.stages] == ["mi210", "a10g", "a10g"]
    assert [s.gpus for s in plan.stages] == [(0,), (0,), (1,)]


@pytest.mark.parametrize(
    ("options", "check"),
    [
        pytest.param({"context_length": 8192}, lambda p: p.context_length == 8192, id="a context override wins"),
        pytest.param({"parallel": 16}, lambda p: p.parallel == 16, id="a parallel override wins"),
        pytest.param(
            {"cache_type_k": CacheType.F16, "cache_type_v": CacheType.Q4_0},
            lambda p: (p.cache_type_k, p.cache_type_v, p.kv_bytes_per_token) == ("f16", "q4_0", 80 * (2048 + 576)),
            id="cache type overrides win and change the KV bytes per token",
        ),
        pytest.param(
            {"max_stages": 4},
            lambda p: (len(p.stages), p.context_length) == (4, 67328),
            id="a max stages override caps the stages even at a shorter context",
        ),
        pytest.param(
            {"node_selector": {"kubernetes.io/os": "linux"}},
            lambda p: len(p.stages) == 5,
            id="a node selector that every node matches changes nothing",
        ),
        pytest.param(
            {"gpu_memory_bytes": 32 * GIB},
            lambda p: {s.memory_bytes for s in p.stages} == {32 * GIB},
            id="a GPU memory override wins over the labels",
        ),
        pytest.param(
            {"headroom_fraction": 0.2},
            lambda p: {s.usable_bytes for s in p.stages} == {A10G * GIB - int(A10G * GIB * 0.2)},
            id="a headroom override wins",
        ),
    ],
)
def test_an_override_that_fits_wins(options: dict[str, Any], check: Any) -> None:
    plan = _plan(SEVENTY_B, _pool(("a10g", 8, A10G, "nvidia.com/gpu")), **options)
    assert check(plan), plan


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param(
            {"context_length": 131072},
            r"^context 131072 needs 5\.4 GB of KV on stage 0 \(a10g\) which has 3\.7 GB free; "
            r"the largest context that fits is 67328$",
            id="a context that does not fit names the stage and the largest context that does",
        ),
        pytest.param(
            {"context_length": 262144},
            "exceeds the model's native context 131072",
            id="a context beyond the native context is refused",
        ),
        pytest.param(
            {"max_stages": 2},
            "max stages 2 is too few: the model needs at least 4 stages",
            id="a max stages override below what the model needs is refused",
        ),
        pytest.param(
            {"context_length": 131072, "max_stages": 4},
            "the largest context that fits with at most 4 stages is 67328",
            id="a context error under max stages says so",
        ),
    ],
)
def test_an_override_that_cannot_fit_is_an_error_saying_what_would(options: dict[str, Any], message: str) -> None:
    with pytest.raises(OverrideDoesNotFitError, match=message):
        _plan(SEVENTY_B, _pool(("a10g", 4, A10G, "nvidia.com/gpu")), **options)


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"parallel": 0}, id="zero parallel slots are refused"),
        pytest.param({"context_length": 0}, id="a zero context is refused"),
        pytest.param({"headroom_fraction": 1.0}, id="a headroom of the whole GPU is refused"),
    ],
)
def test_an_option_out_of_range_is_refused(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidOptionError):
        PlanOptions(**options)


def test_parallel_slots_share_one_kv_pool_with_a_partial_block_each() -> None:
    nodes = _pool(("a10g", 4, A10G, "nvidia.com/gpu"))
    one, sixteen = (_plan(SEVENTY_B, nodes, parallel=n) for n in (1, 16))
    assert 0 <= one.context_length - sixteen.context_length <= 1024
    per_token = SEVENTY_B.kv_bytes_per_token(type_k=sixteen.cache_type_k, type_v=sixteen.cache_type_v)
    for stage in sixteen.stages:
        layers = stage.layer_end - stage.layer_start
        assert stage.kv_bytes == (sixteen.context_length + 15 * BLOCK_TOKENS) * per_token * layers // 80


def test_tolerations_let_a_tainted_pool_in() -> None:
    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    nodes = [gpu_node("a100", taints=[taint])]
    assert not _plan(llama3_8b(), nodes).feasible
    plan = _plan(llama3_8b(), nodes, tolerations=(Toleration(key="nvidia.com/gpu", operator="Exists"),))
    assert plan.feasible


def test_a_pool_too_small_reports_the_gap_and_who_was_counted() -> None:
    nodes = [*_pool(("a10g", 2, A10G, "nvidia.com/gpu")), gpu_node("down", ready=False)]
    plan = _plan(SEVENTY_B, nodes)
    shortfall = plan.shortfall
    assert shortfall is not None
    assert not plan.feasible
    assert plan.stages == ()
    assert shortfall.message == (
        f"requires {shortfall.required_bytes / 1e9:.1f} GB, pool has {shortfall.available_bytes / 1e9:.1f} GB "
        f"across 2 GPUs, short by {shortfall.short_by_bytes / 1e9:.1f} GB"
    )
    assert shortfall.available_bytes == 2 * (A10G * GIB - A10G * GIB // 10)
    assert shortfall.required_bytes > SEVENTY_B.resident_total_bytes
    assert shortfall.short_by_bytes == shortfall.required_bytes - shortfall.available_bytes > 0
    assert [(p.node, p.gpu) for p in shortfall.participants] == [("a10g", 0), ("a10g", 1)]
    assert all(p.weight_bytes + p.kv_bytes <= p.usable_bytes for p in shortfall.participants)
    assert [e.node for e in plan.excluded] == ["down"]


def test_a_layer_larger_than_any_gpu_is_a_per_gpu_shortfall() -> None:
    model = dense_model(layers=4, embd=16384, ffn=131072, weight_type=F16)
    plan = _plan(model, _pool(("small", 16, 8, "nvidia.com/gpu")))
    assert plan.shortfall is not None
    assert "but layer 0 alone needs" in plan.shortfall.message
    assert plan.shortfall.short_by_bytes > 0


def test_an_empty_pool_is_a_shortfall_of_the_whole_model() -> None:
    plan = _plan(llama3_8b(), [gpu_node("cpu", gpus=0)])
    assert plan.shortfall is not None
    assert plan.shortfall.message.startswith("requires ")
    assert "pool has 0.0 GB across 0 GPUs" in plan.shortfall.message
    assert plan.excluded[0].reason.startswith("no GPU")


def test_the_plan_round_trips_through_json() -> None:
    plan = _plan(llama3_70b(), _pool(("a10g", 4, A10G, "nvidia.com/gpu"), ("mi", 1, MI300X, "amd.com/gpu")))
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    short = _plan(SEVENTY_B, _pool(("a10g", 1, A10G, "nvidia.com/gpu")))
    assert Plan.model_validate_json(short.model_dump_json()) == short
