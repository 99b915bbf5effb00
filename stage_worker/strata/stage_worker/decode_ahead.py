"""Decoding ahead: a single-stage pipeline launches its next greedy decode step before it reads this one's picks.

Why: between two decode steps the GPU waits for the host, which reads the picks, hands them to the coordinator, hears
back (over gRPC when served) and builds the next step's inputs: 0.15-0.3 ms a step in process on an H100, about
1.3 ms served, against a 4 ms step. When every slot of a step is greedy on the model's own logits and the stage holds
both the embedding and the head, the next step is known but for its tokens, and those are the picks already on the
device. So the engine launches step N + 1 for the same slots, one position on, its tokens taken on the device from
step N's picks, and only then reads step N's picks; the host's work overlaps the GPU's.

The next `Engine.step` takes the launched work when it asks exactly that: each of its chunks one of those slots at
that position with the token step N picked, greedy as is (a slot whose request ended may be left out). Anything else
(a new prompt, a sampled slot, a draft, a rollback) runs as it would have. Either way the position taken ahead in a
slot the step does not take it for is given back at once, so the pool holds what the coordinator counts (a full pool
must not refuse a prompt for cells a guess holds). The work launched ahead for nothing costs GPU time only.

Not with a sliding-window pool: taking the next position's cells may give back a window block, which a rolled-back
chunk of that slot would still need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.stage_worker.decode import Picks

if TYPE_CHECKING:  # the engine imports this module
    from strata.stage_worker.engine import Chunk


@dataclass(frozen=True)
class Ahead:
    """A decode step launched ahead: its slots and positions, the tokens it was fed (the previous step's picks), and
    its own picks on their way."""

    slots: tuple[int, ...]
    positions: tuple[int, ...]
    tokens: tuple[int, ...]
    picks: Picks
    revisions: tuple[int, ...]  # each slot's in the pool once the step took its cells: a change since voids its row


def takes_ahead(chunk: Chunk) -> bool:
    """A chunk a step launched ahead can stand for: one position, picked greedily on the model's own logits."""
    return (
        chunk.length == 1
        and chunk.sample
        and not chunk.drafted
        and not chunk.return_logits
        and chunk.sampling.greedy_as_is
    )


def rows_served(ahead: Ahead, chunks: list[Chunk], *, revisions: Sequence[int]) -> list[int] | None:
    """The rows of the step launched ahead that answer `chunks`, in the chunks' order; None when the step asks for
    anything that step did not compute, or one of its slots changed since (the pool's `revisions`, by slot)."""
    row_of = {slot: row for row, slot in enumerate(ahead.slots)}
    rows = []
    for chunk in chunks:
        row = row_of.get(chunk.slot)
        if (
            row is None
            or not takes_ahead(chunk)
            or chunk.start_position != ahead.positions[row]
            or tuple(chunk.token_ids) != (ahead.tokens[row],)
            or revisions[chunk.slot] != ahead.revisions[row]
        ):
            return None
        rows.append(row)
    return rows
