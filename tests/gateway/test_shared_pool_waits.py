"""A chunk that would overrun the stages' shared KV pool waits for cells that other generations free, instead of
ending its generation; only when nothing under way can free any does one generation end with "length" (the one
holding the fewest cells), and a chunk past the context ends its own generation at once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from strata.gateway.generation import Finished, Sampling
from strata.gateway.pipeline import Pipeline
from strata.gateway.stage_stream import Step

CONTEXT = 128


@dataclass(frozen=True)
class Case:
    name: str
    held: tuple[int, ...]  # per slot: positions fed so far (a prompt longer than that is still prefilling)
    prompts: tuple[int, ...]  # per slot: prompt length
    in_flight: bool  # another step is under way
    stepping: tuple[int, ...]  # slots whose chunk the step carries
    ended: tuple[int, ...]  # slots whose generation ended with "length"


CASES = [
    Case("a prompt that does not fit yet waits beside the decoding", (100, 0), (100, 40), False, (0,), ()),
    Case("all short, nothing under way: the one holding fewest cells ends", (70, 58), (70, 58), False, (), (1,)),
    Case("all short with a step in flight: all wait for it", (70, 58), (70, 58), True, (), ()),
    Case("a generation at the end of its context ends at once", (CONTEXT, 0), (CONTEXT, 8), False, (), (0,)),
    Case("room enough: both step", (60, 0), (60, 8), False, (0, 1), ()),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_chunk_short_of_pool_cells_waits_for_them(case: Case) -> None:
    pipeline = Pipeline(first_stage="127.0.0.1:1", slots=len(case.held), context=CONTEXT, fence=None)
    pipeline._ready = True
    generations = []
    for slot, (fed, prompt) in enumerate(zip(case.held, case.prompts, strict=True)):
        g = pipeline.submit(
            slot=slot, prompt=tuple(range(3, 3 + prompt)), max_tokens=64, sampling=Sampling(), stop_ids=frozenset(),
            on_freed=lambda: None,
        )  # fmt: skip
        g.fed, g.last_token = fed, 7
        generations.append(g)
    if case.in_flight:  # with two micro-batches, the other group's step (its slots are not these)
        pipeline._groups = 2
        pipeline._in_flight.append(Step(step_id=9, chunks=[]))
    chunks = pipeline._chunks()
    assert tuple(c.slot for c in chunks) == case.stepping
    ended = tuple(g.slot for g in generations if g.finished)
    assert ended == case.ended
    for slot in ended:
        assert generations[slot].events.get_nowait() == Finished("length")
