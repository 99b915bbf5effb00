"""Planning `strata serve` for this machine: every stage shares one device, so fitting the model is one sum.

The cluster planner (strata.operator.planner) searches pools of GPUs; the gateway may not import it (an import-linter
contract keeps operator code out of the data plane), and one machine has nothing to search: its stages take even
layer spans on the same device. It must still answer the planner's question, does the model fit and with how much
context, by the planner's rules: headroom stays free, the KV cache gets 85% of what the weights leave, the context
is snapped down to a multiple of 256 (never below 512), and a context the user asks for is honoured or refused with
what would fit, never shrunk. Compute buffers are small beside a machine's memory and come out of the headroom.
Weights count as the bytes a GPU stage holds once loaded (ModelInfo's resident figures), not the file's size. A CPU
stage computes in float32 and holds up to twice that; ModelInfo does not carry the element counts to say exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata.fit import DEFAULT_HEADROOM_FRACTION, KV_BUDGET_PERCENT, candidate_contexts
from strata.gateway.local import even_spans
from strata.gguf.model import CacheType, ModelInfo
from strata.plan import GB

# A workstation's memory serves everything else it runs too: unless asked, the context grows no further than this.
DEFAULT_CONTEXT_CAP = 4096
MEMINFO = Path("/proc/meminfo")


class LocalFitError(ValueError):
    """The model, or the context asked for, does not fit this machine's device; the message says by how much."""


@dataclass(frozen=True, kw_only=True)
class LocalPlan:
    spans: tuple[tuple[int, int], ...]
    context: int
    weight_bytes: int  # every stage's weights as loaded: the first adds token_embd, the last the output head
    kv_bytes: int  # every stage's KV pool at `context` (the lanes share each pool)
    usable_bytes: int | None  # None: the device's memory is unknown and nothing was checked


def stage_weight_bytes(model: ModelInfo, spans: list[tuple[int, int]]) -> int:
    """Resident weights over all stages; a tied output head shares token_embd only when one stage holds both."""
    head, embeddings = model.resident_head_bytes, model.resident_embedding_bytes
    if model.output_tied and len(spans) == 1:
        head -= embeddings
    return sum(model.layer_resident_bytes) + embeddings + head


def plan_local(
    *,
    model: ModelInfo,
    stages: int,
    parallel: int,
    cache_type: CacheType,
    available_bytes: int | None,
    context: int = 0,
) -> LocalPlan:
    """Spans, context and the bytes they take on a device with `available_bytes` free; `context` 0: the largest
    that fits, up to DEFAULT_CONTEXT_CAP. Raises ValueError for more stages than layers, LocalFitError when it does
    not fit."""
    spans = even_spans(model.block_count, stages)
    weights = stage_weight_bytes(model, spans)
    native = model.context_length
    if context > native:
        raise LocalFitError(f"context {context} exceeds the model's native context {native}")

    def kv(cells: int) -> int:
        return model.kv_bytes(n_ctx=cells, type_k=cache_type, type_v=cache_type, n_seq=parallel)

    def plan(cells: int, usable: int | None) -> LocalPlan:
        return LocalPlan(
            spans=tuple(spans), context=cells, weight_bytes=weights, kv_bytes=kv(cells), usable_bytes=usable
        )

    if available_bytes is None:
        return plan(context or min(native, DEFAULT_CONTEXT_CAP), None)
    usable = int(available_bytes * (1 - DEFAULT_HEADROOM_FRACTION))
    budget = max(0, usable - weights) * KV_BUDGET_PERCENT // 100
    # Asked for a context, the message names the largest that fits at all; otherwise the default stops at the cap.
    top = native if context else min(native, DEFAULT_CONTEXT_CAP)
    candidates = candidate_contexts(native=top) or [top]
    fitting = [cells for cells in candidates if kv(cells) <= budget]
    if not fitting:
        smallest = candidates[0]
        required = weights + kv(smallest) * 100 // KV_BUDGET_PERCENT
        raise LocalFitError(
            f"requires {required / GB:.1f} GB at context {smallest}, this machine has {usable / GB:.1f} GB usable, "
            f"short by {(required - usable) / GB:.1f} GB"
        )
    if context and kv(context) > budget:
        raise LocalFitError(
            f"context {context} needs {kv(context) / GB:.2f} GB of KV beside {weights / GB:.1f} GB of weights, and "
            f"{budget / GB:.2f} GB is left for it; the largest context that fits is {fitting[-1]}"
        )
    return plan(context or fitting[-1], usable)


def available_memory_bytes(device: str) -> int | None:
    """What the stages may take on `device` now: the kernel's MemAvailable for the CPU, free memory for a CUDA
    device; None for a device whose memory this cannot read."""
    if device == "cpu":
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        return None
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            free, _total = torch.cuda.mem_get_info(torch.device(device))
            return int(free)
    return None
