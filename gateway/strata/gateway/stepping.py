"""Building the driver's steps and handing out what their replies carry.

A step carries a chunk per generation that may step now: a prefill slice, or the last sampled token (with the tokens
speculation drafts after it). A chunk that would run past the context ends its generation with finish_reason
"length". The KV pool is shared by all slots: a chunk that would overrun it waits for the cells other generations
free as they finish; only when nothing under way can free any (no step in flight, none to send) does the waiting
generation that holds the fewest cells end with "length", so the others go on. A generation under a grammar
(strata.gateway.grammar) carries its mask of allowed tokens in each chunk that samples, computed when the chunk is
built (after its previous token landed and advanced the grammar); it ends with "stop" as soon as the grammar allows
nothing more, without a step to sample the end-of-text token.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict

from strata.gateway.draft_lengths import START_HORIZON, draft_lengths, smoothed
from strata.gateway.errors import GatewayError, PipelineError
from strata.gateway.generation import Finished, Generation, Token, cells_in_use
from strata.gateway.grammar import ConstraintViolationError
from strata.gateway.speculation import Speculation, proposals
from strata.gateway.stage_stream import StageStream, Step
from strata.kv_layout import BLOCK_TOKENS
from strata.rpc.v1 import stage_pb2


class Stepping(StageStream):
    context: int
    prefill_chunk: int
    speculation: Speculation | None
    _groups: int
    # Seconds of a one-position step of the pipeline, lately (0 until a step landed): each landed step's round trip
    # over its cost in one-position steps. What a draft model's token costs is weighed against it.
    _position_seconds: float = 0.0

    def _chunks(self) -> list[stage_pb2.SlotChunk]:
        """The next step: a chunk for each generation that may step now, in slot order. With micro-batches it takes
        the longest waiting first, no more than an even share of the stepping slots (so uneven groups even out
        as they land) and no more than leaves a slot for each step still to write (so G groups fill up)."""
        used = cells_in_use(self._active.values(), block=BLOCK_TOKENS)
        waiting = [g for g in self._active.values() if not g.cancelled and not g.in_flight and not g.held]
        stepping = len(waiting) + sum(1 for g in self._active.values() if g.in_flight)
        even = math.ceil(stepping / self._groups)
        share = min(even, math.ceil(len(waiting) / (self._groups - len(self._in_flight))))
        chosen = sorted(waiting, key=lambda g: (g.landed, g.slot))[:share]
        budgets = self._draft_budgets(chosen)
        if budgets and not any(budgets.values()):
            self.metrics.speculative_off_steps.inc()
        chunks = []
        short: list[Generation] | None = []  # waiting for cells of the shared pool (None: some will come free)
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
                draft = self._draft(g, used=used, budget=budgets.get(slot, 0))
                chunk = stage_pb2.SlotChunk(
                    slot=slot,
                    start_position=g.fed,
                    length=1 + len(draft),
                    token_ids=[g.last_token, *draft],
                    sample=True,
                    sampling=g.sampling.to_proto(g.generated, g.prompt_tokens),
                    drafted=len(draft),
                )
            if chunk.start_position + chunk.length > self.context:
                self._finish(g, Finished("length"))
                short = None  # its cells come free before the next step
                continue
            if used + chunk.length > self.context:
                if short is not None:
                    short.append(g)
                continue
            used += chunk.length
            chunks.append(chunk)
        if short and not chunks and not self._in_flight:
            self._finish(min(short, key=lambda g: (g.cells(), -g.slot)), Finished("length"))
        return self._with_masks(chunks)

    async def _propose_off_loop(self) -> None:
        """Each decoding generation whose drafter runs a model gets its proposal in a worker thread, so the loop
        serves every other request meanwhile; `_draft` takes it, cut to the room the step leaves."""
        if self.speculation is None:
            return
        # The step to come takes at most these: budgets over all of them are no longer than the step's own.
        waiting = [g for g in self._active.values() if not g.cancelled and not g.in_flight and not g.held]
        computing = [(g, d) for g in waiting if (d := g.drafter) is not None and d.computes and g.proposed is None]
        if not computing:
            return  # n-gram lookup proposes on the loop, in _draft: no budgets to weigh here (a heap walk a step)
        budgets = self._draft_budgets(waiting)
        asking = [
            (g, (d, min(g.max_tokens - g.produced, self.context - g.fed, budgets[g.slot] + 1) - 1))
            for g, d in computing
            if budgets.get(g.slot, 0)
        ]
        if not asking:
            return
        # One thread for all of them: a draft model proposes for every lane in shared steps (one a draft token).
        begun = self._clock()
        drafted = await asyncio.to_thread(proposals, [lane for _, lane in asking])
        self.metrics.speculative_draft_seconds.inc(self._clock() - begun)
        for (g, _), proposal in zip(asking, drafted, strict=True):
            g.proposed = proposal

    def _draft_budgets(self, stepping: list[Generation]) -> dict[int, int]:
        """How many tokens each decoding generation with a drafter may draft in a step of `stepping`
        (strata.gateway.draft_lengths): none where drafting would not pay. A proposal still to be made by a drafter
        that computes costs its tokens and its start (spread over the steps the request may still take), against a
        one-position step of the pipeline; until a step has landed to measure that by, such a lane does not draft. A
        proposal already made costs nothing more."""
        s = self.speculation
        decoding = [g for g in stepping if g.fed >= len(g.prompt)]
        if s is None or not decoding:
            return {}
        rates: dict[int, float] = {}
        making: dict[int, float] = {}
        starting: dict[int, float] = {}
        unpriced: list[int] = []
        for g in decoding:
            d = g.drafter
            if d is None:
                continue
            if d.computes and g.proposed is None:
                if not self._position_seconds:
                    unpriced.append(g.slot)
                    continue
                making[g.slot] = d.token_seconds / self._position_seconds
                steps_left = max(1, min(g.max_tokens - g.produced, START_HORIZON))
                starting[g.slot] = d.start_seconds / self._position_seconds / steps_left
            rates[g.slot] = g.acceptance.rate
        lengths = draft_lengths(
            decoding=len(decoding),
            acceptance=rates,
            max_draft=s.max_draft,
            min_draft=s.min_draft,
            cost=s.step_cost,
            draft_cost=making,
            start_cost=starting,
        )
        return lengths | dict.fromkeys(unpriced, 0)

    def _time_step(self, step: Step) -> None:
        """Fold the landed step's round trip into the seconds of a one-position step. Steps that prefill are left out:
        a prompt's positions cost a step otherwise than the linear cost of decode positions says."""
        if self.speculation is None or not step.written_at or any(c.length > 1 + c.drafted for c in step.chunks):
            return
        positions = sum(c.length for c in step.chunks)
        seconds = (self._clock() - step.written_at) / self.speculation.step_cost.ratio(max(positions, 1))
        self._position_seconds = smoothed(self._position_seconds, seconds)

    def _draft(self, g: Generation, *, used: int, budget: int) -> tuple[int, ...]:
        """The tokens g's drafter proposes after its last one, at most `budget` (none while the step does not draft):
        no more than g may still produce after the one this step picks anyway, nor than the pool and the context have
        room for. A proposal made off the loop serves this step only: the step changes the tokens it followed."""
        proposed, g.proposed = g.proposed or (), None
        if g.drafter is None or self.speculation is None:
            return ()
        if not budget:
            if not g.drafter.computes:  # a guess costs a few lookups: check it against the step's own pick
                guess = g.drafter.propose(self.speculation.min_draft)
                g.shadow = guess[0] if guess else None
            return ()
        room = min(g.max_tokens - g.produced, self.context - used, self.context - g.fed, budget + 1) - 1
        if g.drafter.computes:
            proposed = proposed[: max(room, 0)]
            draft = proposed if len(proposed) >= self.speculation.min_draft else ()
        else:
            draft = g.drafter.propose(room)
        if draft and g.constraint is not None:  # a token the grammar refuses is never picked: the draft ends before it
            draft = draft[: g.constraint.allows(draft)]
            if len(draft) < self.speculation.min_draft:
                draft = ()
        if draft:
            self.metrics.speculative_drafted.inc(len(draft))
        return draft

    def _with_masks(self, chunks: list[stage_pb2.SlotChunk]) -> list[stage_pb2.SlotChunk]:
        """Each sampling chunk of a constrained generation gets its mask, all of the step's computed together, and a
        drafted one the mask of each drafted position's pick; a generation whose grammar failed ends with an error and
        leaves the step."""
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
                continue
            chunk.allowed_tokens = mask
            if chunk.drafted and g.constraint is not None:  # each drafted position's pick: the mask its draft leads to
                try:
                    chunk.draft_allowed_tokens.extend(g.constraint.draft_masks(chunk.token_ids[-chunk.drafted :]))
                except ConstraintViolationError as exc:
                    self._finish(g, PipelineError(f"the output constraint failed: {exc}"))
                    failed.add(chunk.slot)
        return [c for c in chunks if c.slot not in failed]

    def _dispatch(self, step: Step, reply: stage_pb2.ForwardReply) -> None:
        self._time_step(step)
        self.metrics.steps.inc()
        self.metrics.step_positions.inc(sum(c.length for c in step.chunks))
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
            if g.shadow is not None and not chunk.drafted:
                g.acceptance.observe(drafted=1, accepted=int(run[0].token_id == g.shadow))
            g.shadow = None
            if chunk.drafted:
                g.acceptance.observe(drafted=chunk.drafted, accepted=len(run) - 1)
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

    def _finish(self, g: Generation, event: Finished | GatewayError) -> None:
        if not g.finished and not g.cancelled:
            g.events.put_nowait(event)
        g.finished = True
        g.cancelled = True  # its slot is reset before the next step
