"""Conditions into status, and the phase and reason a person reads in `kubectl get` derived from them.

The conditions are the truth; `phase` and `reason` only summarise them for the printer columns, so they are derived
in one place (`settle`) after every change rather than set by each code path. A spec that cannot be applied while an
older generation serves says both in its Planned condition (`refuse`), and shows as the phase ChangeRefused.
"""

from __future__ import annotations

import datetime as dt

from strata.operator.reasons import Reason
from strata.operator.status import Condition, ConditionType, ModelDeploymentStatus, Phase

# The order in which a False condition explains the phase: the earliest step that failed.
_ORDER = (
    ConditionType.PLANNED,
    ConditionType.CAPACITY_AVAILABLE,
    ConditionType.STAGES_READY,
    ConditionType.GATEWAY_READY,
    ConditionType.READY,
)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(status: ModelDeploymentStatus, kind: ConditionType) -> Condition | None:
    return next((c for c in status.conditions if c.type == kind), None)


def set_condition(
    status: ModelDeploymentStatus, kind: ConditionType, *, ok: bool, reason: str, message: str, generation: int
) -> None:
    """Upsert a condition; lastTransitionTime moves only when the status flips."""
    value = "True" if ok else "False"
    existing = condition(status, kind)
    moved = existing.last_transition_time if existing is not None and existing.status == value else _now()
    updated = Condition(
        type=kind, status=value, reason=reason, message=message, observedGeneration=generation, lastTransitionTime=moved
    )
    if existing is None:
        status.conditions.append(updated)
    else:
        status.conditions[status.conditions.index(existing)] = updated


def set_gateway_ready(status: ModelDeploymentStatus, *, ok: bool, generation: int) -> None:
    """GatewayReady from whether the gateway Deployment has an available replica."""
    set_condition(
        status,
        ConditionType.GATEWAY_READY,
        ok=ok,
        reason=Reason.AVAILABLE if ok else Reason.UNAVAILABLE,
        message="gateway has an available replica" if ok else "no gateway replica available",
        generation=generation,
    )


def refuse(
    status: ModelDeploymentStatus, *, reason: str, message: str, generation: int, retry_in: float | None = None
) -> str:
    """Planned=False for spec generation `generation`, naming the generation that keeps serving if one does, and
    when the model is read again; returns the message without that delay (the Event's, the same on every retry)."""
    serving = status.serving
    if serving is not None:
        kept = (
            f"generation {serving.spec_generation}"
            if serving.spec_generation is not None
            else f"plan generation {serving.generation}"
        )
        message = f"generation {generation} cannot be applied: {message}; {kept} keeps serving"
    shown = message if retry_in is None else f"{message}; reading it again in {retry_in:.0f}s"
    set_condition(status, ConditionType.PLANNED, ok=False, reason=reason, message=shown, generation=generation)
    return message


def phase_of(status: ModelDeploymentStatus) -> Phase:
    planned = condition(status, ConditionType.PLANNED)
    stages = condition(status, ConditionType.STAGES_READY)
    ready = condition(status, ConditionType.READY)
    plan, serving = status.plan, status.serving
    older_serves = plan is not None and serving is not None and serving.generation != plan.generation
    if planned is None:
        return Phase.PENDING
    if planned.status == "False":
        if status.serving is not None:
            return Phase.CHANGE_REFUSED
        return Phase.SHORTFALL if planned.reason == Reason.NO_PLAN_FITS else Phase.FAILED
    if stages is not None and stages.reason == Reason.LOAD_FAILED:  # the newest generation's stages, even while
        return Phase.CHANGE_REFUSED if older_serves else Phase.FAILED  # an older one keeps Ready true
    if ready is not None and ready.status == "True":
        return Phase.READY
    if ready is not None and ready.reason == Reason.SCALED_TO_ZERO:
        return Phase.SCALED_TO_ZERO
    return Phase.LOADING


def settle(status: ModelDeploymentStatus) -> None:
    """Derive `phase` and `reason` from the conditions: never empty once the operator has seen the deployment."""
    status.phase = phase_of(status)
    if status.phase == Phase.READY:
        ready = condition(status, ConditionType.READY)
        status.reason = ready.reason if ready is not None else ""
        return
    failing = (condition(status, kind) for kind in _ORDER)
    status.reason = next((c.reason for c in failing if c is not None and c.status == "False"), status.phase.value)
