"""Snapshots on one stage: a restored slot reads the saved rows bit-exact from the same blocks (no copy), a write into a
shared block copies it first, live slots take pinned blocks back when short, and the budget evicts least recently
used."""

from __future__ import annotations

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.errors import ContextExceededError
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.prefix_cache import PrefixCache
from strata_testbed.small_pools import BLOCK, LAYERS, WIDTH, prefill, small_pool


def held(kv: KVPool, *, slot: int, length: int) -> torch.Tensor:
    prefix = kv.prefix(slot=slot, length=length)
    assert prefix is not None, "a pool without a sliding window holds every position"
    return prefix.cells


def contents(kv: KVPool, slot: int, length: int) -> list[tuple[torch.Tensor, ...]]:
    """What attention would read for the slot's first `length` positions, raw and dequantised, layer by layer."""
    cells = held(kv, slot=slot, length=length)
    rows = []
    for layer in kv.layers:
        k, v = layer.keys.raw(cells), layer.values.raw(cells)
        scales = [s for s in (k.scales, v.scales) if s is not None]
        rows.append((k.values, v.values, *scales, *layer.read(cells)))
    return rows


@pytest.mark.parametrize(
    "cache_type",
    [
        pytest.param(CacheType.F32, id="an f32 cache"),
        pytest.param(CacheType.F16, id="an f16 cache"),
        pytest.param(CacheType.Q8_0, id="a q8_0 cache, int8 values and f16 scales alike"),
    ],
)
@pytest.mark.parametrize(
    ("saved", "restored"),
    [
        pytest.param(32, 32, id="restoring the whole snapshot"),
        pytest.param(32, 16, id="restoring a shorter prefix of it"),
    ],
)
def test_a_restored_slot_reads_back_bit_identical_to_the_prefill(
    cache_type: CacheType, saved: int, restored: int
) -> None:
    kv = small_pool(cache_type, context=128)
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=40, seed=1)
    assert cache.save(pool=kv, slot=0, generation=3, key=b"k", length=saved)
    prefill(kv, slot=1, length=5, seed=2)  # the target slot held something else before
    assert cache.restore(pool=kv, slot=1, generation=3, key=b"k", length=restored)
    assert kv.length(1) == restored
    for original, copy in zip(contents(kv, 0, restored), contents(kv, 1, restored), strict=True):
        for a, b in zip(original, copy, strict=True):
            assert torch.equal(a, b)
    cells = held(kv, slot=1, length=restored)
    assert torch.equal(kv.table[1, :restored], cells), "decode reads a slot's cells from the device table"
    assert torch.equal(cells, held(kv, slot=0, length=restored)), "the saved slot's own cells, not copies"
    assert kv.free_cells == kv.full.cells - 40, "a restore takes no block"


def test_a_snapshot_costs_its_tokens_not_the_context() -> None:
    kv = small_pool(CacheType.Q8_0, context=64)
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=32, seed=1)
    cache.save(pool=kv, slot=0, generation=0, key=b"a", length=16)
    per_cell = LAYERS * 2 * (WIDTH + WIDTH // 32 * 2)  # K and V: int8 values plus one f16 scale per 32
    assert kv.cell_bytes == per_cell
    assert cache.stats().bytes_held == 16 * per_cell


@pytest.mark.parametrize(
    ("generation", "key", "length"),
    [
        pytest.param(1, b"other", 16, id="another key misses"),
        pytest.param(2, b"k", 16, id="the same key from another plan generation misses"),
        pytest.param(1, b"k", 17, id="more positions than the snapshot holds miss"),
    ],
)
def test_a_restore_of_something_not_held_misses_and_is_counted(generation: int, key: bytes, length: int) -> None:
    kv = small_pool(CacheType.F16)
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=16, seed=1)
    cache.save(pool=kv, slot=0, generation=1, key=b"k", length=16)
    assert not cache.restore(pool=kv, slot=1, generation=generation, key=key, length=length)
    assert (cache.stats().hits, cache.stats().misses) == (0, 1)


def test_the_least_recently_used_snapshot_goes_first_and_the_budget_is_never_passed() -> None:
    kv = small_pool(CacheType.F16, context=128, parallel=2)
    snapshot = 16 * kv.cell_bytes
    cache = PrefixCache(budget_bytes=2 * snapshot + snapshot // 2)  # room for two snapshots, not three
    held: list[int] = []
    for seed, key in enumerate((b"a", b"b")):
        prefill(kv, slot=0, length=16, seed=seed)
        assert cache.save(pool=kv, slot=0, generation=0, key=key, length=16)
        held.append(cache.stats().bytes_held)
    assert cache.restore(pool=kv, slot=1, generation=0, key=b"a", length=16)  # "a" is now the most recent
    prefill(kv, slot=0, length=16, seed=9)
    assert cache.save(pool=kv, slot=0, generation=0, key=b"c", length=16)
    held.append(cache.stats().bytes_held)
    assert max(held) <= cache.budget_bytes
    assert cache.stats().evictions == 1
    assert cache.stats().snapshots == 2
    assert not cache.restore(pool=kv, slot=1, generation=0, key=b"b", length=16), "b was least recently used"
    assert cache.restore(pool=kv, slot=1, generation=0, key=b"a", length=16)
    assert cache.restore(pool=kv, slot=1, generation=0, key=b"c", length=16)


@pytest.mark.parametrize(
    ("budget", "length"),
    [
        pytest.param(0, 1, id="a budget of zero keeps nothing"),
        pytest.param(1000, 16, id="a snapshot larger than the whole budget is not kept"),
    ],
)
def test_a_snapshot_that_cannot_fit_is_not_kept_and_evicts_nothing(budget: int, length: int) -> None:
    kv = small_pool(CacheType.F32)
    cache = PrefixCache(budget_bytes=budget)
    prefill(kv, slot=0, length=16, seed=1)
    assert not cache.save(pool=kv, slot=0, generation=0, key=b"k", length=length)
    assert cache.stats() == cache.stats().__class__(
        snapshots=0, bytes_held=0, budget_bytes=budget, hits=0, misses=0, evictions=0
    )


def test_a_restore_into_a_full_pool_takes_no_block_and_hits() -> None:
    kv = small_pool(CacheType.F32, context=40)  # five blocks, and two for the other slots' partial last blocks
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=32, seed=1)
    cache.save(pool=kv, slot=0, generation=0, key=b"k", length=32)
    prefill(kv, slot=2, length=24, seed=2)
    assert kv.free_cells == 0
    assert cache.restore(pool=kv, slot=1, generation=0, key=b"k", length=32)
    assert (kv.length(1), cache.stats().hits) == (32, 1)


def test_a_snapshot_longer_than_the_slot_is_refused() -> None:
    kv = small_pool(CacheType.F32)
    prefill(kv, slot=0, length=8, seed=1)
    with pytest.raises(ContextExceededError, match="holds 8 positions"):
        PrefixCache(budget_bytes=1 << 20).save(pool=kv, slot=0, generation=0, key=b"k", length=16)


def test_clearing_forgets_every_snapshot_and_frees_its_bytes() -> None:
    kv = small_pool(CacheType.F32)
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=16, seed=1)
    cache.save(pool=kv, slot=0, generation=0, key=b"k", length=16)
    cache.clear()
    assert (cache.stats().snapshots, cache.stats().bytes_held) == (0, 0)
    assert not cache.restore(pool=kv, slot=1, generation=0, key=b"k", length=16)


def rewrite(kv: KVPool, *, slot: int, start: int, length: int, seed: int) -> None:
    """Write other K and V for positions start..start+length-1 of `slot`, as a later step would."""
    generator = torch.Generator().manual_seed(seed)
    cells = kv.extend(slot=slot, start_position=start, length=length).full.new
    for layer in kv.layers:
        layer.write(
            cells, torch.randn(length, WIDTH, generator=generator), torch.randn(length, WIDTH, generator=generator)
        )


@pytest.mark.parametrize(
    ("writer", "start", "saved"),
    [
        pytest.param(1, 20, 20, id="the restored slot continuing into the shared partial block copies it"),
        pytest.param(0, 20, 20, id="the saving slot continuing past the saved length copies the shared block"),
        pytest.param(0, 12, 16, id="a rollback of the saving slot into the saved positions copies, never poisons"),
    ],
)
def test_a_write_into_a_shared_block_copies_it_and_the_snapshot_keeps_its_rows(
    writer: int, start: int, saved: int
) -> None:
    kv = small_pool(CacheType.Q8_0)
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=24, seed=1)
    original = contents(kv, 0, saved)
    assert cache.save(pool=kv, slot=0, generation=0, key=b"k", length=saved)
    assert cache.restore(pool=kv, slot=1, generation=0, key=b"k", length=saved)
    shared = kv.full.blocks_of(writer)[start // BLOCK]
    rewrite(kv, slot=writer, start=start, length=6, seed=7)
    assert kv.full.blocks_of(writer)[start // BLOCK] != shared, "the writer took a block of its own"
    assert cache.restore(pool=kv, slot=2, generation=0, key=b"k", length=saved)
    for before, after in zip(original, contents(kv, 2, saved), strict=True):
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b)
    unchanged = min(start, saved)
    for before, after in zip(contents(kv, writer, unchanged), contents(kv, 2, unchanged), strict=True):
        for a, b in zip(before, after, strict=True):
            assert torch.equal(a, b), "the copy kept the writer's positions before its write"


def test_a_slot_short_of_blocks_takes_back_those_only_snapshots_hold() -> None:
    kv = small_pool(CacheType.F16, context=32, parallel=2)  # four blocks of 8, and one for the second slot
    cache = PrefixCache(budget_bytes=1 << 20)
    prefill(kv, slot=0, length=24, seed=1)
    assert cache.save(pool=kv, slot=0, generation=0, key=b"k", length=24)
    kv.reset(0)
    assert kv.free_cells == 2 * BLOCK, "the snapshot still holds three blocks"
    prefill(kv, slot=1, length=32, seed=2)
    assert (cache.stats().snapshots, cache.stats().evictions, kv.free_cells) == (0, 1, BLOCK)
    assert not cache.restore(pool=kv, slot=0, generation=0, key=b"k", length=24)
