"""What a request is to the coordinator's driver (strata.gateway.pipeline): its sampling parameters, the
generation on its slot, and the events the driver hands it (a token, then how it finished, or the error that
ended it). The serving layer reads these without touching the driver."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass, field

from strata.gateway.draft_lengths import Acceptance
from strata.gateway.errors import GatewayError
from strata.gateway.grammar import Constraint
from strata.gateway.speculation import Drafter
from strata.rpc.v1 import stage_pb2


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
    cache_salt: str = ""  # its prompt shares cached prefixes only with prompts of the same salt
    events: asyncio.Queue[Token | Finished | GatewayError] = field(default_factory=asyncio.Queue)
    fed: int = 0
    cached: int = 0  # prompt tokens restored from a prefix snapshot instead of prefilled
    shares: bytes | None = None  # the snapshot it restored: its first `cached` positions are that snapshot's blocks
    keeps: bytes | None = None  # the snapshot of its own prompt the stages keep: its blocks are that snapshot's
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
    acceptance: Acceptance = field(default_factory=Acceptance)  # how its recent drafts fared: how long the next may be
    # A free drafter's guess at the token of a step that sent no draft, checked against the token when it lands: a
    # lane that stopped drafting keeps learning whether drafting would pay again.
    shadow: int | None = None

    def __post_init__(self) -> None:
        if self.sampling.repetition_penalty != 1.0:
            self.prompt_tokens = frozenset(self.prompt)

    def cells(self) -> int:
        """Positions the stages hold for it, counting those it shares with a snapshot (`cached`) as its own."""
        return max(self.fed + self.in_flight, self.held_cells)

    async def stream(self) -> AsyncIterator[Token | Finished]:
        """Tokens until a Finished; raises the GatewayError that ended the generation, if one did."""
        async for together in self.in_runs():
            for event in together:
                yield event

    async def in_runs(self) -> AsyncIterator[list[Token | Finished]]:
        """The events as they land, each time all that are queued: a step that verified drafts hands over a run of
        tokens at once, and a reader that takes them together writes to its client once, not once a token. The last
        list ends with a Finished; the GatewayError that ended the generation is raised after the tokens before it."""
        while True:
            events: list[Token | Finished] = []
            error: GatewayError | None = None
            event = await self.events.get()
            while True:
                if isinstance(event, GatewayError):
                    error = event
                    break
                events.append(event)
                if isinstance(event, Finished) or self.events.empty():
                    break
                event = self.events.get_nowait()
            if events:
                yield events
            if error is not None:
                raise error
            if events and isinstance(events[-1], Finished):
                return


def cells_in_use(generations: Iterable[Generation], *, block: int) -> int:
    """Cells the stages' pools hold for these generations, counting shared blocks once: the choices of `n > 1` (and
    any prompts restored from one snapshot) map the same blocks of the prompt. A sharer holds its own blocks from
    the block its restored prefix ends in (it copies that one before its first write); the shared whole blocks
    count with the generation that computed them while it runs, else once for all that share them."""
    generations = list(generations)
    producers = {g.keeps for g in generations if g.keeps is not None}
    used = 0
    shared: dict[bytes, int] = {}
    for g in generations:
        if g.shares is None:
            used += g.cells()
            continue
        whole = g.cached // block * block
        used += g.cells() - whole
        if g.shares not in producers:
            shared[g.shares] = max(shared.get(g.shares, 0), whole)
    return used + sum(shared.values())
