"""Splitting the layers into contiguous spans over an ordered list of GPUs, at a given context.

The rule for one stage: its weights (plus embeddings if first, head if last) and fixed buffers fit in its usable
memory, the prefix cache takes its share of what remains, its KV at the context fits in 85% of the rest, and at
least `margin` bytes stay spare. The split is a
greedy fill: each GPU in turn takes the longest span that fits. For a fixed GPU order that is optimal (no split
covers more layers with the first i GPUs), which makes "does context c fit on these GPUs?" one linear pass, and
because the fill only ever looks at a prefix of the order, more GPUs never make it fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from strata.fit import KV_BUDGET_PERCENT
from strata.operator.planner.profile import ModelProfile


@dataclass(frozen=True)
class Span:
    slot: int  # index into the GPU order
    start: int
    end: int  # exclusive


def stage_fits(
    profile: ModelProfile,
    *,
    usable: int,
    start: int,
    end: int,
    context: int,
    margin: int = 0,
) -> bool:
    """Layers [start, end) fit on one GPU with `usable` bytes at `context`, keeping `margin` spare."""
    first, last = start == 0, end == profile.layers
    free = usable - profile.weight_bytes(start, end, first=first, last=last) - profile.buffer_bytes(last=last)
    if free < 0:
        return False
    free -= profile.prefix_cache_bytes(free)
    kv = profile.kv_bytes(start, end, context)
    return kv * 100 <= free * KV_BUDGET_PERCENT and free - kv >= margin


def longest_span(profile: ModelProfile, *, usable: int, start: int, context: int, margin: int, stop: int) -> int:
    """The largest end in (start, stop] whose span fits, or `start` when not even one layer does."""
    low, high = start, stop  # invariant: low fits (or is start), everything above high does not
    while low < high:
        middle = (low + high + 1) // 2
        if stage_fits(profile, usable=usable, start=start, end=middle, context=context, margin=margin):
            low = middle
        else:
            high = middle - 1
    return low


def place(profile: ModelProfile, *, usable: Sequence[int], context: int, margin: int = 0) -> tuple[list[Span], int]:
    """Greedy fill: each GPU in order takes the longest span that fits; returns the spans and the first layer left.

    A GPU that cannot take a single layer is passed over. A GPU that could take every remaining layer but not the
    output head as well leaves the last layer to the next GPU, so the head always sits with a layer.
    """
    layers = profile.layers
    spans: list[Span] = []
    position = 0
    for slot, capacity in enumerate(usable):
        if stage_fits(profile, usable=capacity, start=position, end=layers, context=context, margin=margin):
            spans.append(Span(slot, position, layers))
            return spans, layers
        end = longest_span(profile, usable=capacity, start=position, context=context, margin=margin, stop=layers - 1)
        if end > position:
            spans.append(Span(slot, position, end))
            position = end
    return spans, position


def fill(profile: ModelProfile, *, usable: Sequence[int], context: int, margin: int = 0) -> list[Span] | None:
    """Spans covering every layer exactly once on a prefix of `usable` (GPUs in order), or None if they run out."""
    spans, placed = place(profile, usable=usable, context=context, margin=margin)
    return spans if placed == profile.layers else None
