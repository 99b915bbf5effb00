"""The serving pipelines read from a ModelDeployment's status, and following them as they change."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest
from strata.gateway.pipeline_list import PipelineFollower, PipelineListError, serving_pipelines
from strata.gateway.pipelines import PipelineEntry
from strata.modeldeployment import stage_address


def listed(index: int, generation: int, *, ready: bool = True, parallel: int = 4) -> dict[str, Any]:
    serving = {"generation": generation, "parallel": parallel, "contextLength": 8192, "stages": []}
    return {"index": index, "plan": serving, "serving": serving, "ready": ready}


def entry(index: int, generation: int) -> PipelineEntry:
    address = stage_address("chat", "team", generation=generation, index=0)
    return PipelineEntry(index=index, generation=generation, first_stage=address, parallel=4, context=8192)


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        pytest.param({}, None, id="a status without pipelines lists nothing yet"),
        pytest.param({"pipelines": []}, [], id="an empty list means no pipeline serves"),
        pytest.param(
            {"pipelines": [listed(1, 7), listed(0, 3)]}, [entry(0, 3), entry(1, 7)], id="ready pipelines, by index"
        ),
        pytest.param(
            {"pipelines": [listed(0, 3), listed(1, 7, ready=False)]}, [entry(0, 3)], id="one not ready is left out"
        ),
        pytest.param(
            {"pipelines": [{"index": 2, "plan": listed(2, 9)["plan"], "ready": False}]},
            [],
            id="one without a serving plan is left out",
        ),
    ],
)
def test_the_ready_pipelines_of_a_status(status: dict[str, Any], expected: list[PipelineEntry] | None) -> None:
    assert serving_pipelines(status, deployment="chat", namespace="team") == expected


def test_a_first_stage_is_the_stage_pod_the_operator_names() -> None:
    (found,) = serving_pipelines({"pipelines": [listed(0, 12)]}, deployment="chat", namespace="team") or []
    assert found.first_stage == "chat-g12-s0-0.chat-stages.team.svc.cluster.local:50051"


@pytest.mark.parametrize(
    ("status", "message"),
    [
        pytest.param({"pipelines": {}}, "must be a list", id="a list that is not a list"),
        pytest.param({"pipelines": ["x"]}, r"pipelines\[0\] must be an object", id="an entry that is not an object"),
        pytest.param(
            {"pipelines": [listed(0, 3, parallel=0)]},
            r"serving.parallel must be an integer of at least 1",
            id="no lanes",
        ),
        pytest.param(
            {"pipelines": [listed(0, 3) | {"index": True}]}, r"index must be an integer", id="a boolean for an index"
        ),
        pytest.param({"pipelines": [listed(0, 3), listed(0, 4)]}, "names an index twice", id="one index twice"),
    ],
)
def test_a_status_this_gateway_cannot_read_says_where(status: dict[str, Any], message: str) -> None:
    with pytest.raises(PipelineListError, match=message):
        serving_pipelines(status, deployment="chat", namespace="team")


def test_the_follower_applies_each_change_once_and_keeps_the_list_when_a_read_fails() -> None:
    reads: list[Sequence[PipelineEntry] | Exception | None] = [
        None,
        [entry(0, 1)],
        [entry(0, 1)],
        OSError("the API server is away"),
        PipelineListError("status.pipelines must be a list"),
        [entry(0, 1), entry(1, 2)],
        [],
    ]
    applied: list[Sequence[PipelineEntry]] = []

    def read() -> Sequence[PipelineEntry] | None:
        result = reads.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    async def apply(entries: Sequence[PipelineEntry]) -> None:
        applied.append(entries)

    async def run() -> None:
        follower = PipelineFollower(read=read, apply=apply, period_s=60, source="a test")
        for _ in range(7):
            await follower.poll()

    asyncio.run(run())
    assert applied == [(entry(0, 1),), (entry(0, 1), entry(1, 2)), ()]
