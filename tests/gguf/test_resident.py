"""What a tensor takes on a stage: the quantised types people download in their blocks (Q4_K and Q5_K with their
sub-scales unpacked), F16 and BF16 as stored, every other type at 2 bytes per element."""

from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from strata.gguf.resident import COMPUTE_BYTES_PER_ELEMENT, COMPUTE_WIDTH_TYPES, KEPT_BLOCK_BYTES, resident_bytes

ELEMENTS = 4096 * 256  # a whole number of blocks for every type, K-quants' 256 included
MATRIX = "blk.3.ffn_up.weight"  # a dense block's matrix


def stored(ggml_type: Q) -> int:
    block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
    return int(ELEMENTS // block_elements * block_bytes)


@pytest.mark.parametrize(
    ("ggml_type", "file_bytes", "gpu_bytes"),
    [
        pytest.param(Q.F32, 4 * ELEMENTS, 2 * ELEMENTS, id="F32 shrinks to 2 bytes per element"),
        pytest.param(Q.F16, 2 * ELEMENTS, 2 * ELEMENTS, id="F16 is cast to bf16, the same size"),
        pytest.param(Q.BF16, 2 * ELEMENTS, 2 * ELEMENTS, id="BF16 is kept as stored"),
        pytest.param(Q.Q8_0, ELEMENTS // 32 * 34, ELEMENTS // 32 * 34, id="Q8_0 stays in its blocks"),
        pytest.param(Q.Q4_0, ELEMENTS // 32 * 18, ELEMENTS // 32 * 18, id="Q4_0 stays in its blocks"),
        pytest.param(Q.Q4_K, ELEMENTS // 256 * 144, ELEMENTS // 256 * 148, id="Q4_K unpacks its sub-scales"),
        pytest.param(Q.Q5_K, ELEMENTS // 256 * 176, ELEMENTS // 256 * 180, id="Q5_K unpacks its sub-scales"),
        pytest.param(Q.Q6_K, ELEMENTS // 256 * 210, ELEMENTS // 256 * 210, id="Q6_K stays in its blocks"),
        pytest.param(Q.Q3_K, ELEMENTS // 256 * 110, 2 * ELEMENTS, id="Q3_K is dequantised to 2 bytes per element"),
        pytest.param(Q.IQ4_XS, ELEMENTS // 256 * 136, 2 * ELEMENTS, id="IQ4_XS is dequantised"),
    ],
)
def test_a_tensor_takes_what_the_stage_keeps(ggml_type: Q, file_bytes: int, gpu_bytes: int) -> None:
    assert stored(ggml_type) == file_bytes
    assert resident_bytes(ggml_type, name=MATRIX, elements=ELEMENTS, stored_bytes=file_bytes) == gpu_bytes


def test_kept_types_stay_within_five_percent_of_the_file() -> None:
    for ggml_type in KEPT_BLOCK_BYTES:
        held = resident_bytes(ggml_type, name=MATRIX, elements=ELEMENTS, stored_bytes=stored(ggml_type))
        assert stored(ggml_type) <= held <= 1.05 * stored(ggml_type)


@pytest.mark.parametrize(
    ("name", "ggml_type", "gpu_bytes"),
    [
        pytest.param("blk.3.ffn_up_exps.weight", Q.Q4_K, 2 * ELEMENTS, id="Q4_K up experts are dequantised"),
        pytest.param("blk.3.ffn_gate_exps.weight", Q.Q8_0, 2 * ELEMENTS, id="Q8_0 gate experts are dequantised"),
        pytest.param("blk.3.ffn_down_exps.weight", Q.Q6_K, 2 * ELEMENTS, id="Q6_K down experts are dequantised"),
        pytest.param("blk.3.ffn_down_exps.weight", Q.BF16, 2 * ELEMENTS, id="BF16 experts are kept as stored"),
        pytest.param("blk.3.ffn_gate_inp.weight", Q.F32, 2 * ELEMENTS, id="the F32 router is cast"),
    ],
)
def test_a_mixtures_stacked_experts_are_held_dequantised(name: str, ggml_type: Q, gpu_bytes: int) -> None:
    assert resident_bytes(ggml_type, name=name, elements=ELEMENTS, stored_bytes=stored(ggml_type)) == gpu_bytes


def test_every_other_type_is_dequantised_to_the_compute_width() -> None:
    dequantised = set(GGML_QUANT_SIZES) - COMPUTE_WIDTH_TYPES - set(KEPT_BLOCK_BYTES)
    assert {Q.F16, Q.BF16} == COMPUTE_WIDTH_TYPES
    assert {resident_bytes(t, name=MATRIX, elements=ELEMENTS, stored_bytes=stored(t)) for t in dequantised} == {
        COMPUTE_BYTES_PER_ELEMENT * ELEMENTS
    }


ON_THE_CPU = {  # float32 compute: what a draft model holds in the gateway process (strata.draft_memory)
    "F32 stays 4 bytes per element": (Q.F32, 4 * ELEMENTS),
    "F16 widens to 4 bytes per element": (Q.F16, 4 * ELEMENTS),
    "Q8_0 stays in its blocks": (Q.Q8_0, ELEMENTS // 32 * 34),
    "Q4_K unpacks its sub-scales as on a GPU": (Q.Q4_K, ELEMENTS // 256 * 148),
    "Q3_K is dequantised to 4 bytes per element": (Q.Q3_K, 4 * ELEMENTS),
}


@pytest.mark.parametrize(("ggml_type", "cpu_bytes"), ON_THE_CPU.values(), ids=ON_THE_CPU.keys())
def test_a_tensor_takes_what_a_cpu_computing_in_float32_keeps(ggml_type: Q, cpu_bytes: int) -> None:
    held = resident_bytes(ggml_type, name=MATRIX, elements=ELEMENTS, stored_bytes=stored(ggml_type), compute_bytes=4)
    assert held == cpu_bytes
