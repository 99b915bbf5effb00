"""Waiting for stages to load: every wait ends, on a stage's reported failure or at a deadline, with its message.

A stage loads in the background and says how far it got in its load status (GetLoadStatus): bytes loaded, loaded,
or the error that stopped it (strata.stage_worker.server reports every failure there). Whoever needs loaded stages
(`strata serve`, tests, benchmarks) waits on all of them at once, so a stage that fails is reported as soon as it
says so, not after the others have finished loading, and every way out carries that stage's own message. A stage
that cannot answer yet (not listening, or started again after its process died) is asked again until its deadline:
whoever owns the processes (strata.gateway.supervision for `strata serve`) decides what a dead one means. It lives
below the components because the gateway's `strata serve` and the stage worker's client both wait this way.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS

STATUS_TIMEOUT_S = 2.0
# A stage that is not up yet (or is busy) answers these; anything else means the address is not a stage.
RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True, kw_only=True)
class WatchedStage:
    """A stage to wait for: where it answers, and what messages call it."""

    address: str
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or f"the stage at {self.address}"


class StageLoadError(Exception):
    """A stage did not load: it reported a failure, or it answered as no stage does."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"{stage} failed to load: {reason}")
        self.stage = stage
        self.reason = reason


class StageLoadTimeoutError(StageLoadError):
    """A stage had not loaded by the deadline; the message says how far it got."""


class LoadWatch:
    """The stages a caller waits for, each asked for its load status by `poll`. Stages may be added while another
    thread polls (`strata serve` watches the stages it has started while it starts the next). Each stage's deadline
    counts from when it was added, or from when it was last said to be loading again (`reload`)."""

    def __init__(self, stages: Sequence[WatchedStage] = ()) -> None:
        self._stages: list[tuple[WatchedStage, grpc.Channel]] = []
        self._since: dict[int, float] = {}
        self._loaded: dict[int, stage_pb2.LoadStatus] = {}
        self._progress: dict[int, str] = {}
        for stage in stages:
            self.add(stage)

    def add(self, stage: WatchedStage) -> None:
        self._since[len(self._stages)] = time.monotonic()
        # The shared options: a stage started again on its port is dialled again within a second.
        self._stages.append((stage, grpc.insecure_channel(stage.address, options=GRPC_OPTIONS)))

    def reload(self, address: str) -> None:
        """The stage at `address` loads again (its process was started again): forget that it had loaded, and give
        it a new deadline. Call it from the thread that polls."""
        for index, (stage, _channel) in enumerate(self._stages):
            if stage.address == address:
                self._loaded.pop(index, None)
                self._progress[index] = "started again"
                self._since[index] = time.monotonic()

    def poll(self) -> bool:
        """Ask every stage not loaded yet once; True when every stage added so far has loaded. Raises StageLoadError
        for the first that failed."""
        stages = list(self._stages)
        for index, (stage, channel) in enumerate(stages):
            if index in self._loaded:
                continue
            status = _status(stage, stage_pb2_grpc.StageStub(channel))
            if status is None:
                self._progress[index] = "its load status cannot be read yet"
            elif status.loaded:
                self._loaded[index] = status
            else:
                self._progress[index] = f"{status.bytes_loaded} of {status.bytes_total} bytes loaded"
        return len(self._loaded) == len(stages)

    def statuses(self) -> list[stage_pb2.LoadStatus]:
        """The load statuses of the stages, in the order they were added, once `poll` has said all loaded."""
        return [self._loaded[index] for index in range(len(self._stages))]

    def overdue(self, timeout_s: float) -> StageLoadTimeoutError | None:
        """The error for the first stage not loaded `timeout_s` after its deadline started, saying how far it got;
        None while every stage is loaded or within its time."""
        now = time.monotonic()
        for index, (stage, _channel) in enumerate(list(self._stages)):
            if index not in self._loaded and now - self._since[index] >= timeout_s:
                progress = self._progress.get(index, "no answer yet")
                return StageLoadTimeoutError(stage.label, f"not loaded after {timeout_s:g} s ({progress})")
        return None

    def close(self) -> None:
        for _stage, channel in self._stages:
            channel.close()


def wait_all_loaded(
    stages: Sequence[WatchedStage], *, timeout_s: float, poll_s: float = 0.2
) -> list[stage_pb2.LoadStatus]:
    """Poll every stage until all have loaded and return their statuses in order; raise StageLoadError at the first
    failure and StageLoadTimeoutError when `timeout_s` runs out."""
    watch = LoadWatch(stages)
    try:
        while not watch.poll():
            late = watch.overdue(timeout_s)
            if late is not None:
                raise late
            time.sleep(poll_s)
        return watch.statuses()
    finally:
        watch.close()


def wait_loaded(target: str, *, timeout_s: float, poll_s: float = 0.2) -> stage_pb2.LoadStatus:
    """Wait for the one stage at `target` (host:port) to load; raises as wait_all_loaded does."""
    return wait_all_loaded([WatchedStage(address=target)], timeout_s=timeout_s, poll_s=poll_s)[0]


def _status(stage: WatchedStage, stub: stage_pb2_grpc.StageStub) -> stage_pb2.LoadStatus | None:
    """The stage's load status; None while it cannot answer yet. Raises StageLoadError for a failure it reports and
    for an answer no stage gives."""
    try:
        status: stage_pb2.LoadStatus = stub.GetLoadStatus(stage_pb2.LoadStatusRequest(), timeout=STATUS_TIMEOUT_S)
    except grpc.RpcError as exc:
        if exc.code() not in RETRIED:
            raise StageLoadError(stage.label, f"its load status answered {exc.code().name}: {exc.details()}") from None
        return None
    if status.error:
        raise StageLoadError(stage.name or f"stage {status.stage_index} at {stage.address}", status.error)
    return status
