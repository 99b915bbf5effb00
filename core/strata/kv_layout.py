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
"""

from __future__ import annotations

BLOCK_TOKENS = 64


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
