"""How much of a GPU a stage may use, and what besides weights and KV it must hold.

Usable memory is the GPU's memory minus headroom: a share of it (10% by default) but never less than what the
backend's runtime itself takes (context, library workspaces), which no setting can give back. Each stage also
needs fixed compute buffers: activations for one micro-batch, and on the last stage the logits. Of what is left
after weights and buffers, a share (5% by default) is reserved for prefix snapshots (restored by command so a resent
prompt is not prefilled again; strata.stage_worker.prefix_cache), and the rest goes to the KV cache at 85%, so
allocator slack never meets a full cache. A prefix cache share of 0 gives the KV cache what it had without one.
"""

from __future__ import annotations

from strata.fit import KV_BUDGET_PERCENT
from strata.gguf.model import UBATCH_TOKENS, ModelInfo
from strata.plan import Backend

GIB = 1 << 30
# What the runtime keeps for itself before any tensor is loaded: CUDA context and cuBLAS workspaces; HIP runtime
# and rocBLAS/hipBLASLt workspaces (larger); Level Zero and oneDNN on Intel.
RUNTIME_OVERHEAD_BYTES: dict[Backend, int] = {
    Backend.CUDA: 1 * GIB,
    Backend.ROCM: 3 * GIB // 2,
    Backend.XPU: 1 * GIB,
}
DEFAULT_PREFIX_CACHE_FRACTION = 0.05  # prefix cache = (usable - weights - buffers) * 0.05
ACTIVATION_BUFFERS = 16  # hidden-state-sized f32 tensors alive at once in one layer's graph (flash attention)
F32_BYTES = 4


def headroom_bytes(*, memory_bytes: int, backend: Backend, fraction: float) -> int:
    """The share of the GPU kept free: `fraction` of its memory, at least the backend's runtime overhead."""
    return max(int(memory_bytes * fraction), RUNTIME_OVERHEAD_BYTES[backend])


def usable_bytes(*, memory_bytes: int, backend: Backend, fraction: float) -> int:
    return max(0, memory_bytes - headroom_bytes(memory_bytes=memory_bytes, backend=backend, fraction=fraction))


def buffer_bytes(*, model: ModelInfo, output_head: bool) -> int:
    """Fixed compute buffers of a stage: activations for one micro-batch, plus the logits on the last stage."""
    activations = UBATCH_TOKENS * model.embedding_length * F32_BYTES * ACTIVATION_BUFFERS
    logits = UBATCH_TOKENS * model.vocab_size * F32_BYTES if output_head else 0
    return activations + logits


def prefix_cache_bytes(*, free: int, fraction: float) -> int:
    """Bytes a stage reserves for prefix snapshots: `fraction` of what its weights and buffers leave (`free`)."""
    return int(max(0, free) * fraction)


def kv_budget_bytes(*, usable: int, weights: int, buffers: int, prefix_cache_fraction: float = 0.0) -> int:
    """KV bytes a stage may hold: 85% of what weights, buffers and the prefix cache leave; zero when they do not fit."""
    free = max(0, usable - weights - buffers)
    return (free - prefix_cache_bytes(free=free, fraction=prefix_cache_fraction)) * KV_BUDGET_PERCENT // 100
