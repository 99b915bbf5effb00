"""A long prefill crosses the stages in pieces: the first stage sends each piece on as soon as it is computed, the
next stage works on it meanwhile, and the step's answer is the same as in one piece."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.engine import Chunk, StepResult
from strata.stage_worker.forward_stream import split_prefill
from strata.stage_worker.server import RunningStage
from strata.stage_worker.wire import tensor_to_proto
from strata_testbed.pipelines import local_pipeline

TERMS = itertools.count(1)
PROMPT = tuple(range(3, 3 + 21))


def chunk(*, slot: int = 1, sample: bool = False, return_logits: bool = False) -> stage_pb2.SlotChunk:
    return stage_pb2.SlotChunk(
        slot=slot, start_position=5, length=10, token_ids=list(range(10)), sample=sample, return_logits=return_logits
    )


def request(*chunks: stage_pb2.SlotChunk, hidden: bool = False) -> stage_pb2.ForwardRequest:
    message = stage_pb2.ForwardRequest(step_id=7, chunks=chunks)
    if hidden:
        message.hidden.CopyFrom(tensor_to_proto(torch.zeros(sum(c.length for c in chunks), 4)))
    return message


@pytest.mark.parametrize(
    ("name", "message", "split", "pieces"),
    [
        ("a chunk longer than the split is cut", request(chunk(sample=True)), 4, [(5, 4), (9, 4), (13, 2)]),
        ("a chunk of exactly the split stays whole", request(chunk()), 10, [(5, 10)]),
        ("a split of 0 keeps every step whole", request(chunk()), 0, [(5, 10)]),
        ("a later stage's chunk (hidden states) stays whole", request(chunk(), hidden=True), 4, [(5, 10)]),
        ("a chunk that returns logits stays whole", request(chunk(return_logits=True)), 4, [(5, 10)]),
        ("a step of several slots stays whole", request(chunk(), chunk(slot=2)), 4, [(5, 10), (5, 10)]),
    ],
)
def test_split_prefill(name: str, message: stage_pb2.ForwardRequest, split: int, pieces: list[tuple[int, int]]) -> None:
    out = split_prefill(message, split=split)
    assert [(c.start_position, c.length) for piece in out for c in piece.chunks] == pieces
    assert all(piece.step_id == message.step_id for piece in out)
    if len(out) > 1:
        assert [t for piece in out for t in piece.chunks[0].token_ids] == list(message.chunks[0].token_ids)
        assert [piece.chunks[0].sample for piece in out] == [False] * (len(out) - 1) + [True]


@pytest.fixture(scope="module")
def pipelines(tiny_models: dict[str, Path]) -> Iterator[dict[str, list[RunningStage]]]:
    spans = [(0, 1), (1, 3)]
    with (
        local_pipeline(tiny_models["llama"], spans, context=64, pipeline_chunk=4) as pieces,
        local_pipeline(tiny_models["llama"], spans, context=64, pipeline_chunk=0) as whole,
    ):
        yield {"pieces": pieces, "whole": whole}


def prefill(stages: list[RunningStage]) -> stage_pb2.SampledToken:
    target = f"127.0.0.1:{stages[0].port}"
    stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(target))
    fence = stage_pb2.Fence(term=next(TERMS), holder="test", lease_uid="lease")
    stub.Claim(stage_pb2.ClaimRequest(fence=fence))
    stub.ResetSlot(stage_pb2.ResetSlotRequest(fence=fence, slot=0))
    step = stage_pb2.ForwardRequest(
        fence=fence, step_id=1, chunks=[stage_pb2.SlotChunk(slot=0, length=len(PROMPT), token_ids=PROMPT, sample=True)]
    )
    replies: Iterator[stage_pb2.ForwardReply] = stub.Forward(iter([step]), timeout=60)
    reply = next(replies)
    token: stage_pb2.SampledToken = reply.tokens[0]
    return token


def test_a_prefill_in_pieces_samples_what_one_piece_samples(pipelines: dict[str, list[RunningStage]]) -> None:
    pieces, whole = prefill(pipelines["pieces"]), prefill(pipelines["whole"])
    assert pieces.token_id == whole.token_id
    assert pieces.logprob == pytest.approx(whole.logprob, abs=1e-4)


def test_the_first_stage_computes_the_next_piece_while_the_next_stage_works(
    pipelines: dict[str, list[RunningStage]], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, last = pipelines["pieces"]
    sender = first.service.next_stage
    assert sender is not None
    engine = last.service.engine
    real_step = engine.step
    seen: list[int] = []
    in_flight: list[int] = []

    def slow_step(chunks: list[Chunk], hidden: torch.Tensor | None) -> StepResult:
        seen.append(sum(c.length for c in chunks))
        time.sleep(0.2)  # the next stage is busy: the first must not wait for it between pieces
        in_flight.append(sender.in_flight.now)  # pieces the first stage sent on meanwhile, this one included
        return real_step(chunks, hidden)

    monkeypatch.setattr(engine, "step", slow_step)
    prefill(pipelines["pieces"])
    assert seen == [4, 4, 4, 4, 4, 1]
    assert max(in_flight) >= 3
