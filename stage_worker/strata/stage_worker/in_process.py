"""The next stage in this process: a step's activations handed over as the tensor itself.

Stages that share a device run in one process (strata.stage_worker.co_located), each still a StageService of its own
on a port of its own, so the coordinator, the fencing and the load status see the same stages as ever. Between two
of them a step's hidden states need no serialisation, no copy and no shared-memory ring: the tensor the first stage
computed is the one the next stage reads. Two processes on one GPU took turns on it (two CUDA contexts, a switch at
every hop); one process keeps one context and one stream of kernels.

The handoff is synchronous: `send` computes the next stage's part of the step on the calling thread (the launcher of
strata.stage_worker.forward_stream) before it returns. Both stages share a device, so running them one after the
other loses nothing that overlap would win, and the tensor is consumed before the stage that made it computes again.
When a stage in another process follows, the step goes on to it on a stream of its own, as from any stage, and its
reply answers this one. The unary calls (claim, slot reset, prefix save and restore) call the next stage's own
methods. Errors stay StageErrors: the first stage's gRPC edge maps them to status codes, once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Protocol

from strata.rpc.v1 import stage_pb2
from strata.stage_worker.errors import NextStageUnavailableError, StageError
from strata.stage_worker.forward_stream import Onward
from strata.stage_worker.next_stage import Carried, Downstream, PendingReply, StepSender, StepsInFlight
from torch import Tensor


class HandedStage(Protocol):
    """What a stage offers the stage before it in the same process (strata.stage_worker.server.StageService)."""

    @property
    def next_stage(self) -> Downstream | None: ...

    @property
    def name(self) -> str: ...

    def last_step(self, request: stage_pb2.ForwardRequest, handed: Tensor | None = None) -> stage_pb2.ForwardReply: ...

    def step(self, request: stage_pb2.ForwardRequest, handed: Tensor | None = None) -> Onward: ...

    def reset_slots(self, slots: Iterable[int]) -> None: ...

    def claim(self, request: stage_pb2.ClaimRequest) -> stage_pb2.ClaimReply: ...

    def reset_slot(self, request: stage_pb2.ResetSlotRequest) -> stage_pb2.ResetSlotReply: ...

    def save_prefix(self, request: stage_pb2.SavePrefixRequest) -> stage_pb2.SavePrefixReply: ...

    def restore_prefix(self, request: stage_pb2.RestorePrefixRequest) -> stage_pb2.RestorePrefixReply: ...


class _Relayed(PendingReply):
    """A step the next stage computed and sent on to a stage in another process: answered by that stage's reply."""

    def __init__(self, counter: StepsInFlight, *, onward: PendingReply) -> None:
        super().__init__(counter)
        self.onward = onward


class HandoffStream:
    """One caller's stream into the next stage in this process; see the module docstring."""

    def __init__(self, stage: HandedStage, counter: StepsInFlight) -> None:
        self._stage = stage
        self._counter = counter
        self._onward: StepSender | None = None  # to the stage after it, opened with the first step it sends on
        self._relayed: set[_Relayed] = set()  # sent on and not received yet: failed on close, so none counts forever
        self._lock = threading.Lock()  # the launcher sends, the caller's thread receives and closes

    def send(self, request: stage_pb2.ForwardRequest, carried: Carried) -> PendingReply:
        """Compute the next stage's part of the step now; a step it refused comes back failed, as from a stage in
        another process."""
        assert carried.handed is not None, "InProcessNextStage.carry hands the activations over"
        after = self._stage.next_stage
        try:
            if after is None:
                done = PendingReply(self._counter)
                done.resolve(self._stage.last_step(request, carried.handed))
                return done
            onward = self._stage.step(request, carried.handed)
        except StageError as error:
            failed = PendingReply(self._counter)
            failed.fail(error)
            return failed
        if self._onward is None:
            self._onward = after.open_stream()
        relayed = _Relayed(self._counter, onward=self._onward.send(onward.request, onward.carried))
        with self._lock:
            self._relayed.add(relayed)
        return relayed

    def receive(self, pending: PendingReply) -> stage_pb2.ForwardReply:
        """The reply to a step sent here: at once when this process answered it, else the stage after's reply,
        waited for as that stream waits (with its step timeout)."""
        if isinstance(pending, _Relayed):
            assert self._onward is not None, "a relayed step went out on the onward stream"
            with self._lock:
                self._relayed.discard(pending)
            try:
                reply = self._onward.receive(pending.onward)
            except StageError as error:
                pending.fail(error)
                raise
            pending.resolve(reply)
            return reply
        if pending.error is not None:
            raise pending.error
        assert pending.reply is not None, "a step answered in process has its reply or its error"
        return pending.reply

    def close(self) -> None:
        if self._onward is not None:
            self._onward.close()
        with self._lock:
            left, self._relayed = self._relayed, set()
        for pending in left:
            pending.fail(NextStageUnavailableError(f"the stream through {self._stage.name} was closed"))


class InProcessNextStage:
    """The Downstream of a stage whose next stage runs in this process."""

    def __init__(self, stage: HandedStage) -> None:
        self.stage = stage
        self.target = f"{stage.name} (in this process)"
        self.in_flight = StepsInFlight()

    @property
    def leaves_process(self) -> bool:
        after = self.stage.next_stage
        return after is not None and after.leaves_process

    def open_stream(self) -> HandoffStream:
        return HandoffStream(self.stage, self.in_flight)

    def carry(self, request: stage_pb2.ForwardRequest, hidden: Tensor) -> Carried:
        return Carried(handed=hidden)

    def reset_here(self, slots: Iterable[int]) -> None:
        self.stage.reset_slots(slots)

    def claim(self, request: stage_pb2.ClaimRequest) -> None:
        self.stage.claim(request)

    def reset_slot(self, request: stage_pb2.ResetSlotRequest) -> None:
        self.stage.reset_slot(request)

    def save_prefix(self, request: stage_pb2.SavePrefixRequest) -> stage_pb2.SavePrefixReply:
        return self.stage.save_prefix(request)

    def restore_prefix(self, request: stage_pb2.RestorePrefixRequest) -> stage_pb2.RestorePrefixReply:
        return self.stage.restore_prefix(request)

    def close(self) -> None:
        """Nothing to close: the next stage is stopped by whoever runs it (strata.stage_worker.co_located)."""
