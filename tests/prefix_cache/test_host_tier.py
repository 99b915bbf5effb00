"""The host tier on one stage: a snapshot the device lets go of (over its budget, or to a slot short of blocks) moves
to host memory, comes back bit-exact into fresh blocks on a restore, is kept on the device again once restored whole,
and the host budget lets the oldest go first."""

from __future__ import annotations

import pytest
import torch
from strata.gguf.model import CacheType
from strata.stage_worker.kv_host import HostTier, block_runs
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.prefix_cache import PrefixCache
from strata_testbed.small_pools import BLOCK, CPU, prefill, small_pool


def seen(kv: KVPool, *, slot: int, length: int) -> list[torch.Tensor]:
    """The raw rows (values and q8_0 scales) a query at `length` reads, layer by layer."""
    prefix = kv.prefix(slot=slot, length=length)
    assert prefix is not None
    rows: list[torch.Tensor] = []
    for layer, windowed in zip(kv.layers, kv.windowed, strict=True):
        if windowed and prefix.window_cells is not None:
            cells = prefix.window_cells[kv.sight(length) - prefix.window_first :]
        else:
            cells = prefix.cells
        for raw in (layer.keys.raw(cells), layer.values.raw(cells)):
            rows.extend(t for t in (raw.values, raw.scales) if t is not None)
    return rows


def snapshot_bytes(kv: KVPool, length: int) -> int:
    return length * kv.cell_bytes


@pytest.mark.parametrize(
    ("cache_type", "window", "restored"),
    [
        pytest.param(CacheType.F32, 0, 24, id="f32, restored whole"),
        pytest.param(CacheType.Q8_0, 0, 24, id="q8_0 values and scales, restored whole"),
        pytest.param(CacheType.F16, 0, 16, id="f16, a shorter prefix of it"),
        pytest.param(CacheType.Q8_0, 12, 24, id="a sliding-window layer beside a full one"),
    ],
)
def test_a_snapshot_evicted_over_the_device_budget_comes_back_from_the_host_bit_exact(
    cache_type: CacheType, window: int, restored: int
) -> None:
    kv = small_pool(cache_type, window=window)
    device_budget = snapshot_bytes(kv, 24) + snapshot_bytes(kv, 24) // 2  # one snapshot, not two
    cache = PrefixCache(budget_bytes=device_budget, host=HostTier(budget_bytes=1 << 20, device=CPU))
    prefill(kv, slot=0, length=24, seed=1)
    expected = seen(kv, slot=0, length=restored)
    assert cache.save(pool=kv, slot=0, generation=0, key=b"a", length=24)
    prefill(kv, slot=1, length=24, seed=2)
    assert cache.save(pool=kv, slot=1, generation=0, key=b"b", length=24)  # a goes to the host
    kv.reset(0)
    kv.reset(1)
    prefill(kv, slot=0, length=40, seed=3)  # a's old blocks are written over
    host = cache.host_stats()
    assert host is not None
    assert (cache.stats().snapshots, cache.stats().evictions, host.entries, host.offloaded) == (1, 1, 1, 1)
    assert cache.restore(pool=kv, slot=2, generation=0, key=b"a", length=restored)
    for want, got in zip(expected, seen(kv, slot=2, length=restored), strict=True):
        assert torch.equal(want, got)
    after = cache.host_stats()
    assert after is not None
    whole = restored == 24
    # A restore pins a on the device again, which sends b (the device holds one) to the host; a whole one leaves it.
    assert (after.entries, after.restored, after.offloaded) == ((1, 1, 2) if whole else (2, 0, 2))
    assert cache.stats().hits == 1


def test_a_slot_short_of_blocks_sends_the_snapshot_to_the_host_and_a_restore_brings_it_back() -> None:
    kv = small_pool(CacheType.F16, context=32, parallel=2)  # four blocks of 8, and one for the second slot
    cache = PrefixCache(budget_bytes=1 << 20, host=HostTier(budget_bytes=1 << 20, device=CPU))
    prefill(kv, slot=0, length=24, seed=1)
    expected = seen(kv, slot=0, length=24)
    assert cache.save(pool=kv, slot=0, generation=0, key=b"k", length=24)
    kv.reset(0)
    prefill(kv, slot=1, length=32, seed=2)  # takes the snapshot's blocks back
    host = cache.host_stats()
    assert host is not None
    assert (cache.stats().snapshots, host.entries, host.bytes_held) == (0, 1, snapshot_bytes(kv, 24))
    kv.reset(1)
    assert cache.restore(pool=kv, slot=0, generation=0, key=b"k", length=24)
    for want, got in zip(expected, seen(kv, slot=0, length=24), strict=True):
        assert torch.equal(want, got)


@pytest.mark.parametrize(
    ("host_snapshots", "kept"),
    [
        pytest.param(0, [], id="no host budget keeps nothing"),
        pytest.param(1, [b"b"], id="room for one keeps the newest"),
        pytest.param(2, [b"a", b"b"], id="room for two keeps both"),
    ],
)
def test_the_host_budget_lets_the_oldest_go_first(host_snapshots: int, kept: list[bytes]) -> None:
    kv = small_pool(CacheType.F32, context=128, parallel=3)
    one = snapshot_bytes(kv, 16)
    host = HostTier(budget_bytes=host_snapshots * one, device=CPU)
    cache = PrefixCache(budget_bytes=one, host=host)
    for slot, key in enumerate((b"a", b"b", b"c")):
        prefill(kv, slot=slot, length=16, seed=slot)
        assert cache.save(pool=kv, slot=slot, generation=0, key=key, length=16)
    stats = cache.host_stats()
    assert stats is not None
    assert stats.bytes_held <= stats.budget_bytes
    for key in (b"a", b"b"):
        kv.reset(2)
        assert cache.restore(pool=kv, slot=2, generation=0, key=key, length=8) is (key in kept), key


def test_clearing_forgets_the_host_entries_too() -> None:
    kv = small_pool(CacheType.F32)
    cache = PrefixCache(budget_bytes=snapshot_bytes(kv, 16), host=HostTier(budget_bytes=1 << 20, device=CPU))
    for slot, key in enumerate((b"a", b"b")):
        prefill(kv, slot=slot, length=16, seed=slot)
        assert cache.save(pool=kv, slot=slot, generation=0, key=key, length=16)
    cache.clear()
    stats = cache.host_stats()
    assert stats is not None
    assert (stats.entries, stats.bytes_held) == (0, 0)
    assert not cache.restore(pool=kv, slot=2, generation=0, key=b"a", length=16)


def test_a_negative_host_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="host KV budget"):
        HostTier(budget_bytes=-1, device=CPU)


@pytest.mark.parametrize(
    ("blocks", "length", "runs"),
    [
        pytest.param((0, 1, 2), 24, [(0, 24)], id="blocks in order move as one range"),
        pytest.param((0, 1, 2), 20, [(0, 20)], id="a partial last block moves only its positions"),
        pytest.param((3, 4, 0, 1), 32, [(24, 16), (0, 16)], id="a gap starts a new range"),
        pytest.param((5, 4), 16, [(40, 8), (32, 8)], id="descending blocks are ranges of one block"),
        pytest.param((2, 3), 8, [(16, 8)], id="blocks past the length are not read"),
    ],
)
def test_block_runs_cover_the_positions_in_order(
    blocks: tuple[int, ...], length: int, runs: list[tuple[int, int]]
) -> None:
    assert block_runs(blocks, size=BLOCK, length=length) == runs


def test_a_restore_the_device_cannot_keep_stays_in_the_host_tier() -> None:
    kv = small_pool(CacheType.F32, context=128)
    one = snapshot_bytes(kv, 16)
    cache = PrefixCache(budget_bytes=one, host=HostTier(budget_bytes=1 << 20, device=CPU))
    prefill(kv, slot=0, length=16, seed=1)
    assert cache.save(pool=kv, slot=0, generation=0, key=b"a", length=16)
    prefill(kv, slot=1, length=16, seed=2)
    assert cache.save(pool=kv, slot=1, generation=0, key=b"b", length=16)  # a goes to the host
    cache.budget_bytes = one // 2  # the device budget shrinks below one snapshot: a cannot come back there
    for slot in (2, 0):  # twice: the first restore must not have lost it
        assert cache.restore(pool=kv, slot=slot, generation=0, key=b"a", length=16)
    stats = cache.host_stats()
    assert stats is not None
    assert (stats.entries, stats.restored) == (1, 0)
