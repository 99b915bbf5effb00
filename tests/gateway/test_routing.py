"""Routing across pipelines (strata.gateway.routing), pure: the prefix holder, the hash ring, the load bound."""

from __future__ import annotations

import pytest
from strata.gateway.routing import Candidate, affinity_key, ring_order, round_robin, route, within_bound

KEY = affinity_key(list(range(40)), block=16)


def owner(key: int, indices: list[int]) -> int:
    return ring_order(key, indices)[0]


def pipelines(*busy: int, lanes: int = 4, cached: dict[int, int] | None = None) -> list[Candidate]:
    return [Candidate(index=i, lanes=lanes, busy=b, cached=(cached or {}).get(i, 0)) for i, b in enumerate(busy)]


HOME = owner(KEY, [0, 1, 2])  # where KEY goes among three idle pipelines
AWAY = next(i for i in ring_order(KEY, [0, 1, 2]) if i != HOME)


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        pytest.param([], None, id="no pipeline serves: nowhere to go"),
        pytest.param(pipelines(4, 4, 4), None, id="every lane of every pipeline is busy: nowhere to go"),
        pytest.param(pipelines(0, 0, 0), HOME, id="a prompt nobody holds goes to its place on the ring"),
        pytest.param(
            pipelines(0, 0, 0, cached={AWAY: 32}),
            AWAY,
            id="the pipeline holding the prompt's prefix wins over the ring",
        ),
        pytest.param(
            pipelines(0, 0, 0, cached={HOME: 16, AWAY: 32}),
            AWAY,
            id="the longest cached prefix wins over a shorter one",
        ),
        pytest.param(
            [Candidate(index=i, lanes=4, busy=4 if i == HOME else 0) for i in range(3)],
            AWAY,
            id="a prompt whose place is full goes to the next pipeline on the ring",
        ),
        pytest.param(
            [Candidate(index=i, lanes=4, busy=3 if i == AWAY else 0, cached=32 if i == AWAY else 0) for i in range(3)],
            HOME,
            id="a holder loaded beyond the bound gives way to the ring: a hot prefix spills over",
        ),
        pytest.param(
            [Candidate(index=i, lanes=4, busy=3 if i == HOME else 0) for i in range(3)],
            next(i for i in ring_order(KEY, [0, 1, 2]) if i != HOME),
            id="a place on the ring loaded beyond the bound is skipped for the next one within it",
        ),
    ],
)
def test_route(candidates: list[Candidate], expected: int | None) -> None:
    assert route(KEY, candidates) == expected


def test_when_every_free_pipeline_is_over_the_bound_the_least_loaded_free_one_takes_it() -> None:
    # With a slack of 1 or more some pipeline is always within the bound; a quarter of an even share puts both past it.
    candidates = [Candidate(index=0, lanes=4, busy=3), Candidate(index=1, lanes=4, busy=2)]
    assert not any(within_bound(c, candidates, balance=0.25) for c in candidates)
    assert route(KEY, candidates, balance=0.25) == 1


def test_the_bound_weighs_shares_by_lanes() -> None:
    big, small = Candidate(index=0, lanes=12, busy=6), Candidate(index=1, lanes=4, busy=4)
    assert within_bound(big, [big, small], balance=1.0), "a 7th of 11 busy lanes is within 12 of 16 lanes' share"
    assert not within_bound(small, [big, small], balance=1.0), "a 5th of 11 exceeds 4 of 16 lanes' share, plus one"


def test_at_low_load_a_chat_stays_with_its_cache_while_its_last_request_is_still_releasing_its_lane() -> None:
    candidates = [
        Candidate(index=i, lanes=2, busy=1 if i == AWAY else 0, cached=32 if i == AWAY else 0) for i in range(4)
    ]
    assert route(KEY, candidates) == AWAY


@pytest.mark.parametrize(
    ("first", "second", "same"),
    [
        pytest.param(
            [1, 2, 3, 4], [1, 2, 3, 4, 5, 6], True, id="a later turn that extends the first block keys the same"
        ),
        pytest.param([1, 2, 3, 4, 9], [1, 2, 3, 4, 7], True, id="prompts equal in their first block key the same"),
        pytest.param([1, 2, 3], [1, 2, 3, 4], False, id="a prompt shorter than the block keys on all it has"),
        pytest.param([1, 2, 3, 4], [1, 2, 3, 5], False, id="prompts that differ within the block key apart"),
    ],
)
def test_affinity_key(first: list[int], second: list[int], same: bool) -> None:
    assert (affinity_key(first, block=4) == affinity_key(second, block=4)) is same


def test_a_pipeline_that_joins_the_ring_takes_keys_only_for_itself() -> None:
    keys = [affinity_key([k], block=1) for k in range(2000)]
    before = {k: owner(k, [0, 1, 2]) for k in keys}
    after = {k: owner(k, [0, 1, 2, 3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == 3 for k in moved), "a key moves only to the new pipeline"
    assert 0.15 < len(moved) / len(keys) < 0.35, "about a quarter of the keys move to the fourth pipeline"


def test_keys_spread_over_the_ring() -> None:
    counts = [0, 0, 0, 0]
    for k in range(4000):
        counts[owner(affinity_key([k], block=1), [0, 1, 2, 3])] += 1
    assert min(counts) > 700, f"64 points per pipeline spread the keys: {counts}"


@pytest.mark.parametrize(
    ("turn", "busy", "expected"),
    [
        pytest.param(0, (0, 0, 0), 0, id="round robin starts at the first pipeline"),
        pytest.param(4, (0, 0, 0), 1, id="round robin takes turns"),
        pytest.param(1, (0, 4, 0), 2, id="round robin skips a full pipeline"),
        pytest.param(1, (4, 4, 4), None, id="round robin finds nowhere when all are full"),
    ],
)
def test_round_robin(turn: int, busy: tuple[int, ...], expected: int | None) -> None:
    assert round_robin(turn, pipelines(*busy)) == expected
