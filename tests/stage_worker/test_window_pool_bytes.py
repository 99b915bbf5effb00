"""A stage built from a generated Gemma 3-style file allocates the KV bytes its plan counts.

The stage is built as a pod builds it (strata.stage_worker.stage_load.build_engine: the file's header, its own
layers, the pool from its settings, a warmed decode step), and its pool's bytes are set against the planner's: the
full-attention layers hold the context in whole blocks, the sliding-window layers only each slot's window in whole
blocks plus a micro-batch (strata.kv_layout), so at a long context the pool is a fraction of a full cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from strata.gguf.model import CacheType, ModelInfo
from strata.gguf.reader import inspect_model
from strata.gguf.testmodels import SMALL_SHAPES, write_test_model
from strata.kv_layout import ResidentBudget
from strata.operator.planner import PlanOptions, plan_placement
from strata.plan import Plan
from strata.stage_worker.loader import LoadProgress
from strata.stage_worker.settings import StageSettings
from strata.stage_worker.stage_load import build_engine
from strata_testbed.cluster_objects import gpu_node

WINDOW = 1024  # Gemma 3's; the small shape's 8-token window would make the window space a block per slot


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelInfo]:
    shape = dataclasses.replace(SMALL_SHAPES["gemma3"], sliding_window=WINDOW)
    path = write_test_model(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", architecture="gemma3", shape=shape).path
    return path, inspect_model(str(path))


@dataclass(frozen=True)
class PoolCase:
    context: int
    parallel: int
    cache: CacheType
    splits: tuple[int, ...] = ()  # layers where a stage ends and the next begins; () plans one stage
    resident: int = 0  # tokens of a resident window (spec.kvCache.residentWindow); 0: none


POOL_CASES = [
    pytest.param(PoolCase(16384, 4, CacheType.Q8_0), id="16k context, four slots, q8_0, one stage"),
    pytest.param(PoolCase(32768, 1, CacheType.F16), id="the native 32k context, one slot, f16"),
    pytest.param(PoolCase(8192, 2, CacheType.Q8_0, splits=(3,)), id="8k context, two slots, q8_0, two stages"),
    pytest.param(PoolCase(16384, 3, CacheType.F32, splits=(2, 5)), id="16k context, three slots, f32, three stages"),
    pytest.param(PoolCase(16384, 2, CacheType.Q8_0, resident=4096), id="16k context, a resident window, one stage"),
    pytest.param(
        PoolCase(8192, 2, CacheType.Q8_0, splits=(3,), resident=2048),
        id="a resident window over two stages, the first of sliding layers only",
    ),
]


def plan_one_stage(model: ModelInfo, case: PoolCase) -> Plan:
    options = PlanOptions(
        context_length=case.context, parallel=case.parallel, cache_type_k=case.cache, cache_type_v=case.cache,
        resident_window=ResidentBudget(case.resident) if case.resident else None,
    )  # fmt: skip
    plan = plan_placement(model=model, nodes=[gpu_node("node-a", gpus=1, gib=80)], options=options)
    assert isinstance(plan, Plan), plan
    assert plan.feasible, plan.shortfall
    return plan


@pytest.mark.parametrize("case", POOL_CASES)
def test_a_built_gemma3_stage_allocates_the_kv_bytes_of_its_plan(
    gemma3: tuple[Path, ModelInfo], case: PoolCase
) -> None:
    path, model = gemma3
    plan = plan_one_stage(model, case)
    assert (plan.context_length, plan.parallel) == (case.context, case.parallel)
    bounds = (0, *case.splits, model.block_count)
    spans = list(itertools.pairwise(bounds))
    if not case.splits:
        assert [(s.layer_start, s.layer_end) for s in plan.stages] == spans
    full_cache = model.kv_bytes_per_token(type_k=case.cache, type_v=case.cache) * case.context
    allocated_total = 0
    for index, (start, end) in enumerate(spans):
        settings = StageSettings(
            stage_index=index, layer_start=start, layer_end=end, model_url=str(path), context=plan.context_length,
            parallel=plan.parallel, cache_type_k=plan.cache_type_k, cache_type_v=plan.cache_type_v,
            resident_tokens=case.resident,
        )  # fmt: skip
        engine = build_engine(
            settings, has_next=end < model.block_count, progress=LoadProgress(), cancelled=threading.Event()
        )
        planned = model.kv_bytes(
            n_ctx=plan.context_length, type_k=plan.cache_type_k, type_v=plan.cache_type_v, layers=range(start, end),
            n_seq=plan.parallel, resident=bool(case.resident),
        )  # fmt: skip
        if not case.splits:
            assert planned == plan.stages[0].kv_bytes
        allocated = engine.pool.nbytes
        assert abs(allocated - planned) <= 0.02 * planned
        if any(model.is_sliding(il) for il in range(start, end)):
            assert engine.pool.window is not None, "the sliding layers have a space of their own"
        full_layers = any(not model.is_sliding(il) for il in range(start, end))
        assert (engine.pool.resident is not None) == (bool(case.resident) and full_layers)
        allocated_total += allocated
    assert allocated_total < full_cache / 2, "the sliding layers hold their windows, not the context"
