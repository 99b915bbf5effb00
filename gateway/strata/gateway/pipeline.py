"""The coordinator's side of the pipeline: one driver task steps every active slot together over one gRPC stream.

Continuous batching as strata.stage_worker.client does it, made asynchronous: each step carries a chunk per active
generation (a prefill slice or the last sampled token); tokens go to each generation's queue as they arrive. A
generation that finishes, or whose client went away, has its slot reset on the stages before its lane is released,
so the next request on that lane starts on a clean slot. The KV pool is shared by all slots, so the driver counts
the cells in use and ends a generation with finish_reason "length" before a step would overrun the pool.

Micro-batches. With one step at a time only one stage works while the others wait. With `micro_batches` G > 1 and a
first stage that has a next one (its load status says so), the driver splits the active slots into up to G steps of
disjoint slots and keeps up to G of them in flight on the stream: it writes the next group's step before the
previous group's reply is back, so stage 0 computes one group while stage 1 computes another (the stages overlap
them, strata.stage_worker.forward_stream). Replies come back in order; each is dispatched as it lands and that
group's slots build their next step. A slot's next chunk needs its previous reply, so a slot is in at most one step
in flight. Everything that touches a slot outside a step (ResetSlot, SavePrefix, RestorePrefix) waits until the slot
has no step in flight, and the pool count includes the positions of the steps in flight. Any error fails every step
in flight, and the stream with them. With G = 1 it is one step at a time, as before.

A generation under a grammar (strata.gateway.grammar) carries its mask of allowed tokens in each chunk that samples,
computed when the chunk is built (after its previous token landed and advanced the grammar); it ends with "stop"
as soon as the grammar allows nothing more, without a step to sample the end-of-text token.

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

With a Speculation, a generation's decode chunk carries its last token and the tokens its drafter proposes after
it (n-gram lookup over its context, strata.gateway.speculation, unless `drafters` makes another kind); the reply
then holds one to all of those tokens plus one, dispatched in order as if each had come from a step of its own,
and the slot's next chunk starts after them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, defaultdict, deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc import aio
from strata.gateway.errors import GatewayError, NotReadyError, PipelineError
from strata.gateway.grammar import Constraint, ConstraintViolationError
from strata.gateway.metrics import GatewayMetrics
from strata.gateway.prefix_index import PrefixIndex, boundary_hashes
from strata.gateway.speculation import Drafter, NgramDrafter, Speculation, drafts_for
from strata.lease import FencingToken
from strata.rpc.v1 import stage_pb2, stage_pb2_grpc
from strata.settings import GRPC_OPTIONS

log = logging.getLogger(__name__)

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


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    logprobs: int = 0  # alternatives per token
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token generated so far
    frequency_penalty: float = 0.0  # subtracted for each time a token was generated so far
    repetition_penalty: float = 1.0  # divides the positive logits of prompt and generated tokens; 1: off

    def to_proto(
        self, generated: Mapping[int, int] | None = None, prompt: frozenset[int] = frozenset()
    ) -> stage_pb2.SamplingParams:
        """The step's parameters; the presence and frequency penalties become a bias on the tokens `generated` so
        far (token -> count), and the repetition penalty names the distinct tokens of the `prompt` and the
        generation, so the stages need no history of their own."""
        bias = dict(self.logit_bias)
        for token, count in (generated or {}).items():
            bias[token] = bias.get(token, 0.0) - self.presence_penalty - self.frequency_penalty * count
        repeated = sorted(prompt | set(generated or ())) if self.repetition_penalty != 1.0 else []
        return stage_pb2.SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            logprobs=self.logprobs,
            logit_bias={t: b for t, b in bias.items() if b},
            repetition_penalty=self.repetition_penalty if repeated else 0.0,
            penalized=repeated,
        )

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


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
    constraint: Constraint | None = None  # a grammar the tokens must follow; its mask goes with each sampling chunk
    events: asyncio.Queue[Token | Finished | GatewayError] = field(default_factory=asyncio.Queue)
    fed: int = 0
    cached: int = 0  # prompt tokens restored from a prefix snapshot instead of prefilled
    looked_up: bool = False  # the prefix cache was asked for this prompt
    held: bool = False  # waiting for another generation's prefill of the same prefix, to restore it from the cache
    produced: int = 0
    last_token: int = -1
    cancelled: bool = False
    finished: bool = False
    in_flight: int = 0  # positions of its chunk in a step not yet answered; 0: its slot is free to step or reset
    held_cells: int = 0  # positions the stages hold for it: past `fed` after rejected drafts, until its next step
    landed: int = 0  # the step whose reply last carried it: the longest waiting go first when steps are split
    generated: Counter[int] = field(default_factory=Counter)  # token -> times generated, for the penalties
    # The prompt's distinct tokens, which a repetition penalty applies to (empty without one).
    prompt_tokens: frozenset[int] = field(init=False, default=frozenset())
    drafter: Drafter | None = None  # proposes tokens to verify, when speculation applies to this request
    proposed: tuple[int, ...] | None = None  # a computing drafter's proposal, made off the loop before the step

    def __post_init__(self) -> None:
        if self.sampling.repetition_penalty != 1.0:
            self.prompt_tokens = frozenset(self.prompt)

    async def stream(self) -> AsyncIterator[Token | Finished]:
        """Tokens until a Finished; raises the GatewayError that ended the generation, if one did."""
        while True:
            event = await self.events.get()
            if isinstance(event, GatewayError):
                raise event
            yield event
            if isinstance(event, Finished):
                return


@dataclass(frozen=True)
class _Step:
    step_id: int
    chunks: list[stage_pb2.SlotChunk]


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
        self._in_flight: deque[_Step] = deque()  # written on the stream, oldest first; replies come in this order
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
        )
        s = self.speculation
        if s is not None and drafts_for(penalised=sampling.penalised, constrained=constraint is not None):
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

    def _chunks(self) -> list[stage_pb2.SlotChunk]:
        """The next step: a chunk for each generation that may step now, in slot order. With micro-batches it takes
        the longest waiting first, no more than an even share of the stepping slots (so uneven groups even out
        as they land) and no more than leaves a slot for each step still to write (so G groups fill up)."""
        used = sum(max(g.fed + g.in_flight, g.held_cells) for g in self._active.values())
        waiting = [g for g in self._active.values() if not g.cancelled and not g.in_flight and not g.held]
        stepping = len(waiting) + sum(1 for g in self._active.values() if g.in_flight)
        even = math.ceil(stepping / self._groups)
        share = min(even, math.ceil(len(waiting) / (self._groups - len(self._in_flight))))
        chosen = sorted(waiting, key=lambda g: (g.landed, g.slot))[:share]
        decoding = sum(1 for g in chosen if g.fed >= len(g.prompt))
        drafting = self.speculation is not None and decoding <= self.speculation.max_slots
        chunks = []
        for g in sorted(chosen, key=lambda g: g.slot):
            slot = g.slot
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
                    sampling=g.sampling.to_proto(g.generated, g.prompt_tokens),
                )
            else:
                draft = self._draft(g, used=used, drafting=drafting)
                chunk = stage_pb2.SlotChunk(
                    slot=slot,
                    start_position=g.fed,
                    length=1 + len(draft),
                    token_ids=[g.last_token, *draft],
                    sample=True,
                    sampling=g.sampling.to_proto(g.generated, g.prompt_tokens),
                    drafted=len(draft),
                )
            if used + chunk.length > self.context or chunk.start_position + chunk.length > self.context:
                self._finish(g, Finished("length"))
                continue
            used += chunk.length
            chunks.append(chunk)
        return self._with_masks(chunks)

    async def _propose_off_loop(self) -> None:
        """Each decoding generation whose drafter runs a model gets its proposal in a worker thread, so the loop
        serves every other request meanwhile; `_draft` takes it, cut to the room the step leaves."""
        if self.speculation is None:
            return
        for g in list(self._active.values()):
            d = g.drafter
            if d is None or not d.computes or g.proposed is not None or g.cancelled or g.in_flight or g.held:
                continue
            if g.fed >= len(g.prompt):
                limit = min(g.max_tokens - g.produced, self.context - g.fed) - 1
                g.proposed = await asyncio.to_thread(d.propose, limit)

    def _draft(self, g: Generation, *, used: int, drafting: bool) -> tuple[int, ...]:
        """The tokens g's drafter proposes after its last one (none while the step does not draft): no more than g
        may still produce after the one this step picks anyway, nor than the pool and the context have room for.
        A proposal made off the loop serves this step only: the step changes the tokens it followed."""
        proposed, g.proposed = g.proposed or (), None
        if g.drafter is None or self.speculation is None or not drafting:
            return ()
        room = min(g.max_tokens - g.produced, self.context - used, self.context - g.fed) - 1
        if g.drafter.computes:
            proposed = proposed[: max(room, 0)]
            draft = proposed if len(proposed) >= self.speculation.min_draft else ()
        else:
            draft = g.drafter.propose(room)
        if draft:
            self.metrics.speculative_drafted.inc(len(draft))
        return draft

    def _with_masks(self, chunks: list[stage_pb2.SlotChunk]) -> list[stage_pb2.SlotChunk]:
        """Each sampling chunk of a constrained generation gets its mask, all of the step's computed together; a
        generation whose grammar failed ends with an error and leaves the step."""
        constrained = [(c, g) for c in chunks if c.sample and (g := self._active[c.slot]).constraint is not None]
        if not constrained:
            return chunks
        constraints = [g.constraint for _, g in constrained if g.constraint is not None]
        failed = set()
        for (chunk, g), mask in zip(constrained, constraints[0].grammars.masks(constraints), strict=True):
            if mask is None:
                error = g.constraint.error if g.constraint is not None else ""
                self._finish(g, PipelineError(f"the output constraint failed: {error}"))
                failed.add(chunk.slot)
            else:
                chunk.allowed_tokens = mask
        return [c for c in chunks if c.slot not in failed]

    def _dispatch(self, step: _Step, reply: stage_pb2.ForwardReply) -> None:
        sampled: defaultdict[int, list[stage_pb2.SampledToken]] = defaultdict(list)
        for token in reply.tokens:  # a drafted chunk's slot has its run of tokens, in order
            sampled[token.slot].append(token)
        for chunk in step.chunks:
            slot = chunk.slot
            g = self._active.get(slot)
            if g is None:
                continue
            g.in_flight = 0
            g.landed = step.step_id
            if g.finished:
                continue
            run = sampled.get(slot, [])
            if chunk.sample and not run:  # a stage that broke the protocol: never step the slot again as if it had
                self._finish(g, PipelineError(f"the last stage answered step {step.step_id} with no token for {slot}"))
                continue
            # A drafted chunk's positions hold what the model picked only up to the last accepted draft.
            g.fed = chunk.start_position + (len(run) if chunk.drafted else chunk.length)
            g.held_cells = chunk.start_position + chunk.length
            if chunk.drafted:
                self.metrics.speculative_accepted.inc(len(run) - 1)
                self.metrics.speculative_run.observe(len(run))
            for token in run:
                if not self._deliver(g, token):
                    break

    def _deliver(self, g: Generation, token: stage_pb2.SampledToken) -> bool:
        """Hand g one picked token; False once g has finished (a stop, its length, a grammar's end or failure)."""
        g.last_token = token.token_id
        g.produced += 1
        if g.drafter is not None:
            g.drafter.extend((token.token_id,))
        if g.sampling.penalised:
            g.generated[token.token_id] += 1
        if g.constraint is not None:
            try:
                g.constraint.advance(token.token_id)
            except ConstraintViolationError as exc:
                self._finish(g, PipelineError(f"the output constraint failed: {exc}"))
                return False
        if not g.cancelled:
            g.events.put_nowait(
                Token(
                    token_id=token.token_id,
                    logprob=token.logprob,
                    top_logprobs=tuple((t.token_id, t.logprob) for t in token.top_logprobs),
                )
            )
        if token.token_id in g.stop_ids or (g.constraint is not None and g.constraint.complete):
            self._finish(g, Finished("stop"))
        elif g.produced >= g.max_tokens:
            self._finish(g, Finished("length"))
        return not g.finished

    async def _restore_prefixes(self) -> None:
        """Restore the longest known prefix into each new generation's slot, on every stage or not at all."""
        if self.prefixes is None:
            return
        for slot, g in sorted(self._active.items()):
            if g.looked_up or g.cancelled:
                continue
            if len(g.prompt) <= self.prefixes.chunk:
                g.looked_up = True
                continue  # too short to share a whole chunk: never a hit, so not a miss either
            match = self.prefixes.longest(g.prompt)
            g.held = match is None and self._prefilled_beside(g)
            if g.held:
                continue
            g.looked_up = True
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

    def _prefilled_beside(self, g: Generation) -> bool:
        """Whether another generation is prefilling a prompt whose whole chunk-aligned part begins g's prompt (the
        choices of `n > 1`, the same prompt sent twice at once). g then waits for that prefix's snapshot instead of
        computing the same positions beside it, and restores it as soon as the other's prefill lands: it never waits
        longer than its own prefill would have taken."""
        assert self.prefixes is not None
        mine = {d for _, d in boundary_hashes(g.prompt, chunk=self.prefixes.chunk, limit=len(g.prompt))}
        for other in self._active.values():
            if other is g or other.held or not other.looked_up or other.cancelled or other.fed >= len(other.prompt):
                continue
            wanted = self.prefixes.to_save(other.prompt)
            if wanted is not None and wanted[0] in mine:
                return True
        return False

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
        self._in_flight.append(_Step(step_id=self._step_id, chunks=chunks))
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

    async def _read(self) -> tuple[_Step, stage_pb2.ForwardReply]:
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
