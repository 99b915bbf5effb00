"""Prefix snapshots: this stage's K and V rows of a slot's first N positions, kept to be restored into another slot.

Agents and chat clients resend the same system prompt and history every turn. After a prefill the coordinator asks
every stage to keep the KV of a chunk-aligned token prefix for its own layers; a later request that starts with the
same tokens has it restored by command into its slot and prefills only the rest. KV never crosses the wire: each
stage restores what it kept itself.

A snapshot is the rows exactly as stored (q8_0's int8 values and f16 scales alike), so a restored slot reads back
bit-identical to the prefill that wrote it. Its size is N times the bytes of one position of this stage's layers: it
follows the tokens used, not the context. Sliding-window layers keep only what their cells still hold (at least the
positions a query at N sees): such a snapshot serves a shorter prefix only where that prefix's window lies inside
it, and a save after the window has moved past position N keeps nothing (the coordinator then prefills in full).

Snapshots are filed under (plan generation, the coordinator's hash of the prefix's token ids); a stage holds them
within a byte budget, dropping the least recently used first, and forgets them all when a new coordinator term is
accepted (strata.stage_worker.server), so none crosses a term.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from strata.stage_worker.errors import PoolExhaustedError
from strata.stage_worker.kv_pool import KVPool, RawRows


@dataclass(frozen=True)
class Snapshot:
    length: int  # positions 0..length-1
    keys: tuple[RawRows, ...]  # one per layer of this stage
    values: tuple[RawRows, ...]
    window_first: int = 0  # the first position the sliding-window layers' rows hold (their row 0)

    @property
    def nbytes(self) -> int:
        return sum(rows.nbytes for rows in (*self.keys, *self.values))


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
    """Snapshots within `budget_bytes`, least recently used first out; a budget of 0 keeps nothing."""

    def __init__(self, *, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache budget must not be negative, not {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._snapshots: OrderedDict[SnapshotKey, Snapshot] = OrderedDict()
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
            if held is not None and held.length >= length:
                self._snapshots.move_to_end(name)
                return True
        window = prefix.window_cells
        own = [window if windowed and window is not None else prefix.cells for windowed in pool.windowed]
        layers = list(zip(pool.layers, own, strict=True))
        size = sum(cells.shape[0] * (layer.keys.row_bytes + layer.values.row_bytes) for layer, cells in layers)
        if size > self.budget_bytes:
            return False
        snapshot = Snapshot(
            length=length,
            keys=tuple(layer.keys.raw(cells) for layer, cells in layers),
            values=tuple(layer.values.raw(cells) for layer, cells in layers),
            window_first=prefix.window_first,
        )
        with self._lock:
            self._drop(name)
            while self._snapshots and self._bytes + snapshot.nbytes > self.budget_bytes:
                self._drop(next(iter(self._snapshots)))
                self._evictions += 1
            self._snapshots[name] = snapshot
            self._bytes += snapshot.nbytes
        return True

    def restore(self, *, pool: KVPool, slot: int, generation: int, key: bytes, length: int) -> bool:
        """Make `slot` hold the snapshot's first `length` positions; False (a miss) when it is not held here."""
        with self._lock:
            snapshot = self._snapshots.get((generation, key))
            if snapshot is None or not 1 <= length <= snapshot.length or snapshot.window_first > pool.sight(length):
                self._misses += 1
                return False
            self._snapshots.move_to_end((generation, key))
        try:
            # Truncates the slot and takes fresh cells, writing them into the device cell tables as a prefill does.
            placed = pool.place(slot=slot, length=length)
        except PoolExhaustedError:
            with self._lock:
                self._misses += 1
            return False
        # The sliding-window layers' rows start at the snapshot's window_first; the slot holds from placed's.
        skip = placed.window_first - snapshot.window_first
        for layer, windowed, keys, values in zip(
            pool.layers, pool.windowed, snapshot.keys, snapshot.values, strict=True
        ):
            if windowed and placed.window_cells is not None:
                layer.keys.put(placed.window_cells, keys.rows(skip, length - snapshot.window_first))
                layer.values.put(placed.window_cells, values.rows(skip, length - snapshot.window_first))
            else:
                layer.keys.put(placed.cells, keys.head(length))
                layer.values.put(placed.cells, values.head(length))
        with self._lock:
            self._hits += 1
        return True

    def clear(self) -> None:
        """Forget every snapshot (a new coordinator term); the counters keep counting."""
        with self._lock:
            self._snapshots.clear()
            self._bytes = 0

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

    def _drop(self, name: SnapshotKey) -> None:
        snapshot = self._snapshots.pop(name, None)
        if snapshot is not None:
            self._bytes -= snapshot.nbytes
