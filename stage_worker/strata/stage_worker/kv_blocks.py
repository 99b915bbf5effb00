"""Blocks of KV cells: a free list and a reference count per block, the one place a cell space takes and returns them.

Block b is cells b * size .. b * size + size - 1 of every layer's stores, so a slot's table keeps naming cells
(`block * size + offset`) and attention reads it unchanged. A block is free at count 0; a slot that holds it counts
1, and a block several holders share (a prefix snapshot and the slots it was restored into) counts each of them, so
it returns to the free list only when the last one lets go. Holders that may let go on demand (the prefix cache)
register `on_short`: a growth short of blocks asks it to, before it refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from strata.stage_worker.errors import PoolExhaustedError


class BlockAccountingError(RuntimeError):
    """A block was let go more often than it was held: a bug in a cell space, never a client's doing."""


class BlockAllocator:
    """`blocks` blocks of `size` cells; hands out the lowest free ones first (a stack)."""

    def __init__(self, *, blocks: int, size: int) -> None:
        if blocks < 1 or size < 1:
            raise ValueError(f"a KV block space needs at least one block of at least one cell, not {blocks} of {size}")
        self.blocks = blocks
        self.size = size
        self._free: list[int] = list(range(blocks - 1, -1, -1))
        self._counts = [0] * blocks
        # Lets go of some held blocks (the least recently used prefix snapshot); False: it holds none any more.
        self.on_short: Callable[[], bool] | None = None

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._counts[block]

    def check(self, needs: Iterable[tuple[int, int]]) -> None:
        """Refuse, before anything is taken, the first of `needs` ((slot, blocks), in the order they would be taken)
        that the free blocks cannot cover, once `on_short` has let go of what it can."""
        needs = list(needs)
        total = sum(count for _, count in needs)
        while total > len(self._free) and self.on_short is not None and self.on_short():
            pass
        free = len(self._free)
        for slot, count in needs:
            if count > free:
                raise PoolExhaustedError(
                    f"slot {slot} needs {count} KV blocks ({count * self.size} cells) but only {free} of "
                    f"{self.blocks} blocks are free"
                )
            free -= count

    def allocate(self, count: int, *, slot: int) -> list[int]:
        """`count` free blocks, each held once, for `slot` (named in the error when too few are free)."""
        self.check([(slot, count)])
        taken = [self._free.pop() for _ in range(count)]
        for block in taken:
            self._counts[block] = 1
        return taken

    def share(self, block: int) -> None:
        """One more holder of a held block."""
        if self._counts[block] < 1:
            raise BlockAccountingError(f"block {block} is free; only a held block can be shared")
        self._counts[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """One holder fewer of each block; a block no one holds goes back on the free list."""
        for block in blocks:
            if self._counts[block] < 1:
                raise BlockAccountingError(f"block {block} is released more often than it was held")
            self._counts[block] -= 1
            if not self._counts[block]:
                self._free.append(block)
