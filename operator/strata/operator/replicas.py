"""A deployment's pipelines in its status: which generation each loads and serves, how a re-plan moves them (place,
pure: the reconciler passes in which generations serve), and the counts the scale subresource shows.

Plan generations are numbered across the deployment (one counter, a new number for each pipeline that re-plans), so
a generation names one pipeline's stages and stage names stay `<deployment>-g<generation>-s<index>`. status.plan and
status.serving are pipeline 0's; the gateway drives every pipeline status.pipelines lists as ready (the pipelines
ConfigMap, pipelines.json, lists the same).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from strata.operator.planner import PipelinePlan
from strata.operator.render import PipelineChildren
from strata.operator.rollout import PipelineState, admitted, replacement_budget
from strata.operator.status import EventReason, ModelDeploymentStatus, PipelineStatus, PlanSummary, StageSummary
from strata.plan import Plan


def summarize(plan: Plan, *, generation: int, spec_generation: int | None = None) -> PlanSummary:
    return PlanSummary(
        generation=generation,
        specGeneration=spec_generation,
        stages=[
            StageSummary(
                index=s.index,
                node=s.node,
                gpus=len(s.gpus),
                backend=str(s.backend),
                layerStart=s.layer_start,
                layerEnd=s.layer_end,
                kvBytes=s.kv_bytes,
                hostKVBytes=s.host_kv_bytes,
            )
            for s in plan.stages
        ],
        contextLength=plan.context_length,
        parallel=plan.parallel,
        cacheTypeK=str(plan.cache_type_k),
        cacheTypeV=str(plan.cache_type_v),
        residentWindowTokens=0 if plan.resident_window is None else plan.resident_window.tokens,
    )


def same_placement(current: PlanSummary | None, new: PlanSummary) -> bool:
    if current is None:
        return False
    same = {"generation", "spec_generation"}
    return current.model_dump(exclude=same) == new.model_dump(exclude=same)


def describe(summary: PlanSummary) -> str:
    stages = ", ".join(f"{s.node} layers [{s.layer_start},{s.layer_end})" for s in summary.stages)
    kv = f"{summary.cache_type_k}/{summary.cache_type_v}"
    window = summary.resident_window_tokens
    resident = f", decode over a resident window of {window} tokens" if window else ""
    return (
        f"generation {summary.generation}: {len(summary.stages)} stage(s) ({stages}), "
        f"context {summary.context_length}, {summary.parallel} slots, KV {kv}{resident}"
    )


def previous_pipelines(status: ModelDeploymentStatus) -> dict[int, PipelineStatus]:
    """The pipelines the status knew, by index; a status written before pipelines had an index has pipeline 0 only,
    in its plan and serving fields."""
    if status.pipelines:
        return {p.index: p for p in status.pipelines}
    if status.plan is None:
        return {}
    return {0: PipelineStatus(index=0, plan=status.plan, serving=status.serving)}


def generations_in_use(pipelines: Iterable[PipelineStatus]) -> set[int]:
    """Every generation a pipeline loads or serves: the stage sets to keep."""
    return {plan.generation for p in pipelines for plan in (p.plan, p.serving) if plan is not None}


def next_generation(pipelines: Iterable[PipelineStatus]) -> int:
    """The number a newly planned pipeline generation takes: above every one the status names."""
    return max(generations_in_use(pipelines), default=0) + 1


def serving(pipelines: Iterable[PipelineStatus]) -> list[tuple[int, PlanSummary]]:
    """(index, plan) of every pipeline whose serving generation is ready, in index order."""
    return [(p.index, p.serving) for p in sorted(pipelines, key=lambda p: p.index) if p.ready and p.serving]


def rollout_waits(pipelines: Iterable[PipelineStatus], *, spec_generation: int) -> bool:
    """A pipeline still runs a plan of an older spec and none is being replaced: its turn in the rollout has come,
    and only a reconcile (which admits it) moves it, as no spec change or lost node will ring for it."""
    pipelines = list(pipelines)
    if any(_replacing(p) for p in pipelines):
        return False
    return any(
        p.plan is not None and p.plan.spec_generation is not None and p.plan.spec_generation != spec_generation
        for p in pipelines
    )


def count(status: ModelDeploymentStatus, *, desired: int, ready: Mapping[int, bool]) -> None:
    """Each pipeline's readiness, and replicas, readyReplicas and pipelinesReady from them."""
    for pipeline in status.pipelines:
        pipeline.ready = ready.get(pipeline.index, False)
    status.replicas = sum(p.plan is not None for p in status.pipelines)
    status.ready_replicas = sum(p.ready for p in status.pipelines)
    status.pipelines_ready = f"{status.ready_replicas}/{desired}"


@dataclass
class Placement:
    """What one reconcile does to the pipelines: their status, the ones to render, and the Events to record."""

    pipelines: list[PipelineStatus] = field(default_factory=list)
    rendered: list[PipelineChildren] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)


def _replacing(old: PipelineStatus | None) -> bool:
    return bool(old and old.serving and old.plan and old.plan.generation != old.serving.generation)


def place(
    before: Mapping[int, PipelineStatus],
    pipelines: Sequence[PipelinePlan],
    *,
    replicas: int,
    max_unavailable: int,
    spec_generation: int,
    ready: Mapping[int, bool],
) -> Placement:
    """Each planned pipeline against what it ran `before`: the same placement keeps its generation, a new one takes
    the next generation number when the rollout bound lets it (`ready` says which serving generations serve), and
    one that waits for its turn keeps its plan and its running children. A pipeline the pool cannot hold keeps the
    generation it serves, if any, and says why it has no placement."""
    generation = next_generation(before.values())
    wanted: dict[int, PlanSummary] = {}
    states = []
    for pipeline in pipelines:
        old = before.get(pipeline.index)
        if pipeline.plan is None:
            continue
        current = old.plan.generation if old is not None and old.plan is not None else generation
        wanted[pipeline.index] = summarize(pipeline.plan, generation=current, spec_generation=spec_generation)
        serves = old is not None and old.serving is not None and ready.get(old.serving.generation, False)
        new = old is None or not same_placement(old.plan, wanted[pipeline.index])
        states.append(PipelineState(index=pipeline.index, serves=serves, replacing=_replacing(old), wants_new=new))
    allowed = admitted(states, budget=replacement_budget(replicas=replicas, max_unavailable=max_unavailable))
    changing = {s.index for s in states if s.wants_new}
    placement = Placement()
    for pipeline in pipelines:
        old = before.get(pipeline.index)
        kept = old.serving if old is not None else None
        if pipeline.plan is None or (pipeline.index in changing and pipeline.index not in allowed):
            waiting = old.plan if old is not None else None
            placement.pipelines.append(
                PipelineStatus(index=pipeline.index, plan=waiting, serving=kept, shortfall=pipeline.short)
            )
            if pipeline.plan is None and (old is None or old.shortfall != pipeline.short):
                message = f"pipeline {pipeline.index}: {pipeline.short}"
                placement.events.append(("Warning", EventReason.CAPACITY_SHORTFALL.value, message))
            continue
        summary = wanted[pipeline.index]
        if pipeline.index in changing:
            summary = summarize(pipeline.plan, generation=generation, spec_generation=spec_generation)
            generation += 1
            said = describe(summary) if replicas == 1 else f"pipeline {pipeline.index}: {describe(summary)}"
            reason = EventReason.PLANNED if old is None or old.plan is None else EventReason.REPLANNED
            placement.events.append(("Normal", reason.value, said))
        # A new generation loads beside the one that serves; it moves over in Reconciler.advance once it is ready.
        if kept is None or kept.generation == summary.generation:
            kept = summary
        placement.pipelines.append(PipelineStatus(index=pipeline.index, plan=summary, serving=kept))
        placement.rendered.append(
            PipelineChildren(index=pipeline.index, plan=pipeline.plan, generation=summary.generation)
        )
    return placement
