"""Every serving pipeline of a deployment behind one gateway: one driver each, and the router that picks one.

Each pipeline (its own set of stages, its own first stage, lanes, KV pool and prefix cache) gets its own driver
(strata.gateway.pipeline.Pipeline), unchanged. This object is what the serving layer and the election see instead of
one driver:

- requests: `submit` routes a prompt to a pipeline (strata.gateway.routing: the one that holds its prefix, else its
  place on the hash ring, within a bound on load) and a free slot there; `cancel` reaches the driver that runs it;
- admission: the serving pipelines' slots add up to the capacity Admission hands out (`on_capacity`), so a request is
  admitted only while some serving pipeline has a free slot, and a pipeline that stops serving takes its lanes away
  at once;
- fencing: one coordinator term for all of them. `promote`, `extend` and `step_down` reach every driver, so a stale
  coordinator stops driving every pipeline on its own clock, as it did one; a refusal from any pipeline's stages
  (`deposed`) makes the coordinator let go of the Lease, since a newer term exists;
- the list: `update` follows the pipelines that serve (strata.gateway.pipeline_list reads it). A new one gets a
  driver, which claims its stages with the current term; one that leaves the list takes no new requests and is given
  `DRAIN_S` to finish what it runs, then fails the rest with the retryable 503 and is closed (the operator keeps its
  stages past that: strata.draining). A driver that fails
  (its stages unreachable, a step refused) fails its own requests with that 503 and stops counting until it is
  ready again; the others carry on.

Ready while at least one pipeline serves.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from strata.draining import DRAIN_S
from strata.gateway.errors import NotReadyError
from strata.gateway.generation import Generation, Sampling
from strata.gateway.grammar import Constraint
from strata.gateway.metrics import GatewayMetrics, PipelineCollector, PipelineFigures
from strata.gateway.pipeline import Pipeline
from strata.gateway.routing import Candidate, Policy, affinity_key, round_robin, route
from strata.lease import FencingToken

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0  # tokens per second are counted over this window
DEFAULT_BLOCK = 256  # tokens of a prompt's head that key its place on the ring when there is no prefix cache


@dataclass(frozen=True, kw_only=True)
class PipelineEntry:
    """One serving pipeline: where its first stage listens and what its plan gives it."""

    index: int
    generation: int
    first_stage: str
    parallel: int
    context: int


# Builds the driver of one pipeline; the callback reports its readiness.
DriverFactory = Callable[[PipelineEntry, FencingToken | None, Callable[[bool], None]], Pipeline]


@dataclass(eq=False)
class _Member:
    entry: PipelineEntry
    driver: Pipeline
    free: deque[int]
    running: set[Generation] = field(default_factory=set)
    finished_tokens: int = 0  # tokens of generations that have ended
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens so far), for the rate
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing runs on it

    def tokens(self) -> int:
        return self.finished_tokens + sum(g.produced for g in self.running)


class Pipelines:
    def __init__(
        self,
        *,
        make_driver: DriverFactory,
        metrics: GatewayMetrics,
        fence: FencingToken | None,
        prefix_chunk: int = 0,
        policy: Policy = Policy.PREFIX,
        on_capacity: Callable[[int], None] = lambda _lanes: None,
        drain_s: float = DRAIN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`fence`: the token of a gateway that is the only coordinator (never lapses), or None under an election
        (standby until `promote`)."""
        self._make_driver = make_driver
        self.metrics = metrics
        self.policy = policy
        self.block = prefix_chunk or DEFAULT_BLOCK
        self.on_capacity = on_capacity
        self.drain_s = drain_s
        self._clock = clock
        self._fence = fence
        self._valid_until = math.inf
        self._static = fence is not None
        self._members: dict[int, _Member] = {}
        self._owner: dict[Generation, _Member] = {}
        self._draining: set[asyncio.Task[None]] = set()
        self._retiring: set[_Member] = set()  # left the list, finishing what they run under the current term
        self._turn = 0
        self._started = False
        self._capacity = -1
        self._serving = asyncio.Event()  # set while some pipeline serves: what a held request waits on
        metrics.registry.register(PipelineCollector(self.figures))

    # Lifecycle and the list.

    async def start(self, entries: Sequence[PipelineEntry] = ()) -> None:
        self._started = True
        await self.update(entries)
        self._refresh()

    async def close(self) -> None:
        for task in list(self._draining):
            task.cancel()
        await asyncio.gather(*self._draining, return_exceptions=True)
        members, self._members = list(self._members.values()), {}
        for member in members:
            member.driver.step_down("the gateway is shutting down")
            await member.driver.close()

    async def update(self, entries: Sequence[PipelineEntry]) -> None:
        """Drive exactly `entries`: a pipeline whose entry changed (a new generation, another first stage) is
        retired and driven anew."""
        wanted = {e.index: e for e in entries}
        for index, member in list(self._members.items()):
            if wanted.get(index) != member.entry:
                del self._members[index]
                self._retiring.add(member)
                task = asyncio.create_task(self._retire(member), name=f"retire-pipeline-{index}")
                self._draining.add(task)
                task.add_done_callback(self._draining.discard)
        for index, entry in sorted(wanted.items()):
            if index not in self._members:
                await self._add(entry)
        self._refresh()

    async def _add(self, entry: PipelineEntry) -> None:
        member: _Member | None = None

        def ready_changed(_ready: bool) -> None:
            if member is not None and self._members.get(entry.index) is member:
                self._refresh()

        driver = self._make_driver(entry, self._fence if self._static else None, ready_changed)
        member = _Member(entry=entry, driver=driver, free=deque(range(entry.parallel)))
        member.idle.set()
        self._members[entry.index] = member
        await driver.start()
        if not self._static and self._fence is not None and self._clock() < self._valid_until:
            driver.promote(self._fence, valid_until=self._valid_until)
        log.info("driving pipeline %d (generation %d) at %s", entry.index, entry.generation, entry.first_stage)

    async def _retire(self, member: _Member) -> None:
        """Let what runs on a pipeline that left the list finish, for at most drain_s, then fail the rest."""
        entry = member.entry
        log.info("pipeline %d (generation %d) no longer serves: draining it", entry.index, entry.generation)
        try:
            await asyncio.wait_for(member.idle.wait(), timeout=self.drain_s)
        except TimeoutError:
            log.warning("pipeline %d did not finish within %g s: failing what it runs", entry.index, self.drain_s)
        finally:
            self._retiring.discard(member)
            member.driver.step_down(f"pipeline {entry.index} (generation {entry.generation}) no longer serves")
            await member.driver.close()

    # Readiness and capacity.

    @property
    def ready(self) -> bool:
        return any(m.driver.ready for m in self._members.values())

    @property
    def not_ready_reason(self) -> str:
        if not self._members:
            return "no pipeline serves yet"
        return "; ".join(f"pipeline {i}: {m.driver.not_ready_reason}" for i, m in sorted(self._members.items()))

    @property
    def lanes(self) -> int:
        """Lanes of every pipeline driven, serving or not: the most that could run at once."""
        return sum(m.entry.parallel for m in self._members.values())

    @property
    def capacity(self) -> int:
        """Lanes of the pipelines that serve now."""
        return sum(m.entry.parallel for m in self._members.values() if m.driver.ready)

    @property
    def drivers(self) -> dict[int, Pipeline]:
        return {index: m.driver for index, m in self._members.items()}

    def _refresh(self) -> None:
        self.metrics.ready.set(1 if self.ready else 0)
        capacity = self.capacity
        if self._started and capacity != self._capacity:
            self._capacity = capacity
            self.on_capacity(capacity)
        # After on_capacity: a held request that wakes finds the lanes already in admission.
        if self.ready:
            self._serving.set()
        else:
            self._serving.clear()

    async def wait_ready(self, within_s: float) -> bool:
        """Wait up to `within_s` seconds for some pipeline to serve; whether one does."""
        try:
            await asyncio.wait_for(self._serving.wait(), timeout=within_s)
        except TimeoutError:
            return False
        return True

    @property
    def coordinating(self) -> bool:
        """This gateway may drive pipelines now: the only coordinator, or the holder of an unexpired term."""
        return self._static or (self._fence is not None and self._clock() < self._valid_until)

    # Fencing: one term for every pipeline.

    @property
    def fence(self) -> FencingToken | None:
        return self._fence

    @property
    def deposed(self) -> bool:
        """A stage of some pipeline refused the current term: another coordinator holds a newer one."""
        return any(m.driver.deposed and m.driver.fence == self._fence for m in self._members.values())

    def promote(self, fence: FencingToken, *, valid_until: float = math.inf) -> None:
        self._fence, self._valid_until = fence, valid_until
        for member in self._members.values():
            member.driver.promote(fence, valid_until=valid_until)
        for member in self._retiring:  # what they ran cannot go on under another term, and they serve no more
            member.driver.step_down(f"the coordinator moved to term {fence.term}")

    def extend(self, *, valid_until: float) -> None:
        self._valid_until = valid_until
        for member in [*self._members.values(), *self._retiring]:
            member.driver.extend(valid_until=valid_until)

    def step_down(self, reason: str) -> None:
        self._valid_until = -math.inf
        for member in [*self._members.values(), *self._retiring]:
            member.driver.step_down(reason)

    # Requests.

    def submit(
        self,
        *,
        prompt: tuple[int, ...],
        max_tokens: int,
        sampling: Sampling,
        stop_ids: frozenset[int],
        on_freed: Callable[[], None],
        constraint: Constraint | None = None,
        cache_salt: str = "",
    ) -> Generation:
        """Start `prompt` on the pipeline routing picks, on a free slot there; NotReadyError when none has one."""
        member = self._choose(prompt, salt=cache_salt)
        if member is None:
            raise NotReadyError(f"no serving pipeline has a free lane ({self.not_ready_reason})", retry_after_s=1)
        slot = member.free.popleft()
        started: list[Generation] = []

        def freed() -> None:
            member.free.append(slot)
            for g in started:
                self._owner.pop(g, None)
                member.running.discard(g)
                member.finished_tokens += g.produced
            if not member.running:
                member.idle.set()
            on_freed()

        try:
            generation = member.driver.submit(
                slot=slot,
                prompt=prompt,
                max_tokens=max_tokens,
                sampling=sampling,
                stop_ids=stop_ids,
                on_freed=freed,
                constraint=constraint,
                cache_salt=cache_salt,
            )
        except BaseException:
            member.free.appendleft(slot)
            raise
        started.append(generation)
        member.running.add(generation)
        member.idle.clear()
        self._owner[generation] = member
        return generation

    def cancel(self, generation: Generation) -> None:
        member = self._owner.get(generation)
        if member is not None:
            member.driver.cancel(generation)

    def pipeline_of(self, generation: Generation) -> int | None:
        """The index of the pipeline that runs `generation`, None once it has ended."""
        member = self._owner.get(generation)
        return None if member is None else member.entry.index

    def _choose(self, prompt: tuple[int, ...], *, salt: str) -> _Member | None:
        serving = [m for m in self._members.values() if m.driver.ready and len(prompt) < m.entry.context]
        candidates = [
            Candidate(
                index=m.entry.index,
                lanes=m.entry.parallel,
                busy=m.entry.parallel - len(m.free),
                cached=m.driver.prefixes.covered(prompt, salt=salt) if m.driver.prefixes is not None else 0,
            )
            for m in serving
        ]
        if self.policy is Policy.ROUND_ROBIN:
            chosen = round_robin(self._turn, candidates)
            self._turn += 1
        else:
            chosen = route(affinity_key(prompt, block=self.block), candidates)
        return None if chosen is None else self._members[chosen]

    # Figures.

    def figures(self) -> list[PipelineFigures]:
        now = self._clock()
        figures = []
        for index, m in sorted(self._members.items()):
            tokens = m.tokens()
            m.samples.append((now, tokens))
            while len(m.samples) > 1 and now - m.samples[0][0] > RATE_WINDOW_S:
                m.samples.popleft()
            since, before = m.samples[0]
            figures.append(
                PipelineFigures(
                    index=index,
                    ready=m.driver.ready,
                    lanes=m.entry.parallel,
                    busy=m.entry.parallel - len(m.free),
                    kv_cells=sum(g.fed + g.in_flight for g in m.running),
                    tokens=tokens,
                    tokens_per_second=(tokens - before) / (now - since) if now > since else 0.0,
                )
            )
        return figures
