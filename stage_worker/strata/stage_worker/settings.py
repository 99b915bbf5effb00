"""What one stage pod is told to be: its span, the model, the KV pool, its neighbours, its device.

The operator sets these through the environment of the stage's container; the same names work as command-line
flags (`strata stage-worker --help`), and a flag wins over the environment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from strata.gguf.model import CacheType
from strata.kv_layout import BLOCK_TOKENS, ResidentBudget
from strata.stage_worker.kv_resident import ResidentShape

COMPUTE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_dtype(device: torch.device) -> torch.dtype:
    """The compute dtype where none is asked for: float32 on the CPU, bfloat16 on GPUs."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


@dataclass(frozen=True)
class StageSettings:
    stage_index: int
    layer_start: int
    layer_end: int
    model_url: str  # a local path, file:// or http(s):// URL of the GGUF file
    context: int  # KV cells in the unified pool
    parallel: int  # slots sharing the pool
    cache_type_k: CacheType = CacheType.Q8_0
    cache_type_v: CacheType = CacheType.Q8_0
    next_stage: str = ""  # host:port of the next stage; empty on the last stage
    listen: str = "0.0.0.0:50051"
    device: str = "cpu"  # torch device: cpu, cuda, cuda:1 (ROCm builds of torch also say cuda)
    dtype: str = ""  # compute dtype; empty: float32 on CPU, bfloat16 on GPUs
    plan_generation: int = 0
    step_timeout_s: float = 120.0  # how long a step may wait for the next stage's reply
    prefix_cache_bytes: int = 0  # device bytes for prefix snapshots (the plan reserves them); 0 keeps none
    kv_host_bytes: int = 0  # host bytes for snapshots the device lets go of (spec.kvCache.hostMemory); 0 keeps none
    pipeline_chunk: int = 512  # the first stage sends a longer prefill on in pieces of this many positions; 0: whole
    # Activations from a previous stage on this host come through a shared-memory ring of `hop_slots` slots of
    # `hop_slot_positions` positions each (a larger step comes inline); 0 slots: always inline.
    hop_slots: int = 4
    hop_slot_positions: int = 1024
    # Decode attends over a resident window of this many positions a slot (strata.stage_worker.kv_resident): the
    # first `resident_sink_tokens`, the last `resident_recent_tokens` and blocks chosen between them; 0: every
    # position (exact).
    resident_tokens: int = 0
    resident_sink_tokens: int = 64
    resident_recent_tokens: int = 1024

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"layer span [{self.layer_start}, {self.layer_end}) is empty or negative")
        if self.context < 1 or self.parallel < 1:
            raise ValueError(f"context ({self.context}) and parallel ({self.parallel}) must be positive")
        if self.pipeline_chunk < 0:
            raise ValueError(f"the pipeline chunk must not be negative, not {self.pipeline_chunk}")
        if self.hop_slots < 0 or self.hop_slot_positions < 1:
            raise ValueError(
                f"the shared hop needs 0 or more slots of 1 or more positions, not {self.hop_slots} of "
                f"{self.hop_slot_positions}"
            )
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"the prefix cache budget must not be negative, not {self.prefix_cache_bytes}")
        if self.kv_host_bytes < 0:
            raise ValueError(f"the host KV budget must not be negative, not {self.kv_host_bytes}")
        _ = self.resident_shape  # a window that leaves nothing to choose is refused here, before the model loads
        if self.dtype and self.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")

    @property
    def resident_shape(self) -> ResidentShape | None:
        if not self.resident_tokens:
            return None
        budget = ResidentBudget(
            tokens=self.resident_tokens, sink_tokens=self.resident_sink_tokens,
            recent_tokens=self.resident_recent_tokens,
        )  # fmt: skip
        return ResidentShape.of(budget, block=BLOCK_TOKENS)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def compute_dtype(self) -> torch.dtype:
        if self.dtype:
            return COMPUTE_DTYPES[self.dtype]
        return default_dtype(self.torch_device)
