"""The coordinator's index: prompts keyed by chained block hashes, and the longest block-aligned prefix a prompt
shares with a saved one, never all of it."""

from __future__ import annotations

import pytest
from strata.gateway.prefix_index import PrefixIndex, block_hashes, prefix_seed

CHUNK = 4
SEED = prefix_seed(model="model.gguf", cache_type="q8_0")
SAVED = tuple(range(10, 22))  # 12 tokens: a snapshot of all three chunks


def index(*, chunk: int = CHUNK, block: int | None = None) -> PrefixIndex:
    prefixes = PrefixIndex(chunk=chunk, seed=SEED, block=block)
    wanted = prefixes.to_save(SAVED)
    assert wanted is not None
    key, length = wanted
    prefixes.add(SAVED, key=key, length=length)
    return prefixes


def last_hash(tokens: tuple[int, ...], *, seed: bytes = SEED, block: int = CHUNK) -> bytes:
    return block_hashes(tokens, block=block, seed=seed, limit=len(tokens))[-1][1]


@pytest.mark.parametrize(
    ("left", "right", "same"),
    [
        pytest.param(last_hash(SAVED), last_hash(SAVED), True, id="the same tokens and seed hash alike"),
        pytest.param(
            last_hash(SAVED), last_hash((*SAVED[:8], 99, *SAVED[9:])), False, id="one token changed in the last block"
        ),
        pytest.param(
            last_hash(SAVED),
            last_hash((99, *SAVED[1:])),
            False,
            id="one token changed in the first block changes the last",
        ),
        pytest.param(
            last_hash(SAVED),
            last_hash(SAVED, seed=prefix_seed(model="model.gguf", cache_type="f16")),
            False,
            id="another cache type",
        ),
        pytest.param(
            last_hash(SAVED),
            last_hash(SAVED, seed=prefix_seed(model="other.gguf", cache_type="q8_0")),
            False,
            id="another model",
        ),
        pytest.param(
            last_hash(SAVED),
            last_hash(SAVED, seed=prefix_seed(model="model.gguf", cache_type="q8_0", salt="tenant-a")),
            False,
            id="a salt",
        ),
        pytest.param(
            prefix_seed(model="ab", cache_type="c"),
            prefix_seed(model="a", cache_type="bc"),
            False,
            id="parts that concatenate alike are told apart",
        ),
        pytest.param(
            last_hash(SAVED[:4] + SAVED[4:8]),
            block_hashes(SAVED, block=CHUNK, seed=SEED, limit=12)[1][1],
            True,
            id="a block's hash names the whole prefix up to it",
        ),
    ],
)
def test_chained_block_hashes_tell_prefixes_apart(left: bytes, right: bytes, same: bool) -> None:
    assert (left == right) is same


def test_only_whole_blocks_are_hashed() -> None:
    assert [length for length, _ in block_hashes(SAVED[:11], block=CHUNK, seed=SEED, limit=11)] == [4, 8]


@pytest.mark.parametrize(
    ("prompt", "block", "length"),
    [
        pytest.param((*SAVED, 1), None, 12, id="a prompt extending the saved one restores all of it"),
        pytest.param(SAVED, None, 8, id="the same prompt restores one chunk less, leaving a token to prefill"),
        pytest.param((*SAVED[:9], 99, 98), None, 8, id="a prompt sharing two chunks restores those of the longer one"),
        pytest.param((*SAVED[:3], 99, 98), None, None, id="sharing less than a chunk finds nothing"),
        pytest.param((11, *SAVED), None, None, id="the same tokens shifted by one find nothing"),
        pytest.param((*SAVED[:7], 99, 98), 2, 6, id="blocks smaller than the chunk hit at a block boundary"),
    ],
)
def test_the_longest_shared_block_aligned_prefix_is_found(
    prompt: tuple[int, ...], block: int | None, length: int | None
) -> None:
    match = index(block=block).longest(prompt)
    assert (match.length if match else None) == length
    if match is not None:
        assert match.key == last_hash(SAVED, block=block or CHUNK), "always the saved snapshot's key"


def test_another_seed_finds_nothing_of_the_same_tokens() -> None:
    saved = index()
    other = PrefixIndex(chunk=CHUNK, seed=prefix_seed(model="model.gguf", cache_type="f16"))
    wanted = other.to_save(SAVED)
    assert wanted is not None
    assert saved.longest((*SAVED, 1)) is not None
    assert other.longest((*SAVED, 1)) is None
    assert saved.covered((*SAVED, 1)) == 12
    assert other.covered((*SAVED, 1)) == 0


@pytest.mark.parametrize(
    ("chunk", "block", "expected"),
    [
        pytest.param(256, None, 64, id="a 256-token chunk hashes the pool's 64-token blocks"),
        pytest.param(16, None, 16, id="a chunk smaller than a pool block is its own block"),
        pytest.param(96, None, 32, id="a chunk of one and a half blocks hashes their common measure"),
    ],
)
def test_the_hash_block_divides_the_chunk(chunk: int, block: int | None, expected: int) -> None:
    assert PrefixIndex(chunk=chunk, block=block).block == expected


def test_a_chunk_of_partial_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="whole hash blocks of 3"):
        PrefixIndex(chunk=4, block=3)


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


@pytest.mark.parametrize(
    ("saved_salt", "asked_salt", "found"),
    [
        pytest.param("", "", 8, id="unsalted finds unsalted"),
        pytest.param("tenant-a", "tenant-a", 8, id="a salt finds its own"),
        pytest.param("tenant-a", "tenant-b", 0, id="another salt finds nothing"),
        pytest.param("tenant-a", "", 0, id="an unsalted request finds no salted prefix"),
        pytest.param("", "tenant-a", 0, id="a salted request finds no unsalted prefix"),
    ],
)
def test_a_request_salt_shares_prefixes_with_its_own_salt_only(saved_salt: str, asked_salt: str, found: int) -> None:
    prefixes = PrefixIndex(chunk=CHUNK, seed=SEED)
    wanted = prefixes.to_save(SAVED, salt=saved_salt)
    assert wanted is not None
    key, length = wanted
    prefixes.add(SAVED, key=key, length=length, salt=saved_salt)
    asked = (*SAVED[:9], 77, 78)
    assert prefixes.covered(asked, salt=asked_salt) == found
    match = prefixes.longest(asked, salt=asked_salt)
    assert (0 if match is None else match.length) == found
