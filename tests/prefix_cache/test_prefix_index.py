"""The coordinator's index: the longest chunk-aligned prefix a prompt shares with a saved one, never all of it."""

from __future__ import annotations

import pytest
from strata.gateway.prefix_index import PrefixIndex, boundary_hashes

CHUNK = 4
SAVED = tuple(range(10, 22))  # 12 tokens: a snapshot of all three chunks


def index() -> PrefixIndex:
    prefixes = PrefixIndex(chunk=CHUNK)
    wanted = prefixes.to_save(SAVED)
    assert wanted is not None
    key, length = wanted
    prefixes.add(SAVED, key=key, length=length)
    return prefixes


@pytest.mark.parametrize(
    ("prompt", "length"),
    [
        pytest.param((*SAVED, 1), 12, id="a prompt extending the saved one restores all of it"),
        pytest.param(SAVED, 8, id="the same prompt restores one chunk less, leaving a token to prefill"),
        pytest.param((*SAVED[:9], 99, 98), 8, id="a prompt sharing two chunks restores those of the longer snapshot"),
        pytest.param((*SAVED[:3], 99, 98), None, id="sharing less than a chunk finds nothing"),
        pytest.param((11, *SAVED), None, id="the same tokens shifted by one find nothing"),
    ],
)
def test_the_longest_shared_chunk_aligned_prefix_is_found(prompt: tuple[int, ...], length: int | None) -> None:
    match = index().longest(prompt)
    assert (match.length if match else None) == length
    if match is not None:
        assert match.key == boundary_hashes(SAVED, chunk=CHUNK, limit=12)[-1][1], "always the saved snapshot's key"


def test_a_prefix_a_snapshot_already_covers_is_not_saved_again() -> None:
    prefixes = index()
    assert prefixes.to_save((*SAVED[:8], 77, 78)) is None
    assert prefixes.to_save((*SAVED, 5, 6, 7, 8)) is not None


def test_forgetting_a_snapshot_drops_every_boundary_that_pointed_at_it() -> None:
    prefixes = index()
    match = prefixes.longest((*SAVED, 1))
    assert match is not None
    prefixes.forget(match.key)
    assert len(prefixes) == 0
    assert prefixes.longest((*SAVED, 1)) is None


def test_the_index_keeps_at_most_its_capacity_dropping_the_oldest() -> None:
    prefixes = PrefixIndex(chunk=CHUNK, max_entries=3)
    for start in (0, 100):
        prompt = tuple(range(start, start + 8))
        prefixes.add(prompt, key=bytes([start]), length=8)
    assert len(prefixes) == 3
    assert prefixes.longest(tuple(range(100, 109))) is not None
    assert prefixes.longest((0, 1, 2, 3, 4)) is None
