"""Activations between stages on one host through the receiving stage's shared-memory region: the same outputs as
inline, inline wherever the region cannot be opened, a reference that does not fit the region refused by name, and
the region's file gone once its stage stops."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from strata.gateway.local import StageProcess
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.client import Completion, Pipeline, Request, wait_loaded
from strata.stage_worker.server import RunningStage
from strata.stage_worker.shared_hop import SHM, HopLink, HopRegion, HopWriter
from strata_testbed.pipelines import local_pipeline

SPANS = ((0, 2), (2, 3))
ELSEWHERE = "strata-hop-1-1-00000000deadbeef"  # a region's name, of no region here
TERMS = itertools.count(1)
REQUESTS = (
    Request(prompt=(1, 17, 200, 3, 45, 99, 12, 7, 250, 31, 64, 128, 5), max_tokens=6, prompt_logits=True),
    Request(prompt=tuple(range(4, 4 + 22)), max_tokens=6),  # cut into 4-position pieces by the first stage
)


def status(port: int) -> stage_pb2.LoadStatus:
    stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    reply: stage_pb2.LoadStatus = stub.GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=10)
    return reply


@contextmanager
def stage_process(model: Path, folder: Path, index: int, *, next_port: int = 0, **env: str) -> Iterator[int]:
    """`strata stage-worker` for SPANS[index] as a child process, loaded; yields its port and stops it with SIGTERM."""
    start, end = SPANS[index]
    process = StageProcess(
        env={
            "STRATA_STAGE_INDEX": str(index), "STRATA_LAYER_START": str(start), "STRATA_LAYER_END": str(end),
            "STRATA_MODEL_URL": str(model), "STRATA_CONTEXT": "64", "STRATA_PARALLEL": "2",
            "STRATA_CACHE_TYPE_K": "f32", "STRATA_CACHE_TYPE_V": "f32", "STRATA_LISTEN": "127.0.0.1:0",
            "STRATA_NEXT_STAGE": f"127.0.0.1:{next_port}" if next_port else "", "STRATA_PIPELINE_CHUNK": "4", **env,
        },
        log_path=folder / f"stage-{index}.log",
    )  # fmt: skip
    try:
        wait_loaded(f"127.0.0.1:{process.port}", timeout_s=120)
        yield process.port
    finally:
        process.stop()


@dataclass(frozen=True)
class Run:
    completions: list[Completion]
    last: stage_pb2.LoadStatus  # the last stage's, after the run: how the activations came


def run_two_stages(model: Path, folder: Path, *, hop_slots: int, remove_region: bool = False) -> Run:
    with ExitStack() as stack:
        last = stack.enter_context(stage_process(model, folder, 1, STRATA_HOP_SLOTS=str(hop_slots)))
        if remove_region:  # as if on another host: the advertised file is not there to open
            (SHM / status(last).hop_region.name).unlink()
        first = stack.enter_context(stage_process(model, folder, 0, next_port=last))
        pipeline = Pipeline(f"127.0.0.1:{first}", fence=stage_pb2.Fence(term=1, holder="test", lease_uid="lease"))
        pipeline.claim()
        completions = pipeline.generate(list(REQUESTS), slots=2, prefill_chunk=16)
        pipeline.link.close()
        return Run(completions=completions, last=status(last))


@pytest.fixture(scope="module")
def inline(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = run_two_stages(tiny_models["llama"], tmp_path_factory.mktemp("inline"), hop_slots=0)
    assert not run.last.hop_region.name
    assert run.last.activations_inline > 0
    assert run.last.activations_shared == 0
    return run


@pytest.mark.parametrize(
    ("name", "remove_region", "way"),
    [
        ("a next stage on the same host takes them through its region", False, "shared"),
        ("a region that cannot be opened leaves them inline", True, "inline"),
    ],
)
def test_two_stage_processes_compute_the_same_through_shared_memory_as_inline(
    tiny_models: dict[str, Path], tmp_path: Path, inline: Run, name: str, remove_region: bool, way: str
) -> None:
    run = run_two_stages(tiny_models["llama"], tmp_path, hop_slots=4, remove_region=remove_region)
    counts = {"shared": run.last.activations_shared, "inline": run.last.activations_inline}
    assert counts[way] > 0
    assert sum(counts.values()) == counts[way], counts
    for ours, theirs in zip(run.completions, inline.completions, strict=True):
        assert ours.tokens == theirs.tokens
        assert ours.logprobs == theirs.logprobs
        assert len(ours.prompt_logits) == len(theirs.prompt_logits)
        assert all(torch.equal(a, b) for a, b in zip(ours.prompt_logits, theirs.prompt_logits, strict=True))


@pytest.fixture(scope="module")
def in_process(tiny_models: dict[str, Path]) -> Iterator[list[RunningStage]]:
    with local_pipeline(tiny_models["llama"], list(SPANS), context=64) as stages:
        yield stages


def changed(**fields: object) -> Callable[[stage_pb2.SharedTensor | stage_pb2.SharedRegion], None]:
    def change(message: stage_pb2.SharedTensor | stage_pb2.SharedRegion) -> None:
        for field, value in fields.items():
            setattr(message, field, value)

    return change


def with_shape(*shape: int) -> Callable[[stage_pb2.SharedTensor], None]:
    def change(ref: stage_pb2.SharedTensor) -> None:
        del ref.shape[:]
        ref.shape.extend(shape)

    return change


def next_sequence(ref: stage_pb2.SharedTensor) -> None:
    ref.sequence += 1


def unchanged(ref: stage_pb2.SharedTensor) -> None:
    pass


@pytest.mark.parametrize(
    ("name", "change", "refused"),
    [
        ("a reference as written is read", unchanged, None),
        ("another region", changed(region=ELSEWHERE), f"shared region {ELSEWHERE!r}, not in this stage's"),
        ("a slot past the region's end", changed(slot=4), "slot 4 is outside shared region strata-hop-"),
        ("more bytes than a slot holds", with_shape(1 << 20, 64), "takes 268435456 bytes; a slot of shared region"),
        ("a negative dimension", with_shape(-3, 64), "shape (-3, 64) has a negative dimension"),
        ("a dtype that is no wire dtype", changed(dtype="int8"), "tensor dtype 'int8'"),
        ("a sequence the slot does not hold", next_sequence, "held sequence"),
    ],
)
def test_a_reference_that_does_not_fit_the_region_is_refused_by_name(
    in_process: list[RunningStage],
    name: str,
    change: Callable[[stage_pb2.SharedTensor], None],
    refused: str | None,
) -> None:
    last = in_process[1]
    assert last.service.hop_region is not None
    writer = HopWriter.attach(last.service.hop_region.advert())
    assert writer is not None
    dim = last.service.engine.model.config.dim
    placed = writer.write(torch.randn(3, dim), timeout_s=1)
    assert placed is not None
    ref, release = placed
    change(ref)
    stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(f"127.0.0.1:{last.port}"))
    fence = stage_pb2.Fence(term=next(TERMS), holder="test", lease_uid="lease")
    stub.Claim(stage_pb2.ClaimRequest(fence=fence))
    stub.ResetSlot(stage_pb2.ResetSlotRequest(fence=fence, slot=0))
    step = stage_pb2.ForwardRequest(
        fence=fence, step_id=1, chunks=[stage_pb2.SlotChunk(slot=0, length=3, sample=True)], shared_hidden=ref
    )
    try:
        if refused is None:
            assert next(stub.Forward(iter([step]), timeout=30)).tokens
        else:
            with pytest.raises(grpc.RpcError) as caught:
                next(stub.Forward(iter([step]), timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused in caught.value.details()
    finally:
        release()


@pytest.mark.parametrize(
    ("name", "advert", "attached"),
    [
        ("the region as advertised", changed(), True),
        ("a file that is not there (another host)", changed(name=ELSEWHERE), False),
        ("another token (another host's file of that name)", changed(token=b"x" * 16), False),
        ("a layout the file does not have", changed(slots=3), False),
        ("a name that is no region's", changed(name=f"../{ELSEWHERE}"), False),
    ],
)
def test_a_sender_attaches_only_to_the_region_it_can_open_and_recognise(
    tmp_path: Path, name: str, advert: Callable[[stage_pb2.SharedRegion], None], attached: bool
) -> None:
    region = HopRegion(slots=2, slot_bytes=4096, folder=tmp_path)
    try:
        message = region.advert()
        advert(message)
        assert (HopWriter.attach(message, folder=tmp_path) is not None) == attached
    finally:
        region.close()


@pytest.mark.parametrize(
    ("name", "loaded", "attached", "asks_again"),
    [
        ("a loaded stage's region is attached to, and its answer stands", True, True, False),
        ("a stage still loading is asked again after a while", False, False, True),
    ],
)
def test_a_sender_asks_for_the_region_once_the_next_stage_has_loaded_and_again_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, loaded: bool, attached: bool, asks_again: bool
) -> None:
    region = HopRegion(slots=2, slot_bytes=4096, folder=tmp_path)
    asked: list[int] = []

    def load_status() -> stage_pb2.LoadStatus:
        asked.append(1)
        return stage_pb2.LoadStatus(loaded=loaded, hop_region=region.advert() if loaded else None)

    monkeypatch.setattr("strata.stage_worker.shared_hop.RETRY_S", 0.0 if asks_again else 60.0)
    link = HopLink(load_status, folder=tmp_path)
    try:
        first = link.writer()
        assert (first is not None) == attached
        assert link.writer() is first
        assert len(asked) == (2 if asks_again else 1)
        link.ask_again()  # a call to the next stage failed
        assert link.writer() is first  # the same region: the same writer, so no slot has two owners
        assert len(asked) == (3 if asks_again else 2)
    finally:
        region.close()


@pytest.mark.parametrize(
    ("name", "signum", "gone_at_stop"),
    [
        ("stopped with SIGTERM, it removes its region", signal.SIGTERM, True),
        ("killed with SIGKILL, the next stage on the host removes it", signal.SIGKILL, False),
    ],
)
def test_a_stages_region_is_removed_once_it_stops(
    tiny_models: dict[str, Path], tmp_path: Path, name: str, signum: int, gone_at_stop: bool
) -> None:
    model = tiny_models["llama"]
    start, end = SPANS[1]
    env = {
        "STRATA_STAGE_INDEX": "1", "STRATA_LAYER_START": str(start), "STRATA_LAYER_END": str(end),
        "STRATA_MODEL_URL": str(model), "STRATA_CONTEXT": "64", "STRATA_LISTEN": "127.0.0.1:0",
    }  # fmt: skip
    stage = StageProcess(env=env, log_path=tmp_path / "stage.log")
    try:
        wait_loaded(f"127.0.0.1:{stage.port}", timeout_s=120)
        path = SHM / status(stage.port).hop_region.name
        assert path.exists()
        stage.send_signal(signum)
        stage.stop()
        assert path.exists() != gone_at_stop
    finally:
        stage.stop()
    with stage_process(model, tmp_path, 1) as port:
        assert status(port).hop_region.name != path.name
        assert not path.exists()
