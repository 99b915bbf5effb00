"""Which stage sets stay (strata.operator.retirement.retire): a table of changes and what they keep, and the bound."""

from __future__ import annotations

import pytest
from strata.draining import DRAIN_S, retire_after_s
from strata.gateway.settings import GatewaySettings
from strata.operator.retirement import Retiring, retire

NOW = 10_000.0
AFTER = 20.0


def _gone(generation: int, *, pipeline: int, ago: float) -> Retiring:
    return Retiring(generation=generation, pipeline=pipeline, since=NOW - ago)


@pytest.mark.parametrize(
    ("listed", "in_use", "retiring", "kept", "still", "due_in"),
    [
        pytest.param({1: 0, 2: 1}, {1, 2}, [], {1, 2}, [], None, id="nothing leaves: the generations in use stay"),
        pytest.param(
            {1: 0, 2: 1, 3: 2},
            {1},
            [],
            {1, 2, 3},
            [_gone(2, pipeline=1, ago=0), _gone(3, pipeline=2, ago=0)],
            AFTER,
            id="a scale-down from 3 to 1 retires the two served generations and keeps their stages",
        ),
        pytest.param(
            {4: 1},
            {5},
            [],
            {4, 5},
            [_gone(4, pipeline=1, ago=0)],
            AFTER,
            id="a cut-over to a new generation retires the one that served",
        ),
        pytest.param(
            {1: 0},
            {1},
            [],
            {1},
            [],
            None,
            id="a generation that was only loading (never listed) goes at once: no gateway drives it",
        ),
        pytest.param(
            {1: 0},
            {1},
            [_gone(2, pipeline=1, ago=AFTER - 1)],
            {1, 2},
            [_gone(2, pipeline=1, ago=AFTER - 1)],
            1.0,
            id="a retiring generation stays until its bound, and its stamp is not renewed",
        ),
        pytest.param(
            {1: 0},
            {1},
            [_gone(2, pipeline=1, ago=AFTER)],
            {1},
            [],
            None,
            id="at its bound a retiring generation goes",
        ),
        pytest.param(
            {1: 0, 2: 1},
            {1},
            [_gone(2, pipeline=1, ago=AFTER)],
            {1},
            [],
            None,
            id="a generation still listed once its bound passed is not stamped again",
        ),
        pytest.param(
            {},
            {2},
            [_gone(2, pipeline=0, ago=1)],
            {2},
            [],
            None,
            id="a retiring generation back in use stops retiring",
        ),
        pytest.param(
            {},
            set(),
            [_gone(2, pipeline=1, ago=5), _gone(3, pipeline=2, ago=15)],
            {2, 3},
            [_gone(2, pipeline=1, ago=5), _gone(3, pipeline=2, ago=15)],
            5.0,
            id="the next look is due when the earliest bound passes",
        ),
    ],
)
def test_retire(
    listed: dict[int, int],
    in_use: set[int],
    retiring: list[Retiring],
    kept: set[int],
    still: list[Retiring],
    due_in: float | None,
) -> None:
    decision = retire(listed=listed, in_use=in_use, retiring=retiring, now=NOW, after_s=AFTER)
    assert decision.keep == kept
    assert list(decision.retiring) == still
    assert decision.due_in == due_in


def test_the_bound_outlasts_a_poll_a_read_and_the_drain() -> None:
    assert retire_after_s(poll_s=2.0) > 2.0 + DRAIN_S
    assert retire_after_s(poll_s=30.0) - retire_after_s(poll_s=2.0) == 28.0


def test_the_bound_follows_the_drain_the_deployment_sets() -> None:
    assert retire_after_s(poll_s=2.0, drain_s=120.0) - retire_after_s(poll_s=2.0, drain_s=DRAIN_S) == 120.0 - DRAIN_S


@pytest.mark.parametrize(("poll_s", "drain_s"), [(0.0, DRAIN_S), (2.0, 0.0)], ids=["no poll period", "no drain"])
def test_a_poll_period_or_drain_that_is_not_positive_is_refused(poll_s: float, drain_s: float) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        retire_after_s(poll_s=poll_s, drain_s=drain_s)


def test_a_gateway_without_a_drain_is_refused() -> None:
    with pytest.raises(ValueError, match="drain of a pipeline leaving service must be positive"):
        GatewaySettings(model_url="m.gguf", first_stage="127.0.0.1:1", context=64, drain_seconds=0)
