"""Building a stage's engine from its settings: its tensors read from the file, its KV pool, its warmed decode step.

strata.stage_worker.server runs this on the stage's loader thread and turns whatever it raises into the stage's
load status; here every step may fail (a file cut short, memory that runs out, a decode step that runs on no path).
"""

from __future__ import annotations

import logging
import threading

import torch
from strata.gguf import read_header
from strata.gguf.model import CacheType
from strata.gguf.sources import open_source
from strata.stage_worker.engine import Engine
from strata.stage_worker.errors import InvalidRequestError
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_resident import ResidentShape
from strata.stage_worker.loader import LoadProgress, load_stage
from strata.stage_worker.model_config import ModelConfig
from strata.stage_worker.settings import StageSettings
from strata.stage_worker.warm_up import warm_engine

log = logging.getLogger(__name__)


def build_engine(
    settings: StageSettings, *, has_next: bool, progress: LoadProgress, cancelled: threading.Event
) -> Engine:
    """The stage's engine, ready to serve; `has_next`: a next stage follows it (in this process or another)."""
    s = settings
    source = open_source(s.model_url)
    try:
        header = read_header(source)
        model = load_stage(
            source=source,
            header=header,
            layer_start=s.layer_start,
            layer_end=s.layer_end,
            dtype=s.compute_dtype,
            device=s.torch_device,
            progress=progress,
            cancelled=cancelled,
        )
    finally:
        source.close()
    c = model.config
    if model.is_last == has_next:
        raise InvalidRequestError(
            f"layers [{s.layer_start}, {s.layer_end}) of {c.n_layer} "
            + ("end the model, yet a next stage is set" if model.is_last else "need a next stage")
        )
    pool = stage_pool(
        c,
        layers=range(s.layer_start, s.layer_end),
        context=s.context,
        parallel=s.parallel,
        cache_types=(s.cache_type_k, s.cache_type_v),
        dtype=s.compute_dtype,
        device=s.torch_device,
        resident=s.resident_shape,
    )
    return warm_engine(model=model, pool=pool, device=s.torch_device, dtype=s.compute_dtype, stage_index=s.stage_index)


def stage_pool(
    config: ModelConfig,
    *,
    layers: range,
    context: int,
    parallel: int,
    cache_types: tuple[CacheType, CacheType],
    dtype: torch.dtype,
    device: torch.device,
    resident: ResidentShape | None = None,
) -> KVPool:
    """The KV pool of the model's `layers`: K and V in their cache types, the sliding-window layers in a space of
    their own, and a resident window for decode when one is asked for."""
    pool = KVPool(
        n_layers=len(layers),
        context=context,
        parallel=parallel,
        key_width=config.kv_dim,
        value_width=config.kv_dim,
        type_k=cache_types[0],
        type_v=cache_types[1],
        dtype=dtype,
        device=device,
        window=config.sliding_window,
        sliding=tuple(config.is_sliding(il) for il in layers),
    )
    if resident is not None:
        keep_resident(pool, config, layers=layers, shape=resident)
    return pool


def keep_resident(pool: KVPool, config: ModelConfig, *, layers: range, shape: ResidentShape) -> None:
    """Give the pool of the model's `layers` a resident window of `shape`, chosen by its full-attention layers. A
    stage of sliding-window layers only keeps none: each of its steps reads a window already."""
    scales = [None if config.is_sliding(il) else config.attention_rule(il).scale for il in layers]
    if not any(scale is not None for scale in scales):
        return
    pool.keep_resident(shape, n_head=config.n_head, head_dim=config.head_dim, scales=scales)
    log.info(
        "layers [%d, %d): decode attends over a resident window of at most %d positions a slot: %d sink blocks, %d "
        "chosen, %d recent positions (blocks of %d)",
        layers.start, layers.stop, shape.tokens, shape.sinks, shape.selected, shape.recent, shape.block,
    )  # fmt: skip
