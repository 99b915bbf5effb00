"""A model's byte counts as prefix sums, so any span of layers is priced in constant time.

The search asks "do layers [a, b) fit on this GPU at context c?" thousands of times. ModelInfo answers by walking
the layers; here the same numbers come from prefix sums: weights, and KV bytes per cell split into full-attention
layers (which hold the context in whole blocks) and sliding-window layers (which hold about window * slots + ubatch
cells in whole blocks; strata.kv_layout).
Weights are the bytes a stage holds once loaded (ModelInfo's resident figures, strata.gguf.resident), not the
file's: the quantised types people download stay in their blocks (Q4_K and Q5_K a few percent larger), and the others
grow to 2 bytes per value, which planning by file size would not see.
`kv_bytes` equals ModelInfo.kv_bytes for every span; the tests hold it to that.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from strata.fit import KV_BUDGET_PERCENT
from strata.gguf.model import UBATCH_TOKENS, CacheType, ModelInfo
from strata.kv_layout import full_cells, window_space_cells
from strata.operator.planner.memory import buffer_bytes, prefix_cache_bytes


@dataclass(frozen=True)
class ModelProfile:
    layers: int
    native_context: int
    embedding_bytes: int  # every weight figure here is resident bytes on a GPU, not file bytes
    head_bytes: int
    head_bytes_beside_embeddings: int  # what the head adds on a stage that already holds token_embd
    middle_buffer_bytes: int
    last_buffer_bytes: int
    weight_prefix: tuple[int, ...]
    full_kv_prefix: tuple[int, ...]  # bytes per cell, full-attention layers
    window_kv_prefix: tuple[int, ...]  # bytes per cell, sliding-window layers
    window_cells: int  # cells a sliding-window layer holds at most
    slots: int  # parallel slots: each may leave part of its last block unused
    prefix_cache_fraction: float  # of what weights and buffers leave, reserved for prefix snapshots

    @classmethod
    def of(
        cls,
        model: ModelInfo,
        *,
        type_k: CacheType,
        type_v: CacheType,
        parallel: int,
        prefix_cache_fraction: float = 0.0,
        resident: bool = False,
    ) -> ModelProfile:
        cells = [
            model.kv_bytes_per_cell(il, type_k=type_k, type_v=type_v, resident=resident)
            for il in range(model.block_count)
        ]
        sliding = [model.is_sliding(il) for il in range(model.block_count)]
        window = model.sliding_window
        window_cells = 0
        if window is not None:
            window_cells = window_space_cells(window=window.window, slots=parallel, slack=UBATCH_TOKENS)
        head, embeddings = model.resident_head_bytes, model.resident_embedding_bytes
        head_beside_embeddings = head - embeddings if model.output_tied else head
        return cls(
            layers=model.block_count,
            native_context=model.context_length,
            embedding_bytes=embeddings,
            head_bytes=head,
            head_bytes_beside_embeddings=head_beside_embeddings,
            middle_buffer_bytes=buffer_bytes(model=model, output_head=False),
            last_buffer_bytes=buffer_bytes(model=model, output_head=True),
            weight_prefix=(0, *accumulate(model.layer_resident_bytes)),
            full_kv_prefix=(0, *accumulate(c * (not s) for c, s in zip(cells, sliding, strict=True))),
            window_kv_prefix=(0, *accumulate(c * s for c, s in zip(cells, sliding, strict=True))),
            window_cells=window_cells,
            slots=parallel,
            prefix_cache_fraction=prefix_cache_fraction,
        )

    def weight_bytes(self, start: int, end: int, *, first: bool, last: bool) -> int:
        """Layers [start, end), plus token_embd on the first stage and the head on the last (shared when tied)."""
        total = self.weight_prefix[end] - self.weight_prefix[start]
        if first:
            total += self.embedding_bytes
        if last:
            total += self.head_bytes_beside_embeddings if first else self.head_bytes
        return total

    def buffer_bytes(self, *, last: bool) -> int:
        return self.last_buffer_bytes if last else self.middle_buffer_bytes

    def prefix_cache_bytes(self, free: int) -> int:
        """The prefix cache a stage reserves when weights and buffers leave it `free` bytes."""
        return prefix_cache_bytes(free=free, fraction=self.prefix_cache_fraction)

    def kv_free_bytes(self, free: int) -> int:
        """What the KV cache may use of `free`: 85% of it once the prefix cache has its share."""
        return max(0, free - self.prefix_cache_bytes(free)) * KV_BUDGET_PERCENT // 100

    def kv_bytes(self, start: int, end: int, context: int) -> int:
        """KV bytes of layers [start, end) for one unified pool of `context` cells (lanes share it)."""
        full = self.full_kv_prefix[end] - self.full_kv_prefix[start]
        window = self.window_kv_prefix[end] - self.window_kv_prefix[start]
        cells = full_cells(context, slots=self.slots)
        return cells * full + min(cells, self.window_cells) * window
