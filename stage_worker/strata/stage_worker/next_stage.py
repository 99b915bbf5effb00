"""Forward streams from this stage to the next one.

On a stream requests and replies pair up in order. Each caller's stream into this stage gets a stream of its own to
the next stage (`open_stream`), so a chain of streams runs from the coordinator to the last stage: a failure on one
(a stale term refused, a caller gone) never reaches the steps of another caller, and closing a stream closes the
rest of its chain. Sending does not wait: `send` hands back a PendingReply, and a reader thread gives each reply to
the oldest step still waiting, so this stage can compute and send the next step while the stages after it work on
the previous one. `receive` waits for one reply with the step timeout: a next stage that died (the stream breaks) or
hangs (no reply within the step timeout) turns into NextStageUnavailableError, the stream is closed, and every step
still waiting on it fails with the same error, none left to hang. Keepalive pings notice a silent peer between
steps. The steps sent and not yet answered are counted (StepsInFlight) for the stage's load status. `forward`, one
step at a time on a stream shared by its callers that dials again after a failure, is for tools and tests.

`carry` puts a step's activations into its request: through the next stage's shared-memory region where the two
share a host (strata.stage_worker.shared_hop; the region is asked for with GetLoadStatus), else inline. A slot of the
region stays taken until the step is answered or fails.

`Downstream` is what a stage needs of its next stage, wherever that runs: NextStage here for one in another process,
strata.stage_worker.in_process for one in this process, which takes the activations as the tensor itself.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS
from strata.stage_worker.errors import NextStageUnavailableError, StageError
from strata.stage_worker.shared_hop import HopLink
from strata.stage_worker.wire import tensor_to_proto
from torch import Tensor

CHANNEL_OPTIONS = GRPC_OPTIONS
UNARY_TIMEOUT_S = 30.0
ASK_REGION_TIMEOUT_S = 2.0
_CLOSE = object()


def nothing_to_release() -> None:
    """The release of activations sent inline."""


@dataclass(frozen=True)
class Carried:
    """How a step's activations travel on: `release` frees the shared-memory slot they took (once the step is
    answered or failed); `handed` is the tensor itself when the next stage is in this process, None when the
    activations are in the request."""

    release: Callable[[], None] = nothing_to_release
    handed: Tensor | None = None


class RemoteStageError(StageError):
    """The next stage refused the call; carries its status code so this stage answers with the same one."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class StepsInFlight:
    """Steps sent to the next stage whose replies have not come back: now, and the most at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def begin(self) -> None:
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def end(self) -> None:
        with self._lock:
            self.now -= 1


class PendingReply:
    """The next stage's reply to one step, once the reader thread hands it over (or the error that ended the
    stream it was sent on)."""

    def __init__(self, counter: StepsInFlight, release: Callable[[], None] = nothing_to_release) -> None:
        self._counter = counter
        self._release = release  # frees the shared-memory slot of the step's activations
        self._settled = threading.Event()
        self.reply: stage_pb2.ForwardReply | None = None
        self.error: StageError | None = None
        counter.begin()

    def resolve(self, reply: stage_pb2.ForwardReply) -> None:
        self.reply = reply
        self._settle()

    def fail(self, error: StageError) -> None:
        self.error = error
        self._settle()

    def _settle(self) -> None:
        if not self._settled.is_set():
            self._counter.end()
            self._release()
            self._settled.set()

    def wait(self, timeout_s: float) -> bool:
        return self._settled.wait(timeout_s)


class StepSender(Protocol):
    """One caller's stream of steps to the next stage: `send` does not wait for the reply, `receive` does."""

    def send(self, request: stage_pb2.ForwardRequest, carried: Carried) -> PendingReply: ...

    def receive(self, pending: PendingReply) -> stage_pb2.ForwardReply: ...

    def close(self) -> None: ...


class Downstream(Protocol):
    """The next stage, as a stage passes its calls on to it; a failure is a StageError."""

    target: str  # how messages name it
    in_flight: StepsInFlight

    @property
    def leaves_process(self) -> bool:
        """Whether a step sent here reaches a stage in another process (so cutting a prefill into pieces lets that
        stage work while this one computes)."""

    def open_stream(self) -> StepSender: ...

    def carry(self, request: stage_pb2.ForwardRequest, hidden: Tensor) -> Carried: ...

    def reset_here(self, slots: Iterable[int]) -> None:
        """Reset `slots` on the stages after this one that run in this process: a step this stage lost took cells
        there too. A stage in another process frees its own when its stream fails."""

    def claim(self, request: stage_pb2.ClaimRequest) -> None: ...

    def reset_slot(self, request: stage_pb2.ResetSlotRequest) -> None: ...

    def save_prefix(self, request: stage_pb2.SavePrefixRequest) -> stage_pb2.SavePrefixReply: ...

    def restore_prefix(self, request: stage_pb2.RestorePrefixRequest) -> stage_pb2.RestorePrefixReply: ...

    def close(self) -> None: ...


class StepStream:
    def __init__(
        self,
        stub: stage_pb2_grpc.StageStub,
        *,
        target: str,
        step_timeout_s: float,
        counter: StepsInFlight,
        translate: Callable[[grpc.RpcError], StageError],
    ) -> None:
        self.target = target
        self.step_timeout_s = step_timeout_s
        self._requests: queue.Queue[object] = queue.Queue()
        self._counter = counter
        self._translate = translate
        self._lock = threading.Lock()
        self._waiting: deque[PendingReply] = deque()  # oldest first: replies come in request order
        self._ended: StageError | None = None
        self._closed = False
        self.call = stub.Forward(self._iterate())
        threading.Thread(target=self._read, daemon=True, name="next-stage-reader").start()

    @property
    def ended(self) -> bool:
        return self._closed or self._ended is not None

    def _iterate(self) -> Iterator[stage_pb2.ForwardRequest]:
        while (item := self._requests.get()) is not _CLOSE:
            yield item  # type: ignore[misc]

    def _read(self) -> None:
        error: StageError | None = None
        try:
            for reply in self.call:
                with self._lock:
                    pending = self._waiting.popleft() if self._waiting else None
                if pending is None:
                    error = RemoteStageError(grpc.StatusCode.INTERNAL, "the next stage replied to a step never sent")
                    self.call.cancel()
                    break
                pending.resolve(reply)
        except grpc.RpcError as exc:
            error = self._translate(exc)
        with self._lock:
            self._ended = error or NextStageUnavailableError(f"the next stage {self.target} closed the stream")
            left = list(self._waiting)
            self._waiting.clear()
        for pending in left:
            pending.fail(self._ended)

    def send(self, request: stage_pb2.ForwardRequest, carried: Carried = Carried()) -> PendingReply:
        """Send one step without waiting; on a stream that has ended, the step fails at once with its error.
        `carried` (from NextStage.carry) says how its activations travel: its release runs once the step is
        answered or has failed."""
        assert carried.handed is None, "NextStage.carry puts the activations into the request"
        pending = PendingReply(self._counter, carried.release)
        with self._lock:
            if self._ended is not None:
                pending.fail(self._ended)
                return pending
            self._waiting.append(pending)
            self._requests.put(request)
        return pending

    def receive(self, pending: PendingReply) -> stage_pb2.ForwardReply:
        """The reply to a step sent on this stream, waiting at most the step timeout; a stream that broke or hangs
        is closed, and every step still waiting on it fails too."""
        if not pending.wait(self.step_timeout_s):
            self.close()
            raise NextStageUnavailableError(
                f"the next stage {self.target} sent no reply within {self.step_timeout_s:.0f} s"
            )
        if pending.error is not None:
            self.close()
            raise pending.error
        assert pending.reply is not None, "a settled step has a reply or an error"
        return pending.reply

    def close(self) -> None:
        self._closed = True
        self._requests.put(_CLOSE)
        self.call.cancel()


class NextStage:
    leaves_process = True

    def __init__(self, target: str, *, step_timeout_s: float) -> None:
        self.target = target
        self.step_timeout_s = step_timeout_s
        self.in_flight = StepsInFlight()
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._lock = threading.Lock()
        self._shared: StepStream | None = None
        self.hop = HopLink(self._load_status)

    def open_stream(self) -> StepStream:
        """A Forward stream of its own to the next stage, for one caller's stream into this one."""
        return StepStream(
            self._stub,
            target=self.target,
            step_timeout_s=self.step_timeout_s,
            counter=self.in_flight,
            translate=self._translate,
        )

    def forward(self, request: stage_pb2.ForwardRequest) -> stage_pb2.ForwardReply:
        """Send one step on the shared stream and wait for its reply; the next step after a failure dials again."""
        with self._lock:
            if self._shared is None or self._shared.ended:
                self._shared = self.open_stream()
            stream = self._shared
            return stream.receive(stream.send(request))

    def carry(self, request: stage_pb2.ForwardRequest, hidden: Tensor) -> Carried:
        """Put a step's activations into its request: into a slot of the next stage's shared region where this
        stage can open it and a slot comes free within the step timeout, else inline. Returns what frees the slot,
        for `send`."""
        writer = self.hop.writer()
        placed = writer.write(hidden, timeout_s=self.step_timeout_s) if writer is not None else None
        if placed is None:
            request.hidden.CopyFrom(tensor_to_proto(hidden))
            return Carried()
        reference, release = placed
        request.shared_hidden.CopyFrom(reference)
        return Carried(release=release)

    def reset_here(self, slots: Iterable[int]) -> None:
        """Nothing: the next stage is in another process, which resets its slots when its stream fails."""

    def _load_status(self) -> stage_pb2.LoadStatus | None:
        try:
            status: stage_pb2.LoadStatus = self._stub.GetLoadStatus(
                stage_pb2.LoadStatusRequest(), timeout=ASK_REGION_TIMEOUT_S
            )
        except grpc.RpcError:
            return None
        return status

    def reset_slot(self, request: stage_pb2.ResetSlotRequest) -> None:
        self._unary("ResetSlot", request)

    def save_prefix(self, request: stage_pb2.SavePrefixRequest) -> stage_pb2.SavePrefixReply:
        reply: stage_pb2.SavePrefixReply = self._unary("SavePrefix", request)
        return reply

    def restore_prefix(self, request: stage_pb2.RestorePrefixRequest) -> stage_pb2.RestorePrefixReply:
        reply: stage_pb2.RestorePrefixReply = self._unary("RestorePrefix", request)
        return reply

    def claim(self, request: stage_pb2.ClaimRequest) -> None:
        self._unary("Claim", request)

    def _unary(self, method: str, request: object) -> Any:
        """One unary call to the next stage; its failure becomes the StageError this stage answers with."""
        try:
            return getattr(self._stub, method)(request, timeout=UNARY_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise self._translate(exc) from exc

    def close(self) -> None:
        with self._lock:
            if self._shared is not None:
                self._shared.close()
        self._channel.close()

    def _translate(self, error: grpc.RpcError) -> StageError:
        code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
        details = error.details() if isinstance(error, grpc.Call) else str(error)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.hop.ask_again()  # the next stage may come back as a new process, with a region of its own
            return NextStageUnavailableError(f"the next stage {self.target} is unavailable: {details}")
        return RemoteStageError(code, f"the next stage {self.target} refused the step: {details}")
