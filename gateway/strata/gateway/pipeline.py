"""The coordinator's side of the pipeline: one driver task steps every active slot together over one gRPC stream.

Continuous batching as strata.stage_worker.client does it, made asynchronous: each step carries a chunk per active
generation (a prefill slice or the last sampled token, strata.gateway.stepping); tokens go to each generation's queue
as they arrive. A generation that finishes, or whose client went away, has its slot reset on the stages before its
lane is released, so the next request on that lane starts on a clean slot.

Micro-batches. With one step at a time only one stage works while the others wait. With `micro_batches` G > 1 and a
first stage that has a next one (its load status says so), the driver splits the active slots into up to G steps of
disjoint slots and keeps up to G of them in flight on the stream: it writes the next group's step before the
previous group's reply is back, so stage 0 computes one group while stage 1 computes another (the stages overlap
them, strata.stage_worker.forward_stream). Replies come back in order; each is dispatched as it lands and that
group's slots build their next step. A slot's next chunk needs its previous reply, so a slot is in at most one step
in flight. Everything that touches a slot outside a step (ResetSlot, SavePrefix, RestorePrefix) waits until the slot
has no step in flight, and the pool count includes the positions of the steps in flight. Any error fails every step
in flight, and the stream with them. With G = 1 it is one step at a time, as before.

Every call carries the coordinator's fencing token (strata.gateway.stage_stream). A stage answering
FAILED_PRECONDITION means another coordinator holds a newer term (or another plan generation is live): this one
steps down at once, fails what it was running with NotReadyError (503 + Retry-After) and stays down until it is
given a new token. An elected token is only good until the renew deadline the coordinator last extended: past it the
driver refuses to use it, without a round trip, so a gateway that was frozen (or cut off from the API server) never
sends a call on a term it may have lost. A pipeline built without a token is a standby: not ready until `promote`
hands it one. A refusal from a stage (not a token that lapsed here) is handed to `on_fenced`, which records it where
a person looks (strata.gateway.events).

With a prefix chunk set, the driver also runs the prefix cache (strata.gateway.prefix_caching) between steps.

With a Speculation, a generation's decode chunk carries its last token and the tokens its drafter proposes after
it (n-gram lookup over its context, strata.gateway.speculation, unless `drafters` makes another kind, which then
proposes in a worker thread); the reply then holds one to all of those tokens plus one, dispatched in order as if
each had come from a step of its own, and the slot's next chunk starts after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable

import grpc
from grpc import aio
from strata.gateway.errors import GatewayError, NotReadyError, PipelineError
from strata.gateway.generation import Generation, Sampling
from strata.gateway.grammar import Constraint
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.prefix_caching import PrefixCaching
from strata.gateway.prefix_index import PrefixIndex
from strata.gateway.settings import DEFAULT_PREFILL_CHUNK
from strata.gateway.speculation import Drafter, NgramDrafter, Speculation, drafts_for
from strata.gateway.stage_stream import CHANNEL_OPTIONS, DroppedStreamError, LapsedTermError, Step
from strata.gateway.stepping import Stepping
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)


class Pipeline(Stepping, PrefixCaching):
    def __init__(
        self,
        *,
        first_stage: str,
        slots: int,
        context: int,
        fence: FencingToken | None,
        plan_generation: int = 0,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_chunk: int = 0,  # tokens per prefix-cache chunk; 0: no prefix cache
        prefix_seed: bytes = b"",  # what prompt hashes chain from (strata.gateway.prefix_index.prefix_seed)
        micro_batches: int = 1,  # steps in flight at once, of disjoint slots; used only with two stages or more
        speculation: Speculation | None = None,  # None: one position a decode step
        # A request's drafter, given its prompt; None: n-gram lookup. It may answer None (no draft for that request).
        drafters: Callable[[tuple[int, ...]], Drafter | None] | None = None,
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
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be at least 1, not {micro_batches}")
        self.micro_batches = micro_batches
        self._groups = 1  # micro_batches once the first stage says a next stage follows it
        self.speculation = speculation
        self._drafters = drafters
        self.prefixes = PrefixIndex(chunk=prefix_chunk, seed=prefix_seed) if prefix_chunk > 0 else None
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
        self._in_flight: deque[Step] = deque()  # written on the stream, oldest first; replies come in this order
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
        for g in self._active.values():
            if g.drafter is not None:
                g.drafter.close()
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
        constraint: Constraint | None = None,
        cache_salt: str = "",
    ) -> Generation:
        if not self._ready:
            raise NotReadyError(f"the pipeline is not ready: {self.not_ready_reason}", retry_after_s=1)
        if slot in self._active:
            raise PipelineError(f"slot {slot} is still in use")
        generation = Generation(
            slot=slot,
            prompt=prompt,
            max_tokens=max_tokens,
            sampling=sampling,
            stop_ids=stop_ids,
            on_freed=on_freed,
            constraint=constraint,
            cache_salt=cache_salt,
        )
        s = self.speculation
        if s is not None and drafts_for(penalised=sampling.penalised):
            generation.drafter = (
                NgramDrafter(prompt, speculation=s) if self._drafters is None else self._drafters(prompt)
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
            try:
                await self._free_cancelled()
                await self._restore_prefixes()
                await self._send_steps()
                if self._in_flight:
                    await self._land()
            except grpc.RpcError as exc:
                await self._fail_all(exc)

    async def _send_steps(self) -> None:
        """Write a step for the slots without one in flight, and another, until `_groups` steps are in flight."""
        while len(self._in_flight) < self._groups:
            await self._propose_off_loop()
            chunks = self._chunks()
            if not chunks:
                return
            await self._write(chunks)

    async def _land(self) -> None:
        """Wait for the oldest step's reply, hand out its tokens, and save the prefixes whose prefill it completed."""
        step, reply = await self._read()
        self._dispatch(step, reply)
        await self._save_prefixes(step.chunks)

    async def _free_cancelled(self) -> None:
        """Reset the slots of finished and cancelled generations and free their lanes; a slot with a step in flight
        waits for that step's reply, so the reset never overtakes it."""
        for slot, g in list(self._active.items()):
            if not g.cancelled or g.in_flight:
                continue
            await self._unary("ResetSlot", stage_pb2.ResetSlotRequest(fence=self._proto_fence(), slot=slot))
            self._release(slot)

    def _release(self, slot: int) -> None:
        g = self._active.pop(slot, None)
        if g is not None:
            if g.drafter is not None:
                g.drafter.close()
            g.on_freed()

    async def _fail_all(self, exc: grpc.RpcError) -> None:
        code = exc.code() if isinstance(exc, aio.AioRpcError) else grpc.StatusCode.UNKNOWN
        details = exc.details() if isinstance(exc, aio.AioRpcError) else str(exc)
        self._drop_stream()
        if self.deposed or isinstance(exc, DroppedStreamError):  # step_down() or promote() already failed everything
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
            # One stage has nothing to overlap a step with: splitting would only make its batches smaller.
            self._groups = self.micro_batches if status.has_next_stage else 1
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
