"""A small KV pool on the CPU and random K/V written into it: the prefix cache's and the host tier's tests share
them."""

from __future__ import annotations

import torch
from strata.gguf.model import CacheType
from strata.stage_worker.kv_pool import KVPool

CPU = torch.device("cpu")
WIDTH = 64  # K and V values a position, each
LAYERS = 2  # with a window, the first is a sliding-window layer
BLOCK = 8  # the lengths in those tests are whole blocks, so free cells count positions


def small_pool(cache_type: CacheType, *, context: int = 64, parallel: int = 3, window: int = 0) -> KVPool:
    return KVPool(
        n_layers=LAYERS,
        context=context,
        parallel=parallel,
        key_width=WIDTH,
        value_width=WIDTH,
        type_k=cache_type,
        type_v=cache_type,
        dtype=torch.float32,
        device=CPU,
        block=BLOCK,
        window=window,
        sliding=(True, False) if window else (),
        window_slack=BLOCK,
    )


def prefill(kv: KVPool, *, slot: int, length: int, seed: int) -> None:
    """Write random K and V for positions 0..length-1 of `slot` in every layer's cells, as the forward pass would."""
    generator = torch.Generator().manual_seed(seed)
    placed = kv.extend(slot=slot, start_position=0, length=length)
    for layer, windowed in zip(kv.layers, kv.windowed, strict=True):
        cells = placed.window.new if windowed and placed.window is not None else placed.full.new
        layer.write(
            cells, torch.randn(length, WIDTH, generator=generator), torch.randn(length, WIDTH, generator=generator)
        )
