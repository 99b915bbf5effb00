"""How many bytes a tensor takes once a stage has loaded it, which is not always what it takes in the file.

A stage keeps the quantised types people download in their GGUF blocks (strata.stage_worker.weights.formats): the
block bytes, split into one plane per field, so Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q6_K take exactly their size in the
file; Q4_K and Q5_K unpack their twelve bytes of 6-bit sub-scales into sixteen (148 bytes per 144-byte block, 180 per
176), so that a kernel reads a scale with one plain load. F16 and BF16 are kept at their size; F32 (norms, biases)
is cast to the 2-byte compute dtype. Every other type (the IQ and ternary quants, Q2_K, Q3_K) is dequantised to
2 bytes per element, and `strata inspect` says so per tensor type.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

Q = GGMLQuantizationType
# Tensor types already at the compute width, 2 bytes per element: a stage holds them at their size in the file.
COMPUTE_WIDTH_TYPES: frozenset[GGMLQuantizationType] = frozenset({Q.F16, Q.BF16})
# Bytes per element of a weight a stage dequantises: it computes in a 2-byte dtype.
COMPUTE_BYTES_PER_ELEMENT = 2
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


def resident_bytes(ggml_type: GGMLQuantizationType, *, elements: int, stored_bytes: int) -> int:
    """Bytes one tensor of `ggml_type` (`elements` values, `stored_bytes` in the file) takes on a stage."""
    if ggml_type in COMPUTE_WIDTH_TYPES:
        return stored_bytes
    if ggml_type in KEPT_BLOCK_BYTES:
        return elements // GGML_QUANT_SIZES[ggml_type][0] * KEPT_BLOCK_BYTES[ggml_type]
    return elements * COMPUTE_BYTES_PER_ELEMENT
