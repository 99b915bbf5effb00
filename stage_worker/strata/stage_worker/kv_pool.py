"""The KV pool: the cells of a stage's layers, in the planned cache type, that its `parallel` slots share in blocks.

As in llama.cpp's unified KV cache, lanes do not multiply KV memory: the full-attention layers hold the context in
whole blocks of strata.kv_layout.BLOCK_TOKENS cells (and a partial last block for every further slot), and a slot
takes blocks as its sequence grows and gives them
back on reset (strata.stage_worker.kv_cells over strata.stage_worker.kv_blocks). Sliding-window layers keep their K
and V in a smaller space of their own, about `window * slots + slack` cells in whole blocks, where a block whose
positions have left every later query's window goes to the next one. The planner sized the pool with
ModelInfo.kv_bytes() from the same rule (strata.kv_layout); the stores (strata.stage_worker.kv_stores) allocate those
bytes. A resident window (strata.stage_worker.kv_resident), when kept, gives decode steps a compacted table of each
slot's chosen positions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from strata.gguf.model import UBATCH_TOKENS, CacheType
from strata.kv_layout import BLOCK_TOKENS, full_cells, window_space_cells
from strata.stage_worker.errors import ContextExceededError, PoolExhaustedError, UnknownSlotError
from strata.stage_worker.kv_cells import CellSpace, Extension, Piece, Placement, PrefixCells
from strata.stage_worker.kv_resident import ResidentShape, ResidentWindow
from strata.stage_worker.kv_stores import LayerCache, Store
from torch import Tensor


class Taken(NamedTuple):
    """A decode row's new cells: in the full-attention space, in the sliding-window space (0 without one), and its
    column in the table its attention reads (its position, or its column in the resident window's)."""

    full: int
    window: int
    column: int


class KVPool:
    """The context's cells per full-attention layer, fewer per sliding-window layer, shared by `parallel` slots in
    blocks of `block` cells."""

    def __init__(
        self,
        *,
        n_layers: int,
        context: int,
        parallel: int,
        key_width: int,
        value_width: int,
        type_k: CacheType,
        type_v: CacheType,
        dtype: torch.dtype,
        device: torch.device,
        window: int = 0,  # tokens a sliding-window layer sees; 0: none
        sliding: tuple[bool, ...] = (),  # per layer of this pool: attends over the window only
        window_slack: int = UBATCH_TOKENS,  # new rows a step may add beyond the slots' windows, as the plan counts
        block: int = BLOCK_TOKENS,  # cells per block; the plan counts BLOCK_TOKENS, tests take small ones
    ) -> None:
        if sliding and len(sliding) != n_layers:
            raise ValueError(f"the sliding flags name {len(sliding)} layers; the pool holds {n_layers}")
        self.context = context
        self.parallel = parallel
        self.sliding_window = window if any(sliding) else 0
        # Per slot, the changes made to it outside a step (reset, place, adopt): work a step launched ahead
        # (strata.stage_worker.decode_ahead) stands for its slots as they were when it was launched.
        self.revisions = [0] * parallel
        self.device = device
        self.block = block
        self.full = CellSpace(
            blocks=full_cells(context, slots=parallel, block=block) // block,
            block=block,
            parallel=parallel,
            context=context,
            window=0,
            device=device,
        )
        window_cells = window_space_cells(window=window, slots=parallel, slack=window_slack, block=block)
        self.window: CellSpace | None = None
        if window > 0 and any(sliding) and window_cells < self.full.cells:
            self.window = CellSpace(
                blocks=window_cells // block, block=block, parallel=parallel, context=context, window=window,
                device=device,
            )  # fmt: skip
        # Per layer: its cells are the window space's. Without that space a sliding layer keeps every position and
        # attention masks the window, as a full-attention layer's cells would.
        self.windowed = tuple(self.window is not None and flag for flag in (sliding or (False,) * n_layers))

        def cache(cells: int) -> LayerCache:
            return LayerCache(
                keys=Store(cache_type=type_k, cells=cells, width=key_width, device=device),
                values=Store(cache_type=type_v, cells=cells, width=value_width, device=device),
                dtype=dtype,
            )

        spaces = [self.window if windowed and self.window is not None else self.full for windowed in self.windowed]
        self.layers = [cache(space.cells) for space in spaces]
        for space in self._spaces():
            mine = [layer for layer, owner in zip(self.layers, spaces, strict=True) if owner is space]
            space.copy_block = partial(_copy_block, mine, block)
        self.resident: ResidentWindow | None = None  # keep_resident

    def keep_resident(self, shape: ResidentShape, *, n_head: int, head_dim: int, scales: list[float | None]) -> None:
        """Let decode steps attend over a resident window of each slot's full-attention positions
        (strata.stage_worker.kv_resident). `scales`: per layer of the pool, the score scale of a full-attention
        layer, which the window chooses by, or None for a sliding-window one."""
        if len(scales) != len(self.layers):
            raise ValueError(f"{len(scales)} layers' scales for a pool of {len(self.layers)} layers")
        if self.window is None and shape.recent < self.sliding_window:
            raise ValueError(
                f"the resident window's {shape.recent} recent positions must cover the sliding window of "
                f"{self.sliding_window}: its layers read the same compacted table"
            )
        chosen_by = [(layer, scale) for layer, scale in zip(self.layers, scales, strict=True) if scale is not None]
        self.resident = ResidentWindow(
            shape=shape, space=self.full, layers=[layer for layer, _ in chosen_by],
            scales=[scale for _, scale in chosen_by], n_head=n_head, head_dim=head_dim, dtype=self.layers[0].dtype,
        )  # fmt: skip

    @property
    def table(self) -> Tensor:
        """[parallel, context] the full-attention cells of each slot's positions (stale past a slot's length)."""
        return self.full.table

    @property
    def nbytes(self) -> int:
        """The stores' bytes, and the resident window's when it is kept."""
        stores = sum(layer.keys.nbytes + layer.values.nbytes for layer in self.layers)
        return stores + (0 if self.resident is None else self.resident.nbytes)

    @property
    def cell_bytes(self) -> int:
        """Bytes of one position over every layer this pool holds, K and V, as stored."""
        return sum(layer.keys.row_bytes + layer.values.row_bytes for layer in self.layers)

    @property
    def free_cells(self) -> int:
        """Free cells of the full-attention layers: what bounds how many positions the slots hold together."""
        return self.full.free_cells

    def fit(self, pieces: list[Piece]) -> list[Piece]:
        """The longest run of the pieces' positions, in order, that one part of a step may take now: all of them
        unless the sliding-window space is short (the full space refuses a step whole instead)."""
        return list(pieces) if self.window is None else self.window.fit(pieces)

    def sight(self, position: int) -> int:
        """The first position the sliding-window layers keep for a query at `position` (0 without their space)."""
        return 0 if self.window is None else self.window.sight(position)

    def length(self, slot: int) -> int:
        self._slot(slot)
        return self.full.length(slot)

    def check(self, *, slot: int, start_position: int, length: int) -> None:
        """Refuse a chunk that names an unknown slot, leaves a gap, runs past the context, or rolls back to where
        the sliding-window layers no longer hold what it sees."""
        held = self.length(slot)
        if start_position > held:
            raise ContextExceededError(
                f"slot {slot} holds {held} positions; a chunk cannot start at position {start_position}"
            )
        if start_position + length > self.context:
            raise ContextExceededError(
                f"positions {start_position}..{start_position + length - 1} of slot {slot} exceed the context "
                f"of {self.context}"
            )
        if self.window is not None and not self.window.holds_history(slot=slot, start=start_position):
            raise ContextExceededError(
                f"slot {slot} no longer holds positions {self.window.sight(start_position)}.."
                f"{self.window.first(slot) - 1} of its sliding window: a chunk at position {start_position} needs "
                "them; start the slot again from position 0"
            )

    def truncate(self, *, slot: int, position: int) -> None:
        """Give back the slot's blocks of positions `position` and later (a step truncates each of its slots before
        any of them takes blocks, so none reclaims another's positions that a rolled-back chunk still needs)."""
        self._slot(slot)
        for space in self._spaces():
            space.truncate(slot=slot, position=position)
        if self.resident is not None:
            self.resident.moved(slot, position)

    def extend(self, *, slot: int, start_position: int, length: int) -> Extension:
        """Truncate the slot to `start_position` and give it the cells of `length` positions in each space."""
        return self.extend_part([(slot, start_position, length)])[0]

    def extend_part(self, pieces: list[Piece]) -> list[Extension]:
        """One part of a step: each piece's slot truncated to its start and given the cells of its positions, in
        every space; all pieces or none."""
        for slot, start, length in pieces:
            self.check(slot=slot, start_position=start, length=length)
            if self.resident is not None:
                self.resident.prefilled(slot, start)
        full = self.full.extend(pieces)
        if self.window is None:
            return [Extension(full=Placement(new=new, cells=cells), window=None) for new, cells in full]
        try:
            window = self.window.extend(pieces)
        except PoolExhaustedError:
            self._undo(pieces)
            raise
        return [
            Extension(full=Placement(new=new, cells=cells), window=Placement(new=window_new, cells=window_cells))
            for (new, cells), (window_new, window_cells) in zip(full, window, strict=True)
        ]

    def take(self, *, slot: int, position: int) -> Taken:
        """A decode step's new cells for `slot` at `position`, on the host only: the step puts them in the tables."""
        return self.take_all([(slot, position)])[0]

    def take_all(self, positions: list[tuple[int, int]]) -> list[Taken]:
        """`take` for every (slot, position) of a decode step at once: all of them or none."""
        return [run[0] for run in self.take_runs([(slot, position, 1) for slot, position in positions])]

    def take_runs(self, pieces: list[Piece]) -> list[list[Taken]]:
        """`take_all` for a few positions a slot: per piece, each position's new cells, on the host only; all of them
        or none. Each slot is truncated to its piece's start first."""
        for slot, start, length in pieces:
            self.check(slot=slot, start_position=start, length=length)
        cells = self.full.take_runs(pieces)
        window = [[0] * length for _, _, length in pieces]
        if self.window is not None:
            try:
                window = self.window.take_runs(pieces)
            except PoolExhaustedError:
                self._undo(pieces)
                raise
        if self.resident is None:
            columns = [list(range(start, start + length)) for _, start, length in pieces]
        else:
            columns = self.resident.columns(pieces, records=all(length == 1 for _, _, length in pieces))
        return [
            [Taken(*cell) for cell in zip(full, mine, column, strict=True)]
            for full, mine, column in zip(cells, window, columns, strict=True)
        ]

    def prefix(self, *, slot: int, length: int) -> PrefixCells | None:
        """The cells of the slot's positions 0..length-1; None when the sliding-window layers no longer hold all
        that a query at `length` would see."""
        self._slot(slot)
        _, cells = self.full.held(slot=slot, end=length)
        if self.window is None:
            return PrefixCells(length=length, cells=cells)
        first, window_cells = self.window.held(slot=slot, end=length)
        if first > self.window.sight(length):
            return None
        return PrefixCells(length=length, cells=cells, window_first=first, window_cells=window_cells)

    def place(self, *, slot: int, length: int) -> PrefixCells:
        """Empty the slot and give it cells for positions 0..length-1 (only those still in sight in the sliding
        window's space), already in the tables: a restored prefix is written there."""
        self.check(slot=slot, start_position=0, length=length)
        self.revisions[slot] += 1
        self._forget(slot)
        try:
            new, _ = self.full.extend([(slot, 0, length)])[0]
            if self.window is None:
                return PrefixCells(length=length, cells=new)
            first, cells = self.window.place(slot=slot, length=length)
        except PoolExhaustedError:
            self.reset(slot)  # neither space holds a part of the prefix
            raise
        return PrefixCells(length=length, cells=new, window_first=first, window_cells=cells)

    def pin(self, *, slot: int, length: int) -> tuple[int, ...]:
        """The full-attention blocks of the slot's positions 0..length-1, held once more (a prefix snapshot's)."""
        self._slot(slot)
        return self.full.pin(slot=slot, end=length)

    def unpin(self, blocks: tuple[int, ...]) -> None:
        self.full.allocator.release(blocks)

    def adopt(self, *, slot: int, blocks: tuple[int, ...], length: int) -> PrefixCells:
        """Empty the slot and make it hold positions 0..length-1: in pinned `blocks` for the full-attention layers,
        without a copy, and in fresh cells of the sliding-window space for what a query at `length` sees (a restored
        prefix writes those)."""
        self.check(slot=slot, start_position=0, length=length)
        self.revisions[slot] += 1
        self._forget(slot)
        cells = self.full.adopt(slot=slot, blocks=blocks, length=length)
        if self.window is None:
            return PrefixCells(length=length, cells=cells)
        try:
            first, window_cells = self.window.place(slot=slot, length=length)
        except PoolExhaustedError:
            self.reset(slot)  # neither space holds a part of the prefix
            raise
        return PrefixCells(length=length, cells=cells, window_first=first, window_cells=window_cells)

    def on_short(self, release: Callable[[], bool] | None) -> None:
        """Let a holder of pinned blocks (the prefix cache) give some back when the full-attention space runs short."""
        self.full.allocator.on_short = release

    def reset(self, slot: int) -> None:
        self._slot(slot)
        self.revisions[slot] += 1
        self._forget(slot)
        for space in self._spaces():
            space.reset(slot)

    def _forget(self, slot: int) -> None:
        if self.resident is not None:
            self.resident.forget(slot)

    def _undo(self, pieces: list[Piece]) -> None:
        """Give back the full space's blocks of pieces the sliding-window space refused: both hold the same
        positions."""
        for slot, start, _ in pieces:
            self.full.truncate(slot=slot, position=start)

    def _spaces(self) -> list[CellSpace]:
        return [self.full] if self.window is None else [self.full, self.window]

    def _slot(self, slot: int) -> None:
        if not 0 <= slot < self.parallel:
            raise UnknownSlotError(f"slot {slot} does not exist; this stage has slots 0..{self.parallel - 1}")


def _copy_block(layers: list[LayerCache], size: int, source: int, target: int) -> None:
    """Block `source`'s rows, as stored, into block `target`, in every layer of one cell space."""
    rows = torch.arange(source * size, (source + 1) * size, device=layers[0].keys.values.device)
    into = rows + (target - source) * size
    for layer in layers:
        layer.keys.put(into, layer.keys.raw(rows))
        layer.values.put(into, layer.values.raw(rows))
