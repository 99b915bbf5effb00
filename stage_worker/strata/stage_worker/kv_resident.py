"""The resident window: a slot's decode steps attend over some of its blocks, not all of them, so a step's attention
costs about the same at 128K positions as at 4K (issue 24's opt-in; after KVFlash's resident pool and Quest's
query-aware block choice).

A slot's decode step sees its first `sinks` blocks (attention sinks), `selected` blocks chosen from the rest by the
score below, and its recent positions (from a block boundary on: `recent` of them right after a choice, a block
more before the next). They sit in a table of their own, compacted: column c is the slot's c-th resident position,
and a step's kv_len is its column + 1. The attention kernel reads that table as it reads the pool's: K is rotated
when written, so a cell's position never enters q.k, and a sliding window masks the last `window` columns, which are
the last `window` positions while `recent` covers the window.

The choice, at a block boundary once the recent positions have grown a block past `recent`: every full block keeps,
per full-attention layer, the per-channel minimum and maximum of its keys, and Σ_d max(q_d · min_d, q_d · max_d)
bounds q.k for every key of the block (Quest's bound). The last one-row decode step of the slot recorded its query
in every full-attention layer (`LayerCache.queries`); each head's bounds over the candidate blocks go through a
softmax (an estimate of the share of attention each block would take), the shares are summed over the stage's
layers and heads, and the `selected` blocks with the largest sums are kept, in position order. One choice serves
every layer of the stage, so the table stays one table.

What stays exact: prefill chunks (and chunks after cached positions) attend over the pool's own table; a slot
attends over everything until its first decode step has recorded a query, and whenever it holds no more than
sinks + selected blocks plus `recent`. Every block stays in the pool: the window buys speed at depth, not room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from strata.kv_layout import ResidentBudget
from strata.stage_worker.kv_cells import CellSpace, Piece
from torch import Tensor

if TYPE_CHECKING:
    from strata.stage_worker.kv_stores import LayerCache

BOUND_CHUNK_BLOCKS = 256  # blocks whose key bounds are computed at once: bounds the transient memory of a long prompt


@dataclass(frozen=True)
class ResidentShape:
    """How many positions a slot's decode step sees at most, and of which kind, in blocks of `block` cells."""

    sinks: int  # blocks from position 0, always seen
    selected: int  # blocks chosen by score
    recent: int  # positions always seen at the end (a whole number of blocks)
    block: int

    def __post_init__(self) -> None:
        whole = self.block >= 1 and self.recent >= self.block and not self.recent % self.block
        if self.sinks < 0 or self.selected < 0 or not whole:
            raise ValueError(
                f"a resident window needs sinks and selected blocks of 0 or more and recent positions of whole blocks "
                f"of {self.block}, not {self.sinks} sinks, {self.selected} selected and {self.recent} recent"
            )

    @classmethod
    def of(cls, budget: ResidentBudget, *, block: int) -> ResidentShape:
        """The shape of a budget of positions in blocks of `block` (ResidentBudget.split)."""
        sinks, selected, recent = budget.split(block)
        return cls(sinks=sinks, selected=selected, recent=recent, block=block)

    @property
    def tokens(self) -> int:
        """Positions a decode step sees at most: the chosen blocks and the recent positions grown by a block."""
        return (self.sinks + self.selected) * self.block + self.recent + self.block


def score_bounds(queries: Tensor, bounds: Tensor) -> Tensor:
    """Per layer, head and candidate block, a bound on q.k over the block's keys: Σ_d max(q_d · min_d, q_d · max_d).

    queries [L, H, hd] (one slot's last query per layer), bounds [L, C, 2, Hkv, hd] (per candidate block, the min and
    max of its keys) -> [L, Hkv, H / Hkv, C] float32."""
    layers, heads, head_dim = queries.shape
    kv_heads = bounds.shape[3]
    q = queries.float().view(layers, kv_heads, heads // kv_heads, head_dim)  # [L, Hkv, G, hd]
    low = bounds[:, :, 0].float().permute(0, 2, 3, 1)  # [L, Hkv, hd, C]
    high = bounds[:, :, 1].float().permute(0, 2, 3, 1)
    return q.clamp(min=0) @ high + q.clamp(max=0) @ low


def block_shares(queries: Tensor, bounds: Tensor, *, scales: Tensor) -> Tensor:
    """The estimated share of attention of each candidate block (a softmax of its bounds over the candidates, per
    head), summed over layers and heads: score_bounds' arguments, and scales [L] each layer's score scale -> [C]."""
    bound = score_bounds(queries, bounds) * scales.float().view(-1, 1, 1, 1)
    return bound.softmax(dim=-1).sum(dim=(0, 1, 2))


def choose(shares: Tensor, *, candidates: Tensor, keep: int) -> Tensor:
    """The `keep` candidates of the largest shares (all of them when there are no more), in position order: on the
    device, so a choice never waits for the GPU."""
    if candidates.numel() <= keep:
        return candidates
    return candidates[torch.topk(shares, keep).indices].sort().values


class ResidentWindow:
    """The compacted tables of a pool's full-attention space, their slots' choices, and what the choice reads: the
    keys' bounds per block and the last queries per slot."""

    def __init__(
        self,
        *,
        shape: ResidentShape,
        space: CellSpace,
        layers: list[LayerCache],  # the full-attention layers of the space, in order
        scales: list[float],  # their score scales
        n_head: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        if space.block != shape.block:
            raise ValueError(f"the resident window counts blocks of {shape.block}; the space's are {space.block}")
        if not layers:
            raise ValueError("a resident window needs at least one full-attention layer to choose blocks by")
        self.shape = shape
        self.space = space
        self.layers = layers
        self.scales = torch.tensor(scales, dtype=torch.float32, device=space.device)
        parallel, context = space.table.shape
        device = space.device
        self.table = torch.zeros(parallel, context, dtype=torch.long, device=device)
        width = layers[0].keys.values.shape[1]
        self.kv_heads = width // head_dim
        self.head_dim = head_dim
        blocks = space.allocator.blocks
        # bfloat16 whatever the compute dtype (strata.kv_layout.BOUND_BYTES): the plan counts them so
        self.bounds = torch.zeros(len(layers), blocks, 2, self.kv_heads, head_dim, dtype=torch.bfloat16, device=device)
        self.queries = torch.zeros(len(layers), parallel, n_head, head_dim, dtype=dtype, device=device)
        for index, layer in enumerate(layers):
            layer.queries = self.queries[index]
        # per slot: the logical blocks it sees before its tail, in order (on the device; its length is host metadata)
        self._prefix: list[Tensor | None] = [None] * parallel
        self._tail = [0] * parallel  # per slot: the first of its recent positions (a block boundary)
        self._stale = [True] * parallel  # the slot's row must be built again before its next decode step
        self._queried = [False] * parallel  # a decode step of the slot's current sequence recorded its queries
        self._bounded = [0] * parallel  # the slot's first blocks whose bounds are current
        self.choices = 0  # choices made, for the bench and the tests

    @property
    def nbytes(self) -> int:
        """Device bytes beyond the pool's stores that the plan counts: the bounds (the queries are a few KB, and the
        table is the size of the pool's own)."""
        return self.bounds.numel() * self.bounds.element_size()

    def seen(self, slot: int, end: int) -> list[int]:
        """The positions before `end` that the slot's next decode step sees, in its row's order: the chosen blocks',
        then the recent ones (read back from the device: for tests and reports, not for a step)."""
        positions: list[int] = self._positions(slot, end).tolist()
        return positions

    def _positions(self, slot: int, end: int) -> Tensor:
        size, device = self.shape.block, self.table.device
        recent = torch.arange(self._tail[slot], end, device=device)
        prefix = self._prefix[slot]
        if prefix is None:
            return recent
        chosen = (prefix[:, None] * size + torch.arange(size, device=device)).flatten()
        return torch.cat([chosen, recent])

    def forget(self, slot: int) -> None:
        """The slot holds another sequence now (reset, a restored prefix): nothing of its choice or queries stays."""
        self.prefilled(slot, 0)
        self._queried[slot] = False

    def moved(self, slot: int, position: int) -> None:
        """The slot keeps its positions before `position` only (a rollback): a row whose chosen blocks reach past it
        is built again, bounds past it computed again."""
        self._bounded[slot] = min(self._bounded[slot], position // self.shape.block)
        if position < self._tail[slot]:
            self._stale[slot] = True

    def prefilled(self, slot: int, start: int) -> None:
        """A chunk from `start` went through the pool's table, not this one: the row is built again."""
        self.moved(slot, start)
        self._stale[slot] = True

    def columns(self, pieces: list[Piece], *, records: bool) -> list[list[int]]:
        """Per piece of a decode step, its positions' columns in the compacted table (its row built, or its blocks
        chosen, again first where due). `records`: the step records each slot's queries (a one-row step)."""
        out = []
        for slot, start, length in pieces:
            self.moved(slot, start)  # the step truncated the slot to its start
            if self._stale[slot] or (self._queried[slot] and self._next_tail(start) > self._tail[slot]):
                self._build(slot, start)
            prefix = self._prefix[slot]
            base = (0 if prefix is None else prefix.numel()) * self.shape.block - self._tail[slot]
            out.append([base + position for position in range(start, start + length)])
            self._queried[slot] = self._queried[slot] or records
        return out

    def _next_tail(self, start: int) -> int:
        """The first recent position of a choice made for a step at `start`; 0 while no block is left to choose
        from."""
        size = self.shape.block
        tail = max(0, (start - self.shape.recent) // size * size)
        return tail if tail > self.shape.sinks * size else 0

    def _build(self, slot: int, start: int) -> None:
        """Choose the slot's blocks for a step at `start` (once it recorded queries) and lay their cells and its
        recent positions out in its row; until then, or with nothing to choose from, every position in order. All on
        the device: the host knows how many blocks are chosen, never which, so it never waits for the GPU."""
        size, sinks = self.shape.block, self.shape.sinks
        tail = self._next_tail(start) if self._queried[slot] else 0
        prefix = None
        if tail:
            sink_blocks = torch.arange(sinks, device=self.table.device)
            prefix = torch.cat([sink_blocks, self._choose(slot, sinks, tail // size)])
        self._prefix[slot], self._tail[slot] = prefix, tail
        positions = self._positions(slot, start)
        self.table[slot, : positions.numel()] = self.space.table[slot].index_select(0, positions)
        self._stale[slot] = False

    def _choose(self, slot: int, first: int, end: int) -> Tensor:
        """The chosen of the slot's logical blocks first..end-1 (all full), in order."""
        candidates = torch.arange(first, end, device=self.table.device)
        if end - first <= self.shape.selected:
            return candidates  # every block fits: nothing to score
        self._bound(slot, end)
        physical = self.space.table[slot, candidates * self.shape.block] // self.shape.block
        shares = block_shares(self.queries[:, slot], self.bounds.index_select(1, physical), scales=self.scales)
        self.choices += 1
        return choose(shares, candidates=candidates, keep=self.shape.selected)

    def _bound(self, slot: int, end: int) -> None:
        """Compute the key bounds of the slot's blocks up to `end` (logical, all full) not yet computed. Their cells
        come from the pool's table, on the device."""
        size = self.shape.block
        for first in range(self._bounded[slot], end, BOUND_CHUNK_BLOCKS):
            count = min(end, first + BOUND_CHUNK_BLOCKS) - first
            cells = self.space.table[slot, first * size : (first + count) * size]
            physical = cells[::size] // size
            for index, layer in enumerate(self.layers):
                keys = layer.keys.read(cells, dtype=self.bounds.dtype).view(count, size, self.kv_heads, -1)
                self.bounds[index, physical, 0] = keys.amin(dim=1)
                self.bounds[index, physical, 1] = keys.amax(dim=1)
        self._bounded[slot] = max(self._bounded[slot], end)
