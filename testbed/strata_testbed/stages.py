"""Stage models straight from a GGUF file, for tests that drive the layers without a stage server."""

from __future__ import annotations

from pathlib import Path

import torch
from strata.gguf.header import read_header
from strata.gguf.sources import open_source
from strata.stage_worker.loader import LoadProgress, load_stage
from strata.stage_worker.model import StageModel

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
