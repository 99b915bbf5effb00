"""How many tokens each lane may draft in a step, or none: the decision that keeps speculation from costing speed.

A step's time grows with the positions it carries. With one slot decoding, a step of k + 1 positions reads each weight
once, as a step of one does, so drafts are nearly free; with 16 slots each drafting k, the step carries 16(k + 1)
positions and may be bound by computing them rather than by reading the weights, so a draft that is likely rejected
costs more than it saves. The decision weighs both, per lane, from numbers the driver has:

- the step's cost: `StepCost.ratio(positions)`, the time of a step carrying that many positions over a one-position
  step's. The model is linear, 1 + marginal * (positions - 1): a (k+1)-position step costs 1 + marginal·k one-position
  steps. The default marginal (DEFAULT_MARGINAL) is a documented guess; a deployment sets its own (the speculation's
  position cost, `--position-cost`) from a bench run on its GPUs (bench/speculative.py reports it).
- each lane's acceptance rate: the chance that its next draft token is accepted, given the one before it was
  (`Acceptance`, from the lane's recent verified runs). A draft of k then yields 1 + a + a² + … + a^k tokens on average.

A draft model also costs its own steps, one per draft token, which the step's drafting lanes share: the driver
measures what a draft token costs a lane (a draft step's time over the lanes it carried) against a one-position step
of the pipeline, and the decision adds it to the price of that lane's drafts. A lane whose draft slot lacks much of
its request (its first draft feeds the whole prompt) pays that feed too, when its draft starts: the driver waits for
it before it writes the step. The feed serves the drafts of the rest of the request, so the driver spreads it over the
steps the request may still take, at most START_HORIZON of them (a request may end long before its max_tokens).

The decision maximises the step's expected tokens per unit of cost: starting from no drafts (one position a lane, what
plain decoding yields), it repeatedly makes the move with the most expected tokens per unit of cost added — starting a
lane's draft at `min_draft` tokens (a shorter draft is never sent), or lengthening a started one by a token, up to
`max_draft` — and stops at the first move that would not raise tokens per cost. Every move it makes raises the
estimate, so with the model right a step never yields less per unit of time than plain decoding; as the batch fills,
the tokens a step already yields grow and so does the bar a draft token must pass, so drafts shorten and then stop.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass

# A (k+1)-position step costs 1 + 0.1·k one-position steps unless a deployment sets its own. Conservative for a GPU
# decoding a small batch (the weights are read once for up to tens of positions) and far too kind to a CPU (which
# computes each position, a marginal near 1): a measured cost corrects both.
DEFAULT_MARGINAL = 0.1
# A lane with no verified drafts yet is taken to accept half its draft tokens: enough for one slot to draft (a step of
# one more position is nearly free), not enough for a full batch to.
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0  # the prior counts as this many draft tokens
START_HORIZON = 32  # steps a draft's start (its feed of the prompt) is spread over, at most
TIMING_WEIGHT = 0.2  # of the newest step, in a running figure of seconds a step (a lane's draft, the pipeline's)
DECAY = 0.7  # each verified run's counts weigh this much less at the next one: the estimate follows the text


def smoothed(lately: float, seconds: float) -> float:
    """A measured time folded into its running figure by TIMING_WEIGHT (the first measure, while there is none)."""
    return seconds if not lately else lately + TIMING_WEIGHT * (seconds - lately)


@dataclass(frozen=True, kw_only=True)
class StepCost:
    marginal: float = DEFAULT_MARGINAL  # added cost of one more position, in one-position steps

    def __post_init__(self) -> None:
        if not 0.0 <= self.marginal <= 1.0:
            raise ValueError(f"a step's marginal position cost must be within [0, 1], not {self.marginal}")

    def ratio(self, positions: int) -> float:
        return 1.0 + self.marginal * (positions - 1)


@dataclass(kw_only=True)
class Acceptance:
    """One lane's recent acceptance: decayed counts of accepted draft tokens and of draft tokens tried (those up to
    and including the first rejected one: the rest were never compared). The prior decays with them, so a lane whose
    drafts keep failing falls as low as its evidence says (with a fixed prior the rate would stay above
    prior / (evidence's most weight + prior's), which can still pay for one slot)."""

    accepted: float = 0.0
    tried: float = 0.0
    prior: float = PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * self.prior) / (self.tried + self.prior)

    def observe(self, *, drafted: int, accepted: int) -> None:
        rejected = 1 if accepted < drafted else 0
        self.accepted = self.accepted * DECAY + accepted
        self.tried = self.tried * DECAY + accepted + rejected
        self.prior *= DECAY


def draft_lengths(
    *,
    decoding: int,
    acceptance: Mapping[int, float],
    max_draft: int,
    min_draft: int,
    cost: StepCost,
    draft_cost: Mapping[int, float] | None = None,
    start_cost: Mapping[int, float] | None = None,
) -> dict[int, int]:
    """Each drafting lane's draft length for a step (0: none) by the rule above. `decoding`: the slots that decode in
    the step, drafting or not (each yields one token for one position); `acceptance`: slot -> rate for those that may
    draft; `draft_cost`: slot -> what each of its draft tokens costs to make, in one-position steps (a draft model
    computes one step per token for the lanes drafting together; n-gram lookup costs nothing and is left out);
    `start_cost`: slot -> what starting its draft costs once, in one-position steps (a draft model's feed of what
    its slot lacks)."""
    making, starting = draft_cost or {}, start_cost or {}
    if not 1 <= min_draft <= max_draft:
        raise ValueError(f"draft lengths need 1 <= min draft ({min_draft}) <= max draft ({max_draft})")
    if decoding < len(acceptance):
        raise ValueError(f"{len(acceptance)} drafting lanes cannot be more than the {decoding} decoding slots")
    lengths = dict.fromkeys(acceptance, 0)
    order = {slot: index for index, slot in enumerate(acceptance)}  # ties go to the lane named first

    def move(slot: int) -> tuple[float, int, int, float, int, float]:
        """The lane's next move, as a heap entry: (-tokens per cost, its order, slot, tokens, positions, what making
        its drafts adds)."""
        rate, k = acceptance[slot], lengths[slot]
        added = min_draft if k == 0 else 1
        gain = sum(rate**j for j in range(k + 1, k + added + 1))
        made = making.get(slot, 0.0) * added + (starting.get(slot, 0.0) if k == 0 else 0.0)
        price = cost.marginal * added + made
        return (-(gain / price) if price else -math.inf), order[slot], slot, gain, added, made

    # No lane's next move depends on another's draft, so the best move is the best of each lane's next one: a heap of
    # those finds it in log(lanes), where a scan of every lane per move took milliseconds a step for a full batch.
    moves = [move(slot) for slot in acceptance]
    heapq.heapify(moves)
    tokens, positions, making_cost = float(decoding), decoding, 0.0
    while moves:
        _, _, slot, gain, added, adds = heapq.heappop(moves)
        now = cost.ratio(positions) + making_cost
        made = making_cost + adds
        if (tokens + gain) / (cost.ratio(positions + added) + made) <= tokens / now:
            return lengths
        lengths[slot] += added
        tokens += gain
        positions += added
        making_cost = made
        if lengths[slot] < max_draft:
            heapq.heappush(moves, move(slot))
    return lengths
