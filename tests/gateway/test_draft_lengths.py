"""The draft length decision (strata.gateway.draft_lengths): drafts lengthen where they are likely accepted and the
step has room for positions, shorten as the batch fills, stop below the minimum draft, and vanish where they would
not pay; never a decision whose expected tokens per unit of cost fall below plain decoding's."""

from __future__ import annotations

import random

import pytest
from strata.gateway.draft_lengths import PRIOR_ACCEPTANCE, Acceptance, StepCost, draft_lengths

GPU_LIKE = StepCost(marginal=0.1)  # the default
FREE = StepCost(marginal=0.0)  # a step of any width costs one position's
CPU_LIKE = StepCost(marginal=1.0)  # every position costs a one-position step


def lanes(count: int, rate: float) -> dict[int, float]:
    return dict.fromkeys(range(count), rate)


CASES = {  # decoding slots, acceptance by lane, max draft, min draft, cost: draft lengths
    "one slot whose drafts are likely accepted drafts the most it may": (1, {0: 0.8}, 4, 1, GPU_LIKE, {0: 4}),
    "one slot whose drafts are rarely accepted drafts nothing": (1, {0: 0.05}, 4, 1, GPU_LIKE, {0: 0}),
    "sixteen slots at the prior draft nothing: speculation is off for the step": (
        16, lanes(16, PRIOR_ACCEPTANCE), 4, 1, GPU_LIKE, dict.fromkeys(range(16), 0)
    ),
    "sixteen slots accepting nine in ten draft shorter than one slot would": (
        16, lanes(16, 0.9), 4, 1, GPU_LIKE, dict.fromkeys(range(16), 2)
    ),
    "sixteen slots that nearly always accept still draft the most": (
        16, lanes(16, 0.95), 4, 1, GPU_LIKE, dict.fromkeys(range(16), 4)
    ),
    "slots that cannot draft raise the bar for the one that can": (8, {0: 0.7}, 4, 1, GPU_LIKE, {0: 2}),
    "the same lane alone drafts longer": (1, {0: 0.7}, 4, 1, GPU_LIKE, {0: 4}),
    "a lane that rarely accepts leaves the positions to one that does": (
        4, {0: 0.9, 1: 0.3}, 4, 1, GPU_LIKE, {0: 4, 1: 0}
    ),
    "a one-token draft that pays is not sent under a minimum of three": (1, {0: 0.12}, 4, 3, GPU_LIKE, {0: 0}),
    "the same lane sends its one token with a minimum of one": (1, {0: 0.12}, 4, 1, GPU_LIKE, {0: 1}),
    "the maximum draft caps a lane that would draft on": (1, {0: 0.99}, 16, 1, GPU_LIKE, {0: 16}),
    "free positions: every lane drafts the most": (4, lanes(2, 0.3), 4, 1, FREE, {0: 4, 1: 4}),
    "a position as dear as a step: no draft ever pays": (2, lanes(2, 0.99), 4, 1, CPU_LIKE, {0: 0, 1: 0}),
    "no lane may draft": (4, {}, 4, 1, GPU_LIKE, {}),
}  # fmt: skip


@pytest.mark.parametrize(
    ("decoding", "acceptance", "max_draft", "min_draft", "cost", "lengths"), CASES.values(), ids=CASES.keys()
)
def test_draft_lengths(
    decoding: int, acceptance: dict[int, float], max_draft: int, min_draft: int, cost: StepCost, lengths: dict[int, int]
) -> None:
    chosen = draft_lengths(
        decoding=decoding, acceptance=acceptance, max_draft=max_draft, min_draft=min_draft, cost=cost
    )
    assert chosen == lengths
    assert all(k == 0 or min_draft <= k <= max_draft for k in chosen.values())
    tokens = decoding + sum(sum(acceptance[s] ** j for j in range(1, k + 1)) for s, k in chosen.items())
    plain = decoding / cost.ratio(decoding)
    assert tokens / cost.ratio(decoding + sum(chosen.values())) >= plain, "never below plain decoding's estimate"


REFUSED = {
    "a minimum draft of 0": ({"decoding": 1, "acceptance": {0: 0.5}, "max_draft": 4, "min_draft": 0}, "1 <= min"),
    "a minimum above the maximum": ({"decoding": 1, "acceptance": {0: 0.5}, "max_draft": 2, "min_draft": 3}, "<= max"),
    "more drafting lanes than decoding slots": (
        {"decoding": 1, "acceptance": lanes(2, 0.5), "max_draft": 4, "min_draft": 1}, "cannot be more than"
    ),
}  # fmt: skip


@pytest.mark.parametrize(("arguments", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_inconsistent_inputs_are_refused(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        draft_lengths(cost=GPU_LIKE, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("marginal", [-0.1, 1.5], ids=["negative", "dearer than a step"])
def test_a_position_cost_out_of_range_is_refused(marginal: float) -> None:
    with pytest.raises(ValueError, match="marginal position cost"):
        StepCost(marginal=marginal)


RUNS = {
    "no runs yet: the prior": ([], PRIOR_ACCEPTANCE),
    "every draft accepted: the rate climbs towards 1": ([(4, 4)] * 6, 0.97),
    "every first draft rejected: the rate falls towards 0": ([(4, 0)] * 6, 0.03),
}


@pytest.mark.parametrize(("runs", "near"), RUNS.values(), ids=RUNS.keys())
def test_a_lanes_acceptance_follows_its_verified_runs(runs: list[tuple[int, int]], near: float) -> None:
    acceptance = Acceptance()
    for drafted, accepted in runs:
        acceptance.observe(drafted=drafted, accepted=accepted)
    assert acceptance.rate == pytest.approx(near, abs=0.06)


def test_recent_runs_outweigh_old_ones() -> None:
    acceptance = Acceptance()
    for _ in range(10):
        acceptance.observe(drafted=4, accepted=4)
    high = acceptance.rate
    for _ in range(8):
        acceptance.observe(drafted=4, accepted=0)
    assert acceptance.rate < 0.5 < high


def test_a_lane_whose_drafts_keep_failing_stops_drafting_even_alone() -> None:
    acceptance = Acceptance()
    for _ in range(20):
        acceptance.observe(drafted=2, accepted=0)
    lengths = draft_lengths(decoding=1, acceptance={0: acceptance.rate}, max_draft=4, min_draft=1, cost=GPU_LIKE)
    assert lengths == {0: 0}


MADE = {  # decoding slots, acceptance, each draft token's cost to make (a draft model's step): lengths
    "a draft as dear as a step drafts nothing, even for one slot that agrees": (1, {0: 0.99}, {0: 1.0}, {0: 0}),
    "a draft a tenth of a step drafts the most for one slot": (1, {0: 0.8}, {0: 0.1}, {0: 4}),
    "the same draft for sixteen slots, one lane after another, drafts nothing": (
        16, lanes(16, 0.8), dict.fromkeys(range(16), 0.1), dict.fromkeys(range(16), 0)
    ),
    "n-gram lookup, free to make, takes the positions a draft model would pay for": (
        2, {0: 0.8, 1: 0.8}, {1: 0.5}, {0: 4, 1: 0}
    ),
}  # fmt: skip


@pytest.mark.parametrize(("decoding", "acceptance", "made", "lengths"), MADE.values(), ids=MADE.keys())
def test_a_draft_models_own_steps_count_against_its_drafts(
    decoding: int, acceptance: dict[int, float], made: dict[int, float], lengths: dict[int, int]
) -> None:
    chosen = draft_lengths(
        decoding=decoding, acceptance=acceptance, max_draft=4, min_draft=1, cost=GPU_LIKE, draft_cost=made
    )
    assert chosen == lengths
    tokens = decoding + sum(sum(acceptance[s] ** j for j in range(1, k + 1)) for s, k in chosen.items())
    spent = GPU_LIKE.ratio(decoding + sum(chosen.values())) + sum(made.get(s, 0.0) * k for s, k in chosen.items())
    assert tokens / spent >= decoding / GPU_LIKE.ratio(decoding), "never below plain decoding's estimate"


def _by_scanning(
    *, decoding: int, acceptance: dict[int, float], max_draft: int, min_draft: int, cost: StepCost,
    draft_cost: dict[int, float],
) -> dict[int, int]:  # fmt: skip
    """The rule of strata.gateway.draft_lengths written plainly: every move of every lane weighed at each step."""
    lengths = dict.fromkeys(acceptance, 0)
    tokens, positions, making = float(decoding), decoding, 0.0
    while True:
        options = []
        for slot, rate in acceptance.items():
            k = lengths[slot]
            if k < max_draft:
                added = min_draft if k == 0 else 1
                gain = sum(rate**j for j in range(k + 1, k + added + 1))
                price = (cost.marginal + draft_cost.get(slot, 0.0)) * added
                options.append((gain / price if price else float("inf"), slot, gain, added))
        if not options:
            return lengths
        _, slot, gain, added = max(options, key=lambda o: o[0])  # the first of equals, as the lanes are named
        made = making + draft_cost.get(slot, 0.0) * added
        if (tokens + gain) / (cost.ratio(positions + added) + made) <= tokens / (cost.ratio(positions) + making):
            return lengths
        lengths[slot] += added
        tokens, positions, making = tokens + gain, positions + added, made


@pytest.mark.parametrize("seed", range(40))
def test_the_heap_chooses_as_a_scan_of_every_lane_would(seed: int) -> None:
    rng = random.Random(seed)  # noqa: S311 - cases, not secrets
    lanes = rng.choice([1, 2, 5, 16, 64])
    acceptance = {slot: rng.choice([rng.random(), 1.0, 0.5, 0.0]) for slot in rng.sample(range(128), lanes)}
    draft_cost = {slot: rng.choice([0.0, 0.05, 0.5, 1.0]) for slot in acceptance if rng.random() < 0.5}
    max_draft = rng.randint(1, 7)
    arguments = {
        "decoding": lanes + rng.randint(0, 8), "acceptance": acceptance, "max_draft": max_draft,
        "min_draft": rng.randint(1, max_draft), "cost": StepCost(marginal=rng.choice([0.0, 0.01, 0.1, 0.5, 1.0])),
        "draft_cost": draft_cost,
    }  # fmt: skip
    assert draft_lengths(**arguments) == _by_scanning(**arguments)  # type: ignore[arg-type]
