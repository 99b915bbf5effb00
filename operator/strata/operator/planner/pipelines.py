"""Several pipelines of one model: each planned by the same search, on the GPUs the earlier ones left.

Pipeline 0 gets the whole pool, pipeline 1 what pipeline 0 did not take, and so on; so pipelines may differ in
their split and stage count (the later ones see smaller or fewer GPUs), and each says why through its own plan. When
only k of n fit, the first k are placed and every later one carries the shortfall the search wrote for the pool it
was offered. The order is deterministic, so planning again on an unchanged pool gives every pipeline the placement
it had: adding a replica never moves the ones that serve.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass

from strata.gguf.model import ModelInfo
from strata.operator.planner.errors import OverrideDoesNotFitError
from strata.operator.planner.inventory import Inventory
from strata.operator.planner.options import PlanOptions
from strata.operator.planner.search import plan_on_inventory
from strata.plan import Plan


def without(inventory: Inventory, plan: Plan) -> Inventory:
    """`inventory` less the GPUs `plan` takes; a node group left with none drops out (it is not excluded: it is
    this deployment's own)."""
    taken = Counter({(s.node, s.resource): 0 for s in plan.stages})
    for stage in plan.stages:
        taken[(stage.node, stage.resource)] += len(stage.gpus)
    left = []
    for entry in inventory.gpus:
        free = entry.free - taken[(entry.node, entry.resource)]
        if free > 0:
            left.append(dataclasses.replace(entry, free=free))
    return Inventory(gpus=tuple(left), excluded=inventory.excluded)


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline `index`'s placement, or why it has none (the shortfall message, or the override it cannot honour
    on what the earlier pipelines left)."""

    index: int
    plan: Plan | None
    short: str | None = None


def plan_pipelines(
    *, model: ModelInfo, inventory: Inventory, options: PlanOptions, replicas: int
) -> tuple[PipelinePlan, ...]:
    """`replicas` pipelines in order, each placed or short with the reason.

    Pipeline 0 raises as a single plan does when an override cannot be honoured (the spec is wrong for this pool);
    a later pipeline that cannot honour it on what is left is short instead (the spec is right, the pool is full).
    Once one pipeline is short the later ones are too, with the same reason: they would be offered the same GPUs.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be zero or more, not {replicas}")
    pipelines: list[PipelinePlan] = []
    left = inventory
    for index in range(replicas):
        if pipelines and pipelines[-1].plan is None:
            pipelines.append(dataclasses.replace(pipelines[-1], index=index))
            continue
        try:
            plan = plan_on_inventory(model=model, inventory=left, options=options)
        except OverrideDoesNotFitError as e:
            if index == 0:
                raise
            pipelines.append(PipelinePlan(index=index, plan=None, short=f"on the GPUs left to it: {e}"))
            continue
        if plan.shortfall is not None:
            pipelines.append(PipelinePlan(index=index, plan=None, short=plan.shortfall.message))
            continue
        pipelines.append(PipelinePlan(index=index, plan=plan))
        left = without(left, plan)
    return tuple(pipelines)
