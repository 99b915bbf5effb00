"""The paged allocator: slots grow by whole blocks, give them back, share them by count, and an exhausted space says
which slot needed what before it takes anything."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from strata.stage_worker.errors import PoolExhaustedError
from strata.stage_worker.kv_blocks import BlockAccountingError, BlockAllocator
from strata.stage_worker.kv_cells import CellSpace, Piece

CPU = torch.device("cpu")
BLOCK = 4


def space(*, blocks: int = 6, parallel: int = 2, window: int = 0, context: int = 24) -> CellSpace:
    return CellSpace(blocks=blocks, block=BLOCK, parallel=parallel, context=context, window=window, device=CPU)


@dataclass(frozen=True)
class GrowthCase:
    parts: list[list[Piece]]  # extended in order
    blocks: dict[int, tuple[int, ...]]  # slot -> its block table afterwards
    free_blocks: int
    resets: tuple[int, ...] = ()  # slots reset after the parts
    window: int = 0


GROWTH_CASES = [
    pytest.param(
        GrowthCase(parts=[[(0, 0, 5)]], blocks={0: (0, 1), 1: ()}, free_blocks=4),
        id="five positions take two whole blocks",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 5)], [(0, 5, 3)]], blocks={0: (0, 1)}, free_blocks=4),
        id="growing inside the last block takes no new one",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 8)], [(0, 8, 1)]], blocks={0: (0, 1, 2)}, free_blocks=3),
        id="the position after a full block takes the next block",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 4), (1, 0, 4)], [(0, 4, 2)]], blocks={0: (0, 2), 1: (1,)}, free_blocks=3),
        id="slots interleave blocks from one free list, lowest first",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 10)], [(0, 5, 1)]], blocks={0: (0, 1)}, free_blocks=4),
        id="a rollback into a block keeps that block and returns the later ones",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 10), (1, 0, 3)]], resets=(0,), blocks={0: (), 1: (3,)}, free_blocks=5),
        id="a reset returns every block of the slot and no other",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 10)], [(0, 10, 1)]], window=4, blocks={0: (1, 2)}, free_blocks=4),
        id="a window slot returns the blocks its next query no longer sees when it grows",
    ),
    pytest.param(
        GrowthCase(parts=[[(0, 0, 9)], [(0, 9, 1)]], window=7, blocks={0: (0, 1, 2)}, free_blocks=3),
        id="a window slot keeps a block while one of its positions is in sight",
    ),
]


@pytest.mark.parametrize("case", GROWTH_CASES)
def test_slots_grow_and_release_whole_blocks(case: GrowthCase) -> None:
    cells = space(window=case.window)
    for part in case.parts:
        cells.extend(part)
    for slot in case.resets:
        cells.reset(slot)
    assert {slot: cells.blocks_of(slot) for slot in case.blocks} == case.blocks
    assert cells.allocator.free_blocks == case.free_blocks
    for slot in range(cells.parallel):
        for position in range(cells.first(slot), cells.length(slot)):
            block = cells.blocks_of(slot)[position // BLOCK - cells.first(slot) // BLOCK]
            assert int(cells.table[slot, position]) == block * BLOCK + position % BLOCK


@pytest.mark.parametrize(
    ("held", "part", "message"),
    [
        pytest.param(
            [(0, 0, 20)],
            [(1, 0, 8)],
            r"slot 1 needs 2 KV blocks \(8 cells\) but only 1 of 6 blocks are free",
            id="a slot short of blocks is named with its need",
        ),
        pytest.param(
            [(0, 0, 12)],
            [(0, 12, 4), (1, 0, 9)],
            r"slot 1 needs 3 KV blocks \(12 cells\) but only 2 of 6",
            id="in a part the first slot left short is named, after what earlier pieces take",
        ),
    ],
)
def test_an_exhausted_space_names_the_slot_and_takes_nothing(
    held: list[Piece], part: list[Piece], message: str
) -> None:
    cells = space()
    cells.extend(held)
    before = cells.allocator.free_blocks
    with pytest.raises(PoolExhaustedError, match=message):
        cells.extend(part)
    assert cells.allocator.free_blocks == before


@pytest.mark.parametrize(
    ("shares", "releases", "count", "free"),
    [
        pytest.param(0, 1, 0, 4, id="a block held once is free after one release"),
        pytest.param(1, 1, 1, 3, id="a shared block stays held while one holder keeps it"),
        pytest.param(2, 3, 0, 4, id="a block held three times is free after three releases"),
    ],
)
def test_shared_blocks_are_counted(shares: int, releases: int, count: int, free: int) -> None:
    allocator = BlockAllocator(blocks=4, size=BLOCK)
    (block,) = allocator.allocate(1, slot=0)
    for _ in range(shares):
        allocator.share(block)
    allocator.release([block] * releases)
    assert (allocator.refcount(block), allocator.free_blocks) == (count, free)


def test_a_block_released_more_often_than_held_is_a_bug_caught() -> None:
    allocator = BlockAllocator(blocks=2, size=BLOCK)
    (block,) = allocator.allocate(1, slot=0)
    allocator.release([block])
    with pytest.raises(BlockAccountingError, match=f"block {block} is released more often"):
        allocator.release([block])
    with pytest.raises(BlockAccountingError, match=f"block {block} is free"):
        allocator.share(block)


@pytest.mark.parametrize(
    ("held", "queue", "part"),
    [
        pytest.param([], [(0, 0, 30)], [(0, 0, 24)], id="a long chunk is cut at the space's blocks"),
        pytest.param(
            [(0, 0, 10)],
            [(0, 10, 3), (1, 0, 20)],
            [(0, 10, 3), (1, 0, 16)],
            id="a window slot's dead blocks count as room",
        ),
        pytest.param(
            [(0, 0, 2)],
            [(0, 2, 2), (1, 0, 24)],
            [(0, 2, 2), (1, 0, 20)],
            id="the rest of a slot's last block costs nothing",
        ),
    ],
)
def test_fit_takes_the_longest_run_of_positions_the_blocks_hold(
    held: list[Piece], queue: list[Piece], part: list[Piece]
) -> None:
    cells = space(window=3)
    if held:
        cells.extend(held)
    assert cells.fit(queue) == part
    cells.extend(part)  # what fit promises, the space gives


@pytest.mark.parametrize(
    ("window", "block"),
    [
        pytest.param(10, 4, id="a window longer than two blocks"),
        pytest.param(8, 4, id="a window of exactly two blocks"),
        pytest.param(3, 4, id="a window shorter than a block"),
        pytest.param(1024, 64, id="Gemma 3's window in the planned blocks"),
    ],
)
def test_a_decoding_window_slot_holds_only_the_blocks_its_window_reaches(window: int, block: int) -> None:
    per_slot = -(-window // block) + 1
    context = 3 * window + 2 * block
    cells = CellSpace(blocks=per_slot, block=block, parallel=1, context=context, window=window, device=CPU)
    for position in range(context):
        ((cell,),) = cells.take_runs([(0, position, 1)])
        held = cells.blocks_of(0)
        assert len(held) <= per_slot
        assert cell // block == held[-1]
        assert cells.first(0) <= cells.sight(position), "every position the query sees is still held"
    assert cells.allocator.free_blocks + len(cells.blocks_of(0)) == per_slot, "the rest went back to the pool"
