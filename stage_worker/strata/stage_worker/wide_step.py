"""A step of a few positions a slot, run as a decode step: how its rows are laid out.

Speculative decoding verifies `[last, d1..dk]` for each slot in one step, and a draft model feeds the run the target
accepted in one. Run eagerly, like a prefill chunk, such a step pays the host's launch time for every kernel of every
layer, which on a GPU costs more than the drafts save; run as the decode body (strata.stage_worker.decode) with
`width` rows a slot, it is one graph replay. A graph has fixed shapes, so every slot gets the same number of rows: a
chunk shorter than the widest is followed by filler positions (its last token again, at the next positions), which
take real cells for the step and are given back after it. They come after the chunk's own positions, so causal
attention keeps them out of every real row's result, and their picks are never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from strata.stage_worker.decode import WIDEST

if TYPE_CHECKING:
    from strata.stage_worker.engine import Chunk


@dataclass(frozen=True)
class WideStep:
    width: int  # rows a slot
    slots: list[int]  # per row
    positions: list[int]  # per row
    tokens: list[int]  # per row (a stage that embeds); a filler repeats its chunk's last token
    real: list[int]  # the rows of the chunks' own positions, in the step's order: its hidden states in and out
    source: list[int]  # per row: the step's row whose hidden state it takes (a filler: its chunk's last)
    picks: list[list[int]]  # per chunk: the rows whose next token it samples (none when it does not sample)
    fillers: list[tuple[int, int]]  # (slot, first filler position) of each chunk that has fillers

    @property
    def pieces(self) -> list[tuple[int, int, int]]:
        """(slot, start, width) per chunk: the positions the step takes cells for."""
        return [(self.slots[i], self.positions[i], self.width) for i in range(0, len(self.slots), self.width)]


def widen(chunks: Sequence[Chunk]) -> WideStep | None:
    """The rows of a step of a few positions a slot after what it holds: drafts to verify, or a few tokens to feed
    (a draft model catching up with an accepted run), at most WIDEST positions a chunk, none asking for its logits.
    None for any other step: one with a prompt's first chunk runs as prefill does, one of single positions as the
    plain decode step."""
    width = max(chunk.length for chunk in chunks)
    if width == 1 or width > WIDEST or any(c.return_logits or (c.start_position == 0 and c.length > 1) for c in chunks):
        return None
    slots: list[int] = []
    positions: list[int] = []
    tokens: list[int] = []
    real: list[int] = []
    source: list[int] = []
    picks: list[list[int]] = []
    fillers: list[tuple[int, int]] = []
    step_row = 0
    for index, chunk in enumerate(chunks):
        first = index * width
        own = list(chunk.token_ids) or [0] * chunk.length  # a stage after the first gets no token ids
        for r in range(width):
            slots.append(chunk.slot)
            positions.append(chunk.start_position + r)
            tokens.append(own[min(r, chunk.length - 1)])
            source.append(step_row + min(r, chunk.length - 1))
        real.extend(range(first, first + chunk.length))
        last = chunk.length - 1
        picks.append([first + r for r in range(last - chunk.drafted, last + 1)] if chunk.sample else [])
        if chunk.length < width:
            fillers.append((chunk.slot, chunk.start_position + chunk.length))
        step_row += chunk.length
    return WideStep(
        width=width, slots=slots, positions=positions, tokens=tokens, real=real, source=source, picks=picks,
        fillers=fillers,
    )  # fmt: skip
