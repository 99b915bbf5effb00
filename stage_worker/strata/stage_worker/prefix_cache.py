"""Prefix snapshots: this stage's K and V rows of a slot's first N positions, kept to be restored into another slot.

Agents and chat clients resend the same system prompt and history every turn. After a prefill the coordinator asks
every stage to keep the KV of a chunk-aligned token prefix for its own layers; a later request that starts with the
same tokens has it restored by command into its slot and prefills only the rest. KV never crosses the wire: each
stage restores what it kept itself.

A snapshot is the rows exactly as stored (q8_0's int8 values and f16 scales alike), so a restored slot reads back
bit-identical to the prefill that wrote it. Its size is N times the bytes of one position of this stage's layers: it
follows the tokens used, not the context. Snapshots are filed under (plan generation, the coordinator's hash of the
prefix's token ids); a stage holds them within a byte budget, dropping the least recently used first, and forgets
them all when a new coordinator term is accepted (strata.stage_worker.server), so none crosses a term.
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
        """Keep the first `length` positions of `slot`; False when the snapshot alone is over the budget."""
        cells = pool.prefix_cells(slot=slot, length=length)
        name = (generation, key)
        with self._lock:
            held = self._snapshots.get(name)
            if held is not None and held.length >= length:
                self._snapshots.move_to_end(name)
                return True
        if length * pool.cell_bytes > self.budget_bytes:
            return False
        snapshot = Snapshot(
            length=length,
            keys=tuple(layer.keys.raw(cells) for layer in pool.layers),
            values=tuple(layer.values.raw(cells) for layer in pool.layers),
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
            if snapshot is None or not 1 <= length <= snapshot.length:
                self._misses += 1
                return False
            self._snapshots.move_to_end((generation, key))
        try:
            # Truncates the slot and takes fresh cells, writing them into the device cell table as a prefill does.
            cells, _ = pool.extend(slot=slot, start_position=0, length=length)
        except PoolExhaustedError:
            with self._lock:
                self._misses += 1
            return False
        for layer, keys, values in zip(pool.layers, snapshot.keys, snapshot.values, strict=True):
            layer.keys.put(cells, keys.head(length))
            layer.values.put(cells, values.head(length))
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
