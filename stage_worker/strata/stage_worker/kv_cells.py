"""One space of KV cells and which slot holds which: a free list, each slot's cells in position order, and the same
on the device as a table (row = slot, column = position) that attention reads in place.

A pool has a space for its full-attention layers (`context` cells: a slot may hold every position of the context)
and, when the stage has sliding-window layers, a space of their own of `window * slots + slack` cells, the planner's
count (strata.gguf.model.SlidingWindow.cells). A position a slot's next query can no longer see (before
`length - window + 1`) is dead: a slot releases its own dead cells when it next grows, and a slot short of cells
reclaims the other slots' dead ones. So between steps a slot's live positions are at most window - 1, and the
slack takes a step's new rows (strata.stage_worker.engine splits a step whose rows would not fit). Dead cells stay
in place until someone needs them, so a prefix snapshot taken right after a prefill still finds the positions before
the last chunk. The table keeps its columns of dead positions (stale, pointing at cells now reused): attention never
reads before a query's window.
"""

from __future__ import annotations

import torch
from strata.stage_worker.errors import ContextExceededError, PoolExhaustedError
from torch import Tensor


class CellSpace:
    """`cells` cells shared by `parallel` slots; with a window, a slot keeps only the positions still in sight."""

    def __init__(self, *, cells: int, parallel: int, context: int, window: int, device: torch.device) -> None:
        self.cells = cells
        self.parallel = parallel
        self.window = window  # 0: every position stays in sight; else a query at p sees p - window + 1..p
        self.device = device
        self._free: list[int] = list(range(cells - 1, -1, -1))  # a stack: pop() hands out low cells first
        self._held: list[list[int]] = [[] for _ in range(parallel)]  # cells of positions first..length-1
        self._first: list[int] = [0] * parallel
        # Decode steps write their new cell into the table on the device themselves; prefill chunks from the host.
        self.table = torch.zeros(parallel, context, dtype=torch.long, device=device)

    @property
    def free_cells(self) -> int:
        return len(self._free)

    def length(self, slot: int) -> int:
        return self._first[slot] + len(self._held[slot])

    def first(self, slot: int) -> int:
        """The first position the slot still holds."""
        return self._first[slot]

    def sight(self, position: int) -> int:
        """The first position a query at `position` sees."""
        return max(0, position - self.window + 1) if self.window else 0

    def holds_history(self, *, slot: int, start: int) -> bool:
        """Whether the slot still holds every earlier position that a chunk starting at `start` sees."""
        return start == 0 or self._first[slot] <= self.sight(start)

    def room(self) -> int:
        """New positions the slots may take now: free cells and dead ones."""
        if not self.window:
            return len(self._free)
        live = sum(min(self.length(slot), self.window - 1) for slot in range(self.parallel))
        return self.cells - live

    def truncate(self, *, slot: int, position: int) -> None:
        """Give back the cells of positions `position` and later."""
        held = self._held[slot]
        keep = max(0, position - self._first[slot])
        self._free.extend(reversed(held[keep:]))
        del held[keep:]
        if not held:
            self._first[slot] = min(self._first[slot], position)

    def extend(self, *, slot: int, start: int, length: int) -> tuple[Tensor, Tensor]:
        """Truncate the slot to `start`, release what has left its sight, take `length` cells; returns (the new cells,
        the cells of every position held, first..end-1)."""
        self.truncate(slot=slot, position=start)
        self._release_before(slot, self.sight(start))
        held = self._held[slot]
        held.extend(self._take(length, slot=slot))
        as_tensor = torch.tensor(held, dtype=torch.long, device=self.device)
        new = as_tensor[start - self._first[slot] :]
        self.table[slot, start : start + length] = new
        return new, as_tensor

    def take(self, *, slot: int, position: int) -> int:
        """A decode step's one new cell for `slot` at `position`, on the host only: the step puts it in the table."""
        self.truncate(slot=slot, position=position)
        self._release_before(slot, self.sight(position))
        cell = self._take(1, slot=slot)[0]
        self._held[slot].append(cell)
        return cell

    def held(self, *, slot: int, end: int) -> tuple[int, Tensor]:
        """(first, the cells of positions first..end-1): what the slot still holds of its first `end` positions."""
        if not 1 <= end <= self.length(slot):
            raise ContextExceededError(
                f"slot {slot} holds {self.length(slot)} positions; a prefix of {end} is not there"
            )
        first = min(self._first[slot], end)
        return first, torch.tensor(self._held[slot][: end - first], dtype=torch.long, device=self.device)

    def place(self, *, slot: int, length: int) -> tuple[int, Tensor]:
        """Empty the slot and give it cells for the positions of 0..length-1 that a query at `length` sees (a
        restored prefix); returns (first, their cells), already in the table."""
        self.reset(slot)
        first = self.sight(length)
        cells = self._take(length - first, slot=slot)
        self._first[slot] = first
        self._held[slot] = cells
        as_tensor = torch.tensor(cells, dtype=torch.long, device=self.device)
        self.table[slot, first:length] = as_tensor
        return first, as_tensor

    def reset(self, slot: int) -> None:
        self.truncate(slot=slot, position=0)
        self._first[slot] = 0

    def _release_before(self, slot: int, position: int) -> None:
        held = self._held[slot]
        dead = min(len(held), position - self._first[slot])
        if dead <= 0:
            return
        self._free.extend(reversed(held[:dead]))
        del held[:dead]
        self._first[slot] += dead

    def _take(self, count: int, *, slot: int) -> list[int]:
        if count > len(self._free) and self.window:
            for other in range(self.parallel):
                self._release_before(other, self.sight(self.length(other)))
        if count > len(self._free):
            raise PoolExhaustedError(
                f"slot {slot} needs {count} KV cells but only {len(self._free)} of {self.cells} are free"
            )
        return [self._free.pop() for _ in range(count)]
