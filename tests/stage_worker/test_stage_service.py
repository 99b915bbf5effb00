"""The Stage service's contract: load status and health, fencing, refusals with a code and a message, and a dead
next stage failing the step at once with a retryable code."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from strata.gguf import read_header
from strata.gguf.sources import open_source
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.client import Pipeline, Request
from strata.stage_worker.errors import NextStageUnavailableError
from strata.stage_worker.server import RunningStage
from strata.stage_worker.wire import tensor_to_proto
from strata_testbed.pipelines import local_pipeline

TERMS = itertools.count(100)
SPANS = [(0, 1), (1, 3)]


def fence(term: int, holder: str = "coordinator-a") -> stage_pb2.Fence:
    return stage_pb2.Fence(term=term, holder=holder, lease_uid=f"lease-{holder}")


def stub(stage: RunningStage) -> stage_pb2_grpc.StageStub:
    return stage_pb2_grpc.StageStub(grpc.insecure_channel(f"127.0.0.1:{stage.port}"))


def forward_once(stage: RunningStage, request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardReply:
    replies: Iterator[stage_pb2.ForwardReply] = stub(stage).Forward(iter([request]), timeout=30)
    return next(replies)


@pytest.fixture(scope="module")
def two_stages(tiny_models: dict[str, Path]) -> Iterator[list[RunningStage]]:
    with local_pipeline(tiny_models["llama"], SPANS, context=32, parallel=2) as stages:
        yield stages


def test_every_stage_reports_loaded_bytes_of_only_its_own_tensors(
    two_stages: list[RunningStage], tiny_models: dict[str, Path]
) -> None:
    header = read_header(open_source(str(tiny_models["llama"])))
    for stage, (start, end) in zip(two_stages, SPANS, strict=True):
        status = stub(stage).GetLoadStatus(stage_pb2.LoadStatusRequest())
        wanted = {f"blk.{il}." for il in range(start, end)}
        expected = sum(t.nbytes for t in header.tensors if t.name[: t.name.index(".", 4) + 1] in wanted)
        expected += sum(header.tensor_by_name[n].nbytes for n in ("token_embd.weight",) if start == 0)
        expected += sum(header.tensor_by_name[n].nbytes for n in ("output_norm.weight", "output.weight") if end == 3)
        assert (status.loaded, status.bytes_loaded, status.bytes_total) == (True, expected, expected)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{stage.port}"))
        serving = health.Check(health_pb2.HealthCheckRequest(service="strata.rpc.v1.Stage"))
        assert serving.status == health_pb2.HealthCheckResponse.SERVING


def test_claims_accept_newer_terms_and_refuse_older_ones_and_other_holders(two_stages: list[RunningStage]) -> None:
    first = stub(two_stages[0])
    term = next(TERMS)
    assert first.Claim(stage_pb2.ClaimRequest(fence=fence(term))).accepted_term == term
    assert stub(two_stages[1]).GetLoadStatus(stage_pb2.LoadStatusRequest()).accepted_term == term
    with pytest.raises(grpc.RpcError) as older:
        first.Claim(stage_pb2.ClaimRequest(fence=fence(term - 1, "coordinator-b")))
    assert older.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"term {term - 1}" in older.value.details()
    assert f"accepted term {term}" in older.value.details()
    with pytest.raises(grpc.RpcError) as same:
        first.Claim(stage_pb2.ClaimRequest(fence=fence(term, "coordinator-b")))
    assert same.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "coordinator-a" in same.value.details()
    assert "coordinator-b" in same.value.details()


def chunk(slot: int = 0, start: int = 0, length: int = 2) -> stage_pb2.SlotChunk:
    return stage_pb2.SlotChunk(slot=slot, start_position=start, length=length, token_ids=[5] * length, sample=True)


@pytest.mark.parametrize(
    ("stage_index", "build", "code", "message"),
    [
        pytest.param(
            1,
            lambda f: stage_pb2.ForwardRequest(fence=f, chunks=[chunk()], hidden=tensor_to_proto(torch.zeros(2, 7))),
            grpc.StatusCode.INVALID_ARGUMENT,
            "hidden states must be [2, 128]",
            id="hidden states of the wrong width are refused",
        ),
        pytest.param(
            0,
            lambda f: stage_pb2.ForwardRequest(fence=f, chunks=[chunk(slot=9)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "slot 9 does not exist",
            id="an unknown slot is refused",
        ),
        pytest.param(
            0,
            lambda f: stage_pb2.ForwardRequest(fence=f, chunks=[chunk(length=40)]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "exceed the context of 32",
            id="positions beyond the context are refused",
        ),
        pytest.param(
            0,
            lambda f: stage_pb2.ForwardRequest(fence=stage_pb2.Fence(term=f.term - 1, holder="old"), chunks=[chunk()]),
            grpc.StatusCode.FAILED_PRECONDITION,
            "is older than the accepted term",
            id="a step from a stale term is refused",
        ),
        pytest.param(
            0,
            lambda f: stage_pb2.ForwardRequest(fence=f, plan_generation=7, chunks=[chunk()]),
            grpc.StatusCode.FAILED_PRECONDITION,
            "plan generation 7",
            id="a step for another plan generation is refused",
        ),
    ],
)
def test_bad_steps_are_refused_with_a_code_and_a_message(
    two_stages: list[RunningStage],
    stage_index: int,
    build: object,
    code: grpc.StatusCode,
    message: str,
) -> None:
    current = fence(next(TERMS))
    stub(two_stages[0]).Claim(stage_pb2.ClaimRequest(fence=current))
    assert callable(build)
    with pytest.raises(grpc.RpcError) as refused:
        forward_once(two_stages[stage_index], build(current))
    assert refused.value.code() == code
    assert message in refused.value.details()


def test_a_dead_next_stage_fails_the_step_promptly_and_frees_its_slots(tiny_models: dict[str, Path]) -> None:
    with local_pipeline(tiny_models["qwen2"], [(0, 1), (1, 2), (2, 3)], context=64, parallel=2) as stages:
        pipeline = Pipeline(f"127.0.0.1:{stages[0].port}", fence=fence(1), step_timeout_s=10)
        pipeline.claim()
        assert len(pipeline.generate([Request(prompt=(1, 2, 3), max_tokens=3)], slots=2)[0].tokens) == 3
        stages[2].stop(0)
        started = time.monotonic()
        # The client maps the first stage's UNAVAILABLE to its typed, retryable error.
        with pytest.raises(NextStageUnavailableError, match="is unavailable"):
            pipeline.generate([Request(prompt=(4, 5, 6, 7), max_tokens=3)], slots=2)
        assert time.monotonic() - started < 5
        for stage in stages[:2]:
            pool = stage.service.engine.pool
            assert pool.free_cells == pool.full.cells, "every block is back"
