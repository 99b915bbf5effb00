"""The message the StagesReady condition and the LoadFailed Event carry when stages report failed loads: every failing
stage named in order with its own error, nothing while none fails, and always short enough for a condition."""

from __future__ import annotations

import pytest
from strata.operator.progress import MAX_STAGE_ERROR_CHARS, StageLoad, load_failure
from strata.operator.status import MAX_CONDITION_MESSAGE_CHARS, Condition, ConditionType


def load(stage: int, error: str = "") -> StageLoad:
    return StageLoad(stage=stage, bytes_loaded=10, bytes_total=100, error=error)


@pytest.mark.parametrize(
    ("loads", "message"),
    [
        pytest.param([], None, id="no stage answers: nothing failed"),
        pytest.param([load(0), load(1)], None, id="stages still loading: nothing failed"),
        pytest.param(
            [load(1, "the file ends at byte 96"), load(0)],
            "stage 1 failed to load: the file ends at byte 96",
            id="one failing stage is named with its error",
        ),
        pytest.param(
            [load(2, "OutOfMemoryError: CUDA out of memory"), load(0, "the file ends at byte 96")],
            "stage 0 failed to load: the file ends at byte 96; "
            "stage 2 failed to load: OutOfMemoryError: CUDA out of memory",
            id="several failing stages are named in stage order",
        ),
    ],
)
def test_the_load_failure_names_each_failing_stage_with_its_error(loads: list[StageLoad], message: str | None) -> None:
    assert load_failure(loads) == message


def test_a_long_error_is_shortened_and_many_of_them_still_fit_a_condition() -> None:
    traceback = "x" * (MAX_STAGE_ERROR_CHARS * 2)
    one = load_failure([load(0, traceback)])
    assert one is not None
    assert one == "stage 0 failed to load: " + "x" * (MAX_STAGE_ERROR_CHARS - 1) + "…"

    many = load_failure([load(index, traceback) for index in range(40)])
    assert many is not None
    assert len(many) == MAX_CONDITION_MESSAGE_CHARS
    condition = Condition(
        type=ConditionType.STAGES_READY, status="False", reason="LoadFailed", message=many, lastTransitionTime="t"
    )
    assert condition.message == many  # the status model would refuse a longer message
