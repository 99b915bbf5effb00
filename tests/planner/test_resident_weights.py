"""Stages are sized by what their weights take on the GPU once loaded, not by their size in the file.

The model is a generated Llama-3-8B-like header in the K-quants real downloads use (Q4_K, Q6_K): 5.2 GB in the file,
16.1 GB on GPUs once dequantised to bfloat16. A 16 GiB GPU (14.4 GiB usable) holds the file's bytes easily and the
resident ones not at all.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from strata.fit import KV_BUDGET_PERCENT
from strata.gguf import inspect_model
from strata.gguf.model import CacheType, ModelInfo
from strata.gguf.testmodels import write_header_only_model
from strata.operator.planner import plan_placement
from strata.operator.planner.memory import DEFAULT_PREFIX_CACHE_FRACTION, buffer_bytes
from strata.plan import GB
from strata_testbed.cluster_objects import gpu_node

GIB = 1 << 30
USABLE = 16 * GIB - int(16 * GIB * 0.1)  # a 16 GiB GPU less the default 10% headroom


@pytest.fixture(scope="module")
def k_quant_8b(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    path = tmp_path_factory.mktemp("resident") / "llama3-8b.gguf"
    write_header_only_model(path, shape="llama3-8b")
    return inspect_model(str(path))


def as_if_file_bytes_were_resident(model: ModelInfo) -> ModelInfo:
    """The model as the planner saw it before: every tensor as large on the GPU as in the file."""
    return dataclasses.replace(
        model, layer_resident_bytes=model.layer_bytes, non_layer_resident_bytes=dict(model.non_layer_bytes)
    )


@pytest.mark.parametrize(
    ("gpus", "by_file_bytes", "stages"),
    [
        pytest.param(1, True, 1, id="by file bytes one 16 GiB GPU would have taken the model"),
        pytest.param(1, False, 0, id="by resident bytes one 16 GiB GPU is a shortfall"),
        pytest.param(2, True, 1, id="by file bytes two GPUs would still have planned one stage"),
        pytest.param(2, False, 2, id="by resident bytes two GPUs are needed, one stage each"),
    ],
)
def test_a_k_quant_model_needs_room_for_its_dequantised_weights(
    k_quant_8b: ModelInfo, gpus: int, by_file_bytes: bool, stages: int
) -> None:
    model = as_if_file_bytes_were_resident(k_quant_8b) if by_file_bytes else k_quant_8b
    plan = plan_placement(model=model, nodes=[gpu_node("t4", gpus=gpus, gib=16)])
    assert len(plan.stages) == stages
    assert (plan.shortfall is None) == (stages > 0)
    assert sum(stage.weight_bytes for stage in plan.stages) == (model.resident_total_bytes if stages else 0)
    assert all(stage.spare_bytes >= 0 for stage in plan.stages)


def test_the_shortfall_speaks_of_the_bytes_that_will_be_resident(k_quant_8b: ModelInfo) -> None:
    plan = plan_placement(model=k_quant_8b, nodes=[gpu_node("t4", gpus=1, gib=16)])
    assert plan.shortfall is not None
    kv = k_quant_8b.kv_bytes(n_ctx=512, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0)
    reserved_kv = math.ceil(kv * 100 / KV_BUDGET_PERCENT / (1 - DEFAULT_PREFIX_CACHE_FRACTION))
    required = k_quant_8b.resident_total_bytes + buffer_bytes(model=k_quant_8b, output_head=True) + reserved_kv
    assert (plan.shortfall.required_bytes, plan.shortfall.available_bytes) == (required, USABLE)
    assert plan.shortfall.message == (
        f"requires {required / GB:.1f} GB, pool has {USABLE / GB:.1f} GB across 1 GPU, "
        f"short by {(required - USABLE) / GB:.1f} GB"
    )
    assert plan.shortfall.message == "requires 16.5 GB, pool has 15.5 GB across 1 GPU, short by 1.0 GB"
