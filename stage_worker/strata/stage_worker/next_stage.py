"""The long-lived Forward stream from this stage to the next one.

One stream carries every step; requests and replies pair up in order. A reader thread moves replies into a queue so
a step can wait with a deadline: a next stage that died (the stream breaks) or hangs (no reply within the step
timeout) turns into NextStageUnavailableError at once, the broken stream is dropped, and the next step dials again.
Keepalive pings notice a silent peer between steps.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import grpc
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS
from strata.stage_worker.errors import NextStageUnavailableError, StageError

CHANNEL_OPTIONS = GRPC_OPTIONS
UNARY_TIMEOUT_S = 30.0
_CLOSE = object()


class RemoteStageError(StageError):
    """The next stage refused the call; carries its status code so this stage answers with the same one."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Stream:
    def __init__(self, stub: stage_pb2_grpc.StageStub) -> None:
        self._requests: queue.Queue[object] = queue.Queue()
        self.replies: queue.Queue[stage_pb2.ForwardReply | grpc.RpcError] = queue.Queue()
        self.call = stub.Forward(self._iterate())
        threading.Thread(target=self._read, daemon=True, name="next-stage-reader").start()

    def _iterate(self) -> Iterator[stage_pb2.ForwardRequest]:
        while (item := self._requests.get()) is not _CLOSE:
            yield item  # type: ignore[misc]

    def _read(self) -> None:
        try:
            for reply in self.call:
                self.replies.put(reply)
        except grpc.RpcError as exc:
            self.replies.put(exc)

    def send(self, request: stage_pb2.ForwardRequest) -> None:
        self._requests.put(request)

    def close(self) -> None:
        self._requests.put(_CLOSE)
        self.call.cancel()


class NextStage:
    def __init__(self, target: str, *, step_timeout_s: float) -> None:
        self.target = target
        self.step_timeout_s = step_timeout_s
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._lock = threading.Lock()
        self._stream: _Stream | None = None

    def forward(self, request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardReply:
        with self._lock:
            if self._stream is None:
                self._stream = _Stream(self._stub)
            stream = self._stream
            stream.send(request)
            try:
                reply = stream.replies.get(timeout=self.step_timeout_s)
            except queue.Empty:
                self._drop()
                raise NextStageUnavailableError(
                    f"the next stage {self.target} sent no reply within {self.step_timeout_s:.0f} s"
                ) from None
            if isinstance(reply, grpc.RpcError):
                self._drop()
                raise self._translate(reply)
            return reply

    def reset_slot(self, request: stage_pb2.ResetSlotRequest) -> None:
        try:
            self._stub.ResetSlot(request, timeout=UNARY_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._translate(exc) from exc

    def save_prefix(self, request: stage_pb2.SavePrefixRequest) -> stage_pb2.SavePrefixReply:
        try:
            reply: stage_pb2.SavePrefixReply = self._stub.SavePrefix(request, timeout=UNARY_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._translate(exc) from exc
        return reply

    def restore_prefix(self, request: stage_pb2.RestorePrefixRequest) -> stage_pb2.RestorePrefixReply:
        try:
            reply: stage_pb2.RestorePrefixReply = self._stub.RestorePrefix(request, timeout=UNARY_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._translate(exc) from exc
        return reply

    def claim(self, request: stage_pb2.ClaimRequest) -> None:
        try:
            self._stub.Claim(request, timeout=UNARY_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._translate(exc) from exc

    def close(self) -> None:
        with self._lock:
            self._drop()
        self._channel.close()

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _translate(self, error: grpc.RpcError) -> StageError:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            return NextStageUnavailableError(f"the next stage {self.target} is unavailable: {details}")
        return RemoteStageError(code, f"the next stage {self.target} refused the step: {details}")
