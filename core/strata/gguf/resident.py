"""How many bytes a tensor takes once a stage has loaded it, which is not always what it takes in the file.

A stage keeps the quantised types people download in their GGUF blocks (strata.stage_worker.weights.formats): the
block bytes, split into one plane per field, so Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q6_K take exactly their size in the
file; Q4_K and Q5_K unpack their twelve bytes of 6-bit sub-scales into sixteen (148 bytes per 144-byte block, 180 per
176), so that a kernel reads a scale with one plain load. F16 and BF16 are kept at their size; F32 (norms, biases)
is cast to the 2-byte compute dtype. Every other type (the IQ and ternary quants, Q2_K, Q3_K) is dequantised to
2 bytes per element, and `strata inspect` says so per tensor type.

A mixture of experts' stacked expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps) are the exception: a stage
dequantises them at load to the 2-byte compute dtype, whatever their type, because its grouped matmul over the
experts (strata.stage_worker.experts) takes plain values. For a Q4_K expert that is about 3.5 times its size in the
file, and the planner counts exactly that: every expert, at 2 bytes per element (F16 and BF16 at their size).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from strata.gguf.architectures import STACKED_EXPERT_TENSORS

Q = GGMLQuantizationType
# Tensor types already at the compute width, 2 bytes per element: a stage holds them at their size in the file.
COMPUTE_WIDTH_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F16, Q.BF16})
# Bytes per element of a weight a stage dequantises: it computes in a 2-byte dtype.
COMPUTE_BYTES_PER_ELEMENT = 2
CPU_BYTES = 4  # a CPU computes in float32 (strata.stage_worker.settings.default_dtype)
# Quantised types a stage keeps in their blocks -> bytes one block takes there (its size in the file, plus the
# unpacked sub-scales of Q4_K and Q5_K).
KEPT_BLOCK_BYTES: dict[GGMLQuantizationType, int] = {
    Q.Q8_0: 34,
    Q.Q4_0: 18,
    Q.Q4_1: 20,
    Q.Q5_0: 22,
    Q.Q5_1: 24,
    Q.Q4_K: 148,
    Q.Q5_K: 180,
    Q.Q6_K: 210,
}


def kept_quantised(ggml_type: GGMLQuantizationType) -> bool:
    """Whether a stage keeps this type in its blocks (otherwise it holds plain 2-byte values)."""
    return ggml_type in KEPT_BLOCK_BYTES


def stacked_experts(name: str) -> bool:
    """Whether the file's tensor `name` (blk.N.ffn_up_exps.weight) holds a mixture's stacked experts."""
    return name.startswith("blk.") and name.split(".", 2)[-1] in STACKED_EXPERT_TENSORS


def resident_bytes(
    ggml_type: GGMLQuantizationType,
    *,
    name: str,
    elements: int,
    stored_bytes: int,
    compute_bytes: int = COMPUTE_BYTES_PER_ELEMENT,
) -> int:
    """Bytes the file's tensor `name` of `ggml_type` (`elements` values, `stored_bytes` in the file) takes on a
    stage computing in a dtype of `compute_bytes` a value (2 on GPUs; 4 on the CPU, which computes in float32)."""
    if ggml_type in COMPUTE_WIDTH_TYPES and compute_bytes == COMPUTE_BYTES_PER_ELEMENT:
        return stored_bytes
    if ggml_type in KEPT_BLOCK_BYTES and not stacked_experts(name):
        block_elements: int = GGML_QUANT_SIZES[ggml_type][0]
        return elements // block_elements * KEPT_BLOCK_BYTES[ggml_type]
    return elements * compute_bytes
