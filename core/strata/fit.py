"""The fitting rules every plan follows: the cluster planner's (strata.operator.planner) and `strata serve`'s alike.

Contexts: a context is only worth serving if it holds a real conversation (the floor, 512 tokens), and runtimes
allocate KV in blocks, so a plan snaps down: to a multiple of 256 by default, or to a power of two. The native
context (what the model was trained for) caps everything; a model whose native context is below the floor is offered
exactly its native context. Memory: headroom stays free on every device, and the KV cache takes 85% of what the
rest leaves, stored as q8_0 unless the user says otherwise.

They live here, below every component, so the gateway's single-machine plan follows the same rules without
importing the operator.
"""

from __future__ import annotations

from enum import StrEnum

from strata.gguf.model import CacheType

CONTEXT_FLOOR = 512
CONTEXT_STEP = 256
# GPU memory kept free by default, beside (at least) the backend's runtime overhead.
DEFAULT_HEADROOM_FRACTION = 0.10
# The KV cache gets this share of what weights, buffers and the prefix cache leave; the rest absorbs fragmentation.
KV_BUDGET_PERCENT = 85  # kv_budget = (usable - weights - buffers - prefix cache) * 0.85
# The KV cache type unless the user picks one: half of f16's memory, with negligible quality loss.
DEFAULT_CACHE_TYPE = CacheType.Q8_0


class ContextSnap(StrEnum):
    STEP = "step"  # multiples of CONTEXT_STEP
    POWER_OF_TWO = "power-of-two"


def snap_down(tokens: int, *, snap: ContextSnap = ContextSnap.STEP) -> int:
    """The largest tidy context at most `tokens`; 0 when even the floor does not fit."""
    if tokens < CONTEXT_FLOOR:
        return 0
    if snap is ContextSnap.POWER_OF_TWO:
        return 1 << (tokens.bit_length() - 1)
    return tokens // CONTEXT_STEP * CONTEXT_STEP


def candidate_contexts(*, native: int, snap: ContextSnap = ContextSnap.STEP) -> list[int]:
    """Every context the search may pick, ascending, the largest being snap_down(native)."""
    if native < CONTEXT_FLOOR:
        return [native] if native > 0 else []
    top = snap_down(native, snap=snap)
    if snap is ContextSnap.POWER_OF_TWO:
        return [1 << bit for bit in range(CONTEXT_FLOOR.bit_length() - 1, top.bit_length())]
    return list(range(CONTEXT_FLOOR, top + 1, CONTEXT_STEP))
