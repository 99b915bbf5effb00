"""The driver's gRPC link to the first stage: unary calls, and the one Forward stream its steps ride on.

Steps are written without waiting for their replies (up to the driver's micro-batch count in flight) and replies
come back in order, each paired with the oldest step written. Every state-changing call carries the coordinator's
fencing token; a token that is missing or past its renew deadline fails here, before any call is sent, shaped as a
stage's refusal (FAILED_PRECONDITION) so the driver handles both alike. Every wait has a deadline: a unary call
UNARY_TIMEOUT_S, a step's reply the driver's step timeout. Dropping the stream loses every step in flight on it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio
from strata.gateway.generation import Generation
from strata.gateway.metrics import GatewayMetrics
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS

CHANNEL_OPTIONS = GRPC_OPTIONS
UNARY_TIMEOUT_S = 10.0


class LapsedTermError(aio.AioRpcError):  # type: ignore[misc]  # grpc is untyped
    """The token is missing or lapsed, so no call was sent: it fails as a stage's refusal would, but no stage
    refused it."""


class DroppedStreamError(aio.AioRpcError):  # type: ignore[misc]  # grpc is untyped
    """step_down() or promote() cancelled the stream under a step: they have already failed what ran, and said why."""


def rpc_error(code: grpc.StatusCode, details: str, *, kind: type[aio.AioRpcError] = aio.AioRpcError) -> aio.AioRpcError:
    """A failure the driver raises itself, shaped as one a stage returns, so one handler (`_fail_all`) reads both."""
    return kind(code, aio.Metadata(), aio.Metadata(), details=details)


def stream_dropped() -> aio.AioRpcError:
    return rpc_error(grpc.StatusCode.CANCELLED, "the stream was dropped", kind=DroppedStreamError)


@dataclass(frozen=True)
class Step:
    step_id: int
    chunks: list[stage_pb2.SlotChunk]
    written_at: float = 0.0  # the driver's clock when it was written: how long the pipeline took for it


class StageStream:
    """The gRPC half of the driver (strata.gateway.pipeline.Pipeline sets this state up and inherits the calls)."""

    plan_generation: int
    metrics: GatewayMetrics
    step_timeout_s: float
    _fence: FencingToken | None
    _valid_until: float
    _clock: Callable[[], float]
    _active: dict[int, Generation]
    _step_id: int
    _stub: stage_pb2_grpc.StageStub | None
    _call: aio.StreamStreamCall | None
    _in_flight: deque[Step]

    def _proto_fence(self) -> stage_pb2.Fence:
        """The token for a state-changing call; a missing or lapsed one fails like a stage's refusal would."""
        f = self._fence
        if f is None or self._clock() >= self._valid_until:
            why = "no coordinator term" if f is None else f"the lease behind term {f.term} was not renewed in time"
            raise rpc_error(grpc.StatusCode.FAILED_PRECONDITION, why, kind=LapsedTermError)
        return stage_pb2.Fence(lease_uid=f.lease_uid, term=f.term, holder=f.holder)

    async def _unary(self, method: str, request: object) -> Any:
        assert self._stub is not None, "start() opens the channel"
        call = getattr(self._stub, method)
        return await call(request, timeout=UNARY_TIMEOUT_S)

    async def _step(self, chunks: list[stage_pb2.SlotChunk]) -> stage_pb2.ForwardReply:
        """One step alone: write it and wait for its reply (the readiness probe)."""
        await self._write(chunks)
        _step, reply = await self._read()
        return reply

    async def _write(self, chunks: list[stage_pb2.SlotChunk]) -> None:
        """Write a step on the stream without waiting for its reply; its slots are in flight until `_read`."""
        assert self._stub is not None, "start() opens the channel"
        self._step_id += 1
        request = stage_pb2.ForwardRequest(
            fence=self._proto_fence(), plan_generation=self.plan_generation, step_id=self._step_id, chunks=chunks
        )
        if self._call is None:
            self._call = self._stub.Forward()
        call = self._call
        # In flight from here: a cancel() while the write is under way must already find the slot busy.
        self._in_flight.append(Step(step_id=self._step_id, chunks=chunks, written_at=self._clock()))
        self.metrics.steps_in_flight.set(len(self._in_flight))
        for chunk in chunks:
            if (g := self._active.get(chunk.slot)) is not None:
                g.in_flight = chunk.length
        try:
            await call.write(request)
        except asyncio.InvalidStateError as exc:
            self._drop_stream()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"cannot write a step: {exc!r}") from exc
        except aio.AioRpcError:
            self._drop_stream()
            raise
        except asyncio.CancelledError:
            raise self._dropped_under(call) from None

    async def _read(self) -> tuple[Step, stage_pb2.ForwardReply]:
        """The oldest step in flight and its reply, waiting at most the step timeout."""
        call = self._call
        assert call is not None, "a step was written on the open stream"
        assert self._in_flight, "a step was written"
        try:
            reply = await asyncio.wait_for(call.read(), timeout=self.step_timeout_s)
        except (TimeoutError, asyncio.InvalidStateError) as exc:
            self._drop_stream()
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"no reply to a step: {exc!r}") from exc
        except aio.AioRpcError:
            self._drop_stream()
            raise
        except asyncio.CancelledError:
            raise self._dropped_under(call) from None
        still_open = self._call is call  # a bool, so mypy keeps `call` narrowed to an open call below
        if not still_open:  # dropped while the reply was on its way to this task
            raise stream_dropped()
        if reply is aio.EOF:
            self._drop_stream()
            status = await call.code()
            raise rpc_error(status, await call.details())
        step = self._in_flight.popleft()
        self.metrics.steps_in_flight.set(len(self._in_flight))
        result: stage_pb2.ForwardReply = reply
        if result.step_id != step.step_id:  # replies pair with requests in order; anything else is a broken stage
            self._drop_stream()
            raise rpc_error(
                grpc.StatusCode.INTERNAL, f"the reply to step {result.step_id} came back for step {step.step_id}"
            )
        return step, result

    def _dropped_under(self, call: aio.StreamStreamCall) -> aio.AioRpcError:
        """grpc raises CancelledError in a read or write of a call cancelled here: when step_down() or promote()
        dropped the stream under the driver, that is the step failing, not the driver being cancelled."""
        task = asyncio.current_task()
        if (task is not None and task.cancelling()) or self._call is call:
            raise asyncio.CancelledError
        return stream_dropped()

    def _drop_stream(self) -> None:
        """Cancel the stream; every step in flight on it is lost, so its slots are no longer in flight."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._in_flight.clear()
        self.metrics.steps_in_flight.set(0)
        for g in self._active.values():
            g.in_flight = 0
