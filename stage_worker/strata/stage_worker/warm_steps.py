"""The decode steps a stage runs before it says it is ready, so that serving never waits for a compiler.

A GPU stage's decode step is compiled (torch.compile, Triton) and captured per (slots, rows a slot). The compiled
blocks take any batch size (dynamic shapes: one slot and two cover every size and depth at a width, each width
compiling its own), but a Triton kernel compiles again for each new variant of its launch: the attention kernel's
tiling and launch shape follow the batch, and the products take other kernels by rows of x. Each compilation costs
seconds, so warming up only one and two slots left them to the first requests of each new shape.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

import torch
from strata.stage_worker.decode import WIDEST, Decoder
from strata.stage_worker.errors import ContextExceededError, PoolExhaustedError
from strata.stage_worker.kernels.quant_matmul import rows_variant
from strata.stage_worker.kv_cells import Piece
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.model import StageModel
from torch import Tensor


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


def attention_variant(model: StageModel, device: torch.device) -> Callable[[int, int], Hashable]:
    """What picks the attention kernel's compiled variant for a step of (sequences, rows of the longest): on CUDA its
    tiling and launch; elsewhere nothing is compiled."""
    if device.type != "cuda":
        return lambda sequences, rows: None
    from strata.stage_worker.kernels.paged_attention_triton import tile_shape

    c = model.config

    def variant(sequences: int, rows: int) -> Hashable:
        return tile_shape(
            n_seq=sequences, max_q_len=rows, n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim, device=device
        ).variant

    return variant


def variant_of(model: StageModel, device: torch.device) -> Callable[[int, int], Hashable]:
    """What picks the compiled kernels of a decode step of (slots, width): on CUDA the attention kernel's tiling and
    launch, and the products' kernels by rows; elsewhere nothing is compiled."""
    if device.type != "cuda":
        return lambda slots, width: None
    attention = attention_variant(model, device)
    return lambda slots, width: (attention(slots, width), rows_variant(slots * width))


def prefill_shapes(
    parallel: int,
    variant: Callable[[int, int], Hashable],
    *,
    tile: int,
    most_tiles: Callable[[int], int],
    met: Iterable[Hashable] = (),
) -> list[tuple[int, int]]:
    """(sequences, rows of the longest) of the prefill steps a stage runs before it says it is ready: for each
    attention variant (`variant(sequences, rows)`) that a step of up to `parallel` sequences meets and the decode
    steps did not (`met`), the step of it that takes the fewest cells: one sequence of that many rows, the others of
    one row each (a prefill beside decoding slots), fewest sequences first. `tile`: the query rows a program of the
    kernel takes, by which the variant may change; `most_tiles(sequences)`: the tiles a sequence may take past which
    the variant no longer changes (or the pool ends). A step attends all its sequences in one launch
    (strata.stage_worker.model), whose variant follows their number and the longest, so without these the first
    batch of new prompts, or the first long one, waited seconds for a compiler."""
    best: dict[Hashable, tuple[int, int, int]] = {}
    known = set(met)
    for sequences in range(1, parallel + 1):
        for tiles in range(1, most_tiles(sequences) + 1):
            rows = max(2, (tiles - 1) * tile + 1)
            key = variant(sequences, rows)
            cells = rows + sequences - 1
            if key not in known and (key not in best or cells < best[key][0]):
                best[key] = (cells, sequences, rows)
    return [(sequences, rows) for _, sequences, rows in sorted(best.values())]


def prefill_probes(
    *, n_head: int, n_head_kv: int, head_dim: int, context: int, device: torch.device
) -> tuple[int, Callable[[int], int]]:
    """`prefill_shapes`' tile and most_tiles for the attention kernel's launch rule: rows probed a short chunk's tile
    apart, as far as a long chunk's (wider) tiles saturate the launch, or the pool ends."""
    from strata.stage_worker.kernels.paged_attention_triton import saturating_programs, tile_shape

    def block_t(rows: int) -> int:
        shape = tile_shape(
            n_seq=1, max_q_len=rows, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, device=device
        )
        return shape.block_t

    tile, widest = block_t(2), block_t(max(2, context))
    pool_tiles, saturated = -(-context // tile), saturating_programs(device)

    def most_tiles(sequences: int) -> int:
        # Programs are sequences x tiles x KV heads; past `saturated` the launch is the same (one split, most warps).
        return min(pool_tiles, -(-saturated // (sequences * n_head_kv)) * (widest // tile))

    return tile, most_tiles


def warm_steps(*, decoder: Decoder, pool: KVPool, model: StageModel, dtype: torch.dtype) -> list[tuple[int, int]]:
    """Run (on GPUs: compile and capture) a decode step of each of `warm_shapes`, on cells taken and given back;
    returns them."""
    widths = decoder.compiled_widths or (1,)
    shapes = warm_shapes(pool.parallel, variant_of(model, decoder.device), widths)
    for batch, width in shapes:
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
    return shapes


def warm_prefill(
    *,
    forward: Callable[[list[Piece], Tensor], Tensor],
    pool: KVPool,
    model: StageModel,
    device: torch.device,
    dtype: torch.dtype,
    met: Iterable[tuple[int, int]],
    variant: Callable[[int, int], Hashable] | None = None,
) -> list[tuple[int, int]]:
    """Run a prefill step (`forward`: the engine's, over pieces and their rows' hidden state) of each of
    `prefill_shapes` that the pool can hold, on cells taken and given back; returns them. `met`: the (slots, width) of
    the decode steps already run, whose variants need no prefill step; `variant`: what picks the attention kernel's
    compiled variant (default: `attention_variant`; on the CPU nothing compiles, and no step runs)."""
    if variant is None:
        if device.type != "cuda":
            return []
        variant = attention_variant(model, device)
    c = model.config
    tile, most_tiles = prefill_probes(
        n_head=c.n_head, n_head_kv=c.n_head_kv, head_dim=c.head_dim, context=pool.context, device=device
    )
    decoded = {variant(slots, width) for slots, width in met}
    ran = []
    for sequences, rows in prefill_shapes(pool.parallel, variant, tile=tile, most_tiles=most_tiles, met=decoded):
        pieces = [(0, 0, rows), *((slot, 0, 1) for slot in range(1, sequences))]
        hidden = torch.zeros(rows + sequences - 1, c.dim, dtype=dtype, device=device)
        try:
            forward(pieces, hidden)
        except (ContextExceededError, PoolExhaustedError):
            continue  # a pool too small for this step never serves one of it
        finally:
            for slot in range(sequences):
                pool.reset(slot)
        ran.append((sequences, rows))
    return ran


def warm_reads(pool: KVPool) -> bool:
    """Compile the kernel through which a lone prompt of FLASH_MIN_ROWS or more reads its q8_0 K and V back
    (kv_stores.LayerCache.read), reading one cell: no warm prefill step need be that long. True where it ran (a q8_0
    store on a GPU)."""
    q8 = (layer for layer in pool.layers if layer.keys.scales is not None or layer.values.scales is not None)
    layer = next(q8, None)
    if pool.device.type != "cuda" or layer is None:
        return False
    layer.read(torch.zeros(1, dtype=torch.long, device=pool.device))
    return True
