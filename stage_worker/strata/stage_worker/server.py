"""The gRPC edge of a stage: service Stage, the standard health service, and the one place errors become codes.

The server answers at once and loads the weights in the background, so the operator can read load progress while
the stage fills; a load that fails, for any reason, leaves its message in the load status for every caller to read.
The coordinator talks to the first stage only: Forward, ResetSlot, Claim, SavePrefix and RestorePrefix run here and
are passed on to the next stage, and the last stage's sampled tokens (and the prefix cache's answers, summed over
the stages) travel back up the same calls.

Forward does not wait for the next stage's reply before computing the next request of the same stream
(strata.stage_worker.forward_stream): a coordinator that keeps several steps in flight (micro-batches of disjoint
slots) has every stage working at once, and replies still come back in request order. Each caller's stream is passed
on as a stream of its own, and each request is fenced on its own. A step that cannot reach the next stage frees the
slots it touched, and those of the steps behind it, and fails with UNAVAILABLE, which the coordinator may retry; the
stream ends there. The load status counts the steps sent on and not yet answered, so overlap can be seen from outside.

A stage after the first makes a shared-memory region once loaded and advertises it in the load status; a previous
stage on the same host writes activations there and sends only a reference (strata.stage_worker.shared_hop). A
previous stage in the same process hands the tensor over instead (strata.stage_worker.in_process): such a stage
makes no region, and every call reaches it as a method call, its errors still StageErrors. The load status counts
the steps whose activations came each way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from strata.gguf import GGUFError
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.stage_worker.engine import Engine
from strata.stage_worker.errors import (
    InvalidRequestError,
    NextStageUnavailableError,
    NotLoadedError,
    PoolExhaustedError,
    StageError,
    StaleTermError,
    WrongGenerationError,
)
from strata.stage_worker.fencing import Holder, TermFence
from strata.stage_worker.forward_stream import ForwardStream, Onward
from strata.stage_worker.in_process import HandedStage, InProcessNextStage
from strata.stage_worker.kv_host import HostTier
from strata.stage_worker.loader import LoadProgress
from strata.stage_worker.next_stage import CHANNEL_OPTIONS, Downstream, NextStage, RemoteStageError
from strata.stage_worker.prefix_cache import PrefixCache
from strata.stage_worker.settings import StageSettings
from strata.stage_worker.shared_hop import HopRegion
from strata.stage_worker.stage_load import build_engine
from strata.stage_worker.wire import (
    chunk_from_proto,
    reply_from_result,
    stats_to_proto,
    summed_stats,
    tensor_from_proto,
)
from torch import Tensor

log = logging.getLogger(__name__)
SERVICE_NAME = "strata.rpc.v1.Stage"
MAX_PREFIX_KEY_BYTES = 64  # a sha256 is 32
T = TypeVar("T")

STATUS_CODES: tuple[tuple[type[StageError], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (PoolExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StaleTermError, grpc.StatusCode.FAILED_PRECONDITION),
    (WrongGenerationError, grpc.StatusCode.FAILED_PRECONDITION),
    (NotLoadedError, grpc.StatusCode.UNAVAILABLE),
    (NextStageUnavailableError, grpc.StatusCode.UNAVAILABLE),
)


def status_code(error: StageError) -> grpc.StatusCode:
    if isinstance(error, RemoteStageError):
        return error.code
    for kind, code in STATUS_CODES:
        if isinstance(error, kind):
            return code
    return grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, error: StageError) -> NoReturn:
    context.abort(status_code(error), str(error))
    raise AssertionError("grpc's abort() returns only by raising")


def exc_message(error: Exception) -> str:
    """A load failure as a person reads it: a typed error's own message, anything else with its type (an
    OutOfMemoryError or a RuntimeError from a kernel says little without it)."""
    if isinstance(error, StageError | GGUFError):
        return str(error)
    return f"{type(error).__name__}: {error}"


class StageService(stage_pb2_grpc.StageServicer):  # type: ignore[misc]  # generated code is untyped
    """One stage. `then` is the next stage when it runs in this process (settings.next_stage is empty then);
    `after_in_process` says the previous stage does, so no shared region is made for it."""

    def __init__(
        self,
        settings: StageSettings,
        *,
        health_servicer: health.HealthServicer,
        then: HandedStage | None = None,
        after_in_process: bool = False,
    ) -> None:
        if then is not None and settings.next_stage:
            raise ValueError(f"stage {settings.stage_index}: a next stage in this process and at {settings.next_stage}")
        self.settings = settings
        self.after_in_process = after_in_process
        self.progress = LoadProgress()
        self.fence = TermFence(stage=settings.stage_index)
        host = (
            HostTier(budget_bytes=settings.kv_host_bytes, device=settings.torch_device)
            if settings.kv_host_bytes
            else None
        )
        self.prefix_cache = PrefixCache(budget_bytes=settings.prefix_cache_bytes, host=host)
        self._health = health_servicer
        self._engine: Engine | None = None
        self._engine_lock = threading.Lock()
        self._cancel = threading.Event()
        self.hop_region: HopRegion | None = None
        self._received_lock = threading.Lock()
        self.received = {"hidden": 0, "shared_hidden": 0, "in_process": 0}  # steps by how their activations came
        self.next_stage: Downstream | None = None
        if then is not None:
            self.next_stage = InProcessNextStage(then)
        elif settings.next_stage:
            self.next_stage = NextStage(settings.next_stage, step_timeout_s=settings.step_timeout_s)
        for service in ("", SERVICE_NAME):
            health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)

    # Loading.

    def load(self) -> None:
        """Load the weights, allocate the KV pool and warm the decode step up; runs on the loader thread.

        Whatever goes wrong on the way (a typed error, running out of memory, a failing compile or capture, a bug)
        ends here as the load status's error, which every wait for this stage reads: an exception that escaped
        would end the thread in silence and leave the stage loading forever.
        """
        s = self.settings
        try:
            engine = build_engine(
                s, has_next=self.next_stage is not None, progress=self.progress, cancelled=self._cancel
            )
        except Exception as exc:
            self.progress.error = exc_message(exc)
            log.exception("stage %d failed to load layers [%d, %d)", s.stage_index, s.layer_start, s.layer_end)
            return
        if s.layer_start > 0 and s.hop_slots > 0 and not self.after_in_process:
            self.hop_region = self._make_region(engine)
        self._engine = engine
        for service in ("", SERVICE_NAME):
            self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "stage %d loaded layers [%d, %d): %d bytes", s.stage_index, s.layer_start, s.layer_end, engine.pool.nbytes
        )

    def _make_region(self, engine: Engine) -> HopRegion | None:
        s = self.settings
        slot_bytes = s.hop_slot_positions * engine.model.config.dim * s.compute_dtype.itemsize
        try:
            region = HopRegion(slots=s.hop_slots, slot_bytes=slot_bytes)
        except OSError as exc:
            log.warning("stage %d takes activations inline only: no shared region (%s)", s.stage_index, exc)
            return None
        if self._cancel.is_set():  # stopped while loading: close() has run already
            region.close()
            return None
        log.info("stage %d takes activations from this host in %s", s.stage_index, region.path)
        return region

    def close(self) -> None:
        self._cancel.set()
        if self.hop_region is not None:
            self.hop_region.close()
        if self.next_stage is not None:
            self.next_stage.close()

    @property
    def name(self) -> str:
        return f"stage {self.settings.stage_index}"

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            detail = self.progress.error or f"{self.progress.bytes_loaded} of {self.progress.bytes_total} bytes"
            raise NotLoadedError(f"stage {self.settings.stage_index} is not loaded: {detail}")
        return self._engine

    # Calls.

    def _admit(self, fence: stage_pb2.Fence, plan_generation: int | None = None) -> None:
        if plan_generation is not None and plan_generation != self.settings.plan_generation:
            raise WrongGenerationError(
                f"stage {self.settings.stage_index}: the call is for plan generation {plan_generation}; "
                f"this stage serves generation {self.settings.plan_generation}"
            )
        if self.fence.admit(Holder(term=fence.term, holder=fence.holder, lease_uid=fence.lease_uid)):
            with self._engine_lock:  # the snapshots' blocks go back to the pool that steps allocate from
                self.prefix_cache.clear()  # snapshots never cross coordinator terms

    def GetLoadStatus(
        self, request: stage_pb2.LoadStatusRequest, context: grpc.ServicerContext
    ) -> stage_pb2.LoadStatus:
        s, p = self.settings, self.progress
        return stage_pb2.LoadStatus(
            stage_index=s.stage_index,
            layer_start=s.layer_start,
            layer_end=s.layer_end,
            bytes_loaded=p.bytes_loaded,
            bytes_total=p.bytes_total,
            loaded=self._engine is not None,
            plan_generation=s.plan_generation,
            accepted_term=self.fence.accepted_term,
            error=p.error,
            has_next_stage=self.next_stage is not None,
            steps_in_flight=self.next_stage.in_flight.now if self.next_stage is not None else 0,
            steps_in_flight_peak=self.next_stage.in_flight.peak if self.next_stage is not None else 0,
            hop_region=self.hop_region.advert() if self.hop_region is not None else None,
            activations_inline=self.received["hidden"],
            activations_shared=self.received["shared_hidden"],
            activations_in_process=self.received["in_process"],
        )

    def Claim(self, request: stage_pb2.ClaimRequest, context: grpc.ServicerContext) -> stage_pb2.ClaimReply:
        return self._guard(context, lambda: self.claim(request))

    def ResetSlot(self, request: stage_pb2.ResetSlotRequest, context: grpc.ServicerContext) -> stage_pb2.ResetSlotReply:
        return self._guard(context, lambda: self.reset_slot(request))

    def SavePrefix(
        self, request: stage_pb2.SavePrefixRequest, context: grpc.ServicerContext
    ) -> stage_pb2.SavePrefixReply:
        return self._guard(context, lambda: self.save_prefix(request))

    def RestorePrefix(
        self, request: stage_pb2.RestorePrefixRequest, context: grpc.ServicerContext
    ) -> stage_pb2.RestorePrefixReply:
        return self._guard(context, lambda: self.restore_prefix(request))

    # The calls as methods (raising StageError): the gRPC methods above, and a previous stage in this process.

    def claim(self, request: stage_pb2.ClaimRequest) -> stage_pb2.ClaimReply:
        self._admit(request.fence, request.plan_generation)
        if self.next_stage is not None:
            self.next_stage.claim(request)
        return stage_pb2.ClaimReply(accepted_term=self.fence.accepted_term)

    def reset_slot(self, request: stage_pb2.ResetSlotRequest) -> stage_pb2.ResetSlotReply:
        self._admit(request.fence)
        with self._engine_lock:
            self.engine.pool.reset(request.slot)
        if self.next_stage is not None:
            self.next_stage.reset_slot(request)
        return stage_pb2.ResetSlotReply()

    def save_prefix(self, request: stage_pb2.SavePrefixRequest) -> stage_pb2.SavePrefixReply:
        kept, own = self._on_prefix(request, self.prefix_cache.save)
        if self.next_stage is None:
            return stage_pb2.SavePrefixReply(kept=kept, stats=own)
        onward = self.next_stage.save_prefix(request)
        return stage_pb2.SavePrefixReply(kept=kept and onward.kept, stats=summed_stats(own, onward.stats))

    def restore_prefix(self, request: stage_pb2.RestorePrefixRequest) -> stage_pb2.RestorePrefixReply:
        restored, own = self._on_prefix(request, self.prefix_cache.restore)
        if self.next_stage is None:
            return stage_pb2.RestorePrefixReply(restored=restored, stats=own)
        # Passed on even after a miss here, so every stage's figures come back; the coordinator then resets the
        # slot everywhere and prefills from position 0.
        onward = self.next_stage.restore_prefix(request)
        return stage_pb2.RestorePrefixReply(
            restored=restored and onward.restored, stats=summed_stats(own, onward.stats)
        )

    def _on_prefix(
        self, request: stage_pb2.SavePrefixRequest | stage_pb2.RestorePrefixRequest, act: Callable[..., bool]
    ) -> tuple[bool, stage_pb2.PrefixCacheStats]:
        """This stage's part of a prefix call: admit it, run `act` (the cache's save or restore) on the slot under
        the engine lock, and report whether it did, with this stage's figures."""
        self._admit(request.fence, request.plan_generation)
        self._check_key(request.key)
        with self._engine_lock:
            done = act(
                pool=self.engine.pool,
                slot=request.slot,
                generation=request.plan_generation,
                key=request.key,
                length=request.length,
            )
        return done, stats_to_proto(self.prefix_cache.stats())

    @staticmethod
    def _check_key(key: bytes) -> None:
        if not 1 <= len(key) <= MAX_PREFIX_KEY_BYTES:
            raise InvalidRequestError(f"a prefix key is 1 to {MAX_PREFIX_KEY_BYTES} bytes, not {len(key)}")

    def Forward(
        self, request_iterator: Iterator[stage_pb2.ForwardRequest], context: grpc.ServicerContext
    ) -> Iterator[stage_pb2.ForwardReply]:
        if self.next_stage is None:  # the last stage: nothing downstream to overlap with
            for request in request_iterator:
                yield self._guard(context, lambda request=request: self.last_step(request))  # type: ignore[misc]
            return
        stream = ForwardStream(
            requests=request_iterator,
            downstream=self.next_stage.open_stream(),
            compute=self.step,
            reset=self.reset_slots,
            split=self.settings.pipeline_chunk if self.next_stage.leaves_process else 0,
        )
        try:
            yield from stream.replies()
        except StageError as error:
            abort(context, error)

    def _activations(self, request: stage_pb2.ForwardRequest, handed: Tensor | None) -> Tensor | None:
        """The hidden states a step came with: handed over by a previous stage in this process, inline, or through
        this stage's shared region; None on the first stage."""
        way = "in_process" if handed is not None else request.WhichOneof("activations")
        if way is None:
            return None
        if handed is not None:
            hidden = handed
        elif way == "hidden":
            hidden = tensor_from_proto(request.hidden)
        elif self.hop_region is None:
            raise InvalidRequestError(f"stage {self.settings.stage_index} has no shared region to read activations")
        else:
            hidden = self.hop_region.read(request.shared_hidden, device=self.settings.torch_device)
        with self._received_lock:
            self.received[way] += 1
        return hidden

    def last_step(self, request: stage_pb2.ForwardRequest, handed: Tensor | None = None) -> stage_pb2.ForwardReply:
        """Compute a step on the last stage and answer it; `handed`: activations from a stage in this process."""
        self._admit(request.fence, request.plan_generation)
        chunks = [chunk_from_proto(c) for c in request.chunks]
        hidden = self._activations(request, handed)
        with self._engine_lock:
            result = self.engine.step(chunks, hidden)
        return reply_from_result(request.step_id, result)

    def step(self, request: stage_pb2.ForwardRequest, handed: Tensor | None = None) -> Onward:
        """Compute a step on a stage with a next stage: its slots, and the request to send on."""
        assert self.next_stage is not None, "only a stage with a next stage sends steps on"
        self._admit(request.fence, request.plan_generation)
        chunks = [chunk_from_proto(c) for c in request.chunks]
        hidden = self._activations(request, handed)
        with self._engine_lock:
            result = self.engine.step(chunks, hidden)
        assert result.hidden is not None, "load() refuses a stage that ends the model yet has a next stage"
        onward = stage_pb2.ForwardRequest(
            fence=request.fence, plan_generation=request.plan_generation, step_id=request.step_id, chunks=request.chunks
        )
        carried = self.next_stage.carry(onward, result.hidden)  # outside the engine lock: it may wait for a slot
        return Onward(slots=tuple(chunk.slot for chunk in chunks), request=onward, carried=carried)

    def reset_slots(self, slots: Iterable[int]) -> None:
        """Free `slots` here and on the stages after this one in this process (a step lost on its way on)."""
        slots = tuple(slots)
        with self._engine_lock:
            for slot in slots:
                self.engine.pool.reset(slot)
        if self.next_stage is not None:
            self.next_stage.reset_here(slots)

    def _guard(self, context: grpc.ServicerContext, call: Callable[[], T]) -> T:
        try:
            return call()
        except StageError as error:
            abort(context, error)


class RunningStage:
    """A started server: the service, the bound port, and the background load. `then` and `after_in_process` place
    it among stages of one process (StageService says how); `loader`, a thread not started yet, loads it instead of
    a thread of its own (strata.stage_worker.co_located loads such stages one after the other)."""

    def __init__(
        self,
        settings: StageSettings,
        *,
        max_workers: int = 16,
        then: StageService | None = None,
        after_in_process: bool = False,
        loader: threading.Thread | None = None,
    ) -> None:
        self.health = health.HealthServicer()
        self.service = StageService(settings, health_servicer=self.health, then=then, after_in_process=after_in_process)
        self.handlers = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="stage-handler")
        self.server = grpc.server(self.handlers, options=CHANNEL_OPTIONS)
        stage_pb2_grpc.add_StageServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(settings.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {settings.listen}")
        self.server.start()
        if loader is None:
            loader = threading.Thread(target=self.service.load, daemon=True, name="stage-loader")
            loader.start()
        self.loader = loader

    def stop(self, grace_s: float | None = None) -> None:
        self.service.close()
        self.server.stop(grace_s).wait()
        # Idle handler threads end now rather than at the interpreter's exit, so a thread still running after the
        # stop is one that a call holds (strata.stage_worker.shutdown names it).
        self.handlers.shutdown(wait=False)
