"""The coordinator's side of the pipeline: one driver task steps every active slot together over one gRPC stream.

Continuous batching as strata.stage_worker.client does it, made asynchronous: each step carries a chunk per active
generation (a prefill slice or the last sampled token); tokens go to each generation's queue as they arrive. A
generation that finishes, or whose client went away, has its slot reset on the stages before its lane is released,
so the next request on that lane starts on a clean slot. The KV pool is shared by all slots, so the driver counts
the cells in use and ends a generation with finish_reason "length" before a step would overrun the pool.

Every call carries the coordinator's fencing token. A stage answering FAILED_PRECONDITION means another coordinator
holds a newer term (or another plan generation is live): this one steps down at once, fails what it was running
with NotReadyError (503 + Retry-After) and stays down until it is given a new token. An elected token is only good
until the renew deadline the coordinator last extended: past it the driver refuses to use it, without a round trip,
so a gateway that was frozen (or cut off from the API server) never sends a call on a term it may have lost. A
pipeline built without a token is a standby: not ready until `promote` hands it one. A refusal from a stage (not a
token that lapsed here) is handed to `on_fenced`, which records it where a person looks (strata.gateway.events).

With a prefix chunk set, the driver also runs the prefix cache (strata.gateway.prefix_index). Before a new
generation's first prefill chunk it looks up the longest chunk-aligned prefix of the prompt that it asked the
stages to keep, and asks every stage to restore it into the slot (RestorePrefix); only when every stage has it does
prefill start after it, otherwise the slot is reset and prefilled from position 0, so a lost snapshot costs time and
never changes the output. After a prompt's prefill completes it asks every stage to keep the prompt's longest
chunk-aligned prefix (SavePrefix). Both calls run in the driver between steps, in order with the steps on the same
stages: a snapshot is taken before anything can reset or reuse the slot, and a restore lands before the slot's first
step. They cost one unary call through the stages each, small beside the prefill they save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio
from strata.gateway.errors import GatewayError, NotReadyError, PipelineError
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.prefix_index import PrefixIndex
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = GRPC_OPTIONS
UNARY_TIMEOUT_S = 10.0


class LapsedTermError(aio.AioRpcError):  # type: ignore[misc]  # grpc is untyped
    """The token is missing or lapsed, so no call was sent: it fails as a stage's refusal would, but no stage
    refused it."""


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int = 0  # alternatives per token

    def to_proto(self) -> stage_pb2.SamplingParams:
        return stage_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, seed=self.seed, logprobs=self.logprobs
        )


@dataclass(frozen=True)
class Token:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" or "length"


@dataclass(eq=False)
class Generation:
    """One request on one slot. The driver feeds `events`; the serving object reads them and may cancel."""

    slot: int
    prompt: tuple[int, ...]
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset[int]
    on_freed: Callable[[], None]
    events: asyncio.Queue[Token | Finished | GatewayError] = field(default_factory=asyncio.Queue)
    fed: int = 0
    cached: int = 0  # prompt tokens restored from a prefix snapshot instead of prefilled
    looked_up: bool = False  # the prefix cache was asked for this prompt
    produced: int = 0
    last_token: int = -1
    cancelled: bool = False
    finished: bool = False

    async def stream(self) -> AsyncIterator[Token | Finished]:
        """Tokens until a Finished; raises the GatewayError that ended the generation, if one did."""
        while True:
            event = await self.events.get()
            if isinstance(event, GatewayError):
                raise event
            yield event
            if isinstance(event, Finished):
                return


class Pipeline:
    def __init__(
        self,
        *,
        first_stage: str,
        slots: int,
        context: int,
        fence: FencingToken | None,
        plan_generation: int = 0,
        prefill_chunk: int = 256,
        prefix_chunk: int = 0,  # tokens per prefix-cache chunk; 0: no prefix cache
        metrics: GatewayMetrics | None = None,  # None: figures of its own, unread
        step_timeout_s: float = 120.0,
        probe_interval_s: float = 0.5,
        on_ready_change: Callable[[bool], None] = lambda _ready: None,
        on_fenced: Callable[[FencingToken, str], None] = lambda _fence, _details: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first_stage = first_stage
        self.slots = slots
        self.context = context
        self.plan_generation = plan_generation
        self.prefill_chunk = prefill_chunk
        self.prefixes = PrefixIndex(chunk=prefix_chunk) if prefix_chunk > 0 else None
        self.metrics = metrics or GatewayMetrics()
        self.step_timeout_s = step_timeout_s
        self.probe_interval_s = probe_interval_s
        self._fence = fence
        self._valid_until = math.inf  # a token given at construction (single coordinator) never lapses
        self._clock = clock
        self._on_ready_change = on_ready_change
        self._on_fenced = on_fenced  # must return at once: it runs on the driver's path
        self._ready = False
        self.deposed = fence is None
        self.not_ready_reason = (
            f"connecting to the first stage at {first_stage}"
            if fence is not None
            else "standby: another gateway replica coordinates the pipeline"
        )
        self._active: dict[int, Generation] = {}
        self._wake = asyncio.Event()
        self._step_id = 0
        self._channel: aio.Channel | None = None
        self._stub: stage_pb2_grpc.StageStub | None = None
        self._call: aio.StreamStreamCall | None = None
        self._driver: asyncio.Task[None] | None = None

    # Lifecycle.

    async def start(self) -> None:
        self._channel = aio.insecure_channel(self.first_stage, options=CHANNEL_OPTIONS)
        self._stub = stage_pb2_grpc.StageStub(self._channel)
        self._driver = asyncio.create_task(self._drive(), name="pipeline-driver")

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
        self._drop_stream()
        if self._channel is not None:
            await self._channel.close()

    @property
    def ready(self) -> bool:
        return self._ready

    def _set_ready(self, ready: bool, reason: str = "") -> None:
        self.not_ready_reason = reason
        if ready != self._ready:
            self._ready = ready
            log.info("pipeline %s%s", "ready" if ready else "not ready: ", reason)
            self._on_ready_change(ready)

    def promote(self, fence: FencingToken, *, valid_until: float = math.inf) -> None:
        """Take a new fencing token (a won election): the driver claims the stages again before serving."""
        if self._active:  # claiming resets every slot: what ran under the old token cannot go on
            self._abandon(NotReadyError(f"the coordinator moved to term {fence.term}", retry_after_s=1))
            self._drop_stream()
        self._fence = fence
        self._valid_until = valid_until
        self.deposed = False
        if self.prefixes is not None:
            self.prefixes.clear()  # the stages drop their snapshots when they accept the new term
        self._set_ready(False, f"claiming the stages with term {fence.term}")
        self._wake.set()

    def extend(self, *, valid_until: float) -> None:
        """The coordinator renewed the Lease: the current token may be used until `valid_until` (monotonic)."""
        self._valid_until = valid_until

    def step_down(self, reason: str) -> None:
        """Stop coordinating at once (the Lease is lost or was not renewed in time): fail what runs with a 503."""
        self._valid_until = -math.inf
        if self.deposed:
            return
        self.deposed = True
        log.warning("stepping down: %s", reason)
        self._set_ready(False, f"stepped down: {reason}")
        self._abandon(NotReadyError(f"this gateway no longer coordinates the pipeline: {reason}", retry_after_s=1))
        self._drop_stream()
        self._wake.set()

    @property
    def fence(self) -> FencingToken | None:
        return self._fence

    # Requests.

    def submit(
        self,
        *,
        slot: int,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: Sampling,
        stop_ids: frozenset[int],
        on_freed: Callable[[], None],
    ) -> Generation:
        if not self._ready:
            raise NotReadyError(f"the pipeline is not ready: {self.not_ready_reason}", retry_after_s=1)
        if slot in self._active:
            raise PipelineError(f"slot {slot} is still in use")
        generation = Generation(
            slot=slot, prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop_ids=stop_ids, on_freed=on_freed
        )
        self._active[slot] = generation
        self._wake.set()
        return generation

    def cancel(self, generation: Generation) -> None:
        """Stop generating for `generation` (client gone, or a stop string matched); its slot is reset next."""
        generation.cancelled = True
        self._wake.set()

    # The driver.

    async def _drive(self) -> None:
        while True:
            if not self._ready:
                await self._become_ready()
                continue
            if not self._active:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._free_cancelled()
            if not self._active:
                continue
            try:
                await self._restore_prefixes()
            except grpc.RpcError as exc:
                await self._fail_all(exc)
                continue
            chunks = self._chunks()
            if not chunks:
                continue
            try:
                reply = await self._step(chunks)
                self._dispatch(chunks, reply)
                await self._save_prefixes(chunks)
            except grpc.RpcError as exc:
                await self._fail_all(exc)
                continue

    def _chunks(self) -> list[stage_pb2.SlotChunk]:
        used = sum(g.fed for g in self._active.values())
        chunks = []
        for slot, g in sorted(self._active.items()):
            if g.fed < len(g.prompt):
                # Chunks end on multiples of prefill_chunk even after a restored prefix, so a restored request
                # prefills the same spans of positions as a full prefill would.
                end = (g.fed // self.prefill_chunk + 1) * self.prefill_chunk
                ids = g.prompt[g.fed : end]
                chunk = stage_pb2.SlotChunk(
                    slot=slot,
                    start_position=g.fed,
                    length=len(ids),
                    token_ids=ids,
                    sample=g.fed + len(ids) == len(g.prompt),
                    sampling=g.sampling.to_proto(),
                )
            else:
                chunk = stage_pb2.SlotChunk(
                    slot=slot,
                    start_position=g.fed,
                    length=1,
                    token_ids=[g.last_token],
                    sample=True,
                    sampling=g.sampling.to_proto(),
                )
            if used + chunk.length > self.context or chunk.start_position + chunk.length > self.context:
                self._finish(g, Finished("length"))
                continue
            used += chunk.length
            chunks.append(chunk)
        return chunks

    def _dispatch(self, chunks: list[stage_pb2.SlotChunk], reply: stage_pb2.ForwardReply) -> None:
        sampled = {t.slot: t for t in reply.tokens}
        for chunk in chunks:
            slot = chunk.slot
            g = self._active.get(slot)
            if g is None or g.finished:
                continue
            g.fed = chunk.start_position + chunk.length
            token = sampled.get(slot)
            if token is None:
                continue
            g.last_token = token.token_id
            g.produced += 1
            if not g.cancelled:
                g.events.put_nowait(
                    Token(
                        token_id=token.token_id,
                        logprob=token.logprob,
                        top_logprobs=tuple((t.token_id, t.logprob) for t in token.top_logprobs),
                    )
                )
            if token.token_id in g.stop_ids:
                self._finish(g, Finished("stop"))
            elif g.produced >= g.max_tokens:
                self._finish(g, Finished("length"))

    async def _restore_prefixes(self) -> None:
        """Restore the longest known prefix into each new generation's slot, on every stage or not at all."""
        if self.prefixes is None:
            return
        for slot, g in sorted(self._active.items()):
            if g.looked_up or g.cancelled:
                continue
            g.looked_up = True
            if len(g.prompt) <= self.prefixes.chunk:
                continue  # too short to share a whole chunk: never a hit, so not a miss either
            match = self.prefixes.longest(g.prompt)
            if match is None:
                self.metrics.prefix_cache_misses.inc()
                continue
            request = stage_pb2.RestorePrefixRequest(
                fence=self._proto_fence(),
                plan_generation=self.plan_generation,
                slot=slot,
                key=match.key,
                length=match.length,
            )
            reply = await self._unary("RestorePrefix", request)
            self.metrics.observe_prefix_stages(reply.stats)
            if reply.restored:
                g.fed = g.cached = match.length
                self.metrics.prefix_cache_hits.inc()
                self.metrics.prefix_cache_cached_tokens.inc(match.length)
                continue
            # Some stage lost the snapshot (evicted, restarted): the others restored it, so clear the slot everywhere
            # and prefill it whole.
            self.metrics.prefix_cache_misses.inc()
            self.prefixes.forget(match.key)
            await self._unary("ResetSlot", stage_pb2.ResetSlotRequest(fence=self._proto_fence(), slot=slot))

    async def _save_prefixes(self, chunks: list[stage_pb2.SlotChunk]) -> None:
        """Ask every stage to keep the longest chunk-aligned prefix of each prompt whose prefill just completed."""
        if self.prefixes is None:
            return
        for chunk in chunks:
            g = self._active.get(chunk.slot)
            if g is None or chunk.start_position + chunk.length != len(g.prompt):
                continue
            wanted = self.prefixes.to_save(g.prompt)
            if wanted is None:
                continue
            key, length = wanted
            request = stage_pb2.SavePrefixRequest(
                fence=self._proto_fence(), plan_generation=self.plan_generation, slot=chunk.slot, key=key, length=length
            )
            reply = await self._unary("SavePrefix", request)
            self.metrics.observe_prefix_stages(reply.stats)
            if reply.kept:
                self.prefixes.add(g.prompt, key=key, length=length)

    def _finish(self, g: Generation, event: Finished | GatewayError) -> None:
        if not g.finished and not g.cancelled:
            g.events.put_nowait(event)
        g.finished = True
        g.cancelled = True  # its slot is reset before the next step

    async def _free_cancelled(self) -> None:
        for slot, g in list(self._active.items()):
            if not g.cancelled:
                continue
            try:
                await self._unary("ResetSlot", stage_pb2.ResetSlotRequest(fence=self._proto_fence(), slot=slot))
            except grpc.RpcError as exc:
                await self._fail_all(exc)
                return
            self._release(slot)

    def _release(self, slot: int) -> None:
        g = self._active.pop(slot, None)
        if g is not None:
            g.on_freed()

    async def _fail_all(self, exc: grpc.RpcError) -> None:
        code = exc.code() if isinstance(exc, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
        details = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
        self._drop_stream()
        if self.deposed:  # step_down() already failed everything and cancelled the stream under this call
            return
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            log.warning("a stage refused this coordinator, stepping down: %s", details)
            self.deposed = True
            if self._fence is not None and not isinstance(exc, LapsedTermError):
                self._on_fenced(self._fence, details)
            error: GatewayError = NotReadyError(
                f"this gateway no longer coordinates the pipeline: {details}", retry_after_s=1
            )
            self._set_ready(False, f"stepped down: {details}")
        elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            error = NotReadyError(f"a pipeline stage is unavailable: {details}", retry_after_s=1)
            self._set_ready(False, f"a stage is unavailable: {details}")
        else:
            error = PipelineError(f"the pipeline refused the step ({code.name}): {details}")
        if self.deposed or not self._ready:
            self._abandon(error)
        else:
            for g in self._active.values():
                self._finish(g, error)

    def _abandon(self, error: GatewayError) -> None:
        """End every generation with `error` and free its lane without touching the stages: they either belong to
        another coordinator now or are reset by the next claim and probe."""
        for g in self._active.values():
            self._finish(g, error)
        for slot in list(self._active):
            self._release(slot)

    async def _become_ready(self) -> None:
        """Wait for the stages to load, claim them with our term, and run a one-token probe through all of them."""
        while self.deposed:
            self._wake.clear()
            await self._wake.wait()
        claiming = self._fence
        try:
            status = await self._unary("GetLoadStatus", stage_pb2.LoadStatusRequest())
            if not status.loaded:
                reason = status.error or f"stage 0 loaded {status.bytes_loaded} of {status.bytes_total} bytes"
                self._set_ready(False, reason)
                await asyncio.sleep(self.probe_interval_s)
                return
            await self._unary(
                "Claim", stage_pb2.ClaimRequest(fence=self._proto_fence(), plan_generation=self.plan_generation)
            )
            for slot in range(self.slots):
                await self._unary("ResetSlot", stage_pb2.ResetSlotRequest(fence=self._proto_fence(), slot=slot))
            probe = stage_pb2.SlotChunk(slot=0, start_position=0, length=1, token_ids=[0], sample=True)
            await self._step([probe])
            await self._unary("ResetSlot", stage_pb2.ResetSlotRequest(fence=self._proto_fence(), slot=0))
        except grpc.RpcError as exc:
            self._drop_stream()
            if self.deposed or self._fence != claiming:  # step_down() or promote() got here first and said why
                return
            details = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
            if isinstance(exc, aio.AioRpcError) and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                log.warning("a stage refused this coordinator's claim, stepping down: %s", details)
                self.deposed = True
                if claiming is not None and not isinstance(exc, LapsedTermError):
                    self._on_fenced(claiming, details)
            self._set_ready(False, f"the pipeline at {self.first_stage} is not serving: {details}")
            await asyncio.sleep(self.probe_interval_s)
            return
        if self.deposed or self._fence != claiming:  # stepped down or promoted again while claiming: start over
            return
        self._set_ready(True)

    # gRPC.

    def _proto_fence(self) -> stage_pb2.Fence:
        """The token for a state-changing call; a missing or lapsed one fails like a stage's refusal would."""
        f = self._fence
        if f is None or self._clock() >= self._valid_until:
            why = "no coordinator term" if f is None else f"the lease behind term {f.term} was not renewed in time"
            raise LapsedTermError(grpc.StatusCode.FAILED_PRECONDITION, aio.Metadata(), aio.Metadata(), details=why)
        return stage_pb2.Fence(lease_uid=f.lease_uid, term=f.term, holder=f.holder)

    async def _unary(self, method: str, request: object) -> Any:
        assert self._stub is not None, "start() opens the channel"
        call = getattr(self._stub, method)
        return await call(request, timeout=UNARY_TIMEOUT_S)

    async def _step(self, chunks: list[stage_pb2.SlotChunk]) -> stage_pb2.ForwardReply:
        assert self._stub is not None, "start() opens the channel"
        self._step_id += 1
        request = stage_pb2.ForwardRequest(
            fence=self._proto_fence(), plan_generation=self.plan_generation, step_id=self._step_id, chunks=chunks
        )
        if self._call is None:
            self._call = self._stub.Forward()
        call = self._call
        try:
            await call.write(request)
            reply = await asyncio.wait_for(call.read(), timeout=self.step_timeout_s)
        except (TimeoutError, asyncio.InvalidStateError) as exc:
            self._drop_stream()
            raise aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), details=f"no reply to a step: {exc!r}"
            ) from exc
        except aio.AioRpcError:
            self._drop_stream()
            raise
        if reply is aio.EOF:
            self._drop_stream()
            status = await call.code()
            raise aio.AioRpcError(status, aio.Metadata(), aio.Metadata(), details=await call.details())
        result: stage_pb2.ForwardReply = reply
        return result

    def _drop_stream(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
