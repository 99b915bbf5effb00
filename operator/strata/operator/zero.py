"""A deployment at zero pipelines (spec.replicas 0, set by hand or by the autoscaler): what its status says (pure).

No stage runs, and nothing is wrong: Ready is False with the reason ScaledToZero (phase ScaledToZero), and Planned
still says where a cold start would place pipeline 0. The gateway stays, rendered from the plan it already has, so
its pods do not roll while they hold requests; status.plan and status.serving keep that plan, which is also what
brings pipeline 0 back on the same generation when the pool still holds its placement.
"""

from __future__ import annotations

from strata.operator.conditions import set_condition, set_gateway_ready
from strata.operator.reasons import Reason
from strata.operator.replicas import count, describe, next_generation, previous_pipelines, summarize
from strata.operator.status import ConditionType, ModelDeploymentStatus, PlanSummary
from strata.plan import Plan

SAID = "replicas is 0: no stage runs; a request to the gateway scales it up when spec.autoscaling allows"


def park(status: ModelDeploymentStatus, first: Plan, *, spec_generation: int) -> PlanSummary:
    """Empty status.pipelines and keep the plan the gateway runs with (pipeline 0's would-be plan for a deployment
    that never ran one, on a fresh generation number); returns that plan."""
    kept = status.serving or summarize(
        first, generation=next_generation(previous_pipelines(status).values()), spec_generation=spec_generation
    )
    status.pipelines = []
    status.plan = status.serving = kept
    status.stage_count = len(first.stages)
    status.context_length = first.context_length
    would = describe(summarize(first, generation=kept.generation))
    said = f"replicas is 0: no pipeline runs; a cold start would place {would}"
    set_condition(
        status, ConditionType.PLANNED, ok=True, reason=Reason.PLANNED, message=said, generation=spec_generation
    )
    set_condition(
        status,
        ConditionType.CAPACITY_AVAILABLE,
        ok=True,
        reason=Reason.FITS,
        message="pipeline 0 would fit the pool now",
        generation=spec_generation,
    )
    return kept


def observed_at_zero(status: ModelDeploymentStatus, *, generation: int, gateway_ok: bool) -> None:
    """StagesReady and Ready False for ScaledToZero, GatewayReady as the gateway is, and no pipeline counted."""
    status.pipelines = []
    status.load_progress = []
    status.ready = f"0/{len(status.plan.stages) if status.plan else 0}"
    for kind in (ConditionType.STAGES_READY, ConditionType.READY):
        set_condition(status, kind, ok=False, reason=Reason.SCALED_TO_ZERO, message=SAID, generation=generation)
    set_gateway_ready(status, ok=gateway_ok, generation=generation)
    count(status, desired=0, ready={})
