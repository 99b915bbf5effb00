"""Explaining why nothing fits: how much the model needs, how much the pool offers, and who was counted.

The figure a person needs first is the gap ("short by 14.2 GB": add a GPU of that size, or free one). When the
pool is large enough in total but no split works, the gap is per GPU instead: a single layer (with embeddings or
head) that no GPU can hold. Every GPU counted is listed with what it would hold at the smallest context, and the
excluded nodes come along, since freeing one of them is often the cheapest fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from strata.fit import KV_BUDGET_PERCENT
from strata.operator.planner.profile import ModelProfile
from strata.operator.planner.slots import Slot
from strata.operator.planner.split import Span, place
from strata.plan import GB, Participant, Shortfall

MAX_LISTED_PARTICIPANTS = 256  # keeps a shortfall well inside a ConfigMap's 1 MiB


def gigabytes(count: int) -> str:
    return f"{count / GB:.1f} GB"


def _reserved_kv(kv: int, profile: ModelProfile) -> int:
    """KV bytes scaled up by the shares the planner keeps beside it: kv fits in 85% of what is free once the prefix
    cache has taken its fraction."""
    return math.ceil(kv * 100 / KV_BUDGET_PERCENT / (1 - profile.prefix_cache_fraction))


def _span_need(profile: ModelProfile, start: int, end: int, context: int) -> int:
    """Usable bytes one GPU needs for layers [start, end) at `context`."""
    last = end == profile.layers
    weights = profile.weight_bytes(start, end, first=start == 0, last=last)
    return weights + profile.buffer_bytes(last=last) + _reserved_kv(profile.kv_bytes(start, end, context), profile)


def explain_shortfall(
    profile: ModelProfile, *, slots: Sequence[Slot], gpu_count: int, available: int, context: int
) -> Shortfall:
    """The Shortfall at `context` (the smallest the planner would offer) on the GPUs in `slots`."""
    layers = profile.layers
    stages = max(1, min(gpu_count, layers))
    weights = profile.weight_prefix[layers] + profile.embedding_bytes
    weights += profile.head_bytes if stages > 1 else profile.head_bytes_beside_embeddings
    buffers = profile.last_buffer_bytes + (stages - 1) * profile.middle_buffer_bytes
    required = weights + buffers + _reserved_kv(profile.kv_bytes(0, layers, context), profile)
    short_by = required - available
    gpus = f"{gpu_count} GPU" if gpu_count == 1 else f"{gpu_count} GPUs"
    message = f"requires {gigabytes(required)}, pool has {gigabytes(available)} across {gpus}"
    spans, unplaced = place(profile, usable=[slot.usable_bytes for slot in slots], context=context)
    if short_by > 0:
        message += f", short by {gigabytes(short_by)}"
    elif slots:
        largest = max(slot.usable_bytes for slot in slots)
        need = _span_need(profile, unplaced, unplaced + 1, context)
        if need > largest:
            short_by = need - largest
            message += (
                f", but layer {unplaced} alone needs {gigabytes(need)} on one GPU and the largest offers "
                f"{gigabytes(largest)}: short by {gigabytes(short_by)}"
            )
        else:
            short_by = _span_need(profile, unplaced, layers, context)
            message += (
                f", but split into whole layers it does not pack: layers {unplaced}-{layers - 1} found no GPU "
                f"with room, short by {gigabytes(short_by)}"
            )
    held = {span.slot: span for span in spans}
    ordinals: dict[tuple[str, str], int] = {}
    participants = []
    for index, slot in enumerate(slots[:MAX_LISTED_PARTICIPANTS]):
        ordinal = ordinals.get((slot.node, slot.resource), 0)
        ordinals[(slot.node, slot.resource)] = ordinal + 1
        span = held.get(index)
        participants.append(
            Participant(
                node=slot.node,
                gpu=ordinal,
                usable_bytes=slot.usable_bytes,
                weight_bytes=_held_weights(profile, span),
                kv_bytes=profile.kv_bytes(span.start, span.end, context) if span else 0,
            )
        )
    return Shortfall(
        required_bytes=required,
        available_bytes=available,
        short_by_bytes=short_by,
        gpu_count=gpu_count,
        message=message,
        participants=tuple(participants),
    )


def _held_weights(profile: ModelProfile, span: Span | None) -> int:
    if span is None:
        return 0
    return profile.weight_bytes(span.start, span.end, first=span.start == 0, last=span.end == profile.layers)
