"""One caller's Forward stream on a stage that has a next stage: compute step k+1 while step k is downstream.

A thread takes the stream's requests in order: it computes each (the server's `compute`: fencing, then the layers),
sends the hidden states on to the next stage without waiting, on a stream of this caller's own, and queues the
pending reply. The handler's generator yields the queued replies in the same order, waiting for each with the step
timeout (strata.stage_worker.next_stage). When the caller's stream ends, for any reason, so does the one onward.
So this stage works on the next step while the stages after it work on the previous one, and requests and replies
still pair up in order. A caller that writes one step and waits for its reply gets exactly the old behaviour.

The first step that fails ends the stream. A step this stage refused (fencing, a bad chunk) fails after the replies
before it; nothing behind it is computed. A step the next stage could not answer (it died, hung, or dropped the
stream) fails with NextStageUnavailableError and its slots are reset here; so are the slots of every step computed
behind it, whose replies can no longer come back on this stream. A step the next stage refused is passed back with
its status code, its own slots left as they were (the coordinator resets them), the steps behind it reset.

A long prefill is pipelined inside one step: the first stage cuts a chunk of more than `split` positions into pieces
(`split_prefill`), sends each piece on as soon as it is computed and computes the next meanwhile, so the stages after
it work on piece i while this one works on piece i+1; the step's one reply is the last piece's. Without this, a
4,096-token prompt crossed to the next stage as one 32 MiB message after the whole prefill, and two stages took three
times as long to the first token as one. A next stage in this process (strata.stage_worker.in_process) computes each
step as it is sent, on the same device: there the stage is given `split` 0 unless a stage in another process follows,
since pieces would only make smaller matrix products for nothing to overlap with.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc
from strata.rpc.v1 import stage_pb2
from strata.stage_worker.errors import NextStageUnavailableError
from strata.stage_worker.next_stage import Carried, PendingReply, StepSender


@dataclass(frozen=True)
class Onward:
    """A step computed here: its slots, the request for the next stage, and how its activations travel (in the
    request, through a shared-memory slot freed once the step is answered or failed, or handed over in process)."""

    slots: tuple[int, ...]
    request: stage_pb2.ForwardRequest
    carried: Carried


@dataclass(frozen=True)
class Launched:
    """A step computed here and sent on (in one piece or several): its slots, and the next stage's replies to come;
    the last piece's reply answers the step."""

    slots: tuple[int, ...]
    pending: tuple[PendingReply, ...]


def split_prefill(request: stage_pb2.ForwardRequest, *, split: int) -> list[stage_pb2.ForwardRequest]:
    """The request as pieces of at most `split` positions, in order, when it is one slot's chunk of token ids (the
    first stage's prefill) and asks for no logits and no draft check; otherwise the request itself. Only the last
    piece samples."""
    if split < 1 or len(request.chunks) != 1 or request.WhichOneof("activations") is not None:
        return [request]
    chunk = request.chunks[0]
    if chunk.length <= split or chunk.return_logits or chunk.drafted or len(chunk.token_ids) != chunk.length:
        return [request]
    pieces = []
    for offset in range(0, chunk.length, split):
        length = min(split, chunk.length - offset)
        piece = stage_pb2.ForwardRequest(
            fence=request.fence, plan_generation=request.plan_generation, step_id=request.step_id
        )
        part = piece.chunks.add()
        part.CopyFrom(chunk)
        part.start_position = chunk.start_position + offset
        part.length = length
        del part.token_ids[:]
        part.token_ids.extend(chunk.token_ids[offset : offset + length])
        part.sample = chunk.sample and offset + length == chunk.length
        pieces.append(piece)
    return pieces


@dataclass(frozen=True)
class _Failed:
    error: Exception


_END = object()


class ForwardStream:
    def __init__(
        self,
        *,
        requests: Iterator[stage_pb2.ForwardRequest],
        downstream: StepSender,
        compute: Callable[[stage_pb2.ForwardRequest], Onward],
        reset: Callable[[Iterable[int]], None],
        split: int = 0,
    ) -> None:
        self._requests = requests
        self._downstream = downstream
        self._compute = compute  # a request -> what to send on; raises StageError
        self._reset = reset
        self._split = split  # positions per piece of a pipelined prefill; 0: never cut a step
        self._lock = threading.Lock()
        self._queue: queue.Queue[object] = queue.Queue()
        self._stopped = False

    def replies(self) -> Iterator[stage_pb2.ForwardReply]:
        """The replies in request order; raises the error of the first step that failed."""
        threading.Thread(target=self._launch_all, daemon=True, name="forward-stream").start()
        try:
            while (item := self._queue.get()) is not _END:
                if isinstance(item, _Failed):
                    self._stop(failed=())
                    raise item.error
                assert isinstance(item, Launched), "the queue holds launched steps, one failure and the end"
                try:
                    for pending in item.pending:
                        reply = self._downstream.receive(pending)
                except NextStageUnavailableError:
                    self._stop(failed=item.slots)
                    raise
                except Exception:
                    self._stop(failed=())
                    raise
                yield reply
        finally:
            # The caller went away, or the stream failed: send nothing more on its behalf.
            self._stop(failed=())
            self._downstream.close()

    def _launch_all(self) -> None:
        try:
            for request in self._requests:
                sent: list[PendingReply] = []
                for piece in split_prefill(request, split=self._split):
                    if self._stopped:
                        return
                    onward = self._compute(piece)
                    with self._lock:
                        if self._stopped:  # the stream failed while this step was being computed
                            onward.carried.release()
                            self._reset(onward.slots)
                            return
                        sent.append(self._downstream.send(onward.request, onward.carried))
                with self._lock:
                    self._queue.put(Launched(slots=onward.slots, pending=tuple(sent)))
        except grpc.RpcError:
            pass  # the caller cancelled the stream: there is no one to answer
        except Exception as exc:  # handed over in order: the replies before it still go back first
            self._queue.put(_Failed(exc))
        finally:
            self._queue.put(_END)

    def _stop(self, *, failed: tuple[int, ...]) -> None:
        """Stop launching; reset `failed` and the slots of every step launched behind it, whose replies are lost."""
        with self._lock:
            self._stopped = True
            behind: list[int] = []
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Launched):
                    behind.extend(item.slots)
        slots = (*failed, *behind)
        if slots:
            self._reset(slots)
