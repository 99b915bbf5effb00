"""Local pipelines for tests and benchmarks: stage servers on loopback, in this process, last stage first. Each stage
runs alone, as a stage process runs it (its next stage reached over gRPC), or all of them co-located, as the stages of
one process that share a device (strata.stage_worker.co_located: the activations handed over in memory)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strata.gguf.model import CacheType
from strata.stage_worker.co_located import CoLocatedStages
from strata.stage_worker.server import RunningStage
from strata.stage_worker.settings import StageSettings


@contextmanager
def local_pipeline(
    model: Path,
    spans: list[tuple[int, int]],
    *,
    context: int = 128,
    parallel: int = 2,
    cache_type: CacheType = CacheType.F32,
    prefix_cache_bytes: int = 0,
    kv_host_bytes: int = 0,
    plan_generation: int = 0,
    load_timeout_s: float = 60.0,
    pipeline_chunk: int = 512,
    co_located: bool = False,
) -> Iterator[list[RunningStage]]:
    """Start one stage per span; yields them first to last once all have loaded."""

    def settings(index: int, next_stage: str) -> StageSettings:
        start, end = spans[index]
        return StageSettings(
            stage_index=index,
            layer_start=start,
            layer_end=end,
            model_url=str(model),
            context=context,
            parallel=parallel,
            cache_type_k=cache_type,
            cache_type_v=cache_type,
            next_stage=next_stage,
            listen="127.0.0.1:0",
            prefix_cache_bytes=prefix_cache_bytes,
            kv_host_bytes=kv_host_bytes,
            plan_generation=plan_generation,
            pipeline_chunk=pipeline_chunk,
        )

    stages: list[RunningStage] = []
    try:
        if co_located:
            stages = CoLocatedStages([settings(index, "") for index in range(len(spans))]).stages
        else:
            next_stage = ""
            for index in reversed(range(len(spans))):
                stage = RunningStage(settings(index, next_stage))
                stages.insert(0, stage)
                next_stage = f"127.0.0.1:{stage.port}"
        deadline = time.monotonic() + load_timeout_s
        for stage in stages:
            stage.loader.join(max(0.0, deadline - time.monotonic()))
            if stage.service.progress.error or not stage.service.progress.loaded:
                raise RuntimeError(f"stage {stage.service.settings.stage_index} did not load: {stage.service.progress}")
        yield stages
    finally:
        for stage in stages:
            stage.stop(0)
