"""How many bytes a tensor takes once a GPU stage has loaded it, which is not what it takes in the file.

A stage dequantises every weight to the compute dtype, bfloat16, at 2 bytes per element (F16 is cast to bf16, the
same size; BF16 is kept). So an F32 norm shrinks to half, a Q8_0 weight grows to 1.9 times its file size, and a
K-quant or Q4_0 weight to 3-4 times: a 40 GB Q4_K_M 70B file holds about 140 GB on GPUs, and so does a 75 GB Q8_0
one. Planning by file bytes would put that on GPUs that cannot hold it, so the planner and `strata serve` size
weights by these figures.

Keeping Q8_0 quantised on the GPU would need a GEMV that reads int8 blocks at the bandwidth cuBLAS reaches on bf16;
a first Triton kernel for it was slower than cuBLAS on bf16 (docs/benchmarks.md), so Q8_0 is dequantised too.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

# Tensor types already at the compute width, 2 bytes per element: a GPU stage holds them at their size in the file.
COMPUTE_WIDTH_TYPES: frozenset[GGMLQuantizationType] = frozenset({GGMLQuantizationType.F16, GGMLQuantizationType.BF16})
# Bytes per element of every weight on a GPU stage: GPUs compute in bfloat16.
COMPUTE_BYTES_PER_ELEMENT = 2


def resident_bytes(ggml_type: GGMLQuantizationType, *, elements: int, stored_bytes: int) -> int:
    """Bytes one tensor of `ggml_type` (`elements` values, `stored_bytes` in the file) takes on a GPU stage."""
    if ggml_type in COMPUTE_WIDTH_TYPES:
        return stored_bytes
    return elements * COMPUTE_BYTES_PER_ELEMENT
