"""What Strata knows about a model once its GGUF header is read: shapes, byte counts and KV-cache arithmetic.

Everything here is pure data and arithmetic, shared by the planner (which sizes stages and context), the stage
worker (which sizes its KV pool) and the gateway. The formulas follow llama.cpp's conventions (DESIGN.md, "Model
metadata"), so a plan matches what a llama.cpp-style runtime would allocate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from strata.gguf.executable import not_executable_reason
from strata.kv_layout import full_cells, resident_bytes_per_cell, window_cells

# Tokens per micro-batch (llama.cpp's n_ubatch): the planner sizes compute buffers by it, and a sliding-window layer
# keeps this many cells beyond its slots' windows for the new rows of a step.
UBATCH_TOKENS = 512


class CacheType(StrEnum):
    """KV-cache element types a plan may choose (llama.cpp's `--cache-type-k/-v` names)."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    IQ4_NL = "iq4_nl"


# (bytes per block, elements per block) for each cache type.
CACHE_BLOCKS: dict[CacheType, tuple[int, int]] = {
    CacheType.F32: (4, 1),
    CacheType.F16: (2, 1),
    CacheType.BF16: (2, 1),
    CacheType.Q8_0: (34, 32),
    CacheType.Q4_0: (18, 32),
    CacheType.Q4_1: (20, 32),
    CacheType.Q5_0: (22, 32),
    CacheType.Q5_1: (24, 32),
    CacheType.IQ4_NL: (18, 32),
}


def row_bytes(cache_type: CacheType, elements: int) -> int:
    """nb(t, n) = ceil(n / block_t) * bytes_t: bytes to store `elements` values of `cache_type`."""
    block_bytes, block_elements = CACHE_BLOCKS[cache_type]
    return math.ceil(elements / block_elements) * block_bytes


@dataclass(frozen=True)
class RopeSettings:
    freq_base: float
    dimension_count: int
    scaling_type: str | None = None
    scaling_factor: float | None = None
    original_context_length: int | None = None


@dataclass(frozen=True)
class SlidingWindow:
    """Sliding-window attention: `window` tokens, on the layers flagged True in `layers`."""

    window: int
    layers: tuple[bool, ...]

    def cells(self, *, n_ctx: int, n_seq: int, n_ubatch: int = UBATCH_TOKENS) -> int:
        """KV cells a sliding-window layer holds: about window * n_seq + n_ubatch in whole blocks, at most the full
        space (strata.kv_layout)."""
        return window_cells(window=self.window, slots=n_seq, context=n_ctx, slack=n_ubatch)


@dataclass(frozen=True)
class ModelInfo:
    """The typed description of a GGUF model; built by the header reader, or directly in tests."""

    architecture: str
    block_count: int
    embedding_length: int
    head_count: int
    head_count_kv: tuple[int, ...]  # one entry per layer (a scalar in the file is repeated)
    key_length: int
    value_length: int
    context_length: int
    vocab_size: int
    layer_bytes: tuple[int, ...]  # in the file, one entry per layer: the sum of that layer's blk.N.* tensors
    non_layer_bytes: dict[str, int]  # in the file, by tensor role: token_embd, output_norm, output
    # The same tensors once a GPU stage holds them (strata.gguf.resident): what plans size stages by. They differ
    # from the file's figures for every type but F16 and BF16.
    layer_resident_bytes: tuple[int, ...]
    non_layer_resident_bytes: dict[str, int]
    output_tied: bool  # no `output` tensor: the head reuses token_embd
    # Every tensor once a CPU process holds it in float32 (strata.gguf.resident): what a draft model in the gateway
    # takes (strata.draft_memory). 0 where it was not worked out (a ModelInfo built by hand).
    cpu_resident_bytes: int = 0
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGML type name -> how many tensors have it
    rope: RopeSettings | None = None
    # What the file asks for that the stages do not apply although they run its architecture (a RoPE scaling),
    # in words naming the key; None when nothing.
    unsupported: str | None = None
    sliding_window: SlidingWindow | None = None
    expert_count: int = 0
    expert_used_count: int = 0
    name: str | None = None
    tokenizer_model: str | None = None
    tokenizer_pre: str | None = None
    has_chat_template: bool = False
    header_bytes: int = 0  # the header's size: where the tensor data starts
    header_bytes_read: int = 0  # bytes fetched to read the header (HTTP: the sum of the Range responses)
    file_bytes: int | None = None  # the whole file's size, when the source states it
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        per_layer = {
            "head_count_kv": len(self.head_count_kv),
            "layer_bytes": len(self.layer_bytes),
            "layer_resident_bytes": len(self.layer_resident_bytes),
        }
        if any(count != self.block_count for count in per_layer.values()):
            counts = ", ".join(f"{name} has {count}" for name, count in per_layer.items())
            raise ValueError(f"per-layer fields must have block_count={self.block_count} entries: {counts}")

    @property
    def executable(self) -> bool:
        """Strata's stages run this model's architecture (strata.gguf.executable says why not otherwise)."""
        return self.not_executable_reason is None

    @property
    def not_executable_reason(self) -> str | None:
        """Why Strata's stages cannot run this model, or None (the check `strata serve` and the operator make)."""
        return not_executable_reason(self.architecture, unsupported=self.unsupported)

    @property
    def total_bytes(self) -> int:
        """Every tensor's bytes in the file."""
        return sum(self.layer_bytes) + sum(self.non_layer_bytes.values())

    @property
    def head_bytes(self) -> int:
        """File bytes of the output head the last stage carries (token_embd again when tied)."""
        return _head_bytes(self.non_layer_bytes, tied=self.output_tied)

    @property
    def embedding_bytes(self) -> int:
        """File bytes of token_embd."""
        return self.non_layer_bytes.get("token_embd", 0)

    @property
    def resident_total_bytes(self) -> int:
        """Every tensor's bytes once loaded on GPU stages (token_embd once, even when the head reuses it)."""
        return sum(self.layer_resident_bytes) + sum(self.non_layer_resident_bytes.values())

    @property
    def resident_head_bytes(self) -> int:
        """Bytes the output head takes on the last stage's GPU (token_embd again when tied)."""
        return _head_bytes(self.non_layer_resident_bytes, tied=self.output_tied)

    @property
    def resident_embedding_bytes(self) -> int:
        """Bytes token_embd takes on the first stage's GPU."""
        return self.non_layer_resident_bytes.get("token_embd", 0)

    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and self.sliding_window.layers[layer]

    def kv_bytes_per_cell(self, layer: int, *, type_k: CacheType, type_v: CacheType, resident: bool = False) -> int:
        """Bytes one KV cell (one token) takes in `layer`: nb(type_k, nkv*hk) + nb(type_v, nkv*hv), and with
        `resident` its share of a full-attention layer's resident window (strata.kv_layout)."""
        n_kv = self.head_count_kv[layer]
        cell = row_bytes(type_k, n_kv * self.key_length) + row_bytes(type_v, n_kv * self.value_length)
        if resident and not self.is_sliding(layer):
            cell += resident_bytes_per_cell(n_kv * self.key_length)
        return cell

    def kv_bytes_per_token(self, *, type_k: CacheType, type_v: CacheType, layers: Iterable[int] | None = None) -> int:
        """KV bytes per token summed over `layers` (all by default), as if every layer held the full context."""
        span = range(self.block_count) if layers is None else layers
        return sum(self.kv_bytes_per_cell(il, type_k=type_k, type_v=type_v) for il in span)

    def kv_bytes(
        self,
        *,
        n_ctx: int,
        type_k: CacheType,
        type_v: CacheType,
        layers: Iterable[int] | None = None,
        n_seq: int = 1,
        n_ubatch: int = 512,
        resident: bool = False,
    ) -> int:
        """Total KV bytes for `layers` at context `n_ctx` in a paged pool: the context in whole blocks, fewer cells in
        sliding-window layers; with `resident`, a resident window's key bounds in the full-attention layers."""
        span = range(self.block_count) if layers is None else layers
        total = 0
        for il in span:
            cells = full_cells(n_ctx, slots=n_seq)
            if self.sliding_window is not None and self.sliding_window.layers[il]:
                cells = self.sliding_window.cells(n_ctx=n_ctx, n_seq=n_seq, n_ubatch=n_ubatch)
            total += cells * self.kv_bytes_per_cell(il, type_k=type_k, type_v=type_v, resident=resident)
        return total


def _head_bytes(by_role: dict[str, int], *, tied: bool) -> int:
    return by_role.get("token_embd" if tied else "output", 0) + by_role.get("output_norm", 0)
