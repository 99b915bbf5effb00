"""Stages that share a device in one process: each its own service on its own port, the activations handed from one
to the next as the tensor itself, the same tokens as one stage and as separate stages, a prefill kept whole unless a
stage in another process follows, and a refusal of the in-process stage answered with its code at the first stage."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from strata.gguf.model import CacheType
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.client import Pipeline, Request
from strata.stage_worker.co_located import CoLocatedStages, co_located_settings, parse_split
from strata.stage_worker.engine import Chunk, StepResult
from strata.stage_worker.server import RunningStage
from strata.stage_worker.settings import StageSettings
from strata_testbed.pipelines import local_pipeline

PROMPTS = ((3, 1, 4, 1, 5, 9, 2, 6) * 3, (2, 7, 1, 8, 2))
TERMS = itertools.count(10)
PROCESS = StageSettings(
    stage_index=1, layer_start=2, layer_end=8, model_url="m.gguf", context=64, parallel=2, next_stage="h:1"
)


@pytest.mark.parametrize(
    ("name", "split", "listen", "expected"),
    [
        ("no split is one stage", "", "127.0.0.1:0", [(1, 2, 8, "127.0.0.1:0", "h:1")]),
        (
            "a split makes consecutive stages; only the last has the next stage",
            "4,5",
            "127.0.0.1:0",
            [(1, 2, 4, "127.0.0.1:0", ""), (2, 4, 5, "127.0.0.1:0", ""), (3, 5, 8, "127.0.0.1:0", "h:1")],
        ),
        (
            "one address per stage",
            "4",
            "127.0.0.1:7001,127.0.0.1:7002",
            [(1, 2, 4, "127.0.0.1:7001", ""), (2, 4, 8, "127.0.0.1:7002", "h:1")],
        ),
    ],
)
def test_a_process_span_divides_into_its_stages(
    name: str, split: str, listen: str, expected: list[tuple[int, int, int, str, str]]
) -> None:
    stages = co_located_settings(replace(PROCESS, listen=listen), split_at=parse_split(split))
    assert [(s.stage_index, s.layer_start, s.layer_end, s.listen, s.next_stage) for s in stages] == expected


@pytest.mark.parametrize(
    ("name", "split", "listen", "message"),
    [
        ("a split outside the span", "8", "127.0.0.1:0", "split-at 8 must divide layers [2, 8) at increasing layers"),
        ("splits out of order", "5,4", "127.0.0.1:0", "split-at 5,4 must divide layers [2, 8)"),
        ("a split that is not a number", "four", "127.0.0.1:0", "split-at 'four' is not a comma-separated list"),
        (
            "one fixed port for two stages",
            "4",
            "127.0.0.1:7001",
            "listen address 127.0.0.1:7001 serves one stage; 2 stages in one process need one address each",
        ),
        ("three addresses for two stages", "4", "a:1,a:2,a:3", "listen names 3 addresses for 2 stages"),
    ],
)
def test_a_split_that_does_not_fit_is_refused_with_what_is_wrong(
    name: str, split: str, listen: str, message: str
) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace(")", r"\)")):
        co_located_settings(replace(PROCESS, listen=listen), split_at=parse_split(split))


def generate(stages: list[RunningStage]) -> list[list[int]]:
    pipeline = Pipeline(f"127.0.0.1:{stages[0].port}", fence=stage_pb2.Fence(term=next(TERMS), holder="test"))
    pipeline.claim()
    done = pipeline.generate([Request(prompt=p, max_tokens=8) for p in PROMPTS], slots=2)
    return [c.tokens for c in done]


@pytest.fixture(scope="module")
def llama(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


@pytest.mark.parametrize(
    "spans",
    [pytest.param([(0, 1), (1, 3)], id="two stages"), pytest.param([(0, 1), (1, 2), (2, 3)], id="three stages")],
)
def test_co_located_stages_generate_what_one_stage_and_separate_stages_do(
    llama: Path, spans: list[tuple[int, int]]
) -> None:
    with local_pipeline(llama, [(0, 3)]) as one:
        expected = generate(one)
    with local_pipeline(llama, spans) as separate:
        assert generate(separate) == expected
    with local_pipeline(llama, spans, co_located=True) as co_located:
        assert generate(co_located) == expected
        statuses = [stage.service.GetLoadStatus(stage_pb2.LoadStatusRequest(), None) for stage in co_located]
    assert [s.activations_in_process > 0 for s in statuses] == [False] + [True] * (len(spans) - 1)
    assert all(s.activations_inline == s.activations_shared == 0 for s in statuses), "no hop left the process"
    assert all(not s.hop_region.name for s in statuses), "no stage makes a shared region for a stage beside it"
    assert len({s.port for s in co_located}) == len(spans), "each stage answers on a port of its own"


def slow_steps(stage: RunningStage, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the positions of each step `stage` computes."""
    engine = stage.service.engine
    real_step = engine.step
    seen: list[int] = []

    def step(chunks: list[Chunk], hidden: torch.Tensor | None) -> StepResult:
        seen.append(sum(c.length for c in chunks))
        return real_step(chunks, hidden)

    monkeypatch.setattr(engine, "step", step)
    return seen


def first_token(stages: list[RunningStage], prompt: tuple[int, ...]) -> int:
    pipeline = Pipeline(f"127.0.0.1:{stages[0].port}", fence=stage_pb2.Fence(term=next(TERMS), holder="test"))
    pipeline.claim()
    pipeline.reset(0)
    reply = pipeline.step([stage_pb2.SlotChunk(slot=0, length=len(prompt), token_ids=prompt, sample=True)])
    token: int = reply.tokens[0].token_id
    return token


@contextmanager
def then_another_process(model: Path, *, pipeline_chunk: int) -> Iterator[list[RunningStage]]:
    """Stages 0 and 1 in one group whose last stage sends on over gRPC to stage 2, as a process of its own would."""
    base = StageSettings(
        stage_index=0, layer_start=0, layer_end=1, model_url=str(model), context=128, parallel=2,
        cache_type_k=CacheType.F32, cache_type_v=CacheType.F32, listen="127.0.0.1:0", pipeline_chunk=pipeline_chunk,
    )  # fmt: skip
    last = RunningStage(replace(base, stage_index=2, layer_start=2, layer_end=3))
    group = CoLocatedStages(
        [replace(base, layer_end=1), replace(base, stage_index=1, layer_start=1, layer_end=2,
                                            next_stage=f"127.0.0.1:{last.port}")]
    )  # fmt: skip
    stages = [*group.stages, last]
    try:
        for stage in stages:
            stage.loader.join(60)
            assert stage.service.progress.loaded
            assert not stage.service.progress.error
        yield stages
    finally:
        for stage in stages:
            stage.stop(0)


def test_a_prefill_stays_whole_in_process_and_goes_in_pieces_to_another_process(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = PROMPTS[0]
    with local_pipeline(llama, [(0, 3)]) as one:
        expected = first_token(one, prompt)
    with local_pipeline(llama, [(0, 1), (1, 3)], co_located=True, pipeline_chunk=4) as co_located:
        seen = slow_steps(co_located[1], monkeypatch)
        assert first_token(co_located, prompt) == expected
        assert seen == [len(prompt)], "both stages share a device: nothing to overlap, so no pieces"
    with then_another_process(llama, pipeline_chunk=4) as mixed:
        seen = slow_steps(mixed[2], monkeypatch)
        assert first_token(mixed, prompt) == expected
        assert seen == [4] * 6, "the stage in another process gets pieces, to work on one while the next is computed"
        assert mixed[1].service.GetLoadStatus(stage_pb2.LoadStatusRequest(), None).activations_in_process == 6


def test_a_refusal_of_the_stage_in_process_comes_back_with_its_code(llama: Path) -> None:
    with local_pipeline(llama, [(0, 1), (1, 3)], co_located=True) as (first, second):
        newer = stage_pb2.Fence(term=next(TERMS) + 100, holder="newer")
        older = stage_pb2.Fence(term=newer.term - 1, holder="older")
        with grpc.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            stage_pb2_grpc.StageStub(channel).Claim(stage_pb2.ClaimRequest(fence=newer), timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{first.port}") as channel, pytest.raises(grpc.RpcError) as refused:
            stage_pb2_grpc.StageStub(channel).Claim(stage_pb2.ClaimRequest(fence=older), timeout=10)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"stage 1: term {older.term} (holder 'older') is older" in (refused.value.details() or "")


def test_co_located_stages_load_on_one_thread(llama: Path) -> None:
    with local_pipeline(llama, [(0, 1), (1, 3)], co_located=True) as (first, second):
        assert first.loader is second.loader, "one loader thread: no capture runs beside another stage's load"
