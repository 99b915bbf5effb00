"""The placement plan: which GPU runs which layers, with how much context; or why nothing fits.

The operator writes a Plan into the deployment's ConfigMap as JSON; the stage worker reads its own stage from it
(layer span, KV cells, cache types) and the gateway reads the context length and lane count. One schema for all
three, so it lives in shared code, and every field is plain JSON (byte counts as integers, enums as strings).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, computed_field
from strata.gguf.model import CacheType
from strata.kv_layout import ResidentBudget

GB = 1_000_000_000  # messages speak decimal gigabytes, as GPU datasheets do


class Backend(StrEnum):
    """The runtime a stage's GPU needs; the GPU's vendor decides it."""

    CUDA = "cuda"
    ROCM = "rocm"
    XPU = "xpu"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class Stage(_Frozen):
    """One pipeline stage: one GPU holding the contiguous layers [layer_start, layer_end)."""

    index: int = Field(ge=0)
    node: str
    resource: str  # the extended resource the stage pod requests, e.g. nvidia.com/gpu
    gpus: tuple[int, ...]  # ordinals among the GPUs this plan takes on `node`; the device plugin picks the devices
    backend: Backend
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=1)  # exclusive
    embeddings: bool  # carries token_embd (the first stage)
    output_head: bool  # carries output_norm and output (the last stage)
    memory_bytes: int = Field(ge=0)  # the GPU's memory, before headroom
    usable_bytes: int = Field(ge=0)  # memory minus headroom
    weight_bytes: int = Field(ge=0)  # its layers, plus embeddings and head where it carries them, as held on the GPU
    buffer_bytes: int = Field(ge=0)  # fixed compute buffers
    kv_bytes: int = Field(ge=0)  # its layers' KV cache at the plan's context
    prefix_cache_bytes: int = Field(default=0, ge=0)  # reserved for prefix snapshots of its layers' KV
    host_kv_bytes: int = Field(default=0, ge=0)  # host memory (not the GPU's) for KV blocks the GPU lets go of

    @property
    def spare_bytes(self) -> int:
        """Usable memory left once weights, buffers, KV and the prefix cache are in place."""
        return self.usable_bytes - self.weight_bytes - self.buffer_bytes - self.kv_bytes - self.prefix_cache_bytes


class Excluded(_Frozen):
    """A node the planner left out, with a reason a person can act on."""

    node: str
    reason: str


class Participant(_Frozen):
    """A GPU counted in a shortfall, with what it would have held at the smallest context."""

    node: str
    gpu: int
    usable_bytes: int
    weight_bytes: int  # as held on the GPU, not the file's size
    kv_bytes: int


class Shortfall(_Frozen):
    """Why no plan exists: the model at the smallest context needs more than the pool offers."""

    required_bytes: int
    available_bytes: int
    short_by_bytes: int
    gpu_count: int
    message: str
    participants: tuple[Participant, ...] = ()


class Plan(_Frozen):
    """The planner's answer: stages, context and cache types; or no stages and a shortfall."""

    stages: tuple[Stage, ...]
    context_length: int = Field(ge=0)
    parallel: int = Field(ge=1)
    cache_type_k: CacheType
    cache_type_v: CacheType
    kv_bytes_per_token: int = Field(ge=0)  # all layers, one cell each
    excluded: tuple[Excluded, ...] = ()
    shortfall: Shortfall | None = None
    # Decode attends over a resident window of each slot's positions (approximate past it); None: every position.
    resident_window: ResidentBudget | None = None

    @computed_field  # type: ignore[prop-decorator]
    @property
    def feasible(self) -> bool:
        return self.shortfall is None and bool(self.stages)
