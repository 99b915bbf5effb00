"""How many KV cells a stage's paged pool holds: the one rule the planner prices and the stage allocates.

A stage hands out KV cells in blocks of BLOCK_TOKENS consecutive positions (strata.stage_worker.kv_blocks): a block
is one contiguous range of every layer's rows, the unit a prefix is shared in and a host tier would move. So a space
holds whole blocks:
- the full-attention layers' space holds the context in whole blocks, plus one block per further slot: the slots
  share it, and each may leave the rest of its last block unused, so any lengths that sum to the context still fit
  (what a pool of single cells promised);
- a sliding-window layer's space holds, per slot, the blocks a window of positions can straddle at any alignment,
  `ceil(window / block) + 1`, plus the blocks of one micro-batch of new rows; never more than the full space (then
  the sliding layers simply use the full one).
Paging costs at most a block per slot in each space (0.6% at 4 slots and 32K), the price of whole blocks.

A resident window (spec.kvCache.residentWindow; strata.stage_worker.kv_resident) lets decode attend over some of a
slot's blocks: it keeps, per full-attention layer and block, the minimum and maximum of the block's keys in bfloat16
(`resident_bytes_per_cell`, about 3% of a q8_0 block) to choose them by. Every block stays in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 64
BOUND_BYTES = 2  # a key bound is stored in bfloat16


@dataclass(frozen=True)
class ResidentBudget:
    """What a decode step of a slot sees at most: `tokens` positions, of them the first `sink_tokens` and the last
    `recent_tokens`, and blocks chosen between them."""

    tokens: int
    sink_tokens: int = 64
    recent_tokens: int = 1024

    def split(self, block: int = BLOCK_TOKENS) -> tuple[int, int, int]:
        """(sink blocks, chosen blocks, recent positions): the sinks and recent positions rounded up to whole blocks,
        what is left of `tokens` chosen, less the block the recent positions grow by before the next choice (so a step
        never sees more than `tokens`). ValueError when nothing is left to choose."""
        if min(self.tokens, self.sink_tokens, self.recent_tokens) < 0:
            raise ValueError(
                f"a resident window's tokens ({self.tokens}), sink tokens ({self.sink_tokens}) and recent tokens "
                f"({self.recent_tokens}) must not be negative"
            )
        sinks, recent = blocks_for(self.sink_tokens, block=block), max(1, blocks_for(self.recent_tokens, block=block))
        selected = (self.tokens - (sinks + recent + 1) * block) // block
        if selected < 1:
            raise ValueError(
                f"a resident window of {self.tokens} tokens leaves no block to choose after {sinks * block} sink and "
                f"{(recent + 1) * block} recent tokens (blocks of {block}; the recent ones grow by a block between "
                "choices)"
            )
        return sinks, selected, recent * block


def resident_bytes_per_cell(key_width: int, *, block: int = BLOCK_TOKENS) -> int:
    """Bytes a full-attention layer's resident window keeps per cell: its block's key minimum and maximum, shared by
    the block's cells."""
    return -(-2 * key_width * BOUND_BYTES // block)


def blocks_for(positions: int, *, block: int = BLOCK_TOKENS) -> int:
    """Blocks that hold `positions` positions from a block boundary."""
    return -(-positions // block)


def full_cells(context: int, *, slots: int, block: int = BLOCK_TOKENS) -> int:
    """Cells of the full-attention space: the context in whole blocks, and a partial last block for every slot."""
    return (blocks_for(context, block=block) + slots - 1) * block


def window_space_cells(*, window: int, slots: int, slack: int, block: int = BLOCK_TOKENS) -> int:
    """Cells a sliding-window space needs: every slot's window at its worst alignment plus `slack` new rows, in whole
    blocks."""
    per_slot = blocks_for(window, block=block) + 1
    return (slots * per_slot + blocks_for(slack, block=block)) * block


def window_cells(*, window: int, slots: int, context: int, slack: int, block: int = BLOCK_TOKENS) -> int:
    """Cells a sliding-window layer holds: its own space's, or the full space's when that is no larger."""
    needed = window_space_cells(window=window, slots=slots, slack=slack, block=block)
    return min(full_cells(context, slots=slots, block=block), needed)
