"""SavePrefix and RestorePrefix over real gRPC through three stage servers: every stage acts, the figures are summed,
and the fence holds: no snapshot outlives a coordinator term, and calls from stale terms or other generations fail."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.server import RunningStage
from strata_testbed.pipelines import local_pipeline

GENERATION = 4
TERMS = itertools.count(10)
PROMPT = tuple(range(3, 35))  # 32 tokens
BUDGET = 1 << 20


def fence(term: int, holder: str = "coordinator-a") -> stage_pb2.Fence:
    return stage_pb2.Fence(term=term, holder=holder, lease_uid=f"lease-{holder}")


@pytest.fixture(scope="module")
def stages(prefix_models: dict[str, Path]) -> Iterator[list[RunningStage]]:
    spans = [(0, 1), (1, 2), (2, 3)]
    with local_pipeline(
        prefix_models["llama"], spans, context=128, parallel=2, prefix_cache_bytes=BUDGET, plan_generation=GENERATION
    ) as running:
        yield running


@pytest.fixture
def first(stages: list[RunningStage]) -> Iterator[stage_pb2_grpc.StageStub]:
    with grpc.insecure_channel(f"127.0.0.1:{stages[0].port}") as channel:
        yield stage_pb2_grpc.StageStub(channel)


def claim(first: stage_pb2_grpc.StageStub, term: int, holder: str = "coordinator-a") -> stage_pb2.Fence:
    current = fence(term, holder)
    first.Claim(stage_pb2.ClaimRequest(fence=current, plan_generation=GENERATION))
    return current


def prefill(first: stage_pb2_grpc.StageStub, current: stage_pb2.Fence, *, slot: int) -> None:
    chunk = stage_pb2.SlotChunk(slot=slot, start_position=0, length=len(PROMPT), token_ids=PROMPT, sample=True)
    request = stage_pb2.ForwardRequest(fence=current, plan_generation=GENERATION, step_id=1, chunks=[chunk])
    reply = next(first.Forward(iter([request]), timeout=30))
    assert len(reply.tokens) == 1


def save(first: stage_pb2_grpc.StageStub, current: stage_pb2.Fence, *, key: bytes) -> stage_pb2.SavePrefixReply:
    request = stage_pb2.SavePrefixRequest(fence=current, plan_generation=GENERATION, slot=0, key=key, length=16)
    reply: stage_pb2.SavePrefixReply = first.SavePrefix(request, timeout=30)
    return reply


def restore(
    first: stage_pb2_grpc.StageStub, current: stage_pb2.Fence, *, key: bytes, generation: int = GENERATION
) -> stage_pb2.RestorePrefixReply:
    request = stage_pb2.RestorePrefixRequest(fence=current, plan_generation=generation, slot=1, key=key, length=16)
    reply: stage_pb2.RestorePrefixReply = first.RestorePrefix(request, timeout=30)
    return reply


def test_every_stage_keeps_and_restores_its_own_layers_and_the_reply_sums_them(
    stages: list[RunningStage], first: stage_pb2_grpc.StageStub
) -> None:
    current = claim(first, next(TERMS))
    prefill(first, current, slot=0)
    saved = save(first, current, key=b"prefix-a")
    per_stage = [stage.service.prefix_cache.stats() for stage in stages]
    assert saved.kept
    assert [s.snapshots for s in per_stage] == [1, 1, 1]
    assert saved.stats.bytes_held == sum(s.bytes_held for s in per_stage) > 0
    assert saved.stats.budget_bytes == 3 * BUDGET
    restored = restore(first, current, key=b"prefix-a")
    assert restored.restored
    assert restored.stats.hits == 3
    assert [stage.service.engine.pool.length(1) for stage in stages] == [16, 16, 16]


def test_a_stage_that_lost_the_snapshot_makes_the_whole_restore_miss(
    stages: list[RunningStage], first: stage_pb2_grpc.StageStub
) -> None:
    current = claim(first, next(TERMS))
    prefill(first, current, slot=0)
    assert save(first, current, key=b"prefix-b").kept
    stages[1].service.prefix_cache.clear()
    before = stages[1].service.prefix_cache.stats().misses
    reply = restore(first, current, key=b"prefix-b")
    assert not reply.restored
    assert stages[1].service.prefix_cache.stats().misses == before + 1
    assert stages[2].service.engine.pool.length(1) == 16, "the stages after the miss still answered"


@pytest.mark.parametrize(
    ("holder", "term_step", "kept"),
    [
        pytest.param("coordinator-a", 0, True, id="the same term claiming again keeps the snapshots"),
        pytest.param("coordinator-b", 1, False, id="a newer term drops every snapshot on every stage"),
    ],
)
def test_snapshots_never_cross_coordinator_terms(
    stages: list[RunningStage], first: stage_pb2_grpc.StageStub, holder: str, term_step: int, kept: bool
) -> None:
    term = next(TERMS)
    current = claim(first, term)
    prefill(first, current, slot=0)
    assert save(first, current, key=b"prefix-c").kept
    later = claim(first, term + term_step, holder)
    reply = restore(first, later, key=b"prefix-c")
    assert reply.restored is kept
    assert (reply.stats.snapshots > 0) is kept
    next(TERMS)  # the next test starts above the term used here


@pytest.mark.parametrize(
    ("build", "code", "message"),
    [
        pytest.param(
            lambda f: stage_pb2.RestorePrefixRequest(
                fence=f, plan_generation=GENERATION + 1, slot=1, key=b"prefix-d", length=16
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"plan generation {GENERATION + 1}",
            id="a restore for another plan generation is refused",
        ),
        pytest.param(
            lambda f: stage_pb2.RestorePrefixRequest(
                fence=fence(f.term - 1, "old"), plan_generation=GENERATION, slot=1, key=b"prefix-d", length=16
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "is older than the accepted term",
            id="a restore from a stale term is refused",
        ),
        pytest.param(
            lambda f: stage_pb2.RestorePrefixRequest(
                fence=fence(f.term, "intruder"), plan_generation=GENERATION, slot=1, key=b"prefix-d", length=16
            ),
            grpc.StatusCode.FAILED_PRECONDITION,
            "cannot use it",
            id="a restore from another holder of the same term is refused",
        ),
        pytest.param(
            lambda f: stage_pb2.SavePrefixRequest(fence=f, plan_generation=GENERATION, slot=0, key=b"", length=16),
            grpc.StatusCode.INVALID_ARGUMENT,
            "a prefix key is 1 to 64 bytes",
            id="a save without a key is refused",
        ),
        pytest.param(
            lambda f: stage_pb2.SavePrefixRequest(fence=f, plan_generation=GENERATION, slot=0, key=b"x", length=99),
            grpc.StatusCode.INVALID_ARGUMENT,
            "holds 32 positions",
            id="a save of more positions than the slot holds is refused",
        ),
    ],
)
def test_bad_prefix_calls_are_refused_with_a_code_and_a_message(
    stages: list[RunningStage], first: stage_pb2_grpc.StageStub, build: object, code: grpc.StatusCode, message: str
) -> None:
    current = claim(first, next(TERMS))
    prefill(first, current, slot=0)
    assert save(first, current, key=b"prefix-d").kept
    request = build(current)  # type: ignore[operator]
    call = first.RestorePrefix if isinstance(request, stage_pb2.RestorePrefixRequest) else first.SavePrefix
    with pytest.raises(grpc.RpcError) as refused:
        call(request, timeout=30)
    assert refused.value.code() == code
    assert message in refused.value.details()
    assert stages[2].service.prefix_cache.stats().snapshots == 1, "a refused call changed nothing"
