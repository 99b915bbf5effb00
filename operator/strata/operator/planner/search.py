"""The placement search: the longest context first, then the fewest stages, then the most spare memory.

GPUs are tried most usable first (slots.py), and the greedy fill (split.py) answers "does context c fit on the
first k of them?" in one pass. Every question the search asks is monotone, so each is a binary search:
  1. context: the largest candidate context that fits on all GPUs the plan may use (at most max_stages, at most
     one per layer);
  2. stages: the smallest k whose first k GPUs still reach that context;
  3. balance: the largest margin (in MiB) every stage can keep spare on those k GPUs, which moves layers off the
     fullest stage.
A 1,000-node pool costs one sort of its node groups plus a few hundred span checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from strata.fit import candidate_contexts
from strata.gguf.model import UBATCH_TOKENS, ModelInfo
from strata.operator.planner.errors import OverrideDoesNotFitError
from strata.operator.planner.inventory import Inventory
from strata.operator.planner.options import PlanOptions
from strata.operator.planner.profile import ModelProfile
from strata.operator.planner.shortfall import MAX_LISTED_PARTICIPANTS, explain_shortfall, gigabytes
from strata.operator.planner.slots import Slot, ordered_slots, pool_usable_bytes
from strata.operator.planner.split import Span, fill
from strata.plan import Plan, Stage

MIB = 1 << 20


def _largest(low: int, high: int, holds: Callable[[int], bool]) -> int | None:
    """The largest x in [low, high] for which `holds` is true, given it is true up to some point; else None."""
    if low > high or not holds(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if holds(middle):
            low = middle
        else:
            high = middle - 1
    return low


def best_context(profile: ModelProfile, usable: Sequence[int], contexts: Sequence[int]) -> int | None:
    """The largest candidate context the GPUs `usable` (in order) can hold, or None when not even the smallest."""
    found = _largest(0, len(contexts) - 1, lambda i: fill(profile, usable=usable, context=contexts[i]) is not None)
    return None if found is None else contexts[found]


def fewest_gpus(profile: ModelProfile, usable: Sequence[int], context: int) -> int:
    """The smallest k such that the first k GPUs hold every layer at `context` (the caller knows all of them do)."""
    count = len(usable)
    fewer = _largest(0, count - 1, lambda k: fill(profile, usable=usable[:k], context=context) is None)
    return count if fewer is None else fewer + 1


def widest_margin(profile: ModelProfile, usable: Sequence[int], context: int) -> int:
    """The most bytes (in whole MiB) every stage can keep spare at `context` on exactly these GPUs."""
    ceiling = max(usable) // MIB
    found = _largest(0, ceiling, lambda m: fill(profile, usable=usable, context=context, margin=m * MIB) is not None)
    return (found or 0) * MIB


def balanced_split(profile: ModelProfile, usable: Sequence[int], context: int) -> list[Span]:
    """The split of every layer over `usable` at `context` whose smallest spare memory is largest.

    The caller has checked that these GPUs hold the model at `context`, so the fill at margin zero exists.
    """
    margin = widest_margin(profile, usable, context)
    return fill(profile, usable=usable, context=context, margin=margin) or []


def plan_on_inventory(*, model: ModelInfo, inventory: Inventory, options: PlanOptions) -> Plan:
    """The plan for `model` on `inventory`, honouring `options`; a Plan with a shortfall when nothing fits."""
    profile = ModelProfile.of(
        model,
        type_k=options.cache_type_k,
        type_v=options.cache_type_v,
        parallel=options.parallel,
        prefix_cache_fraction=options.prefix_cache_fraction,
        resident=options.resident_window is not None,
    )
    slots = ordered_slots(inventory, headroom_fraction=options.headroom_fraction, limit=model.block_count)
    allowed = [slot.usable_bytes for slot in slots[: options.max_stages or model.block_count]]
    contexts = candidate_contexts(native=model.context_length, snap=options.context_snap)
    automatic = best_context(profile, allowed, contexts)
    if automatic is None:
        _refuse_max_stages(profile, slots, contexts, options)
        return _shortfall_plan(model=model, profile=profile, inventory=inventory, options=options, contexts=contexts)
    context = automatic
    if options.context_length is not None:
        context = options.context_length
        _check_context(profile=profile, slots=slots, allowed=allowed, automatic=automatic, options=options)
    count = fewest_gpus(profile, allowed, context)
    spans = balanced_split(profile, allowed[:count], context)
    return _plan(
        model=model, profile=profile, options=options, slots=slots, spans=spans, context=context, inventory=inventory
    )


def _check_context(
    *, profile: ModelProfile, slots: Sequence[Slot], allowed: Sequence[int], automatic: int, options: PlanOptions
) -> None:
    """Raise when the user's context cannot be honoured, naming the stage that runs out and what would fit."""
    wanted = options.context_length or 0
    if wanted > profile.native_context:
        raise OverrideDoesNotFitError(
            f"context {wanted} exceeds the model's native context {profile.native_context}; "
            f"the largest context that fits is {automatic}"
        )
    if fill(profile, usable=allowed, context=wanted) is not None:
        return
    count = fewest_gpus(profile, allowed, automatic)
    spans = fill(profile, usable=allowed[:count], context=automatic, margin=0) or []
    limit = ""
    if options.max_stages:
        limit = f" with at most {options.max_stages} stage{'s' if options.max_stages > 1 else ''}"
    for index, span in enumerate(spans):
        usable = allowed[span.slot]
        last = span.end == profile.layers
        held = profile.weight_bytes(span.start, span.end, first=span.start == 0, last=last)
        free = profile.kv_free_bytes(usable - held - profile.buffer_bytes(last=last))
        needed = profile.kv_bytes(span.start, span.end, wanted)
        if needed > free:
            raise OverrideDoesNotFitError(
                f"context {wanted} needs {gigabytes(needed)} of KV on stage {index} ({slots[span.slot].node}) "
                f"which has {gigabytes(free)} free; the largest context that fits{limit} is {automatic}"
            )
    raise OverrideDoesNotFitError(f"context {wanted} does not fit; the largest context that fits{limit} is {automatic}")


def _refuse_max_stages(
    profile: ModelProfile, slots: Sequence[Slot], contexts: Sequence[int], options: PlanOptions
) -> None:
    """When only the max-stages override stands in the way, say so rather than report a shortfall."""
    if options.max_stages is None or not contexts:
        return
    everything = [slot.usable_bytes for slot in slots]
    if fill(profile, usable=everything, context=contexts[0]) is None:
        return
    needed = fewest_gpus(profile, everything, contexts[0])
    raise OverrideDoesNotFitError(
        f"max stages {options.max_stages} is too few: the model needs at least {needed} stages on this pool "
        f"at context {contexts[0]}"
    )


def _shortfall_plan(
    *, model: ModelInfo, profile: ModelProfile, inventory: Inventory, options: PlanOptions, contexts: Sequence[int]
) -> Plan:
    listed = ordered_slots(
        inventory, headroom_fraction=options.headroom_fraction, limit=max(model.block_count, MAX_LISTED_PARTICIPANTS)
    )
    shortfall = explain_shortfall(
        profile,
        slots=listed,
        gpu_count=inventory.gpu_count,
        available=pool_usable_bytes(inventory, headroom_fraction=options.headroom_fraction),
        context=contexts[0] if contexts else 1,
    )
    return Plan(
        stages=(),
        context_length=0,
        parallel=options.parallel,
        cache_type_k=options.cache_type_k,
        cache_type_v=options.cache_type_v,
        kv_bytes_per_token=model.kv_bytes_per_token(type_k=options.cache_type_k, type_v=options.cache_type_v),
        excluded=inventory.excluded,
        shortfall=shortfall,
    )


def _plan(
    *,
    model: ModelInfo,
    profile: ModelProfile,
    options: PlanOptions,
    slots: Sequence[Slot],
    spans: Sequence[Span],
    context: int,
    inventory: Inventory,
) -> Plan:
    """The Plan for `spans`; KV bytes come from ModelInfo itself, the reference the stage worker sizes its pool by."""
    types = {"type_k": options.cache_type_k, "type_v": options.cache_type_v}
    ordinals: dict[tuple[str, str], int] = {}
    stages = []
    for index, span in enumerate(spans):
        slot = slots[span.slot]
        ordinal = ordinals.get((slot.node, slot.resource), 0)
        ordinals[(slot.node, slot.resource)] = ordinal + 1
        first, last = span.start == 0, span.end == model.block_count
        weights = profile.weight_bytes(span.start, span.end, first=first, last=last)
        buffers = profile.buffer_bytes(last=last)
        stages.append(
            Stage(
                index=index,
                node=slot.node,
                resource=slot.resource,
                gpus=(ordinal,),
                backend=slot.backend,
                layer_start=span.start,
                layer_end=span.end,
                embeddings=first,
                output_head=last,
                memory_bytes=slot.memory_bytes,
                usable_bytes=slot.usable_bytes,
                weight_bytes=weights,
                buffer_bytes=buffers,
                prefix_cache_bytes=profile.prefix_cache_bytes(slot.usable_bytes - weights - buffers),
                host_kv_bytes=options.host_kv_bytes,
                kv_bytes=model.kv_bytes(
                    n_ctx=context,
                    layers=range(span.start, span.end),
                    n_seq=options.parallel,
                    n_ubatch=UBATCH_TOKENS,
                    resident=options.resident_window is not None,
                    **types,
                ),
            )
        )
    return Plan(
        stages=tuple(stages),
        context_length=context,
        parallel=options.parallel,
        cache_type_k=options.cache_type_k,
        cache_type_v=options.cache_type_v,
        kv_bytes_per_token=model.kv_bytes_per_token(type_k=options.cache_type_k, type_v=options.cache_type_v),
        excluded=inventory.excluded,
        resident_window=options.resident_window,
    )
