"""Stage models straight from a GGUF file, for tests that drive the layers without a stage server."""

from __future__ import annotations

from pathlib import Path

import torch
from strata.gguf.header import read_header
from strata.gguf.model import CacheType
from strata.gguf.sources import open_source
from strata.kv_layout import BLOCK_TOKENS
from strata.stage_worker.engine import Chunk, Engine, StepResult
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_resident import ResidentShape
from strata.stage_worker.loader import LoadProgress, load_stage
from strata.stage_worker.model import StageModel
from strata.stage_worker.stage_load import keep_resident

CPU = torch.device("cpu")


def load_spans(
    path: Path,
    spans: list[tuple[int, int]] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device = CPU,
) -> list[StageModel]:
    """The layers [start, end) of each span as a stage model; None: one stage of every layer."""
    source = open_source(str(path))
    try:
        header = read_header(source)
        if spans is None:
            layers = header.metadata[f"{header.metadata['general.architecture']}.block_count"]
            assert isinstance(layers, int)
            spans = [(0, layers)]
        return [
            load_stage(
                source=source,
                header=header,
                layer_start=start,
                layer_end=end,
                dtype=dtype,
                device=device,
                progress=LoadProgress(),
            )
            for start, end in spans
        ]
    finally:
        source.close()


def cpu_engines(
    path: Path,
    spans: list[tuple[int, int]],
    *,
    cache_type: CacheType,
    context: int = 64,
    parallel: int = 2,
    block: int = BLOCK_TOKENS,
    resident: ResidentShape | None = None,
    window_space: bool = False,
) -> list[Engine]:
    """An engine per span on the CPU, float32, each with a pool of `context` cells shared by `parallel` slots (and a
    resident window of that shape; `window_space`: sliding-window layers keep a space of their own, as a stage's
    pool does once the window is shorter than the context)."""
    built = []
    for (start, end), model in zip(spans, load_spans(path, spans), strict=True):
        c = model.config
        sliding = tuple(c.is_sliding(il) for il in range(start, end)) if window_space else ()
        pool = KVPool(
            n_layers=end - start, context=context, parallel=parallel, key_width=c.kv_dim, value_width=c.kv_dim,
            type_k=cache_type, type_v=cache_type, dtype=torch.float32, device=CPU, block=block,
            window=c.sliding_window if window_space else 0, sliding=sliding, window_slack=block,
        )  # fmt: skip
        if resident is not None:
            keep_resident(pool, c, layers=range(start, end), shape=resident)
        built.append(Engine(model=model, pool=pool, device=CPU, dtype=torch.float32))
    return built


def through(stages: list[Engine], chunks: list[Chunk]) -> StepResult:
    """One step through every stage in order, each stage's hidden states into the next; the last stage's result."""
    hidden = None
    for engine in stages:
        result = engine.step(chunks, hidden)
        hidden = result.hidden
    return result
