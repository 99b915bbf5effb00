"""On a GPU, load failures that CUDA itself raises rather than a test's stand-in: a KV pool larger than the GPU's
memory, and a decode step whose capture a host synchronisation invalidates on every graph path. Either ends the
stage's load with CUDA's message in its load status and leaves it NOT_SERVING, where a stage's loader thread used to
die with the traceback in its log while callers waited on it.

These need a CUDA device; CI has none, so they run on a GPU lease and are skipped elsewhere. The CPU tests in
tests/stage_worker/test_load_failures.py inject the same failures and time the report against the 10 s bound; here
the failures are real, and a failed capture comes after torch.compile, which takes longer than that on a cold cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from strata.gguf import inspect_model
from strata.gguf.model import CacheType
from strata.gguf.testmodels import write_test_model
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker import server
from strata.stage_worker.decode import DecodeOutput, Decoder
from strata.stage_worker.server import RunningStage
from strata.stage_worker.settings import StageSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU lease)")

LOADED_OR_FAILED_WITHIN_S = 240.0  # compiling the decode step comes first, and a cold compile cache is slow


@dataclass(frozen=True)
class Size:
    context: int  # KV cells
    parallel: int  # slots: the slot table holds parallel x context cell numbers of 8 bytes


SERVING = Size(context=128, parallel=2)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("gpu") / "llama.gguf", architecture="llama", block_count=2).path


@contextmanager
def started_stage(model: Path, *, size: Size = SERVING) -> Iterator[RunningStage]:
    """The whole model as one in-process stage on cuda:0, loading in the background."""
    settings = StageSettings(
        stage_index=0, layer_start=0, layer_end=2, model_url=str(model), context=size.context, parallel=size.parallel,
        cache_type_k=CacheType.F32, cache_type_v=CacheType.F32, listen="127.0.0.1:0", device="cuda:0",
    )  # fmt: skip
    stage = RunningStage(settings)
    try:
        yield stage
    finally:
        stage.stop(0)


def load_outcome(stage: RunningStage) -> stage_pb2.LoadStatus:
    with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        deadline = time.monotonic() + LOADED_OR_FAILED_WITHIN_S
        while time.monotonic() < deadline:
            status: stage_pb2.LoadStatus = stub.GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=5)
            if status.loaded or status.error:
                return status
            time.sleep(0.1)
    pytest.fail(f"the stage neither loaded nor failed within {LOADED_OR_FAILED_WITHIN_S:g} s: {status}")


def serving_status(stage: RunningStage) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{stage.port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=server.SERVICE_NAME))
    return int(check.status)


def more_cells_than_the_gpu_holds(model: Path, monkeypatch: pytest.MonkeyPatch) -> Size:
    """A pool whose f32 cells and slot table take twice the GPU's whole memory. Many slots make each cell dear, so
    the cells stay few enough (some millions) for the host's free list."""
    parallel = 1024
    per_cell = inspect_model(str(model)).kv_bytes_per_token(type_k=CacheType.F32, type_v=CacheType.F32) + 8 * parallel
    return Size(context=2 * torch.cuda.mem_get_info(0)[1] // per_cell, parallel=parallel)


def a_synchronisation_inside_every_capture(model: Path, monkeypatch: pytest.MonkeyPatch) -> Size:
    """A host synchronisation during capture, as stray host work in a step would make: CUDA refuses it and
    invalidates the capture, on the compiled path and on the plain one."""
    real: Callable[[Decoder, int, int], DecodeOutput] = Decoder._body

    def body(self: Decoder, b: int, width: int) -> DecodeOutput:
        out = real(self, b, width)
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)
        return out

    monkeypatch.setattr(Decoder, "_body", body)
    return SERVING


@pytest.mark.parametrize(
    ("make_it_fail", "messages", "within_s"),
    [
        pytest.param(
            more_cells_than_the_gpu_holds,
            ["OutOfMemoryError: CUDA out of memory"],
            10.0,  # the bound: the pool is allocated right after the tiny model's weights
            id="a KV pool larger than the GPU fails the load with CUDA's out-of-memory error",
        ),
        pytest.param(
            a_synchronisation_inside_every_capture,
            [
                "the decode step runs on no path: ",
                "compiled blocks in CUDA graphs: ",
                "CUDA graphs alone: ",
                "CUDA error",  # CUDA's refusal of the synchronisation, or the invalidated capture's end it causes
            ],
            LOADED_OR_FAILED_WITHIN_S,  # after torch.compile has compiled the step
            id="a capture invalidated on every graph path fails the load, with no eager fallback",
        ),
    ],
)
def test_a_load_that_cuda_fails_is_reported_with_cudas_message(
    model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_it_fail: Callable[[Path, pytest.MonkeyPatch], Size],
    messages: list[str],
    within_s: float,
) -> None:
    size = make_it_fail(model_path, monkeypatch)
    started = time.monotonic()
    with started_stage(model_path, size=size) as stage:
        status = load_outcome(stage)
        assert time.monotonic() - started < within_s, f"reported {time.monotonic() - started:.1f} s after the start"
        assert not status.loaded, "the stage loaded"
        for message in messages:
            assert message in status.error, status.error
        assert serving_status(stage) == health_pb2.HealthCheckResponse.NOT_SERVING
