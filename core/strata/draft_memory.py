"""The memory a draft model takes where it runs: in the gateway process, on the CPU (speculative decoding's method
"draft", strata.gateway.draft_model).

The draft loads as a stage of all its layers computing in float32: the quantised types a stage keeps stay in their
blocks, every other tensor becomes 4-byte values (ModelInfo.cpu_resident_bytes). Its KV pool holds `context` cells
shared by one slot per lane, in the draft's cache type, as a stage's pool (ModelInfo.kv_bytes). The operator adds
both to the gateway pod's memory request, and `strata serve` reports them, so that a draft never takes a gateway
past what its node set aside for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.gguf.model import CacheType, ModelInfo

# The draft's KV cache type: a stage's default; its rounding costs acceptance, never text.
DRAFT_CACHE_TYPE = CacheType.Q8_0
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class DraftMemory:
    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        """In MiB: a draft is small (Gemma 3 270M Q4_K_M holds 338 MiB on a CPU with 16 lanes over 16K cells), and
        GiB would round it away."""
        return (
            f"{self.total_bytes / MIB:,.1f} MiB ({self.weight_bytes / MIB:,.1f} MiB of weights, "
            f"{self.kv_bytes / MIB:,.1f} MiB of KV)"
        )


def draft_memory(
    draft: ModelInfo, *, context: int, slots: int, cache_type: CacheType, on_cpu: bool = True
) -> DraftMemory:
    """What the draft `draft` holds with a pool of `context` cells over `slots` slots in `cache_type`: on the CPU
    (float32), or on a GPU (`on_cpu` False: a stage's 2-byte compute dtype, ModelInfo.resident_total_bytes)."""
    if context < 1 or slots < 1:
        raise ValueError(f"a draft's pool needs a context ({context}) and slots ({slots}) of at least 1")
    if on_cpu and not draft.cpu_resident_bytes:
        raise ValueError(f"the draft {draft.name or draft.architecture} has no CPU figure: describe it from its header")
    kv = draft.kv_bytes(n_ctx=context, type_k=cache_type, type_v=cache_type, n_seq=slots)
    weights = draft.cpu_resident_bytes if on_cpu else draft.resident_total_bytes
    return DraftMemory(weight_bytes=weights, kv_bytes=kv)


def memory_request(base: str, draft: DraftMemory) -> str:
    """A memory request of `base` (a Kubernetes quantity in Mi or Gi) plus the draft's bytes, in whole Mi."""
    units = {"Mi": MIB, "Gi": GIB}
    number, unit = base[:-2], base[-2:]
    if unit not in units or not number.isdigit():
        raise ValueError(f"a base memory request must be whole Mi or Gi, not {base!r}")
    return f"{-(-(int(number) * units[unit] + draft.total_bytes) // MIB)}Mi"
