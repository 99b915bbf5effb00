"""Prefix snapshots: this stage's KV of a slot's first N positions, kept to be restored into another slot.

Agents and chat clients resend the same system prompt and history every turn. After a prefill the coordinator asks
every stage to keep the KV of a chunk-aligned token prefix for its own layers; a later request that starts with the
same tokens has it restored by command into its slot and prefills only the rest. KV never crosses the wire: each
stage restores what it kept itself.

The full-attention layers' part is not copied: a snapshot pins the slot's blocks of the KV pool
(strata.stage_worker.kv_cells), and a restore maps the same blocks into the new slot's table; whichever slot next
writes into a shared block (the partial last one) copies it first, so nobody's rows change under another. Only the
positions' tokens are final when the coordinator saves them (it saves prompt prefixes once their prefill is done;
drafted positions come after the prompt), so a speculative rollback never changes a pinned block's positions. The
sliding-window layers keep a copy of what their cells still hold (at least the positions a query at N sees, at most
a window and a block): their space is sized for the slots' windows alone. Such a snapshot serves a shorter prefix
only where that prefix's window lies inside it, and a save after the window has moved past position N keeps nothing.

Pinned blocks come out of the pool that live slots use, so they are lent, not owned: when a slot's growth finds too
few free blocks, the cache lets go of its least recently used snapshots first (KVPool.on_short), and a slot never
waits on a snapshot. A snapshot's size is N times the bytes of one position of this stage's layers; the cache holds
them within a byte budget as before, dropping the least recently used first, and forgets them all when a new
coordinator term is accepted (strata.stage_worker.server), so none crosses a term.

With a host tier (strata.stage_worker.kv_host), a snapshot the device lets go of (over the budget, or to a slot short
of blocks) moves there first: its full-attention rows and its window copies, as stored. A restore that finds it only
there writes them into fresh blocks, bit for bit what the prefill wrote, and pins those blocks again as a device
snapshot, so the next slot to restore it maps them (the choices of `n > 1` share one copy); a restore of all of it
leaves the host tier. Host entries are let go oldest first over
the host budget.

Snapshots are filed under (plan generation, the coordinator's chained hash of the prefix's token blocks,
strata.gateway.prefix_index).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from strata.stage_worker.errors import PoolExhaustedError
from strata.stage_worker.kv_host import HostRows, HostTier, HostTierStats, block_runs
from strata.stage_worker.kv_pool import KVPool
from strata.stage_worker.kv_stores import RawRows


@dataclass(frozen=True)
class Snapshot:
    length: int  # positions 0..length-1
    pool: KVPool  # whose blocks these are: a reloaded stage's new pool has none of them
    blocks: tuple[int, ...]  # the full-attention layers' blocks of those positions, pinned
    position_bytes: int  # bytes of one position over the full-attention layers
    keys: tuple[RawRows | None, ...]  # per layer of this stage: a copy for sliding-window layers, None for the others
    values: tuple[RawRows | None, ...]
    window_first: int = 0  # the first position the sliding-window layers' rows hold (their row 0)

    @property
    def nbytes(self) -> int:
        copied = sum(rows.nbytes for rows in (*self.keys, *self.values) if rows is not None)
        return self.length * self.position_bytes + copied


@dataclass(frozen=True)
class HostSnapshot:
    """A snapshot whose rows are in the host tier: every layer's rows of positions window_first.. for sliding-window
    layers and 0.. for the others (None: that layer's rows never left, as for a snapshot without sliding layers)."""

    length: int
    pool: KVPool
    keys: tuple[HostRows, ...]  # per layer of this stage
    values: tuple[HostRows, ...]
    window_first: int

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in (*self.keys, *self.values))

    @property
    def parts(self) -> list[HostRows]:
        return [*self.keys, *self.values]


@dataclass(frozen=True)
class PrefixCacheStats:
    snapshots: int
    bytes_held: int
    budget_bytes: int
    hits: int
    misses: int
    evictions: int


SnapshotKey = tuple[int, bytes]  # (plan generation, hash of the prefix's token ids)


class PrefixCache:
    """Snapshots within `budget_bytes`, least recently used first out; a budget of 0 keeps nothing.

    save, restore and clear change a pool's blocks: they run under the stage's engine lock, as its steps do (and
    the cache's letting go on a short pool runs inside a step). The cache's own lock guards its table."""

    def __init__(self, *, budget_bytes: int, host: HostTier | None = None) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must not be negative, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.host = host  # None: a snapshot the device lets go of is gone
        self._lock = threading.Lock()
        self._snapshots: OrderedDict[SnapshotKey, Snapshot] = OrderedDict()
        self._hosted: OrderedDict[SnapshotKey, HostSnapshot] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def save(self, *, pool: KVPool, slot: int, generation: int, key: bytes, length: int) -> bool:
        """Keep the first `length` positions of `slot`; False when the snapshot alone is over the budget, or when
        the sliding-window layers no longer hold all that a query at `length` sees."""
        prefix = pool.prefix(slot=slot, length=length)
        if prefix is None:
            return False
        name = (generation, key)
        with self._lock:
            held = self._snapshots.get(name)
            if held is not None and held.pool is pool and held.length >= length:
                self._snapshots.move_to_end(name)
                return True
        window = prefix.window_cells
        # Per layer: the cells to copy (the sliding-window layers'), or None (the full-attention layers' are pinned).
        own = [window if windowed else None for windowed in pool.windowed]
        layers = list(zip(pool.layers, own, strict=True))
        full_layers = [layer for layer, windowed in zip(pool.layers, pool.windowed, strict=True) if not windowed]
        position_bytes = sum(layer.keys.row_bytes + layer.values.row_bytes for layer in full_layers)
        copied = sum(
            cells.shape[0] * (layer.keys.row_bytes + layer.values.row_bytes)
            for layer, cells in layers
            if cells is not None
        )
        if length * position_bytes + copied > self.budget_bytes:
            return False
        snapshot = Snapshot(
            length=length,
            pool=pool,
            blocks=pool.pin(slot=slot, length=length),
            position_bytes=position_bytes,
            keys=tuple(None if cells is None else layer.keys.raw(cells) for layer, cells in layers),
            values=tuple(None if cells is None else layer.values.raw(cells) for layer, cells in layers),
            window_first=prefix.window_first,
        )
        pool.on_short(self._let_go)
        with self._lock:
            replaced = self._drop(name)
            evicted = []
            while self._snapshots and self._bytes + snapshot.nbytes > self.budget_bytes:
                oldest = next(iter(self._snapshots))
                evicted.append((oldest, self._drop(oldest)))
                self._evictions += 1
            self._snapshots[name] = snapshot
            self._bytes += snapshot.nbytes
        _unpin([replaced])
        self._spill(evicted)
        return True

    def restore(self, *, pool: KVPool, slot: int, generation: int, key: bytes, length: int) -> bool:
        """Make `slot` hold the snapshot's first `length` positions, from the device or else the host tier; False (a
        miss) when it is held in neither."""
        with self._lock:
            snapshot = self._snapshots.get((generation, key))
            hosted = self._hosted.get((generation, key))
            if snapshot is not None and _serves(snapshot, pool=pool, length=length):
                self._snapshots.move_to_end((generation, key))
            elif hosted is not None and _serves(hosted, pool=pool, length=length):
                snapshot = None
            else:
                self._misses += 1
                return False
        if snapshot is None:
            assert hosted is not None  # the branch above returned otherwise
            return self._bring_back(hosted, pool=pool, slot=slot, generation=generation, key=key, length=length)
        try:
            # The full-attention layers take the pinned blocks as they are; the window's cells are fresh.
            placed = pool.adopt(slot=slot, blocks=snapshot.blocks[: -(-length // pool.block)], length=length)
        except PoolExhaustedError:
            with self._lock:
                self._misses += 1
            return False
        # The sliding-window layers' rows start at the snapshot's window_first; the slot holds from placed's.
        skip = placed.window_first - snapshot.window_first
        for layer, keys, values in zip(pool.layers, snapshot.keys, snapshot.values, strict=True):
            if keys is not None and values is not None and placed.window_cells is not None:
                layer.keys.put(placed.window_cells, keys.rows(skip, length - snapshot.window_first))
                layer.values.put(placed.window_cells, values.rows(skip, length - snapshot.window_first))
        with self._lock:
            self._hits += 1
        return True

    def clear(self) -> None:
        """Forget every snapshot (a new coordinator term), giving back its blocks; the counters keep counting."""
        with self._lock:
            dropped = list(self._snapshots.values())
            self._snapshots.clear()
            self._bytes = 0
            hosted = list(self._hosted.values())
            self._hosted.clear()
        _unpin(dropped)
        if self.host is not None:
            for entry in hosted:
                self.host.let_go(entry.nbytes, entry.parts)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(
                snapshots=len(self._snapshots),
                bytes_held=self._bytes,
                budget_bytes=self.budget_bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
            )

    def _let_go(self) -> bool:
        """A pool short of blocks: drop the least recently used snapshot; False when none is left."""
        with self._lock:
            if not self._snapshots:
                return False
            oldest = next(iter(self._snapshots))
            dropped = self._drop(oldest)
            self._evictions += 1
        self._spill([(oldest, dropped)])
        return True

    def host_stats(self) -> HostTierStats | None:
        """The host tier's figures (None without one)."""
        if self.host is None:
            return None
        with self._lock:
            return self.host.stats(len(self._hosted))

    def _spill(self, evicted: list[tuple[SnapshotKey, Snapshot | None]]) -> None:
        """Snapshots the device lets go of: their rows to the host tier where it has room, then their blocks back."""
        for name, snapshot in evicted:
            if snapshot is None:
                continue
            if self.host is not None and self.host.fits(snapshot.nbytes):
                self._make_room(snapshot.nbytes)
                hosted = _offload(snapshot, self.host)
                with self._lock:
                    self._hosted[name] = hosted
            _unpin([snapshot])

    def _make_room(self, nbytes: int) -> None:
        assert self.host is not None
        while self.host.free_bytes < nbytes:
            with self._lock:
                if not self._hosted:
                    return
                _, oldest = self._hosted.popitem(last=False)
            self.host.let_go(oldest.nbytes, oldest.parts)

    def _bring_back(
        self, hosted: HostSnapshot, *, pool: KVPool, slot: int, generation: int, key: bytes, length: int
    ) -> bool:
        """Restore from the host tier into fresh cells, kept on the device again where its budget allows; a restore
        of all of it that the device keeps leaves the host tier."""
        assert self.host is not None
        try:
            placed = pool.place(slot=slot, length=length)
        except PoolExhaustedError:
            with self._lock:
                self._misses += 1
            return False
        # The full-attention layers' rows go straight into the slot's new blocks; the window's are few.
        runs = block_runs(pool.full.blocks_of(slot), size=pool.block, length=length)
        skip = placed.window_first - hosted.window_first
        for layer, keys, values, windowed in zip(pool.layers, hosted.keys, hosted.values, pool.windowed, strict=True):
            for store, rows in ((layer.keys, keys), (layer.values, values)):
                if windowed and placed.window_cells is not None:
                    # The window's cells are scattered over its space; they are few, so they go through a copy.
                    staged = self.host.fetch(rows, start=skip, stop=skip + placed.window_cells.shape[0])
                    store.put(placed.window_cells, staged)
                else:
                    self.host.bring_back(rows, into=[store.view(*run) for run in runs])
        with self._lock:
            self._hits += 1
        # Pinned again on the device, so the next slot that restores it maps these blocks instead of copying its own;
        # the host copy goes only once the device holds all of it.
        kept = self.save(pool=pool, slot=slot, generation=generation, key=key, length=length)
        with self._lock:
            whole = kept and length == hosted.length and self._hosted.get((generation, key)) is hosted
            if whole:
                del self._hosted[(generation, key)]
        if whole:
            self.host.restored(hosted.nbytes)
        return True

    def _drop(self, name: SnapshotKey) -> Snapshot | None:
        snapshot = self._snapshots.pop(name, None)
        if snapshot is not None:
            self._bytes -= snapshot.nbytes
        return snapshot


def _serves(held: Snapshot | HostSnapshot, *, pool: KVPool, length: int) -> bool:
    """Whether a snapshot of this pool holds the first `length` positions and all that a query at `length` sees."""
    return held.pool is pool and 1 <= length <= held.length and held.window_first <= pool.sight(length)


def _offload(snapshot: Snapshot, host: HostTier) -> HostSnapshot:
    """The snapshot's rows in the host tier: the full-attention layers' read in place from its pinned blocks, the
    sliding-window layers' from its copies."""
    pool = snapshot.pool
    runs = block_runs(snapshot.blocks, size=pool.block, length=snapshot.length)
    keys, values = [], []
    for layer, own_keys, own_values in zip(pool.layers, snapshot.keys, snapshot.values, strict=True):
        keys.append([own_keys] if own_keys is not None else [layer.keys.view(*run) for run in runs])
        values.append([own_values] if own_values is not None else [layer.values.view(*run) for run in runs])
    hosted = host.offload([*keys, *values])
    return HostSnapshot(
        length=snapshot.length,
        pool=pool,
        keys=tuple(hosted[: len(keys)]),
        values=tuple(hosted[len(keys) :]),
        window_first=snapshot.window_first,
    )


def _unpin(snapshots: Sequence[Snapshot | None]) -> None:
    for snapshot in snapshots:
        if snapshot is not None:
            snapshot.pool.unpin(snapshot.blocks)
