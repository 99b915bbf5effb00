"""The phase and reason columns derived from the conditions, the refused-change message, and the retry delays."""

from __future__ import annotations

import pytest
from strata.operator.backoff import MAX_DELAY_SECONDS, Backoff, retry_delay
from strata.operator.conditions import refuse, set_condition, settle
from strata.operator.status import ConditionType, ModelDeploymentStatus, PlanSummary

P, S, R = ConditionType.PLANNED, ConditionType.STAGES_READY, ConditionType.READY


def plan(generation: int, spec_generation: int) -> PlanSummary:
    return PlanSummary.model_validate(
        {"generation": generation, "specGeneration": spec_generation, "stages": [], "contextLength": 512,
         "parallel": 1, "cacheTypeK": "q8_0", "cacheTypeV": "q8_0"}
    )  # fmt: skip


def status(
    *conditions: tuple[ConditionType, bool, str], serving: int | None = None, newest: int = 1
) -> ModelDeploymentStatus:
    result = ModelDeploymentStatus()
    if serving is not None:
        result.serving, result.plan = plan(serving, serving), plan(newest, newest)
    for kind, ok, reason in conditions:
        set_condition(result, kind, ok=ok, reason=reason, message="", generation=1)
    return result


@pytest.mark.parametrize(
    ("given", "phase", "reason"),
    [
        pytest.param(status(), "Pending", "Pending", id="nothing seen yet is Pending"),
        pytest.param(status((P, False, "ModelNotFound")), "Failed", "ModelNotFound",
                     id="an unreadable model with nothing serving is Failed with the cause"),
        pytest.param(status((P, False, "NoPlanFits")), "Shortfall", "NoPlanFits", id="no plan fits is Shortfall"),
        pytest.param(status((P, True, "Planned"), (R, True, "Ready"), (P, False, "ModelGated"), serving=1),
                     "ChangeRefused", "ModelGated", id="a refused change while a generation serves is ChangeRefused"),
        pytest.param(status((P, True, "Planned"), (S, False, "Loading"), (R, False, "NotReady"), serving=1),
                     "Loading", "Loading", id="stages loading is Loading"),
        pytest.param(status((P, True, "Planned"), (S, False, "LoadFailed"), (R, False, "NotReady"), serving=1),
                     "Failed", "LoadFailed", id="a failed load with nothing else serving is Failed"),
        pytest.param(status((P, True, "Planned"), (S, False, "LoadFailed"), (R, True, "Ready"), serving=1, newest=2),
                     "ChangeRefused", "LoadFailed", id="a new generation that fails to load beside the old is refused"),
        pytest.param(status((P, True, "Planned"), (S, True, "Ready"), (R, True, "Ready"), serving=1),
                     "Ready", "Ready", id="everything ready is Ready"),
    ],
)  # fmt: skip
def test_phase_and_reason_columns_follow_the_conditions(given: ModelDeploymentStatus, phase: str, reason: str) -> None:
    settle(given)
    assert (given.phase, given.reason) == (phase, reason)


def test_a_refused_change_names_the_generation_that_keeps_serving_and_the_retry() -> None:
    given = status((P, True, "Planned"), serving=1)
    event = refuse(given, reason="ModelNotFound", message="no such file", generation=3, retry_in=8.0)
    planned = next(c for c in given.conditions if c.type == P)
    assert event == "generation 3 cannot be applied: no such file; generation 1 keeps serving"
    assert planned.message == f"{event}; reading it again in 8s"
    assert (planned.status, planned.reason, planned.observed_generation) == ("False", "ModelNotFound", 3)


def test_retries_grow_from_seconds_to_a_cap_of_minutes() -> None:
    delays = [retry_delay(n) for n in range(1, 12)]
    assert delays[:4] == [2.0, 4.0, 8.0, 16.0]
    assert delays == sorted(delays)
    assert delays[-1] == MAX_DELAY_SECONDS == 300.0


def test_a_retry_is_due_after_its_delay_and_a_new_generation_starts_again() -> None:
    now = [0.0]
    backoff = Backoff(clock=lambda: now[0])
    assert backoff.failed("uid", generation=1) == 2.0
    assert backoff.failed("uid", generation=1) == 4.0
    assert not backoff.due("uid")
    now[0] = 4.0
    assert backoff.due("uid")
    assert backoff.failed("uid", generation=2) == 2.0
    backoff.succeeded("uid")
    now[0] = 100.0
    assert not backoff.due("uid")
