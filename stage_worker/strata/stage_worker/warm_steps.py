"""The decode steps a stage runs before it says it is ready, so that serving never waits for a compiler.

A GPU stage's decode step is compiled (torch.compile, Triton) and captured per (slots, rows a slot). The compiled
blocks take any batch size (dynamic shapes: one slot and two cover every size and depth at a width, each width
compiling its own), but a Triton kernel compiles again for each new variant of its launch: the attention kernel's
tiling and launch shape follow the batch, and the products take other kernels by rows of x. Each compilation costs
seconds, so warming up only one and two slots left them to the first requests of each new shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from strata.stage_worker.decode import WIDEST, Decoder
from strata.stage_worker.errors import ContextExceededError, PoolExhaustedError
from strata.stage_worker.kernels.quant_matmul import rows_variant
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import StageModel


def warm_shapes(
    parallel: int, variant: Callable[[int, int], Hashable], widths: Sequence[int] = (1,)
) -> list[tuple[int, int]]:
    """The (slots, rows a slot) steps a stage runs before it says it is ready, so that serving never waits for a
    compiler: one slot and two at each of `widths`, the widths whose blocks are compiled (their shapes are dynamic in
    the batch, and these two cover every batch size and depth at that width), then the first shape of each kernel
    variant (`variant(slots, width)`: what picks the compiled Triton kernels) that any step of up to `parallel` slots
    and WIDEST rows a slot meets. Measured on an H200 before this (bench/speculative.py, Gemma 3 270M): each new
    variant met while serving cost its step seconds, and 16 streams decoded at a fifth of their speed."""
    shapes = sorted({(slots, width) for width in widths for slots in (1, min(2, parallel))}, key=lambda s: s[::-1])
    seen = {variant(slots, width) for slots, width in shapes}
    for width in range(1, WIDEST + 1):
        for slots in range(1, parallel + 1):
            key = variant(slots, width)
            if key not in seen:
                seen.add(key)
                shapes.append((slots, width))
    return shapes


def variant_of(model: StageModel, device: torch.device) -> Callable[[int, int], Hashable]:
    """What picks the compiled kernels of a decode step of (slots, width): on CUDA the attention kernel's tiling and
    launch, and the products' kernels by rows; elsewhere nothing is compiled."""
    if device.type != "cuda":
        return lambda slots, width: None
    from strata.stage_worker.kernels.paged_attention_triton import tile_shape

    c = model.config

    def variant(slots: int, width: int) -> Hashable:
        tiles = tile_shape(
            n_seq=slots, max_q_len=width, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim, device=device
        )
        return tiles.variant, rows_variant(slots * width)

    return variant


def warm_steps(*, decoder: Decoder, pool: KVPool, model: StageModel, dtype: torch.dtype) -> None:
    """Run (on GPUs: compile and capture) a decode step of each of `warm_shapes`, on cells taken and given back."""
    widths = decoder.compiled_widths or (1,)
    for batch, width in warm_shapes(pool.parallel, variant_of(model, decoder.device), widths):
        slots = list(range(batch))
        rows = batch * width
        hidden = None if model.is_first else torch.zeros(rows, model.config.dim, dtype=dtype, device=decoder.device)
        try:
            runs = pool.take_runs([(slot, 0, width) for slot in slots])  # all of them or none
        except (ContextExceededError, PoolExhaustedError):
            continue  # a pool too small for this shape never serves a step of it
        try:
            decoder.run(
                slots=[slot for slot in slots for _ in range(width)],
                positions=list(range(width)) * batch,
                cells=[cell for run in runs for cell in run],
                tokens=[0] * rows,
                hidden=hidden,
                width=width,
            )
        finally:  # a failed compilation leaves the slots empty too, for the engine that replaces this one
            for slot in slots:
                pool.reset(slot)
