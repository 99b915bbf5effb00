"""How many bytes a tensor takes once a GPU stage has loaded it, which is not what it takes in the file.

The stage worker keeps F16, BF16 and Q8_0 tensors on a GPU as stored (Q8_0 stays quantised and is multiplied in
blocks); every other type is dequantised to the compute dtype, bfloat16, at 2 bytes per element. So an F32 norm
shrinks to half, and a K-quant or Q4_0 weight grows to 3-4 times its file size: a 40 GB Q4_K_M 70B file holds
about 140 GB on GPUs. Planning by file bytes would put that on GPUs that cannot hold it, so the planner and
`strata serve` size weights by these figures.

Q8_0 is counted as stored, but the stage worker still dequantises it to bfloat16 as well (1.9 times its file size):
keeping it quantised needs a GEMV that reads int8 blocks at the bandwidth cuBLAS reaches on bf16, and the first
Triton kernel for it did not (docs/benchmarks.md). Until the stage keeps Q8_0 as stored, a Q8_0 plan undercounts
its weights, as every plan did before this rule; counting Q8_0 at 2 bytes per element is the other way to close it.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType

# Tensor types a GPU stage holds exactly as the file stores them.
KEPT_AS_STORED: frozenset[GGMLQuantizationType] = frozenset(
    {GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0}
)
# Bytes per element of every other type once dequantised: GPUs compute in bfloat16.
COMPUTE_BYTES_PER_ELEMENT = 2


def resident_bytes(ggml_type: GGMLQuantizationType, *, elements: int, stored_bytes: int) -> int:
    """Bytes one tensor of `ggml_type` (`elements` values, `stored_bytes` in the file) takes on a GPU stage."""
    if ggml_type in KEPT_AS_STORED:
        return stored_bytes
    return elements * COMPUTE_BYTES_PER_ELEMENT
