"""One space of KV cells and which slot holds which, in blocks: each slot's blocks in position order (its block
table) over a BlockAllocator, and the same on the device as a table of cells (row = slot, column = position) that
attention reads in place.

Position p of a slot lives in its block p // size at offset p % size, so its cell is `block * size + p % size`: the
table the kernels read is the block table spelled out per position. A slot grows by whole blocks and gives them
back when it is truncated or reset. A prefix snapshot pins a slot's blocks and another slot adopts them, without a
copy; a slot about to write into a block someone else also holds (the partial last block of a shared prefix) first
copies it to a block of its own (copy on write, `copy_block`).

A pool has a space for its full-attention layers (the context in whole blocks; a slot may hold every position of the
context) and, when the stage has sliding-window layers, a space of their own (strata.kv_layout.window_cells, the
planner's count). A block whose positions a slot's next query can no longer see (all before `length - window + 1`)
is dead: a slot releases its own dead blocks when it next grows, and a growth short of blocks reclaims the dead
blocks of the slots that are not growing in the same part (theirs are computed; a growing slot's rows still read
what its chunk sees). So between steps a slot holds at most the blocks its window straddles, and the space's spare
blocks take a step's new rows (strata.stage_worker.engine splits a step whose rows would not fit, `fit`). Dead
blocks stay in place until someone needs them, so a prefix snapshot taken right after a prefill still finds the
positions before the last chunk. The table keeps its columns of dead positions (stale, pointing at cells now reused):
attention never reads before a query's window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from strata.stage_worker.errors import ContextExceededError
from strata.stage_worker.kv_blocks import BlockAccountingError, BlockAllocator
from torch import Tensor

Piece = tuple[int, int, int]  # (slot, start position, length): a chunk, or the part of one that a step part takes


@dataclass(frozen=True)
class Placement:
    """Where a chunk went in one cell space."""

    new: Tensor  # [T] the cells its positions are written to
    cells: Tensor  # the cells of every position the space holds for the slot, first..end-1 (from 0: all of them)


@dataclass(frozen=True)
class Extension:
    full: Placement  # the full-attention layers' cells
    window: Placement | None  # the sliding-window layers' cells, when they have a space of their own


@dataclass(frozen=True)
class PrefixCells:
    """The cells of a slot's first `length` positions: all of them for full-attention layers; for sliding-window
    layers, from `window_first` on (at least what a query at `length` sees)."""

    length: int
    cells: Tensor  # [length]
    window_first: int = 0
    window_cells: Tensor | None = None  # [length - window_first]


def _blocks_to(position: int, size: int) -> int:
    """Blocks that positions 0..position-1 reach."""
    return -(-position // size)


class CellSpace:
    """`blocks` blocks of `block` cells shared by `parallel` slots; with a window, a slot keeps only the blocks still
    in sight."""

    def __init__(
        self, *, blocks: int, block: int, parallel: int, context: int, window: int, device: torch.device
    ) -> None:
        self.block = block
        self.cells = blocks * block
        self.parallel = parallel
        self.window = window  # 0: every position stays in sight; else a query at p sees p - window + 1..p
        self.device = device
        self.allocator = BlockAllocator(blocks=blocks, size=block)
        self._blocks: list[list[int]] = [[] for _ in range(parallel)]  # per slot: logical blocks base.. in order
        self._base = [0] * parallel  # the logical block (position // block) of a slot's first held block
        self._first = [0] * parallel  # the first position a slot holds; == its length when it holds no block
        self._length = [0] * parallel
        # Decode steps write their new cell into the table on the device themselves; prefill chunks from the host.
        self.table = torch.zeros(parallel, context, dtype=torch.long, device=device)
        # Copies block src's rows to block dst in every layer of this space (the pool's stores).
        self.copy_block: Callable[[int, int], None] | None = None

    @property
    def free_cells(self) -> int:
        return self.allocator.free_blocks * self.block

    def blocks_of(self, slot: int) -> tuple[int, ...]:
        """The slot's block table: its blocks, the first holding position base * block."""
        return tuple(self._blocks[slot])

    def length(self, slot: int) -> int:
        return self._length[slot]

    def first(self, slot: int) -> int:
        """The first position the slot still holds."""
        return self._first[slot]

    def sight(self, position: int) -> int:
        """The first position a query at `position` sees."""
        return max(0, position - self.window + 1) if self.window else 0

    def holds_history(self, *, slot: int, start: int) -> bool:
        """Whether the slot still holds every earlier position that a chunk starting at `start` sees."""
        return start == 0 or self._first[slot] <= self.sight(start)

    def cell(self, *, slot: int, position: int) -> int:
        block = self._blocks[slot][position // self.block - self._base[slot]]
        return block * self.block + position % self.block

    def truncate(self, *, slot: int, position: int) -> None:
        """Give back the blocks that only hold positions `position` and later (the rest of a partial block is
        written over)."""
        if position >= self._length[slot]:
            return
        held = self._blocks[slot]
        keep = _blocks_to(position, self.block) - self._base[slot] if position > self._first[slot] else 0
        self.allocator.release(reversed(held[keep:]))
        del held[keep:]
        self._length[slot] = position
        if not held:
            self._first[slot] = position

    def fit(self, pieces: list[Piece]) -> list[Piece]:
        """The longest run of the pieces' positions, in order, that the space can take now, counting the dead
        blocks that growing releases (the last piece possibly cut short). Each slot is already truncated to its
        piece's start, as a step does before it takes cells."""
        available = self.allocator.free_blocks + sum(self._dead(slot) for slot in range(self.parallel))
        part: list[Piece] = []
        for slot, start, length in pieces:
            reach = self._reach(slot, start)
            taken = min(length, (reach + available) * self.block - start)
            if taken < 1:
                break
            part.append((slot, start, taken))
            available -= _blocks_to(start + taken, self.block) - reach
            if taken < length:
                break
        return part

    def grow(self, pieces: list[Piece]) -> None:
        """Truncate each piece's slot to its start, release what has left its sight, and give it the blocks of the
        piece's positions; all of them or, when the blocks do not suffice, none (PoolExhaustedError names the first
        slot left short)."""
        growing = {slot for slot, _, _ in pieces}
        for slot, start, _ in pieces:
            self.truncate(slot=slot, position=start)
            self._release_before(slot, self.sight(start))
        shared = {slot for slot, start, _ in pieces if self._shared_tail(slot, start)}
        needs = [
            (slot, _blocks_to(start + length, self.block) - self._reach(slot, start) + (slot in shared))
            for slot, start, length in pieces
        ]
        if sum(count for _, count in needs) > self.allocator.free_blocks and self.window:
            for other in range(self.parallel):
                if other not in growing:
                    self._release_before(other, self.sight(self._length[other]))
        self.allocator.check(needs)
        for (slot, start, length), (_, count) in zip(pieces, needs, strict=True):
            if slot in shared:
                self._copy_tail(slot, start)
                count -= 1
            if not self._blocks[slot]:
                self._base[slot], self._first[slot] = start // self.block, start
            self._blocks[slot].extend(self.allocator.allocate(count, slot=slot))
            self._length[slot] = start + length

    def extend(self, pieces: list[Piece]) -> list[tuple[Tensor, Tensor]]:
        """`grow`, then put the new positions' cells in the table; per piece (the new cells, the cells of every
        position the slot holds, first..end-1)."""
        self.grow(pieces)
        placed = []
        for slot, start, length in pieces:
            new = self._cells(slot, start, start + length)
            self.table[slot, start : start + length] = new
            placed.append((new, self.table[slot, self._first[slot] : start + length]))
        return placed

    def take_runs(self, pieces: list[Piece]) -> list[list[int]]:
        """A decode step's new cells, on the host only (the step puts them in the table): per piece, its positions'
        (one a slot, or a few: a step that verifies drafts)."""
        self.grow(pieces)
        return [
            [self.cell(slot=slot, position=position) for position in range(start, start + length)]
            for slot, start, length in pieces
        ]

    def held(self, *, slot: int, end: int) -> tuple[int, Tensor]:
        """(first, the cells of positions first..end-1): what the slot still holds of its first `end` positions."""
        if not 1 <= end <= self.length(slot):
            raise ContextExceededError(
                f"slot {slot} holds {self.length(slot)} positions; a prefix of {end} is not there"
            )
        first = min(self._first[slot], end)
        return first, self.table[slot, first:end]

    def place(self, *, slot: int, length: int) -> tuple[int, Tensor]:
        """Empty the slot and give it cells for the positions of 0..length-1 that a query at `length` sees (a
        restored prefix); returns (first, their cells), already in the table."""
        self.reset(slot)
        first = self.sight(length)
        self.grow([(slot, first, length - first)])
        cells = self._cells(slot, first, length)
        self.table[slot, first:length] = cells
        return first, cells

    def pin(self, *, slot: int, end: int) -> tuple[int, ...]:
        """One more hold on each block of the slot's positions 0..end-1 (a prefix snapshot); the last may be partial."""
        if self._first[slot] or not 1 <= end <= self._length[slot]:
            raise ContextExceededError(
                f"slot {slot} holds positions {self._first[slot]}..{self._length[slot] - 1}; a prefix of {end} is "
                "not all there"
            )
        blocks = tuple(self._blocks[slot][: _blocks_to(end, self.block)])
        for block in blocks:
            self.allocator.share(block)
        return blocks

    def adopt(self, *, slot: int, blocks: tuple[int, ...], length: int) -> Tensor:
        """Empty the slot and make it hold positions 0..length-1 in `blocks` (pinned ones, now held once more), already
        in the table; returns their cells. Its first write into a block it shares copies that block."""
        if len(blocks) != _blocks_to(length, self.block):
            raise ValueError(f"{length} positions take {_blocks_to(length, self.block)} blocks, not {len(blocks)}")
        self.reset(slot)
        for block in blocks:
            self.allocator.share(block)
        self._blocks[slot] = list(blocks)
        self._length[slot] = length
        cells = self._cells(slot, 0, length)
        self.table[slot, :length] = cells
        return cells

    def reset(self, slot: int) -> None:
        self.truncate(slot=slot, position=0)
        self._first[slot] = self._length[slot] = 0

    def _cells(self, slot: int, start: int, end: int) -> Tensor:
        """The cells of the slot's positions start..end-1, from its block table."""
        positions = torch.arange(start, end)
        blocks = torch.tensor(self._blocks[slot], dtype=torch.long)
        cells = blocks[positions // self.block - self._base[slot]] * self.block + positions % self.block
        return cells.to(self.device)

    def _shared_tail(self, slot: int, start: int) -> bool:
        """Whether writing position `start` of a slot truncated there lands in a block another holder shares."""
        held = self._blocks[slot]
        return bool(start % self.block and held) and self.allocator.refcount(held[-1]) > 1

    def _copy_tail(self, slot: int, start: int) -> None:
        """Give the slot a block of its own in place of its shared last one, the positions before `start` copied."""
        if self.copy_block is None:
            raise BlockAccountingError("a shared block must be copied before a write, and this space has no stores")
        held = self._blocks[slot]
        (own,) = self.allocator.allocate(1, slot=slot)
        self.copy_block(held[-1], own)
        self.allocator.release([held[-1]])
        held[-1] = own
        low = max(self._first[slot], start - start % self.block)
        self.table[slot, low:start] = self._cells(slot, low, start)

    def _reach(self, slot: int, start: int) -> int:
        """The logical block a slot truncated to `start` takes first: past its last held block, or, holding none
        that the position's window reaches, the block of `start` itself."""
        end = self._base[slot] + len(self._blocks[slot])
        if self._blocks[slot] and end > self.sight(start) // self.block:
            return end
        return start // self.block

    def _dead(self, slot: int) -> int:
        """Held blocks whose positions the slot's next query no longer sees."""
        if not self.window:
            return 0
        return max(0, min(len(self._blocks[slot]), self.sight(self._length[slot]) // self.block - self._base[slot]))

    def _release_before(self, slot: int, position: int) -> None:
        held = self._blocks[slot]
        dead = min(len(held), position // self.block - self._base[slot])
        if dead <= 0:
            return
        self.allocator.release(reversed(held[:dead]))
        del held[:dead]
        self._base[slot] += dead
        self._first[slot] = max(self._first[slot], self._base[slot] * self.block) if held else self._length[slot]
