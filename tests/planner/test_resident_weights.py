"""Stages are sized by what their weights take once loaded, not by their size in the file.

A stage keeps Q4_K and Q6_K in their blocks, Q4_K with its sub-scales unpacked (148 bytes for each 144-byte block):
a generated Llama-3-8B-like header in the K-quants real downloads use is 5,172,420,608 B in the file and
5,257,691,136 B loaded. Q3_K is dequantised to 2 bytes per value: the same shape in Q3_K is 3,451,453,440 B in the
file and 16,060,522,496 B loaded. A 16 GiB GPU (15.5 GB usable) holds the first easily, and the second's file bytes
but not its loaded ones; a GPU of 6,418 MiB (5.66 GB usable) holds the K-quant file's bytes but not the sub-scales.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from gguf import GGMLQuantizationType
from strata.fit import KV_BUDGET_PERCENT
from strata.gguf import inspect_model
from strata.gguf.model import CacheType, ModelInfo
from strata.gguf.testmodels import write_header_only_model
from strata.operator.planner import plan_placement
from strata.operator.planner.memory import DEFAULT_PREFIX_CACHE_FRACTION, buffer_bytes
from strata.plan import GB
from strata_testbed.cluster_objects import gpu_node
from strata_testbed.model_shapes import llama3_8b

GIB = 1 << 30
USABLE = 16 * GIB - int(16 * GIB * 0.1)  # a 16 GiB GPU less the default 10% headroom
# 6,729,760,768 B less 1 GiB of CUDA runtime (more than 10%): 5,656,018,944 B usable. At context 512 the K-quant 8B
# needs 5,613,457,193 B by file bytes and 5,698,727,721 B by loaded bytes (weights, 396,886,016 B of buffers, and
# 35,651,584 B of q8_0 KV over 85% of 95%).
BETWEEN_FILE_AND_LOADED_MIB = 6418


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInfo]:
    path = tmp_path_factory.mktemp("resident") / "llama3-8b.gguf"
    write_header_only_model(path, shape="llama3-8b")
    return {"Q4_K/Q6_K": inspect_model(str(path)), "Q3_K": llama3_8b(weight_type=GGMLQuantizationType.Q3_K)}


def as_if_file_bytes_were_resident(model: ModelInfo) -> ModelInfo:
    """The model as a planner going by file size would see it: every tensor as large loaded as in the file."""
    return dataclasses.replace(
        model, layer_resident_bytes=model.layer_bytes, non_layer_resident_bytes=dict(model.non_layer_bytes)
    )


def gpu_pool(*, gpus: int, mib: int) -> list[dict[str, object]]:
    """One node of `gpus` GPUs of `mib` MiB each, labelled as GPU Feature Discovery labels them."""
    return [gpu_node("gpu", gpus=gpus, gib=None, labels={"nvidia.com/gpu.memory": str(mib)})]


@pytest.mark.parametrize(
    ("weights", "file_bytes", "loaded_bytes"),
    [
        pytest.param(
            "Q4_K/Q6_K",
            5_172_420_608,
            5_257_691_136,
            id="Q4_K and Q6_K stay in their blocks: Q4_K grows by 148/144 and F32 norms halve",
        ),
        pytest.param(
            "Q3_K", 3_451_453_440, 16_060_522_496, id="Q3_K is dequantised to 2 bytes per value, 4.65 times its file"
        ),
    ],
)
def test_loaded_bytes_follow_each_tensor_type(
    models: dict[str, ModelInfo], weights: str, file_bytes: int, loaded_bytes: int
) -> None:
    assert (models[weights].total_bytes, models[weights].resident_total_bytes) == (file_bytes, loaded_bytes)


@pytest.mark.parametrize(
    ("weights", "gpus", "mib", "by_file_bytes", "stages"),
    [
        pytest.param("Q4_K/Q6_K", 1, 16 * 1024, False, 1, id="a K-quant model takes one 16 GiB GPU by loaded bytes"),
        pytest.param(
            "Q4_K/Q6_K",
            1,
            BETWEEN_FILE_AND_LOADED_MIB,
            True,
            1,
            id="by file bytes a GPU without room for Q4_K's unpacked sub-scales would have taken the model",
        ),
        pytest.param(
            "Q4_K/Q6_K",
            1,
            BETWEEN_FILE_AND_LOADED_MIB,
            False,
            0,
            id="by loaded bytes a GPU without room for Q4_K's unpacked sub-scales is a shortfall",
        ),
        pytest.param("Q3_K", 1, 16 * 1024, True, 1, id="by file bytes one 16 GiB GPU would have taken a Q3_K model"),
        pytest.param("Q3_K", 1, 16 * 1024, False, 0, id="dequantised Q3_K makes one 16 GiB GPU a shortfall"),
        pytest.param("Q3_K", 2, 16 * 1024, True, 1, id="by file bytes two GPUs would still have planned one stage"),
        pytest.param("Q3_K", 2, 16 * 1024, False, 2, id="dequantised Q3_K needs both GPUs, one stage each"),
    ],
)
def test_a_model_needs_room_for_the_bytes_its_stages_load(
    models: dict[str, ModelInfo], weights: str, gpus: int, mib: int, by_file_bytes: bool, stages: int
) -> None:
    model = as_if_file_bytes_were_resident(models[weights]) if by_file_bytes else models[weights]
    plan = plan_placement(model=model, nodes=gpu_pool(gpus=gpus, mib=mib))
    assert len(plan.stages) == stages
    assert (plan.shortfall is None) == (stages > 0)
    assert sum(stage.weight_bytes for stage in plan.stages) == (model.resident_total_bytes if stages else 0)
    assert all(stage.spare_bytes >= 0 for stage in plan.stages)


def test_the_shortfall_speaks_of_the_bytes_that_will_be_resident(models: dict[str, ModelInfo]) -> None:
    model = models["Q3_K"]
    plan = plan_placement(model=model, nodes=gpu_pool(gpus=1, mib=16 * 1024))
    assert plan.shortfall is not None
    kv = model.kv_bytes(n_ctx=512, type_k=CacheType.Q8_0, type_v=CacheType.Q8_0, n_seq=4)
    reserved_kv = math.ceil(kv * 100 / KV_BUDGET_PERCENT / (1 - DEFAULT_PREFIX_CACHE_FRACTION))
    required = model.resident_total_bytes + buffer_bytes(model=model, output_head=True) + reserved_kv
    assert (plan.shortfall.required_bytes, plan.shortfall.available_bytes) == (required, USABLE)
    assert plan.shortfall.message == (
        f"requires {required / GB:.1f} GB, pool has {USABLE / GB:.1f} GB across 1 GPU, "
        f"short by {(required - USABLE) / GB:.1f} GB"
    )
    # 16,060,522,496 B of weights + 396,886,016 B of buffers + 60,707,032 B reserved for 704 cells of q8_0 KV (512
    # and a partial block for each of three more slots).
    assert plan.shortfall.message == "requires 16.5 GB, pool has 15.5 GB across 1 GPU, short by 1.1 GB"
