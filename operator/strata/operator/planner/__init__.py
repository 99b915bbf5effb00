"""Placement planning: pure functions from Nodes, Pods and a ModelInfo to a Plan (or a Shortfall that explains).

No I/O and no Kubernetes client here (an import-linter contract holds it to that): the operator lists the objects
and writes the result; `strata plan` reads them from a file. Same input, same plan.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from strata.gguf.model import ModelInfo
from strata.operator.planner.inventory import Inventory, build_inventory
from strata.operator.planner.options import PlanOptions
from strata.operator.planner.pipelines import PipelinePlan, plan_pipelines
from strata.operator.planner.search import plan_on_inventory
from strata.plan import Plan

__all__ = [
    "Inventory",
    "PipelinePlan",
    "PlanOptions",
    "build_inventory",
    "plan_on_inventory",
    "plan_pipelines",
    "plan_placement",
]


def plan_placement(
    *,
    model: ModelInfo,
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]] = (),
    options: PlanOptions | None = None,
) -> Plan:
    """Inventory the pool, then plan `model` on it."""
    chosen = options or PlanOptions()
    inventory = build_inventory(
        nodes=nodes,
        pods=pods,
        node_selector=chosen.node_selector,
        tolerations=chosen.tolerations,
        gpu_memory_bytes=chosen.gpu_memory_bytes,
    )
    return plan_on_inventory(model=model, inventory=inventory, options=chosen)
