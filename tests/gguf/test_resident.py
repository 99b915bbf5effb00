"""What a tensor takes on a GPU stage: F16 and BF16 as stored, every other type (Q8_0 too) at 2 bytes per element."""

from __future__ import annotations

import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from strata.gguf.resident import COMPUTE_BYTES_PER_ELEMENT, COMPUTE_WIDTH_TYPES, resident_bytes

ELEMENTS = 4096 * 256  # a whole number of blocks for every type, K-quants' 256 included


def stored(ggml_type: Q) -> int:
    block_elements, block_bytes = GGML_QUANT_SIZES[ggml_type]
    return int(ELEMENTS // block_elements * block_bytes)


@pytest.mark.parametrize(
    ("ggml_type", "file_bytes", "gpu_bytes"),
    [
        pytest.param(Q.F32, 4 * ELEMENTS, 2 * ELEMENTS, id="F32 shrinks to 2 bytes per element"),
        pytest.param(Q.F16, 2 * ELEMENTS, 2 * ELEMENTS, id="F16 is cast to bf16, the same size"),
        pytest.param(Q.BF16, 2 * ELEMENTS, 2 * ELEMENTS, id="BF16 is kept as stored"),
        pytest.param(Q.Q8_0, ELEMENTS // 32 * 34, 2 * ELEMENTS, id="Q8_0 is dequantised to 2 bytes per element"),
        pytest.param(Q.Q4_0, ELEMENTS // 32 * 18, 2 * ELEMENTS, id="Q4_0 grows to 2 bytes per element"),
        pytest.param(Q.Q4_K, ELEMENTS // 256 * 144, 2 * ELEMENTS, id="Q4_K grows to 2 bytes per element"),
        pytest.param(Q.Q6_K, ELEMENTS // 256 * 210, 2 * ELEMENTS, id="Q6_K grows to 2 bytes per element"),
    ],
)
def test_a_tensor_takes_its_stored_size_or_two_bytes_per_element(ggml_type: Q, file_bytes: int, gpu_bytes: int) -> None:
    assert stored(ggml_type) == file_bytes
    assert resident_bytes(ggml_type, elements=ELEMENTS, stored_bytes=file_bytes) == gpu_bytes


def test_every_other_type_is_dequantised_to_the_compute_width() -> None:
    dequantised = set(GGML_QUANT_SIZES) - COMPUTE_WIDTH_TYPES
    assert {Q.F16, Q.BF16} == COMPUTE_WIDTH_TYPES
    assert {resident_bytes(t, elements=ELEMENTS, stored_bytes=stored(t)) for t in dequantised} == {
        COMPUTE_BYTES_PER_ELEMENT * ELEMENTS
    }
