"""Speculative decoding's coordinator side: n-gram prompt lookup proposes the next tokens, the stages verify them.

A decode step costs about the same for one position as for a few (it reads every weight once either way), and over
S stages it pays S hops besides. So when the text can be guessed, the driver sends a slot's last token followed by
up to `max_draft` guessed ones as one chunk; every stage computes them together, the last stage keeps its own
picks up to the first that differs from the guess (strata.stage_worker.engine.accept), and one step yields between
one and max_draft + 1 tokens. The tokens are exactly those that decoding one position at a time would have picked,
so speculation changes speed, never text (up to the rounding of a different batch shape, as any batching does);
a sampled pick is the same seeded draw as without speculation, and a draft counts only where the draw is the draft.

Drafters sit behind one small interface (`Drafter`): this module's n-gram lookup, and a draft model sharing the
target's vocabulary (strata.gateway.draft_model). The n-gram guess is prompt lookup (as llama.cpp's lookup decoding
and vLLM's n-gram proposer do): find the last place where
the generation's latest n tokens occurred before, for n from `ngram_max` down to `ngram_min`, and propose what
followed them there. Agents and editors repeat their context (code being edited, tool results quoted back,
structured output), which is where it pays; on text that does not repeat it proposes nothing and costs nothing.

What it applies to: requests without penalties, whose picks depend only on their own position's logits, seed and
mask. Under a grammar, a draft ends before the first token the grammar refuses, and each drafted position's pick
samples inside the mask its draft leads to, so the text is the one decoding a position a step gives. Requests with
penalties decode one position a step beside them. How long each
lane's draft may be in a step, or whether the step drafts at all, strata.gateway.draft_lengths decides from the lanes'
recent acceptance and what a position costs: with a full batch a step is no longer bound by reading the weights, and
drafts that would cost what they save are not asked for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from strata.draft_memory import DRAFT_CACHE_TYPE
from strata.gateway.draft_lengths import DEFAULT_MARGINAL, StepCost
from strata.gguf.model import CacheType


@dataclass(frozen=True, kw_only=True)
class Speculation:
    max_draft: int = 4  # tokens proposed after a slot's last one, at most
    min_draft: int = 1  # a shorter proposal is not sent: one position a step, as without speculation
    ngram_max: int = 4  # longest suffix of the generation looked up
    ngram_min: int = 1  # shortest
    # What one more position adds to a step's time, in one-position steps (strata.gateway.draft_lengths.StepCost).
    position_cost: float = DEFAULT_MARGINAL
    # The prompt's last tokens that lookup indexes (the output is indexed whole): the index costs a few dictionary
    # entries a token and is built in the gateway's event loop when a request starts, so a 128K-token prompt is not
    # indexed whole.
    lookback: int = 8192
    # A draft model stops proposing at its first pick whose probability is under this (llama.cpp's --draft-p-min).
    # 0.3: such a pick is more likely wrong than right even for a draft that agrees with its target wherever it is
    # sure, and every draft token after a wrong one is computed for nothing, by the draft and by every stage. It is
    # lower than llama.cpp's 0.75 because a stage verifies a few more positions for about the price of one, so a
    # longer, riskier run costs the target little; a measurement on the target GPUs should set it.
    p_min: float = 0.3

    def __post_init__(self) -> None:
        if not 1 <= self.min_draft <= self.max_draft:
            raise ValueError(f"speculation needs 1 <= min draft ({self.min_draft}) <= max draft ({self.max_draft})")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"speculation needs 1 <= n-gram min ({self.ngram_min}) <= max ({self.ngram_max})")
        if self.lookback < 1:
            raise ValueError(f"speculation needs a lookback ({self.lookback}) of at least 1")
        if not 0.0 <= self.position_cost <= 1.0:
            raise ValueError(f"speculation needs a position cost within [0, 1], not {self.position_cost}")
        if not 0.0 <= self.p_min <= 1.0:
            raise ValueError(f"speculation needs a draft probability floor (p min) within [0, 1], not {self.p_min}")

    @property
    def step_cost(self) -> StepCost:
        return StepCost(marginal=self.position_cost)


DEFAULTS = Speculation()  # what the gateway's options start from


class DraftModelError(ValueError):
    """A draft model that cannot draft for the target (another vocabulary, a file that fails): names both files."""


@dataclass(frozen=True, kw_only=True)
class DraftSource:
    """Where the draft model of method "draft" comes from and where it runs (strata.gateway.draft_model)."""

    url: str  # a path, file://, http(s):// or hf:// URL, as the model's own source
    token: str | None = field(default=None, repr=False)  # bearer token for https:// and hf:// sources
    device: str = "cpu"  # torch device the draft computes on
    cache_type: CacheType = DRAFT_CACHE_TYPE  # the draft's KV (strata.draft_memory sizes it so)


class SharedProposer(Protocol):
    """What computes the proposals of several requests' drafters together (a draft model: one step a draft token for
    all of them, where one a request would take as many)."""

    def propose(self, lanes: Sequence[tuple[Drafter, int]]) -> list[tuple[int, ...]]:
        """Each lane's proposal under its limit, as its drafter's `propose` would give it."""
        ...


class Drafter(Protocol):
    """What the driver asks of a request's drafter (strata.gateway.pipeline): each token the request produced, in
    order; a proposal before each decode step; and close once the request ends (finished, cancelled, abandoned).
    `computes`: its proposals run a model, so the driver asks for them in a worker thread, never on its loop;
    `shared`: what proposes for it together with other requests' drafters (None: it proposes alone)."""

    computes: bool

    @property
    def shared(self) -> SharedProposer | None: ...

    @property
    def token_seconds(self) -> float:
        """What one draft token costs it to make, lately (0 for a drafter that does not compute)."""
        ...

    @property
    def start_seconds(self) -> float:
        """What its next proposal costs before the first draft token, beyond a token's cost: feeding a model what
        it lacks of the request, the prompt at the first proposal (0 for a drafter that does not compute)."""
        ...

    def extend(self, tokens: Iterable[int]) -> None: ...

    def propose(self, limit: int) -> tuple[int, ...]: ...

    def close(self) -> None: ...


class NgramDrafter:
    """The tokens of one generation so far (prompt, then output), indexed so that a proposal costs a few dictionary
    lookups however long the context: for each n-gram size, where the token after its latest earlier occurrence is."""

    computes = False  # a few dictionary lookups: on the driver's loop
    token_seconds = start_seconds = 0.0
    shared = None

    def __init__(self, prompt: Sequence[int], *, speculation: Speculation) -> None:
        self.speculation = speculation
        self.tokens: list[int] = []  # the prompt's last `lookback` tokens, then the output
        # (n-gram) -> index of the token that followed its latest occurrence whose follower is known. The current
        # suffix's own occurrence has no follower yet, so a lookup of the suffix finds the one before it.
        self._follower: dict[tuple[int, ...], int] = {}
        self.extend(prompt[-speculation.lookback :])

    def extend(self, tokens: Iterable[int]) -> None:
        s = self.speculation
        for token in tokens:
            end = len(self.tokens)  # the new token's index: it follows the n-grams ending just before it
            for n in range(s.ngram_min, min(s.ngram_max, end) + 1):
                self._follower[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def propose(self, limit: int) -> tuple[int, ...]:
        """`limit` tokens (at most max draft) that followed the longest suffix seen before; () when none was, or
        when limit is under the minimum draft. Where what followed runs into the end of the context, the text is
        repeating itself with the period from there to the end, and the proposal goes on repeating it."""
        s = self.speculation
        limit = min(limit, s.max_draft)
        if limit < s.min_draft:
            return ()
        for n in range(min(s.ngram_max, len(self.tokens)), s.ngram_min - 1, -1):
            start = self._follower.get(tuple(self.tokens[-n:]))
            if start is not None:
                period = len(self.tokens) - start
                return tuple(self.tokens[start + i % period] for i in range(limit))
        return ()

    def close(self) -> None:
        """Nothing to give back: the index is this object's own."""


def proposals(lanes: Sequence[tuple[Drafter, int]]) -> list[tuple[int, ...]]:
    """Each lane's proposal under its limit: the lanes of one shared proposer together, the others one by one."""
    out: list[tuple[int, ...]] = [()] * len(lanes)
    together: dict[int, tuple[SharedProposer, list[int]]] = {}
    for index, (drafter, limit) in enumerate(lanes):
        shared = drafter.shared
        if shared is None:
            out[index] = drafter.propose(limit)
        else:
            together.setdefault(id(shared), (shared, []))[1].append(index)
    for shared, indices in together.values():
        for index, proposal in zip(indices, shared.propose([lanes[i] for i in indices]), strict=True):
            out[index] = proposal
    return out


def drafts_for(*, penalised: bool) -> bool:
    """Whether a request's tokens may be verified from drafts: its pick at a position depends on nothing but that
    position's logits, seed and mask (no penalty counting earlier picks). A grammar's mask follows the tokens before
    it, so the driver gives each drafted position the mask that its draft leads to (strata.gateway.stepping)."""
    return not penalised
