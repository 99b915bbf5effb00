"""What a user may set on a plan. Every field left as None is the planner's to choose; every field set wins."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from strata.fit import DEFAULT_CACHE_TYPE, DEFAULT_HEADROOM_FRACTION, ContextSnap
from strata.gguf.model import CacheType
from strata.kv_layout import ResidentBudget
from strata.operator.planner.errors import InvalidOptionError
from strata.operator.planner.memory import DEFAULT_PREFIX_CACHE_FRACTION
from strata.operator.planner.scheduling import Toleration

DEFAULT_PARALLEL = 4  # lanes sharing the KV pool


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    context_length: int | None = None
    parallel: int = DEFAULT_PARALLEL
    cache_type_k: CacheType = DEFAULT_CACHE_TYPE
    cache_type_v: CacheType = DEFAULT_CACHE_TYPE
    max_stages: int | None = None
    headroom_fraction: float = DEFAULT_HEADROOM_FRACTION
    prefix_cache_fraction: float = DEFAULT_PREFIX_CACHE_FRACTION  # of what weights and buffers leave; 0: none
    context_snap: ContextSnap = ContextSnap.STEP
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    gpu_memory_bytes: int | None = None  # overrides every node's memory label
    host_kv_bytes: int = 0  # host memory per stage for KV blocks the GPU lets go of (spec.kvCache.hostMemory)
    resident_window: ResidentBudget | None = None  # decode over a resident window (spec.kvCache.residentWindow)

    def __post_init__(self) -> None:
        if self.context_length is not None and self.context_length < 1:
            raise InvalidOptionError(f"context length must be at least 1, not {self.context_length}")
        if self.parallel < 1:
            raise InvalidOptionError(f"parallel slots must be at least 1, not {self.parallel}")
        if self.max_stages is not None and self.max_stages < 1:
            raise InvalidOptionError(f"max stages must be at least 1, not {self.max_stages}")
        if not 0 <= self.headroom_fraction < 1:
            raise InvalidOptionError(f"headroom must be a fraction in [0, 1), not {self.headroom_fraction}")
        if not 0 <= self.prefix_cache_fraction < 1:
            raise InvalidOptionError(f"the prefix cache share must be in [0, 1), not {self.prefix_cache_fraction}")
        if self.resident_window is not None:
            try:
                self.resident_window.split()
            except ValueError as exc:
                raise InvalidOptionError(str(exc)) from exc
        if self.host_kv_bytes < 0:
            raise InvalidOptionError(f"host KV memory must not be negative, not {self.host_kv_bytes} bytes")
        if self.gpu_memory_bytes is not None and self.gpu_memory_bytes < 1:
            raise InvalidOptionError(f"GPU memory must be positive, not {self.gpu_memory_bytes} bytes")
