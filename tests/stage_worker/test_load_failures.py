"""A stage whose load fails says so: its load status carries the message within seconds, health stays NOT_SERVING, the
log names the stage, and every wait on it ends with that message instead of waiting forever.

Each failure is made on the CPU, in process: tensor data cut short (a real file), running out of memory and a decode
step that cannot run on any path (injected where the stage allocates and where it warms the step up).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from strata.gguf.model import CacheType
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_loading import LoadWatch, StageLoadError, StageLoadTimeoutError, WatchedStage, wait_all_loaded
from strata.stage_worker import server, stage_load
from strata.stage_worker.engine import Engine
from strata.stage_worker.server import RunningStage
from strata.stage_worker.settings import StageSettings
from strata_testbed.broken_models import cut_tensor_data

REPORT_WITHIN_S = 10.0


@contextmanager
def started_stage(model: Path, *, listen: str = "127.0.0.1:0") -> Iterator[RunningStage]:
    """The whole tiny model as one in-process stage, loading in the background."""
    settings = StageSettings(
        stage_index=0,
        layer_start=0,
        layer_end=3,
        model_url=str(model),
        context=32,
        parallel=2,
        cache_type_k=CacheType.F32,
        cache_type_v=CacheType.F32,
        listen=listen,
    )
    stage = RunningStage(settings)
    try:
        yield stage
    finally:
        stage.stop(0)


def load_outcome(stage: RunningStage, *, within_s: float = REPORT_WITHIN_S) -> stage_pb2.LoadStatus:
    """The load status once it says loaded or failed; a stage that says neither in time fails the test."""
    stub = stage_pb2_grpc.StageStub(grpc.insecure_channel(f"127.0.0.1:{stage.port}"))
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        status: stage_pb2.LoadStatus = stub.GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=5)
        if status.loaded or status.error:
            return status
        time.sleep(0.05)
    pytest.fail(f"the stage neither loaded nor failed within {within_s:g} s: {status}")


def truncated(tmp_path: Path, models: dict[str, Path]) -> Path:
    return cut_tensor_data(models["llama"], tmp_path / "cut.gguf")


def whole(tmp_path: Path, models: dict[str, Path]) -> Path:
    return models["llama"]


def no_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file alone makes the stage fail."""


def kv_pool_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    def allocate(**_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    monkeypatch.setattr(stage_load, "KVPool", allocate)


def decode_step_fails_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    def warm(self: Engine) -> None:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing (injected)")

    monkeypatch.setattr(Engine, "warm_up", warm)


@pytest.mark.parametrize(
    ("model", "fault", "message"),
    [
        pytest.param(truncated, no_fault, "tensor data is cut short", id="tensor data cut short fails the load"),
        pytest.param(
            whole,
            kv_pool_out_of_memory,
            "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
            id="running out of memory for the KV pool fails the load",
        ),
        pytest.param(
            whole,
            decode_step_fails_everywhere,
            "the decode step runs on no path: eager: RuntimeError: CUDA error: operation not permitted",
            id="a decode step that runs on no path fails the load",
        ),
    ],
)
def test_a_failed_load_is_reported_in_the_load_status_with_its_message(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    model: Callable[[Path, dict[str, Path]], Path],
    fault: Callable[[pytest.MonkeyPatch], None],
    message: str,
) -> None:
    fault(monkeypatch)
    with caplog.at_level(logging.ERROR), started_stage(model(tmp_path, tiny_models)) as stage:
        status = load_outcome(stage)
        assert not status.loaded
        assert message in status.error
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{stage.port}"))
        check = health.Check(health_pb2.HealthCheckRequest(service=server.SERVICE_NAME))
        assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert any(r.getMessage().startswith("stage 0 failed to load") for r in caplog.records), caplog.text


def test_a_faster_decode_path_that_fails_falls_back_to_a_slower_one_that_works(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from strata.stage_worker import warm_up

    fast = warm_up.DecodePath(name="injected fast", cuda_graphs=False, compiled=False)
    monkeypatch.setattr(warm_up, "paths_for", lambda _device, **_: (fast, warm_up.EAGER))
    failures = iter([AssertionError("inductor: injected compile failure")])  # the first warm-up fails, then they run
    real = Engine.warm_up

    def warm(self: Engine) -> None:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        real(self)

    monkeypatch.setattr(Engine, "warm_up", warm)
    with caplog.at_level(logging.WARNING), started_stage(tiny_models["llama"]) as stage:
        status = load_outcome(stage)
        assert (status.loaded, status.error) == (True, "")
        assert not stage.service.engine.decoder.graphs
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "stage 0: the decode step failed on the injected fast path" in warned
    assert "stage 0: serving decode steps on the slower eager path" in warned


def free_address() -> str:
    """A loopback address where nothing listens: a stage that never comes up."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize(
    ("stages", "timeout_s", "error", "message"),
    [
        pytest.param(
            lambda failing, silent: [
                WatchedStage(address=silent, name="stage 0"),
                WatchedStage(address=failing, name="stage 1"),
            ],
            60.0,
            StageLoadError,
            "stage 1 failed to load: the file ends at byte",
            id="a stage that fails ends the wait at once though another has not answered",
        ),
        pytest.param(
            lambda failing, silent: [WatchedStage(address=failing)],
            60.0,
            StageLoadError,
            "stage 0 at {failing} failed to load: the file ends at byte",
            id="an unnamed stage is named by its index and address",
        ),
        pytest.param(
            lambda failing, silent: [WatchedStage(address=silent, name="stage 3")],
            1.0,
            StageLoadTimeoutError,
            "stage 3 failed to load: not loaded after 1 s (its load status cannot be read yet)",
            id="a stage that never answers ends the wait at the deadline",
        ),
    ],
)
def test_every_wait_for_loading_ends_with_the_stage_s_message(
    tiny_models: dict[str, Path],
    tmp_path: Path,
    stages: Callable[[str, str], list[WatchedStage]],
    timeout_s: float,
    error: type[StageLoadError],
    message: str,
) -> None:
    with started_stage(truncated(tmp_path, tiny_models)) as stage:
        failing = f"127.0.0.1:{stage.port}"
        started = time.monotonic()
        with pytest.raises(error) as ended:
            wait_all_loaded(stages(failing, free_address()), timeout_s=timeout_s)
    assert str(ended.value).startswith(message.format(failing=failing)), ended.value
    assert time.monotonic() - started < min(timeout_s, REPORT_WITHIN_S) + 2.0


def polled_until(watch: LoadWatch, *, within_s: float = REPORT_WITHIN_S) -> None:
    """Poll `watch` until every stage has loaded; a failure it reports propagates."""
    deadline = time.monotonic() + within_s
    while not watch.poll():
        assert time.monotonic() < deadline, f"not loaded within {within_s:g} s"
        time.sleep(0.05)


def test_a_stage_started_again_on_its_address_is_watched_loading_again(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """What `strata serve` does when its supervisor starts a dead stage again: the new process's load is what counts."""
    cut = truncated(tmp_path, tiny_models)
    with started_stage(tiny_models["llama"]) as first:
        address = f"127.0.0.1:{first.port}"
        watch = LoadWatch([WatchedStage(address=address, name="stage 0")])
        try:
            polled_until(watch)
            first.stop(0)
            with started_stage(cut, listen=address):
                assert watch.poll(), "a stage once loaded is not asked again until it is said to load again"
                watch.reload(address)
                with pytest.raises(StageLoadError, match=r"^stage 0 failed to load: the file ends at byte"):
                    polled_until(watch)
        finally:
            watch.close()
